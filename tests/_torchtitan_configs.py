"""Config registry of the TorchTitan tests: a tiny llama3 trained by ``FastspecTrainer`` on CPU.

``--module tests._torchtitan_configs --config tiny`` (TorchTitan's own config-registry lookup)
gives a 2-layer llama3 (dim 64, 4 query heads, 2 KV heads, seq 32, vocab 256) fed synthetic tokens,
with the probe on. Everything CPU-specific of the tests that a config can hold is here, never in
``fastspec.integrations.torchtitan``:

* no tokenizer assets or dataset ship with the TorchTitan wheel: :class:`SyntheticTokenizer` and
  :class:`SyntheticDataLoader` stand in (TorchTitan's swappable ``tokenizer``/``dataloader``
  Configurables). The global batch of step s is a function of s alone, and data-parallel rank r
  gets rows ``[r·b, (r+1)·b)`` of it: one rank with the global batch sees the same tokens;
* FlexAttention has no CPU backward: dense SDPA (no ``positions`` are fed, so no mask is needed);
* gloo has no ``PREMUL_SUM``: FSDP reduces gradients with a plain sum (``parallelize_fn`` wrapper);
* the default ``spmd_types`` backend fails under FSDP on torch 2.13: ``partial_dtensor``;
* float32 parameters (no bf16 mixed precision), so that sharded and single-process runs agree.

The launcher (``tests/_torchtitan_train.py``) applies the process-level workarounds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import _build_llama3_layers, model_registry
from torchtitan.models.llama3.model import Llama3Model

from fastspec.integrations.torchtitan import FastspecConfig, FastspecTrainer

VOCAB, DIM, N_HEADS, N_KV_HEADS, N_LAYERS, HIDDEN = 256, 64, 4, 2, 2, 128
SEQ_LEN, LOCAL_BATCH = 32, 4


class SyntheticTokenizer(BaseTokenizer):
    """Stands in for the Hugging Face tokenizer the default config loads from assets that the
    wheel does not ship: the dataloader makes token ids itself, nothing is encoded."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, tokenizer_path: str | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("SyntheticTokenizer: the synthetic dataloader needs no encoding")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("SyntheticTokenizer: nothing to decode")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticDataLoader(BaseDataLoader):
    """Batch i of the run: the rows of this data-parallel rank of a global batch drawn from a
    generator seeded with ``seed + i``, so any data-parallel split sees the same global tokens.
    Its position is saved per data-parallel rank, as TorchTitan's own dataloader does."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 1234
        vocab_size: int = VOCAB
        infinite: bool = True  # it always is; TorchTitan's validator sets this field of its loader

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = None):
        self.config, self.dp_world_size, self.dp_rank = config, dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.position = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.config.seed + self.position)
            rows = self.local_batch_size * self.dp_world_size
            tokens = torch.randint(0, self.config.vocab_size, (rows, self.seq_len + 1), generator=g)
            mine = tokens[self.dp_rank * self.local_batch_size:(self.dp_rank + 1) * self.local_batch_size]
            self.position += 1
            yield {"input": mine[:, :-1].contiguous()}, mine[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.position, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"dp_rank_{self.dp_rank}"
        if state_dict and key in state_dict:
            self.position = int(state_dict[key])


class JsonLinesLogger(BaseLogger):
    """Writes every ``log(metrics, step)`` call as one JSON line: what the tests read back."""

    def __init__(self, path: str):
        self.path = path

    def log(self, metrics: dict[str, Any], step: int) -> None:
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


class RecordingMetrics(MetricsProcessor):
    """TorchTitan's metrics processor with :class:`JsonLinesLogger` as its logger on rank 0
    (the rank TorchTitan logs on without pipeline parallelism): ``{dump_folder}/metrics.jsonl``."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def _build_metric_logger(self, *, config, parallel_dims, dump_folder, **kwargs) -> BaseLogger:
        import os

        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return BaseLogger()
        os.makedirs(dump_folder, exist_ok=True)
        return JsonLinesLogger(os.path.join(dump_folder, "metrics.jsonl"))


def _sum_reduction_parallelize(parallelize_fn):
    """``parallelize_fn`` whose FSDP modules reduce with SUM: gloo has no ``PREMUL_SUM``."""

    def parallelize(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def _tiny_model_spec():
    spec = model_registry("debugmodel")
    model = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": torch.nn.init.xavier_uniform_, "bias": torch.nn.init.zeros_}),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
            hidden_dim=HIDDEN,
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=4 * SEQ_LEN, theta=10000, scaling="none"),
            attn_backend="flex"),
    )
    # FlexAttention has no CPU backward: dense causal SDPA instead
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return dataclasses.replace(spec, flavor="tiny", model=model,
                               parallelize_fn=_sum_reduction_parallelize(spec.parallelize_fn))


def tiny() -> FastspecTrainer.Config:
    """The tiny llama3 with the probe streaming keys and FFN inputs, emitting every 2 steps."""
    from torchtitan.components.checkpoint import CheckpointManager

    spec = _tiny_model_spec()
    return FastspecTrainer.Config(
        model_spec=spec,
        hf_assets_path=".",
        tokenizer=SyntheticTokenizer.Config(),
        dataloader=SyntheticDataLoader.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        training=TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ_LEN, steps=4,
                                mixed_precision_param="float32"),
        metrics=RecordingMetrics.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=SelectiveAC.Config(),
        fastspec=FastspecConfig(enable=True, keys=True, ffn=True, emit_every=2, ffn_rows="all"),
    )


def tiny_full_ac() -> FastspecTrainer.Config:
    """:func:`tiny` with full activation checkpointing: every block's forward runs again in backward."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = tiny()
    config.activation_checkpoint = FullAC.Config()
    return config


def tiny_validated() -> FastspecTrainer.Config:
    """:func:`tiny` with TorchTitan's validator after every step (2 batches of other synthetic
    tokens, in eval mode under ``no_grad``): its forwards must not reach the streaming totals."""
    from torchtitan.components.validate import Validator

    config = tiny()
    config.validator = Validator.Config(enable=True, freq=1, steps=2, dataloader=SyntheticDataLoader.Config(seed=99))
    return config
