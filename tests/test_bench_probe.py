"""The ``probe`` benchmark suite (probe overhead near the floor) at quick sizes: structure, one call of every side, and
accuracy checks that return numbers. No timing is asserted (performance lives in benchmarks)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from fastspec.bench import models
from fastspec.bench.runner import run_cases
from fastspec.bench.suites import SUITES, cases
from fastspec.bench.suites import probe as probe_suite

CPU = torch.device("cpu")


def _by_kind(tier: str = "quick") -> dict[str, object]:
    return {c.size.split("-")[0] + ("_fast" if c.variant.endswith("-fast") else ""): c
            for c in cases("probe", tier, CPU)}


def test_probe_suite_is_registered_with_four_cases_per_tier():
    assert "probe" in SUITES
    for tier in ("quick", "cpu", "gpu"):
        got = {kind: (c.variant, list(c.baselines), c.overhead) for kind, c in _by_kind(tier).items()}
        assert got == {
            "measure": ("keys", ["plain forward (eval, no_grad)"], True),
            "train_step": ("keys-emit_every=100", ["training step without probe"], True),
            "rank": ("covariance-sv", ["svdvals per head"], False),
            "rank_fast": ("covariance-sv-fast", ["svdvals per head"], False),
        }


def test_sizes_are_the_target_shapes():
    cpu, gpu = _by_kind("cpu"), _by_kind("gpu")
    assert cpu["measure"].size == "measure-L8-KV8-d128-ff1536-N4x256-fp32"
    assert cpu["train_step"].size == "train_step-L8-KV8-d128-ff1536-N4x256-fp32"
    assert cpu["rank"].size == "rank-L8-H8-N4x2048-D128-fp32"
    assert gpu["measure"].size == "measure-L32-KV8-d128-ff8192-N4x2048-bf16"
    assert gpu["rank"].size == "rank-L32-H8-N4x2048-D128-fp32"


def test_gpu_cases_are_built_without_building_a_model_or_keys(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("built at case construction")

    monkeypatch.setattr(models, "build_llama", no_build)
    monkeypatch.setattr(probe_suite, "synthetic_keys", no_build)
    assert len(cases("probe", "gpu", CPU)) == 4


def test_every_side_runs_once_and_the_checks_return_finite_errors():
    pytest.importorskip("transformers")
    for kind, case in _by_kind().items():
        assert case.skip is None
        inp = case.setup()
        with case.fastspec_context(inp):
            case.fastspec(inp)
        for fn in case.baselines.values():
            fn(inp)
        errors = case.check(inp)
        assert math.isfinite(errors["fastspec_error"]) and errors["fastspec_error"] >= 0, (kind, errors)
        if kind == "train_step":
            assert errors["fastspec_error"] == 0  # the probe only reads activations
            assert errors["layers"] == errors["layers_requested"] == 2
        elif kind == "measure":
            assert errors["baseline_error"] is None  # the baseline forward computes no rank
            assert math.isfinite(errors["svdvals_fp32_pr_rel_err"])
        else:
            assert math.isfinite(errors["baseline_error"]) and errors["baseline_error"] >= 0
        del inp


def test_runner_rows_carry_overhead_for_the_probe_cases_only():
    pytest.importorskip("transformers")
    rows = run_cases(cases("probe", "quick", CPU), CPU, warmup=0, repeats=1)
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    assert len(rows) == 4
    for r in rows:
        assert r["suite"] == "probe" and r["fastspec_s"] > 0 and r["baseline_s"] > 0
        if r["size"].startswith("rank-"):
            assert "overhead_pct" not in r
        else:
            assert math.isclose(r["overhead_pct"], (r["fastspec_s"] / r["baseline_s"] - 1) * 100)


def test_model_cases_skip_cleanly_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    kinds = _by_kind()
    assert "transformers" in kinds["measure"].skip and "transformers" in kinds["train_step"].skip
    assert kinds["rank"].skip is None and kinds["rank_fast"].skip is None  # no model needed


def test_synthetic_keys_are_deterministic_and_rank_deficient_before_rope():
    L, B, H, T, D = 2, 2, 8, 64, 16
    keys = probe_suite.synthetic_keys(L, B, H, T, D, CPU)
    again = probe_suite.synthetic_keys(L, B, H, T, D, CPU)
    assert len(keys) == L and all(k.shape == (B, H, T, D) and k.dtype == torch.float32 for k in keys)
    assert all(torch.equal(a, b) for a, b in zip(keys, again))
    cos, sin = probe_suite.rope_tables(T, D, CPU)
    # undo the rotation (rotate by −θ): the heads' pre-RoPE ranks come back
    pre = probe_suite.apply_rope(keys[0].double(), cos.double(), -sin.double())
    # (rtol: the keys were rotated in fp32, so the round trip leaves ~1e-7 relative noise)
    ranks = [int(torch.linalg.matrix_rank(pre[:, h].reshape(B * T, D), rtol=1e-5)) for h in range(H)]
    assert ranks == [D] * 4 + list(probe_suite.DEFICIENT_RANKS)
    # after RoPE the rank-1 head spreads over more dimensions (the hard case for fp32 Gram sums)
    assert int(torch.linalg.matrix_rank(keys[0][:, 4].double().reshape(B * T, D), rtol=1e-5)) > 1


def test_rope_tables_match_the_llama_rotary_embedding():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T, D = 32, 16
    cos, sin = probe_suite.rope_tables(T, D, CPU)
    k = torch.randn(1, 2, T, D, generator=torch.Generator().manual_seed(0))
    ours = probe_suite.apply_rope(k, cos, sin)
    theirs = apply_rotary_pos_emb(k, k, cos[None], sin[None])[1]
    torch.testing.assert_close(ours, theirs)


def test_rank_helpers_agree_with_each_other_in_float64():
    keys = probe_suite.synthetic_keys(1, 1, 4, 64, 8, CPU)
    hand64 = probe_suite.svdvals_key_rank(keys, torch.float64)
    assert hand64.shape == (1, 4) and hand64.dtype == torch.float64
    got = probe_suite.covariance_key_rank(keys)
    assert got.shape == (1, 4)
    torch.testing.assert_close(got.double().cpu(), hand64, rtol=1e-3, atol=0)
