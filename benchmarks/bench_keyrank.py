"""The key-rank protocol (docs/protocols.md) end to end: fastspec.Probe.measure vs hooks +
svdvals per head.

Cases: ``fastspec.bench.suites.cases("keyrank", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("keyrank")
def test_keyrank(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
