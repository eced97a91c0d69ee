"""fastspec.eigvalsh as the single switch point: solver choice, fallback log line, bad input,
the deprecated ``backend`` names, the torch.library custom op (opcheck, fake impl, torch.compile).
The CUDA kernel's run-time build and launcher: tests/test_eig_nvrtc.py; the limits:
tests/test_eig_limits.py."""
from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import fastspec
from fastspec.eig import dispatch, limits, native
from fastspec.eig.matrices import make_batch

needs_ext = pytest.mark.skipif(os.environ.get("FASTSPEC_NO_EXT") == "1", reason="FASTSPEC_NO_EXT=1")


def test_solvers_report():
    b = fastspec.solvers()
    assert set(b) == {"torch", "cuda", "host"}
    for name, info in b.items():
        assert isinstance(info["available"], bool) and isinstance(info["reason"], str) and info["reason"], name
    assert b["torch"]["available"]
    if not torch.cuda.is_available():
        assert not b["cuda"]["available"]


def test_auto_on_cpu_is_torch():
    A = torch.from_numpy(make_batch("indefinite", 20, 3)).float()
    assert torch.equal(fastspec.eigvalsh(A), torch.linalg.eigvalsh(A))
    assert torch.equal(fastspec.eigvalsh(A, solver="torch"), torch.linalg.eigvalsh(A))


@pytest.mark.parametrize(
    "A, solver, exc, word",
    [
        (torch.zeros(3, 3, dtype=torch.int32), "auto", TypeError, "A"),
        (torch.zeros(3, 3, dtype=torch.complex64), "auto", TypeError, "A"),
        (torch.zeros(3, 4), "auto", ValueError, "A"),
        (torch.zeros(4), "auto", ValueError, "A"),
        (torch.zeros(3, 3), "lapack", ValueError, "solver"),
        (torch.zeros(3, 3), "cuda", ValueError, "A"),  # CPU tensor for the CUDA solver
    ],
)
def test_bad_input(A, solver, exc, word):
    with pytest.raises(exc, match=word):
        fastspec.eigvalsh(A, solver=solver)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="A"):
        fastspec.eigvalsh([[1.0]])


def _fake_cuda(shape, **kw):
    # FakeTensorMode lets a CPU-only machine build CUDA "tensors" (shape/dtype/device only):
    # enough to exercise the dispatch decisions and the op's fake implementation
    return torch.empty(shape, device="cuda", **kw)


def test_auto_fallback_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(native, "_fallback_reasons", set())
    monkeypatch.setattr(native, "status", lambda solver: (False, "extension built without CUDA (test)"))
    with caplog.at_level(logging.WARNING, logger="fastspec"), FakeTensorMode():
        A = _fake_cuda((16, 128, 128))
        for _ in range(3):
            out = fastspec.eigvalsh(A)
            assert out.shape == (16, 128) and out.device.type == "cuda"
    lines = [r for r in caplog.records if r.name == "fastspec"]
    assert len(lines) == 1 and "built without CUDA (test)" in lines[0].getMessage()
    assert "torch.linalg.eigvalsh" in lines[0].getMessage()


def test_only_an_explicit_cuda_solver_compiles_before_the_op(monkeypatch):
    """``solver="cuda"`` prepares the kernel first, so a kernel that cannot be had raises; under
    ``"auto"`` the op itself falls back to torch (test_eig_nvrtc), so nothing may raise before it."""
    monkeypatch.setattr(native, "status", lambda solver: (True, "pretend"))
    prepared = []
    monkeypatch.setattr(dispatch, "_prepare_cuda", prepared.append)
    with FakeTensorMode():
        A = _fake_cuda((4, 64, 64))
        fastspec.eigvalsh(A)
        assert prepared == []
        fastspec.eigvalsh(A, solver="cuda")
        assert len(prepared) == 1 and prepared[0] is A


def test_auto_choice(monkeypatch):
    monkeypatch.setattr(native, "status", lambda solver: (True, "pretend"))
    with FakeTensorMode():
        assert dispatch._auto(_fake_cuda((4, 128, 128))) == "cuda"
        assert dispatch._auto(_fake_cuda((4, 128, 128), dtype=torch.float64)) == "cuda"
        n = limits.AUTO_MAX_N
        assert dispatch._auto(_fake_cuda((4, n, n))) == "cuda"
        assert dispatch._auto(_fake_cuda((4, n + 1, n + 1))) == "torch"
        assert dispatch._auto(_fake_cuda((4, 64, 64)).requires_grad_()) == "torch"  # no autograd natively
        assert dispatch._auto(torch.empty(4, 64, 64)) == "torch"  # CPU: LAPACK beats the serial twin
        # chosen "cuda" goes through the custom op, whose fake impl gives the shape
        assert fastspec.eigvalsh(_fake_cuda((2, 3, 64, 64))).shape == (2, 3, 64)


def test_explicit_solver_unavailable_raises(monkeypatch):
    monkeypatch.setattr(native, "status", lambda solver: (False, "not built (test)"))
    with pytest.raises(RuntimeError, match="not built"):
        fastspec.eigvalsh(torch.eye(3), solver="host")


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
        return fastspec.eigvalsh(x, solver="host").sum(-1)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    assert torch.equal(compiled(A), f(A))
    B = torch.from_numpy(make_batch("spd", 24, 6)).float()  # new batch size: recompiles or stays symbolic
    assert torch.equal(compiled(B), f(B))


def _nonfinite_batch(dtype):
    """[7, 5, 5]: symmetric matrices, 1, 3, 4 and 6 with NaN/Inf in the lower triangle (6 all NaN:
    LAPACK raises on it), 5 with NaN only above the diagonal (never read: a normal matrix)."""
    A = torch.from_numpy(make_batch("indefinite", 5, 7, seed=3)).to(dtype)
    A[1, 2, 1] = float("nan")
    A[3, 4, 4] = float("inf")
    A[4, 3, 0] = -float("inf")
    A[5] += torch.triu(torch.full((5, 5), float("nan"), dtype=dtype), diagonal=1)
    A[6] = float("nan")
    return A, [1, 3, 4, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", ["torch", "auto", pytest.param("host", marks=needs_ext)])
def test_nonfinite_matrix_gives_nan_row_on_every_solver(solver, dtype):
    A, bad = _nonfinite_batch(dtype)
    out = fastspec.eigvalsh(A, solver=solver)
    assert out.shape == (7, 5) and out.dtype == dtype
    for i in range(7):
        if i in bad:
            assert torch.isnan(out[i]).all(), i
        else:  # neighbours of a NaN matrix get what they get alone (LAPACK: to round-off, batched or not)
            torch.testing.assert_close(out[i], fastspec.eigvalsh(A[i], solver=solver))


def test_nonfinite_matrix_under_autograd_keeps_finite_gradients():
    A, _ = _nonfinite_batch(torch.float64)
    A.requires_grad_()
    fastspec.eigvalsh(A)[[0, 2, 5]].sum().backward()
    assert torch.isfinite(A.grad).all()
    torch.testing.assert_close(A.grad[0].tril(), torch.eye(5, dtype=torch.float64))  # d tr(A) / dA


class _OpLog(TorchDispatchMode):
    """Every aten op run inside the block: (op, its input tensors, its output tensors)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, self._tensors(args), self._tensors(out)))
        return out

    @staticmethod
    def _tensors(x) -> list:
        return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_cpu_batch_pays_no_full_size_pass_for_the_nan_guard(dtype):
    """The issue's batch (16 matrices 32×32 on CPU): before the solve the guard may only reduce
    (outputs of at most one value per matrix) or take views of ``A``, the solve gets ``A`` itself (no masked copy), and
    its result is returned as is. The full NaN rule (isfinite, tril_, any, where: seven passes over
    the batch, each its own parallel region, ~50 µs idle and milliseconds on a busy 2-core CPU)
    is only for a batch that holds a NaN/Inf somewhere (test_nonfinite_matrix_gives_nan_row_...)."""
    A = torch.randn(16, 32, 32, dtype=dtype)
    A = A + A.mT
    with _OpLog() as log:
        w = fastspec.eigvalsh(A)
    with _OpLog():  # (under a dispatch mode torch's eigvalsh computes eigenvectors too: other rounding)
        assert torch.equal(w, torch.linalg.eigvalsh(A))
    names = [str(op.overloadpacket) for op, _, _ in log.ops]
    solve = next(i for i, name in enumerate(names) if "eigh" in name)
    for op, _, outs in log.ops[:solve]:  # reductions, or views of A (detach): no batch-size temporary
        assert all(t.numel() <= 16 or t.untyped_storage().data_ptr() == A.untyped_storage().data_ptr()
                   for t in outs), (op, [tuple(t.shape) for t in outs], names)
    assert log.ops[solve][1][0].data_ptr() == A.data_ptr(), names  # A itself, not a copy
    assert names[solve + 1:] == [], names  # the solve's result, nothing masked afterwards
    assert "aten.tril_" not in names and "aten.where" not in names


def test_finite_entries_whose_sum_overflows_are_not_a_nan_matrix():
    """A cheap all-finite check that sums the batch must not take an overflow for a NaN: these
    entries are finite (their sum is not), so the eigenvalues are LAPACK's, not NaN."""
    A = torch.diag(torch.tensor([3e38, 3e38, -1.0]))[None].repeat(2, 1, 1)
    assert torch.isinf(A.sum())
    torch.testing.assert_close(fastspec.eigvalsh(A), torch.linalg.eigvalsh(A))
    assert torch.isfinite(fastspec.eigvalsh(A)).all()


def test_nan_guard_keeps_its_rule_under_vmap_and_compile():
    """Transforms that cannot branch on a value (vmap, dynamo) still get the NaN rule, sync-free."""
    A, bad = _nonfinite_batch(torch.float64)
    want = fastspec.eigvalsh(A)
    torch.testing.assert_close(torch.func.vmap(fastspec.eigvalsh)(A), want, equal_nan=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fastspec.eigvalsh(x), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(A), want, equal_nan=True)
    assert torch.isnan(want[bad]).all() and torch.isfinite(want[[0, 2, 5]]).all()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("solver", ["auto", pytest.param("host", marks=needs_ext)])
def test_numpy_array_in_numpy_array_out(solver, dtype):
    np = pytest.importorskip("numpy")
    if solver == "host" and dtype == "float16":
        pytest.skip("host takes float32/float64")
    a = make_batch("spd", 6, 3).astype(dtype)
    a_before = a.copy()
    out = fastspec.eigvalsh(a, solver=solver)
    assert type(out) is np.ndarray and out.dtype == a.dtype and out.shape == (3, 6)
    assert np.array_equal(out, fastspec.eigvalsh(torch.from_numpy(a), solver=solver).numpy())
    assert np.array_equal(a, a_before)  # zero-copy in, never written
    strided = a.transpose(0, 2, 1)  # a non-contiguous view: DLPack carries the strides
    assert np.array_equal(fastspec.eigvalsh(strided, solver=solver),
                          fastspec.eigvalsh(torch.from_numpy(a).mT, solver=solver).numpy())


@pytest.mark.gpu
def test_cupy_array_in_cupy_array_out():
    cupy = pytest.importorskip("cupy")
    a = cupy.asarray(make_batch("gram-activations", 64, 8)).astype(cupy.float32)
    out = fastspec.eigvalsh(a)
    assert type(out) is cupy.ndarray and out.dtype == a.dtype and out.shape == (8, 64)
    assert out.device.id == a.device.id
    want = fastspec.eigvalsh(torch.from_dlpack(a))
    assert torch.equal(torch.from_dlpack(out), want)


class _ForeignArray:
    """A DLPack producer from a library this test stands in for (module set per test)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_dlpack_result_goes_back_through_the_libraries_from_dlpack(monkeypatch):
    # a JAX array's type lives in jaxlib, its from_dlpack in jax.numpy; only imported modules are used
    stub = type(sys)("jax.numpy")
    stub.from_dlpack = lambda t: ("jax", t)
    monkeypatch.setitem(sys.modules, "jax.numpy", stub)
    monkeypatch.setattr(_ForeignArray, "__module__", "jaxlib._jax")
    A = torch.from_numpy(make_batch("spd", 4, 2))
    tag, out = fastspec.eigvalsh(_ForeignArray(A))
    assert tag == "jax" and torch.equal(out, fastspec.eigvalsh(A))
    monkeypatch.delitem(sys.modules, "jax.numpy")
    with pytest.raises(TypeError, match="^A: .*no from_dlpack"):
        fastspec.eigvalsh(_ForeignArray(A))


@pytest.mark.parametrize("bad", ["abc", [[1.0, 0.0], [0.0, 1.0]], None, torch.Tensor])
def test_non_array_input_names_the_argument(bad):
    with pytest.raises(TypeError, match="^A: expected a torch.Tensor or a DLPack array"):
        fastspec.eigvalsh(bad)


# ------------------------------------------------------------------- the deprecated backend names


def test_deprecated_backend_keyword_warns_and_solves_the_same():
    A = torch.from_numpy(make_batch("indefinite", 12, 3)).float()
    with pytest.warns(DeprecationWarning, match=r"backend= is deprecated, use solver=") as record:
        out = fastspec.eigvalsh(A, backend="torch")
    assert torch.equal(out, fastspec.eigvalsh(A, solver="torch"))
    assert len(record) == 1 and record[0].filename == __file__  # pointed at the caller, said once
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="^solver: expected one of"):
        fastspec.eigvalsh(A, backend="lapack")
    with pytest.raises(TypeError, match="^solver, backend: pass solver= alone"):
        fastspec.eigvalsh(A, solver="torch", backend="torch")
    # code traced with the old keyword keeps working: a warning inside dynamo would break the graph
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fastspec.eigvalsh(x, backend="torch"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(A), out)


def test_new_names_do_not_warn():
    A = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fastspec.eigvalsh(A, solver="torch")
        fastspec.solvers()
        assert fastspec.eig.SOLVERS == dispatch.SOLVERS == ("auto", "torch", "cuda", "host")


def test_deprecated_backends_names_warn_and_alias_the_new_ones():
    with pytest.warns(DeprecationWarning, match=r"backends\(\) is deprecated, use solvers\(\)"):
        assert fastspec.backends() == fastspec.solvers()
    for module in (fastspec.eig, dispatch):
        with pytest.warns(DeprecationWarning, match="BACKENDS is deprecated, use SOLVERS") as record:
            assert module.BACKENDS is dispatch.SOLVERS
        assert record[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'SOLVER'"):
        fastspec.eig.SOLVER  # noqa: B018 - the module __getattr__ still refuses unknown names
