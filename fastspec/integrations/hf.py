"""Hugging Face ``Trainer``: a callback that runs the eval-protocol probe (docs/protocols.md) on a
schedule."""
from __future__ import annotations

from transformers import TrainerCallback

from ._schedule import check_alerts, check_every, make_probe, measure


class FastspecTrainerCallback(TrainerCallback):
    """Every ``every_n_steps`` optimizer steps (and at step 0), probe the model on ``batch``.

    The new records' :func:`fastspec.integrations.scalars` are appended to
    ``state.log_history`` (so they land in ``trainer_state.json`` next to the losses) and, if
    ``writer`` is given (a TensorBoard ``SummaryWriter``), logged there too with the heatmap.

    Args:
        batch: the fixed evaluation batch (tensor of input ids or dict of model kwargs).
        every_n_steps: probe schedule in ``state.global_step`` units.
        probe: a :class:`fastspec.Probe`, a factory ``model -> Probe``, or None to build
            ``Probe(model, **probe_kwargs)`` when training begins.
        tokens_per_step: if given, ``tokens_seen = step · tokens_per_step`` in the records.
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checking every
            measurement (docs/alerts.md). The number of new alerts is logged as
            ``{prefix}/alerts`` with the scalars (and to ``writer``, with their messages), then
            the alert's ``action`` runs (``"raise"`` stops ``trainer.train``). A resumed run
            restores its reference with ``alerts.load_state_dict`` (the Trainer keeps no
            callback state).

    All records stay available as ``callback.records``, every alert as ``callback.alerts.fired``.
    """

    def __init__(self, batch, every_n_steps: int = 100, *, probe=None, probe_kwargs: dict | None = None,
                 tokens_per_step: int | None = None, writer=None, prefix: str = "fastspec", alerts=None):
        self.batch, self.every, self.alerts = batch, check_every(every_n_steps), check_alerts(alerts)
        self._probe_arg, self.probe_kwargs = probe, probe_kwargs
        self.tokens_per_step, self.writer, self.prefix = tokens_per_step, writer, prefix
        self.probe = None
        self.records: list = []

    def _measure(self, state, model) -> None:
        if model is None:
            raise ValueError("model: the Trainer passed no model to the callback")
        if self.probe is None:
            self.probe = make_probe(self._probe_arg, model, self.probe_kwargs)
        step = int(state.global_step)
        new, values, fired = measure(self, model, step)
        state.log_history.append({**values, "step": step})
        if self.writer is not None:
            from .tensorboard import log_to_tensorboard

            log_to_tensorboard(self.writer, new, step=step, prefix=self.prefix, alerts=fired)
        if fired:
            self.alerts.notify(fired)  # after logging: "raise" must not lose this measurement

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._measure(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._measure(state, model)
