"""The asynchronous hand-off of one emission's values from the device to the host.

Metrics are computed on the device of the accumulators. Turning them into Python floats needs
the values on the host; doing that with one ``.item()`` per metric would stall the training
stream hundreds of times per emission. Instead every emission is packed into one ``[M, S]``
tensor, copied with ``non_blocking=True`` into pinned host memory, and an event is recorded;
:class:`PendingRecords` turns it into :class:`~fastspec.probe.record.Record` objects once the
event has completed (or when the user asks for the records, which waits for it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .record import PROTOCOLS, Record

# (site, layer, head, metric) for each entry of a packed value tensor
RecordKey = tuple[str, "int | None", "int | None", str]


class PendingRecords:
    """Records whose values are still on their way to the host (see module docstring)."""

    def __init__(self, step: int, tokens_seen: int | None, keys: list[RecordKey], values: Tensor,
                 protocol: str | None = None, layouts: list[str | None] | None = None):
        if values.numel() != len(keys):
            raise ValueError(f"values: expected {len(keys)} entries, got {values.numel()}")
        if protocol is not None and protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {PROTOCOLS} or None, got {protocol!r}")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"layouts: expected {len(keys)} entries, got {len(layouts)}")
        self.step, self.tokens_seen, self.keys, self.protocol = step, tokens_seen, keys, protocol
        self.layouts = layouts if layouts is not None else [None] * len(keys)
        values = values.detach().reshape(-1).to(torch.float64)
        self._event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host = host
        else:
            self._host = values

    def ready(self) -> bool:
        """True when the values have reached the host (never blocks)."""
        return self._event is None or self._event.query()

    def materialize(self) -> list[Record]:
        """The records; waits for the copy if it is still running."""
        if self._event is not None:
            self._event.synchronize()
        vals = self._host.tolist()  # one bulk transfer to Python, not one sync per metric
        return [Record(self.step, self.tokens_seen, s, l, h, m, float(v), self.protocol, lay)
                for (s, l, h, m), v, lay in zip(self.keys, vals, self.layouts)]
