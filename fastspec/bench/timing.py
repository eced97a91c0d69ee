"""Wall-clock timing for the benchmark cases: warmup, then the median (and range) of repeats.

On CUDA each repeat is bracketed by CUDA events (device time of the queued work, no host
launch jitter); on CPU by ``time.perf_counter``. The median, not the mean, because the CI
machines are shared and a single preempted repeat should not move the number; and
:func:`measure_interleaved` alternates the contenders repeat by repeat so that load from other
processes drifting over the run lands on all of them alike.
"""
from __future__ import annotations

import contextlib
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


def _check(warmup: int, repeats: int) -> None:
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup/repeats: expected warmup >= 0 and repeats >= 1, got {warmup}/{repeats}")


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``fn()`` call, device work included."""
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


def measure(fn: Callable[[], object], *, device: torch.device, warmup: int = 2,
            repeats: int = 5) -> Timing:
    """Time ``fn()``; ``warmup`` untimed calls first (compilation, autotuning, allocator)."""
    return measure_interleaved([fn], device=device, warmup=warmup, repeats=repeats)[0]


def measure_interleaved(fns: list[Callable[[], object]], *, device: torch.device, warmup: int = 2,
                        repeats: int = 5,
                        contexts: list[Callable[[], ContextManager]] | None = None,
                        deadline: float | None = None) -> list[Timing]:
    """Time each of ``fns`` round-robin: every round calls each once, in order.

    ``contexts[i]()`` (if given) is entered around each call of ``fns[i]``, outside its timing
    (e.g. a probe's hooks that must be off while the baseline runs).
    ``deadline`` (a ``time.monotonic()`` value): once it has passed, stop after the current
    round as soon as one timed round is done; ``Timing.repeats`` says how many were.
    """
    _check(warmup, repeats)
    contexts = contexts or [contextlib.nullcontext] * len(fns)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(warmup + repeats):
        for fn, ctx, out in zip(fns, contexts, times):
            with ctx():
                t = time_once(fn, device)
            if r >= warmup:
                out.append(t)
        if deadline is not None and times[0] and time.monotonic() > deadline:
            break
    return [Timing(statistics.median(t), min(t), max(t), len(t)) for t in times]
