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
    n, rejected = st["n"].clone(), st["rejected"].clone()
    dist.all_reduce(n, op=SUM, group=group)
    dist.all_reduce(rejected, op=SUM, group=group)
    shift = None
    if cov.track_mean:
        shift = st["mean"] * st["n"].double()[:, None]
        dist.all_reduce(shift, op=SUM, group=group)
        shift /= n.double().clamp_min(1)[:, None]
    s, G = cov._sums_about(shift)
    dist.all_reduce(s, op=SUM, group=group)
    dist.all_reduce(G, op=SUM, group=group)
    out = type(cov)((*cov.sites, cov.D), device=cov.device, track_mean=cov.track_mean, settings=cov.settings)
    out._merge_sums(n, torch.zeros_like(s) if shift is None else shift, s, G, rejected)
    return out
