"""What the Lightning and HF callbacks share: building the probe, moving the batch, the schedule,
checking ``alerts``."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def check_every(every_n_steps) -> int:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ValueError(f"every_n_steps: expected a positive int, got {every_n_steps!r}")
    return every_n_steps


def check_alerts(alerts):
    """``alerts`` (a ``RankCollapseAlert`` or None), checked."""
    from .alerts import RankCollapseAlert

    if alerts is not None and not isinstance(alerts, RankCollapseAlert):
        raise TypeError(f"alerts: expected a fastspec.integrations.alerts.RankCollapseAlert or None, "
                        f"got {type(alerts).__name__}")
    return alerts


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
