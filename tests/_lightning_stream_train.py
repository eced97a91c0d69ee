"""Training harness of tests/test_stream_lightning.py: a tiny Lightning run with
``fastspec.integrations.lightning.FastspecStreamCallback``.

Under torchrun (gloo, CPU) it trains with ``strategy="ddp"`` on every rank torchrun started
(Lightning sees torchelastic and does not spawn), e.g.::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_lightning_stream_train.py --out DIR

The tests also import :func:`fit` and :class:`LM` to train in their own process (one device).

The model is the demo's smallest (``tests/_tiny_models.py::demo_model``, float64 with
``--double``), trained by plain SGD at a constant rate (no scheduler: a run stopped at
``max_steps=3`` and resumed to 6 takes the steps of one run to 6). The data are :func:`rows`,
fixed tokens read in order: under DDP a ``DistributedSampler(shuffle=False)`` of our own gives
rank ``r`` the rows ``r::world`` (Lightning's own would shuffle: it always does for training), so
the rows of each optimizer step of ``world`` ranks with ``--batch b`` are those of one process
with batch ``world·b``. The probe streams keys and FFN (every FFN row, float64
products) with ``emit_every=2``. ``--ckpt-every N`` adds a ``ModelCheckpoint`` saving every N
optimizer steps into ``DIR/ckpt`` (a collective save of the probe's state under DDP).
Each rank writes ``DIR/rank{r}.json``: ``{"records": [...], "world_size": w, "global_step": s}``,
the callback's records as dicts.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from _tiny_models import demo_model
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from fastspec.integrations import as_dicts
from fastspec.integrations.lightning import FastspecStreamCallback

VOCAB, SEQ = 64, 16
PROBE_KWARGS = {"emit_every": 2, "precision": "exact", "ffn_rows": "all"}


def rows(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` sequences of fixed random tokens."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class LM(pl.LightningModule):
    """The demo model's causal-LM loss, SGD at a constant rate. ``by_step``: a tensor
    ``[steps, micro, batch, SEQ]``; each training batch is then ``by_step[global_step, micro]``
    whatever the loader gave (a resumed run's rows do not depend on where Lightning restarts a
    plain ``DataLoader``). ``trained`` keeps the ``global_step`` of every training batch."""

    def __init__(self, double: bool = False, by_step: torch.Tensor | None = None, accumulate: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.model = demo_model().train()
        if double:
            self.model.double()
        self.by_step, self.accumulate = by_step, accumulate
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(int(self.global_step))
        if self.by_step is not None:
            batch = self.by_step[self.global_step, batch_idx % self.accumulate]
        return self.model(input_ids=batch, labels=batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(callbacks, root, **kw) -> pl.Trainer:
    """A CPU trainer without progress bar, model summary or (unless given) logger and checkpoints."""
    args = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, "default_root_dir": str(root), "num_sanity_val_steps": 0}
    if any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks):
        args["enable_checkpointing"] = True
    return pl.Trainer(callbacks=callbacks, **{**args, **kw})


def fit(root, *, steps: int, batch: int, n_rows: int, ckpt_every: int | None = None, ckpt_path=None,
        devices: int = 1, double: bool = True):
    """Train ``steps`` optimizer steps on ``rows(n_rows)`` (``batch`` rows per device and step,
    in order); returns ``(callback, trainer, module)``."""
    cb = FastspecStreamCallback(probe_kwargs=dict(PROBE_KWARGS), model_attr="model",
                                tokens_per_step=devices * batch * SEQ)
    callbacks = [cb]
    if ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(Path(root) / "ckpt"), every_n_train_steps=ckpt_every,
                                                      save_top_k=-1, filename="{step}"))
    data, sampler = rows(n_rows), None
    kw = {"strategy": "ddp", "devices": devices, "use_distributed_sampler": False} if devices > 1 else {}
    tr = trainer(callbacks, root, max_steps=steps, **kw)
    if devices > 1:  # under torchrun: the ranks' rows in order, not Lightning's shuffled sampler
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=devices, rank=tr.global_rank, shuffle=False)
    lm = LM(double=double)
    tr.fit(lm, torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler), ckpt_path=ckpt_path)
    return cb, tr, lm


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=2, help="rows per rank and step")
    p.add_argument("--rows", type=int, default=12, help="rows of one epoch (all ranks)")
    p.add_argument("--ckpt-every", type=int, default=None)
    args = p.parse_args(argv)
    world = TorchElasticEnvironment().world_size() if TorchElasticEnvironment.detect() else 1  # torchrun's ranks
    out = Path(args.out)
    cb, tr, _ = fit(out, steps=args.steps, batch=args.batch, n_rows=args.rows, ckpt_every=args.ckpt_every,
                    devices=world)
    rank = tr.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"records": as_dicts(cb.records), "world_size": tr.world_size, "global_step": int(tr.global_step)}))


if __name__ == "__main__":
    main()
