"""What a benchmark case is, the accuracy it claims, and the helpers every suite module shares.

The bottom of :mod:`fastspec.bench`: it imports nothing else from the package, so the suite
modules (:mod:`fastspec.bench.suites`), the runner and the pytest glue can all build on it
without a cycle. The registry that lists the suites is one level up, in
:mod:`fastspec.bench.suites`.

A :class:`Case` is one (suite, size, fastspec variant): how to build its inputs, the fastspec
callable, one or more baseline callables a user would otherwise write, an accuracy check (error
against an fp64 reference, or the PR difference against the hand-written protocol) and the
:class:`Claim` that check must hold, set where the case is built. ``pytest benchmarks``
(``benchmarks/conftest.py``) and ``fastspec bench`` (:mod:`fastspec.bench.runner`) both judge a
case by :meth:`Claim.violated`, so the two cannot disagree on what passes.
Sizes come in three tiers (:data:`TIERS`):

* ``quick``: tiny shapes, every suite in about 25 s on a 2-core CPU (``fastspec bench --quick``,
  :data:`fastspec.commands.bench.QUICK_TIME`); CI and the Triton interpreter.
* ``cpu``: the default without CUDA; scaled-down shapes with the same structure.
* ``gpu``: the shapes the README claims (1.5B-model keys and FFN, 16384 matrices of 128×128).
"""
from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch

TIERS = ("quick", "cpu", "gpu")
HEADLINE = "headline"
"""Tag of the cases ``benchmarks/gpu_run.py`` measures in the first minutes of a GPU window
(``fastspec bench --filter headline``; the rest: ``--exclude headline``)."""

Inputs = dict[str, Any]

SEED = 0
"""Seed of the random number generators when a case builds its inputs (:meth:`Case.inputs`):
every run, and every ``--filter`` of it, times and checks a case on the same data, so its error
can be compared across runs and a claim that holds does not flip with the draw."""

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
FLOOR_EPS = 8
"""The floor of :func:`no_worse_than`, in eps_fp32 (errors are relative to the matrix scale): it
keeps a baseline that happens to round almost exactly from making the bound ~0; 8 is the value
tests/test_eig_host.py uses for the solvers themselves."""


@dataclass(frozen=True)
class Claim:
    """The accuracy a case promises, checked on the dict its ``check`` returns.

    ``fastspec_error`` must be finite and at most ``factor × errors[relative_to] + floor``
    (``relative_to`` None: at most ``floor``), and every field named in ``zero`` must be 0.
    :meth:`violated` is the one rule: ``benchmarks/conftest.py`` asserts it, ``fastspec bench``
    marks a row that breaks it and exits 1. Build one with :func:`no_worse_than`,
    :func:`at_most` or :func:`exactly_zero`.

    Attributes:
        text: the bound on fastspec's error in words, for tables, JSON and messages
            (``≤ 2 × baseline_error + 8·eps_fp32``).
    """

    text: str
    factor: float = 0.0
    floor: float = 0.0
    relative_to: str | None = None
    zero: tuple[str, ...] = ()

    def violated(self, errors: Mapping[str, Any]) -> str | None:
        """None when ``errors`` hold the claim, else one line saying how they break it."""
        err = errors.get("fastspec_error")
        if err is None or not math.isfinite(err):
            return f"fastspec error is {err} (claim: {self.text})"
        bound, of = self.floor, ""
        if self.relative_to is not None:
            ref = errors.get(self.relative_to)
            if ref is None or not math.isfinite(ref):
                return f"{self.relative_to} is {ref}: no reference to hold the error to (claim: {self.text})"
            bound += self.factor * ref
            of = f", {self.relative_to} {ref:.3g}"
        if not err <= bound:
            return f"fastspec error {err:.3g} > {bound:.3g} (claim: {self.text}{of})"
        for name in self.zero:
            if errors.get(name) != 0:
                return f"{name} is {errors.get(name)} (claim: {self.text})"
        return None


def no_worse_than(relative_to: str = "baseline_error", *, floor: float = FLOOR_EPS * EPS32,
                  floor_text: str = f"{FLOOR_EPS}·eps_fp32") -> Claim:
    """fastspec's error at most 2 × ``errors[relative_to]`` (the baseline in the same precision,
    both relative to the scale) + ``floor``: the fast path may not be meaningfully less accurate
    than what it replaces."""
    return Claim(f"≤ 2 × {relative_to} + {floor_text}", factor=2.0, floor=floor, relative_to=relative_to)


def at_most(bound: float) -> Claim:
    """fastspec's error at most ``bound`` (a parity target of its own)."""
    return Claim(f"≤ {bound:g}", floor=bound)


def exactly_zero(*zero: str) -> Claim:
    """fastspec's error 0 (e.g. the loss unchanged by the probe), and every field of ``zero``
    too (e.g. ``graph_breaks``)."""
    return Claim("= 0" + "".join(f", {name} = 0" for name in zero), zero=zero)


@dataclass
class Case:
    """One benchmark case; every callable takes the dict built by ``setup()``.

    Attributes:
        suite, size, variant: identify the case; ``size`` is a readable id (``B4096-n128-fp32``),
            ``variant`` the fastspec configuration (``auto``, ``triton``, a solver backend).
        setup: builds the inputs on the device (called once per case, through :meth:`inputs`).
        fastspec: the call being timed.
        baselines: ``{name: call}`` timed the same way in the same run.
        check: ``inputs -> {"fastspec_error": x, "baseline_error": y | None, ...}``;
            ``error_kind`` says what the numbers are (e.g. ``max rel err vs fp64``).
        claim: the :class:`Claim` that ``check``'s numbers must hold.
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
        tags: words ``--filter``/``--exclude`` also match (:func:`select`);
            :data:`HEADLINE` marks the cases the GPU kit measures first.
        row_extra: ``row -> {field: value}`` added to each timed row (e.g. a bandwidth share
            derived from a reference copy's time), or None.
        device_time: on CUDA, time every side's device work with the host's launch time hidden
            (the ``device`` clock of :mod:`fastspec.bench.timing`): for a kernel whose single
            call is host-bound but overlaps earlier work inside a training step.
    """

    suite: str
    size: str
    variant: str
    setup: Callable[[], Inputs]
    fastspec: Callable[[Inputs], Any]
    baselines: dict[str, Callable[[Inputs], Any]]
    check: Callable[[Inputs], dict[str, float | None]]
    error_kind: str
    claim: Claim
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
    device_time: bool = False

    def inputs(self) -> Inputs:
        """:attr:`setup`'s inputs, drawn from generators seeded with :data:`SEED` (torch's CPU
        and CUDA ones); the caller's generator states are restored afterwards."""
        with torch.random.fork_rng():  # CPU and every visible CUDA device
            torch.manual_seed(SEED)
            return self.setup()

    def close(self, inputs: Inputs | None) -> None:
        """Run :attr:`teardown` on ``inputs`` (nothing without either)."""
        if inputs is not None and self.teardown is not None:
            self.teardown(inputs)

    @property
    def id(self) -> str:
        """Readable id for pytest: ``B4096-n128-fp32-auto``."""
        return f"{self.size}-{self.variant}"


def select(cases: list[Case], filters: list[str] | None, excludes: list[str] | None = None) -> list[Case]:
    """Cases whose ``'suite size variant tags'`` contains any of ``filters`` (all without
    filters) and none of ``excludes`` (``fastspec bench --filter/--exclude``)."""
    def text(c: Case) -> str:
        return " ".join([c.suite, c.size, c.variant, *sorted(c.tags)])

    return [c for c in cases
            if (not filters or any(f in text(c) for f in filters))
            and not any(f in text(c) for f in excludes or ())]


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
