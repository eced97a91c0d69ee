"""Per-head bf16 key and FFN activation covariance accumulation: fastspec vs the plain-torch path.

Cases: ``fastspec.bench.suites.cases("covariance", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("covariance")
def test_covariance(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
