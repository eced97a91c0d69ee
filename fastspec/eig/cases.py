"""Adversarial test matrices for symmetric eigensolvers, shared by tests and benchmarks.

``make_batch(family, n, batch, seed) -> np.ndarray [batch, n, n]`` (float64, exactly symmetric),
deterministic in ``(family, n, batch, seed)``. Cast to the precision under test and compute the
reference from the *cast* matrix in float64, so the reference is exact for the input the solver
actually sees.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch


def _rotation(rng: np.random.Generator, n: int) -> np.ndarray:
    # torch's LAPACK, not numpy's: the scipy-openblas QR wheel takes ~0.5 s per 128 x 128 on a busy
    # 2-core box (thread spin), which dominated the test suite
    q, r = torch.linalg.qr(torch.from_numpy(rng.standard_normal((n, n))))
    return (q * torch.sign(torch.diagonal(r))).numpy()  # Haar-distributed orthogonal


def _with_spectrum(rng: np.random.Generator, lam: np.ndarray) -> np.ndarray:
    q = _rotation(rng, len(lam))
    a = (q * lam) @ q.T
    return (a + a.T) / 2


def _gram_activations(rng: np.random.Generator, n: int) -> np.ndarray:
    # what the library eigensolves in practice (SPEC §1): X^T X / T of activation-like rows with
    # log-normal channel scales and a few huge-mean channels (one dominant eigenvalue)
    T = 4 * n + 64
    scale = np.exp(rng.standard_normal(n))
    mean = np.zeros(n)
    mean[: max(1, n // 32)] = 20.0
    x = rng.standard_normal((T, n)) * scale + mean
    return x.T @ x / T


def _wilkinson(n: int) -> np.ndarray:
    # W+_n: pairs of eigenvalues agreeing to many digits
    return np.diag(np.abs(np.arange(n) - (n - 1) / 2)) + np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)


FAMILIES = {
    "spd": lambda rng, n: _with_spectrum(rng, rng.uniform(0.1, 1.0, n)),
    "indefinite": lambda rng, n: (lambda g: (g + g.T) / 2)(rng.standard_normal((n, n))),
    "gram_activations": _gram_activations,
    "rank_deficient": lambda rng, n: (lambda x: x.T @ x)(rng.standard_normal((max(1, n // 4), n))),
    "repeated": lambda rng, n: _with_spectrum(rng, np.floor(np.arange(n) / 4) + 1.0),  # multiplicity 4
    "clustered": lambda rng, n: _with_spectrum(rng, 1.0 + 1e-6 * np.arange(n)),
    "graded": lambda rng, n: _with_spectrum(rng, np.logspace(0, -8, n)),  # spans 1e-8 of lambda_max
    "zero": lambda rng, n: np.zeros((n, n)),
    "identity": lambda rng, n: np.eye(n),
    "wilkinson": lambda rng, n: _wilkinson(n),
    "huge": lambda rng, n: _with_spectrum(rng, rng.uniform(0.1, 1.0, n)) * 1e30,
    "tiny": lambda rng, n: _with_spectrum(rng, rng.uniform(0.1, 1.0, n)) * 1e-30,
    "subnormal_fp32": lambda rng, n: _with_spectrum(rng, rng.uniform(0.1, 1.0, n)) * 1e-39,  # below FLT_MIN
}


def make_batch(family: str, n: int, batch: int, seed: int = 0) -> np.ndarray:
    """``[batch, n, n]`` float64 symmetric matrices of one family (keys of ``FAMILIES``)."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    if n < 1 or batch < 0:
        raise ValueError(f"n, batch: expected n >= 1 and batch >= 0, got n={n}, batch={batch}")
    rng = np.random.default_rng([seed, n, zlib.crc32(family.encode())])
    return np.stack([FAMILIES[family](rng, n) for _ in range(batch)]) if batch else np.zeros((0, n, n))
