"""OLMo-core: a trainer callback that streams the probe over the training tokens (docs/olmo_core.md).

:class:`FastspecCallback` builds :class:`fastspec.Probe` on the train module's model, streams it
over every training forward (the ``stream`` protocol of docs/protocols.md: no extra forward, no
fixed batch), merges the ranks' covariances over the data-parallel group at each emission, and
hands the metrics to OLMo-core's own metric logging, so the console and W&B loggers show them.
Its state (accumulators, schedule, records, alerts) travels in OLMo-core's per-rank trainer
checkpoints.

Needs ``ai2-olmo-core`` (tested: :data:`TESTED`); only this module imports it, so ``import
fastspec`` and ``import fastspec.integrations`` work without it. Another version warns once, at
import: OLMo-core's callback API and module layout change between minor releases.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from olmo_core.train.callbacks import Callback, ConsoleLoggerCallback
from olmo_core.train.common import MetricMergeStrategy

from .. import _args
from ._schedule import check_alerts, check_probe
from ._versions import warn_if_untested

__all__ = ["TESTED", "FastspecCallback"]

#: the ``ai2-olmo-core`` versions this integration is tested with (tests/test_integration_olmo_core.py)
TESTED = ">=3.0,<3.1"
EMIT_ON = ("rank0", "all")
_STATE_VERSION = 1


warn_if_untested(__name__, "ai2-olmo-core", TESTED)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass
class FastspecCallback(Callback):
    """Streams :class:`fastspec.Probe` over the training forwards and logs its metrics with the trainer's.

    Add it to ``TrainerConfig.callbacks`` (``config.with_callback("fastspec", FastspecCallback(...))``).

    Args:
        probe_kwargs: keyword arguments of ``fastspec.Probe`` (``keys``, ``ffn``, ``emit_every``,
            ``budget``, ...). The callback adds ``process_group=trainer.dp_process_group`` under
            ``torch.distributed`` and ``sync`` from ``emit_on``, unless given here.
        probe: instead of ``probe_kwargs``: a :class:`fastspec.Probe` built on the train module's
            model, or a factory called as ``probe(model, process_group=group)`` (the data-parallel
            group, None without ``torch.distributed``) that returns one.
        emit_on: which ranks keep records and push metrics: ``"rank0"`` (default; the probe's
            ``sync="rank0"``, as OLMo-core's loggers write from rank 0) or ``"all"``
            (``sync="all"``: every rank gets the global metrics).
        prefix: the metric names' prefix (:func:`fastspec.integrations.scalars`).
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checking each emission
            (docs/alerts.md) on the emitting ranks. The number of new alerts is logged as
            ``{prefix}/alerts``; the alert's ``action`` runs at the end of the step
            (``post_step``, after this step's checkpoint).
        console: add ``{prefix}/*/mean`` and ``{prefix}/alerts`` to the metrics every
            ``ConsoleLoggerCallback`` prints (the per-layer values go to W&B and other loggers).

    Streaming starts at the first training step (``pre_step``): OLMo-core's dry-run batch before it
    is not counted. ``probe.step`` runs in ``pre_optim_step``, once per optimizer step. After
    training the emitting ranks' records are ``callback.records``, the probe ``callback.probe``.
    """

    probe_kwargs: dict | None = None
    probe: Any = None
    emit_on: str = "rank0"
    prefix: str = "fastspec"
    alerts: Any = None
    console: bool = True
    records: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        from ..probe import Probe

        check_probe(self.probe, self.probe_kwargs, factory="(model, process_group=) -> Probe")
        _args.choice("emit_on", self.emit_on, EMIT_ON)
        _args.text("prefix", self.prefix)
        self.alerts = check_alerts(self.alerts)
        self.console = _args.flag("console", self.console)
        sync = (self.probe_kwargs or {}).get("sync")
        if self.emit_on == "all" and sync == "rank0":  # ranks other than 0 would never get a record
            raise ValueError("emit_on: 'all' with probe_kwargs sync='rank0' leaves every rank but 0 without "
                             "records; use emit_on='rank0' or sync='all'")
        # a factory is called once, at pre_train; `probe` then holds the Probe
        self._factory: Callable | None = None if isinstance(self.probe, Probe) else self.probe
        if self._factory is not None:
            self.probe = None
        self._pending: dict | None = None  # state loaded before the probe existed (resume)
        self._fired: list = []              # alerts of this step, notified at post_step
        self._attached = False

    # ------------------------------------------------------------------ helpers
    def _rank(self) -> int:
        return dist.get_rank() if _dist() else 0

    @property
    def emits(self) -> bool:
        """Whether this rank keeps records and pushes metrics."""
        return self.emit_on == "all" or self._rank() == 0

    def _build(self):
        from ..probe import Probe

        model = self.trainer.train_module.model
        group = self.trainer.dp_process_group if _dist() else None
        if self.probe is not None:
            return self.probe
        if self._factory is not None:
            probe = self._factory(model, process_group=group)
            if not isinstance(probe, Probe):
                raise TypeError(f"probe: the factory returned a {type(probe).__name__}, not a fastspec.Probe")
            return probe
        kwargs = dict(self.probe_kwargs or {})
        kwargs.setdefault("sync", "all" if self.emit_on == "all" else "rank0")
        if group is not None:
            kwargs.setdefault("process_group", group)
        return Probe(model, **kwargs)

    # ------------------------------------------------------------ trainer events
    def pre_train(self):
        if self.probe is None:
            self.probe = self._build()
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None
        if self.console:
            wanted = [f"{self.prefix}/*/mean", f"{self.prefix}/alerts"]
            for cb in self.trainer.callbacks.values():
                if isinstance(cb, ConsoleLoggerCallback):
                    cb.metrics = list(cb.metrics) + [p for p in wanted if p not in cb.metrics]

    def pre_step(self, batch):
        del batch
        # attach here, not in pre_train: the trainer's dry-run batch (after pre_train) is not training data
        if not self._attached:
            self.probe.attach()
            self._attached = True

    def pre_optim_step(self):
        # After every micro-batch's forward and backward of this step, before the optimizer step:
        # the step's tokens are all captured (activation checkpointing's recompute is never counted),
        # and the checkpointer, which saves in post_train_batch, sees the probe state after this step.
        # (post_step would come after the checkpoint, and after this step's evals, whose forwards
        # must not be attributed to a step they did not train on.)
        new = self.probe.step(self.trainer.global_step, tokens_seen=self.trainer.global_train_tokens_seen)
        if not new or not self.emits:
            return
        from . import scalars

        self.records.extend(new)
        values = scalars(new, self.prefix)
        if self.alerts is not None:
            fired = self.alerts.check(new, notify=False)
            values[f"{self.prefix}/alerts"] = float(len(fired))
            self._fired += fired
        for name, value in values.items():
            # reduce_type None: no collective, each emitting rank logs its own (already global) value
            self.trainer.record_metric(name, value, reduce_type=None, merge_strategy=MetricMergeStrategy.latest)

    def post_step(self):
        if self._fired:
            fired, self._fired = self._fired, []
            self.alerts.notify(fired)  # "raise" stops the trainer here, after this step's checkpoint

    def post_train(self):
        self._finish()

    def close(self):
        self._finish()

    def _finish(self) -> None:
        if self.probe is None or not self._attached:
            return
        self.probe.detach()
        self._attached = False
        if self.emits:  # records still in flight (CUDA) reach the host here; none are lost
            self.records = self._stream_records()

    def _stream_records(self) -> list:
        return [r for r in self.probe.records() if r.protocol == "stream"]

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the probe's (accumulators of this rank's tokens since the last
        emission, schedule, record history) and the alerts'. OLMo-core saves it per rank."""
        if self.probe is None:  # e.g. the step-0 checkpoint, before pre_train: what was loaded, if anything
            return dict(self._pending or {})
        state = {"version": _STATE_VERSION, "rank": self._rank(),
                 "world_size": dist.get_world_size() if _dist() else 1, "probe": self.probe.state_dict()}
        if self.alerts is not None:
            state["alerts"] = self.alerts.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; OLMo-core loads checkpoints before ``pre_train``, so the state is
        kept until the probe is built there."""
        if not state_dict:  # a checkpoint saved before the probe existed
            return
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: not a FastspecCallback state (version {_STATE_VERSION})")
        if self.probe is None:
            self._pending = state_dict
        else:
            self._restore(state_dict)

    def _restore(self, state: dict) -> None:
        probe_state = state["probe"]
        world = dist.get_world_size() if _dist() else 1
        if (state["rank"], state["world_size"]) != (self._rank(), world):
            # OLMo-core falls back to rank 0's file when this rank has none (another world size): its
            # accumulators hold other ranks' tokens, which the next emission would count again
            warnings.warn(f"fastspec: the checkpoint's probe state was saved by rank {state['rank']} of "
                          f"{state['world_size']}, restored on rank {self._rank()} of {world}: the tokens "
                          f"accumulated since its last emission are dropped", stacklevel=2)
            probe_state = {**probe_state, "accumulators": []}
        self.probe.load_state_dict(probe_state)
        if self.alerts is not None and "alerts" in state:
            self.alerts.load_state_dict(state["alerts"])
        self.records = self._stream_records() if self.emits else []
