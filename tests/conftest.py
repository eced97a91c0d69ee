"""Set-up of tests/: the Triton interpreter without CUDA, and a fixed seed per test.

The tiers (``--full``) and the ``gpu`` marker are the repository's ``conftest.py``: the benchmarks' checks
share them."""
from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run under the interpreter on CPU tensors. triton.jit reads this
# when a kernel is decorated, so it must be set before any test module imports triton (torch
# itself does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

