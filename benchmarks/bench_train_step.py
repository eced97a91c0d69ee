"""Llama-style training step with and without a streaming fastspec.Probe (keys + FFN).

Cases: ``fastspec.bench.cases("train_step", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("train_step")
def test_train_step(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
