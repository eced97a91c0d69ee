"""Logging integrations against the real libraries (each skipped cleanly when not installed)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fastspec.integrations import heatmap, heatmap_image, scalars
from fastspec.probe import Record


def _records(step=5):
    """2 layers × 3 heads of key PR with known values, a layer-less loss and a per-layer γ CV."""
    recs = [Record(step, 640, "keys", l, h, "participation_ratio", 10.0 * l + h + 1) for l in range(2) for h in range(3)]
    recs += [Record(step, 640, "gamma_k", l, None, "gamma_cv", 0.1 * (l + 1)) for l in range(2)]
    recs.append(Record(step, 640, "loss", None, None, "eval_loss", 2.5))
    return recs


EXPECTED = {
    "fastspec/keys/participation_ratio/layer0": 2.0,
    "fastspec/keys/participation_ratio/layer1": 12.0,
    "fastspec/keys/participation_ratio/mean": 7.0,
    "fastspec/gamma_k/gamma_cv/layer0": 0.1,
    "fastspec/gamma_k/gamma_cv/layer1": 0.2,
    "fastspec/gamma_k/gamma_cv/mean": 0.15,
    "fastspec/loss/eval_loss": 2.5,
}


def test_scalars_aggregate_heads_then_layers():
    got = scalars(_records())
    assert got.keys() == EXPECTED.keys()
    assert all(got[k] == pytest.approx(v) for k, v in EXPECTED.items())
    assert scalars([r.as_dict() for r in _records()], prefix="x")["x/loss/eval_loss"] == 2.5
    with pytest.raises(TypeError, match="records"):
        scalars([1.0])


def test_scalars_and_heatmap_keep_eval_and_streaming_apart():
    from dataclasses import replace

    evals = [replace(r, protocol="eval") for r in _records()]
    stream = [replace(r, protocol="stream", value=r.value + 100.0) for r in _records()]
    got = scalars(evals + stream)
    assert got["fastspec/keys/participation_ratio/mean"] == pytest.approx(7.0)
    assert got["fastspec/stream/keys/participation_ratio/mean"] == pytest.approx(107.0)
    assert np.array_equal(heatmap(stream + evals), heatmap(_records()))
    # dicts from an older records file name the head "head"
    old = [{("head" if k == "head_index" else k): v for k, v in r.as_dict().items()} for r in _records()]
    assert np.array_equal(heatmap(old), heatmap(_records()))


def test_heatmap_grid_and_image():
    grid = heatmap(_records())
    assert grid.shape == (2, 3) and grid[1, 2] == 13.0
    img = heatmap_image(np.array([[0.0, np.nan], [1.0, 2.0]]), scale=4)
    assert img.shape == (8, 8, 3) and img.dtype == np.uint8
    assert (img[:4, 4:] == 0).all()                          # NaN is black
    assert len({tuple(img[0, 0]), tuple(img[4, 0]), tuple(img[4, 4])}) == 3  # min, mid, max differ
    with pytest.raises(ValueError, match="records"):
        heatmap(_records(), site="queries")


def test_tensorboard_scalars_and_heatmap(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from fastspec.integrations.tensorboard import log_to_tensorboard

    writer = SummaryWriter(log_dir=str(tmp_path))
    log_to_tensorboard(writer, _records(step=5))
    log_to_tensorboard(writer, _records(step=9))
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(EXPECTED)
    for tag, v in EXPECTED.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [5, 9]
        assert events[0].value == pytest.approx(v, rel=1e-6)
    (img_tag,) = acc.Tags()["images"]
    assert img_tag == "fastspec/keys/participation_ratio/heatmap"
    img = acc.Images(img_tag)[-1]
    assert img.step == 9 and (img.height, img.width) == (2 * 16, 3 * 16)


def _wandb_records(path) -> list:
    """W&B's own ``Record`` protobufs in an offline ``.wandb`` file: a LevelDB-format log (7-byte
    header, 32 KiB blocks, records of crc32/length/type + payload)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block, buf, records = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer too short for a header: padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        buf, pos = buf + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            records.append(rec)
    return records


def _wandb_history(path) -> list[dict]:
    """History rows of an offline ``.wandb`` file."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for rec in _wandb_records(path) if rec.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_gets_scalars_and_image(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from fastspec.integrations.wandb import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="fastspec-tests")
    try:
        payload = log_to_wandb(_records(step=5), run=run)
        log_to_wandb(_records(step=9), run=run)
    finally:
        run.finish()
        wandb.teardown()  # stops the W&B service, which writes the offline log asynchronously
    assert set(payload) == set(EXPECTED) | {"fastspec/keys/participation_ratio/heatmap"}
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = _wandb_history(log)
    assert [h["_step"] for h in history] == [5, 9]
    for key, v in EXPECTED.items():
        assert history[0][key] == pytest.approx(v)
    image = history[0]["fastspec/keys/participation_ratio/heatmap/path"]
    assert (log.parent / "files" / image).is_file()
    assert (history[0]["fastspec/keys/participation_ratio/heatmap/height"],
            history[0]["fastspec/keys/participation_ratio/heatmap/width"]) == (2 * 16, 3 * 16)
    with pytest.raises(ValueError, match="run"):
        log_to_wandb(_records(), run=None)


def _alerts():
    """What ``RankCollapseAlert`` finds in :func:`_records`: layer 0's key PR (mean 2) below 5."""
    from fastspec.integrations.alerts import RankCollapseAlert

    fired = RankCollapseAlert(threshold=5.0, action=None).check(_records(step=9))
    assert [(a.step, a.layer, a.kind) for a in fired] == [(9, 0, "below_threshold")]
    return fired


def test_tensorboard_alert_count_and_messages(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from fastspec.integrations.tensorboard import log_to_tensorboard

    writer = SummaryWriter(log_dir=str(tmp_path))
    assert log_to_tensorboard(writer, _records(step=5), alerts=[])["fastspec/alerts"] == 0.0
    (alert,) = _alerts()
    log_to_tensorboard(writer, _records(step=9), alerts=[alert])
    log_to_tensorboard(writer, _records(step=12))  # no alerts= given: no count either
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("fastspec/alerts")] == [(5, 0.0), (9, 1.0)]
    (text,) = acc.Tensors("fastspec/alerts/messages/text_summary")  # add_text appends the suffix
    assert text.step == 9 and text.tensor_proto.string_val[0].decode() == alert.message


def test_wandb_alerts_are_counted_and_sent(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from fastspec.integrations.wandb import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (alert,) = _alerts()
    run = wandb.init(mode="offline", dir=str(tmp_path), project="fastspec-tests")
    try:
        payload = log_to_wandb(_records(step=9), run=run, alerts=[alert])
    finally:
        run.finish()
        wandb.teardown()
    assert payload["fastspec/alerts"] == 1
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(log)
    sent = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
    assert [(a.title, a.text, a.level) for a in sent] == [
        ("fastspec below_threshold: keys layer 0", alert.message, "WARN")]
    assert _wandb_history(log)[0]["fastspec/alerts"] == 1


# ------------------------------------------------------------------ training-loop callbacks
def _tiny_model():
    # imported here: _tiny_models skips without transformers, which this module's other tests need not
    from _tiny_models import demo_model

    return demo_model()


def _expect_probe_keys(values: dict):
    for layer in (0, 1):
        assert f"fastspec/keys/participation_ratio/layer{layer}" in values
        assert f"fastspec/ffn/participation_ratio/layer{layer}" in values
        assert f"fastspec/gamma_k/gamma_cv/layer{layer}" in values
    pr = values["fastspec/keys/participation_ratio/mean"]
    assert 1.0 <= pr <= 16.0 and math.isfinite(pr)  # sv-PR of d_head = 16


def test_hf_trainer_callback_logs_on_schedule(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from fastspec.integrations.hf import FastspecTrainerCallback

    model = _tiny_model()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16), generator=g)]
    batch = {"input_ids": data[0]["input_ids"][None].repeat(2, 1), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    cb = FastspecTrainerCallback(batch, every_n_steps=2, probe_kwargs={"keys": True, "ffn": True},
                                 tokens_per_step=2 * 16)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=100, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    logged = [h for h in trainer.state.log_history if any(k.startswith("fastspec/") for k in h)]
    assert [h["step"] for h in logged] == [0, 2, 4]
    for h in logged:
        _expect_probe_keys(h)
    assert {r.tokens_seen for r in cb.records} == {0, 64, 128}
    assert model.training  # the probe restored train mode


def test_lightning_callback_logs_on_schedule(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from fastspec.integrations.lightning import FastspecCallback

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _tiny_model()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(ids, batch_size=2)
    cb = FastspecCallback({"input_ids": ids[:2], "attention_mask": torch.ones(2, 16, dtype=torch.long)},
                          every_n_steps=2, model_attr="model")
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = pl.Trainer(max_steps=4, logger=logger, callbacks=[cb], accelerator="cpu", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(LM(), loader)
    import csv

    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("fastspec/keys/participation_ratio/mean")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
    for r in rows:
        _expect_probe_keys({k: float(v) for k, v in r.items() if v not in ("", None)})
    assert {r.step for r in cb.records} == {0, 2, 4}


def test_callbacks_reject_bad_schedule():
    pytest.importorskip("transformers")
    from fastspec.integrations.hf import FastspecTrainerCallback

    with pytest.raises(ValueError, match="every_n_steps"):
        FastspecTrainerCallback({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, every_n_steps=0)
