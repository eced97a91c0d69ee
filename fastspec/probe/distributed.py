"""Exact merge of per-rank covariance accumulators with ``torch.distributed`` (SPEC §1).

Raw sums (``track_mean=False``: ``n, Σx, Σxxᵀ``) add, so one all-reduce each is exact.

The centered state ``(n, mean, M2)`` of ``track_mean=True`` does not add. It is merged about a
common shift, the global mean ``μ = Σ_r n_r mean_r / N`` (one all-reduce first), using

    M2 = Σ_r [ M2_r + n_r (mean_r − μ)(mean_r − μ)ᵀ ]

which is Chan's pairwise correction generalised to R parts. Every term is a PSD matrix about
the true mean, so nothing cancels (going through raw ``Σxxᵀ − N μμᵀ`` would lose the
large-mean channels that SPEC §1 warns about). The rank's own accumulator is left untouched:
the result is a new :class:`~fastspec.Covariance` holding the global rows.
"""
from __future__ import annotations

import torch

from ..covariance import Covariance


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def all_reduce_covariance(cov: Covariance, group=None) -> Covariance:
    """A new Covariance with the rows of every rank in ``group`` (a collective: call on all ranks)."""
    dist = torch.distributed
    sd = cov.state_dict()
    if sd["state"] is None:
        raise RuntimeError("all_reduce_covariance: this rank's accumulator has seen no data; every "
                           "rank must update every site before the merge (or none may)")
    st = {k: v.detach().clone() for k, v in sd["state"].items()}
    SUM = dist.ReduceOp.SUM
    for k in ("n", "rejected"):
        dist.all_reduce(st[k], op=SUM, group=group)
    if not cov.track_mean:
        for k in ("sum", "gram"):
            dist.all_reduce(st[k], op=SUM, group=group)
    else:
        n_local = sd["state"]["n"].double()
        mean_local = st["mean"]
        weighted = mean_local * n_local[:, None]
        dist.all_reduce(weighted, op=SUM, group=group)
        mu = weighted / st["n"].double().clamp_min(1)[:, None]
        delta = mean_local - mu
        m2 = st["m2"] + delta[:, :, None] * delta[:, None, :] * n_local[:, None, None]
        dist.all_reduce(m2, op=SUM, group=group)
        st["mean"], st["m2"] = mu, m2
    out = Covariance((*cov.sites, cov.D), track_mean=cov.track_mean, backend=cov.backend,
                     precision=cov.precision)
    out.load_state_dict({"dim": sd["dim"], "track_mean": cov.track_mean, "state": st})
    return out
