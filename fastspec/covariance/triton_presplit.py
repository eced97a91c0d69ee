"""Pre-split wide-``D`` covariance partials: centre and split the rows once, then a Gram kernel.

For one chunk of rows ``x: [B, T, S, D]`` seen as ``[S, N, D]`` (row ``r`` of site ``s`` is
``x[r // Tk, (r % Tk)·ROW_STEP, s]``), :func:`presplit_partials` computes, over the rows whose
``status`` is 1 (valid), ``d = x − c`` in fp32 and returns ``G = Σ d dᵀ [S, D, D]`` (fp32,
exactly symmetric) and ``s = Σ d [S, D]`` (fp32). It is the wide-``D`` (``D > 128``) counterpart
of ``_cov_partials_kernel``'s tiled path, with the same inputs: ``c`` from ``_center_kernel``,
``status`` from ``_row_status_kernel``.

1. ``_split_rows_kernel`` reads x once and writes ``d ≈ hi + lo`` (both bf16, ``hi`` the nearest
   bf16 of ``d``, ``lo`` the nearest of ``d − hi``; 0 for rows that are not valid) to two
   ``[S, Nc, D]`` workspaces, and per-program partial ``Σd`` that torch sums in a fixed order.
2. ``_gram_presplit_kernel``: one program per 128×128 tile of G's upper triangle and site walks
   the rows in blocks and sums ``hi hiᵀ + hi loᵀ + lo hiᵀ (+ lo loᵀ)`` on the tensor cores.

Design envelope
---------------
* Why pre-split: the tiled ``_cov_partials_kernel`` centres and splits each 128-column strip of
  a row block inside every tile program that reads it, i.e. ``D/128`` times per element (64
  times at ``D = 8192``): ALU work (convert, subtract, two bit-exact roundings) that competes
  with the dots for issue slots. Its operands are computed in registers, so its dots cannot take
  the wgmma path that reads both operands straight from shared memory, where Triton
  software-pipelines plain loads (``cp.async``, ``num_stages`` buffers). Here the split is done
  once; the Gram loop is loads and dots only.
* Bytes: the pre-pass reads x once (plus the ``[S, N]`` status) and writes hi + lo, ``2·2·N·D``
  bytes; each tile program then reads 4 strips (hi and lo of its two column tiles) per row
  block, mostly from L2.
* Memory: hi and lo are a workspace of at most :data:`PRESPLIT_ELEMS` elements each
  (``S·Nc·D``, 128 MB in bf16): longer chunks are cut into row chunks (and, for very many sites,
  site groups), looped in Python from shapes alone (no host sync); the Gram kernel of every row
  chunk after the first adds into G (``ACCUM``), one more read of G per extra chunk.
* Accuracy: every ``d`` that needs <= 16 significant bits is ``hi + lo`` exactly (``c``'s grid
  makes centred rows short, see ``_center_kernel``), and bf16 products are exact in fp32.
  Each row block's dots are summed in their own fp32 tile that is added to G by an fp32 add:
  summing inside the matrix instructions' chain lost the split's accuracy on an H100 (the
  in-kernel path's ``ACC=2``). ``LOLO=False`` drops ``lo loᵀ`` (3 dots; ≤ 2^-16 of ``|d_i d_j|``
  per product: bf16 keeps 8 significant bits, so ``|lo| <= 2^-8·|d|``).
* Symmetry: diagonal tiles are averaged with their transpose, off-diagonal tiles stored with
  their mirror, so G is bitwise symmetric (the added chunks too: a symmetric G plus a symmetric
  tile stays symmetric).
* Determinism: fixed grid, fixed row order inside a program, no atomics; ``Σd`` partials summed
  by torch in a fixed order.
* Interpreter (``upcast=True``, the CPU tests): hi/lo are stored as bf16 too (their values are
  bf16 already, so the interpreter's truncating cast is exact) and converted to fp32 before the
  dots (the interpreter's bf16 ``tl.dot`` is wrong).
* Compiled for sm_90 without a GPU (Triton 3.9, bf16, ``LOLO=False``, the launch's
  specialization of a contiguous input; kept honest by
  ``tests/test_covariance_presplit.py::test_kernels_compile_for_sm90_without_a_gpu``); per warp
  and row block of the Gram loop:

  =======================  =========  =====  ============  =====  ======  ==============
  BT / warps / stages      registers  spill  loop instrs.  HGMMA  LDGSTS  shared memory
  =======================  =========  =====  ============  =====  ======  ==============
  64 / 8 / 3               252        0      228           12     16      192 KB
  64 / 8 / 4               252        0      228           12     16      256 KB (no fit)
  32 / 8 / 4               226        0      177           6      8       128 KB
  32 / 4 / 4               255        240 B  345           12     16      128 KB
  =======================  =========  =====  ============  =====  ======  ==============

  Both operands of every dot come from the pipeline's shared-memory buffers (wgmma with
  transposed A, no ``LDS`` of operands into registers). Each stage buffers 4 strips of
  ``BT × 128`` bf16: at BT = 64 a 4th stage needs 256 KB, over an H100's 227 KB a block, so the
  launcher caps the stages at what fits (:func:`_gram_stages`). G and the block tile are two
  128×128 fp32 tiles, 128 registers a thread at 8 warps but 256 at 4: 4 warps spill whatever
  the row block (summing the tile as two column halves one after the other did not help: ptxas
  overlaps one half's matrix instructions with the other half's adds, so both stay live).
  The pre-pass (32-row blocks, 4 warps): 145 registers, no spills, 680 instructions per 32×128
  block per warp and no int64 division (int32 row numbers): ~680 issue cycles for 24 KB of
  HBM traffic, several programs per SM, so memory bound.

Cost model, PREDICTED (not measured): FFN ``[N = 16384, D = 8192]`` bf16, one site, on an H100
SXM (~990 TFLOP/s dense bf16, ~3.35 TB/s HBM, 132 SMs, 50 MB L2)
-------------------------------------------------------------------------------------------
* Tensor time: 3 dots (``LOLO=False``) over the triangle, ``3·2·N·D²/2`` ≈ 3.3 TFLOP, ≈ 3.4 ms
  at peak (4 dots: 4.4 TFLOP, 4.5 ms). The in-kernel split path ran 22 ms (measured).
* Pre-pass: 268 MB of x read + 537 MB of hi/lo written ≈ 0.8 GB, ≈ 0.3 ms at HBM rate. Here
  ``N·D`` = 2^27 > :data:`PRESPLIT_ELEMS`: 2 row chunks, the second Gram pass re-reading G
  (268 MB, ~0.1 ms).
* L2: per 64-row block a tile program reads 4 strips × 64 rows × 128 columns × 2 bytes = 64 KB
  for 3 × 2·64·128² = 6.3 MFLOP of dots, ≈ 0.84 µs of one SM's share of the peak (~7.5 TFLOP/s):
  132 SMs then ask ~10 TB/s of L2, above what an H100's L2 is usually credited with (roughly
  5-7 TB/s). The L2 rate may bound the kernel (≈ 35 GB of L2 reads in all: ~5-7 ms), not the
  tensor cores; a wider tile (256×128, or a cluster sharing strips by TMA multicast) would halve
  the bytes per flop. hi/lo (537 MB) do not fit in L2: concurrent programs share a row block's
  strips only while they walk the rows together (a wave of ~132 programs touches ~2 MB per row
  block).
"""
from __future__ import annotations

import functools
import os
from contextlib import nullcontext

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_compat import fix_interpreter_index
from .triton_kernels import _lower_pair, _round_to_bf16, _row_offsets

__all__ = ["PRESPLIT_ELEMS", "presplit_partials"]

# interpreter only (the CPU tests): see _triton_compat. Read at import, as triton.jit does.
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    fix_interpreter_index()

# elements (S·Nc·D, padded) of each of the hi and lo workspaces: 128 MB each in bf16
PRESPLIT_ELEMS = 1 << 26

# every buffer the kernels write goes through this (tests swap in a NaN-filling version so a
# kernel that skips part of an output fails loudly instead of reading stale zeros)
_empty = torch.empty

# width of a G tile and of a row strip
BD = 128
# the pre-pass: rows per block, and row blocks per program (each program owns one 128-column
# strip of SPLIT_ROWS rows, so the Σd partials are [cdiv(N, SPLIT_ROWS), S, D], not one per block)
SPLIT_BT = 32
SPLIT_ROWS = 512
SPLIT_WARPS = 4


@triton.jit
def _split_rows_kernel(
    p_x, p_status, p_c, p_hi, p_lo, p_sum,
    N, Tk, D, NR, r_start,
    stride_xb, stride_xt, stride_xs, stride_xd,
    ROW_STEP,
    stride_ws, stride_wr, stride_pk, stride_ps,
    ROWS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """One (row group, column strip, site): rows [i_g·ROWS, (i_g+1)·ROWS) ∩ [0, NR) of the chunk
    that starts at row ``r_start``, columns [i_d·BD, (i_d+1)·BD).

    Writes ``hi``/``lo`` (bf16) for every workspace column (0 past D, so the Gram loop needs no
    column mask) and every row below ``NR`` (0 past the chunk's last row, so it needs no row
    mask either), and this strip's Σd over its valid rows to ``p_sum[i_g, s]``.
    """
    i_g, i_d, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_xs = p_x + i_s.to(tl.int64) * stride_xs
    p_xd = o_d.to(tl.int64) * stride_xd
    b_c = tl.load(p_c + i_s.to(tl.int64) * D + o_d, mask=m_d, other=0)
    o_w = i_s.to(tl.int64) * stride_ws + o_d
    b_S = tl.zeros([BT, BD], dtype=tl.float32)  # Σd per row slot: reduced once, after the loop
    l_lo = i_g * ROWS
    l_hi = tl.minimum(l_lo + ROWS, NR)
    for l0 in range(l_lo, l_hi, BT):
        o_l = l0 + tl.arange(0, BT)  # row within the chunk (the workspace row)
        o_r = r_start + o_l  # row of the chunk of x; int32 (rows < 2^31): no int64 division
        m_w = o_l < NR
        m_r = m_w & (o_r < N)
        o_b, o_t, _ = _row_offsets(o_r, Tk, ROW_STEP, stride_xb, stride_xt)
        o_row = o_b.to(tl.int64) * stride_xb + o_t.to(tl.int64) * stride_xt
        b_st = tl.load(p_status + i_s.to(tl.int64) * N + o_r, mask=m_r, other=0)
        m = (b_st == 1)[:, None] & m_d[None, :]
        b_x = tl.load(p_xs + o_row[:, None] + p_xd[None, :], mask=m, other=0)
        # the masked load reads 0 for rows that are not valid (a rejected row's NaN is never
        # loaded); the select makes their d 0, not −c (a select, not a product with the mask)
        b_dv = tl.where(m, b_x.to(tl.float32) - b_c[None, :], 0.0)
        b_h = _round_to_bf16(b_dv)
        b_l = _round_to_bf16(b_dv - b_h)  # d − hi is exact in fp32
        p_w = o_w[None, :] + o_l[:, None].to(tl.int64) * stride_wr
        # the values are bf16 already: the cast is exact (also under the interpreter, whose
        # fp32 -> bf16 cast truncates)
        tl.store(p_hi + p_w, b_h.to(tl.bfloat16), mask=m_w[:, None])
        tl.store(p_lo + p_w, b_l.to(tl.bfloat16), mask=m_w[:, None])
        b_S += b_dv
    tl.store(p_sum + i_g.to(tl.int64) * stride_pk + i_s.to(tl.int64) * stride_ps + o_d,
             tl.sum(b_S, axis=0), mask=m_d)


@triton.jit
def _block_tile(b_ah, b_al, b_bh, b_bl, UPCAST: tl.constexpr, LOLO: tl.constexpr):
    """One row block's Σ d_a d_bᵀ from its hi/lo strips ([BT, BM] and [BT, BN]), fp32.

    The block's own tile, added to G by the caller with an fp32 add: summing every block inside
    the matrix instructions' accumulation lost the split's accuracy on an H100. Small terms
    first; the chain starts from zero and ends in a dot, so Triton does not fold the caller's
    add back into the dots.
    """
    if UPCAST:  # interpreter: bf16 products are exact in fp32, its bf16 dot is not
        b_ah, b_al = b_ah.to(tl.float32), b_al.to(tl.float32)
        b_bh, b_bl = b_bh.to(tl.float32), b_bl.to(tl.float32)
    b_t = tl.dot(tl.trans(b_ah), b_bl, input_precision="ieee")
    b_t = tl.dot(tl.trans(b_al), b_bh, b_t, input_precision="ieee")
    if LOLO:
        b_t = tl.dot(tl.trans(b_al), b_bl, b_t, input_precision="ieee")
    return tl.dot(tl.trans(b_ah), b_bh, b_t, input_precision="ieee")


@triton.jit
def _gram_presplit_kernel(
    p_hi, p_lo, p_G,
    D, NR,
    stride_ws, stride_wr,
    UPCAST: tl.constexpr, LOLO: tl.constexpr, ACCUM: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr,
):
    """One (tile of G's upper triangle, site): G[m-tile, n-tile] (+)= Σ over rows [0, NR) of the
    pre-split rows; NR a multiple of BT (the workspace rows past the chunk are zeros).

    Grid (NTILE(NTILE+1)/2, S). ACCUM: add to the tile already in G (row chunks after the first).
    Registers: G and the block tile are two [BD, BD] fp32 tiles, 2·BD²/(32·num_warps) registers
    a thread: 128 at 8 warps, 256 at 4, more than a thread has (4 warps spill, whatever BT).
    """
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    i_n, i_m = _lower_pair(i_t)  # i_m <= i_n: the upper triangle by (row tile m, column tile n)
    o_m = i_m * BD + tl.arange(0, BD)
    o_n = i_n * BD + tl.arange(0, BD)
    # a block's element offsets within the site's workspace, loop invariant (int32: each
    # workspace has at most PRESPLIT_ELEMS elements); only the scalar row varies from block to
    # block, so no per-element 64-bit pointer is live across the loop (4 such strips of 64-bit
    # pointers cost ~20 registers a thread and spilled more at 4 warps)
    o_i = tl.arange(0, BT) * stride_wr
    o_a = o_i[:, None] + o_m[None, :]
    o_b = o_i[:, None] + o_n[None, :]
    p_his = p_hi + i_s.to(tl.int64) * stride_ws
    p_los = p_lo + i_s.to(tl.int64) * stride_ws
    b_G = tl.zeros([BD, BD], dtype=tl.float32)
    # unmasked, contiguous strips: Triton pipelines them through cp.async into shared memory,
    # where the dots read them
    for r0 in range(0, NR, BT):
        o_r = r0 * stride_wr
        b_ah = tl.load(p_his + o_r + o_a)
        b_al = tl.load(p_los + o_r + o_a)
        b_bh = tl.load(p_his + o_r + o_b)
        b_bl = tl.load(p_los + o_r + o_b)
        b_G = b_G + _block_tile(b_ah, b_al, b_bh, b_bl, UPCAST, LOLO)

    p_Gs = p_G + i_s.to(tl.int64) * D * D
    m_G = (o_m < D)[:, None] & (o_n < D)[None, :]
    p_mn = p_Gs + o_m[:, None].to(tl.int64) * D + o_n[None, :]
    if i_m == i_n:
        # a diagonal tile is not bitwise symmetric by itself (hi·lo vs lo·hi round differently,
        # and a dot's summation order may differ between (i, j) and (j, i)): averaging with the
        # transpose is exact on the diagonal and makes it so
        b_G = (b_G + tl.trans(b_G)) * 0.5
    if ACCUM:
        # G is exactly symmetric already, so old + new stays so, mirrored tiles included
        b_G = tl.load(p_mn, mask=m_G, other=0) + b_G
    tl.store(p_mn, b_G, mask=m_G)
    if i_m != i_n:
        tl.store(p_Gs + o_n[None, :].to(tl.int64) * D + o_m[:, None], b_G, mask=m_G)


@functools.cache
def _smem_bytes(device: torch.device) -> int:
    """Shared memory one block may opt into on ``device`` (232448 bytes on an H100)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _gram_stages(wanted: int, BT: int, rows: int, smem: int | None) -> int:
    """The Gram loop's pipeline stages: ``wanted``, but never more than the loop's row blocks
    (deeper pipelines over short loops raced on an H100: ``triton_update.pipeline_stages``) nor
    than fit in ``smem`` bytes of shared memory (None: no limit, the interpreter).

    Each stage buffers 4 strips of ``BT × 128`` bf16: 64 KB at BT = 64, so an H100 (227 KB a
    block) holds 3 stages, not 4 (a 4-stage launch fails for lack of shared memory).
    """
    stages = min(wanted, rows // BT)
    if smem is not None:
        stages = min(stages, smem // (4 * BT * BD * 2))
    return max(1, stages)


def _chunks(S: int, N: int, Dp: int, BT: int) -> tuple[int, int, int]:
    """(sites per group, row chunks, padded rows per chunk) with ``sites·rows·Dp`` <=
    :data:`PRESPLIT_ELEMS` wherever one site's BT rows fit; chunks balanced, multiples of BT."""
    budget = max(1, PRESPLIT_ELEMS // Dp)  # (site, row) pairs per workspace
    rows_all = triton.cdiv(N, BT) * BT
    sites = min(S, budget // rows_all) if budget >= rows_all else 1
    cap = max(BT, budget // sites // BT * BT)
    n_chunks = triton.cdiv(rows_all, cap)
    rows = triton.cdiv(triton.cdiv(N, n_chunks), BT) * BT  # <= cap: cap is a multiple of BT
    return sites, triton.cdiv(N, rows), rows  # rounding up may leave a chunk fewer


def presplit_partials(x: Tensor, status: Tensor, c: Tensor, N: int, Tk: int, common: dict, *,
                      BT: int, num_warps: int, num_stages: int, lolo: bool,
                      upcast: bool) -> tuple[Tensor, Tensor]:
    """``(G [S, D, D], s [S, D])``: ``Σ d dᵀ`` (fp32, exactly symmetric) and ``Σ d`` (fp32) over
    the valid rows (``status == 1``) of ``x: [B, T, S, D]`` (bf16/fp16, any strides, never
    copied), ``d = x − c`` computed in fp32.

    Row ``r < N`` of site ``s`` is ``x[r // Tk, (r % Tk)·ROW_STEP, s]``; ``status: [S, N]`` int8
    (1 valid, 2 rejected, 0 masked out: the mask is read only through it), ``c: [S, D]`` fp32
    contiguous. ``common``: the launcher's strides and ``ROW_STEP`` (its mask entries are
    ignored). ``BT``, ``num_warps``, ``num_stages``: the Gram kernel's row block and launch
    (``num_stages`` capped at a chunk's row blocks); ``lolo``: the ``lo loᵀ`` dot; ``upcast``:
    the interpreter's fp32 dots. No host sync: everything follows from shapes.
    """
    S, D = x.shape[2], x.shape[3]
    dev = x.device
    f32 = {"dtype": torch.float32, "device": dev}
    if N == 0 or S == 0 or D == 0:
        return torch.zeros(S, D, D, **f32), torch.zeros(S, D, **f32)
    BT = int(BT)
    NTILE = triton.cdiv(D, BD)
    Dp = NTILE * BD  # workspace columns: whole strips, zero past D
    sites, n_chunks, rows = _chunks(S, N, Dp, BT)
    # each chunk's rows padded to whole Gram blocks; the pre-pass writes the padding as zeros
    padded = [triton.cdiv(min(rows, N - k * rows), BT) * BT for k in range(n_chunks)]
    groups = [triton.cdiv(nr, SPLIT_ROWS) for nr in padded]
    G = _empty(S, D, D, **f32)
    s_ws = _empty(sum(groups), S, D, **f32)
    hi = _empty(sites, rows, Dp, dtype=torch.bfloat16, device=dev)
    lo = _empty(sites, rows, Dp, dtype=torch.bfloat16, device=dev)
    smem = _smem_bytes(dev) if x.is_cuda else None
    strides = {k: common[k] for k in ("stride_xb", "stride_xt", "stride_xs", "stride_xd", "ROW_STEP")}
    with torch.cuda.device(dev) if x.is_cuda else nullcontext():
        for s0 in range(0, S, sites):
            sg = min(sites, S - s0)
            xs, cs, sts, Gs = x[:, :, s0:s0 + sg], c[s0:s0 + sg], status[s0:s0 + sg], G[s0:s0 + sg]
            k0 = 0
            for k, (nr, n_groups) in enumerate(zip(padded, groups)):
                r_start = k * rows
                _split_rows_kernel[(n_groups, NTILE, sg)](
                    xs, sts, cs, hi, lo, s_ws[k0:, s0:],
                    N, Tk, D, nr, r_start, **strides,
                    stride_ws=rows * Dp, stride_wr=Dp, stride_pk=S * D, stride_ps=D,
                    ROWS=SPLIT_ROWS, BT=SPLIT_BT, BD=BD, num_warps=SPLIT_WARPS)
                stages = _gram_stages(num_stages, BT, nr, smem)
                _gram_presplit_kernel[(NTILE * (NTILE + 1) // 2, sg)](
                    hi, lo, Gs, D, nr, rows * Dp, Dp,
                    UPCAST=bool(upcast), LOLO=bool(lolo), ACCUM=k > 0, BT=BT, BD=BD,
                    num_warps=num_warps, num_stages=stages)
                k0 += n_groups
    # fixed-order sum of the row groups' Σd (a plain dim reduction: deterministic)
    return G, s_ws.sum(0)
