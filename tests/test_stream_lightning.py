"""Lightning streaming (``fastspec.integrations.lightning.FastspecStreamCallback``) in real
``lightning.pytorch.Trainer`` runs on CPU, with the demo's smallest model
(``tests/_tiny_models.py::demo_model``) in the LightningModule of ``tests/_lightning_stream_train.py``:

* gradient accumulation (2 micro-batches a step) with validation after every batch, in the
  middle of a step too, and a sanity check: records bit-for-bit those of the run without
  validation, one ``probe.step`` per optimizer step (``n`` = the tokens of ``emit_every`` steps ×
  2 micro-batches), and no validation counted as training time;
* a run stopped at a checkpoint in the middle of an emission window and resumed with
  ``trainer.fit(..., ckpt_path=...)`` gives the records (and alerts) of the run that never
  stopped; the callback's state is in the ``.ckpt``;
* DDP on 2 ranks under ``torchrun`` streams the records of one process on the same rows, emitted
  once (rank 0); its checkpoint (a collective save) resumes on one process exactly;
* the scalars reach the trainer's loggers (``CSVLogger``) at the emission steps;
* alerts run their action after the emission is logged (``"raise"`` stops ``fit``);
* bad arguments raise one-line errors naming the argument.
"""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import _lightning_stream_train as harness
from _integrations import env
from lightning.pytorch.loggers import CSVLogger, Logger

import fastspec
from fastspec.integrations import as_dicts, scalars
from fastspec.integrations.alerts import RankCollapseAlert, RankCollapseError
from fastspec.integrations.lightning import FastspecStreamCallback

ROOT = Path(__file__).resolve().parents[1]
SEQ = harness.SEQ
EMISSIONS = [2, 4, 6]  # emit_every=2 over 6 optimizer steps


class Collect(Logger):
    """A logger keeping every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name = property(lambda self: "collect")
    version = property(lambda self: 0)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))


def _values(records) -> dict:
    """``{(step, site, layer, head, metric): value}`` of the streamed records, without the
    probe's overhead record (a wall-clock timing)."""
    return {(r["step"], r["site"], r["layer"], r["head_index"], r["metric"]): r["value"]
            for r in as_dicts(records) if r["site"] != "probe" and r["protocol"] == "stream"}


def _steps(values: dict) -> list[int]:
    return sorted({k[0] for k in values})


def _n(values: dict, site: str = "keys") -> dict:
    """``{step: n}`` of a site (one value per step: every head and layer saw the same tokens)."""
    out: dict = {}
    for (step, s, _, _, metric), v in values.items():
        if s == site and metric == "n":
            out.setdefault(step, set()).add(v)
    return {step: v.pop() if len(v) == 1 else v for step, v in out.items()}


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got and got.keys() == want.keys()
    bad = [k for k in want if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))]
    assert not bad, f"{len(bad)} of {len(want)} records differ, e.g. {[(k, got[k], want[k]) for k in bad[:3]]}"


def _assert_close(got: dict, want: dict, rel: float) -> None:
    assert got and got.keys() == want.keys()
    bad = {k: (got[k], want[k]) for k in want
           if not (math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-300)
                   or (math.isnan(got[k]) and math.isnan(want[k])))}
    assert not bad, f"{len(bad)} of {len(want)} values differ beyond {rel:g}, e.g. {next(iter(bad.items()))}"


# ------------------------------------------------------------------ gradient accumulation, validation
def _accumulation_run(tmp_path, validate: bool, logger=None):
    """6 optimizer steps of 2 micro-batches of 2 rows (``emit_every=2``); with ``validate`` a
    sanity check and a validation after every batch (``val_check_interval`` counts batches: half
    of them fall inside a step). The probe's clock is fake: a training batch takes 1 s, a
    validation 100 s."""
    now = [0.0]

    class LM(harness.LM):
        def training_step(self, batch, batch_idx):
            now[0] += 1.0
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            now[0] += 100.0
            self.validated = getattr(self, "validated", 0) + 1
            super().validation_step(batch, batch_idx)

    cb = FastspecStreamCallback(lambda model: fastspec.Probe(model, emit_every=2, clock=lambda: now[0]),
                                model_attr="model", tokens_per_step=2 * 2 * SEQ)
    val = {"val_check_interval": 1, "num_sanity_val_steps": 1, "limit_val_batches": 1} if validate else \
          {"limit_val_batches": 0}
    tr = harness.trainer([cb], tmp_path, max_steps=6, accumulate_grad_batches=2, logger=logger or False,
                         log_every_n_steps=1, **val)
    lm = LM()
    loader = torch.utils.data.DataLoader(harness.rows(24), batch_size=2)
    tr.fit(lm, loader, torch.utils.data.DataLoader(harness.rows(2, seed=1), batch_size=2))
    assert int(tr.global_step) == 6 and lm.trained == [s for s in range(6) for _ in range(2)]
    return cb, lm


def test_accumulation_with_validation_every_batch_leaves_the_records_bitwise_unchanged(tmp_path):
    plain, _ = _accumulation_run(tmp_path / "plain", validate=False)
    validated, lm = _accumulation_run(tmp_path / "validated", validate=True)
    assert lm.validated == 1 + 12  # the sanity check, then after each of the 12 batches
    want = _values(plain.records)
    _assert_bitwise(_values(validated.records), want)
    assert _steps(want) == EMISSIONS
    # one probe.step per optimizer step: an emission covers 2 steps x 2 micro-batches x 2 rows
    assert _n(want) == {s: 2 * 2 * 2 * SEQ for s in EMISSIONS}
    assert {r.tokens_seen for r in validated.records} == {s * 2 * 2 * SEQ for s in EMISSIONS}
    # the validations, between steps and inside one, are not training time: only the training
    # batches' fake seconds (2 a step) make the step times, of every step after the first
    for cb in (plain, validated):
        ov = cb.probe.overhead()
        assert ov["base_s"] == pytest.approx(5 * 2.0) and ov["other_forwards"] == 0, ov


def test_scalars_reach_the_csv_logger_at_the_emission_steps(tmp_path):
    logger = CSVLogger(str(tmp_path), name="run")
    cb, _ = _accumulation_run(tmp_path, validate=False, logger=logger)
    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("fastspec/stream/keys/participation_ratio/mean")]
    assert [int(r["step"]) for r in rows] == EMISSIONS
    for row in rows:
        step = int(row["step"])
        want = scalars([r for r in cb.records if r.step == step], "fastspec")
        for tag in ("fastspec/stream/keys/participation_ratio/mean", "fastspec/stream/keys/participation_ratio/layer0",
                    "fastspec/stream/keys/participation_ratio/layer1", "fastspec/stream/ffn/effective_dim/mean"):
            assert float(row[tag]) == pytest.approx(want[tag], rel=1e-6), tag
        assert "fastspec/alerts" not in row or row["fastspec/alerts"] == ""  # no alerts= given


# ------------------------------------------------------------------ checkpoint and resume
STEP_ROWS = harness.rows(6 * 2).view(6, 1, 2, SEQ)  # the 2 rows of each optimizer step


def _resume_run(tmp_path, steps: int, ckpt_every=None, ckpt_path=None):
    """``steps`` optimizer steps on :data:`STEP_ROWS` (a batch's rows follow ``global_step``, not
    the loader, which a mid-epoch resume restarts); ``emit_every=2``, alerts on every emission."""
    alerts = RankCollapseAlert(threshold=1e9, action=None)  # every layer below it from the first emission
    cb = FastspecStreamCallback(probe_kwargs={"emit_every": 2}, model_attr="model", tokens_per_step=2 * SEQ,
                                alerts=alerts)
    callbacks = [cb]
    if ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=ckpt_every,
                                                      save_top_k=-1, filename="{step}"))
    tr = harness.trainer(callbacks, tmp_path, max_steps=steps)
    lm = harness.LM(by_step=STEP_ROWS)
    loader = torch.utils.data.DataLoader(harness.rows(16, seed=2), batch_size=2)  # 8 batches: one epoch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch ended")
        tr.fit(lm, loader, ckpt_path=ckpt_path)
    return cb, lm


def test_stop_at_a_checkpoint_and_resume_gives_the_uninterrupted_records(tmp_path):
    whole, lm = _resume_run(tmp_path / "whole", 6)
    assert lm.trained == [0, 1, 2, 3, 4, 5]
    want = _values(whole.records)
    assert _steps(want) == EMISSIONS and _n(want) == {s: 2 * 2 * SEQ for s in EMISSIONS}

    first, _ = _resume_run(tmp_path / "stopped", 3, ckpt_every=3)  # stops in the window of step 4's emission
    assert _steps(_values(first.records)) == [2]
    path = tmp_path / "stopped" / "ckpt" / "step=3.ckpt"
    state = torch.load(path, weights_only=False)["callbacks"]["FastspecStreamCallback"]
    assert (state["world_size"], state["per_rank"]) == (1, False)
    assert {(e["site"], e["layer"]) for e in state["probe"]["accumulators"]} == {
        ("keys", 0), ("keys", 1), ("ffn", 0), ("ffn", 1)}  # step 3's tokens, not emitted yet
    assert state["probe"]["settings"]["emit_every"] == 2

    resumed, lm = _resume_run(tmp_path / "stopped", 6, ckpt_path=str(path))  # a fresh module, trainer, callback
    assert lm.trained == [3, 4, 5]
    got = _values(resumed.records)
    assert _n(got) == _n(want)  # step 4's emission: step 3's restored tokens and step 4's
    _assert_close(got, want, rel=1e-12)
    assert [r.tokens_seen for r in resumed.records if r.metric == "n" and r.site == "keys" and r.layer == 0] == [
        64, 128, 192]
    # the alerts' state came back too: the layers that fired at step 2 stay fired, and fire
    # again neither at step 4 nor at 6, as in the run that never stopped
    assert [(a.step, a.layer) for a in whole.alerts.fired] == [(2, 0), (2, 1)]
    assert resumed.alerts.fired == []
    assert [e["active"] for e in state["alerts"]["layers"]] == [["below_threshold"]] * 2


# ------------------------------------------------------------------ DDP under torchrun
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """``tests/_lightning_stream_train.py`` on 2 ranks (2 rows each a step, 6 steps, an epoch of
    3 steps) with a checkpoint every 3 steps; each rank's output and the run's folder."""
    out = tmp_path_factory.mktemp("lightning_ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "_lightning_stream_train.py"), "--out", str(out), "--steps", "6", "--batch", "2",
           "--rows", "12", "--ckpt-every", "3"]
    res = subprocess.run(cmd, check=False, env=env(), capture_output=True, text=True, timeout=240)
    if res.returncode != 0:
        pytest.fail(f"torchrun failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}", pytrace=False)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out


# slow: a torchrun launch and a resume (~20 s on 2 cores, serial); the fast tier keeps the ranks'
# merge and the distributed checkpoint state without a trainer (tests/test_stream_state.py)
@pytest.mark.slow
@pytest.mark.serial  # 2 ranks fill a 2-core machine
def test_ddp_streams_the_records_of_one_process_and_its_checkpoint_resumes_on_one(ddp_run, tmp_path):
    ranks, out = ddp_run
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [6, 6]
    assert ranks[1]["records"] == []  # emitted once: rank 0 has the global records
    got = _values(ranks[0]["records"])
    one, _, lm = harness.fit(tmp_path / "one", steps=6, batch=4, n_rows=12)  # one process, the same rows
    assert lm.trained == [0, 1, 2, 3, 4, 5]
    want = _values(one.records)
    assert _steps(want) == EMISSIONS and _n(want) == _n(want, "ffn") == {s: 2 * 4 * SEQ for s in EMISSIONS}
    assert _n(got) == _n(want) and _n(got, "ffn") == _n(want, "ffn")
    _assert_close(got, want, rel=1e-10)  # float64 model and products: only the rounding differs
    assert {r["tokens_seen"] for r in ranks[0]["records"]} == {s * 4 * SEQ for s in EMISSIONS}

    # the save at step 3 was a collective (it did not hang): both ranks' accumulators, merged
    path = out / "ckpt" / "step=3.ckpt"
    state = torch.load(path, weights_only=False)["callbacks"]["FastspecStreamCallback"]
    assert (state["world_size"], state["per_rank"]) == (2, False)
    assert len(state["probe"]["accumulators"]) == 4  # one per (site, layer), not one per rank
    # resumed on one process (batch 4: the rows both ranks took): the rest of the run, exactly
    resumed, _, lm = harness.fit(tmp_path / "resumed", steps=6, batch=4, n_rows=12, ckpt_path=str(path))
    assert lm.trained == [3, 4, 5]
    res = _values(resumed.records)
    assert _n(res) == _n(want)  # step 4's emission: both ranks' rows of step 3, restored, and step 4's
    _assert_close(res, want, rel=1e-10)


# ------------------------------------------------------------------ alerts
def _alert_run(tmp_path, action):
    """4 steps, ``emit_every=2``, keys only, an alert whose threshold every layer is below; returns
    the callback, the trainer, the logger and the fit to call."""
    alerts = RankCollapseAlert(threshold=1e9, action=action)
    cb = FastspecStreamCallback(probe_kwargs={"emit_every": 2, "ffn": False}, model_attr="model", alerts=alerts)
    logger = Collect()
    tr = harness.trainer([cb], tmp_path, max_steps=4, logger=logger)
    return cb, tr, logger, lambda: tr.fit(harness.LM(), torch.utils.data.DataLoader(harness.rows(8), batch_size=2))


def _logged(logger) -> list[tuple[int, dict]]:
    return [(step, m) for step, m in logger.logged if any(k.startswith("fastspec/") for k in m)]


def test_alerts_run_their_action_after_the_emission_is_logged(tmp_path):
    seen, at_action = [], []

    def action(alert):
        seen.append(alert)
        at_action.append(len(_logged(logger)))

    cb, _, logger, fit = _alert_run(tmp_path, action)
    fit()
    assert [(a.step, a.layer, a.kind) for a in seen] == [(2, 0, "below_threshold"), (2, 1, "below_threshold")]
    assert cb.alerts.fired == seen and at_action == [1, 1]  # the step-2 emission was logged first
    logged = _logged(logger)
    assert [(step, m["fastspec/alerts"]) for step, m in logged] == [(2, 2.0), (4, 0.0)]  # fired once: not re-armed
    assert all("fastspec/stream/keys/participation_ratio/mean" in m for _, m in logged)


def test_raise_stops_fit_after_logging_the_emission(tmp_path):
    cb, tr, logger, fit = _alert_run(tmp_path, "raise")
    with pytest.raises(RankCollapseError, match="step 2"):
        fit()
    assert int(tr.global_step) == 2  # stopped at the emission that alerted
    logged = _logged(logger)
    assert [(step, m["fastspec/alerts"]) for step, m in logged] == [(2, 2.0)]
    assert "fastspec/stream/keys/participation_ratio/layer0" in logged[0][1]
    assert {r.step for r in cb.records} == {2} and len(cb.alerts.fired) == 2
    assert not cb.probe._hooks.installed  # on_exception detached it: no hook stays on the model


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs, name", [
    ({"probe": "x"}, "probe"),
    ({"probe_kwargs": [1]}, "probe_kwargs"),
    ({"prefix": 3}, "prefix"),
    ({"prefix": ""}, "prefix"),
    ({"tokens_per_step": 0}, "tokens_per_step"),
    ({"tokens_per_step": 1.5}, "tokens_per_step"),
    ({"model_attr": 3}, "model_attr"),
    ({"alerts": "warn"}, "alerts"),
    ({"probe": lambda model: fastspec.Probe(model), "probe_kwargs": {"emit_every": 2}}, "probe_kwargs"),
])
def test_bad_arguments_raise_one_line_errors_naming_the_argument(kwargs, name):
    with pytest.raises((TypeError, ValueError)) as info:
        FastspecStreamCallback(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{name}:") and "\n" not in message, message
