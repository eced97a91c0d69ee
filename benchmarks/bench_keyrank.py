"""SPEC §5 key-rank protocol end to end: fastspec.Probe.measure vs hooks + svdvals per head."""
import pytest

from fastspec.bench.pytest_cases import params, run_benchmark


@pytest.mark.parametrize("case, side", params("keyrank"))
def test_keyrank(benchmark, case, side):
    run_benchmark(benchmark, case, side)
