"""Capture routing: where one site's rows go, decided at capture time from the probe's state.

A capture goes to exactly one :class:`~fastspec.probe.sites.Collector`, or nowhere:

1. nowhere outside the probed model's own forward (e.g. the checkpoint recompute in backward);
2. the eval measurement's collector while :meth:`Probe.measure` runs (:meth:`Router.measuring`);
3. the streaming totals while the probe is attached and the schedule captures this step;
4. nowhere otherwise.

Nothing is switched in and out to get there: the destination is computed from those three
facts each time, and each fact has one owner (``measure`` the context, ``attach``/``detach``
:attr:`Router.streaming`, ``step`` :attr:`Router.capture_this_step`).

Captures run under ``no_grad`` with autocast off and read the activations without changing
them: outputs and gradients are bitwise the same with and without the probe. Only streaming
captures are timed for the overhead budget (a ``measure`` is the user's explicit cost).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from .budget import WorkTimer
from .hooks import ForwardScope
from .sites import Collector


class Router:
    """Sends each capture to the collector it belongs to (see the module docstring).

    Args:
        stream: the streaming totals.
        scope: the model's forward depth and mask.
        timer: times streaming captures for the budget.
        row_step: token sampling (every ``row_step``-th token) of measurements and of streaming
            sites without a row step of their own.
    """

    def __init__(self, stream: Collector, scope: ForwardScope, timer: WorkTimer, row_step: int):
        self.stream, self.scope, self.timer, self.row_step = stream, scope, timer, row_step
        self.streaming = False         # attached: owned by Probe.attach / detach
        self.capture_this_step = True  # the schedule's decision: owned by Probe.step
        self._measurement: Collector | None = None

    def destination(self) -> Collector | None:
        """Where a capture made now goes (None: dropped)."""
        if not self.scope.active:
            return None
        if self._measurement is not None:
            return self._measurement
        return self.stream if self.streaming and self.capture_this_step else None

    @contextlib.contextmanager
    def measuring(self, collector: Collector) -> Iterator[Collector]:
        """Inside this context every capture goes to ``collector`` (an eval measurement)."""
        outer, self._measurement = self._measurement, collector
        try:
            yield collector
        finally:
            self._measurement = outer

    def capture(self, site: str, layer: int | None, x: Tensor, *, headed: bool, convention: str,
                head_offset: int = 0, stream_row_step: int | None = None) -> None:
        """Merge rows ``x: [*rows, H, D]`` (``headed``) or ``[*rows, D]`` of one site."""
        target = self.destination()
        if target is None:
            return
        streaming = target is self.stream
        # only streaming work is the budget's to time: measure() captures would pile up CUDA
        # events (never popped without step()) and count against the streaming interval
        token = self.timer.start(x.device) if streaming else None
        # a site's own streaming row step (FFN: ffn_row_step); measure() is the eval protocol
        row_step = stream_row_step if streaming and stream_row_step is not None else self.row_step
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            # inference-mode tensors may be read outside inference mode; the state must not become one
            stack.enter_context(torch.inference_mode(False))
            if x.device.type in ("cuda", "cpu"):
                stack.enter_context(torch.autocast(x.device.type, enabled=False))
            x = x.detach()
            target.update(site, layer, x, self.scope.mask_for(x), headed=headed, convention=convention,
                          head_offset=head_offset, row_step=row_step)
        if token is not None:
            self.timer.stop(token, "capture")
