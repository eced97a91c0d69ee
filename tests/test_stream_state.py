"""The trainer callbacks' checkpoint state under ``torch.distributed`` (``fastspec/integrations/_stream.py``),
on 2 gloo ranks without a trainer: saving in the middle of an emission window and restoring gives
the records of a run that never stopped,

* ``sync="rank0"`` (the callbacks' default): the ranks' accumulators are merged on rank 0; the
  merged state resumes exactly on 2 ranks, and on 1 process (another world size);
* ``sync="none"``: each rank's accumulators are kept side by side and each rank takes its own
  back; on another world size they are dropped, with a warning.

The trainers' own paths (HF ``on_save``, Lightning ``state_dict``) are tested in
tests/test_stream_hf.py and tests/test_stream_lightning.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _ranks import start_ranks
from _tiny_models import batch, build

from fastspec.integrations._stream import Stream

WORLD = 2
# build() models are in eval mode; float64 products everywhere, so that one process adding both
# ranks' rows in one update matches two ranks' sums to rounding
KW = {"emit_every": 2, "forwards": "all", "ffn_rows": "all", "precision": "exact"}


def _rows(rank: int, step: int) -> dict:
    return batch(B=2, T=8, seed=10 * step + rank)  # rank r's own rows at each step


def _stream(model, sync: str) -> Stream:
    stream = Stream(None, {**KW, "sync": sync}, None, "fastspec", None)
    stream.build(model)
    stream.attach()
    return stream


def _run(stream: Stream, model, rank: int, steps) -> list:
    for step in steps:
        stream.unpause()
        model(**_rows(rank, step))
        stream.step(step)
    stream.finish()
    return stream.records


def _values(records) -> dict:
    return {(r.step, r.site, r.layer, r.head_index, r.metric): r.value for r in records if r.site != "probe"}


def _worker(rank: int, tmpdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        model = build("llama")
        out = {}
        for sync in ("rank0", "none"):
            out[f"{sync}/whole"] = _values(_run(_stream(model, sync), model, rank, [1, 2, 3, 4]))
            first = _stream(model, sync)
            _run(first, model, rank, [1, 2, 3])        # the checkpoint after step 3: mid-window
            state = first.state_dict()                 # a collective: rank 0 gets it
            if rank == 0:
                torch.save(state, os.path.join(tmpdir, f"state-{sync}.pt"))
            out[f"{sync}/others_state"] = state
            dist.barrier()
            resumed = Stream(None, {**KW, "sync": sync}, None, "fastspec", None)
            resumed.load_state_dict(torch.load(os.path.join(tmpdir, f"state-{sync}.pt"), weights_only=False))
            resumed.build(model)
            resumed.attach()
            out[f"{sync}/resumed"] = _values(_run(resumed, model, rank, [4]))
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream_state")
    build("llama")  # imports the model code once, before the fork
    start_ranks(_worker, str(tmp), nprocs=WORLD)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and want
    bad = {k: (got[k], want[k]) for k in want if got[k] != pytest.approx(want[k], rel=1e-12, abs=1e-12)}
    assert not bad, list(bad.items())[:5]


def test_rank0_state_merges_the_ranks_and_resumes_exactly_on_two_ranks(ranks):
    tmp, (r0, r1) = ranks
    _close(r0["rank0/resumed"], r0["rank0/whole"])
    assert r1["rank0/resumed"] == r1["rank0/whole"] == {}  # rank 1 never holds records
    assert r1["rank0/others_state"] is None              # only rank 0 gets (and writes) the state
    state = torch.load(tmp / "state-rank0.pt", weights_only=False)
    assert state["world_size"] == 2 and not state["per_rank"]
    n = {int(v) for e in state["probe"]["accumulators"] for v in e["state"]["n"].flatten()}
    assert n == {2 * 2 * 8}  # step 3's rows of both ranks, merged into one entry per (site, layer)


def test_rank0_state_resumes_exactly_on_one_process(ranks):
    tmp, (r0, _) = ranks
    model = build("llama")
    resumed = Stream(None, dict(KW), None, "fastspec", None)  # no process group here: sync is moot
    resumed.load_state_dict(torch.load(tmp / "state-rank0.pt", weights_only=False))
    resumed.build(model)
    resumed.attach()
    for step in [4]:  # both ranks' rows of step 4, in one process
        resumed.unpause()
        model(**{k: torch.cat([_rows(0, step)[k], _rows(1, step)[k]]) for k in ("input_ids", "attention_mask")})
        resumed.step(step)
    resumed.finish()
    _close(_values(resumed.records), r0["rank0/whole"])


def test_none_state_keeps_each_rank_s_own_accumulators(ranks):
    tmp, (r0, r1) = ranks
    for r in (r0, r1):
        _close(r["none/resumed"], r["none/whole"])
    assert r0["none/whole"] != r1["none/whole"]  # each rank emitted its own tokens
    state = torch.load(tmp / "state-none.pt", weights_only=False)
    assert state["per_rank"] and len(state["probe"]) == WORLD  # each rank's whole probe state


def test_none_state_on_another_world_size_drops_the_accumulators_with_a_warning(ranks):
    tmp, _ = ranks
    resumed = Stream(None, {**KW, "sync": "none"}, None, "fastspec", None)
    resumed.load_state_dict(torch.load(tmp / "state-none.pt", weights_only=False))
    with pytest.warns(UserWarning, match="saved by 2 ranks .* restored on 1"):
        resumed.build(build("llama"))
    assert not resumed.probe._totals.accs  # dropped: the next emission counts new tokens only
    assert {k[0] for k in _values(resumed.probe.records())} == {2}  # the history is kept
