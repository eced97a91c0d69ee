"""Batched symmetric eigenvalues: one switch point between torch.linalg and fastspec's solver."""
from .dispatch import backends, eigvalsh

__all__ = ["eigvalsh", "backends"]
