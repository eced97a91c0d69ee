"""Rank-collapse alerts: warn when a layer's key rank falls below a threshold, drops sharply
between emissions, or stops being a number (docs/alerts.md).

:class:`RankCollapseAlert` keeps, per ``(protocol, layer)``, the reference value of one
``(site, metric)`` and which alerts are raised; :meth:`RankCollapseAlert.check` takes the
records of one emission and returns :class:`Alert` objects. Plain loop::

    alert = RankCollapseAlert(threshold=8.0, drop=0.2)       # PR < 8, or a fall of 20% or more
    alerts = alert.check(probe.measure(eval_batch, step=step))   # eval protocol, every N steps
    alerts = alert.check(probe.step(step))                        # or streaming, every step

Lightning: ``FastspecCallback(batch, alerts=RankCollapseAlert(...))``; HF ``Trainer``:
``FastspecTrainerCallback(batch, alerts=RankCollapseAlert(...))``.
"""
from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .. import _args
from ._records import as_dicts

__all__ = ["Alert", "RankCollapseAlert", "RankCollapseError", "RankCollapseWarning"]

KINDS = ("nan", "below_threshold", "drop")
REFERENCES = ("previous", "best", "first")
REFERENCE_WORDS = {"previous": "previous emission", "best": "best so far", "first": "first emission"}
ACTIONS = ("warn", "log", "raise")
log = logging.getLogger("fastspec")


class RankCollapseWarning(UserWarning):
    """Category of the warnings of ``action="warn"`` (filter it with ``warnings.filterwarnings``)."""


class RankCollapseError(RuntimeError):
    """Raised by ``action="raise"``; ``.alerts`` holds every alert of that emission."""

    def __init__(self, alerts: list[Alert]):
        super().__init__("\n".join(a.message for a in alerts))
        self.alerts = alerts


@dataclass(frozen=True)
class Alert:
    """One alert: the layer mean of ``(site, metric)`` at ``step`` broke a rule.

    ``kind``: ``"below_threshold"`` (``value < threshold``), ``"drop"``
    (``value < (1 − drop)·reference``, ``reference`` the previous, best or first value of that
    layer) or ``"nan"`` (``value`` NaN or infinite: a diverged run, or activations that were all
    NaN/Inf and rejected). ``threshold`` / ``reference`` are None for the kinds that do not use them.
    """

    step: int
    site: str
    layer: int | None
    metric: str
    value: float
    kind: str
    protocol: str | None
    threshold: float | None
    reference: float | None
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


class RankCollapseAlert:
    """Rank-collapse rule for one ``(site, metric)``, checked emission by emission.

    Per emission (one step of one protocol) the per-head records are averaged per layer,
    ``v_l = mean_h value[l, h]`` (as :func:`fastspec.integrations.scalars` does), and each layer is
    compared with its own remembered state, kept per ``(protocol, layer)``: eval and streaming
    records measure different tokens and are never compared with each other. Layer ``l`` alerts
    when

    * ``v_l`` is NaN or infinite (kind ``"nan"``; the reference keeps its last finite value);
    * ``v_l < threshold`` (kind ``"below_threshold"``);
    * ``v_l < (1 − drop) · ref_l`` (kind ``"drop"``), ``ref_l`` being ``v_l`` of the previous
      emission (``reference="previous"``), the largest so far (``"best"``) or the first
      (``"first"``). The first emission of a layer only sets ``ref_l``.

    An alert fires when its condition starts to hold and is re-armed once the condition stops
    holding (the layer recovered), so a layer that stays collapsed alerts once, not at every
    emission; ``repeat=True`` alerts at every emission where the condition holds.

    Args:
        site, metric: which records to watch (default: the key PR of the key-rank protocol).
            The rules suit metrics where low means collapse (ranks, ``effective_dim``, ``sui``).
        threshold: absolute floor in the metric's units (e.g. ``8.0`` for PR of ``d_head = 128``
            keys). For a fraction of the ceiling ``D``, watch ``metric="hard_rank_normalized"``,
            ``(PR − 1)/(D − 1)`` in [0, 1], with ``threshold`` in (0, 1). None: no floor.
        drop: relative fall in (0, 1) that alerts (``0.2``: a fall of more than 20%). None: none.
            With neither ``threshold`` nor ``drop`` only non-finite values alert.
        reference: what ``drop`` compares with: ``"previous"``, ``"best"`` or ``"first"``.
        action: what :meth:`check` does with each emission's alerts: ``"warn"``
            (:class:`RankCollapseWarning`), ``"log"`` (WARNING on the ``logging`` logger
            ``"fastspec"``), ``"raise"`` (:class:`RankCollapseError` after the state is updated),
            a callable ``alert -> None``, or None (only return them).
        repeat: alert at every emission while a condition holds, not only when it starts to.

    Every alert returned so far is kept in ``fired``. :meth:`state_dict` /
    :meth:`load_state_dict` carry the references and the raised alerts into a resumed run.
    """

    def __init__(self, *, site: str = "keys", metric: str = "participation_ratio", threshold: float | None = None,
                 drop: float | None = None, reference: str = "previous", action: str | Callable | None = "warn",
                 repeat: bool = False):
        self.site, self.metric = _args.text("site", site), _args.text("metric", metric)
        self.threshold = _args.real("threshold", threshold, "a finite number or None", optional=True)
        self.drop = _args.real("drop", drop, "a fraction in (0, 1) or None", lambda d: 0 < d < 1, optional=True)
        self.reference = _args.choice("reference", reference, REFERENCES)
        if not (action is None or action in ACTIONS or callable(action)):
            raise ValueError(f"action: expected one of {ACTIONS}, a callable or None, got {action!r}")
        self.action, self.repeat = action, _args.flag("repeat", repeat)
        # (protocol, layer) -> reference value (None until a finite one) and the kinds raised now
        self._ref: dict[tuple[str | None, int | None], float | None] = {}
        self._active: dict[tuple[str | None, int | None], set[str]] = defaultdict(set)
        self.fired: list[Alert] = []

    def check(self, records, *, notify: bool = True) -> list[Alert]:
        """Compare the records of one emission (``Record``s or dicts) with the remembered state,
        update it, and return the new alerts, ordered by step, protocol, layer. Records of several
        steps are taken step by step in order; other sites and metrics are ignored.
        ``notify=False`` skips ``action`` (call :meth:`notify` later)."""
        groups: dict[tuple[int, str | None, int | None], list[float]] = defaultdict(list)
        for r in as_dicts(records):
            if r["site"] == self.site and r["metric"] == self.metric:
                layer = None if r["layer"] is None else int(r["layer"])
                groups[(int(r["step"]), r["protocol"], layer)].append(float(r["value"]))
        out: list[Alert] = []
        order = sorted(groups, key=lambda k: (k[0], str(k[1]), -1 if k[2] is None else k[2]))
        for step, protocol, layer in order:
            vals = groups[(step, protocol, layer)]
            out += self._update(step, protocol, layer, math.fsum(vals) / len(vals))
        self.fired += out
        if notify:
            self.notify(out)
        return out

    def _update(self, step: int, protocol: str | None, layer: int | None, v: float) -> list[Alert]:
        key = (protocol, layer)
        ref = self._ref.get(key)
        if not math.isfinite(v):
            holds = {"nan": (None, None)}
        else:
            holds = {}
            if self.threshold is not None and v < self.threshold:
                holds["below_threshold"] = (self.threshold, None)
            if self.drop is not None and ref is not None and v < (1.0 - self.drop) * ref:
                holds["drop"] = (None, ref)
            if ref is None or self.reference == "previous" or (self.reference == "best" and v > ref):
                self._ref[key] = v
        active = self._active[key]
        if "nan" not in holds:  # a NaN says nothing about the floor or the drop: those keep their state
            active.intersection_update(holds)
        alerts = [self._alert(step, protocol, layer, v, kind, *holds[kind])
                  for kind in KINDS if kind in holds and (self.repeat or kind not in active)]
        active.update(holds)
        return alerts

    def _alert(self, step, protocol, layer, v, kind, threshold, reference) -> Alert:
        where = (f"{self.site}/{self.metric} of layer {layer}" if layer is not None
                 else f"{self.site}/{self.metric}") + (f" ({protocol})" if protocol else "")
        if kind == "nan":
            what = f"is {v} (a diverged run, or activations rejected as NaN/Inf)"
        elif kind == "below_threshold":
            what = f"is {v:.4g}, below the threshold {threshold:.4g}"
        else:
            what = (f"fell {1.0 - v / reference:.0%} from {reference:.4g} ({REFERENCE_WORDS[self.reference]}) to {v:.4g}, "
                    f"more than the drop limit {self.drop:.0%}")
        return Alert(step, self.site, layer, self.metric, v, kind, protocol, threshold, reference,
                     f"fastspec rank collapse at step {step}: {where} {what}")

    def notify(self, alerts: list[Alert]) -> None:
        """Carry out ``action`` for ``alerts`` (nothing when there are none)."""
        if not alerts or self.action is None:
            return
        if self.action == "raise":
            raise RankCollapseError(alerts)
        for a in alerts:
            if self.action == "warn":
                warnings.warn(a.message, RankCollapseWarning, stacklevel=3)
            elif self.action == "log":
                log.warning(a.message)
            else:
                self.action(a)

    # --------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Per ``(protocol, layer)``: the reference value and the alerts raised now (plain types)."""
        keys = sorted(set(self._ref) | set(self._active), key=lambda k: (str(k[0]), -1 if k[1] is None else k[1]))
        return {"version": 1, "site": self.site, "metric": self.metric, "reference": self.reference,
                "layers": [{"protocol": p, "layer": l, "reference": self._ref.get((p, l)),
                            "active": sorted(self._active.get((p, l), ()))} for p, l in keys]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (replacing the current state) from an alert on the same
        ``site``, ``metric`` and ``reference``."""
        if not isinstance(sd, dict) or sd.get("version") != 1:
            raise ValueError("state_dict: not a RankCollapseAlert state_dict (version 1)")
        theirs, ours = (sd["site"], sd["metric"], sd["reference"]), (self.site, self.metric, self.reference)
        if theirs != ours:
            raise ValueError(f"state_dict: saved for (site, metric, reference) = {theirs}, this alert watches {ours}")
        self._ref = {(e["protocol"], e["layer"]): e["reference"] for e in sd["layers"]}
        self._active = defaultdict(set, {(e["protocol"], e["layer"]): set(e["active"]) for e in sd["layers"]})

    def __repr__(self) -> str:
        return (f"RankCollapseAlert(site={self.site!r}, metric={self.metric!r}, threshold={self.threshold}, "
                f"drop={self.drop}, reference={self.reference!r}, action={self.action!r})")
