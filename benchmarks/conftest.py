"""pytest-benchmark glue for ``benchmarks/bench_*.py``: parametrization and one benchmark body.

Kept here, outside the installed ``fastspec`` package, because it needs pytest; the cases
themselves come from :func:`fastspec.bench.suites.cases`, the same ones ``fastspec bench`` runs.
A bench file marks its test with the suite and asks for the ``case``, ``side`` and
``run_benchmark`` fixtures:

    @pytest.mark.suite("eigvalsh")
    def test_eigvalsh(benchmark, case, side, run_benchmark):
        run_benchmark(benchmark, case, side)

Each case yields one test per side, ``fastspec`` and every baseline, grouped together so the
pytest-benchmark table compares them in the same run. The fastspec side also asserts the case's
accuracy claim (:meth:`fastspec.bench.case.Claim.violated`, the rule ``fastspec bench`` applies
too), so the suites test the benchmark code itself when CI runs them with
``--benchmark-disable`` (every body runs once, untimed).

Size tier: ``FASTSPEC_BENCH_TIER`` (``quick``/``cpu``/``gpu``) when set. Otherwise ``quick`` for
checks in the fast test tier (untimed, without ``--full``: the default ``python -m pytest``), and
for timed runs (``--benchmark-enable``) and the full tier (``--full``, what CI runs) the device's
own: ``gpu`` with CUDA, ``cpu`` without.
"""
from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

from fastspec.bench.case import (
    Case,
    Inputs,
    check_tier,
    default_device,
    default_tier,
    free_memory,
)
from fastspec.bench.suites import SUITES, cases


def pytest_configure(config):
    config.addinivalue_line("markers", "suite(name): the fastspec.bench suite whose cases parametrize "
                                       "this benchmark's 'case' and 'side' arguments")


def tier_and_device(config: pytest.Config) -> tuple[str, torch.device]:
    """The size tier and device of this run (module docstring)."""
    device = default_device()
    tier = os.environ.get("FASTSPEC_BENCH_TIER")
    if not tier:
        untimed = config.getoption("benchmark_disable") and not config.getoption("benchmark_enable")
        fast_tier = not config.getoption("--full")
        tier = "quick" if untimed and fast_tier else default_tier(device)
    return check_tier(tier), device


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")


def params(suite: str, config: pytest.Config) -> list:
    """``pytest.param(case, side)`` for every case of ``suite``; ids like ``B64-n128-fp32-auto-fastspec``."""
    tier, device = tier_and_device(config)
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
    metafunc.parametrize("case, side", params(suite, metafunc.config))


_last: dict[int, tuple[Case, Inputs]] = {}


def _inputs(case: Case) -> Inputs:
    """One setup per case: its sides are consecutive parameters, so keep only the last case's.

    The previous case's inputs are closed (``Case.teardown``) and freed first, as ``fastspec
    bench`` does between cases (a Probe holds its model through reference cycles: without a
    collection two 1.5B training setups would share the GPU)."""
    if id(case) not in _last:
        _close_last()
        free_memory(default_device())
        _last[id(case)] = (case, case.inputs())
    return _last[id(case)][1]


def _close_last() -> None:
    for case, inputs in _last.values():
        case.close(inputs)
    _last.clear()


@pytest.fixture(scope="session", autouse=True)
def _close_the_last_case():
    yield
    _close_last()


def assert_claim(case: Case, errors: dict) -> None:
    """The accuracy the case claims (``case.claim``, set where its suite builds it; see
    benchmarks/README.md for why these bounds)."""
    violation = case.claim.violated(errors)
    assert violation is None, f"{case.id}: {violation}"


def _run_benchmark(benchmark, case: Case, side: str, *, rounds: int = 5, warmup: int = 2) -> None:
    inputs = _inputs(case)
    fn = case.fastspec if side == "fastspec" else case.baselines[side]
    benchmark.group = f"{case.suite} {case.size}"
    benchmark.extra_info.update(suite=case.suite, size=case.size, variant=case.variant, side=side)
    if side == "fastspec":
        errors = case.check(inputs)
        benchmark.extra_info.update(error_kind=case.error_kind, claim=case.claim.text, **errors)
        assert_claim(case, errors)
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
