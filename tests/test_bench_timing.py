"""The benchmarks' ``device`` clock, driven through a simulated CUDA stream.

No GPU here, so :class:`FakeGPU` stands in for one stream: the host has a clock, the device is
busy until ``free``, and work queued at host time ``now`` starts at ``max(now, free)``. Events
complete when the device reaches them, as CUDA's do. The timing code runs unchanged on top of
it (``torch.cuda``'s events, sync and stream, ``_spin`` and the module's ``time`` are swapped),
so these tests check what the clock reports against the simulated device work, which is known
exactly.
"""
from __future__ import annotations

import types

import pytest
import torch

from fastspec.bench import timing
from fastspec.bench.case import Case, no_worse_than
from fastspec.bench.runner import run_case

CUDA = torch.device("cuda")
CYCLES_PER_S = 2e9  # the simulated GPU's clock: the first spin (2^20 cycles) lasts 0.52 ms


class FakeGPU:
    def __init__(self) -> None:
        self.now = 0.0   # host clock, seconds
        self.free = 0.0  # the device is busy until then
        self.spins: list[float] = []

    def host(self, seconds: float) -> None:
        self.now += seconds

    def queue(self, seconds: float) -> None:
        self.free = max(self.now, self.free) + seconds

    def sync(self) -> None:
        self.now = max(self.now, self.free)


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.at = gpu, None

    def record(self, stream=None) -> None:
        self.at = max(self.gpu.now, self.gpu.free)  # reached once the work queued before it is done

    def query(self) -> bool:
        return self.at <= self.gpu.now

    def synchronize(self) -> None:
        self.gpu.now = max(self.gpu.now, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch's


@pytest.fixture
def gpu(monkeypatch) -> FakeGPU:
    g = FakeGPU()

    def spin(cycles: int, device) -> None:
        g.spins.append(cycles / CYCLES_PER_S)
        g.queue(cycles / CYCLES_PER_S)

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(g))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: g.sync())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(timing, "_spin", spin)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: g.now,
                                                              monotonic=lambda: g.now))
    return g


def launches(gpu: FakeGPU, *, host_s: float, kernels: list[float]):
    """A call that spends ``host_s`` on the host, spread evenly over queueing ``kernels``."""
    def call() -> None:
        for seconds in kernels:
            gpu.host(host_s / len(kernels))
            gpu.queue(seconds)
    return call


def test_events_time_a_host_bound_call_by_its_launches_and_the_device_clock_by_its_kernels(gpu):
    call = launches(gpu, host_s=300e-6, kernels=[20e-6] * 3)  # 60 µs of kernels, 300 µs to queue
    events = timing.measure(call, device=CUDA, warmup=0, repeats=3)
    assert events.clock == "events" and events.host is None
    assert events.median == pytest.approx(320e-6)  # the last launch at 300 µs, then its kernel
    device = timing.measure(call, device=CUDA, warmup=0, repeats=3, device_only=True)
    assert device.clock == "device"
    assert device.median == pytest.approx(60e-6) and device.max == pytest.approx(60e-6)
    assert device.host == pytest.approx(300e-6)


def test_a_device_bound_call_reads_the_same_on_both_clocks(gpu):
    call = launches(gpu, host_s=10e-6, kernels=[500e-6])
    events = timing.measure(call, device=CUDA, warmup=0, repeats=2)
    device = timing.measure(call, device=CUDA, warmup=0, repeats=2, device_only=True)
    assert events.median == pytest.approx(510e-6)  # the kernel starts once it is queued
    assert device.median == pytest.approx(500e-6) and device.clock == "device"


def test_the_spin_grows_past_a_host_time_longer_than_its_first_length_and_keeps_it(gpu):
    """3 ms of queueing outlasts the first spin (0.52 ms): that call is timed again with a spin
    twice the host's time, which covers it; the next calls start from the spin learnt."""
    call = launches(gpu, host_s=3e-3, kernels=[40e-6] * 2)
    spin = timing.Spin()
    seconds, host = timing.device_time_once(call, CUDA, spin)
    assert seconds == pytest.approx(80e-6) and host == pytest.approx(3e-3)
    assert gpu.spins == pytest.approx([timing.SPIN_START_CYCLES / CYCLES_PER_S, 6e-3])
    assert spin.misses == 0
    timing.device_time_once(call, CUDA, spin)
    assert gpu.spins[2:] == pytest.approx([6e-3])  # one try: the spin it kept covers the call


def test_a_call_that_waits_for_the_gpu_gives_up_the_spin_and_says_so(gpu):
    """A host sync inside the call can never be covered: after SPIN_TRIES misses it is timed on
    the events clock, and no more spins are queued for it."""
    def synced() -> None:
        gpu.host(5e-6)
        gpu.queue(50e-6)
        gpu.sync()  # .item(), a blocking copy
        gpu.host(5e-6)
        gpu.queue(50e-6)

    fast = launches(gpu, host_s=100e-6, kernels=[30e-6])
    a, b = timing.measure_interleaved([fast, synced], device=CUDA, warmup=1, repeats=3, device_only=True)
    assert a.clock == "device" and a.median == pytest.approx(30e-6)
    assert b.clock == "events" and b.host is None
    assert b.median == pytest.approx(110e-6)  # time_once: 5 + 50 µs, sync, 5 + 50 µs
    assert len(gpu.spins) == 4 + timing.SPIN_TRIES  # fast: one per round; synced: its misses only


def test_device_only_is_ignored_on_cpu():
    t = timing.measure(lambda: None, device=torch.device("cpu"), warmup=0, repeats=2, device_only=True)
    assert t.clock == "wall" and t.host is None


def test_rows_of_a_device_time_case_carry_each_sides_clock_and_host_time(gpu):
    fast = launches(gpu, host_s=200e-6, kernels=[25e-6] * 2)
    slow = launches(gpu, host_s=400e-6, kernels=[100e-6] * 4)
    case = Case(suite="covariance", size="s", variant="v", setup=dict, fastspec=lambda inp: fast(),
                baselines={"torch": lambda inp: slow()},
                check=lambda inp: {"fastspec_error": 0.0, "baseline_error": 0.0},
                error_kind="max rel err", claim=no_worse_than(), device_time=True)
    [row] = run_case(case, CUDA, warmup=1, repeats=2)
    assert row["clock"] == row["baseline_clock"] == "device"
    assert row["fastspec_s"] == pytest.approx(50e-6) and row["baseline_s"] == pytest.approx(400e-6)
    assert row["speedup"] == pytest.approx(8.0)
    assert row["fastspec_host_s"] == pytest.approx(200e-6) and row["baseline_host_s"] == pytest.approx(400e-6)
    case.device_time = False
    [row] = run_case(case, CUDA, warmup=1, repeats=2)
    assert row["clock"] == row["baseline_clock"] == "events" and "fastspec_host_s" not in row
    assert row["speedup"] == pytest.approx(500e-6 / 225e-6)  # the launches set the pace of both


def test_the_covariance_cases_ask_for_the_device_clock():
    from fastspec.bench.suites import cases

    selected = cases("covariance", "quick", torch.device("cpu"))
    assert selected and all(c.device_time for c in selected)
    assert not any(c.device_time for c in cases("eigvalsh", "quick", torch.device("cpu")))


@pytest.mark.gpu
def test_on_a_gpu_the_device_clock_drops_the_launch_time_of_a_host_bound_call():
    """200 one-element adds: the host's launches (several µs each through torch) outlast the
    kernels, so events measure the launches and the device clock less; a call ending in
    ``.item()`` waits for the GPU and stays on events; a device-bound call reads the same."""
    x = torch.zeros(1, device=CUDA)

    def adds() -> None:
        for _ in range(200):
            x.add_(1)

    events = timing.measure(adds, device=CUDA, warmup=2, repeats=5)
    device = timing.measure(adds, device=CUDA, warmup=2, repeats=5, device_only=True)
    assert events.clock == "events" and device.clock == "device"
    assert device.median < 0.8 * events.median and device.host > device.median
    synced = timing.measure(lambda: x.add_(1).item(), device=CUDA, warmup=1, repeats=2, device_only=True)
    assert synced.clock == "events" and synced.host is None
    sleep = timing.measure(lambda: torch.cuda._sleep(1 << 22), device=CUDA, warmup=1, repeats=3)
    slept = timing.measure(lambda: torch.cuda._sleep(1 << 22), device=CUDA, warmup=1, repeats=3,
                           device_only=True)
    assert slept.clock == "device" and slept.median == pytest.approx(sleep.median, rel=0.1)
