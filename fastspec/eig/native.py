"""The ``fastspec::eigvalsh`` custom op, the host twin's launcher and the team emulation's.

``torch.ops.fastspec.eigvalsh(A)`` runs fastspec's solver on ``A``'s device: on CUDA the kernel
compiled at first use by NVRTC (:mod:`.cuda`, :mod:`.nvrtc`), on CPU the host twin of the same
numerics (``csrc/eig_host.cpp``, module ``fastspec.eig._host``, built by setup.py with
a C++ compiler). The op has a fake implementation, so it traces under ``torch.compile``. When the
CUDA kernel cannot be had (no NVRTC, a compile error, a driver too old), the op says why once on
the ``fastspec`` logger and solves with :func:`.reference.eigvalsh_reference` instead: never a crash.

The host launcher flattens ``A: [..., n, n]`` to ``[B, n, n]`` (a view when the strides allow, a
copy otherwise), passes element strides and allocates ``out: [B, n]``. The extension is
optional: importing this module never fails; :func:`status` says what is usable and why not. A
build compiled with other limits than :mod:`.limits` (a stale build) is not used.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from . import cuda as _cuda
from . import limits
from .nvrtc import KernelUnavailable
from .reference import eigvalsh_reference


def _load_host() -> tuple[object | None, str]:
    """``(the host-twin module, "")``, or ``(None, why it cannot be used)``."""
    try:
        from . import _host
    except ImportError as exc:  # not built (no compiler, FASTSPEC_NO_EXT=1) or built for another Python
        return None, f"native extension fastspec.eig._host not importable ({exc}); build it with a C++ compiler"
    # a build left from other limits would accept sizes the kernel rejects, or size its team wrongly
    built = {name: getattr(_host, name.removeprefix("FS_"), None) for name in limits.MACROS}
    if built != limits.MACROS:
        return None, (f"native extension fastspec.eig._host was built with other limits ({built}) than "
                      f"fastspec/eig/limits.py ({limits.MACROS}); rebuild it (pip install -e .)")
    return _host, ""


_ext, _EXT_ERROR = _load_host()

DTYPES = (torch.float32, torch.float64)

log = logging.getLogger("fastspec")
_fallback_reasons: set[str] = set()


def status(solver: str) -> tuple[bool, str]:
    """``(available, reason)`` of the ``"host"`` or ``"cuda"`` native solver in this process."""
    if solver == "cuda":
        return _cuda.status()
    if _ext is None:
        return False, _EXT_ERROR
    return True, ("host twin of the CUDA solver (csrc/eig_core.h, serial), float32/float64 CPU tensors, "
                  f"n <= {limits.MAX_N}")


def log_fallback(reason: str) -> None:
    """Say on the ``fastspec`` logger, once per reason, that ``"auto"`` solves with torch because
    the CUDA kernel cannot be had (``dispatch`` before the op, :func:`cuda_eigvalsh` inside it);
    never while dynamo traces, where a log call would break the graph."""
    if reason in _fallback_reasons or torch.compiler.is_compiling():
        return
    _fallback_reasons.add(reason)
    log.warning("fastspec.eigvalsh: CUDA eigensolver unavailable (%s); using torch.linalg.eigvalsh", reason)


def _require(solver: str) -> None:
    ok, reason = status(solver)
    if not ok:
        raise RuntimeError(f"eigvalsh solver={solver!r} unavailable: {reason}")


def _flatten(A: Tensor) -> tuple[Tensor, Tensor]:
    """``A: [..., n, n]`` -> ``(A3: [B, n, n], out: [B, n])`` on ``A``'s device, after the dtype
    check. Both native solvers launch on these."""
    if A.dtype not in DTYPES:
        raise TypeError(f"A: native eigvalsh takes float32/float64, got {A.dtype}")
    n = A.shape[-1]
    A3 = A.reshape(math.prod(A.shape[:-2]), n, n)  # not -1: ambiguous when n == 0
    return A3, torch.empty(A3.shape[:2], dtype=A.dtype, device=A.device)


def host_eigvalsh(A: Tensor) -> Tensor:
    """Host twin: eigenvalues of CPU ``A: [..., n, n]`` (lower triangle), ``[..., n]`` ascending."""
    _require("host")
    if A.device.type != "cpu":
        raise ValueError(f"A: expected a cpu tensor, got device {A.device}")
    A3, out = _flatten(A)
    B, n = out.shape
    if B and n:
        f = _ext.host_eigvalsh_f32 if A.dtype == torch.float32 else _ext.host_eigvalsh_f64
        f(A3.data_ptr(), out.data_ptr(), B, n, *A3.stride(), out.stride(0))
    return out.reshape(A.shape[:-1])


def team_eigvalsh(A: Tensor, algo: str = "block", schedule: int = 0, drop: int = -1) -> tuple[Tensor, list[int]]:
    """For tests and the GPU kit's dry run, not for speed: algorithm ``algo`` of the CUDA kernel
    (:data:`.variants.ALGORITHMS`) run by the team emulation (one rank, a fiber, per CUDA thread),
    on CPU ``A: [..., n, n]`` -> ``[..., n]``; with the site of every ``FS_SYNC`` barrier passed,
    in order. ``schedule``: 0 on two OS threads at once, 1 one rank at a time in rank order, 2 in
    reverse; ``drop``: the index (in that list) of the barrier every rank leaves out
    (csrc/eig_host.cpp)."""
    _require("host")
    if A.device.type != "cpu":
        raise ValueError(f"A: expected a cpu tensor, got device {A.device}")
    A3, out = _flatten(A)
    B, n = out.shape
    sites: list[int] = []
    if B and n:
        f = _ext.team_eigvalsh_f32 if A.dtype == torch.float32 else _ext.team_eigvalsh_f64
        sites = f(A3.data_ptr(), out.data_ptr(), B, n, *A3.stride(), out.stride(0), algo=_ext.ALGOS[algo],
                  schedule=schedule, drop=drop)
    return out.reshape(A.shape[:-1]), sites


@torch.library.custom_op("fastspec::eigvalsh", mutates_args=())
def eigvalsh_op(A: Tensor) -> Tensor:
    """``torch.ops.fastspec.eigvalsh``: native solver on ``A``'s device (CUDA kernel or host twin)."""
    return cuda_eigvalsh(A) if A.device.type == "cuda" else host_eigvalsh(A)


def cuda_eigvalsh(A: Tensor, fallback: bool = True) -> Tensor:
    """CUDA kernel: eigenvalues of ``A: [..., n, n]`` (lower triangle), ``[..., n]`` ascending,
    asynchronous on the current stream; torch.linalg when the kernel cannot be had, said once per
    reason on the ``fastspec`` logger (``fallback=False``: KernelUnavailable instead, for an
    explicit ``solver="cuda"``).

    The steady state allocates the output and nothing else, and reads nothing of ``A`` on the
    host: ``[B, n, n]`` and ``[n, n]`` go to the kernel with their own strides (no view made),
    other batch shapes through ``reshape`` (a view wherever the strides allow one). Non-finite
    matrices are the kernel's to flag (a NaN row), not a pass here."""
    if A.dtype not in DTYPES:
        raise TypeError(f"A: native eigvalsh takes float32/float64, got {A.dtype}")
    shape = A.shape
    n = shape[-1]
    out = A.new_empty(shape[:-1])  # contiguous: rows n apart
    dims = len(shape)
    if dims == 3:
        A3, batch, strides = A, shape[0], A.stride()
    elif dims == 2:
        A3, batch, strides = A, 1, (0, *A.stride())  # one matrix: its batch stride is never used
    else:
        batch = math.prod(shape[:-2])
        A3 = A.reshape(batch, n, n)  # not -1: ambiguous when n == 0
        strides = A3.stride()
    if batch and n:
        try:
            _cuda.run(A3, strides, batch, n, out.data_ptr(), n)
        except KernelUnavailable as exc:
            if not fallback:
                raise
            log_fallback(str(exc))
            out.copy_(eigvalsh_reference(A))
    return out


@eigvalsh_op.register_fake
def _eigvalsh_fake(A: Tensor) -> Tensor:
    return A.new_empty(A.shape[:-1])
