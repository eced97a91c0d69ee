"""The precision and backend policy: which arithmetic every accumulator and eigensolve uses.

This module is the only place that decides it; :class:`fastspec.Covariance` and
:class:`fastspec.Probe` ask it. Two choices matter for accuracy:

**Products** (``precision``): the dtype in which ``x xᵀ`` is formed and summed within one update.
Totals across updates are always float64 (and counts int64).

* ``"fast"``: float32 products (the Triton kernels on CUDA, float32 BLAS on CPU), centred on a
  per-update shift when the accumulator tracks the mean. Every entry of ``G = Σxxᵀ`` then carries
  a relative error of ~1e-7, so an eigenvalue of ``G`` is known to about ``1e-7·λ_max``.
  For the ``eig`` convention that is harmless (PR of eigenvalues moves by ~1e-7). For ``sv``,
  ``σ = sqrt(λ)`` turns it into an absolute error of ``~3e-4·σ_max`` on every *small* singular
  value: the PR of a full-rank head is still exact to ~1e-8, but a head whose keys span a
  low-rank subspace before RoPE (the spectrum then has many singular values far below σ_max)
  moves by 5e-5 to 4e-4 relative against float64 ``svdvals`` (3.6e-4 in the CPU benchmark).
* ``"exact"``: float64 products (float64 BLAS ``syrk`` on CPU, cuBLAS DGEMM on CUDA) of rows
  converted block by block into one reused buffer; singular values resolved down to
  ``~1e-8·σ_max``: the key PR matches float64 ``svdvals`` to ~1e-8 also for rank-deficient
  heads. On CPU, ``syrk`` computes only one triangle, so float64 costs about what float32
  ``gemm`` does; on CUDA it is cheap where float64 runs at full rate (sm_60/70/80/90/100:
  P100, V100, A100, H100/H200, B200) and 32-64x slower on consumer GPUs.
* ``"auto"`` (default): ``"exact"`` for accumulators of raw sums (``track_mean=False``, the
  ``sv`` convention, e.g. keys) on CPU and on full-rate-float64 GPUs, ``"fast"`` everywhere
  else (centred accumulators, the ``eig`` convention, e.g. FFN inputs) and whenever
  ``backend="triton"`` is asked for explicitly.

**Eigensolve dtype** of :meth:`Covariance.spectrum`: float64 for ``sv`` everywhere (a float32
solve would add the same ``sqrt(eps32)·σ_max`` error as float32 products); for ``eig`` float32 on
CUDA (the batched solver) and float64 on CPU (LAPACK, about as fast as float32 at 128×128).

**Backend**: ``"triton"`` (float32 kernels, CUDA or the interpreter) or ``"torch"`` (the blocked
BLAS path of ``blocked.py``, any device). ``"auto"`` picks Triton for ``"fast"`` updates of CUDA
tensors when Triton is importable, the torch path otherwise. ``"exact"`` always runs the torch path.
``"inplace"`` (``inplace.py``, any device) multiplies blocks of rows straight into the totals,
with no ``D × D`` temporary: products in the totals' dtype (float64 totals: float64 products,
whatever ``precision``; float32 totals: float32), a workspace known in advance. A probe under a
memory budget gives it to its FFN sites (``fastspec.probe.plan``).

**Totals** (``Covariance(totals=...)``): float64 by default. float32 halves the memory of the
``D × D`` totals of a wide centred site, at a cost measured per metric in docs/scale.md (the
probe uses it only where a budget leaves no room for float64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._args import choice

PRECISIONS = ("auto", "exact", "fast")
BACKENDS = ("auto", "torch", "triton", "inplace")

# (major, minor) compute capabilities whose float64 throughput is 1/2 of float32 or better
_FULL_RATE_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}


@dataclass(frozen=True)
class UpdateSettings:
    """What a user chose for the covariance updates: ``precision`` (one of ``PRECISIONS``) and
    ``backend`` (one of ``BACKENDS``), checked here, once.

    :class:`fastspec.Probe` and :class:`fastspec.Covariance` build one from their public
    ``precision=``/``backend=`` arguments and hand it down unchanged (a probe's collectors give
    the same object to every accumulator); :func:`update_plan` turns it into the plan of one update.
    """

    precision: str = "auto"
    backend: str = "auto"

    def __post_init__(self):
        choice("precision", self.precision, PRECISIONS)
        choice("backend", self.backend, BACKENDS)


def full_rate_fp64(device: torch.device) -> bool:
    """Whether float64 matrix products run at (about) float32 speed on ``device``; CPUs: True."""
    if device.type != "cuda":
        return True
    return tuple(torch.cuda.get_device_capability(device)) in _FULL_RATE_FP64


class UpdatePlan(NamedTuple):
    """How one update is computed: ``products`` dtype and ``backend`` (``"torch"``/``"triton"``)."""

    products: torch.dtype
    backend: str


def update_plan(settings: UpdateSettings, track_mean: bool, x: torch.Tensor) -> UpdatePlan:
    """The plan for merging rows ``x`` into an accumulator (see the module docstring)."""
    precision, backend = settings.precision, settings.backend
    if backend == "inplace":  # the totals' dtype decides (ops.covariance_update dispatches it first)
        return UpdatePlan(torch.float64, "inplace")
    if x.dtype == torch.float64:
        exact = True  # float64 input keeps float64 products whatever the precision
    elif precision == "auto":  # an explicit backend="triton" asks for its float32 kernels
        exact = not track_mean and backend != "triton" and full_rate_fp64(x.device)
    else:
        exact = precision == "exact"
    if exact:
        if backend == "triton" and x.dtype != torch.float64:
            raise ValueError("backend: 'triton' accumulates float32 products; use precision='fast' "
                             "with it (or backend='auto' for float64 products)")
        return UpdatePlan(torch.float64, "torch")
    if backend == "triton" or (backend == "auto" and x.is_cuda and _triton_importable()):
        return UpdatePlan(torch.float32, "triton")
    return UpdatePlan(torch.float32, "torch")


def solve_dtype(convention: str, device: torch.device) -> torch.dtype:
    """Eigensolve precision for a spectrum of ``convention`` on ``device`` (module docstring)."""
    if convention == "sv" or device.type != "cuda":
        return torch.float64
    return torch.float32


_TRITON: bool | None = None


def _triton_importable() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            from . import triton_update  # noqa: F401
            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON
