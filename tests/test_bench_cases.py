"""The benchmark baselines and timers do what they claim (they are the other side of every claim)."""
from __future__ import annotations

import time

import pytest
import torch

from fastspec.bench.case import max_rel_err
from fastspec.bench.suites import SUITES, cases
from fastspec.bench.timing import measure, measure_interleaved

CPU = torch.device("cpu")


def test_hand_key_rank_sees_post_rope_keys():
    """The hand protocol's keys are what attention uses: compare with the KV cache (post-RoPE)."""
    pytest.importorskip("transformers")
    from fastspec.bench.models import MODEL_SHAPES, build_llama, hand_key_rank

    model = build_llama("quick", CPU)
    ids = torch.randint(MODEL_SHAPES["quick"]["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got = hand_key_rank(model, batch, torch.float64)
    with torch.no_grad():
        cache = model.eval()(**batch, use_cache=True).past_key_values
    for layer in range(got.shape[0]):
        k = cache.layers[layer].keys if hasattr(cache, "layers") else cache.key_cache[layer]  # [B, H, T, d]
        for h in range(got.shape[1]):
            s = torch.linalg.svdvals(k[:, h].reshape(-1, k.shape[-1]).double())
            assert got[layer, h].item() == pytest.approx((s.sum() ** 2 / (s ** 2).sum()).item(), rel=1e-12)


def test_hand_key_rank_restores_train_mode_and_removes_hooks():
    pytest.importorskip("transformers")
    from fastspec.bench.models import build_llama, hand_key_rank

    model = build_llama("quick", CPU).train()
    ids = torch.randint(100, (1, 8))
    hand_key_rank(model, {"input_ids": ids})
    assert model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_max_rel_err_is_relative_to_each_matrix_scale():
    ref = torch.tensor([[1.0, 2.0], [1e-6, 2e-6]], dtype=torch.float64)
    x = ref * (1 + torch.tensor([[1e-3], [1e-2]], dtype=torch.float64))
    # matrix 1: 2e-3/2 = 1e-3; matrix 2: 2e-8/2e-6 = 1e-2 (not hidden by matrix 1's scale)
    assert max_rel_err(x, ref) == pytest.approx(1e-2)


@pytest.mark.parametrize("suite", SUITES)
def test_every_tier_has_cases_with_readable_unique_ids(suite):
    for tier in ("quick", "cpu", "gpu"):
        ids = [c.id for c in cases(suite, tier, CPU)]
        assert ids and len(ids) == len(set(ids))
        assert all(" " not in i for i in ids)


def test_unknown_suite_and_tier_are_refused():
    with pytest.raises(ValueError, match="suite"):
        cases("svd", "quick", CPU)
    with pytest.raises(ValueError, match="tier"):
        cases("eigvalsh", "huge", CPU)


def test_timer_measures_wall_clock_and_interleaves():
    order = []
    t = measure_interleaved([lambda: (order.append("a"), time.sleep(0.02)), lambda: order.append("b")],
                            device=CPU, warmup=1, repeats=3)
    assert order == ["a", "b"] * 4  # round-robin, warmup round included
    assert t[0].median >= 0.02 and t[0].min <= t[0].median and t[0].repeats == 3
    assert t[1].median < t[0].median


def test_timer_contexts_wrap_only_their_own_calls_outside_the_timing():
    """The probe's hooks (``fastspec_context``) are on for the fastspec calls only, and
    attaching/detaching them is not timed."""
    import contextlib

    state = {"on": False}
    seen = {"a": [], "b": []}

    @contextlib.contextmanager
    def slow_hooks():
        time.sleep(0.03)
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False
            time.sleep(0.03)

    t = measure_interleaved([lambda: seen["a"].append(state["on"]), lambda: seen["b"].append(state["on"])],
                            device=CPU, warmup=1, repeats=3, contexts=[slow_hooks, contextlib.nullcontext])
    assert seen == {"a": [True] * 4, "b": [False] * 4}
    assert t[0].median < 0.01


def test_timer_refuses_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, device=CPU, repeats=0)


def test_model_suites_skip_cleanly_without_transformers(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    for suite in ("keyrank", "train_step", "train_step_compiled"):
        for case in cases(suite, "quick", CPU):
            assert case.skip and "transformers" in case.skip


def test_covariance_cases_time_the_kernel_the_update_and_a_copy_of_the_same_bytes():
    """Each covariance case has a copy of its input's bytes as a second baseline; the copy's rows
    carry the bandwidth it measured (read + write) and fastspec's share of it. Under the Triton
    interpreter (conftest sets it without CUDA) the update and the launch alone are measured too,
    each accurate against fp64."""
    import math

    from fastspec.bench.runner import run_cases
    from fastspec.bench.suites.covariance import COPY, KERNEL

    selected = cases("covariance", "quick", CPU)
    assert {c.variant for c in selected} == {"auto", "triton", KERNEL}
    rows = run_cases(selected, CPU, warmup=0, repeats=1)
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    copies = [r for r in rows if r["baseline"] == COPY]
    assert len(copies) == len(selected) == len(rows) - len(copies)
    for r in copies:
        shape = [int(p[1:]) for p in r["size"].split("-")[1:-1]]
        nbytes = math.prod(shape) * (2 if r["size"].endswith(("bf16", "fp16")) else 4)
        assert r["copy_GBps"] == pytest.approx(2 * nbytes / r["baseline_s"] / 1e9)
        assert r["pct_of_copy_bandwidth"] == pytest.approx(100 * r["fastspec_rate"] / r["copy_GBps"])
        assert r["baseline_error"] is None
    for r in rows:
        if r["baseline"] != COPY:
            assert "pct_of_copy_bandwidth" not in r
            assert r["fastspec_error"] <= 4 * r["baseline_error"] + 8 * 2.0**-24, r


def test_a_case_is_built_on_the_same_data_every_run_and_leaves_the_callers_generator_alone():
    """Inputs come from generators seeded with ``SEED``: two runs of a case report the same
    error (a claim cannot flip with the draw), and the caller's random stream goes on as if the
    case had not drawn from it."""
    from fastspec.bench.runner import run_cases

    ffn = [c for c in cases("covariance", "quick", CPU) if c.size.startswith("ffn") and c.variant == "auto"]
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    first = ffn[0].inputs()["x"]
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(ffn[0].inputs()["x"], first)
    errors = [[r["fastspec_error"] for r in run_cases(ffn, CPU, warmup=0, repeats=1)] for _ in range(2)]
    assert errors[0] == errors[1] and errors[0][0] > 0, errors


# ------------------------------------------------------------------------ the accuracy claims
def test_a_relative_claim_holds_up_to_its_bound_and_says_how_it_broke():
    from fastspec.bench.case import EPS32, no_worse_than

    claim = no_worse_than()
    bound = 2 * 1e-7 + 8 * EPS32
    assert claim.violated({"fastspec_error": bound, "baseline_error": 1e-7}) is None
    assert claim.violated({"fastspec_error": 0.0, "baseline_error": 0.0}) is None  # the floor
    broke = claim.violated({"fastspec_error": bound * 1.01, "baseline_error": 1e-7})
    assert broke == (f"fastspec error {bound * 1.01:.3g} > {bound:.3g} "
                     "(claim: ≤ 2 × baseline_error + 8·eps_fp32, baseline_error 1e-07)")
    other = no_worse_than("svdvals_fp32_pr_rel_err")  # relative to another field of the check
    assert other.violated({"fastspec_error": 3e-7, "baseline_error": 0.0, "svdvals_fp32_pr_rel_err": 1e-7}) is None
    assert "svdvals_fp32_pr_rel_err is None" in other.violated({"fastspec_error": 0.0, "baseline_error": 0.0})


@pytest.mark.parametrize("errors, expected", [
    ({"fastspec_error": float("nan"), "baseline_error": 1.0}, "fastspec error is nan"),
    ({"fastspec_error": None, "baseline_error": 1.0}, "fastspec error is None"),
    ({"fastspec_error": 0.0, "baseline_error": float("inf")}, "baseline_error is inf"),
])
def test_no_error_and_no_reference_break_the_claim(errors, expected):
    from fastspec.bench.case import no_worse_than

    assert no_worse_than().violated(errors).startswith(expected)


def test_absolute_and_exact_claims():
    from fastspec.bench.case import at_most, exactly_zero

    assert at_most(1e-4).violated({"fastspec_error": 1e-4}) is None
    assert at_most(1e-4).violated({"fastspec_error": 2e-4}) == "fastspec error 0.0002 > 0.0001 (claim: ≤ 0.0001)"
    claim = exactly_zero("graph_breaks", "recompiles")
    assert claim.text == "= 0, graph_breaks = 0, recompiles = 0"
    assert claim.violated({"fastspec_error": 0.0, "graph_breaks": 0, "recompiles": 0}) is None
    assert claim.violated({"fastspec_error": 1e-9, "graph_breaks": 0, "recompiles": 0}).startswith("fastspec error 1e-09 > 0")
    assert claim.violated({"fastspec_error": 0.0, "graph_breaks": 0, "recompiles": 2}) == (
        "recompiles is 2 (claim: = 0, graph_breaks = 0, recompiles = 0)")


def test_compare_holds_its_rows_to_the_claim_of_the_eigvalsh_cases():
    from fastspec.bench.accuracy import CLAIM, within_bound
    from fastspec.bench.case import EPS32

    assert (CLAIM.factor, CLAIM.floor) == (2.0, 8 * EPS32)
    assert within_bound(2e-7 + 8 * EPS32, 1e-7) and not within_bound(2e-7 + 9 * EPS32, 1e-7)
    assert not within_bound(float("nan"), 1e-7) and not within_bound(0.0, float("nan"))


def test_each_suite_sets_the_claim_it_makes_where_it_builds_its_cases():
    """The rules benchmarks/README.md states, case by case (benchmarks/conftest.py and
    ``fastspec bench`` only apply them)."""
    from fastspec.bench.case import EPS32, EPS64
    from fastspec.bench.suites.probe import FAST_PR_BOUND, PR_TARGET

    claims = {(c.suite, c.size, c.variant): c.claim for s in SUITES for c in cases(s, "quick", CPU)}
    for (suite, size, variant), claim in claims.items():
        if suite == "eigvalsh" and size.startswith("compile-"):  # the cached image is the compiled code
            expected = (0.0, 0.0, None, ())
        elif suite == "eigvalsh" and size.endswith("-fp64"):  # n·eps64: vs LAPACK fp64, torch's error is 0
            n = int(size.split("-n")[1].split("-")[0])
            expected = (2.0, n * EPS64, "baseline_error", ())
        elif suite in ("eigvalsh", "covariance", "keyrank"):
            expected = (2.0, 8 * EPS32, "baseline_error", ())
        elif suite == "train_step" or size.startswith("train_step-"):
            expected = (0.0, 0.0, None, ())
        elif suite == "train_step_compiled":
            expected = (0.0, 0.0, None, ("graph_breaks", "recompiles"))
        elif size.startswith("measure-"):
            expected = (2.0, 8 * EPS32, "svdvals_fp32_pr_rel_err", ())
        else:  # the probe's rank cases: parity with fp64 svdvals
            expected = (0.0, FAST_PR_BOUND if variant.endswith("-fast") else PR_TARGET, None, ())
        assert (claim.factor, claim.floor, claim.relative_to, claim.zero) == expected, (suite, size, variant)


class _Benchmark:
    """What ``benchmarks/conftest.py`` uses of pytest-benchmark's fixture: runs the call once."""

    def __init__(self):
        self.group, self.extra_info, self.calls = None, {}, 0

    def pedantic(self, fn, rounds, warmup_rounds, iterations):
        fn()
        self.calls += 1


def _bench_conftest():
    """``benchmarks/conftest.py`` as a module of its own (not the plugin pytest loaded)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("fastspec_benchmarks_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pytest_benchmarks_fail_a_case_that_breaks_its_claim():
    """The benchmark body asserts the same :meth:`Claim.violated` that ``fastspec bench`` reports."""
    from fastspec.bench.case import Case, no_worse_than

    def case(size: str, err: float) -> Case:
        return Case(suite="eigvalsh", size=size, variant="auto", setup=dict, fastspec=lambda inp: None,
                    baselines={"torch.linalg.eigvalsh": lambda inp: None},
                    check=lambda inp: {"fastspec_error": err, "baseline_error": 1e-7},
                    error_kind="max rel err vs fp64", claim=no_worse_than())

    conftest = _bench_conftest()
    held, broken = case("B1-n4-fp32", 1e-7), case("B2-n4-fp32", 1e-3)
    bench = _Benchmark()
    conftest._run_benchmark(bench, held, "fastspec")
    assert bench.calls == 1 and bench.extra_info["claim"] == "≤ 2 × baseline_error + 8·eps_fp32"
    bench = _Benchmark()
    with pytest.raises(AssertionError, match=r"^B2-n4-fp32-auto: fastspec error 0\.001 > 1\.15e-06 \(claim: "):
        conftest._run_benchmark(bench, broken, "fastspec")
    assert bench.calls == 0  # nothing timed
    conftest._run_benchmark(bench, broken, "torch.linalg.eigvalsh")  # the baseline's side claims nothing
    assert bench.calls == 1
    conftest._close_last()
