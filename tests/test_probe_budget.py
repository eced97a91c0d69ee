"""Overhead budget: the probe times its own work and widens its capture interval to stay under
the budget. Tested with an injected clock, so every number is deterministic."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from _tiny_models import batch, build

import fastspec
from fastspec.probe.budget import OverheadBudget, WorkTimer


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


def test_budget_policy_interval_is_ceil_cost_over_budget_and_relaxes():
    b = OverheadBudget(0.01, base_every=2, smoothing=1.0)
    assert b.observe(work_s=0.05, step_s=1.0, active=True) == 5  # 5% per captured step -> 1 in 5
    assert b.average_fraction == pytest.approx(0.01)
    assert b.observe(work_s=0.0, step_s=1.0, active=False) == 5  # idle steps say nothing about cost
    assert b.observe(work_s=0.001, step_s=1.0, active=True) == 2  # cheap again: back to base_every
    assert OverheadBudget(None, 3).observe(0.9, 1.0, True) == 3  # no budget: never adapts


def test_budget_smoothing_and_bad_arguments():
    b = OverheadBudget(0.1, base_every=1, smoothing=0.5)
    b.observe(0.4, 1.0, True)
    assert b.observe(0.0, 1.0, True) == math.ceil(0.2 / 0.1)  # EMA: 0.5*0.4 + 0.5*0
    for bad in (0, 1.0, -0.1, "1%"):
        with pytest.raises(ValueError, match="budget"):
            OverheadBudget(bad, 1)
    with pytest.raises(ValueError, match="every"):
        OverheadBudget(0.01, 0)


def test_work_timer_host_clock_sums_capture_windows():
    clock = TickClock(tick=0.5)
    timer = WorkTimer(clock)
    for _ in range(3):
        timer.stop(timer.start(None))
    assert timer.close_step("a") == [(pytest.approx(1.5), "a")]
    assert timer.close_step("b") == [(0.0, "b")]


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
    end = FakeEvent(ms=30.0)
    timer._events.append((FakeEvent(0.0), end))  # what start()/stop() record on CUDA
    assert timer.close_step("captured") == []     # not complete: nothing is reported yet
    assert timer.close_step("idle") == []         # and nothing overtakes it
    end.done = True
    assert timer.close_step("idle2") == [(pytest.approx(0.03), "captured"), (0.0, "idle"), (0.0, "idle2")]


def test_probe_adapts_interval_to_stay_under_budget():
    model = build("gpt2")
    inputs = batch(B=2, T=8)
    tick = 1e-3
    clock = TickClock(tick)
    probe = fastspec.Probe(model, ffn=False, budget=0.01, emit_every=1000, clock=clock)
    captured_steps = []
    with probe.streaming():
        for step in range(40):
            reads = clock.reads
            model(**inputs)
            if clock.reads > reads:
                captured_steps.append(step)
            clock.advance(0.1)  # 100 ms of "training" per step
            probe.step(step)
    # one captured step: 2 layers x 1 capture x 1 tick of work = 2 ms over ~103 ms of step
    cost = 2 * tick / (0.1 + 2 * 2 * tick + tick)
    expected_every = math.ceil(cost / 0.01)
    assert probe.every == expected_every
    gaps = {b - a for a, b in itertools.pairwise(captured_steps[3:])}
    assert gaps == {expected_every}
    assert probe.overhead()["average"] <= 0.01
    assert probe.overhead()["every"] == expected_every


def test_without_budget_every_step_is_captured_and_overhead_reported():
    model = build("gpt2")
    clock = TickClock(1e-3)
    probe = fastspec.Probe(model, ffn=False, emit_every=5, clock=clock)
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
    probe = fastspec.Probe(model, ffn=False, budget=0.01, clock=clock)
    for step in range(3):
        probe.measure(batch(B=2, T=8), step=step)
    assert clock.reads == 0
    with probe.streaming():
        model(**batch(B=2, T=8))
    assert clock.reads == 2 * 2  # streaming captures are timed: 2 layers, start + stop


@pytest.mark.gpu
def test_cuda_records_arrive_asynchronously_and_match_cpu():
    model = build("llama")
    inputs = batch(pad="right")
    want = {(r.site, r.layer, r.head, r.metric): r.value for r in fastspec.Probe(model).measure(inputs, step=0)}
    model = model.cuda()
    probe = fastspec.Probe(model, emit_every=1)
    with probe.streaming():
        model(**{k: v.cuda() for k, v in inputs.items()})
        probe.step(0)
    got = {(r.site, r.layer, r.head, r.metric): r.value for r in probe.records() if r.site != "probe"}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-3, abs=1e-6), k  # fp32 eigensolve on CUDA
    assert torch.cuda.is_available()
