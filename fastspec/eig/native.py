"""Launchers for the native batched eigensolver (``csrc/``, module ``fastspec._eig_ext``).

Layer between tensors and the raw-pointer pybind11 entries: flattens ``A: [..., n, n]`` to
``[B, n, n]`` (a view when the strides allow, a copy otherwise), passes element strides, the
device ordinal and the current CUDA stream, allocates ``out: [B, n]`` (and, for n whose matrix
does not fit in shared memory, the device workspace). The extension is optional: importing this
module never fails; :func:`status` says what is usable and why not.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._trace import assume_constant_result

try:
    from fastspec import _eig_ext as _ext

    _EXT_ERROR = ""
except ImportError as exc:  # not built (no compiler, FASTSPEC_NO_EXT=1) or built for another Python
    _ext = None
    _EXT_ERROR = f"native extension fastspec._eig_ext not importable ({exc}); build it with a C++ compiler (and nvcc)"

DTYPES = (torch.float32, torch.float64)
CUDA_MAX_N = 256  # design envelope of csrc/eig_cuda.cu; "auto" sends larger n to torch.linalg


_runtime_devices: list[int] = []


@assume_constant_result
def _cuda_runtime_devices() -> int:
    # devices the extension's own (static) CUDA runtime sees: 0 also when the driver is older
    # than the CUDA it was built with, where torch's runtime may still work. Asked once, lazily
    # (never at import: no CUDA initialisation before a fork).
    if not _runtime_devices:
        _runtime_devices.append(_ext.cuda_device_count())
    return _runtime_devices[0]


def status(backend: str) -> tuple[bool, str]:
    """``(available, reason)`` of the ``"host"`` or ``"cuda"`` native backend in this process."""
    if _ext is None:
        return False, _EXT_ERROR
    if backend == "host":
        return True, "host twin of the CUDA solver (csrc/eig_core.h, serial), float32/float64 CPU tensors"
    if not _ext.has_cuda:
        return False, "fastspec._eig_ext was built without CUDA (no nvcc at build time, or FASTSPEC_NO_CUDA=1)"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if _cuda_runtime_devices() == 0:
        return False, "the extension's CUDA runtime sees no device (NVIDIA driver older than its CUDA build?)"
    return True, f"batched block-per-matrix kernel, float32/float64 CUDA tensors, n <= {CUDA_MAX_N}"


def _require(backend: str) -> None:
    ok, reason = status(backend)
    if not ok:
        raise RuntimeError(f"eigvalsh backend={backend!r} unavailable: {reason}")


def _flatten(A: Tensor, device_type: str) -> tuple[Tensor, Tensor]:
    """``A: [..., n, n]`` -> ``(A3: [B, n, n], out: [B, n])`` after dtype/device checks."""
    if A.dtype not in DTYPES:
        raise TypeError(f"A: native eigvalsh takes float32/float64, got {A.dtype}")
    if A.device.type != device_type:
        raise ValueError(f"A: expected a {device_type} tensor, got device {A.device}")
    n = A.shape[-1]
    A3 = A.reshape(math.prod(A.shape[:-2]), n, n)  # not -1: ambiguous when n == 0
    return A3, torch.empty(A3.shape[:2], dtype=A.dtype, device=A.device)


def host_eigvalsh(A: Tensor) -> Tensor:
    """Host twin: eigenvalues of CPU ``A: [..., n, n]`` (lower triangle), ``[..., n]`` ascending."""
    _require("host")
    A3, out = _flatten(A, "cpu")
    B, n = out.shape
    if B and n:
        f = _ext.host_eigvalsh_f32 if A.dtype == torch.float32 else _ext.host_eigvalsh_f64
        f(A3.data_ptr(), out.data_ptr(), B, n, *A3.stride(), out.stride(0))
    return out.reshape(A.shape[:-1])


def cuda_eigvalsh(A: Tensor) -> Tensor:
    """CUDA kernel: eigenvalues of CUDA ``A: [..., n, n]`` (lower triangle), ``[..., n]`` ascending.

    Asynchronous on the current stream of ``A``'s device, like any torch op.
    """
    _require("cuda")
    A3, out = _flatten(A, "cuda")
    B, n = out.shape
    if n > _ext.max_n_cuda:
        raise ValueError(f"A: n = {n} exceeds the CUDA solver's limit {_ext.max_n_cuda}; use backend='torch'")
    if B and n:
        dev = A.device.index if A.device.index is not None else torch.cuda.current_device()
        ws = _ext.cuda_workspace_elems(B, n, A.element_size(), dev)
        work = torch.empty(ws, dtype=A.dtype, device=A.device) if ws else None
        f = _ext.cuda_eigvalsh_f32 if A.dtype == torch.float32 else _ext.cuda_eigvalsh_f64
        stream = torch.cuda.current_stream(A.device).cuda_stream
        f(A3.data_ptr(), out.data_ptr(), work.data_ptr() if work is not None else 0, B, n, *A3.stride(),
          out.stride(0), dev, stream)
    return out.reshape(A.shape[:-1])


@torch.library.custom_op("fastspec::eigvalsh", mutates_args=())
def eigvalsh_op(A: Tensor) -> Tensor:
    """``torch.ops.fastspec.eigvalsh``: native solver on ``A``'s device (CUDA kernel or host twin)."""
    return cuda_eigvalsh(A) if A.device.type == "cuda" else host_eigvalsh(A)


@eigvalsh_op.register_fake
def _eigvalsh_fake(A: Tensor) -> Tensor:
    return A.new_empty(A.shape[:-1])
