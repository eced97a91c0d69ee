"""``Record``: one measurement in tidy form, and the asynchronous hand-off from device to host.

Metrics are computed on the device of the accumulators. Turning them into Python floats needs
the values on the host; doing that with one ``.item()`` per metric would stall the training
stream hundreds of times per emission. Instead every emission is packed into one ``[M, S]``
tensor, copied with ``non_blocking=True`` into pinned host memory, and an event is recorded;
:class:`PendingRecords` turns it into :class:`Record` objects once the event has completed
(or when the user asks for the records, which waits for it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Record:
    """One measurement ``(step, tokens_seen, site, layer, head, metric, value)``.

    ``site`` is ``"keys"``, ``"queries"``, ``"keys_prerope"``, ``"ffn"``, ``"gamma_k"``,
    ``"gamma_q"``, ``"probe"`` (the probe's own overhead) or a user module site label.
    ``head`` is the global head index (``None`` for per-layer sites), ``layer`` ``None`` for
    sites outside the layer stack.
    """

    step: int
    tokens_seen: int | None
    site: str
    layer: int | None
    head: int | None
    metric: str
    value: float

    def as_dict(self) -> dict:
        return asdict(self)


# (site, layer, head, metric) for each entry of a packed value tensor
RecordKey = tuple[str, "int | None", "int | None", str]


class PendingRecords:
    """Records whose values are still on their way to the host (see module docstring)."""

    def __init__(self, step: int, tokens_seen: int | None, keys: list[RecordKey], values: Tensor):
        if values.numel() != len(keys):
            raise ValueError(f"values: expected {len(keys)} entries, got {values.numel()}")
        self.step, self.tokens_seen, self.keys = step, tokens_seen, keys
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
        return [Record(self.step, self.tokens_seen, s, l, h, m, float(v))
                for (s, l, h, m), v in zip(self.keys, vals)]
