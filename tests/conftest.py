"""Shared test fixtures: seeding, devices, and fp64 ground truth helpers."""
from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run under the interpreter on CPU tensors. triton.jit reads this
# when a kernel is decorated, so it must be set before any test module imports triton (torch
# itself does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # tests marked gpu skip cleanly without CUDA
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
