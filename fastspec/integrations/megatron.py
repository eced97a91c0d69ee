"""Megatron-core: stream the probe through a Megatron training loop (docs/megatron.md).

:class:`FastspecStream` builds :class:`fastspec.Probe` on a Megatron-core ``GPTModel`` (one model
chunk, or the list of chunks Megatron's pipeline schedules take, wrapped or not in Megatron's
``DistributedDataParallel``/``Float16Module``), streams it over every training forward, and is
told of each optimizer step by one call, ``stream.step(iteration)``, after the optimizer step:

* **data (and context) parallelism**: each emission sums the covariances of the data-parallel
  group with context parallelism (``parallel_state.get_data_parallel_group(with_context_parallel=True)``),
  so the records are those of the global batch;
* **tensor parallelism**: each rank holds some query groups, whose keys are exact per group
  (global group index ``tp_rank × groups per rank + g``); the FFN input is split by column
  over the ranks: the sampled rows of each FFN layer are gathered over the tensor-parallel group
  to the rank that keeps the layer (``linear_fc2.tp_group``; docs/scale.md), so the FFN records
  are those of one process, reported by tensor-parallel rank 0;
* **pipeline parallelism** (virtual stages included): each stage probes its own layers, with
  Megatron's global layer numbers; at each emission the model-parallel group of the logging rank
  gathers its members' records there (one ``gather_object``, outside the pipeline schedule).

Why an explicit ``step`` and not a ``forward_step`` wrapper: Megatron's ``forward_step_func`` runs
once per micro-batch and cannot tell the last micro-batch of a step, and an emission's collective
inside it would deadlock the pipeline schedule (stage 0 would wait in the gather before sending
the activations the last stage waits for). Megatron-LM's ``pretrain()`` has no callback: its users
add the ``step`` line to ``train()`` after ``train_step`` (docs/megatron.md shows where).

Needs ``megatron-core`` (tested: :data:`TESTED`); only this module imports it, so ``import fastspec``
and ``import fastspec.integrations`` work without it. Another version warns once, at import.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

from .. import _args
from ._schedule import check_alerts, check_probe
from ._versions import warn_if_untested

__all__ = ["TESTED", "FastspecStream"]

#: the ``megatron-core`` versions this integration is tested with (tests/test_integration_megatron.py)
TESTED = ">=0.16,<0.20"
_STATE_VERSION = 1
#: the key of the probe's state in a Megatron distributed checkpoint (:meth:`FastspecStream.sharded_state_dict`)
CHECKPOINT_KEY = "fastspec.stream"


warn_if_untested(__name__, "megatron-core", TESTED)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _parallel() -> bool:
    """Whether Megatron's model-parallel groups exist (``parallel_state.initialize_model_parallel``)."""
    return _dist() and parallel_state.model_parallel_is_initialized()


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _config(model):
    """The ``TransformerConfig`` of the first chunk (through Megatron's wrappers)."""
    from ..probe.probe import _unwrap_compiled

    return getattr(_unwrap_compiled(_chunks(model)[0]), "config", None)


def _one_overhead(records: list) -> list:
    """``records`` gathered from several pipeline stages (and tensor-parallel ranks), each with its
    own probe's ``("probe", "overhead_fraction")`` record per emission: one per step is kept, the
    largest (the stage whose probe costs most holds the others up: the pipeline moves at its pace)."""
    worst: dict = {}
    rest = []
    for r in records:
        if r.site == "probe":
            key = (r.step, r.metric)
            if key not in worst or r.value > worst[key].value:
                worst[key] = r
        else:
            rest.append(r)
    return rest + list(worst.values())


class FastspecStream:
    """Streams :class:`fastspec.Probe` over a Megatron-core model's training forwards.

    Args:
        model: the model as Megatron's training loop holds it: a ``GPTModel``, or the list of model
            chunks (virtual pipeline stages), wrapped or not in Megatron's DDP / ``Float16Module``.
        probe_kwargs: keyword arguments of ``fastspec.Probe`` (``keys``, ``ffn``, ``emit_every``,
            ``budget``, ...). The stream adds ``process_group`` (the data-parallel group with
            context parallelism), ``tp_rank`` and ``sync="all"`` under ``torch.distributed``, unless
            given here, and ``tp_group`` (Megatron's tensor-parallel group: the FFN rows are
            gathered over it) under tensor parallelism.
        probe: instead of ``probe_kwargs``: a :class:`fastspec.Probe` built on ``model``, or a factory
            called as ``probe(model, process_group=group, tp_rank=r)`` that returns one.
        tensorboard: a TensorBoard ``SummaryWriter`` (Megatron-LM: ``get_tensorboard_writer()``),
            written on the logging rank; None: none.
        wandb: a W&B run, or the ``wandb`` module (Megatron-LM: ``get_wandb_writer()``), logged on
            the logging rank; None: none.
        log_rank: the global rank that keeps the records and logs them: default the last rank,
            where Megatron-LM keeps its writers.
        prefix: the metric names' prefix (:func:`fastspec.integrations.scalars`).
        alerts: a :class:`fastspec.integrations.alerts.RankCollapseAlert` checked on the logging
            rank at each emission (docs/alerts.md); its ``action`` runs after the records are logged.

    After training (:meth:`finish`), the logging rank's records of every layer and group are
    :attr:`records`; :attr:`probe` is this rank's probe (its own layers and groups).
    """

    def __init__(self, model, *, probe_kwargs: dict | None = None, probe: Any = None, tensorboard: Any = None,
                 wandb: Any = None, log_rank: int | None = None, prefix: str = "fastspec", alerts: Any = None):
        from ..probe import Probe

        check_probe(probe, probe_kwargs, factory="(model, process_group=, tp_rank=) -> Probe")
        _args.text("prefix", prefix)
        self.alerts = check_alerts(alerts)
        self.prefix, self.tensorboard, self.wandb = prefix, tensorboard, wandb
        for name, writer, method in (("tensorboard", tensorboard, "add_scalar"), ("wandb", wandb, "log")):
            if writer is not None and not callable(getattr(writer, method, None)):
                raise _args.ArgumentTypeError(f"{name}: expected an object with .{method}() or None, "
                                              f"got {type(writer).__name__}")
        world = dist.get_world_size() if _dist() else 1
        self.log_rank = world - 1 if log_rank is None else _args.integer("log_rank", log_rank, minimum=0)
        if self.log_rank >= world:
            raise ValueError(f"log_rank: expected a rank below the world size {world}, got {self.log_rank}")
        group, tp_rank = self._groups()
        if isinstance(probe, Probe):
            self.probe = probe
        elif probe is not None:
            self.probe = probe(model, process_group=group, tp_rank=tp_rank)
            if not isinstance(self.probe, Probe):
                raise TypeError(f"probe: the factory returned a {type(self.probe).__name__}, not a fastspec.Probe")
        else:
            self.probe = Probe(model, **self._kwargs(model, probe_kwargs, group, tp_rank))
        self.records: list = []
        self._buffer: list = []   # this rank's records not yet gathered to the logging rank
        self._seen = 0            # this rank's streamed records that reached the buffer so far
        self._calls = 0
        self.probe.attach()
        self._attached = True

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _groups() -> tuple[Any, int]:
        """(the data-parallel group with context parallelism, this rank's tensor-parallel rank)."""
        if not _parallel():
            return None, 0
        return (parallel_state.get_data_parallel_group(with_context_parallel=True),
                parallel_state.get_tensor_model_parallel_rank())

    def _kwargs(self, model, probe_kwargs: dict | None, group, tp_rank: int) -> dict:
        kwargs = dict(probe_kwargs or {})
        tp = parallel_state.get_tensor_model_parallel_world_size() if _parallel() else 1
        if tp > 1:
            kwargs.setdefault("tp_group", parallel_state.get_tensor_model_parallel_group())
            cfg = _config(model)
            groups = getattr(cfg, "num_query_groups", None) or getattr(cfg, "num_attention_heads", None)
            if kwargs.get("keys", True) and isinstance(groups, int) and groups % tp:
                raise ValueError(f"keys: {groups} query groups do not split over {tp} tensor-parallel ranks "
                                 f"(Megatron then repeats groups on several ranks); pass keys=False")
        if _dist():
            kwargs.setdefault("sync", "all")
            if kwargs["sync"] != "all":
                raise ValueError(f"probe_kwargs: sync={kwargs['sync']!r} under torch.distributed; the stream "
                                 f"gathers every stage's merged records to the logging rank, which needs sync='all'")
            if group is not None:
                kwargs.setdefault("process_group", group)
            kwargs.setdefault("tp_rank", tp_rank)
        return kwargs

    @property
    def emits(self) -> bool:
        """Whether this rank is the logging rank (keeps :attr:`records`, writes the loggers)."""
        return (dist.get_rank() if _dist() else 0) == self.log_rank

    def _gather_group(self) -> Any:
        """The model-parallel group (tensor × pipeline) of the logging rank, when this rank is in it;
        None otherwise (or with no model parallelism: nothing to gather)."""
        if not _parallel():
            return None
        group = parallel_state.get_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1 or self.log_rank not in ranks:
            return None
        return group

    # ------------------------------------------------------------------ training
    def step(self, iteration: int, tokens_seen: int | None = None) -> list:
        """Call on every rank once per optimizer step, after it (outside the pipeline schedule).

        Returns the records this call brought to the logging rank (there; ``[]`` elsewhere), which
        it has also logged: at an emission step, that emission's records of every layer and group.
        An emission is a collective over the data-parallel group, and the gather of records one
        over the logging rank's model-parallel group: every rank calls ``step`` equally often, as
        Megatron's loop does. On a GPU, an emission step waits for its records to reach the host
        (one device sync every ``emit_every`` steps, which the gather would make anyway); other
        steps never sync."""
        iteration = _args.integer("iteration", iteration, minimum=0)
        self.probe.step(iteration, tokens_seen=tokens_seen)
        self._calls += 1
        # emissions come every emit_every calls on every rank (under torch.distributed the probe
        # never adapts that interval); gathering then keeps the collective as rare as the emissions
        if self._calls % self.probe.emit_every == 0:
            self._take_new()
            return self._collect()
        return []

    def _take_new(self) -> None:
        """Move this rank's streamed records not buffered yet into the buffer (waiting for any still
        in flight on the device)."""
        stream = [r for r in self.probe.records() if r.protocol == "stream"]
        self._buffer.extend(stream[self._seen:])
        self._seen = len(stream)

    def finish(self) -> list:
        """Detach the probe, and bring every record still in flight (on a GPU, the last emission's)
        to the logging rank; a collective like :meth:`step`. Returns (and logs) them there."""
        if not self._attached:
            return []
        self.probe.detach()
        self._attached = False
        self._take_new()
        return self._collect()

    close = finish

    def _collect(self) -> list:
        """Gather the buffered records of the logging rank's model-parallel group to the logging
        rank; there, add them to :attr:`records`, log them and check the alerts."""
        mine, self._buffer = self._buffer, []
        group = self._gather_group()
        if group is not None:
            parts = [None] * dist.get_world_size(group) if self.emits else None
            dist.gather_object(mine, parts, dst=self.log_rank, group=group)
            new = _one_overhead([r for part in (parts or []) for r in part]) if self.emits else []
        else:
            new = mine if self.emits else []
        if not new:
            return []
        new.sort(key=lambda r: (r.step, r.site, -1 if r.layer is None else r.layer,
                                -1 if r.head_index is None else r.head_index, r.metric))
        self.records.extend(new)
        self._log(new)
        return new

    def _log(self, new: list) -> None:
        fired = self.alerts.check(new, notify=False) if self.alerts is not None else None
        by_step: dict[int, list] = {}
        for r in new:
            by_step.setdefault(r.step, []).append(r)
        for step, rows in sorted(by_step.items()):
            if self.tensorboard is not None:
                from .tensorboard import log_to_tensorboard

                log_to_tensorboard(self.tensorboard, rows, step=step, prefix=self.prefix, alerts=fired)
            if self.wandb is not None:
                from .wandb import log_to_wandb

                log_to_wandb(rows, run=self.wandb, step=step, prefix=self.prefix, alerts=fired)
        if fired:
            self.alerts.notify(fired)  # "raise" stops training here, after the records are logged

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the probe's (its accumulators of this rank's tokens since the last
        emission, schedule, record history), the logging rank's gathered records and the alerts'."""
        state = {"version": _STATE_VERSION, "rank": dist.get_rank() if _dist() else 0,
                 "world_size": dist.get_world_size() if _dist() else 1, "calls": self._calls,
                 "probe": self.probe.state_dict(), "records": [r.as_dict() for r in self.records]}
        if self.alerts is not None:
            state["alerts"] = self.alerts.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's, saved by the same rank of the same world size)."""
        from ..probe.record import Record

        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"state: not a FastspecStream state (version {_STATE_VERSION})")
        world, rank = (dist.get_world_size(), dist.get_rank()) if _dist() else (1, 0)
        if (state["rank"], state["world_size"]) != (rank, world):
            raise ValueError(f"state: saved by rank {state['rank']} of {state['world_size']}, loaded on rank "
                             f"{rank} of {world}; resume with the same parallel layout (or start the stream anew)")
        self.probe.load_state_dict(state["probe"])
        self._calls = int(state["calls"])
        self._seen = sum(r.protocol == "stream" for r in self.probe.records())
        self._buffer = []
        self.records = [Record.from_dict(r) for r in state["records"]]
        if self.alerts is not None and "alerts" in state:
            self.alerts.load_state_dict(state["alerts"])

    def sharded_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` as a Megatron distributed-checkpoint entry: ``{"state": ShardedObject}``,
        one object per global rank (key :data:`CHECKPOINT_KEY`), for ``dist_checkpointing.save``
        beside the model's and optimizer's; ``dist_checkpointing.load`` of this same dict returns
        ``{"state": state}`` for :meth:`load_state_dict`."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        world, rank = (dist.get_world_size(), dist.get_rank()) if _dist() else (1, 0)
        return {"state": ShardedObject(CHECKPOINT_KEY, self.state_dict(), (world,), (rank,), replica_id=0)}

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Restore what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        self.load_state_dict(loaded["state"])

    def overhead(self) -> dict:
        """This rank's :meth:`fastspec.Probe.overhead`."""
        return self.probe.overhead()

