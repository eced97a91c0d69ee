"""Per-head bf16 key and FFN activation covariance accumulation: fastspec vs the plain-torch path."""
import pytest

from fastspec.bench.pytest_cases import params, run_benchmark


@pytest.mark.parametrize("case, side", params("covariance"))
def test_covariance(benchmark, case, side):
    run_benchmark(benchmark, case, side)
