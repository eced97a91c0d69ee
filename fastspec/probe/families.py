"""Where the probe sites live in each Hugging Face model family.

Attention keys and queries need no table: every supported family calls the registered
attention function with post-RoPE ``query_states``/``key_states`` (see ``hf_attention.py``).
The table below only says, per ``config.model_type``, which modules are

* ``ffn``: the down projection, whose *input* is the FFN post-activation (docs/protocols.md);
* ``k_norm``/``q_norm``: the per-head Q/K RMSNorm (its weight is γ), if any;
* ``k_proj``: the key projection, for pre-RoPE keys when there is no ``k_norm``.

Each pattern is a regular expression matched against the full module name with
``re.fullmatch``; group 1 is the layer index. To add a family, register one entry::

    fastspec.probe.FAMILIES["my_model"] = fastspec.probe.Family(
        ffn=r"(?:.*\\.)?blocks\\.(\\d+)\\.ffn\\.w2", k_norm=None, q_norm=None,
        k_proj=r"(?:.*\\.)?blocks\\.(\\d+)\\.attn\\.wk")
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import nn

_P = r"(?:.*\.)?"  # any module prefix (model., base_model., transformer., ...)


@dataclass(frozen=True)
class Family:
    """Module-name patterns of one model family (group 1 of each = layer index)."""

    ffn: str | None
    k_norm: str | None = None
    q_norm: str | None = None
    k_proj: str | None = None  # None: the family has no rotary embedding (keys are pre-RoPE already)
    gamma_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)


_DECODER = Family(
    ffn=_P + r"layers\.(\d+)\.mlp\.down_proj",
    k_proj=_P + r"layers\.(\d+)\.self_attn\.k_proj",
)
_QK_NORM = Family(
    ffn=_DECODER.ffn,
    k_norm=_P + r"layers\.(\d+)\.self_attn\.k_norm",
    q_norm=_P + r"layers\.(\d+)\.self_attn\.q_norm",
    k_proj=_DECODER.k_proj,
)

FAMILIES: dict[str, Family] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _QK_NORM,
    "gemma": _DECODER,
    "gemma2": _DECODER,
    "gemma3_text": Family(**{**_QK_NORM.__dict__, "gamma_offset": 1.0}),
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
                      f"assuming the Llama layout for FFN/Q-K-norm sites (see README: adding a family)",
                      stacklevel=3)
        family = DEFAULT_FAMILY
    if prerope_keys and family.k_norm is None and family.k_proj is None:
        raise ValueError(f"prerope_keys: {model_type!r} has no rotary embedding, so its keys are "
                         f"already pre-RoPE; use keys=True")
    return family
