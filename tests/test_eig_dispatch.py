"""fastspec.eigvalsh as the single switch point: backend choice, fallback log line, bad input,
the torch.library custom op (opcheck, fake impl, torch.compile) and the build of the extension."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fastspec
from fastspec.eig import dispatch, native
from fastspec.eig.cases import make_batch

needs_ext = pytest.mark.skipif(os.environ.get("FASTSPEC_NO_EXT") == "1", reason="FASTSPEC_NO_EXT=1")


def test_backends_report():
    b = fastspec.backends()
    assert set(b) == {"torch", "cuda", "host"}
    for name, info in b.items():
        assert isinstance(info["available"], bool) and isinstance(info["reason"], str) and info["reason"], name
    assert b["torch"]["available"]
    if not torch.cuda.is_available():
        assert not b["cuda"]["available"]


@needs_ext
def test_extension_has_cuda_when_nvcc_was_present():
    # CI builds with nvcc on PATH: the module must then contain the CUDA solver (a broken .cu
    # build fails `pip install`; this catches a build that silently went host-only)
    if shutil.which("nvcc") is None or os.environ.get("FASTSPEC_NO_CUDA") == "1":
        pytest.skip("no nvcc here: host-only build expected")
    from fastspec import _eig_ext

    assert _eig_ext.has_cuda and _eig_ext.max_n_cuda >= native.CUDA_MAX_N


def test_auto_on_cpu_is_torch():
    A = torch.from_numpy(make_batch("indefinite", 20, 3)).float()
    assert torch.equal(fastspec.eigvalsh(A), torch.linalg.eigvalsh(A))
    assert torch.equal(fastspec.eigvalsh(A, backend="torch"), torch.linalg.eigvalsh(A))


@pytest.mark.parametrize(
    "A, backend, exc, word",
    [
        (torch.zeros(3, 3, dtype=torch.int32), "auto", TypeError, "A"),
        (torch.zeros(3, 3, dtype=torch.complex64), "auto", TypeError, "A"),
        (torch.zeros(3, 4), "auto", ValueError, "A"),
        (torch.zeros(4), "auto", ValueError, "A"),
        (torch.zeros(3, 3), "lapack", ValueError, "backend"),
        (torch.zeros(3, 3), "cuda", ValueError, "A"),  # CPU tensor for the CUDA backend
    ],
)
def test_bad_input(A, backend, exc, word):
    with pytest.raises(exc, match=word):
        fastspec.eigvalsh(A, backend=backend)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="A"):
        fastspec.eigvalsh([[1.0]])


def _fake_cuda(shape, **kw):
    # FakeTensorMode lets a CPU-only machine build CUDA "tensors" (shape/dtype/device only):
    # enough to exercise the dispatch decisions and the op's fake implementation
    return torch.empty(shape, device="cuda", **kw)


def test_auto_fallback_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_fallback_logged", False)
    monkeypatch.setattr(native, "status", lambda backend: (False, "extension built without CUDA (test)"))
    with caplog.at_level(logging.WARNING, logger="fastspec"), FakeTensorMode():
        A = _fake_cuda((16, 128, 128))
        for _ in range(3):
            out = fastspec.eigvalsh(A)
            assert out.shape == (16, 128) and out.device.type == "cuda"
    lines = [r for r in caplog.records if r.name == "fastspec"]
    assert len(lines) == 1 and "built without CUDA (test)" in lines[0].getMessage()
    assert "torch.linalg.eigvalsh" in lines[0].getMessage()


def test_auto_choice(monkeypatch):
    monkeypatch.setattr(native, "status", lambda backend: (True, "pretend"))
    with FakeTensorMode():
        assert dispatch._auto(_fake_cuda((4, 128, 128))) == "cuda"
        assert dispatch._auto(_fake_cuda((4, 128, 128), dtype=torch.float64)) == "cuda"
        assert dispatch._auto(_fake_cuda((4, native.CUDA_MAX_N + 1, native.CUDA_MAX_N + 1))) == "torch"
        assert dispatch._auto(_fake_cuda((4, 64, 64)).requires_grad_()) == "torch"  # no autograd natively
        assert dispatch._auto(torch.empty(4, 64, 64)) == "torch"  # CPU: LAPACK beats the serial twin
        # chosen "cuda" goes through the custom op, whose fake impl gives the shape
        assert fastspec.eigvalsh(_fake_cuda((2, 3, 64, 64))).shape == (2, 3, 64)


def test_explicit_backend_unavailable_raises(monkeypatch):
    monkeypatch.setattr(native, "status", lambda backend: (False, "not built (test)"))
    with pytest.raises(RuntimeError, match="not built"):
        fastspec.eigvalsh(torch.eye(3), backend="host")


@needs_ext
@pytest.mark.parametrize("shape", [(5, 9, 9), (2, 3, 16, 16), (0, 4, 4), (3, 0, 0), (1, 1)])
def test_custom_op_opcheck(shape):
    A = torch.randn(shape)
    A = A + A.mT
    torch.library.opcheck(torch.ops.fastspec.eigvalsh.default, (A,))


@needs_ext
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    # aot_eager traces through the fake impl and functionalization without a C++ compile step
    torch._dynamo.reset()
    A = torch.from_numpy(make_batch("spd", 24, 4)).float()

    def f(x):
        return fastspec.eigvalsh(x, backend="host").sum(-1)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    assert torch.equal(compiled(A), f(A))
    B = torch.from_numpy(make_batch("spd", 24, 6)).float()  # new batch size: recompiles or stays symbolic
    assert torch.equal(compiled(B), f(B))


@needs_ext
def test_cuda_status_asks_the_extension_runtime(monkeypatch):
    # torch sees a GPU but the extension's static CUDA runtime does not (old driver): not usable,
    # with a reason; the check also traces under torch.compile (constant-folded)
    from fastspec import _eig_ext

    if not _eig_ext.has_cuda or torch.cuda.is_available():
        pytest.skip("needs a CUDA build on a machine without a GPU")
    monkeypatch.setattr(native, "_runtime_devices", [])
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + native._cuda_runtime_devices(), backend="eager", fullgraph=True)
    assert torch.equal(f(torch.zeros(3)), torch.zeros(3))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ok, reason = native.status("cuda")
    assert not ok and "runtime sees no device" in reason
