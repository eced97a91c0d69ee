"""Accuracy side of the eigvalsh claim: fastspec vs torch.linalg fp32 vs an fp64 reference.

Each family is a batch of ``[b, n, n]`` symmetric fp32 matrices, random or built to be hard for
a symmetric eigensolver. The reference is ``torch.linalg.eigvalsh`` in float64 of the *same*
fp32-rounded matrices, so it is the exact spectrum of the input (up to ~1e-16). Error per matrix:
``max_i |λ_i − λ_i^fp64| / max_i |λ_i^fp64|`` (backward-stable solvers reach a few n·eps_fp32),
then the max over the batch. ``ratio`` = fastspec error / torch fp32 error; the library's claim
(STYLE: "no worse than 2× torch.linalg fp32 vs fp64") is ``ratio ≤ 2`` up to an 8·eps floor.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .cases import max_rel_err

EPS32 = torch.finfo(torch.float32).eps
# Bound: fastspec error <= 2 × torch's error in the same precision + FLOOR_EPS·eps_fp32 (errors are
# relative to the matrix scale). The floor keeps a baseline that happens to round almost exactly
# from making the bound ~0; 8 is the value tests/test_eig_host.py uses for the solvers themselves.
FLOOR_EPS = 8


def within_bound(err: float, torch_err: float) -> bool:
    return math.isfinite(err) and err <= 2 * torch_err + FLOOR_EPS * EPS32


SIZES = {"quick": ([16, 48], 4), "cpu": ([64, 128, 256], 32), "gpu": ([64, 128, 256], 256)}


def _with_spectrum(lam: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``Q diag(λ) Qᵀ`` with Haar-random orthogonal ``Q`` (fp64), ``λ: [b, n]``."""
    b, n = lam.shape
    Q, R = torch.linalg.qr(torch.randn(b, n, n, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]
    return (Q * lam[:, None, :]) @ Q.mT


def _wishart(b, n, g):
    X = torch.randn(b, 2 * n, n, generator=g, dtype=torch.float64)
    return X.mT @ X / (2 * n)


def _powerlaw(b, n, g):
    k = torch.arange(1, n + 1, dtype=torch.float64)
    return _with_spectrum((k ** -1.5).expand(b, n), g)


def _graded(b, n, g):  # 12 decades: small eigenvalues are where fp32 solvers lose digits
    return _with_spectrum(torch.logspace(0, -12, n, dtype=torch.float64).expand(b, n), g)


def _clustered(b, n, g):  # four tight clusters: eigenvector-free solvers must not merge/split them
    lam = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=torch.float64).repeat_interleave(math.ceil(n / 4))[:n]
    return _with_spectrum((lam + 1e-7 * torch.rand(b, n, generator=g, dtype=torch.float64)), g)


def _degenerate(b, n, g):  # identity + rank one: an (n−1)-fold eigenvalue
    v = torch.randn(b, n, 1, generator=g, dtype=torch.float64)
    return torch.eye(n, dtype=torch.float64) + v @ v.mT


def _rank_deficient(b, n, g):  # Gram of n/4 rows: 3n/4 exact zeros (short key batches)
    X = torch.randn(b, max(1, n // 4), n, generator=g, dtype=torch.float64)
    return X.mT @ X


def _large_mean(b, n, g):  # uncentered Gram of data with mean 100 ± 1: one eigenvalue ~1e4·n
    X = 100 + torch.randn(b, 2 * n, n, generator=g, dtype=torch.float64)
    return X.mT @ X / (2 * n)


def _wilkinson(b, n, g):  # W+_n: pairs of eigenvalues agreeing to many digits
    d = (torch.arange(n, dtype=torch.float64) - (n - 1) / 2).abs()
    W = torch.diag(d) + torch.diag(torch.ones(n - 1, dtype=torch.float64), 1) \
        + torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)
    return W.expand(b, n, n).clone()


def _tiny(b, n, g):  # scale 1e-30: squares of entries underflow fp32
    return _powerlaw(b, n, g) * 1e-30


def _huge(b, n, g):  # scale 1e30: squares of entries overflow fp32
    return _powerlaw(b, n, g) * 1e30


FAMILIES: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    "wishart": _wishart, "powerlaw": _powerlaw, "graded-1e-12": _graded, "clustered": _clustered,
    "degenerate": _degenerate, "rank-deficient": _rank_deficient, "large-mean": _large_mean,
    "wilkinson": _wilkinson, "tiny-1e-30": _tiny, "huge-1e30": _huge,
}


def _variants(device: torch.device) -> list[str]:
    import fastspec

    out = ["auto"]
    for name, info in fastspec.backends().items():
        if name in ("auto", "torch") or not info.get("available"):
            continue
        if (name == "cuda") == (device.type == "cuda") or name not in ("cuda", "host"):
            out.append(name)
    return out


def compare(tier: str, device: torch.device, families: list[str] | None = None, *,
            deadline: float | None = None) -> list[dict]:
    """One row per (family, n, fastspec variant): errors vs fp64 and their ratio.

    ``deadline`` (``time.monotonic()``): no new (family, n) starts after it; those left get a
    row with ``skipped`` naming the time cap.
    """
    import fastspec

    from .runner import CAP_REACHED

    sizes, batch = SIZES[tier]
    rows = []
    for fam in families or list(FAMILIES):
        if fam not in FAMILIES:
            raise ValueError(f"families: unknown family {fam!r}; expected some of {list(FAMILIES)}")
        for n in sizes:
            if deadline is not None and time.monotonic() > deadline:
                rows.append({"family": fam, "n": n, "batch": batch, "skipped": CAP_REACHED})
                continue
            g = torch.Generator().manual_seed(n)
            A = FAMILIES[fam](batch, n, g).to(torch.float32).to(device)
            ref = torch.linalg.eigvalsh(A.double())
            torch_err = max_rel_err(torch.linalg.eigvalsh(A), ref)
            for variant in _variants(device):
                head = {"family": fam, "n": n, "batch": batch, "variant": variant}
                try:
                    err = max_rel_err(fastspec.eigvalsh(A, backend=variant), ref)
                except Exception as e:  # noqa: BLE001 - reported in the row, the CLI exits non-zero
                    rows.append({**head, "error": f"{type(e).__name__}: {e}"})
                    continue
                ok = within_bound(err, torch_err)
                rows.append({**head, "fastspec_error": err if math.isfinite(err) else None,
                             "torch_fp32_error": torch_err if math.isfinite(torch_err) else None,
                             "ratio": err / torch_err if torch_err > 0 and math.isfinite(err) else None,
                             "within_2x_torch": ok})
    return rows
