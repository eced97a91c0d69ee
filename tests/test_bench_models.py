"""Layer fitting of the ``train_step`` suite (fastspec.bench.models.fit_layers) and the
model suites end to end through the runner, with what they record in result rows."""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from fastspec.bench import models
from fastspec.bench.models import OutOfMemory, fit_layers
from fastspec.bench.runner import run_cases
from fastspec.bench.suites import cases
from fastspec.bench.suites import train_step as train_step_suite

CPU = torch.device("cpu")


class Recorder:
    """An injected builder/trial pair: ``oom_above`` layers run out of memory (in ``where``),
    a trial takes ``per_layer_s × layers`` seconds; ``built`` lists the depths tried."""

    def __init__(self, oom_above: int | None = None, per_layer_s: float = 0.0, where: str = "trial"):
        self.oom_above, self.per_layer_s, self.where = oom_above, per_layer_s, where
        self.built: list[int] = []
        self.freed = 0

    def _maybe_oom(self, layers: int) -> None:
        if self.oom_above is not None and layers > self.oom_above:
            raise OutOfMemory(f"CUDA out of memory. Tried to allocate 2.00 GiB at {layers} layers.\n"
                              "GPU 0 has a total capacity of 79.19 GiB ...")

    def build(self, layers: int) -> dict:
        self.built.append(layers)
        if self.where == "build":
            self._maybe_oom(layers)
        return {"layers": layers}

    def trial(self, inputs: dict) -> float:
        if self.where == "trial":
            self._maybe_oom(inputs["layers"])
        return self.per_layer_s * inputs["layers"]

    def free(self) -> None:
        self.freed += 1


@pytest.mark.parametrize("where", ["build", "trial"])
def test_fit_halves_on_out_of_memory_and_records_requested_vs_actual(where):
    r = Recorder(oom_above=8, per_layer_s=1e-3, where=where)
    inputs, fit = fit_layers(32, r.build, r.trial, floor=4, budget_s=60, calls=7, free=r.free)
    assert r.built == [32, 16, 8] and r.freed == 2
    assert inputs == {"layers": 8}
    assert (fit.requested, fit.layers) == (32, 8)
    assert fit.extras() == {"layers": 8, "layers_requested": 32}
    assert fit.round_s == pytest.approx(8e-3)
    (what, why), = fit.notes().items()
    assert what == "32 layers"
    # the reason names each depth that failed and keeps only the first line of the CUDA message
    assert why == ("reduced to 8 layers: out of memory at 32 layers (CUDA out of memory. Tried to allocate "
                   "2.00 GiB at 32 layers.); out of memory at 16 layers (CUDA out of memory. Tried to "
                   "allocate 2.00 GiB at 16 layers.)")


def test_fit_drops_the_failed_try_before_freeing():
    """The failed step's tensors are referenced by the exception's traceback: ``free()`` (gc +
    ``empty_cache``) must run after they are released, or the retry sees the memory still taken."""
    class Big:
        pass

    refs, alive_at_free = [], []

    def build(layers):
        obj = Big()
        refs.append(weakref.ref(obj))
        return {"layers": layers, "activations": obj}

    def trial(inputs):
        if inputs["layers"] > 8:
            raise OutOfMemory("CUDA out of memory.")
        return 0.0

    def free():
        gc.collect()
        alive_at_free.append(refs[-1]() is not None)

    inputs, fit = fit_layers(16, build, trial, floor=4, budget_s=60, calls=7, free=free)
    assert fit.layers == 8 and alive_at_free == [False]
    assert refs[-1]() is inputs["activations"]


def test_fit_reduces_when_the_trial_says_the_rounds_overrun_the_budget():
    r = Recorder(per_layer_s=0.1)  # 32 layers: 7 × 3.2 s = 22.4 s > 10 s
    inputs, fit = fit_layers(32, r.build, r.trial, floor=4, budget_s=10, calls=7, free=r.free)
    # linear in depth: 16 layers would be 11.2 s (> 10), so it goes to 8 (5.6 s) without trying 16
    assert r.built == [32, 8] and r.freed == 1
    assert fit.layers == 8 and fit.requested == 32
    assert fit.reasons == ("at 32 layers 7 timed rounds × 3.2 s = 22.4 s > budget 10 s",)
    assert fit.notes() == {"32 layers": "reduced to 8 layers: at 32 layers 7 timed rounds × 3.2 s = 22.4 s "
                                        "> budget 10 s"}


def test_fit_keeps_the_requested_depth_when_it_fits():
    r = Recorder(per_layer_s=0.01)
    _, fit = fit_layers(32, r.build, r.trial, floor=4, budget_s=60, calls=7, free=r.free)
    assert r.built == [32] and r.freed == 0
    assert fit.layers == 32 and fit.reasons == () and fit.notes() == {}


@pytest.mark.parametrize("requested, tried", [(32, [32, 16, 8, 4]), (6, [6, 4]), (4, [4])])
def test_fit_gives_up_at_the_floor_with_every_reason(requested, tried):
    r = Recorder(oom_above=0)
    with pytest.raises(RuntimeError) as info:
        fit_layers(requested, r.build, r.trial, floor=4, budget_s=60, calls=7, free=r.free)
    msg = str(info.value)
    assert r.built == tried and r.freed == len(tried)
    assert "\n" not in msg
    assert msg.startswith(f"fit_layers: no depth from {requested} down to 4 layers fits: ")
    assert all(f"out of memory at {n} layers" in msg for n in tried)


def test_fit_runs_the_floor_anyway_when_even_it_is_too_slow():
    """Slow is not fatal (the run's time cap cuts repeats): a loaded machine must not become an error."""
    r = Recorder(per_layer_s=10.0)
    inputs, fit = fit_layers(32, r.build, r.trial, floor=4, budget_s=10, calls=7, free=r.free)
    assert r.built == [32, 4] and inputs == {"layers": 4} and fit.layers == 4
    assert fit.reasons[-1] == "at 4 layers 7 timed rounds × 40 s = 280 s > budget 10 s, ran anyway at the floor"
    assert fit.notes()["32 layers"].startswith("reduced to 4 layers: at 32 layers 7 timed rounds × 320 s")
    # a tier that starts at the floor (cpu: 4 layers) is measured as it is, without a note row
    _, fit = fit_layers(4, r.build, r.trial, floor=4, budget_s=10, calls=7, free=r.free)
    assert fit.layers == 4 and fit.notes() == {}


def test_fit_never_goes_below_a_tier_that_starts_under_the_floor():
    """The quick tier has 2 layers: never reduced (it fits or the case reports why)."""
    r = Recorder(oom_above=1)
    with pytest.raises(RuntimeError, match="no depth from 2 down to 2 layers fits"):
        fit_layers(2, r.build, r.trial, floor=4, budget_s=60, calls=7, free=r.free)
    assert r.built == [2]


def test_fit_lets_other_errors_through():
    def trial(inputs):
        raise ValueError("shape mismatch")

    r = Recorder()
    with pytest.raises(ValueError, match="shape mismatch"):
        fit_layers(32, r.build, trial, floor=4, budget_s=60, calls=7, free=r.free)
    assert r.built == [32]


def test_fit_refuses_bad_limits():
    r = Recorder()
    with pytest.raises(ValueError, match="budget_s > 0"):
        fit_layers(32, r.build, r.trial, floor=4, budget_s=0, calls=7)


def test_gpu_cases_are_built_without_building_a_model(monkeypatch):
    """``fastspec bench --filter`` constructs every case: no 1.5B model may be built before setup()."""
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built at case construction")

    monkeypatch.setattr(models, "build_llama", no_build)
    sizes = {c.size for s in ("train_step", "keyrank") for c in cases(s, "gpu", CPU)}
    assert sizes == {"L32-KV8-d128-ff8192-N4x2048-bf16"}
    # the compiled case keeps every dimension but the depth (its compile must fit the kit's slot)
    assert [c.size for c in cases("train_step_compiled", "gpu", CPU)] == ["L8-KV8-d128-ff8192-N4x2048-bf16"]


def _measured(rows):
    return [r for r in rows if "fastspec_s" in r]


def test_quick_model_suites_run_end_to_end_with_the_layer_fields():
    pytest.importorskip("transformers")
    selected = cases("train_step", "quick", CPU) + cases("keyrank", "quick", CPU)
    rows = run_cases(selected, CPU, warmup=0, repeats=1)
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    assert {(r["suite"], r["variant"]) for r in _measured(rows)} == {
        ("train_step", "emit_every=100"), ("train_step", "budget=0.01-emit_every=100"),
        ("train_step", "emit_every=1"), ("keyrank", "auto")}
    for r in _measured(rows):
        if r["suite"] == "train_step":
            assert r["size"].startswith("L2-")
            assert r["layers"] == r["layers_requested"] == 2
            assert r["fastspec_error"] == 0
        else:
            assert "layers" not in r and math.isfinite(r["pr_diff_vs_baseline"])


def test_compiled_case_names_its_backend_without_touching_the_device():
    """inductor on CUDA, aot_eager on CPU (no C++ compile in CI); building the case compiles nothing."""
    (cpu,) = cases("train_step_compiled", "quick", CPU)
    (cuda,) = cases("train_step_compiled", "gpu", torch.device("cuda"))
    assert (cpu.variant, cuda.variant) == ("aot_eager-emit_every=100", "inductor-emit_every=100")
    assert list(cpu.baselines) == ["compiled training step without probe"] and cpu.overhead
    assert cuda.size == "L8-KV8-d128-ff8192-N4x2048-bf16"  # the train_step suite's shape, 8 layers


def test_shared_twin_shares_the_weights_but_not_the_hooks():
    pytest.importorskip("transformers")
    model = models.build_llama("quick", CPU)
    twin = models.shared_twin(model)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(1))
    assert all(a is b for a, b in zip(model.parameters(), twin.parameters()))
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers()))
    assert twin is not model and twin.model.layers[0] is not model.model.layers[0]
    ids = torch.randint(models.MODEL_SHAPES["quick"]["vocab_size"], (1, 8))
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    assert seen == [1]  # the model's hook ran once, for the model only


@pytest.mark.slow
def test_quick_compiled_train_step_runs_end_to_end_with_the_compile_fields():
    """Both sides compiled (aot_eager on CPU) in the untimed warm-up: one graph each, no
    recompile, no graph break, and the probe does not change the compiled loss."""
    pytest.importorskip("transformers")
    rows = run_cases(cases("train_step_compiled", "quick", CPU), CPU, warmup=0, repeats=1)
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    (r,) = rows
    assert (r["suite"], r["variant"], r["baseline"]) == (
        "train_step_compiled", "aot_eager-emit_every=100", "compiled training step without probe")
    assert r["size"].startswith("L2-") and r["layers"] == r["layers_requested"] == 2
    assert r["fastspec_error"] == 0 and r["error_kind"] == "|Δloss| with probe"
    assert math.isclose(r["overhead_pct"], (r["fastspec_s"] / r["baseline_s"] - 1) * 100)
    assert (r["probed_graphs"], r["baseline_graphs"], r["recompiles"], r["graph_breaks"]) == (1, 1, 0, 0)
    assert r["probed_compile_s"] > 0 and r["baseline_compile_s"] > 0
    # the probe stayed attached for the compiled case; the case's teardown detached it: no
    # hook and no process-wide attention wrapper outlives it
    from fastspec.probe import hf_attention

    assert not hf_attention._CALLBACKS and not hf_attention._PATCHES


def test_the_budget_case_reports_what_the_probe_says_beside_the_measured_overhead():
    """keys + FFN under budget=0.01 (issue: measured against interleaved plain steps, next to
    what the budget itself reports): the row carries Probe.overhead() read after the timed rounds."""
    pytest.importorskip("transformers")
    suite = cases("train_step", "quick", CPU)
    assert [c.variant for c in suite] == ["emit_every=100", "budget=0.01-emit_every=100", "emit_every=1"]
    budget = suite[1]
    assert budget.row_extra is not None and suite[0].row_extra is None and suite[2].row_extra is None
    (r,) = run_cases([budget], CPU, warmup=1, repeats=2)
    assert "error" not in r and "skipped" not in r, r
    assert math.isclose(r["overhead_pct"], (r["fastspec_s"] / r["baseline_s"] - 1) * 100)
    # the probe ran its budget: an average and a measured share, an interval, FFN sampling
    assert r["budget_average_pct"] > 0 and r["budget_measured_pct"] > 0
    assert r["budget_every"] >= 1 and r["ffn_row_step"] >= 1 and r["fastspec_error"] == 0


class Built(list):
    """Depths of the models built, and the largest one that fits (``limit``)."""
    limit: int


def _fake_oom_above(monkeypatch, limit: int, requested: int, floor: int) -> Built:
    """The quick train_step case asks for ``requested`` layers; building more than ``built.limit``
    (initially ``limit``) runs out of memory. Returns the depths of the models actually built."""
    built = Built()
    built.limit = limit
    real = models.build_llama

    def build_llama(tier, device, layers=None, *, shape=None):
        if layers > built.limit:
            raise OutOfMemory(f"CUDA out of memory. Tried to allocate 1.00 GiB ({layers} layers)")
        model = real(tier, device, layers, shape=shape)
        built.append(len(model.model.layers))
        return model

    monkeypatch.setitem(models.MODEL_SHAPES, "quick",
                        {**models.MODEL_SHAPES["quick"], "num_hidden_layers": requested})
    monkeypatch.setattr(models, "build_llama", build_llama)
    monkeypatch.setattr(models, "MIN_LAYERS", floor)
    return built


def test_a_reduced_case_runs_fewer_layers_and_says_so_in_its_rows(monkeypatch):
    pytest.importorskip("transformers")
    built = _fake_oom_above(monkeypatch, limit=2, requested=4, floor=2)
    case = train_step_suite.train_step_cases("quick", CPU)[0]
    rows = run_cases([case], CPU, warmup=0, repeats=1)
    assert built == [2]
    assert [r for r in rows if "error" in r] == []
    (measured,) = _measured(rows)
    assert measured["size"].startswith("L4-")  # the requested shape: fixed before setup() runs
    assert (measured["layers"], measured["layers_requested"]) == (2, 4)
    (note,) = [r for r in rows if "skipped" in r]
    assert {k: note[k] for k in ("suite", "size", "variant")} == {k: measured[k] for k in ("suite", "size", "variant")}
    assert note["baseline"] == "4 layers"
    assert note["skipped"] == ("reduced to 2 layers: out of memory at 4 layers "
                               "(CUDA out of memory. Tried to allocate 1.00 GiB (4 layers))")
    # the same case set up again where it fits: no stale note from the first run
    built.limit = 4
    rows = run_cases([case], CPU, warmup=0, repeats=1)
    assert built == [2, 4] and [r for r in rows if "skipped" in r or "error" in r] == []
    assert (rows[0]["layers"], rows[0]["layers_requested"]) == (4, 4)


def test_a_case_that_cannot_fit_is_an_error_row_naming_why(monkeypatch):
    pytest.importorskip("transformers")
    built = _fake_oom_above(monkeypatch, limit=1, requested=4, floor=2)
    rows = run_cases(train_step_suite.train_step_cases("quick", CPU)[:1], CPU, warmup=0, repeats=1)
    assert built == []
    (row,) = rows
    assert row["error"].startswith("RuntimeError: fit_layers: no depth from 4 down to 2 layers fits: "
                                   "out of memory at 4 layers")
    assert "out of memory at 2 layers" in row["error"]
