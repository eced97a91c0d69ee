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
