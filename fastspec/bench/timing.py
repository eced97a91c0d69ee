"""Timing for the benchmark cases: warmup, then the median (and range) of repeats.

Three clocks (:attr:`Timing.clock`):

* ``wall``: on CPU, ``time.perf_counter`` around the call.
* ``events``: on CUDA, CUDA events recorded before and after the call. The GPU starts the call's
  first kernel as soon as it is queued, so when the host takes longer to queue the call's
  kernels than the GPU takes to run them (a host-bound call: small kernels, many launches) the
  events measure the host's launch time, not the kernels'.
* ``device``: the device's own work, asked for with ``device_only=True``. A spin kernel
  (``torch.cuda._sleep``) is queued ahead of the start event, so the GPU is still busy with it
  while the host queues the call; the events then bracket the call's kernels back to back. The
  spin must outlast the host's queueing: when the start event has already completed by the time
  the host has queued the whole call, the GPU may have idled inside the bracket, and the call is
  timed again with a longer spin (:class:`Spin`). A call that waits for the GPU itself (a host
  sync) can never be covered; its repeats stay on the ``events`` clock, and say so. This is what
  a call costs inside a training step, where the host runs ahead of the GPU and the launches
  overlap earlier kernels.

The median, not the mean, because the CI machines are shared and a single preempted repeat
should not move the number; and :func:`measure_interleaved` alternates the contenders repeat by
repeat so that load from other processes drifting over the run lands on all of them alike.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call: ``median`` over ``repeats`` timed calls, the fastest and the slowest one
    (their spread is what ``fastspec bench`` takes as the measurement noise)."""

    median: float
    min: float
    max: float
    repeats: int
    clock: str = "wall"
    """``wall``, ``events`` or ``device`` (see the module docstring): ``device`` only when every
    timed repeat had the host's launch time hidden."""
    host: float | None = None
    """On the ``device`` clock: the median seconds the host took to queue one call (what the
    clock hides; a call whose host time exceeds its device time is host-bound on its own)."""


def _check(warmup: int, repeats: int) -> None:
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup/repeats: expected warmup >= 0 and repeats >= 1, got {warmup}/{repeats}")


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``fn()`` call, device work included (``wall`` or ``events`` clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # on ``device``'s stream, not the current device's (``--device cuda:1``)
        stream = torch.cuda.current_stream(device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


SPIN_START_CYCLES = 1 << 20
"""The first spin (~0.5 ms at the H100's 1.98 GHz): ample for a call of a few launches."""
SPIN_MAX_S = 1.0
"""Never spin longer than this."""
SPIN_TRIES = 3
"""Misses in a row after which a callable is taken to wait for the GPU itself (a host sync):
its calls are then timed on the ``events`` clock, without a spin."""


def _spin(cycles: int, device: torch.device) -> None:
    """Queue a kernel that keeps ``device`` busy for ``cycles`` clock cycles (its current stream)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)


class Spin:
    """The spin kernel's length for one timed callable, learnt from its calls.

    Each call measures the spin's own duration (an event before it), which gives the GPU's
    cycles per second, and the host's time to queue the call; the spin then grows to twice that
    time. It never shrinks, so the repeats of a callable keep what its warm-up found. A call the
    spin did not cover is a miss. After a miss the spin is twice the host's time of the call
    that missed, so a second miss in a row means the host waited for the GPU inside the call
    (its time then includes the spin); :data:`SPIN_TRIES` misses in a row and the callable gives
    up on spinning.
    """

    def __init__(self) -> None:
        self.cycles = SPIN_START_CYCLES
        self.misses = 0

    def learn(self, spun_s: float, host_s: float, covered: bool) -> None:
        self.misses = 0 if covered else self.misses + 1
        if spun_s > 0:
            rate = self.cycles / spun_s  # cycles per second of this GPU's clock
            self.cycles = max(1, min(max(self.cycles, math.ceil(rate * 2 * host_s)),
                                     math.ceil(rate * SPIN_MAX_S)))

    @property
    def gave_up(self) -> bool:
        return self.misses >= SPIN_TRIES


def device_time_once(fn: Callable[[], object], device: torch.device,
                     spin: Spin) -> tuple[float, float | None]:
    """(seconds of the device work of one ``fn()`` call, the host's seconds to queue it), or
    (:func:`time_once`'s seconds, None) when the host's launch time could not be hidden.

    ``device`` must be CUDA. A call the spin did not cover is timed again with the longer spin
    ``spin`` learnt from it, until one is covered or ``spin`` gives up (then on the ``events``
    clock of :func:`time_once`); each try calls ``fn`` once.
    """
    stream = torch.cuda.current_stream(device)
    for _ in range(SPIN_TRIES):  # gives up after as many misses in a row at most
        if spin.gave_up:
            break
        torch.cuda.synchronize(device)
        before, start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        before.record(stream)
        _spin(spin.cycles, device)
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        stop.record(stream)
        host_s = time.perf_counter() - t0
        covered = not start.query()  # the spin still ran when the host had queued everything
        stop.synchronize()
        spin.learn(before.elapsed_time(start) / 1e3, host_s, covered)
        if covered:
            return start.elapsed_time(stop) / 1e3, host_s
    return time_once(fn, device), None


def measure(fn: Callable[[], object], *, device: torch.device, warmup: int = 2,
            repeats: int = 5, device_only: bool = False) -> Timing:
    """Time ``fn()``; ``warmup`` untimed calls first (compilation, autotuning, allocator)."""
    return measure_interleaved([fn], device=device, warmup=warmup, repeats=repeats,
                               device_only=device_only)[0]


def measure_interleaved(fns: list[Callable[[], object]], *, device: torch.device, warmup: int = 2,
                        repeats: int = 5,
                        contexts: list[Callable[[], ContextManager]] | None = None,
                        deadline: float | None = None, device_only: bool = False) -> list[Timing]:
    """Time each of ``fns`` round-robin: every round calls each once, in order.

    ``contexts[i]()`` (if given) is entered around each call of ``fns[i]``, outside its timing
    (e.g. a probe's hooks that must be off while the baseline runs).
    ``deadline`` (a ``time.monotonic()`` value): once it has passed, stop after the current
    round as soon as one timed round is done; ``Timing.repeats`` says how many were.
    ``device_only`` (CUDA): time the device's work with the host's launch time hidden (the
    ``device`` clock); each callable learns its own spin in the warm-up rounds. Ignored on CPU.
    """
    _check(warmup, repeats)
    contexts = contexts or [contextlib.nullcontext] * len(fns)
    times: list[list[float]] = [[] for _ in fns]
    hosts: list[list[float | None]] = [[] for _ in fns]  # device clock: the host's queueing time
    spun = device_only and device.type == "cuda"
    spins = [Spin() for _ in fns]
    for r in range(warmup + repeats):
        for fn, ctx, out, host, spin in zip(fns, contexts, times, hosts, spins):
            with ctx():
                t, h = device_time_once(fn, device, spin) if spun else (time_once(fn, device), None)
            if r >= warmup:
                out.append(t)
                host.append(h)
        if deadline is not None and times[0] and time.monotonic() > deadline:
            break
    return [_timing(t, h, device) for t, h in zip(times, hosts)]


def _timing(times: list[float], hosts: list[float | None], device: torch.device) -> Timing:
    """The :class:`Timing` of one callable's timed repeats (``hosts``: None where not hidden)."""
    stats = (statistics.median(times), min(times), max(times), len(times))
    if device.type != "cuda":
        return Timing(*stats, clock="wall")
    if any(h is None for h in hosts):
        return Timing(*stats, clock="events")
    return Timing(*stats, clock="device", host=statistics.median(hosts))
