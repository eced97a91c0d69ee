"""The test tiers and the GPU marker of the repository's conftest.py (README: which command runs which)."""
from __future__ import annotations

import itertools
import os
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

def test_fast():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.gpu
def test_on_the_device():
    import torch
    assert torch.cuda.is_available()
"""


@pytest.fixture
def sample(pytester, monkeypatch):
    monkeypatch.setenv("FASTSPEC_TEST_WORKERS", "0")  # one process: these tests count its outcomes
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n    gpu: device\n")
    pytester.makepyfile(test_sample=SAMPLE)
    return pytester


def _gpu_outcome() -> dict:
    import torch
    return {"passed": 1} if torch.cuda.is_available() else {"skipped": 1}


def test_default_run_is_the_fast_tier(sample):
    res = sample.runpytest("-p", "no:cacheprovider")
    gpu = _gpu_outcome()
    res.assert_outcomes(passed=1 + gpu.get("passed", 0), skipped=gpu.get("skipped", 0), deselected=1)
    res.stdout.fnmatch_lines(["*1 slow tests deselected; `pytest --full` runs them*"])


def test_full_runs_the_slow_tests_too(sample):
    res = sample.runpytest("-p", "no:cacheprovider", "--full")
    gpu = _gpu_outcome()
    res.assert_outcomes(passed=2 + gpu.get("passed", 0), skipped=gpu.get("skipped", 0))


@pytest.mark.parametrize("args", [["test_sample.py::test_slow"], ["-m", "slow"]])
def test_naming_or_selecting_a_slow_test_runs_it(sample, args):
    res = sample.runpytest("-p", "no:cacheprovider", *args)
    res.assert_outcomes(passed=1)


def test_no_test_starts_past_the_deadline_and_the_summary_counts_them(sample, monkeypatch):
    """``FASTSPEC_TEST_DEADLINE`` (the GPU kit's tests step sets it to its cap): every test not
    started by then is skipped as such, and one summary line counts them ("time cap reached" is
    what the kit reads as a capped step)."""
    import time

    monkeypatch.setenv("FASTSPEC_TEST_DEADLINE", f"{time.time() - 1:.3f}")
    res = sample.runpytest("-p", "no:cacheprovider", "--full", "-rs")
    res.assert_outcomes(skipped=3)
    late = 3 - _gpu_outcome().get("skipped", 0)  # without CUDA the gpu test is skipped before it starts
    res.stdout.fnmatch_lines([f"time cap reached: {late} tests not started (FASTSPEC_TEST_DEADLINE)"])
    res.stdout.fnmatch_lines([f"SKIPPED [[]{late}[]] conftest.py:*: time cap reached before this test started"])
    monkeypatch.setenv("FASTSPEC_TEST_DEADLINE", f"{time.time() + 600:.3f}")
    res = sample.runpytest("-p", "no:cacheprovider", "--full")
    gpu = _gpu_outcome()
    res.assert_outcomes(passed=2 + gpu.get("passed", 0), skipped=gpu.get("skipped", 0))
    assert "tests not started" not in res.stdout.str()


def test_under_a_deadline_a_failure_is_printed_when_it_happens(pytester, monkeypatch):
    """The GPU kit's tests step can be cut before pytest's summary: each failure's last report
    lines are printed as the test fails, before the next test starts, and only under a cap."""
    import time

    monkeypatch.setenv("FASTSPEC_TEST_WORKERS", "0")

    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_two="""
def test_breaks():
    kernel, torch_err = 3.5e-06, 1.3e-07
    assert kernel <= 4 * torch_err, f"second moment: kernel {kernel:.3g} vs torch {torch_err:.3g}"

def test_after():
    print("the next test ran")
""")
    monkeypatch.setenv("FASTSPEC_TEST_DEADLINE", f"{time.time() + 600:.3f}")
    res = pytester.runpytest("-p", "no:cacheprovider", "-s", "-q")
    res.assert_outcomes(failed=1, passed=1)
    out = res.stdout.lines
    first = next(i for i, ln in enumerate(out) if ln.startswith("failed now: test_two.py::test_breaks (call)"))
    reason = next(i for i, ln in enumerate(out) if "AssertionError: second moment: kernel 3.5e-06 vs torch 1.3e-07" in ln)
    assert first < reason < next(i for i, ln in enumerate(out) if "the next test ran" in ln)
    monkeypatch.delenv("FASTSPEC_TEST_DEADLINE")
    res = pytester.runpytest("-p", "no:cacheprovider", "-q")
    assert "failed now:" not in res.stdout.str()


def test_a_deadline_that_is_no_time_is_a_one_line_usage_error(sample, monkeypatch):
    monkeypatch.setenv("FASTSPEC_TEST_DEADLINE", "in ten minutes")
    res = sample.runpytest("-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    expected = "*FASTSPEC_TEST_DEADLINE: expected seconds since the epoch (time.time()), got 'in ten minutes'"
    res.stderr.fnmatch_lines([expected])
    assert "Traceback" not in res.stderr.str()


WORKERS_SAMPLE = """
import json, os, subprocess, sys, time
import pytest, torch

def _log(name):
    t0 = time.monotonic()
    time.sleep(0.3)
    with open(os.path.join(LOGS, name + ".json"), "w") as f:
        json.dump({"start": t0, "end": time.monotonic(), "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                   "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                   "caches": [os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                                          "FASTSPEC_CACHE")]}, f)

@pytest.mark.parametrize("i", range(6))
def test_ordinary(i):
    _log(f"ordinary{i}")

@pytest.mark.serial
@pytest.mark.parametrize("i", range(2))
def test_serial(i):
    _log(f"serial{i}")

@pytest.mark.slow
def test_slow():
    pass

def test_child_process():  # the pytest runs a test starts do not add their times to the run's
    code = "import os; print(os.environ.get('FASTSPEC_TEST_TIMES'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "None"
"""
SAMPLE_RAN = (["test_workers.py::test_child_process"] + [f"test_workers.py::test_ordinary[{i}]" for i in range(6)]
              + [f"test_workers.py::test_serial[{i}]" for i in range(2)])  # the fast tier: not test_slow


@pytest.fixture
def workers_sample(pytester, monkeypatch, tmp_path):
    """The sample above, run by the repository's conftest.py in a child pytest process; its
    tests log what they saw to ``logs``, and the run's times go to ``times`` (which already
    holds a line: appended to, not replaced)."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n    gpu: device\n    serial: alone\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    pytester.makepyfile(test_workers=f"LOGS = {str(logs)!r}\n" + WORKERS_SAMPLE)
    times = tmp_path / "times.tsv"
    times.write_text("1.000\tfrom before\n")
    monkeypatch.setenv("FASTSPEC_TEST_TIMES", str(times))
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "OMP_NUM_THREADS", "FASTSPEC_TEST_WORKERS"):
        monkeypatch.delenv(var, raising=False)  # this test may itself run in a worker
    return types.SimpleNamespace(pytester=pytester, logs=logs, times=times)


def _logs(logs) -> dict:
    import json
    return {p.stem: json.loads(p.read_text()) for p in logs.glob("*.json")}


def _times(times, ran: list[str], wall_at_least: float) -> None:
    """FASTSPEC_TEST_TIMES: the line that was there, one line per test that ran (set-up, call and
    teardown), then one for the whole run."""
    lines = [ln.split("\t") for ln in times.read_text().splitlines()]
    assert lines[0] == ["1.000", "from before"]
    assert sorted(nodeid for _, nodeid in lines[1:-1]) == sorted(ran)
    seconds = {nodeid: float(t) for t, nodeid in lines[1:]}
    assert all(seconds[n] >= 0.3 for n in ran if "ordinary" in n or "serial" in n)  # each sleeps 0.3 s
    assert lines[-1][1] == "<pytest run>" and seconds["<pytest run>"] >= wall_at_least


@pytest.mark.serial  # its timings of the sample's tests must not share the machine
def test_workers_share_the_cores_keep_their_caches_and_serial_tests_run_alone(workers_sample, monkeypatch):
    """Two workers (``FASTSPEC_TEST_WORKERS=2``, as a 2-core machine gets by default): each runs
    torch on one core and compiles into caches of its own; a ``serial`` test overlaps no other
    test; the fast tier's summary line still counts the slow tests the workers deselected; every
    test's time is recorded, the run's too."""
    w = workers_sample
    monkeypatch.setenv("FASTSPEC_TEST_WORKERS", "2")
    # one test at a time to each worker: by default a module's tests share one (--dist loadscope)
    res = w.pytester.runpytest_subprocess("-p", "no:cacheprovider", "--dist", "load")
    res.assert_outcomes(passed=9)
    res.stdout.fnmatch_lines(["*1 slow tests deselected; `pytest --full` runs them*"])
    got = _logs(w.logs)
    assert len(got) == 8 and {g["worker"] for g in got.values()} == {"gw0", "gw1"}
    cores = len(os.sched_getaffinity(0))
    assert {(g["threads"], g["omp"]) for g in got.values()} == {(max(1, cores // 2), str(max(1, cores // 2)))}
    for g in got.values():
        assert all(c.endswith(f"xdist-{g['worker']}") for c in g["caches"]), g["caches"]
    assert got["serial0"]["caches"][2] in (str(Path(os.environ["FASTSPEC_CACHE"]) / "xdist-gw0"),
                                          str(Path(os.environ["FASTSPEC_CACHE"]) / "xdist-gw1"))
    for name in ("serial0", "serial1"):
        s = got[name]
        overlapping = [k for k, g in got.items() if k != name and g["start"] < s["end"] and s["start"] < g["end"]]
        assert not overlapping, (name, overlapping)
    # the ordinary ones did run side by side (else the check above proves nothing)
    ordinary = sorted((g["start"], g["end"]) for k, g in got.items() if k.startswith("ordinary"))
    assert any(b[0] < a[1] for a, b in itertools.pairwise(ordinary))
    _times(w.times, SAMPLE_RAN, wall_at_least=5 * 0.3)  # 6 x 0.3 s side by side, 2 alone


@pytest.mark.parametrize("how", [["-n", "0"], ["test_workers.py::test_ordinary"], ["-s"]])
def test_one_process_when_asked_or_when_naming_tests(workers_sample, how):
    """``-n 0``, a run naming its tests by node id, and ``-s`` stay in one process (no cores
    given to anyone: torch keeps its own thread count); the times are recorded as with workers."""
    w = workers_sample
    res = w.pytester.runpytest_subprocess("-p", "no:cacheprovider", *how)
    ran = [n for n in SAMPLE_RAN if "test_ordinary" in n] if "::" in how[0] else SAMPLE_RAN
    res.assert_outcomes(passed=len(ran))
    assert {g["worker"] for g in _logs(w.logs).values()} == {None}
    _times(w.times, ran, wall_at_least=0.3 * (len(ran) - 1))


def test_a_worker_count_that_is_no_number_is_a_one_line_usage_error(workers_sample, monkeypatch):
    monkeypatch.setenv("FASTSPEC_TEST_WORKERS", "two")
    res = workers_sample.pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*FASTSPEC_TEST_WORKERS: expected a number of workers (0: one process), got 'two'"])
    assert "Traceback" not in res.stderr.str()


def test_gpu_tests_are_marked_one_way_and_slow_is_used():
    """A GPU-only test is ``mark.gpu``, never its own ``skipif(not torch.cuda.is_available())``
    (the GPU kit selects on the marker, and would miss it); the ``slow`` marker is in use."""
    files = sorted((ROOT / "tests").glob("test_*.py")) + sorted((ROOT / "benchmarks").glob("bench_*.py"))
    files = [f for f in files if f.name != Path(__file__).name]  # (its sample has both)
    own_skip = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    assert not [f.name for f in files if own_skip.search(f.read_text())]
    assert any("mark.slow" in f.read_text() for f in files)


def test_ci_runs_the_full_tier_and_the_kit_dry_run_under_the_gpu_stack():
    """CI runs README's test command, which must ask for ``--full`` (every slow test runs once, on
    the newest packages); the stages of .ci/run run the fast tier or more, and the GPU machines'
    stage runs the GPU kit's dry run (slow), the compiled captures and every module whose Triton
    kernels are compiled for sm_90 (a slow test: what the GPU machines' Triton makes of them) in full."""
    readme = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(readme) if "ci-test-command" in line)
    command = readme[at + 2]  # the marker, the fence, the command (what .ci/run reads)
    assert "pytest" in command and "--full" in command.split("pytest", 1)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash -c \"$cmd\"" in ci  # the newest stage runs that command as is
    stage = ci.split("stage_gpu_stack() {", 1)[1].split("\n}\n", 1)[0]
    full = re.search(r"^GPU_STACK_FULL=\(([^)]*)\)", ci, re.MULTILINE).group(1).split()
    assert {"tests/test_gpu_run.py", "tests/test_probe_compile.py"} <= set(full)
    assert all((ROOT / f).is_file() for f in full)
    sm90 = {f"tests/{f.name}" for f in (ROOT / "tests").glob("test_*.py")
            if f.name != Path(__file__).name and "from _sm90 import compiled_for_sm90" in f.read_text()}
    assert sm90 and sm90 <= set(full), sm90 - set(full)
    # the fast tier leaves those files to the full run, which names them
    assert re.search(r'-m pytest .*tests benchmarks \\\n *"\$\{GPU_STACK_FULL\[@\]/#/--ignore=\}"', stage)
    assert re.search(r'-m pytest .*--full .*"\$\{GPU_STACK_FULL\[@\]\}"', stage)
    # a marker expression would override the tiers and the gpu marker's skip: none anywhere
    assert not [line for line in ci.splitlines() if "-m pytest" in line and " -m " in line.split("-m pytest", 1)[1]]


def test_ci_ends_with_each_failed_stage_and_why(tmp_path):
    """CI's log is read from its end: a stage that fails (here the oldest one, its virtual
    environment refused for want of disk, as a full disk refuses the gpu-stack's ~5 GB of CUDA
    torch) is named in the last lines with the error it printed and the disk space left then."""
    import shutil
    import subprocess
    import sys

    (tmp_path / ".ci").mkdir()
    for name in (".ci/run", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # refuses `-m venv` as a full disk does; runs the rest (the closing table)
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
                    '  echo "WARNING: Location \'file:///opt/x/\' is ignored: it is neither a file nor a directory." >&2\n'
                    '  echo "Error: [Errno 28] No space left on device: \'$3/bin\'" >&2; exit 1\n'
                    "fi\n"
                    f'exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CI_STAGES": "oldest",
           "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    last = res.stdout.rstrip().splitlines()[-1]
    assert last.startswith("  why oldest: Error: [Errno 28] No space left on device"), res.stdout
    assert re.search(r"\[\d+\.\d GB free on /\S*\]$", last), last
    assert "=== CI: oldest in" in res.stdout and "failed: oldest" in res.stdout
    assert not list(tmp_path.glob("fastspec-ci.*"))  # its scratch folder, logs included, is gone


def _bench_conftest():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_bench_conftest", ROOT / "benchmarks" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Config:
    def __init__(self, **options):
        self.options = {"benchmark_disable": True, "benchmark_enable": False, "--full": False, **options}

    def getoption(self, name):
        return self.options[name]


@pytest.mark.parametrize("options, env, expected", [
    ({}, None, "quick"),                               # the fast tier checks at quick sizes
    ({"--full": True}, None, "device"),                # CI: the device's own tier (cpu here)
    ({"benchmark_enable": True}, None, "device"),      # timing: never the quick sizes unasked
    ({"benchmark_disable": False}, None, "device"),
    ({"--full": True}, "quick", "quick"),              # FASTSPEC_BENCH_TIER wins
    ({}, "cpu", "cpu"),
])
def test_benchmark_size_tier_follows_the_test_tier(monkeypatch, options, env, expected):
    from fastspec.bench.case import default_device, default_tier

    if env is None:
        monkeypatch.delenv("FASTSPEC_BENCH_TIER", raising=False)
    else:
        monkeypatch.setenv("FASTSPEC_BENCH_TIER", env)
    tier, device = _bench_conftest().tier_and_device(_Config(**options))
    assert tier == (default_tier(default_device()) if expected == "device" else expected)
