"""Launcher of the Triton covariance-update kernels (``triton_kernels.py``) (docs/accumulators.md).

:func:`covariance_partials_triton` has the contract of
:func:`fastspec.covariance.reference.covariance_partials_reference`, except that the center
``c`` is a per-site shift chosen in-kernel rather than the exact chunk mean: per channel, the
mean of up to 64 valid rows spread over the chunk, rounded to a power-of-two grid of about 1/16
of their std (and to the input dtype); the caller's Chan merge is exact for any shift. It runs on
CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``
was set before triton was imported (this is how the CPU tests reach the kernels).

Per call, with no host sync (sizes come from shapes only) on the current CUDA stream:

1. ``_center_kernel`` (center=True): ``c[S, D]``.
2. ``_row_status_kernel`` (only when ``D`` > one tile): per-row valid/rejected flags ``[S, N]``.
3. ``_cov_partials_kernel``: grid (tile pairs of G, site, row split) writes fp32 partials to a
   workspace ``[SPLIT, S, D, D]``, each exactly symmetric (upper-triangle tiles stored with their
   mirror, diagonal tiles averaged with their transpose in-kernel); the split axis is then summed
   by torch in a fixed order.
"""
from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from .reference import CovPartials, covariance_partials_reference
from .triton_kernels import _center_kernel, _cov_partials_kernel, _row_status_kernel

__all__ = ["covariance_partials_triton", "launch_config"]

# rows sampled for the center; enough to put c within ~std/8 of the mean
CENTER_ROWS = 64

# every buffer the kernels write goes through this (tests swap in a NaN-filling version so a
# kernel that skips part of an output fails loudly instead of reading stale zeros)
_empty = torch.empty


# triton.jit reads TRITON_INTERPRET when the kernels are decorated (import time), so do we
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreting() -> bool:
    return _INTERPRET


class LaunchConfig(NamedTuple):
    """Fixed per-``D`` tiling (no autotuning: a different pick would change summation order)."""

    BD: int  # width of a G tile (and of a row block's columns)
    NTILE: int  # tiles per side of G; 1 = whole rows in one tile, fused validity
    BT: int  # rows per block
    num_warps: int
    split: int  # row splits (programs per (tile, site) along N)
    rows_per_split: int


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_and_warps(BD: int, NTILE: int, elem_bytes: int) -> tuple[int, int]:
    """Rows per block and warps: the largest blocks ptxas (sm_90, Triton 3.9) fits without spills
    in the row loop.

    Checked by compiling for sm_90 without a GPU and reading ``cuobjdump -res-usage``; fp32
    ``ieee`` dots run on the FMA units and are unrolled over the rows, hence short blocks (the
    tiled fp32 kernel spills anyway: fp32 wide-D input is outside the envelope).
    """
    if elem_bytes == 4:
        return 16, 8 if BD == 128 else 4
    if NTILE > 1:
        return 64, 8
    return (32, 8) if BD == 128 else (32, 4) if BD == 64 else (64, 4)


def launch_config(N: int, S: int, D: int, device: torch.device, elem_bytes: int,
                  split: int | None = None) -> LaunchConfig:
    """Tiles for ``[N rows, S sites, D]``: whole rows for D <= 128, else 128-wide tiles of G.

    ``split`` (tests) forces the number of row splits; by default enough programs to fill the
    GPU twice over, with at least ``2·D/elem_bytes·4`` rows per split so the fp32 workspace
    (``D²·4`` bytes per split) stays under a quarter of the bytes of x it summarizes.
    """
    BD = max(16, triton.next_power_of_2(D)) if D <= 128 else 128
    NTILE = triton.cdiv(D, BD)
    BT, num_warps = _rows_and_warps(BD, NTILE, elem_bytes)
    if split is None:
        pairs = S * NTILE * (NTILE + 1) // 2
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        min_rows = max(BT, 16 * D // elem_bytes)
        split = max(1, min(triton.cdiv(target, pairs), triton.cdiv(N, min_rows)))
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"split: expected an int >= 1, got {split!r}")
    rps = triton.cdiv(triton.cdiv(max(N, 1), split), BT) * BT
    return LaunchConfig(BD, NTILE, BT, num_warps, triton.cdiv(max(N, 1), rps), rps)


def _check(x: Tensor, mask: Tensor | None, row_step: int) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x: expected a 4-D tensor [B, T, S, D], got "
                         f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"x: expected bf16/fp16/fp32/fp64, got {x.dtype}")
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(x.shape[:2])):
        raise ValueError(f"mask: expected a tensor of shape {list(x.shape[:2])}, got "
                         f"{list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    if not isinstance(row_step, int) or isinstance(row_step, bool) or row_step < 1:
        raise ValueError(f"row_step: expected an int >= 1, got {row_step!r}")
    if not x.is_cuda and not _interpreting():
        raise RuntimeError("x: the Triton covariance kernels need a CUDA tensor (or TRITON_INTERPRET=1 "
                           "set before importing triton, for CPU tests); use backend='torch' on CPU")


def covariance_partials_triton(x: Tensor, mask: Tensor | None = None, row_step: int = 1,
                               center: bool = True, *, split: int | None = None) -> CovPartials:
    """FP32 partials of one chunk ``x: [B, T, S, D]`` (any strides), ``mask: [B, T]`` or None.

    Rows ``x[b, t]`` for ``t = 0, k, 2k, ...`` (``k = row_step``) with ``mask[b, t]`` true are
    kept; per site ``s`` a kept row is *valid* if its ``D`` values are finite, else *rejected*.
    Returns ``CovPartials(n [S] int64, c [S, D], s = Σ(x−c) [S, D], G = Σ(x−c)(x−c)ᵀ
    [S, D, D], rejected [S] int64)`` over valid rows; fp32 sums, ``c = 0`` when not ``center``,
    ``G`` exactly symmetric.
    float64 input is delegated to the torch reference (the kernels accumulate in fp32).
    """
    _check(x, mask, row_step)
    if x.dtype == torch.float64:
        return covariance_partials_reference(x, mask, row_step, center)
    x = x.detach()  # called from forward hooks: the kernels read the data, autograd has no part
    B, T, S, D = x.shape
    Tk = triton.cdiv(T, row_step)
    N = B * Tk
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    if N == 0 or S == 0:
        zeros = torch.zeros(S, dtype=torch.int64, device=dev)
        return CovPartials(zeros, torch.zeros(S, D, **f32), torch.zeros(S, D, **f32),
                           torch.zeros(S, D, D, **f32), zeros.clone())
    cfg = launch_config(N, S, D, dev, x.element_size(), split)
    fused = cfg.NTILE == 1
    lowp = x.dtype in (torch.bfloat16, torch.float16)
    split_bf16 = bool(center) and lowp
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask != 0
        mask = mask.view(torch.uint8)  # same bytes; triton loads bool pointers unevenly across versions
        smb, smt = mask.stride()
    else:
        mask, smb, smt = x, 0, 0  # never read: HAS_MASK=False
    sxb, sxt, sxs, sxd = x.stride()
    common = dict(stride_xb=sxb, stride_xt=sxt, stride_xs=sxs, stride_xd=sxd,
                  stride_mb=smb, stride_mt=smt, ROW_STEP=row_step, HAS_MASK=mask is not x)

    with torch.cuda.device(dev) if x.is_cuda else nullcontext():
        if center:
            c = _empty(S, D, **f32)
            _center_kernel[(S,)](x, mask, c, N, Tk, D, **common, ROUND_TO_INPUT=lowp,
                                 NC=CENTER_ROWS, BD=min(cfg.BD, 64))
        else:
            c = torch.zeros(S, D, **f32)
        if fused:
            status = c  # never read: FUSED_STATUS=True
        else:
            status = _empty(S, N, dtype=torch.int8, device=dev)
            _row_status_kernel[(triton.cdiv(N, 64), S)](x, mask, status, N, Tk, D, **common,
                                                         BT=64, BD=128, num_warps=8)
        G_ws = _empty(cfg.split, S, D, D, **f32)
        s_ws = _empty(cfg.split, S, D, **f32)
        cnt = _empty(2, cfg.split, S, dtype=torch.int32, device=dev) if fused else c
        _cov_partials_kernel[(cfg.NTILE * cfg.NTILE, S, cfg.split)](
            x, mask, status, c, G_ws, s_ws, cnt, cnt[1] if fused else c,
            N, Tk, D, S, cfg.rows_per_split, **common,
            FUSED_STATUS=fused, CENTER=bool(center), SPLIT_BF16=split_bf16,
            UPCAST=_interpreting(), PRECISION="ieee",
            NTILE=cfg.NTILE, BT=cfg.BT, BD=cfg.BD, num_warps=cfg.num_warps)

    # fixed-order reduction of the row splits (a plain dim reduction: no atomics)
    # every split's G is exactly symmetric (the kernel symmetrizes diagonal tiles and mirrors
    # the others), and an elementwise sum of symmetric matrices stays so: no G + Gᵀ pass here
    G = G_ws[0] if cfg.split == 1 else G_ws.sum(0)
    s = s_ws[0] if cfg.split == 1 else s_ws.sum(0)
    if fused:
        n, rejected = cnt.sum(1, dtype=torch.int64).unbind(0)
    else:
        n = (status == 1).sum(1, dtype=torch.int64)
        rejected = (status == 2).sum(1, dtype=torch.int64)
    return CovPartials(n, c, s, G, rejected)

