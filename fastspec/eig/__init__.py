"""Batched symmetric eigenvalues: one switch point (dispatch.py) between torch.linalg and
fastspec's native solver, whose sources are in fastspec/eig/csrc/: the CUDA kernel, compiled at
first use by NVRTC (nvrtc.py) and launched on torch's stream (cuda.py), and its host twin
(native.py, the custom op both run through)."""
from .dispatch import BACKENDS, backends, eigvalsh

__all__ = ["BACKENDS", "eigvalsh", "backends"]
