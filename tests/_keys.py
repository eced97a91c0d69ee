"""Synthetic attention keys for the exact-update tests: heads of low rank before RoPE, so their
``sv`` spectrum has singular values far below the largest (what float32 products would blur)."""
from __future__ import annotations

import torch


def lowrank_rope_keys(r: int, B: int = 2, H: int = 2, T: int = 512, D: int = 64, seed: int = 5,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Post-RoPE keys ``[B, H, T, D]`` of ``dtype`` whose pre-RoPE keys span an ``r``-dim subspace."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, H, T, r, generator=g, dtype=torch.float64)
    W = torch.randn(H, r, D, generator=g, dtype=torch.float64)
    k = torch.einsum("bhtr,hrd->bhtd", z, W)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-k[..., D // 2:], k[..., : D // 2]], -1)
    return (k * cos + rot * sin).to(dtype)
