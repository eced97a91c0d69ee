"""Streaming probes inside ``torch.compile``: no graph break, no recompile, the eager records.

The hooks are traced with the model; each capture is one ``fastspec::covariance_update_`` op
gated by a device tensor (fastspec/probe/routing.py, fastspec/covariance/ops.py). Most tests
use ``backend="aot_eager"``: dynamo, AOTAutograd and functionalization, which is where graph
breaks, recompiles and in-place state mutation are decided, without a C++ compile; one test
runs Inductor end to end. CUDA graphs (``mode="reduce-overhead"``) need a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch
from _tiny_models import batch, build

import fastspec
from fastspec.probe.budget import CALIBRATE_EVERY

FAMILIES = ["llama", "qwen3", "gpt2"]
OP = "fastspec.covariance_update_"


def _probe(model, name: str, **kw) -> fastspec.Probe:
    # these forwards are eval/no_grad ones: stream them too (which stream: tests/test_probe_forwards.py)
    return fastspec.Probe(model, queries=True, prerope_keys=name != "gpt2", ffn_rows="all", forwards="all", **kw)


def _values(records) -> dict:
    return {(r.step, r.site, r.layer, r.head_index, r.metric): r.value for r in records
            if r.site != "probe"}  # overhead_fraction: a timing, not a statistic


def _ops(graph_module) -> int:
    """How many ``fastspec::covariance_update_`` captures a traced graph holds, in the subgraphs of
    its higher-order ops too (a checkpointed layer is one: ``wrap_body_N``)."""
    return sum(n.op == "call_function" and OP in str(n.target)
               for gm in graph_module.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes)


def _assert_same(got: dict, want: dict, rel: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    bad = [(k, got[k], want[k]) for k in want
           if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k]))
                   or abs(got[k] - want[k]) <= rel * abs(want[k]))]
    assert not bad, f"{len(bad)} of {len(want)} records differ, e.g. {bad[:3]}"


def _stream(model, forward, probe, inputs: list[dict], steps: int) -> dict:
    with probe.streaming():
        for step in range(steps):
            with torch.no_grad():
                forward(**inputs[step % len(inputs)])
            probe.step(step)
    return _values(probe.records())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", FAMILIES)
def test_explain_reports_no_graph_break_and_one_op_per_capture(name):
    model = build(name)
    probe = _probe(model, name).attach()
    try:
        explained = torch._dynamo.explain(model)(**batch(pad="right"))
    finally:
        probe.detach()
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1
    layers = model.config.num_hidden_layers
    sites = 4 if name != "gpt2" else 3  # keys, queries, ffn (+ pre-RoPE keys)
    ops = [n for n in explained.graphs[0].graph.nodes if n.op == "call_function" and OP in str(n.target)]
    assert len(ops) == sites * layers


@pytest.mark.parametrize("name", FAMILIES)
def test_fullgraph_records_equal_eager(name):
    """every=2 and emissions every 3 steps, padded batches: the same records as eager."""
    model = build(name)
    inputs = [batch(seed=s, pad="right" if s % 2 else "left") for s in range(3)]
    want = _stream(model, model, _probe(model, name, every=2, emit_every=3), inputs, steps=9)
    probe = _probe(model, name, every=2, emit_every=3)
    probe.attach()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = _stream(model, compiled, probe, inputs, steps=9)
    _assert_same(got, want)
    assert {k[0] for k in got} == {2, 5, 8}


@pytest.mark.slow
def test_varying_sequence_lengths_go_dynamic_once_and_equal_eager():
    """Batches of 8, 12, 16, 10 tokens: dynamo recompiles once with dynamic shapes (torch's
    own behaviour, probe or not), the capture ops take symbolic row counts, and the records
    are the eager ones."""
    from torch._dynamo.utils import counters

    model = build("llama")
    inputs = [batch(T=T, seed=T, pad="right") for T in (8, 12, 16, 10)]
    want = _stream(model, model, _probe(model, "llama", emit_every=2), inputs, steps=8)
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = _stream(model, compiled, _probe(model, "llama", emit_every=2), inputs, steps=8)
    _assert_same(got, want)
    assert counters["stats"]["unique_graphs"] == 2


def test_attach_after_compile_recompiles_once_then_captures():
    model = build("llama")
    inputs = [batch(seed=s) for s in range(2)]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        plain = compiled(**inputs[0]).logits  # compiled without hooks
    want = _stream(model, model, _probe(model, "llama", emit_every=2), inputs, steps=4)
    probe = _probe(compiled, "llama", emit_every=2)  # the compiled wrapper is accepted
    got = _stream(model, compiled, probe, inputs, steps=4)
    _assert_same(got, want)
    with torch.no_grad():
        again = compiled(**inputs[0]).logits  # detached: hooks gone, recompiled without them
    assert torch.equal(plain, again)


def test_measure_runs_eagerly_next_to_submodules_compiled_in_place():
    """Attention and MLP compiled in place (as under FSDP2): streaming captures in their graphs,
    and a measurement afterwards still sees every site (it runs with compilation off; the
    graph traced for streaming would drop measurement captures)."""
    model = build("llama")
    inputs = batch(pad="left")
    want = _values(fastspec.Probe(model, ffn_rows="all").measure(inputs, step=0))
    for layer in model.model.layers:
        layer.self_attn.compile(fullgraph=True, backend="aot_eager")
        layer.mlp.compile(fullgraph=True, backend="aot_eager")
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming():
        with torch.no_grad():
            model(**inputs)
        assert probe._router.captured_in_graph
        streamed = _values(probe.step(0))
        measured = _values(probe.measure(inputs, step=0))
    _assert_same(measured, want)
    _assert_same(streamed, want)


def test_layers_compiled_one_by_one_keep_their_sites():
    """``layers[i] = torch.compile(layers[i])`` puts ``_orig_mod`` in every module name below
    it; the FFN, pre-RoPE and module sites are still found, and record what eager streaming does."""
    model = build("qwen3")
    inputs = [batch(seed=s) for s in range(2)]
    kw = dict(modules="model.layers.*.mlp.act_fn", every=1, emit_every=2)
    want = _stream(model, model, _probe(model, "qwen3", **kw), inputs, steps=2)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert any("._orig_mod." in n for n, _ in model.named_modules())
    got = _stream(model, model, _probe(model, "qwen3", **kw), inputs, steps=2)
    _assert_same(got, want)


def test_no_recompile_across_100_steps_with_emission_and_a_changing_interval():
    """A budget that changes ``every`` (a fake clock makes captured steps expensive, then
    cheap), emissions every 10 steps: one graph, never recompiled; the token counts follow the
    schedule exactly."""
    model = build("llama")
    inputs = batch(B=2, T=8)
    now = [0.0]
    probe = fastspec.Probe(model, ffn_rows="all", budget=0.1, emit_every=10, clock=lambda: now[0], forwards="all")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    everys, captured, counted = [], 0, []
    with probe.streaming():
        for step in range(100):
            due = probe._router.capture_this_step
            with torch.no_grad():
                compiled(**inputs)
            if step == 0:
                torch.compiler.set_stance("fail_on_recompile")  # from here on a recompile raises
            captured += due
            now[0] += 1.0 + (0.5 if due and step < 50 else 0.0)  # capture costs 50%, then nothing
            records = probe.step(step)
            everys.append(probe.every)
            n = {r.value for r in records if r.site == "keys" and r.metric == "n"}
            if n:
                counted.append((n, captured))
                captured = 0
    torch.compiler.set_stance("default")
    assert len(counted) == 10
    assert all(n == {16.0 * c} for n, c in counted), counted  # 16 tokens per captured step
    assert len(set(everys)) > 2 and max(everys) >= 5  # throttled by the budget ...
    assert everys[-1] < max(everys)  # ... and relaxed once captures became cheap
    assert probe.overhead()["capture"] is not None


def test_untimed_captures_leave_calibration_steps_idle_with_a_budget():
    b = fastspec.probe.budget.OverheadBudget(0.5, 1)
    assert all(b.capture_due(s) for s in range(40))  # eager: captures are timed, every step
    b.observe(None, 0.0, 1.2, captured=True)
    assert b.capture_cost is None  # nothing idle to compare with yet
    due = [b.capture_due(s) for s in range(2 * CALIBRATE_EVERY)]
    assert due.count(False) == 2 and not due[CALIBRATE_EVERY - 1]
    b.observe(None, 0.0, 1.0, captured=False)
    b.observe(None, 0.0, 1.2, captured=True)
    assert b.capture_cost == pytest.approx(0.2)
    b.observe(None, 0.0, 60.0, captured=True)  # a recompile: the median does not move
    assert b._untimed_capture_s(1.2, True) == pytest.approx(0.2)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_outputs_and_gradients_bitwise_equal_with_and_without_the_probe(backend):
    """Keys, queries and FFN inputs are tensors the compiled model writes to memory anyway (the
    attention and down-projection inputs), so reading them changes nothing, Inductor included.
    Pre-RoPE keys are not: Inductor fuses k_norm into RoPE, and a probe that reads k_norm's
    output makes it store that output and recompute less, which may move results by an ulp;
    so they are checked bitwise only where nothing is fused (docs/compile.md)."""
    model = build("qwen3").train()
    inputs = batch(pad="right")
    labels = inputs["input_ids"]
    sites = dict(queries=True, prerope_keys=backend != "inductor", ffn_rows="all", emit_every=1)

    def train_step(forward):
        model.zero_grad(set_to_none=True)
        out = forward(**inputs, labels=labels)
        out.loss.backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    plain = train_step(torch.compile(model, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    probe = fastspec.Probe(model, **sites)
    with probe.streaming():
        probed = train_step(torch.compile(model, fullgraph=True, backend=backend))
        records = probe.step(0)
    assert torch.equal(plain[0], probed[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], probed[1]))
    eager = fastspec.Probe(model, **sites)
    with eager.streaming():
        model(**inputs, labels=labels)
        want = eager.step(0)
    _assert_same(_values(records), _values(want))


def _explain(model, probe, **inputs):
    """``torch._dynamo.explain`` of one forward, with ``probe`` attached for it (or None)."""
    torch._dynamo.reset()
    if probe is not None:
        probe.attach()
    try:
        return torch._dynamo.explain(model)(**inputs)
    finally:
        if probe is not None:
            probe.detach()
        torch._dynamo.reset()


def test_activation_checkpointing_no_break_and_no_recompute_counted():
    """Hooks inside checkpointed layers are traced into the checkpoint's subgraph (which allows
    no Python side effects); the recompute in backward is not counted, as eagerly.

    What fastspec promises is checked against the model's own behaviour, not against its
    fullgraph status: transformers 5.25's checkpointed Llama breaks the graph by itself (its
    output capturing mutates a context variable inside the checkpoint, "HOP: Unsafe side
    effect"), with or without a probe. The probe adds no break of its own (the same breaks, the
    same graphs, none in fastspec's code), where the model has none its captures are ops of the
    graph and ``fullgraph=True`` compiles, and the compiled records are the eager ones, the
    recompute not counted."""
    model = build("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = dict(batch(), use_cache=False)
    inputs["labels"] = inputs["input_ids"]

    def run(forward):
        probe = fastspec.Probe(model, ffn_rows="all", emit_every=1)
        with probe.streaming():
            forward(**inputs).loss.backward()
            return _values(probe.step(0))

    want = run(model)
    alone = _explain(model, None, **inputs)
    probed = _explain(model, fastspec.Probe(model, ffn_rows="all"), **inputs)
    assert probed.graph_break_count == alone.graph_break_count, [r.reason for r in probed.break_reasons]
    assert probed.graph_count == alone.graph_count
    ours = [r.reason for r in probed.break_reasons
            if any("fastspec" in str(frame.filename) for frame in r.user_stack)]
    assert not ours, ours
    model_breaks = alone.graph_break_count > 0
    if not model_breaks:  # every capture is an op of the one graph (in its layers' checkpoint
        # subgraphs): 2 sites (keys, FFN) per layer
        assert probed.graph_count == 1
        assert _ops(probed.graphs[0]) == 2 * model.config.num_hidden_layers
    got = run(torch.compile(model, fullgraph=not model_breaks, backend="aot_eager"))
    _assert_same(got, want)
    assert {v for k, v in got.items() if k[-1] == "n"} == {36.0}  # 3 x 12 tokens, once


def test_nan_rows_masks_and_row_sampling_in_the_graph():
    """A plain module site: refused NaN rows, the padding mask and row_step counted in the graph
    exactly as eagerly."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)

        def forward(self, x, attention_mask=None):
            return self.b(torch.relu(self.a(x)))

    net = Net()
    x = torch.randn(3, 10, 6)
    x[1, 4, 2] = float("nan")
    x[2, 7, 0] = float("inf")
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[2, 8:] = 0

    def run(forward):
        probe = fastspec.Probe(net, keys=False, ffn=False, row_step=2, emit_every=1,
                               modules=[fastspec.probe.ModuleSite("a", heads=2), fastspec.probe.ModuleSite("b", io="input")])
        with probe.streaming():
            forward(x, attention_mask=mask)
            with pytest.warns(UserWarning, match=r"NaN/Inf .* at 2 site layers: a \(1 of 14 rows\); b \(1 of 14"):
                return _values(probe.step(0))  # the rejected rows are reported, eager and compiled

    want = run(net)
    got = run(torch.compile(net, fullgraph=True, backend="aot_eager"))
    _assert_same(got, want)
    assert got[(0, "a", None, 0, "rejected")] == 1.0  # x[1, 4] is a kept row (row_step 2), NaN
    # kept rows t = 0, 2, .., 8 of 3 sequences, less the NaN row and the padded x[2, 8]
    # (x[2, 7], the Inf, is not a kept row)
    assert got[(0, "b", None, None, "n")] == 3 * 5 - 1 - 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode, cuda_graphs", [(None, False), (None, True), ("reduce-overhead", True)])
def test_cuda_compiled_and_cuda_graphs_equal_eager(mode, cuda_graphs):
    """Default mode with the gate on the host or on the GPU, and CUDA graphs (which need the
    GPU gate): the records of eager streaming, and no CUDA graph skipped."""
    from torch._dynamo.utils import counters

    model = build("llama").cuda()
    inputs = [{k: v.cuda() for k, v in batch(seed=s).items()} for s in range(2)]
    want = _stream(model, model, _probe(model, "llama", every=2, emit_every=4), inputs, steps=8)
    probe = _probe(model, "llama", every=2, emit_every=4, cuda_graphs=cuda_graphs)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    counters.clear()
    got = _stream(model, compiled, probe, inputs, steps=8)
    _assert_same(got, want, rel=1e-5)
    if mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0
