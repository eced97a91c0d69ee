"""The ``keyrank`` suite: the key-rank evaluation protocol (docs/protocols.md) end to end.

``fastspec.Probe.measure`` vs the hand protocol (eval mode, forward hooks on every layer's
``k_proj`` plus its rotary embedding, one ``torch.linalg.svdvals(K.float())`` per KV head, PR of
σ; :func:`~fastspec.bench.models.hand_key_rank`), on the Llama-style models of
:mod:`fastspec.bench.models`. Accuracy: max over heads of |PR − PR_fp64| / PR_fp64 for both
(PR_fp64: the hand protocol with float64 svdvals), and the max |ΔPR| between fastspec and the
hand protocol (``pr_diff_vs_baseline``). Claim: no worse than 2 × the hand protocol's error
(:func:`~fastspec.bench.case.no_worse_than`).

Shapes: the tier's :data:`~fastspec.bench.models.MODEL_SHAPES` entry (``gpu``: the 1.5B shape in
bf16) with :data:`KEYRANK_TOKENS` tokens.
"""
from __future__ import annotations

import torch

from .. import models
from ..case import Case, Inputs, no_worse_than

KEYRANK_TOKENS = {"quick": (1, 64), "cpu": (2, 256), "gpu": (4, 2048)}  # (batch, sequence)


def keyrank_cases(tier: str, device: torch.device) -> list[Case]:
    """The one case of ``tier``: ``Probe.measure`` vs hooks + ``svdvals`` per head (module docstring)."""
    skip = models.requirements()
    shape, batch_shape = models.MODEL_SHAPES[tier], KEYRANK_TOKENS[tier]
    L, H = shape["num_hidden_layers"], shape["num_key_value_heads"]

    def setup() -> Inputs:
        import fastspec

        model = models.build_llama(tier, device)
        ids = models.tokens(batch_shape, shape["vocab_size"], device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"model": model, "batch": batch, "probe": fastspec.Probe(model, keys=True, ffn=False)}

    def run(inp: Inputs) -> list:
        return inp["probe"].measure(inp["batch"], step=0)

    def hand(inp: Inputs) -> torch.Tensor:
        return models.hand_key_rank(inp["model"], inp["batch"])

    def check(inp: Inputs) -> dict:
        probe_pr, hand_pr = models.probe_key_rank(run(inp), L, H), hand(inp).double()
        truth = models.hand_key_rank(inp["model"], inp["batch"], torch.float64)

        def worst(d: torch.Tensor) -> float:  # a head the probe did not report is NaN, not 0
            return float("nan") if d.isnan().any() else float(d.abs().max())
        return {"fastspec_error": worst((probe_pr - truth) / truth),
                "baseline_error": worst((hand_pr - truth) / truth),
                "pr_diff_vs_baseline": worst(probe_pr - hand_pr)}

    return [Case(suite="keyrank", size=models.size_id(tier, shape, batch_shape), variant="auto", setup=setup,
                 fastspec=run, baselines={"hooks + svdvals per head": hand}, check=check,
                 error_kind="max rel err of PR vs fp64", claim=no_worse_than(), skip=skip)]
