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
    never sees it (it raises, or returns garbage, on NaN) and no host sync decides anything.

    A CPU batch that is all finite, the usual case, skips that rule: :func:`_surely_finite` checks
    with one reduction, and ``A`` goes to LAPACK as it is."""
    if _surely_finite(A):
        return torch.linalg.eigvalsh(A)
    # unsqueeze, not [..., None]: Ellipsis indexing breaks FakeTensorMode CUDA tensors on CPU builds
    bad = torch.isfinite(A).logical_not().tril_().flatten(-2).any(-1).unsqueeze(-1)  # [..., 1]
    w = torch.linalg.eigvalsh(torch.where(bad.unsqueeze(-1), 0, A))
    return w.masked_fill(bad, float("nan"))


def _surely_finite(A: Tensor) -> bool:
    """True when ``A`` certainly holds no NaN/Inf, decided by one sum; False also means "not
    checked here" (the exact per-matrix rule then runs).

    Why: the exact rule is seven passes over the batch (``isfinite`` alone is four aten ops), each
    a parallel region; for 16 matrices 32×32 that is ~50 µs next to LAPACK's ~290 µs on an idle
    2-thread CPU, and milliseconds when the threads wait for a busy machine's cores. A sum is
    finite only if every entry is (IEEE: NaN and ±Inf propagate through addition); a finite
    batch whose sum overflows gets False and the exact rule, which keeps it. NaN in the unread
    upper triangle also gives False, and the exact rule ignores it, as before.

    Only for plain CPU tensors outside tracing: reading the sum is a host sync on CUDA (the
    rule promises none), and a value-dependent branch is a graph break under ``torch.compile``,
    an error under ``vmap`` and a baked-in constant under ``torch.jit.trace``; fake and other
    subclassed tensors hold no values to read."""
    if (A.device.type != "cpu" or type(A) not in (Tensor, torch.nn.Parameter)
            or torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch._C._functorch.is_functorch_wrapped_tensor(A)):
        return False
    return bool(A.detach().sum().isfinite())
