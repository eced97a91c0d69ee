"""What the Hugging Face and Lightning streaming callbacks share (``hf.FastspecStreamCallback``,
``lightning.FastspecStreamCallback``): building the probe, one ``probe.step`` per optimizer step
with its scalars and alerts, the pauses between steps, and the probe's state in a checkpoint.

**The checkpoint state is global.** Under ``torch.distributed`` each rank accumulates its own
shard of the tokens since the last emission. Saving is a collective: the ranks' accumulators are
gathered to rank 0 of the probe's group and merged there, exactly as the next emission would merge
them (``Covariance.merge``), so one state holds the whole run and rank 0 alone writes it (the
trainers save callback state from rank 0). On restore rank 0 takes the merged accumulators and the
other ranks start empty: the next emission sums the same rows, whatever the world size of the
resumed run; under a memory plan that gives each FFN layer to one rank (``Probe(memory=...)``,
docs/scale.md) each rank takes back the layers it keeps. With ``sync="none"`` (each rank emits its own tokens) the ranks' whole probe states
(accumulators and records) are kept side by side instead, and each rank takes its own back (a run
resumed on another world size drops the accumulators, with a warning).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _args
from ._schedule import check_alerts, check_probe

STATE_VERSION = 1


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _cpu(obj):
    """``obj`` with every tensor moved to the CPU (a state to pickle or gather)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj


def merge_accumulators(states: list[list[dict]], settings) -> list[dict]:
    """One list of accumulator entries (``Probe.state_dict()["accumulators"]``) holding every
    rank's rows: entries of the same (site, layer) merged exactly (``Covariance.merge``)."""
    from ..probe.sites import SiteCovariance

    merged: dict = {}
    for entries in states:
        for e in entries:
            key = (e["site"], e["layer"])
            acc = SiteCovariance.from_state_dict(e, settings)
            if key in merged:
                merged[key].cov.merge(acc.cov)
            else:
                merged[key] = acc
    return [{"site": s, "layer": l, **merged[(s, l)].state_dict()}
            for (s, l) in sorted(merged, key=lambda k: (k[0], -1 if k[1] is None else k[1]))]


class Stream:
    """A probe streamed by a trainer callback: built on the trainer's model, stepped once per
    optimizer step, paused between steps, saved and restored with the trainer's checkpoints."""

    def __init__(self, probe, probe_kwargs, tokens_per_step, prefix, alerts):
        from ..probe import Probe

        check_probe(probe, probe_kwargs)
        self.tokens_per_step = _args.integer("tokens_per_step", tokens_per_step, minimum=1, optional=True)
        self.prefix = _args.text("prefix", prefix)
        self.alerts = check_alerts(alerts)
        self.probe_kwargs = probe_kwargs
        self.probe = probe if isinstance(probe, Probe) else None
        self._factory: Callable | None = None if isinstance(probe, Probe) else probe
        self._pending: dict | None = None  # a state loaded before the probe was built
        self.records: list = []
        self.attached = False
        self._built = None  # the probe this object built (a user's Probe is never rebuilt)

    # ------------------------------------------------------------------ probe
    def build(self, model: torch.nn.Module):
        """The probe, built on ``model`` the first time (``Probe(model, **probe_kwargs)``, with
        ``sync="rank0"`` under ``torch.distributed`` unless given: the trainers log from rank 0),
        and any state loaded before it existed restored."""
        from ..probe import Probe
        from ..probe.probe import _unwrap_compiled

        model = _unwrap_compiled(model)
        if self.probe is not None and self.probe.model is not model:
            if self._built is not self.probe:  # the user's own Probe
                raise ValueError("probe: it was built on another model than the trainer's; build it on the "
                                 "model you train, or pass a factory model -> Probe")
            self.finish()  # this callback trains a new model (a new trainer): a probe of its own
            self.probe = None
        if self.probe is None:
            if self._factory is not None:
                probe = self._factory(model)
                if not isinstance(probe, Probe):
                    raise TypeError(f"probe: the factory returned a {type(probe).__name__}, not a fastspec.Probe")
            else:
                kwargs = dict(self.probe_kwargs or {})
                if _dist():
                    kwargs.setdefault("sync", "rank0")
                probe = Probe(model, **kwargs)
            self.probe = self._built = probe
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)
        return self.probe

    def attach(self) -> None:
        """Attach, paused until the first step's first forward (:meth:`unpause`): what the
        trainer does before it (an evaluation at start, a sanity check) is not training."""
        if not self.attached:
            self.probe.attach()
            self.probe.pause()
            self.attached = True

    def unpause(self) -> None:
        if self.attached:
            self.probe.unpause()

    def pause(self) -> None:
        if self.attached:
            self.probe.pause()

    def step(self, step: int, tokens_seen: int | None = None) -> tuple[list, dict[str, float], list]:
        """``probe.step`` at the end of an optimizer step, then a pause until the next one's first
        forward (:meth:`unpause`). Returns this rank's new streamed records (also in
        :attr:`records`), their scalars (with ``{prefix}/alerts`` when ``alerts`` is set) and the
        alerts they raised, not notified yet: the caller logs first."""
        from . import scalars

        self.probe.unpause()
        if tokens_seen is None and self.tokens_per_step is not None:
            tokens_seen = step * self.tokens_per_step
        new = [r for r in self.probe.step(step, tokens_seen=tokens_seen) if r.protocol == "stream"]
        self.probe.pause()  # what the trainer does until the next step is not training
        if not new:
            return [], {}, []
        self.records.extend(new)
        values = scalars(new, self.prefix)
        fired = []
        if self.alerts is not None:
            fired = self.alerts.check(new, notify=False)
            values[f"{self.prefix}/alerts"] = float(len(fired))
        return new, values, fired

    def finish(self) -> None:
        """Detach at the end of training; the records still in flight (CUDA) reach the host."""
        if self.probe is None or not self.attached:
            return
        self.probe.detach()
        self.attached = False
        self.records = [r for r in self.probe.records() if r.protocol == "stream"]

    # ------------------------------------------------------------- checkpoint
    def _group_rank(self) -> tuple[int, int]:
        if not _dist():
            return 0, 1
        group = self.probe._emitter.process_group
        return dist.get_rank(group), dist.get_world_size(group)

    def state_dict(self) -> dict | None:
        """The callback's state for a checkpoint: the probe's (accumulators of every rank merged,
        module docstring), its settings, the alerts'. A collective under ``torch.distributed``:
        every rank calls it; rank 0 of the probe's group gets the state, the others ``None``."""
        if self.probe is None:  # saved before the probe existed: what was loaded, if anything
            return None if self._pending is None else dict(self._pending)
        state = _cpu(self.probe.state_dict())
        rank, world = self._group_rank()
        per_rank = False
        if world > 1:
            group = self.probe._emitter.process_group
            per_rank = not self.probe._emitter.collective  # sync="none": each rank's own records too
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(state if per_rank else state["accumulators"], gathered,
                               dst=0 if group is None else dist.get_global_rank(group, 0), group=group)
            if rank != 0:
                return None
            state = gathered if per_rank else {**state, "accumulators": merge_accumulators(gathered,
                                                                                           self.probe.settings)}
        out = {"version": STATE_VERSION, "world_size": world, "per_rank": per_rank, "probe": state}
        if self.alerts is not None:
            out["alerts"] = self.alerts.state_dict()
        return out

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict` on every rank (kept until the probe is built, if need be)."""
        if not state:  # a checkpoint saved before the probe existed
            return
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state_dict: not a fastspec streaming callback state (version {STATE_VERSION})")
        if self.probe is None:
            self._pending = state
        else:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        rank, world = self._group_rank()
        if state["per_rank"]:  # one probe state per rank of the run that saved it
            saved = state["probe"]
            probe_state = dict(saved[rank] if rank < len(saved) else saved[0])
            if state["world_size"] != world:
                warnings.warn(f"fastspec: the checkpoint's probe state was saved by {state['world_size']} ranks "
                              f"(sync='none'), restored on {world}: the tokens accumulated since its last "
                              f"emission are dropped", stacklevel=3)
                probe_state["accumulators"] = []
                if rank >= len(saved):  # a rank the saving run did not have: no records of its own
                    probe_state["history"] = []
        else:
            probe_state = dict(state["probe"])
        if not state["per_rank"] and rank != 0:
            # rank 0 takes every rank's rows of the sites the emission sums (it sums them once);
            # the FFN layers a memory plan gives one rank each go back to that rank
            probe_state["accumulators"] = self.probe._owned_entries(probe_state["accumulators"])
        reports = self.probe._emitter.reports()
        if not reports:  # sync="rank0": the other ranks never held records
            probe_state["history"] = []
        # the accumulators go back where the model's activations are (they were saved from the CPU)
        param = next((p for p in self.probe.model.parameters() if p.is_floating_point()), None)
        if param is not None:
            probe_state["accumulators"] = [
                {**e, "state": None if e["state"] is None else {k: v.to(param.device) for k, v in e["state"].items()}}
                for e in probe_state["accumulators"]]
        self.probe.load_state_dict(probe_state)
        if self.alerts is not None and "alerts" in state:
            self.alerts.load_state_dict(state["alerts"])
        self.records = [r for r in self.probe.records() if r.protocol == "stream"] if reports else []
