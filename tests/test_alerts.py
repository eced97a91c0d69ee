"""Rank-collapse alerts: the rule on synthetic records with known answers, its state, its actions,
and the plain-loop, Lightning and HF Trainer hooks on real tiny models."""
from __future__ import annotations

import copy
import json
import logging
import math
import warnings

import pytest
import torch

from fastspec.integrations.alerts import (
    Alert,
    RankCollapseAlert,
    RankCollapseError,
    RankCollapseWarning,
)
from fastspec.probe import Record

NAN = math.nan


def _emission(step, per_layer, protocol="eval", site="keys", metric="participation_ratio"):
    """Per-head records of one emission: ``per_layer[l]`` is the list of layer l's head values."""
    return [Record(step, None, site, l, h, metric, float(v), protocol)
            for l, heads in enumerate(per_layer) for h, v in enumerate(heads)]


def _run(alert, emissions, protocol="eval"):
    """``[(step, layer, kind)]`` of every alert over ``emissions = [(step, per_layer), ...]``."""
    return [(a.step, a.layer, a.kind) for step, vals in emissions
            for a in alert.check(_emission(step, vals, protocol))]


def test_threshold_uses_the_head_mean_and_names_layer_and_step():
    alert = RankCollapseAlert(threshold=5.0, action=None)
    # layer 1's heads straddle the threshold at step 100 (mean 6), fall below it at 200 (mean 4.5)
    got = _run(alert, [(0, [[9, 9], [9, 9]]), (100, [[9, 9], [3, 9]]), (200, [[9, 9], [3, 6]])])
    assert got == [(200, 1, "below_threshold")]
    (a,) = alert.fired
    assert (a.value, a.threshold, a.reference, a.protocol, a.site, a.metric) == (
        4.5, 5.0, None, "eval", "keys", "participation_ratio")
    assert "step 200" in a.message and "layer 1" in a.message and "threshold 5" in a.message


@pytest.mark.parametrize("reference,expected", [
    # values of layer 0: 10, 12, 9, 7, 6; drop=0.3 means below 70% of the reference
    ("previous", []),                                      # no single step loses 30%
    ("best", [(300, 0, "drop", 12.0)]),                    # 7 < 0.7 · 12 = 8.4
    ("first", [(400, 0, "drop", 10.0)]),                   # 6 < 0.7 · 10 = 7, but 7 is not
])
def test_drop_against_each_reference(reference, expected):
    alert = RankCollapseAlert(drop=0.3, reference=reference, action=None)
    for step, v in zip(range(0, 500, 100), (10, 12, 9, 7, 6)):
        alert.check(_emission(step, [[v, v], [5, 5]]))
    assert [(a.step, a.layer, a.kind, a.reference) for a in alert.fired] == expected


def test_drop_from_previous_emission_and_no_alert_within_limits():
    alert = RankCollapseAlert(threshold=2.0, drop=0.2, action=None)
    # layer 1 goes 10 -> 8.5 (-15%: within) -> 6 (-29%: alert) -> 5 (-17%: within)
    got = _run(alert, [(0, [[10], [10]]), (1, [[10], [8.5]]), (2, [[9], [6]]), (3, [[9], [5]])])
    assert got == [(2, 1, "drop")]
    assert alert.fired[0].reference == 8.5 and alert.fired[0].value == 6.0
    assert "fell 29% from 8.5" in alert.fired[0].message


def test_eval_and_stream_records_are_never_mixed():
    alert = RankCollapseAlert(drop=0.2, action=None)
    # eval PR ~10 and stream PR ~6 at every step, both steady: compared across protocols they
    # would drop by 40% at every step, and averaged they would hide the stream's fall at step 3
    for step, stream in ((0, 6.0), (1, 6.0), (2, 6.1), (3, 3.0)):
        alert.check(_emission(step, [[10, 10]], "eval") + _emission(step, [[stream, stream]], "stream"))
    assert [(a.step, a.layer, a.kind, a.protocol, a.reference) for a in alert.fired] == [
        (3, 0, "drop", "stream", 6.1)]
    # records without a protocol (made elsewhere) are a third stream of their own
    assert alert.check(_emission(4, [[1.0, 1.0]], None)) == []


def test_nan_alerts_once_and_keeps_the_last_finite_reference():
    alert = RankCollapseAlert(threshold=3.0, drop=0.5, action=None)
    got = _run(alert, [(0, [[8, 8], [8, 8]]), (1, [[8, NAN], [8, 8]]), (2, [[NAN, NAN], [8, 8]]),
                       (3, [[3.4, 3.4], [8, 8]]), (4, [[math.inf, 1], [8, 8]])])
    # one NaN head makes the layer mean NaN; after it, 3.4 is compared with 8 (step 0), not NaN
    assert got == [(1, 0, "nan"), (3, 0, "drop"), (4, 0, "nan")]
    assert alert.fired[1].reference == 8.0 and "is nan" in alert.fired[0].message


def test_alerts_rearm_when_the_layer_recovers_and_repeat_alerts_every_time():
    emissions = [(0, [[2]]), (1, [[2]]), (2, [[6]]), (3, [[1]]), (4, [[1]])]
    once = RankCollapseAlert(threshold=4.0, action=None)
    assert _run(once, emissions) == [(0, 0, "below_threshold"), (3, 0, "below_threshold")]
    every = RankCollapseAlert(threshold=4.0, repeat=True, action=None)
    assert [s for s, _, _ in _run(every, emissions)] == [0, 1, 3, 4]


def test_several_steps_in_one_call_other_records_ignored_and_dicts_accepted():
    alert = RankCollapseAlert(drop=0.5, action=None)
    recs = _emission(2, [[2, 2]]) + _emission(1, [[10, 10]])        # out of order, as a flush may be
    recs += _emission(2, [[100, 100]], site="ffn") + _emission(2, [[0.1, 0.1]], metric="entropy_rank")
    recs.append(Record(2, None, "loss", None, None, "eval_loss", NAN))
    old = [{("head" if k == "head_index" else k): v for k, v in r.as_dict().items() if k != "protocol"}
           for r in recs]                                           # an older file's dicts
    assert [(a.step, a.kind, a.protocol) for a in alert.check(old)] == [(2, "drop", None)]
    with pytest.raises(TypeError, match="records"):
        alert.check([1.0])


def test_state_dict_round_trip_keeps_reference_and_raised_alerts():
    alert = RankCollapseAlert(threshold=4.0, drop=0.3, reference="best", action=None)
    _run(alert, [(0, [[10], [10]]), (1, [[12], [3]])])                # layer 1 below threshold and dropped
    sd = json.loads(json.dumps(alert.state_dict()))                 # plain types: any checkpoint format
    resumed = RankCollapseAlert(threshold=4.0, drop=0.3, reference="best", action=None)
    resumed.load_state_dict(sd)
    # layer 0's best (12) survives the resume: 8 < 0.7 · 12; layer 1, still collapsed, stays quiet
    assert _run(resumed, [(2, [[8], [3]])]) == [(2, 0, "drop")]
    fresh = RankCollapseAlert(threshold=4.0, drop=0.3, reference="best", action=None)
    assert _run(fresh, [(2, [[8], [3]])]) == [(2, 1, "below_threshold")]
    with pytest.raises(ValueError, match="state_dict: saved for"):
        RankCollapseAlert(metric="entropy_rank").load_state_dict(sd)
    with pytest.raises(ValueError, match="state_dict: not a RankCollapseAlert"):
        resumed.load_state_dict({"version": 0})


def test_actions_warn_log_raise_callable(caplog):
    collapse = [_emission(0, [[10]]), _emission(1, [[1]])]

    def alerts_with(action):
        alert = RankCollapseAlert(drop=0.5, action=action)
        return [a for e in collapse for a in alert.check(e)]

    with pytest.warns(RankCollapseWarning, match="layer 0") as rec:
        alerts_with("warn")
    assert len(rec) == 1 and rec[0].filename == __file__            # points at the caller of check
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        alerts_with("log")
    assert [r.getMessage() for r in caplog.records if r.name == "fastspec"] == [
        "fastspec rank collapse at step 1: keys/participation_ratio of layer 0 (eval) fell 90% from 10 "
        "(previous emission) to 1, more than the drop limit 50%"]
    got = []
    assert alerts_with(got.append) == got and len(got) == 1 and isinstance(got[0], Alert)
    alert = RankCollapseAlert(drop=0.5, action="raise")
    alert.check(collapse[0])
    with pytest.raises(RankCollapseError, match="fell 90%") as exc:
        alert.check(collapse[1])
    assert [a.kind for a in exc.value.alerts] == ["drop"] and alert.fired == exc.value.alerts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(alerts_with(None)) == 1                          # None: returned, nothing else


@pytest.mark.parametrize("kwargs,message", [
    ({"threshold": "8"}, "threshold: expected a finite number or None, got '8'"),
    ({"threshold": NAN}, "threshold: expected a finite number or None, got nan"),
    ({"threshold": True}, "threshold: expected a finite number or None, got True"),
    ({"drop": 1.0}, r"drop: expected a fraction in \(0, 1\) or None, got 1.0"),
    ({"drop": 0}, r"drop: expected a fraction in \(0, 1\) or None, got 0"),
    ({"reference": "last"}, r"reference: expected one of \('previous', 'best', 'first'\), got 'last'"),
    ({"action": "print"}, r"action: expected one of \('warn', 'log', 'raise'\), a callable or None, got 'print'"),
    ({"repeat": 1}, "repeat: expected True or False, got 1"),
    ({"site": ""}, "site: expected a non-empty str, got ''"),
    ({"metric": None}, "metric: expected a non-empty str, got None"),
])
def test_argument_validation(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        RankCollapseAlert(**kwargs)


# ------------------------------------------------------------------ real probes, real loops
def _collapse_gpt2_keys(model, layer: int) -> None:
    """Make every key head of ``layer`` rank 1: the key block of GPT-2's fused ``c_attn``
    ``[d_model, 3·d_model]`` becomes an outer product and its bias 0, so each key is a multiple
    of one vector (GPT-2 has no RoPE to spread it again): sv-PR exactly 1."""
    n = model.config.n_embd
    attn = model.transformer.h[layer].attn
    with torch.no_grad():
        attn.c_attn.weight[:, n:2 * n] = torch.outer(torch.randn(n), torch.randn(n))
        attn.c_attn.bias[n:2 * n] = 0.0


def test_plain_loop_with_a_probe_names_the_collapsed_layer():
    from _tiny_models import batch, build

    import fastspec

    model = build("gpt2").train()
    probe = fastspec.Probe(model, ffn=False, emit_every=1)
    alert = RankCollapseAlert(threshold=2.0, drop=0.5, action=None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eval_batch, fired = batch(seed=1), []
    with probe.streaming():
        for step in range(3):
            if step == 2:                      # between the measurements of steps 1 and 2
                _collapse_gpt2_keys(model, layer=1)
            ids = batch(seed=10 + step)["input_ids"]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            fired += alert.check(probe.step(step))
            fired += alert.check(probe.measure(eval_batch, step=step))
    assert sorted((a.step, a.layer, a.kind, a.protocol) for a in fired) == [
        (2, 1, kind, protocol) for kind in ("below_threshold", "drop") for protocol in ("eval", "stream")]
    assert all(1.0 <= a.value < 1.5 for a in fired)  # rank 1, give or take step 2's update (eval)


def _demo_model():
    pytest.importorskip("transformers")
    from fastspec.demo import ModelSize, build_model

    return build_model("qk_norm", ModelSize(d_model=32, layers=2, heads=2, kv_heads=1, d_ff=64, seq_len=16),
                       vocab_size=64, seed=0)


def _zero_keys(model, layer: int) -> None:
    """All keys of ``layer`` 0 (k_proj zeroed and frozen, so training cannot move it): the
    sv spectrum is all zero and the PR NaN, what a diverged layer reports."""
    k_proj = model.model.layers[layer].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight.zero_()
    k_proj.weight.requires_grad_(False)


EXPECTED_ALERT = (2, 1, "nan", "eval")   # layer 1 zeroed during step 2, measured after it


def test_lightning_callback_collects_logs_and_checkpoints_alerts(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from fastspec.integrations.lightning import FastspecCallback

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _demo_model()

        def training_step(self, batch, batch_idx):
            if batch_idx == 1:                 # the optimizer step that makes global_step 2
                _zero_keys(self.model, layer=1)
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    eval_batch = {"input_ids": ids[:2], "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    cb = FastspecCallback(eval_batch, every_n_steps=2, model_attr="model", probe_kwargs={"ffn": False},
                          alerts=RankCollapseAlert(drop=0.5, action=None))
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = pl.Trainer(max_steps=4, logger=logger, callbacks=[cb], accelerator="cpu", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(LM(), torch.utils.data.DataLoader(ids, batch_size=2))
    assert [(a.step, a.layer, a.kind, a.protocol) for a in cb.alerts.fired] == [EXPECTED_ALERT]
    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("fastspec/alerts")]
    assert [(int(r["step"]), float(r["fastspec/alerts"])) for r in rows] == [(0, 0.0), (2, 1.0), (4, 0.0)]
    # the alert state travels in Lightning's checkpoint
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][cb.state_key]
    resumed = FastspecCallback(eval_batch, alerts=RankCollapseAlert(drop=0.5, action=None))
    resumed.load_state_dict(copy.deepcopy(saved))
    assert resumed.alerts.state_dict() == cb.alerts.state_dict()
    assert {e["layer"]: e["active"] for e in saved["alerts"]["layers"]} == {0: [], 1: ["nan"]}


def test_hf_trainer_callback_logs_then_raises(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fastspec.integrations.hf import FastspecTrainerCallback

    class ZeroLayer1(TrainerCallback):         # listed first: runs before the probe's on_step_end
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                _zero_keys(model, layer=1)

    model = _demo_model()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16), generator=g)]
    eval_batch = {"input_ids": data[0]["input_ids"][None].repeat(2, 1),
                  "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    cb = FastspecTrainerCallback(eval_batch, every_n_steps=2, probe_kwargs={"ffn": False},
                                 alerts=RankCollapseAlert(drop=0.5, action="raise"))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=100, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ZeroLayer1(), cb])
    with pytest.raises(RankCollapseError, match="step 2: keys/participation_ratio of layer 1") as exc:
        trainer.train()
    assert [(a.step, a.layer, a.kind, a.protocol) for a in exc.value.alerts] == [EXPECTED_ALERT]
    logged = [(h["step"], h["fastspec/alerts"]) for h in trainer.state.log_history if "fastspec/alerts" in h]
    assert logged == [(0, 0), (2, 1)]                # the collapsed measurement is logged before raising


def test_callbacks_reject_a_non_alert():
    pytest.importorskip("transformers")
    from fastspec.integrations.hf import FastspecTrainerCallback

    with pytest.raises(TypeError, match="^alerts: expected a fastspec.integrations.alerts.RankCollapseAlert"):
        FastspecTrainerCallback({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, alerts={"drop": 0.2})
