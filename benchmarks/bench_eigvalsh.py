"""fastspec.eigvalsh vs torch.linalg.eigvalsh (and CuPy on CUDA) on batches of fp32 Gram matrices."""
import pytest

from fastspec.bench.pytest_cases import params, run_benchmark


@pytest.mark.parametrize("case, side", params("eigvalsh"))
def test_eigvalsh(benchmark, case, side):
    run_benchmark(benchmark, case, side)
