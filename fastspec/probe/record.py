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

PROTOCOLS = ("eval", "stream")


@dataclass(frozen=True)
class Record:
    """One measurement ``(step, tokens_seen, site, layer, head_index, metric, value, protocol)``.

    ``site`` is ``"keys"``, ``"queries"``, ``"keys_prerope"``, ``"ffn"``, ``"gamma_k"``,
    ``"gamma_q"``, ``"probe"`` (the probe's own overhead) or a user module site label.
    ``head_index`` is the global head index (``None`` for per-layer sites; not ``head``, which
    as a DataFrame column would hide ``DataFrame.head``), ``layer`` ``None`` for sites outside
    the layer stack. ``protocol`` says which schedule measured it: ``"eval"``
    (:meth:`fastspec.Probe.measure`, one fixed batch) or ``"stream"`` (the training tokens
    accumulated between emissions); ``None`` for records from elsewhere (a loss, a user's
    own). The two protocols of the same step measure different tokens: never average them.
    """

    step: int
    tokens_seen: int | None
    site: str
    layer: int | None
    head_index: int | None
    metric: str
    value: float
    protocol: str | None = None

    @property
    def head(self) -> int | None:
        """Deprecated alias of :attr:`head_index`."""
        return self.head_index

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> Record:
        """A record from :meth:`as_dict`'s output, also from older files that name the head ``head``
        and have no ``protocol``."""
        row = dict(row)
        if "head" in row and "head_index" not in row:
            row["head_index"] = row.pop("head")
        return cls(**{f: row.get(f) for f in _FIELDS})


_FIELDS = ("step", "tokens_seen", "site", "layer", "head_index", "metric", "value", "protocol")

# (site, layer, head, metric) for each entry of a packed value tensor
RecordKey = tuple[str, "int | None", "int | None", str]


class PendingRecords:
    """Records whose values are still on their way to the host (see module docstring)."""

    def __init__(self, step: int, tokens_seen: int | None, keys: list[RecordKey], values: Tensor,
                 protocol: str | None = None):
        if values.numel() != len(keys):
            raise ValueError(f"values: expected {len(keys)} entries, got {values.numel()}")
        if protocol is not None and protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {PROTOCOLS} or None, got {protocol!r}")
        self.step, self.tokens_seen, self.keys, self.protocol = step, tokens_seen, keys, protocol
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
        return [Record(self.step, self.tokens_seen, s, l, h, m, float(v), self.protocol)
                for (s, l, h, m), v in zip(self.keys, vals)]
