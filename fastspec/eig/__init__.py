"""Batched symmetric eigenvalues: one switch point (dispatch.py) between torch.linalg and
fastspec's native solver (csrc/: CUDA kernel + host twin, launched from native.py)."""
from .dispatch import BACKENDS, backends, eigvalsh

__all__ = ["BACKENDS", "eigvalsh", "backends"]
