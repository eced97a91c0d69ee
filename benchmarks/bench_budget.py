"""The overhead a budgeted probe reports vs what it really costs (a probe-free twin and the same
model detached, interleaved step by step; and in blocks of 15 with the probe left attached while the
twin trains), at budgets of 2% and 5%; and a Hugging Face Trainer with the streaming callback
(budget 5%, evaluations and checkpoint saves every 10 steps) against a probe-free twin trainer, the
two trainers taking turns step by step.

Cases: ``fastspec.bench.suites.cases("budget", ...)``; parametrization and body: ``conftest.py``.

Untimed (``--benchmark-disable``, what the test tiers and CI run) the body checks the suite's code,
not the overhead: at every size tier the paired run gets the ``quick`` tier's warm-up and window
(the ``cpu`` tier's four-minute window, extended to the next emission, took ~10 minutes of a
full-tier run on 2 CPU cores for the two cases). Timed runs, and ``fastspec bench``, keep each tier's own.
"""
import pytest

from fastspec.bench.suites import budget


@pytest.mark.suite("budget")
def test_budget(benchmark, case, side, run_benchmark, monkeypatch):
    short = budget.WINDOW_S["quick"]
    if benchmark.disabled:
        for tier in budget.WINDOW_S:
            monkeypatch.setitem(budget.WINDOW_S, tier, short)
            monkeypatch.setitem(budget.WARMUP_ROUNDS, tier, budget.WARMUP_ROUNDS["quick"])
    run_benchmark(benchmark, case, side)
    if benchmark.disabled and side == "fastspec":
        row = benchmark.extra_info
        # the window's steps fit the short window, at most as long again to an emission, and the
        # round that ended it (an emitting one: a few mean rounds at most; in the attached-blocks
        # rows a round is a block of steps of each kind); the cpu tier's would be 240 s. The HF
        # Trainer row has no same-model steps, and its window's wall time holds its saves too.
        per_round = row["probed_mean_s"] + row["twin_mean_s"] + (row["same_model_mean_s"] or 0.0)
        assert row["rounds"] * per_round <= 2 * short + (10 + row["block"]) * per_round, row
