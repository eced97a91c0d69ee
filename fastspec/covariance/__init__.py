"""Streaming covariance of activations: accumulator, precision policy, torch paths and kernels."""
from .accumulator import Covariance, spectra
from .reference import CovPartials, covariance_partials_reference

__all__ = ["Covariance", "CovPartials", "covariance_partials_reference", "spectra"]
