"""The benchmark suites, one module each, and their registry: ``cases(suite, tier, device)``.

Shared by ``benchmarks/bench_*.py`` and ``fastspec bench``. ``cases`` builds every
:class:`~fastspec.bench.case.Case` of one suite, importing that suite's module only when it is
asked for, so that listing one suite does not import the others' dependencies. No suite module
imports this registry or another suite: what they share is below them, in
:mod:`fastspec.bench.case` (the case type, its claim, error helpers) and
:mod:`fastspec.bench.models` (the Llama-style models).

Suites (see benchmarks/README.md), in the order ``fastspec bench`` runs them:

* ``eigvalsh`` (:mod:`~fastspec.bench.suites.eigvalsh`): batched symmetric eigenvalues.
* ``covariance`` (:mod:`~fastspec.bench.suites.covariance`): streaming key and FFN covariances.
* ``keyrank`` (:mod:`~fastspec.bench.suites.keyrank`): the key-rank evaluation protocol of
  docs/protocols.md end to end.
* ``train_step`` (:mod:`~fastspec.bench.suites.train_step`): streaming-probe overhead on a
  Llama-style training step.
* ``probe`` (:mod:`~fastspec.bench.suites.probe`): what the probe costs on top of the work it
  rides on (``Probe.measure`` vs the plain forward, keys-only streaming vs the plain step) and
  the key-rank computation alone vs ``svdvals`` per head.
* ``budget`` (:mod:`~fastspec.bench.suites.budget`): the overhead a budgeted probe reports
  against what it really costs (a twin model and the same model without the probe, interleaved
  step by step), at budgets of 2% and 5%; and a Hugging Face ``Trainer`` with the streaming
  callback, evaluating and saving checkpoints, against a twin trainer.
* ``train_step_compiled`` (:mod:`~fastspec.bench.suites.train_step`): ``train_step`` with both
  sides through ``torch.compile(fullgraph=True)`` (inductor on CUDA, ``aot_eager`` on CPU).
  Last: its compilation is the slowest setup of all.
"""
from __future__ import annotations

import torch

from ..case import Case, check_tier, default_device

SUITES = ("eigvalsh", "covariance", "keyrank", "train_step", "probe", "budget", "train_step_compiled")


def cases(suite: str, tier: str, device: torch.device | None = None) -> list[Case]:
    """Every case of ``suite`` at ``tier`` on ``device`` (default: CUDA if present)."""
    check_tier(tier)
    device = default_device() if device is None else torch.device(device)
    if suite == "eigvalsh":
        from .eigvalsh import eigvalsh_cases as build
    elif suite == "covariance":
        from .covariance import covariance_cases as build
    elif suite == "keyrank":
        from .keyrank import keyrank_cases as build
    elif suite == "train_step":
        from .train_step import train_step_cases as build
    elif suite == "probe":
        from .probe import probe_cases as build
    elif suite == "budget":
        from .budget import budget_cases as build
    elif suite == "train_step_compiled":
        from .train_step import train_step_compiled_cases as build
    else:
        raise ValueError(f"suite: expected one of {SUITES}, got {suite!r}")
    return build(tier, device)
