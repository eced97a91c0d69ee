"""Tiny Hugging Face checkpoints written to disk (no downloads), for the ``fastspec analyze`` tests.

Each writer saves a randomly initialised ``*ForCausalLM`` with ``save_pretrained`` (safetensors)
and the shared test tokenizer beside it, so that ``AutoModel.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` load it offline, as they would a real training run's
checkpoint folder. :func:`write_gguf` writes the same kind of tiny Llama as a llama.cpp GGUF file.

Design:

* one tokenizer for every fixture (:func:`tokenizer`): a byte-level BPE over printable ASCII
  plus newline and tab, with one merge (two spaces; 100 ids), built offline with the
  ``tokenizers`` library. Byte-level, because that is the vocabulary GGUF's ``"gpt2"`` tokenizer type spells, so the GGUF
  file and the folders tokenize text into the same ids (which makes the batch of a mixed run
  identical too);
* sizes as in ``tests/_tiny_models.py`` (hidden 32, 4 heads of 8, 2 KV heads where the family
  has GQA, FFN 48) with 128 positions, so a forward of a few sequences takes milliseconds;
* seeded weights (``torch.random.fork_rng``, so the caller's global RNG is left alone), and a
  ``scale`` on the key projection so checkpoints of a series can differ in a known way.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3", "gpt2", "gemma3")
EOS, UNK = "<|endoftext|>", "<unk>"
SPECIALS = (EOS, UNK)  # ids 0 and 1
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, POSITIONS = 32, 4, 2, 8, 48, 128


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``bytes_to_unicode``), which byte-level BPE
    vocabularies (and GGUF's ``"gpt2"`` tokenizer type) spell their tokens in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def vocabulary() -> list[str]:
    """The tokens in id order, in byte-level spelling: the two specials, one per character, and
    the one merged token (two spaces, ``"ĠĠ"``)."""
    spell = _byte_spelling()
    return list(SPECIALS) + [spell[ord(c)] for c in CHARS] + [spell[32] * 2]


# The one merge, space + space: a real BPE merge (GGUF needs one: an empty merges array reads back
# as none, and then transformers derives merges from scores the file does not have).
MERGES = (("Ġ", "Ġ"),)


@functools.cache
def tokenizer():
    """The shared test tokenizer: a ``PreTrainedTokenizerFast``, byte-level BPE (one id per ASCII
    character, one merge: two spaces), 100 ids, ``eos_token`` ``<|endoftext|>`` (id 0, also bos
    and pad), ``unk_token`` ``<unk>`` (1), ``model_max_length`` 128. Cached: do not modify it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(vocabulary())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token=UNK,
                                                bos_token=EOS, pad_token=EOS, model_max_length=POSITIONS)


def _config(family: str, layers: int, **config):
    vocab = len(tokenizer())
    tokens = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if family in ("llama", "qwen3", "gemma3"):
        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
               "gemma3": transformers.Gemma3TextConfig}[family]
        return cls(**{"vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": FFN,
                      "num_hidden_layers": layers, "num_attention_heads": HEADS,
                      "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "max_position_embeddings": POSITIONS, **tokens, **config})
    if family == "gpt2":
        return transformers.GPT2Config(**{"vocab_size": vocab, "n_embd": HIDDEN, "n_layer": layers,
                                          "n_head": HEADS, "n_inner": FFN, "n_positions": POSITIONS,
                                          "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                          **tokens, **config})
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


_MODELS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel",
           "gemma3": "Gemma3ForCausalLM"}


def model(family: str, *, seed: int = 0, layers: int = 2, scale: float = 1.0, **config):
    """The tiny ``*ForCausalLM`` that :func:`write_checkpoint` saves, in eval mode (not saved).

    ``scale`` multiplies the key projection (weight and bias, so every key is scaled by exactly
    ``scale`` before any Q/K norm): ``k_proj`` in Llama/Qwen3/Gemma 3, the key third of GPT-2's
    fused ``c_attn`` (a ``Conv1D``: weight ``[hidden, 3·hidden]``, keys in columns hidden..2·hidden).
    Note that Qwen3's and Gemma 3's ``k_norm`` undo such a scale (RMSNorm), and that scale-free
    metrics (participation ratio, effective rank) do not see it at all: use ``seed`` for series
    whose spectra must differ."""
    cfg = _config(family, layers, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = getattr(transformers, _MODELS[family])(cfg)
    if scale != 1.0:
        with torch.no_grad():
            if family == "gpt2":
                for block in net.transformer.h:
                    block.attn.c_attn.weight[:, HIDDEN:2 * HIDDEN] *= scale
                    block.attn.c_attn.bias[HIDDEN:2 * HIDDEN] *= scale
            else:
                for layer in net.model.layers:
                    layer.self_attn.k_proj.weight *= scale
                    if layer.self_attn.k_proj.bias is not None:
                        layer.self_attn.k_proj.bias *= scale
    return net.eval()


def write_checkpoint(folder, family: str, *, seed: int = 0, layers: int = 2, scale: float = 1.0,
                     **config) -> Path:
    """Save :func:`model` ``(family, seed=, layers=, scale=, **config)`` and :func:`tokenizer` to
    ``folder`` (created): ``config.json``, ``model.safetensors``, the tokenizer files. ``config``:
    extra config fields (they override the tiny sizes). Returns ``folder`` as a ``Path``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # safetensors is the only format transformers 5 writes (no safe_serialization argument any more)
    model(family, seed=seed, layers=layers, scale=scale, **config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def write_series(root, family: str = "llama", steps: Sequence[int] = (100, 200, 300), *, seed: int = 0,
                 scales: Sequence[float] | None = None, **kw) -> Path:
    """A training run's checkpoint folder: ``root/checkpoint-<step>`` for each of ``steps``, the
    i-th with seed ``seed + i`` (so their spectra differ) and scale ``scales[i]`` (default: the
    ``scale`` in ``kw``, else 1). ``kw`` goes to :func:`write_checkpoint`. Returns ``root``."""
    root = Path(root)
    if scales is not None and len(scales) != len(steps):
        raise ValueError(f"scales: expected {len(steps)} values, one per step, got {len(scales)}")
    for i, step in enumerate(steps):
        extra = dict(kw) if scales is None else {**kw, "scale": scales[i]}
        write_checkpoint(root / f"checkpoint-{step}", family, seed=seed + i, **extra)
    return root


def _permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` of a q/k projection ``[heads·head_dim, hidden]``: within
    each head, the rotary halves (HF's rotate_half layout) become interleaved pairs (GGML's RoPE).
    transformers applies the inverse on load (``_reverse_permute_weights``)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, *, seed: int = 0) -> Path:
    """Write :func:`model` ``("llama", seed=seed)`` to ``path`` as a GGUF file (F32 tensors, llama
    metadata, and the :func:`tokenizer` as a ``"gpt2"`` byte-level BPE vocabulary) that both
    ``AutoModel.from_pretrained(path.parent, gguf_file=path.name)`` and
    ``AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)`` load offline, with the same
    logits as the model and the same ids as :func:`tokenizer`. Needs the ``gguf`` package."""
    gguf = pytest.importorskip("gguf")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    net = model("llama", seed=seed)
    cfg = net.config
    sd = {k: v.detach().float().numpy() for k, v in net.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")  # not "mistral...": transformers would read the file as Mistral
    w.add_context_length(POSITIONS)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([" ".join(pair) for pair in MERGES])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)
    w.add_unk_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight")  # no output.weight: transformers ties it to the embedding
    for hf, gg in names.items():
        t = torch.from_numpy(sd[hf])
        if ".attn_q." in gg:
            t = _permute_for_gguf(t, HEADS)
        elif ".attn_k." in gg:
            t = _permute_for_gguf(t, KV_HEADS)
        w.add_tensor(gg, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def skip_unless_gguf_tokenizer_loads(path) -> None:
    """Skip the calling test where this transformers cannot read :func:`write_gguf`'s tokenizer:
    transformers 5.1 converts every Llama GGUF tokenizer as a sentencepiece one and fails on its
    byte-level BPE merges (TypeError); 5.24 reads it. A limit of the fixture, not of fastspec."""
    path = Path(path)
    try:
        transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except TypeError as e:
        pytest.skip(f"transformers {transformers.__version__} cannot convert this test GGUF's byte-level "
                    f"tokenizer ({' '.join(str(e).split())[:80]})")
