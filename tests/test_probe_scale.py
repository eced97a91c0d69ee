"""The probe's memory plan across ranks: FFN layers owned by one data-parallel rank each, taking
turns, gathered over tensor-parallel ranks (``fastspec/probe/plan.py``, ``layout.py``,
docs/scale.md), on gloo ranks on CPU (tests/_ranks.py; one 2-rank job and one 4-rank job, every
variant in each).

The model is ``wide_llama`` (4 layers, d_ff 512); each rank trains on rows of its own. Budgets are
the planner's least figure for the layout a variant names, so the variant gets that layout:

* owned (float64 totals; 2 and 4 ranks): each FFN layer's record equals the float64 spectrum of
  the rows its owner saw in the window (1e-6), every layer is reported once per emission on every
  rank (``sync="all"``), the keys' records equal one process's over every rank's rows;
* rotation (a budget of one layer a rank, float32 totals): each window reports the layers of its
  turn, each equal to the float64 spectrum of that window's rows of its owner (2e-5: float32);
* checkpoints: a probe's own state saved mid-window resumes to the uninterrupted run's records
  (1e-12); so does the trainer callbacks' merged state (``integrations/_stream.py``, rank 0 writes
  it, every rank takes back what it keeps), and on one process it says what it keeps;
* tensor parallelism (2 ranks, DTensor: attention and MLP sharded, the whole batch on both): the
  FFN records equal one process's over the same tokens (the rows gathered to the layer's rank);
* ``probe.memory()`` never exceeds the budget, and its peak equals ``fastspec plan``'s for the
  same config and layout.

Megatron-core's tensor parallelism: tests/test_integration_megatron.py.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _memory import FFNRows, ffn_reference, least_budget
from _ranks import results, run_variant, start_ranks
from _tiny_models import batch, wide_llama

import fastspec
from fastspec.probe import plan

ROOT = Path(__file__).resolve().parents[1]
KW = {"ffn_rows": "all", "forwards": "all", "precision": "exact"}
METRICS = ("participation_ratio", "entropy_rank", "sui", "n")
STEPS = (1, 2, 3, 4)


def _rows(rank: int, step: int) -> dict:
    return batch(B=2, T=8, pad="left", seed=10 * step + rank)


def _budget(world: int, mode: str, totals: str, fit: int | None = None) -> int:
    stage = fastspec.Probe(wide_llama(), **KW)._wide.stage
    return least_budget(stage, mode, totals, fit, plan.Ranks(dp=world, device="cpu"))


def _values(records) -> dict:
    return {(r.step, r.site, r.layer, r.head_index, r.metric): r.value for r in records if r.site != "probe"}


def _stream(model, probe, rank: int, steps, rows=None) -> list:
    out = []
    with probe.streaming():
        for step in steps:
            data = _rows(rank, step)
            if rows is not None:
                rows[step] = {"mask": data["attention_mask"]}
                grab = FFNRows(model)
            model(**data)
            if rows is not None:
                grab.remove()
                rows[step]["ffn"] = {l: r[0] for l, r in grab.rows.items()}
            out += probe.step(step)
    return out


# ------------------------------------------------------------------------------------ the ranks
def _worker(rank: int, world: int, tmpdir: str, budgets: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    out: dict = {}
    try:
        model = wide_llama()

        def owned():
            probe = fastspec.Probe(model, **KW, emit_every=2, memory=budgets["owned"])
            rows: dict = {}
            records = _stream(model, probe, rank, STEPS, rows)
            return {"records": _values(records), "layouts": {r.layout for r in records if r.site in ("ffn", "keys")},
                    "rows": rows, "mode": (probe.layout.mode, probe.layout.totals, probe.layout.groups),
                    "holders": dict(probe.layout.holders), "memory": probe.memory()}

        def rotation():
            probe = fastspec.Probe(model, **KW, emit_every=1, memory=budgets["rotation"])
            rows: dict = {}
            records = _stream(model, probe, rank, STEPS, rows)
            return {"records": _values(records), "rows": rows, "holders": dict(probe.layout.holders),
                    "mode": (probe.layout.mode, probe.layout.totals, probe.layout.groups), "memory": probe.memory()}

        def checkpoint():
            first = fastspec.Probe(model, **KW, emit_every=2, memory=budgets["owned"])
            _stream(model, first, rank, STEPS[:3])  # saved after step 3: mid-window
            torch.save(first.state_dict(), os.path.join(tmpdir, f"probe-{rank}.pt"))
            resumed = fastspec.Probe(model, **KW, emit_every=2, memory=budgets["owned"])
            resumed.load_state_dict(torch.load(os.path.join(tmpdir, f"probe-{rank}.pt"), weights_only=False))
            probe_records = _values(_stream(model, resumed, rank, STEPS[3:]))
            # the trainer callbacks' state: merged on rank 0 (sync="rank0"), every rank takes its own back
            from fastspec.integrations._stream import Stream

            kwargs = {**KW, "emit_every": 2, "memory": budgets["owned"]}

            def stream_run(stream, steps):
                for step in steps:
                    stream.unpause()
                    model(**_rows(rank, step))
                    stream.step(step)
                stream.finish()
                return _values(stream.records)

            def new_stream():
                s = Stream(None, kwargs, None, "fastspec", None)
                s.build(model)
                s.attach()
                return s

            whole = stream_run(new_stream(), STEPS)
            saving = new_stream()
            stream_run(saving, STEPS[:3])
            state = saving.state_dict()  # a collective: rank 0 gets it
            if rank == 0:
                torch.save(state, os.path.join(tmpdir, "stream.pt"))
            dist.barrier()
            again = Stream(None, kwargs, None, "fastspec", None)
            again.load_state_dict(torch.load(os.path.join(tmpdir, "stream.pt"), weights_only=False))
            again.build(model)
            again.attach()
            kept = sorted(l for s, l in again.probe._totals.accs if s == "ffn")
            return {"probe": probe_records, "stream_whole": whole, "stream_resumed": stream_run(again, STEPS[3:]),
                    "stream_kept": kept, "holders": dict(again.probe.layout.holders),
                    "memory": max(first.memory()["peak"], resumed.memory()["peak"])}

        def tensor_parallel():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh = init_device_mesh("cpu", (world,))
            tp_model = wide_llama()
            for layer in tp_model.model.layers:
                parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                           "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
                parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                     "down_proj": RowwiseParallel()})
            alone = [dist.new_group([r]) for r in range(world)][rank]  # no data parallelism: a group of one
            probe = fastspec.Probe(tp_model, **KW, emit_every=1, process_group=alone, tp_rank=rank)
            full = batch(B=3, T=10, pad="right")
            with probe.streaming():
                tp_model(**full)
                stream = _values(probe.step(0))
            measure = _values(probe.measure(full, step=0))
            return {"stream": stream, "measure": measure, "mode": probe.layout.mode,
                    "holders": dict(probe.layout.holders), "memory": probe.memory()}

        variants = {"owned": owned}
        if world == 2:
            variants.update(rotation=rotation, checkpoint=checkpoint, tensor_parallel=tensor_parallel)
        for name, fn in variants.items():
            run_variant(out, name, fn)
            dist.barrier()
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _job(tmp_path_factory, world: int) -> tuple[list[dict], dict, Path]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    budgets = {"owned": _budget(world, "owned", "float64"), "rotation": _budget(world, "owned", "float32", fit=1)}
    tmp = tmp_path_factory.mktemp(f"scale{world}")
    start_ranks(_worker, world, str(tmp), budgets, nprocs=world)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)], budgets, tmp


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _job(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _job(tmp_path_factory, 4)


# ---------------------------------------------------------------------------------- references
def _ffn_reference(rows: dict, step_set, layer: int) -> dict:
    """Metrics of the float64 covariance of one rank's kept FFN rows of layer ``layer`` in ``step_set``."""
    return ffn_reference([rows[s]["ffn"][layer] for s in step_set], [rows[s]["mask"] for s in step_set])


def _one_process(world: int, steps=STEPS, emit_every: int = 2) -> dict:
    """One process on every rank's rows of each step (the keys' reference)."""
    model = wide_llama()
    probe = fastspec.Probe(model, **KW, emit_every=emit_every)
    out = []
    with probe.streaming():
        for step in steps:
            parts = [_rows(r, step) for r in range(world)]
            model(**{k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "attention_mask")})
            out += probe.step(step)
    return _values(out)


def _check_owned(res: list[dict], world: int, budget: int) -> None:
    holders = res[0]["holders"]
    owner = {l: h[0] for l, h in holders.items()}
    assert sorted(set(owner.values())) == list(range(world))  # spread over every rank
    keys_ref = {k: v for k, v in _one_process(world).items() if k[1] == "keys"}
    for rank, x in enumerate(res):
        assert x["mode"] == ("owned", "float64", 1)
        assert x["layouts"] == {"owned", "replicated"}  # FFN: one rank's tokens; keys: every rank's
        assert x["memory"]["peak"] <= budget and x["memory"]["peak"] == x["memory"]["planned_peak"]
        got = x["records"]
        for emit, window in ((2, (1, 2)), (4, (3, 4))):
            layers = {k[2] for k in got if k[0] == emit and k[1] == "ffn"}
            assert layers == {0, 1, 2, 3}, (rank, emit, layers)  # every layer once, on every rank
            for layer in layers:
                want = _ffn_reference(res[owner[layer]]["rows"], window, layer)
                for name in METRICS:
                    assert got[(emit, "ffn", layer, None, name)] == pytest.approx(want[name], rel=1e-6), \
                        (rank, emit, layer, name)
        keys = {k: v for k, v in got.items() if k[1] == "keys"}
        assert keys.keys() == keys_ref.keys()
        for k, v in keys_ref.items():
            assert keys[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


# --------------------------------------------------------------------------------------- tests
def test_two_ranks_own_the_ffn_layers_and_report_each_once(two):
    outs, budgets, _ = two
    _check_owned(results(outs, "owned"), 2, budgets["owned"])


@pytest.mark.slow  # the 2-rank test checks the same; 4 ranks on 2 cores take ~8 s more (CI's newest runs it)
def test_four_ranks_own_one_ffn_layer_each(four):
    outs, budgets, _ = four
    res = results(outs, "owned")
    assert [len(x["memory"]["ffn_layers"]) for x in res] == [1, 1, 1, 1]
    _check_owned(res, 4, budgets["owned"])


def test_rotation_reports_each_layer_in_turn_equal_to_its_window(two):
    outs, budgets, _ = two
    res = results(outs, "rotation")
    owner = {l: h[0] for l, h in res[0]["holders"].items()}
    for rank, x in enumerate(res):
        assert x["mode"] == ("owned", "float32", 2)
        assert x["memory"]["peak"] <= budgets["rotation"]
        got = x["records"]
        for window, step in enumerate(STEPS):
            layers = {k[2] for k in got if k[0] == step and k[1] == "ffn"}
            turn = {l for l in range(4) if (l // 2) == window % 2}  # each rank's 2 layers in 2 turns
            assert layers == turn, (rank, step, layers)
            for layer in layers:
                want = _ffn_reference(res[owner[layer]]["rows"], (step,), layer)
                for name in METRICS:  # float32 totals and solve: ~1e-6 of the float64 reference
                    assert got[(step, "ffn", layer, None, name)] == pytest.approx(want[name], rel=2e-5)
                assert got[(step, "ffn", layer, None, "window_start")] == step


def test_checkpoints_under_ownership_resume_exactly(two):
    outs, budgets, tmp = two
    whole = [x["records"] for x in results(outs, "owned")]
    res = results(outs, "checkpoint")
    for rank, x in enumerate(res):
        want = {k: v for k, v in whole[rank].items() if k[0] == 4}
        assert x["probe"] == pytest.approx(want, rel=1e-12, abs=1e-12) and x["probe"]
        assert x["memory"] <= budgets["owned"]
    # the callbacks' merged state: rank 0 reports (sync="rank0"); each rank took back its own layers
    r0 = res[0]
    assert r0["stream_resumed"] == pytest.approx(r0["stream_whole"], rel=1e-12) and r0["stream_whole"]  # history too
    assert res[1]["stream_resumed"] == {}
    for rank, x in enumerate(res):
        assert x["stream_kept"] == sorted(l for l, h in x["holders"].items() if h[0] == rank)
    # on one process (another world size): the layout changes, and it says what it keeps
    from fastspec.integrations._stream import Stream

    state = torch.load(tmp / "stream.pt", weights_only=False)
    later = r"; the rows of FFN layers \[3\], which this rank keeps but whose turn is later, are dropped"
    for budget, layers, dropped in ((budgets["owned"] + 10 ** 5, [0, 1, 2, 3], ""), (budgets["owned"], [0, 1, 2], later)):
        # one process holds 4 layers in float32 with a little more room, 3 a turn with a little less
        stream = Stream(None, {**KW, "emit_every": 2, "memory": budget}, None, "fastspec", None)
        stream.load_state_dict(state)
        with pytest.warns(UserWarning, match=r"saved under another FFN layout \(.*dp 2 -> 1.*\): each FFN layer's "
                                             r"accumulator goes to the rank that keeps it now.*" + dropped):
            stream.build(wide_llama())
        n = {l: int(acc.cov.n.item()) for (s, l), acc in stream.probe._totals.accs.items() if s == "ffn"}
        assert n == {l: 2 * 8 - 3 for l in layers}  # step 3's rows of each layer's owner (3 padded rows)


def test_tensor_parallel_ffn_records_equal_one_process(two):
    outs, _, _ = two
    res = results(outs, "tensor_parallel")
    model = wide_llama()
    full = batch(B=3, T=10, pad="right")
    want = {k: v for k, v in _values(fastspec.Probe(model, **KW).measure(full, step=0)).items()}
    for rank, x in enumerate(res):
        assert x["mode"] == "replicated" and {h[1] for h in x["holders"].values()} == {0, 1}
        for kind in ("stream", "measure"):
            ffn = {k: v for k, v in x[kind].items() if k[1] == "ffn"}
            if rank:  # the gathered FFN records are reported once, by tensor-parallel rank 0
                assert not ffn
                continue
            want_ffn = {k: v for k, v in want.items() if k[1] == "ffn"}
            assert ffn.keys() == want_ffn.keys()
            for k, v in want_ffn.items():
                assert ffn[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (kind, k)
        keys = {k for k in x["measure"] if k[1] == "keys"}
        assert {k[3] for k in keys} == {rank}  # each rank its own KV head (global index)


def test_fastspec_plan_matches_every_rank_s_memory(two, tmp_path):
    outs, budgets, _ = two
    wide_llama().config.to_json_file(tmp_path / "config.json")
    res = subprocess.run([sys.executable, "-m", "fastspec", "plan", str(tmp_path), "--dp", "2", "--memory",
                          str(budgets["owned"]), "--device", "cpu", "--dtype", "fp32", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    probes = [x["memory"] for x in results(outs, "owned")]
    assert out["memory_peak_bytes"] == max(m["peak"] for m in probes)
    assert not out["ffn_all_reduced"] and out["layouts"] == [["owned", "float64"]]
    assert sorted(r["peak_bytes"] for r in out["ranks"] for _ in range(r["ranks"])) == sorted(m["peak"] for m in probes)
