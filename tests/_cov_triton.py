"""What the Triton covariance kernels' test modules share (tests/test_covariance_triton.py, its
launch-setting candidates in tests/test_covariance_triton_configs.py): the device, the tolerance
rule against fp64 and the torch reference, and two autouse fixtures (import them into a module).

Tolerance rule (flash-attention style): for each case, the kernel's error against an fp64
ground truth on the same input must be at most ``RATIO`` × the error of the torch reference
(which accumulates in fp32 too) plus a floor of ``FLOOR`` (a few fp32 ulps of the result,
for cases where torch happens to be nearly exact). Errors are on what the caller uses: the
chunk mean ``c + s/n`` and centered sum ``G − s sᵀ/n`` (independent of the chosen center ``c``),
or the raw ``Σx``, ``Σxxᵀ`` when ``center=False``.
"""
from __future__ import annotations

import pytest
import torch

from fastspec.covariance import triton_update as tu
from fastspec.covariance.reference import covariance_partials_reference as reference
from fastspec.covariance.triton_update import covariance_partials_triton as kernel

RATIO = 4.0
FLOOR = 8 * 2.0**-24
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# the real kernels where there is a GPU (conftest leaves TRITON_INTERPRET unset), the interpreter
# on CPU tensors otherwise: the same tests check both
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _nan_filled_buffers(monkeypatch):
    """Kernel outputs start as NaN (or -1 for ints): an unwritten entry cannot pass as 0."""

    def empty(*shape, dtype=torch.float32, device=None):
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(tu, "_empty", empty)


@pytest.fixture(autouse=True)
def _fp32_torch_yardstick():
    """The torch reference's CUDA matmuls stay fp32 (TF32 would loosen every RATIO bound)."""
    # not monkeypatch: allow_tf32 lives behind the module's __getattr__/__setattr__, and
    # pytest >= 9 undoes an attribute missing from the instance __dict__ with delattr (fails)
    matmul = torch.backends.cuda.matmul
    old, matmul.allow_tf32 = matmul.allow_tf32, False
    yield
    matmul.allow_tf32 = old


def _stats(p, center: bool):
    """(n, first, second) in fp64: mean and centered sum, or raw Σx and Σxxᵀ."""
    n = p.n.double()
    c, s, G = p.c.double(), p.s.double(), p.G.double()
    if center:
        nn = n.clamp_min(1)[:, None]
        return n, c + s / nn, G - s[:, :, None] * s[:, None, :] / nn[..., None]
    cs = c[:, :, None] * s[:, None, :]
    return n, s + n[:, None] * c, G + cs + cs.transpose(1, 2) + n[:, None, None] * c[:, :, None] * c[:, None, :]


def _errors(p, truth, center: bool):
    n, a1, a2 = _stats(p, center)
    _, t1, t2 = _stats(truth, center)
    scale1 = t1.norm() + (t2.diagonal(dim1=1, dim2=2).sum(-1) / n.clamp_min(1)).sum().sqrt()
    return ((a1 - t1).norm() / scale1).item(), ((a2 - t2).norm() / t2.norm()).item()


def check_against_fp64(x, mask=None, row_step=1, center=True, split=None, **launch):
    """Run kernel and torch reference; both vs fp64 truth on the same (possibly low-precision) x."""
    got = kernel(x, mask, row_step, center, split=split, **launch)
    ref = reference(x, mask, row_step, center)
    truth = reference(x.double(), mask, row_step, center)
    assert got.n.dtype == got.rejected.dtype == torch.int64
    assert got.G.dtype == got.s.dtype == torch.float32
    assert got.n.tolist() == truth.n.tolist()
    assert got.rejected.tolist() == truth.rejected.tolist()
    # exactly symmetric, split or not (diagonal tiles symmetrized in-kernel, the rest mirrored)
    assert torch.equal(got.G, got.G.mT)
    e1, e2 = _errors(got, truth, center)
    r1, r2 = _errors(ref, truth, center)
    assert e1 <= RATIO * r1 + FLOOR, f"first moment: kernel {e1:.3g} vs torch {r1:.3g}"
    assert e2 <= RATIO * r2 + FLOOR, f"second moment: kernel {e2:.3g} vs torch {r2:.3g}"
    return got
