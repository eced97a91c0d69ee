"""Test matrices for symmetric eigensolvers: the one set of families the solver's tests
(``tests/test_eig_*.py``) and the accuracy comparison (``fastspec compare``,
:mod:`fastspec.bench.accuracy`) both draw from, so a hard case added here is checked by both.

``make_batch(family, n, batch, seed) -> np.ndarray [batch, n, n]`` (float64, exactly symmetric),
deterministic in ``(family, n, batch, seed)``. Cast to the precision under test and compute the
reference from the *cast* matrix in float64, so the reference is exact for the input the solver
actually sees.

Families (:data:`FAMILIES`), by what they stress:

* typical spectra: ``spd`` (eigenvalues uniform in [0.1, 1]), ``indefinite`` (symmetric
  Gaussian), ``wishart`` (``XᵀX / 2n`` of Gaussian ``X [2n, n]``), ``powerlaw`` (λ_k = k^-1.5),
  ``gram-activations`` (Gram of activation-like rows: log-normal channel scales, a few channels
  with mean 20, one dominant eigenvalue), ``large-mean`` (uncentered Gram of data with mean
  100 ± 1: one eigenvalue ~1e4·n above the rest);
* wide dynamic range, where fp32 solvers lose the small eigenvalues' digits: ``graded-1e-8`` and
  ``graded-1e-12`` (log-spaced from 1 down to 1e-8 / 1e-12);
* multiple and nearly multiple eigenvalues, which eigenvector-free solvers must neither merge nor
  split: ``repeated`` (multiplicity 4), ``degenerate`` (identity + rank one: an (n−1)-fold
  eigenvalue), ``one-cluster`` (1 + 1e-6·k), ``four-clusters`` (1, 1/2, 1/4, 1/8, each spread by
  1e-7), ``wilkinson`` (W+_n: pairs agreeing to many digits);
* exact zeros: ``rank-deficient`` (Gram of n/4 rows: 3n/4 zero eigenvalues, short key
  batches), ``zero``, ``identity``;
* scale, where squares of entries leave the fp32 range: ``spd-1e30`` and ``spd-1e-30``,
  ``subnormal-fp32`` (``spd`` × 1e-39, below the smallest normal fp32), ``powerlaw-1e30`` and
  ``powerlaw-1e-30``.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch


# The random numbers come from numpy (one seeded Generator per batch); every product and
# factorization runs in torch. Not numpy's BLAS: the scipy-openblas wheel takes ~0.5 s per 128 x 128
# QR on a busy 2-core box (thread spin), and alternating it with torch's thread pool costs ~10 ms
# per matrix in spin-waits, which dominated the test suite and `fastspec compare`.
def _rotation(rng: np.random.Generator, n: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.from_numpy(rng.standard_normal((n, n))))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed orthogonal


def _symmetric(a: torch.Tensor) -> np.ndarray:
    """``(a + aᵀ) / 2`` as numpy: exactly symmetric, so the cast to fp32 stays symmetric too."""
    return ((a + a.T) / 2).numpy()


def _with_spectrum(rng: np.random.Generator, lam: np.ndarray) -> np.ndarray:
    q = _rotation(rng, len(lam))
    return _symmetric((q * torch.from_numpy(np.asarray(lam, dtype=np.float64))) @ q.T)


def _gram(x: np.ndarray, scale: bool = True) -> np.ndarray:
    """``xᵀx / rows`` (``scale=False``: ``xᵀx``) of ``x [rows, n]``."""
    t = torch.from_numpy(x)
    return _symmetric(t.T @ t / (len(x) if scale else 1))


def _spd(rng: np.random.Generator, n: int) -> np.ndarray:
    return _with_spectrum(rng, rng.uniform(0.1, 1.0, n))


def _powerlaw(rng: np.random.Generator, n: int) -> np.ndarray:
    return _with_spectrum(rng, np.arange(1, n + 1) ** -1.5)


def _gram_activations(rng: np.random.Generator, n: int) -> np.ndarray:
    # what the library eigensolves in practice (docs/accumulators.md): X^T X / T of activation-like
    # rows with log-normal channel scales and a few huge-mean channels (one dominant eigenvalue)
    T = 4 * n + 64
    scale = np.exp(rng.standard_normal(n))
    mean = np.zeros(n)
    mean[: max(1, n // 32)] = 20.0
    return _gram(rng.standard_normal((T, n)) * scale + mean)


def _four_clusters(rng: np.random.Generator, n: int) -> np.ndarray:
    lam = np.repeat([1.0, 0.5, 0.25, 0.125], -(-n // 4))[:n]
    return _with_spectrum(rng, lam + 1e-7 * rng.random(n))


def _degenerate(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, 1))
    return np.eye(n) + v @ v.T


def _wilkinson(n: int) -> np.ndarray:
    # W+_n: pairs of eigenvalues agreeing to many digits
    return np.diag(np.abs(np.arange(n) - (n - 1) / 2)) + np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)


FAMILIES: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "spd": _spd,
    "indefinite": lambda rng, n: (lambda g: (g + g.T) / 2)(rng.standard_normal((n, n))),
    "wishart": lambda rng, n: _gram(rng.standard_normal((2 * n, n))),
    "powerlaw": _powerlaw,
    "gram-activations": _gram_activations,
    "large-mean": lambda rng, n: _gram(100.0 + rng.standard_normal((2 * n, n))),
    "graded-1e-8": lambda rng, n: _with_spectrum(rng, np.logspace(0, -8, n)),
    "graded-1e-12": lambda rng, n: _with_spectrum(rng, np.logspace(0, -12, n)),
    "repeated": lambda rng, n: _with_spectrum(rng, np.floor(np.arange(n) / 4) + 1.0),
    "degenerate": _degenerate,
    "one-cluster": lambda rng, n: _with_spectrum(rng, 1.0 + 1e-6 * np.arange(n)),
    "four-clusters": _four_clusters,
    "wilkinson": lambda rng, n: _wilkinson(n),
    "rank-deficient": lambda rng, n: _gram(rng.standard_normal((max(1, n // 4), n)), scale=False),
    "zero": lambda rng, n: np.zeros((n, n)),
    "identity": lambda rng, n: np.eye(n),
    "spd-1e30": lambda rng, n: _spd(rng, n) * 1e30,
    "spd-1e-30": lambda rng, n: _spd(rng, n) * 1e-30,
    "subnormal-fp32": lambda rng, n: _spd(rng, n) * 1e-39,
    "powerlaw-1e30": lambda rng, n: _powerlaw(rng, n) * 1e30,
    "powerlaw-1e-30": lambda rng, n: _powerlaw(rng, n) * 1e-30,
}
"""``name -> (rng, n) -> [n, n]`` float64 symmetric matrix; see the module docstring."""


def make_batch(family: str, n: int, batch: int, seed: int = 0) -> np.ndarray:
    """``[batch, n, n]`` float64 symmetric matrices of one family (keys of ``FAMILIES``)."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    if n < 1 or batch < 0:
        raise ValueError(f"n, batch: expected n >= 1 and batch >= 0, got n={n}, batch={batch}")
    rng = np.random.default_rng([seed, n, zlib.crc32(family.encode())])
    return np.stack([FAMILIES[family](rng, n) for _ in range(batch)]) if batch else np.zeros((0, n, n))
