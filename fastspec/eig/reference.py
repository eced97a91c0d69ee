"""Plain-torch reference of ``fastspec.eigvalsh``: the ``"torch"`` solver (docs/kernels.md).

``torch.linalg.eigvalsh`` with the native solvers' NaN rule. It is what ``solver="auto"`` runs
wherever the native kernel does not apply (CPU, gradients, ``n > AUTO_MAX_N``), the fallback of
the custom op when the CUDA kernel cannot be had, and the baseline the native solvers' accuracy is
measured against (tests/test_eig_host.py, tests/test_eig_cuda.py; their float64 reference is NumPy).

    A: [..., n, n]   real symmetric, lower triangle read (torch.linalg's rule)
    w: [..., n]      ascending, A's dtype; every entry NaN for a matrix whose lower triangle
                     holds a NaN/Inf, its batch neighbours unaffected
"""
from __future__ import annotations

import torch
from torch import Tensor


def eigvalsh_reference(A: Tensor) -> Tensor:
    """Eigenvalues ``[..., n]`` of ``A: [..., n, n]`` by ``torch.linalg.eigvalsh``, NaN rows for
    non-finite matrices (module docstring). A bad matrix is solved as a zero matrix, so LAPACK
    never sees it (it raises, or returns garbage, on NaN) and no host sync decides anything."""
    # unsqueeze, not [..., None]: Ellipsis indexing breaks FakeTensorMode CUDA tensors on CPU builds
    bad = torch.isfinite(A).logical_not().tril_().flatten(-2).any(-1).unsqueeze(-1)  # [..., 1]
    w = torch.linalg.eigvalsh(torch.where(bad.unsqueeze(-1), 0, A))
    return w.masked_fill(bad, float("nan"))
