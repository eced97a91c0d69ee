"""benchmarks/tensor_core_sum_model.py: the CPU model of the covariance kernels' tensor-core sums
that the kernel's block tile (``_gram_dot``'s ``ACC=2``, ``FLUSH_ROWS``) rests on."""
from __future__ import annotations

import pytest
import torch

from benchmarks import tensor_core_sum_model as model
from fastspec.covariance import triton_kernels


def test_truncation_rounds_toward_zero_within_one_ulp():
    v = torch.tensor([1 + 2.0**-30, -(1 + 2.0**-30), 3.0, -(2.0**-24) * (1 + 2.0**-30), 0.0], dtype=torch.float64)
    got = model.truncate_fp32(v)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, -1.0, 3.0, -(2.0**-24), 0.0]
    x = torch.randn(10_000, dtype=torch.float64) * 1e3
    t = model.truncate_fp32(x).double()
    assert bool((t.abs() <= x.abs()).all())
    ulp = torch.nextafter(t.float().abs(), torch.tensor(float("inf"))).double() - t.abs()
    assert bool(((x - t).abs() < ulp).all())


def test_a_chain_summed_exactly_in_steps_is_the_exact_gram_when_nothing_rounds():
    # small integers: every partial sum is exact in fp32, so the model must give the exact Gram
    x = torch.randint(-4, 5, (100, 8)).double()
    for flush in (None, 32, 128):
        assert torch.equal(model.chained_gram([(x, x)], 32, flush).double(), x.T @ x)


def test_the_model_reproduces_the_h100_split_and_ranks_the_uncentred_choices():
    # the H100 (2026-11-26): the split 35-59x torch fp32 accumulating in the dots, 1.2-1.4x in a
    # block tile; the model must land near both, and say what the kernel's uncentred choice buys
    split = model.split_ratios(1024, seed=0)
    assert 25 < split["acc0"] < 80 and split["acc2"] < 2
    raw = model.raw_ratios(512, seed=0, dtype=torch.float16, mean=100.0,
                           flush_rows=triton_kernels.FLUSH_ROWS.value)
    assert raw["acc0"] > 4 and raw["128rows"] < 2.5 and raw["block"] < 2.5


def test_the_command_prints_each_case_and_refuses_bad_sizes(capsys):
    assert model.main(["--rows", "64", "--seeds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("split fp16") and sum(ln.startswith("raw ") for ln in out) == 6
    with pytest.raises(SystemExit):
        model.main(["--rows", "0"])
    assert "--rows and --seeds: expected positive integers" in capsys.readouterr().err
