"""Where the probe sites live in each Hugging Face model family.

Attention keys and queries need no table: every supported family calls the registered
attention function with post-RoPE ``query_states``/``key_states`` (see ``hf_attention.py``).
The table below only says, per ``config.model_type``, which modules are

* ``ffn``: the down projection, whose *input* is the FFN post-activation (SPEC §5);
* ``k_norm``/``q_norm``: the per-head Q/K RMSNorm (its weight is γ, SPEC §5), if any;
* ``k_proj``: the key projection, for pre-RoPE keys when there is no ``k_norm``.

Each pattern is a regular expression matched against the full module name with
``re.fullmatch``; group 1 is the layer index. To add a family, register one entry::

    fastspec.probe.FAMILIES["my_model"] = fastspec.probe.Family(
        ffn=r"(?:.*\\.)?blocks\\.(\\d+)\\.ffn\\.w2", k_norm=None, q_norm=None,
        k_proj=r"(?:.*\\.)?blocks\\.(\\d+)\\.attn\\.wk")
"""
from __future__ import annotations

from dataclasses import dataclass

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
