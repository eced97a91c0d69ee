"""The families of ``fastspec.probe.FAMILIES`` beyond the Llama/GPT-2/BERT layouts (GPT-NeoX, OPT,
Phi-3, Phi, OLMo 1/2/3), each a tiny random model built offline (``_tiny_models``).

Ground truth by hand, as in ``test_probe_parity.py``: forward pre-hooks on each layer's down
projection (the FFN site is its input; PR of the eigenvalues of the float64 centred covariance)
and on each attention module, whose post-RoPE keys are recomputed from the module's own
projections and its modeling module's ``apply_rotary_pos_emb`` (key PR from ``svdvals``).
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from _tiny_models import batch, build
from test_probe_parity import (
    RTOL,
    _forward_with_hooks,
    _key_rank_by_hand,
    _probe_values,
)

import fastspec
from fastspec.probe import FAMILIES, Family
from fastspec.probe.families import ffn_modules, matches


def _heads(x: torch.Tensor, d: int) -> torch.Tensor:
    """``[B, T, H·d]`` -> ``[B, H, T, d]``."""
    return x.unflatten(-1, (-1, d)).transpose(1, 2)


def _rope(module, k: torch.Tensor, kw: dict) -> torch.Tensor:
    cos, sin = kw["position_embeddings"]
    return sys.modules[type(module).__module__].apply_rotary_pos_emb(k, k, cos, sin)[1]


def _neox_keys(m, h, kw):  # fused query_key_value, per head [q | k | v]; partial RoPE inside the helper
    return _rope(m, _heads(m.query_key_value(h), 3 * m.head_size).chunk(3, dim=-1)[1], kw)


def _opt_keys(m, h, kw):  # no RoPE: learned positions are added to the embeddings
    return _heads(m.k_proj(h), m.head_dim)


def _phi3_keys(m, h, kw):  # fused qkv_proj: [q (H·d) | k (H_kv·d) | v]
    q = m.config.num_attention_heads * m.head_dim
    return _rope(m, _heads(m.qkv_proj(h)[..., q:q + m.num_key_value_heads * m.head_dim], m.head_dim), kw)


def _phi_keys(m, h, kw):  # optional per-head LayerNorm, RoPE on the first rotary_ndims only
    k = _heads(m.k_proj(h), m.head_dim)
    if m.qk_layernorm:
        k = m.k_layernorm(k)
    r = m.rotary_ndims
    return torch.cat([_rope(m, k[..., :r], kw), k[..., r:]], dim=-1)


def _olmo_keys(m, h, kw):  # OLMo 2/3: RMSNorm over the whole key projection, before the head split
    k = m.k_proj(h)
    if hasattr(m, "k_norm"):
        k = m.k_norm(k)
    return _rope(m, _heads(k, m.head_dim), kw)


class Case(NamedTuple):
    builder: str
    stack: str  # the layer ModuleList, as nested in the model
    attn: str   # attention module in a layer
    ffn: str    # down projection in a layer
    keys: Callable  # (attention module, hidden states, its kwargs) -> post-RoPE keys [B, H_kv, T, d]
    qk_layernorm: bool = False  # Phi's optional per-head LayerNorm


CASES = {
    "gpt_neox": Case("gpt_neox", "gpt_neox.layers", "attention", "mlp.dense_4h_to_h", _neox_keys),
    "opt": Case("opt", "model.decoder.layers", "self_attn", "fc2", _opt_keys),
    "phi3": Case("phi3", "model.layers", "self_attn", "mlp.down_proj", _phi3_keys),
    "phi": Case("phi", "model.layers", "self_attn", "mlp.fc2", _phi_keys),
    "phi_qk_layernorm": Case("phi", "model.layers", "self_attn", "mlp.fc2", _phi_keys, qk_layernorm=True),
    "olmo": Case("olmo", "model.layers", "self_attn", "mlp.down_proj", _olmo_keys),
    "olmo2": Case("olmo2", "model.layers", "self_attn", "mlp.down_proj", _olmo_keys),
    "olmo3": Case("olmo3", "model.layers", "self_attn", "mlp.down_proj", _olmo_keys),
}


def _build(case: str):
    c = CASES[case]
    return build(c.builder, **({"qk_layernorm": True} if c.qk_layernorm else {}))


def _per_layer(model, case: str, path: str) -> dict[int, torch.nn.Module]:
    """``{layer: the submodule at path}`` (e.g. ``CASES[case].attn``) of every layer."""
    return {i: model.get_submodule(f"{CASES[case].stack}.{i}.{path}") for i in range(model.config.num_hidden_layers)}


def _ffn_inputs_by_hand(model, case: str, inputs: dict) -> dict[int, torch.Tensor]:
    captured = {}
    handles = [mod.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0].detach()))
               for i, mod in _per_layer(model, case, CASES[case].ffn).items()]
    _forward_with_hooks(model, inputs, handles)
    return captured


def _keys_by_hand(model, case: str, inputs: dict) -> dict[int, torch.Tensor]:
    """Post-RoPE keys of the valid tokens per layer, ``[N, H_kv, d_head]``."""
    captured = {}

    def hook(module, args, kwargs, layer):
        h = kwargs.get("hidden_states", args[0] if args else None)
        captured[layer] = CASES[case].keys(module, h, kwargs).transpose(1, 2).detach()  # [B, T, H, d]
    handles = [attn.register_forward_pre_hook(lambda m, a, k, i=i: hook(m, a, k, i), with_kwargs=True)
               for i, attn in _per_layer(model, case, CASES[case].attn).items()]
    _forward_with_hooks(model, inputs, handles)
    keep = inputs["attention_mask"].bool()
    return {layer: k[keep] for layer, k in captured.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_family_is_registered_and_its_patterns_find_every_layer(case):
    model = _build(case)
    family = FAMILIES[model.config.model_type]
    layers = list(range(model.config.num_hidden_layers))
    assert [(name, layer) for name, _, layer in matches(model, family.ffn)] == \
        [(f"{CASES[case].stack}.{i}.{CASES[case].ffn}", i) for i in layers]
    for pattern in (family.k_proj, family.k_norm, family.q_norm):
        found = matches(model, pattern)
        assert [layer for *_, layer in found] in ([], layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not in fastspec.probe.FAMILIES" fallback warning
        fastspec.Probe(model)


# OPT runs its FFN on flattened [B·T, d] rows: the "right" padding case checks they are masked
@pytest.mark.parametrize("case, pad", [(c, p) for c in CASES for p in (None, "right")])
def test_ffn_site_is_the_down_projection_input(case, pad):
    model = _build(case)
    inputs = batch(B=3, T=12, pad=pad)
    captured = _ffn_inputs_by_hand(model, case, inputs)
    records = fastspec.Probe(model, keys=False).measure(inputs, step=0)
    ffn = [r for r in records if r.site == "ffn"]
    pr = {r.layer: r.value for r in ffn if r.metric == "participation_ratio"}
    n = {r.layer: r.value for r in ffn if r.metric == "n"}
    assert sorted(r.layer for r in ffn if r.metric == "participation_ratio") == [0, 1]  # one per layer
    assert {r.head_index for r in ffn} == {None}
    keep = inputs["attention_mask"].bool()
    for layer, x in captured.items():
        X = x.reshape(*keep.shape, -1)[keep].double()  # [B, T, d_ff] (OPT: [B·T, d_ff]) -> valid rows
        assert X.shape[1] == 48  # d_ff: the down projection's input, not its d_model output
        lam = torch.linalg.eigvalsh(torch.cov(X.T))
        assert pr[layer] == pytest.approx((lam.sum() ** 2 / lam.square().sum()).item(), rel=RTOL)
        assert n[layer] == X.shape[0]  # padding is not counted


@pytest.mark.parametrize("case", list(CASES))
def test_key_rank_matches_svdvals_of_post_rope_keys(case):
    model = _build(case)
    inputs = batch(B=3, T=12, pad="left")
    records = fastspec.Probe(model, ffn=False).measure(inputs, step=0)
    got, n = _probe_values(records, "keys", "participation_ratio"), _probe_values(records, "keys", "n")
    hand = _keys_by_hand(model, case, inputs)
    kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    assert sorted(hand) == [0, 1] and len(got) == 2 * kv_heads
    for layer, K in hand.items():
        assert K.shape[1] == kv_heads
        for h, w in enumerate(_key_rank_by_hand(K).tolist()):
            assert got[(layer, h)] == pytest.approx(w, rel=RTOL)
            assert n[(layer, h)] == K.shape[0]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_are_bitwise_unchanged_with_the_probe_on(case):
    model = _build(case)
    inputs = batch(B=2, T=10, pad="left")
    with torch.no_grad():
        want = model(**inputs).logits
        # these forwards are eval/no_grad ones: stream them too (which stream: tests/test_probe_forwards.py)
        probe = fastspec.Probe(model, queries=True, ffn_rows="all", emit_every=1, forwards="all")
        with probe.streaming():
            got = model(**inputs).logits
    assert torch.equal(got, want)
    assert {r.site for r in probe.step(0)} >= {"keys", "queries", "ffn"}  # the hooks did run


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_whole_projection_norm_gamma_cv_is_per_head(name):
    model = build(name)  # γ drawn from U(0.5, 1.5)
    records = fastspec.Probe(model, ffn=False).measure(batch(), step=0)
    d = model.config.hidden_size // model.config.num_attention_heads
    for site, attr in (("gamma_k", "k_norm"), ("gamma_q", "q_norm")):
        got = {(r.layer, r.head_index): r.value for r in records if r.site == site and r.metric == "gamma_cv"}
        want = {}
        for layer, block in enumerate(model.model.layers):
            w = getattr(block.self_attn, attr).weight.detach().double().reshape(-1, d)  # [H, d_head]
            want.update({(layer, h): (g.std(unbiased=False) / g.mean()).item() for h, g in enumerate(w)})
        assert got == pytest.approx(want, rel=1e-12)
    assert len({h for _, h in got}) == model.config.num_attention_heads  # q_norm: one CV per query head
    model.model.layers[0].self_attn.k_norm.weight.requires_grad_(False)
    frozen = [r.value for r in fastspec.Probe(model, ffn=False).measure(batch(), step=1)
              if r.site == "gamma_k" and r.layer == 0]
    assert frozen and all(v == 0.0 for v in frozen)  # gamma_cv and gamma_trainable of every head


def test_phi_qk_layernorm_gamma_cv_is_per_layer():
    model = build("phi", qk_layernorm=True)
    records = fastspec.Probe(model, ffn=False).measure(batch(), step=0)
    got = {r.layer: r.value for r in records if r.site == "gamma_k" and r.metric == "gamma_cv"}
    assert {r.head_index for r in records if r.site == "gamma_k"} == {None}
    for layer, block in enumerate(model.model.layers):
        w = block.self_attn.k_layernorm.weight.detach().double()
        assert got[layer] == pytest.approx((w.std(unbiased=False) / w.mean()).item(), rel=1e-12)


@pytest.mark.parametrize("case", ["gpt_neox", "opt", "phi3", "phi", "olmo"])
def test_families_without_qk_norm_report_no_gamma(case):
    records = fastspec.Probe(_build(case), ffn=False).measure(batch(), step=0)
    assert records and not [r for r in records if r.site.startswith("gamma")]


@pytest.mark.parametrize("case, message", [
    ("gpt_neox", "fused QKV"), ("phi3", "fused QKV"), ("opt", "no rotary embedding"),
    ("olmo2", "whole key projection"), ("phi_qk_layernorm", r"\[B, H, T, d_head\]"),
])
def test_prerope_keys_refused_where_no_module_gives_them(case, message):
    with pytest.raises(ValueError, match=rf"^prerope_keys: '\w+' .*{message}.*use keys=True"):
        fastspec.Probe(_build(case), prerope_keys=True)


@pytest.mark.parametrize("case", ["phi", "olmo"])
def test_prerope_keys_are_the_key_projection_output(case):
    model = _build(case)
    inputs = batch(B=2, T=12, pad="left")
    captured = {}
    attn = _per_layer(model, case, CASES[case].attn)[1]
    h = attn.k_proj.register_forward_hook(lambda m, a, out: captured.__setitem__(1, out.detach()))
    records = fastspec.Probe(model, prerope_keys=True, ffn=False).measure(inputs, step=0)
    h.remove()
    K = captured[1].unflatten(-1, (-1, attn.head_dim))[inputs["attention_mask"].bool()]
    pre = _probe_values(records, "keys_prerope", "participation_ratio")
    for head, w in enumerate(_key_rank_by_hand(K).tolist()):
        assert pre[(1, head)] == pytest.approx(w, rel=RTOL)


def _unregistered(monkeypatch):
    """A GPT-2 model under a model_type that FAMILIES does not know."""
    model = build("gpt2")
    monkeypatch.setattr(model.config, "model_type", "my_gpt")
    return model


def test_unknown_family_ffn_error_names_ffn_the_model_type_and_both_ways_out(monkeypatch):
    model = _unregistered(monkeypatch)
    with pytest.warns(UserWarning, match="'my_gpt' is not in fastspec.probe.FAMILIES"), \
            pytest.raises(ValueError) as err:
        fastspec.Probe(model).measure(batch(), step=0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ffn: ") and "'my_gpt'" in msg
    assert "register the family in fastspec.probe.FAMILIES" in msg and "ffn=False" in msg
    # both ways out work: without FFN sites (keys need no family), or with the family registered
    with pytest.warns(UserWarning, match="my_gpt"):
        records = fastspec.Probe(model, ffn=False).measure(batch(), step=0)
    assert {r.site for r in records} == {"keys"}
    monkeypatch.setitem(FAMILIES, "my_gpt", FAMILIES["gpt2"])
    assert "ffn" in {r.site for r in fastspec.Probe(model).measure(batch(), step=0)}


def test_ffn_modules_error(monkeypatch):
    model = _unregistered(monkeypatch)
    with pytest.raises(ValueError, match=r"^ffn: no module matches .* \(model_type 'my_gpt'\); .*FAMILIES, or pass ffn=False"):
        ffn_modules(model, FAMILIES["llama"])
    assert [layer for *_, layer in ffn_modules(model, FAMILIES["gpt2"])] == [0, 1]


def test_family_rejects_an_unknown_norm_layout():
    with pytest.raises(ValueError, match=r"^norm_layout: expected one of \('head', 'head_first', 'flat'\)"):
        Family(ffn=None, norm_layout="per_head")
