"""Batched symmetric eigenvalues, the whole op in this folder (docs/kernels.md):

* ``dispatch.py``: ``eigvalsh(A, solver=...)``, the one switch point between the solvers;
* ``reference.py``: the plain-torch solver (``torch.linalg.eigvalsh`` with the NaN rule), the
  reference and the fallback;
* ``native.py``: the ``torch.ops.fastspec.eigvalsh`` custom op both native solvers run through,
  and the host twin's launcher (module ``_host``, built by setup.py from ``csrc/``);
* ``cuda.py`` (launch plan, driver) and ``nvrtc.py`` (compile at first use, disk cache) for the
  CUDA kernel; ``precompile.py`` fills the cache ahead of time;
* ``variants.py``: the kernel's algorithms (block, packed, regs, split) and which one runs for a
  GPU, dtype, n and batch, from the measured table ``selection.json`` (``FASTSPEC_EIG_VARIANT``
  forces one);
* ``limits.py``: the limits and layout numbers, the one place they are written (the C++/CUDA
  sources get them as macros);
* ``matrices.py``: the test-matrix families the tests and ``fastspec compare`` draw from;
* ``csrc/``: the kernel, the shared numerics and the host twin's sources (shipped in the wheel).
"""
from .dispatch import SOLVERS, backends, eigvalsh, solvers

__all__ = ["SOLVERS", "backends", "eigvalsh", "solvers"]


def __getattr__(name: str):
    if name == "BACKENDS":  # the deprecated name of SOLVERS
        from .dispatch import _deprecated

        _deprecated("BACKENDS", "SOLVERS")
        return SOLVERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
