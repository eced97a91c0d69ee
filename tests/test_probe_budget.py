"""Overhead budget: the probe times its own work (captures and emissions), reports it as a
fraction of the probe-free step time, and widens its capture and emission intervals to stay
under the budget; FFN streaming subsamples tokens to fit. Tested with injected clocks, so every
number is deterministic."""
from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from _tiny_models import batch, build

import fastspec
from fastspec.probe.budget import (
    PAUSE_FACTOR,
    PAUSE_MIN_STEPS,
    PAUSE_WINDOW,
    OverheadBudget,
)
from fastspec.probe.ffn_sampling import (
    DEFAULT_FFN_SHARE,
    auto_ffn_rows,
    ffn_flop_share,
    matmul_parameters,
)
from fastspec.probe.timer import StepClock, WorkTimer


class TickClock:
    """Host clock that advances ``tick`` seconds per reading (so each timed capture costs one
    tick) and ``advance(dt)`` seconds of simulated training work."""

    def __init__(self, tick: float):
        self.t, self.tick, self.reads = 0.0, tick, 0

    def __call__(self) -> float:
        self.t += self.tick
        self.reads += 1
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class ManualClock:
    """Host clock that only moves when told: reading it is free, so the probe work a test
    injects is exactly the work there is."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def test_budget_policy_interval_is_ceil_cost_over_budget_and_relaxes():
    b = OverheadBudget(0.01, base_every=2, smoothing=1.0)
    # 50 ms of work in a 1.05 s step: 5% of the 1 s the step takes without the probe -> 1 in 5
    assert b.observe(0.05, 0.0, step_s=1.05, captured=True) == 5
    assert b.average_fraction == pytest.approx(0.01)
    assert b.last_fraction == pytest.approx(0.05)
    assert b.observe(0.0, 0.0, step_s=1.0, captured=False) == 5  # idle steps say nothing about cost
    assert b.observe(0.001, 0.0, step_s=1.001, captured=True) == 2  # cheap again: back to base_every
    assert OverheadBudget(None, 3).observe(0.9, 0.0, 1.9, True) == 3  # no budget: never adapts
    assert b.measured_fraction == pytest.approx(0.051 / 3)  # all work / all probe-free time


def test_names_moved_out_of_budget_py_still_import_with_a_deprecation_warning():
    from fastspec.probe import budget, ffn_sampling, timer

    for name, module in (("WorkTimer", timer), ("KINDS", timer), ("DEFAULT_FFN_SHARE", ffn_sampling),
                         ("choose_ffn_rows", ffn_sampling), ("matmul_parameters", ffn_sampling)):
        with pytest.warns(DeprecationWarning, match=f"fastspec.probe.budget.{name} moved to {module.__name__}"):
            assert getattr(budget, name) is getattr(module, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        budget.nothing  # noqa: B018


def test_budget_smoothing_and_bad_arguments():
    b = OverheadBudget(0.1, base_every=1, smoothing=0.5)
    b.observe(0.4, 0.0, 1.4, True)
    assert b.observe(0.0, 0.0, 1.0, True) == math.ceil(0.2 / 0.1)  # EMA: 0.5*0.4 + 0.5*0
    for bad in (0, 1.0, -0.1, "1%", True):
        with pytest.raises(ValueError, match="budget"):
            OverheadBudget(bad, 1)
    with pytest.raises(ValueError, match="every"):
        OverheadBudget(0.01, 0)
    with pytest.raises(ValueError, match="emit_every"):
        OverheadBudget(0.01, 1, 0)


def _planned(budget, every, emit_every, c, e, adapt_emission=True):
    b = OverheadBudget(budget, every, emit_every, smoothing=1.0)
    b.adapt_emission = adapt_emission
    b.observe(c, 0.0, 1.0 + c, captured=True)
    b.observe(0.0, e, 1.0 + e, captured=False, emitted=True)
    return b.every, b.emit_every, b.average_fraction


def test_budget_counts_and_throttles_emission_too():
    # fits: nothing changes; the estimate is c/every + e/emit_every
    assert _planned(0.1, 1, 10, 0.05, 0.2) == (1, 10, pytest.approx(0.05 + 0.02))
    # emission within half the budget keeps its interval; captures take what is left
    every, emit, avg = _planned(0.01, 1, 10, 0.02, 0.04)  # e/10 = 0.004 <= 0.005
    assert (every, emit) == (math.ceil(0.02 / (0.01 - 0.004)), 10) and avg <= 0.01
    # captures within their half keep theirs; emissions are spaced out, in multiples of emit_every
    every, emit, avg = _planned(0.01, 1, 5, 0.002, 0.2)  # 0.2/5 = 4% emission alone
    assert every == 1 and emit == 5 * math.ceil(0.2 / ((0.01 - 0.002) * 5)) and avg <= 0.01
    # both too expensive: half each
    every, emit, avg = _planned(0.01, 2, 4, 0.1, 0.1)
    assert (every, emit) == (math.ceil(0.1 / 0.005), 4 * math.ceil(0.1 / (0.005 * 4))) and avg <= 0.01
    # emissions that must stay in lockstep across ranks are never spaced; captures keep half
    every, emit, _ = _planned(0.01, 1, 5, 0.02, 0.2, adapt_emission=False)
    assert (every, emit) == (math.ceil(0.02 / 0.005), 5)
    # no budget: only reported
    assert _planned(None, 1, 1, 0.3, 0.3) == (1, 1, pytest.approx(0.6))


def test_emissions_stay_on_multiples_of_emit_every_when_spaced_out():
    b = OverheadBudget(0.01, 1, 3, smoothing=1.0)
    b.emit_every = 9  # as planned for an emission costing ~3x its share
    due = []
    for s in range(1, 40):
        if b.emit_due(s):
            b.emitted(s)
            due.append(s)
    assert due == [9, 18, 27, 36]
    b.emit_every = 3  # cheap again: the next multiple of 3
    assert [s for s in range(37, 46) if b.emit_due(s)] == [39, 42, 45]


def test_budget_state_round_trip_and_old_format():
    b = OverheadBudget(0.01, 1, 5, smoothing=1.0)
    b.observe(0.02, 0.0, 1.02, True)
    b.observe(0.0, 0.3, 1.3, False, emitted=True)
    b.emitted(10)
    c = OverheadBudget(0.01, 1, 5)
    c.load_state_dict(b.state_dict())
    assert c.state_dict() == b.state_dict() and c.average_fraction == b.average_fraction
    old = OverheadBudget(0.01, 2, 5)
    old.load_state_dict({"every": 4, "active_cost": 0.04, "last_fraction": 0.04})  # before emission accounting
    assert (old.every, old.emit_every, old.capture_cost, old.emit_cost) == (4, 5, 0.04, None)


def test_work_timer_host_clock_sums_capture_and_emission_windows():
    clock = TickClock(tick=0.5)
    timer = WorkTimer(clock)
    for _ in range(3):
        timer.stop(timer.start(None))
    timer.stop(timer.start(None), "emit")
    assert timer.close_step("a") == [({"capture": pytest.approx(1.5), "emit": pytest.approx(0.5)}, "a")]
    assert timer.close_step("b") == [({"capture": 0.0, "emit": 0.0}, "b")]


class FakeEvent:
    """Stands in for a CUDA event pair's end: completes when the test says so."""

    def __init__(self, ms: float):
        self.ms, self.done = ms, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return end.ms


def test_work_timer_accounts_late_device_work_to_its_own_step():
    # the host runs ahead of the GPU: a captured step's events complete only during a later
    # (idle) step; their work must still be reported with the captured step's tag
    timer = WorkTimer(TickClock(tick=0.0))
    end, emit_end = FakeEvent(ms=30.0), FakeEvent(ms=7.0)
    timer._events.append((FakeEvent(0.0), end, "capture"))  # what start()/stop() record on CUDA
    timer._events.append((FakeEvent(0.0), emit_end, "emit"))
    assert timer.close_step("captured") == []     # not complete: nothing is reported yet
    assert timer.close_step("idle") == []         # and nothing overtakes it
    end.done = emit_end.done = True
    zero = {"capture": 0.0, "emit": 0.0}
    assert timer.close_step("idle2") == [({"capture": pytest.approx(0.03), "emit": pytest.approx(0.007)}, "captured"),
                                         (zero, "idle"), (zero, "idle2")]


def test_probe_adapts_interval_to_stay_under_budget():
    model = build("gpt2")
    inputs = batch(B=2, T=8)
    tick = 1e-3
    clock = TickClock(tick)
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, ffn=False, budget=0.01, emit_every=1000, clock=clock, forwards="all")
    captured_steps = []
    with probe.streaming():
        for step in range(40):
            reads = clock.reads
            model(**inputs)
            if clock.reads > reads:
                captured_steps.append(step)
            clock.advance(0.1)  # 100 ms of "training" per step
            probe.step(step)
    # one captured step: 2 layers x 1 capture x 1 tick of work = 2 ms, over the step's time
    # without it: 100 ms + 2 unmeasured ticks (the start() reads) + 1 (step()'s own read)
    cost = 2 * tick / (0.1 + 2 * tick + tick)
    expected_every = math.ceil(cost / 0.01)
    assert probe.every == expected_every
    gaps = {b - a for a, b in itertools.pairwise(captured_steps[3:])}
    assert gaps == {expected_every}
    assert probe.overhead()["average"] <= 0.01
    assert probe.overhead()["every"] == expected_every


def test_without_budget_every_step_is_captured_and_overhead_reported():
    model = build("gpt2")
    clock = TickClock(1e-3)
    probe = fastspec.Probe(model, ffn=False, emit_every=5, clock=clock, forwards="all")
    with probe.streaming():
        for step in range(5):
            model(**batch(B=2, T=8))
            clock.advance(0.1)
            records = probe.step(step)
    assert probe.every == 1
    (overhead,) = [r for r in records if r.site == "probe"]
    assert overhead.metric == "overhead_fraction" and 0 < overhead.value < 0.1
    assert {r.value for r in records if r.metric == "n"} == {5 * 2 * 8}


def test_measure_is_not_timed_as_streaming_overhead():
    # measure() work is not the streaming budget's: timing it would pile up CUDA events
    # (popped only by step()) and charge eval forwards to the streaming capture interval
    model = build("gpt2")
    clock = TickClock(1e-3)
    probe = fastspec.Probe(model, ffn=False, budget=0.01, clock=clock, forwards="all")
    for step in range(3):
        probe.measure(batch(B=2, T=8), step=step)
    assert clock.reads == 0
    with probe.streaming():
        model(**batch(B=2, T=8))
    # streaming captures are timed (2 layers, start + stop); detaching notes when a pause may start
    assert clock.reads == 2 * 2 + 1


def _simulate(*, budget, every, emit_every, capture_s, emit_s, steps=160, step_s=1.0):
    """A training loop on a controllable clock: each step's own work takes ``step_s``, each
    captured step's captures ``capture_s`` and each emission ``emit_s`` (injected into the probe's
    real capture and emission paths). Returns the probe and the true overhead, i.e.
    (time with probe - time of the same steps without probe work) / time without, over the
    last whole periods of the final schedule (after the warm-up, where the costs are learnt)."""
    model = build("gpt2")
    inputs = batch(B=2, T=8)
    clock = ManualClock()
    probe = fastspec.Probe(model, ffn=False, budget=budget, every=every, emit_every=emit_every, clock=clock,
                           forwards="all")
    update, emit = probe._totals.update, probe._emitter.records

    def slow_update(*args, **kwargs):
        clock.advance(capture_s / 2)  # gpt2: 2 layers of keys per captured forward
        return update(*args, **kwargs)

    def slow_emit(*args, **kwargs):
        clock.advance(emit_s)
        return emit(*args, **kwargs)

    probe._totals.update, probe._emitter.records = slow_update, slow_emit
    starts, records = [], []
    with probe.streaming():
        for step in range(steps):
            starts.append(clock.t)
            model(**inputs)
            clock.advance(step_s)
            records += [r.value for r in probe.step(step) if r.site == "probe"]
    starts.append(clock.t)
    ov = probe.overhead()
    period = math.lcm(ov["every"], ov["emit_every"])
    window = (steps // 2) // period * period
    assert window >= period, "the schedule's period must fit in the second half of the run"
    true = (starts[-1] - starts[-1 - window] - window * step_s) / (window * step_s)
    return probe, true, records


CASES = [  # budget, every, emit_every, capture cost, emission cost (fractions of a step), steps
    (None, 1, 5, 0.02, 0.1, 60),
    (None, 1, 1, 0.02, 0.1, 20),
    (None, 3, 10, 0.01, 2.0, 80),     # emission dominates
    (0.01, 1, 5, 0.02, 0.1, 120),     # both over their half of the budget
    (0.01, 1, 1, 0.001, 0.5, 160),    # emission dominates: emissions spaced out
    (0.01, 1, 10, 0.001, 0.05, 60),   # fits
    (0.01, 1, 4, 0.05, 0.01, 80),     # captures dominate: captures spaced out
    (0.05, 2, 10, 0.2, 0.05, 60),
]


@pytest.mark.parametrize("budget,every,emit_every,capture_s,emit_s,steps", CASES)
def test_reported_overhead_matches_true_end_to_end_overhead(budget, every, emit_every, capture_s, emit_s, steps):
    probe, true, records = _simulate(budget=budget, every=every, emit_every=emit_every,
                                     capture_s=capture_s, emit_s=emit_s, steps=steps)
    ov = probe.overhead()
    assert ov["average"] == pytest.approx(true, rel=0.2)
    assert ov["average"] == pytest.approx(ov["capture"] + ov["emission"])
    assert records and records[-1] == pytest.approx(true, rel=0.2)  # the overhead_fraction record
    assert ov["measured"] > 0
    if budget is None:
        assert (probe.every, ov["emit_every"]) == (every, emit_every)
        assert true == pytest.approx(capture_s / every + emit_s / emit_every, rel=1e-6)
    else:
        assert true <= budget * 1.1
        assert ov["emit_every"] % emit_every == 0 and probe.every >= every


def test_expensive_emission_is_throttled_and_counted():
    # without a budget the emission alone costs 50% of a step (0.5 every step);
    # with budget=0.01 emissions are spaced out until the whole probe fits
    _, true_free, _ = _simulate(budget=None, every=1, emit_every=1, capture_s=0.001, emit_s=0.5, steps=10)
    probe, true, _ = _simulate(budget=0.01, every=1, emit_every=1, capture_s=0.001, emit_s=0.5)
    assert true_free == pytest.approx(0.501)
    assert true <= 0.01 * 1.1
    ov = probe.overhead()
    assert ov["emit_every"] > 1 and ov["emission"] == pytest.approx(0.5 / ov["emit_every"])
    assert probe.every == 1  # cheap captures keep their rate


# ------------------------------------------------------------------ FFN rows
def _ffn_share(model, widths):
    return 2 * sum(d * d for d in widths) / (6 * matmul_parameters(model))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_auto_ffn_rows_from_the_flop_model(name):
    model = build(name)
    emb = model.transformer.wpe.weight.numel() if name == "gpt2" else model.model.embed_tokens.weight.numel()
    # every parameter does matmul work per token except the embedding lookups (gpt2: the
    # token embedding is tied to lm_head, a matmul, so only the position embedding drops out)
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters()) - emb
    d_ff = 4 * 32 if name == "gpt2" else 48
    share = 2 * 2 * d_ff**2 / (6 * matmul_parameters(model))  # 2 layers, 2·N·d_ff² vs 6·N·P
    assert share > DEFAULT_FFN_SHARE  # a tiny model: full-rate FFN would be most of a step
    probe = fastspec.Probe(model)
    assert probe.ffn_share == pytest.approx(share)
    assert probe.ffn_rows == math.ceil(share / DEFAULT_FFN_SHARE) == probe.ffn_row_step
    assert share / probe.ffn_rows <= DEFAULT_FFN_SHARE < share / (probe.ffn_rows - 1)
    with_budget = fastspec.Probe(model, budget=0.05)  # the budget is the target when set
    assert with_budget.ffn_rows == math.ceil(share / 0.05)
    sampled = fastspec.Probe(model, row_step=2)  # global token sampling already halves the cost
    assert sampled.ffn_rows == math.ceil(share / (2 * DEFAULT_FFN_SHARE))
    assert sampled.ffn_row_step == 2 * sampled.ffn_rows
    ov = probe.overhead()
    assert (ov["ffn_rows"], ov["ffn_row_step"], ov["ffn_share"]) == (probe.ffn_rows, probe.ffn_rows,
                                                                     pytest.approx(share))
    assert fastspec.Probe(model, ffn=False).ffn_rows == 1


def test_flop_model_helpers():
    assert ffn_flop_share([100, 100], 6000) == pytest.approx(2 * 2e4 / 36000)
    assert auto_ffn_rows(0.2, 0.01) == 20 and auto_ffn_rows(0.2, 0.01, row_step=4) == 5
    assert auto_ffn_rows(0.005, 0.01) == 1
    assert auto_ffn_rows(0.03, 0.01) == 3  # exactly on target: no extra sampling


def _stream_n(probe, model, inputs):
    with probe.streaming():
        model(**inputs)
        records = probe.step(0)
    return {r.site: r.value for r in records if r.metric == "n"}  # one value per site here


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ffn_rows_all_int_and_measure(name):
    model = build(name)
    inputs = batch(B=3, T=12, pad="right")
    mask = inputs["attention_mask"]
    tokens = mask.sum().item()
    n = _stream_n(fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all"), model, inputs)
    assert n == {"keys": tokens, "ffn": tokens}  # full rate
    n = _stream_n(fastspec.Probe(model, ffn_rows=3, emit_every=1, forwards="all"), model, inputs)
    assert n == {"keys": tokens, "ffn": mask[:, ::3].sum().item()}  # every 3rd token, padding excluded
    n = _stream_n(fastspec.Probe(model, ffn_rows=2, row_step=2, emit_every=1, forwards="all"), model, inputs)
    assert n == {"keys": mask[:, ::2].sum().item(), "ffn": mask[:, ::4].sum().item()}  # row_step x ffn_rows
    auto = fastspec.Probe(model, emit_every=1, forwards="all")
    assert auto.ffn_rows > 1
    n = _stream_n(auto, model, inputs)
    assert n["ffn"] == mask[:, ::auto.ffn_rows].sum().item() < tokens
    # measure() is the eval protocol: every token, whatever ffn_rows says
    measured = {r.site: r.value for r in auto.measure(inputs, step=1) if r.metric == "n"}
    assert measured == {"keys": tokens, "ffn": tokens}
    for bad in (0, -1, 1.5, "half", True):
        with pytest.raises(ValueError, match="ffn_rows"):
            fastspec.Probe(model, ffn_rows=bad)


@pytest.mark.gpu
def test_cuda_records_arrive_asynchronously_and_match_cpu():
    model = build("llama")
    inputs = batch(pad="right")
    want = {(r.site, r.layer, r.head_index, r.metric): r.value for r in fastspec.Probe(model).measure(inputs, step=0)}
    model = model.cuda()
    probe = fastspec.Probe(model, emit_every=1, ffn_rows="all", forwards="all")
    with probe.streaming():
        model(**{k: v.cuda() for k, v in inputs.items()})
        probe.step(0)
    got = {(r.site, r.layer, r.head_index, r.metric): r.value for r in probe.records() if r.site != "probe"}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-3, abs=1e-6), k  # fp32 eigensolve on CUDA
    assert torch.cuda.is_available()


def test_step_clock_leaves_out_pauses_while_detached():
    clock = ManualClock()
    sc = StepClock(clock)
    assert sc.lap() is None  # the first step has no start
    clock.advance(2.0)
    assert sc.lap() == 2.0
    clock.advance(1.0)
    sc.detached()            # e.g. evaluation, or another model trained: not a step with the probe
    clock.advance(10.0)
    sc.detached()            # detaching twice keeps the first time
    clock.advance(5.0)
    sc.attached()
    clock.advance(2.0)
    assert sc.lap() == 3.0   # 1 + 2 s, without the 15 s detached
    # a detached span that a step closes belongs to it (streaming() around each forward only)
    clock.advance(1.0)
    sc.detached()
    clock.advance(4.0)       # backward and optimizer run after the forwards' context ended
    assert sc.lap() == 5.0
    clock.advance(0.5)       # data loading before the next forward: still part of the step
    sc.attached()
    clock.advance(1.5)
    assert sc.lap() == 2.0


def _slow_probe(capture_s: float, clock, **kw):
    """A gpt2 probe (keys only) whose captured forwards cost ``capture_s`` on ``clock``."""
    model = build("gpt2")
    probe = fastspec.Probe(model, ffn=False, emit_every=1000, clock=clock, forwards="all", **kw)
    update = probe._totals.update

    def slow_update(*args, **kwargs):
        clock.advance(capture_s / 2)  # 2 layers of keys per captured forward
        return update(*args, **kwargs)

    probe._totals.update = slow_update
    return model, probe


def test_probe_overhead_leaves_out_time_detached_between_steps():
    # blocks of probed steps alternating with blocks of a probe-free twin (or an evaluation)
    # in the same loop. The twin's block used to count as one long probed step and
    # made the reported overhead read ~35% low
    clock = ManualClock()
    model, probe = _slow_probe(0.05, clock)
    inputs = batch(B=2, T=8)
    step = 0
    for block in range(4):
        probe.attach()
        for _ in range(5):
            model(**inputs)
            clock.advance(1.0)  # the step's own work
            probe.step(step)
            step += 1
        probe.detach()
        clock.advance(5.0)      # the twin's 5 steps, the probe detached
    ov = probe.overhead()
    assert ov["base_s"] == pytest.approx(19 * 1.0)  # every step but the first has a start
    assert ov["work_s"] == pytest.approx(19 * 0.05)
    assert ov["measured"] == pytest.approx(0.05)
    assert ov["average"] == pytest.approx(0.05)


def test_probe_overhead_with_streaming_around_each_forward_counts_the_whole_step():
    # `with probe.streaming(): forward` then backward, optimizer and step() while detached: the
    # detached span that step() closes is the step's own, as is the data loading after it
    clock = ManualClock()
    model, probe = _slow_probe(0.1, clock)
    inputs = batch(B=2, T=8)
    for step in range(6):
        clock.advance(0.5)      # data loading
        with probe.streaming():
            model(**inputs)
        clock.advance(1.5)      # backward and optimizer
        probe.step(step)
    ov = probe.overhead()
    assert ov["base_s"] == pytest.approx(5 * 2.0)
    assert ov["measured"] == pytest.approx(0.1 / 2.0)


def test_capturing_says_which_steps_the_schedule_captures():
    clock = ManualClock()
    model, probe = _slow_probe(0.0, clock, every=3)
    seen = []
    with probe.streaming():
        for step in range(7):
            seen.append(probe.capturing)
            model(**batch(B=2, T=8))
            clock.advance(1.0)
            probe.step(step)
    assert seen == [True, False, False, True, False, False, True]
    assert probe.overhead()["every"] == 3


# ---------------------------------------------------------------- pauses it is not told about
def _steady(b: OverheadBudget, n: int, step_s: float = 1.0, work: float = 0.01) -> None:
    for _ in range(n):
        b.observe(work, 0.0, step_s + work, captured=True)


def test_a_step_far_longer_than_the_recent_ones_counts_at_their_median():
    b = OverheadBudget(None, 1, smoothing=1.0)
    _steady(b, PAUSE_MIN_STEPS)
    b.observe(0.01, 0.0, 20.0 + 0.01, captured=True)  # a checkpoint save: 19 s more than a step
    assert (b.paused_steps, b.paused_s) == (1, pytest.approx(19.0))
    assert b.base_s == pytest.approx(PAUSE_MIN_STEPS + 1.0)  # counted as one typical step
    assert b.measured_fraction == pytest.approx(0.01) and b.last_fraction == pytest.approx(0.01)
    b.observe(0.01, 0.0, PAUSE_FACTOR * 1.0 + 0.01, captured=True)  # at the limit: a slow step, kept
    assert b.paused_steps == 1 and b.base_s == pytest.approx(PAUSE_MIN_STEPS + 1.0 + PAUSE_FACTOR)
    # emission and capture work are the probe's, never a pause: only the probe-free time is judged
    b.observe(0.01, 10.0, 1.0 + 10.01, captured=True, emitted=True)
    assert b.paused_steps == 1


def test_the_pause_rule_waits_for_history_and_follows_a_lasting_change():
    b = OverheadBudget(None, 1)
    b.observe(0.0, 0.0, 1.0, captured=False)
    b.observe(0.0, 0.0, 50.0, captured=False)  # the second step: nothing to compare with yet
    assert b.paused_steps == 0 and b.base_s == pytest.approx(51.0)
    b = OverheadBudget(None, 1)
    _steady(b, 10)
    paused = []
    for _ in range(PAUSE_WINDOW):  # from here on every step takes 4x as long (longer sequences)
        b.observe(0.01, 0.0, 4.01, captured=True)
        paused.append(b.paused_steps)
    assert 0 < paused[-1] <= PAUSE_WINDOW // 2 + 1  # set aside until they are half the window ...
    assert paused[-1] == paused[-4]                  # ... then training again


def test_pause_bookkeeping_survives_a_state_dict_round_trip():
    b = OverheadBudget(None, 1)
    _steady(b, 6)
    b.observe(0.01, 0.0, 30.0, captured=True)
    c = OverheadBudget(None, 1)
    c.load_state_dict(b.state_dict())
    assert (c.paused_steps, c.paused_s) == (b.paused_steps, b.paused_s) == (1, pytest.approx(30.0 - 0.01 - 1.0))
    c.observe(0.01, 0.0, 30.0, captured=True)  # the restored window still knows a typical step
    assert c.paused_steps == 2
    old = {k: v for k, v in b.state_dict().items() if k not in ("paused_steps", "paused_s", "recent")}
    d = OverheadBudget(None, 1)
    d.load_state_dict(old)  # a checkpoint written before the rule
    assert (d.paused_steps, d.paused_s) == (0, 0.0)


def test_probe_left_attached_while_a_twin_trains_reports_the_probed_steps_cost():
    # the loop: blocks of probed steps, and between them a probe-free twin trained for 15
    # steps with the probe still attached. Each twin block used to count as one probed step
    # (16 s of base time for 1 s of training) and made a 5% overhead read as ~1.6%
    clock = ManualClock()
    model, probe = _slow_probe(0.05, clock)
    inputs = batch(B=2, T=8)
    step = 0
    with probe.streaming():
        for block in range(4):
            for _ in range(15):
                model(**inputs)
                clock.advance(1.0)
                probe.step(step)
                step += 1
            clock.advance(15.0)  # the twin's 15 steps: the probe is not told
    ov = probe.overhead()
    assert (ov["paused_steps"], ov["paused_s"]) == (3, pytest.approx(3 * 15.0))
    assert ov["measured"] == pytest.approx(0.05) and ov["average"] == pytest.approx(0.05)
    assert ov["base_s"] == pytest.approx(59 * 1.0)


def test_probe_pause_leaves_out_the_time_between_steps_and_captures_nothing():
    # a trainer's callback: step() then pause() until the next step's first forward; what the
    # trainer does in between (logging, evaluation, a checkpoint save) is no step's time, and a
    # forward in the pause (even a training one) is not captured
    clock = ManualClock()
    model, probe = _slow_probe(0.05, clock)
    inputs = batch(B=2, T=8)
    probe.attach()
    probe.pause()                      # as the callbacks attach: paused until the first step starts
    clock.advance(7.0)                 # an evaluation at start
    for step in range(5):
        probe.unpause()
        model(**inputs)
        clock.advance(1.0)             # the step's own work
        probe.step(step)
        probe.pause()
        clock.advance(3.0)             # a checkpoint save
        model(**inputs)                # a forward during the pause: not captured
    ov = probe.overhead()
    assert ov["base_s"] == pytest.approx(4 * 1.0)  # every step but the first has a start
    assert ov["work_s"] == pytest.approx(4 * 0.05)
    assert ov["paused_steps"] == 0     # told about: nothing for the pause rule to set aside
    n = {r.value for r in probe.records() if r.metric == "n"}
    assert not n                       # emit_every=1000: nothing emitted yet; the totals say:
    assert {int(v) for acc in probe._totals.accs.values() for v in acc.cov.n.flatten()} == {5 * 2 * 8}
    probe.detach()                     # ends the pause; unpause() after it is a no-op
    probe.unpause()
    assert not probe._router.streaming


def test_probe_step_during_a_pause_leaves_the_pause_out_and_keeps_pausing():
    clock = ManualClock()
    model, probe = _slow_probe(0.05, clock)
    inputs = batch(B=2, T=8)
    probe.attach()
    for step in range(4):
        with probe.paused():           # the context manager unpauses on leaving
            clock.advance(2.0)
        model(**inputs)
        clock.advance(1.0)
        probe.pause()
        clock.advance(4.0)             # paused before and after step(): neither span is step time
        probe.step(step)
        clock.advance(4.0)
        probe.unpause()
    assert probe.overhead()["base_s"] == pytest.approx(3 * 1.0)
    assert probe.overhead()["work_s"] == pytest.approx(3 * 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step() while paused is attached: no "not attached" warning
        probe.pause()
        probe.step(4)
    probe.detach()
    probe.pause()                       # not attached: a no-op
    assert not probe._paused
