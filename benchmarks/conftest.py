"""pytest-benchmark glue for ``benchmarks/bench_*.py``: parametrization and one benchmark body.

Kept here, outside the installed ``fastspec`` package, because it needs pytest; the cases
themselves come from :func:`fastspec.bench.cases.cases`, the same ones ``fastspec bench`` runs.
A bench file marks its test with the suite and asks for the ``case``, ``side`` and
``run_benchmark`` fixtures:

    @pytest.mark.suite("eigvalsh")
    def test_eigvalsh(benchmark, case, side, run_benchmark):
        run_benchmark(benchmark, case, side)

Each case yields one test per side, ``fastspec`` and every baseline, grouped together so the
pytest-benchmark table compares them in the same run. The fastspec side also asserts the case's
accuracy claim, so the suites test the benchmark code itself when CI runs them with
``--benchmark-disable`` (every body runs once, untimed).

Size tier: ``FASTSPEC_BENCH_TIER`` (``quick``/``cpu``/``gpu``), default ``gpu`` with CUDA and
``cpu`` without.
"""
from __future__ import annotations

import contextlib
import math
import os
import re

import pytest
import torch

from fastspec.bench.accuracy import FLOOR_EPS, within_bound
from fastspec.bench.case import (
    Case,
    Inputs,
    check_tier,
    default_device,
    default_tier,
    free_memory,
)
from fastspec.bench.cases import SUITES, cases


def pytest_configure(config):
    config.addinivalue_line("markers", "suite(name): the fastspec.bench suite whose cases parametrize "
                                       "this benchmark's 'case' and 'side' arguments")


def tier_and_device() -> tuple[str, torch.device]:
    device = default_device()
    tier = os.environ.get("FASTSPEC_BENCH_TIER") or default_tier(device)
    return check_tier(tier), device


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")


def params(suite: str) -> list:
    """``pytest.param(case, side)`` for every case of ``suite``; ids like ``B64-n128-fp32-auto-fastspec``."""
    tier, device = tier_and_device()
    out = []
    for case in cases(suite, tier, device):
        for side in ["fastspec", *case.baselines]:
            marks = [pytest.mark.skip(reason=case.skip)] if case.skip else []
            out.append(pytest.param(case, side, id=f"{case.id}-{_slug(side)}", marks=marks))
    return out


def pytest_generate_tests(metafunc):
    """Parametrize ``case, side`` of a test marked ``@pytest.mark.suite(name)``."""
    marker = metafunc.definition.get_closest_marker("suite")
    if marker is None:
        return
    (suite,) = marker.args
    if suite not in SUITES:
        raise ValueError(f"pytest.mark.suite: expected one of {SUITES}, got {suite!r}")
    metafunc.parametrize("case, side", params(suite))


_last: dict[int, tuple[Case, Inputs]] = {}


def _inputs(case: Case) -> Inputs:
    """One setup per case: its sides are consecutive parameters, so keep only the last case's.

    The previous case's inputs are closed (``Case.teardown``) and freed first, as ``fastspec
    bench`` does between cases (a Probe holds its model through reference cycles: without a
    collection two 1.5B training setups would share the GPU)."""
    if id(case) not in _last:
        _close_last()
        free_memory(default_device())
        _last[id(case)] = (case, case.setup())
    return _last[id(case)][1]


def _close_last() -> None:
    for case, inputs in _last.values():
        case.close(inputs)
    _last.clear()


@pytest.fixture(scope="session", autouse=True)
def _close_the_last_case():
    yield
    _close_last()


def assert_accuracy(case: Case, errors: dict) -> None:
    """The claim each suite makes, against fp64 (see benchmarks/README.md for why these bounds)."""
    fast, base = errors["fastspec_error"], errors.get("baseline_error")
    assert fast is not None and math.isfinite(fast), f"{case.id}: fastspec error is {fast}"
    if case.suite in ("eigvalsh", "covariance", "keyrank"):
        # no worse than 2× torch in the same precision (errors are relative to scale), plus the
        # floor of fastspec.bench.accuracy.within_bound
        if case.size.endswith("-fp64"):
            # vs LAPACK fp64, which on CPU *is* torch (error 0): no "2× torch" to hold, so the
            # classical backward-stability bound n·eps64 (as tests/test_eig_host.py); an fp32
            # floor would make the fp64 claim vacuous
            n = int(re.search(r"-n(\d+)-", case.size).group(1))
            bound = 2 * (base or 0.0) + n * torch.finfo(torch.float64).eps
            assert fast <= bound, f"{case.id}: fastspec error {fast:.3g} > 2 × torch {base:.3g} + n·eps64"
        else:
            assert within_bound(fast, base), (
                f"{case.id}: fastspec error {fast:.3g} > 2 × torch {base:.3g} + {FLOOR_EPS}·eps")
    elif case.suite == "train_step":
        assert fast == 0, f"{case.id}: the probe changed the loss by {fast:.3g}"
    elif case.suite == "train_step_compiled":
        assert fast == 0, f"{case.id}: the probe changed the compiled loss by {fast:.3g}"
        # fullgraph=True raises on a break; the schedule is data on the device: no recompile
        assert errors["graph_breaks"] == 0 and errors["recompiles"] == 0, (
            f"{case.id}: {errors['graph_breaks']} graph breaks, {errors['recompiles']} recompiles")
    elif case.suite == "probe":
        from fastspec.bench.cases_probe import FAST_PR_BOUND, PR_TARGET

        if case.size.startswith("train_step-"):
            assert fast == 0, f"{case.id}: the probe changed the loss by {fast:.3g}"
        elif case.size.startswith("measure-"):  # the keyrank claim: no worse than 2× svdvals fp32
            base = errors["svdvals_fp32_pr_rel_err"]
            assert within_bound(fast, base), (
                f"{case.id}: fastspec error {fast:.3g} > 2 × svdvals fp32 {base:.3g} + {FLOOR_EPS}·eps")
        else:  # rank: parity with float64 svdvals (PR_TARGET; float32 products: looser)
            bound = FAST_PR_BOUND if case.variant.endswith("-fast") else PR_TARGET
            assert fast <= bound, f"{case.id}: PR rel err vs fp64 {fast:.3g} > {bound:g}"


def _run_benchmark(benchmark, case: Case, side: str, *, rounds: int = 5, warmup: int = 2) -> None:
    inputs = _inputs(case)
    fn = case.fastspec if side == "fastspec" else case.baselines[side]
    benchmark.group = f"{case.suite} {case.size}"
    benchmark.extra_info.update(suite=case.suite, size=case.size, variant=case.variant, side=side)
    if side == "fastspec":
        errors = case.check(inputs)
        benchmark.extra_info.update(error_kind=case.error_kind, **errors)
        assert_accuracy(case, errors)
    device = default_device()

    def call():
        fn(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()

    context = case.fastspec_context(inputs) if side == "fastspec" else contextlib.nullcontext()
    with context:
        benchmark.pedantic(call, rounds=rounds, warmup_rounds=warmup, iterations=1)


@pytest.fixture
def run_benchmark():
    """``run_benchmark(benchmark, case, side)``: set up the case (once for all its sides), check
    the fastspec side's accuracy claim, then time the side with pytest-benchmark."""
    return _run_benchmark
