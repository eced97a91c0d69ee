"""Triton kernels for one streaming covariance update (docs/accumulators.md); launcher in ``triton_update.py``.

Design envelope
---------------
* Tuned for attention heads, ``D`` in {32, 64, 96, 128} (one ``BD``-wide tile holds the whole
  row, so row validity, ``Σ(x−c)`` and ``Σ(x−c)(x−c)ᵀ`` come from ONE read of x: memory bound).
  ``D = 256`` and wide FFN widths (up to 16384) tile ``G`` into 128×128 blocks; only the upper
  triangle is computed (the lower is stored as its transpose) and a row-validity pre-pass reads
  x once more. Wide ``D`` is a GEMM (``N·D²`` flops over the triangle), not memory bound.
* Symmetry: ``G`` is written exactly symmetric. Off-diagonal tiles are stored with their mirror;
  diagonal tiles (the only ones at D <= 128) are averaged with their transpose before the
  store, which absorbs the hi·lo vs lo·hi rounding of the split and any summation
  order difference inside a dot. Cost: one BD×BD transpose (through shared memory) per
  diagonal tile, instead of a D² pass over G in the launcher.
* Inputs bf16/fp16/fp32 with arbitrary strides ``x: [B, T, S, D]`` (no ``.contiguous()``).
* Products: bf16/fp16 rows go through tensor-core ``tl.dot`` with fp32 accumulation. Uncentered
  (``CENTER=False``, the ``sv`` key probe) products are exact. Centered rows ``d = x − c`` are
  fp32; they are split ``d ≈ hi + lo`` (both bf16, 16 significant bits, exact whenever ``d``
  needs ≤ 16 bits; ``c`` lies on a grid of spacing ≥ σ/32 (``_center_kernel``), so ``d`` is a
  multiple of ``min(σ/32, ulp(x))`` and rows up to ~2^11·σ from ``c`` stay exact) and ``d dᵀ = hi hiᵀ + hi loᵀ + lo hiᵀ + lo loᵀ``: 4 dots, or 3 where
  the launch setting drops ``lo loᵀ`` (``LOLO``): that biases the diagonal by at most 2^-16
  relative (~2^-19 typically, 0 where d fits 8 bits), above one fp32 rounding but below what an
  fp32 sum of thousands of rows loses (docs/kernels.md, "Dropping lo·lo"). fp32 input uses
  ``input_precision="ieee"`` (never TF32): exact but on the FMA units, i.e. compute bound.
* Determinism: fixed tile/row-block order, per-row-split partials written to a workspace and
  summed in a fixed order by the launcher; no atomics, no autotuning (a different pick between
  processes would change the summation order), so equal inputs give bitwise equal sums.
* No host sync: sizes come from shapes only; safe on the current stream inside forward hooks.
* Fused row loop (D <= 128, ``_fused_rows``): per 32-row block it loads x once (Triton
  software-pipelines the load through ``cp.async``), multiplies on the tensor cores, and adds
  the block elementwise into a [BT, BD] fp32 tile of column sums; nothing crosses threads in
  the loop (the tile is reduced once, after it, in a fixed order: deterministic). Rows are not
  tested one by one: a NaN/±Inf in any kept row makes that program's Σd non-finite, and such a
  program (or one whose sums overflowed) redoes its rows with the exact per-row test, so
  rejected rows are still counted and never merged, bit for bit as if they had been masked.
  Row addresses: when every sequence has >= BT sampled rows (``TK_GE_BT``) the block's first
  (b, t) and offsets are carried from block to block and a row wraps into the next sequence at
  most once (one compare per row); otherwise int32 division of small numbers per row.
* Launch settings of 16-bit input with ``D > 64`` (rows per block, warps, stages, the split's
  ``lo·lo``, the unrolled flush ``UNROLL``, pre-split) are candidates of ``triton_configs.py``,
  raced on a GPU by ``benchmarks/triton_race.py`` and read from its table; the first candidate
  of each kernel is what follows here. After the partials, ``_finish_kernel`` sums the row
  splits, the counts and ``c = 0`` in one launch (it replaced four torch launches).
* Block sizes (launcher ``_rows_and_warps``): the largest row blocks that ptxas fits in 255
  registers without spilling in the row loop on sm_90 (Triton 3.9; checked by compiling without
  a GPU): BD=128 fused: 32 rows, 8 warps; BD<=64: 32-64 rows, 4 warps; tiled: 64 rows, 8 warps;
  fp32: 16 rows. The fp32 tiled kernel (FMA dot) spills: fp32 input with D > 128 is outside
  the envelope. Triton 3.6 spills inside the loop of the 16-bit tiled kernel (D > 128) too.
* SASS of the keys kernel (bf16, D = 128, 8 warps, sm_90, the launcher's specialization of a
  contiguous input; per 32-row iteration per warp; Triton 3.9 / 3.6 where they differ; kept
  honest by ``test_kernels_compile_for_sm90_without_a_gpu``; the last step of each row is the
  float32 block tile of ``_gram_dot``'s ``ACC=2``, flushed every block for the split and every
  ``FLUSH_ROWS`` = 128 rows uncentred, by a select evaluated every block):

  ==============================  =========================  ===============================
  before -> now                   CENTER=False (``sv``)      CENTER=True (hi + lo split)
  ==============================  =========================  ===============================
  loop instructions               454/461 -> 184 -> 452/451  647/644 -> 414/399 -> 502/484
  BAR per iteration               10/5 -> 2                  14/7 -> 7/4
  SHFL per iteration              32/28 -> 0                 32/28 -> 0
  int64 division in the loop      2 CALL + I2F/RCP -> none   same -> none
  registers, spills               158/155, 0 -> 242/246, 0   174/171, 0 -> 240/252, 0
  num_stages (cp.async depth)     3 (4 raced on an H100)     3
  ==============================  =========================  ===============================

Byte/flop arithmetic (H100 SXM: ~3.35 TB/s HBM, ~990 TFLOP/s dense bf16; H200: 4.8 TB/s)
-------------------------------------------------------------------------------------------
* keys ``[B=8, H=8, T=2048, D=128]`` bf16 (N = 16384 rows per head): 33.6 MB read once; flops
  ``2·N·D²·H`` = 4.3 GFLOP uncentered (~4 µs at peak), ×4 centered (17 GFLOP, ~17 µs); memory
  time 10 µs (H100) / 7 µs (H200). Grid: 8 heads × 16 row splits = 128 programs of 1024 rows
  (one wave, one 8-warp program per SM: 4 of 132 SMs idle since programs do not span heads),
  workspace ``16·H·D²·4`` = 8.4 MB (1/4 of the input, L2 resident until the torch sum).
* Cost model (a PREDICTION from the SASS counts above, not a measurement): per program,
  time ≈ max(memory, issue, tensor) + ~1.5 µs (pipeline fill, G symmetrize + 64 KB store).
  memory: 33.6 MB at ~3.0 TB/s (~90 % of HBM peak for streaming reads) = 11.2 µs; Little's
  law asks ~3.35 TB/s × ~0.8 µs ≈ 2.7 MB in flight, the 4-stage pipeline kept 3 blocks × 8 KB
  × 128 SMs = 3.1 MB. issue: 8 warps × 184 / 4 schedulers = 368 cycles per block, × 32 blocks
  = 6.7 µs at 1.75 GHz (before: 922 cycles, 16.9 µs: issue bound). So uncentered ≈ 12.5 µs,
  ~2.7 TB/s ≈ 80 % of HBM (before: ≈ 18 µs, ~55 %), plus the split sum (8.4 MB from L2, one
  small torch kernel). Now (3 stages, the block tile): 2 blocks × 8 KB × 128 SMs = 2.1 MB in
  flight, ~80 % of what Little's law asks; issue: 8 warps × (190 + 197 / 4) / 4 = 479 cycles per
  block, 8.8 µs: still under the memory time. Centered: issue (8 warps × 414 / 4; 502 since the split sums each block in its own tile) = 828 (1004) cycles per block (15 (18) µs) overlapping
  the 4 dots (17 GFLOP, ~18 µs at ~95 % of peak): ≈ 20 µs, compute bound (a per-block "skip
  the lo dots when lo ≡ 0" branch would recover large-mean data; not done).
* The torch per-head path (``reference.py``) reads x, writes an fp32 copy, reads it back for an
  fp32 einsum, i.e. ≥ 5× the bytes plus an fp32 (TF32-free) matmul.
* FFN ``[N=16384, D=8192]`` bf16: 268 MB of x; ``N·D²`` = 1.1 TFLOP uncentered over the upper
  triangle (~1.1 ms at peak), ×4 centered. Each of the 2080 tile programs reads 2×128 columns
  of every row (64 flop/byte per 64-row block), i.e. ~17 GB of mostly-L2 traffic: expect it to
  be L2 bound near 2-3 ms uncentered; larger tiles / TMA / a persistent schedule are the next
  step if FFN probes need to be cheaper. The row-validity pre-pass adds one 268 MB read.
* Targets: >= 80 % of HBM bandwidth on the key case, >= 3× the torch per-head matmul path.
  MEASURED on one H200 (2026-11-26, Triton 3.6; docs/kernels.md, "Measured on a GPU"): the
  uncentered keys kernel ran 18.8 µs under Nsight Compute (1.9 TB/s, 40 % of HBM; prediction
  12.5 µs). 192 registers allow one 8-warp program per SM, and the shared-memory stores of the
  pipeline have 5.8-way bank conflicts. A whole call took 152 µs, event-timed: the launcher's
  host work, not the kernel. The centred FFN case ran 22.4 ms (prediction: 2-3 ms uncentred, 4 dots per block centred). On that GPU, fp16
  uncentered at D = 128 was 1.7 % off, and the centered split was 30-60× less accurate than torch
  fp32 (see ``benchmarks/gpu_diag.py``). The interpreter passes both.
  MEASURED on one H100 (2026-11-26, Triton 3.6): the uncentered keys kernel 21.4 µs under ncu
  (1.68 TB/s, 50 % of DRAM peak; 192 registers, 12.5 % occupancy, 128 programs on 132 SMs,
  0.51 eligible warps per scheduler); the CUDA-graphed launch 36.9 µs uncentered, 75.6 µs
  centered; 131 µs of host time per call. ``gpu_diag.py accuracy`` explained both failures:
  (1) 4 pipeline stages over a loop of 2 row blocks race (sums change between launches, up to
  19 % off; 2-3 stages or >= 3 blocks are exact), so the launcher caps the stages at the
  shortest program's block count (``pipeline_stages``); (2) the split's accuracy is lost in
  the tensor cores' accumulation: summing each block in its own tile (``ACC=2``) brings it to
  1.2-1.4× torch fp32, so the split uses it (``block_accumulation``).
  MEASURED on one H100 (2026-11-27, Triton 3.6; device time, a spin kernel ahead of the start
  event): the uncentred keys partials 46.4 µs per call (36.7 µs CUDA-graphed; a device copy of
  the same bytes 21.8 µs), centred 77.9 µs graphed; FFN centred 22.0 ms. Both fixes above held;
  uncentred 16-bit sums about large means then failed against fp64 (3 tests), which moved the
  uncentred dots to the block tile too and every launch to 3 stages (``block_accumulation``,
  ``pipeline_stages``). Not yet timed on a GPU.
  MEASURED on one H100 (2026-11-27 evening, Triton 3.6): that launch (the uncentred tile
  flushed under an ``if`` every 4th block, 3 stages) raced: the keys case 6.5e-4 off fp64
  (torch 3.7e-6), sums changing from launch to launch, and the masked D = 96 tests failed. The
  same dots at 1 stage were exact; at 2 stages, with the tile added only after the loop, or
  with ACC=0 on masked input they raced too; the flush as a select every block was exact and
  steady on all 8 inputs of ``benchmarks/race_probe.py`` and passed every GPU covariance test
  (139). Graphed keys partials: 44.7 µs per call (the racing launch 39.3, ACC=0 38.2).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from ._triton_compat import fix_interpreter_index

# interpreter only (the CPU tests): Triton 3.6 cannot run runtime-bound range() loops with
# numpy >= 2.4 (see _triton_compat). Read at import, as triton.jit and triton_update do.
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    fix_interpreter_index()


@triton.jit
def _row_offsets(o_r, Tk, ROW_STEP, stride_xb, stride_xt):
    """Row r of the sampled chunk is x[b, t] with b = r // Tk, t = (r % Tk)·ROW_STEP (int64)."""
    o_b = o_r // Tk
    o_t = (o_r % Tk) * ROW_STEP
    return o_b, o_t, o_b * stride_xb + o_t * stride_xt


@triton.jit
def _row_keep(p_mask, o_b, o_t, m_r, stride_mb, stride_mt, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        return m_r & (tl.load(p_mask + o_b * stride_mb + o_t * stride_mt, mask=m_r, other=0) != 0)
    return m_r


@triton.jit
def _nonfinite(b_x, axis: tl.constexpr):
    """How many NaN/±Inf values ``b_x`` holds along ``axis``: x − x is 0 for finite x and NaN
    for NaN/±Inf, one test for both."""
    b_f = b_x.to(tl.float32)
    return tl.sum(((b_f - b_f) != 0).to(tl.int32), axis=axis)


@triton.jit
def _count_nonfinite(p_row, keep, D, stride_xd, ROWS: tl.constexpr, BD: tl.constexpr):
    """Per kept row, how many of its D values are NaN/±Inf (one pass over D in BD tiles)."""
    b_bad = tl.zeros([ROWS], dtype=tl.int32)
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        b_x = tl.load(p_row[:, None] + o_d[None, :].to(tl.int64) * stride_xd,
                      mask=keep[:, None] & (o_d < D)[None, :], other=0)
        b_bad += _nonfinite(b_x, 1)
    return b_bad


@triton.jit
def _row_status_kernel(
    p_x, p_mask, p_status,
    N, Tk, D,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt,
    ROW_STEP,
    HAS_MASK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """status[s, r] = 1 valid, 2 rejected (kept by the mask but not finite), 0 masked out."""
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    o_r = i_r.to(tl.int64) * BT + tl.arange(0, BT)
    m_r = o_r < N
    o_b, o_t, o_row = _row_offsets(o_r, Tk, ROW_STEP, stride_xb, stride_xt)
    keep = _row_keep(p_mask, o_b, o_t, m_r, stride_mb, stride_mt, HAS_MASK)
    p_row = p_x + i_s.to(tl.int64) * stride_xs + o_row
    b_bad = _count_nonfinite(p_row, keep, D, stride_xd, BT, BD)
    b_status = tl.where(keep, tl.where(b_bad == 0, 1, 2), 0).to(tl.int8)
    tl.store(p_status + i_s.to(tl.int64) * N + o_r, b_status, mask=m_r)


@triton.jit
def _center_kernel(
    p_x, p_mask, p_c,
    N, Tk, D,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt,
    ROW_STEP,
    HAS_MASK: tl.constexpr, ROUND_TO_INPUT: tl.constexpr, NC: tl.constexpr, BD: tl.constexpr,
):
    """c[s, j] = sample mean m_j of channel j rounded to a power-of-two grid of about σ_j/16
    (0 if |m_j| is below half a step, or there are no valid rows).

    The sample: the valid rows among NC rows spread evenly over the chunk (spreading keeps
    left/right padding from emptying it). Any shift near the mean keeps the centered products
    small; the coarse grid (and, with ROUND_TO_INPUT, the input dtype's grid) keeps x − c exact
    in fp32 and short enough for the hi + lo bf16 split.
    """
    i_s = tl.program_id(0)
    o_i = tl.arange(0, NC).to(tl.int64)
    o_r = tl.where(N > NC, o_i * N // NC, o_i)  # short chunks: every row once
    m_r = o_i < N
    o_b, o_t, o_row = _row_offsets(o_r, Tk, ROW_STEP, stride_xb, stride_xt)
    keep = _row_keep(p_mask, o_b, o_t, m_r, stride_mb, stride_mt, HAS_MASK)
    p_row = p_x + i_s.to(tl.int64) * stride_xs + o_row
    b_bad = _count_nonfinite(p_row, keep, D, stride_xd, NC, BD)
    valid = keep & (b_bad == 0)
    b_cnt = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        m = valid[:, None] & m_d[None, :]
        b_x = tl.load(p_row[:, None] + o_d[None, :].to(tl.int64) * stride_xd, mask=m, other=0).to(tl.float32)
        b_mean = tl.sum(b_x, axis=0) / b_cnt
        b_dev = tl.where(m, b_x - b_mean[None, :], 0.0)
        b_var = tl.sum(b_dev * b_dev, axis=0) / b_cnt
        # c = the mean rounded to a multiple of q, a power of two in (σ/32, σ/16] (σ: the
        # sample's std; exact bit trick, no log2), then (ROUND_TO_INPUT) to the input dtype,
        # i.e. to the coarser of the two grids. c is within ~σ/8 of the mean (no cancellation
        # in G − s sᵀ/n), |mean| < q/2 gives c = 0, and x − c is a multiple of min(q, ulp(x)):
        # few bits for x anywhere near c, outliers included (the split needs <= 16).
        b_q = (tl.sqrt(b_var).to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        b_q = b_q * 0.0625
        b_ok = (b_q > 0) & (b_q < float("inf"))
        b_k = b_mean / tl.where(b_ok, b_q, 1.0)
        # σ = 0 or |mean| >= 2^24·q: the mean itself; σ = inf (overflow): 0
        b_c = tl.where(b_ok & (tl.abs(b_k) < 16777216.0), tl.floor(b_k + 0.5) * b_q, b_mean)
        b_c = tl.where(b_var < float("inf"), b_c, 0.0)
        if ROUND_TO_INPUT:
            b_c = b_c.to(p_x.dtype.element_ty).to(tl.float32)
        tl.store(p_c + i_s.to(tl.int64) * D + o_d, b_c, mask=m_d)


@triton.jit
def _lower_pair(i_p):
    """Tile pair (i_r, i_c), i_r >= i_c, of the p-th lower-triangle tile: p = i_r(i_r+1)/2 + i_c.

    The float square root is exact enough for p < 2^21 and the two integer corrections fix any
    off-by-one of it (``tl.sqrt`` may be approximate)."""
    i_r = ((tl.sqrt((8 * i_p + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i_r = tl.where(i_r * (i_r + 1) // 2 > i_p, i_r - 1, i_r)
    i_r = tl.where((i_r + 1) * (i_r + 2) // 2 <= i_p, i_r + 1, i_r)
    return i_r, i_p - i_r * (i_r + 1) // 2


@triton.jit
def _round_to_bf16(b_f):
    """fp32 -> nearest bf16 value (ties to even), kept in fp32; finite input.

    Done on the bits because the interpreter's fp32 -> bf16 cast truncates (GPU casts round),
    and a truncated split hi + lo is biased toward 0, which shows on the diagonal of G.
    """
    b_u = b_f.to(tl.uint32, bitcast=True)
    b_u = (b_u + 0x7FFF + ((b_u >> 16) & 1)) & 0xFFFF0000
    return b_u.to(tl.float32, bitcast=True)


# uncentred 16-bit rows with ACC=2: the block tile is added to G once per this many rows (4
# blocks of 32 rows, 2 of 64: a chain of 8 matrix instructions of 16 rows at most)
FLUSH_ROWS: tl.constexpr = tl.constexpr(128)


@triton.jit
def _gram_dot(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr, ACC: tl.constexpr, LOLO: tl.constexpr = True,
              FLUSH_SELECT: tl.constexpr = True):
    """(b_acc, b_blk) with b_aᵀ b_b summed in: b_a: [BT, BM], b_b: [BT, BN] (zeros in invalid
    rows/columns), ``i_blk`` the row block's index in the caller's loop.

    SPLIT_BF16: the fp32 blocks are split hi + lo in bf16 (16 significant bits) and the four
    bf16 products summed, so every d that needs <= 16 bits is multiplied exactly. LOLO=False
    drops lo·loᵀ (3 dots): bf16 keeps 8 significant bits, so |lo| <= 2^-8·|d| and each dropped
    product is at most 2^-16·|d_i d_j| (~2^-19 on average); lo is 0 wherever d fits 8 bits
    (docs/kernels.md, "Dropping lo·lo", bounds what that does to G; a launch setting of
    ``triton_configs.py``).
    UPCAST (interpreter): bf16/fp16 operands go through fp32, where their products are exact.
    ACC: where the block's products are summed (the launcher's ``block_accumulation``: 2 for
    16-bit input, on tensor cores; 0 for fp32; ``benchmarks/gpu_diag.py accuracy`` sweeps them).
    0: every dot accumulates into ``b_acc`` (the tensor core's own accumulation). 1: the split's
    three correction dots go to a per-block accumulator that is added to ``b_acc`` by an fp32
    add. 2: the products are summed in a block tile added to ``b_acc`` by an fp32 add: the
    split's four dots every block; uncentred rows' one dot into ``b_blk``, carried across
    :data:`FLUSH_ROWS` rows (the caller adds what is left after its loop: ``_gram_flush``).
    1 and 2 hold a second [BM, BN] fp32 tile. On an H100 the split lost 35-59x torch's
    accuracy with 0 and 1.2-1.4x with 2: the accumulation inside the matrix instructions, not
    the split, was what cost the bits (a model that truncates each instruction's sum to fp32, so
    that a long chain drifts toward zero instead of averaging out, reproduces both numbers:
    ``benchmarks/tensor_core_sum_model.py``).

    FLUSH_SELECT=False (uncentred ACC=2 only): no flush here; the caller's loop is unrolled over
    a group of blocks and adds the tile after each group (``_fused_rows``'s UNROLL).

    Why the uncentred tile is carried across blocks: Triton rewrites ``acc + dot(a, b)`` (a
    dot from zero, then an add) into ``dot(a, b, acc)``, i.e. back into ACC=0 (compiled, the
    add is gone); a tile that already holds the previous blocks' products is not zero, so the
    add stays an fp32 add. The flush into ``b_acc`` is a select evaluated every block (an ``if``
    every 4th block raced on an H100, see the comment below): 64 adds and 2 x 64 selects per
    thread per block, the keys kernel's loop 190 -> 452 instructions per warp, ~15 % of its time.
    """
    if SPLIT_BF16:
        b_ah = _round_to_bf16(b_a)
        b_bh = _round_to_bf16(b_b)
        b_al = _round_to_bf16(b_a - b_ah)
        b_bl = _round_to_bf16(b_b - b_bh)
        if not UPCAST:  # exact: the values are bf16 already
            b_ah, b_bh = b_ah.to(tl.bfloat16), b_bh.to(tl.bfloat16)
            b_al, b_bl = b_al.to(tl.bfloat16), b_bl.to(tl.bfloat16)
        if ACC == 0:
            b_acc = tl.dot(tl.trans(b_ah), b_bh, b_acc, input_precision=PRECISION)
            b_acc = tl.dot(tl.trans(b_ah), b_bl, b_acc, input_precision=PRECISION)
            b_acc = tl.dot(tl.trans(b_al), b_bh, b_acc, input_precision=PRECISION)
            if LOLO:  # <= 2^-16 of d·d, of one sign on the diagonal (docs/kernels.md)
                b_acc = tl.dot(tl.trans(b_al), b_bl, b_acc, input_precision=PRECISION)
        else:
            # this block's own tile (``b_blk`` stays unused: four chained dots are never folded)
            b_t = tl.dot(tl.trans(b_ah), b_bl, input_precision=PRECISION)
            b_t = tl.dot(tl.trans(b_al), b_bh, b_t, input_precision=PRECISION)
            if LOLO:
                b_t = tl.dot(tl.trans(b_al), b_bl, b_t, input_precision=PRECISION)
            if ACC == 1:
                b_acc = tl.dot(tl.trans(b_ah), b_bh, b_acc, input_precision=PRECISION) + b_t
            else:
                b_t = tl.dot(tl.trans(b_ah), b_bh, b_t, input_precision=PRECISION)
                b_acc = b_acc + b_t
    else:
        if UPCAST:
            b_a, b_b = b_a.to(tl.float32), b_b.to(tl.float32)
        if ACC == 2 and not FLUSH_SELECT:
            b_blk = tl.dot(tl.trans(b_a), b_b, b_blk, input_precision=PRECISION)
        elif ACC == 2:
            BT: tl.constexpr = b_a.shape[0]
            tl.static_assert(FLUSH_ROWS // BT >= 2, "one block per flush would be folded into ACC=0")
            b_blk = tl.dot(tl.trans(b_a), b_b, b_blk, input_precision=PRECISION)
            # a select every block, not an ``if`` every 4th: on an H100 (Triton 3.6) the ``if``
            # raced (sums off by up to 1e-2 and changing from launch to launch, at 2 and 3
            # stages, exact at 1), and so did a tile added only after the loop; the select was
            # exact and steady on every input (benchmarks/race_probe.py). Cause not found: the
            # TTGIR waits for each dot (pendings = 0) in both. Cost: keys 39 -> 45 us per call.
            flush = i_blk % (FLUSH_ROWS // BT) == FLUSH_ROWS // BT - 1
            b_acc = b_acc + tl.where(flush, b_blk, 0.0)
            b_blk = tl.where(flush, 0.0, b_blk)
        else:
            b_acc = tl.dot(tl.trans(b_a), b_b, b_acc, input_precision=PRECISION)
    return b_acc, b_blk


@triton.jit
def _gram_flush(b_acc, b_blk, SPLIT_BF16: tl.constexpr, ACC: tl.constexpr):
    """After the row loop: what the uncentred block tile still holds (ACC=2) goes into ``b_acc``."""
    if ACC == 2 and not SPLIT_BF16:
        b_acc = b_acc + b_blk
    return b_acc


@triton.jit
def _prep_block(b_x, m, b_c, CENTER: tl.constexpr):
    """Operand block for the dot: x − c in fp32 (CENTER) or raw x, 0 outside the mask ``m``."""
    # one return: the compiler type-checks every return, even in a constexpr-dead branch
    if CENTER:
        # tl.where, not a product: a masked-out NaN row times 0 is still NaN
        b_out = tl.where(m, b_x.to(tl.float32) - b_c[None, :], 0.0)
    else:
        b_out = tl.where(m, b_x, tl.zeros_like(b_x))
    return b_out


@triton.jit
def _load_prepped(p_row, o_d, m_d, valid, p_cs, stride_xd, CENTER: tl.constexpr):
    m = valid[:, None] & m_d[None, :]
    b_x = tl.load(p_row[:, None] + o_d[None, :].to(tl.int64) * stride_xd, mask=m, other=0)
    b_c = tl.load(p_cs + o_d, mask=m_d, other=0) if CENTER else None
    return _prep_block(b_x, m, b_c, CENTER)


@triton.jit
def _fused_rows(
    p_xs, p_mask, p_cs, r_lo, r_hi, Tk, ROW_STEP,
    stride_xb, stride_xt, stride_xd, stride_mb, stride_mt, o_d, m_d,
    HAS_MASK: tl.constexpr, CENTER: tl.constexpr, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, ACC: tl.constexpr, EXACT: tl.constexpr, TK_GE_BT: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, LOLO: tl.constexpr, UNROLL: tl.constexpr,
):
    """(G, Σd, valid rows, rejected rows) over rows [r_lo, r_hi) of one site, the tile holding
    whole rows (one read of x).

    UNROLL > 1: the loop walks groups of UNROLL blocks (unrolled at compile time), and the
    uncentred block tile (ACC=2) is added to G after each group, unconditionally: none of the
    select's 2 x 64 instructions per thread and block, and no branch (an ``if`` flush raced on an
    H100). UNROLL = 1: the select every block (``_gram_dot``).

    EXACT=False (the fast pass): every kept row is merged, with no finiteness test; a NaN/±Inf
    in any kept row makes Σd non-finite, and the caller then reruns with EXACT=True, which tests
    every row and counts the non-finite ones as rejected (the rare path: the exact semantics).
    """
    b_G = tl.zeros([BD, BD], dtype=tl.float32)
    b_blk = tl.zeros([BD, BD], dtype=tl.float32)  # the block tile of ACC=2 (uncentred)
    i_blk = 0
    b_S = tl.zeros([BT, BD], dtype=tl.float32)  # Σd per row slot: reduced once, after the loop
    b_n = tl.zeros([BT], dtype=tl.int32)
    b_rej = tl.zeros([BT], dtype=tl.int32)
    b_c = tl.load(p_cs + o_d, mask=m_d, other=0) if CENTER else None
    o_i = tl.arange(0, BT)
    p_xd = o_d.to(tl.int64) * stride_xd
    # between consecutive sampled rows of one sequence; int64 (r_lo is): a stride times a row
    # count (Tk · stride_k in the wrap jump) can pass 2^31 on long sequences
    stride_xk = (r_lo * 0 + stride_xt) * ROW_STEP
    stride_mk = (r_lo * 0 + stride_mt) * ROW_STEP
    # (b, t) of the block's first row: one division per program, then carried from block to
    # block (no per-row int64 // and %). t0 < Tk always.
    b0 = r_lo // Tk
    t0 = (r_lo - b0 * Tk).to(tl.int32)
    if TK_GE_BT:
        # BT <= Tk: a block starting at t0 < Tk wraps into the next sequence at most once, so
        # row i is at (b0, t0 + i) or (b0 + 1, t0 + i − Tk): its offsets are the first row's
        # plus i·stride_k, plus a loop-invariant jump if it wrapped. Only the first row's
        # offsets (scalars) are carried.
        o_x0 = b0 * stride_xb + t0.to(tl.int64) * stride_xk
        o_m0 = b0 * stride_mb + t0.to(tl.int64) * stride_mk
        jump_x = stride_xb - Tk * stride_xk
        jump_m = stride_mb - Tk * stride_mk
        o_xi = o_i.to(tl.int64) * stride_xk
        o_mi = o_i.to(tl.int64) * stride_mk
    if UNROLL > 1 and ACC == 2 and not SPLIT_BF16:
        tl.static_assert(UNROLL >= 2, "one block per flush would be folded into ACC=0")
    for g0 in range(r_lo, r_hi, BT * UNROLL):
        for u in tl.static_range(UNROLL):
            r0 = g0 + u * BT
            m_r = o_i < r_hi - r0
            if TK_GE_BT:
                wrap = t0 + o_i >= Tk
                o_row = o_x0 + o_xi + wrap.to(tl.int64) * jump_x
                o_mrow = o_m0 + o_mi + wrap.to(tl.int64) * jump_m
                t0 += BT
                step = t0 >= Tk
                o_x0 += BT * stride_xk + tl.where(step, jump_x, 0)
                o_m0 += BT * stride_mk + tl.where(step, jump_m, 0)
                t0 = tl.where(step, t0 - Tk, t0).to(tl.int32)
            else:
                # Tk < BT (short or heavily subsampled sequences): int32 division of small numbers
                o_t = t0 + o_i  # < Tk + BT
                o_b = b0 + (o_t // Tk).to(tl.int64)
                o_t = (o_t % Tk).to(tl.int64)
                o_row = o_b * stride_xb + o_t * stride_xk
                o_mrow = o_b * stride_mb + o_t * stride_mk
                t0 += BT
                b0 += (t0 // Tk).to(tl.int64)
                t0 = (t0 % Tk).to(tl.int32)
            if HAS_MASK:
                keep = m_r & (tl.load(p_mask + o_mrow, mask=m_r, other=0) != 0)
            else:
                keep = m_r
            b_x = tl.load((p_xs + o_row)[:, None] + p_xd[None, :], mask=keep[:, None] & m_d[None, :], other=0)
            if EXACT:
                ok = _nonfinite(b_x, 1) == 0
                valid = keep & ok
                b_rej += (keep & ~ok).to(tl.int32)
            else:
                valid = keep
            b_n += valid.to(tl.int32)
            if CENTER or EXACT:
                b_a = _prep_block(b_x, valid[:, None] & m_d[None, :], b_c, CENTER)
            else:
                b_a = b_x  # the masked load already zeroed what is not valid
            b_G, b_blk = _gram_dot(b_a, b_a, b_G, b_blk, i_blk, SPLIT_BF16, UPCAST, PRECISION, ACC, LOLO, UNROLL == 1)
            i_blk += 1  # noqa: SIM113 - a Triton loop: no enumerate()
            b_S += b_a.to(tl.float32)
        if UNROLL > 1:
            b_G = _gram_flush(b_G, b_blk, SPLIT_BF16, ACC)
            b_blk = tl.zeros_like(b_blk)
    b_G = _gram_flush(b_G, b_blk, SPLIT_BF16, ACC)
    return b_G, tl.sum(b_S, axis=0), tl.sum(b_n, axis=0), tl.sum(b_rej, axis=0)


@triton.jit
def _cov_partials_kernel(
    p_x, p_mask, p_status, p_c,
    p_G, p_s, p_n, p_rej,
    N, Tk, D, S, RPS,
    stride_xb, stride_xt, stride_xs, stride_xd, stride_mb, stride_mt,
    ROW_STEP,
    HAS_MASK: tl.constexpr, FUSED_STATUS: tl.constexpr, CENTER: tl.constexpr,
    SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    NTILE: tl.constexpr, TK_GE_BT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    LOLO: tl.constexpr = True, UNROLL: tl.constexpr = 1,
):
    """One (tile of G, site, row split): partial Σ d dᵀ over rows [i_k·RPS, (i_k+1)·RPS).

    Grid (NTILE(NTILE+1)/2, S, SPLIT): the tiles (i_m, i_n), i_m <= i_n, of one triangle (the
    other is stored as their mirror); d = x − c (CENTER) or x, rows not valid contribute 0.
    Outputs, all fp32/int32 workspaces indexed [i_k, s]: G [D, D], s = Σd [D] (diagonal tiles),
    and with FUSED_STATUS (NTILE == 1, the tile holds whole rows) n and rejected counts.
    """
    i_t, i_s, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # no program for the other triangle (written as the mirror of this one's tiles)
    i_n, i_m = _lower_pair(i_t)
    o_m = i_m * BD + tl.arange(0, BD)
    o_n = i_n * BD + tl.arange(0, BD)
    m_m, m_n = o_m < D, o_n < D
    r_lo = i_k.to(tl.int64) * RPS
    r_hi = tl.minimum(r_lo + RPS, N)
    p_xs = p_x + i_s.to(tl.int64) * stride_xs
    p_cs = p_c + i_s.to(tl.int64) * D

    if FUSED_STATUS:
        # fast pass: no per-row finiteness test; a NaN/±Inf in any kept row reaches Σd
        b_G, b_sum, n_ok, n_rej = _fused_rows(
            p_xs, p_mask, p_cs, r_lo, r_hi, Tk, ROW_STEP, stride_xb, stride_xt, stride_xd,
            stride_mb, stride_mt, o_m, m_m, HAS_MASK, CENTER, SPLIT_BF16, UPCAST, PRECISION, ACC,
            False, TK_GE_BT, BT, BD, LOLO, UNROLL)
        if _nonfinite(b_sum, 0) != 0:
            # some kept row is not finite (or Σd overflowed): redo this program's rows with
            # the exact per-row test, so rejected rows are counted and never merged
            b_G, b_sum, n_ok, n_rej = _fused_rows(
                p_xs, p_mask, p_cs, r_lo, r_hi, Tk, ROW_STEP, stride_xb, stride_xt, stride_xd,
                stride_mb, stride_mt, o_m, m_m, HAS_MASK, CENTER, SPLIT_BF16, UPCAST, PRECISION, ACC,
                True, TK_GE_BT, BT, BD, LOLO, UNROLL)
    else:
        b_G = tl.zeros([BD, BD], dtype=tl.float32)
        b_blk = tl.zeros([BD, BD], dtype=tl.float32)
        i_blk = 0
        b_sum = tl.zeros([BD], dtype=tl.float32)
        for r0 in range(r_lo, r_hi, BT):
            o_r = r0 + tl.arange(0, BT).to(tl.int64)
            m_r = o_r < r_hi
            o_b, o_t, o_row = _row_offsets(o_r, Tk, ROW_STEP, stride_xb, stride_xt)
            p_row = p_xs + o_row
            b_st = tl.load(p_status + i_s.to(tl.int64) * N + o_r, mask=m_r, other=0)
            valid = b_st == 1
            b_a = _load_prepped(p_row, o_m, m_m, valid, p_cs, stride_xd, CENTER)
            b_b = _load_prepped(p_row, o_n, m_n, valid, p_cs, stride_xd, CENTER)
            b_G, b_blk = _gram_dot(b_a, b_b, b_G, b_blk, i_blk, SPLIT_BF16, UPCAST, PRECISION, ACC, LOLO)
            i_blk += 1  # noqa: SIM113 - a Triton loop: no enumerate()
            b_sum += tl.sum(b_a.to(tl.float32), axis=0)
        b_G = _gram_flush(b_G, b_blk, SPLIT_BF16, ACC)

    o_out = (i_k.to(tl.int64) * S + i_s) * D
    p_Gk = p_G + o_out * D
    m_G = m_m[:, None] & m_n[None, :]
    if i_m == i_n:
        # a diagonal tile is not bitwise symmetric by itself: the split's hi·lo and lo·hi dots
        # round G[i, j] and G[j, i] differently, and a dot's (MMA, or the interpreter's BLAS)
        # summation order may differ between the two. Averaging with the transpose is exact on
        # the diagonal and makes G exactly symmetric (off-diagonal tiles store their mirror).
        b_G = (b_G + tl.trans(b_G)) * 0.5
        tl.store(p_s + o_out + o_m, b_sum, mask=m_m)
    tl.store(p_Gk + o_m[:, None].to(tl.int64) * D + o_n[None, :], b_G, mask=m_G)
    if i_m != i_n:
        tl.store(p_Gk + o_n[None, :].to(tl.int64) * D + o_m[:, None], b_G, mask=m_G)
    if FUSED_STATUS:
        tl.store(p_n + i_k.to(tl.int64) * S + i_s, n_ok)
        tl.store(p_rej + i_k.to(tl.int64) * S + i_s, n_rej)


@triton.jit
def _split_counts(p_cnt, S, i_s, KS, BK: tl.constexpr):
    """Site i_s's valid and rejected rows, int64, from per-split int32 counts ``cnt [2, KS, S]``
    (``cnt[0]`` valid, ``cnt[1]`` rejected), BK splits loaded at once: the finish kernels of the
    float32 update here and of ``triton_exact.py``."""
    o_k = tl.arange(0, BK)
    b_ok = tl.zeros([BK], dtype=tl.int64)
    b_bad = tl.zeros([BK], dtype=tl.int64)
    for k0 in range(0, KS, BK):
        m_k = (k0 + o_k) < KS
        b_ok += tl.load(p_cnt + (k0 + o_k) * S + i_s, mask=m_k, other=0).to(tl.int64)
        b_bad += tl.load(p_cnt + (KS + k0 + o_k) * S + i_s, mask=m_k, other=0).to(tl.int64)
    return tl.sum(b_ok, axis=0), tl.sum(b_bad, axis=0)


@triton.jit
def _finish_kernel(
    p_Gw, p_sw, p_cnt, p_status, p_G, p_s, p_c, p_nr,
    S, D, N, SPLIT,
    FROM_STATUS: tl.constexpr, ZERO_C: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):
    """The launcher's last step, one launch: the row splits' partials summed in a fixed order.

    Grid (cdiv(D, BR)², S); program (tile, s) writes its BR x BR tile of
    ``G[s] = Σ_k Gw[k, s]`` (``Gw [SPLIT, S, D, D]``, every split exactly symmetric, so the sum
    is too), the first tile column also ``s[s, rows] = Σ_k sw[k, s, rows]`` (``sw [SPLIT, S, D]``)
    and, with ZERO_C, ``c[s, rows] = 0``; tile 0 writes ``nr [2, S]`` int64, valid and rejected
    rows, from the fused kernel's per-split counts ``cnt [2, SPLIT, S]`` int32 or (FROM_STATUS)
    from ``status [S, N]`` int8 (1 valid, 2 rejected). BK splits are loaded at once and reduced
    by ``tl.sum`` (a fixed tree: the same bits every launch), so their loads are in flight
    together. Replaces four torch launches (c's zeros, the three split sums): each costs a few
    µs of device time on a keys update of ~20 µs.
    """
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    nt = tl.cdiv(D, BR)
    i_r, i_c = i_t // nt, i_t % nt
    o_e = tl.arange(0, BR * BR)
    o_r = i_r * BR + o_e // BR
    o_c = i_c * BR + o_e % BR
    m_e = (o_r < D) & (o_c < D)
    DD = D.to(tl.int64) * D
    o_tile = i_s * DD + o_r.to(tl.int64) * D + o_c
    o_k = tl.arange(0, BK)
    b_G = tl.zeros([BR * BR], dtype=tl.float32)
    for k0 in range(0, SPLIT, BK):
        m_k = (k0 + o_k) < SPLIT
        b_g = tl.load(p_Gw + (k0 + o_k)[:, None].to(tl.int64) * S * DD + o_tile[None, :],
                      mask=m_k[:, None] & m_e[None, :], other=0.0)
        b_G += tl.sum(b_g, axis=0)
    tl.store(p_G + o_tile, b_G, mask=m_e)
    if i_c == 0:
        o_d = i_r * BR + tl.arange(0, BR)
        m_d = o_d < D
        b_s = tl.zeros([BR], dtype=tl.float32)
        for k0 in range(0, SPLIT, BK):
            m_k = (k0 + o_k) < SPLIT
            b_sk = tl.load(p_sw + ((k0 + o_k)[:, None].to(tl.int64) * S + i_s) * D + o_d[None, :],
                           mask=m_k[:, None] & m_d[None, :], other=0.0)
            b_s += tl.sum(b_sk, axis=0)
        tl.store(p_s + i_s * D + o_d, b_s, mask=m_d)
        if ZERO_C:
            tl.store(p_c + i_s * D + o_d, tl.zeros([BR], dtype=tl.float32), mask=m_d)
    if i_t == 0:
        if FROM_STATUS:
            o_n = tl.arange(0, BN)
            b_ok = tl.zeros([BN], dtype=tl.int64)
            b_bad = tl.zeros([BN], dtype=tl.int64)
            for r0 in range(0, N, BN):
                b_st = tl.load(p_status + i_s.to(tl.int64) * N + r0 + o_n, mask=r0 + o_n < N, other=0)
                b_ok += (b_st == 1).to(tl.int64)
                b_bad += (b_st == 2).to(tl.int64)
            n_ok, n_bad = tl.sum(b_ok, axis=0), tl.sum(b_bad, axis=0)
        else:
            n_ok, n_bad = _split_counts(p_cnt, S, i_s, SPLIT, BK)
        tl.store(p_nr + i_s, n_ok)
        tl.store(p_nr + S + i_s, n_bad)
