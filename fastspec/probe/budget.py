"""The probe's overhead budget: what its work costs against the training it rides on, reported
honestly, and the capture/emission intervals that keep it under a budget.

**What is counted.** Two kinds of work per training step (the interval between two
:meth:`Probe.step` calls, less the time the probe spent detached in between: ``timer.StepClock``): *capture* work (every streaming capture in a hook: masking, sampling,
the covariance update) and *emission* work (computing the metrics, packing the records and
resetting the accumulators inside :meth:`Probe.step`), timed without syncing the device and
handed here step by step once a step's timings are complete (``timer.py``). Not counted: the
dispatch of the hooks themselves (a few µs of Python per hooked module call, also on idle steps)
and the ``measure()`` eval protocol (it is not streaming).

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
the budget. Tensor-parallel ranks that gather FFN rows (``layout.py``) capture together, so
there the capture interval is not adapted either (``Probe.overhead()`` still reports the cost).

**Pauses it is not told about.** A step's time runs from one :meth:`Probe.step` to the next, so
whatever else happens in between counts as training: a checkpoint save, an evaluation loop (its
forwards are left out already, ``timer.py``, but not its data loading and metrics), a data-loader
stall, a second model trained in the same loop. Counted as training it would inflate the base
time, make the probe look cheaper than it is, and let the budget spend more. The rule: a step
whose probe-free time exceeds ``PAUSE_FACTOR`` (3) times the median of the last
``PAUSE_WINDOW`` (15) steps' (once ``PAUSE_MIN_STEPS`` (5) have been seen) is counted at that
median, a typical step's duration; the excess is set aside as a pause, and
:meth:`Probe.overhead` reports how many steps had one (``"paused_steps"``) and how many seconds
were set aside (``"paused_s"``). The window keeps every step, paused or not, so a lasting change
of step time (longer sequences, a new phase) is accepted once it fills half the window, while a
pause every few steps cannot move the median. A pause shorter than twice a step is not caught:
that is within the spread of step times that a median of recent steps cannot tell from training.

FFN token sampling is sized from a FLOP model before any step runs, not timed: ``ffn_sampling.py``.
"""
from __future__ import annotations

import importlib
import math
import statistics
import warnings
from collections import deque

from .. import _args

#: Captures inside a compiled graph: step times kept per kind (captured / idle), and, with a
#: budget and ``every=1``, one step in ``CALIBRATE_EVERY`` left idle to compare with.
UNTIMED_WINDOW = 9
CALIBRATE_EVERY = 16
#: The pause rule (module docstring): a step longer than ``PAUSE_FACTOR`` times the median of the
#: last ``PAUSE_WINDOW`` steps' probe-free times, once ``PAUSE_MIN_STEPS`` were seen, is counted
#: at that median.
PAUSE_FACTOR = 3.0
PAUSE_WINDOW = 15
PAUSE_MIN_STEPS = 5


class OverheadBudget:
    """Measured capture/emission costs and the intervals that keep them under budget (module doc)."""

    def __init__(self, budget: float | None, base_every: int, base_emit_every: int = 1,
                 smoothing: float = 0.5):
        budget = _args.real("budget", budget, "a fraction in (0, 1) or None", lambda b: 0 < b < 1, optional=True)
        base_every = _args.integer("every", base_every, minimum=1)
        base_emit_every = _args.integer("emit_every", base_emit_every, minimum=1)
        smoothing = _args.real("smoothing", smoothing, "a number in (0, 1]", lambda s: 0 < s <= 1)
        self.budget, self.base_every, self.base_emit_every = budget, base_every, base_emit_every
        self.smoothing = smoothing
        self.adapt_emission = True  # False where emissions must stay in lockstep across ranks
        self.adapt_capture = True   # False where captures must (tensor-parallel ranks gathering FFN rows)
        self.every, self.emit_every = base_every, base_emit_every
        self.capture_cost: float | None = None  # EMA of capture work / base time, captured steps
        self.emit_cost: float | None = None     # EMA of emission work / base time, emitting steps
        self.last_fraction: float | None = None
        self.work_s = self.base_s = 0.0         # totals over the accounted steps
        self.last_emit = 0                      # step count of the last emission
        self.untimed = False  # captures ran inside a compiled graph: costs come from step times
        self._step_times: dict[bool, deque[float]] = {True: deque(maxlen=UNTIMED_WINDOW),
                                                      False: deque(maxlen=UNTIMED_WINDOW)}
        self._recent: deque[float] = deque(maxlen=PAUSE_WINDOW)  # probe-free seconds of recent steps
        self.paused_steps = 0                   # steps counted at a typical duration (pause rule)
        self.paused_s = 0.0                     # and the seconds set aside from them

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
        step_s = self._set_aside_pause(step_s, capture_s or 0.0, emit_s)
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

    def _set_aside_pause(self, step_s: float, capture_s: float, emit_s: float) -> float:
        """``step_s`` with a pause set aside (the pause rule of the module docstring): a step
        whose probe-free time ``own`` exceeds ``PAUSE_FACTOR`` × the recent median is counted at
        that median, plus its probe work."""
        own = step_s - capture_s - emit_s
        if own <= 0:
            return step_s
        typical = statistics.median(self._recent) if len(self._recent) >= PAUSE_MIN_STEPS else None
        self._recent.append(own)  # paused or not: a lasting change of step time moves the median
        if typical is None or own <= PAUSE_FACTOR * typical:
            return step_s
        self.paused_steps += 1
        self.paused_s += own - typical
        return typical + capture_s + emit_s

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
            if cap_share is not None and self.adapt_capture:
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
                "work_s": self.work_s, "base_s": self.base_s, "last_emit": self.last_emit,
                "paused_steps": self.paused_steps, "paused_s": self.paused_s, "recent": list(self._recent)}

    def load_state_dict(self, sd: dict) -> None:
        self.every = int(sd["every"])
        self.emit_every = int(sd.get("emit_every", self.base_emit_every))
        self.capture_cost = sd.get("capture_cost", sd.get("active_cost"))
        self.emit_cost = sd.get("emit_cost")
        self.last_fraction = sd.get("last_fraction")
        self.work_s, self.base_s = float(sd.get("work_s", 0.0)), float(sd.get("base_s", 0.0))
        self.last_emit = int(sd.get("last_emit", 0))
        self.paused_steps, self.paused_s = int(sd.get("paused_steps", 0)), float(sd.get("paused_s", 0.0))
        self._recent.clear()
        self._recent.extend(float(t) for t in sd.get("recent", ()))


# names that lived here before the timer and the FFN FLOP model got modules of their own
_MOVED = {name: "timer" for name in ("KINDS", "WorkTimer")} | {
    name: "ffn_sampling" for name in ("GRAM_FLOPS", "STEP_FLOPS", "DEFAULT_FFN_SHARE", "matmul_parameters",
                                      "ffn_flop_share", "auto_ffn_rows", "ffn_widths", "choose_ffn_rows")}


def __getattr__(name: str):
    if name in _MOVED:
        module = f"{__package__}.{_MOVED[name]}"
        warnings.warn(f"{__name__}.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
