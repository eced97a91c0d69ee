"""Every record a probe has produced, including those whose values are still on their way.

Emissions hand over :class:`~fastspec.probe.pending.PendingRecords` (values copied to the host
asynchronously). :meth:`History.flush` turns those whose copy has finished into records, in
emission order, without waiting (``block=False``) or waiting for all of them.
"""
from __future__ import annotations

from .pending import PendingRecords
from .record import FIELDS, INT_FIELDS, Record


class History:
    """The records of one probe, in the order they were emitted."""

    def __init__(self):
        self._records: list[Record] = []
        self._pending: list[PendingRecords] = []

    def add(self, pending: PendingRecords | None) -> None:
        """Queue one emission (None: nothing was emitted)."""
        if pending is not None:
            self._pending.append(pending)

    def extend(self, records: list[Record]) -> None:
        """Append records that are already on the host (an eval measurement's)."""
        self._records.extend(records)

    def flush(self, block: bool = True) -> list[Record]:
        """Move emissions whose values reached the host (``block``: all of them, waiting) into the
        history; returns the new records."""
        new: list[Record] = []
        while self._pending and (block or self._pending[0].ready()):
            new.extend(self._pending.pop(0).materialize())
        self._records.extend(new)
        return new

    def records(self) -> list[Record]:
        """Every record so far, waiting for values still in flight."""
        self.flush()
        return list(self._records)

    def to_dataframe(self):
        """:meth:`records` as a ``pandas.DataFrame`` with the :class:`Record` fields as columns.

        ``step``, ``tokens_seen``, ``layer`` and ``head_index`` are nullable integers (``Int64``:
        a per-layer site's missing head is ``<NA>``, and 3 stays 3 rather than 3.0)."""
        try:
            import pandas as pd
        except ImportError as e:  # optional dependency
            raise ImportError("to_dataframe needs pandas: pip install 'fastspec[plot]'") from e
        df = pd.DataFrame([r.as_dict() for r in self.records()], columns=list(FIELDS))
        return df.astype({c: "Int64" for c in INT_FIELDS} | {"value": "float64"})

    def state_dict(self) -> list[dict]:
        return [r.as_dict() for r in self.records()]

    def load_state_dict(self, rows: list[dict]) -> None:
        self.flush()
        self._records = [Record.from_dict(r) for r in rows]
