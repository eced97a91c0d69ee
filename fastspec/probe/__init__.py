"""Probes: per-layer, per-head spectral metrics from a live PyTorch / Hugging Face model.

``fastspec.Probe`` puts the streaming :class:`fastspec.Covariance` on attention keys/queries
(after Q/K-norm and RoPE), FFN post-activations and any module, on the eval protocol
(:meth:`Probe.measure`) or streaming during training (:meth:`Probe.attach` / :meth:`Probe.step`),
and reports tidy :class:`Record` rows (docs/protocols.md). ``probe.py`` lists the module of each job.
"""
from .families import FAMILIES, Family
from .probe import Probe
from .record import Record
from .sites import ModuleSite

__all__ = ["FAMILIES", "Family", "ModuleSite", "Probe", "Record"]
