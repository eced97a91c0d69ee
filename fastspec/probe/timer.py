"""The probe's work time per training step and kind of work, without syncing the device.

Two kinds of work (``KINDS``) are timed separately per training step (the interval between two
:meth:`Probe.step` calls): *capture* work (every streaming capture in a hook: masking, sampling,
the covariance update) and *emission* work (computing the metrics, packing the records and
resetting the accumulators inside :meth:`Probe.step`). On CPU each is timed with the host clock;
on CUDA with a pair of events each, read later once they have completed, so timing never syncs
the training stream. A step's work is handed out with that step's tag (its step time, whether it
captured, whether it emitted) once all its events have completed: without host syncs the host
can run a step or more ahead of the GPU, and adding late events to whichever step is current
would credit a captured step's cost to an idle one. What the times are used for: ``budget.py``.

The step time itself (:class:`StepClock`) runs from one :meth:`Probe.step` call to the next, less
any time the probe spent detached between two such calls: evaluation, another model trained in
between, a pause with the probe switched off are not a training step with the probe, and counted
as one they would make the probe's work look cheaper than it is. For the same reason an eager
forward of the probed model that does not train (evaluation: ``model.eval()``, ``no_grad``,
``inference_mode``) is left out while the probe streams training forwards only: the span of its
root forward (:meth:`StepClock.other_forward`). Pauses the probe is not told about (a checkpoint
save, a data-loader stall, an evaluation loop's own work) are set aside by the budget's pause
rule instead (``budget.py``).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

KINDS = ("capture", "emit")


class WorkTimer:
    """The probe's work time per step and kind (host clock or CUDA events), per closed step."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self.clock = clock or time.perf_counter
        self._host = dict.fromkeys(KINDS, 0.0)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        self._closed: deque[tuple[dict, list, Any]] = deque()  # (host seconds, events, tag) per step

    def start(self, device: torch.device | None):
        if device is not None and device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ("cuda", ev)
        return ("host", self.clock())

    def stop(self, token, kind: str = "capture") -> None:
        where, start = token
        if where == "host":
            self._host[kind] += self.clock() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end, kind))

    def close_step(self, tag: Any) -> list[tuple[dict, Any]]:
        """End the current step's timing, labelled ``tag``; returns ``({kind: seconds}, tag)`` of
        every closed step whose CUDA events have all completed, oldest first (never syncs)."""
        self._closed.append((self._host, self._events, tag))
        self._host, self._events = dict.fromkeys(KINDS, 0.0), []
        done = []
        while self._closed and all(end.query() for _, end, _ in self._closed[0][1]):
            host, events, t = self._closed.popleft()
            work = dict(host)
            for s, e, kind in events:
                work[kind] += s.elapsed_time(e) / 1e3
            done.append((work, t))
        return done


class StepClock:
    """Seconds of each training step (between two :meth:`Probe.step` calls), less the time the
    probe spent detached in between.

    A detached span that ends (:meth:`attached`) before the next step is a pause, left out; one
    that a step closes (``step()`` right after ``detach()``, as with a ``streaming()`` context
    around each step's forwards) is part of that step: the backward and optimizer ran in it.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._last: float | None = None       # the previous step's end
        self._paused = 0.0                    # pause seconds since then
        self._off_since: float | None = None  # detached since (a span no step has closed yet)
        self._other_since: float | None = None  # a forward that does not train, running since
        self.other_forwards = 0               # such forwards left out so far, and their seconds
        self.other_s = 0.0

    def other_forward(self, starts: bool) -> None:
        """A forward that does not train starts (``True``) or ends: its span is not step time."""
        if starts:
            self._other_since = self.clock()
        elif self._other_since is not None:
            span = self.clock() - self._other_since
            self._other_since = None
            if self._off_since is None:  # inside a detached span it is left out already
                self._paused += span
                self.other_forwards += 1
                self.other_s += span

    def detached(self) -> None:
        if self._off_since is None:
            self._off_since = self.clock()

    def attached(self) -> None:
        if self._off_since is not None:
            self._paused += self.clock() - self._off_since
            self._off_since = None

    def lap(self) -> float | None:
        """End the current step: its seconds (None for the first one), and start the next."""
        now = self.clock()
        step_s = None if self._last is None else now - self._last - self._paused
        # a detached span closed by this step belongs to it; what follows counts from here
        self._last, self._paused, self._off_since, self._other_since = now, 0.0, None, None
        return step_s
