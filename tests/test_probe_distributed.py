"""Distributed merge: 2 gloo processes on CPU, each with half of the batch, see the metrics a
single process computes on the whole batch (the sums merge exactly: docs/accumulators.md)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _ranks import start_ranks
from _tiny_models import batch, build

import fastspec

WORLD = 2


def _half(inputs: dict, rank: int) -> dict:
    B = inputs["input_ids"].shape[0] // WORLD
    return {k: v[rank * B:(rank + 1) * B] for k, v in inputs.items()}


def _large_mean_rows(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return 1e4 + torch.randn(50 + 30 * rank, 5, generator=g, dtype=torch.float64) * (1 + rank)


def _worker(rank: int, tmpdir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = build("llama")
        inputs = _half(batch(B=4, T=10, pad="left"), rank)
        out = {"measure": fastspec.Probe(model, queries=True).measure(inputs, step=3)}
        # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
        probe = fastspec.Probe(model, emit_every=1, sync="rank0", ffn_rows="all", forwards="all")
        with probe.streaming():
            model(**inputs)
            out["rank0"] = probe.step(0)
        cov = fastspec.Covariance(5).update(_large_mean_rows(rank))
        merged = cov.all_reduce()
        out["cov"] = (merged.n.clone(), merged.mean.clone(), merged.covariance().clone())
        out["local_n"] = cov.n.clone()  # the rank's own accumulator is untouched
        raw = fastspec.Covariance(5, track_mean=False).update(_large_mean_rows(rank)).all_reduce()
        out["raw"] = (raw.n.clone(), raw.gram().clone(), raw.track_mean)
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _values(records):
    return {(r.site, r.layer, r.head_index, r.metric): r.value for r in records}


def test_two_rank_gloo_merge_equals_single_process(tmp_path):
    model = build("llama")  # also imports the model code once, before the fork
    full = batch(B=4, T=10, pad="left")
    want = _values(fastspec.Probe(model, queries=True).measure(full, step=3))
    start_ranks(_worker, str(tmp_path), nprocs=WORLD)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for out in outs:
        got = _values(out["measure"])
        assert got.keys() == want.keys()
        for k, v in want.items():
            # per-rank fp32 partials are summed in another order: ~1e-7 relative
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
        assert {r.value for r in out["measure"] if r.metric == "n"} == {full["attention_mask"].sum().item()}

    # sync="rank0": only rank 0 reports, with the global token count
    assert outs[1]["rank0"] == []
    n0 = {r.value for r in outs[0]["rank0"] if r.metric == "n"}
    assert n0 == {full["attention_mask"].sum().item()}

    # eig state with a mean 1e4 times the spread: merged about the global mean, no cancellation
    rows = torch.cat([_large_mean_rows(r) for r in range(WORLD)])
    for out in outs:
        n, mean, cov = out["cov"]
        assert n.item() == rows.shape[0]
        torch.testing.assert_close(mean, rows.mean(0), rtol=1e-14, atol=0)
        torch.testing.assert_close(cov, torch.cov(rows.T), rtol=1e-9, atol=1e-12)
    assert [out["local_n"].item() for out in outs] == [50, 80]
    for out in outs:  # raw sums (sv sites) add as they are
        n, gram, track_mean = out["raw"]
        assert n.item() == rows.shape[0] and not track_mean
        torch.testing.assert_close(gram, rows.T @ rows, rtol=1e-13, atol=0)


def test_tensor_parallel_rank_reports_global_head_indices():
    model = build("llama")  # 2 KV heads, 4 query heads per (pretend) TP shard
    records = fastspec.Probe(model, queries=True, ffn=False, tp_rank=1).measure(batch(), step=0)
    assert {r.head_index for r in records if r.site == "keys"} == {2, 3}
    assert {r.head_index for r in records if r.site == "queries"} == {4, 5, 6, 7}
