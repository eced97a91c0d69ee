"""What every algorithm of the CUDA eigensolver promises, checked on each through the team
emulation (its own code, one rank per CUDA thread, csrc/eig_host.cpp): the contract of
``fastspec.eigvalsh`` beyond accuracy. Each algorithm's own file adds its accuracy battery, its
barrier-mutation check and its SASS bounds (tests/test_eig_host.py for block, test_eig_packed.py,
test_eig_regs.py, test_eig_split.py).

* a matrix with NaN/Inf in its lower triangle gives n NaNs, and its batch neighbours the bits
  they get alone;
* the zero matrix gives zeros, the identity ones;
* scaling A by 2^k scales the eigenvalues by exactly 2^k (the inputs are rescaled internally),
  far outside float32's range in float64;
* the strict upper triangle is never read;
* one team solves a batch in turn: early exits and reused shared memory (poisoned with NaN before
  the first matrix) leave the next matrix unaffected;
* no race: threads running freely and one at a time in either order give the same bits.

n = 45: a partial second warp of columns (and for regs/split, a second half of the team).
"""
from __future__ import annotations

import _eig_team
import pytest
import torch
from _eig_team import CONCURRENT, FORWARD, REVERSE, one_torch_thread  # noqa: F401 - an autouse fixture

from fastspec.eig.matrices import make_batch
from fastspec.eig.variants import ALGORITHMS

pytestmark = _eig_team.NO_EXT
N = 45


def _cases() -> list:
    return [pytest.param(name, dtype, id=f"{name}-{dtype}") for name, a in ALGORITHMS.items() for dtype in a.dtypes]


def solve(A: torch.Tensor, algo: str, schedule: int = CONCURRENT) -> torch.Tensor:
    return _eig_team.team(A, algo, schedule)[0]


def batch(family: str, n: int, count: int, dtype: str) -> torch.Tensor:
    return torch.from_numpy(make_batch(family, n, count)).to(getattr(torch, dtype))


@pytest.mark.parametrize("algo, dtype", _cases())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_matrix_gives_nan_and_spares_neighbours(algo, dtype, bad):
    A = batch("indefinite", N, 4, dtype)
    solo = solve(A, algo)
    A[1, 40, 3] = bad  # lower triangle, in the second warp's rows
    A[2, N - 1, N - 1] = bad
    out = solve(A, algo)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.equal(out[0], solo[0]) and torch.equal(out[3], solo[3])


@pytest.mark.parametrize("algo, dtype", _cases())
def test_zero_and_identity(algo, dtype):
    dt = getattr(torch, dtype)
    for n in (1, 5, N):
        assert torch.equal(solve(torch.zeros(2, n, n, dtype=dt), algo), torch.zeros(2, n, dtype=dt))
        ones = solve(torch.eye(n, dtype=dt).expand(2, n, n), algo)
        assert (ones - 1).abs().max() <= 2 * torch.finfo(dt).eps, n


@pytest.mark.parametrize("algo, dtype", _cases())
def test_power_of_two_scaling_is_exact(algo, dtype):
    A = batch("indefinite", N, 2, dtype)
    base = solve(A, algo, FORWARD)
    for k in (-100, -30, 7, 100) + ((-1000, 600) if dtype == "float64" else ()):
        assert torch.equal(solve(A * 2.0**k, algo, FORWARD), base * 2.0**k), k


@pytest.mark.parametrize("algo, dtype", _cases())
def test_strict_upper_triangle_is_never_read(algo, dtype):
    A = batch("indefinite", N, 2, dtype)
    garbage = torch.tril(A) + torch.triu(torch.full_like(A, float("nan")), diagonal=1)
    assert torch.equal(solve(garbage, algo, FORWARD), solve(A, algo, FORWARD))


@pytest.mark.parametrize("algo, dtype", _cases())
def test_one_team_solves_a_batch_in_turn(algo, dtype):
    A = batch("gram-activations", N, 6, dtype)
    A[1, 35, 3] = float("nan")
    A[3] = 0
    for schedule in (CONCURRENT, REVERSE):
        out = solve(A, algo, schedule)
        assert torch.isnan(out[1]).all() and torch.equal(out[3], torch.zeros_like(out[3]))
        for i in (0, 2, 4, 5):
            assert torch.equal(out[i], solve(A[i:i + 1], algo, schedule)[0]), (schedule, i)


@pytest.mark.parametrize("algo, dtype", _cases())
def test_no_race_the_schedule_changes_no_bit(algo, dtype):
    A = batch("four-clusters", N, 2, dtype)
    free = solve(A, algo)
    assert torch.equal(solve(A, algo, FORWARD), free) and torch.equal(solve(A, algo, REVERSE), free)
