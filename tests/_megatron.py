"""Tiny Megatron-core GPT models on CPU for the tests (tests/test_integration_megatron.py,
tests/_megatron_train.py): building one, a batch for it, and the shims its CPU run needs.

Megatron-core runs on CPU, gloo, without TransformerEngine or apex (``get_gpt_layer_local_spec()``),
once its CUDA-only calls are shimmed here (never in the library): ``torch.cuda.current_device``
(RoPE and the pipeline's receive buffers allocate on it) returns ``"cpu"``, ``torch.cuda.synchronize``
(``dist_checkpointing.save`` and the pipeline's batched p2p call it) does nothing, so does waiting
on ``torch.cuda.current_stream()`` (megatron-core 0.17+'s DistributedDataParallel), the pipeline
schedules' token counter (``torch.zeros(..., device="cuda")``) is made on the CPU, activation
recomputation saves and restores no CUDA RNG state (there is none), and the tensor-parallel
RNG tracker is seeded with ``inference_rng_tracker=True`` (no CUDA generator). The local attention
needs an explicit mask: :func:`batch` gives Megatron's boolean ``[B, 1, T, T]`` (True = masked out),
causal, with the padding of each sequence masked as keys.
"""
from __future__ import annotations

import os
import types
import warnings

import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")


def install_shims():
    """Shim the CUDA-only calls a CPU run of Megatron-core makes (training with its pipeline
    schedules and activation recomputation included); returns a function that puts the originals
    back (a pytest process restores them after its Megatron tests)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random

    saved = torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream
    saved_megatron = schedules.torch, random._get_cuda_rng_state, random._set_cuda_rng_state

    def current_device():  # Megatron allocates RoPE tables and p2p buffers there
        return "cpu"
    current_device.shim = True
    torch.cuda.current_device = current_device
    # dist_checkpointing.save syncs before writing; the pipeline's batched p2p (batch_p2p_sync) after each exchange
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # megatron-core 0.17+: DistributedDataParallel's grad sync waits on the current stream for the
    # events of CUDA-graph replays (none here)
    torch.cuda.current_stream = lambda *args, **kwargs: _NO_STREAM
    # forward_backward_func counts tokens in torch.zeros([], device="cuda"): made on the CPU
    schedules.torch = _CpuTorch("torch")
    # activation recomputation (tensor_parallel.checkpoint) saves and restores the CUDA RNG state
    # (torch.cuda.default_generators): there is none; the CPU state is still saved and restored
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None

    def restore():
        torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream = saved
        schedules.torch, random._get_cuda_rng_state, random._set_cuda_rng_state = saved_megatron
    return restore


class _NoStream:
    """``torch.cuda.current_stream()`` on the CPU (test shim): waiting on it is a no-op."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


_NO_STREAM = _NoStream()


class _CpuTorch(types.ModuleType):
    """``torch`` as Megatron's pipeline schedules see it (test shim): ``torch.zeros(...,
    device="cuda")`` is made on the CPU; everything else is torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def shutdown() -> None:
    """Destroy Megatron's groups and the process group (an in-process test's teardown)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


VOCAB = 128
SEQ = 16


def init(tp: int = 1, pp: int = 1, vp: int | None = None, seed: int = 0) -> None:
    """``torch.distributed`` on gloo (one process unless torchrun set the world) and Megatron's
    model-parallel groups, seeded."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not getattr(torch.cuda.current_device, "shim", False):
        install_shims()
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("gloo")
        else:  # one process (a pytest worker): no port to pick
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    torch.manual_seed(seed)


def config(layers: int = 2, hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128,
           qk_layernorm: bool = False, recompute: str | None = None, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             num_query_groups=groups, ffn_hidden_size=ffn, use_cpu_initialization=True,
                             pipeline_dtype=torch.float32, qk_layernorm=qk_layernorm, hidden_dropout=0.0,
                             attention_dropout=0.0, **extra, **kw)


def gpt(cfg, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    """A ``GPTModel`` of ``cfg`` with RoPE, from the local (no TransformerEngine) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    return GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope", pre_process=pre_process,
                    post_process=post_process, **kw)


def batch(seed: int, b: int = 2, s: int = SEQ, pad: tuple[int, ...] = ()) -> dict:
    """``{"input_ids", "position_ids", "attention_mask", "labels"}`` for a GPTModel call: random
    tokens, Megatron's causal boolean mask (True = masked out), and the last ``pad[i]`` tokens of
    sequence ``i`` masked as keys of every query (padding); ``keep`` [B, T] says which are real."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].repeat(b, 1, 1, 1)
    keep = torch.ones(b, s, dtype=torch.bool)
    for i, p in enumerate(pad):
        if p:
            mask[i, 0, :, s - p:] = True
            keep[i, s - p:] = False
    return {"input_ids": ids, "position_ids": torch.arange(s).expand(b, s), "attention_mask": mask,
            "labels": torch.roll(ids, -1, 1), "keep": keep}


def call(model, data: dict):
    """``model(input_ids, position_ids, attention_mask, labels=labels)``: the per-token loss [B, T]."""
    return model(data["input_ids"], data["position_ids"], data["attention_mask"], labels=data["labels"])
