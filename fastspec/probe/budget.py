"""The probe's own cost: timing its work and keeping it under an overhead budget.

Work is timed per training step: on CPU with a host clock around every capture and emission;
on CUDA with a pair of events per capture (read later, once they have completed, so timing
never syncs the training stream). Step time is the host-clock interval between two
:meth:`Probe.step` calls. A step's work is accounted to that step (its step time and whether it
captured) once all its events have completed: without host syncs the host can run a step or
more ahead of the GPU, and adding late events to whichever step is current would credit a
captured step's cost to an idle one, so the budget would see captures as nearly free.

Budget policy (deterministic): the fraction ``c = work / step_time`` is measured on the steps
the probe is active, smoothed with an exponential moving average; capturing on one step in
``every`` costs about ``c / every`` on average, so ``every = max(base_every, ceil(c / budget))``
keeps the average under the budget. It relaxes back to ``base_every`` as soon as the cost
falls. Skipping whole steps keeps every captured step's statistics complete and unbiased
(token sampling would change what one step measures).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class OverheadBudget:
    """Choose the capture interval from measured work/step-time fractions (see module doc)."""

    def __init__(self, budget: float | None, base_every: int, smoothing: float = 0.5):
        if budget is not None and not (isinstance(budget, (int, float)) and 0 < budget < 1):
            raise ValueError(f"budget: expected a fraction in (0, 1) or None, got {budget!r}")
        if not isinstance(base_every, int) or isinstance(base_every, bool) or base_every < 1:
            raise ValueError(f"every: expected an int >= 1, got {base_every!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: expected a value in (0, 1], got {smoothing!r}")
        self.budget, self.base_every, self.smoothing = budget, base_every, smoothing
        self.every = base_every
        self.active_cost: float | None = None  # EMA of work/step on active steps
        self.last_fraction: float | None = None

    def observe(self, work_s: float, step_s: float, active: bool) -> int:
        """Account one finished step; returns the capture interval to use from now on."""
        if step_s <= 0:
            return self.every
        frac = work_s / step_s
        self.last_fraction = frac
        if active:
            a = self.smoothing
            self.active_cost = frac if self.active_cost is None else (1 - a) * self.active_cost + a * frac
        if self.budget is not None and self.active_cost is not None:
            self.every = max(self.base_every, math.ceil(self.active_cost / self.budget - 1e-12))
        return self.every

    @property
    def average_fraction(self) -> float | None:
        """Expected overhead per step at the current interval."""
        return None if self.active_cost is None else self.active_cost / self.every

    def state_dict(self) -> dict:
        return {"every": self.every, "active_cost": self.active_cost, "last_fraction": self.last_fraction}

    def load_state_dict(self, sd: dict) -> None:
        self.every = int(sd["every"])
        self.active_cost, self.last_fraction = sd["active_cost"], sd["last_fraction"]


class WorkTimer:
    """The probe's work time per step (host clock or CUDA events), handed out per closed step."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self.clock = clock or time.perf_counter
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._closed: deque[tuple[float, list, Any]] = deque()  # (host_s, events, tag) per step

    def start(self, device: torch.device | None):
        if device is not None and device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ("cuda", ev)
        return ("host", self.clock())

    def stop(self, token) -> None:
        kind, start = token
        if kind == "host":
            self._host_s += self.clock() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end))

    def close_step(self, tag: Any) -> list[tuple[float, Any]]:
        """End the current step's timing, labelled ``tag``; returns ``(work_s, tag)`` of every
        closed step whose CUDA events have all completed, oldest first (never syncs)."""
        self._closed.append((self._host_s, self._events, tag))
        self._host_s, self._events = 0.0, []
        done = []
        while self._closed and all(end.query() for _, end in self._closed[0][1]):
            host_s, events, t = self._closed.popleft()
            done.append((host_s + sum(s.elapsed_time(e) for s, e in events) / 1e3, t))
        return done
