"""What a benchmark case is, and the helpers every suite module shares.

The bottom of :mod:`fastspec.bench`: it imports nothing else from the package, so the suite
modules (``cases_*``), the runner and the pytest glue can all build on it without a cycle. The
registry that lists the suites is one level up, in :mod:`fastspec.bench.cases`.

A :class:`Case` is one (suite, size, fastspec variant): how to build its inputs, the fastspec
callable, one or more baseline callables a user would otherwise write, and an accuracy check
(error against an fp64 reference, or the PR difference against the hand-written protocol).
Sizes come in three tiers (:data:`TIERS`):

* ``quick``: seconds on a 2-core CPU; CI and the Triton interpreter.
* ``cpu``: the default without CUDA; scaled-down shapes with the same structure.
* ``gpu``: the shapes the README claims (1.5B-model keys and FFN, 16384 matrices of 128×128).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch

TIERS = ("quick", "cpu", "gpu")
HEADLINE = "headline"
"""Tag of the cases ``benchmarks/gpu_run.py`` measures in the first minutes of a GPU window
(``fastspec bench --filter headline``; the rest: ``--exclude headline``)."""

Inputs = dict[str, Any]


@dataclass
class Case:
    """One benchmark case; every callable takes the dict built by ``setup()``.

    Attributes:
        suite, size, variant: identify the case; ``size`` is a readable id (``B4096-n128-fp32``),
            ``variant`` the fastspec configuration (``auto``, ``triton``, a solver backend).
        setup: builds the inputs on the device (called once per case).
        fastspec: the call being timed.
        baselines: ``{name: call}`` timed the same way in the same run.
        check: ``inputs -> {"fastspec_error": x, "baseline_error": y | None}``; ``error_kind``
            says what the numbers are (e.g. ``max rel err vs fp64``).
        rate: ``(unit, seconds -> value)`` for throughput next to time (GB/s, µs/matrix), or None.
        fastspec_context: context manager entered around the fastspec timing (a probe's hooks).
        skip: reason the case cannot run here (unavailable backend or dependency), else None.
        notes: ``{what: why}`` for baselines left out here (e.g. ``{"cupy.linalg.eigvalsh": "cupy not installed"}``).
        baseline_scale: ``{name: factor}`` for a baseline timed on a slice of the input because
            it loops one call per item (``torch.linalg.eigvalsh`` on CUDA for n > 32): its
            measured time is multiplied by ``factor`` (full batch / timed slice) and the row
            records the factor.
        overhead: the fastspec side is its baseline plus a probe: each row also gets
            ``overhead_pct = (fastspec_s / baseline_s − 1)·100``.
        teardown: called with the inputs once the case is done (e.g. detach a probe that
            stayed attached for a compiled model), or None.
        tags: words ``--filter``/``--exclude`` also match (:func:`fastspec.bench.cli.select`);
            :data:`HEADLINE` marks the cases the GPU kit measures first.
        row_extra: ``row -> {field: value}`` added to each timed row (e.g. a bandwidth share
            derived from a reference copy's time), or None.
    """

    suite: str
    size: str
    variant: str
    setup: Callable[[], Inputs]
    fastspec: Callable[[Inputs], Any]
    baselines: dict[str, Callable[[Inputs], Any]]
    check: Callable[[Inputs], dict[str, float | None]]
    error_kind: str
    rate: tuple[str, Callable[[float], float]] | None = None
    fastspec_context: Callable[[Inputs], ContextManager] = field(
        default=lambda inputs: contextlib.nullcontext())
    skip: str | None = None
    notes: dict[str, str] = field(default_factory=dict)
    baseline_scale: dict[str, float] = field(default_factory=dict)
    overhead: bool = False
    teardown: Callable[[Inputs], None] | None = None
    tags: frozenset[str] = frozenset()
    row_extra: Callable[[dict], dict] | None = None

    def close(self, inputs: Inputs | None) -> None:
        """Run :attr:`teardown` on ``inputs`` (nothing without either)."""
        if inputs is not None and self.teardown is not None:
            self.teardown(inputs)

    @property
    def id(self) -> str:
        """Readable id for pytest: ``B4096-n128-fp32-auto``."""
        return f"{self.size}-{self.variant}"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_tier(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else "cpu"


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"tier: expected one of {TIERS}, got {tier!r}")
    return tier


def max_rel_err(x: torch.Tensor, ref: torch.Tensor, dims: tuple[int, ...] = (-1,)) -> float:
    """``max over the batch of max|x − ref| / max|ref|`` along ``dims`` (error relative to scale)."""
    diff = (x.double() - ref).abs().amax(dim=dims)
    scale = ref.abs().amax(dim=dims).clamp_min(torch.finfo(torch.float64).tiny)
    return float((diff / scale).max())


def free_memory(device: torch.device) -> None:
    """Collect garbage (a Probe holds its model through reference cycles) and, on CUDA, return
    the cached blocks, so the next case does not share the GPU with the previous one's inputs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
