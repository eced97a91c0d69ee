"""Accumulators of one probe: one :class:`~fastspec.Covariance` per (site, layer).

Attention sites hold ``Covariance((H, d_head))`` (all heads of a layer batched in one update);
FFN and module sites ``Covariance(F)`` or ``Covariance((H, F/H))``. Memory is O(sites·D²) and
independent of batch size and sequence length (SPEC §1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from ..covariance import Covariance

CONVENTIONS = ("eig", "sv")

# layer index from a module name: the number after a layer-stack container, else the first number
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_ANY_INDEX_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(name: str, module=None) -> int | None:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    m = _LAYER_RE.search(name) or _ANY_INDEX_RE.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ModuleSite:
    """A user-chosen site: every module whose name matches ``pattern`` (``fnmatch`` glob).

    Args:
        pattern: e.g. ``"model.layers.*.mlp.act_fn"``.
        io: ``"output"`` (first tensor of the output) or ``"input"`` (first positional input).
        heads: split the last axis ``F`` into ``[heads, F/heads]`` (one site per head).
        convention: ``"eig"`` (centered covariance) or ``"sv"`` (raw singular values), SPEC §2.
        label: ``Record.site`` of its records; default: the pattern.
    """

    pattern: str
    io: str = "output"
    heads: int | None = None
    convention: str = "eig"
    label: str | None = None

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"modules: pattern must be a non-empty string, got {self.pattern!r}")
        if self.io not in ("output", "input"):
            raise ValueError(f"modules: io must be 'output' or 'input', got {self.io!r}")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ValueError(f"modules: heads must be a positive int or None, got {self.heads!r}")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"modules: convention must be one of {CONVENTIONS}, got {self.convention!r}")

    @property
    def site(self) -> str:
        return self.label or self.pattern


class Accumulator:
    """One site group: ``Covariance`` + how to turn it into records."""

    def __init__(self, dim: tuple[int, ...], convention: str, headed: bool, head_offset: int,
                 backend: str, precision: str = "auto"):
        self.convention, self.headed, self.head_offset = convention, headed, head_offset
        self.cov = Covariance(dim, track_mean=(convention == "eig"), backend=backend, precision=precision)

    def state_dict(self) -> dict:
        sd = self.cov.state_dict()
        state = None if sd["state"] is None else {k: v.detach().clone() for k, v in sd["state"].items()}
        return {"dim": sd["dim"], "convention": self.convention, "headed": self.headed,
                "head_offset": self.head_offset, "state": state}

    @classmethod
    def from_state_dict(cls, sd: dict, backend: str, precision: str = "auto") -> Accumulator:
        acc = cls(tuple(sd["dim"]), sd["convention"], sd["headed"], sd["head_offset"], backend, precision)
        acc.cov.load_state_dict({"dim": tuple(sd["dim"]), "track_mean": sd["convention"] == "eig",
                                 "state": sd["state"]})
        return acc


SiteKey = tuple[str, "int | None"]


class Collector:
    """The accumulators one schedule writes into (streaming totals, or one eval measurement).

    ``backend`` and ``precision`` go to every :class:`~fastspec.Covariance`; what they mean and
    the accuracy of each choice is ``fastspec.covariance.policy``'s to say (by default ``sv``
    sites, i.e. keys, get float64 products and ``eig`` sites float32 ones).
    """

    def __init__(self, backend: str, precision: str = "auto"):
        self.backend, self.precision = backend, precision
        self.accs: dict[SiteKey, Accumulator] = {}

    def update(self, site: str, layer: int | None, x: Tensor, mask: Tensor | None, *,
               headed: bool, convention: str, head_offset: int = 0, row_step: int = 1) -> None:
        """Merge rows ``x: [*rows, H, D]`` (headed) or ``[*rows, D]``; ``mask: [*rows]`` or None."""
        dim = tuple(x.shape[-2:]) if headed else (x.shape[-1],)
        acc = self.accs.get((site, layer))
        if acc is None:
            acc = self.accs[(site, layer)] = Accumulator(dim, convention, headed, head_offset,
                                                         self.backend, self.precision)
        elif (*acc.cov.sites, acc.cov.D) != dim:
            raise ValueError(f"{site} layer {layer}: activation shape {list(x.shape)} does not match "
                             f"the accumulator's {(*acc.cov.sites, acc.cov.D)}")
        if x.numel() == 0:  # e.g. a batch with no tokens: nothing to merge
            return
        acc.cov.update(x, mask, row_step=row_step)

    def load(self, entries: list[dict]) -> None:
        """Replace the accumulators with :meth:`Accumulator.state_dict` entries (plus site/layer)."""
        self.accs = {(e["site"], e["layer"]): Accumulator.from_state_dict(e, self.backend, self.precision)
                     for e in entries}

    def reset(self) -> None:
        for acc in self.accs.values():
            acc.cov.reset()

    def sorted_items(self) -> list[tuple[SiteKey, Accumulator]]:
        # a fixed order on every rank: the all-reduces must line up
        return sorted(self.accs.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))


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


def as_bool_mask(mask) -> Tensor | None:
    """A 2-D ``[B, T]`` keep-mask from an HF ``attention_mask`` (1 = real token), else None."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        return None
    return mask if mask.dtype == torch.bool else mask != 0
