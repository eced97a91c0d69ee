"""Streaming covariance of activations: accumulator, torch reference and kernels (SPEC.md §1)."""
from .accumulator import Covariance
from .reference import CovPartials, covariance_partials_reference

__all__ = ["Covariance", "CovPartials", "covariance_partials_reference"]
