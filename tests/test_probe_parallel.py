"""The probe under distributed engines: FSDP2 (``fully_shard``) and DTensor tensor parallelism.

Two gloo processes on CPU (tests/_ranks.py, file rendezvous, one thread each, as test_probe_distributed.py),
tiny Llama (4 query heads, 2 KV heads, 2 layers), each engine eager and compiled
(``backend="aot_eager"``). One 2-rank job per engine runs every variant; each variant's records
(or its traceback) come back to the parent, which compares them with one process's records.

* FSDP2, every decoder layer and the root sharded, each rank half of the batch: ``sync="all"``
  records equal the records of one process on the whole batch. Compiled: the attention and MLP
  modules are compiled in place with ``fullgraph=True`` (the probe's hooks live there); the
  FSDP2 hooks on the layers stay outside the graphs, because torch runs them under
  ``torch._dynamo.disable`` and a ``fullgraph`` compile of the whole model cannot trace them
  (that test skips while torch has this limitation, whether or not a probe is attached).
* Tensor parallelism (q/k/v column-wise, o_proj row-wise), the whole batch on both ranks,
  ``tp_rank=rank, sync="none"``: rank r reports its local KV heads as global heads
  ``r * H_local + h``, each equal to that head of the single-process records. Compiled: the whole
  model with ``fullgraph=True``.
"""
from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
from _ranks import results, run_variant, start_ranks
from _tiny_models import batch, build

import fastspec

WORLD = 2
KV_HEADS, Q_HEADS = 2, 4  # the tiny Llama's (tests/_tiny_models.py)
COMPILE = dict(fullgraph=True, backend="aot_eager")


def _gloo() -> None:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is not available in this torch")
    return fully_shard


def _tensor_parallel():
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    except ImportError:
        pytest.skip("DTensor tensor parallelism (torch.distributed.tensor.parallel) is not available")
    return init_device_mesh, ColwiseParallel, RowwiseParallel, parallelize_module


def _values(records) -> dict:
    return {(r.site, r.layer, r.head_index, r.metric): r.value for r in records}


def _assert_same(got: dict, want: dict, rel: float = 1e-6) -> None:
    """Every record of ``want`` in ``got`` and the other way round, values to ``rel``."""
    assert got, "no records"
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys())[:4], sorted(want.keys() - got.keys())[:4])
    # per-rank fp32 partials / sharded matmuls sum in another order: ~1e-7 relative
    bad = [(k, got[k], want[k]) for k in want
           if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k]))
                   or abs(got[k] - want[k]) <= rel * abs(want[k]) + 1e-12)]
    assert not bad, f"{len(bad)} of {len(want)} records differ, e.g. {bad[:3]}"


def _half(inputs: dict, rank: int) -> dict:
    B = inputs["input_ids"].shape[0] // WORLD
    return {k: v[rank * B:(rank + 1) * B] for k, v in inputs.items()}


def _finish(rank: int, tmpdir: str, variants: dict) -> None:
    """Run every variant (its records or its traceback), save them for the parent, leave the group."""
    out: dict = {}
    try:
        for name, fn in variants.items():
            run_variant(out, name, fn)
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _init(rank: int, tmpdir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    # a variant that fails on one rank only must not leave the other waiting for long
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))


def _run(worker, tmpdir: str) -> list[dict]:
    start_ranks(worker, tmpdir, nprocs=WORLD)
    return [torch.load(os.path.join(tmpdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


FSDP_INPUTS = dict(B=4, T=10, pad="left")


# ------------------------------------------------------------------------------------ FSDP2
def _fsdp_worker(rank: int, tmpdir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    _init(rank, tmpdir)
    inputs = _half(batch(**FSDP_INPUTS), rank)

    def sharded(compile_blocks: bool = False):
        model = build("llama")
        for layer in model.model.layers:
            if compile_blocks:  # in place: module names (and so the probe's sites) do not change
                layer.self_attn.compile(**COMPILE)
                layer.mlp.compile(**COMPILE)
            fully_shard(layer)
        fully_shard(model)
        return model

    def stream(model, forward, backward: bool) -> dict:
        # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
        probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")  # sync="all"
        with probe.streaming():
            with torch.set_grad_enabled(backward):
                logits = forward(**inputs).logits
            if backward:
                logits.float().square().mean().backward()
            in_graph = probe._router.captured_in_graph  # cleared by step()
            records = probe.step(0)
        measured = fastspec.Probe(model, ffn_rows="all").measure(inputs, step=0)
        return {"stream": _values(records), "measure": _values(measured), "in_graph": in_graph}

    def eager():
        model = sharded()
        return stream(model, model, backward=True)

    def compiled_blocks():
        model = sharded(compile_blocks=True)
        return stream(model, model, backward=False)

    def compiled_whole():
        model = sharded()
        try:  # without a probe first: is this a torch limitation?
            with torch.no_grad():
                torch.compile(model, **COMPILE)(**inputs)
        except torch._dynamo.exc.Unsupported as e:
            torch._dynamo.reset()
            return {"unsupported": str(e).splitlines()[0]}
        return stream(model, torch.compile(model, **COMPILE), backward=False)

    _finish(rank, tmpdir, {"eager": eager, "compiled_blocks": compiled_blocks, "compiled_whole": compiled_whole})


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    _gloo()
    _fully_shard()
    model = build("llama")
    full = batch(**FSDP_INPUTS)
    probe = fastspec.Probe(model, ffn_rows="all", emit_every=1, forwards="all")
    with probe.streaming():
        model(**full)
        stream = _values(probe.step(0))
    measure = _values(fastspec.Probe(model, ffn_rows="all").measure(full, step=0))
    outs = _run(_fsdp_worker, str(tmp_path_factory.mktemp("fsdp")))
    return outs, stream, measure, full["attention_mask"].sum().item()


def _check_fsdp(res: list[dict], stream: dict, measure: dict, tokens: int) -> None:
    _assert_same(measure, stream, rel=0)  # the single-process references agree with each other
    for x in res:  # every rank: the global metrics
        for kind in ("stream", "measure"):
            _assert_same(x[kind], stream)
            _assert_same(x[kind], measure)
        assert {v for k, v in x["stream"].items() if k[3] == "n"} == {tokens}
        assert {k[0] for k in x["stream"]} == {"keys", "ffn"}


def test_fsdp2_eager_records_equal_one_process_on_the_whole_batch(fsdp):
    outs, stream, measure, tokens = fsdp
    res = results(outs, "eager")
    _check_fsdp(res, stream, measure, tokens)
    assert not any(x["in_graph"] for x in res)


def test_fsdp2_compiled_blocks_fullgraph_records_equal_one_process(fsdp):
    """Attention and MLP compiled in place with fullgraph=True inside FSDP2-sharded layers: the
    captures are in the graphs (no graph break), and measure() (run eagerly) agrees."""
    outs, stream, measure, tokens = fsdp
    res = results(outs, "compiled_blocks")
    _check_fsdp(res, stream, measure, tokens)
    assert all(x["in_graph"] for x in res)


def test_fsdp2_compiled_whole_model_fullgraph(fsdp):
    outs, stream, measure, tokens = fsdp
    res = results(outs, "compiled_whole")
    if any("unsupported" in x for x in res):
        reason = next(x["unsupported"] for x in res if "unsupported" in x)
        pytest.skip(f"torch {torch.__version__}: fullgraph compile of an FSDP2 model fails without "
                    f"the probe too (its hooks are dynamo-disabled): {reason}")
    _check_fsdp(res, stream, measure, tokens)
    assert all(x["in_graph"] for x in res)


# --------------------------------------------------------------------- tensor parallelism
TP_INPUTS = dict(B=3, T=10, pad="right")


def _tp_worker(rank: int, tmpdir: str) -> None:
    init_device_mesh, ColwiseParallel, RowwiseParallel, parallelize_module = _tensor_parallel()

    _init(rank, tmpdir)
    inputs = batch(**TP_INPUTS)  # the whole batch on every rank
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()}

    def parallel():
        model = build("llama")
        for layer in model.model.layers:
            # the Llama attention reshapes q/k/v with -1 heads: the local head counts need no edit
            parallelize_module(layer.self_attn, mesh, plan)
        return model

    def probe(model):
        return fastspec.Probe(model, queries=True, ffn=False, tp_rank=rank, sync="none", emit_every=1,
                              forwards="all")

    def stream(model, forward, backward: bool) -> dict:
        p = probe(model)
        with p.streaming():
            with torch.set_grad_enabled(backward):
                logits = forward(**inputs).logits
            if backward:
                logits.float().square().mean().backward()
            in_graph = p._router.captured_in_graph
            records = p.step(0)
        return {"stream": _values(records), "in_graph": in_graph, "logits": logits.detach()}

    def eager():
        model = parallel()
        return {**stream(model, model, backward=True), "measure": _values(probe(model).measure(inputs, step=0))}

    def compiled():
        model = parallel()
        return stream(model, torch.compile(model, **COMPILE), backward=False)

    _finish(rank, tmpdir, {"eager": eager, "compiled": compiled})


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    _gloo()
    _tensor_parallel()
    model = build("llama")
    full = batch(**TP_INPUTS)
    with torch.no_grad():
        logits = model(**full).logits
    want = _values(fastspec.Probe(model, queries=True, ffn=False).measure(full, step=0))
    outs = _run(_tp_worker, str(tmp_path_factory.mktemp("tp")))
    return outs, want, logits, full["attention_mask"].sum().item()


def _check_tp(res: list[dict], want: dict, logits: torch.Tensor, tokens: int, kinds: tuple[str, ...]) -> None:
    kv_local, q_local = KV_HEADS // WORLD, Q_HEADS // WORLD
    for rank, x in enumerate(res):
        torch.testing.assert_close(x["logits"], logits, rtol=1e-5, atol=1e-5)  # the model is still right
        heads = {"keys": {rank * kv_local + h for h in range(kv_local)},
                 "queries": {rank * q_local + h for h in range(q_local)}}
        mine = {k: v for k, v in want.items() if k[2] in heads.get(k[0], ())}
        assert mine and {k[2] for k in mine if k[0] == "keys"} == heads["keys"]
        for kind in kinds:
            _assert_same(x[kind], mine)  # exactly this rank's global heads, each as one process sees it
            assert {v for k, v in x[kind].items() if k[3] == "n"} == {tokens}


def test_tensor_parallel_eager_rank_reports_its_global_heads(tp):
    outs, want, logits, tokens = tp
    res = results(outs, "eager")
    _check_tp(res, want, logits, tokens, ("stream", "measure"))
    assert not any(x["in_graph"] for x in res)


def test_tensor_parallel_compiled_fullgraph_rank_reports_its_global_heads(tp):
    outs, want, logits, tokens = tp
    res = results(outs, "compiled")
    _check_tp(res, want, logits, tokens, ("stream",))
    assert all(x["in_graph"] for x in res)
