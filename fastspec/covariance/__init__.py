"""Streaming covariance of activations: the accumulator, its precision policy, torch paths,
Triton kernels, the plain-torch reference and the distributed merge (docs/accumulators.md)."""
from .covariance import CONVENTIONS, Covariance, spectra
from .reference import CovPartials, covariance_partials_reference

__all__ = ["CONVENTIONS", "Covariance", "CovPartials", "covariance_partials_reference", "spectra"]
