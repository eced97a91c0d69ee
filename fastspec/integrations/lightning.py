"""PyTorch Lightning: :class:`FastspecStreamCallback` streams the probe over the training tokens
(docs/lightning.md); :class:`FastspecCallback` runs the eval-protocol probe (docs/protocols.md) on
a fixed batch, on a schedule.

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


class FastspecStreamCallback(Callback):
    """Stream :class:`fastspec.Probe` over the training tokens of a Lightning ``Trainer`` run: the
    ``stream`` protocol of docs/protocols.md, no extra forward, no fixed batch (docs/lightning.md).

    * ``on_train_start`` (after the sanity check's validation, the model on its device): builds the
      probe on the LightningModule (or its ``model_attr``), restores the state of a checkpoint
      being resumed, and attaches it.
    * ``on_train_batch_end`` of the batch that ended an optimizer step (``trainer.global_step``
      moved; with ``accumulate_grad_batches`` the last of its micro-batches):
      ``probe.step(trainer.global_step)``. From there to the next batch's start the probe is
      paused (``Probe.pause``): validation, checkpoint saves and logging are not training time for
      the budget, and their forwards are not captured. So it is after the other micro-batches
      (``val_check_interval`` counts batches: a validation can fall inside a step).
    * An emission's scalars (:func:`fastspec.integrations.scalars`, ``{prefix}/stream/...``) go to
      every logger of the trainer (``trainer.loggers``), at the emitting step.
    * Checkpoints: the callback's ``state_dict`` holds the probe's state (accumulators of every
      rank merged, schedule, budget, records) and the alerts'; ``trainer.fit(..., ckpt_path=...)``
      restores it, so a run stopped at a checkpoint and resumed gives the records of one that
      never stopped. Under DDP saving is a collective (Lightning calls ``state_dict`` on every
      rank; rank 0 writes the file).

    Args:
        probe: a :class:`fastspec.Probe` built on the model, a factory ``model -> Probe``, or
            None to build ``Probe(model, **probe_kwargs)`` when training starts.
        probe_kwargs: arguments of ``fastspec.Probe`` (``emit_every``, ``budget``, ``keys``,
            ``ffn``, ...). Under DDP the callback adds ``sync="rank0"`` unless given: rank 0 gets
            the global records and logs them.
        model_attr: attribute of the LightningModule holding the network to probe (e.g.
            ``"model"`` for a wrapped HF model); None probes the LightningModule itself.
        tokens_per_step: if given, ``tokens_seen = global_step · tokens_per_step`` in the records.
        prefix: the scalars' prefix.
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checking every emission
            (docs/alerts.md). The number of new alerts goes to the loggers as ``{prefix}/alerts``
            with the scalars, then the alert's ``action`` runs (``"raise"`` stops ``trainer.fit``).

    After training: ``callback.records`` (this rank's streamed records: all of them on rank 0),
    ``callback.probe``.
    """

    def __init__(self, probe=None, probe_kwargs: dict | None = None, *, model_attr: str | None = None,
                 tokens_per_step: int | None = None, prefix: str = "fastspec", alerts=None):
        super().__init__()
        from .. import _args
        from ._stream import Stream

        self._stream = Stream(probe, probe_kwargs, tokens_per_step, prefix, alerts)
        self.model_attr = _args.text("model_attr", model_attr, optional=True)
        self._last_step: int | None = None

    probe = property(lambda self: self._stream.probe, doc="The probe (built when training starts).")
    records = property(lambda self: self._stream.records, doc="This rank's streamed records so far.")
    alerts = property(lambda self: self._stream.alerts, doc="The ``alerts`` argument.")
    prefix = property(lambda self: self._stream.prefix, doc="The scalars' prefix.")

    def _model(self, pl_module):
        return getattr(pl_module, self.model_attr) if self.model_attr else pl_module

    def on_train_start(self, trainer, pl_module) -> None:
        # here, not at setup: the model is on its device, where a restored state's accumulators go
        self._stream.build(self._model(pl_module))
        self._last_step = int(trainer.global_step)
        self._stream.attach()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stream.unpause()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if step == self._last_step:  # a micro-batch of gradient accumulation: the step goes on at the
            self._stream.pause()       # next batch's start; a validation (val_check_interval counts
            return                     # batches) may run before it, and is not training time
        self._last_step = step
        _, values, fired = self._stream.step(step)
        if values:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)
        if fired:
            self._stream.alerts.notify(fired)  # after logging: "raise" must not lose this emission

    def on_train_end(self, trainer, pl_module) -> None:
        self._stream.finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stream.finish()  # e.g. an alert's "raise": no hook stays on the model

    def state_dict(self) -> dict:
        return self._stream.state_dict() or {}

    def load_state_dict(self, state_dict: dict) -> None:
        self._stream.load_state_dict(state_dict)
