"""Model-level suites on a Llama-style transformer built from ``transformers.LlamaConfig``.

* ``keyrank``: the SPEC §5 key-rank protocol end to end, ``fastspec.Probe.measure`` vs the hand
  protocol (eval mode, forward hooks on every layer's ``k_proj`` plus its rotary embedding, one
  ``torch.linalg.svdvals(K.float())`` per KV head, PR of σ). Accuracy: max over heads of
  |PR − PR_fp64| / PR_fp64 for both (PR_fp64: the hand protocol with float64 svdvals), and the max
  |ΔPR| between fastspec and the hand protocol (``pr_diff_vs_baseline``).
* ``train_step``: one training step (forward, backward, AdamW) with and without a streaming
  ``fastspec.Probe`` on every layer's keys and FFN activations; reported as overhead in % of the
  step. Accuracy: |Δloss| with the probe attached (hooks must not change the numbers).

``gpu`` tier: the 1.5B shape of SPEC §5 (d_model 2048, 32 layers, 16 query / 8 KV heads of 128,
d_ff 8192) in bf16 with 4 × 2048 tokens; ``cpu``/``quick``: small fp32 models of the same layout.
Weights are random: timings and protocol agreement do not depend on training.
"""
from __future__ import annotations

from typing import Any

import torch

from .cases import Case, Inputs

MODEL_SHAPES: dict[str, dict[str, int]] = {
    "quick": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=128),
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=688, vocab_size=512),
    "gpu": dict(hidden_size=2048, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, intermediate_size=8192, vocab_size=32000),
}
KEYRANK_TOKENS = {"quick": (1, 64), "cpu": (2, 256), "gpu": (4, 2048)}  # (batch, sequence)
TRAIN_TOKENS = {"quick": (1, 32), "cpu": (2, 128), "gpu": (4, 2048)}


def _requirements() -> str | None:
    """Why the model suites cannot run here (None: they can)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers not installed (pip install 'fastspec[hf]')"
    import fastspec

    if not hasattr(fastspec, "Probe"):
        return "fastspec.Probe is not available in this version"
    return None


def _dtype(tier: str) -> torch.dtype:
    return torch.bfloat16 if tier == "gpu" else torch.float32


def build_llama(tier: str, device: torch.device) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` of the tier's shape on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_SHAPES[tier], max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(_dtype(tier))


def _tokens(tier: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1234)
    return torch.randint(MODEL_SHAPES[tier]["vocab_size"], shape, generator=g).to(device)


def hand_key_rank(model: Any, batch: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SPEC §5 key-rank PR per (layer, KV head), ``[L, H_kv]``, the way one writes it by hand.

    ``dtype`` is the precision of ``svdvals`` (the protocol says fp32; float64 gives the truth
    both fp32 paths are measured against).

    Forward hooks take every layer's ``k_proj`` output and the rotary ``(cos, sin)`` handed to its
    attention; post-RoPE keys are rebuilt with the model's own ``apply_rotary_pos_emb`` (so they
    are bit-identical to what attention sees), then ``svdvals`` of each head's ``[n, d]`` keys.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    cfg = model.config
    H, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    keys: dict[int, torch.Tensor] = {}
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        handles.append(attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: rope.__setitem__(i, kwargs["position_embeddings"]), with_kwargs=True))
        handles.append(attn.k_proj.register_forward_hook(
            lambda m, args, out, i=i: keys.__setitem__(i, out)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    prs = []
    for i in range(len(layers)):
        B, T = keys[i].shape[:2]
        k = keys[i].view(B, T, H, d).transpose(1, 2)  # [B, H, T, d]
        cos, sin = rope[i]
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        for h in range(H):
            s = torch.linalg.svdvals(k[:, h].reshape(B * T, d).to(dtype))
            prs.append(s.sum().square() / s.square().sum())
    return torch.stack(prs).view(len(layers), H).cpu()


def probe_key_rank(records: list, L: int, H: int) -> torch.Tensor:
    """``[L, H]`` key PR from Probe records (site ``keys``, metric ``participation_ratio``)."""
    out = torch.full((L, H), float("nan"), dtype=torch.float64)
    for r in records:
        if r.site == "keys" and r.metric == "participation_ratio":
            out[r.layer, r.head] = r.value
    return out


def _size(tier: str, tokens: tuple[int, int]) -> str:
    s = MODEL_SHAPES[tier]
    dt = "bf16" if _dtype(tier) == torch.bfloat16 else "fp32"
    return (f"L{s['num_hidden_layers']}-KV{s['num_key_value_heads']}-d{s['head_dim']}"
            f"-ff{s['intermediate_size']}-N{tokens[0]}x{tokens[1]}-{dt}")


def keyrank_cases(tier: str, device: torch.device) -> list[Case]:
    skip = _requirements()
    tokens = KEYRANK_TOKENS[tier]
    L, H = MODEL_SHAPES[tier]["num_hidden_layers"], MODEL_SHAPES[tier]["num_key_value_heads"]

    def setup() -> Inputs:
        import fastspec

        model = build_llama(tier, device)
        ids = _tokens(tier, tokens, device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"model": model, "batch": batch, "probe": fastspec.Probe(model, keys=True, ffn=False)}

    def run(inp: Inputs) -> list:
        return inp["probe"].measure(inp["batch"], step=0)

    def hand(inp: Inputs) -> torch.Tensor:
        return hand_key_rank(inp["model"], inp["batch"])

    def check(inp: Inputs) -> dict:
        probe_pr, hand_pr = probe_key_rank(run(inp), L, H), hand(inp).double()
        truth = hand_key_rank(inp["model"], inp["batch"], torch.float64)

        def worst(d: torch.Tensor) -> float:  # a head the probe did not report is NaN, not 0
            return float("nan") if d.isnan().any() else float(d.abs().max())
        return {"fastspec_error": worst((probe_pr - truth) / truth),
                "baseline_error": worst((hand_pr - truth) / truth),
                "pr_diff_vs_baseline": worst(probe_pr - hand_pr)}

    return [Case(suite="keyrank", size=_size(tier, tokens), variant="auto", setup=setup, fastspec=run,
                 baselines={"hooks + svdvals per head": hand}, check=check,
                 error_kind="max rel err of PR vs fp64", skip=skip)]


def train_step_cases(tier: str, device: torch.device) -> list[Case]:
    """Probe defaults (capture every step, metrics every 100 steps: the timed steps are capture
    only), and ``emit_every=1`` (metrics every step: the worst case; emission cost per step =
    the difference, amortized by ``emit_every``)."""
    return [_train_step_case(tier, device, emit_every) for emit_every in (100, 1)]


def _train_step_case(tier: str, device: torch.device, emit_every: int) -> Case:
    skip = _requirements()
    tokens = TRAIN_TOKENS[tier]

    def setup() -> Inputs:
        import fastspec

        model = build_llama(tier, device).train()
        return {"model": model, "ids": _tokens(tier, tokens, device),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
                "probe": fastspec.Probe(model, keys=True, ffn=True, emit_every=emit_every), "step": [0]}

    def plain(inp: Inputs) -> None:
        loss = inp["model"](input_ids=inp["ids"], labels=inp["ids"]).loss
        loss.backward()
        inp["opt"].step()
        inp["opt"].zero_grad(set_to_none=True)

    def probed(inp: Inputs) -> None:
        plain(inp)
        inp["probe"].step(inp["step"][0])
        inp["step"][0] += 1

    def check(inp: Inputs) -> dict:
        model, ids = inp["model"], inp["ids"]
        with torch.no_grad():
            base = model(input_ids=ids, labels=ids).loss
            with inp["probe"].streaming():
                probed_loss = model(input_ids=ids, labels=ids).loss
        return {"fastspec_error": float((probed_loss.double() - base.double()).abs()),
                "baseline_error": None}

    return Case(suite="train_step", size=_size(tier, tokens), variant=f"emit_every={emit_every}",
                setup=setup, fastspec=probed, baselines={"training step without probe": plain},
                check=check, error_kind="|Δloss| with probe", skip=skip,
                fastspec_context=lambda inp: inp["probe"].streaming())
