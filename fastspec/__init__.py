"""fastspec: how many dimensions do your activations really use?

Definitions, conventions and measurement protocols are in docs/ (pages cited below).

Public API:
    fastspec.Covariance       streaming per-site n, Σx, Σxxᵀ accumulator (docs/accumulators.md)
    fastspec.eigvalsh         batched symmetric eigenvalues (drop-in for torch.linalg.eigvalsh)
    fastspec.metrics          participation ratio, entropy rank, SUI, eDim, ... (docs/metrics.md)
    fastspec.fit_power_law    log-log least squares across widths (docs/fits.md)
    fastspec.tail_index       spectral tail exponent over a rank window (docs/fits.md)
    fastspec.Probe            per-layer/per-head metrics from a live (HF) model (docs/protocols.md)
    fastspec.analyze          spectra of pretrained models / checkpoint series (docs/analyze.md)
    fastspec.analysis         tables and width/tail fits of records   (these need pandas,
    fastspec.plots            matplotlib figures of records            matplotlib or the
    fastspec.integrations     TensorBoard, W&B, Lightning, HF Trainer  logging library)

Every name is loaded on first use (PEP 562 ``__getattr__``): ``import fastspec`` imports neither
torch nor any optional library, so ``fastspec --help`` starts in a fraction of the time torch
takes to import. ``fastspec.Probe`` and ``from fastspec import Probe`` import what they need.
"""
import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> submodule defining it (relative to this package)
_LAZY_NAMES = {
    "Covariance": "covariance",
    "backends": "eig",  # deprecated name of solvers
    "eigvalsh": "eig",
    "solvers": "eig",
    "PowerLawFit": "fits",
    "TailFit": "fits",
    "fit_power_law": "fits",
    "tail_index": "fits",
    "SpectrumMetrics": "metrics",
    "summarize": "metrics",
    "Probe": "probe",
    "Record": "probe",
    "analyze": "checkpoints",
}
# submodules reachable as attributes of ``fastspec`` without importing them first
# (``fastspec.probe.ModuleSite``, ``fastspec.analysis.to_frame``)
_LAZY_SUBMODULES = ("metrics", "covariance", "eig", "fits", "probe",
                    "analysis", "plots", "report", "integrations", "demo", "bench", "checkpoints")

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from . import metrics
    from .covariance import Covariance
    from .eig import backends, eigvalsh, solvers
    from .fits import PowerLawFit, TailFit, fit_power_law, tail_index
    from .metrics import SpectrumMetrics, summarize
    from .checkpoints import analyze
    from .probe import Probe, Record


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    elif name in _LAZY_SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'fastspec' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute, not this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_SUBMODULES))


__all__ = [
    "Covariance",
    "PowerLawFit",
    "Probe",
    "Record",
    "analyze",
    "SpectrumMetrics",
    "TailFit",
    "backends",
    "eigvalsh",
    "fit_power_law",
    "metrics",
    "solvers",
    "summarize",
    "tail_index",
]
