"""pytest set-up shared by ``tests/`` and ``benchmarks/``: the two test tiers and the GPU marker.

Tiers. ``python -m pytest -q`` runs the fast tier: every test except those marked ``slow``, so
that every capability is still checked by at least one test in a few minutes on a 2-core CPU.
``python -m pytest -q --full`` runs everything, the slow tests too; CI runs that (README.md).
A run that names tests itself (``path::test``) or selects on ``slow`` with ``-m`` gets what it
asked for.

GPU. A test that needs a CUDA device is marked ``gpu`` (``pytest.mark.gpu``, or ``pytestmark``
for a whole file) and nothing else: without CUDA it is skipped with one reason, and the GPU kit
(``benchmarks/gpu_run.py``) selects the device tests with ``-m "gpu or triton"``.

Time cap. With ``FASTSPEC_TEST_DEADLINE`` set (seconds since the epoch, as ``time.time()``), no
test starts after it: the rest are skipped as not started, and the summary says how many. The
GPU kit sets it to its tests step's cap, a grace period before it interrupts pytest, so the
interrupt no longer lands inside a running test (where an import can turn it into a failure).
Under a cap a failure's reason is also printed the moment the test fails (the last lines of
its report, ``failed now: <test>``): a run still cut before pytest's own summary (a test past
the cap that does not end in the grace period) keeps why each finished test failed.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

FULL_FLAG = "--full"
DEADLINE_ENV = "FASTSPEC_TEST_DEADLINE"
CAP_REACHED = "time cap reached"  # what the GPU kit reads as a capped step
NOT_STARTED = f"{CAP_REACHED} before this test started"

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs this file on sample tests


def pytest_addoption(parser):
    parser.addoption(FULL_FLAG, action="store_true", default=False,
                     help="run the full tier: the tests marked slow too (what CI runs)")


def _tier_is_chosen_by_user(config) -> bool:
    """The user picked tests by node id or selected on the ``slow`` marker: run what they named."""
    return (any("::" in str(a) for a in config.args)
            or "slow" in (config.getoption("markexpr", "") or ""))


def _deadline() -> float | None:
    """``FASTSPEC_TEST_DEADLINE`` as seconds since the epoch, or None when unset."""
    value = os.environ.get(DEADLINE_ENV, "")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"{DEADLINE_ENV}: expected seconds since the epoch (time.time()), "
                                f"got {value!r}") from None


FAILED_NOW = "failed now:"
FAILED_NOW_LINES = 15  # of a failure's report, printed under a cap the moment the test fails

_config = None  # pytest_runtest_logreport gets no config


def pytest_configure(config):
    global _config
    _config = config
    # read once; a bad value stops the run before the first test, in one line
    config._fastspec_deadline = _deadline()


def pytest_runtest_logreport(report):
    # the controller (pytest-xdist's too: it replays its workers' reports) prints; workers
    # have no terminal of their own
    config = _config
    if (not report.failed or config is None or config._fastspec_deadline is None
            or hasattr(config, "workerinput")):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    lines = [ln for ln in report.longreprtext.splitlines() if ln.strip()][-FAILED_NOW_LINES:]
    if getattr(reporter._tw, "width_of_current_line", 0):  # after -q's progress characters
        reporter._tw.line()
    reporter.write_line(f"{FAILED_NOW} {report.nodeid} ({report.when})")
    for ln in lines:
        reporter.write_line(f"    {ln}")


def pytest_runtest_setup(item):
    deadline = item.config._fastspec_deadline
    if deadline is not None and time.time() > deadline:
        pytest.skip(NOT_STARTED)


def pytest_collection_modifyitems(config, items):
    if not config.getoption(FULL_FLAG) and not _tier_is_chosen_by_user(config):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
            config._fastspec_slow_deselected = len(slow)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_fastspec_slow_deselected", 0)
    if n:
        terminalreporter.write_line(f"fast tier: {n} slow tests deselected; `pytest {FULL_FLAG}` runs them")
    # the skip reports (pytest-xdist's workers' too) carry the reason as (path, line, text)
    late = sum(NOT_STARTED in str(getattr(r, "longrepr", "")) for r in terminalreporter.stats.get("skipped", []))
    if late:
        terminalreporter.write_line(f"{CAP_REACHED}: {late} tests not started ({DEADLINE_ENV})")
