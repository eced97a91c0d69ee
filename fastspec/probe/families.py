"""Where the probe sites live in each Hugging Face model family.

Attention keys and queries need no table: every supported family calls the registered
attention function with post-RoPE ``query_states``/``key_states`` (see ``hf_attention.py``).
The table below only says, per ``config.model_type``, which modules are

* ``ffn``: the down projection, whose *input* is the FFN post-activation (docs/protocols.md):
  ``mlp.down_proj`` (Llama layout, also Phi-3 after its fused ``gate_up_proj``), ``mlp.c_proj``
  (GPT-2), ``mlp.dense_4h_to_h`` (GPT-NeoX), ``fc2`` (OPT, Phi);
* ``k_norm``/``q_norm``: the Q/K norm (its weight is γ), if any, laid out as ``norm_layout``
  says. Qwen3, Gemma 3, OLMo 2/3 and Phi (``qk_layernorm=True``) have one; Llama, Mistral,
  Qwen2, Gemma 1/2, OLMo, GPT-2, BERT, GPT-NeoX, OPT and Phi-3 have none;
* ``k_proj``: the key projection, for pre-RoPE keys when there is no ``k_norm``; None when the
  family has no rotary embedding or fuses the key projection into one QKV matmul (GPT-NeoX's
  ``query_key_value``, Phi-3's ``qkv_proj``), which then says ``rotary=True``.

Each pattern is a regular expression matched against the full module name with
``re.fullmatch``; group 1 is the layer index. To add a family, register one entry::

    fastspec.probe.FAMILIES["my_model"] = fastspec.probe.Family(
        ffn=r"(?:.*\\.)?blocks\\.(\\d+)\\.ffn\\.w2", k_norm=None, q_norm=None,
        k_proj=r"(?:.*\\.)?blocks\\.(\\d+)\\.attn\\.wk")

Not listed: mixture-of-experts FFNs (Mixtral, OLMoE, ...), which have no single down
projection per layer, and families whose attention bypasses the attention interface (Falcon,
GPT-J as of transformers 5.23), whose keys the probe cannot see.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import nn

_P = r"(?:.*\.)?"  # any module prefix (model., base_model., transformer., ...)
NORM_LAYOUTS = ("head", "head_first", "flat")


@dataclass(frozen=True)
class Family:
    """Module-name patterns of one model family (group 1 of each = layer index).

    ``norm_layout`` is how the ``k_norm``/``q_norm`` modules act:

    * ``"head"``: on ``[B, T, H, d_head]`` with a ``[d_head]`` weight shared by the heads
      (Qwen3, Gemma 3); γ is one vector per layer and its output gives the pre-RoPE keys;
    * ``"head_first"``: the same weight, on ``[B, H, T, d_head]`` (Phi's ``qk_layernorm``);
    * ``"flat"``: on the whole projection ``[B, T, H·d_head]`` with an ``[H·d_head]`` weight
      (OLMo 2/3); γ is split per head (``gamma.py``).

    ``prerope_keys`` needs ``"head"`` (or no norm, then ``k_proj``). ``rotary``: whether the
    family has a rotary embedding; None (default) infers it from ``k_norm``/``k_proj`` being set.
    """

    ffn: str | None
    k_norm: str | None = None
    q_norm: str | None = None
    k_proj: str | None = None  # None: no rotary embedding (keys are pre-RoPE already), or a fused QKV
    gamma_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    norm_layout: str = "head"
    rotary: bool | None = None

    def __post_init__(self):
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout: expected one of {NORM_LAYOUTS}, got {self.norm_layout!r}")

    @property
    def has_rotary(self) -> bool:
        return self.rotary if self.rotary is not None else (self.k_norm or self.k_proj) is not None


def _layers(path: str, norms: str | None = None, **kw) -> Family:
    """A family with its FFN down projection at ``...layers.{i}.<path>`` and, with ``norms``, its
    Q/K norms at ``...layers.{i}.<norms>`` (``{}`` becomes ``k`` / ``q``)."""
    at = _P + r"layers\.(\d+)\."
    if norms is not None:
        kw.update(k_norm=at + norms.format("k"), q_norm=at + norms.format("q"))
    return Family(ffn=at + path, **kw)


_K_PROJ = _P + r"layers\.(\d+)\.self_attn\.k_proj"
_DECODER = _layers(r"mlp\.down_proj", k_proj=_K_PROJ)
_QK_NORM = _layers(r"mlp\.down_proj", r"self_attn\.{}_norm", k_proj=_K_PROJ)
_OLMO2 = _layers(r"mlp\.down_proj", r"self_attn\.{}_norm", k_proj=_K_PROJ, norm_layout="flat")

FAMILIES: dict[str, Family] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _QK_NORM,
    "gemma": _DECODER,
    "gemma2": _DECODER,
    "gemma3_text": Family(**{**_QK_NORM.__dict__, "gamma_offset": 1.0}),
    "olmo": _DECODER,
    "olmo2": _OLMO2,
    "olmo3": _OLMO2,
    "phi": _layers(r"mlp\.fc2", r"self_attn\.{}_layernorm", k_proj=_K_PROJ, norm_layout="head_first"),
    "phi3": _layers(r"mlp\.down_proj", rotary=True),  # qkv_proj: no separate key projection
    "gpt_neox": _layers(r"mlp\.dense_4h_to_h", rotary=True),  # query_key_value: fused QKV
    "opt": _layers(r"fc2"),  # learned positions: no RoPE
    "gpt2": Family(ffn=_P + r"h\.(\d+)\.mlp\.c_proj"),
    "bert": Family(ffn=_P + r"layer\.(\d+)\.output\.dense"),
}
FAMILIES["gemma3"] = FAMILIES["gemma3_text"]

# Unknown decoder families usually follow the Llama layout; used with a warning.
DEFAULT_FAMILY = _DECODER


# layer index from a module name: the number after a layer-stack container, else the first number
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_ANY_INDEX_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(name: str, module=None) -> int | None:
    """The layer index of a module: its ``layer_idx`` attribute, else the number in its name."""
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    m = _LAYER_RE.search(name) or _ANY_INDEX_RE.search(name)
    return int(m.group(1)) if m else None


def plain_name(name: str) -> str:
    """A module name without the ``_orig_mod`` segments that ``torch.compile`` wrappers put in it
    (``layers.0._orig_mod.mlp`` -> ``layers.0.mlp``, e.g. layers compiled one by one)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def matches(model: nn.Module, pattern: str | None) -> list[tuple[str, nn.Module, int | None]]:
    """``(name, module, layer)`` of every module whose full name (:func:`plain_name`)
    ``re.fullmatch``-es ``pattern`` (layer: group 1 of the pattern, else :func:`layer_of`);
    ``[]`` for ``pattern=None``. ``name`` is the module's real name in ``model``."""
    if pattern is None:
        return []
    rx = re.compile(pattern)
    out = []
    for name, mod in model.named_modules():
        m = rx.fullmatch(plain_name(name))
        if m:
            out.append((name, mod, int(m.group(1)) if m.groups() else layer_of(name, mod)))
    return out


def ffn_modules(model: nn.Module, family: Family) -> list[tuple[str, nn.Module, int | None]]:
    """:func:`matches` of ``family.ffn``: the FFN down projections; raises if there are none."""
    found = matches(model, family.ffn)
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"ffn: no module matches the FFN down-projection pattern {family.ffn!r} in this "
                         f"model (model_type {model_type!r}); register the family in fastspec.probe.FAMILIES, "
                         f"or pass ffn=False (keys need no family; docs/protocols.md)")
    return found


def _check_prerope(model: nn.Module, model_type: str, family: Family) -> None:
    """Raise where the family has no module whose output is the pre-RoPE keys ``[B, T, H, d_head]``
    (or ``[B, T, H·d_head]``, from ``k_proj``) for the probe to hook."""
    if family.k_norm is not None and family.norm_layout != "head" and matches(model, family.k_norm):
        where = "the whole key projection" if family.norm_layout == "flat" else "[B, H, T, d_head]"
        raise ValueError(f"prerope_keys: {model_type!r} normalises keys over {where}, which the probe does "
                         f"not split into pre-RoPE heads; use keys=True (post-RoPE)")
    if family.k_norm is None and family.k_proj is None:
        if not family.has_rotary:
            raise ValueError(f"prerope_keys: {model_type!r} has no rotary embedding, so its keys are "
                             f"already pre-RoPE; use keys=True")
        raise ValueError(f"prerope_keys: {model_type!r} computes keys in a fused QKV projection, so there "
                         f"is no pre-RoPE key module to hook; use keys=True (post-RoPE)")


def resolve_family(model: nn.Module, needs_family: bool, prerope_keys: bool) -> Family | None:
    """The :class:`Family` of an HF model (Llama layout with a warning when unknown); None for a
    model without ``config.model_type``, which then may only have ``modules`` sites."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        if needs_family:
            raise ValueError("model: keys/queries/ffn/prerope_keys sites need a Hugging Face model "
                             "(with .config.model_type); for other models pass keys=False, ffn=False "
                             "and choose sites with modules=")
        return None
    family = FAMILIES.get(model_type)
    if family is None:
        warnings.warn(f"fastspec.Probe: model_type {model_type!r} is not in fastspec.probe.FAMILIES; "
                      f"assuming the Llama layout for FFN/Q-K-norm sites (register it: docs/protocols.md, "
                      f"or pass ffn=False)",
                      stacklevel=3)
        family = DEFAULT_FAMILY
    if prerope_keys:
        _check_prerope(model, model_type, family)
    return family
