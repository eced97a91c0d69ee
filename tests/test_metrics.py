"""Metrics of docs/metrics.md: boundary spectra, closed forms, identities and invariances."""
import math
import warnings

import numpy as np
import pytest
import torch

import fastspec
from fastspec import metrics as M


@pytest.mark.parametrize("D", [1, 2, 7, 128])
def test_flat_spectrum_has_full_rank(D):
    v = torch.full((D,), 3.5, dtype=torch.float64)
    assert M.participation_ratio(v).item() == pytest.approx(D, rel=1e-12)
    assert M.entropy_rank(v).item() == pytest.approx(D, rel=1e-12)
    assert M.spectral_concentration(v).item() == pytest.approx(0.0, abs=1e-12)
    assert M.effective_dim(v).item() == pytest.approx(D if D > 1 else 1, rel=1e-12)


@pytest.mark.parametrize("D", [2, 16, 100])
def test_single_value_has_rank_one(D):
    v = torch.zeros(D, dtype=torch.float64)
    v[D // 2] = 7.0
    assert M.participation_ratio(v).item() == pytest.approx(1.0)
    assert M.entropy_rank(v).item() == pytest.approx(1.0)  # exercises 0·log 0 = 0
    assert M.spectral_utilization(v).item() == 0.0  # both normalized ranks are 0
    assert M.effective_dim(v).item() == pytest.approx(1.0)
    assert M.spectral_concentration(v).item() == pytest.approx((D - 1) / D)
    assert M.top_share(v, 1).item() == pytest.approx(1.0)


@pytest.mark.parametrize("r,D", [(1, 10), (3, 10), (17, 64)])
def test_r_equal_values_have_rank_r(r, D):
    v = torch.zeros(D, dtype=torch.float64)
    v[torch.randperm(D)[:r]] = 2.0
    assert M.participation_ratio(v).item() == pytest.approx(r)
    assert M.entropy_rank(v).item() == pytest.approx(r)
    assert M.top_share(v, r).item() == pytest.approx(1.0)
    assert M.top_share(v, 1).item() == pytest.approx(1 / r)


@pytest.mark.parametrize("q", [0.3, 0.7, 0.95])
def test_exponential_decay_pr_closed_form(q):
    # v_k = q^k, k = 0..D-1: PR = ((1-q^D)/(1-q))² / ((1-q^{2D})/(1-q²))
    D = 50
    v = q ** torch.arange(D, dtype=torch.float64)
    expected = ((1 - q**D) / (1 - q)) ** 2 / ((1 - q ** (2 * D)) / (1 - q**2))
    assert M.participation_ratio(v).item() == pytest.approx(expected, rel=1e-12)


def test_concentration_rises_with_power_law_exponent():
    D = 2048
    k = torch.arange(1, D + 1, dtype=torch.float64)
    alphas = [0.0, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0]
    sc = [M.spectral_concentration(k ** (-a)).item() for a in alphas]
    assert all(b > a for a, b in zip(sc, sc[1:]))
    assert sc[0] == pytest.approx(0.0, abs=1e-12)
    assert sc[alphas.index(0.8)] == pytest.approx(0.57, abs=0.03)  # the sanity value of docs/metrics.md
    assert sc[alphas.index(2.0)] > 0.98


def test_concentration_D_dependence_fades_for_steep_power_laws():
    # 1 − SC shrinks like D^(1−α) for 1 < α < 2: between D = 1024 and 4096 SC moves by < 0.03
    # at α = 1.5 and < 0.01 at α = 2, while at α = 1 it still moves by ~0.04 (docs/metrics.md).
    def sc(a, D):
        return M.spectral_concentration(torch.arange(1, D + 1, dtype=torch.float64) ** -a).item()

    assert abs(sc(1.5, 4096) - sc(1.5, 1024)) < 0.03
    assert abs(sc(2.0, 4096) - sc(2.0, 1024)) < 0.01
    assert abs(sc(1.0, 4096) - sc(1.0, 1024)) > 0.03


def test_sui_is_harmonic_mean_and_edim_in_range():
    v = torch.rand(64, 37, dtype=torch.float64) ** 4
    D = v.shape[-1]
    s = M.summarize(v)
    h, e = s.hard_rank_normalized, s.soft_rank_normalized
    torch.testing.assert_close(s.sui, 2 * h * e / (h + e))
    torch.testing.assert_close(M.spectral_utilization(v), s.sui)
    torch.testing.assert_close(M.effective_dim(v), s.effective_dim)
    assert ((s.effective_dim >= 1) & (s.effective_dim <= D)).all()
    assert (s.sui <= torch.maximum(h, e) + 1e-12).all() and (s.sui >= torch.minimum(h, e) - 1e-12).all()
    torch.testing.assert_close(s.utilization, s.participation_ratio / D)
    torch.testing.assert_close(s.ghost_dims, D - s.participation_ratio)


def test_metrics_invariant_to_order_and_scale():
    v = torch.rand(5, 33, dtype=torch.float64)
    perm = v[:, torch.randperm(33)]
    for fn in (M.participation_ratio, M.entropy_rank, M.spectral_concentration,
               M.spectral_utilization, M.effective_dim, lambda x: M.top_share(x, 0.1)):
        ref = fn(v)
        torch.testing.assert_close(fn(perm), ref)
        torch.testing.assert_close(fn(v * 1e6), ref)
        torch.testing.assert_close(fn(v * 1e-6), ref)


def test_summarize_matches_individual_functions():
    v = torch.rand(3, 4, 20, dtype=torch.float64)
    s = M.summarize(v)
    torch.testing.assert_close(s.participation_ratio, M.participation_ratio(v))
    torch.testing.assert_close(s.entropy_rank, M.entropy_rank(v))
    torch.testing.assert_close(s.spectral_concentration, M.spectral_concentration(v))
    torch.testing.assert_close(s.top10pct_share, M.top_share(v, 0.1))
    torch.testing.assert_close(s.top1_share, M.top_share(v, 1))
    assert s.participation_ratio.shape == (3, 4) and s.D == 20 and s.n is None


def test_dim_argument_reduces_the_named_axis():
    v = torch.rand(6, 9, dtype=torch.float64)
    torch.testing.assert_close(M.participation_ratio(v, dim=0), M.participation_ratio(v.T))
    torch.testing.assert_close(M.summarize(v, dim=0).entropy_rank, M.entropy_rank(v.T))


def test_top_share_fraction_uses_ceil():
    v = torch.arange(10, 0, -1, dtype=torch.float64)  # 10..1, sum 55
    assert M.top_share(v, 0.25).item() == pytest.approx((10 + 9 + 8) / 55)  # ceil(2.5) = 3
    assert M.top_share(v, 0.1).item() == pytest.approx(10 / 55)  # exactly 1, not 2
    assert M.top_share(v, 1.0).item() == pytest.approx(1.0)


def test_negative_roundoff_is_clamped():
    v = torch.tensor([1.0, 1.0, -1e-9], dtype=torch.float64)
    assert M.participation_ratio(v).item() == pytest.approx(2.0)
    assert M.entropy_rank(v).item() == pytest.approx(2.0)


def test_dtypes_float64_stays_float64_low_precision_computes_in_float32():
    v = torch.rand(4, 16, dtype=torch.float64)
    assert M.summarize(v).participation_ratio.dtype == torch.float64
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        out = M.participation_ratio(v.to(dt))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), M.participation_ratio(v), rtol=2e-2, atol=0)


def test_normalized_rank():
    assert M.normalized_rank(torch.tensor(1.0), 10).item() == 0.0
    assert M.normalized_rank(torch.tensor(10.0), 10).item() == 1.0
    assert M.normalized_rank(1.0, 1).item() == 0.0
    with pytest.raises(ValueError, match="D"):
        M.normalized_rank(1.0, 0)


def test_all_zero_spectrum_is_nan_not_an_error():
    assert math.isnan(M.participation_ratio(torch.zeros(4)).item())


@pytest.mark.parametrize("v", [torch.zeros(4), torch.tensor([3.0, float("nan"), 1.0, 0.5])])
def test_undefined_ranks_stay_nan_through_sui_and_effective_dim(v):
    """SUI and eDim are built on PR and eR: a NaN there must not turn into SUI 0 / eDim 1."""
    s = M.summarize(v)
    for name in ("sui", "effective_dim"):
        assert math.isnan(getattr(s, name).item()), name
    assert math.isnan(M.spectral_utilization(v).item()) and math.isnan(M.effective_dim(v).item())


@pytest.mark.parametrize("bad,err,match", [
    (torch.arange(5), TypeError, "floating"),
    (torch.ones(5, dtype=torch.complex64), TypeError, "floating"),
    (torch.tensor(1.0), ValueError, "scalar"),
    (torch.ones(3, 0), ValueError, "empty"),
    ([1.0, 2.0], TypeError, "torch.Tensor"),
])
def test_bad_spectra_are_rejected_with_the_argument_named(bad, err, match):
    with pytest.raises(err, match=match):
        M.participation_ratio(bad)


@pytest.mark.parametrize("k", [0, 11, 0.0, 1.5, True, "3"])
def test_top_share_rejects_bad_k(k):
    with pytest.raises((ValueError, TypeError), match="k_or_fraction"):
        M.top_share(torch.rand(10), k)


def _rank_at_by_hand(v, fraction):
    """Components for ``fraction`` of the total of each row of ``v`` (numpy, PCA-style)."""
    cum = np.cumsum(-np.sort(-np.asarray(v, dtype=np.float64), axis=-1), axis=-1)
    return np.array([np.searchsorted(c / c[-1], fraction) + 1 for c in cum.reshape(-1, cum.shape[-1])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fraction", [0.05, 0.5, 0.9, 0.99])
def test_rank_at_matches_cumulative_share_by_hand(dtype, fraction):
    v = (torch.rand(40, 33, dtype=torch.float64) ** 6).to(dtype)  # steep: k spreads over 1..D
    got = M.rank_at(v, fraction)
    assert got.dtype == torch.promote_types(dtype, torch.float32) and got.shape == (40,)
    np.testing.assert_array_equal(got.numpy(), _rank_at_by_hand(v.numpy(), fraction))
    torch.testing.assert_close(M.rank_at(v.T, fraction, dim=0), got)
    torch.testing.assert_close(M.rank_at(v[:, torch.randperm(33)], fraction), got)  # any order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_at_sanity_values_and_undefined_spectra(dtype):
    t = lambda *x: torch.tensor(x, dtype=dtype)
    assert M.rank_at(torch.ones(10, dtype=dtype), 0.9).item() == 9  # an exact tie, not 10 by round-off
    assert M.rank_at(torch.ones(10, dtype=dtype), 0.91).item() == 10
    assert M.rank_at(torch.ones(10, dtype=dtype), 1.0).item() == 10
    assert M.rank_at(t(0, 0, 5, 0), 1.0).item() == 1
    assert M.rank_at(t(1, 1e-6, 0, 0), 1.0).item() == 2  # f = 1: every nonzero value counts
    assert M.rank_at(torch.arange(1, 65, dtype=dtype) ** -2.0, 1.0).item() == 64
    assert M.rank_at(t(3, 1), 0.75).item() == 1 and M.rank_at(t(3, 1), 0.76).item() == 2
    assert M.rank_at(t(2.0), 0.9).item() == 1  # D = 1
    for v in (t(0, 0, 0), t(1, float("nan"), 2), t(1, float("inf"), 2)):
        assert math.isnan(M.rank_at(v).item()), v
    both = M.rank_at(torch.stack([t(0, 0, 0), t(4, 4, 2)]))
    assert math.isnan(both[0].item()) and both[1].item() == 3  # a NaN row does not spill over


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.9", None, torch.tensor(0.9)])
def test_rank_at_rejects_bad_fraction(fraction):
    with pytest.raises((ValueError, TypeError), match="fraction"):
        M.rank_at(torch.rand(10), fraction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clearly_negative_values_warn_roundoff_does_not(dtype):
    D = 4
    tol = D * torch.finfo(torch.float32).eps * 2.0  # -D·eps·max|v| with max|v| = 2 (eps at least float32's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert M.participation_ratio(torch.tensor([2.0, 2.0, 0.0, -0.5 * tol], dtype=dtype)).item() == pytest.approx(2)
        M.summarize(torch.tensor([2.0, 2.0, -0.5, -0.1], dtype=dtype), check_negative=False)
        M.rank_at(torch.tensor([2.0, 2.0, -0.5, -0.1], dtype=dtype), check_negative=False)
    v = torch.tensor([[2.0, 2.0, -0.5, -2 * tol], [1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    for fn in (M.participation_ratio, M.entropy_rank, M.summarize, M.rank_at, M.effective_dim,
               lambda x: M.top_share(x, 1)):
        with pytest.warns(UserWarning, match=r"^v: 2 value\(s\) below .*most negative -0\.5\)") as rec:
            fn(v)
        assert len(rec) == 1 and rec[0].filename == __file__  # one check, pointing at the caller
    with pytest.warns(UserWarning):
        torch.testing.assert_close(M.participation_ratio(v), M.participation_ratio(v.clamp_min(0)))  # still clamped


def test_probe_rank_at_90_is_pca_components_of_the_variance(monkeypatch):
    """rank@90 on a real probe run: ``sv`` keys use σ² of the key matrix (svdvals, squared), ``eig``
    FFN sites the covariance eigenvalues; emission never runs the negative-value check (a sync)."""
    from _tiny_models import batch, build  # skips this test without transformers
    from test_probe_parity import _ffn_inputs_by_hand, _keys_by_hand

    model = build("llama")
    inputs = batch(B=3, T=12, pad="left")
    monkeypatch.setattr(M, "_warn_negative", None)  # calling it would raise TypeError
    records = fastspec.Probe(model).measure(inputs, step=0)
    got = {(r.site, r.layer, r.head_index): r.value for r in records if r.metric == "rank_at_90"}
    sigma_differs = False
    for layer, K in _keys_by_hand(model, inputs).items():
        for h in range(K.shape[1]):
            sigma = torch.linalg.svdvals(K[:, h].double()).numpy()
            assert got[("keys", layer, h)] == _rank_at_by_hand(sigma**2, 0.9)[0], (layer, h)
            sigma_differs |= _rank_at_by_hand(sigma, 0.9)[0] != _rank_at_by_hand(sigma**2, 0.9)[0]
    assert sigma_differs  # the test tells σ² from σ
    keep = inputs["attention_mask"].bool()
    for layer, x in _ffn_inputs_by_hand(model, inputs).items():
        lam = torch.linalg.eigvalsh(torch.cov(x[keep].double().T)).numpy()
        assert got[("ffn", layer, None)] == _rank_at_by_hand(lam, 0.9)[0]
