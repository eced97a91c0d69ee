"""The exact covariance update's routes (``fastspec/covariance/routes.py``): which one runs, that
every route runs behind the one op with the same results, and what one update dispatches.

Without a GPU the Triton routes run under ``TRITON_INTERPRET=1`` (conftest) on CPU tensors and
the ``dmma`` route's arithmetic is checked in ``tests/test_cov_gram_cuda.py``; the choice among
routes for a CUDA device is checked here with the device's properties stood in for.
"""
from __future__ import annotations

import collections
import json

import pytest
import torch
from _keys import lowrank_rope_keys
from torch.utils._python_dispatch import TorchDispatchMode

import fastspec
from fastspec.covariance import blocked, ops, routes
from fastspec.metrics import participation_ratio

CUDA0 = torch.device("cuda", 0)
# the interpreter's numpy computes inf - inf on the way to flagging a row
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(routes.ENV, raising=False)
    routes.forget()
    yield
    routes.forget()


def _on_cpu(name: str) -> str:
    """Why route ``name`` cannot run on CPU tensors here ("" when it can)."""
    try:
        return routes.ROUTES[name].status(torch.device("cpu"), torch.float16, 32)
    except ImportError as exc:  # triton missing
        return str(exc)


CPU_ROUTES = [pytest.param(n, marks=pytest.mark.skipif(bool(_on_cpu(n)), reason=_on_cpu(n) or "runs"))
              for n in routes.ROUTES]


# ------------------------------------------------------------------------------- the choice


def _fake_cuda(monkeypatch, arch=90, available=("dmma", "triton_f64", "prep_gemm", "blocked"), table=()):
    """Stand in a CUDA device of compute capability ``arch`` on which the routes ``available``
    can run, and a route table of ``table`` rows."""
    monkeypatch.setattr(routes, "_arch", lambda device: arch)
    for name, r in list(routes.ROUTES.items()):
        why = "" if name in available else f"{name} stood down by the test"
        monkeypatch.setitem(routes.ROUTES, name, routes.Route(r.name, r.what, lambda d, t, D, w=why: w, r.partials,
                                                              r.accumulate))
    monkeypatch.setattr(routes, "load_table", lambda path=None: [routes.Row.from_json(d) for d in table])


def _row(route, rows=(12288, None), dtype="bfloat16", D=128, arch=90):
    return {"arch": arch, "dtype": dtype, "D": D, "rows": list(rows), "route": route,
            "measured": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01", "device_us": {route: 40.0}}}


def test_cpu_tensors_take_the_blocked_route():
    x = torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)
    name, why = routes.choose(x)
    assert name == "blocked" and "syrk" in why


def test_without_a_table_row_the_first_route_that_runs_in_the_predicted_order(monkeypatch):
    _fake_cuda(monkeypatch)
    assert routes._choose(CUDA0, torch.bfloat16, 128, 16384, "")[0] == "dmma"
    _fake_cuda(monkeypatch, available=("prep_gemm", "blocked"))  # e.g. no NVRTC, Triton 3.6
    name, why = routes._choose(CUDA0, torch.bfloat16, 128, 16384, "")
    assert name == "prep_gemm" and "no measured row for sm_90 bfloat16 D=128" in why
    assert "not dmma (dmma stood down" in why and "not triton_f64" in why


def test_a_table_row_wins_where_it_matches(monkeypatch):
    _fake_cuda(monkeypatch, table=[_row("prep_gemm"), _row("triton_f64", rows=(0, 12287))])
    name, why = routes._choose(CUDA0, torch.bfloat16, 128, 16384, "")
    assert name == "prep_gemm" and why.startswith("measured on NVIDIA H100 80GB HBM3 2026-12-01")
    assert routes._choose(CUDA0, torch.bfloat16, 128, 8192, "")[0] == "triton_f64"
    # another dtype, D or arch: no row matches, the predicted order decides
    assert routes._choose(CUDA0, torch.float16, 128, 16384, "")[0] == "dmma"
    assert routes._choose(CUDA0, torch.bfloat16, 64, 16384, "")[0] == "dmma"
    _fake_cuda(monkeypatch, arch=100, table=[_row("prep_gemm")])
    assert routes._choose(CUDA0, torch.bfloat16, 128, 16384, "")[0] == "dmma"


def test_a_table_row_whose_route_cannot_run_here_is_passed_over_and_said(monkeypatch):
    _fake_cuda(monkeypatch, available=("prep_gemm", "blocked"), table=[_row("triton_f64")])
    name, why = routes._choose(CUDA0, torch.bfloat16, 128, 16384, "")
    assert name == "prep_gemm" and "not the table's triton_f64 (triton_f64 stood down" in why


def test_the_environment_variable_forces_a_route(monkeypatch):
    _fake_cuda(monkeypatch, table=[_row("prep_gemm")])
    assert routes._choose(CUDA0, torch.bfloat16, 128, 16384, "blocked") == (
        "blocked", f"forced by {routes.ENV}=blocked")
    with pytest.raises(ValueError, match=rf"{routes.ENV}: expected one of dmma, triton_f64, prep_gemm, blocked, "
                                         r"got 'cublas'"):
        routes._choose(CUDA0, torch.bfloat16, 128, 16384, "cublas")
    _fake_cuda(monkeypatch, available=("blocked",))
    with pytest.raises(RuntimeError, match=rf"{routes.ENV}=dmma cannot run here: dmma stood down"):
        routes._choose(CUDA0, torch.bfloat16, 128, 16384, "dmma")


def test_the_choice_is_cached_per_shape_and_setting(monkeypatch):
    calls = []
    real = routes._choose
    monkeypatch.setattr(routes, "_choose", lambda *a: calls.append(a) or real(*a))
    x = torch.zeros(2, 8, 3, 16)
    for _ in range(3):
        routes.choose(x)
    assert len(calls) == 1
    routes.choose(x, rows=4)
    monkeypatch.setenv(routes.ENV, "blocked")
    routes.choose(x)
    assert len(calls) == 3


def test_the_shipped_table_loads_and_a_bad_row_is_named(tmp_path):
    routes.load_table()  # the shipped file parses and every row names a known route
    bad = tmp_path / "routes.json"
    bad.write_text(json.dumps({"rows": [_row("cublas")]}))
    with pytest.raises(ValueError, match=r"route table row 0 .*route must be one of"):
        routes.load_table(bad)
    bad.write_text(json.dumps({"rows": [_row("dmma", rows=(10, 5))]}))
    with pytest.raises(ValueError, match="row range non-empty"):
        routes.load_table(bad)


def test_fastspec_info_prints_the_route_and_why(capsys):
    from fastspec.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cov route: exact (float64) raw-sum update on cpu" in out
    assert "bfloat16 D=128, 16384 rows per site: blocked (CPU tensors" in out
    assert "dmma" in out and "FASTSPEC_COV_VARIANT forces one" in out


# ------------------------------------------------------------------ the same update on every route


@pytest.mark.triton
@pytest.mark.parametrize("name", CPU_ROUTES)
def test_every_route_gives_the_svdvals_spectrum_of_rank_deficient_heads(name, monkeypatch):
    """Through the public path (``Covariance.update`` under ``precision="auto"``, i.e. the op), a
    forced route gives the ``sv`` participation ratio of float64 ``svdvals`` of the valid rows,
    with a NaN row refused and padding (holding Inf) never read, and the same totals as the
    reference route to float64 rounding."""
    k = lowrank_rope_keys(r=2, T=96, D=32, dtype=torch.float16)
    B, H, T, D = k.shape
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 50:] = False
    k[1, :, 60:] = float("inf")  # padding
    k[0, 1, 7, 3] = float("nan")  # one refused row of head 1
    keys = k.transpose(1, 2)  # [B, T, H, D] as attention stores them: strided
    valid = [torch.cat([k[0, h], k[1, h, :50]]) for h in range(H)]
    valid[1] = torch.cat([valid[1][:7], valid[1][8:]])
    truth = torch.stack([participation_ratio(torch.linalg.svdvals(v.double())) for v in valid])

    monkeypatch.setenv(routes.ENV, "blocked")
    ref = fastspec.Covariance((H, D), track_mean=False).update(keys[:1], mask[:1]).update(keys[1:], mask[1:])
    monkeypatch.setenv(routes.ENV, name)
    routes.forget()
    cov = fastspec.Covariance((H, D), track_mean=False).update(keys[:1], mask[:1]).update(keys[1:], mask[1:])
    assert cov.n.tolist() == [len(v) for v in valid] and cov.rejected.tolist() == [0, 1]
    pr = cov.metrics("sv").participation_ratio
    assert ((pr - truth) / truth).abs().max() < 1e-8
    torch.testing.assert_close(cov.gram(), ref.gram(), rtol=1e-14, atol=0)
    if name != "blocked":  # the new routes write the Gram exactly symmetric
        assert torch.equal(cov.gram(), cov.gram().mT)


@pytest.mark.triton
@pytest.mark.parametrize("name", CPU_ROUTES)
def test_every_route_compiles_into_the_op_without_graph_breaks(name, monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` a route runs inside the one custom op: no graph
    break, and the totals match the eager route bit for bit."""
    monkeypatch.setenv(routes.ENV, name)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 6, 2, 16, generator=g).half() for _ in range(2)]
    eager = fastspec.Covariance((2, 16), track_mean=False)
    compiled = fastspec.Covariance((2, 16), track_mean=False, device="cpu")
    step = torch.compile(lambda c, x: c.update(x), fullgraph=True, backend="aot_eager")
    for x in xs:
        eager.update(x)
        step(compiled, x)
    assert torch.equal(compiled.n, eager.n) and torch.equal(compiled.gram(), eager.gram())


# ------------------------------------------------------------- what one update dispatches


class _Dispatched(TorchDispatchMode):
    """Counts the torch ops dispatched, except inside a kernel launch (the Triton interpreter
    runs kernels with torch ops of its own, which a GPU launch does not have)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launches: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, module, monkeypatch):
        """Count the launches of ``module``'s kernels (its ``*_kernel`` names), pausing the op count."""
        mode = self

        class Launcher:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    mode.launches.append(self.name)
                    mode.paused += 1
                    try:
                        return self.kernel[grid](*args, **kwargs)
                    finally:
                        mode.paused -= 1
                return launch

        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, Launcher(name, getattr(module, name)))


# per route: the most torch ops and kernel launches one exact update through Covariance.update
# may dispatch, with its buffers already allocated (the second update of a shape). The ops
# allowed are views and the GEMM: no allocation, no host read (no aten._local_scalar_dense), no
# copy, no merge (the routes add into the totals in their last kernel). Raising a budget needs a
# reason in this comment:
#   triton_f64: Covariance.update's reshape to [B, T, S, D], three detaches (the update, the op's
#     argument, the route's own), the mask's uint8 view; 2 kernels (Gram, finish with the merge)
#   prep_gemm: the same, rows64ᵀ, the Gram's [0], and the cuBLAS bmm; 2 Triton kernels + the GEMM
BUDGET = {"triton_f64": (5, 2), "prep_gemm": (8, 2)}
ALLOWED = {"aten.view.default", "aten.detach.default", "aten.view.dtype", "aten.transpose.int", "aten.select.int",
           "aten.bmm.out"}


@pytest.mark.triton
@pytest.mark.parametrize("name", [p for p in CPU_ROUTES if p.values[0] in BUDGET])
def test_one_update_dispatches_at_most_its_budget_of_ops_and_launches(name, monkeypatch):
    from fastspec.covariance import triton_exact

    monkeypatch.setenv(routes.ENV, name)
    S, D = 2, 32
    x = torch.randn(2, S, 16, D).half().transpose(1, 2)
    mask = torch.rand(2, 16) > 0.2
    cov = fastspec.Covariance((S, D), track_mean=False).update(x, mask)  # buffers, choice, compile
    mode = _Dispatched()
    mode.wrap(triton_exact, monkeypatch)
    with mode:
        cov.update(x, mask)
    max_ops, max_launches = BUDGET[name]
    assert set(mode.ops) <= ALLOWED, dict(mode.ops)
    assert sum(mode.ops.values()) <= max_ops and len(mode.launches) <= max_launches, (dict(mode.ops), mode.launches)


def test_the_reference_route_dispatches_dozens_of_ops_per_update(monkeypatch):
    """What the budgets above replace: the blocked route's CUDA code path (run on CPU, where its
    code is the same but for the BLAS call) dispatches tens of ops per row block, and each is a
    kernel launch on a GPU (807 µs and ~60 launches per layer on an H100)."""
    monkeypatch.setattr(blocked, "_use_syrk", lambda device: False)
    monkeypatch.setenv(routes.ENV, "blocked")
    x = torch.randn(2, 2, 16, 32).half().transpose(1, 2)
    mask = torch.rand(2, 16) > 0.2
    cov = fastspec.Covariance((2, 32), track_mean=False).update(x, mask)
    with _Dispatched() as mode:
        cov.update(x, mask)
    assert sum(mode.ops.values()) > 3 * max(o for o, _ in BUDGET.values()), dict(mode.ops)


def test_an_empty_update_or_a_closed_gate_changes_nothing_on_every_route(monkeypatch):
    for name in routes.ROUTES:
        if _on_cpu(name):
            continue
        monkeypatch.setenv(routes.ENV, name)
        routes.forget()
        cov = fastspec.Covariance((2, 8), track_mean=False).update(torch.randn(1, 4, 2, 8))
        st = cov._state
        before = {k: v.clone() for k, v in st.items()}
        # no rows at all (Covariance.update refuses that; the op is called by compiled graphs)
        ops.covariance_update(st["n"], st["rejected"], st["sum"], st["gram"], torch.randn(0, 4, 2, 8), None, None,
                              1, False, "auto", "auto")
        cov.update(torch.randn(1, 4, 2, 8), torch.zeros(1, 4, dtype=torch.bool))  # every row padding
        cov.update(torch.randn(1, 4, 2, 8), gate=torch.tensor(False))  # a closed gate, read on the host
        x = torch.randn(1, 4, 2, 8)  # a closed gate on the data's device: folded into the mask
        ops.covariance_update(st["n"], st["rejected"], st["sum"], st["gram"], x,
                              ops.fold_gate(x, None, torch.tensor(False)), None, 1, False, "auto", "auto")
        assert all(torch.equal(st[k], before[k]) for k in before), name


def test_ops_use_the_route_only_for_exact_raw_sums(monkeypatch):
    """Centred accumulators and float32 products never reach the routes (the policy decides)."""
    seen = []
    monkeypatch.setattr(routes, "choose", lambda x, rows=None, skip=frozenset(): seen.append(x.shape) or ("blocked", ""))
    x = torch.randn(1, 4, 2, 8)
    fastspec.Covariance((2, 8), track_mean=True).update(x)
    fastspec.Covariance((2, 8), track_mean=False, precision="fast").update(x)
    assert seen == []
    fastspec.Covariance((2, 8), track_mean=False).update(x)
    assert seen == [torch.Size([1, 4, 2, 8])]
    assert ops.routes is routes


@pytest.mark.triton
def test_a_route_whose_kernel_cannot_be_had_hands_the_update_to_the_next(monkeypatch, caplog):
    """A compile error at a route's first use (KernelUnavailable) is said once, and the update
    (and every later one) runs on the next route; forced by the variable, it is raised."""
    from fastspec.eig.nvrtc import KernelUnavailable

    if _on_cpu("prep_gemm"):
        pytest.skip(_on_cpu("prep_gemm"))
    _fake_cuda(monkeypatch, available=("dmma", "prep_gemm", "blocked"))
    calls = []

    def broken(*args):
        calls.append(1)
        raise KernelUnavailable("NVRTC could not compile cov_gram.cu (test)")

    r = routes.ROUTES["dmma"]
    monkeypatch.setitem(routes.ROUTES, "dmma", routes.Route(r.name, r.what, r.status, r.partials, broken))
    # CPU rows, chosen as if on the stood-in GPU
    monkeypatch.setattr(routes, "GPU_TYPES", ("cuda", "cpu"))
    x = torch.randn(2, 6, 2, 16).half()
    want = fastspec.Covariance((2, 16), track_mean=False, precision="exact", backend="torch")
    with monkeypatch.context() as m:
        m.setattr(routes, "choose", lambda x, rows=None, skip=frozenset(): ("blocked", ""))
        want.update(x).update(x)
    cov = fastspec.Covariance((2, 16), track_mean=False)
    with caplog.at_level("WARNING", logger="fastspec"):
        cov.update(x).update(x)
    assert len(calls) == 1 and routes.status("dmma", x.device, torch.float16, 16).startswith("failed here: NVRTC")
    assert routes.status("dmma", CUDA0, torch.float16, 16) == ""  # on its device only
    assert sum("the dmma route of the exact covariance update failed" in r.message for r in caplog.records) == 1
    torch.testing.assert_close(cov.gram(), want.gram(), rtol=1e-14, atol=0)
    assert torch.equal(cov.n, want.n)
    routes.forget()
    monkeypatch.setenv(routes.ENV, "dmma")
    with pytest.raises(KernelUnavailable, match="could not compile"):
        cov.update(x)


@pytest.mark.triton
def test_strided_totals_take_the_merge_instead_of_the_folded_kernel(monkeypatch):
    """The routes' folded merge writes contiguous totals; totals that are views with other strides
    (what a compiled graph may pass the op) get the route's partials and the merge instead."""
    if _on_cpu("prep_gemm"):
        pytest.skip(_on_cpu("prep_gemm"))
    monkeypatch.setenv(routes.ENV, "prep_gemm")
    x = torch.randn(2, 6, 2, 16).half()
    want = fastspec.Covariance((2, 16), track_mean=False).update(x)._state
    st = {"n": torch.zeros(4, dtype=torch.int64)[::2], "rejected": torch.zeros(2, dtype=torch.int64),
          "sum": torch.zeros(16, 2, dtype=torch.float64).mT, "gram": torch.zeros(2, 16, 16, dtype=torch.float64)}
    ops.exact_update(st, x, None, 1)
    for k in st:
        assert torch.equal(st[k], want[k]), k
