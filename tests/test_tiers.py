"""The test tiers and the GPU marker of the repository's conftest.py (README: which command runs which)."""
from __future__ import annotations

import re
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
def sample(pytester):
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
    stage runs the GPU kit's dry run (slow) and the compiled captures in full."""
    readme = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(readme) if "ci-test-command" in line)
    command = readme[at + 2]  # the marker, the fence, the command (what .ci/run reads)
    assert "pytest" in command and "--full" in command.split("pytest", 1)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash -c \"$cmd\"" in ci  # the newest stage runs that command as is
    stage = ci.split("stage_gpu_stack() {", 1)[1].split("\n}\n", 1)[0]
    full = re.search(r"^GPU_STACK_FULL=\((.*)\)$", ci, re.MULTILINE).group(1).split()
    assert {"tests/test_gpu_run.py", "tests/test_probe_compile.py"} <= set(full)
    assert all((ROOT / f).is_file() for f in full)
    # the fast tier leaves those files to the full run, which names them
    assert re.search(r'-m pytest .*tests benchmarks \\\n *"\$\{GPU_STACK_FULL\[@\]/#/--ignore=\}"', stage)
    assert re.search(r'-m pytest .*--full "\$\{GPU_STACK_FULL\[@\]\}"', stage)
    # a marker expression would override the tiers and the gpu marker's skip: none anywhere
    assert not [line for line in ci.splitlines() if "-m pytest" in line and " -m " in line.split("-m pytest", 1)[1]]


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
