"""The registry of benchmark suites, shared by ``benchmarks/bench_*.py`` and ``fastspec bench``.

``cases(suite, tier, device)`` builds every :class:`~fastspec.bench.case.Case` of one suite.
This module sits above the suite modules: it imports them (when a suite is asked for, so that
listing one suite does not import the others' dependencies), and none of them imports it. The
case type itself and the helpers the suites share live below, in :mod:`fastspec.bench.case`.

Suites (see benchmarks/README.md):

* ``eigvalsh`` (:mod:`~fastspec.bench.cases_eigvalsh`): batched symmetric eigenvalues.
* ``covariance`` (:mod:`~fastspec.bench.cases_covariance`): streaming key and FFN covariances.
* ``keyrank`` (:mod:`~fastspec.bench.cases_models`): the key-rank evaluation protocol of
  docs/protocols.md end to end.
* ``train_step`` (:mod:`~fastspec.bench.cases_models`): streaming-probe overhead on a
  Llama-style training step.
* ``probe`` (:mod:`~fastspec.bench.cases_probe`): what the probe costs on top of the work it
  rides on (``Probe.measure`` vs the plain forward, keys-only streaming vs the plain step) and
  the key-rank computation alone vs ``svdvals`` per head.
* ``train_step_compiled`` (:mod:`~fastspec.bench.cases_models`): ``train_step`` with both sides
  through ``torch.compile(fullgraph=True)`` (inductor on CUDA, ``aot_eager`` on CPU). Last: its
  compilation is the slowest setup of all.
"""
from __future__ import annotations

import torch

from .case import Case, check_tier, default_device

SUITES = ("eigvalsh", "covariance", "keyrank", "train_step", "probe", "train_step_compiled")


def cases(suite: str, tier: str, device: torch.device | None = None) -> list[Case]:
    """Every case of ``suite`` at ``tier`` on ``device`` (default: CUDA if present)."""
    check_tier(tier)
    device = default_device() if device is None else torch.device(device)
    if suite == "eigvalsh":
        from .cases_eigvalsh import eigvalsh_cases as build
    elif suite == "covariance":
        from .cases_covariance import covariance_cases as build
    elif suite == "keyrank":
        from .cases_models import keyrank_cases as build
    elif suite == "train_step":
        from .cases_models import train_step_cases as build
    elif suite == "probe":
        from .cases_probe import probe_cases as build
    elif suite == "train_step_compiled":
        from .cases_models import train_step_compiled_cases as build
    else:
        raise ValueError(f"suite: expected one of {SUITES}, got {suite!r}")
    return build(tier, device)
