"""The in-place covariance update (``fastspec/covariance/inplace.py``, ``backend="inplace"``) and
float32 totals (``Covariance(totals=torch.float32)``) against the float64 reference of the same
rows (``reference.py``): random and adversarial inputs (odd widths, strided views, padding, row
sampling, NaN/Inf rows, a mean 1e4 times the spread, nothing kept), and the workspace it
allocates against the bound the memory plan counts (``plan.inplace_capture_bytes``).

Tolerances: float64 totals form float64 products of the rows, exact for 16/32-bit input, so only
the summation order differs from the reference (~1e-15 relative). float32 totals round every
product and sum to float32: ~1e-6 of the largest entry (a few units of eps32 times the number of
blocks), which is what the accuracy battery of docs/scale.md measures per metric.
"""
from __future__ import annotations

import pytest
import torch
from _memory import Allocations

import fastspec
from fastspec.covariance import inplace
from fastspec.covariance.reference import covariance_partials_reference
from fastspec.probe import plan


def _rows(B=3, T=40, S=2, D=17, *, dtype=torch.float32, mean=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, S, D, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, D, dtype=torch.float64)
    return (x + mean).to(dtype)


def _reference(x, mask, row_step, track_mean):
    """n, rejected, mean/sum and m2/gram in float64 from the reference partials (about 0)."""
    p = covariance_partials_reference(x.double(), mask, row_step, center=False)
    n = p.n.double()
    if not track_mean:
        return p.n, p.rejected, p.s, p.G
    mean = p.s / n.clamp_min(1)[:, None]
    m2 = p.G - p.s[:, :, None] * p.s[:, None, :] / n.clamp_min(1)[:, None, None]
    return p.n, p.rejected, mean, m2


def _state(cov):
    st = cov._state
    first, second = ("mean", "m2") if cov.track_mean else ("sum", "gram")
    return st["n"], st["rejected"], st[first], st[second]


CASES = {
    "plain": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "fp16-odd-width": dict(dtype=torch.float16, D=33, S=1),
    "large-mean": dict(mean=1e4, dtype=torch.float32),
    "one-site-wide": dict(S=1, D=130, T=20),
}


@pytest.mark.parametrize("track_mean", [True, False], ids=["eig", "sv"])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_totals_match_the_reference(case, track_mean):
    kw = CASES[case]
    x = _rows(**kw)
    mask = torch.rand(x.shape[:2], generator=torch.Generator().manual_seed(1)) > 0.25
    cov = fastspec.Covariance(x.shape[2:], backend="inplace", track_mean=track_mean)
    for step in (1, 3):  # two updates: the second goes through the Chan merge with a nonzero n_a
        cov.update(x, mask, row_step=step)
    n = sum(_reference(x, mask, s, track_mean)[0] for s in (1, 3))
    assert torch.equal(cov.n.reshape(-1), n)
    ref = fastspec.Covariance(x.shape[2:], precision="exact", track_mean=track_mean)
    for step in (1, 3):
        ref.update(x, mask, row_step=step)
    got, exp = _state(cov), _state(ref)
    scale = exp[3].abs().amax()
    torch.testing.assert_close(got[2], exp[2], rtol=1e-12, atol=1e-12 * exp[2].abs().amax())
    assert ((got[3] - exp[3]).abs().amax() / scale).item() < 1e-12


def test_strided_rows_nan_rows_and_nothing_kept():
    x = _rows(B=2, T=30, S=3, D=9)
    view = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, T-major strides
    view[1, 4, 2, 3] = float("nan")
    view[0, 7, 0, 0] = float("inf")
    cov = fastspec.Covariance((3, 9), backend="inplace")
    cov.update(view)
    assert cov.rejected.tolist() == [1, 0, 1]
    assert cov.n.tolist() == [59, 60, 59]
    ref = fastspec.Covariance((3, 9), precision="exact").update(view)
    torch.testing.assert_close(cov.covariance(), ref.covariance(), rtol=1e-11, atol=1e-13)
    # nothing kept: the totals stay exactly zero (no NaN from an empty chunk)
    empty = fastspec.Covariance((3, 9), backend="inplace")
    empty.update(view, torch.zeros(view.shape[:2], dtype=torch.bool))
    assert empty.n.tolist() == [0, 0, 0] and torch.equal(empty._state["m2"], torch.zeros(3, 9, 9, dtype=torch.float64))


@pytest.mark.parametrize("track_mean", [True, False], ids=["eig", "sv"])
def test_float32_totals_hold_the_reference_to_float32_rounding(track_mean):
    cov = fastspec.Covariance((2, 24), backend="inplace", totals=torch.float32, track_mean=track_mean)
    ref = fastspec.Covariance((2, 24), precision="exact", track_mean=track_mean)
    for seed in range(5):  # a stream of updates: rounding accumulates over merges
        xs = _rows(B=4, T=64, S=2, D=24, mean=3.0, seed=seed)
        cov.update(xs)
        ref.update(xs)
    second = "m2" if track_mean else "gram"
    assert cov._state[second].dtype == torch.float32 and cov._state["n"].dtype == torch.int64
    err = ((cov._state[second].double() - ref._state[second]).abs().amax() / ref._state[second].abs().amax()).item()
    assert 0 < err < 1e-5, err  # rounded (not float64 in disguise), within a few eps32 per merge
    pr = cov.metrics("eig" if track_mean else "sv").participation_ratio
    pr_ref = ref.metrics("eig" if track_mean else "sv").participation_ratio
    torch.testing.assert_close(pr, pr_ref, rtol=1e-5, atol=0)


def test_float32_totals_round_trip_through_state_dict_merge_and_repr():
    x = _rows(S=1, D=12)
    a = fastspec.Covariance(12, backend="inplace", totals=torch.float32).update(x[:, :, 0])
    b = fastspec.Covariance(12, backend="inplace", totals=torch.float32)
    b.load_state_dict(a.state_dict())
    assert b._state["m2"].dtype == torch.float32 and torch.equal(b._state["m2"], a._state["m2"])
    assert "totals=torch.float32" in repr(b) and a.state_dict()["totals"] == "float32"
    wide = fastspec.Covariance(12)  # float64 totals take a float32 state exactly
    wide.load_state_dict(a.state_dict())
    assert wide._state["m2"].dtype == torch.float64
    merged = fastspec.Covariance(12, backend="inplace", totals=torch.float32).update(x[:, :, 0]).merge(a)
    assert merged.n.item() == 2 * a.n.item()
    with pytest.raises(ValueError, match="totals: expected torch.float64 or torch.float32"):
        fastspec.Covariance(12, totals=torch.float16)


def test_inplace_is_one_op_under_compile():
    x = _rows(B=2, T=16, S=2, D=8)
    cov = fastspec.Covariance((2, 8), backend="inplace", device="cpu")
    eager = fastspec.Covariance((2, 8), backend="inplace").update(x)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(rows):
        cov.update(rows)
        return rows.sum()

    step(x)
    torch.testing.assert_close(cov.covariance(), eager.covariance(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("D, totals", [(40, torch.float64), (300, torch.float64), (300, torch.float32)])
def test_workspace_stays_within_the_bound_the_plan_counts(D, totals):
    """Many more rows than a block: the update allocates at most ``workspace_bytes`` (the plan's
    ``inplace_capture_bytes``, the same number), whatever the batch."""
    peaks = []
    for B in (6, 12):
        x = _rows(B=B, T=400, S=1, D=D)
        x[2, 5, 0, 1] = float("nan")  # the row-by-row path too
        cov = fastspec.Covariance(D, backend="inplace", totals=totals, device="cpu")
        mask = torch.rand(B, 400, generator=torch.Generator().manual_seed(2)) > 0.1
        with Allocations() as mem:
            cov.update(x[:, :, 0], mask)
        peaks.append(mem.peak)
    itemsize = torch.empty(0, dtype=totals).element_size()
    bound = inplace.workspace_bytes(1, D, itemsize)
    assert bound == plan.inplace_capture_bytes(1, D, itemsize)
    assert inplace.block_rows(1, D, itemsize) == plan.block_rows(1, D, itemsize) < 6 * 400
    assert 0 < peaks[0] <= bound, (peaks, bound)
    assert peaks[1] == peaks[0]  # twice the rows, the same workspace


def test_block_rows_follow_the_width():
    assert inplace.block_rows(1, 48, 8) == 256          # narrow: the GEMM floor
    assert inplace.block_rows(1, 512, 8) == 512         # as many rows as columns
    assert inplace.block_rows(1, 14336, 8) == 585       # the 64 MiB block
    assert inplace.block_rows(1, 28672, 4) == 585
