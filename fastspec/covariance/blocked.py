"""The torch covariance update: row blocks through one reused buffer, Gram by BLAS ``syrk``.

Design envelope: any device (CPU: float32/float64 BLAS ``syrk`` from SciPy, one triangle;
CUDA: ``baddbmm``, cuBLAS), input ``x: [B, T, S, D]`` of any strides and float dtype, products
in float32 or float64 (``policy.py`` decides), totals in float64. Work per update: one copy of
each row into a buffer of at most :data:`BLOCK_ELEMS` elements (converting, centring and zeroing
padded rows on the way), then ``N·D²/2`` multiply-adds per site on CPU (``N·D²`` on CUDA). No
temporary grows with the batch: the buffer and the float64 Gram workspace are allocated once per
thread and reused by every later update of any accumulator (:func:`shared_workspace`).

Per block of rows (rows are the kept ``(b, t)`` pairs, each site's rows ``[R, D]``):

1. ``buf[s, r, :] = x[b, t, s, :] − c[s]`` in the product dtype, padded rows (``mask`` False) set
   to 0. ``c`` is a per-update shift (centred accumulators; ``0`` for raw sums), so the products
   are formed about a point near the data whatever its mean.
2. ``s_b[s] = Σ_r buf[s, r, :]``: needed anyway for ``Σx``; it is finite iff every row of the
   block is (a NaN or ±Inf anywhere propagates into it), so the NaN/Inf check of a finite block
   costs O(S·D). On CPU a block that fails it takes the exact path: rows with a non-finite value
   are found, counted as rejected and zeroed, and the block's sums recomputed. On CUDA (where a
   branch on a device value would sync) every block takes the exact path, which is one more read
   of the buffer (O(N·D), against the ``N·D²`` of the products).
3. ``G[s] += buf[s]ᵀ buf[s]``: float64 products straight into the float64 workspace, or float32
   products of the block added into it.

The caller merges the update's ``(n, c, s, G)`` (``G`` exactly symmetric) into its totals.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor

BLOCK_ELEMS = 1 << 20
"""Elements of the block buffer on CPU (8 MiB in float64): large enough that BLAS runs at full
speed, and never scaling with the batch."""

CUDA_BLOCK_ELEMS = 1 << 22
"""On CUDA (32 MiB in float64): fewer, larger GEMMs, so launches stay a small part of the cost."""

FP32_FLUSH_ROWS = 4096
"""Float32 products are summed over at most this many rows before joining the float64 total
(bounds the float32 summation error at ~sqrt(4096)·eps32 ≈ 4e-6 of an entry, typically less)."""

CENTER_ROWS = 64
"""Rows the shift ``c`` is taken from (the first valid ones of the update)."""


class Workspace:
    """Buffers reused across updates (allocated on first use, grown when a larger one is asked)."""

    def __init__(self):
        self._bufs: dict[tuple, Tensor] = {}
        # the views handed out, by (buffer key, shape): a repeated update gets the same view
        # object back without dispatching a slice and a view (host time on every call)
        self._views: dict[tuple, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (name, dtype, device)
        view = self._views.get((key, shape))
        if view is not None:
            return view
        numel = 1
        for d in shape:
            numel *= d
        t = self._bufs.get(key)
        if t is None or t.numel() < numel:
            t = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
            self._views = {k: v for k, v in self._views.items() if k[0] != key}  # views of the old buffer
        if len(self._views) >= 256:  # shapes that keep changing (ragged batches): no unbounded growth
            self._views.clear()
        view = self._views[(key, shape)] = t[:numel].view(shape)
        return view


_local = threading.local()


def shared_workspace() -> Workspace:
    """This thread's workspace, shared by every accumulator: updates run one after another on a
    thread (and, on CUDA, in stream order), so one buffer per device and dtype serves them all."""
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = Workspace()
    return ws


_blas_pool = None


def _blas_threads_like_torch():
    """Context in which SciPy's BLAS runs on ``torch.get_num_threads()`` threads, as torch would
    (without it OpenBLAS takes every core, e.g. 2 against torch's 1 in a one-thread benchmark).
    A no-op without ``threadpoolctl``."""
    global _blas_pool
    if _blas_pool is None:
        try:
            import scipy.linalg.blas  # noqa: F401  (load SciPy's BLAS before looking for it)
            from threadpoolctl import ThreadpoolController

            _blas_pool = ThreadpoolController().select(user_api="blas")
        except Exception:  # threadpoolctl missing, or a BLAS it cannot drive
            _blas_pool = False
    if _blas_pool is False:
        return contextlib.nullcontext()
    return _blas_pool.limit(limits=torch.get_num_threads())


def _use_syrk(device: torch.device) -> bool:
    """SciPy's BLAS syrk for CPU tensors; CUDA (and anything else) goes through torch."""
    return device.type == "cpu"


def _syrk_into(G: Tensor, a: Tensor, beta: float) -> None:
    """``G[s] = beta·G[s] + a[s]ᵀ a[s]`` on its lower triangle (CPU float32/float64, SciPy BLAS).

    ``a[s]`` is a C-contiguous ``[R, D]`` block, i.e. a Fortran ``[D, R]`` matrix ``aᵀ``; syrk with
    ``trans=0`` forms ``aᵀ·a`` into the upper triangle of the Fortran view of ``G[s]``, which is
    the lower triangle of ``G[s]`` as torch sees it.
    """
    from scipy.linalg import blas

    fn = blas.dsyrk if a.dtype == torch.float64 else blas.ssyrk
    an, gn = a.numpy(), G.numpy()
    for s in range(a.shape[0]):
        out = fn(1.0, an[s].T, beta=beta, c=gn[s].T, trans=0, lower=0, overwrite_c=1)
        if out.ctypes.data != gn[s].ctypes.data:  # SciPy copied c (it does not for a Fortran-ordered one)
            gn[s].T[...] = out


def _symmetrize_lower(G: Tensor) -> None:
    """Copy the lower triangle of every ``G[s]`` onto its upper triangle, in place."""
    upper = torch.ones(G.shape[-2:], dtype=torch.bool, device=G.device).triu(1)
    G.copy_(torch.where(upper, G.mT, G))


def _shift(x: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Per-site shift ``c [S, D]``: mean of up to CENTER_ROWS kept, finite rows (0 if none).

    Rounded to the input dtype first, so that ``x − c`` of nearby rows is formed exactly."""
    B, T, S, D = x.shape
    per_seq = max(1, -(-CENTER_ROWS // B))  # the first rows of every sequence
    rows = x[:, :per_seq].reshape(-1, S, D)[:CENTER_ROWS].to(dtype)
    ok = torch.isfinite(rows).all(-1)  # [r, S]
    if mask is not None:
        ok &= mask[:, :per_seq].reshape(-1)[:CENTER_ROWS, None]
    cnt = ok.sum(0).clamp_min(1).to(dtype)
    c = torch.where(ok[..., None], rows, 0).sum(0) / cnt[:, None]
    return c.to(x.dtype).to(dtype) if x.dtype != torch.float64 else c


def _reject_rows(a: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor]:
    """The exact row-by-row path of one block ``a: [S, R, D]`` (padded rows already 0).

    Zeroes, per site, every row holding a NaN/Inf; returns ``(valid rows [S], rejected rows [S])``
    (a padded row is neither)."""
    ok = torch.isfinite(a).all(-1)  # [S, R]
    a.masked_fill_(~ok[..., None], 0)
    if m is None:
        return ok.sum(1), (~ok).sum(1)
    return (ok & m).sum(1), (~ok & m).sum(1)


def _blocks(B: int, T: int, rows: int):
    """``(b0, b1, t0, t1)`` tiles of the ``[B, T]`` row grid with at most ``rows`` rows each."""
    if T >= rows:
        for b in range(B):
            for t0 in range(0, T, rows):
                yield b, b + 1, t0, min(T, t0 + rows)
    else:
        nb = max(1, rows // T)
        for b0 in range(0, B, nb):
            yield b0, min(B, b0 + nb), 0, T


def accumulate(x: Tensor, mask: Tensor | None, row_step: int, center: bool, products: torch.dtype,
               ws: Workspace) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Sums of one update of rows ``x: [B, T, S, D]`` (``mask: [B, T]`` bool or None).

    Returns ``(n [S] int64, c [S, D], s [S, D] float64, G [S, D, D] float64, rejected [S] int64)``
    about the shift ``c`` (zero when not ``center``): ``s = Σ(x − c)``, ``G = Σ(x − c)(x − c)ᵀ`` over
    valid rows. ``G`` is a view of the workspace, valid until the next call.
    """
    x = x.detach()  # the buffers are not part of any autograd graph
    if row_step > 1:
        x = x[:, ::row_step]
        mask = None if mask is None else mask[:, ::row_step]
    B, T, S, D = x.shape
    dev = x.device
    f64 = dict(dtype=torch.float64, device=dev)
    cpu = _use_syrk(dev)
    c = _shift(x, mask, products) if center else None
    G = ws.get("G", (S, D, D), **f64)
    G.zero_()
    s_tot = torch.zeros(S, D, **f64)
    n = torch.zeros(S, dtype=torch.int64, device=dev)
    rejected = torch.zeros(S, dtype=torch.int64, device=dev)
    rows = max(1, (BLOCK_ELEMS if cpu else CUDA_BLOCK_ELEMS) // max(1, S * D))
    Gb = None if products == torch.float64 else ws.get("Gb", (S, D, D), torch.float32, dev)
    pending = 0  # rows summed into the float32 Gb and not yet added to G
    with _blas_threads_like_torch() if cpu else contextlib.nullcontext():
        for b0, b1, t0, t1 in _blocks(B, T, rows):
            R = (b1 - b0) * (t1 - t0)
            buf = ws.get("buf", (S, b1 - b0, t1 - t0, D), products, dev)
            buf.copy_(x[b0:b1, t0:t1].permute(2, 0, 1, 3))
            a = buf.view(S, R, D)
            if c is not None:
                a.sub_(c[:, None, :])
            m = None if mask is None else mask[b0:b1, t0:t1].reshape(R)
            if m is not None and cpu and bool(m.all()):
                m = None  # nothing padded: skip the fill (on CUDA this test would sync)
            if m is not None:
                a.masked_fill_(~m[None, :, None], 0)
            s_b = a.sum(1, dtype=torch.float64)
            if cpu and bool(torch.isfinite(s_b).all()):
                n += R if m is None else m.sum()
            else:
                n_ok, n_bad = _reject_rows(a, m)
                n += n_ok
                rejected += n_bad
                s_b = a.sum(1, dtype=torch.float64)
            s_tot += s_b
            if Gb is None:  # float64 products straight into the float64 total
                if cpu:
                    _syrk_into(G, a, 1.0)
                else:
                    G.baddbmm_(a.mT, a)
                continue
            if cpu:
                _syrk_into(Gb, a, 1.0 if pending else 0.0)
            elif pending:
                Gb.baddbmm_(a.mT, a)
            else:
                torch.bmm(a.mT, a, out=Gb)
            pending += R
            if pending >= FP32_FLUSH_ROWS:
                G.add_(Gb)
                pending = 0
    if pending:
        G.add_(Gb)
    if cpu:
        _symmetrize_lower(G)
    if c is None:
        c = torch.zeros(S, D, dtype=products, device=dev)
    return n, c, s_tot, G, rejected
