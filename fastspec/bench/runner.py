"""Run benchmark cases and collect one JSON-ready row per (case, baseline).

Row fields: ``suite, size, variant, baseline`` identify it; ``fastspec_s``/``baseline_s`` are
median seconds per call over ``repeats`` timed calls, ``fastspec_min_s``/``fastspec_max_s`` and
``baseline_min_s``/``baseline_max_s`` the fastest and slowest of them (the spread
:func:`fastspec.bench.table.time_ratio_band` judges noise by; a sliced baseline's scaled like its
median); ``speedup = baseline_s / fastspec_s``; ``rate_unit``, ``fastspec_rate``/``baseline_rate``
the throughput (GB/s, µs/matrix); ``error_kind``, ``fastspec_error``/``baseline_error`` the
accuracy side (plus case-specific fields such as ``pr_diff_vs_baseline``); ``claim`` the bound the
case's :class:`~fastspec.bench.case.Claim` sets on fastspec's error and ``claim_held`` whether the
errors hold it (when not, ``claim_violation`` says how, and the CLI exits 1); ``overhead_pct`` for
cases that time a probe on top of their baseline (``Case.overhead``: ``train_step``,
``train_step_compiled``, the ``probe`` suite's measure and train-step cases); ``clock`` and
``baseline_clock`` the clock each side was timed on (``wall``, ``events`` or ``device``, see
:mod:`fastspec.bench.timing`; ``Case.device_time`` asks for ``device``), and on the ``device``
clock ``fastspec_host_s``/``baseline_host_s`` the host's median time to queue one call (a
sliced baseline's scaled); ``torch_threads`` in the document.
A case that cannot run here gives one row with ``skipped`` (the reason); one that raised gives
``error`` (the exception) so one broken case does not hide the others. A baseline timed on a
slice of the input (see ``Case.baseline_scale``) has its time scaled to the full input and
``baseline_scale`` in its row. Cases cut by a time cap get ``skipped`` rows that say so.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

import torch

from .case import Case, free_memory
from .timing import measure_interleaved

SCHEMA = 1


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they become None (and a NaN error is reported, not hidden)."""
    return None if x is None or not math.isfinite(x) else float(x)


class TimeCap(BaseException):
    """Raised (from a SIGTERM handler, or by the caller) when a run's time cap is reached.

    A BaseException so that :func:`run_case`'s per-case ``except Exception`` does not report it
    as the case's error: :func:`run_cases` turns it into ``skipped`` rows and returns."""


STOP = threading.Event()
"""Set by the CLI's SIGTERM handler next to raising :class:`TimeCap`: Python drops an exception
raised while it runs a weakref callback or a destructor ("Exception ignored in ..."), and then
this flag still stops the run before its next case."""


def stop_requested(deadline: float | None) -> bool:
    """Whether a run must start nothing new: SIGTERM came (:data:`STOP`) or ``deadline`` passed."""
    return STOP.is_set() or (deadline is not None and time.monotonic() > deadline)


CAP_REACHED = "time cap reached before this case started"
CAP_DURING = "time cap reached while this case ran"


def run_case(case: Case, device: torch.device, *, warmup: int = 2, repeats: int = 5,
             deadline: float | None = None) -> list[dict]:
    """Time ``case`` against each of its baselines and check its accuracy; rows as above.

    ``deadline`` (``time.monotonic()``): past it, the timing loop stops after its first timed
    round; each row's ``repeats`` says how many rounds were timed.
    """
    head = _head(case)
    if case.skip:
        return [{**head, "skipped": case.skip}]
    rows = []
    inputs = None
    try:
        inputs = case.inputs()
        errors = case.check(inputs)
        violation = case.claim.violated(errors)  # the rule benchmarks/conftest.py asserts
        names = list(case.baselines)
        fast, *slows = measure_interleaved(
            [lambda: case.fastspec(inputs)] + [lambda b=b: b(inputs) for b in case.baselines.values()],
            contexts=[lambda: case.fastspec_context(inputs)] + [contextlib.nullcontext] * len(names),
            device=device, warmup=warmup, repeats=repeats, deadline=deadline,
            device_only=case.device_time)
        for name, slow in zip(names, slows):
            scale = case.baseline_scale.get(name, 1.0)
            base_s = slow.median * scale
            row = {**head, "baseline": name, "fastspec_s": fast.median, "baseline_s": base_s,
                   "speedup": base_s / fast.median, "repeats": fast.repeats,
                   "clock": fast.clock, "baseline_clock": slow.clock,
                   "fastspec_min_s": fast.min, "fastspec_max_s": fast.max,
                   "baseline_min_s": slow.min * scale, "baseline_max_s": slow.max * scale,
                   "error_kind": case.error_kind,
                   "fastspec_error": _finite(errors.get("fastspec_error")),
                   "baseline_error": _finite(errors.get(f"{name}_error", errors.get("baseline_error"))),
                   "claim": case.claim.text, "claim_held": violation is None}
            if violation is not None:
                row["claim_violation"] = violation
            if scale != 1.0:
                row["baseline_scale"] = scale
            if fast.host is not None:
                row["fastspec_host_s"] = fast.host
            if slow.host is not None:
                row["baseline_host_s"] = slow.host * scale
            row.update({k: _finite(v) for k, v in errors.items()
                        if k not in ("fastspec_error", "baseline_error") and not k.endswith("_error")})
            if case.rate is not None:
                unit, fn = case.rate
                row.update(rate_unit=unit, fastspec_rate=fn(fast.median), baseline_rate=fn(base_s))
            if case.overhead:
                row["overhead_pct"] = (fast.median / base_s - 1) * 100
            if case.row_extra is not None:
                row.update(case.row_extra(row))
            rows.append(row)
        for what, why in case.notes.items():
            rows.append({**head, "baseline": what, "skipped": why})
    except Exception as e:  # noqa: BLE001 - reported per case; the CLI exits non-zero
        rows.append({**head, "error": f"{type(e).__name__}: {e}"})
    finally:
        try:
            case.close(inputs)
        except Exception as e:  # noqa: BLE001
            rows.append({**head, "error": f"teardown: {type(e).__name__}: {e}"})
        inputs = None
        free_memory(device)
    return rows


def run_cases(cases: list[Case], device: torch.device, *, warmup: int = 2, repeats: int = 5,
              progress: Callable[[Case], None] | None = None, deadline: float | None = None,
              on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run ``cases`` in order; ``on_rows(rows so far)`` after each (to write partial results).

    Time cap: as :func:`run_capped` (a case is not started once ``deadline`` has passed or
    SIGTERM came; a :class:`TimeCap` during a case, its progress line or ``on_rows`` ends the
    run); every case not measured gets a ``skipped`` row naming the cap, and the rows are
    returned normally: a capped run is a partial result, not a failure.
    """
    def one(case: Case) -> list[dict]:
        if progress is not None:
            progress(case)
        return run_case(case, device, warmup=warmup, repeats=repeats, deadline=deadline)

    rows = run_capped(cases, one, _head, deadline=deadline, on_rows=on_rows)
    if capped(rows):
        free_memory(device)
    return rows


def run_capped(items: list, run_one: Callable[[Any], list[dict]], head: Callable[[Any], dict], *,
               deadline: float | None = None,
               on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """The rows of ``run_one(item)`` for each of ``items`` in order, under the time cap: no item
    starts once :func:`stop_requested`, and a :class:`TimeCap` raised while one runs (or in
    ``on_rows``) ends the loop. The item cut short gets ``{**head(item), "skipped": CAP_DURING}``,
    those never started ``CAP_REACHED``. An item that reports an error (a row with ``error``) once
    SIGTERM came (:data:`STOP`) is cut short too: an error raised while a run is being stopped is
    not a finished item's verdict, and is often the signal's own doing. The handler's TimeCap can
    surface as another library's exception: raised inside Python code that C code called back (a
    Triton ``constexpr``'s ``__index__`` under numpy's shape conversion, on Triton 3.6's
    interpreter), it came out as ``InterpreterError: TypeError("expected a sequence of integers or
    a single integer, got '(64)'")``, and the killed step reported that error and exited 1.
    ``on_rows(rows so far)`` after each item, and once more with the skipped rows when the cap cut
    the run. Shared by ``fastspec bench`` (cases) and ``fastspec compare`` (matrix families)."""
    rows: list[dict] = []
    done = 0  # items whose rows are in ``rows``
    try:
        for item in items:
            if stop_requested(deadline):
                break
            got = run_one(item)
            if STOP.is_set() and any("error" in r for r in got):
                raise TimeCap("SIGTERM")
            rows.extend(got)
            done += 1
            if on_rows is not None:
                on_rows(rows)
    except TimeCap:
        if done < len(items):
            rows.append({**head(items[done]), "skipped": CAP_DURING})
            done += 1
    rows.extend({**head(item), "skipped": CAP_REACHED} for item in items[done:])
    if on_rows is not None and capped(rows):
        on_rows(rows)
    return rows


def _head(case: Case) -> dict:
    return {"suite": case.suite, "size": case.size, "variant": case.variant}


def capped(rows: list[dict]) -> bool:
    """Whether some case of ``rows`` was cut by the time cap."""
    return any(r.get("skipped") in (CAP_REACHED, CAP_DURING) for r in rows)


def report(kind: str, tier: str, rows: list[dict]) -> dict:
    """The JSON document written by ``--json``: schema, kind, date, environment, results."""
    from ..sysinfo import environment

    return {"schema": SCHEMA, "kind": kind, "tier": tier, "torch_threads": torch.get_num_threads(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "environment": environment(), "results": rows}
