"""``fastspec.integrations.hf.FastspecStreamCallback``: the probe streamed over the training tokens of
the real Hugging Face ``Trainer`` on CPU (docs/hf.md), with the tiny demo model.

One probe step per optimizer step, after every micro-batch; evaluation and checkpoint saves leave
the records bit for bit unchanged; a run stopped at a checkpoint and resumed (``True`` or a path
elsewhere) gives the records of one that never stopped; the scalars reach ``log_history``,
``trainer_state.json``, TensorBoard and (layer means only) the console; alerts; bad arguments; and
2 gloo ranks under torchrun (tests/_hf_stream_train.py) give the records of one process.
The probe's own settings check on restore (``Probe.load_state_dict``) is tested on a bare probe too.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _integrations import env
from _tiny_models import demo_model

import fastspec
from fastspec.integrations.hf import STATE_FILE, FastspecStreamCallback

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "_hf_stream_train.py"
BATCH, ACCUMULATE, SEQ = 2, 2, 16          # per micro-batch: 2 sequences of 16 tokens
TOKENS_PER_STEP = BATCH * ACCUMULATE * SEQ  # 64 tokens per optimizer step
EMIT_EVERY, STEPS = 2, 6
EMISSIONS = [2, 4, 6]
PR_MEAN = "fastspec/stream/keys/participation_ratio/mean"


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, SEQ), generator=g)]


def _train(out, *, callback=None, probe_kwargs=None, max_steps=STEPS, evaluate=False, stop_at=None,
           save_steps=None, resume=None, trainers=None, **overrides):
    """One ``Trainer`` run of the demo model with the streaming callback (fresh model, fresh
    callback unless given): returns ``(callback, trainer)``. ``stop_at``: stop after that step;
    ``save_steps``: checkpoints; ``resume``: ``trainer.train(resume_from_checkpoint=resume)``;
    ``trainers``: a list the trainer is appended to before it trains (to read it after a raise)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    if callback is None:
        callback = FastspecStreamCallback(probe_kwargs={"emit_every": EMIT_EVERY, **(probe_kwargs or {})})
    data = _data()
    args = TrainingArguments(**{
        "output_dir": str(out), "max_steps": max_steps, "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATE, "per_device_eval_batch_size": 2, "report_to": [],
        "use_cpu": True, "disable_tqdm": True, "seed": 0, "lr_scheduler_type": "constant", "logging_steps": 1,
        "save_strategy": "steps" if save_steps else "no", "save_steps": save_steps or 500,
        "eval_strategy": "steps" if evaluate else "no", "eval_steps": 1, **overrides})
    trainer = Trainer(model=demo_model().train(), args=args, train_dataset=data,
                      eval_dataset=data[:4] if evaluate else None, callbacks=[callback, Stop()])
    if trainers is not None:
        trainers.append(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return callback, trainer


def _values(records) -> dict[tuple, float]:
    """``{(step, site, layer, head, metric): value}`` without the probe's own overhead (a wall-clock
    timing, never equal between two runs)."""
    out = {}
    for r in fastspec.integrations.as_dicts(records):
        if r["site"] != "probe":
            out[(r["step"], r["site"], r["layer"], r["head_index"], r["metric"])] = r["value"]
    return out


def _n(values: dict, site: str = "keys") -> dict[int, set]:
    """``{step: {n of each layer and head}}`` of ``site``."""
    out: dict[int, set] = {}
    for k, v in values.items():
        if k[1] == site and k[4] == "n":
            out.setdefault(k[0], set()).add(v)
    return out


def _assert_close(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys()
    bad = {k: (got[k], want[k]) for k in want
           if not (got[k] == want[k] or math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-300))}
    assert not bad, f"{len(bad)} of {len(want)} values differ, e.g. {next(iter(bad.items()))}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: no evaluation, no checkpoint."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb, trainer = _train(tmp_path_factory.mktemp("reference"))
    return {"callback": cb, "trainer": trainer, "values": _values(cb.records),
            "warnings": [str(w.message) for w in caught if "fastspec" in str(w.message)]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run stopped at step 3 (mid-window: emissions at 2, 4, 6) with a checkpoint there."""
    out = tmp_path_factory.mktemp("stopped")
    _train(out, stop_at=3, save_steps=3)
    return out / "checkpoint-3"


# ------------------------------------------------------------------ accumulation, evaluation
def test_one_step_per_optimizer_step_and_evaluation_changes_nothing(reference, tmp_path):
    """``gradient_accumulation_steps=2``: one ``probe.step`` per optimizer step, after both
    micro-batches (each emission's ``n`` is the tokens of ``emit_every`` steps of 2 micro-batches);
    an evaluation after every step leaves the records bit for bit as they were."""
    want = reference["values"]
    assert reference["warnings"] == []
    assert {k[0] for k in want} == set(EMISSIONS)  # the emission steps: global_step multiples of emit_every
    assert {r.protocol for r in reference["callback"].records} == {"stream"}
    assert _n(want) == {s: {float(EMIT_EVERY * TOKENS_PER_STEP)} for s in EMISSIONS}
    assert {k[1] for k in want} >= {"keys", "ffn"}
    cb, trainer = _train(tmp_path, evaluate=True)
    assert sum("eval_loss" in h for h in trainer.state.log_history) == STEPS  # it did evaluate, every step
    got = _values(cb.records)
    assert got == want  # bit for bit
    # the overhead record is there (a timing: left out of the comparisons above)
    assert any(r.site == "probe" and r.metric == "overhead_fraction" for r in cb.records)


def test_tokens_seen_from_tokens_per_step_or_the_trainers_count(tmp_path):
    cb, _ = _train(tmp_path / "a", callback=FastspecStreamCallback(probe_kwargs={"emit_every": 2, "ffn": False},
                                                                  tokens_per_step=1000), max_steps=4)
    assert {(r.step, r.tokens_seen) for r in cb.records} == {(2, 2000), (4, 4000)}
    cb, trainer = _train(tmp_path / "b", probe_kwargs={"ffn": False}, max_steps=4,
                         include_num_input_tokens_seen=True)
    assert {(r.step, r.tokens_seen) for r in cb.records} == {(2, 2 * TOKENS_PER_STEP), (4, 4 * TOKENS_PER_STEP)}
    assert trainer.state.num_input_tokens_seen == 4 * TOKENS_PER_STEP


# -------------------------------------------------------------------------- checkpoints
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(reference, checkpoint, tmp_path):
    """Stopped at step 3 (a checkpoint mid-way between emissions 2 and 4), resumed in a fresh
    Trainer with a fresh model and callback: the records (those before the checkpoint too) are
    those of the run that never stopped, for ``resume_from_checkpoint=True`` and for a path in
    another folder (read from the Trainer's argument, not from ``output_dir``)."""
    assert (checkpoint / STATE_FILE).is_file()
    saved = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    assert saved["world_size"] == 1 and saved["probe"]["steps_seen"] == 3
    want = reference["values"]
    # True: the last checkpoint of output_dir (a copy of the stopped run's folder: the fixture stays as it is)
    out = tmp_path / "again"
    shutil.copytree(checkpoint.parent, out)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastspec")
        cb, trainer = _train(out, resume=True)
    assert trainer.state.global_step == STEPS
    _assert_close(_values(cb.records), want, rel=1e-12)
    # a path elsewhere, another output_dir (which holds no checkpoint-3)
    elsewhere = tmp_path / "moved" / "kept"
    shutil.copytree(checkpoint, elsewhere)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastspec")
        cb, _ = _train(tmp_path / "other_output", resume=str(elsewhere))
    _assert_close(_values(cb.records), want, rel=1e-12)
    assert not (tmp_path / "other_output" / "checkpoint-3").exists()


def test_resume_without_the_state_file_warns_and_streams_afresh(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / STATE_FILE).unlink()
    with pytest.warns(UserWarning, match=STATE_FILE):
        cb, _ = _train(tmp_path / "out", resume=str(bare))
    got = _values(cb.records)
    assert 2 not in {k[0] for k in got}  # the records before the checkpoint are not there
    # a new schedule from the resumed step 3: an emission 2 steps on, of steps 4 and 5 (step 3's
    # tokens were in the lost state)
    assert _n(got) == {5: {float(EMIT_EVERY * TOKENS_PER_STEP)}}


def test_resume_with_a_new_schedule_keeps_the_accumulators(reference, checkpoint, tmp_path):
    """emit_every 2 -> 3: a warning names the change; step 3's tokens are kept, and the next
    emission (the first multiple of 3 at least 3 steps after the last one, 2) counts steps 3..6."""
    with pytest.warns(UserWarning, match="emit_every 2 -> 3.*kept"):
        cb, _ = _train(tmp_path, resume=str(checkpoint), probe_kwargs={"emit_every": 3})
    got = _values(cb.records)
    assert _n(got) == {2: {float(EMIT_EVERY * TOKENS_PER_STEP)}, 6: {float(4 * TOKENS_PER_STEP)}}
    assert {k: v for k, v in got.items() if k[0] == 2} == {k: v for k, v in reference["values"].items() if k[0] == 2}


@pytest.mark.parametrize("change", [{"ffn": False}, {"row_step": 2}])
def test_resume_with_other_rows_drops_the_accumulators(checkpoint, tmp_path, change):
    """ffn off or another row_step: the saved rows mean something else; a warning, and the next
    emission (step 4, the schedule is kept) counts step 4's tokens only."""
    with pytest.warns(UserWarning, match="dropped"):
        cb, _ = _train(tmp_path, resume=str(checkpoint), probe_kwargs=change)
    got = _n(_values(cb.records))
    rows = TOKENS_PER_STEP // change.get("row_step", 1)
    assert got[4] == {float(rows)} and got[6] == {float(EMIT_EVERY * rows)}
    assert got[2] == {float(EMIT_EVERY * TOKENS_PER_STEP)}  # the history is kept


def _feed(probe, model, steps, first=1):
    """``steps`` optimizer steps of one training forward each (batches drawn from a fixed seed)."""
    g = torch.Generator().manual_seed(first)
    records = []
    for step in range(first, first + steps):
        ids = torch.randint(0, 64, (2, SEQ), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        records += probe.step(step)
    return records


def test_probe_load_state_dict_checks_the_settings():
    """On a bare probe: a state saved under emit_every=2 loaded under emit_every=3 warns and keeps
    the accumulated rows; under row_step=2 it warns and drops them; a state saved without
    settings (an older one) loads silently as it is."""
    model = demo_model().train()
    probe = fastspec.Probe(model, emit_every=2, ffn=False)
    with probe.streaming():
        _feed(probe, model, 1)  # step 1: 32 rows accumulated, nothing emitted
        state = probe.state_dict()
    assert state["settings"]["emit_every"] == 2 and state["settings"]["row_step"] == 1

    kept = fastspec.Probe(model, emit_every=3, ffn=False)
    with pytest.warns(UserWarning, match=r"emit_every 2 -> 3.*accumulators are kept"):
        kept.load_state_dict(state)
    with kept.streaming():
        records = _feed(kept, model, 2, first=2)  # steps 2, 3: emits at 3 (0 + 3)
    assert {(r.step, r.value) for r in records if r.site == "keys" and r.metric == "n"} == {(3, 3 * 2 * SEQ)}

    dropped = fastspec.Probe(model, emit_every=2, ffn=False, row_step=2)
    with pytest.warns(UserWarning, match=r"row_step 1 -> 2.*dropped"):
        dropped.load_state_dict(state)
    with dropped.streaming():
        records = _feed(dropped, model, 1, first=2)  # step 2: emits (0 + 2) the rows of step 2 only
    assert {(r.step, r.value) for r in records if r.site == "keys" and r.metric == "n"} == {(2, 2 * SEQ // 2)}
    assert {r.step for r in dropped.records()} == {2}  # the history was empty at step 1

    old = {k: v for k, v in state.items() if k != "settings"}
    silent = fastspec.Probe(model, emit_every=3, ffn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        silent.load_state_dict(old)
    saved = [e for e in silent.state_dict()["accumulators"] if e["site"] == "keys"]
    assert saved and all(float(e["state"]["n"].sum()) == 2 * SEQ for e in saved)  # kept as they were


# ----------------------------------------------------------------------------- logging
def test_scalars_in_log_history_and_trainer_state(reference, checkpoint):
    history = reference["trainer"].state.log_history
    logged = {h["step"]: h for h in history if PR_MEAN in h}
    assert sorted(logged) == EMISSIONS
    for h in logged.values():
        assert "loss" in h  # merged into the trainer's own log of that step
        assert {"fastspec/stream/keys/participation_ratio/layer0", "fastspec/stream/keys/participation_ratio/layer1",
                "fastspec/stream/ffn/effective_dim/mean", "fastspec/stream/keys/n/mean"} <= set(h)
        assert h["fastspec/stream/keys/n/mean"] == EMIT_EVERY * TOKENS_PER_STEP
    pr = [r.value for r in reference["callback"].records
          if r.step == 4 and r.site == "keys" and r.metric == "participation_ratio"]
    assert logged[4][PR_MEAN] == pytest.approx(sum(pr) / len(pr), rel=1e-12)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = [h for h in state["log_history"] if PR_MEAN in h]
    assert [h["step"] for h in saved] == [2] and saved[0][PR_MEAN] == logged[2][PR_MEAN]


def test_tensorboard_gets_every_scalar_and_the_console_the_layer_means(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # transformers 5.25 has no TrainingArguments.logging_dir: TENSORBOARD_LOGGING_DIR, else under output_dir
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "out" / "tb"))
    capsys.readouterr()
    _train(tmp_path / "out", max_steps=4, report_to=["tensorboard"])
    printed = capsys.readouterr().out
    (events,) = (tmp_path / "out").rglob("events.out.tfevents*")
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # the Trainer's TensorBoard callback names its scalars train/<key>
    for name in ("keys/participation_ratio/layer0", "keys/participation_ratio/layer1",
                 "keys/participation_ratio/mean", "ffn/effective_dim/layer0"):
        tag = f"train/fastspec/stream/{name}"
        assert tag in tags, (name, sorted(tags)[:20])
        assert [e.step for e in acc.Scalars(tag)] == [2, 4]
    # PrinterCallback (disable_tqdm=True): one dict per log, the layer means but not the layers
    lines = [ln for ln in printed.splitlines() if PR_MEAN in ln]
    assert len(lines) == 2
    assert "fastspec/stream/" in printed and "/layer0" not in printed and "/layer1" not in printed


# ------------------------------------------------------------------------------- alerts
def test_alerts_fire_and_are_logged(tmp_path):
    from fastspec.integrations.alerts import RankCollapseAlert, RankCollapseError

    seen = []
    alert = RankCollapseAlert(threshold=1e9, action=seen.append)
    cb, trainer = _train(tmp_path / "a", max_steps=4,
                         callback=FastspecStreamCallback(probe_kwargs={"emit_every": 2, "ffn": False}, alerts=alert))
    assert [(a.step, a.layer, a.kind) for a in seen] == [(2, 0, "below_threshold"), (2, 1, "below_threshold")]
    assert cb.alerts is alert and alert.fired == seen
    counts = {h["step"]: h["fastspec/alerts"] for h in trainer.state.log_history if "fastspec/alerts" in h}
    assert counts == {2: 2.0, 4: 0.0}  # fires when the condition starts to hold, then not again

    raising = FastspecStreamCallback(probe_kwargs={"emit_every": 2, "ffn": False},
                                     alerts=RankCollapseAlert(threshold=1e9, action="raise"))
    trainers = []
    with pytest.raises(RankCollapseError, match="step 2"):
        _train(tmp_path / "b", max_steps=4, callback=raising, trainers=trainers)
    (trainer,) = trainers
    history = trainer.state.log_history
    logged = [h for h in history if PR_MEAN in h]
    assert [h["step"] for h in logged] == [2] and logged[0]["fastspec/alerts"] == 2.0
    assert trainer.state.global_step == 2  # stopped at the emission
    # train() raised before on_train_end: the callback detached the probe itself
    assert not raising.probe._hooks.installed and not raising._stream.attached


# ---------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, name, kind", [
    ({"probe": "x"}, "probe", TypeError),
    ({"probe_kwargs": [1]}, "probe_kwargs", TypeError),
    ({"prefix": 3}, "prefix", TypeError),
    ({"tokens_per_step": 0}, "tokens_per_step", ValueError),
    ({"probe": lambda m: None, "probe_kwargs": {}}, "probe_kwargs", ValueError),
])
def test_bad_arguments_are_one_line_errors_naming_the_argument(kwargs, name, kind):
    with pytest.raises(kind) as err:
        FastspecStreamCallback(**kwargs)
    assert str(err.value).startswith(f"{name}:") and "\n" not in str(err.value)


# ------------------------------------------------------------------------ DDP (torchrun)
def _torchrun(out: Path, nproc: int, *args: str) -> list[dict]:
    """The harness under torchrun: each rank's ``rank{r}.json``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HARNESS), "--out", str(out), *args]
    res = subprocess.run(cmd, check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(cmd[3:])} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}", pytrace=False)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """2 ranks with per-device batch 2 (a checkpoint every 3 steps), 1 rank with batch 4."""
    two = tmp_path_factory.mktemp("ddp2")
    one = tmp_path_factory.mktemp("ddp1")
    return {"two": _torchrun(two, 2, "--batch", "2", "--save-steps", "3"), "two_dir": two,
            "one": _torchrun(one, 1, "--batch", "4")[0]}


# slow: three torchrun launches (~30 s on 2 cores, serial); the fast tier keeps the ranks' merge and
# the distributed checkpoint state without a trainer (tests/test_stream_state.py)
@pytest.mark.slow
@pytest.mark.serial  # 2 ranks fill a 2-core machine: run alone (as tests/test_integration_*.py)
def test_ddp_two_ranks_stream_the_records_of_one_process(ddp):
    """float64 model, float64 products: the 2-rank records (merged on rank 0, emitted once) equal
    the 1-process ones but for rounding; rank 1 has none. Each emission's ``n`` is every row of
    both ranks; the collective checkpoint save wrote one state with the rows of both ranks."""
    rank0, rank1 = ddp["two"]
    assert rank0["world_size"] == 2 and rank0["global_step"] == STEPS == ddp["one"]["global_step"]
    want = _values(ddp["one"]["records"])
    got = _values(rank0["records"])
    assert {k[0] for k in want} == set(EMISSIONS)
    _assert_close(got, want, rel=1e-10)
    assert _n(got) == {s: {float(EMIT_EVERY * 2 * BATCH * ACCUMULATE * SEQ)} for s in EMISSIONS}
    assert rank1["records"] == [] and rank1["logs"] == []
    assert [h["step"] for h in rank0["logs"]] == EMISSIONS
    assert rank0["warnings"] == rank1["warnings"] == []
    state = torch.load(ddp["two_dir"] / "trainer" / "checkpoint-3" / STATE_FILE, map_location="cpu", weights_only=False)
    assert state["world_size"] == 2 and not state["per_rank"]
    keys = [e for e in state["probe"]["accumulators"] if e["site"] == "keys"]  # step 3's rows, both ranks'
    assert len(keys) == 2 and all(e["state"]["n"].tolist() == [2 * BATCH * ACCUMULATE * SEQ] for e in keys)


@pytest.mark.slow
@pytest.mark.serial
def test_ddp_checkpoint_resumes_on_one_process(ddp, tmp_path):
    """The 2-rank checkpoint at step 3 (accumulators of both ranks merged), resumed on 1 process
    with the accumulation doubled (the same rows per optimizer step): the records of the 1-process
    run that never stopped. The per-device batch stays 2: transformers 5.1 resumes with the
    checkpoint's per-device batch size, whatever the arguments say."""
    out = _torchrun(tmp_path, 1, "--batch", str(BATCH), "--accumulate", str(2 * ACCUMULATE),
                    "--resume", str(ddp["two_dir"] / "trainer" / "checkpoint-3"))[0]
    assert out["warnings"] == []
    _assert_close(_values(out["records"]), _values(ddp["one"]["records"]), rel=1e-10)
