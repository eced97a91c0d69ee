"""Train an OLMo-core transformer with fastspec's callback streaming key rank and FFN spectra.

Runs on CPUs (gloo) or GPUs, one or more ranks, with no download: a small Llama-like OLMo-core
model trained on fixed synthetic tokens (a Zipf-like draw over 256 token ids, the same global
batches on any number of ranks). Swap in your model config and data loader; the fastspec lines
(the ``FastspecCallback`` in the trainer's callbacks) stay the same::

    torchrun --standalone --nproc_per_node 2 examples/olmo_core_train.py --fsdp --out /tmp/fs-olmo
    torchrun --standalone --nproc_per_node 2 examples/olmo_core_train.py --fsdp --ac full --steps 40

Rank 0 prints the metrics OLMo-core's console logger shows (``fastspec/stream/.../mean``) at each
emission and writes every record to ``OUT/fastspec_records.json``. ``tests/_olmo_core_train.py``
and ``benchmarks/trainer_overhead_olmo_core.py`` build their runs with :func:`build_trainer`.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from olmo_core.data.collator import DataCollator
from olmo_core.data.data_loader import TextDataLoaderBase
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank, get_world_size
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.nn.transformer.config import TransformerActivationCheckpointingMode
from olmo_core.optim import AdamWConfig
from olmo_core.train import (
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmo_core.train.callbacks import CheckpointerCallback
from olmo_core.train.common import Duration
from olmo_core.train.train_module import (
    TransformerActivationCheckpointingConfig,
    TransformerDataParallelConfig,
    TransformerTrainModuleConfig,
)

from fastspec.integrations.olmo_core import FastspecCallback

VOCAB, SEED = 256, 1234
AC_MODES = ("none", "full", "selected_modules", "selected_blocks")


class SyntheticTokens(TextDataLoaderBase):
    """Fixed synthetic batches: global batch ``k`` is a seeded draw of ``[instances, seq]`` tokens,
    and rank ``r`` gets rows ``[r·n, (r+1)·n)`` of it, so any world size trains on the same global
    batches. Resumes at the batch its checkpointed state says."""

    def __init__(self, *, instances: int, seq: int, batches: int, **kwargs):
        super().__init__(collator=DataCollator(pad_token_id=0), global_batch_size=instances * seq, **kwargs)
        if instances % self.dp_world_size:
            raise ValueError(f"instances: {instances} sequences do not split over {self.dp_world_size} ranks")
        self.instances, self.seq, self.batches = instances, seq, batches

    @property
    def total_batches(self) -> int:
        return self.batches

    def global_batch(self, k: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(SEED * 1000 + k)
        # a few token ids far more often than others: activations with structure, not white noise
        probs = torch.arange(1, VOCAB + 1, dtype=torch.float64) ** -1.2
        tokens = torch.multinomial(probs, self.instances * self.seq, replacement=True, generator=gen)
        return tokens.view(self.instances, self.seq)

    def _iter_batches(self):
        n = self.instances // self.dp_world_size
        for k in range(self.batches_processed, self.batches):
            yield {"input_ids": self.global_batch(k)[self.dp_rank * n:(self.dp_rank + 1) * n].contiguous()}

    def state_dict(self) -> dict[str, Any]:
        return {"batches_processed": self.batches_processed, "tokens_processed": self.tokens_processed,
                "epoch": self._epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_processed = state_dict["batches_processed"]
        self.tokens_processed = state_dict["tokens_processed"]
        self._epoch = state_dict["epoch"]

    def reshuffle(self, epoch: int | None = None, **kwargs) -> None:
        self._epoch = epoch if epoch is not None else (self._epoch or 0) + 1

    def get_mock_batch(self) -> dict[str, Any]:  # the trainer's dry run before step 1
        return {"input_ids": torch.zeros(self.instances // self.dp_world_size, self.seq, dtype=torch.long)}


def add_arguments(p: argparse.ArgumentParser, *, out_required: bool = True) -> argparse.ArgumentParser:
    """The run's arguments (model size, data, parallelism); the scripts built on this add their own."""
    p.add_argument("--out", required=out_required, default=None,
                   help="output folder (checkpoints under OUT/ckpt unless --save-folder)")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--batches", type=int, default=None, help="batches in the epoch (default: --steps)")
    p.add_argument("--instances", type=int, default=4, help="sequences per global batch")
    p.add_argument("--micro", type=int, default=2, help="sequences per forward on a rank (micro-batch)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="FSDP over the ranks (default with several ranks: DDP)")
    p.add_argument("--ac", default="none", choices=AC_MODES, help="OLMo-core activation checkpointing mode")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-folder", default=None, help="checkpoints folder (default: OUT/ckpt)")
    p.add_argument("--save-interval", type=int, default=1000, help="a checkpoint every N steps (and the last)")
    p.add_argument("--load-path", default=None, help="start from this checkpoint")
    return p


def _ac_config(mode: str) -> TransformerActivationCheckpointingConfig | None:
    if mode == "none":
        return None
    extra: dict[str, Any] = {}
    if mode == "selected_modules":  # the FFNs: the input of w2 (the ffn site) is recomputed in backward
        extra["modules"] = ["blocks.*.feed_forward"]
    elif mode == "selected_blocks":
        extra["block_interval"] = 2
    return TransformerActivationCheckpointingConfig(mode=TransformerActivationCheckpointingMode(mode), **extra)


def build_trainer(args: argparse.Namespace, callbacks: dict):
    """The OLMo-core trainer of one run: model, train module (FSDP/DDP, activation checkpointing),
    data, checkpointer and ``callbacks`` (a ``{name: Callback}`` dict)."""
    model = TransformerConfig.llama_like(
        d_model=args.d_model, vocab_size=VOCAB, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
        hidden_size_multiple_of=32, qk_norm=True, init_seed=SEED,
    ).build(init_device="meta")
    dp = TransformerDataParallelConfig(name=DataParallelType.fsdp if args.fsdp else DataParallelType.ddp)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=args.micro * args.seq, max_sequence_length=args.seq,
        optim=AdamWConfig(lr=args.lr, weight_decay=0.0), dp_config=dp if get_world_size() > 1 else None,
        ac_config=_ac_config(args.ac),
    ).build(model, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    loader = SyntheticTokens(instances=args.instances, seq=args.seq, batches=args.batches or args.steps,
                             work_dir=os.path.join(args.out, "work"),
                             dp_world_size=get_world_size(train_module.dp_process_group),
                             dp_rank=get_rank(train_module.dp_process_group))
    checkpointer = CheckpointerCallback(save_interval=args.save_interval, ephemeral_save_interval=None,
                                        save_async=False)
    config = TrainerConfig(
        save_folder=args.save_folder or os.path.join(args.out, "ckpt"), save_overwrite=True,
        load_path=args.load_path, metrics_collect_interval=1, max_duration=Duration.steps(args.steps),
        callbacks=dict(callbacks), cancel_check_interval=1000,
    ).with_callback("checkpointer", checkpointer)
    return config.build(train_module, loader)


def main(argv=None) -> None:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--emit-every", type=int, default=5, help="probe emission interval (steps)")
    p.add_argument("--emit-on", default="rank0", choices=["rank0", "all"])
    args = p.parse_args(argv)
    prepare_training_environment(seed=SEED, backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        callback = FastspecCallback(probe_kwargs={"emit_every": args.emit_every}, emit_on=args.emit_on)
        trainer = build_trainer(args, {"fastspec": callback})
        trainer.fit()
        callback = trainer.callbacks["fastspec"]  # the trainer keeps its own copy of the callbacks
        if callback.records:
            from fastspec.integrations import as_dicts

            path = Path(args.out) / (f"fastspec_records_rank{get_rank()}.json" if get_rank() else
                                     "fastspec_records.json")
            path.write_text(json.dumps(as_dicts(callback.records)))
            print(f"rank {get_rank()}: {len(callback.records)} records -> {path}")
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main()
