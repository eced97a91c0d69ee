"""Fits of docs/fits.md: power-law scaling and spectral tail index."""
import math

import numpy as np
import pytest
import torch

import fastspec


@pytest.mark.parametrize("beta,c", [(0.5, 1.0), (-1.2, 3.0), (0.83, -0.4)])
def test_power_law_recovers_exact_exponent(beta, c):
    x = np.array([512, 1024, 1365, 2048, 2560, 3072, 3584, 4096], dtype=float)
    fit = fastspec.fit_power_law(x, math.exp(c) * x**beta)
    assert fit.beta == pytest.approx(beta, abs=1e-10)
    assert fit.intercept == pytest.approx(c, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.stderr < 1e-6 and fit.n == len(x)  # sqrt(1 − r²) turns 1e-16 round-off into ~1e-8
    np.testing.assert_allclose(fit.predict(x), math.exp(c) * x**beta, rtol=1e-9)


def test_power_law_with_noise_reports_standard_error():
    rng = np.random.default_rng(0)
    x = np.geomspace(100, 10000, 40)
    y = 2.0 * x**0.7 * np.exp(rng.normal(0, 0.05, size=x.size))
    fit = fastspec.fit_power_law(torch.tensor(x), y)
    assert abs(fit.beta - 0.7) < 4 * fit.stderr and 0 < fit.stderr < 0.05
    assert 0.95 < fit.r2 < 1.0


def test_power_law_bad_input():
    with pytest.raises(ValueError, match="y"):
        fastspec.fit_power_law([1, 2, 3], [1, 0, 2])
    with pytest.raises(ValueError, match="x"):
        fastspec.fit_power_law([1, -2, 3], [1, 2, 2])
    with pytest.raises(ValueError, match="lengths"):
        fastspec.fit_power_law([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="2 points"):
        fastspec.fit_power_law([1.0], [1.0])
    with pytest.raises(ValueError, match="distinct"):
        fastspec.fit_power_law([2.0, 2.0], [1.0, 3.0])


@pytest.mark.parametrize("a", [0.5, 1.0, 2.3])
def test_tail_index_recovers_exponent_in_window(a):
    D = 256
    k = np.arange(1, D + 1, dtype=float)
    v = 5.0 * k ** (-a)
    v[:3] *= 50  # a few outliers at the head that the default window drops
    v[-20:] = 1e-12  # a noisy floor at the tail, also outside the default window
    rng = np.random.default_rng(1)
    fit = fastspec.tail_index(rng.permutation(v))  # any order
    assert fit.a == pytest.approx(a, abs=1e-9) and fit.r2 == pytest.approx(1.0)
    assert (fit.start, fit.stop) == (13, 204)
    with_head = fastspec.tail_index(v, start=0, stop=100)
    assert abs(with_head.a - a) > 0.05  # the window matters


def test_tail_index_bad_window():
    with pytest.raises(ValueError, match="start, stop"):
        fastspec.tail_index(np.ones(10), start=5, stop=5)
    with pytest.raises(ValueError, match="positive"):
        fastspec.tail_index(np.zeros(10), start=0, stop=10)
    with pytest.raises(ValueError, match="1-D"):
        fastspec.tail_index(np.ones((2, 10)))
    with pytest.raises(ValueError, match="finite"):
        fastspec.tail_index(np.r_[np.nan, np.arange(20, 0, -1.0)])
