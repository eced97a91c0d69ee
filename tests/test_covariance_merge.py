"""The one merge path: an accumulator's rows as sums about any shift (``_sums_about``), merged
back by ``_merge_sums`` (what every update and the distributed all-reduce use), reproduce it;
sums about a common shift add (the all-reduce) to the accumulator of all the rows."""
from __future__ import annotations

import pytest
import torch

import fastspec


def _rows(seed: int, n: int, mean: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return mean + torch.randn(n, 3, 6, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 6, dtype=torch.float64)


@pytest.mark.parametrize("track_mean", [True, False])
@pytest.mark.parametrize("mean", [0.0, 1e4])
def test_sums_about_a_common_shift_add_to_the_merged_accumulator(track_mean, mean):
    parts = [_rows(s, n, mean) for s, n in ((0, 40), (1, 7), (2, 90))]
    covs = [fastspec.Covariance((3, 6), track_mean=track_mean).update(x) for x in parts]
    whole = fastspec.Covariance((3, 6), track_mean=track_mean).update(torch.cat(parts))
    n = sum(c._state["n"] for c in covs)
    shift = None
    if track_mean:  # the global mean, as the all-reduce computes it
        shift = sum(c._state["mean"] * c._state["n"].double()[:, None] for c in covs) / n.double()[:, None]
    sums = [c._sums_about(shift) for c in covs]
    s = sum(x[0] for x in sums)
    G = sum(x[1] for x in sums)
    out = fastspec.Covariance((3, 6), track_mean=track_mean, device="cpu")
    out._merge_sums(n, torch.zeros_like(s) if shift is None else shift, s, G, torch.zeros_like(n))
    assert torch.equal(out.n, whole.n)
    torch.testing.assert_close(out.mean, whole.mean, rtol=1e-13, atol=0)
    if track_mean:
        ref = torch.stack([torch.cov(torch.cat(parts)[:, i].T) for i in range(3)])
        # fp64 itself resolves a mean of 1e4 to ~1e-12, i.e. ~1e-9 of a 1e-3 spread: errors are
        # measured in units of sqrt(C_ii C_jj), where that is 1e-9 and a cancellation would be O(1)
        d = torch.diagonal(ref, dim1=-2, dim2=-1).sqrt()
        err = ((out.covariance() - ref).abs() / (d[..., :, None] * d[..., None, :])).max()
        assert err < 1e-8, err
        assert torch.equal(out.covariance(), out.covariance().mT)
    else:
        torch.testing.assert_close(out.gram(), whole.gram(), rtol=1e-13, atol=0)


def test_sums_about_leaves_the_accumulator_alone_and_refuses_a_shift_for_raw_sums():
    cov = fastspec.Covariance(4).update(torch.randn(20, 4, dtype=torch.float64))
    before = {k: v.clone() for k, v in cov._state.items()}
    s, G = cov._sums_about(torch.ones(1, 4, dtype=torch.float64))
    assert torch.equal(G, G.mT)  # exactly symmetric, like every state the merges write
    s += 1
    G += 1
    assert all(torch.equal(before[k], v) for k, v in cov._state.items())
    raw = fastspec.Covariance(4, track_mean=False).update(torch.randn(20, 4))
    with pytest.raises(ValueError, match="shift"):
        raw._sums_about(torch.zeros(1, 4, dtype=torch.float64))


def test_all_reduce_needs_data():
    with pytest.raises(RuntimeError, match="seen no data"):
        fastspec.Covariance(4).all_reduce()
