"""What a probe measures: the sites a user can choose, and one :class:`~fastspec.Covariance`
per (site, layer) that captures are merged into.

Attention sites hold ``Covariance((H, d_head))`` (all heads of a layer batched in one update);
FFN and module sites ``Covariance(F)`` or ``Covariance((H, F/H))``. Memory is O(sites·D²) and
independent of batch size and sequence length (docs/accumulators.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _args
from ..covariance import CONVENTIONS, Covariance
from ..covariance.policy import UpdateSettings


@dataclass(frozen=True)
class ModuleSite:
    """A user-chosen site: every module whose name matches ``pattern`` (``fnmatch`` glob).

    Args:
        pattern: e.g. ``"model.layers.*.mlp.act_fn"``.
        io: ``"output"`` (first tensor of the output) or ``"input"`` (first positional input).
        heads: split the last axis ``F`` into ``[heads, F/heads]`` (one site per head).
        convention: ``"eig"`` (centered covariance) or ``"sv"`` (raw singular values);
            see docs/conventions.md.
        label: ``Record.site`` of its records; default: the pattern.
    """

    pattern: str
    io: str = "output"
    heads: int | None = None
    convention: str = "eig"
    label: str | None = None

    def __post_init__(self):
        # "modules: ..." names the Probe argument these come through
        _args.text("modules: pattern", self.pattern)
        _args.choice("modules: io", self.io, ("output", "input"))
        # a NumPy int is stored as an int: heads is used in shapes
        object.__setattr__(self, "heads", _args.integer("modules: heads", self.heads, minimum=1, optional=True))
        _args.choice("modules: convention", self.convention, CONVENTIONS)
        _args.text("modules: label", self.label, optional=True)

    @property
    def site(self) -> str:
        return self.label or self.pattern


class SiteCovariance:
    """The :class:`~fastspec.Covariance` of one (site, layer), with how its records are labelled:
    its spectrum convention and, for per-head sites, the global index of its first head.
    ``settings``: the probe's precision and backend, handed to the accumulator as they are."""

    def __init__(self, dim: tuple[int, ...], convention: str, headed: bool, head_offset: int,
                 settings: UpdateSettings):
        self.convention, self.headed, self.head_offset = convention, headed, head_offset
        self.cov = Covariance(dim, track_mean=(convention == "eig"), settings=settings)

    def state_dict(self) -> dict:
        sd = self.cov.state_dict()
        state = None if sd["state"] is None else {k: v.detach().clone() for k, v in sd["state"].items()}
        return {"dim": sd["dim"], "convention": self.convention, "headed": self.headed,
                "head_offset": self.head_offset, "state": state}

    @classmethod
    def from_state_dict(cls, sd: dict, settings: UpdateSettings) -> SiteCovariance:
        acc = cls(tuple(sd["dim"]), sd["convention"], sd["headed"], sd["head_offset"], settings)
        acc.cov.load_state_dict({"dim": tuple(sd["dim"]), "track_mean": sd["convention"] == "eig",
                                 "state": sd["state"]})
        return acc


SiteKey = tuple[str, "int | None"]


def site_dim(x: Tensor, headed: bool) -> tuple[int, ...]:
    """The accumulator shape of one site's rows ``x``: ``(H, D)`` (headed) or ``(D,)``."""
    return tuple(x.shape[-2:]) if headed else (x.shape[-1],)


class Collector:
    """The :class:`SiteCovariance` of every (site, layer) one schedule writes into: the running
    streaming totals, or the tokens of one eval measurement.

    ``settings`` (precision and backend, checked once by the probe) go to every
    :class:`~fastspec.Covariance`; what they mean and the accuracy of each choice is
    ``fastspec.covariance.policy``'s to say (by default ``sv`` sites, i.e. keys, get float64
    products and ``eig`` sites float32 ones).
    """

    def __init__(self, settings: UpdateSettings, timer=None):
        self.settings = settings
        self.accs: dict[SiteKey, SiteCovariance] = {}
        # a measurement's own WorkTimer (Probe.measurement(timed=True)): its captures' work time
        self.timer = timer

    def ensure(self, site: str, layer: int | None, dim: tuple[int, ...], convention: str, headed: bool,
               head_offset: int, device: torch.device | None = None) -> SiteCovariance:
        """The :class:`SiteCovariance` of ``(site, layer)``, created if new (raises if an existing
        one has another shape); with ``device``, its state is allocated there if it is not yet."""
        acc = self.accs.get((site, layer))
        if acc is None:
            acc = self.accs[(site, layer)] = SiteCovariance(dim, convention, headed, head_offset, self.settings)
        elif (*acc.cov.sites, acc.cov.D) != tuple(dim):
            raise ValueError(f"{site} layer {layer}: activation shape {list(dim)} (trailing) does not match "
                             f"the accumulator's {(*acc.cov.sites, acc.cov.D)}")
        if device is not None:
            acc.cov.allocate(device)
        return acc

    def update(self, site: str, layer: int | None, x: Tensor, mask: Tensor | None, *,
               headed: bool, convention: str, head_offset: int = 0, row_step: int = 1) -> None:
        """Merge rows ``x: [*rows, H, D]`` (headed) or ``[*rows, D]``; ``mask: [*rows]`` or None."""
        acc = self.ensure(site, layer, site_dim(x, headed), convention, headed, head_offset)
        if x.numel() == 0:  # e.g. a batch with no tokens: nothing to merge
            return
        acc.cov.update(x, mask, row_step=row_step)

    def load(self, entries: list[dict]) -> None:
        """Replace the accumulators with :meth:`SiteCovariance.state_dict` entries (plus site/layer)."""
        self.accs = {(e["site"], e["layer"]): SiteCovariance.from_state_dict(e, self.settings) for e in entries}

    def reset(self) -> None:
        for acc in self.accs.values():
            acc.cov.reset()

    @property
    def device(self) -> torch.device | None:
        """Where the state lives (the device of the first capture), or None before any."""
        for acc in self.accs.values():
            if acc.cov.device is not None:
                return acc.cov.device
        return None

    def sorted_items(self) -> list[tuple[SiteKey, SiteCovariance]]:
        # a fixed order on every rank: the all-reduces must line up
        return sorted(self.accs.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))


def module_sites(modules) -> tuple[ModuleSite, ...]:
    """``Probe(modules=...)`` as a tuple of :class:`ModuleSite`: a glob, a ModuleSite, or a list of them."""
    if modules is None:
        return ()
    try:
        items = [modules] if isinstance(modules, (str, ModuleSite)) else list(modules)
    except TypeError:
        raise TypeError(f"modules: expected a glob string, a ModuleSite or a list of them, "
                        f"got {type(modules).__name__}") from None
    out = []
    for m in items:
        if isinstance(m, str):
            m = ModuleSite(m)
        if not isinstance(m, ModuleSite):
            raise TypeError(f"modules: expected glob strings or ModuleSite, got {type(m).__name__}")
        out.append(m)
    return tuple(out)
