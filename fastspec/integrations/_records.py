"""Records in the one shape every integration reads: dicts with the :class:`fastspec.Record` fields."""
from __future__ import annotations

from ..probe import record


def as_dicts(records) -> list[dict]:
    """Records (``Record``s or dicts) as dicts with every Record field, each through
    ``fastspec.probe.record.normalize`` (a dict from an older file that names the head ``head``
    gets ``head_index``; absent ``tokens_seen``/``layer``/``head_index``/``protocol`` are None)."""
    return [record.normalize(r) for r in records]
