"""``fastspec.integrations.megatron.FastspecStream`` in Megatron-core training runs on 2 gloo ranks.

Each run is ``tests/_megatron_train.py`` under torchrun (CPU, one thread per rank): a 4-layer
GPTModel (2 query groups of width 16, d_ff 128) trained 6 steps with Megatron's own schedules
(``get_forward_backward_func``: no pipelining, 1F1B, interleaved 1F1B), Megatron's
``DistributedDataParallel``, SGD, the stream emitting every 2 steps, some sequences padded. Every
layout trains the same model on the same global batches (the harness draws each weight from its
global name), so each run's records equal those of one process running the same micro-batches.
A run takes 8–11 s, most of it imports; runs are cached per module.

* data parallel (2 ranks): the records of one process (1e-6: float32 sums reordered), and each
  emission's key PR that of float64 ``svdvals`` of the keys every rank's core attention received;
* tensor parallel (2 ranks, one query group each): the keys of one process under global group
  indices, and the FFN records of one process (each FFN layer's rows gathered over the
  tensor-parallel group to the rank that keeps it, docs/scale.md);
* pipeline parallel (2 stages, selective recompute) and virtual pipeline (2 chunks per stage):
  one process's records under Megatron's global layer numbers, gathered to the logging rank;
* Megatron's distributed checkpoint (``dist_checkpointing``) with the stream's ``ShardedObject``:
  stopped after step 3 and resumed to 6, the records of the uninterrupted run.
"""
from __future__ import annotations

import math

import pytest
from _integrations import ROOT, runner

pytest.importorskip("megatron.core")
# each run trains 2 torchrun ranks, which fill a 2-core machine: run alone
pytestmark = pytest.mark.serial

HARNESS = ROOT / "tests" / "_megatron_train.py"
STEPS, EMIT_EVERY = 6, 2
EMISSIONS = (2, 4, 6)
BASE = ("--layers", "4", "--pad")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(*args, nproc=2)`` -> each rank's output of the harness (cached per argument list)."""
    return runner(tmp_path_factory, HARNESS, "--emit-every", str(EMIT_EVERY), paths=(ROOT / "tests",))


def _reference(run) -> list[dict]:
    """One process, the 4 micro-batches that 2 data-parallel ranks split between them."""
    return run(*BASE, "--steps", str(STEPS), "--micro-batches", "4", nproc=1)


def _logged(outs: list[dict]) -> list[dict]:
    """The records of the logging rank (the last), the only rank that keeps them."""
    assert all(not o["records"] for o in outs[:-1]), "a rank other than the logging rank kept records"
    return outs[-1]["records"]


def _values(records, site=None) -> dict[tuple, float]:
    """``{(step, site, layer, head, metric): value}`` without the probe's own overhead (a timing)."""
    return {(r["step"], r["site"], r["layer"], r["head_index"], r["metric"]): r["value"]
            for r in records if r["site"] != "probe" and (site is None or r["site"] == site)}


def _assert_same(got: dict, want: dict, rel: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-9)}
    assert not bad, f"{len(bad)} of {len(want)} values differ, e.g. {next(iter(bad.items()))}"


def _assert_keys_match_svdvals(records, outs) -> None:
    """Each emission's key PR and ``n`` per (layer, group): float64 svdvals of the keys received
    in its window (the 2 steps since the previous emission), all ranks together."""
    import _megatron_train as H

    got = _values(records, "keys")
    for step in EMISSIONS:
        window = range(step - EMIT_EVERY + 1, step + 1)
        want, rows = H.key_pr(outs, window), H.key_rows(outs, window)
        assert want and want.keys() == rows.keys()
        for (layer, group), pr in want.items():
            assert got[(step, "keys", layer, group, "participation_ratio")] == pytest.approx(pr, rel=1e-6)
            assert got[(step, "keys", layer, group, "n")] == rows[(layer, group)]


def test_one_process_keys_match_svdvals(run):
    outs = _reference(run)
    records = _logged(outs)
    assert sorted({r["layer"] for r in records if r["site"] == "keys"}) == [0, 1, 2, 3]
    assert {r["step"] for r in records} == set(EMISSIONS)
    _assert_keys_match_svdvals(records, outs)
    # padding: each window's n is its real tokens, not every token
    n = _values(records, "keys")[(2, "keys", 0, 0, "n")]
    assert n == sum(outs[0]["real_tokens"][str(s)] for s in (1, 2)) < 2 * 4 * 2 * 16


def test_data_parallel_equals_one_process(run):
    outs = run(*BASE, "--steps", str(STEPS), "--micro-batches", "2")
    assert [o["dp"] for o in outs] == [2, 2]
    records = _logged(outs)
    _assert_same(_values(records), _values(_logged(_reference(run))))
    _assert_keys_match_svdvals(records, outs)


@pytest.mark.slow  # a torchrun job of its own (~10 s)
def test_tensor_parallel_keys_take_global_groups_and_ffn_rows_are_gathered(run):
    outs = run(*BASE, "--steps", str(STEPS), "--micro-batches", "4", "--tp", "2")
    assert [o["groups"] for o in outs] == [[0], [1]]
    records = _logged(outs)
    # the FFN input is split by column: its rows are gathered, and the records are one process's
    assert {r["layer"] for r in records if r["site"] == "ffn"} == {0, 1, 2, 3}
    _assert_same(_values(records), _values(_logged(_reference(run))))


@pytest.mark.slow  # a torchrun job of its own (~10 s)
def test_pipeline_stages_keep_global_layers(run):
    outs = run(*BASE, "--steps", str(STEPS), "--micro-batches", "4", "--pp", "2", "--recompute", "selective")
    assert [o["layers"] for o in outs] == [[0, 1], [2, 3]]
    assert all(o["core_attention_calls"]["recomputed"] > 0 for o in outs)  # the replays ran, uncounted
    records = _logged(outs)
    _assert_same(_values(records), _values(_logged(_reference(run))))
    # one overhead record per emission (from the second: the first has no step times yet), whatever
    # the number of stages: the largest of the stages' (each stage's probe reports its own)
    assert sorted(r["step"] for r in records if r["site"] == "probe") == list(EMISSIONS[1:])


@pytest.mark.slow  # a torchrun job of its own (~10 s)
def test_virtual_pipeline_chunks_keep_global_layers(run):
    outs = run(*BASE, "--steps", str(STEPS), "--micro-batches", "4", "--pp", "2", "--vp", "2")
    assert [o["layers"] for o in outs] == [[0, 2], [1, 3]]
    _assert_same(_values(_logged(outs)), _values(_logged(_reference(run))))


@pytest.mark.slow  # two torchrun jobs (~25 s)
def test_distributed_checkpoint_resumes_the_run(run, tmp_path):
    """Pipeline stages (1F1B) save after step 3 and resume to step 6: the records of the uninterrupted
    run, which under pipeline parallelism are one process's bit for bit."""
    ckpt = tmp_path / "ckpt"
    run(*BASE, "--steps", "3", "--micro-batches", "4", "--pp", "2", "--save", str(ckpt))
    resumed = run(*BASE, "--steps", str(STEPS), "--micro-batches", "4", "--pp", "2", "--load", str(ckpt))
    assert [o["first_step"] for o in resumed] == [4, 4]
    # the logging rank's records hold those from before the checkpoint too (its saved history)
    _assert_same(_values(_logged(resumed)), _values(_logged(_reference(run))), rel=1e-12)
