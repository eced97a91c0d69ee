"""pytest set-up shared by ``tests/`` and ``benchmarks/``: the two test tiers and the GPU marker.

Tiers. ``python -m pytest -q`` runs the fast tier: every test except those marked ``slow``, so
that every capability is still checked by at least one test in a few minutes on a 2-core CPU.
``python -m pytest -q --full`` runs everything, the slow tests too; CI runs that (README.md).
A run that names tests itself (``path::test``) or selects on ``slow`` with ``-m`` gets what it
asked for.

GPU. A test that needs a CUDA device is marked ``gpu`` (``pytest.mark.gpu``, or ``pytestmark``
for a whole file) and nothing else: without CUDA it is skipped with one reason, and the GPU kit
(``benchmarks/gpu_run.py``) selects the device tests with ``-m "(gpu or triton) and not sm90"``.

Time cap. With ``FASTSPEC_TEST_DEADLINE`` set (seconds since the epoch, as ``time.time()``), no
test starts after it: the rest are skipped as not started, and the summary says how many. The
GPU kit sets it to its tests step's cap, a grace period before it interrupts pytest, so the
interrupt no longer lands inside a running test (where an import can turn it into a failure).
Under a cap a failure's reason is also printed the moment the test fails (the last lines of
its report, ``failed now: <test>``): a run still cut before pytest's own summary (a test past
the cap that does not end in the grace period) keeps why each finished test failed.

Workers. With pytest-xdist installed (the ``test`` extra has it), a run that does not choose
for itself is spread over the machine's cores, one worker per core up to :data:`MAX_WORKERS`, a
module's tests on one worker (``--dist loadscope``: a module-scoped fixture, such as a dry run
that several tests read, is built once, not once per worker; the fast tier took 263 s so on 2
cores, 279 s with its tests dealt out one by one). It stays in one process where workers would
not pay or cannot work: a CUDA device is visible (the GPU tests share it and time it; the GPU kit
passes its own ``-n``), tests are named by node id, ``-s``, ``--pdb`` or ``--collect-only``.
``-n N`` (``-n 0``: one process) or ``FASTSPEC_TEST_WORKERS=N`` chooses. Each worker runs torch
on its share of the cores (and so do its child processes, through ``OMP_NUM_THREADS``), and
compiles into caches of its own (TorchInductor, Triton, fastspec's NVRTC kernels: the folder
each would use, plus ``xdist-gwN``), so that no test sees another's cache. A test that cannot
share the machine (it fills the cores itself, or times a subprocess against a cap) is marked
``serial``: no other test runs while it does (a lock every test holds, shared by ordinary
tests, exclusive for a serial one).

Times. With ``FASTSPEC_TEST_TIMES`` set to a file, each test's seconds (set-up, call and
teardown) are appended to it as ``seconds<TAB>node id`` lines when the run ends, then the run's
own seconds (from this file's ``pytest_configure`` on) as ``seconds<TAB><pytest run>``:
``.ci/run`` sums them into its closing table. Only that run's tests: the variable is taken out
of the environment, so the pytest runs that its tests start do not add theirs.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

FULL_FLAG = "--full"
DEADLINE_ENV = "FASTSPEC_TEST_DEADLINE"
CAP_REACHED = "time cap reached"  # what the GPU kit reads as a capped step
NOT_STARTED = f"{CAP_REACHED} before this test started"
WORKERS_ENV = "FASTSPEC_TEST_WORKERS"
MAX_WORKERS = 8  # each worker holds its own torch, models and compile caches (~1-2 GB)
SERIAL_LOCK = "fastspec_serial_lock"  # workerinput key: the lock file every worker shares
WORKER_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FASTSPEC_CACHE")
TIMES_ENV = "FASTSPEC_TEST_TIMES"  # a file: each test's seconds are appended to it (.ci/run's summary)
RUN_LINE = "<pytest run>"  # the node id of the line with the whole run's seconds

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs this file on sample tests


def pytest_addoption(parser):
    parser.addoption(FULL_FLAG, action="store_true", default=False,
                     help="run the full tier: the tests marked slow too (what CI runs)")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _workers(config) -> int:
    """How many xdist workers a run that did not pass ``-n`` gets (0: none, one process)."""
    value = os.environ.get(WORKERS_ENV, "")
    if value:
        if not value.isdigit():
            raise pytest.UsageError(f"{WORKERS_ENV}: expected a number of workers (0: one process), got {value!r}")
        return int(value)
    if (torch.cuda.is_available() or config.getoption("usepdb", False) or config.getoption("collectonly", False)
            or config.getoption("capture", "fd") == "no" or _names_tests(config)):
        return 0
    n = min(_cores(), MAX_WORKERS)
    return n if n > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # before xdist's own hook reads -n; never inside a worker (it has its own run to do)
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if getattr(config.option, "numprocesses", None) is not None or getattr(config.option, "tx", None):
        return  # the user chose: -n N (-n 0 is one process), or --tx
    n = _workers(config)
    if n:
        config.option.numprocesses = n
        if config.option.dist == "no":
            config.option.dist = "loadscope"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, in the controller: every worker gets the one lock file of this run."""
    lock = getattr(node.config, "_fastspec_serial_lock", None)
    if lock is None:
        folder = tempfile.mkdtemp(prefix="fastspec-serial-")
        lock = node.config._fastspec_serial_lock = os.path.join(folder, "lock")
        Path(lock).touch()
    node.workerinput[SERIAL_LOCK] = lock


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist, in the controller: the fast tier's deselection happened in the workers (each
    collects every test): keep their count for the summary."""
    n = getattr(node, "workeroutput", {}).get("slow_deselected", 0)
    config = node.config
    config._fastspec_slow_deselected = max(n, getattr(config, "_fastspec_slow_deselected", 0))


def _configure_worker() -> None:
    """In an xdist worker: torch on this worker's share of the cores, compile caches of its own."""
    worker = os.environ["PYTEST_XDIST_WORKER"]
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, _cores() // count)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # its child processes' share too
    from fastspec.eig import nvrtc

    defaults = {  # the folder each library uses when its variable is unset
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"),
        "TRITON_CACHE_DIR": os.path.join(os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache"),
        "FASTSPEC_CACHE": str(nvrtc.cache_dir().parent),  # nvrtc's folder is $FASTSPEC_CACHE/eig
    }
    for var in WORKER_CACHES:
        os.environ[var] = os.path.join(os.environ.get(var) or defaults[var], f"xdist-{worker}")


def _user() -> str:
    import getpass
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container's uid): any fixed name serves, the
        return "unknown"  # folder below it is the worker's own (inductor's own rule needs its ~1 s import)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (its fixtures' set-up and teardown included) holds the run's lock:
    shared for an ordinary test, exclusive for a ``serial`` one."""
    path = getattr(item.config, "workerinput", {}).get(SERIAL_LOCK)
    if path is None:
        yield
        return
    with _lock_held(path, exclusive=item.get_closest_marker("serial") is not None):
        yield


@contextlib.contextmanager
def _lock_held(path: str, exclusive: bool):
    """A readers-writer lock on ``path`` (flock) with a turnstile, so that a serial test waiting
    for the ordinary ones to finish is not starved by the next ones the other workers start."""
    import fcntl  # POSIX only: xdist runs of this suite are Linux's

    with open(path + ".turnstile", "a") as turnstile, open(path) as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)  # let the next test in
            yield
        finally:  # closing the files releases both locks; said here for the reader
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def _names_tests(config) -> bool:
    """The run names its tests by node id (``file.py::test``)."""
    return any("::" in str(a) for a in config.args)


def _tier_is_chosen_by_user(config) -> bool:
    """The user picked tests by node id or selected on the ``slow`` marker: run what they named."""
    return _names_tests(config) or "slow" in (config.getoption("markexpr", "") or "")


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
    if os.environ.get("PYTEST_XDIST_WORKER") and hasattr(config, "workerinput"):
        _configure_worker()
    # this run's times only: not the runs its tests start (subprocesses, pytester), nor its workers
    # (the controller records their reports)
    times = os.environ.pop(TIMES_ENV, None)
    config._fastspec_times = {} if times and not hasattr(config, "workerinput") else None
    config._fastspec_times_path = times
    config._fastspec_t0 = time.monotonic()


def pytest_unconfigure(config):
    lock = getattr(config, "_fastspec_serial_lock", None)
    if lock is not None:
        import shutil
        shutil.rmtree(os.path.dirname(lock), ignore_errors=True)
    times = getattr(config, "_fastspec_times", None)
    if times is not None:
        with open(config._fastspec_times_path, "a") as f:
            f.writelines(f"{seconds:.3f}\t{nodeid}\n" for nodeid, seconds in times.items())
            f.write(f"{time.monotonic() - config._fastspec_t0:.3f}\t{RUN_LINE}\n")


def pytest_runtest_logreport(report):
    # the controller (pytest-xdist's too: it replays its workers' reports) prints; workers
    # have no terminal of their own
    config = _config
    times = getattr(config, "_fastspec_times", None)
    if times is not None:  # set-up, call and teardown
        times[report.nodeid] = times.get(report.nodeid, 0.0) + report.duration
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
            if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the count
                config.workeroutput["slow_deselected"] = len(slow)
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
