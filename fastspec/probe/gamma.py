"""Q/K-norm scale γ per layer: how far a learned normalisation weight has moved from flat.

Not a covariance: it reads parameters, not activations. For a family with Q/K RMSNorm
(``Family.k_norm`` / ``q_norm``) the coefficient of variation of the effective scale
``γ = weight + Family.gamma_offset`` over its ``d_head`` entries is

    CV(γ) = std(γ) / mean(γ)      (population std)

reported as 0 when the weight is frozen (``requires_grad=False``: γ cannot have learned
anything). See docs/protocols.md (key-rank protocol).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .families import Family, matches
from .record import RecordKey


def gamma_values(model: nn.Module, family: Family) -> tuple[list[RecordKey], list[Tensor]]:
    """Record keys and values (``gamma_cv``, ``gamma_trainable``) per layer of ``gamma_k``/``gamma_q``.

    Values stay on the parameters' device (``[2]`` float64 per layer), so an emission can pack
    them with the spectral metrics into one host transfer.
    """
    keys: list[RecordKey] = []
    values: list[Tensor] = []
    for site, pattern in (("gamma_k", family.k_norm), ("gamma_q", family.q_norm)):
        for _, mod, layer in matches(model, pattern):
            w = getattr(mod, "weight", None)
            if not isinstance(w, Tensor):
                continue
            gamma = w.detach().double() + family.gamma_offset
            trainable = bool(w.requires_grad)
            cv = gamma.std(unbiased=False) / gamma.mean() if trainable else gamma.new_zeros(())
            keys += [(site, layer, None, "gamma_cv"), (site, layer, None, "gamma_trainable")]
            values.append(torch.stack([cv, cv.new_tensor(float(trainable))]))
    return keys, values
