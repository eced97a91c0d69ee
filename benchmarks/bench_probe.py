"""Issue 13: Probe.measure and keys-only streaming overhead, the key-rank computation vs svdvals."""
import pytest

from fastspec.bench.pytest_cases import params, run_benchmark


@pytest.mark.parametrize("case, side", params("probe"))
def test_probe(benchmark, case, side):
    run_benchmark(benchmark, case, side)
