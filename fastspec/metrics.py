"""Spectral metrics of a batch of spectra (definitions: docs/metrics.md).

Every function takes ``v`` of shape ``[..., D]``: a batch of spectra (eigenvalues ``λ`` for the
``eig`` convention, singular values ``σ`` for ``sv``), in any order, and reduces the last axis,
returning ``[...]``. Tiny negative values from round-off are clamped to 0 (docs/conventions.md). float64 in
gives float64 out; float32/float16/bfloat16 are computed and returned in float32.

With ``p = v / Σv`` sorted descending and ``cum_k = Σ_{i≤k} p_i``:

=========================  ====================================================
participation_ratio        ``PR = (Σv)² / Σv²``                         in [1, D]
entropy_rank               ``eR = exp(−Σ p log p)``, ``0·log 0 = 0``    in [1, D]
normalized_rank            ``(rank − 1) / (D − 1)``                     in [0, 1]
spectral_concentration     ``SC = (2/D) Σ_k (cum_k − k/D)``             in [0, 1]
spectral_utilization       ``SUI = 2hs / (h + s)`` (0 if both 0)         in [0, 1]
effective_dim              ``eDim = 1 + (D − 1)·SUI``                    in [1, D]
top_share                  ``cum_k``; a fraction f uses ``k = ceil(f·D)`` in [0, 1]
=========================  ====================================================

An all-zero spectrum has no defined rank: PR, eR and everything built on them are NaN there.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor

__all__ = [
    "participation_ratio",
    "entropy_rank",
    "normalized_rank",
    "spectral_concentration",
    "spectral_utilization",
    "effective_dim",
    "top_share",
    "summarize",
    "SpectrumMetrics",
]


def _prepare(v: Tensor, dim: int, name: str = "v") -> Tensor:
    """Validate a batch of spectra and move the reduced axis last, clamped and in compute dtype."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of spectra [..., D], got {type(v).__name__}")
    if v.is_complex() or not v.is_floating_point():
        raise TypeError(f"{name}: expected a real floating dtype, got {v.dtype}")
    if v.dim() == 0:
        raise ValueError(f"{name}: expected at least one axis [..., D], got a scalar")
    if v.shape[dim] == 0:
        raise ValueError(f"{name}: the spectrum axis (dim={dim}) is empty; D must be >= 1")
    if v.dtype != torch.float64:
        v = v.float()
    return v.movedim(dim, -1).clamp_min(0)


def _sorted_shares(v: Tensor) -> Tensor:
    """p sorted descending: [..., D] -> [..., D]."""
    p = v / v.sum(-1, keepdim=True)
    return p.sort(dim=-1, descending=True).values


def participation_ratio(v: Tensor, dim: int = -1) -> Tensor:
    """Hard rank ``PR = (Σv)² / Σv²`` of spectra ``v: [..., D]`` -> ``[...]``."""
    v = _prepare(v, dim)
    return v.sum(-1).square() / v.square().sum(-1)


def entropy_rank(v: Tensor, dim: int = -1) -> Tensor:
    """Soft rank ``eR = exp(−Σ p log p)`` with ``p = v/Σv`` and ``0·log 0 = 0``."""
    v = _prepare(v, dim)
    p = v / v.sum(-1, keepdim=True)
    return torch.exp(-torch.xlogy(p, p).sum(-1))


def normalized_rank(rank: Tensor | float, D: int) -> Tensor:
    """``(rank − 1)/(D − 1)``, mapping a rank in [1, D] to [0, 1]; 0 when D == 1."""
    if not isinstance(D, int) or isinstance(D, bool) or D < 1:
        raise ValueError(f"D: expected a positive int (the spectrum length), got {D!r}")
    rank = torch.as_tensor(rank)
    if not rank.is_floating_point():
        rank = rank.double()
    if D == 1:
        return torch.zeros_like(rank)
    return (rank - 1) / (D - 1)


def spectral_concentration(v: Tensor, dim: int = -1) -> Tensor:
    """``SC = (2/D) Σ_{k=1..D} (cum_k − k/D)``: 0 for a flat spectrum, (D−1)/D for one value."""
    v = _prepare(v, dim)
    D = v.shape[-1]
    cum = _sorted_shares(v).cumsum(-1)
    k = torch.arange(1, D + 1, dtype=v.dtype, device=v.device)
    return (2.0 / D) * (cum - k / D).sum(-1)


def _sui_from_ranks(h: Tensor, s: Tensor) -> Tensor:
    """``2hs/(h+s)``, 0 when both are 0; NaN ranks (an all-zero or NaN spectrum) stay NaN."""
    denom = h + s
    return torch.where(denom == 0, torch.zeros_like(h), 2 * h * s / torch.where(denom == 0, 1, denom))


def spectral_utilization(v: Tensor, dim: int = -1) -> Tensor:
    """SUI: harmonic mean ``2hs/(h+s)`` of the normalized hard and soft ranks (0 if both 0)."""
    v = _prepare(v, dim)
    D = v.shape[-1]
    h = normalized_rank(participation_ratio(v), D)
    s = normalized_rank(entropy_rank(v), D)
    return _sui_from_ranks(h, s)


def effective_dim(v: Tensor, dim: int = -1) -> Tensor:
    """``eDim = 1 + (D − 1)·SUI`` in [1, D]."""
    v = _prepare(v, dim)
    return 1 + (v.shape[-1] - 1) * spectral_utilization(v)


def _resolve_k(k_or_fraction: int | float, D: int) -> int:
    if isinstance(k_or_fraction, bool):
        raise TypeError("k_or_fraction: expected an int k or a float fraction, got a bool")
    if isinstance(k_or_fraction, int):
        k = k_or_fraction
    elif isinstance(k_or_fraction, float):
        if not 0.0 < k_or_fraction <= 1.0:
            raise ValueError(f"k_or_fraction: a fraction must lie in (0, 1], got {k_or_fraction}")
        # The small tolerance keeps e.g. 0.1 * 30 (= 3.0000000000000004) at k = 3.
        k = math.ceil(k_or_fraction * D - 1e-9)
    else:
        raise TypeError(f"k_or_fraction: expected int or float, got {type(k_or_fraction).__name__}")
    if not 1 <= k <= D:
        raise ValueError(f"k_or_fraction: k must lie in [1, D={D}], got {k}")
    return k


def top_share(v: Tensor, k_or_fraction: int | float, dim: int = -1) -> Tensor:
    """Share of the top-k values ``cum_k``; a float f in (0, 1] means ``k = ceil(f·D)``."""
    v = _prepare(v, dim)
    k = _resolve_k(k_or_fraction, v.shape[-1])
    return _sorted_shares(v)[..., :k].sum(-1)


@dataclass(frozen=True)
class SpectrumMetrics:
    """Every metric of docs/metrics.md for a batch of spectra; each field has the batch shape ``[...]``.

    ``n`` (rows seen) and ``rejected`` (rows dropped for NaN/Inf) are filled when the metrics
    come from a :class:`fastspec.Covariance`, and are ``None`` otherwise.
    """

    D: int
    participation_ratio: Tensor
    hard_rank_normalized: Tensor
    entropy_rank: Tensor
    soft_rank_normalized: Tensor
    spectral_concentration: Tensor
    sui: Tensor
    effective_dim: Tensor
    utilization: Tensor
    ghost_dims: Tensor
    top1_share: Tensor
    top10pct_share: Tensor
    n: Tensor | None = None
    rejected: Tensor | None = None

    def as_dict(self) -> dict:
        """The fields as a plain dict (``D`` stays an int, the rest tensors or None)."""
        return asdict(self)

    def tensors(self) -> dict[str, Tensor]:
        """Only the per-spectrum metric tensors, by name (no D, no None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "D" and getattr(self, f.name) is not None}


def summarize(v: Tensor, dim: int = -1) -> SpectrumMetrics:
    """All metrics of docs/metrics.md for spectra ``v: [..., D]`` at once, sharing one sort."""
    v = _prepare(v, dim)
    D = v.shape[-1]
    pr = participation_ratio(v)
    er = entropy_rank(v)
    h = normalized_rank(pr, D)
    s = normalized_rank(er, D)
    sui = _sui_from_ranks(h, s)
    p = _sorted_shares(v)
    cum = p.cumsum(-1)
    k = torch.arange(1, D + 1, dtype=v.dtype, device=v.device)
    return SpectrumMetrics(
        D=D,
        participation_ratio=pr,
        hard_rank_normalized=h,
        entropy_rank=er,
        soft_rank_normalized=s,
        spectral_concentration=(2.0 / D) * (cum - k / D).sum(-1),
        sui=sui,
        effective_dim=1 + (D - 1) * sui,
        utilization=pr / D,
        ghost_dims=D - pr,
        top1_share=cum[..., 0],
        top10pct_share=cum[..., _resolve_k(0.1, D) - 1],
    )
