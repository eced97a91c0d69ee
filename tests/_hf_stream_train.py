"""Training harness of tests/test_stream_hf.py: the Hugging Face ``Trainer`` with
:class:`fastspec.integrations.hf.FastspecStreamCallback`, under torchrun (gloo, CPU), e.g.::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_hf_stream_train.py --out DIR

The model is the demo's tiny QK-norm Llama (tests/_tiny_models.py ``demo_model``) in float64, the
probe takes float64 products (``precision="exact"``): a run on 2 ranks and one on 1 rank with the
per-device batch doubled differ by float64 rounding only. The sampler is sequential, so every
optimizer step sees the same rows whatever the world size (accelerate gives rank r the batches
r, r + w, ... of the one sampler: with ``--batch B`` on 2 ranks, step k's rows are those of
``--batch 2B`` on 1 rank). The probe streams keys and FFN with ``emit_every=2``.

Each rank writes ``DIR/rank{r}.json``: ``{"records": [...], "logs": [log_history entries with the
fastspec scalars], "world_size": w, "global_step": s, "warnings": [...]}``.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiny_models import demo_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from fastspec.integrations import as_dicts
from fastspec.integrations.hf import FastspecStreamCallback


class SequentialTrainer(Trainer):
    """The rows in order: the same rows per optimizer step on any number of ranks."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class StopAt(TrainerCallback):
    def __init__(self, step: int | None):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step == self.step:
            control.should_training_stop = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=2, help="per-device batch")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)

    model = demo_model().double().train()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    cb = FastspecStreamCallback(probe_kwargs={"emit_every": 2, "precision": "exact"})
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=a.steps, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulate, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        lr_scheduler_type="constant", learning_rate=1e-3, logging_steps=1, dataloader_num_workers=0,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500)
    trainer = SequentialTrainer(model=model, args=args, train_dataset=data, callbacks=[cb, StopAt(a.stop_at)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=a.resume)
    rank = trainer.args.process_index
    logs = [h for h in trainer.state.log_history if any(k.startswith("fastspec/") for k in h)]
    result = {"records": as_dicts(cb.records), "logs": logs, "global_step": int(trainer.state.global_step),
              "world_size": trainer.args.world_size,
              "warnings": [str(w.message) for w in caught if "fastspec" in str(w.message)]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
