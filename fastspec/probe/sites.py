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
    ``settings``: the probe's precision and backend, handed to the accumulator as they are (the
    ``"inplace"`` backend for an FFN site under a memory plan); ``totals``: the dtype of its
    ``D × D`` totals (float32 where the plan chose them)."""

    def __init__(self, dim: tuple[int, ...], convention: str, headed: bool, head_offset: int,
                 settings: UpdateSettings, totals: torch.dtype = torch.float64):
        self.convention, self.headed, self.head_offset = convention, headed, head_offset
        self.cov = Covariance(dim, track_mean=(convention == "eig"), settings=settings, totals=totals)

    def state_dict(self) -> dict:
        sd = self.cov.state_dict()
        state = None if sd["state"] is None else {k: v.detach().clone() for k, v in sd["state"].items()}
        return {"dim": sd["dim"], "convention": self.convention, "headed": self.headed,
                "head_offset": self.head_offset, "state": state}

    @classmethod
    def from_state_dict(cls, sd: dict, settings: UpdateSettings, totals: torch.dtype | None = None) -> SiteCovariance:
        """The accumulator of a :meth:`state_dict` entry; its totals in ``totals`` (default: the
        dtype they were saved in)."""
        if totals is None:
            second = None if sd["state"] is None else sd["state"].get("m2", sd["state"].get("gram"))
            totals = torch.float64 if second is None else second.dtype
        acc = cls(tuple(sd["dim"]), sd["convention"], sd["headed"], sd["head_offset"], settings, totals)
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

    def __init__(self, settings: UpdateSettings, timer=None, wide=None, meter=None):
        self.settings = settings
        self.accs: dict[SiteKey, SiteCovariance] = {}
        # a measurement's own WorkTimer (Probe.measurement(timed=True)): its captures' work time
        self.timer = timer
        # the memory plan (layout.WideSites: how the FFN sites are kept) and the probe's meter
        self.wide, self.meter = wide, meter
        self.refused: set[SiteKey] = set()  # sites the budget could not admit (warned once each)
        if meter is not None:
            meter.watch(self)

    def _settings_of(self, site: str) -> tuple[UpdateSettings, torch.dtype]:
        """Update settings and totals dtype of ``site``'s accumulators: the plan's for FFN sites
        under one (the in-place update, its totals), the probe's otherwise."""
        wide = self.wide
        if site == "ffn" and wide is not None and wide.managed:
            totals = torch.float32 if wide.layout.totals == "float32" else torch.float64
            return UpdateSettings(self.settings.precision, "inplace"), totals
        return self.settings, torch.float64

    def ensure(self, site: str, layer: int | None, dim: tuple[int, ...], convention: str, headed: bool,
               head_offset: int, device: torch.device | None = None) -> SiteCovariance | None:
        """The :class:`SiteCovariance` of ``(site, layer)``, created if new (raises if an existing
        one has another shape); with ``device``, its state is allocated there if it is not yet.
        None: a site the memory plan did not know, refused because the budget cannot hold it."""
        acc = self.accs.get((site, layer))
        if acc is None:
            if (site, layer) in self.refused or not self._admit(site, layer, dim):
                return None
            settings, totals = self._settings_of(site)
            acc = self.accs[(site, layer)] = SiteCovariance(dim, convention, headed, head_offset, settings, totals)
        elif (*acc.cov.sites, acc.cov.D) != tuple(dim):
            raise ValueError(f"{site} layer {layer}: activation shape {list(dim)} (trailing) does not match "
                             f"the accumulator's {(*acc.cov.sites, acc.cov.D)}")
        if device is not None and acc.cov.device is None:
            acc.cov.allocate(device)
            self.allocated()
        elif device is not None:
            acc.cov.allocate(device)
        return acc

    def _admit(self, site: str, layer: int | None, dim: tuple[int, ...]) -> bool:
        """Whether the budget holds a new accumulator of a site the plan did not count (the meter
        decides); a refused one is warned about once and never captured."""
        meter = self.meter
        if meter is None or meter.planned(site):
            return True
        from .plan import human, state_bytes

        S, D = (dim[0], dim[1]) if len(dim) == 2 else (1, dim[0])
        need = state_bytes(S, D)
        if meter.admits(need):
            return True
        self.refused.add((site, layer))
        import warnings

        warnings.warn(f"fastspec.Probe: site {site!r} layer {layer} is not measured: its accumulator "
                      f"({human(need)}) would take the probe past its memory budget ({human(meter.budget)}); "
                      f"raise Probe(memory=...) or probe fewer sites", stacklevel=6)
        return False

    def allocated(self) -> None:
        """An accumulator's state was just allocated: the meter sees the bytes held now."""
        if self.meter is not None:
            self.meter.note("capture")

    def update(self, site: str, layer: int | None, x: Tensor, mask: Tensor | None, *,
               headed: bool, convention: str, head_offset: int = 0, row_step: int = 1) -> None:
        """Merge rows ``x: [*rows, H, D]`` (headed) or ``[*rows, D]``; ``mask: [*rows]`` or None."""
        acc = self.ensure(site, layer, site_dim(x, headed), convention, headed, head_offset)
        if acc is None or x.numel() == 0:  # refused by the budget, or a batch with no tokens
            return
        fresh = acc.cov.device is None or acc.cov._state is None
        acc.cov.update(x, mask, row_step=row_step)
        if fresh:
            self.allocated()

    @property
    def nbytes(self) -> int:
        """Bytes of every accumulator's state (what :meth:`fastspec.Probe.memory` counts)."""
        return sum(acc.cov.nbytes for acc in self.accs.values())

    def load(self, entries: list[dict]) -> None:
        """Replace the accumulators with :meth:`SiteCovariance.state_dict` entries (plus site/layer)."""
        accs = {}
        for e in entries:
            settings, totals = self._settings_of(e["site"])
            accs[(e["site"], e["layer"])] = SiteCovariance.from_state_dict(e, settings, totals)
        self.accs = accs
        if self.meter is not None:
            self.meter.note("capture")

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
