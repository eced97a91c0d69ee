"""Launcher of the float64 tensor-core Gram kernel (``csrc/cov_gram.cu``): exact raw partials.

For ``x: [B, T, S, D]`` (bf16/fp16/fp32/fp64, any strides, never copied), ``mask: [B, T]`` bool
(or None) and ``row_step = k`` (rows ``t = 0, k, 2k, ...``), :func:`partials_dmma` returns the
partials about 0 of :class:`~fastspec.covariance.reference.CovPartials`::

    keep[b, t]     = mask[b, t]                       (True without a mask)
    valid[b, t, s] = keep[b, t] and all(isfinite(x[b, t, s, :]))
    n[s]           = Σ valid                               [S]        int64
    rejected[s]    = Σ keep and not valid                  [S]        int64
    s[s]           = Σ_valid x[b, t, s, :]                 [S, D]     float64
    G[s]           = Σ_valid x xᵀ                          [S, D, D]  float64, exactly symmetric
    c[s]           = 0                                     [S, D]     float64

Every value is widened to float64 exactly and every product of two 16/32-bit values is exact in
float64, so the only rounding is that of the float64 sums, whose order is fixed: the same bits
on every run (no float atomics, a row split that depends on the shapes and the SM count only).

Two launches on torch's current stream, no host sync, no Python loop over heads or rows:

1. ``fastspec_cov_gram``, grid ``(split, S)`` (:func:`plan`): block ``(i, s)`` widens rows
   ``[i·rows_per_split, (i+1)·rows_per_split)`` of head ``s`` into shared memory tile by tile,
   tests and zeroes them, sums them, and accumulates the lower triangle of their Gram with
   ``mma.m8n8k4`` float64 (DMMA); it writes its partial (packed lower triangle, row sums,
   counts) to a workspace ``[split, S, D(D+1)/2 + D]``.
2. ``fastspec_cov_gram_reduce``: sums the splits in split order and mirrors the lower triangle,
   into fresh outputs (:func:`partials_dmma`) or added to an accumulator's totals in place
   (:func:`accumulate_dmma`, what an update through the op runs: the merge costs no launch).

The kernel's header holds the design envelope and the cost model (PREDICTED ~46 µs of device
time on an H100 for the keys shape ``[8, 2048, 8, 128]`` bf16, ~25 µs at B = 4; not measured).
It is compiled by NVRTC at first use for the device's arch, one image per ``(D, dtype)``
(:func:`defines`), and cached on disk (:mod:`fastspec.eig.nvrtc`; ``fastspec precompile``
fills it ahead of time). The split partials live in a per-thread workspace, reused by every
call, except while a CUDA graph is being captured, when every buffer is fresh (a graph keeps its
addresses, which later eager calls must not overwrite); :func:`accumulate_dmma` allocates
nothing else and dispatches no torch op.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _args
from ..eig import cuda, nvrtc
from ..eig.nvrtc import KernelUnavailable, ShapeUnsupported
from .blocked import Workspace, shared_workspace
from .reference import CovPartials

__all__ = ["PROGRAM", "Plan", "accumulate_dmma", "defines", "launch_args", "min_blocks", "partials_dmma", "plan",
           "reduce_args", "status", "supports", "tag", "tile_rows"]

PROGRAM = nvrtc.Program("cov_gram", "cov_gram.cu", (), ("fastspec_cov_gram", "fastspec_cov_gram_reduce"))
"""The kernel's source (in :func:`fastspec.eig.nvrtc.csrc_dir`) and its two entry points."""

ENVELOPE_D = (32, 64, 96, 128)
"""Features per head the kernel takes (its lower triangle splits into 8 warp roles of D/32-tile
blocks); any other D is refused and the caller falls back."""

DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}
"""Input dtypes and the kernel's ``FS_COV_IN`` code for each."""

THREADS = 256
"""Block size: 8 warps, one role of the lower triangle each (``FS_COV_ROLES``)."""

REDUCE_THREADS = 256
"""Block size of the reduction (``__launch_bounds__(256)`` in the kernel)."""

PAD = 4
"""Doubles a staged row is padded by (``kPitch = D + 4``: conflict-free fragment loads)."""

MIN_ARCH = 80
"""DMMA (``mma.m8n8k4`` float64) exists from sm_80."""

MAX_INDEX = 2**31 - 1
"""B, T and the rows of one block are 32-bit integers in the kernel."""

MAX_HEADS = 65535
"""Heads are the grid's y dimension."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def tile_rows(D: int, dtype: torch.dtype | str) -> int:
    """Rows per staged tile (``FS_COV_ROWS``): 16 at ``D = 128`` (the prefetched tile's
    registers are what keeps a 128-register budget, 2 blocks per SM, free of spills), else 32."""
    return 16 if D == 128 and _dtype_name(dtype) != "float64" else 32


def min_blocks(D: int, dtype: torch.dtype | str) -> int:
    """Resident blocks per SM the launch bounds size registers for (``FS_COV_MIN_BLOCKS``): 2
    (<= 128 registers), except float64 input at ``D = 128`` (its prefetched tile takes twice the
    registers: 1 block, <= 255 registers)."""
    return 1 if D == 128 and _dtype_name(dtype) == "float64" else 2


def supports(D: int | None = None, dtype: torch.dtype | str | None = None) -> str:
    """"" when the kernel takes ``D`` features of ``dtype`` input (each checked when given), else
    why not (one line)."""
    if dtype is not None and _dtype_name(dtype) not in DTYPES:
        return f"the DMMA Gram kernel takes {'/'.join(DTYPES)} input, got {_dtype_name(dtype)}"
    if D is not None and D not in ENVELOPE_D:
        return f"the DMMA Gram kernel takes D in {ENVELOPE_D} (a multiple of 32 up to 128), got D = {D}"
    return ""


def defines(D: int, dtype: torch.dtype | str) -> tuple[str, ...]:
    """The kernel's macros for ``D`` features of ``dtype`` input (``"-DNAME=value"``)."""
    why = supports(D, dtype)
    if why:
        raise ValueError(why)
    name = _dtype_name(dtype)
    return (f"-DFS_COV_D={D}", f"-DFS_COV_IN={DTYPES[name]}", f"-DFS_COV_THREADS={THREADS}",
            f"-DFS_COV_ROWS={tile_rows(D, name)}", f"-DFS_COV_MIN_BLOCKS={min_blocks(D, name)}")


def tag(D: int, dtype: torch.dtype | str) -> str:
    """The image's name in the kernel cache, e.g. ``bfloat16-d128-r16-b2``."""
    name = _dtype_name(dtype)
    return f"{name}-d{D}-r{tile_rows(D, name)}-b{min_blocks(D, name)}"


@dataclass(frozen=True)
class Plan:
    """One launch of the Gram kernel (what :func:`plan` decides from the shapes alone)."""

    split: int            # row splits per head: blocks along grid x
    rows_per_split: int   # rows a block reduces, a multiple of ``rows``
    rows: int             # rows per staged tile (FS_COV_ROWS)
    threads: int          # block size
    smem: int             # dynamic shared memory per block, bytes: two staged tiles
    grid: tuple[int, int, int]         # (split, S, 1)
    reduce_grid: tuple[int, int, int]  # (ceil((D(D+1)/2 + D + 2) / 256), S, 1)
    record: int           # doubles of one (split, head) partial: D(D+1)/2 + D


@functools.lru_cache(maxsize=256)
def plan(N: int, S: int, D: int, dtype: torch.dtype | str, sms: int) -> Plan:
    """The launch for ``N`` rows of ``S`` heads of ``D`` features on a GPU of ``sms`` SMs.

    ``split = max(1, sms · min_blocks // S)`` blocks per head fill one wave (every block resident
    at once: ``S · split <= sms · min_blocks``), cut down so no block gets fewer than one tile;
    ``rows_per_split`` is a whole number of tiles, and ``split`` is then recounted so none is
    empty. Keys ``N = 16384, S = 8, D = 128`` bf16 on 132 SMs: 32 splits of 512 rows, grid
    (32, 8) = 256 blocks, 2 per SM. A pure function of its arguments: the summation order (and
    so every bit of the result) depends on nothing else.
    """
    why = supports(D, dtype)
    if why:
        raise ValueError(why)
    if N < 0 or S < 1 or sms < 1:
        raise ValueError(f"plan: need N >= 0, S >= 1, sms >= 1, got N = {N}, S = {S}, sms = {sms}")
    rows = tile_rows(D, dtype)
    tiles = -(-N // rows)
    split = max(1, min(sms * min_blocks(D, dtype) // S, tiles))
    rows_per_split = rows * max(1, -(-tiles // split))
    split = max(1, -(-N // rows_per_split))
    record = D * (D + 1) // 2 + D
    return Plan(split, rows_per_split, rows, THREADS, 2 * rows * (D + PAD) * 8, (split, S, 1),
                (-(-(record + 2) // REDUCE_THREADS), S, 1), record)


def launch_args(x_ptr: int, mask_ptr: int, part_ptr: int, counts_ptr: int, B: int, Tk: int, row_step: int,
                x_strides: tuple[int, int, int, int], mask_strides: tuple[int, int], rows_per_split: int) -> list:
    """``fastspec_cov_gram``'s parameters as ctypes values, in its order and widths: four
    pointers (x, mask or 0, partials, counts), then B, Tk = ceil(T / row_step), row_step, x's four
    element strides, mask's two and rows_per_split as 64-bit integers (tests compare this with
    the parameter list of NVRTC's PTX)."""
    return [*(ctypes.c_void_p(p) for p in (x_ptr, mask_ptr, part_ptr, counts_ptr)),
            *(ctypes.c_longlong(v) for v in (B, Tk, row_step, *x_strides, *mask_strides, rows_per_split))]


def reduce_args(part_ptr: int, counts_ptr: int, split: int, G_ptr: int, s_ptr: int, c_ptr: int, n_ptr: int,
                rejected_ptr: int, accumulate: bool = False) -> list:
    """``fastspec_cov_gram_reduce``'s parameters as ctypes values: partials, counts, the number
    of splits (64-bit), then the outputs G, s, c, n, rejected, and whether to add into them (the
    totals of an accumulator, 32-bit) instead of writing them."""
    return [ctypes.c_void_p(part_ptr), ctypes.c_void_p(counts_ptr), ctypes.c_longlong(split),
            *(ctypes.c_void_p(p) for p in (G_ptr, s_ptr, c_ptr, n_ptr, rejected_ptr)),
            ctypes.c_int(int(accumulate))]


# --- where it runs -------------------------------------------------------------------------------


def _arch(index: int) -> tuple[int, int]:
    """(compute capability as major * 10 + minor, SM count) of CUDA device ``index`` (the
    eigensolver's :class:`~fastspec.eig.cuda.DeviceSpec`; torch caches the properties)."""
    spec = cuda.DeviceSpec.of_device(index)
    return spec.cc, spec.sms


_statuses: dict[tuple, str] = {}


def status(device: torch.device | str | int, D: int | None = None, dtype: torch.dtype | str | None = None) -> str:
    """"" when :func:`partials_dmma` can run on ``device`` (for ``D`` features of ``dtype`` input,
    each checked when given), else a one-line reason: D or dtype outside the envelope, not a CUDA
    device, no NVRTC or cuda-bindings, a GPU without float64 tensor cores (before sm_80).
    Remembered per device with an index, D and dtype: every update asks (host time)."""
    key = (device, D, dtype)
    why = _statuses.get(key) if isinstance(device, torch.device) and device.index is not None else None
    if why is None:
        why = _status(device, D, dtype)
        if isinstance(device, torch.device) and device.index is not None:
            _statuses[key] = why
    return why


def _status(device: torch.device | str | int, D: int | None, dtype: torch.dtype | str | None) -> str:
    why = supports(D, dtype)
    if why:
        return why
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return f"the DMMA Gram kernel runs on CUDA devices, got {device.type}"
    ok, why = cuda.status()
    if not ok:
        return why
    cc, _ = _arch(cuda.device_index(device))
    if cc < MIN_ARCH:
        return f"sm_{cc} has no float64 tensor cores (mma.m8n8k4 .f64 needs sm_{MIN_ARCH} or newer)"
    return ""


# --- buffers and launch -------------------------------------------------------------------------


def _workspace(capturing: bool) -> Workspace:
    """This thread's workspace, shared with the other exact routes (calls on a thread run in
    stream order; this kernel's buffers are named ``cov_gram.*``), or a fresh one during CUDA-graph
    capture (a graph keeps its addresses, which later eager calls must not overwrite)."""
    return Workspace() if capturing else shared_workspace()


_configured: set[tuple] = set()  # (image tag, device index): shared memory opt-in done
_config_lock = threading.Lock()


def _prefer_shared_memory(kernel, index: int) -> None:
    """All of the unified L1/shared array as shared memory for ``kernel`` on device ``index`` (as
    the eigensolver does): the default split may leave room for fewer resident blocks than the
    launch bounds plan for. The kernel's loads stream (read once), so L1 has nothing to keep."""
    driver = nvrtc.binding("driver")
    dev = nvrtc.unpack(driver.cuDeviceGet(index), "CUDA driver cuDeviceGet")
    carveout = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    nvrtc.unpack(driver.cuKernelSetAttribute(carveout, 100, kernel, dev), "CUDA driver setting the kernel's carveout")


def _kernels(D: int, dtype: str, index: int, smem: int) -> dict[str, object]:
    """The two entry points for ``(D, dtype)`` on device ``index``: compiled, loaded and given
    their shared memory on first use (all of it host-side work: never inside a graph capture)."""
    kernels = cuda.load_program(PROGRAM, defines(D, dtype), tag(D, dtype), index)
    key = (tag(D, dtype), index)
    if key not in _configured:
        with _config_lock:
            cuda.set_max_smem(kernels["fastspec_cov_gram"], smem, index)
            _prefer_shared_memory(kernels["fastspec_cov_gram"], index)
            _configured.add(key)
    return kernels


def _check(x: Tensor, mask: Tensor | None, row_step: int) -> int:
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x: expected a 4-D tensor [B, T, S, D], got "
                         f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(x.shape[:2])):
        raise ValueError(f"mask: expected a tensor of shape {list(x.shape[:2])}, got "
                         f"{list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    if mask is not None and mask.device != x.device:
        raise ValueError(f"mask: expected it on {x.device}, got {mask.device}")
    row_step = _args.integer("row_step", row_step, minimum=1)
    B, T, S, D = x.shape
    why = status(x.device, D, x.dtype)
    if why:
        raise KernelUnavailable(why)
    # past these limits the kernel cannot take this call, but takes every other: the caller falls
    # back for this call only (ops.exact_update)
    if max(B, T) > MAX_INDEX:
        raise ShapeUnsupported(f"the DMMA Gram kernel indexes B and T with 32 bits, got B = {B}, T = {T}")
    if S > MAX_HEADS:
        raise ShapeUnsupported(f"the DMMA Gram kernel takes at most {MAX_HEADS} heads (its grid's y), got S = {S}")
    return row_step


def partials_dmma(x: Tensor, mask: Tensor | None = None, row_step: int = 1) -> CovPartials:
    """Exact float64 raw partials of ``x: [B, T, S, D]`` (module docstring) on its CUDA device.

    ``mask: [B, T]`` bool (or uint8: nonzero keeps; another dtype is compared with 0 first),
    ``row_step = k`` keeps rows ``t = 0, k, 2k, ...``. Returns ``CovPartials(n [S] int64, c [S, D]
    zeros, s [S, D], G [S, D, D], rejected [S] int64)``, float64 sums about 0, ``G`` exactly
    symmetric, as fresh tensors. Two kernel launches, asynchronous. KernelUnavailable (with the
    reason) when the kernel cannot run here: the caller falls back.
    """
    row_step = _check(x, mask, row_step)
    S, D = x.shape[-2], x.shape[-1]
    f64 = {"dtype": torch.float64, "device": x.device}
    out = CovPartials(torch.empty(S, dtype=torch.int64, device=x.device), torch.empty(S, D, **f64),
                      torch.empty(S, D, **f64), torch.empty(S, D, D, **f64),
                      torch.empty(S, dtype=torch.int64, device=x.device))
    _launch(x, mask, row_step, out.G, out.s, out.c, out.n, out.rejected, False)
    return out


def accumulate_dmma(n: Tensor, rejected: Tensor, sum_: Tensor, gram: Tensor, x: Tensor, mask: Tensor | None = None,
                    row_step: int = 1) -> None:
    """Add the update of ``x`` to an accumulator's raw-sum totals in place (``n``/``rejected``
    ``[S]`` int64, ``sum [S, D]`` and ``gram [S, D, D]`` float64, contiguous, on x's device):
    bitwise what :func:`partials_dmma` then :func:`~fastspec.covariance.ops.merge_sums` give, the
    merge done by the reduction kernel. Two launches, no torch op, nothing allocated once the
    workspace holds the shape (except while a CUDA graph is being captured)."""
    row_step = _check(x, mask, row_step)
    S, D = x.shape[-2], x.shape[-1]
    for name, t, shape, dt in (("n", n, (S,), torch.int64), ("rejected", rejected, (S,), torch.int64),
                               ("sum", sum_, (S, D), torch.float64), ("gram", gram, (S, D, D), torch.float64)):
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"{name}: expected a contiguous {dt} tensor of shape {list(shape)} on {x.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    _launch(x, mask, row_step, gram, sum_, sum_, n, rejected, True)


def _launch(x: Tensor, mask: Tensor | None, row_step: int, G: Tensor, s: Tensor, c: Tensor, n: Tensor,
            rejected: Tensor, accumulate: bool) -> None:
    """The kernel pair into ``(G, s, c, n, rejected)``: written, or added to (``accumulate``;
    ``c`` is then not written). Nothing to do (no launch) for an update without rows when
    accumulating; without rows and not accumulating, the reduction still writes zeros."""
    B, T, S, D = x.shape
    if S == 0 or (accumulate and B * T == 0):
        return
    dtype = _dtype_name(x.dtype)
    dev = x.device
    index = cuda.device_index(dev)
    ws = _workspace(torch.cuda.is_current_stream_capturing())
    Tk = -(-T // row_step)
    p = plan(B * Tk, S, D, dtype, _arch(index)[1])
    if p.rows_per_split > MAX_INDEX:
        raise ShapeUnsupported(f"the DMMA Gram kernel counts a block's rows with 32 bits, got {p.rows_per_split}")
    kernels = _kernels(D, dtype, index, p.smem)
    part = ws.get("cov_gram.partials", (p.split * S * p.record,), torch.float64, dev)
    counts = ws.get("cov_gram.counts", (p.split * S * 2,), torch.int64, dev)
    if mask is not None and mask.dtype not in (torch.bool, torch.uint8):
        mask = mask != 0
    m_ptr, m_strides = (0, (0, 0)) if mask is None else (mask.data_ptr(), mask.stride())
    args = launch_args(x.data_ptr(), m_ptr, part.data_ptr(), counts.data_ptr(), B, Tk, row_step, x.stride(),
                       m_strides, p.rows_per_split)
    cuda.launch_kernel(kernels["fastspec_cov_gram"], p.grid, (p.threads, 1, 1), p.smem, args, index)
    args = reduce_args(part.data_ptr(), counts.data_ptr(), p.split, G.data_ptr(), s.data_ptr(), c.data_ptr(),
                       n.data_ptr(), rejected.data_ptr(), accumulate)
    cuda.launch_kernel(kernels["fastspec_cov_gram_reduce"], p.reduce_grid, (REDUCE_THREADS, 1, 1), 0, args, index)
