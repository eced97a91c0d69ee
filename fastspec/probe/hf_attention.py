"""Intercept post-RoPE ``query_states``/``key_states`` of Hugging Face attention, unchanged.

Every supported family (transformers ≥ 5.1, the floor fastspec requires) computes Q/K-norm and
RoPE in the attention module, then calls an *attention function* ``f(module, query [B, Hq, T, D],
key [B, Hkv, T, D], value, attention_mask, **kw)`` looked up at call time from

* ``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
  (sdpa, flash, flex, ...), or
* the ``eager_attention_forward`` global of the model's modeling module (eager).

:func:`watch` swaps both for a pass-through wrapper that first hands ``(module, query, key)`` to
the callbacks registered for that module object, then calls the original function with the
same arguments. Nothing in the model changes, the attention backend stays what the model chose,
and keys arrive per KV head (GQA: before ``repeat_kv``). The swap is reference-counted across
probes and undone by :meth:`Watch.remove`; modules nobody watches pass straight through.
"""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

from torch import nn

AttnCallback = Callable[[nn.Module, "object", "object"], None]

_LOCK = threading.Lock()
_CALLBACKS: dict[int, list[AttnCallback]] = {}  # id(module) -> callbacks
_PATCHES: dict[tuple[int, str], list] = {}      # (id(container), name) -> [container, original, had_local, refs]


def _make_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def attention_with_probe(module, query, key, *args, **kwargs):
        for cb in _CALLBACKS.get(id(module), ()):
            cb(module, query, key)
        return original(module, query, key, *args, **kwargs)

    attention_with_probe.__fastspec_original__ = original
    return attention_with_probe


def _patch_targets(attn_modules: list[nn.Module], impl: str | None) -> list[tuple[object, str]]:
    """(container, name) pairs holding the attention function these modules will call."""
    targets: list[tuple[object, str]] = []
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers is optional
        ALL_ATTENTION_FUNCTIONS = None
    if ALL_ATTENTION_FUNCTIONS is not None and impl is not None and impl in ALL_ATTENTION_FUNCTIONS:
        targets.append((ALL_ATTENTION_FUNCTIONS, impl))
    for mod_name in sorted({type(m).__module__ for m in attn_modules}):
        module_globals = sys.modules.get(mod_name)
        if module_globals is not None and hasattr(module_globals, "eager_attention_forward"):
            targets.append((module_globals, "eager_attention_forward"))
    return targets


def _install(container, name: str) -> None:
    key = (id(container), name)
    entry = _PATCHES.get(key)
    if entry is not None:
        entry[3] += 1
        return
    if isinstance(container, type(sys)):  # a modeling module's eager function
        original = getattr(container, name)
        setattr(container, name, _make_wrapper(original))
        had_local = None
    else:  # the attention-function mapping (a dict in 4.48, an AttentionInterface later)
        local = getattr(container, "_local_mapping", None)
        had_local = local is not None and name in local
        original = container[name]
        container[name] = _make_wrapper(original)
    _PATCHES[key] = [container, original, had_local, 1]


def _uninstall(container, name: str) -> None:
    key = (id(container), name)
    entry = _PATCHES[key]
    entry[3] -= 1
    if entry[3] > 0:
        return
    del _PATCHES[key]
    _, original, had_local, _ = entry
    if isinstance(container, type(sys)):
        setattr(container, name, original)
    elif hasattr(container, "_local_mapping") and not had_local:
        del container[name]  # drop our local override; the global entry shows through again
    else:
        container[name] = original


class Watch:
    """Handle returned by :func:`watch`; :meth:`remove` undoes it (idempotent)."""

    def __init__(self, pairs: list[tuple[int, AttnCallback]], targets: list[tuple[object, str]]):
        self._pairs, self._targets = pairs, targets

    def remove(self) -> None:
        with _LOCK:
            for mid, cb in self._pairs:
                cbs = _CALLBACKS.get(mid, [])
                if cb in cbs:
                    cbs.remove(cb)
                if not cbs:
                    _CALLBACKS.pop(mid, None)
            for container, name in self._targets:
                _uninstall(container, name)
            self._pairs, self._targets = [], []


def watch(callbacks: dict[nn.Module, AttnCallback], impl: str | None) -> Watch:
    """Call ``callbacks[module](module, query, key)`` whenever ``module`` runs attention.

    ``impl`` is the model's ``config._attn_implementation``. Returns a :class:`Watch`.
    """
    with _LOCK:
        targets = _patch_targets(list(callbacks), impl)
        for container, name in targets:
            _install(container, name)
        pairs = []
        for module, cb in callbacks.items():
            _CALLBACKS.setdefault(id(module), []).append(cb)
            pairs.append((id(module), cb))
    return Watch(pairs, targets)
