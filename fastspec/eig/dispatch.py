"""``fastspec.eigvalsh``: drop-in for ``torch.linalg.eigvalsh`` that picks the fastest solver.

Semantics match torch: ``A: [..., n, n]`` real symmetric (only the lower triangle is read),
result ``[..., n]`` ascending, same dtype as ``A``; float16/bfloat16 are solved in float32.
Solvers (``solver=``; the limits are :mod:`.limits`'s):

* ``"torch"``: ``torch.linalg.eigvalsh`` (the reference and the universal fallback,
  :mod:`.reference`).
* ``"cuda"``: fastspec's batched kernel (csrc/eig_kernel.cu), one thread block per matrix:
  Householder tridiagonalization in shared memory + Sturm bisection. CUDA float32/float64,
  ``n <= MAX_N``. Compiled for the GPU at the first call of each (n, dtype) by NVRTC and cached on
  disk (:mod:`.nvrtc`); no CUDA toolkit needed, only ``cuda-bindings`` (a dependency of
  PyTorch's CUDA 13 wheels). A kernel that cannot be compiled or loaded raises here.
* ``"host"``: the host twin of the same numerics (csrc/eig_core.h) on CPU tensors,
  ``n <= MAX_N``; for tests and CPU-only checks of the algorithm, not for speed.
* ``"auto"``: ``"cuda"`` for CUDA float32/float64 inputs with ``n <= AUTO_MAX_N`` that need no
  gradient, else ``"torch"``. When ``"cuda"`` would apply but the kernel cannot be had (no binding
  or NVRTC, a compile error, an old driver), one log line on the ``fastspec`` logger says why and
  torch is used.

Every solver returns NaN for every eigenvalue of a matrix whose lower triangle holds NaN/Inf,
its batch neighbours unaffected (``torch.linalg.eigvalsh`` alone raises, or returns garbage, on
such input: the torch solver solves a zero stand-in for it, without a host sync). The native
solvers have no autograd: use ``"torch"`` for gradients.

Arrays of other libraries that speak DLPack (``__dlpack__``: CuPy, NumPy >= 1.22, JAX) go in
zero-copy through ``torch.from_dlpack`` and come back as the input's type through its library's
``from_dlpack`` (found from the array's type among the modules already imported).

``backend=``, ``BACKENDS`` and ``backends()`` are the deprecated names of ``solver=``,
:data:`SOLVERS` and :func:`solvers` (``backend`` is the covariance update's word).
"""
from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from . import cuda, limits, native
from .nvrtc import KernelUnavailable
from .reference import eigvalsh_reference

SOLVERS = ("auto", "torch", "cuda", "host")


# top-level module of an array type -> the module with its from_dlpack, where they differ
_FROM_DLPACK_MODULE = {"jaxlib": "jax.numpy", "jax": "jax.numpy"}


def _from_dlpack_of(A: object) -> Callable | None:
    """The ``from_dlpack`` of the library that made ``A`` (its type's module or a parent of it,
    e.g. ``cupy`` for ``cupy._core.core.ndarray``), looked up in ``sys.modules`` (never imports)."""
    mod = type(A).__module__ or ""
    names = [mod.rsplit(".", i)[0] for i in range(mod.count(".") + 1)]
    for name in (_FROM_DLPACK_MODULE.get(names[-1], ""), *names):
        f = getattr(sys.modules.get(name), "from_dlpack", None)
        if callable(f):
            return f
    return None


def _check(A: Tensor) -> None:
    if not isinstance(A, Tensor):
        raise TypeError(f"A: expected a torch.Tensor or a DLPack array (__dlpack__) [..., n, n], "
                        f"got {type(A).__name__}")
    if A.is_complex() or not A.is_floating_point():
        raise TypeError(f"A: expected a real floating dtype, got {A.dtype}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A: expected square matrices [..., n, n], got shape {list(A.shape)}")


def _auto(A: Tensor) -> str:
    wants_grad = A.requires_grad and torch.is_grad_enabled()
    if A.device.type != "cuda" or A.dtype not in native.DTYPES or A.shape[-1] > limits.AUTO_MAX_N or wants_grad:
        return "torch"
    ok, reason = native.status("cuda")
    if not ok:
        native.log_fallback(reason)
        return "torch"
    return "cuda"


def _deprecated(old: str, new: str) -> None:
    """Warn at the caller of the deprecated name (two frames up: past the function using it); not
    while dynamo traces, where a warning is a graph break (``fullgraph=True`` would fail)."""
    if torch.compiler.is_compiling():
        return
    warnings.warn(f"fastspec: the eigensolver's {old} is deprecated, use {new} ('backend' names the covariance "
                  "update path)", DeprecationWarning, stacklevel=3)


def eigvalsh(A: Tensor, *, solver: str = "auto", backend: str | None = None) -> Tensor:
    """Eigenvalues ``[..., n]`` (ascending) of symmetric ``A: [..., n, n]``, lower triangle used.

    ``solver``: ``"auto"`` | ``"torch"`` | ``"cuda"`` | ``"host"`` (module docstring);
    ``backend``: its deprecated name. A matrix with NaN/Inf in its lower triangle gets ``n`` NaNs
    with every solver. ``A`` may also be a DLPack array (CuPy, NumPy, JAX): solved zero-copy on
    its device, returned as the same type and dtype. The native solvers run through
    ``torch.ops.fastspec.eigvalsh`` (a ``torch.library`` custom op with a fake implementation), so
    this works under ``torch.compile``.
    """
    if backend is not None:
        if solver != "auto":
            raise TypeError(f"solver, backend: pass solver= alone (backend= is its deprecated name), "
                            f"got solver={solver!r} and backend={backend!r}")
        _deprecated("backend=", "solver=")
        solver = backend
    return _eigvalsh(A, solver)


def _eigvalsh(A: Tensor, solver: str) -> Tensor:
    if not isinstance(A, Tensor) and hasattr(A, "__dlpack__") and not isinstance(A, type):
        back = _from_dlpack_of(A)
        if back is None:
            raise TypeError(f"A: {type(A).__module__}.{type(A).__name__} has __dlpack__, but no from_dlpack "
                            "was found in its library to return the result; pass a torch.Tensor")
        return back(_eigvalsh(torch.from_dlpack(A), solver))
    _check(A)
    if solver not in SOLVERS:
        raise ValueError(f"solver: expected one of {SOLVERS}, got {solver!r}")
    if A.dtype in (torch.float16, torch.bfloat16):
        return _eigvalsh(A.float(), solver).to(A.dtype)
    requested = solver
    if solver == "auto":
        solver = _auto(A)
    if solver == "torch":
        return eigvalsh_reference(A)
    n = A.shape[-1]
    if n > limits.MAX_N:
        raise ValueError(f"A: n = {n} exceeds the native solvers' limit {limits.MAX_N} "
                         f"(fastspec.eig.limits.MAX_N); use solver='torch'")
    expected = "cuda" if solver == "cuda" else "cpu"
    if A.device.type != expected:
        raise ValueError(f"A: solver={solver!r} takes {expected} tensors, got device {A.device}")
    if A.dtype not in native.DTYPES:
        raise TypeError(f"A: solver={solver!r} takes float32/float64, got {A.dtype}")
    ok, reason = native.status(solver)
    if not ok:
        raise RuntimeError(f"solver: {solver!r} unavailable here: {reason}")
    if n == 0 or A.numel() == 0:
        return A.new_empty(A.shape[:-1])
    if requested == "cuda":  # not for "auto": the op then falls back to torch (native.cuda_eigvalsh)
        _prepare_cuda(A)
    return torch.ops.fastspec.eigvalsh(A)


def _prepare_cuda(A: Tensor) -> None:
    """Explicit ``solver="cuda"``: compile and load the kernel now, so that a kernel that cannot
    be had raises with its reason (``"auto"`` lets the op fall back to torch instead)."""
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 - loaded with torch already

    if torch.compiler.is_compiling() or is_fake(A):
        return  # traced: the op compiles at its first real run
    try:
        cuda.prepare(A.shape[-1], A.dtype, A.device, batch=max(1, math.prod(A.shape[:-2])))
    except KernelUnavailable as exc:
        raise RuntimeError(f"solver: 'cuda' unavailable: {exc}") from None


def solvers() -> dict[str, dict[str, object]]:
    """What each eigvalsh solver can do here: ``{name: {"available": bool, "reason": str}}``."""
    out: dict[str, dict[str, object]] = {"torch": {"available": True, "reason": "torch.linalg.eigvalsh"}}
    for name in ("cuda", "host"):
        ok, reason = native.status(name)
        out[name] = {"available": ok, "reason": reason}
    return out


def backends() -> dict[str, dict[str, object]]:
    """Deprecated name of :func:`solvers`."""
    _deprecated("backends()", "solvers()")
    return solvers()


def __getattr__(name: str):
    if name == "BACKENDS":  # the deprecated name of SOLVERS
        _deprecated("BACKENDS", "SOLVERS")
        return SOLVERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
