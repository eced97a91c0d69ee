"""Probe overhead near the floor: Probe.measure and keys-only streaming vs the work they ride on,
the key-rank computation vs svdvals.

Cases: ``fastspec.bench.suites.cases("probe", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("probe")
def test_probe(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
