"""Exact merge of per-rank :class:`~fastspec.Covariance` accumulators with ``torch.distributed``.

Sums about a common shift add exactly, so the merge is three kinds of all-reduce:

1. ``n`` and ``rejected`` (int64), and, for centred state, ``Σ_r n_r mean_r`` to get the global
   mean ``μ``;
2. each rank's rows as sums about ``μ`` (about 0 for raw sums): ``s_r = n_r (mean_r − μ)`` and
   ``G_r = M2_r + n_r (mean_r − μ)(mean_r − μ)ᵀ`` (``Covariance._sums_about``);
3. ``Σ s_r`` and ``Σ G_r``, merged into a fresh accumulator by ``Covariance._merge_sums``: the
   same code that merges every update, which subtracts the (round-off sized) ``s sᵀ/N``.

Every ``G_r`` is a PSD matrix about the global mean, so nothing cancels when a channel's mean is
far larger than its spread (going through raw ``Σxxᵀ − N μμᵀ`` would lose such channels).

:func:`all_reduce_totals_` is the same merge written into one ``D × D`` buffer in place (a
probe's wide FFN site, whose memory plan has no room for the copies a new accumulator takes).
"""
from __future__ import annotations

import torch


def is_distributed() -> bool:
    """True when ``torch.distributed`` is initialised with more than one rank."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def all_reduce_covariance(cov, group=None):
    """:meth:`Covariance.all_reduce`: a new Covariance with the rows of every rank in ``group``.

    (``covariance.py`` calls this module, never the other way round: the new accumulator is
    built as ``type(cov)(...)``.)"""
    dist = torch.distributed
    if cov._state is None:
        raise RuntimeError("all_reduce: this rank's accumulator has seen no data; every rank must "
                           "update every site before the merge (or none may)")
    st = cov._state
    SUM = dist.ReduceOp.SUM
    n, rejected, shift = _counts_and_mean(st, cov.track_mean, group)
    s, G = cov._sums_about(shift)
    dist.all_reduce(s, op=SUM, group=group)
    dist.all_reduce(G, op=SUM, group=group)
    out = type(cov)((*cov.sites, cov.D), device=cov.device, track_mean=cov.track_mean, settings=cov.settings)
    out._merge_sums(n, torch.zeros_like(s) if shift is None else shift, s, G, rejected)
    return out


def _counts_and_mean(st: dict, track_mean: bool, group):
    """Step 1: the global ``n`` and ``rejected`` and, for centred state, the global mean ``μ``."""
    dist = torch.distributed
    SUM = dist.ReduceOp.SUM
    n, rejected = st["n"].clone(), st["rejected"].clone()
    dist.all_reduce(n, op=SUM, group=group)
    dist.all_reduce(rejected, op=SUM, group=group)
    shift = None
    if track_mean:
        shift = st["mean"] * st["n"].double()[:, None]
        dist.all_reduce(shift, op=SUM, group=group)
        shift /= n.double().clamp_min(1)[:, None]
    return n, rejected, shift


def all_reduce_totals_(st: dict, work, track_mean: bool, group):
    """The merge of :func:`all_reduce_covariance` into ``work``, in place: ``work`` holds this rank's
    ``D × D`` totals ``[S, D, D]`` (``m2``/``gram`` of the state ``st``, or a copy; float64 or
    float32) and leaves holding every rank's, ``M2 = Σ_r G_r − s sᵀ/N`` about the global mean
    (centred) or ``Σ_r gram_r`` (raw). Returns the global ``(n, rejected)``; ``st`` is not changed
    unless ``work`` is its own totals. A collective, as :func:`all_reduce_covariance`."""
    dist = torch.distributed
    n, rejected, mu = _counts_and_mean(st, track_mean, group)
    if track_mean:
        s = (st["mean"] - mu) * st["n"].double()[:, None]  # Σ(x − μ) of this rank's rows
        # G_r = M2_r + n_r δ δᵀ with δ = mean_r − μ: the rows as sums about the global mean
        delta = (st["mean"] - mu).to(work.dtype)
        work.baddbmm_(delta[:, :, None] * st["n"].to(work.dtype)[:, None, None], delta[:, None, :])
        dist.all_reduce(work, group=group)
        dist.all_reduce(s, group=group)
        # M2 = Σ G_r − s sᵀ/N (s is round-off sized: the shift is the global mean)
        a = (s / n.double().clamp_min(1).sqrt()[:, None]).to(work.dtype)
        work.baddbmm_(-a[:, :, None], a[:, None, :])
    else:
        dist.all_reduce(work, group=group)
    return n, rejected
