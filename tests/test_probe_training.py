"""Probe under real training conditions: padding, checkpointing, no effect on the model, grad
modes, autocast, torch.compile, hook removal on error, streaming schedules and state_dict."""
from __future__ import annotations

import io

import pytest
import torch
from _tiny_models import batch, build

import fastspec
from fastspec.probe import hf_attention


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _attention_functions():
    import transformers.models.llama.modeling_llama as ml
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return dict(ALL_ATTENTION_FUNCTIONS._local_mapping), ml.eager_attention_forward


def _by_key(records, metric="participation_ratio"):
    return {(r.site, r.layer, r.head_index): r.value for r in records if r.metric == metric}


def _train_step(model, inputs):
    out = model(**inputs, labels=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100))
    out.loss.backward()
    return out


@pytest.mark.parametrize("pad", ["left", "right"])
def test_padding_content_never_reaches_the_metrics(pad):
    model = build("llama")
    a = batch(pad=pad)
    b = {**a, "input_ids": a["input_ids"].masked_fill(a["attention_mask"] == 0, 5)}  # other pad ids
    ra = fastspec.Probe(model).measure(a, step=0)
    rb = fastspec.Probe(model).measure(b, step=0)
    va, vb = _by_key(ra), _by_key(rb)
    assert va.keys() == vb.keys()
    for k in va:
        assert vb[k] == pytest.approx(va[k], rel=1e-9, abs=1e-12)
    assert {r.value for r in ra if r.metric == "n"} == {a["attention_mask"].sum().item()}
    # counted with the padded rows, the numbers would move: the probe must see a different mask
    rc = fastspec.Probe(model).measure({"input_ids": b["input_ids"]}, step=0)
    assert any(abs(_by_key(rc)[k] - va[k]) > 1e-6 * abs(va[k]) for k in va)


def test_attention_mask_passed_positionally_is_honoured():
    model = build("llama")
    inputs = batch(pad="left")
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming():
        model(inputs["input_ids"], inputs["attention_mask"])  # forward(input_ids, attention_mask, ...)
        records = probe.step(0)
    assert {r.value for r in records if r.metric == "n"} == {inputs["attention_mask"].sum().item()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_outputs_and_gradients_bitwise_unchanged(family):
    inputs = batch(pad="right")
    results = []
    for probed in (False, True):
        model = build(family).train()
        probe = fastspec.Probe(model, ffn_rows="all", queries=True, emit_every=1)
        ctx = probe.streaming() if probed else torch.enable_grad()
        with ctx:
            out = _train_step(model, inputs)
        if probed:
            assert probe.step(0)  # it did capture
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.logits.detach(), grads))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_gradient_checkpointing_recompute_is_not_counted_twice():
    inputs = batch(pad="left")
    valid = inputs["attention_mask"].sum().item()
    values = []
    for ckpt in (False, True):
        model = build("llama").train()
        if ckpt:
            model.gradient_checkpointing_enable()
        probe = fastspec.Probe(model, ffn_rows="all", emit_every=1)
        with probe.streaming():
            _train_step(model, inputs)
            records = probe.step(0)
        assert {r.value for r in records if r.metric == "n"} == {valid}
        values.append(_by_key(records))
    for k, v in values[0].items():
        assert values[1][k] == pytest.approx(v, rel=1e-9)


def test_measure_removes_hooks_restores_modes_and_attention_functions_on_error():
    model = build("llama").train()
    model.model.layers[1].eval()  # mixed modes must come back exactly
    before_hooks, before_fns = _hook_count(model), _attention_functions()
    probe = fastspec.Probe(model, queries=True, prerope_keys=True)
    bad = {"input_ids": torch.full((2, 5), 10_000)}  # out of vocabulary: the forward raises
    with pytest.raises(IndexError):
        probe.measure(bad, step=0)
    assert _hook_count(model) == before_hooks
    assert _attention_functions() == before_fns
    assert not hf_attention._CALLBACKS and not hf_attention._PATCHES
    assert model.training and not model.model.layers[1].training and model.model.layers[0].training
    assert probe.records() == []
    probe.measure(batch(), step=1)  # and it still works afterwards
    assert _hook_count(model) == before_hooks and model.training


def test_streaming_detach_removes_everything_and_context_manager_on_error():
    model = build("qwen3")
    before = _hook_count(model)
    probe = fastspec.Probe(model, queries=True, prerope_keys=True)
    with pytest.raises(RuntimeError, match="boom"), probe.streaming():
        assert _hook_count(model) > before and hf_attention._PATCHES
        raise RuntimeError("boom")
    assert _hook_count(model) == before and not hf_attention._PATCHES and not hf_attention._CALLBACKS


@pytest.mark.parametrize("forwards", ["train", "all"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast_bf16"])
def test_grad_modes_and_autocast(mode, forwards):
    """A forward under ``mode``, then a plain one, of a model in training mode. By default
    (``forwards="train"``) a forward under autocast trains and is captured, one under no_grad or
    inference_mode does not and is not; with ``forwards="all"`` each is captured, equal to the rest."""
    model = build("llama").train()  # dropout is off: the same numerics as in eval mode
    inputs = batch(pad="right")
    reference = _by_key(fastspec.Probe(model).measure(inputs, step=0))
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards=forwards)
    ctx = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode(),
           "autocast_bf16": torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    with probe.streaming():
        with ctx:
            model(**inputs)
        model(**inputs)  # a normal forward after inference mode must still update the state
        records = probe.step(0)
    got = _by_key(records)
    assert got.keys() == reference.keys()
    rel = 0.1 if mode == "autocast_bf16" else 1e-9  # bf16 activations: ~3 significant digits
    for k, v in reference.items():
        assert got[k] == pytest.approx(v, rel=rel)
    # the same rows twice leave the metrics as they are: the token counts tell what was captured
    forwards_captured = 1 if forwards == "train" and mode != "autocast_bf16" else 2
    tokens = inputs["attention_mask"].sum().item()
    assert {r.value for r in records if r.metric == "n"} == {forwards_captured * tokens}


def test_compiled_model_measure_runs_eager_module():
    model = build("gpt2")
    inputs = batch()
    compiled = torch.compile(model)
    want = _by_key(fastspec.Probe(model).measure(inputs, step=0))
    got = _by_key(fastspec.Probe(compiled).measure(inputs, step=0))
    assert got == want


def test_streaming_schedule_every_emit_reset_and_running_totals():
    model = build("llama")
    inputs = batch(B=2, T=8)
    tokens = 16
    for reset, expect_n in ((True, [2 * tokens, 2 * tokens]), (False, [2 * tokens, 4 * tokens])):
        probe = fastspec.Probe(model, every=2, emit_every=4, reset=reset, forwards="all")
        emitted = []
        with probe.streaming():
            for step in range(8):
                model(**inputs)  # steps 0, 2, 4, 6 are captured
                emitted.append(probe.step(step, tokens_seen=tokens * (step + 1)))
        assert [len(e) > 0 for e in emitted] == [False, False, False, True] * 2
        ns = [{r.value for r in e if r.metric == "n" and r.site == "keys"} for e in emitted if e]
        assert ns == [{expect_n[0]}, {expect_n[1]}]
        assert {r.tokens_seen for r in probe.records()} == {4 * tokens, 8 * tokens}


def test_token_sampling_row_step():
    model = build("gpt2")
    inputs = batch(B=2, T=9)
    probe = fastspec.Probe(model, ffn_rows="all", row_step=3, emit_every=1, forwards="all")
    with probe.streaming():
        model(**inputs)
        assert {r.value for r in probe.step(0) if r.metric == "n"} == {2 * 3}


def test_state_dict_round_trip_resumes_exactly():
    model = build("qwen3")
    inputs = [batch(seed=s) for s in range(4)]
    full = fastspec.Probe(model, emit_every=4, reset=False, forwards="all")
    with full.streaming():
        for i, b in enumerate(inputs):
            model(**b)
            full.step(i)
    first = fastspec.Probe(model, emit_every=4, reset=False, forwards="all")
    with first.streaming():
        for i, b in enumerate(inputs[:2]):
            model(**b)
            first.step(i)
    buf = io.BytesIO()
    torch.save({"probe": first.state_dict()}, buf)  # as it goes into a training checkpoint
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)["probe"]
    resumed = fastspec.Probe(model, emit_every=4, reset=False, forwards="all")
    resumed.load_state_dict(sd)
    with resumed.streaming():
        for i, b in enumerate(inputs[2:], start=2):
            model(**b)
            resumed.step(i)
    a, b = full.records(), resumed.records()
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        assert (ra.site, ra.layer, ra.head_index, ra.metric, ra.step) == (rb.site, rb.layer, rb.head_index, rb.metric, rb.step)
        if ra.site != "probe":  # the overhead record is a timing
            assert rb.value == pytest.approx(ra.value, rel=1e-12, abs=1e-12)


def test_records_dataframe_and_memory_independent_of_sequence_length():
    pd = pytest.importorskip("pandas")
    model = build("llama")
    sizes = []
    for T in (8, 32):
        probe = fastspec.Probe(model, emit_every=1, forwards="all")
        with probe.streaming():
            model(**batch(B=4, T=T))
            probe.step(0)
        sizes.append(sum(t.numel() for e in probe.state_dict()["accumulators"] for t in e["state"].values()))
        df = probe.to_dataframe()
    assert sizes[0] == sizes[1]
    assert list(df.columns) == ["step", "tokens_seen", "site", "layer", "head_index", "metric", "value",
                                "protocol", "layout"]
    assert len(df) == len(probe.records()) and isinstance(df, pd.DataFrame)
    assert probe.records()[0].as_dict().keys() == set(df.columns)
    # integers stay integers (nullable: a per-layer site has no head), and DataFrame.head still works
    assert {str(df[c].dtype) for c in ("step", "tokens_seen", "layer", "head_index")} == {"Int64"}
    assert df["head_index"].isna().any() and df["head_index"].notna().any()
    assert len(df.head(2)) == 2 and set(df["protocol"]) == {"stream"}


def test_records_say_which_protocol_measured_them():
    """An eval measurement and a streaming emission of the same step share every column but
    ``value`` and ``protocol``: the protocol is what keeps a groupby from averaging them."""
    model = build("llama")
    probe = fastspec.Probe(model, emit_every=1, forwards="all")
    with probe.streaming():
        model(**batch(B=2, T=8))
        stream = probe.step(3)
    evals = probe.measure(batch(B=2, T=8), step=3)
    assert stream and evals
    assert {r.protocol for r in stream} == {"stream"} and {r.protocol for r in evals} == {"eval"}
    key = lambda r: (r.step, r.site, r.layer, r.head_index, r.metric)
    assert {key(r) for r in evals} <= {key(r) for r in stream}
    df = probe.to_dataframe()
    assert not df.duplicated(["step", "site", "layer", "head_index", "metric", "protocol"]).any()
    # a state_dict keeps the protocol, and one written before it existed (and with "head") loads
    again = fastspec.Probe(model, emit_every=1)  # the same settings: restored without a warning
    again.load_state_dict(probe.state_dict())
    assert [r.protocol for r in again.records()] == [r.protocol for r in probe.records()]
    old = probe.state_dict()
    old["history"] = [{("head" if k == "head_index" else k): v for k, v in r.items() if k != "protocol"}
                      for r in old["history"]]
    again.load_state_dict(old)
    assert [r.head_index for r in again.records()] == [r.head_index for r in probe.records()]
    assert {r.protocol for r in again.records()} == {None}


def test_plain_module_with_module_sites():
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    probe = fastspec.Probe(net, keys=False, ffn=False, modules=["1", fastspec.probe.ModuleSite("2", io="input")])
    x = torch.randn(3, 10, 6)
    captured = {}
    h = net[1].register_forward_hook(lambda m, a, o: captured.__setitem__("out", o.detach()))
    records = probe.measure(x, step=0)
    h.remove()
    pr = {r.site: r.value for r in records if r.metric == "participation_ratio"}
    lam = torch.linalg.eigvalsh(torch.cov(captured["out"].reshape(-1, 16).double().T))
    assert pr["1"] == pytest.approx(fastspec.metrics.participation_ratio(lam).item(), rel=1e-6)
    assert pr["2"] == pytest.approx(pr["1"], rel=1e-6)  # input of [2] is the output of [1]


@pytest.mark.parametrize("kwargs, exc, name", [
    ({"keys": "yes"}, TypeError, "keys"),
    ({"key_convention": "svd"}, ValueError, "key_convention"),
    ({"every": 0}, ValueError, "every"),
    ({"emit_every": 1.5}, ValueError, "emit_every"),
    ({"budget": 2.0}, ValueError, "budget"),
    ({"sync": "some"}, ValueError, "sync"),
    ({"modules": [3]}, TypeError, "modules"),
    ({"modules": "no.such.module"}, ValueError, "modules"),
    ({"backend": "cuda"}, ValueError, "backend"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, name):
    model = build("gpt2")
    with pytest.raises(exc, match=name):
        fastspec.Probe(model, **kwargs).measure(batch(), step=0)


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="model"):
        fastspec.Probe("gpt2")
    with pytest.raises(ValueError, match="model"):
        fastspec.Probe(torch.nn.Linear(2, 2))  # keys/ffn need an HF model
    probe = fastspec.Probe(build("gpt2"))
    with pytest.raises(TypeError, match="batch"):
        probe.measure([1, 2, 3], step=0)
    with pytest.raises(TypeError, match="step"):
        probe.measure(batch(), step="0")
    with pytest.raises(ValueError, match="prerope_keys"):
        fastspec.Probe(build("gpt2"), prerope_keys=True)
    with pytest.raises(ValueError, match="state_dict"):
        probe.load_state_dict({"accumulators": []})


def test_registering_a_family_and_unknown_families(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(model.config, "model_type", "my_llama", raising=False)
    with pytest.warns(UserWarning, match="FAMILIES"):
        fastspec.Probe(model)  # unknown: Llama layout assumed, with a warning
    monkeypatch.setitem(fastspec.probe.FAMILIES, "my_llama", fastspec.probe.Family(
        ffn=r"(?:.*\.)?layers\.(\d+)\.mlp\.up_proj"))  # a different site, to see the table is used
    captured = {}
    h = model.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__(0, a[0]))
    records = fastspec.Probe(model, keys=False).measure(batch(), step=0)
    h.remove()
    n = {r.layer: r.value for r in records if r.site == "ffn" and r.metric == "n"}
    assert n == {0: 36.0, 1: 36.0}
    lam = torch.linalg.eigvalsh(torch.cov(captured[0].reshape(-1, 32).double().T))
    pr = [r.value for r in records if r.site == "ffn" and r.layer == 0 and r.metric == "participation_ratio"]
    assert pr == [pytest.approx(fastspec.metrics.participation_ratio(lam).item(), rel=1e-6)]


def test_warns_when_the_model_bypasses_the_attention_interface(monkeypatch):
    model = build("bert")
    # a model whose attention never reaches the interface: patch the watch to intercept nothing
    monkeypatch.setattr(hf_attention, "watch", lambda callbacks, impl: hf_attention.Watch([], []))
    with pytest.warns(UserWarning, match="site 'keys' captured no rows in this measurement.*attention interface"):
        records = fastspec.Probe(model).measure(batch(), step=0)
    assert {r.site for r in records} == {"ffn"}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generation_with_kv_cache_counts_each_new_token_once(family):
    """``generate`` with a KV cache and the probe on: the same tokens and scores as without it, and
    each token counted once (keys arrive with the whole cache; only the new ones count)."""
    model = build(family)
    inputs = batch(B=2, T=6, pad="left")
    # min_new_tokens: no sequence stops at an EOS, so every decode forward holds B new tokens
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    want = model.generate(**inputs, **kw)
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming():
        got = model.generate(**inputs, **kw)
        records = probe.step(0)
    assert torch.equal(got.sequences, want.sequences) and got.sequences.shape == (2, 6 + 8)
    assert all(torch.equal(g, w) for g, w in zip(got.scores, want.scores, strict=True))
    # prefill: the valid prompt tokens; then 7 decode forwards of one token per sequence (the 8th
    # token is sampled from the last forward's logits and never runs through the model)
    assert {r.site for r in records if r.metric == "n"} == {"keys", "ffn"}  # Qwen3 adds γ records
    assert {r.value for r in records if r.metric == "n"} == {inputs["attention_mask"].sum().item() + 2 * 7}
