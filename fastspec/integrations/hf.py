"""Hugging Face ``Trainer``: :class:`FastspecStreamCallback` streams the probe over the training
tokens (docs/hf.md); :class:`FastspecTrainerCallback` runs the eval-protocol probe
(docs/protocols.md) on a fixed batch, on a schedule."""
from __future__ import annotations

import os
import sys
import warnings

import torch
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


#: the probe's state in each ``checkpoint-N`` folder (written by rank 0; read back on resume)
STATE_FILE = "fastspec_probe.pt"


def _caller(kind: type, depth: int = 8):
    """The nearest object of type ``kind`` that is ``self`` in one of the ``depth`` frames above
    the caller's: the ``CallbackHandler`` dispatching an event (callbacks are not handed it).
    None when not called from there."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, kind):
            return obj
        frame = frame.f_back
    return None


def _resumed_from(args, state) -> str | None:
    """The checkpoint folder ``trainer.train(resume_from_checkpoint=...)`` resumes from: the
    Trainer's own argument (read off its training loop's frame; ``True`` is resolved there to the
    last checkpoint already), else ``{output_dir}/checkpoint-{global_step}``; None when training
    starts fresh."""
    if state.global_step == 0:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop" and "resume_from_checkpoint" in frame.f_locals:
            found = frame.f_locals["resume_from_checkpoint"]
            if isinstance(found, (str, os.PathLike)):
                return os.fspath(found)
            break
        frame = frame.f_back
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")


class _ConsoleFilter(TrainerCallback):
    """Placed just before the Trainer's console printer (``ProgressCallback``/``PrinterCallback``,
    the last callbacks): drops the per-layer scalars ``{prefix}/.../layer{l}`` from the ``logs``
    the printer shows, after every reporter and ``trainer_state.json`` have them, so the console
    keeps one line per log with the layer means."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            for key in [k for k in logs if k.startswith(self.prefix + "/") and k.rsplit("/", 1)[-1].startswith("layer")]:
                del logs[key]


class FastspecStreamCallback(TrainerCallback):
    """Stream :class:`fastspec.Probe` over the training tokens of a Hugging Face ``Trainer`` run:
    the ``stream`` protocol of docs/protocols.md, no extra forward, no fixed batch (docs/hf.md).

    * ``on_train_begin``: builds the probe on the trainer's model (a resumed run restores the
      probe's state from the checkpoint first) and attaches it.
    * ``on_step_end`` (once per optimizer step, after every micro-batch of gradient
      accumulation): ``probe.step(state.global_step)``. From there to the next step's first
      forward the probe is paused (``Probe.pause``): the trainer's logging, evaluation and
      checkpoint saves are not training time for the budget, and their forwards are not captured.
    * An emission's scalars (:func:`fastspec.integrations.scalars`, ``{prefix}/stream/...``) are
      merged into the ``logs`` of the next ``on_log``, so every ``report_to`` integration and
      ``trainer_state.json`` get them at the trainer's logging step (the callback moves itself
      first among the trainer's callbacks so the reporters see them). The console (the Trainer's
      progress bar or printer) shows the layer means only. Two emissions between two logs: the
      later one is logged; every record stays in ``callback.records``.
    * ``on_save``: rank 0 writes the probe's state (accumulators of every rank merged, schedule,
      budget, records, alerts) to ``checkpoint-N/fastspec_probe.pt``; ``trainer.train(
      resume_from_checkpoint=...)`` reads it back, so a run stopped at a checkpoint and resumed
      gives the records of one that never stopped.

    Args:
        probe: a :class:`fastspec.Probe` built on the model, a factory ``model -> Probe``, or
            None to build ``Probe(model, **probe_kwargs)`` when training begins.
        probe_kwargs: arguments of ``fastspec.Probe`` (``emit_every``, ``budget``, ``keys``,
            ``ffn``, ...). Under ``torch.distributed`` the callback adds ``sync="rank0"`` unless
            given: rank 0 gets the global records and logs them.
        tokens_per_step: if given, ``tokens_seen = global_step · tokens_per_step`` in the records;
            else the trainer's own count when it keeps one (``include_num_input_tokens_seen``).
        prefix: the scalars' prefix.
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checking every
            emission (docs/alerts.md). The number of new alerts is logged as ``{prefix}/alerts``
            with the scalars; the alert's ``action`` runs right after the emission (``"raise"``
            stops ``trainer.train``). Its state is saved and restored with the probe's.

    After training: ``callback.records`` (this rank's streamed records: all of them on rank 0),
    ``callback.probe``.
    """

    def __init__(self, probe=None, probe_kwargs: dict | None = None, *, tokens_per_step: int | None = None,
                 prefix: str = "fastspec", alerts=None):
        from ._stream import Stream

        self._stream = Stream(probe, probe_kwargs, tokens_per_step, prefix, alerts)
        self._unlogged: dict[str, float] = {}
        self._reporters_warned = False

    probe = property(lambda self: self._stream.probe, doc="The probe (built when training begins).")
    records = property(lambda self: self._stream.records, doc="This rank's streamed records so far.")
    alerts = property(lambda self: self._stream.alerts, doc="The ``alerts`` argument.")
    prefix = property(lambda self: self._stream.prefix, doc="The scalars' prefix.")

    def _go_first(self) -> None:
        """Move this callback first in the dispatching ``CallbackHandler``, so that the logs it
        merges in ``on_log`` reach the ``report_to`` integrations, which the Trainer lists before
        the user's callbacks. Safe while the handler iterates its list (it is moved from a later
        place to the front: every callback up to its old place has run already)."""
        from transformers.trainer_callback import (
            CallbackHandler,
            PrinterCallback,
            ProgressCallback,
        )

        handler = _caller(CallbackHandler)
        if handler is not None and self in handler.callbacks:
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)
            # the console filter goes before the printer (later in the list than this callback was:
            # the handler calls it once, for this event, with nothing to do)
            cbs = handler.callbacks
            if not any(isinstance(c, _ConsoleFilter) for c in cbs):
                at = next((i for i, c in enumerate(cbs) if isinstance(c, (ProgressCallback, PrinterCallback))), None)
                if at is not None:
                    cbs.insert(at, _ConsoleFilter(self.prefix))
        elif not self._reporters_warned:
            self._reporters_warned = True
            warnings.warn("fastspec: FastspecStreamCallback could not put itself before the report_to "
                          "integrations; its scalars reach trainer_state.json and the callbacks after it only",
                          stacklevel=3)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("model: the Trainer passed no model to the callback")
        self._go_first()
        stream = self._stream
        resumed = _resumed_from(args, state)
        stream.build(model)
        if resumed is not None:
            path = os.path.join(resumed, STATE_FILE)
            if os.path.isfile(path):
                stream.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
            else:
                warnings.warn(f"fastspec: resuming from {resumed}, which holds no {STATE_FILE}: streaming "
                              f"starts afresh at step {state.global_step} (records before it are not in "
                              f"callback.records)", stacklevel=2)
        stream.attach()

    def on_step_begin(self, args, state, control, **kwargs):
        self._stream.unpause()

    def on_step_end(self, args, state, control, **kwargs):
        stream = self._stream
        tokens = None
        if stream.tokens_per_step is None and getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False):
            tokens = int(state.num_input_tokens_seen)
        _, values, fired = stream.step(int(state.global_step), tokens)
        if values:
            self._unlogged = values  # a later emission replaces one not logged yet
        if fired:
            if stream.alerts.action == "raise":  # train() ends here: no on_log, no on_train_end follows
                state.log_history.append({**self._unlogged, "step": int(state.global_step)})
                self._unlogged = {}
                stream.finish()  # no hook stays on the model
            stream.alerts.notify(fired)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._unlogged or logs is None:
            return
        values, self._unlogged = self._unlogged, {}
        logs.update(values)
        # the Trainer appended {**logs, "step": global_step} to log_history just before on_log
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last.update(values)

    def on_save(self, args, state, control, **kwargs):
        if self._stream.probe is None:
            return
        saved = self._stream.state_dict()  # a collective: every rank calls it; rank 0 gets the state
        if saved is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(saved, os.path.join(folder, STATE_FILE))

    def on_train_end(self, args, state, control, **kwargs):
        self._stream.finish()
