"""PyTorch Lightning: a callback that runs the eval-protocol probe (docs/protocols.md) on a schedule.

Needs ``lightning`` (or the older ``pytorch_lightning`` package).
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the pre-2.0 package name
    from pytorch_lightning import Callback

from ._schedule import check_alerts, check_every, make_probe, measure


class FastspecCallback(Callback):
    """Every ``every_n_steps`` optimizer steps (and at step 0), probe the model on ``batch`` and
    send :func:`fastspec.integrations.scalars` of the new records to every logger of the trainer.

    Args:
        batch: the fixed evaluation batch (tensor of input ids or dict of model kwargs); moved
            to the model's device.
        every_n_steps: probe schedule in ``trainer.global_step`` units.
        probe: a :class:`fastspec.Probe`, a factory ``model -> Probe``, or None to build
            ``Probe(model, **probe_kwargs)`` at fit start.
        model_attr: attribute of the LightningModule holding the network to probe (e.g.
            ``"model"`` for a wrapped HF model); None probes the LightningModule itself.
        tokens_per_step: if given, ``tokens_seen = step · tokens_per_step`` in the records.
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checking every
            measurement (docs/alerts.md). The number of new alerts goes to the loggers as
            ``{prefix}/alerts`` with the scalars, then the alert's ``action`` runs (``"raise"``
            stops ``trainer.fit``). Its state is saved in the checkpoint with the callback's.

    All records stay available as ``callback.records``, every alert as ``callback.alerts.fired``.
    """

    def __init__(self, batch, every_n_steps: int = 100, *, probe=None, probe_kwargs: dict | None = None,
                 model_attr: str | None = None, tokens_per_step: int | None = None, prefix: str = "fastspec",
                 alerts=None):
        super().__init__()
        self.batch, self.every, self.alerts = batch, check_every(every_n_steps), check_alerts(alerts)
        self._probe_arg, self.probe_kwargs, self.model_attr = probe, probe_kwargs, model_attr
        self.tokens_per_step, self.prefix = tokens_per_step, prefix
        self.probe = None
        self.records: list = []
        self._last_step: int | None = None

    def _model(self, pl_module):
        return getattr(pl_module, self.model_attr) if self.model_attr else pl_module

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.probe is None:
            self.probe = make_probe(self._probe_arg, self._model(pl_module), self.probe_kwargs)

    def _measure(self, trainer, pl_module) -> None:
        step = int(trainer.global_step)
        if step == self._last_step:  # gradient accumulation: several batches per optimizer step
            return
        self._last_step = step
        _, values, fired = measure(self, self._model(pl_module), step)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        if fired:
            self.alerts.notify(fired)  # after logging: "raise" must not lose this measurement

    def state_dict(self) -> dict:
        return {} if self.alerts is None else {"alerts": self.alerts.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.alerts is not None and "alerts" in state_dict:
            self.alerts.load_state_dict(state_dict["alerts"])

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step % self.every == 0:
            self._measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self._measure(trainer, pl_module)
