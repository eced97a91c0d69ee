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
