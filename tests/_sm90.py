"""Run a test's sm_90 compile script in a fresh process and return what it printed.

The Triton kernels' tests compile them for sm_90 with the wheel's ptxas (the interpreter misses
compile errors and says nothing of registers, spills or instructions). The compile runs in a
child process, with the interpreter off, so that it sees none of the test process's Triton
settings; the script prints one JSON line last (``benchmarks/sass.py`` compiles and reads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_for_sm90(script: str, timeout: float = 600) -> dict:
    """``script``'s last stdout line as JSON; skips where Triton has no NVIDIA backend or ships
    no cuobjdump, fails with the script's stderr where it exits non-zero."""
    pytest.importorskip("triton.backends.nvidia")
    from fastspec.bench.cubin import triton_tool

    if triton_tool("cuobjdump") is None:
        pytest.skip("triton's nvidia backend ships no cuobjdump")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
