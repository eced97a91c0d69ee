"""Q/K-norm scale γ per layer: how far a learned normalisation weight has moved from flat.

Not a covariance: it reads parameters, not activations. For a family with Q/K norms
(``Family.k_norm`` / ``q_norm``) the coefficient of variation of the effective scale
``γ = weight + Family.gamma_offset`` over its ``d_head`` entries is

    CV(γ) = std(γ) / mean(γ)      (population std)

reported as 0 when the weight is frozen (``requires_grad=False``: γ cannot have learned
anything). See docs/protocols.md (key-rank protocol).

A norm over the whole projection (``Family.norm_layout == "flat"``, OLMo 2/3) has one
``[H·d_head]`` weight: its CV is taken per head over that head's ``d_head`` slice, one record
per head (``head_index`` = local head). A CV over all ``H·d_head`` entries would also count
differences in the mean γ between heads, which scale a head's keys uniformly and leave the
shape of its spectrum (its PR) unchanged; the per-head CVs average to a per-layer value like
the other families' (``fastspec.analysis.layer_means``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .families import Family, matches
from .pending import RecordKey


def gamma_values(model: nn.Module, family: Family) -> tuple[list[RecordKey], list[Tensor]]:
    """Record keys and values (``gamma_cv``, ``gamma_trainable``) per layer of ``gamma_k``/``gamma_q``
    (per layer and head for a ``"flat"`` norm).

    Values stay on the parameters' device (``[2]`` float64 per layer, ``[2·H]`` per flat layer),
    so an emission can pack them with the spectral metrics into one host transfer.
    """
    keys: list[RecordKey] = []
    values: list[Tensor] = []
    modules = dict(model.named_modules()) if family.norm_layout == "flat" else {}
    for site, pattern in (("gamma_k", family.k_norm), ("gamma_q", family.q_norm)):
        for name, mod, layer in matches(model, pattern):
            w = getattr(mod, "weight", None)
            if not isinstance(w, Tensor):
                continue
            gamma = (w.detach().double() + family.gamma_offset).reshape(-1)
            heads = [None]
            if modules:  # [H·d_head] -> [H, d_head], d_head from the attention module holding the norm
                d_head = getattr(modules.get(name.rpartition(".")[0]), "head_dim", None)
                if isinstance(d_head, int) and d_head > 0 and gamma.numel() % d_head == 0:
                    gamma = gamma.reshape(-1, d_head)
                    heads = list(range(gamma.shape[0]))
            gamma = gamma.reshape(len(heads), -1)
            trainable = bool(w.requires_grad)
            cv = gamma.std(-1, unbiased=False) / gamma.mean(-1) if trainable else gamma.new_zeros(len(heads))
            for h in heads:
                keys += [(site, layer, h, "gamma_cv"), (site, layer, h, "gamma_trainable")]
            values.append(torch.stack([cv, torch.full_like(cv, float(trainable))], -1).reshape(-1))
    return keys, values
