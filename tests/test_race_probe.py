"""benchmarks/race_probe.py: the H100 race check of the uncentred 16-bit covariance kernel, run
dry (CPU, the interpreter) for the library and for a variant that replaces its ``_gram_dot``."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "race_probe.py"
ROW = re.compile(r"^(\w+)\s+(.+?)\s+stages=(\d) BT=(\d+) split=(\d+) err\s+(\S+) torch\s+(\S+) ratio\s+\S+ (steady|MOVING)")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("variant", ["launcher", "branch"])
def test_dry_run_rows_are_exact_and_steady(variant):
    # the interpreter has no race and multiplies 16-bit values exactly in fp32: every row steady
    # and within a few times torch's own fp32 error (a variant that dropped or doubled a flushed
    # tile would be off by whole blocks, i.e. by percents)
    proc = run("--dry-run", "--one", variant)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert len(rows) == 2 and {r[0] for r in rows} == {variant}, proc.stdout
    keys = rows[0]
    assert keys[1].startswith("keys") and int(keys[3]) * 4 < 160, keys  # > 128 rows: the flush ran
    for r in rows:
        assert r[7] == "steady", r
        assert float(r[5]) <= 4 * float(r[6]) + 1e-7, r


def test_timing_needs_a_gpu_and_says_so():
    proc = run("--dry-run", "--time", "launcher")
    assert proc.returncode == 2 and "--time: needs a GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_kits_step_runs_the_library_alone_and_stops_at_its_time_limit():
    # --kit is gpu_run.py's race-probe step: the library's rows only (its time on a GPU)
    proc = run("--dry-run", "--kit", "--time-limit", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert [r[0] for r in rows] == ["launcher", "launcher"] and all(r[7] == "steady" for r in rows), proc.stdout
    # a limit already spent: no row starts, each is named, and the kit reads the step as capped
    proc = run("--dry-run", "--kit", "--time-limit", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(re.match(r"^launcher +\S.* not run: time cap reached$", ln) for ln in lines), lines


@pytest.mark.parametrize("args, message", [
    (["--time-limit", "5"], "--time-limit: expected seconds >= 0 with --kit; got 5 without --kit"),
    (["--kit", "--time-limit", "-1"], "--time-limit: expected seconds >= 0 with --kit; got -1"),
    (["--kit", "--one", "launcher"], "--kit: runs the library's rows and time itself; drop --one/--time"),
])
def test_bad_kit_arguments_are_one_line_errors(args, message):
    proc = run("--dry-run", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
