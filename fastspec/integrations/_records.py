"""Records in the one shape every integration reads: dicts with the :class:`fastspec.Record` fields."""
from __future__ import annotations


def as_dicts(records) -> list[dict]:
    """Records (``Record``s or dicts) as dicts with the Record fields (a dict from an older file
    that names the head ``head`` gets ``head_index``; a missing ``protocol`` is None)."""
    out = []
    for r in records:
        if hasattr(r, "as_dict"):
            out.append(r.as_dict())
        elif isinstance(r, dict):
            r = dict(r)
            if "head" in r and "head_index" not in r:
                r["head_index"] = r.pop("head")
            r.setdefault("head_index", None)
            r.setdefault("protocol", None)
            out.append(r)
        else:
            raise TypeError(f"records: expected Record objects or dicts, got {type(r).__name__}")
    return out
