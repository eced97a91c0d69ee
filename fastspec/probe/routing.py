"""Capture routing: where one site's rows go, decided at capture time from the probe's state.

A capture goes to exactly one :class:`~fastspec.probe.sites.Collector`, or nowhere:

1. nowhere outside the probed model's own forward (e.g. the checkpoint recompute in backward);
2. the eval measurement's collector while :meth:`Probe.measure` runs (:meth:`Router.measuring`);
3. the streaming totals while the probe is attached, the schedule captures this step, and the
   forward trains: the model in training mode with gradients enabled (``ForwardScope.training``;
   an evaluation forward, under ``model.eval()``, ``torch.no_grad()`` or ``torch.inference_mode()``,
   does not), unless the probe was built with ``forwards="all"`` (:attr:`Router.all_forwards`);
4. nowhere otherwise.

Nothing is switched in and out to get there: the destination is computed from those facts
each time, and each fact has one owner (``measure`` the context, ``attach``/``detach``
:attr:`Router.streaming`, ``step`` :attr:`Router.capture_this_step`, the model's own forward
:attr:`ForwardScope.training`).

Captures run under ``no_grad`` with autocast off and read the activations without changing
them: outputs and gradients are bitwise the same with and without the probe. Only streaming
captures are timed for the overhead budget (a ``measure`` is the user's explicit cost).

**Inside ``torch.compile``** (the hooks are traced with the model, no graph break) a capture is
one ``fastspec::covariance_update_`` op on the streaming totals (``fastspec/covariance/ops.py``):

* the decision "capture this step" is a 0-d bool tensor, :meth:`Router.gate`, that the op
  reads (on the host from a CPU tensor; on the device for CUDA graphs); :meth:`Probe.step`
  fills it. The graph does not change with the schedule, so ``every``, a budget and emissions
  never recompile it;
* the state a capture writes must exist when the graph is traced: :func:`_ensure_slot` runs at
  trace time (dynamo calls it instead of tracing it) and creates it from the traced shapes, on
  the activations' device, marked as a static address for CUDA graphs. Each hook site holds a
  :class:`Slot` through which the traced code then reads that state;
* what the traced code reads from the router (attached, a forward in flight, no measurement)
  becomes a guard: it holds for every training step, and ``detach`` removes the hooks anyway;
* captures in a graph are not timed one by one (a host clock cannot run inside a graph), and
  the traced code changes no Python state (dynamo refuses that inside higher-order ops such as
  activation checkpointing): :attr:`Router.captured_in_graph` infers it instead (captures were
  traced, and no eager capture was timed this step), and ``Probe.step`` then estimates the
  capture cost from whole step times (``budget.py``).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor

from .._trace import assume_constant_result
from .hooks import ForwardScope
from .sites import Collector, site_dim
from .timer import WorkTimer


class Slot:
    """One (site, layer) a hook captures into; the compiled path finds the state through it.

    ``acc`` and ``gate`` are set at trace time by :func:`_ensure_slot`: the streaming
    :class:`~fastspec.probe.sites.SiteCovariance` of this site and the router's gate on its device.
    """

    _keys = itertools.count()

    def __init__(self, router: "Router", site: str, layer: int | None):
        self.router, self.site, self.layer = router, site, layer
        self.acc = None
        self.gate: Tensor | None = None
        # a str, not an int: dynamo may trace an int read through a hook's closure as a SymInt
        # (under FSDP2 it does, once two layers' hooks differ in it), which _ensure_slot cannot take
        self.key = f"slot{next(Slot._keys)}"
        _SLOTS[self.key] = self


_SLOTS: "weakref.WeakValueDictionary[str, Slot]" = weakref.WeakValueDictionary()


@assume_constant_result
def _ensure_slot(key: str, dim: tuple, device: torch.device, convention: str, headed: bool,
                 head_offset: int) -> bool:
    """Create slot ``key``'s streaming state (``dim`` on ``device``) if it does not exist yet, mark
    it static for CUDA graphs, and point the slot at it and at the gate of ``device``.

    Runs at trace time only: the graph then reads ``slot.acc``/``slot.gate`` as inputs."""
    import torch._dynamo

    slot = _SLOTS[key]
    router = slot.router
    acc = router.totals.ensure(slot.site, slot.layer, tuple(dim), convention, headed, head_offset, device)
    if acc is None:  # refused by the memory budget: the traced capture does nothing
        slot.acc = slot.gate = None
        return True
    for t in acc.cov.state_dict()["state"].values():
        torch._dynamo.mark_static_address(t)
    gate = router.gate(device)
    torch._dynamo.mark_static_address(gate)
    slot.acc, slot.gate = acc, gate
    router.traced = True
    return True


class Router:
    """Sends each capture to the collector it belongs to (see the module docstring).

    Args:
        totals: the streaming totals (what streaming captures are merged into).
        scope: the model's forward depth and mask.
        timer: times streaming captures for the budget.
        row_step: token sampling (every ``row_step``-th token) of measurements and of streaming
            sites without a row step of their own.
        cuda_graphs: keep the gate of compiled captures on the activations' device (see :meth:`gate`).
    """

    def __init__(self, totals: Collector, scope: ForwardScope, timer: WorkTimer, row_step: int,
                 cuda_graphs: bool = False, all_forwards: bool = False):
        self.totals, self.scope, self.timer, self.row_step = totals, scope, timer, row_step
        self.cuda_graphs = cuda_graphs
        self.all_forwards = all_forwards  # stream evaluation forwards too (Probe(forwards="all"))
        self.streaming = False         # attached: owned by Probe.attach / detach
        self._capture_this_step = True
        self._gates: dict[torch.device, Tensor] = {}
        self._slots: dict[tuple[str, int | None], Slot] = {}
        self._measurement: Collector | None = None
        self.traced = False   # captures were traced into a compiled graph (set at trace time)
        self.timed = 0        # eager streaming captures timed since end_step()

    @property
    def captured_in_graph(self) -> bool:
        """Whether this step's streaming captures ran inside a compiled graph (untimed)."""
        return self.traced and self.timed == 0

    def end_step(self) -> None:
        """``Probe.step``: start counting the next step's eager captures."""
        self.timed = 0

    @property
    def capture_this_step(self) -> bool:
        """The schedule's decision for the next forwards (owned by ``Probe.step``)."""
        return self._capture_this_step

    @capture_this_step.setter
    def capture_this_step(self, value: bool) -> None:
        self._capture_this_step = bool(value)
        for gate in self._gates.values():
            gate.fill_(self._capture_this_step)  # on CUDA an async fill: no sync

    def gate(self, device: torch.device) -> Tensor:
        """The decision as a 0-d bool tensor, read by the captures of a compiled graph whose
        activations are on ``device``: a CPU tensor, which a closed gate makes free, or with
        ``cuda_graphs`` one on ``device``, which CUDA graphs can hold (``fastspec/covariance/ops.py``)."""
        device = device if self.cuda_graphs else torch.device("cpu")
        gate = self._gates.get(device)
        if gate is None:
            gate = self._gates[device] = torch.full((), self._capture_this_step, dtype=torch.bool,
                                                    device=device)
        return gate

    def slot(self, site: str, layer: int | None) -> Slot:
        """The :class:`Slot` of one hooked (site, layer) (the same one each time the hooks go on)."""
        slot = self._slots.get((site, layer))
        if slot is None:
            slot = self._slots[(site, layer)] = Slot(self, site, layer)
        return slot

    def forget_slots(self) -> None:
        """Point every slot at nothing (after the streaming state was replaced, e.g. by a
        checkpoint load): a compiled graph's guards then fail, and its retrace finds the new state."""
        for slot in self._slots.values():
            slot.acc = slot.gate = None

    def wanted(self) -> bool:
        """Whether a capture made now would be kept: always while dynamo traces (a graph's
        captures are gated by :meth:`gate` at run time), else :meth:`destination` is not None.
        The hooks ask this first, so an idle step's callbacks do no work (``hooks.Hooks``)."""
        return torch.compiler.is_compiling() or self.destination() is not None

    def destination(self) -> Collector | None:
        """Where a capture made now goes (None: dropped)."""
        if not self.scope.active:
            return None
        if self._measurement is not None:
            return self._measurement
        return self.totals if self.streams() and self.capture_this_step else None

    def streams(self) -> bool:
        """Whether the forward in flight feeds the streaming totals (schedule aside): attached,
        and a training forward unless every forward streams."""
        return self.streaming and (self.all_forwards or self.scope.training)

    @contextlib.contextmanager
    def measuring(self, collector: Collector) -> Iterator[Collector]:
        """Inside this context every capture goes to ``collector`` (an eval measurement)."""
        outer, self._measurement = self._measurement, collector
        try:
            yield collector
        finally:
            self._measurement = outer

    def capture(self, slot: Slot, x: Tensor, *, headed: bool, convention: str,
                head_offset: int = 0, stream_row_step: int | None = None, gather: int | None = None) -> None:
        """Merge rows ``x: [*rows, H, D]`` (``headed``) or ``[*rows, D]`` of one site, without the
        padding of the model's ``attention_mask`` (``ForwardScope.mask_for``, which raises if the
        mask cannot cover the rows' ``[B, T]``). ``gather``: the rows ``[B, T, D/tp]`` are this
        rank's columns of an FFN input split by tensor parallelism; the sampled rows are gathered
        to tensor-parallel rank ``gather``, which merges them (``layout.WideSites.gather``)."""
        if torch.compiler.is_compiling():
            self._capture_in_graph(slot, x, headed=headed, convention=convention, head_offset=head_offset,
                                   stream_row_step=stream_row_step)
            return
        target = self.destination()
        if target is None:
            return
        wide = target.wide
        if wide is not None and wide.eval_pass and slot.site != "ffn":
            return  # a later pass of a rotating eval measurement: the other sites were captured in the first
        streaming = target is self.totals
        # only streaming work is the budget's to time: measure() captures would pile up CUDA
        # events (never popped without step()) and count against the streaming interval
        # a measurement is timed only when it asked to be (its own timer: Probe.measurement)
        timer = self.timer if streaming else target.timer
        token = timer.start(x.device) if timer is not None else None
        # a site's own streaming row step (FFN: ffn_row_step); measure() is the eval protocol
        row_step = stream_row_step if streaming and stream_row_step is not None else self.row_step
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            # inference-mode tensors may be read outside inference mode; the state must not become one
            stack.enter_context(torch.inference_mode(False))
            if x.device.type in ("cuda", "cpu"):
                stack.enter_context(torch.autocast(x.device.type, enabled=False))
            x = x.detach()
            mask = self.scope.mask_for(x, headed, slot.site)
            if gather is not None:
                def take(rows: Tensor, m: Tensor | None) -> None:
                    target.update(slot.site, slot.layer, rows, m, headed=False, convention=convention)
                wide.gather(x, mask, gather, row_step, take)
            else:
                target.update(slot.site, slot.layer, x, mask, headed=headed, convention=convention,
                              head_offset=head_offset, row_step=row_step)
        if token is not None:
            timer.stop(token, "capture")
            self.timed += streaming

    def _capture_in_graph(self, slot: Slot, x: Tensor, *, headed: bool, convention: str, head_offset: int,
                          stream_row_step: int | None) -> None:
        """The traced capture: one custom op on the streaming state, gated by the schedule tensor."""
        # guards, constant for a training run: measure() runs the eager module, not a graph
        # an evaluation forward (eval mode, no_grad, inference_mode) traces a graph of its own
        # (dynamo guards on those modes), and that graph holds no capture
        if not self.scope.active or not self.streams() or self._measurement is not None:
            return
        if x.numel() == 0:
            return
        _ensure_slot(slot.key, site_dim(x, headed), x.device, convention, headed, head_offset)
        if slot.acc is None:  # a site the memory budget could not admit (warned at trace time)
            return
        row_step = stream_row_step if stream_row_step is not None else self.row_step
        slot.acc.cov.update(x.detach(), self.scope.mask_for(x, headed, slot.site), row_step=row_step,
                            gate=slot.gate)
