"""The overhead a budgeted probe reports vs what it really costs (a probe-free twin and the same
model detached, interleaved step by step), at budgets of 2% and 5%.

Cases: ``fastspec.bench.suites.cases("budget", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("budget")
def test_budget(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
