"""``Record``: one measurement in tidy form, and the record schema every reader of records uses.

The schema is :data:`FIELDS` (the :class:`Record` fields, in order), of which :data:`NULLABLE`
may be None (a row that lacks one gets None), and :data:`LEGACY_NAMES`, the names older files
use for a field (``head``, now ``head_index``). :func:`normalize` turns one record (a
:class:`Record`, a dict, any mapping or dataclass) into a dict of that schema; tables use
:func:`conform` on their column names. ``analysis.to_frame``, ``integrations.as_dicts`` and
:meth:`Record.from_dict` all go through these two, so a rename or a new field is made here alone.

How an emission's values reach the host without a sync: ``pending.py``. Pure Python (no torch),
so reading records (``analysis``, ``integrations``) does not import torch.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass

PROTOCOLS = ("eval", "stream")


@dataclass(frozen=True)
class Record:
    """One measurement ``(step, tokens_seen, site, layer, head_index, metric, value, protocol, layout)``.

    ``site`` is ``"keys"``, ``"queries"``, ``"keys_prerope"``, ``"ffn"``, ``"gamma_k"``,
    ``"gamma_q"``, ``"probe"`` (the probe's own overhead) or a user module site label.
    ``head_index`` is the global head index (``None`` for per-layer sites; not ``head``, which
    as a DataFrame column would hide ``DataFrame.head``), ``layer`` ``None`` for sites outside
    the layer stack. ``protocol`` says which schedule measured it: ``"eval"``
    (:meth:`fastspec.Probe.measure`, one fixed batch) or ``"stream"`` (the training tokens
    accumulated between emissions); ``None`` for records from elsewhere (a loss, a user's
    own). The two protocols of the same step measure different tokens: never average them.
    ``layout`` says whose tokens a site's record holds (docs/scale.md): ``"replicated"``, every
    data-parallel rank's (merged, or one process's whole input); ``"owned"``, one rank's, as an
    FFN layer that one rank keeps under a memory budget (1/dp of the tokens: the same covariance,
    a larger sampling error); ``None`` for records that are not a site's spectrum (γ, the
    probe's overhead) or from elsewhere. Fits never mix layouts (``fastspec.analysis``).
    """

    step: int
    tokens_seen: int | None
    site: str
    layer: int | None
    head_index: int | None
    metric: str
    value: float
    protocol: str | None = None
    layout: str | None = None

    @property
    def head(self) -> int | None:
        """Deprecated alias of :attr:`head_index`."""
        warnings.warn("Record.head is deprecated; use Record.head_index", DeprecationWarning, stacklevel=2)
        return self.head_index

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping) -> Record:
        """A record from :meth:`as_dict`'s output, also from older files (:func:`normalize`);
        keys that are not fields (``condition``, ``width``) are left out."""
        row = normalize(row)
        return cls(**{f: row[f] for f in FIELDS})


#: the Record fields, in order: the columns of every records table
FIELDS = tuple(f.name for f in fields(Record))
#: fields a record may hold None in, and that a row may therefore lack: ``tokens_seen`` (not
#: counted), ``layer`` (a site outside the layer stack), ``head_index`` (a per-layer site),
#: ``protocol`` (a record from elsewhere, or a file written before protocols existed),
#: ``layout`` (not a site's spectrum, or a file written before layouts existed)
NULLABLE = ("tokens_seen", "layer", "head_index", "protocol", "layout")
#: ``Record.layout`` values
LAYOUTS = ("replicated", "owned")
#: fields that hold integers (or None)
INT_FIELDS = ("step", "tokens_seen", "layer", "head_index")
#: names older files use for a field -> the field (``head`` became ``head_index``: as a
#: DataFrame column it hid ``DataFrame.head``)
LEGACY_NAMES = {"head": "head_index"}
_FIELD_SET = frozenset(FIELDS)


def conform(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """How a row or table with keys/columns ``names`` becomes one of the schema:
    ``(renames {legacy name: field}, nullable fields it lacks)``; raises ``ValueError`` naming
    the fields it lacks that cannot be None. A legacy name is renamed only where the field itself
    is absent; other keys are kept as they are."""
    names = set(names)
    renames = {old: new for old, new in LEGACY_NAMES.items() if old in names and new not in names}
    have = names | set(renames.values())
    missing = [f for f in FIELDS if f not in have and f not in NULLABLE]
    if missing:
        raise ValueError(f"records: missing fields {missing} (a record needs "
                         f"{[f for f in FIELDS if f not in NULLABLE]}; {list(NULLABLE)} may be absent)")
    return renames, [f for f in NULLABLE if f not in have]


def normalize(record) -> dict:
    """One record as a dict with every field of :data:`FIELDS`: a :class:`Record` (or anything
    with ``as_dict()``), a dataclass instance or a mapping; legacy names renamed, absent nullable
    fields None, other keys (e.g. ``condition``, ``width``) kept. Raises ``TypeError`` for
    anything else, ``ValueError`` for a row without ``step``, ``site``, ``metric`` or ``value``."""
    if type(record) is Record:
        return record.as_dict()
    if hasattr(record, "as_dict"):
        row = record.as_dict()
    elif is_dataclass(record) and not isinstance(record, type):
        row = asdict(record)
    elif isinstance(record, Mapping):
        row = dict(record)
    else:
        raise TypeError(f"records: expected Record objects or dicts, got {type(record).__name__}")
    if row.keys() >= _FIELD_SET:  # every field there (a file of as_dict rows): nothing to rename or fill
        return row
    renames, absent = conform(row)
    for old, new in renames.items():
        row[new] = row.pop(old)
    for f in absent:
        row[f] = None
    return row
