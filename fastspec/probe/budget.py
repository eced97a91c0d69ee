"""The probe's own cost: timing all of its work, reporting it honestly, keeping it under a budget.

**What is counted.** Two kinds of work, timed separately per training step (the interval
between two :meth:`Probe.step` calls): *capture* work (every streaming capture in a hook:
masking, sampling, the covariance update) and *emission* work (computing the metrics, packing
the records and resetting the accumulators inside :meth:`Probe.step`). On CPU each is timed with
the host clock; on CUDA with a pair of events each, read later once they have completed, so
timing never syncs the training stream. A step's work is accounted to that step (its step time,
whether it captured, whether it emitted) once all its events have completed: without host syncs
the host can run a step or more ahead of the GPU, and adding late events to whichever step is
current would credit a captured step's cost to an idle one. Not counted: the dispatch of the
hooks themselves (a few µs of Python per hooked module call, also on idle steps) and the
``measure()`` eval protocol (it is not streaming).

**Captures inside a compiled graph** cannot be timed one by one (a host clock does not run in
a graph, and CUDA events there would be replayed, not recorded). Their cost is then judged from
whole step times instead: the median (over the last ``UNTIMED_WINDOW``) probe-free time of steps
that captured, against that of steps that did not, ``c = median_captured / median_idle − 1``.
A median ignores the step that compiled the graph. With a ``budget`` and ``every=1`` there
would be no idle steps to compare with, so one step in ``CALIBRATE_EVERY`` is left idle (whole
steps skipped, as throttling does: the statistics stay unbiased). Until both kinds of step have
been seen, the capture cost is unknown (``None``) and the capture interval does not adapt.

**What is reported.** Overhead is relative to the step *without* the probe: a step of wall time
``step_s`` that did ``w`` seconds of probe work had ``base = step_s - w`` seconds of training, and
costs ``w / base``. Two fractions are kept, each an exponential moving average over the steps
that did that kind of work: ``c`` (capture work / base, on captured steps) and ``e`` (emission
work / base, on emitting steps). Capturing one step in ``every`` and emitting once every ``E``
steps costs on average ::

    overhead = c / every + e / E

per step, idle steps included: that is :meth:`Probe.overhead` ``["average"]`` and the
``("probe", None, None, "overhead_fraction")`` record, an estimate of the measured end-to-end
``(time with probe - time without) / time without``. (The record is written before the
emission it belongs to runs, so the first one cannot include emission cost yet.)
``overhead()["measured"]`` is the plain running ratio of all probe work to all base time.

**Throttling** (with ``budget=B``; deterministic, re-planned after every accounted step):
at the requested intervals (``every``, ``emit_every``) the cost is ``c/every + e/emit_every``.
If that is within ``B`` nothing changes. Otherwise each kind of work is guaranteed half of the
budget and may use what the other leaves:

* emission within its half (``e/emit_every <= B/2``): emissions stay every ``emit_every``
  steps and captures get the rest, ``every = ceil(c / (B - e/emit_every))``;
* captures within their half: captures stay every ``every`` steps and emissions get the rest;
* both over their half: each gets ``B/2``.

A capture interval is never below the requested ``every``; captures happen on the steps that
are multiples of it. An emission interval is a multiple of ``emit_every`` (emissions stay on
steps that are multiples of ``emit_every``, some skipped): the *effective* emit interval
``overhead()["emit_every"]``; with ``reset=True`` an emission then covers all the tokens since
the previous one. Intervals relax back as soon as the measured costs fall. Skipping whole
steps keeps every captured step's statistics complete and unbiased. Under ``torch.distributed``
with ``sync`` other than ``"none"`` an emission is a collective that every rank must reach on
the same step, and ranks measure different timings: there the emission interval is never
adapted (only captures are: they involve no collective), and captures keep at least half of
the budget.

**FFN rows.** Full-rate FFN streaming is inherently expensive: the Gram of the down projection's
input costs ``GRAM_FLOPS · N · d_ff²`` per layer for ``N`` tokens, against about
``STEP_FLOPS · N · P`` for a training step of a model with ``P`` (matmul) parameters: about
30% of a step for GPT-2 small, 20% for Llama-7B, 15% for Qwen3-0.6B. ``Probe(ffn_rows="auto")``
(the default) therefore keeps every ``k``-th token of each sequence at the FFN sites while
streaming (``k=20`` for Llama-7B without a budget), with ``k`` the smallest
integer that brings this FLOP share under the target (the ``budget`` when set, else
``DEFAULT_FFN_SHARE``), see :func:`ffn_flop_share` and :func:`auto_ffn_rows`. Sampling every
``k``-th token leaves the covariance estimator unbiased (same expectation, ``1/k`` of the rows,
so its variance grows about ``k``-fold, less when neighbouring tokens are correlated); the
``eig``-convention FFN metrics are those of ``1/k`` of the streamed tokens, and being
spectra of a finite sample, they move when the row count per emission approaches ``d_ff``.
``ffn_rows="all"`` streams every token; :meth:`Probe.measure` always uses every token.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .families import Family, matches

KINDS = ("capture", "emit")

#: FLOP model of the FFN subsampling: FLOPs per row and per entry of a ``d x d`` Gram (a full
#: GEMM; the symmetric Triton kernel does about half of that) and a training step's FLOPs per
#: token and parameter (forward 2 + backward 4).
GRAM_FLOPS = 2
STEP_FLOPS = 6
#: FFN share of a training step that ``ffn_rows="auto"`` aims at when no ``budget`` is set.
DEFAULT_FFN_SHARE = 0.01
#: Captures inside a compiled graph: step times kept per kind (captured / idle), and, with a
#: budget and ``every=1``, one step in ``CALIBRATE_EVERY`` left idle to compare with.
UNTIMED_WINDOW = 9
CALIBRATE_EVERY = 16


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that do per-token matmul work: every distinct parameter except those used
    only by ``nn.Embedding`` modules (a lookup; a tied output head still counts, once)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def ffn_flop_share(ffn_widths: Iterable[int], n_params: int) -> float:
    """Full-rate FFN streaming cost as a fraction of a training step:
    ``GRAM_FLOPS · Σ d_ff² / (STEP_FLOPS · P)`` (the token count cancels)."""
    if n_params <= 0:
        raise ValueError(f"n_params: expected > 0, got {n_params!r}")
    return GRAM_FLOPS * sum(d * d for d in ffn_widths) / (STEP_FLOPS * n_params)


def auto_ffn_rows(share: float, target: float, row_step: int = 1) -> int:
    """Smallest ``k >= 1`` with ``share / (row_step · k) <= target``: FFN sites then keep every
    ``row_step · k``-th token."""
    if not target > 0:
        raise ValueError(f"target: expected > 0, got {target!r}")
    return max(1, math.ceil(share / (row_step * target) - 1e-9))


def ffn_widths(model: nn.Module, family: Family | None) -> list[int]:
    """``d_ff`` of every FFN site (the down projection's input width), where it can be told."""
    widths = []
    for _, mod, _ in matches(model, family.ffn if family is not None else None):
        d = getattr(mod, "in_features", None)  # nn.Linear
        if not isinstance(d, int):
            d = getattr(mod, "nx", None)  # transformers Conv1D (GPT-2)
        if not isinstance(d, int):
            d = getattr(getattr(model, "config", None), "intermediate_size", None)
        if isinstance(d, int) and d > 0:
            widths.append(d)
    return widths


def choose_ffn_rows(model: nn.Module, family: Family | None, ffn: bool, ffn_rows: int | str,
                     budget: float | None, row_step: int) -> tuple[int, float | None]:
    """``(k, FLOP share of full-rate FFN streaming)``: see ``Probe(ffn_rows=)`` and ``budget.py``."""
    if not (ffn_rows in ("auto", "all") or (isinstance(ffn_rows, int) and not isinstance(ffn_rows, bool)
                                             and ffn_rows >= 1)):
        raise ValueError(f"ffn_rows: expected 'auto', 'all' or an int >= 1, got {ffn_rows!r}")
    if not ffn:
        return 1, None
    widths, params = ffn_widths(model, family), matmul_parameters(model)
    share = ffn_flop_share(widths, params) if widths and params > 0 else None
    if ffn_rows == "all":
        return 1, share
    if ffn_rows != "auto":
        return ffn_rows, share
    if share is None:  # cannot size it: stream every token
        return 1, None
    target = DEFAULT_FFN_SHARE if budget is None else budget
    return auto_ffn_rows(share, target, row_step), share


class OverheadBudget:
    """Measured capture/emission costs and the intervals that keep them under budget (module doc)."""

    def __init__(self, budget: float | None, base_every: int, base_emit_every: int = 1,
                 smoothing: float = 0.5):
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not 0 < budget < 1):
            raise ValueError(f"budget: expected a fraction in (0, 1) or None, got {budget!r}")
        for name, v in (("every", base_every), ("emit_every", base_emit_every)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: expected a value in (0, 1], got {smoothing!r}")
        self.budget, self.base_every, self.base_emit_every = budget, base_every, base_emit_every
        self.smoothing = smoothing
        self.adapt_emission = True  # False where emissions must stay in lockstep across ranks
        self.every, self.emit_every = base_every, base_emit_every
        self.capture_cost: float | None = None  # EMA of capture work / base time, captured steps
        self.emit_cost: float | None = None     # EMA of emission work / base time, emitting steps
        self.last_fraction: float | None = None
        self.work_s = self.base_s = 0.0         # totals over the accounted steps
        self.last_emit = 0                      # step count of the last emission
        self.untimed = False  # captures ran inside a compiled graph: costs come from step times
        self._step_times: dict[bool, deque[float]] = {True: deque(maxlen=UNTIMED_WINDOW),
                                                      False: deque(maxlen=UNTIMED_WINDOW)}

    # ------------------------------------------------------------------ schedule
    def capture_due(self, steps_seen: int) -> bool:
        if self.untimed and self.budget is not None and self.every == 1:
            return steps_seen % CALIBRATE_EVERY != CALIBRATE_EVERY - 1  # an idle step to compare with
        return steps_seen % self.every == 0

    def emit_due(self, steps_seen: int) -> bool:
        return steps_seen % self.base_emit_every == 0 and steps_seen - self.last_emit >= self.emit_every

    def emitted(self, steps_seen: int) -> None:
        self.last_emit = steps_seen

    # --------------------------------------------------------------- accounting
    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def _untimed_capture_s(self, step_s: float, captured: bool) -> float | None:
        """Capture seconds of a step whose captures ran in a graph (module docstring), or None
        while the cost is unknown."""
        self.untimed = True
        self._step_times[captured].append(step_s)
        if not captured:
            return 0.0
        if not self._step_times[False]:
            return None
        ratio = statistics.median(self._step_times[True]) / statistics.median(self._step_times[False])
        return step_s * max(0.0, 1 - 1 / ratio)  # the share of this step above an idle one

    def observe(self, capture_s: float | None, emit_s: float, step_s: float, captured: bool,
                emitted: bool = False) -> int:
        """Account one finished step (wall time ``step_s``, of which ``capture_s + emit_s`` was
        probe work; ``capture_s=None``: its captures ran inside a compiled graph, untimed);
        returns the capture interval to use from now on."""
        if capture_s is None and step_s - emit_s > 0:
            capture_s = self._untimed_capture_s(step_s - emit_s, captured)
        known = capture_s is not None
        capture_s = capture_s or 0.0
        base = step_s - capture_s - emit_s
        if step_s <= 0 or base <= 0:
            return self.every
        self.last_fraction = (capture_s + emit_s) / base if known else None
        self.work_s += capture_s + emit_s
        self.base_s += base
        if captured and known:
            self.capture_cost = self._ema(self.capture_cost, capture_s / base)
        if emitted:
            self.emit_cost = self._ema(self.emit_cost, emit_s / base)
        self._plan()
        return self.every

    def _plan(self) -> None:
        b, every, emit = self.budget, self.base_every, self.base_emit_every
        c, e = self.capture_cost or 0.0, self.emit_cost or 0.0
        ce, ee = c / every, e / emit
        if b is not None and ce + ee > b:
            cap_share = emit_share = None
            if not self.adapt_emission or ee <= b / 2:
                cap_share = max(b - ee, b / 2)
            elif ce <= b / 2:
                emit_share = b - ce
            else:
                cap_share = emit_share = b / 2
            if cap_share is not None:
                every = max(every, math.ceil(c / cap_share - 1e-9))
            if emit_share is not None:
                emit *= max(1, math.ceil(e / (emit_share * emit) - 1e-9))
        self.every, self.emit_every = every, emit

    # ------------------------------------------------------------------ reports
    @property
    def capture_fraction(self) -> float | None:
        """Expected capture overhead per step at the current capture interval."""
        return None if self.capture_cost is None else self.capture_cost / self.every

    @property
    def emit_fraction(self) -> float | None:
        """Expected emission overhead per step at the current emission interval."""
        return None if self.emit_cost is None else self.emit_cost / self.emit_every

    @property
    def average_fraction(self) -> float | None:
        """Expected overhead per step (probe work / time without it) at the current intervals."""
        if self.capture_cost is None and self.emit_cost is None:
            return None
        return (self.capture_fraction or 0.0) + (self.emit_fraction or 0.0)

    @property
    def measured_fraction(self) -> float | None:
        """All probe work so far over all base (probe-free) step time so far."""
        return None if self.base_s <= 0 else self.work_s / self.base_s

    def state_dict(self) -> dict:
        return {"every": self.every, "emit_every": self.emit_every, "capture_cost": self.capture_cost,
                "emit_cost": self.emit_cost, "last_fraction": self.last_fraction,
                "work_s": self.work_s, "base_s": self.base_s, "last_emit": self.last_emit}

    def load_state_dict(self, sd: dict) -> None:
        self.every = int(sd["every"])
        self.emit_every = int(sd.get("emit_every", self.base_emit_every))
        self.capture_cost = sd.get("capture_cost", sd.get("active_cost"))
        self.emit_cost = sd.get("emit_cost")
        self.last_fraction = sd.get("last_fraction")
        self.work_s, self.base_s = float(sd.get("work_s", 0.0)), float(sd.get("base_s", 0.0))
        self.last_emit = int(sd.get("last_emit", 0))


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
