"""What one ``fastspec.eigvalsh`` call costs on the CUDA path, counted on a machine without a GPU
(the call's own host cost, no hidden device work).

The launcher (fastspec/eig/cuda.py) runs against the stand-in driver of tests/_fake_gpu.py, whose
cuLaunchKernel solves with the host twin on the pointers and strides it was given. A CPU tensor
cannot take the public call's CUDA branch, so its entry points are called as that branch calls
them: ``dispatch._fast_cuda`` (what ``eigvalsh`` runs for a plain eager CUDA tensor after its
guard), ``native.cuda_eigvalsh`` and ``cuda.launch``. For one steady-state call the tests pin the
driver calls (exactly one: cuLaunchKernel), the torch ops (the output's allocation, and a view
where the batch shape needs one: no copy, no NaN pass, no ``.item()``) and what is not consulted
again (the plan, the selection table, the binding's import, torch's device switch and stream
objects, a sync). Then: the cached launch packs what :func:`cuda.launch_args` packs, results
through it across layouts, what empties the cache, the guard that keeps tracing, fake tensors and
modes on the op, and the benchmark's dry run (benchmarks/eig_call.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import _fake_gpu
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import fastspec
from fastspec.eig import cuda, dispatch, limits, native, nvrtc, variants
from fastspec.eig.matrices import make_batch

needs_ext = pytest.mark.skipif(native._ext is None, reason="host-twin extension not built")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(n, dtype)``: cuda.py against a fresh FakeDriver (tests/_fake_gpu.py). NVRTC is not
    run: the stand-in loads any bytes, and the images compiled are listed in ``drv.compiled``
    (a variant whose ``algo`` is in ``drv.broken`` raises KernelUnavailable instead)."""
    compiled: list = []
    broken: set = set()

    def compile_variant(variant, target, extra_options=()):
        compiled.append(variant)
        if variant.algo in broken:
            raise nvrtc.KernelUnavailable(f"NVRTC could not compile {variant.algo} (test)")
        return nvrtc.Image(variant, target, b"\x7fELF (test)", "memory", 0.0, None)

    monkeypatch.setattr(nvrtc, "compile_variant", compile_variant)
    monkeypatch.setattr(nvrtc, "choose_target", lambda cc, archs=None: nvrtc.Target(90))
    monkeypatch.setattr(cuda, "_binding", [(True, "NVRTC (test)")])
    monkeypatch.delenv(variants.ENV, raising=False)

    def install(n: int, dtype: str = "float32") -> _fake_gpu.FakeDriver:
        drv = _fake_gpu.install(monkeypatch, n, dtype=dtype)
        drv.compiled, drv.broken = compiled, broken
        return drv
    return install


class Ops(TorchDispatchMode):
    """Every aten op that reaches the dispatcher inside, by name (``aten.new_empty.default``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _forbid(monkeypatch, *targets) -> None:
    """Make each ``(object, name)`` raise when called: what a steady-state call must not do."""
    for obj, name in targets:
        monkeypatch.setattr(obj, name, _refuser(f"{getattr(obj, '__name__', obj)}.{name}"))


def _refuser(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a steady-state call used {what}")
    return refuse


def _steady(monkeypatch) -> None:
    """Forbid everything the first call of a problem does and a later one must not: plan and
    choose again, read the selection table, import the binding, switch the device, build a
    Stream object, synchronize."""
    _forbid(monkeypatch, (cuda, "prepare"), (cuda, "plan"), (cuda, "choose_variant"), (variants, "choose"),
            (variants, "load_table"), (variants.Row, "describe"), (nvrtc, "binding"), (cuda, "_driver"),
            (torch.cuda, "device"), (torch.cuda, "current_stream"), (torch.cuda, "synchronize"),
            (torch.Tensor, "item"), (torch.Tensor, "contiguous"))


def _batch(n: int, B: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """``[B, n, n]`` symmetric, NaN above the diagonal (never read: a stride mixed up reads it)."""
    base = torch.from_numpy(make_batch("indefinite", n, B, seed=seed)).to(dtype)
    return base.tril() + torch.full_like(base, float("nan")).triu(1)


def _want(A: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvalsh(A.tril().double() + A.tril(-1).double().mT).to(A.dtype)


ENTRIES = {
    "fast-auto": lambda A: dispatch._fast_cuda(A, "auto"),
    "fast-cuda": lambda A: dispatch._fast_cuda(A, "cuda"),
    "native": native.cuda_eigvalsh,
}


# ---------------------------------------------------------------------- one steady-state call


@needs_ext
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "batch-strided", "one-matrix", "4d"])
def test_a_steady_call_is_one_launch_and_one_allocation(gpu, monkeypatch, entry, layout):
    drv = gpu(64)
    M = _batch(64, 6)
    A = {"contiguous": M, "transposed": M.mT.contiguous().mT, "batch-strided": torch.stack([M, M], 1)[:, 0],
         "one-matrix": M[2], "4d": M.reshape(2, 3, 64, 64)}[layout]
    call = ENTRIES[entry]
    call(A)  # the problem's first call: compile, load, configure, plan
    assert drv.calls.count("cuLaunchKernel") == 1 and len(drv.loaded) == 1
    drv.calls.clear()
    _steady(monkeypatch)
    with Ops() as ops:
        out = call(A)
    assert drv.calls == ["cuLaunchKernel"]
    # the output, and a view where [2, 3] batch dims meet the kernel's one: nothing else
    assert ops.seen == ["aten.new_empty.default"] + (["aten.view.default"] if layout == "4d" else [])
    torch.testing.assert_close(out, _want(A), atol=1e-4, rtol=0)
    assert drv.launches[-1]["stream"] == _fake_gpu.STREAM and drv.launches[-1]["work"] == 0


@needs_ext
def test_launch_into_a_given_output_allocates_nothing(gpu, monkeypatch):
    drv = gpu(64)
    A = _batch(64, 4)
    out = torch.empty(4, 64)
    cuda.launch(A, out)
    drv.calls.clear()
    _steady(monkeypatch)
    with Ops() as ops:
        cuda.launch(A, out)
    assert ops.seen == [] and drv.calls == ["cuLaunchKernel"]
    torch.testing.assert_close(out, _want(A), atol=1e-4, rtol=0)


@needs_ext
def test_batch_dims_that_cannot_be_merged_are_copied_once(gpu, monkeypatch):
    """[3, 2, n, n] permuted: no view of it is [6, n, n], so reshape copies (the one case that may)."""
    drv = gpu(32)
    A = _batch(32, 6).reshape(2, 3, 32, 32).transpose(0, 1)
    native.cuda_eigvalsh(A)
    drv.calls.clear()
    _steady(monkeypatch)
    with Ops() as ops:
        out = native.cuda_eigvalsh(A)
    assert ops.seen == ["aten.new_empty.default", "aten.clone.default", "aten._unsafe_view.default"]
    assert drv.calls == ["cuLaunchKernel"]
    torch.testing.assert_close(out, _want(A), atol=1e-4, rtol=0)


@needs_ext
def test_workspace_path_allocates_its_workspace_and_nothing_more(gpu, monkeypatch):
    drv = gpu(240)  # fp32 n = 240 does not fit an H100 block's shared memory: a global workspace
    A = _batch(240, 3)
    native.cuda_eigvalsh(A)
    drv.calls.clear()
    _steady(monkeypatch)
    with Ops() as ops:
        out = native.cuda_eigvalsh(A)
    assert ops.seen == ["aten.new_empty.default", "aten.empty.memory_format"] and drv.calls == ["cuLaunchKernel"]
    assert drv.launches[-1]["work"] != 0
    torch.testing.assert_close(out, _want(A), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------- the cached launch


@needs_ext
@pytest.mark.parametrize("n, B, layout", [(64, 5, "contiguous"), (64, 5, "transposed"), (64, 5, "batch-strided"),
                                          (240, 3, "contiguous")])
def test_cached_launch_packs_what_launch_args_packs(gpu, n, B, layout):
    drv = gpu(n)
    M = _batch(n, B)
    A = {"contiguous": M, "transposed": M.mT.contiguous().mT, "batch-strided": torch.stack([M, M], 1)[:, 0]}[layout]
    out = torch.empty(B, n)
    for _ in range(2):  # the first call plans, the second reads the plan
        cuda.launch(A, out)
        work = drv.launches[-1]["work"]
        want = cuda.launch_args(A.data_ptr(), out.data_ptr(), work, B, A.stride(), out.stride(0))
        assert drv.params[-1] == [a.value or 0 for a in want]
        assert (work != 0) == (n == 240)
    first, second = drv.launches
    assert {k: v for k, v in first.items() if k != "work"} == {k: v for k, v in second.items() if k != "work"}
    p = cuda.plan(B, n, "float32", _fake_gpu.H100)
    assert first["grid"] == (p.grid, 1, 1) and first["block"] == (p.variant.threads, 1, 1)
    assert first["smem"] == p.smem


@needs_ext
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "batch-strided", "one-matrix", "4d", "4d-copied",
                                    "empty-batch"])
def test_results_through_the_cached_path(gpu, dtype, layout):
    n = 48
    gpu(n, dtype)
    M = _batch(n, 6, getattr(torch, dtype))
    A = {"contiguous": M, "transposed": M.mT.contiguous().mT, "batch-strided": torch.stack([M, M], 1)[:, 0],
         "one-matrix": M[4], "4d": M.reshape(2, 3, n, n), "4d-copied": M.reshape(2, 3, n, n).transpose(0, 1),
         "empty-batch": M[:0]}[layout]
    tol = 1e-4 if dtype == "float32" else 1e-10
    for _ in range(2):
        out = dispatch._fast_cuda(A, "auto")
        assert out.shape == A.shape[:-1] and out.dtype == A.dtype and out.is_contiguous()
        torch.testing.assert_close(out, _want(A), atol=tol, rtol=0)


@needs_ext
def test_each_thread_packs_its_own_parameters(gpu):
    """The parameter block is per thread: launches from several threads at once each solve their own input."""
    gpu(32)
    inputs = [_batch(32, 3, seed=s) for s in range(4)]
    wants = [_want(A) for A in inputs]
    native.cuda_eigvalsh(inputs[0])
    bad: list = []

    def work(i: int) -> None:
        for _ in range(25):
            if not torch.allclose(native.cuda_eigvalsh(inputs[i]), wants[i], atol=1e-4, rtol=0):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


@needs_ext
def test_forget_and_a_changed_override_make_a_new_plan(gpu, monkeypatch):
    drv = gpu(64)
    prepared = []
    real = cuda.prepare

    def counting(*args, **kwargs):
        prepared.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda, "prepare", counting)
    A = _batch(64, 4)
    for _ in range(3):
        native.cuda_eigvalsh(A)
    assert len(prepared) == 1 and len(drv.loaded) == 1
    native.cuda_eigvalsh(_batch(64, 5))  # another batch: another plan (the choice depends on it), same kernel
    assert len(prepared) == 2 and len(drv.loaded) == 1
    cuda.forget()  # the kernels and the plans: the next call loads again
    native.cuda_eigvalsh(A)
    assert len(prepared) == 3 and len(drv.loaded) == 2
    monkeypatch.setenv(variants.ENV, "packed")  # takes effect at the next call
    out = native.cuda_eigvalsh(A)
    assert len(prepared) == 4 and drv.compiled[-1].algo == "packed"
    assert drv.launches[-1]["smem"] == cuda.smem_bytes(64, "float32", True, "packed")
    torch.testing.assert_close(out, _want(A), atol=1e-4, rtol=0)
    monkeypatch.delenv(variants.ENV)  # back to the plan made without it: no new plan
    native.cuda_eigvalsh(A)
    assert len(prepared) == 4 and drv.launches[-1]["smem"] == cuda.smem_bytes(64, "float32", True)


@needs_ext
def test_a_forced_algorithm_that_cannot_be_had_falls_back_to_block_once(gpu, monkeypatch, caplog):
    drv = gpu(64)
    drv.broken.add("packed")
    monkeypatch.setenv(variants.ENV, "packed")
    monkeypatch.setattr(variants, "_said", set())
    A = _batch(64, 4)
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        for _ in range(3):
            torch.testing.assert_close(native.cuda_eigvalsh(A), _want(A), atol=1e-4, rtol=0)
    assert [v.algo for v in drv.compiled] == ["packed", "block"]
    assert [r.getMessage() for r in caplog.records].count(
        "fastspec.eigvalsh: the packed algorithm (forced by FASTSPEC_EIG_VARIANT=packed) cannot be had "
        "(NVRTC could not compile packed (test)); using block") == 1
    assert len(caplog.records) == 1
    assert {launch["smem"] for launch in drv.launches} == {cuda.smem_bytes(64, "float32", True)}


def test_the_device_is_switched_only_when_another_is_current(gpu, monkeypatch):
    drv = gpu(64)
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    streams = []
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(cuda, "_raw_stream", lambda index: 100 + index)
    monkeypatch.setattr(drv, "cuLaunchKernel", lambda *args: streams.append(args[8]) or (0,))  # no parameters read
    for index in (0, 3, 0):
        cuda._launch_on(drv, index, ("kernel", b"k"), (1, 1, 1), (32, 1, 1), 0, 0)
    assert entered == [3] and streams == [100, 103, 100]  # each on its own device's current stream


def test_a_failed_launch_raises_with_the_drivers_reason(gpu, monkeypatch):
    drv = gpu(64)
    monkeypatch.setattr(drv, "cuLaunchKernel", lambda *args: (types_result(701),))
    with pytest.raises(nvrtc.KernelUnavailable, match="cuLaunchKernel failed"):
        cuda._launch_on(drv, 0, ("kernel", b"k"), (1, 1, 1), (32, 1, 1), 0, 0)


def types_result(code: int):
    """A CUresult stand-in: an int with a name, as cuda.bindings' enums are."""
    class Result(int):
        name = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    return Result(code)


# ----------------------------------------------------------------------- the dispatch's fast path


@needs_ext
def test_fast_path_takes_only_the_common_call(gpu, monkeypatch):
    """Anything else is None: the general path then decides, raises or falls back as it always did."""
    gpu(8)
    A = _batch(8, 2)
    assert dispatch._fast_cuda(A, "auto") is not None
    assert dispatch._fast_cuda(A.half(), "auto") is None  # solved in float32 by the general path
    assert dispatch._fast_cuda(A.requires_grad_(), "auto") is None  # autograd: torch's solver
    assert dispatch._fast_cuda(torch.zeros(3, 4), "auto") is None
    assert dispatch._fast_cuda(torch.zeros(4), "auto") is None
    assert dispatch._fast_cuda(torch.zeros(2, 0, 0), "auto") is None
    big = torch.zeros(1, limits.AUTO_MAX_N + 1, limits.AUTO_MAX_N + 1)
    assert dispatch._fast_cuda(big, "auto") is None  # past "auto"'s limit: torch
    if limits.AUTO_MAX_N < limits.MAX_N:
        gpu(limits.AUTO_MAX_N + 1)
        assert dispatch._fast_cuda(big, "cuda") is not None
    monkeypatch.setattr(cuda, "_binding", [(False, "no binding (test)")])
    assert dispatch._fast_cuda(A.detach(), "auto") is None


@needs_ext
def test_fast_path_explicit_cuda_raises_and_auto_falls_back(gpu, monkeypatch, caplog):
    drv = gpu(16)
    drv.broken.add("block")
    monkeypatch.setattr(native, "_fallback_reasons", set())
    A = _batch(16, 3)
    with pytest.raises(RuntimeError, match=r"^solver: 'cuda' unavailable: NVRTC could not compile block \(test\)$"):
        dispatch._fast_cuda(A, "cuda")
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        for _ in range(2):
            torch.testing.assert_close(dispatch._fast_cuda(A, "auto"), _want(A), atol=1e-4, rtol=0)
    assert len(caplog.records) == 1 and "torch.linalg.eigvalsh" in caplog.records[0].getMessage()


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_means_nothing_traces_or_intercepts():
    A = torch.eye(3)
    assert dispatch._eager_now() and dispatch._eager(A)
    with FakeTensorMode():
        assert not dispatch._eager_now()
    with _Passthrough():
        assert not dispatch._eager_now()
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not dispatch._eager_now()
    seen = []
    torch.vmap(lambda x: seen.append(dispatch._eager_now()) or x)(torch.zeros(2, 3))
    assert seen == [False]
    assert not dispatch._eager(torch.nn.Parameter(A))  # a subclass: its own __torch_function__ may differ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated, not gone
        torch.jit.trace(lambda x: seen.append(dispatch._eager_now()) or x * 2, torch.zeros(2), check_trace=False)
    assert seen == [False, False]

    def traced(x):
        return x + float(dispatch._eager_now())

    assert torch.compile(traced, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 0.0
    torch._dynamo.reset()


def _ops_seen(fn) -> list[str]:
    """Names of the ops torch.profiler records in ``fn()`` (it sees ops without being a mode)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


@needs_ext
def test_an_eager_call_skips_the_op_and_an_intercepted_one_keeps_it():
    A = torch.from_numpy(make_batch("spd", 12, 3)).float()
    want = fastspec.eigvalsh(A, solver="host")
    eager = _ops_seen(lambda: fastspec.eigvalsh(A, solver="host"))
    assert "fastspec::eigvalsh" not in eager and eager.count("aten::empty") == 1  # the output alone
    with torch.device("cpu"):
        moded = _ops_seen(lambda: torch.testing.assert_close(fastspec.eigvalsh(A, solver="host"), want))
    assert "fastspec::eigvalsh" in moded
    with _Passthrough():
        assert torch.equal(fastspec.eigvalsh(A, solver="host"), want)


@pytest.mark.gpu
def test_on_a_gpu_the_public_call_takes_the_fast_path(monkeypatch):
    A = torch.from_numpy(make_batch("spd", 64, 8)).float().cuda()
    want = torch.linalg.eigvalsh(A.double()).float()
    taken = []
    real = dispatch._fast_cuda
    monkeypatch.setattr(dispatch, "_fast_cuda", lambda A, solver: taken.append(solver) or real(A, solver))
    ops = _ops_seen(lambda: fastspec.eigvalsh(A))
    assert taken == ["auto"] and "fastspec::eigvalsh" not in ops
    assert not any(op in ops for op in ("aten::copy_", "aten::isnan", "aten::any", "aten::item",
                                        "aten::_local_scalar_dense", "aten::contiguous"))
    assert (fastspec.eigvalsh(A) - want).abs().max() <= 1e-5 * want.abs().max()


# ------------------------------------------------------------------------------ the benchmark


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eig_call.py"), *args], capture_output=True,
                          text=True, check=False, cwd=ROOT, timeout=300)


def test_benchmark_dry_run_writes_every_field(tmp_path):
    out = tmp_path / "call.json"
    proc = _bench("--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fastspec-eig-call-1" and doc["dry_run"] is True and doc["skipped"] == []
    assert {"fastspec", "python", "torch", "device"} <= set(doc["environment"])
    assert doc["calls"] == 200 and doc["levels"] == ["public", "fast", "op", "native", "launch"]
    assert [(r["name"], r["n"], r["dtype"]) for r in doc["shapes"]] == [("kernel", 128, "float32"),
                                                                        ("probe-keys", 128, "float64")]
    for r in doc["shapes"]:
        assert set(r["host_us"]) == set(doc["levels"]) and all(v > 0 for v in r["host_us"].values()), r
        assert set(r["plan"]) >= {"algo", "grid", "threads", "smem", "workspace"}
        assert r["events_us"] is r["device_us"] is r["graphed_us"] is r["kernel_us"] is None
        assert r["verdict"].startswith("dry run")
    assert "verdict: dry run" in proc.stdout


def test_benchmark_stops_at_its_time_limit(tmp_path):
    out = tmp_path / "call.json"
    proc = _bench("--dry-run", "--json", str(out), "--time-limit", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["skipped"] == ["kernel: everything", "probe-keys: everything"]
    assert all(r["host_us"] == {} for r in doc["shapes"]) and "not run (time limit)" in proc.stdout
    proc = _bench("--dry-run", "--json", str(out), "--time-limit", "-1")
    assert proc.returncode == 2 and "--time-limit: expected seconds >= 0, got -1" in proc.stderr


def test_benchmark_verdict_names_the_gap():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import eig_call
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    row = {"host_us": {"public": 165.0}, "events_us": 3010.0, "device_us": 2470.0, "kernel_us": 2460.0}
    assert eig_call.verdict(row).startswith("the host: a synchronized call waits 540 µs")
    assert "375 µs more than the call's host time" in eig_call.verdict(row)
    assert eig_call.verdict({**row, "device_us": 2900.0}).startswith("hidden device work")
    assert eig_call.verdict({**row, "events_us": 2480.0}).startswith("no gap")
    assert eig_call.verdict({**row, "kernel_us": None}) == "incomplete: kernel_us not measured"
    d = eig_call.differences({**row, "graphed_us": 2460.0})
    assert d == {"events_minus_graphed": 550.0, "events_minus_device": 540.0, "device_minus_kernel": 10.0,
                 "graphed_minus_kernel": 0.0}
