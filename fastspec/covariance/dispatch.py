"""Choose the implementation of one covariance update: plain torch or a Triton kernel.

Every backend is a function ``partials(x, mask, row_step, center) -> CovPartials`` with the
contract of :func:`fastspec.covariance.reference.covariance_partials_reference`.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from .reference import CovPartials, covariance_partials_reference

PartialsFn = Callable[[Tensor, "Tensor | None", int, bool], CovPartials]

BACKENDS = ("auto", "torch", "triton")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def _triton_partials() -> PartialsFn | None:
    """The Triton launcher, or None when Triton (or the kernel module) is unavailable."""
    try:
        from .triton_update import covariance_partials_triton
    except ImportError:
        return None
    return covariance_partials_triton


def select_partials(backend: str, x: Tensor) -> PartialsFn:
    """``auto``: Triton for CUDA tensors when it is importable, torch otherwise."""
    if backend == "torch":
        return covariance_partials_reference
    if backend == "triton":
        fn = _triton_partials()
        if fn is None:
            raise RuntimeError("backend='triton' requested but triton is not installed "
                               "(pip install 'fastspec[triton]')")
        return fn
    if x.is_cuda:
        fn = _triton_partials()
        if fn is not None:
            return fn
    return covariance_partials_reference
