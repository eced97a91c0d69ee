"""Power-law scaling across widths and the spectral tail index (docs/fits.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _args

__all__ = ["PowerLawFit", "TailFit", "fit_power_law", "tail_index"]


@dataclass(frozen=True)
class PowerLawFit:
    """``log y = beta·log x + intercept`` by least squares; ``stderr`` is the SE of beta."""

    beta: float
    intercept: float
    r2: float
    stderr: float
    n: int

    def predict(self, x):
        """``exp(intercept)·x^beta``."""
        return math.exp(self.intercept) * np.asarray(x, dtype=float) ** self.beta


@dataclass(frozen=True)
class TailFit:
    """``λ_k ∝ k^(−a)`` fitted on ranks ``start+1 .. stop`` (1-based k), with its R²."""

    a: float
    intercept: float
    r2: float
    stderr: float
    start: int
    stop: int


def _as_1d(name: str, v) -> np.ndarray:
    try:
        import torch

        if isinstance(v, torch.Tensor):
            v = v.detach().double().cpu().numpy()
    except ImportError:  # torch is a dependency; this only keeps fits usable on plain arrays
        pass
    arr = np.asarray(v, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    return arr


def _linregress(lx: np.ndarray, ly: np.ndarray) -> tuple[float, float, float, float]:
    if np.ptp(lx) == 0:
        raise ValueError("x: needs at least two distinct values to fit a slope")
    # imported here, not at module level: `import fastspec` imports this module, and scipy.stats
    # alone costs ~0.4 s of start-up that only a fit needs
    from scipy import stats

    res = stats.linregress(lx, ly)
    r2 = 1.0 if np.ptp(ly) == 0 else float(res.rvalue) ** 2
    stderr = float(res.stderr) if len(lx) > 2 else float("nan")
    return float(res.slope), float(res.intercept), r2, stderr


def fit_power_law(x, y) -> PowerLawFit:
    """Fit ``y = e^c · x^β`` by least squares of ``log y`` on ``log x``.

    ``x``, ``y``: 1-D, same length >= 2, strictly positive. Returns beta, intercept c, R² and
    the standard error of beta (NaN with only two points).
    """
    x, y = _as_1d("x", x), _as_1d("y", y)
    if x.shape != y.shape:
        raise ValueError(f"x, y: expected equal lengths, got {len(x)} and {len(y)}")
    if len(x) < 2:
        raise ValueError(f"x: need at least 2 points to fit, got {len(x)}")
    for name, a in (("x", x), ("y", y)):
        if not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise ValueError(f"{name}: a power-law fit needs finite, strictly positive values")
    beta, c, r2, se = _linregress(np.log(x), np.log(y))
    return PowerLawFit(beta=beta, intercept=c, r2=r2, stderr=se, n=len(x))


def tail_index(v, start: int | None = None, stop: int | None = None) -> TailFit:
    """Tail exponent ``a`` of ``λ_k ∝ k^(−a)`` over the rank window ``[start, stop)``.

    ``v``: 1-D spectrum in any order (sorted descending here). Window indices are 0-based into
    the sorted spectrum; defaults drop the first 5% (at least 1) and the last 20% of ranks,
    where finite-sample noise bends the curve. Non-positive values in the window are skipped.
    """
    start = _args.integer("start", start, optional=True)
    stop = _args.integer("stop", stop, optional=True)
    v = _as_1d("v", v)
    if not np.all(np.isfinite(v)):  # a NaN would sort first and shift every rank k by one
        raise ValueError("v: a tail fit needs a finite spectrum (it has NaN/Inf values)")
    v = np.sort(v)[::-1]
    D = len(v)
    if start is None:
        start = max(1, round(0.05 * D))
    if stop is None:
        stop = max(start + 2, int(0.8 * D))
    if not 0 <= start < stop <= D or stop - start < 2:
        raise ValueError(f"start, stop: expected 0 <= start < stop <= D={D} with >= 2 ranks, "
                         f"got start={start}, stop={stop}")
    k = np.arange(start + 1, stop + 1, dtype=float)
    w = v[start:stop]
    keep = w > 0
    if keep.sum() < 2:
        raise ValueError("v: fewer than 2 positive values in the fit window")
    slope, c, r2, se = _linregress(np.log(k[keep]), np.log(w[keep]))
    return TailFit(a=-slope, intercept=c, r2=r2, stderr=se, start=start, stop=stop)
