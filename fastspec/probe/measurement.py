"""One eval measurement over several forwards: :meth:`fastspec.Probe.measurement`.

:meth:`Probe.measure` is one forward of one batch. A measurement over more tokens than one
batch holds (``fastspec analyze``: a fixed token budget in batches) merges the captures of
every :meth:`Measurement.forward` into one collector, and :meth:`Measurement.finish` turns it
into records and, on request, the spectra, from one eigensolve. Each forward is the eval
protocol of :meth:`Probe.measure` (eval mode, ``no_grad``, hooks on for the call only, each
module's train/eval flag restored); the records are those of one ``measure`` over all the
batches' tokens.

With ``timed=True`` the captures' work is timed (host clock on CPU, CUDA events on CUDA, read
once they have completed): :attr:`Measurement.capture_seconds` is the probe's share of the
forward time, :attr:`Measurement.solve_seconds` the eigensolve and metrics.
"""
from __future__ import annotations

import time

import torch

from .. import _args
from .record import Record
from .sites import Collector
from .timer import WorkTimer


class Measurement:
    """The captures of several eval forwards, reported as one measurement (module docstring).

    Made by :meth:`fastspec.Probe.measurement`; use it once::

        m = probe.measurement()
        for batch in batches:
            m.forward(batch)                     # the model's output, as model(**batch) returns it
        records, spectra = m.finish(step=0, spectra=True)
    """

    def __init__(self, probe, *, timed: bool = False):
        self._probe = probe
        self._timer = WorkTimer() if _args.flag("timed", timed) else None
        probe._plan_layout()
        wide = probe._wide
        if wide.managed and wide.eval_passes(probe._meter.held()) > 1:
            raise ValueError(f"memory: the budget holds only some of the FFN layers at once beside what the probe "
                             f"holds, so each would need its own pass over the batches, which a measurement over "
                             f"several forwards cannot make; use measure() per batch, raise Probe(memory=...), or "
                             f"pass ffn=False")
        self.collector = probe._collector(self._timer)
        self.forwards = 0
        self.solve_seconds = 0.0
        self._capture = 0.0
        self._finished = False

    def forward(self, batch):
        """One eval forward of ``batch`` (as :meth:`Probe.measure` takes it), its captures merged
        into this measurement; returns the model's output."""
        if self._finished:
            raise RuntimeError("Measurement.forward: this measurement is finished; start another "
                               "with probe.measurement()")
        with self._one_pass():
            out = self._probe._eval_forward(self._probe._as_batch(batch), self.collector)
        self.forwards += 1
        return out

    def _one_pass(self):
        """Under a memory plan: the FFN layers of this rank's single eval pass are the ones captured
        and solved (not the streaming window's)."""
        import contextlib

        wide = self._probe._wide

        @contextlib.contextmanager
        def one():
            if not wide.managed:
                yield
                return
            wide.eval_pass = 0
            try:
                yield
            finally:
                wide.eval_pass = None
        return one()

    @property
    def capture_seconds(self) -> float:
        """Work time of the captures so far (``timed=True``; waits for the device on CUDA)."""
        if self._timer is None:
            raise RuntimeError("Measurement.capture_seconds: start it with probe.measurement(timed=True)")
        if self.collector.device is not None and self.collector.device.type == "cuda":
            torch.cuda.synchronize(self.collector.device)
        for work, _ in self._timer.close_step(None):
            self._capture += work["capture"]
        return self._capture

    def finish(self, *, step: int, tokens_seen: int | None = None, spectra: bool = False):
        """The records of every site over all forwards (appended to the probe's
        :meth:`~fastspec.Probe.records`), or ``(records, spectra)`` with ``spectra=True``
        (``{(site, layer): [*heads, D]}`` as :meth:`~fastspec.Probe.spectra` gives them, from the
        same eigensolve). Warns as :meth:`Probe.measure` does for sites without rows and rows
        rejected for NaN/Inf. Raises if no forward ran."""
        step = _args.integer("step", step)
        tokens_seen = _args.integer("tokens_seen", tokens_seen, minimum=0, optional=True)
        spectra = _args.flag("spectra", spectra)
        if self._finished:
            raise RuntimeError("Measurement.finish: already finished")
        if self.forwards == 0:
            raise ValueError("Measurement.finish: no forward ran; call forward(batch) first")
        self._finished = True
        probe = self._probe
        device = self.collector.device
        sync = device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with self._one_pass():
            pending, specs = probe._emitter.records_and_spectra(self.collector, step, tokens_seen, "eval")
        records: list[Record] = [] if pending is None else pending.materialize()
        if sync:
            torch.cuda.synchronize(device)
        self.solve_seconds = time.perf_counter() - t0
        probe._keep_eval_records(self.collector, records, stacklevel=3)
        return (records, specs) if spectra else records


