"""The probe's hooks on a model: installing and removing them, and the forward they run in.

* :class:`ForwardScope` tracks the probed model's own ``forward``: captures count only while it
  runs (depth > 0), so the forward that activation checkpointing recomputes during backward is
  never counted twice, and it keeps that call's 2-D ``attention_mask`` so padding is not counted
  (a mask whose shape does not fit the call's tokens or a site's rows raises: it cannot be read).
* :class:`Hooks` installs one callback per site (attention keys/queries through
  ``hf_attention.watch``, or, for a family with :class:`~fastspec.probe.families.AttentionInputs`
  (OLMo-core, TorchTitan), forward pre-hooks on the modules that receive them; forward
  pre-hooks on the FFN down projections, forward hooks on
  pre-RoPE key modules and user :class:`~fastspec.probe.ModuleSite` modules) and removes all of
  them. Each callback only shapes the activation into rows ``[*rows, H, D]`` or ``[*rows, D]``
  and hands it to ``capture``; where it goes is ``routing.py``'s business.

Everything here is traceable by dynamo: a model compiled with the hooks on (``fullgraph=True``
included) traces the callbacks, and each capture becomes one custom op (``routing.py``).
"""
from __future__ import annotations

import fnmatch
import inspect
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._trace import assume_constant_result
from . import hf_attention
from .families import (
    AttentionInputs,
    Family,
    ffn_modules,
    layer_of,
    matches,
    plain_name,
    roots,
)
from .sites import ModuleSite

# capture(slot, x, *, headed, convention, head_offset=0, stream_row_step=None, gather=None)
Capture = Callable[..., None]
# slot(site, layer) -> an opaque handle the capture writes through (routing.Slot)
MakeSlot = Callable[[str, "int | None"], object]


@dataclass(frozen=True)
class SitePlan:
    """Which sites a probe captures and how (the :class:`~fastspec.Probe` arguments of the same
    names; ``ffn_row_step``: streaming FFN captures keep every ``ffn_row_step``-th token)."""

    keys: bool
    queries: bool
    ffn: bool
    prerope_keys: bool
    modules: tuple[ModuleSite, ...]
    key_convention: str
    ffn_convention: str
    tp_rank: int
    ffn_row_step: int

    @property
    def names(self) -> list[str]:
        """Record ``site`` names, in the order of the arguments."""
        out = [s for s, on in (("keys", self.keys), ("queries", self.queries), ("ffn", self.ffn),
                               ("keys_prerope", self.prerope_keys)) if on]
        return out + [m.site for m in self.modules]


def first_tensor(obj) -> Tensor | None:
    """The first tensor in a module's output/inputs (HF modules often return tuples)."""
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            t = first_tensor(o)
            if t is not None:
                return t
    if isinstance(obj, dict):
        for o in obj.values():
            t = first_tensor(o)
            if t is not None:
                return t
    return None


def as_bool_mask(mask, rule: str = "keep") -> Tensor | None:
    """A 2-D ``[B, T]`` keep-mask from a model call's ``attention_mask``, else None.

    ``rule`` (``Family.mask``): ``"keep"``, an HF mask ``[B, T]`` (nonzero = real token; any other
    shape is the model's own business: None); ``"megatron"``, also a boolean ``[B, 1, Tq, Tk]``
    mask with True where attention is masked out (Megatron-core's), whose key token ``j`` is
    padding when no query may attend to it: ``keep[b, j] = any_i ~mask[b, 0, i, j]`` (a causal
    mask keeps every token: query ``j`` attends to itself). One reduction on the device, no sync."""
    if not isinstance(mask, Tensor):
        return None
    if mask.dim() == 2:
        return mask if mask.dtype == torch.bool else mask != 0
    if rule == "megatron" and mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[1] == 1:
        return (~mask[:, 0]).any(dim=1)
    return None


def at_position(args: tuple, path: tuple[int, ...]):
    """``args[path[0]][path[1]]...``, or None where the inputs are shorter than the path."""
    value = args
    for i in path:
        if not isinstance(value, (tuple, list)) or len(value) <= i:
            return None
        value = value[i]
    return value


def local_part(x: Tensor, head_axis: int | None, site: str) -> tuple[Tensor, int | None]:
    """``x`` as this rank's tensor, and the global index of its first head when ``x`` is a
    ``DTensor`` sharded over ``head_axis`` (tensor parallelism: mesh coordinate × heads per
    rank, torch's even split); ``(x, None)`` for a plain tensor.

    A DTensor sharded over other row axes (tokens) gives this rank's rows, a replicated one the
    whole tensor. Raises for one sharded over its features (the last axis: no rank holds a
    whole row, e.g. the input of a row-parallel down projection) or holding partial sums
    (not activations yet): ``site`` names the capture in the error."""
    placements = getattr(x, "placements", None)
    if placements is None or not hasattr(x, "to_local"):
        return x, None
    head_axis = None if head_axis is None else head_axis % x.dim()
    offset = 0
    for mesh_dim, p in enumerate(placements):
        if p.is_partial():
            raise ValueError(f"{site}: the activations are a DTensor with a partial placement ({p}): they are "
                             f"not summed over ranks yet, so no rank holds them")
        if not p.is_shard():
            continue
        axis = p.dim % x.dim()
        if axis == head_axis:
            mesh = x.device_mesh
            offset += mesh.get_local_rank(mesh_dim) * -(-x.shape[axis] // mesh.size(mesh_dim))
        elif axis == x.dim() - 1:
            hint = (" (the Probe gathers an FFN layer's rows when it is built on the parallelized model: build "
                    "it after parallelize_module)" if site == "ffn" else "")
            raise ValueError(f"{site}: the activations are a DTensor sharded over their features ({p}, tensor "
                             f"parallelism), so no rank holds whole rows{hint}; probe a replicated module instead, "
                             f"or turn this site off")
    return x.to_local(), offset


def _bhtd_rows(t):
    """A ``[B, H, T, D]`` tensor as the rows view ``[B, T, H, D]``; anything else as it is."""
    return t.transpose(1, 2) if isinstance(t, Tensor) and t.dim() == 4 else t


def _from_bhtd(callback):
    """``callback(module, query, key)`` taking rows ``[B, T, H, D]``, as a callback taking the
    ``[B, H, T, D]`` of the attention interface (transposed views; other ranks pass as they are,
    for ``callback`` to skip)."""
    def bhtd(module, query, key):
        callback(module, _bhtd_rows(query), _bhtd_rows(key))
    return bhtd


def _from_tbhd(callback):
    """``callback(module, query, key)`` taking rows ``[B, T, H, D]``, as a callback taking
    tokens-first ``[T, B, H, D]`` tensors (Megatron-core's ``[s, b, heads, d]``; transposed views)."""
    def tbhd(module, query, key):
        callback(module, *(t.transpose(0, 1) if isinstance(t, Tensor) and t.dim() == 4 else t
                           for t in (query, key)))
    return tbhd


def positional_index(fn, name: str) -> int | None:
    """Position of parameter ``name`` among ``fn``'s positional arguments (worked out once, so the
    pre-hook that runs on every forward, traced or not, needs no ``inspect``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == name:
            return i
    return None


# What a model's forward calls its KV cache: ``past_key_values`` up to transformers 5.23 (and, as
# a deprecated alias, after), ``cache`` from 5.24 on, ``past`` in GPT-2-era remote code.
CACHE_ARGS = ("past_key_values", "cache", "past")


def is_cache(value) -> bool:
    """True for a transformers ``Cache`` object (any version, any name it was passed under),
    duck-typed so that this module never imports transformers; a legacy tuple cache is found by
    its argument name instead (:data:`CACHE_ARGS`)."""
    return callable(getattr(value, "get_seq_length", None))


def check_mask(mask, tokens: Tensor | None, cached: bool) -> None:
    """Raise unless ``mask`` fits the call's ``tokens`` (``input_ids [B, T]`` or ``inputs_embeds
    [B, T, d]``; None: only the mask's rank is checked): a 2-D ``[B, T]`` mask, ``[B, T' >= T]``
    when a KV cache holds earlier tokens; None or a 3-D/4-D mask pass (those are the model's to
    read: the probe then counts every token). Shapes only: no value is read, no device sync."""
    if not isinstance(mask, Tensor) or mask.dim() > 2:
        return
    want = list(tokens.shape[:2]) if isinstance(tokens, Tensor) and tokens.dim() in (2, 3) else None
    if mask.dim() == 2 and (want is None or mask.shape[0] == want[0] and (
            mask.shape[1] == want[1] or cached and mask.shape[1] > want[1])):
        return
    what = "[B, T]" if want is None else f"[{want[0]}, {'>= ' if cached else ''}{want[1]}]"
    raise ValueError(f"attention_mask: expected a 2-D padding mask of shape {what} (the [B, T] of "
                     f"input_ids/inputs_embeds{', with a KV cache' if cached else ''}), got {list(mask.shape)}")


_SCOPES: weakref.WeakValueDictionary[str, ForwardScope] = weakref.WeakValueDictionary()
_scope_keys = itertools.count()


@assume_constant_result
def _traced_forward(key: str, training: bool) -> bool:
    """Note that a compiled graph of the probed model was traced for a forward that trains (or
    not). Runs at trace time only (dynamo calls it once and keeps the result as a constant), so
    the graph's later runs pay nothing and no guard is added; an attribute set in the hook itself
    would be replayed, and guarded on, at every call."""
    scope = _SCOPES.get(key)
    if scope is not None:
        scope.traced[training] = True
    return True


class ForwardScope:
    """Depth of the probed model's own ``forward`` and the ``attention_mask`` it was called with.

    ``mask_rule`` (``Family.mask``): how that mask marks padding (:func:`as_bool_mask`)."""

    def __init__(self, model: nn.Module, mask_rule: str = "keep"):
        self.mask_rule = mask_rule
        forward = roots(model)[0].forward
        self._pos = {name: positional_index(forward, name)
                     for name in ("attention_mask", "input_ids", "inputs_embeds", *CACHE_ARGS)}
        self.depth = 0
        self.mask: Tensor | None = None
        self._call: tuple = (None, False)  # compiled: the call's tokens and KV-cache flag, for check_mask
        # the forward in flight trains: the model in training mode with gradients on (not
        # no_grad, not inference_mode); what streaming captures by default (routing.py)
        self.training = True
        # called with True when an eager forward that does not train starts, False when it ends
        # (the probe leaves its time out of the step time); never inside a compiled graph
        self.on_other: Callable[[bool], None] | None = None
        self.trained = 0  # eager training forwards seen (a warning's hint: were there any?)
        # compiled forwards: whether a graph was traced for a forward that does not train
        # (traced[False]) or one that trains (traced[True]); counted at trace time only
        self.traced = {False: False, True: False}
        self.key = f"scope{next(_scope_keys)}"  # a str: dynamo passes it to _traced_forward as a constant
        _SCOPES[self.key] = self

    @property
    def active(self) -> bool:
        """True while the model's own forward runs (not, e.g., a checkpoint recompute in backward)."""
        return self.depth > 0

    def start(self, module, args, kwargs) -> None:
        """Forward pre-hook (``with_kwargs=True``) of the model. Raises if its ``attention_mask``
        does not fit its tokens (:func:`check_mask`): eagerly here, before the model runs;
        compiled, at the first capture (:meth:`mask_for`)."""
        if self.depth == 0:
            # read at trace time under torch.compile: dynamo guards on both anyway (train/eval mode
            # and grad mode), so this adds no graph break, and no recompile beyond those it makes
            self.training = bool(module.training) and torch.is_grad_enabled()
            mask, tokens = self._arg(args, kwargs, "attention_mask"), self._arg(args, kwargs, "input_ids")
            tokens = self._arg(args, kwargs, "inputs_embeds") if tokens is None else tokens
            cached = self._cached(args, kwargs)
            if torch.compiler.is_compiling():
                # kept as given, checked and converted where a capture uses it (mask_for): no tensor
                # work here (a shape check is some), so a compiled model's top-level hooks add no
                # graph of their own
                self.mask, self._call = (mask if isinstance(mask, Tensor) else None), (tokens, cached)
                _traced_forward(self.key, self.training)
            else:  # eager: checked and converted once per forward, not once per capture
                check_mask(mask, tokens, cached)
                self.mask = as_bool_mask(mask, self.mask_rule)
                if not self.training and self.on_other is not None:
                    self.on_other(True)
                self.trained += self.training
        self.depth += 1

    def _cached(self, args: tuple, kwargs: dict) -> bool:
        """Whether the call hands the model a KV cache (whose earlier tokens a longer mask covers):
        an argument under one of the cache's names (:data:`CACHE_ARGS`), by keyword or by
        position, or a ``Cache`` object under any other keyword. Transformers renamed the
        argument (``past_key_values`` -> ``cache`` in 5.24, and ``generate`` passes whichever
        the installed version takes), so the object decides, not one name."""
        return (any(self._arg(args, kwargs, name) is not None for name in CACHE_ARGS)
                or any(is_cache(v) for v in kwargs.values()))

    def _arg(self, args: tuple, kwargs: dict, name: str):
        """Argument ``name`` of the model call, by keyword or by position."""
        value, pos = kwargs.get(name), self._pos[name]
        return args[pos] if value is None and pos is not None and len(args) > pos else value

    def end(self, module, args, output) -> None:
        """Forward hook (``always_call=True``) of the model."""
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.mask, self._call = None, (None, False)
            if not self.training and self.on_other is not None and not torch.compiler.is_compiling():
                self.on_other(False)

    def reset(self) -> None:
        if self.depth and not self.training and self.on_other is not None:
            self.on_other(False)  # hooks removed mid-forward: the span ends here
        self.depth, self.mask, self._call, self.training = 0, None, (None, False), True

    def token_rows(self, x: Tensor) -> Tensor:
        """Rows ``x: [B·T, F]`` flattened from ``[B, T, F]`` (OPT's FFN runs on those) as a
        ``[B, T, F]`` view, so that the mask reaches them; any other ``x`` as it is."""
        mask = self.mask
        if mask is None or x.dim() != 2 or mask.dim() != 2 or x.shape[0] != mask.shape[0] * mask.shape[1]:
            return x
        return x.unflatten(0, (mask.shape[0], mask.shape[1]))

    def mask_for(self, x: Tensor, headed: bool, site: str = "") -> Tensor | None:
        """``[B, T]`` keep-mask for rows ``x: [B, T, (H,) D]`` (``headed``): the last T columns of
        the model's mask (with a KV cache, the mask also covers the earlier tokens). None without
        a mask, or for rows that are not per token (``x: [N, (H,) D]``, e.g. a pooled output).
        Raises if ``x`` has two row axes that the mask cannot cover (another batch size, or more
        tokens): its padding could not be told apart. Shapes only, no device sync."""
        mask = self.mask
        if mask is not None and torch.compiler.is_compiling():
            check_mask(mask, *self._call)  # shape guards of the model's own graph: free at run time
            mask = as_bool_mask(mask, self.mask_rule)
        if mask is None or x.dim() - (2 if headed else 1) < 2:
            return None
        if mask.shape[0] == 1 and x.shape[0] > 1 and self.mask_rule == "megatron":
            mask = mask.expand(x.shape[0], -1)  # Megatron broadcasts one [1, 1, T, T] mask over the batch
        if mask.shape[0] != x.shape[0] or mask.shape[1] < x.shape[1]:
            raise ValueError(f"attention_mask: shape {list(mask.shape)} does not cover the token rows "
                             f"{list(x.shape[:2])} ([B, T]) of the {site or 'probed'} activations")
        mask = as_bool_mask(mask[:, mask.shape[1] - x.shape[1]:])
        return mask if mask.device == x.device else mask.to(x.device, non_blocking=True)


class Hooks:
    """Every hook one probe puts on ``model``: :meth:`install` all of them, :meth:`remove` all.

    Args:
        model: the (eager) model.
        plan: which sites to hook.
        family: module-name patterns of the model family (``None`` for non-HF models, which
            then have only ``plan.modules``).
        capture: called with each site's rows, see ``Capture``.
        slot: makes the handle of one (site, layer), see ``MakeSlot``.
        scope: the model's forward depth and mask.
        wanted: whether a capture made now would go anywhere (``Router.wanted``; default: always).
            Every site callback asks it first and returns at once when not, so a step the
            schedule leaves idle pays torch's hook dispatch and little else: no transposed
            view, no placement lookup, no mask (measured: ~30 of ~160 µs a forward saved on a
            2-layer model on CPU; the rest is the dispatch).
    """

    def __init__(self, model: nn.Module, plan: SitePlan, family: Family | None, capture: Capture,
                 slot: MakeSlot, scope: ForwardScope, wanted: Callable[[], bool] | None = None):
        self.model, self.plan, self.family, self.scope = model, plan, family, scope
        self._capture, self._slot = capture, slot
        self._wanted = wanted
        self._handles: list | None = None
        # the memory plan's layout of the FFN layers (layout.WideSites), set by the probe before
        # the hooks go on: which layers this rank captures, and the rows tensor parallelism gathers
        self.wide = None

    def _gated(self, callback):
        """``callback`` that returns at once (None) while :attr:`_wanted` says no capture is wanted."""
        wanted = self._wanted
        if wanted is None:
            return callback

        def gated(*args, **kwargs):
            if wanted():
                return callback(*args, **kwargs)
            return None
        return gated

    @property
    def installed(self) -> bool:
        return self._handles is not None

    def install(self) -> None:
        """Register every hook (all or none: a failure removes those already registered)."""
        if self._handles is not None:
            return
        handles: list = []
        try:
            self._install_into(handles)
        except BaseException:
            for h in handles:
                h.remove()
            raise
        self._handles = handles

    def check(self) -> None:
        """Raise now (at ``Probe`` construction) if a requested site matches no module of the
        model, with the error :meth:`install` would raise later."""
        if self.plan.keys or self.plan.queries:
            self._attention_modules()
        if self.plan.ffn:
            ffn_modules(self.model, self.family)
        if self.plan.prerope_keys:
            self._prerope_modules()
        for spec in self.plan.modules:
            self._site_modules(spec)

    def remove(self) -> None:
        """Remove every hook (idempotent) and forget any forward in flight."""
        handles, self._handles = self._handles or [], None
        for h in handles:
            h.remove()
        self.scope.reset()

    # ---------------------------------------------------------------- per site
    def _install_into(self, handles: list) -> None:
        model, plan = self.model, self.plan
        for root in roots(model):
            handles.append(root.register_forward_pre_hook(self.scope.start, with_kwargs=True))
            handles.append(root.register_forward_hook(self.scope.end, always_call=True))
        if plan.keys or plan.queries:
            self._install_attention(handles)
        if plan.ffn:
            for _, mod, layer in ffn_modules(model, self.family):
                handles.append(mod.register_forward_pre_hook(self._gated(self._ffn_hook(layer))))
        if plan.prerope_keys:
            self._install_prerope(handles)
        for spec in plan.modules:
            for name, mod in self._site_modules(spec):
                hook = self._gated(self._module_hook(spec, layer_of(name, mod)))
                handles.append(mod.register_forward_hook(hook) if spec.io == "output"
                               else mod.register_forward_pre_hook(hook))

    # the modules of each site (resolved at construction, by check(), and again at install)
    def _site_modules(self, spec: ModuleSite) -> list[tuple[str, nn.Module]]:
        found = [(n, m) for n, m in self.model.named_modules() if fnmatch.fnmatchcase(plain_name(n), spec.pattern)]
        if not found:
            raise ValueError(f"modules: no module name matches {spec.pattern!r} (names as in "
                             f"model.named_modules(), e.g. 'model.layers.*.mlp.act_fn')")
        return found

    @property
    def _attention_inputs(self) -> AttentionInputs | None:
        """Where the family's attention receives q/k (non-HF models); None: the HF interface."""
        return self.family.attention if self.family is not None else None

    def _attention_modules(self) -> dict[nn.Module, int]:
        spec = self._attention_inputs
        if spec is not None:  # a family that names the modules receiving q/k (non-HF models)
            found = {mod: layer for _, mod, layer in matches(self.model, spec.module, self.family.layer_number)
                     if layer is not None}
            if not found:
                raise ValueError(f"keys/queries: no module matches the attention pattern {spec.module!r} "
                                 f"(with a layer index) in this model; check the family "
                                 f"(fastspec.probe.FAMILIES, Probe(family=...)), or pass keys=False")
            return found
        found = {}
        for name, mod in self.model.named_modules():
            if "Attention" not in type(mod).__name__ or getattr(mod, "is_cross_attention", False) \
                    or "Cross" in type(mod).__name__:
                continue
            layer = layer_of(name, mod)
            if layer is not None:
                found[mod] = layer
        if not found:
            # phrased as ffn_modules' error: what was looked for, then the ways out
            model_type = getattr(getattr(self.model, "config", None), "model_type", None)
            raise ValueError(f"keys/queries: found no attention module with a layer index in this model "
                             f"(model_type {model_type!r}; a module whose class name contains 'Attention'); "
                             f"pass keys=False (and queries=False) if it does not call the Hugging Face "
                             f"attention interface, or probe any module by name with modules=[...] (a glob or "
                             f"ModuleSite; fastspec.probe.FAMILIES registers a family's FFN and Q/K-norm modules)")
        return found

    def _prerope_modules(self) -> tuple[list, bool]:
        """The k_norm modules (``True``) if the family has them, else the k_proj ones (``False``)."""
        fam = self.family
        use_norm = fam.k_norm is not None and bool(matches(self.model, fam.k_norm))
        found = matches(self.model, fam.k_norm if use_norm else fam.k_proj)
        if not found:
            raise ValueError("prerope_keys: found no k_norm/k_proj modules in this model")
        return found, use_norm

    def _install_attention(self, handles: list) -> None:
        spec = self._attention_inputs
        callbacks = {mod: self._attention_callback(layer) for mod, layer in self._attention_modules().items()}
        if spec is None:  # the HF interface hands q/k over as [B, H, T, D]
            callbacks = {mod: self._gated(_from_bhtd(cb)) for mod, cb in callbacks.items()}
            handles.append(hf_attention.watch(callbacks, getattr(self.model.config, "_attn_implementation", None)))
            return
        for mod, callback in callbacks.items():
            handles.append(mod.register_forward_pre_hook(self._gated(self._inputs_hook(spec, callback))))

    @staticmethod
    def _inputs_hook(spec: AttentionInputs, callback):
        """A forward pre-hook handing the module's ``(query, key)`` inputs to ``callback`` as rows
        ``[B, T, H, D]``: as they are (``"BTHD"``, no op at all, which matters for a DTensor) or
        transposed views (``"BHTD"``)."""
        query_pos, key_pos = spec.query, spec.key
        if spec.layout == "BHTD":
            callback = _from_bhtd(callback)
        elif spec.layout == "TBHD":
            callback = _from_tbhd(callback)

        def hook(module, args):
            key = at_position(args, key_pos)
            query = at_position(args, query_pos) if query_pos is not None else None
            if isinstance(key, Tensor):
                callback(module, query if isinstance(query, Tensor) else None, key)
        return hook

    def _attention_callback(self, layer: int):
        plan, capture = self.plan, self._capture
        keys, queries = self._slot("keys", layer), self._slot("queries", layer)

        def rows(x: Tensor) -> tuple[Tensor, int]:
            """Rows ``x: [B, T, H, D]`` of this rank's heads, and the global index of its first head:
            from a DTensor's placement (TorchTitan's tensor parallelism), else ``tp_rank × H``."""
            x, offset = local_part(x, 2, "keys/queries")
            return x, plan.tp_rank * x.shape[2] if offset is None else offset

        def callback(module, query: Tensor | None, key: Tensor) -> None:
            """``query`` (or None) and ``key`` as rows ``[B, T, H, D]``."""
            if key.dim() != 4 or (query is not None and query.dim() != 4):
                return
            tq = key.shape[1] if query is None else query.shape[1]
            if plan.keys:
                k = key[:, key.shape[1] - tq:] if key.shape[1] > tq else key  # new tokens only (KV cache)
                k, offset = rows(k)
                capture(keys, k, headed=True, convention=plan.key_convention, head_offset=offset)
            if plan.queries and query is not None:
                q, offset = rows(query)
                capture(queries, q, headed=True, convention=plan.key_convention, head_offset=offset)
        return callback

    def _install_prerope(self, handles: list) -> None:
        plan, capture = self.plan, self._capture
        found, use_norm = self._prerope_modules()
        mods = dict(self.model.named_modules())
        for name, mod, layer in found:
            head_dim = getattr(mods.get(name.rsplit(".", 1)[0]), "head_dim", None)
            if not use_norm and not isinstance(head_dim, int):
                raise ValueError(f"prerope_keys: cannot tell the head width of {name}")

            def hook(module, args, output, slot=self._slot("keys_prerope", layer), head_dim=head_dim,
                     use_norm=use_norm):
                k = output if use_norm else output.unflatten(-1, (-1, head_dim))  # [B, T, H, d_head]
                capture(slot, k, headed=True, convention=plan.key_convention,
                        head_offset=plan.tp_rank * k.shape[-2])
            handles.append(mod.register_forward_hook(self._gated(hook)))

    def _ffn_hook(self, layer: int | None):
        plan, capture, slot, scope = self.plan, self._capture, self._slot("ffn", layer), self.scope
        seq_first = self.family.seq_first
        wide = self.wide if self.wide is not None and self.wide.managed else None

        def hook(module, args):
            x = first_tensor(args)
            if x is None or not x.is_floating_point():
                return
            dst = None
            if wide is not None:  # the memory plan: this rank's layers, their turn, the tensor-parallel gather
                if torch.compiler.is_compiling() and (wide.rotating or wide.split):
                    raise RuntimeError(
                        "ffn: under torch.compile the FFN layers cannot take turns (rotation) nor have their "
                        "rows gathered over tensor-parallel ranks; give the probe more memory (Probe(memory=)), "
                        "compile without the FFN site (ffn=False), or run eagerly (docs/scale.md)")
                if wide.split:
                    dst = wide.holder(layer)
                    if dst is None:
                        return
                    x = x.to_local() if hasattr(x, "to_local") else x  # this rank's columns
                elif not wide.captures(layer):
                    return
            if dst is None:
                x, _ = local_part(x, None, "ffn")
            if seq_first and x.dim() == 3:  # [T, B, d_ff] (Megatron) as a [B, T, d_ff] view
                x = x.transpose(0, 1)
            x = scope.token_rows(x)
            if dst is None:
                capture(slot, x, headed=False, convention=plan.ffn_convention, stream_row_step=plan.ffn_row_step)
            elif x.dim() == 3:
                capture(slot, x, headed=False, convention=plan.ffn_convention, stream_row_step=plan.ffn_row_step,
                        gather=dst)
            else:
                raise ValueError(f"ffn: the tensor-parallel FFN input of layer {layer} has shape {list(x.shape)}; "
                                 f"the gather takes [B, T, d_ff/tp] (or [T, B, d_ff/tp] tokens first)")
        return hook

    def _module_hook(self, spec: ModuleSite, layer: int | None):
        plan, capture, slot = self.plan, self._capture, self._slot(spec.site, layer)

        def hook(module, args, output=None):
            x = first_tensor(output if spec.io == "output" else args)
            if x is None or not x.is_floating_point() or x.dim() < 2:
                return
            x, _ = local_part(x, None, f"modules: {spec.pattern!r}")
            if spec.heads is not None:
                if x.shape[-1] % spec.heads:
                    raise ValueError(f"modules: {spec.pattern!r} width {x.shape[-1]} is not divisible "
                                     f"by heads={spec.heads}")
                x = x.unflatten(-1, (spec.heads, -1))
            capture(slot, x, headed=spec.heads is not None, convention=spec.convention,
                    head_offset=plan.tp_rank * (spec.heads or 0))
        return hook
