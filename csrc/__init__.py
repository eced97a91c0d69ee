"""fastspec's CUDA and C++ sources, shipped as package data (``fastspec._csrc``).

setup.py maps this folder onto the package ``fastspec._csrc``, so that the wheel carries the
sources and NVRTC compiles them at first use wherever fastspec is installed
(``fastspec/eig/nvrtc.py``, :func:`fastspec.eig.nvrtc.csrc_dir`). Nothing here is Python code.
"""
