"""What the Lightning and HF callbacks share: building the probe, moving the batch, the schedule,
checking ``alerts`` (and the streaming callbacks' ``probe``/``probe_kwargs``), one scheduled
measurement."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .. import _args


def check_every(every_n_steps) -> int:
    return _args.integer("every_n_steps", every_n_steps, minimum=1)


def check_alerts(alerts):
    """``alerts`` (a ``RankCollapseAlert`` or None), checked."""
    from .alerts import RankCollapseAlert

    if alerts is not None and not isinstance(alerts, RankCollapseAlert):
        raise TypeError(f"alerts: expected a fastspec.integrations.alerts.RankCollapseAlert or None, "
                        f"got {type(alerts).__name__}")
    return alerts


def check_probe(probe, probe_kwargs, factory: str = "model -> Probe") -> None:
    """The streaming callbacks' ``probe`` (a ``Probe``, a factory ``factory``, or None) and
    ``probe_kwargs`` (a dict or None; not with ``probe``), checked."""
    from ..probe import Probe

    if probe_kwargs is not None and not isinstance(probe_kwargs, dict):
        raise _args.ArgumentTypeError(f"probe_kwargs: expected a dict of fastspec.Probe arguments or None, "
                                      f"got {type(probe_kwargs).__name__}")
    if not (probe is None or isinstance(probe, Probe) or callable(probe)):
        raise _args.ArgumentTypeError(f"probe: expected a fastspec.Probe, a factory {factory}, or None, "
                                      f"got {type(probe).__name__}")
    if probe is not None and probe_kwargs is not None:
        raise ValueError("probe_kwargs: given together with probe=; pass one of them")


def to_device(batch, device: torch.device):
    """The fixed eval batch (a tensor or a dict of model kwargs) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    raise TypeError(f"batch: expected a tensor or a dict of model kwargs, got {type(batch).__name__}")


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def make_probe(probe, model: torch.nn.Module, probe_kwargs: dict | None):
    """``probe`` as given, built by ``probe(model)`` if it is a factory, or ``Probe(model, **probe_kwargs)``."""
    from ..probe import Probe

    if probe is None:
        return Probe(model, **(probe_kwargs or {}))
    if isinstance(probe, Probe):
        return probe
    if isinstance(probe, Callable):
        return probe(model)
    raise TypeError(f"probe: expected a fastspec.Probe, a factory model -> Probe, or None, got {type(probe).__name__}")


def measure(cb, model: torch.nn.Module, step: int) -> tuple[list, dict[str, float], list | None]:
    """One scheduled measurement of callback ``cb`` (its ``probe``, ``batch``, ``tokens_per_step``,
    ``prefix``, ``alerts`` and ``records``): the new records (also appended to ``cb.records``), their
    :func:`~fastspec.integrations.scalars` and the alerts they raise (None without ``alerts``), whose
    number is the scalar ``{prefix}/alerts``. The alerts are not notified yet: the caller logs first,
    so that ``action="raise"`` never loses the measurement."""
    from . import scalars

    tokens = None if cb.tokens_per_step is None else step * cb.tokens_per_step
    new = cb.probe.measure(to_device(cb.batch, model_device(model)), step=step, tokens_seen=tokens)
    cb.records.extend(new)
    values = scalars(new, cb.prefix)
    fired = None if cb.alerts is None else cb.alerts.check(new, notify=False)
    if fired is not None:
        values[f"{cb.prefix}/alerts"] = float(len(fired))
    return new, values, fired
