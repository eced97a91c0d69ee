"""Llama-style training step with and without a streaming fastspec.Probe (keys + FFN), eager
and through ``torch.compile(fullgraph=True)``.

Cases: ``fastspec.bench.suites.cases("train_step", ...)`` and ``cases("train_step_compiled", ...)``;
parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("train_step")
def test_train_step(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)


@pytest.mark.suite("train_step_compiled")
def test_train_step_compiled(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
