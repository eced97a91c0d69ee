"""``fastspec.eigvalsh``: drop-in for ``torch.linalg.eigvalsh`` that picks the fastest solver.

Semantics match torch: ``A: [..., n, n]`` real symmetric (only the lower triangle is read),
result ``[..., n]`` ascending, same dtype as ``A``. Backends:

* ``"torch"``: ``torch.linalg.eigvalsh`` (the reference and the universal fallback).
* ``"auto"``: the fastest available backend for the input (today: torch).
"""
from __future__ import annotations

import torch
from torch import Tensor

BACKENDS = ("auto", "torch")


def _check(A: Tensor) -> None:
    if not isinstance(A, Tensor):
        raise TypeError(f"A: expected a torch.Tensor [..., n, n], got {type(A).__name__}")
    if A.is_complex() or not A.is_floating_point():
        raise TypeError(f"A: expected a real floating dtype, got {A.dtype}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A: expected square matrices [..., n, n], got shape {list(A.shape)}")


def eigvalsh(A: Tensor, *, backend: str = "auto") -> Tensor:
    """Eigenvalues of symmetric ``A: [..., n, n]``, ascending, ``[..., n]`` (lower triangle used)."""
    _check(A)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if A.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.eigvalsh(A.float()).to(A.dtype)
    return torch.linalg.eigvalsh(A)


def backends() -> dict[str, dict[str, object]]:
    """What each eigvalsh backend can do here: ``{name: {"available": bool, "reason": str}}``."""
    return {"torch": {"available": True, "reason": "torch.linalg.eigvalsh"}}
