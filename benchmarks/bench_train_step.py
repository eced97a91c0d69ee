"""Llama-style training step with and without a streaming fastspec.Probe (keys + FFN)."""
import pytest

from fastspec.bench.pytest_cases import params, run_benchmark


@pytest.mark.parametrize("case, side", params("train_step"))
def test_train_step(benchmark, case, side):
    run_benchmark(benchmark, case, side)
