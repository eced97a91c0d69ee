"""Run benchmark cases and collect one JSON-ready row per (case, baseline).

Row fields: ``suite, size, variant, baseline`` identify it; ``fastspec_s``/``baseline_s`` are
median seconds per call; ``speedup = baseline_s / fastspec_s``; ``rate_unit``,
``fastspec_rate``/``baseline_rate`` the throughput (GB/s, µs/matrix); ``error_kind``,
``fastspec_error``/``baseline_error`` the accuracy side (plus case-specific fields such as
``pr_diff_vs_baseline``); ``overhead_pct`` for ``train_step``; ``torch_threads`` in the document.
A case that cannot run here gives one row with ``skipped`` (the reason); one that raised gives
``error`` (the exception) so one broken case does not hide the others.
"""
from __future__ import annotations

import contextlib
import gc
import math
from datetime import datetime, timezone
from typing import Callable

import torch

from .cases import Case
from .timing import measure_interleaved

SCHEMA = 1


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they become None (and a NaN error is reported, not hidden)."""
    return None if x is None or not math.isfinite(x) else float(x)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_case(case: Case, device: torch.device, *, warmup: int = 2, repeats: int = 5) -> list[dict]:
    """Time ``case`` against each of its baselines and check its accuracy; rows as above."""
    head = {"suite": case.suite, "size": case.size, "variant": case.variant}
    if case.skip:
        return [{**head, "skipped": case.skip}]
    rows = []
    try:
        inputs = case.setup()
        errors = case.check(inputs)
        names = list(case.baselines)
        fast, *slows = measure_interleaved(
            [lambda: case.fastspec(inputs)] + [lambda b=b: b(inputs) for b in case.baselines.values()],
            contexts=[lambda: case.fastspec_context(inputs)] + [contextlib.nullcontext] * len(names),
            device=device, warmup=warmup, repeats=repeats)
        for name, slow in zip(names, slows):
            row = {**head, "baseline": name, "fastspec_s": fast.median, "baseline_s": slow.median,
                   "speedup": slow.median / fast.median, "repeats": repeats,
                   "error_kind": case.error_kind,
                   "fastspec_error": _finite(errors.get("fastspec_error")),
                   "baseline_error": _finite(errors.get(f"{name}_error", errors.get("baseline_error")))}
            row.update({k: _finite(v) for k, v in errors.items()
                        if k not in ("fastspec_error", "baseline_error") and not k.endswith("_error")})
            if errors.get("fastspec_error") is not None and not math.isfinite(errors["fastspec_error"]):
                row["error"] = f"fastspec {case.error_kind} is {errors['fastspec_error']}"
            if case.rate is not None:
                unit, fn = case.rate
                row.update(rate_unit=unit, fastspec_rate=fn(fast.median), baseline_rate=fn(slow.median))
            if case.suite == "train_step":
                row["overhead_pct"] = (fast.median / slow.median - 1) * 100
            rows.append(row)
        for what, why in case.notes.items():
            rows.append({**head, "baseline": what, "skipped": why})
    except Exception as e:  # noqa: BLE001 - reported per case; the CLI exits non-zero
        rows.append({**head, "error": f"{type(e).__name__}: {e}"})
    finally:
        inputs = None
        _free(device)
    return rows


def run_cases(cases: list[Case], device: torch.device, *, warmup: int = 2, repeats: int = 5,
              progress: Callable[[Case], None] | None = None) -> list[dict]:
    rows = []
    for case in cases:
        if progress is not None:
            progress(case)
        rows.extend(run_case(case, device, warmup=warmup, repeats=repeats))
    return rows


def report(kind: str, tier: str, rows: list[dict]) -> dict:
    """The JSON document written by ``--json``: schema, kind, date, environment, results."""
    from ..cli_info import environment

    return {"schema": SCHEMA, "kind": kind, "tier": tier, "torch_threads": torch.get_num_threads(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "environment": environment(), "results": rows}
