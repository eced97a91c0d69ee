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

The call's own cost: the native solvers run through the custom op ``torch.ops.fastspec.eigvalsh``
wherever something may trace or intercept the call (``torch.compile``, fake tensors, tensor
subclasses, dispatch or function modes, functorch transforms). Elsewhere, in plain eager code,
the op's dispatch would be most of a call's host time and does nothing, so the op's
implementation is called directly (:func:`_eager`); a CUDA float32/float64 batch that needs no
gradient takes a shorter path still (:func:`_fast_cuda`): a few attribute reads, then the
launcher's cached plan (:mod:`.cuda`).
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
    this works under ``torch.compile``; a plain eager call skips the op's dispatch (module docstring).
    """
    # is_compiling first: dynamo folds it to True and never traces the checks behind it
    if (not torch.compiler.is_compiling() and type(A) is Tensor and A.is_cuda and backend is None
            and (solver == "auto" or solver == "cuda") and _eager_now()):
        out = _fast_cuda(A, solver)
        if out is not None:
            return out
    if backend is not None:
        if solver != "auto":
            raise TypeError(f"solver, backend: pass solver= alone (backend= is its deprecated name), "
                            f"got solver={solver!r} and backend={backend!r}")
        _deprecated("backend=", "solver=")
        solver = backend
    return _eigvalsh(A, solver)


# each None where this torch lacks it: then no call counts as plain eager (the op always runs)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_transforms = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_jit_tracing = getattr(torch._C, "_get_tracing_state", None)


def _eager_now() -> bool:
    """Whether nothing can trace or intercept a call made now: no dynamo trace, no
    TorchDispatchMode (FakeTensorMode, functionalization, proxy tracing), no TorchFunctionMode
    (``with torch.device(...)`` is one), no functorch transform (vmap, grad), no
    ``torch.jit.trace``. Each check is one C call (torch 2.x's own, as
    torch.utils._python_dispatch, torch.overrides and torch.jit use them)."""
    if _dispatch_modes is None or _function_modes is None or _transforms is None or _jit_tracing is None:
        return False
    return (not torch.compiler.is_compiling() and not _dispatch_modes() and not _function_modes()
            and _transforms() is None and _jit_tracing() is None)


def _eager(A: Tensor) -> bool:
    """:func:`_eager_now` for a plain ``torch.Tensor`` ``A`` (not a subclass: not a FakeTensor, a
    FunctionalTensor or a user's ``__torch_function__`` type) that asks for no gradient: the op's
    implementation may then be called directly, the op's dispatch skipped. (With a gradient asked
    for, the op runs: it is what says that the native solvers have no autograd.)"""
    return type(A) is Tensor and not (A.requires_grad and torch.is_grad_enabled()) and _eager_now()


def _fast_cuda(A: Tensor, solver: str) -> Tensor | None:
    """The common call (``solver`` ``"auto"`` or ``"cuda"``, plain eager CUDA ``A``), decided in a
    few attribute reads: a float32/float64 batch of square matrices, 1 <= n <= the solver's
    limit, no gradient asked for, the binding here (a CUDA tensor means a GPU). None for anything
    else: :func:`_eigvalsh` then decides, raises or falls back as always."""
    dtype = A.dtype
    if dtype is not torch.float32 and dtype is not torch.float64:
        return None
    shape = A.shape
    if len(shape) < 2:
        return None
    n = shape[-1]
    if shape[-2] != n or n == 0 or n > (limits.AUTO_MAX_N if solver == "auto" else limits.MAX_N) \
            or A.requires_grad or not cuda.binding_ok():
        return None
    return _solve_cuda(A, strict=solver == "cuda")


def _solve_cuda(A: Tensor, strict: bool) -> Tensor:
    """The op's CUDA implementation called directly; ``strict`` (an explicit ``solver="cuda"``):
    a kernel that cannot be had raises with its reason instead of falling back to torch."""
    try:
        return native.cuda_eigvalsh(A, fallback=not strict)
    except KernelUnavailable as exc:
        raise RuntimeError(f"solver: 'cuda' unavailable: {exc}") from None


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
    if _eager(A):  # nothing traces or intercepts this call: the op's implementation, without its dispatch
        return _solve_cuda(A, strict=requested == "cuda") if solver == "cuda" else native.host_eigvalsh(A)
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
