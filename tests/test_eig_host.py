"""Host twin of the CUDA eigensolver (csrc/eig_core.h, ``solver="host"``) against fp64 LAPACK.

The host twin runs the kernel's exact per-matrix numerics serially, so this file is CPU CI's
check of the algorithm itself. Accuracy criterion, per batch:

    max |lambda - lambda_ref| <= 2 * (torch.linalg.eigvalsh fp32 error on the same batch) + floor,
    floor = 8 * eps_fp32 * ||A||_2.

lambda_ref: numpy (LAPACK) float64 eigenvalues of the fp32 input itself. The floor exists because
LAPACK is exact on some inputs (identity, 1x1) or lucky on a small batch, where 2 x 0 leaves no room
for the last-bit rounding of any backward-stable fp32 method; 8 eps ||A|| is far below the classical
O(n eps ||A||) bound of Householder tridiagonalization for every n >= 8 tested here.
"""
from __future__ import annotations

import _eig_team
import pytest
import torch
from _eig_team import one_torch_thread  # noqa: F401 - an autouse fixture: one torch thread

import fastspec
from fastspec.eig.matrices import FAMILIES, make_batch

EPS32, EPS64 = _eig_team.EPS32, _eig_team.EPS64
SIZES = [2, 8, 17, 32, 64, 100, 128, 256]

pytestmark = _eig_team.NO_EXT


def host(A: torch.Tensor) -> torch.Tensor:
    return fastspec.eigvalsh(A, solver="host")


reference = _eig_team.reference  # numpy (LAPACK) float64 eigenvalues of the input itself
assert_within_torch_error = _eig_team.assert_within_torch_error  # the criterion of the module docstring


def test_extension_is_built():
    # CI installs with a compiler present: a silently missing extension must fail, not skip
    assert fastspec.solvers()["host"]["available"], fastspec.solvers()["host"]["reason"]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_battery(family, n):
    batch = 4 if n <= 128 else 2
    A = torch.from_numpy(make_batch(family, n, batch)).float()
    ours = host(A)
    assert ours.shape == (batch, n) and ours.dtype == torch.float32
    assert torch.isfinite(ours).all()
    assert (ours.diff(dim=-1) >= 0).all(), "not ascending"
    assert_within_torch_error(A, ours)


def test_fp32_battery_more_seeds_at_n128():
    # the aimed-for size: a larger batch, so the torch error is not a lucky small-sample minimum
    for family in ("indefinite", "gram-activations", "graded-1e-8", "one-cluster"):
        A = torch.from_numpy(make_batch(family, 128, 12, seed=1)).float()
        assert_within_torch_error(A, host(A))


@pytest.mark.parametrize("n", [8, 64, 128])
@pytest.mark.parametrize("family", ["spd", "indefinite", "gram-activations", "graded-1e-8", "repeated", "spd-1e30"])
def test_fp64(family, n):
    # LAPACK fp64 is the best reference at hand, so no "2 x torch" here: both are backward stable,
    # and n * eps64 * ||A|| (the classical bound) still fails loudly if anything ran in fp32
    A = torch.from_numpy(make_batch(family, n, 4))
    ours = host(A)
    assert ours.dtype == torch.float64
    ref = reference(A)
    assert (ours - ref).abs().max() <= n * EPS64 * ref.abs().max()


def test_zero_and_identity_exact():
    for n in (1, 5, 64):
        assert torch.equal(host(torch.zeros(2, n, n)), torch.zeros(2, n))
        torch.testing.assert_close(host(torch.eye(n).expand(3, n, n)), torch.ones(3, n), atol=2 * EPS32, rtol=0)


def test_power_of_two_scaling_is_exact():
    # inputs are rescaled by 2^-e internally: scaling A by 2^k must scale the result exactly
    A = torch.from_numpy(make_batch("indefinite", 50, 3)).float()
    base = host(A)
    for k in (-100, -30, 7, 100):
        assert torch.equal(host(A * 2.0**k), base * 2.0**k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_matrix_gives_nan_and_spares_neighbours(bad):
    A = torch.from_numpy(make_batch("spd", 33, 4)).float()
    solo = host(A)
    A[1, 20, 3] = bad  # lower triangle: read
    A[2, 32, 32] = bad
    out = host(A)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.equal(out[0], solo[0]) and torch.equal(out[3], solo[3])


def test_strict_upper_triangle_is_never_read():
    A = torch.from_numpy(make_batch("indefinite", 40, 3)).float()
    lower = torch.tril(A)
    garbage = lower + torch.triu(torch.full_like(A, float("nan")), diagonal=1)
    assert torch.equal(host(garbage), host(A))
    assert_within_torch_error(A, host(garbage))


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda A: A.mT, id="transposed"),
        pytest.param(lambda A: A[:, ::2, ::2], id="strided-rows-and-cols"),
        pytest.param(lambda A: A[::2], id="strided-batch"),
        pytest.param(lambda A: A[:1].expand(3, -1, -1), id="stride0-batch"),
        pytest.param(lambda A: A.reshape(2, 2, *A.shape[1:]), id="batch-dims-2x2"),
        pytest.param(lambda A: A.permute(1, 2, 0).contiguous().permute(2, 0, 1), id="batch-innermost"),
    ],
)
def test_strides_and_batch_dims(view):
    # strides are passed to the kernel as-is: the arithmetic must be identical to the contiguous copy
    A = view(torch.from_numpy(make_batch("indefinite", 38, 4)).float())
    out = host(A)
    assert out.shape == A.shape[:-1]
    assert torch.equal(out, host(A.contiguous()))


def test_empty_and_tiny_shapes():
    assert host(torch.zeros(0, 16, 16)).shape == (0, 16)
    assert host(torch.zeros(3, 0, 0)).shape == (3, 0)
    assert host(torch.zeros(2, 0, 7, 7)).shape == (2, 0, 7)
    x = torch.tensor([[[-3.5]], [[2.0]]])
    assert torch.equal(host(x), torch.tensor([[-3.5], [2.0]]))


def test_half_precision_inputs_are_solved_in_fp32():
    A = torch.from_numpy(make_batch("spd", 24, 2)).to(torch.bfloat16)
    out = host(A)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.linalg.eigvalsh(A.float()).to(torch.bfloat16))


# ------------------------------------------------- the kernel's parallel algorithm, on threads
# The one-thread twin runs every loop serially, so it cannot catch a wrong rank/size stride, a
# missing barrier or a device buffer-layout slip. The team emulation runs the same eig_core.h code
# with round_up(n, 32) ranks (capped at limits.MAX_THREADS, like the kernel's block) with the
# kernel's barriers, reduction order and padded shared-memory layout (csrc/eig_host.cpp; helpers in
# tests/_eig_team.py, shared with the other algorithms' tests). ~0.04 s per 128 x 128 matrix on 2
# cores.

def team(A: torch.Tensor, schedule: int = _eig_team.CONCURRENT) -> torch.Tensor:
    return _eig_team.team(A, "block", schedule)[0]


def _battery() -> list:
    """Every family at every n; the fast tier leaves out n = 128 and three families at n = 100
    (about 2 s each: the four-warp team at n = 100 is still checked on two families)."""
    return _eig_team.battery_cases(
        [2, 5, 17, 33, 100, 128], lambda family, n: n == 128 or (n == 100 and family not in ("indefinite", "wilkinson")),
        families=("indefinite", "graded-1e-8", "four-clusters", "rank-deficient", "wilkinson"))


@pytest.mark.parametrize("family, n", _battery())
def test_team_emulation_battery(family, n):
    A = torch.from_numpy(make_batch(family, n, 2)).float()
    ours = team(A)
    assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all()
    assert_within_torch_error(A, ours)
    # same numerics as the serial twin, different reduction order: agree to rounding level
    torch.testing.assert_close(ours, host(A), atol=16 * EPS32 * n**0.5 * ours.abs().max().item(), rtol=0)


@pytest.mark.slow
def test_team_emulation_eight_warps():
    A = torch.from_numpy(make_batch("gram-activations", 256, 1)).float()  # 256 threads: 8 warps
    assert_within_torch_error(A, team(A))


def test_team_emulation_fp64():
    A64 = torch.from_numpy(make_batch("indefinite", 64, 2))
    ref = reference(A64)
    assert (team(A64) - ref).abs().max() <= 64 * EPS64 * ref.abs().max()


@pytest.mark.parametrize("n", [9, pytest.param(37, marks=pytest.mark.slow)])
def test_every_barrier_of_the_block_algorithm_is_needed(n):
    """Leaving out any one FS_SYNC barrier changes the results in one of the two serial orders,
    except the sites annotated ``// unseen:`` in eig_core.h (each says why)."""
    A = torch.from_numpy(make_batch("indefinite", n, 2)).float()
    _eig_team.assert_barriers_needed(A, "block")


def test_the_mutation_check_catches_a_missing_barrier():
    """The check itself: the barrier between the reflector's column update and building the
    reflector from that column (eig_core.h's tridiagonalize) is left out, and the results move."""
    A = torch.from_numpy(make_batch("indefinite", 9, 2)).float()
    base, sites = _eig_team.team(A, "block", _eig_team.FORWARD)
    lines = (_eig_team.nvrtc.CSRC / "eig_core.h").read_text().splitlines()
    line = next(i for i, ln in enumerate(lines) if "update_column(team, j, n, wk, u, w);" in ln) + 2
    assert "FS_SYNC(team)" in lines[line - 1]
    # its second pass (reflector 1): reflector 0's update is the first that is not a no-op
    k = [i for i, s in enumerate(sites) if s == 10000 + line][1]
    moved = [not torch.equal(_eig_team.team(A, "block", order, drop=k)[0], base)
             for order in (_eig_team.FORWARD, _eig_team.REVERSE)]
    assert any(moved), _eig_team.site_name(sites[k])
