"""Plain-torch reference for one update of the streaming covariance (docs/accumulators.md).

This is the ground truth every covariance kernel is tested against, and the CPU path.

One call reduces a batch of activation rows to *partials* about a per-site center ``c``:

    x: [B, T, S, D]  (any strides; B, T leading batch axes, S sites, D features)
    valid[b, t, s] = mask[b, t] and all(isfinite(x[b, t, s, :]))
    n[s]      = Σ valid                                   (int64)
    c[s]      = center the partials are taken about       (mean of the valid rows, or 0)
    s[s]      = Σ_valid (x − c)                            [S, D]
    G[s]      = Σ_valid (x − c)(x − c)ᵀ                    [S, D, D]
    rejected[s] = rows with mask true but a NaN/Inf in site s (never merged into the sums)

Centering on the chunk mean before the products is what keeps the covariance accurate when a
channel's mean is large against its spread (the ``G − s sᵀ/n`` cancellation, docs/accumulators.md). The
caller turns partials into the chunk mean ``c + s/n`` and centered sum ``G − s sᵀ/n`` in float64.
Sums run in float32 for fp32/fp16/bf16 input and float64 for float64 input.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class CovPartials(NamedTuple):
    """Per-site moments of one chunk about center ``c`` (see module docstring)."""

    n: Tensor  # [S] int64
    c: Tensor  # [S, D]
    s: Tensor  # [S, D]
    G: Tensor  # [S, D, D]
    rejected: Tensor  # [S] int64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP32 for every input dtype except float64, which keeps float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def covariance_partials_reference(
    x: Tensor, mask: Tensor | None = None, row_step: int = 1, center: bool = True
) -> CovPartials:
    """Partials of one chunk, plain torch. ``x: [B, T, S, D]``, ``mask: [B, T]`` bool or None.

    ``row_step = k`` keeps every k-th row along T (token sampling). ``center=False`` takes the
    partials about 0 (``c = 0``), i.e. raw ``Σx`` and ``Σxxᵀ``.
    """
    if row_step > 1:
        x = x[:, ::row_step]
        mask = None if mask is None else mask[:, ::row_step]
    B, T, S, D = x.shape
    acc = accumulation_dtype(x.dtype)
    xf = x.reshape(B * T, S, D).to(acc)
    finite = torch.isfinite(xf).all(-1)  # [N, S]
    if mask is not None:
        keep = mask.reshape(B * T, 1).to(torch.bool)
        rejected = (keep & ~finite).sum(0)
        valid = keep & finite
    else:
        rejected = (~finite).sum(0)
        valid = finite
    n = valid.sum(0)
    xz = torch.where(valid[..., None], xf, 0)
    if center:
        c = xz.sum(0) / n.clamp_min(1)[:, None].to(acc)
    else:
        c = torch.zeros(S, D, dtype=acc, device=x.device)
    d = torch.where(valid[..., None], xf - c, 0)
    s = d.sum(0)
    G = torch.einsum("nsi,nsj->sij", d, d)
    return CovPartials(n.to(torch.int64), c, s, G, rejected.to(torch.int64))
