"""Spectral metrics of a batch of spectra (definitions: docs/metrics.md).

Every function takes ``v`` of shape ``[..., D]``: a batch of spectra (eigenvalues ``λ`` for the
``eig`` convention, singular values ``σ`` for ``sv``), in any order, and reduces the last axis,
returning ``[...]``. Negative values are clamped to 0; those below the round-off tolerance
``−D·eps·max|v|`` (per spectrum; ``eps`` of ``v``'s dtype, at least float32's) also raise a
``UserWarning`` (docs/conventions.md).
float64 in gives float64 out; float32/float16/bfloat16 are computed and returned in float32.

With ``p = v / Σv`` sorted descending and ``cum_k = Σ_{i≤k} p_i``:

=========================  ====================================================
participation_ratio        ``PR = (Σv)² / Σv²``                         in [1, D]
entropy_rank               ``eR = exp(−Σ p log p)``, ``0·log 0 = 0``    in [1, D]
normalized_rank            ``(rank − 1) / (D − 1)``                     in [0, 1]
spectral_concentration     ``SC = (2/D) Σ_k (cum_k − k/D)``             in [0, 1]
spectral_utilization       ``SUI = 2hs / (h + s)`` (0 if both 0)         in [0, 1]
effective_dim              ``eDim = 1 + (D − 1)·SUI``                    in [1, D]
top_share                  ``cum_k``; a fraction f uses ``k = ceil(f·D)`` in [0, 1]
rank_at                    smallest ``k`` with ``cum_k ≥ f``              in {1, …, D}
=========================  ====================================================

An all-zero spectrum has no defined rank: PR, eR and everything built on them are NaN there.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor

from . import _args

__all__ = [
    "participation_ratio",
    "entropy_rank",
    "normalized_rank",
    "spectral_concentration",
    "spectral_utilization",
    "effective_dim",
    "top_share",
    "rank_at",
    "summarize",
    "SpectrumMetrics",
]


def _prepare(v: Tensor, dim: int, name: str = "v", check_negative: bool = True) -> Tensor:
    """Validate a batch of spectra and move the reduced axis last, clamped and in compute dtype."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of spectra [..., D], got {type(v).__name__}")
    if v.is_complex() or not v.is_floating_point():
        raise TypeError(f"{name}: expected a real floating dtype, got {v.dtype}")
    if v.dim() == 0:
        raise ValueError(f"{name}: expected at least one axis [..., D], got a scalar")
    if v.shape[dim] == 0:
        raise ValueError(f"{name}: the spectrum axis (dim={dim}) is empty; D must be >= 1")
    # float64 spectra are often solved from matrices formed in float32: float32's eps at least
    eps = max(torch.finfo(v.dtype).eps, torch.finfo(torch.float32).eps)
    if v.dtype != torch.float64:
        v = v.float()
    v = v.movedim(dim, -1)
    if check_negative:
        _warn_negative(v, eps, name)
    return v.clamp_min(0)


def _warn_negative(v: Tensor, eps: float, name: str) -> None:
    """Warn about values of ``v: [..., D]`` below ``−D·eps·max|v|`` (per spectrum): a backward-stable
    eigensolve of a PSD matrix errs by at most about ``D·eps·‖A‖``, so anything lower is not round-off."""
    bad = v < -v.shape[-1] * eps * v.abs().amax(-1, keepdim=True)
    if bad.any():  # the one host sync of the check; check_negative=False skips it
        warnings.warn(f"{name}: {int(bad.sum())} value(s) below the round-off tolerance -D·eps·max|{name}| "
                      f"(most negative {v[bad].min().item():.6g}); a spectrum is >= 0, they are treated as 0",
                      UserWarning, stacklevel=4)


def _sorted_shares(v: Tensor) -> Tensor:
    """p sorted descending: [..., D] -> [..., D]."""
    p = v / v.sum(-1, keepdim=True)
    return p.sort(dim=-1, descending=True).values


# The private metric kernels take prepared spectra (_prepare: clamped, last axis, compute dtype),
# so composite metrics and summarize validate (and check for negatives) once.
def _pr(v: Tensor) -> Tensor:
    return v.sum(-1).square() / v.square().sum(-1)


def _er(v: Tensor) -> Tensor:
    p = v / v.sum(-1, keepdim=True)
    return torch.exp(-torch.xlogy(p, p).sum(-1))


def _sc(cum: Tensor) -> Tensor:
    """SC from the cumulative sorted shares ``cum: [..., D]``."""
    D = cum.shape[-1]
    k = torch.arange(1, D + 1, dtype=cum.dtype, device=cum.device)
    return (2.0 / D) * (cum - k / D).sum(-1)


def _sui_from_ranks(h: Tensor, s: Tensor) -> Tensor:
    """``2hs/(h+s)``, 0 when both are 0; NaN ranks (an all-zero or NaN spectrum) stay NaN."""
    denom = h + s
    return torch.where(denom == 0, torch.zeros_like(h), 2 * h * s / torch.where(denom == 0, 1, denom))


def _sui(v: Tensor) -> Tensor:
    D = v.shape[-1]
    return _sui_from_ranks(normalized_rank(_pr(v), D), normalized_rank(_er(v), D))


def participation_ratio(v: Tensor, dim: int = -1) -> Tensor:
    """Hard rank ``PR = (Σv)² / Σv²`` of spectra ``v: [..., D]`` -> ``[...]``."""
    return _pr(_prepare(v, dim))


def entropy_rank(v: Tensor, dim: int = -1) -> Tensor:
    """Soft rank ``eR = exp(−Σ p log p)`` with ``p = v/Σv`` and ``0·log 0 = 0``."""
    return _er(_prepare(v, dim))


def normalized_rank(rank: Tensor | float, D: int) -> Tensor:
    """``(rank − 1)/(D − 1)``, mapping a rank in [1, D] to [0, 1]; 0 when D == 1."""
    D = _args.integer("D", D, minimum=1)
    rank = torch.as_tensor(rank)
    if not rank.is_floating_point():
        rank = rank.double()
    if D == 1:
        return torch.zeros_like(rank)
    return (rank - 1) / (D - 1)


def spectral_concentration(v: Tensor, dim: int = -1) -> Tensor:
    """``SC = (2/D) Σ_{k=1..D} (cum_k − k/D)``: 0 for a flat spectrum, (D−1)/D for one value."""
    return _sc(_sorted_shares(_prepare(v, dim)).cumsum(-1))


def spectral_utilization(v: Tensor, dim: int = -1) -> Tensor:
    """SUI: harmonic mean ``2hs/(h+s)`` of the normalized hard and soft ranks (0 if both 0)."""
    return _sui(_prepare(v, dim))


def effective_dim(v: Tensor, dim: int = -1) -> Tensor:
    """``eDim = 1 + (D − 1)·SUI`` in [1, D]."""
    v = _prepare(v, dim)
    return 1 + (v.shape[-1] - 1) * _sui(v)


def _resolve_k(k_or_fraction: int | float, D: int) -> int:
    try:
        k = _args.index(k_or_fraction)  # an int k (Python or NumPy)
    except TypeError:  # else a fraction (a bool is neither)
        f = _args.real("k_or_fraction", k_or_fraction, "an int k or a fraction in (0, 1]", lambda f: 0 < f <= 1)
        # The small tolerance keeps e.g. 0.1 * 30 (= 3.0000000000000004) at k = 3.
        k = math.ceil(f * D - 1e-9)
    if not 1 <= k <= D:
        raise ValueError(f"k_or_fraction: k must lie in [1, D={D}], got {k}")
    return k


def top_share(v: Tensor, k_or_fraction: int | float, dim: int = -1) -> Tensor:
    """Share of the top-k values ``cum_k``; a float f in (0, 1] means ``k = ceil(f·D)``."""
    v = _prepare(v, dim)
    k = _resolve_k(k_or_fraction, v.shape[-1])
    return _sorted_shares(v)[..., :k].sum(-1)


def rank_at(v: Tensor, fraction: float = 0.9, dim: int = -1, *, check_negative: bool = True) -> Tensor:
    """Smallest ``k`` whose top-k values hold ``fraction`` of the total: ``Σ_{i≤k} v_i ≥ f·Σv``
    over ``v: [..., D]`` sorted descending -> ``[...]``, integer-valued in {1, …, D}.

    On variances (``eig`` eigenvalues, or ``σ²`` for ``sv``) and ``f = 0.9`` this is PCA's
    "components for 90% explained variance". The partial sums run in float64 and a share within
    their round-off ``D·eps64`` of ``f`` counts as reached (ten equal values give 9 at f = 0.9).
    NaN where ``Σv`` is 0, NaN or Inf. ``check_negative=False`` skips the negative-value warning
    (a host sync) for spectra of PSD matrices, as the probe's emission does.
    """
    fraction = _args.real("fraction", fraction, "a number in (0, 1]", lambda f: 0 < f <= 1)
    return _rank_at(_prepare(v, dim, check_negative=check_negative), fraction)


def _rank_at(v: Tensor, fraction: float) -> Tensor:
    cum = v.double().sort(dim=-1, descending=True).values.cumsum(-1)
    total = cum[..., -1]  # the same summation order as cum, so f = 1 reaches it exactly
    k = (cum < (fraction - v.shape[-1] * torch.finfo(torch.float64).eps) * total[..., None]).sum(-1) + 1
    return k.to(v.dtype).masked_fill(~(torch.isfinite(total) & (total > 0)), math.nan)


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


def summarize(v: Tensor, dim: int = -1, *, check_negative: bool = True) -> SpectrumMetrics:
    """All metrics of docs/metrics.md for spectra ``v: [..., D]`` at once, sharing one sort.

    ``check_negative=False`` skips the warning about clearly negative values and its host sync:
    for spectra of PSD matrices that are already clamped (``Covariance.spectrum``, the probe).
    """
    v = _prepare(v, dim, check_negative=check_negative)
    D = v.shape[-1]
    pr = _pr(v)
    h = normalized_rank(pr, D)
    er = _er(v)
    s = normalized_rank(er, D)
    sui = _sui_from_ranks(h, s)
    cum = _sorted_shares(v).cumsum(-1)
    return SpectrumMetrics(
        D=D,
        participation_ratio=pr,
        hard_rank_normalized=h,
        entropy_rank=er,
        soft_rank_normalized=s,
        spectral_concentration=_sc(cum),
        sui=sui,
        effective_dim=1 + (D - 1) * sui,
        utilization=pr / D,
        ghost_dims=D - pr,
        top1_share=cum[..., 0],
        top10pct_share=cum[..., _resolve_k(0.1, D) - 1],
    )
