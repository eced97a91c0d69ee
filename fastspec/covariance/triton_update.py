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
3. ``_cov_partials_kernel``: grid (triangle tiles of G, site, row split) writes fp32 partials
   to a workspace ``[SPLIT, S, D, D]``, each exactly symmetric (upper-triangle tiles stored with
   their mirror, diagonal tiles averaged with their transpose in-kernel). For D <= 128 (whole
   rows in one tile) a program merges its rows without testing them one by one and reruns them
   with the exact per-row test only if its Σd comes out non-finite (some kept row has a
   NaN/±Inf, or the sum overflowed). A pre-split candidate (wide D, centred 16-bit input)
   replaces this step with ``triton_presplit.presplit_partials``.
4. ``_finish_kernel``: the row splits summed in a fixed order, the counts, and ``c = 0`` when
   not centred, in one launch (a wide D with one row split needs none: its partials are the sums).

An uncentred keys update is thus 2 launches, a centred one 3. Launch settings of 16-bit input
with ``D > 64`` are a measured candidate of :mod:`.triton_configs`; the grid (:func:`launch_config`)
for the keys shape ``[8, 2048, 8, 128]`` bf16 on an H100: 8 heads × 16 row splits = 128 programs
of 1024 rows (one wave, one 8-warp program per SM), and an 8.4 MB workspace (1/4 of the input).
Predicted (a cost model, not a measurement; see the header of ``triton_kernels.py`` and
docs/kernels.md): ≈ 12.5 µs uncentered (~80 % of HBM bandwidth), ≈ 20 µs centered.
"""
from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from .. import _args
from .reference import CovPartials, covariance_partials_reference
from .triton_configs import CANDIDATES, ENV, TritonConfig, arch_of, choose, kernel_of
from .triton_kernels import (
    _center_kernel,
    _cov_partials_kernel,
    _finish_kernel,
    _row_status_kernel,
)
from .triton_presplit import presplit_partials

__all__ = ["REFERENCE", "block_accumulation", "covariance_partials_triton", "launch_config", "pipeline_stages",
           "serving"]

# rows sampled for the center; enough to put c within ~std/8 of the mean
CENTER_ROWS = 64

# the finish kernel: BR x BR tiles of G (16 programs a site at D = 128), BK row splits loaded
# at once (the keys case's 16 in two steps), BN status bytes per step of the wide path's counts
FINISH_BR, FINISH_BK, FINISH_BN = 32, 8, 1024

# every buffer the kernels write goes through this (tests swap in a NaN-filling version so a
# kernel that skips part of an output fails loudly instead of reading stale zeros)
_empty = torch.empty


# the fused kernel walks rows by carrying the first row's (b, t) from block to block when
# every sequence has at least BT sampled rows (Tk >= BT); tests turn this off to check that
# the general per-row (int32) indexing gives bitwise the same partials
_ROW_CARRY = True

# triton.jit reads TRITON_INTERPRET when the kernels are decorated (import time), so do we
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# load-pipeline stages (Triton's num_stages) of every covariance launch: 4 raced on an H100
# (pipeline_stages says where)
STAGES = 3


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
    num_stages: int = STAGES  # software-pipelining depth of the row loop's loads (Triton's num_stages)
    lolo: bool = True  # the centred split forms lo·loᵀ (triton_configs.TritonConfig.lolo)
    presplit: bool = False  # tiled, centred 16-bit: hi/lo written by a pre-pass (triton_presplit.py)
    name: str = ""  # the triton_configs candidate these settings come from ("" : fixed rules)
    unroll: int = 1  # fused path: row blocks per unrolled group (TritonConfig.unroll)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_and_warps(BD: int, NTILE: int, elem_bytes: int) -> tuple[int, int]:
    """Rows per block and warps: the largest blocks ptxas (sm_90, Triton 3.9) fits without spills
    in the row loop.

    Checked by compiling for sm_90 without a GPU and reading ``cuobjdump -res-usage``; fp32
    ``ieee`` dots run on the FMA units and are unrolled over the rows, hence short blocks (the
    tiled fp32 kernel spills anyway: fp32 wide-D input is outside the envelope). At BD=128 the
    fused kernel fits 64-row blocks too (250 registers) but saves only ~13 % of the loop's
    instructions per row, and 16 warps (114 registers) issue ~1.6x more warp-instructions per
    row block than 8 (each warp repeats the row-offset and pipeline bookkeeping).
    """
    if elem_bytes == 4:
        return 16, 8 if BD == 128 else 4
    if NTILE > 1:
        return 64, 8
    return (32, 8) if BD == 128 else (32, 4) if BD == 64 else (64, 4)


def launch_config(N: int, S: int, D: int, device: torch.device, elem_bytes: int,
                  split: int | None = None, candidate: TritonConfig | None = None) -> LaunchConfig:
    """Tiles for ``[N rows, S sites, D]``: whole rows for D <= 128, else 128-wide tiles of G.

    ``candidate`` (16-bit input, ``64 < D``: the raced kernels of :mod:`.triton_configs`) sets
    the rows per block, warps, stages (still capped by :func:`pipeline_stages`), ``lolo`` and
    ``presplit``; without one (fp32 input, ``D <= 64``) the fixed rules of
    :func:`_rows_and_warps` do. ``split`` (tests) forces the number of row splits. By default
    (fused path, D <= 128):

    * one wave: ``S·split <= #SMs`` programs. The fused kernel holds a 128×128 fp32 ``G`` per
      program and uses 180-245 registers per thread at 8 warps, so one program per SM is
      resident; a second wave would leave most SMs idle in its tail (e.g. S = 5: 265 programs
      on 132 SMs is 3 waves, the last with one program), so split = ``#SMs // S``, rounded down.
    * latency hiding comes from the pipeline, not from more resident programs: Triton
      software-pipelines the loop's x loads (``cp.async`` into shared memory, ``num_stages``
      buffers of ``BT·BD`` elements); with 3 stages each SM keeps 2 row blocks (16 KB at
      BD = 128 bf16) in flight while it multiplies the current one, a little under what
      Little's law asks of an H100 SM (3.35 TB/s × ~0.8 µs / 132 SMs ≈ 20 KB). 4 stages
      would cover it, but on an H100 (Triton 3.6) every failing launch that could be a race had
      4 stages (see :func:`pipeline_stages`), so no launch uses them. A second
      resident program would need <= 128 registers (ptxas spills the rare exact-fallback loop
      and the epilogue then) and twice the splits, i.e. twice the workspace.
    * workspace: at least ``16·D/elem_bytes`` rows per split, so the fp32 partials
      (``D²·4`` bytes per split and site) stay <= 1/4 of the bytes of x they summarize: the
      ``[split, S, D, D]`` workspace is written once and summed once by torch, and at this
      size it stays in L2 (50 MB on H100) between the two.

    keys ``[B=8, H=8, T=2048, D=128]`` bf16 on an H100 (132 SMs): split = min(132 // 8,
    16384 / 1024) = 16, grid 8 × 16 = 128 programs (4 SMs idle: programs do not span sites),
    1024 rows (32 blocks of 32) each, workspace 16·8·128²·4 = 8.4 MB (1/4 of the 33.6 MB read).
    The tiled path (D > 128, many tile programs) keeps two programs' worth per SM as target.
    """
    BD = max(16, triton.next_power_of_2(D)) if D <= 128 else 128
    NTILE = triton.cdiv(D, BD)
    if candidate is not None:
        if candidate.kernel != kernel_of(D) or elem_bytes != 2:
            raise ValueError(f"candidate: {candidate.name!r} is a {candidate.kernel} setting; this update "
                             f"({elem_bytes}-byte input, D={D}) runs {kernel_of(D) if elem_bytes == 2 else None}")
        BT, num_warps, stages = candidate.BT, candidate.num_warps, candidate.num_stages
        unroll = candidate.unroll if NTILE == 1 else 1
    else:
        BT, num_warps = _rows_and_warps(BD, NTILE, elem_bytes)
        stages, unroll = STAGES, 1
    if split is None:
        pairs = S * NTILE * (NTILE + 1) // 2
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        target = sms // pairs if NTILE == 1 else triton.cdiv(2 * sms, pairs)
        min_rows = max(BT, 16 * D // elem_bytes)
        split = max(1, min(target, triton.cdiv(N, min_rows)))
    split = _args.integer("split", split, minimum=1)
    # whole unrolled groups per split (a group is one trip of the row loop)
    group = BT * unroll
    rps = triton.cdiv(triton.cdiv(max(N, 1), split), group) * group
    split = triton.cdiv(max(N, 1), rps)
    extra = {} if candidate is None else {"lolo": candidate.lolo, "presplit": candidate.presplit,
                                          "name": candidate.name, "unroll": unroll}
    return LaunchConfig(BD, NTILE, BT, num_warps, split, rps, pipeline_stages(stages, N, rps, split, group),
                        **extra)


def pipeline_stages(wanted: int, N: int, rows_per_split: int, split: int, BT: int) -> int:
    """``wanted`` load-pipeline stages, but never more than the shortest program's row blocks
    (``BT``: the rows of one trip of the loop, a block or an unrolled group of blocks).

    On an H100 (Triton 3.6, 2026-11-26, ``benchmarks/gpu_diag.py accuracy``) the fused kernel
    with 4 stages gave wrong sums that changed from launch to launch (a race, errors up to 19 %)
    whenever a program's loop had 2 row blocks: fp16 and bf16 ``[2, 24, 2, 128]`` with 32-row
    blocks, and ``[2, 64, 2, 128]`` with 64-row blocks; the same launches with 3 or 2 stages
    were exact. The next run (2026-11-27) still found 4-stage launches wrong over 8 and 16 row
    blocks (bf16 ``[2, 128, 4, 96]`` and ``[2, 256, 8, 128]`` against fp64; their fp16 twins
    passed), so the launcher asks for :data:`STAGES` (3), never 4, and caps even those at the
    loop's trip count: inputs that small gain nothing from a deeper pipeline. The evening run
    of 2026-11-27 (``benchmarks/race_probe.py``) found 3 and 2 stages racing too, with the dots
    accumulating into ``G`` on masked input (those two shapes) and with the uncentred block tile
    flushed under an ``if``; 1 stage was exact. The tile flushed by a select every block
    (``triton_kernels._gram_dot``) is exact and steady at 3 stages on every input it ran.
    """
    last = max(N, 1) - (split - 1) * rows_per_split  # the last program's rows (the fewest)
    return max(1, min(wanted, triton.cdiv(min(rows_per_split, last), BT)))


def block_accumulation(tensor_cores: bool) -> int:
    """Where a row block's products are summed (``_gram_dot``'s ``ACC``): 2 wherever the dots run
    on tensor cores (16-bit input, centred or not), 0 for fp32 input (``ieee`` dots on the FMA
    units, which round every add).

    Measured on an H100 (Triton 3.6, 2026-11-26, ``benchmarks/gpu_diag.py accuracy``): the
    centred hi + lo split, its four dots accumulating into ``G`` inside the tensor-core
    instructions (``ACC=0``), was 35-59x less accurate than torch float32 on channels whose
    means lie near their spread; its three correction dots summed apart (``ACC=1``), 9-18x;
    the whole block summed in its own tile and added to ``G`` by an fp32 add (``ACC=2``),
    1.2-1.4x. The tensor cores' accumulation, not the split, loses the bits. Uncentred 16-bit
    products are exact too, but their sums went through the same accumulation: the next run
    (2026-11-27) found them outside 4x torch fp32 against fp64 (fp16 ``[512, 2048]`` rows about
    a mean of up to 100). A model of the matrix instruction that reproduces the split's
    measured 35-59x (each 16-row step's sum truncated to fp32) puts uncentred rows at 4-17x
    torch with ``ACC=0`` over 512-1024 rows, and at 1.0-2.1x with the block tile flushed every
    128 rows (``triton_kernels.FLUSH_ROWS``), which they now use. Measured on the H100 (the
    evening run of 2026-11-27, ``benchmarks/race_probe.py``, the flush as a select): fp16
    ``[512, 2048]`` about means up to 100, masked, 7.5x torch fp32 with ``ACC=0`` -> 1.2x; one
    1024-row program about the same means 76x -> 5.5x (the model's 1.0-2.1x is optimistic
    there); the keys case 0.27x -> 0.03x.
    Cost of the second fp32 tile, compiled for sm_90 (Triton 3.6 / 3.9, masked rows): the
    centred keys kernel (``BD = 128``, 32-row blocks) 234 -> 252 / 229 -> 240 registers, no
    spills, row loop 399 -> 484 / 414 -> 502 instructions per warp (+21 %); the tiled FFN kernel
    214 -> 255 / 212 -> 255 registers, an 8 / 24 byte stack (2 / 0 spill instructions in the
    loop), loop +8 % / +4 %. Uncentred (Triton 3.9 / 3.6), the tile flushed by a select every
    block (an ``if`` every 4th block raced on the H100): the keys kernel 180 -> 242 / 246
    registers, no spills, loop 180 -> 452 / 451 instructions per warp, 38.2 -> 44.7 µs per
    graphed call on the H100; the tiled fp16 kernel's loop +6 % / +4 % over the ``if``, its
    spills about unchanged. ``benchmarks/tensor_core_sum_model.py`` is the model.
    """
    return 2 if tensor_cores else 0


def _check(x: Tensor, mask: Tensor | None, row_step: int) -> int:
    """Raise on bad arguments; returns ``row_step`` as an int (a NumPy int is not a constexpr)."""
    row_step = check_args(x, mask, row_step)
    if not x.is_cuda and not _interpreting():
        raise RuntimeError("x: the Triton covariance kernels need a CUDA tensor (or TRITON_INTERPRET=1 "
                           "set before importing triton, for CPU tests); use backend='torch' on CPU")
    return row_step


def check_args(x: Tensor, mask: Tensor | None, row_step: int) -> int:
    """The arguments of a Triton update (``x: [B, T, S, D]`` of a float dtype, ``mask: [B, T]``,
    ``row_step >= 1``), each named in its error; ``row_step`` as an int (a constexpr)."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x: expected a 4-D tensor [B, T, S, D], got "
                         f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"x: expected bf16/fp16/fp32/fp64, got {x.dtype}")
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(x.shape[:2])):
        raise ValueError(f"mask: expected a tensor of shape {list(x.shape[:2])}, got "
                         f"{list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    return _args.integer("row_step", row_step, minimum=1)


def covariance_partials_triton(x: Tensor, mask: Tensor | None = None, row_step: int = 1,
                               center: bool = True, *, split: int | None = None,
                               config: LaunchConfig | None = None, acc: int | None = None,
                               candidate: TritonConfig | None = None) -> CovPartials:
    """FP32 partials of one chunk ``x: [B, T, S, D]`` (any strides), ``mask: [B, T]`` or None.

    Rows ``x[b, t]`` for ``t = 0, k, 2k, ...`` (``k = row_step``) with ``mask[b, t]`` true are
    kept; per site ``s`` a kept row is *valid* if its ``D`` values are finite, else *rejected*.
    Returns ``CovPartials(n [S] int64, c [S, D], s = Σ(x−c) [S, D], G = Σ(x−c)(x−c)ᵀ
    [S, D, D], rejected [S] int64)`` over valid rows; fp32 sums, ``c = 0`` when not ``center``,
    ``G`` exactly symmetric.
    float64 input is delegated to the torch reference (the kernels accumulate in fp32).

    The launch settings of 16-bit input with ``D > 64`` are a candidate of
    :mod:`~fastspec.covariance.triton_configs`: ``candidate`` (the race, tests), else the one
    :func:`~fastspec.covariance.triton_configs.choose` picks (``$FASTSPEC_COV_TRITON_CONFIG``,
    the measured table, the default).

    Diagnostics and tests only (``benchmarks/gpu_diag.py``): ``config`` replaces
    :func:`launch_config`'s tiling (its ``BD``/``NTILE`` must suit ``D``), ``acc`` picks where the
    kernel sums a block's products (``_gram_dot``'s ``ACC``; ``None``: :func:`block_accumulation`).
    """
    row_step = _check(x, mask, row_step)
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
    lowp = x.dtype in (torch.bfloat16, torch.float16)
    if config is None:
        kernel = kernel_of(D) if lowp else None
        if candidate is None and kernel is not None:
            candidate, _ = choose(kernel, arch_of(dev), x.dtype, bool(center))
        cfg = launch_config(N, S, D, dev, x.element_size(), split, candidate)
    else:
        cfg = config
    fused = cfg.NTILE == 1
    split_bf16 = bool(center) and lowp
    acc = block_accumulation(lowp) if acc is None else acc
    acc = _args.choice("acc", _args.integer("acc", acc, minimum=0), (0, 1, 2))
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
            c = _empty(S, D, **f32)  # zeros, written by the last launch
        if fused:
            status = c  # never read: FUSED_STATUS=True
        else:
            status = _empty(S, N, dtype=torch.int8, device=dev)
            _row_status_kernel[(triton.cdiv(N, 64), S)](x, mask, status, N, Tk, D, **common,
                                                         BT=64, BD=128, num_warps=8)
        if cfg.presplit and split_bf16 and not fused:
            G, s = presplit_partials(x, status, c, N, Tk, common, BT=cfg.BT, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, lolo=cfg.lolo, upcast=_interpreting())
            return CovPartials((status == 1).sum(1, dtype=torch.int64), c, s, G,
                               (status == 2).sum(1, dtype=torch.int64))
        G_ws = _empty(cfg.split, S, D, D, **f32)
        s_ws = _empty(cfg.split, S, D, **f32)
        cnt = _empty(2, cfg.split, S, dtype=torch.int32, device=dev) if fused else c
        _cov_partials_kernel[(cfg.NTILE * (cfg.NTILE + 1) // 2, S, cfg.split)](
            x, mask, status, c, G_ws, s_ws, cnt, cnt[1] if fused else c,
            N, Tk, D, S, cfg.rows_per_split, **common,
            FUSED_STATUS=fused, CENTER=bool(center), SPLIT_BF16=split_bf16,
            UPCAST=_interpreting(), PRECISION="ieee", ACC=acc,
            NTILE=cfg.NTILE, TK_GE_BT=_ROW_CARRY and Tk >= cfg.BT, BT=cfg.BT, BD=cfg.BD, LOLO=cfg.lolo,
            # the centred split sums every block in its own tile: nothing to flush per group
            UNROLL=1 if split_bf16 else cfg.unroll, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        if not fused and cfg.split == 1:
            # one split of a wide D: the partials are the sums already (no copy of D² floats)
            if not center:
                c.zero_()
            return CovPartials((status == 1).sum(1, dtype=torch.int64), c, s_ws[0], G_ws[0],
                               (status == 2).sum(1, dtype=torch.int64))
        # the row splits summed in a fixed order, c's zeros and the counts: one launch. Every
        # split's G is exactly symmetric (the kernel symmetrizes diagonal tiles and mirrors the
        # others), and an elementwise sum of symmetric matrices stays so: no G + Gᵀ pass
        G = _empty(S, D, D, **f32)
        s = _empty(S, D, **f32)
        nr = _empty(2, S, dtype=torch.int64, device=dev)
        BR = min(FINISH_BR, max(16, triton.next_power_of_2(D)))
        nt = triton.cdiv(D, BR)
        _finish_kernel[(nt * nt, S)](G_ws, s_ws, cnt, status, G, s, c, nr, S, D, N, cfg.split,
                                     FROM_STATUS=not fused, ZERO_C=not center, BR=BR, BK=FINISH_BK,
                                     BN=FINISH_BN, num_warps=4)
    return CovPartials(nr[0], c, s, G, nr[1])


# --- which settings serve: first-use self-checks ---------------------------------------------------

REFERENCE = "reference"
"""What :func:`serving` answers where no Triton configuration may serve: the torch path
(``blocked.py``, float32 products) takes the update."""

_serving: dict[tuple, TritonConfig | None | str] = {}
_broken: dict[tuple, str] = {}  # (device, dtype, D, center, candidate name) -> why it could not be built


def _label(D: int, dtype: torch.dtype, candidate: TritonConfig | None) -> str:
    if candidate is not None:
        return f"the {candidate.kernel} kernel, candidate {candidate.name}"
    return "the fused-row kernel" if D <= 128 else "the tiled kernel"


def serving(x: Tensor, center: bool) -> TritonConfig | None | str:
    """The launch settings a float32 update of ``x: [B, T, S, D]`` runs on its device, each
    configuration (kernel × candidate × dtype × convention × D) checked at its first use
    (:mod:`fastspec.selfcheck`): a candidate of :mod:`.triton_configs` (16-bit input, ``D > 64``:
    the one :func:`~.triton_configs.choose` picks, else the next that passes), None (the fixed
    settings of fp32 input or ``D <= 64``; float64 input, which the launcher hands to the
    reference), or :data:`REFERENCE` (nothing passed or built: the torch path serves). A forced
    candidate (``$FASTSPEC_COV_TRITON_CONFIG``) that fails raises. Cached per device, dtype, D,
    convention and the variable, once its check has run."""
    from .. import selfcheck

    forced = os.environ.get(ENV, "").strip()
    key = (x.device, x.dtype, x.shape[-1], bool(center), forced)
    got = _serving.get(key, _serving)
    if got is not _serving:
        return got
    D, dtype = x.shape[-1], x.dtype
    if dtype == torch.float64:
        _serving[key] = None
        return None
    kernel = kernel_of(D) if dtype in (torch.bfloat16, torch.float16) else None
    if kernel is None:
        options: list[TritonConfig | None] = [None]
    else:
        first, _ = choose(kernel, arch_of(x.device), dtype, bool(center))
        options = [first] if forced else [first, *(c for c in CANDIDATES[kernel] if c != first)]
    settled = True
    for cand in options:
        name = "fixed" if cand is None else cand.name
        if (x.device, dtype, D, bool(center), name) in _broken:
            continue
        try:
            verdict = _self_check(x.device, dtype, D, bool(center), cand)
        except Exception as exc:
            if forced or not selfcheck.is_build_failure(exc):
                raise
            mark_broken(x, center, cand, str(exc))
            continue
        if verdict is False:
            if forced:
                raise RuntimeError(f"${ENV}={forced}: the candidate failed its self-check here (see the warning)")
            continue
        if verdict is None:
            settled = False
        if settled:
            _serving[key] = cand
        return cand
    _serving[key] = REFERENCE
    return REFERENCE


def _self_check(device: torch.device, dtype: torch.dtype, D: int, center: bool,
                candidate: TritonConfig | None) -> bool | None:
    """One configuration's first-use self-check: the adversarial rows of
    :func:`fastspec.selfcheck.rows` through :func:`covariance_partials_triton` with these settings,
    against float64 (within 4x torch float32's own error)."""
    from .. import selfcheck

    if not selfcheck.applies(device):
        return True

    def case() -> str:
        for x, mask in selfcheck.rows(D, dtype, device):
            why = selfcheck.compare_fast(covariance_partials_triton(x, mask, 1, center, candidate=candidate),
                                         x, mask, center)
            if why:
                return why
        return ""

    name = "fixed" if candidate is None else candidate.name
    conv = "centred" if center else "raw sums"
    return selfcheck.run(("triton", name, device, dtype, D, center), f"the float32 Triton update ({_label(D, dtype, candidate)})",
                         f"{str(dtype).removeprefix('torch.')} D={D} {conv}", device, case,
                         "the next candidate" if candidate is not None else "the torch path")


def mark_broken(x: Tensor, center: bool, candidate: TritonConfig | None, why: str) -> None:
    """``candidate``'s kernel could not be built for an update of ``x`` (at its self-check, or for
    this call's own specialization of shapes and strides): not used again on this device for
    this dtype, D and convention; :func:`serving` decides anew. Said once."""
    import logging

    name = "fixed" if candidate is None else candidate.name
    _broken[x.device, x.dtype, x.shape[-1], bool(center), name] = why
    for key in [k for k in _serving if k[:4] == (x.device, x.dtype, x.shape[-1], bool(center))]:
        del _serving[key]
    logging.getLogger("fastspec").warning("fastspec: %s of the float32 Triton update could not be built on %s (%s); "
                                          "the next settings serve", _label(x.shape[-1], x.dtype, candidate), x.device,
                                          why)


def forget() -> None:
    """Drop what :func:`serving` decided and the settings that failed to build (tests)."""
    _serving.clear()
    _broken.clear()
