"""Probes: per-layer, per-head spectral metrics from a live PyTorch / Hugging Face model.

``fastspec.Probe`` puts the streaming :class:`fastspec.Covariance` on attention keys/queries
(after Q/K-norm and RoPE), FFN post-activations and any module, on the eval protocol
(:meth:`Probe.measure`) or streaming during training (:meth:`Probe.attach` / :meth:`Probe.step`),
and reports tidy :class:`Record` rows (docs/protocols.md). ``probe.py`` lists the module of each job.

``Record`` and the record schema (``record.py``) are pure Python; the other names load torch on
first use (PEP 562 ``__getattr__``), so reading records files (``fastspec.analysis``,
``fastspec.integrations``) imports no torch.
"""
import importlib
from typing import TYPE_CHECKING

from .record import Record

# public name -> submodule defining it
_LAZY_NAMES = {"FAMILIES": "families", "Family": "families", "AttentionInputs": "families", "Probe": "probe",
               "ModuleSite": "sites"}

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from .families import FAMILIES, AttentionInputs, Family
    from .probe import Probe
    from .sites import ModuleSite


def __getattr__(name: str):
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute, not this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["FAMILIES", "AttentionInputs", "Family", "ModuleSite", "Probe", "Record"]
