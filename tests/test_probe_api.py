"""Probe API edges: what a user may pass (a tokenizer's BatchEncoding, NumPy ints), what raises
(an attention_mask that does not fit the tokens, a site that matches nothing, no site at all)
and what warns (step() without streaming, a site that captures no rows)."""
from __future__ import annotations

import types
import warnings

import pytest
import torch
from _tiny_models import batch, build, cache_kwarg, transformers

import fastspec
from fastspec.probe import ModuleSite, hf_attention


def _values(records) -> dict:
    return {(r.site, r.layer, r.head_index, r.metric): r.value for r in records}


def _n(records, site: str) -> set:
    return {r.value for r in records if r.site == site and r.metric == "n"}


def _fastspec_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fastspec.Probe")]


def _streaming_warnings(probe, model, steps: int) -> list[str]:
    """The fastspec warnings of ``steps`` streaming steps, each one forward on a fresh ``batch()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.streaming():
            for step in range(steps):
                model(**batch())
                probe.step(step)
    return _fastspec_warnings(caught)


def test_measure_and_spectra_take_any_mapping_of_model_kwargs():
    model = build("llama")
    inputs = batch(pad="left")
    probe = fastspec.Probe(model)
    want = _values(probe.measure(inputs, step=0))
    assert _values(probe.measure(transformers.BatchEncoding(inputs), step=0)) == want  # a UserDict
    assert _values(probe.measure(types.MappingProxyType(inputs), step=0)) == want
    spectra = probe.spectra(transformers.BatchEncoding(inputs))
    assert spectra.keys() == probe.spectra(inputs).keys() and spectra
    assert all(torch.equal(v, probe.spectra(inputs)[k]) for k, v in spectra.items())
    assert _n(probe.measure(inputs["input_ids"], step=0), "keys") == {inputs["input_ids"].numel()}
    with pytest.raises(TypeError, match="batch: expected a mapping of model kwargs .* or an input_ids tensor"):
        probe.measure([inputs["input_ids"]], step=0)
    with pytest.raises(TypeError, match="batch: input_ids is a list.*return_tensors='pt'"):
        probe.measure({"input_ids": inputs["input_ids"].tolist()}, step=0)


def test_step_without_streaming_warns_once_but_not_after_a_detach():
    model = build("gpt2")
    inputs = batch(B=2, T=8)
    probe = fastspec.Probe(model, emit_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**inputs)
        probe.step(0)
        probe.step(1)
    msgs = [m for m in _fastspec_warnings(caught) if "step()" in m]
    assert len(msgs) == 1 and "with probe.streaming():" in msgs[0] and "probe.attach()" in msgs[0]
    assert caught[0].filename == __file__  # points at the caller
    # legitimate: attached; one final step after detach; streaming() around each step's forwards
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, emit_every=2, forwards="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.streaming():
            model(**inputs)
            probe.step(0)
        final = probe.step(1)
        for step in (2, 3):
            with probe.streaming():
                model(**inputs)
            per_step = probe.step(step)
    assert _fastspec_warnings(caught) == []
    assert _n(final, "keys") == {16} and _n(per_step, "keys") == {32}  # steps 2 and 3 both captured
    with pytest.warns(UserWarning, match=r"step\(\) was called while the probe is not attached"):
        probe.step(4)  # a second call after detach: nothing can have been captured since


@pytest.mark.parametrize("make", [
    lambda m: m[:, :-3],                                   # shorter than the tokens
    lambda m: torch.cat([torch.ones_like(m[:, :2]), m], 1),  # longer, without a KV cache
    lambda m: m[:2],                                       # another batch size
    lambda m: m[0],                                        # 1-D
    lambda m: m.reshape(1, -1),                            # right numel, flattened
    lambda m: m.T.contiguous(),                            # right numel, [T, B]
], ids=["short", "long", "batch", "1d", "flat", "transposed"])
def test_attention_mask_that_does_not_fit_the_tokens_raises(make):
    model = build("llama")
    inputs = batch(B=3, T=12, pad="right")
    bad = {**inputs, "attention_mask": make(inputs["attention_mask"])}
    shape = r"\[3, 12\] \(the \[B, T\] of input_ids/inputs_embeds\), got \["
    probe = fastspec.Probe(model, emit_every=1, forwards="all")
    with pytest.raises(ValueError, match=r"attention_mask: expected a 2-D padding mask of shape " + shape):
        probe.measure(bad, step=0)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with probe.streaming():
        with pytest.raises(ValueError, match="attention_mask: .*" + shape):
            model(inputs_embeds=embeds, attention_mask=bad["attention_mask"])
        model(**inputs)  # the right mask still works
        assert _n(probe.step(0), "keys") == {inputs["attention_mask"].sum().item()}


def test_attention_mask_is_checked_inside_a_compiled_graph():
    """Compiled, the check runs at the first capture, in the model's graph (shape guards only):
    a compiled graph cannot raise the ValueError itself, it names it in dynamo's error, whose
    wording differs between torch versions."""
    model = build("gpt2")
    inputs = batch(B=3, T=12, pad="right")
    probe = fastspec.Probe(model, emit_every=1, forwards="all").attach()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            compiled(**inputs)
            assert _n(probe.step(0), "keys") == {inputs["attention_mask"].sum().item()}
            with pytest.raises((ValueError, torch._dynamo.exc.Unsupported)) as info:
                compiled(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :-3])
            # torch 2.13 prints the message whole; 2.11 prints the pieces of its f-string one by one
            # (``...shape '), ConstantVariable(str: '[3, 12]')``): both name the argument and the shape
            assert "attention_mask: expected a 2-D padding mask of shape " in str(info.value)
            assert "[3, 12]" in str(info.value)
    finally:
        probe.detach()
        torch._dynamo.reset()


class _PoolNet(torch.nn.Module):
    """Per-token rows (``proj``: [B, T, 8]) and per-sequence rows (``pool``: [B, 8])."""

    def __init__(self):
        super().__init__()
        self.proj, self.pool = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)

    def forward(self, x, attention_mask=None):
        return self.pool(self.proj(x).mean(1))


def test_mask_is_checked_against_each_sites_token_rows():
    net = _PoolNet()
    x = torch.randn(3, 6, 4)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1:, 4:] = 0  # right padding: 14 tokens
    probe = fastspec.Probe(net, keys=False, ffn=False, modules=["proj", ModuleSite("pool", heads=2, label="pool")])
    records = probe.measure({"x": x, "attention_mask": mask}, step=0)
    assert _n(records, "proj") == {14}
    assert _n(records, "pool") == {3}  # [B, H, D] heads of one row per sequence: not token rows
    with pytest.raises(ValueError, match=r"attention_mask: shape \[3, 4\] does not cover the token rows "
                                         r"\[3, 6\] .* of the proj activations"):
        probe.measure({"x": x, "attention_mask": mask[:, :4]}, step=0)
    with pytest.raises(ValueError, match=r"attention_mask: expected a 2-D padding mask of shape \[B, T\]"):
        probe.measure({"x": x, "attention_mask": mask[0]}, step=0)


def test_flattened_ffn_rows_get_the_padding_mask():
    """OPT runs its FFN on ``[B·T, d]`` rows: they are viewed as ``[B, T, d]`` so padding drops out."""
    model = build("opt")
    inputs = batch(B=3, T=12, pad="right")
    records = fastspec.Probe(model, keys=False, ffn_rows="all").measure(inputs, step=0)
    assert _n(records, "ffn") == {inputs["attention_mask"].sum().item()}


def test_generation_with_a_cache_may_pass_a_longer_mask():
    model = build("llama")
    inputs = batch(B=2, T=6, pad="left")
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming():
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        assert _n(probe.step(0), "ffn") == {inputs["attention_mask"].sum().item() + 2 * 2}


def _cache_names(model) -> list[str]:
    """Every keyword the installed transformers' forward takes a KV cache under: ``cache`` from
    5.24 on, where ``past_key_values`` stays as a deprecated alias; ``past_key_values`` before."""
    return ["cache", "past_key_values"] if cache_kwarg(model) == "cache" else ["past_key_values"]


def test_a_mask_longer_than_the_tokens_passes_with_a_cache_and_raises_without_one():
    """Decode step by hand: one new token per sequence, a mask over the cached tokens too. With
    the cache (under any name the forward takes, or by position) it passes and counts the new
    tokens; without a cache the same mask cannot be read and raises, ``use_cache=True`` or not."""
    model = build("llama")
    inputs = batch(B=2, T=6, pad="left")
    new = torch.tensor([[5], [7]])
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)  # [2, 7]
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24's deprecated past_key_values name
        for name in [*_cache_names(model), None]:  # None: positionally
            cache = transformers.DynamicCache()
            model(**inputs, **{cache_kwarg(model): cache}, use_cache=True)  # prefill fills the cache
            probe.step(0)  # drop the prefill's rows
            if name is None:  # forward(input_ids, attention_mask, position_ids, cache, ...)
                model(new, mask, None, cache)
            else:
                model(input_ids=new, attention_mask=mask, **{name: cache})
            assert _n(probe.step(0), "ffn") == {2}
        for kw in ({}, {"use_cache": True}):
            with pytest.raises(ValueError, match=r"attention_mask: expected .* shape \[2, 1\] \(the \[B, T\] of"):
                model(input_ids=new, attention_mask=mask, **kw)
        # a cache may make the mask longer, never shorter
        with pytest.raises(ValueError, match=r"attention_mask: expected .* shape \[2, >= 6\] .* KV cache"):
            model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :4],
                  **{cache_kwarg(model): transformers.DynamicCache()})


class _KVNet(torch.nn.Module):
    """A forward that takes its KV cache under a name of its own (``kv``)."""

    def forward(self, input_ids, attention_mask=None, kv=None):
        return input_ids


def test_a_cache_object_under_any_keyword_counts_as_a_cache():
    """The object decides, not the argument's name: a ``Cache`` passed as ``kv=`` lets the mask
    cover earlier tokens; ``kv=None`` (or a non-cache value) does not."""
    from fastspec.probe.hooks import ForwardScope

    net = _KVNet()  # the pre-hook reads the model's train/eval mode: handed the module as a hook is
    scope = ForwardScope(net)
    ids, mask = torch.ones(2, 1, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)
    scope.start(net, (ids, mask), {"kv": transformers.DynamicCache()})
    assert scope.mask is not None and scope.mask.shape == (2, 7)
    scope.reset()
    for kv in (None, torch.zeros(2, 6)):
        with pytest.raises(ValueError, match=r"shape \[2, 1\] \(the \[B, T\] of input_ids/inputs_embeds\), got \[2, 7\]"):
            scope.start(net, (ids, mask), {"kv": kv})
        scope.reset()


def test_sites_that_capture_no_rows_warn_with_a_hint(monkeypatch):
    model = build("llama")
    for layer in model.model.layers:
        layer.mlp.spare = torch.nn.Linear(48, 32)  # matched by the family below, never called
    monkeypatch.setattr(model.config, "model_type", "spare_llama", raising=False)
    monkeypatch.setitem(fastspec.probe.FAMILIES, "spare_llama",
                        fastspec.probe.Family(ffn=r"(?:.*\.)?layers\.(\d+)\.mlp\.spare"))
    # the embedding's input holds token ids: no floating-point rows
    probe = fastspec.Probe(model, modules=ModuleSite("model.embed_tokens", io="input"), emit_every=1,
                           forwards="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = probe.measure(batch(), step=0)
    msgs = _fastspec_warnings(caught)
    assert len(msgs) == 2 and {r.site for r in records} == {"keys"}
    assert "site 'ffn' captured no rows in this measurement" in msgs[0]
    assert "fastspec.probe.FAMILIES" in msgs[0] and "ffn=False" in msgs[0]
    assert "site 'model.embed_tokens' captured no rows" in msgs[1] and "floating-point input" in msgs[1]
    # streaming: at the first emission, once per site
    msgs = _streaming_warnings(probe, model, 3)
    assert [m.split("'")[1] for m in msgs] == ["ffn", "model.embed_tokens"]
    assert all("captured no rows by step 0" in m for m in msgs)


def test_streaming_warns_when_the_model_bypasses_the_attention_interface(monkeypatch):
    model = build("bert")
    monkeypatch.setattr(hf_attention, "watch", lambda callbacks, impl: hf_attention.Watch([], []))
    probe = fastspec.Probe(model, emit_every=1, forwards="all")
    msgs = _streaming_warnings(probe, model, 2)
    assert len(msgs) == 1 and "site 'keys' captured no rows by step 0" in msgs[0]
    assert "attention interface" in msgs[0]


def test_sites_that_match_nothing_or_no_site_at_all_raise_at_construction(monkeypatch):
    model = build("gpt2")
    with pytest.raises(ValueError, match="modules: no module name matches 'no.such.module'"):
        fastspec.Probe(model, modules="no.such.module")
    for kw in ({}, {"modules": []}):
        with pytest.raises(ValueError, match="no site selected"):
            fastspec.Probe(model, keys=False, ffn=False, **kw)
    monkeypatch.setitem(fastspec.probe.FAMILIES, "gpt2", fastspec.probe.Family(ffn=r"h\.(\d+)\.nothing"))
    with pytest.raises(ValueError, match=r"ffn: no module matches .*FAMILIES, or pass ffn=False"):
        fastspec.Probe(model)
    with pytest.raises(TypeError, match="clock"):
        fastspec.Probe(model, ffn=False, clock=1.0)


def test_module_site_arguments_and_duplicate_site_names_raise():
    model = build("gpt2")
    with pytest.raises(TypeError, match="modules: expected a glob string, a ModuleSite or a list of them, got int"):
        fastspec.Probe(model, modules=3)
    for kw in ({"heads": True}, {"label": 3}, {"label": ""}):
        with pytest.raises(ValueError, match="modules: "):
            ModuleSite("transformer.h.*.mlp.act", **kw)
    # one accumulator per site name: two sites of one name would merge their rows
    for modules, kw in ((["transformer.h.*.mlp.act"] * 2, {}),
                        (ModuleSite("transformer.h.*.mlp.act", label="ffn"), {})):
        with pytest.raises(ValueError, match=r"modules: site name\(s\) \[.*\] used twice"):
            fastspec.Probe(model, modules=modules, **kw)
    probe = fastspec.Probe(model, keys=False, ffn=False,
                           modules=ModuleSite("transformer.h.*.mlp.c_proj", io="input", label="ffn"))
    assert {r.site for r in probe.measure(batch(), step=0)} == {"ffn"}


def test_steps_and_tokens_seen_take_numpy_ints_and_name_bad_ones():
    np = pytest.importorskip("numpy")
    model = build("gpt2")
    probe = fastspec.Probe(model, emit_every=1, forwards="all")
    records = probe.measure(batch(), step=np.int64(3), tokens_seen=np.int64(100))
    assert {(r.step, r.tokens_seen) for r in records} == {(3, 100)} and type(records[0].step) is int
    with probe.streaming():
        model(**batch())
        assert {(r.step, r.tokens_seen) for r in probe.step(np.int32(4), np.int64(7))} == {(4, 7)}
    for kw, exc in (({"tokens_seen": "100"}, TypeError), ({"tokens_seen": -1}, ValueError),
                    ({"tokens_seen": 1.0}, TypeError)):
        with pytest.raises(exc, match="tokens_seen"):
            probe.measure(batch(), step=0, **kw)
    for step in (1.0, True, "1"):
        with pytest.raises(TypeError, match="step: expected an int"):
            probe.step(step)


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _captured_rows(probe) -> int:
    return sum(int(acc.cov.n.sum()) for acc in probe._totals.accs.values() if acc.cov.device is not None)


def test_probe_is_a_context_manager_and_close_removes_every_hook_also_on_error():
    model = build("llama")
    bare = _hook_count(model)
    with pytest.raises(RuntimeError, match="training failed"):
        with fastspec.Probe(model, emit_every=1, forwards="all") as probe:
            assert isinstance(probe, fastspec.Probe)
            probe.attach()
            assert _hook_count(model) > bare
            model(**batch())
            rows = _captured_rows(probe)
            assert rows > 0
            raise RuntimeError("training failed")
    assert _hook_count(model) == bare and not probe._hooks.installed
    model(**batch())  # neither a module hook nor the attention interface captures any more
    assert _captured_rows(probe) == rows
    assert probe.step(0) and probe.records()  # the final step still emits what was accumulated

    probe = fastspec.Probe(model).attach()
    probe.close()
    probe.close()  # twice is fine
    assert _hook_count(model) == bare
    with fastspec.Probe(model) as probe:  # entering attaches nothing; measure works as ever
        assert _hook_count(model) == bare and probe.measure(batch(), step=0)
    assert _hook_count(model) == bare and probe.records()


def test_measurement_over_several_batches_is_one_measure_of_all_their_tokens():
    """Probe.measurement(): the records of batches A and B are those of one measure() of A and B
    stacked (the sums merge exactly; only the float32 FFN products' rounding differs), its spectra
    those of Probe.spectra, from one solve; each forward restores the train flag; misuse raises."""
    model = build("qwen3").train()
    probe = fastspec.Probe(model, queries=True, prerope_keys=True)
    a, b = batch(B=2, T=10, pad="right", seed=1), batch(B=3, T=10, pad="left", seed=2)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    want = _values(probe.measure(both, step=0))
    m = probe.measurement(timed=True)
    m.forward(a)
    assert model.training  # restored after each forward
    m.forward(b)
    assert m.capture_seconds > 0 and m.forwards == 2
    records, spectra = m.finish(step=7, tokens_seen=5, spectra=True)
    got = _values(records)
    assert got.keys() == want.keys() and {r.step for r in records} == {7}
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-5, abs=1e-9), key
    assert got[("keys", 0, 0, "n")] == int(both["attention_mask"].sum())
    ref = probe.spectra(both)
    assert spectra.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(spectra[key], ref[key], rtol=1e-5, atol=1e-7)
    assert m.solve_seconds > 0
    assert [r.step for r in probe.records()].count(7) == len(records)  # in the probe's history too
    with pytest.raises(RuntimeError, match="finished"):
        m.forward(a)
    with pytest.raises(RuntimeError, match="already finished"):
        m.finish(step=8)
    with pytest.raises(ValueError, match="no forward ran"):
        probe.measurement().finish(step=0)
    with pytest.raises(RuntimeError, match="timed=True"):
        probe.measurement().capture_seconds


def test_measurement_warns_like_measure_at_the_callers_line():
    """Measurement.finish warns for rows refused for NaN/Inf, as measure() does, pointing at the caller."""
    model = build("llama")
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda mod, args: (args[0].clone().fill_(float("nan")),))
    m = fastspec.Probe(model).measurement()
    m.forward(batch())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.finish(step=0)
    found = [w for w in caught if "NaN/Inf" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__
