"""The demo's three conditions, built from Hugging Face configs (the QK-norm study).

* ``qk_norm``: Qwen3 layout, per-head RMSNorm on queries and keys with learned scale γ;
* ``qk_norm_frozen``: the same model with every q_norm/k_norm γ frozen at 1;
* ``no_qk_norm``: Llama layout (identical except for the missing Q/K norms).

All three share d_model, depth, heads, GQA grouping, RoPE and the seed; the Q/K norm weights
consume no random numbers at init, so the three models start from identical linear weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _args
from . import CONDITIONS


@dataclass(frozen=True)
class ModelSize:
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    d_ff: int = 384
    seq_len: int = 128

    def __post_init__(self):
        for name in ("d_model", "layers", "heads", "kv_heads", "d_ff", "seq_len"):  # (frozen: store plain ints)
            object.__setattr__(self, name, _args.integer(name, getattr(self, name), minimum=1))
        if self.d_model % self.heads:
            raise ValueError(f"heads: expected a divisor of d_model ({self.d_model}), got {self.heads}")
        if (self.d_model // self.heads) % 2:  # rotary embeddings rotate pairs of dimensions
            raise ValueError(f"heads: expected d_model / heads (the head width) to be even for rotary "
                             f"embeddings, got {self.d_model} / {self.heads} = {self.d_model // self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads ({self.heads}), got {self.kv_heads}")


def build_model(condition: str, size: ModelSize, vocab_size: int, seed: int) -> torch.nn.Module:
    """A freshly initialised causal LM for ``condition`` (see module docstring)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    _args.choice("condition", condition, CONDITIONS)
    common = dict(vocab_size=vocab_size, hidden_size=size.d_model, intermediate_size=size.d_ff,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  num_key_value_heads=size.kv_heads, head_dim=size.d_model // size.heads,
                  max_position_embeddings=max(size.seq_len, 128), tie_word_embeddings=False,
                  attention_dropout=0.0, rope_theta=10000.0)
    torch.manual_seed(seed)
    if condition == "no_qk_norm":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=False))
    if condition == "qk_norm_frozen":
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.requires_grad_(False)
    return model
