"""Build hook: the top-level ``csrc/`` as the package ``fastspec._csrc``, and fastspec's optional
native extension ``fastspec.eig._host``.

Package metadata lives in pyproject.toml. This file adds what it cannot say: the packages, with
``csrc/`` (the CUDA and C++ sources, outside the ``fastspec/`` tree) mapped onto
``fastspec._csrc`` so the wheel ships them and NVRTC finds them at run time (an editable install
maps the package onto the checkout's folder); and the extension: the host twin of
the CUDA eigensolver and its team emulation (eig_host.cpp, bindings.cpp), and for tests the host
twin of the DMMA Gram kernel pair (cov_gram_host.cpp: cov_gram.cu's own code on a software GPU),
plain C++ built with the Python's C++ compiler and pybind11. No CUDA toolkit is involved: the CUDA
kernels (eig_kernel.cu, cov_gram.cu) ship as source and are compiled at first use by NVRTC
(fastspec/eig/nvrtc.py).
Both compile with the limits of fastspec/eig/limits.py as macros (``FS_MAX_N``, ...), the one place
they are written; this file reads them from there without importing the package (no torch here).

* a C++ compiler and pybind11: the module is built; a compile error fails the install (CI must see
  a broken build).
* no compiler, no pybind11, or ``FASTSPEC_NO_EXT=1``: no extension, one message; the package
  installs as pure Python, ``solver="host"`` is unavailable and the CUDA kernel unaffected.
"""
from __future__ import annotations

import os
import runpy
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup

CSRC = Path("csrc")  # the sources; installed as the package fastspec._csrc
LIMITS = Path("fastspec/eig/limits.py")  # plain constants, no imports: run on its own here


def _say(msg: str) -> None:
    print(f"fastspec setup: {msg}", file=sys.stderr)


def _extensions() -> list[Extension]:
    if os.environ.get("FASTSPEC_NO_EXT", "").strip().lower() in ("1", "true", "yes", "on"):
        _say("FASTSPEC_NO_EXT set: no host-twin extension (the CUDA kernel is compiled at run time either way)")
        return []
    cxx = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(cxx) is None:
        _say(f"no C++ compiler ({cxx}): no host-twin extension (the CUDA kernel is compiled at run time either way)")
        return []
    try:
        import pybind11
    except ImportError:
        _say("pybind11 not importable at build time: no host-twin extension (the CUDA kernel is compiled at run "
             "time either way)")
        return []
    macros = runpy.run_path(str(LIMITS))["MACROS"]
    return [Extension(
        "fastspec.eig._host",
        sources=[str(CSRC / "bindings.cpp"), str(CSRC / "eig_host.cpp"), str(CSRC / "cov_gram_host.cpp")],
        include_dirs=[pybind11.get_include(), str(CSRC)],
        define_macros=[(name, str(value)) for name, value in macros.items()],
        depends=[*(str(p) for p in sorted(CSRC.glob("*.h"))), str(CSRC / "cov_gram.cu"), str(LIMITS)],
        # -Wno-unknown-pragmas: cov_gram.cu's `#pragma unroll` (nvcc's), compiled by cov_gram_host.cpp
        extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread", "-Wno-unknown-pragmas"],
        extra_link_args=["-pthread"],  # the concurrent schedule's two std::threads in the test-only team emulation (eig_host.cpp)
        language="c++",
    )]


setup(
    packages=[*find_packages(include=["fastspec", "fastspec.*"]), "fastspec._csrc"],
    package_dir={"fastspec._csrc": str(CSRC)},
    ext_modules=_extensions(),
)
