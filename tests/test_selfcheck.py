"""First-use self-checks (fastspec/selfcheck.py): a kernel that gives a wrong answer is caught at its
first use, warned about once, never used again in the process, and the next candidate (ending at
the reference) serves; a kernel that cannot take one call's shape falls back for that call only.

Without a GPU, the kernels are stood in: the CUDA eigensolver through the stand-in driver of
tests/_fake_gpu.py (its launches run the host twin on the pointers the launcher packed; a
"broken" driver perturbs what they write), the exact covariance routes and the float32 Triton
update through stand-in functions (the reference's sums, perturbed or not). The checks' own
arithmetic (the cases, the bounds) is checked against the float64 reference directly.
"""
from __future__ import annotations

import ctypes
import warnings

import _fake_gpu
import pytest
import torch

import fastspec
from fastspec import preflight, selfcheck
from fastspec.covariance import routes
from fastspec.covariance.reference import CovPartials, covariance_partials_reference
from fastspec.eig import cuda, native, nvrtc, variants

needs_ext = pytest.mark.skipif(native._ext is None, reason=f"needs the host twin: {native._EXT_ERROR}")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Every verdict this test's own; checks on (whatever the caller's environment says)."""
    monkeypatch.setattr(selfcheck, "_results", {})
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    routes.forget()
    yield
    routes.forget()


def _self_check_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, selfcheck.SelfCheckWarning)]


# ---------------------------------------------------------------------------- the checks' arithmetic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [32, 128, 640])
def test_the_reference_passes_and_a_small_error_in_g_fails(dtype, D):
    """The bounds are tight enough to catch one wrong element (2^-40 relative), loose enough for
    the reference itself; the counts and the symmetry are exact."""
    for x, mask in selfcheck.rows(D, dtype, torch.device("cpu")):
        assert not x.is_contiguous() or x.shape[1] == 32 or x.shape[2] == 1  # the strided case, then the aligned one
        ref = covariance_partials_reference(x.double(), mask, 1, center=False)
        assert selfcheck.compare_raw(ref, x, mask) == ""
        assert int(ref.rejected.sum()) >= 2 and int(ref.n.min()) < x.shape[0] * x.shape[1]  # NaN rows, masks
        G = ref.G.clone()
        G[0, 1, 0] += G[0, 1, 0].abs() * 2.0**-40  # ~100x the float64 summation bound
        assert selfcheck.compare_raw(ref._replace(G=G), x, mask) == "G is not exactly symmetric"
        G[0, 0, 1] = G[0, 1, 0]
        assert "G[0, 0, 1]" in selfcheck.compare_raw(ref._replace(G=G), x, mask)  # symmetric, still wrong
        wrong_n = ref.n.clone()
        wrong_n[0] += 1
        assert "counts" in selfcheck.compare_raw(ref._replace(n=wrong_n), x, mask)
        for center in (False, True):
            fast = covariance_partials_reference(x, mask, 1, center=center)  # float32 sums: torch's own error
            assert selfcheck.compare_fast(fast, x, mask, center) == ""
            off = fast.G.clone()
            off[0] *= 1 + 1e-3  # a site's centred moments 1e-3 off: far beyond 4x torch float32's error
            assert "site 0" in selfcheck.compare_fast(fast._replace(G=off), x, mask, center)


@pytest.mark.parametrize("n", [2, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eigenvalue_cases_pass_torch_and_fail_a_small_shift(n, dtype):
    A, lam = selfcheck.spectra(n)
    Ad = A.to(dtype)
    bad = ~torch.isfinite(Ad).all(-1).all(-1)
    assert bad.tolist() == [False] * 5 + [True] and lam[-1].isnan().all()
    got = torch.linalg.eigvalsh(torch.where(bad[:, None, None], 0, Ad))
    got[bad] = float("nan")
    assert selfcheck.compare_eigenvalues(got, A, dtype) == ""
    assert (lam[:5] - got[:5].double()).abs().max() <= 1e-5 * lam[:5].abs().amax()  # the spectra are what they say
    assert "matrix 0" in selfcheck.compare_eigenvalues(got + 1e-4 * got[:1].abs().amax(), A, dtype)
    finite = got.clone()
    finite[-1] = 0
    assert "holds a NaN" in selfcheck.compare_eigenvalues(finite, A, dtype)


def test_a_check_runs_once_warns_once_and_never_while_tracing_or_capturing(monkeypatch):
    calls = []

    def case():
        calls.append(1)
        return "G[0, 0, 0] off"

    dev = torch.device("cpu")
    monkeypatch.setattr(selfcheck, "can_run_now", lambda device: False)  # a trace or a capture
    assert selfcheck.run(("k",), "kernel K", "config C", dev, case, "the reference") is None and not calls
    monkeypatch.undo()
    monkeypatch.setattr(selfcheck, "_results", {})
    with pytest.warns(selfcheck.SelfCheckWarning, match=r"kernel K \[config C\] on cpu gave a wrong answer: "
                                                        r"G\[0, 0, 0\] off; .* the reference serves instead"):
        assert selfcheck.run(("k",), "kernel K", "config C", dev, case, "the reference") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert selfcheck.run(("k",), "kernel K", "config C", dev, case, "the reference") is False
    assert calls == [1] and [c.ok for c in selfcheck.results()] == [False]
    monkeypatch.setenv(selfcheck.ENV, "0")
    assert selfcheck.run(("k2",), "kernel K", "config C", dev, case, "the reference") is True and calls == [1]
    monkeypatch.setenv(selfcheck.ENV, "1")

    def crash():
        raise IndexError("kernel read out of bounds")

    with pytest.warns(selfcheck.SelfCheckWarning, match="IndexError: kernel read out of bounds"):
        assert selfcheck.run(("k3",), "kernel K", "config C", dev, crash, "the reference") is False

    def unbuilt():
        raise nvrtc.KernelUnavailable("NVRTC could not compile it")

    with pytest.raises(nvrtc.KernelUnavailable):  # not a verdict: the caller's rule disables the kernel
        selfcheck.run(("k4",), "kernel K", "config C", dev, unbuilt, "the reference")
    assert ("k4",) not in selfcheck._results
    assert selfcheck.can_run_now(dev)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not selfcheck.can_run_now(dev)


# ---------------------------------------------------------------------- the CUDA eigensolver


class WrongDriver(_fake_gpu.FakeDriver):
    """The stand-in driver whose kernel writes eigenvalues off by 1e-3 relative: a kernel with a
    bug in its last step."""

    def cuLaunchKernel(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        super().cuLaunchKernel(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        addr = (ctypes.c_void_p * 8).from_address(params)
        out, batch = (ctypes.c_uint64.from_address(addr[i]).value for i in (1, 3))
        ctype = ctypes.c_float if self.dtype == "float32" else ctypes.c_double
        vals = (ctype * (batch * self.n)).from_address(out)
        for i in range(batch * self.n):
            vals[i] *= 1 + 1e-3
        return (0,)


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(n, wrong)``: cuda.py against the stand-in driver with self-checks on, NVRTC stood in."""
    def compile_variant(variant, target, extra_options=()):
        return nvrtc.Image(variant, target, b"\x7fELF (test)", "memory", 0.0, None)

    monkeypatch.setattr(nvrtc, "compile_variant", compile_variant)
    monkeypatch.setattr(nvrtc, "choose_target", lambda cc, archs=None: nvrtc.Target(90))
    monkeypatch.setattr(cuda, "_binding", [(True, "NVRTC (test)")])
    monkeypatch.delenv(variants.ENV, raising=False)

    def install(n: int, wrong: bool = False) -> _fake_gpu.FakeDriver:
        drv = _fake_gpu.install(monkeypatch, n, self_check=True)
        if wrong:
            bad = WrongDriver(n)
            bad.calls = drv.calls
            monkeypatch.setattr(cuda, "_driver", lambda: bad)
            return bad
        return drv
    return install


@needs_ext
def test_a_correct_eigensolver_is_checked_once_then_serves(gpu):
    drv = gpu(32)
    A = torch.randn(5, 32, 32, dtype=torch.float32)
    A = A + A.mT
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = native.cuda_eigvalsh(A)
        torch.testing.assert_close(out, torch.linalg.eigvalsh(A.double()).float(), atol=1e-4, rtol=0)
    assert [ln["batch"] for ln in drv.launches] == [6, 5, 5]  # the check's six matrices, once
    (check,) = selfcheck.results()
    assert check.ok and check.kernel == "the CUDA eigensolver's block algorithm" and check.config == "float32 n=32"


@needs_ext
def test_a_wrong_eigensolver_is_caught_warned_once_and_torch_serves(gpu, caplog):
    drv = gpu(32, wrong=True)
    A = torch.randn(5, 32, 32, dtype=torch.float32)
    A = A + A.mT
    with pytest.warns(selfcheck.SelfCheckWarning, match=r"block algorithm \[float32 n=32\] on cuda:0 gave a wrong "
                                                        r"answer: matrix 0: .*torch.linalg.eigvalsh serves"):
        out = native.cuda_eigvalsh(A)
    torch.testing.assert_close(out, torch.linalg.eigvalsh(A), atol=0, rtol=0)  # the reference's own answer
    launched = len(drv.launches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.SelfCheckWarning)
        again = native.cuda_eigvalsh(A)
    assert torch.equal(again, out) and len(drv.launches) == launched == 1  # the check's launch alone
    with pytest.raises(nvrtc.KernelUnavailable, match="failed its self-check"):
        cuda.prepare(32, "float32", 0, batch=5)


@needs_ext
def test_a_candidate_algorithm_that_fails_gives_way_to_block(gpu, monkeypatch):
    """The selection picks ``packed`` (forced here); it fails its check and block, checked in turn, serves."""
    drv = gpu(32)
    monkeypatch.setenv(variants.ENV, "packed")
    solve = drv.cuLaunchKernel
    seen = []

    def launch(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append(bx)
        solve(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        if len(seen) == 1:  # the first launch is packed's check: spoil it
            addr = (ctypes.c_void_p * 8).from_address(params)
            out = ctypes.c_uint64.from_address(addr[1]).value
            ctypes.c_float.from_address(out).value += 1.0
        return (0,)

    monkeypatch.setattr(drv, "cuLaunchKernel", launch)
    with pytest.warns(selfcheck.SelfCheckWarning, match=r"packed algorithm .* the block algorithm serves"):
        _, p = cuda.prepare(32, "float32", 0, batch=5)
    assert p.variant.algo == "block" and [c.ok for c in selfcheck.results()] == [False, True]


# ---------------------------------------------------------------------- the exact covariance routes


def _stand_in_route(monkeypatch, error: float = 0.0, limit_heads: int | None = None):
    """Make ``dmma`` a stand-in route on the CPU: the reference's float64 sums (G's element (1, 0)
    and (0, 1) off by ``error`` relative), refusing more than ``limit_heads`` heads as a shape past
    its limits. Returns the list its calls are recorded in."""
    calls = []

    def partials(x, mask, row_step):
        if limit_heads is not None and x.shape[2] > limit_heads:
            raise nvrtc.ShapeUnsupported(f"at most {limit_heads} heads (test)")
        calls.append(tuple(x.shape))
        p = covariance_partials_reference(x.double(), mask, row_step, center=False)
        G = p.G.clone()
        G[:, 1, 0] *= 1 + error
        G[:, 0, 1] = G[:, 1, 0]
        return CovPartials(p.n, torch.zeros_like(p.s), p.s, G, p.rejected)

    r = routes.ROUTES["dmma"]
    monkeypatch.setitem(routes.ROUTES, "dmma", routes.Route(r.name, r.what, lambda d, t, D: "", partials))
    for name in ("triton_f64", "prep_gemm"):  # under the interpreter they would run on the CPU: stood down
        r = routes.ROUTES[name]
        monkeypatch.setitem(routes.ROUTES, name, routes.Route(r.name, r.what, lambda d, t, D: "stood down (test)",
                                                              r.partials, r.accumulate))
    monkeypatch.setattr(routes, "GPU_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(routes, "_arch", lambda device: 90)
    monkeypatch.setattr(routes, "load_table", lambda path=None: [])
    monkeypatch.setattr(selfcheck, "DEVICE_TYPES", ("cuda", "cpu"))
    return calls


def _blocked_totals(x, S, D):
    want = fastspec.Covariance((S, D), track_mean=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(routes, "choose", lambda x, rows=None, skip=frozenset(): ("blocked", ""))
        want.update(x).update(x)
    return want


def test_a_correct_route_is_checked_once_then_serves(monkeypatch):
    calls = _stand_in_route(monkeypatch)
    x = torch.randn(2, 6, 2, 16).half()
    cov = fastspec.Covariance((2, 16), track_mean=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.SelfCheckWarning)
        cov.update(x).update(x)
    assert calls == [(2, 37, 3, 16), (2, 32, 3, 16), (2, 6, 2, 16), (2, 6, 2, 16)]  # the check's two cases, once
    assert [(c.kernel, c.config, c.ok) for c in selfcheck.results()] == [
        ("the exact covariance route dmma", "float16 D=16", True)]


def test_a_wrong_route_never_reaches_a_record(monkeypatch):
    """dmma off by 1e-9 relative in one element (far below what a spectrum would show, far above
    float64's summation error): caught by its first use's check, warned once, and blocked takes
    every update, bitwise what blocked alone gives."""
    calls = _stand_in_route(monkeypatch, error=1e-9)
    x = torch.randn(2, 6, 2, 16).half()
    want = _blocked_totals(x, 2, 16)
    cov = fastspec.Covariance((2, 16), track_mean=False)
    with pytest.warns(selfcheck.SelfCheckWarning, match=r"exact covariance route dmma \[float16 D=16\] on cpu gave a "
                                                        r"wrong answer: partials: G\[0, (0, 1|1, 0)\]"):
        cov.update(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.SelfCheckWarning)
        cov.update(x)
    assert calls == [(2, 37, 3, 16)]  # the check's first case, nothing else
    assert torch.equal(cov.gram(), want.gram()) and torch.equal(cov.n, want.n)
    assert "self-check" in routes.status("dmma", x.device, torch.float16, 16)
    assert routes.status("dmma", x.device, torch.float16, 32) == ""  # that configuration only
    assert routes.choose(x)[0] == "blocked"


def test_a_shape_past_a_routes_limits_falls_back_for_that_call_only(monkeypatch, caplog):
    calls = _stand_in_route(monkeypatch, limit_heads=3)
    wide, narrow = torch.randn(2, 6, 5, 16).half(), torch.randn(2, 6, 2, 16).half()
    cov5, cov2 = fastspec.Covariance((5, 16), track_mean=False), fastspec.Covariance((2, 16), track_mean=False)
    with caplog.at_level("WARNING", logger="fastspec"):
        cov5.update(wide)    # blocked, this call
        cov2.update(narrow)  # dmma again
        cov5.update(wide)
    assert calls == [(2, 37, 3, 16), (2, 32, 3, 16), (2, 6, 2, 16)] and not caplog.records
    assert routes.status("dmma", wide.device, torch.float16, 16) == ""
    want = _blocked_totals(wide, 5, 16)
    assert torch.equal(cov5.gram(), want.gram())
    monkeypatch.setenv(routes.ENV, "dmma")  # forced: a request, raised
    with pytest.raises(nvrtc.ShapeUnsupported, match="at most 3 heads"):
        cov5.update(wide)


def test_the_dmma_launcher_raises_shape_unsupported_past_its_limits(monkeypatch):
    from fastspec.covariance import gram_cuda

    monkeypatch.setattr(gram_cuda, "status", lambda device, D=None, dtype=None: "")
    x = torch.zeros(1, 1, gram_cuda.MAX_HEADS + 1, 32).expand(1, 1, gram_cuda.MAX_HEADS + 1, 32)
    with pytest.raises(nvrtc.ShapeUnsupported, match="65535 heads"):
        gram_cuda.partials_dmma(x)
    assert selfcheck.is_build_failure(nvrtc.KernelUnavailable("x")) and not selfcheck.is_build_failure(
        nvrtc.ShapeUnsupported("x"))


# -------------------------------------------------------------------- the float32 Triton update


def _stand_in_triton(monkeypatch, wrong: set[str]):
    """The Triton launcher stood in by the torch reference (float32 sums), a site's Gram 1e-3 off
    for the candidates named in ``wrong`` ("fixed": the fixed settings). Returns the candidates
    each call ran with."""
    tu = pytest.importorskip("fastspec.covariance.triton_update")
    seen = []

    def launcher(x, mask=None, row_step=1, center=True, *, candidate=None, **kw):
        name = "fixed" if candidate is None else candidate.name
        seen.append(name)
        p = covariance_partials_reference(x, mask, row_step, center)
        return p._replace(G=p.G * (1 + 1e-3)) if name in wrong else p

    monkeypatch.setattr(tu, "covariance_partials_triton", launcher)
    monkeypatch.setattr(tu, "_serving", {})
    monkeypatch.setattr(tu, "_broken", {})
    monkeypatch.setattr(selfcheck, "DEVICE_TYPES", ("cuda", "cpu"))
    return seen


@pytest.mark.parametrize("track_mean", [True, False])
def test_a_wrong_triton_kernel_gives_way_to_the_reference(monkeypatch, track_mean):
    seen = _stand_in_triton(monkeypatch, wrong={"fixed"})
    x = torch.randn(3, 5, 2, 32)
    cov = fastspec.Covariance((2, 32), track_mean=track_mean, backend="triton", precision="fast")
    with pytest.warns(selfcheck.SelfCheckWarning, match=r"Triton update \(the fused-row kernel\) \[float32 D=32 "
                                                        r".*the torch path serves"):
        cov.update(x)
    cov.update(x)
    assert seen == ["fixed"]  # the check's first case; the updates ran the torch path
    want = fastspec.Covariance((2, 32), track_mean=track_mean, backend="torch", precision="fast").update(x).update(x)
    assert torch.equal(cov.matrix("eig" if track_mean else "sv"), want.matrix("eig" if track_mean else "sv"))


def test_a_wrong_triton_candidate_gives_way_to_the_next(monkeypatch):
    from fastspec.covariance import triton_configs

    first, second = (c.name for c in triton_configs.CANDIDATES["keys"][:2])
    seen = _stand_in_triton(monkeypatch, wrong={first})
    x = torch.randn(2, 5, 2, 96).to(torch.float16)
    cov = fastspec.Covariance((2, 96), track_mean=True, backend="triton")
    with pytest.warns(selfcheck.SelfCheckWarning, match=rf"candidate {first}\) .* the next candidate serves"):
        cov.update(x)
    cov.update(x)
    assert seen == [first, second, second, second, second]  # first's check (fails at once), second's two, two updates
    monkeypatch.setenv(triton_configs.ENV, first)  # forced: a request, raised
    with pytest.raises(RuntimeError, match=f"{first}: the candidate failed its self-check"):
        cov.update(x)


# ------------------------------------------------------------------------ up front, and the CLI


def test_covariance_with_a_device_and_probe_attach_run_their_checks_up_front(monkeypatch):
    from _tiny_models import build

    asked = []
    monkeypatch.setattr(preflight, "up_front", lambda *a, **k: asked.append((a, k)))
    fastspec.Covariance((3, 16), device="cpu", track_mean=False)
    assert asked and asked[0][0][1:4] == (16, False, fastspec.Covariance((3, 16)).settings)
    asked.clear()
    monkeypatch.setattr(selfcheck, "DEVICE_TYPES", ("cuda", "cpu"))
    model = build("llama")
    cfg = model.config
    probe = fastspec.Probe(model, emit_every=1)
    probe.attach()
    probe.detach()
    probe.attach()  # once per probe
    probe.detach()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    assert [a[1:5] + a[5:] for a, _ in asked] == [
        (head_dim, False, probe.settings, kv, (torch.float32, torch.bfloat16)),
        (cfg.hidden_size, True, probe.settings, 1, (torch.float32, torch.bfloat16))]


def test_up_front_checks_the_route_an_update_will_take(monkeypatch):
    calls = _stand_in_route(monkeypatch, error=1e-9)
    with pytest.warns(selfcheck.SelfCheckWarning, match="exact covariance route dmma"):
        checks = preflight.up_front(torch.device("cpu"), 16, False, dtypes=(torch.float16,))
    assert [(c.config, c.ok) for c in checks] == [("float16 D=16", False)] and calls == [(2, 37, 3, 16)]
    x = torch.randn(2, 6, 2, 16).half()
    with warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.SelfCheckWarning)
        fastspec.Covariance((2, 16), track_mean=False).update(x)  # blocked serves, nothing to warn again
    assert calls == [(2, 37, 3, 16)]


def test_info_check_without_a_gpu_says_so(capsys):
    from fastspec.cli import main

    assert main(["info", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device visible to torch: the self-checks run fastspec's GPU kernels")


def test_every_configuration_lists_each_route_candidate_and_algorithm():
    rows = preflight.every_configuration(torch.device("cuda", 0))
    kernels = {k for k, _, _ in rows}
    assert {"exact route dmma", "exact route triton_f64", "exact route prep_gemm"} <= kernels
    assert {f"eigensolver {a}" for a in variants.names() if variants.takes(a, 128, "float32")} <= kernels
    try:
        from fastspec.covariance import triton_configs
    except ImportError:
        return
    for cands in triton_configs.CANDIDATES.values():
        assert {f"float32 Triton update ({c.name})" for c in cands} <= kernels


def test_a_triton_candidate_that_cannot_be_built_gives_way_to_the_next(monkeypatch, caplog):
    """What the arch compiles found (tests/test_arches.py): the default FFN setting asks more shared
    memory than an sm_86/89/120 block has, and Triton refuses its launch; the next candidate that
    builds and passes serves, with one log line, and no self-check verdict is recorded for it."""
    from fastspec.covariance import triton_configs

    OutOfResources = type("OutOfResources", (RuntimeError,), {"__module__": "triton.runtime.errors"})
    first, second = (c.name for c in triton_configs.CANDIDATES["ffn"][:2])
    seen = _stand_in_triton(monkeypatch, wrong=set())
    tu = pytest.importorskip("fastspec.covariance.triton_update")
    stand_in = tu.covariance_partials_triton

    def launcher(x, mask=None, row_step=1, center=True, *, candidate=None, **kw):
        if candidate is not None and candidate.name == first:
            raise OutOfResources("out of resource: shared memory, Required: 114688, Hardware limit: 101376")
        return stand_in(x, mask, row_step, center, candidate=candidate, **kw)

    monkeypatch.setattr(tu, "covariance_partials_triton", launcher)
    x = torch.randn(2, 5, 1, 160).to(torch.bfloat16)
    cov = fastspec.Covariance((1, 160), track_mean=True, backend="triton")
    with caplog.at_level("WARNING", logger="fastspec"), warnings.catch_warnings():
        warnings.simplefilter("error", selfcheck.SelfCheckWarning)
        cov.update(x)
    assert seen == [second, second, second]  # its check's two cases, then the update
    assert [c.config for c in selfcheck.results()] == ["bfloat16 D=160 centred"]
    assert sum(f"candidate {first}" in r.getMessage() and "could not be built" in r.getMessage()
               for r in caplog.records) == 1
