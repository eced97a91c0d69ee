"""The in-place covariance update: blocks of rows multiplied straight into the totals.

Design envelope: wide sites whose totals are most of a memory budget, an FFN layer's input
(``d_ff`` = 8,192 to 28,672) above all. The update allocates no ``D × D`` temporary: only one
block of at most :func:`block_rows` rows ``[S, R, D]`` in the totals' dtype (at most
:data:`BLOCK_BYTES`) and a few ``[S, D]`` vectors, so its workspace is known before it runs
(:func:`workspace_bytes`, what ``fastspec.probe.plan`` counts). Totals in float64 (float64
products: exact for 16- and 32-bit input) or float32 (float32 products, TF32 off). Any device:
torch's ``baddbmm_`` (BLAS, cuBLAS), no kernel of its own.

Where it stops being good: each block is one GEMM that reads and writes the whole ``S·D²`` totals,
so a block of ``R`` rows does ``2·R`` flops per total it moves. It is bandwidth-bound below about
``R = 160`` (float64 on an H100: 67 TFLOP/s against 3.35 TB/s, predicted), which is why a block
is as large as :data:`BLOCK_BYTES` lets it be (585 rows at ``D = 14,336`` in float64). The sampled
FFN rows of one capture (a few hundred at the default sampling) are one block; an update of
16,384 rows at ``D = 8,192`` runs 19 GEMMs, where the Triton kernels run one pass (predicted
5× slower there: use the default backend where memory allows).

Per update of rows ``x: [B, T, S, D]`` (``mask: [B, T]``), with centring (``track_mean``):

1. a shift ``c [S, D]``: the mean of the first kept, finite rows (:func:`_shift`), rounded to
   the input dtype, so that ``x − c`` of nearby rows is formed exactly;
2. per block: ``buf = x − c`` in the totals' dtype, padded rows zeroed, rows holding a NaN/Inf
   zeroed and counted as rejected; ``s += Σ buf`` (float64); ``M2 += bufᵀ buf`` in place;
3. (``ops.merge_sums`` with ``G=None``) the Chan correction in place: ``M2 += −s sᵀ/n_b +
   δ δᵀ·n_a n_b/n``, ``mean += δ·n_b/n``, ``n += n_b``, exact for any shift.

Raw sums (``track_mean=False``) skip the shift and the correction: ``gram += bufᵀ buf``,
``sum += s``. The reference beside it is ``reference.py`` (the float64 sums of the same rows);
``tests/test_covariance_inplace.py`` compares the two.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import blocked

BLOCK_BYTES = 64 << 20
"""Bytes of the row block (64 MiB): rows enough for a GEMM that is not bandwidth-bound on the
widest FFN (292 rows at ``D = 28,672`` in float64), small beside the totals it serves (1% of a
``14,336²`` float64 matrix)."""

CENTER_ROWS = 64
"""Rows the shift is taken from: the first kept, finite ones among the first ``CENTER_ROWS``
tokens of the first sequences (at most ``2·CENTER_ROWS`` rows are read)."""

VECTORS = 8
"""``[S, D]`` float64-sized vectors the update holds besides the block (shift, sums, the Chan
correction's vectors and their stacks): part of :func:`workspace_bytes`."""


BLOCK_ROWS = (256, 4096)
"""A block has ``D`` rows (its GEMM then moves as many bytes of rows as of totals), at least 256
(a GEMM of fewer is bandwidth-bound), at most 4096 (compute-bound long before), and never more
than :data:`BLOCK_BYTES`: 256 rows at ``D = 48``, 512 at 512, 585 at 14,336 in float64."""


def block_rows(S: int, D: int, itemsize: int) -> int:
    """Rows per block for ``S`` sites of width ``D`` in totals of ``itemsize`` bytes."""
    lo, hi = BLOCK_ROWS
    return max(1, min(BLOCK_BYTES // max(1, S * D * itemsize), max(lo, min(hi, D))))


def workspace_bytes(S: int, D: int, itemsize: int) -> int:
    """An upper bound of the bytes one update allocates beside the totals, whatever the rows:
    the block ``[S, R, D]`` (``R`` = :func:`block_rows`), its row sums and flags ``[S, R]``, the
    shift's rows (at most ``2·CENTER_ROWS``: a copy in the totals' dtype, ``isfinite``'s
    temporaries, the masked copy) and :data:`VECTORS` ``[S, D]`` vectors. No ``[S, R, D]``
    temporary besides the block: a row's NaN/Inf is found from its sum."""
    R = block_rows(S, D, itemsize)
    shift = 2 * CENTER_ROWS * S * D * (8 + 3 * itemsize + 3)
    return S * R * D * itemsize + S * R * (itemsize + 8) + shift + VECTORS * S * D * 8


def _shift(x: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Per-site shift ``c [S, D]``: the mean of the kept, finite rows among the first
    ``CENTER_ROWS`` tokens of the first sequences (0 if none), rounded to the input dtype, so
    that ``x − c`` of nearby rows is formed exactly. Reads at most ``2·CENTER_ROWS`` rows,
    however large the batch (``blocked._shift`` reads one row of every sequence)."""
    B, T, S, D = x.shape
    per_seq = min(T, CENTER_ROWS)
    nseq = min(B, -(-CENTER_ROWS // per_seq))
    rows = x[:nseq, :per_seq].reshape(-1, S, D).to(dtype)
    ok = torch.isfinite(rows).all(-1)  # [r, S]
    if mask is not None:
        ok &= mask[:nseq, :per_seq].reshape(-1)[:, None]
    cnt = ok.sum(0).clamp_min(1).to(dtype)
    c = torch.where(ok[..., None], rows, 0).sum(0) / cnt[:, None]
    return c.to(x.dtype).to(dtype) if x.dtype != torch.float64 else c


def _reject_rows(a: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor]:
    """``blocked._reject_rows`` without its ``[S, R, D]`` flags: a row holds a NaN/Inf iff its sum
    is not finite (NaN and ±Inf propagate; a finite row overflows only past ``max/D``, far beyond
    any activation). Zeroes those rows of ``a: [S, R, D]``; returns ``(valid [S], rejected [S])``
    (a padded row, already zero, is neither)."""
    ok = torch.isfinite(a.sum(-1))  # [S, R]
    a.masked_fill_(~ok[..., None], 0)
    if m is None:
        return ok.sum(1), (~ok).sum(1)
    return (ok & m).sum(1), (~ok & m).sum(1)


@contextlib.contextmanager
def _no_tf32(device: torch.device):
    """float32 products in float32: a user's ``allow_tf32`` (or ``set_float32_matmul_precision``)
    must not round the probe's products to TF32's 10-bit mantissa."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = old


def accumulate(second: Tensor, x: Tensor, mask: Tensor | None, row_step: int, center: bool
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Add ``Σ(x − c)(x − c)ᵀ`` of rows ``x: [B, T, S, D]`` (``mask: [B, T]`` bool or None, every
    ``row_step``-th token) to the ``[S, D, D]`` totals ``second`` in place (float64 or float32),
    and return the rest of the update's sums about the shift ``c``: ``(n [S] int64, c [S, D],
    s = Σ(x − c) [S, D] float64, rejected [S] int64)``, for ``ops.merge_sums`` to merge without a
    ``G`` (it is in ``second`` already). ``c = 0`` when not ``center`` (raw sums)."""
    x = x.detach()
    if row_step > 1:
        x = x[:, ::row_step]
        mask = None if mask is None else mask[:, ::row_step]
    B, T, S, D = x.shape
    dtype, dev = second.dtype, x.device
    cpu = dev.type == "cpu"
    s = torch.zeros(S, D, dtype=torch.float64, device=dev)
    nb = torch.zeros(S, dtype=torch.int64, device=dev)
    rejected = torch.zeros(S, dtype=torch.int64, device=dev)
    if B * T == 0:
        return nb, torch.zeros(S, D, dtype=dtype, device=dev), s, rejected
    c = _shift(x, mask, dtype) if center else torch.zeros(S, D, dtype=dtype, device=dev)
    R = block_rows(S, D, second.element_size())
    with _no_tf32(dev):
        for b0, b1, t0, t1 in blocked._blocks(B, T, R):
            rows = (b1 - b0) * (t1 - t0)
            # one strided copy converts and lays the rows out per site (no intermediate copy)
            a = torch.empty(S, b1 - b0, t1 - t0, D, dtype=dtype, device=dev)
            a.copy_(x[b0:b1, t0:t1].permute(2, 0, 1, 3))
            a = a.view(S, rows, D)
            if center:
                a.sub_(c[:, None, :])
            m = None if mask is None else mask[b0:b1, t0:t1].reshape(rows)
            if m is not None and cpu and bool(m.all()):
                m = None  # nothing padded: skip the fill (on CUDA this test would sync)
            if m is not None:
                a.masked_fill_(~m[None, :, None], 0)
            # sums in the totals' dtype (a dtype= sum may cast the whole block first)
            s_b = a.sum(1)
            if cpu and bool(torch.isfinite(s_b).all()):
                nb += rows if m is None else m.sum()
            else:  # a NaN/Inf somewhere (or CUDA, where the test would sync): row by row
                ok, bad = _reject_rows(a, m)
                nb += ok
                rejected += bad
                s_b = a.sum(1)
            s += s_b
            second.baddbmm_(a.mT, a)
            del a
    return nb, c, s, rejected
