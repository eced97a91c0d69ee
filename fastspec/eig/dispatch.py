"""``fastspec.eigvalsh``: drop-in for ``torch.linalg.eigvalsh`` that picks the fastest solver.

Semantics match torch: ``A: [..., n, n]`` real symmetric (only the lower triangle is read),
result ``[..., n]`` ascending, same dtype as ``A``; float16/bfloat16 are solved in float32.
Backends:

* ``"torch"``: ``torch.linalg.eigvalsh`` (the reference and the universal fallback).
* ``"cuda"``: fastspec's batched kernel (fastspec/eig/csrc/eig_kernel.cu), one thread block per matrix:
  Householder tridiagonalization in shared memory + Sturm bisection. CUDA float32/float64,
  n <= 1024. Compiled for the GPU at the first call of each (n, dtype) by NVRTC and cached on
  disk (:mod:`.nvrtc`); no CUDA toolkit needed, only ``cuda-bindings`` (a dependency of
  PyTorch's CUDA 13 wheels). A kernel that cannot be compiled or loaded raises here.
* ``"host"``: the host twin of the same numerics (fastspec/eig/csrc/eig_core.h) on CPU tensors; for tests
  and CPU-only checks of the algorithm, not for speed.
* ``"auto"``: ``"cuda"`` for CUDA float32/float64 inputs with ``n <= 256`` that need no gradient,
  else ``"torch"``. When ``"cuda"`` would apply but the kernel cannot be had (no binding or
  NVRTC, a compile error, an old driver), one log line on the ``fastspec`` logger says why and
  torch is used.

Every backend returns NaN for every eigenvalue of a matrix whose lower triangle holds NaN/Inf,
its batch neighbours unaffected (``torch.linalg.eigvalsh`` alone raises, or returns garbage, on
such input: the torch backend solves a zero stand-in for it, without a host sync). The native
backends have no autograd: use ``"torch"`` for gradients.

Arrays of other libraries that speak DLPack (``__dlpack__``: CuPy, NumPy >= 1.22, JAX) go in
zero-copy through ``torch.from_dlpack`` and come back as the input's type through its library's
``from_dlpack`` (found from the array's type among the modules already imported).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from . import cuda, native
from .nvrtc import KernelUnavailable

BACKENDS = ("auto", "torch", "cuda", "host")

log = logging.getLogger("fastspec")
_fallback_logged = False


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


def _log_fallback_once(reason: str) -> None:
    global _fallback_logged
    if _fallback_logged or torch.compiler.is_compiling():
        return
    _fallback_logged = True
    log.warning("fastspec.eigvalsh: CUDA eigensolver unavailable (%s); using torch.linalg.eigvalsh", reason)


def _auto(A: Tensor) -> str:
    wants_grad = A.requires_grad and torch.is_grad_enabled()
    if A.device.type != "cuda" or A.dtype not in native.DTYPES or A.shape[-1] > native.CUDA_MAX_N or wants_grad:
        return "torch"
    ok, reason = native.status("cuda")
    if not ok:
        _log_fallback_once(reason)
        return "torch"
    return "cuda"


def eigvalsh(A: Tensor, *, backend: str = "auto") -> Tensor:
    """Eigenvalues ``[..., n]`` (ascending) of symmetric ``A: [..., n, n]``, lower triangle used.

    ``backend``: ``"auto"`` | ``"torch"`` | ``"cuda"`` | ``"host"`` (module docstring).
    A matrix with NaN/Inf in its lower triangle gets ``n`` NaNs on every backend. ``A`` may also be
    a DLPack array (CuPy, NumPy, JAX): solved zero-copy on its device, returned as the same type
    and dtype. The native backends run through ``torch.ops.fastspec.eigvalsh`` (a
    ``torch.library`` custom op with a fake implementation), so this works under ``torch.compile``.
    """
    if not isinstance(A, Tensor) and hasattr(A, "__dlpack__") and not isinstance(A, type):
        back = _from_dlpack_of(A)
        if back is None:
            raise TypeError(f"A: {type(A).__module__}.{type(A).__name__} has __dlpack__, but no from_dlpack "
                            "was found in its library to return the result; pass a torch.Tensor")
        return back(eigvalsh(torch.from_dlpack(A), backend=backend))
    _check(A)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if A.dtype in (torch.float16, torch.bfloat16):
        return eigvalsh(A.float(), backend=backend).to(A.dtype)
    if backend == "auto":
        backend = _auto(A)
    if backend == "torch":
        return native.torch_eigvalsh(A)
    expected = "cuda" if backend == "cuda" else "cpu"
    if A.device.type != expected:
        raise ValueError(f"A: backend={backend!r} takes {expected} tensors, got device {A.device}")
    if A.dtype not in native.DTYPES:
        raise TypeError(f"A: backend={backend!r} takes float32/float64, got {A.dtype}")
    ok, reason = native.status(backend)
    if not ok:
        raise RuntimeError(f"backend: {backend!r} unavailable here: {reason}")
    if A.shape[-1] == 0 or A.numel() == 0:
        return A.new_empty(A.shape[:-1])
    if backend == "cuda":
        _prepare_cuda(A)
    return torch.ops.fastspec.eigvalsh(A)


def _prepare_cuda(A: Tensor) -> None:
    """Explicit ``backend="cuda"``: compile and load the kernel now, so that a kernel that cannot
    be had raises with its reason (``"auto"`` lets the op fall back to torch instead)."""
    n = A.shape[-1]
    if n > cuda.MAX_N:
        raise ValueError(f"A: n = {n} exceeds the CUDA solver's limit {cuda.MAX_N}; use backend='torch'")
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 - loaded with torch already

    if torch.compiler.is_compiling() or is_fake(A):
        return  # traced: the op compiles at its first real run
    try:
        cuda.prepare(n, A.dtype, A.device)
    except KernelUnavailable as exc:
        raise RuntimeError(f"backend: 'cuda' unavailable: {exc}") from None


def backends() -> dict[str, dict[str, object]]:
    """What each eigvalsh backend can do here: ``{name: {"available": bool, "reason": str}}``."""
    out: dict[str, dict[str, object]] = {"torch": {"available": True, "reason": "torch.linalg.eigvalsh"}}
    for name in ("cuda", "host"):
        ok, reason = native.status(name)
        out[name] = {"available": ok, "reason": reason}
    return out
