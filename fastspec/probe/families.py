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

**Models that are not Hugging Face models** (the trainers' own modules: OLMo-core's
``Transformer``, TorchTitan's decoders) call no attention interface. Their family says where
attention receives its post-RoPE queries and keys, by position among a module's inputs
(:class:`AttentionInputs`); the probe reads them there with a forward pre-hook. Such a family
names the model classes it is for (``Family.model_classes``), so ``Probe(model)`` finds it
without ``config.model_type``; ``Probe(model, family=...)`` chooses one explicitly::

    fastspec.probe.FAMILIES["my_trainer"] = fastspec.probe.Family(
        ffn=r"(?:.*\\.)?blocks\\.(\\d+)\\.mlp\\.w2",
        attention=fastspec.probe.AttentionInputs(r"(?:.*\\.)?blocks\\.(\\d+)\\.attn\\.core",
                                                 query=0, key=1, layout="BTHD"),
        model_classes=("my_trainer.model.",))
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import nn

_P = r"(?:.*\.)?"  # any module prefix (model., base_model., transformer., ...)
NORM_LAYOUTS = ("head", "head_first", "flat")


LAYOUTS = ("BTHD", "BHTD", "TBHD")
#: ``Family(mask=...)``: how a model call's ``attention_mask`` marks padding (``hooks.ForwardScope``)
MASK_RULES = ("keep", "megatron")


@dataclass(frozen=True)
class AttentionInputs:
    """Where a model's attention receives its post-RoPE queries and keys: positional inputs of the
    modules whose full names ``re.fullmatch`` ``module`` (group 1: the layer index).

    ``query`` and ``key`` are positions among the module's positional arguments: an int, or a
    tuple of ints that indexes into nested tuples (``(0, 1)``: ``args[0][1]``, for a module called
    with one ``(q, k, v)`` tuple, as OLMo-core's attention backends are); ``query=None`` when the
    queries are not there. ``layout`` is the axes of those tensors: ``"BTHD"`` (batch, tokens,
    heads, head width), ``"BHTD"`` or ``"TBHD"`` (tokens first: Megatron-core's ``[s, b, groups,
    d_head]``); the last two are read as transposed views, no copy. Keys arrive per KV head (before any GQA repeat), which is
    what the key-rank protocol measures.
    """

    module: str
    query: int | tuple[int, ...] | None = 0
    key: int | tuple[int, ...] = 1
    layout: str = "BTHD"

    def __post_init__(self):
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"module: expected a regular expression (group 1: the layer index), got {self.module!r}")
        for name in ("query", "key"):
            value = getattr(self, name)
            if value is None and name == "query":
                continue
            path = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
            if not (isinstance(path, tuple) and path
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path)):
                raise ValueError(f"{name}: expected a position (an int >= 0, or a tuple of them into nested "
                                 f"tuples), got {value!r}")
            object.__setattr__(self, name, path)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")


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

    ``attention``: where the keys and queries are read (:class:`AttentionInputs`); None (the
    Hugging Face families) reads them at the attention interface (``hf_attention.py``).
    ``model_classes``: prefixes of the module path of model classes (e.g.
    ``"olmo_core.nn.transformer."``) this family is found for when the model has no
    ``config.model_type``; any class in the model's MRO counts, so wrappers that subclass the
    model (FSDP2's ``fully_shard``) keep it.

    ``seq_first``: the model's activations are ``[T, B, ...]`` (tokens first, Megatron-core), so
    the FFN inputs ``[T, B, d_ff]`` are read as ``[B, T, d_ff]`` views (no copy), for token
    sampling and the padding mask. ``layer_number``: an attribute of the layer module (the
    module named by a pattern up to its group 1, e.g. ``decoder.layers.0``) that holds the layer's
    1-based global number, used instead of group 1 (Megatron's ``layer_number``: under pipeline
    parallelism a stage's ``layers.0`` is some later layer of the model). ``mask``: how the
    ``attention_mask`` of a model call marks padding: ``"keep"`` (a 2-D ``[B, T]`` mask, nonzero
    for real tokens; other masks are the model's own and count every token) or ``"megatron"``
    (a boolean ``[B, 1, T, T]`` mask, True where attention is masked out: a token that no query
    may attend to is padding; a 2-D mask is read as ``"keep"``).
    """

    ffn: str | None
    k_norm: str | None = None
    q_norm: str | None = None
    k_proj: str | None = None  # None: no rotary embedding (keys are pre-RoPE already), or a fused QKV
    gamma_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    norm_layout: str = "head"
    rotary: bool | None = None
    attention: AttentionInputs | None = None
    model_classes: tuple[str, ...] = ()
    seq_first: bool = False
    layer_number: str | None = None
    mask: str = "keep"

    def __post_init__(self):
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout: expected one of {NORM_LAYOUTS}, got {self.norm_layout!r}")
        if self.attention is not None and not isinstance(self.attention, AttentionInputs):
            raise TypeError(f"attention: expected a fastspec.probe.AttentionInputs or None, "
                            f"got {type(self.attention).__name__}")
        classes = (self.model_classes,) if isinstance(self.model_classes, str) else tuple(self.model_classes)
        if not all(isinstance(c, str) and c for c in classes):
            raise ValueError(f"model_classes: expected module-path prefixes (strings), got {self.model_classes!r}")
        object.__setattr__(self, "model_classes", classes)
        if self.mask not in MASK_RULES:
            raise ValueError(f"mask: expected one of {MASK_RULES}, got {self.mask!r}")
        if self.layer_number is not None and not (isinstance(self.layer_number, str) and self.layer_number):
            raise ValueError(f"layer_number: expected an attribute name or None, got {self.layer_number!r}")

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

# The trainers' own models (docs/olmo_core.md, docs/torchtitan.md). Their Q/K norms are left out
# (no γ records): OLMo-core's sit over the whole projection or per head depending on the config,
# and under FSDP2 their weights are shards, which γ's statistics cannot be taken over.
FAMILIES["olmo_core"] = Family(
    # Transformer.blocks[i]: attention.backend((q, k, v), ...) with q, k, v [B, T, H, d_head]
    ffn=_P + r"blocks\.(\d+)\.feed_forward\.w2",
    attention=AttentionInputs(_P + r"blocks\.(\d+)\.attention\.backend", query=(0, 0), key=(0, 1)),
    rotary=True, model_classes=("olmo_core.nn.transformer.",))
FAMILIES["torchtitan"] = Family(
    # Decoder.layers[i]: attention.inner_attention(q, k, v, ...) with q, k, v [B, T, H, d_head]
    ffn=_P + r"layers\.(\d+)\.feed_forward\.w2",
    attention=AttentionInputs(_P + r"layers\.(\d+)\.attention\.inner_attention", query=0, key=1),
    rotary=True, model_classes=("torchtitan.models.",))

# Megatron-core's GPTModel (docs/megatron.md), from get_gpt_layer_local_spec() or the Transformer
# Engine spec: decoder.layers[i].self_attention.core_attention(query, key, value, attention_mask, ...)
# with query [s, b, heads, d_head] and key [s, b, query groups, d_head] after RoPE (and after
# q/k_layernorm), mlp.linear_fc2 on [s, b, d_ff]; layer i of a pipeline stage is global layer
# layer_number - 1. Its Q/K norms are left out, as OLMo-core's are.
FAMILIES["megatron"] = Family(
    ffn=_P + r"decoder\.layers\.(\d+)\.mlp\.linear_fc2",
    attention=AttentionInputs(_P + r"decoder\.layers\.(\d+)\.self_attention\.core_attention",
                              query=0, key=1, layout="TBHD"),
    rotary=True, model_classes=("megatron.core.models.gpt.",), seq_first=True,
    layer_number="layer_number", mask="megatron")

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


# name segments of wrapper modules: torch.compile's (``layers.0._orig_mod.mlp``, layers compiled one
# by one) and torch's activation-checkpoint wrapper (TorchTitan and OLMo-core wrap each block)
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def plain_name(name: str) -> str:
    """A module name without the segments of wrapper modules (:data:`WRAPPER_SEGMENTS`):
    ``layers.0._checkpoint_wrapped_module.mlp`` -> ``layers.0.mlp``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def matches(model: nn.Module, pattern: str | None, number: str | None = None) -> list[tuple[str, nn.Module, int | None]]:
    """``(name, module, layer)`` of every module whose full name (:func:`plain_name`)
    ``re.fullmatch``-es ``pattern`` (layer: group 1 of the pattern, else :func:`layer_of`);
    ``[]`` for ``pattern=None``. ``name`` is the module's real name in ``model``.

    ``number`` (a family's ``layer_number``): the layer is ``getattr(layer module, number) - 1``,
    the layer module being the one whose name is the match up to the end of group 1 (Megatron's
    global layer numbers); a layer module without that attribute raises."""
    if pattern is None:
        return []
    rx = re.compile(pattern)
    named = list(model.named_modules())
    by_plain = {plain_name(n): m for n, m in named} if number is not None else {}
    out = []
    for name, mod in named:
        plain = plain_name(name)
        m = rx.fullmatch(plain)
        if not m:
            continue
        layer = int(m.group(1)) if m.groups() else layer_of(name, mod)
        if number is not None and m.groups():
            owner = by_plain.get(plain[:m.end(1)])
            value = getattr(owner, number, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layer_number: the layer module {plain[:m.end(1)]!r} has no {number!r} "
                                 f"attribute holding its 1-based global number (got {value!r})")
            layer = value - 1
        out.append((name, mod, layer))
    return out


def ffn_modules(model: nn.Module, family: Family) -> list[tuple[str, nn.Module, int | None]]:
    """:func:`matches` of ``family.ffn``: the FFN down projections; raises if there are none."""
    found = matches(model, family.ffn, family.layer_number)
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"ffn: no module matches the FFN down-projection pattern {family.ffn!r} in this "
                         f"model (model_type {model_type!r}); register the family in fastspec.probe.FAMILIES, "
                         f"or pass ffn=False (keys need no family; docs/protocols.md)")
    # under tensor parallelism a down projection takes a column slab of the FFN rows (Megatron-core's
    # RowParallelLinear, a row-wise parallel DTensor Linear): the probe gathers the sampled rows to
    # the rank that keeps the layer (layout.ffn_split, layout.WideSites.gather)
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


class ModelChunks(nn.ModuleList):
    """Several modules probed as one model: the model chunks of Megatron's pipeline schedules
    (virtual pipeline parallelism hands a stage a list of them). Each chunk's own ``forward``
    counts (:class:`ForwardScope` hooks every chunk); the container itself is never called."""

    def forward(self, *args, **kwargs):
        raise TypeError("model: a list of model chunks is not one callable model; run each chunk "
                        "(Megatron's pipeline schedule does), or probe one chunk")


def roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose own ``forward`` is the probed model's: the chunks of a :class:`ModelChunks`,
    else the model."""
    return list(model) if isinstance(model, ModelChunks) else [model]


def _family_of_class(model: nn.Module) -> tuple[str, Family] | None:
    """The registered family whose ``model_classes`` names a class of ``model`` (its MRO; of the
    first chunk, for :class:`ModelChunks`)."""
    modules = [f"{cls.__module__}.{cls.__qualname__}" for cls in type(roots(model)[0]).__mro__]
    for name, family in FAMILIES.items():
        if any(m.startswith(prefix) for prefix in family.model_classes for m in modules):
            return name, family
    return None


def _chosen_family(family) -> tuple[str, Family]:
    """``Probe(family=...)``: a name in :data:`FAMILIES` or a :class:`Family`."""
    if isinstance(family, Family):
        return "custom", family
    if isinstance(family, str):
        if family not in FAMILIES:
            raise ValueError(f"family: expected a name in fastspec.probe.FAMILIES or a Family, got {family!r} "
                             f"(registered: {', '.join(sorted(FAMILIES))})")
        return family, FAMILIES[family]
    raise TypeError(f"family: expected a name in fastspec.probe.FAMILIES, a fastspec.probe.Family or None, "
                    f"got {type(family).__name__}")


def resolve_family(model: nn.Module, needs_family: bool, prerope_keys: bool, family=None) -> Family | None:
    """The :class:`Family` of a model: ``family`` if given (a name in :data:`FAMILIES` or a
    :class:`Family`); else an HF model's by ``config.model_type`` (Llama layout with a warning when
    unknown); else the one whose ``model_classes`` names the model's class (OLMo-core,
    TorchTitan). None for any other model, which then may only have ``modules`` sites."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if family is not None:
        model_type, family = _chosen_family(family)
    elif model_type is not None:
        family = FAMILIES.get(model_type)
        if family is None:
            warnings.warn(f"fastspec.Probe: model_type {model_type!r} is not in fastspec.probe.FAMILIES; "
                          f"assuming the Llama layout for FFN/Q-K-norm sites (register it: docs/protocols.md, "
                          f"or pass ffn=False)",
                          stacklevel=3)
            family = DEFAULT_FAMILY
    elif (found := _family_of_class(model)) is not None:
        model_type, family = found
    elif needs_family:
        raise ValueError("model: keys/queries/ffn/prerope_keys sites need a Hugging Face model "
                         "(with .config.model_type), a model of a registered trainer (OLMo-core, "
                         "TorchTitan, Megatron-core) or family=...; for other models pass keys=False, ffn=False "
                         "and choose sites with modules=")
    else:
        return None
    if prerope_keys:
        _check_prerope(model, model_type, family)
    return family
