"""The benchmark baselines and timers do what they claim (they are the other side of every claim)."""
from __future__ import annotations

import time

import pytest
import torch

from fastspec.bench.case import max_rel_err
from fastspec.bench.cases import SUITES, cases
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

    from fastspec.bench.cases_covariance import COPY, KERNEL
    from fastspec.bench.runner import run_cases

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
