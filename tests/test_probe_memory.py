"""The probe's memory plan in one process (``fastspec/probe/plan.py``, ``layout.py``,
``Probe(memory=...)``, ``probe.memory()``, ``fastspec plan``): the budget argument, the layouts a
budget chooses and the errors it raises, what ``memory()`` reports against the tensors the probe
owns and against what its work really allocates, the rotation of FFN layers (each window's
record equal to the float64 spectrum of that window's rows), eval measurements under a budget,
records' ``layout``, checkpoints, compile, and the planner's figures at the Llama-3-8B and 70B
shapes. Data-parallel ownership and tensor parallelism: tests/test_probe_scale.py.

The model is ``wide_llama`` (4 layers, d_ff 512): 2.1 MB of float64 FFN totals a layer, so budgets
of a few MB choose between the layouts. Budgets are taken from the planner's own figures (the
least a layout needs), so each test forces the layout it names.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _memory import Allocations, FFNRows, ffn_reference, least_budget
from _tiny_models import batch, wide_llama

import fastspec
from fastspec.probe import plan
from fastspec.probe.layout import resolve_budget

ROOT = Path(__file__).resolve().parents[1]
KW = {"ffn_rows": "all", "forwards": "all", "emit_every": 1}
METRICS = ("participation_ratio", "entropy_rank", "sui", "n")


def _stage(model, **kw) -> plan.Stage:
    return fastspec.Probe(model, **{**KW, **kw})._wide.stage


def _budget(stage: plan.Stage, mode: str, totals: str, fit: int | None = None, ranks=None) -> int:
    return least_budget(stage, mode, totals, fit, ranks)


reference = ffn_reference


def _values(records, site="ffn") -> dict:
    return {(r.layer, r.metric): r.value for r in records if r.site == site}


def _assert_metrics(got: dict, layer: int, want: dict, rel: float) -> None:
    for name in METRICS:
        assert got[(layer, name)] == pytest.approx(want[name], rel=rel), (layer, name)


# --------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("value, want", [("4GB", ("bytes", 4e9)), ("512 MiB", ("bytes", 2.0 ** 29)),
                                         ("1.5gb", ("bytes", 1.5e9)), (123456, ("bytes", 123456.0)),
                                         (0.25, ("fraction", 0.25)), (1.0, ("fraction", 1.0)), (None, None)])
def test_memory_argument_forms(value, want):
    assert plan.memory_arg(value) == want


@pytest.mark.parametrize("value", ["4 furlongs", "GB", "", 0, -5, 1.5, 0.0, True, [1]])
def test_memory_argument_errors_name_it(value):
    with pytest.raises((ValueError, TypeError), match="^memory: "):
        plan.memory_arg(value)
    with pytest.raises((ValueError, TypeError), match="^memory: "):
        fastspec.Probe(wide_llama(), memory=value)


def test_default_budget_is_a_fraction_of_a_cuda_device_and_none_on_the_cpu(monkeypatch):
    import fastspec.probe.layout as layout

    assert resolve_budget(None, torch.device("cpu")) is None
    monkeypatch.setattr(layout, "device_total", lambda device: 80 * 10 ** 9)
    assert resolve_budget(None, torch.device("cuda", 0)) == int(plan.DEFAULT_FRACTION * 80e9) == 4 * 10 ** 9
    assert resolve_budget(("fraction", 0.1), torch.device("cuda", 0)) == 8 * 10 ** 9
    assert resolve_budget(("bytes", 12345.0), torch.device("cpu")) == 12345


# ----------------------------------------------------------------------------------- layouts
def test_a_budget_picks_the_first_layout_that_fits():
    model = wide_llama()
    stage = _stage(model)
    assert fastspec.Probe(model, **KW).layout.mode == "default"  # no budget on the CPU: as before
    cases = [(_budget(stage, "replicated", "float64"), ("replicated", "float64", 1)),
             (_budget(stage, "replicated", "float32"), ("replicated", "float32", 1)),
             (_budget(stage, "replicated", "float32", fit=2), ("replicated", "float32", 2)),
             (_budget(stage, "replicated", "float32", fit=1), ("replicated", "float32", 4))]
    for budget, want in cases:
        probe = fastspec.Probe(model, **KW, memory=budget)
        got = (probe.layout.mode, probe.layout.totals, probe.layout.groups)
        assert got == want, (budget, got)
        assert probe.memory()["planned_peak"] <= budget
    sv = fastspec.Probe(model, **KW, ffn_convention="sv", memory=_budget(stage, "replicated", "float32"))
    assert sv.layout.totals == "float64" and sv.layout.groups > 1  # sv spectra never in float32


def test_a_budget_below_one_layer_is_refused_naming_d_ff_the_bytes_and_the_budget():
    model = wide_llama()
    least = _budget(_stage(model), "replicated", "float32", fit=1)
    with pytest.raises(ValueError, match=r"^memory: one FFN layer \(d_ff 512\) needs 1.05 MB of float32 totals "
                                         r"and .* over the budget"):
        fastspec.Probe(model, **KW, memory=least - 1)
    with pytest.raises(ValueError, match=r"^memory: the budget 1 MB does not hold the replicated sites"):
        fastspec.Probe(model, **KW, memory="1MB")
    with pytest.raises(ValueError, match="reset=False keeps every layer's running totals"):
        fastspec.Probe(model, **KW, reset=False, memory=least)
    assert fastspec.Probe(model, **KW, ffn=False, memory="10MB").layout.mode == "replicated"  # keys alone fit


# ------------------------------------------------------------------------------------ memory()
def _owned_bytes(probe) -> dict[str, int]:
    """Bytes of every accumulator tensor in the probe's checkpoint state, per site."""
    out: dict[str, int] = {}
    for e in probe.state_dict()["accumulators"]:
        n = sum(t.numel() * t.element_size() for t in (e["state"] or {}).values())
        out[e["site"]] = out.get(e["site"], 0) + n
    return out


@pytest.mark.parametrize("layout", ["default", "replicated-float64", "replicated-float32", "rotation"])
def test_memory_is_what_the_probe_owns_and_its_peak_is_the_plan_s(layout):
    model = wide_llama()
    stage = _stage(model)
    budget = {"default": None, "replicated-float64": _budget(stage, "replicated", "float64"),
              "replicated-float32": _budget(stage, "replicated", "float32"),
              "rotation": _budget(stage, "replicated", "float32", fit=1)}[layout]
    probe = fastspec.Probe(model, **{**KW, "emit_every": 2}, memory=budget)
    assert probe.memory()["now"] == 0 and probe.memory()["peak"] == 0
    with probe.streaming():
        for step in range(3):  # mid-window at the end: accumulators held
            model(**batch(B=2, T=8, seed=step))
            probe.step(step)
    mem, owned = probe.memory(), _owned_bytes(probe)
    assert mem["now"] == sum(owned.values()) > 0
    assert {k: v for k, v in mem["sites"].items() if v} == {k: v for k, v in owned.items() if v}
    if budget is not None:
        assert mem["peak"] == mem["planned_peak"] <= budget  # every kept layer allocated and emitted once
    ffn = {e["layer"] for e in probe.state_dict()["accumulators"] if e["site"] == "ffn"}
    held = {e["layer"] for e in probe.state_dict()["accumulators"] if e["site"] == "ffn" and e["state"]}
    assert held == ({0} if layout == "rotation" else {0, 1, 2, 3}) or (layout == "rotation" and held <= ffn)
    totals = {t.dtype for e in probe.state_dict()["accumulators"] if e["site"] == "ffn" and e["state"]
              for k, t in e["state"].items() if k == "m2"}
    assert totals == {torch.float32 if layout in ("replicated-float32", "rotation") else torch.float64}


@pytest.mark.parametrize("fit", [None, 1], ids=["float32", "rotation"])
def test_what_captures_and_emissions_allocate_stays_within_the_peak_and_the_budget(monkeypatch, fit):
    """The probe's captures and emissions run under an allocation tracker: the bytes the probe held
    plus what each piece of work allocated never exceed ``memory()["peak"]``, nor the budget (the
    eigensolver's own copy of its input, which no tracker sees, is in the peak as the plan's)."""
    from fastspec.probe.emission import Emitter
    from fastspec.probe.sites import Collector

    model = wide_llama()
    stage = _stage(model)
    budget = _budget(stage, "replicated", "float32", fit=fit)
    probe = fastspec.Probe(model, **KW, memory=budget)
    seen = []

    def tracked(fn):
        def run(self, *args, **kwargs):
            held = probe.memory()["now"]
            with Allocations() as mem:
                out = fn(self, *args, **kwargs)
            seen.append(held + mem.peak)
            return out
        return run

    monkeypatch.setattr(Collector, "update", tracked(Collector.update))
    monkeypatch.setattr(Emitter, "records", tracked(Emitter.records))
    with probe.streaming():
        for step in range(4):
            model(**batch(B=3, T=12, seed=step))
            probe.step(step)
    assert len(seen) > 8
    assert max(seen) <= probe.memory()["peak"] <= budget, (max(seen), probe.memory())


# ----------------------------------------------------------------------------------- rotation
def test_rotation_reports_each_layer_in_turn_equal_to_its_window_s_rows():
    model = wide_llama()
    budget = _budget(_stage(model), "replicated", "float32", fit=1)
    probe = fastspec.Probe(model, **KW, memory=budget)
    assert probe.layout.groups == 4
    rows = FFNRows(model)
    with probe.streaming():
        for step in range(6):
            inputs = batch(B=2, T=10, pad="left", seed=step)
            model(**inputs)
            records = probe.step(10 + step)
            window = rows.take()
            got = _values(records)
            layer = step % 4  # one layer a window, in layer order
            assert {l for l, _ in got} == {layer}
            # float32 totals and a float32 solve: ~1e-6 of the float64 reference (docs/scale.md)
            _assert_metrics(got, layer, reference(window[layer], [inputs["attention_mask"]]), rel=2e-5)
            assert got[(layer, "window_start")] == 10 + step
            assert {r.layout for r in records if r.site == "ffn"} == {"replicated"}
            assert probe.memory()["now"] == _owned_bytes(probe)["keys"]  # the turn's layer was freed
    rows.remove()


def test_measure_under_a_budget_takes_a_pass_per_group_and_equals_the_unbudgeted_measure():
    model = wide_llama()
    inputs = batch(B=3, T=10, pad="right")
    want = {(r.site, r.layer, r.head_index, r.metric): r.value for r in fastspec.Probe(model).measure(inputs, step=0)}
    budget = _budget(_stage(model), "replicated", "float32", fit=1)
    probe = fastspec.Probe(model, memory=budget, precision="exact")
    forwards = []
    handle = model.register_forward_hook(lambda *a: forwards.append(1))
    got = {(r.site, r.layer, r.head_index, r.metric): r.value for r in probe.measure(inputs, step=0)}
    handle.remove()
    assert len(forwards) == 4  # not streaming: room for one layer beside nothing held, 4 passes
    assert got.keys() == want.keys()  # every site once (keys and γ from the first pass only)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=2e-5 if k[0] == "ffn" else 1e-6, abs=1e-9), k
    with pytest.raises(ValueError, match="^memory: the budget holds only some of the FFN layers"):
        probe.measurement()
    assert fastspec.Probe(model, memory=_budget(_stage(model), "replicated", "float32")).measurement() is not None


# ----------------------------------------------------------------------------- records, state
def test_records_say_their_layout_and_analysis_never_mixes_layouts():
    model = wide_llama()
    records = fastspec.Probe(model, **KW).measure(batch(), step=0)
    assert {r.layout for r in records if r.site in ("keys", "ffn")} == {"replicated"}
    assert {r.layout for r in records if r.site.startswith("gamma")} <= {None}
    from fastspec import analysis

    rows = [r.as_dict() for r in records]
    owned = [{**r, "step": 1, "layout": "owned"} for r in rows]
    assert analysis.layer_means(rows + [{**r, "step": 1} for r in rows], site="ffn").shape[0] > 0
    with pytest.raises(ValueError, match=r"^layout: the ffn/participation_ratio records come from layouts "
                                         r"\['owned', 'replicated'\]"):
        analysis.layer_means(rows + owned, site="ffn")
    old = [{k: v for k, v in r.items() if k != "layout"} for r in rows]  # a file from before layouts
    assert analysis.to_frame(old)["layout"].isna().all()


def test_a_state_resumes_exactly_and_a_change_of_layout_says_what_it_keeps():
    model = wide_llama()
    budget = _budget(_stage(model), "replicated", "float32")
    steps = [batch(B=2, T=8, seed=s) for s in range(4)]

    def run(probe, which):
        out = []
        with probe.streaming():
            for s in which:
                model(**steps[s])
                out += probe.step(s)
        return out

    kw = {**KW, "emit_every": 2, "memory": budget}
    whole = _values(run(fastspec.Probe(model, **kw), range(4)))
    first = fastspec.Probe(model, **kw)
    run(first, range(3))
    state = first.state_dict()
    assert state["layout"] == {"mode": "replicated", "totals": "float32", "dp": 1, "tp": 1, "groups": 1}
    resumed = fastspec.Probe(model, **kw)
    resumed.load_state_dict(state)
    got = _values(run(resumed, [3]))
    assert got == pytest.approx({k: v for k, v in whole.items()}, rel=1e-12) and got
    other = fastspec.Probe(model, **{**kw, "memory": None})
    with pytest.warns(UserWarning, match=r"saved under another FFN layout \(mode 'replicated' -> 'default', "
                                         r"totals 'float32' -> 'float64'\).*its next record's n says"):
        other.load_state_dict(state)
    assert {(s, l) for s, l in other._totals.accs} == {(s, l) for s, l in first._totals.accs}


def test_a_layout_is_the_same_on_another_world_size_unless_layers_are_owned_or_split():
    same = plan.Layout.same
    sig = {"mode": "replicated", "totals": "float64", "dp": 2, "tp": 1, "groups": 1}
    assert same(sig, {**sig, "dp": 1}) and same({**sig, "mode": "default"}, {**sig, "mode": "default", "dp": 8})
    assert not same({**sig, "mode": "owned"}, {**sig, "mode": "owned", "dp": 1})
    assert not same({**sig, "mode": "owned"}, {**sig, "mode": "replicated", "dp": 1})
    assert not same({**sig, "tp": 2}, sig) and not same(sig, {**sig, "totals": "float32"})
    assert not same(sig, {**sig, "groups": 2})


def test_compiled_model_streams_under_a_budget_and_refuses_rotation_at_trace_time():
    model = wide_llama()
    stage = _stage(model)
    inputs = batch(B=2, T=8)
    eager = fastspec.Probe(model, **KW, memory=_budget(stage, "replicated", "float32"))
    with eager.streaming():
        model(**inputs)
        want = _values(eager.step(0))
    probe = fastspec.Probe(model, **KW, memory=_budget(stage, "replicated", "float32"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with probe.streaming():
        compiled(**inputs)
        in_graph = probe._router.captured_in_graph  # cleared by step()
        got = _values(probe.step(0))
    assert in_graph and got == pytest.approx(want, rel=1e-6)
    torch._dynamo.reset()
    rotating = fastspec.Probe(model, **KW, memory=_budget(stage, "replicated", "float32", fit=1))
    with rotating.streaming(), pytest.raises(Exception, match="cannot take turns"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs)
    torch._dynamo.reset()


def test_float32_totals_cost_far_less_than_sampling_on_the_accuracy_battery():
    """The battery of docs/scale.md (``benchmarks/ffn_totals_accuracy.py``) at D = 256: every record
    metric of float32 totals within 2e-5 of float64's, and (median over the cases) a hundred
    times below the spread two halves of the same rows have."""
    import statistics

    sys.path.insert(0, str(ROOT))
    from benchmarks import ffn_totals_accuracy as acc

    cases = acc.battery((256,), quick=True)
    assert {c["case"] for c in cases} == set(acc.CASES)
    for m in acc.METRICS:
        errs = [c["float32_rel_err"][m] for c in cases]
        assert max(errs) <= 2e-5, (m, errs)
        spread = statistics.median(c["sampling_rel_diff"][m] for c in cases)
        assert statistics.median(errs) * 100 <= spread or m == "rank_at_90", (m, errs, spread)
    assert any(c["float32_rel_err"]["participation_ratio"] > 0 for c in cases)  # float32 really ran


# ------------------------------------------------------------------------------ fastspec plan
def _plan(*args) -> subprocess.CompletedProcess:
    """``fastspec plan ARGS`` run in this process (``fastspec.cli.main``: its exit code and output)."""
    import contextlib
    import io

    from fastspec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return subprocess.CompletedProcess(["fastspec", "plan", *args], code, out.getvalue(), err.getvalue())


def test_fastspec_plan_equals_probe_memory_for_the_same_config(tmp_path):
    model = wide_llama()
    model.config.to_json_file(tmp_path / "config.json")
    stage = _stage(model)
    for budget in (_budget(stage, "replicated", "float64"), _budget(stage, "replicated", "float32", fit=2)):
        res = _plan(str(tmp_path), "--memory", str(budget), "--device", "cpu", "--json", "--dtype", "fp32")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        probe = fastspec.Probe(model, **KW, memory=budget)
        with probe.streaming():
            for step in range(probe.layout.groups):  # every kept layer captured and emitted once
                model(**batch(seed=step))
                probe.step(step)
        mem = probe.memory()
        assert out["memory_peak_bytes"] == mem["planned_peak"] == mem["peak"], (out["memory_peak_bytes"], mem)
        assert out["ffn_every"] == mem["ffn_every"] == probe.layout.groups
        assert out["ranks"][0]["ffn_layers"] == mem["ffn_layers"]


def test_fastspec_plan_llama_3_8b_and_70b_fit_their_budgets():
    configs = ROOT / "docs" / "examples" / "configs"
    res = _plan(str(configs / "llama-3-8b.json"), "--dp", "8", "--memory", "2GB", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["memory_peak_bytes"] <= 2e9 and not out["ffn_all_reduced"] and out["ffn_every"] <= 4
    assert {tuple(x) for x in out["layouts"]} == {("owned", "float32")}
    res = _plan(str(configs / "llama-3-70b.json"), "--dp", "8", "--tp", "8", "--pp", "4", "--memory", "8GB", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["memory_peak_bytes"] <= 8e9 and out["ffn_every"] == 1 and not out["ffn_all_reduced"]
    # every one of the 80 FFN layers is kept by one rank, in every window
    kept = sum(r["ranks"] * len(r["ffn_layers"]) for r in out["ranks"])
    assert kept == 80 * 8 // 8  # (one owner a layer among dp·tp ranks of each stage)
    text = _plan(str(configs / "llama-3-8b.json"), "--dp", "8", "--memory", "2GB")
    assert "each FFN layer measured every 4 emission window(s)" in text.stdout and "solve s (predicted)" in text.stdout


@pytest.mark.parametrize("args, message", [
    (("nowhere.json",), "config: no file nowhere.json"),
    (("{cfg}", "--sites", "keys,mlp"), "--sites: expected some of keys, queries, ffn"),
    (("{cfg}", "--pp", "40"), "--pp: 40 stages for 32 layers"),
    (("{cfg}", "--tp", "3"), "--tp: num_kv_heads 8 does not split over 3"),
    (("{cfg}", "--memory", "300MB"), "memory: one FFN layer (d_ff 14336) needs"),
    (("{cfg}", "--memory", "10MB"), "memory: the budget 10 MB does not hold the replicated sites"),
    (("{cfg}", "--dp", "0"), "--dp: expected an int >= 1, got 0"),
])
def test_fastspec_plan_errors_are_one_line(args, message):
    cfg = str(ROOT / "docs" / "examples" / "configs" / "llama-3-8b.json")
    res = _plan(*(a.format(cfg=cfg) for a in args))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("fastspec plan: error: ") and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
