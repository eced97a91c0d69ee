"""fastspec: how many dimensions do your activations really use?

Definitions, conventions and measurement protocols are in docs/ (pages cited below).

Public API:
    fastspec.Covariance       streaming per-site n, Σx, Σxxᵀ accumulator (docs/accumulators.md)
    fastspec.eigvalsh         batched symmetric eigenvalues (drop-in for torch.linalg.eigvalsh)
    fastspec.metrics          participation ratio, entropy rank, SUI, eDim, ... (docs/metrics.md)
    fastspec.fit_power_law    log-log least squares across widths (docs/fits.md)
    fastspec.tail_index       spectral tail exponent over a rank window (docs/fits.md)
    fastspec.Probe            per-layer/per-head metrics from a live (HF) model (docs/protocols.md)
    fastspec.analysis         tables and width/tail fits of records   (loaded on first use:
    fastspec.plots            matplotlib figures of records            these need pandas,
    fastspec.integrations     TensorBoard, W&B, Lightning, HF Trainer  matplotlib or the
                                                                       logging library)
"""
from . import metrics
from .covariance import Covariance
from .eig import backends, eigvalsh
from .fits import PowerLawFit, TailFit, fit_power_law, tail_index
from .metrics import SpectrumMetrics, summarize
from .probe import Probe, Record

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("analysis", "plots", "report", "integrations", "demo")


def __getattr__(name: str):
    # `fastspec.analysis` etc. without importing pandas/matplotlib/transformers at `import fastspec`
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fastspec' has no attribute {name!r}")

__all__ = [
    "Covariance",
    "PowerLawFit",
    "Probe",
    "Record",
    "SpectrumMetrics",
    "TailFit",
    "backends",
    "eigvalsh",
    "fit_power_law",
    "metrics",
    "summarize",
    "tail_index",
]
