"""fastspec.eigvalsh vs torch.linalg.eigvalsh and the external batched solvers (cuSOLVER, JAX,
CuPy, cuSolverDx heev, where available) on batches of Gram matrices.

Cases: ``fastspec.bench.suites.cases("eigvalsh", ...)``; parametrization and body: ``conftest.py``.
"""
import pytest


@pytest.mark.suite("eigvalsh")
def test_eigvalsh(benchmark, case, side, run_benchmark):
    run_benchmark(benchmark, case, side)
