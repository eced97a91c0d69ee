"""Two exact float64 candidates for the raw ("keys", ``sv``) covariance update, in Triton.

Both compute, for ``x: [B, T, S, D]`` (bf16/fp16/fp32/fp64, any strides, never copied),
``mask: [B, T]`` bool (or int, or None) and ``row_step = k`` (rows ``t = 0, k, 2k, ...``), the
partials about 0 (``c = 0``) of :class:`~fastspec.covariance.reference.CovPartials`::

    keep[b, t]     = mask[b, t]                       (True without a mask)
    valid[b, t, s] = keep[b, t] and all(isfinite(x[b, t, s, :]))
    n[s]           = Σ valid                               [S]        int64
    rejected[s]    = Σ keep and not valid                  [S]        int64
    s[s]           = Σ_valid x[b, t, s, :]                 [S, D]     float64
    G[s]           = Σ_valid x xᵀ                          [S, D, D]  float64, exactly symmetric
    c[s]           = 0                                     [S, D]     float64

Every product is formed in float64, where the product of two 16-bit (11/8 significant bits) or
two float32 (24 bits) values is exact (<= 48 bits of a 53-bit significand), and every sum runs in
float64: the only rounding is that of the float64 additions. This is the precision of today's
exact route (:mod:`fastspec.covariance.blocked` with float64 products), without its ~60 launches
per update (807 µs of device time on an H100 for ``[8, 2048, 8, 128]`` bf16, where its GEMM
alone is ~62 µs). Both are bit-for-bit deterministic run to run (fixed splits chosen from the
shapes alone, fixed-order reductions, no float atomics), never sync with the host, loop over no
heads in Python, and keep their large buffers in the thread's
:func:`~fastspec.covariance.blocked.shared_workspace` (fresh ones while a CUDA graph is being
captured, so a graph never shares memory with later eager calls).

Candidates
----------
1. **prep_gemm** (:func:`partials_prep_gemm`): ``_prep_rows_kernel`` reads every row once and
   writes it as float64 into ``rows64 [S, Nc, D]`` (rows that are masked out or hold a NaN/±Inf
   as zeros), with per-program row sums ``[K, S, D]`` float64 and counts ``[2, K, S]`` int32;
   then ONE batched float64 GEMM for all heads, ``torch.bmm(rows64ᵀ, rows64)`` (cuBLAS DGEMM,
   DMMA on sm_80+); then ``_finish_kernel`` sums the partials in a fixed order and mirrors the
   lower triangle of the GEMM's output onto the upper one. The GEMM's ``G[i, j]`` and ``G[j, i]``
   are two independently rounded sums (cuBLAS promises no symmetry), so one of them is taken
   for both: a copy, no extra rounding, done while the output is written anyway (no separate
   ``tril``/``where`` pass). rows64 is bounded by :data:`CHUNK_ELEMS` (2^24 elements, 128 MiB);
   longer updates loop in Python over row chunks (prep, then ``baddbmm`` into the same Gram),
   one chunk for the target shapes. **Launches: 2 per chunk + 1** (3 for the target shapes).
2. **triton_f64** (:func:`partials_triton_f64`): ``_gram_f64_kernel`` loads 16/32-bit row tiles,
   widens them to float64 in registers and accumulates ``tl.dot(aᵀ, a, out_dtype=float64)``
   (DMMA on sm_80+, compiled by Triton >= 3.9), with row sums and NaN/±Inf row flags in the
   same pass; grid ``(S, SPLIT)``. ``D <= 128`` is split in two column halves of ``BC = 64``,
   and a program holds the three 64² tiles of the lower triangle (``a0ᵀa0``, ``a1ᵀa0``,
   ``a1ᵀa1``): 3/4 of the products of one 128² dot, every element loaded and widened once.
   Partials ``[SPLIT, S, D, D]`` (lower tiles written, the upper one never) are summed in a
   fixed order and mirrored by the same ``_finish_kernel``. ``D > 128`` (outside the keys
   envelope) goes to ``_gram_f64_tiled_kernel``, one 64² lower tile per program. **Launches:
   2.** Triton 3.6 (the GPU machines' version) aborts the process compiling this dot;
   :func:`triton_f64_status` decides from the installed version, without compiling anything.

Design envelope (target: keys ``[B=8, T=2048, S=8, D=128]`` bf16, N = 16384 rows per head; also
``B = 4``, N = 8192). Registers/instructions: compiled for sm_90 by Triton 3.9 without a GPU,
with the specialization of a contiguous input (``test_kernels_compile_for_sm90_without_a_gpu``)
------------------------------------------------------------------------------------------------
* ``_prep_rows_kernel``: grid ``(cdiv(Nc, 256), S)`` = (64, 8) = 512 programs of 256 rows,
  whole rows in one ``[BT, BD]`` tile (``BD = next_pow2(D)``, ``BT = 4096 // BD``: 32 rows at
  ``D = 128``), 8 warps: 128 registers (two programs per SM), no spills, 378 instructions per
  32-row block per warp, 16 float64 widenings per thread. x read once (33.6 MB), rows64 written
  once (``S·N·D·8`` = 134 MB), partial sums 0.5 MB. No spills up to ``D = 4096``.
* ``_gram_f64_kernel`` (D = 128): ``BT = 16`` rows per block, 8 warps, 244 registers (one
  program per SM), no spills; per block and warp 96 DMMA (m8n8k4) in 417 instructions, i.e.
  the issue slots (4.3 per DMMA) stay under the DMMA pipe's 8 cycles per instruction. The next
  block's raw tiles are loaded into registers before this block's dots (Triton does not
  software-pipeline a load that is widened before its dot; ``num_stages=1``). ``SPLIT =
  clamp(cdiv(128, S), 1, cdiv(N, 256))`` (shape-only: one wave of ~128 programs on a 132-SM
  H100/H200): 16 at the target, grid (8, 16) = 128 programs of 1024 rows (512 at ``B = 4``).
  Partials ``16·8·128²·8`` = 16.8 MB allocated, 12.6 MB written (L2-resident until the finish).
  ``D <= 64``: one 64² accumulator, 32-row blocks, 4 warps: 168 registers, 128 DMMA in 609
  instructions per block and warp, ~384 programs.
* ``_finish_kernel``: grid ``(lower 32² tiles, S)`` = (10, 8) at ``D = 128``, 64 registers;
  four splits of G loaded per iteration (added in split order), the sums' splits in blocks of
  :data:`FINISH_BK`.

Cost model: a PREDICTION for an H100 SXM (3.35 TB/s HBM, ~3.0 TB/s reached by streaming
kernels; ~67 TFLOP/s float64 tensor-core peak = 256 flop/clk/SM at 1.98 GHz, i.e. one 512-flop
DMMA per SM every 2 cycles; cuBLAS DGEMM measured ~35 TFLOP/s), not a measurement: nothing here
has run on a GPU.

* prep_gemm, B = 8: prep 33.6 MB read + 134 MB written = 168 MB / 3.0 TB/s ≈ 56 µs (issue:
  512 · 8 blocks · 8 warps · 378 / (132 · 4) ≈ 23 k cycles ≈ 12 µs: memory bound); GEMM
  ``2·N·D²·S`` = 4.3 GFLOP / 35 TFLOP/s ≈ 123 µs (its 134 MB read as both operands, ≤ 90 µs,
  overlaps); finish ≈ 3 µs; total ≈ 182 µs (B = 4: 28 + 61 + 3 ≈ 92 µs), against 807 µs today.
* triton_f64, B = 8: per program 64 blocks × 768 DMMA = 49 k DMMA at 0.5 per cycle = 98 k
  cycles = 50 µs at 1.98 GHz (``3·2·N·64²·S`` = 3.2 GFLOP on 128 of 132 SMs at peak); x's
  33.6 MB over that time is 0.7 TB/s; epilogue (three 32 KB tiles per program) ~1 µs; finish
  (10.5 MB of partials from L2, 4 loads in flight per program) ≈ 4 µs: total ≈ 55 µs at DMMA
  peak, ≈ 66 µs if the DMMA pipe runs at 80 % (its operands come from shared memory: 72 LDS
  per 96 DMMA per warp, ~75 % of the SM's shared-memory bandwidth). B = 4: ≈ 29-35 µs.
  The largest unknown: Triton 3.9 emits ``mma.sync`` m8n8k4 (``DMMA.8x8x4``, the A100 shape);
  if Hopper reaches its float64 peak only with its own m16n8k{4,8,16} shapes (what Triton 3.6
  emits, ``DMMA.16x8x16``, and what cuBLAS uses), this kernel runs at half rate: ≈ 105 µs.

Triton 3.6, compiled in a subprocess (not in-process: see :func:`triton_f64_status`): this
``_gram_f64_kernel`` did not abort there, but spilled (16-row blocks: 255 registers, a 248-byte
stack, 151 spill instructions; 32-row blocks: a 2.8 KB stack); never run, so never checked on a
GPU. The status function refuses every version below 3.9.
"""
from __future__ import annotations

import functools
import os
import re
from contextlib import nullcontext
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_compat import fix_interpreter_index
from .blocked import Workspace, shared_workspace
from .reference import CovPartials
from .triton_kernels import _lower_pair, _row_keep, _row_offsets, _split_counts
from .triton_update import check_args

__all__ = ["CHUNK_ELEMS", "Totals", "accumulate_prep_gemm", "accumulate_triton_f64", "partials_prep_gemm",
           "partials_triton_f64", "prep_gemm_status", "triton_f64_status"]

# triton.jit reads TRITON_INTERPRET when the kernels are decorated (import time), so do we
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if _INTERPRET:
    fix_interpreter_index()  # runtime-bound range() loops on Triton 3.6 + numpy >= 2.4

CHUNK_ELEMS = 1 << 24
"""Elements of prep_gemm's float64 row buffer (128 MiB): ``[8, 2048, 8, 128]`` is one chunk."""

PREP_ROWS = 256
"""Rows per prep program: 512 programs at the target (~2 waves of 2 resident programs per SM:
enough loads in flight for a streaming kernel), partial sums 1/64 of the rows."""

F64_PROGRAMS = 128
"""Programs triton_f64 aims for per resident program per SM (one wave on a 132-SM H100/H200):
chosen from the shapes alone, so the summation order is the same on every GPU."""

F64_BC = 64  # column tile of triton_f64: D = 128 is two tiles, three 64² accumulators
F64_MIN_ROWS = 256  # fewest rows per triton_f64 program (short updates: fewer, fuller programs)
FINISH_BR = 32  # tile of the finish kernel: 10 tiles per head at D = 128
FINISH_BK = 64  # splits of the row sums per finish step: prep_gemm's 64 at the target in one

# every buffer goes through this (tests swap in a NaN-filling one, so a kernel that leaves part
# of what is read later unwritten fails loudly)
_empty = torch.empty

_TRITON_36_REASON = ("Triton 3.6's fp64 dot lowering aborts on widened 16-bit operands "
                     "(fixed upstream in triton-lang/triton PR 11664)")
_F64_DOT_FROM = (3, 9)  # the first version where the kernel was compiled into DMMA and checked


# ----------------------------------------------------------------------------------- kernels
@triton.jit
def _nonfinite_f64(b_x):
    """Per row of a float64 tile, how many values are NaN/±Inf (x − x is NaN exactly for those).

    In float64, not float32 (``triton_kernels._nonfinite``): a finite float64 value above
    3.4e38 would become Inf in float32 and its row would be rejected."""
    return tl.sum(((b_x - b_x) != 0).to(tl.int32), axis=1)


@triton.jit
def _prep_rows_kernel(
    p_x, p_mask, p_rows, p_sp, p_cnt,
    R0, NC, Tk, D, S, KS, K0, RPP,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt, ROW_STEP,
    HAS_MASK: tl.constexpr, ROWS64: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """prep_gemm's one pass over the rows of a chunk: float64 rows, row sums and counts.

    Program (i_k, i_s) takes the chunk's rows l in [i_k·RPP, min((i_k+1)·RPP, NC)), i.e. the
    sampled rows r = R0 + l (x[b, t] with b = r // Tk, t = (r % Tk)·ROW_STEP), of site i_s:

        rows[i_s, l, :]         = x[b, t, i_s, :] as float64 if valid else 0     [NC, D] per site
        sp[K0 + i_k, i_s, :]    = Σ_l rows[i_s, l, :]                              float64
        cnt[0, K0 + i_k, i_s]   = Σ_l valid,  cnt[1, K0 + i_k, i_s] = Σ_l keep and not valid

    Whole rows in one ``[BT, BD]`` tile (BD >= D), so the finiteness test costs no second read.
    The sums are kept per row slot (``[BT, BD]``) and reduced once after the loop: nothing
    crosses threads inside it.
    """
    i_k, i_s = tl.program_id(0), tl.program_id(1)
    zero = i_s.to(tl.int64) * 0
    # int64 strides: the row index stays int32 (a cheap division) while its products with the
    # strides are int64 (a [B, T] view of a long tensor can pass 2^31 elements)
    sxb, sxt = zero + stride_xb, zero + stride_xt
    smb, smt = zero + stride_mb, zero + stride_mt
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_xd = o_d.to(tl.int64) * stride_xd
    p_xs = p_x + i_s.to(tl.int64) * stride_xs
    p_out = p_rows + i_s.to(tl.int64) * NC * D
    lo = i_k * RPP  # < NC + RPP: a chunk holds at most ~CHUNK_ELEMS rows, int32 is enough
    hi = tl.minimum(lo + RPP, NC)
    b_S = tl.zeros([BT, BD], dtype=tl.float64)
    b_n = tl.zeros([BT], dtype=tl.int32)
    b_rej = tl.zeros([BT], dtype=tl.int32)
    for l0 in range(lo, hi, BT):
        o_l = l0 + tl.arange(0, BT)
        m_r = o_l < hi
        o_r = o_l.to(tl.int64) + R0 if ROWS64 else o_l + R0
        o_b, o_t, o_row = _row_offsets(o_r, Tk, ROW_STEP, sxb, sxt)
        keep = _row_keep(p_mask, o_b, o_t, m_r, smb, smt, HAS_MASK)
        # not masked by ``keep``: the x load does not wait for the mask load (padding is
        # zeroed by the select below, whatever it holds)
        b_x = tl.load(p_xs + o_row[:, None] + p_xd[None, :], mask=m_r[:, None] & m_d[None, :], other=0)
        b_x = b_x.to(tl.float64)  # exact for every input dtype
        ok = _nonfinite_f64(b_x) == 0
        valid = keep & ok
        # tl.where, not a product: NaN·0 is NaN
        b_a = tl.where(valid[:, None], b_x, 0.0)
        tl.store(p_out + o_l[:, None].to(tl.int64) * D + o_d[None, :], b_a, mask=m_r[:, None] & m_d[None, :])
        b_S += b_a
        b_n += valid.to(tl.int32)
        b_rej += (keep & ~ok).to(tl.int32)
    o_k = K0 + i_k
    tl.store(p_sp + (o_k * S + i_s).to(tl.int64) * D + o_d, tl.sum(b_S, axis=0), mask=m_d)
    tl.store(p_cnt + o_k * S + i_s, tl.sum(b_n, axis=0))
    tl.store(p_cnt + (KS + o_k) * S + i_s, tl.sum(b_rej, axis=0))


@triton.jit
def _load_raw(p_row, o_c, D, stride_xd, rows):
    """``[BT, BC]`` tile of columns ``o_c`` of the rows ``p_row`` with ``rows`` True, in the
    input dtype (0 elsewhere)."""
    return tl.load(p_row[:, None] + o_c[None, :].to(tl.int64) * stride_xd,
                   mask=rows[:, None] & (o_c < D)[None, :], other=0)


@triton.jit
def _block_rows(p_xs, p_mask, r0, hi, Tk, ROW_STEP, sxb, sxt, smb, smt,
                HAS_MASK: tl.constexpr, BT: tl.constexpr):
    """Row pointers ``[BT]``, rows in range, and kept rows of the block starting at row r0."""
    o_r = r0 + tl.arange(0, BT)
    m_r = o_r < hi
    o_b, o_t, o_row = _row_offsets(o_r, Tk, ROW_STEP, sxb, sxt)
    keep = _row_keep(p_mask, o_b, o_t, m_r, smb, smt, HAS_MASK)
    return p_xs + o_row, m_r, keep


@triton.jit
def _gram_f64_kernel(
    p_x, p_mask, p_Gp, p_sp, p_cnt,
    N, Tk, D, S, RPS, KS,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt, ROW_STEP,
    HAS_MASK: tl.constexpr, ROWS64: tl.constexpr, HALVES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """triton_f64, ``D <= 2·BC``: the whole lower triangle of G of site i_s over row split i_k.

    Over the sampled rows r in [i_k·RPS, min((i_k+1)·RPS, N)), with ``a0``/``a1`` the float64
    ``[BT, BC]`` tiles of columns ``[0, BC)`` / ``[BC, 2·BC)`` (0 in rows that are not valid and
    in columns >= D; ``a1`` only when ``HALVES == 2``):

        Gp[i_k, i_s, :BC, :BC]   = Σ a0ᵀ a0        Gp[i_k, i_s, BC:, :BC] = Σ a1ᵀ a0
        Gp[i_k, i_s, BC:, BC:]   = Σ a1ᵀ a1        (the upper tile [:BC, BC:] is never written)
        sp[i_k, i_s, :]          = Σ_rows [a0, a1]
        cnt[0 / 1, i_k, i_s]     = valid / rejected rows

    Three 64² dots instead of one 128² at ``D = 128`` (3/4 of the matrix products), every
    element loaded and widened once. Rows are read unmasked by ``mask`` (padding is zeroed by a
    select, never multiplied), so a block's x load does not wait for its mask load; and the next
    block's raw tiles are loaded before this block's dots (a register prefetch: Triton does not
    software-pipeline a load that is widened before its dot), so their latency hides behind
    the matrix instructions.
    """
    i_s, i_k = tl.program_id(0), tl.program_id(1)
    zero = i_s.to(tl.int64) * 0
    sxb, sxt = zero + stride_xb, zero + stride_xt
    smb, smt = zero + stride_mb, zero + stride_mt
    o_j = tl.arange(0, BC)
    p_xs = p_x + i_s.to(tl.int64) * stride_xs
    lo = i_k.to(tl.int64) * RPS if ROWS64 else i_k * RPS
    hi = tl.minimum(lo + RPS, N)
    b_00 = tl.zeros([BC, BC], dtype=tl.float64)
    b_10 = tl.zeros([BC, BC], dtype=tl.float64)
    b_11 = tl.zeros([BC, BC], dtype=tl.float64)
    b_S0 = tl.zeros([BT, BC], dtype=tl.float64)  # Σ per row slot: reduced once, after the loop
    b_S1 = tl.zeros([BT, BC], dtype=tl.float64)
    b_n = tl.zeros([BT], dtype=tl.int32)
    b_rej = tl.zeros([BT], dtype=tl.int32)
    p_row, m_r, keep = _block_rows(p_xs, p_mask, lo, hi, Tk, ROW_STEP, sxb, sxt, smb, smt, HAS_MASK, BT)
    b_x0 = _load_raw(p_row, o_j, D, stride_xd, m_r)
    b_x1 = _load_raw(p_row, BC + o_j, D, stride_xd, m_r) if HALVES == 2 else b_x0
    for r0 in range(lo, hi, BT):
        b_h0 = b_x0.to(tl.float64)  # exact for every input dtype
        b_h1 = b_x1.to(tl.float64)
        keep_c = keep
        # prefetch the next block (rows past hi are masked: the last one loads nothing)
        p_row, m_r, keep = _block_rows(p_xs, p_mask, r0 + BT, hi, Tk, ROW_STEP, sxb, sxt, smb, smt, HAS_MASK, BT)
        b_x0 = _load_raw(p_row, o_j, D, stride_xd, m_r)
        if HALVES == 2:
            b_x1 = _load_raw(p_row, BC + o_j, D, stride_xd, m_r)
        b_bad = _nonfinite_f64(b_h0)
        if HALVES == 2:
            b_bad += _nonfinite_f64(b_h1)
        ok = b_bad == 0
        valid = keep_c & ok
        # tl.where, not a product: NaN·0 is NaN (and masked-out padding may hold anything)
        b_a0 = tl.where(valid[:, None], b_h0, 0.0)
        # float64 operands and accumulator: exact products, float64 sums (DMMA on sm_80+)
        b_00 = tl.dot(tl.trans(b_a0), b_a0, b_00, out_dtype=tl.float64)
        b_S0 += b_a0  # elementwise: no cross-thread reduction in the loop
        if HALVES == 2:
            b_a1 = tl.where(valid[:, None], b_h1, 0.0)
            b_10 = tl.dot(tl.trans(b_a1), b_a0, b_10, out_dtype=tl.float64)
            b_11 = tl.dot(tl.trans(b_a1), b_a1, b_11, out_dtype=tl.float64)
            b_S1 += b_a1
        b_n += valid.to(tl.int32)
        b_rej += (keep_c & ~ok).to(tl.int32)
    o_out = (i_k * S + i_s).to(tl.int64) * D
    m_0 = o_j < D
    p_G = p_Gp + o_out * D
    tl.store(p_G + o_j[:, None] * D + o_j[None, :], b_00, mask=m_0[:, None] & m_0[None, :])
    tl.store(p_sp + o_out + o_j, tl.sum(b_S0, axis=0), mask=m_0)
    if HALVES == 2:
        o_1 = BC + o_j
        m_1 = o_1 < D
        tl.store(p_G + o_1[:, None] * D + o_j[None, :], b_10, mask=m_1[:, None] & m_0[None, :])
        tl.store(p_G + o_1[:, None] * D + o_1[None, :], b_11, mask=m_1[:, None] & m_1[None, :])
        tl.store(p_sp + o_out + o_1, tl.sum(b_S1, axis=0), mask=m_1)
    tl.store(p_cnt + i_k * S + i_s, tl.sum(b_n, axis=0))
    tl.store(p_cnt + (KS + i_k) * S + i_s, tl.sum(b_rej, axis=0))


@triton.jit
def _gram_f64_tiled_kernel(
    p_x, p_mask, p_Gp, p_sp, p_cnt,
    N, Tk, D, S, RPS, KS,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt, ROW_STEP,
    HAS_MASK: tl.constexpr, ROWS64: tl.constexpr, NT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """triton_f64, ``D > 2·BC`` (outside the keys envelope): one lower-triangle tile (i_r, i_c)
    of G, site i_s, row split i_k; grid (NT(NT+1)/2, S, SPLIT).

        Gp[i_k, i_s, tile (i_r, i_c)] = Σ a_rᵀ a_c    (a_r, a_c: float64 [BT, BC] column tiles)
        sp[i_k, i_s, cols of i_r]     = Σ_rows a_r    (diagonal tiles store it)
        cnt[0 / 1, i_k, i_s]          = valid / rejected rows   (tile 0 stores them)

    The finiteness test needs the whole row: a loop over its NT column tiles counts the
    non-finite values first (a re-read of the row per tile pair, mostly from L1/L2).
    """
    i_p, i_s, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_c = _lower_pair(i_p)
    zero = i_s.to(tl.int64) * 0
    sxb, sxt = zero + stride_xb, zero + stride_xt
    smb, smt = zero + stride_mb, zero + stride_mt
    o_j = tl.arange(0, BC)
    o_cr = i_r * BC + o_j
    o_cc = i_c * BC + o_j
    p_xs = p_x + i_s.to(tl.int64) * stride_xs
    lo = i_k.to(tl.int64) * RPS if ROWS64 else i_k * RPS
    hi = tl.minimum(lo + RPS, N)
    b_G = tl.zeros([BC, BC], dtype=tl.float64)
    b_S = tl.zeros([BT, BC], dtype=tl.float64)
    b_n = tl.zeros([BT], dtype=tl.int32)
    b_rej = tl.zeros([BT], dtype=tl.int32)
    for r0 in range(lo, hi, BT):
        p_row, _, keep = _block_rows(p_xs, p_mask, r0, hi, Tk, ROW_STEP, sxb, sxt, smb, smt, HAS_MASK, BT)
        b_bad = tl.zeros([BT], dtype=tl.int32)
        for i_t in range(NT):
            b_bad += _nonfinite_f64(_load_raw(p_row, i_t * BC + o_j, D, stride_xd, keep).to(tl.float64))
        ok = b_bad == 0
        valid = keep & ok
        b_ar = _load_raw(p_row, o_cr, D, stride_xd, valid).to(tl.float64)
        b_ac = _load_raw(p_row, o_cc, D, stride_xd, valid).to(tl.float64)
        b_G = tl.dot(tl.trans(b_ar), b_ac, b_G, out_dtype=tl.float64)
        b_S += b_ar
        b_n += valid.to(tl.int32)
        b_rej += (keep & ~ok).to(tl.int32)
    o_out = (i_k * S + i_s).to(tl.int64) * D
    m_cr, m_cc = o_cr < D, o_cc < D
    tl.store(p_Gp + (o_out + o_cr[:, None]) * D + o_cc[None, :], b_G, mask=m_cr[:, None] & m_cc[None, :])
    if i_r == i_c:
        tl.store(p_sp + o_out + o_cr, tl.sum(b_S, axis=0), mask=m_cr)
    if i_p == 0:
        tl.store(p_cnt + i_k * S + i_s, tl.sum(b_n, axis=0))
        tl.store(p_cnt + (KS + i_k) * S + i_s, tl.sum(b_rej, axis=0))


@triton.jit
def _finish_kernel(
    p_Gp, p_sp, p_cnt, p_G, p_s, p_c, p_n, p_rej,
    S, D, KG, KS,
    BR: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
):
    """Fixed-order sums of the partials, and the exactly symmetric G (both candidates).

    Program (i_p, i_s) owns the lower-triangle tile (i_r, i_c) of ``BR × BR`` of site i_s:

        G[i_s, tile]   = (((Gp[0] + Gp[1]) + Gp[2]) + ...)[i_s, tile]   (only lower tiles read)
        G[i_s, tileᵀ]  = its transpose; on a diagonal tile, G[i, j] = G[j, i] = the i >= j entry
        s[i_s, cols]   = Σ_{k < KS} sp[k, i_s, cols],  c[i_s, cols] = 0     (diagonal tiles)
        n / rej[i_s]   = Σ_k cnt[0 / 1, k, i_s]                         (tile 0), int64

    ``ACC``: ``G``, ``s``, ``n`` and ``rej`` are an accumulator's totals (``gram``, ``sum``,
    ``n``, ``rejected``), and the update's sums are *added* to them in place (``c`` is not
    written): ``total + Σ_k partial_k``, the same additions :func:`~fastspec.covariance.ops.merge_sums`
    makes, so the totals are bitwise those of partials then merge, without the merge's launches.
    The lower tile of the total is added first and then mirrored, so the total stays exactly
    symmetric.

    The G loop adds four splits per iteration, in order (same sums as one at a time, four
    loads in flight); the sums of ``sp`` go through ``[BK, BR]`` blocks and ``tl.sum`` (a fixed
    reduction tree of the compiled kernel), so prep_gemm's 64 splits are one round trip.
    """
    i_p, i_s = tl.program_id(0), tl.program_id(1)
    i_r, i_c = _lower_pair(i_p)
    zero = i_s.to(tl.int64) * 0
    D64 = zero + D
    DD = D64 * D
    o_i = tl.arange(0, BR)
    o_r, o_c = i_r * BR + o_i, i_c * BR + o_i
    m_r, m_c = o_r < D, o_c < D
    o_tile = o_r[:, None].to(tl.int64) * D + o_c[None, :]
    m = m_r[:, None] & m_c[None, :]
    p_tile = p_Gp + i_s * DD + o_tile
    b_G = tl.zeros([BR, BR], dtype=tl.float64)
    o_k0 = o_i[:, None] * 0  # a [BR, 1] zero: the split index as a tensor, for the masks
    for k in range(0, KG, 4):
        b_g0 = tl.load(p_tile + k * S * DD, mask=m, other=0.0)
        b_g1 = tl.load(p_tile + (k + 1) * S * DD, mask=m & (o_k0 + k + 1 < KG), other=0.0)
        b_g2 = tl.load(p_tile + (k + 2) * S * DD, mask=m & (o_k0 + k + 2 < KG), other=0.0)
        b_g3 = tl.load(p_tile + (k + 3) * S * DD, mask=m & (o_k0 + k + 3 < KG), other=0.0)
        b_G = (((b_G + b_g0) + b_g1) + b_g2) + b_g3
    p_Gs = p_G + i_s * DD
    if ACC:
        b_G = tl.load(p_Gs + o_tile, mask=m, other=0.0) + b_G
    if i_r == i_c:
        # each of G[i, j] and G[j, i] is a correctly summed float64 value; take the lower one
        # for both (a copy: no rounding added, bitwise symmetric)
        b_G = tl.where(o_i[:, None] >= o_i[None, :], b_G, tl.trans(b_G))
        tl.store(p_Gs + o_tile, b_G, mask=m)
        o_k = tl.arange(0, BK)
        b_s = tl.zeros([BR], dtype=tl.float64)
        for k0 in range(0, KS, BK):
            m_k = (k0 + o_k) < KS
            b_sk = tl.load(p_sp + ((k0 + o_k)[:, None] * S + i_s) * D64 + o_r[None, :],
                           mask=m_k[:, None] & m_r[None, :], other=0.0)
            b_s += tl.sum(b_sk, axis=0)
        if ACC:
            b_s = tl.load(p_s + i_s * D64 + o_r, mask=m_r, other=0.0) + b_s
        else:
            tl.store(p_c + i_s * D64 + o_r, tl.zeros([BR], dtype=tl.float64), mask=m_r)
        tl.store(p_s + i_s * D64 + o_r, b_s, mask=m_r)
        if i_p == 0:
            b_n1, b_rej1 = _split_counts(p_cnt, S, i_s, KS, BK)
            if ACC:
                b_n1 += tl.load(p_n + i_s)
                b_rej1 += tl.load(p_rej + i_s)
            tl.store(p_n + i_s, b_n1)
            tl.store(p_rej + i_s, b_rej1)
    else:
        tl.store(p_Gs + o_tile, b_G, mask=m)
        tl.store(p_Gs + o_c[:, None].to(tl.int64) * D + o_r[None, :], tl.trans(b_G), mask=m_c[:, None] & m_r[None, :])


# --------------------------------------------------------------------------------- launchers
def _interpreting() -> bool:
    return _INTERPRET


def _cuda_reason(device: torch.device, what: str) -> str:
    if device.type == "cuda" or _interpreting():
        return ""
    return (f"{what} needs a CUDA tensor (or TRITON_INTERPRET=1 set before importing triton, "
            f"for CPU tests), got a {device.type} tensor")


@functools.cache
def _f64_dot_reason(version: str) -> str:
    """Why this Triton version cannot compile the float64 dot of widened 16-bit tiles ("" if it
    can). Decided from the version string alone: on 3.6 the compile itself aborts the process,
    so trying it in-process is not an option."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return f"Triton {version!r}: unknown version; the fp64 dot kernel is verified from Triton 3.9"
    major_minor = (int(m.group(1)), int(m.group(2)))
    if major_minor == (3, 6):
        return _TRITON_36_REASON
    if major_minor < _F64_DOT_FROM:
        return (f"Triton {version}: fp64 dots of widened 16-bit operands are verified from Triton 3.9 "
                f"(3.6 aborts compiling them)")
    return ""


def prep_gemm_status(device) -> str:
    """"" if :func:`partials_prep_gemm` runs on ``device`` (CUDA, or any tensor under the
    interpreter), else a one-line reason."""
    return _cuda_reason(torch.device(device), "prep_gemm")


def triton_f64_status(device) -> str:
    """"" if :func:`partials_triton_f64` runs on ``device``, else a one-line reason.

    Compiled (CUDA): from the installed Triton version (cached per version string), never by
    compiling: Triton 3.6 dies compiling the kernel. Under the interpreter the dot is numpy's
    and any version runs it."""
    reason = _cuda_reason(torch.device(device), "triton_f64")
    if reason or _interpreting():
        return reason
    return _f64_dot_reason(triton.__version__)


def _check(x: Tensor, mask: Tensor | None, row_step: int, status) -> int:
    """Raise on bad arguments or an unusable device; ``row_step`` as an int (a constexpr)."""
    row_step = check_args(x, mask, row_step)
    reason = status(x.device)
    if reason:
        raise RuntimeError(reason)
    return row_step


def _workspace(x: Tensor) -> Workspace | None:
    """The thread's shared workspace, or None (fresh buffers) while a CUDA graph is captured:
    a captured graph keeps its addresses, which later eager calls must not overwrite."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return shared_workspace()


def _buffer(ws: Workspace | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> Tensor:
    if ws is None:
        return _empty(shape, dtype=dtype, device=device)
    return ws.get("triton_exact." + name, shape, dtype, device)


def _mask_args(x: Tensor, mask: Tensor | None):
    """(mask as uint8 bytes, stride_b, stride_t); ``x`` as a never-read stand-in without one."""
    if mask is None:
        return x, 0, 0
    mask = mask if mask.dtype == torch.bool else mask != 0
    mask = mask.to(x.device).view(torch.uint8)  # same bytes; triton loads bool pointers unevenly
    return mask, mask.stride(0), mask.stride(1)


def _zeros(S: int, D: int, device: torch.device) -> CovPartials:
    f64 = {"dtype": torch.float64, "device": device}
    z = torch.zeros(S, dtype=torch.int64, device=device)
    return CovPartials(z, torch.zeros(S, D, **f64), torch.zeros(S, D, **f64), torch.zeros(S, D, D, **f64), z.clone())


Totals = tuple[Tensor, Tensor, Tensor, Tensor]
"""An accumulator's raw-sum totals ``(n [S] int64, rejected [S] int64, sum [S, D] float64,
gram [S, D, D] float64)``, contiguous, on the data's device: what the ``accumulate_*`` functions
add an update into."""


def _finish(Gp: Tensor, sp: Tensor, cnt: Tensor, S: int, D: int, into: Totals | None = None) -> CovPartials | None:
    """One launch: ``Gp [KG, S, D, D]`` (lower tiles read), ``sp [KS, S, D]``, ``cnt [2, KS, S]``
    -> fresh outputs (not workspace views: a caller may keep them across updates), or, with
    ``into``, added to those totals in place (returns None)."""
    dev = Gp.device
    f64 = {"dtype": torch.float64, "device": dev}
    if into is None:
        G = _empty((S, D, D), **f64)
        s = _empty((S, D), **f64)
        c = _empty((S, D), **f64)
        nr = _empty((2, S), dtype=torch.int64, device=dev)
        n, rej = nr[0], nr[1]
    else:
        n, rej, s, G = into
        c = s  # never written when accumulating
    BR = min(FINISH_BR, max(16, triton.next_power_of_2(D)))
    nt = triton.cdiv(D, BR)
    _finish_kernel[(nt * (nt + 1) // 2, S)](Gp, sp, cnt, G, s, c, n, rej, S, D, Gp.shape[0], sp.shape[0],
                                            BR=BR, BK=FINISH_BK, ACC=into is not None, num_warps=4)
    return None if into is not None else CovPartials(n, c, s, G, rej)


def _check_totals(into: Totals, x: Tensor) -> None:
    S, D = x.shape[-2], x.shape[-1]
    shapes = ((S,), (S,), (S, D), (S, D, D))
    dtypes = (torch.int64, torch.int64, torch.float64, torch.float64)
    for name, t, shape, dt in zip(("n", "rejected", "sum", "gram"), into, shapes, dtypes):
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"{name}: expected a contiguous {dt} tensor of shape {list(shape)} on {x.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")


def _prep_config(D: int) -> tuple[int, int, int]:
    """(BD, BT, num_warps) of the prep kernel: whole rows, ~4096 elements per row block."""
    BD = max(16, triton.next_power_of_2(D))
    BT = min(64, max(1, 4096 // BD))
    return BD, BT, 8 if BT * BD >= 4096 else 4


def _common(x: Tensor, mask: Tensor | None, row_step: int) -> dict:
    mask_t, smb, smt = _mask_args(x, mask)
    sxb, sxt, sxs, sxd = x.stride()
    return {"p_mask": mask_t, "stride_xb": sxb, "stride_xt": sxt, "stride_xs": sxs, "stride_xd": sxd,
            "stride_mb": smb, "stride_mt": smt, "ROW_STEP": row_step, "HAS_MASK": mask is not None}


def partials_prep_gemm(x: Tensor, mask: Tensor | None = None, row_step: int = 1) -> CovPartials:
    """Exact float64 raw partials of ``x: [B, T, S, D]`` (module docstring): float64 rows, one
    batched float64 GEMM, one finish.

    Launches: per chunk of at most :data:`CHUNK_ELEMS` float64 row elements, ``_prep_rows_kernel``
    and one ``bmm``/``baddbmm`` over all heads; then ``_finish_kernel``: 3 for one chunk.
    """
    return _prep_gemm(x, mask, row_step, None)


def accumulate_prep_gemm(n: Tensor, rejected: Tensor, sum_: Tensor, gram: Tensor, x: Tensor,
                         mask: Tensor | None = None, row_step: int = 1) -> None:
    """Add the update of ``x`` to the raw-sum totals in place (:data:`Totals`): what
    :func:`partials_prep_gemm` then :func:`~fastspec.covariance.ops.merge_sums` do, bit for bit,
    with the merge folded into the finish kernel (3 launches, no torch op beside the GEMM)."""
    _check_totals((n, rejected, sum_, gram), x)
    _prep_gemm(x, mask, row_step, (n, rejected, sum_, gram))


class _Update(NamedTuple):
    """One update's checked arguments and sizes (``N = B·Tk`` rows of ``S`` sites of ``D``)."""

    x: Tensor
    row_step: int
    Tk: int
    N: int
    S: int
    D: int


def _update(x: Tensor, mask: Tensor | None, row_step: int, status) -> _Update:
    row_step = _check(x, mask, row_step, status)
    B, T, S, D = x.shape
    Tk = triton.cdiv(T, row_step)
    return _Update(x.detach(), row_step, Tk, B * Tk, S, D)


def _prep_gemm(x: Tensor, mask: Tensor | None, row_step: int, into: Totals | None) -> CovPartials | None:
    x, row_step, Tk, N, S, D = _update(x, mask, row_step, prep_gemm_status)
    dev = x.device
    if N == 0 or S == 0 or D == 0:
        return None if into is not None else _zeros(S, D, dev)
    ws = _workspace(x)
    f64 = {"dtype": torch.float64, "device": dev}
    BD, BT, warps = _prep_config(D)
    nc_max = max(1, min(N, CHUNK_ELEMS // (S * D)))
    chunks = [(r0, min(nc_max, N - r0)) for r0 in range(0, N, nc_max)]  # shapes only: no sync
    splits = [triton.cdiv(nc, PREP_ROWS) for _, nc in chunks]
    KS = sum(splits)
    sp = _buffer(ws, "sums", (KS, S, D), **f64)
    cnt = _buffer(ws, "counts", (2, KS, S), torch.int32, dev)
    gram = _buffer(ws, "gram", (1, S, D, D), **f64)
    common = _common(x, mask, row_step)
    rows64_flag = N + PREP_ROWS >= 2**31
    k0 = 0
    with torch.cuda.device(dev) if x.is_cuda else nullcontext():
        for (r0, nc), split in zip(chunks, splits):
            rows = _buffer(ws, "rows64", (S, nc, D), **f64)
            _prep_rows_kernel[(split, S)](x, p_rows=rows, p_sp=sp, p_cnt=cnt, R0=r0, NC=nc, Tk=Tk, D=D,
                                          S=S, KS=KS, K0=k0, RPP=PREP_ROWS, **common, ROWS64=rows64_flag,
                                          BT=BT, BD=BD, num_warps=warps)
            # one GEMM for every head: [S, D, nc] @ [S, nc, D] (cuBLAS reads the transpose in place)
            if k0 == 0:
                torch.bmm(rows.mT, rows, out=gram[0])
            else:
                gram[0].baddbmm_(rows.mT, rows)
            k0 += split
        return _finish(gram, sp, cnt, S, D, into)


def _f64_config(N: int, S: int, D: int) -> tuple[int, int, int, int, int, int]:
    """(BC, NT, BT, num_warps, SPLIT, rows per split) of the gram kernel, from the shapes alone.

    ``NT <= 2`` (D <= 128): ``_gram_f64_kernel``, grid (S, SPLIT); ``D = 128`` holds three
    64² float64 accumulators (8 warps, 16-row blocks: 244 registers, one program per SM, so
    ~128 programs: one wave); ``D <= 64`` one (4 warps, 32-row blocks, ~170 registers, three per
    SM). Wider: ``_gram_f64_tiled_kernel``, grid (NT(NT+1)/2, S, SPLIT), two per SM.
    """
    BC = min(F64_BC, max(16, triton.next_power_of_2(D)))
    NT = triton.cdiv(D, BC)
    if NT == 2:
        BT, warps, programs = 16, 8, F64_PROGRAMS
    elif NT == 1:
        BT, warps, programs = 32, 4, 3 * F64_PROGRAMS
    else:
        BT, warps, programs = 32, 4, 2 * F64_PROGRAMS
    tiles = 1 if NT <= 2 else NT * (NT + 1) // 2
    split = max(1, min(triton.cdiv(programs, S * tiles), triton.cdiv(N, F64_MIN_ROWS)))
    rps = triton.cdiv(triton.cdiv(N, split), BT) * BT
    return BC, NT, BT, warps, triton.cdiv(N, rps), rps


def partials_triton_f64(x: Tensor, mask: Tensor | None = None, row_step: int = 1) -> CovPartials:
    """Exact float64 raw partials of ``x: [B, T, S, D]`` (module docstring): 16/32-bit tiles
    widened in registers, float64 ``tl.dot``; no float64 copy of the rows in memory.

    Launches: 2 (``_gram_f64_kernel`` or, for D > 128, ``_gram_f64_tiled_kernel``; then
    ``_finish_kernel``). Raises ``RuntimeError`` with :func:`triton_f64_status`'s reason where
    the kernel cannot be compiled (Triton < 3.9).
    """
    return _triton_f64(x, mask, row_step, None)


def accumulate_triton_f64(n: Tensor, rejected: Tensor, sum_: Tensor, gram: Tensor, x: Tensor,
                          mask: Tensor | None = None, row_step: int = 1) -> None:
    """Add the update of ``x`` to the raw-sum totals in place (:data:`Totals`): what
    :func:`partials_triton_f64` then :func:`~fastspec.covariance.ops.merge_sums` do, bit for
    bit, with the merge folded into the finish kernel (2 launches, no torch op)."""
    _check_totals((n, rejected, sum_, gram), x)
    _triton_f64(x, mask, row_step, (n, rejected, sum_, gram))


def _triton_f64(x: Tensor, mask: Tensor | None, row_step: int, into: Totals | None) -> CovPartials | None:
    x, row_step, Tk, N, S, D = _update(x, mask, row_step, triton_f64_status)
    dev = x.device
    if N == 0 or S == 0 or D == 0:
        return None if into is not None else _zeros(S, D, dev)
    ws = _workspace(x)
    f64 = {"dtype": torch.float64, "device": dev}
    BC, NT, BT, warps, split, rps = _f64_config(N, S, D)
    Gp = _buffer(ws, "gram_splits", (split, S, D, D), **f64)
    sp = _buffer(ws, "sums", (split, S, D), **f64)
    cnt = _buffer(ws, "counts", (2, split, S), torch.int32, dev)
    args = dict(p_Gp=Gp, p_sp=sp, p_cnt=cnt, N=N, Tk=Tk, D=D, S=S, RPS=rps, KS=split,
                **_common(x, mask, row_step), ROWS64=N + rps >= 2**31, BT=BT, BC=BC, num_warps=warps,
                # the kernel prefetches the next row block into registers itself; no cp.async
                # pipeline of Triton's (the kind that raced on an H100, triton_update.py)
                num_stages=1)
    with torch.cuda.device(dev) if x.is_cuda else nullcontext():
        if NT <= 2:
            _gram_f64_kernel[(S, split)](x, HALVES=NT, **args)
        else:
            _gram_f64_tiled_kernel[(NT * (NT + 1) // 2, S, split)](x, NT=NT, **args)
        return _finish(Gp, sp, cnt, S, D, into)
