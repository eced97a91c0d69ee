"""The GPU kit's helpers (``benchmarks/gpu_run.py``): versions, profiling targets, ncu and
compute-sanitizer, each optional and probed before it is trusted.

    python benchmarks/gpu_tools.py env                       # versions and what the machine has
    python benchmarks/gpu_tools.py target eig|cov|all [--small] [--dry-run]
    python benchmarks/gpu_tools.py ncu [--time-limit S] [--dry-run]
    python benchmarks/gpu_tools.py sanitize [--time-limit S] [--dry-run]

Targets: ``eig`` = ``fastspec.eigvalsh`` of 4096 float32 128×128 power-law Gram matrices on the
CUDA solver, three launches (two warm-ups, then the one ncu profiles); ``cov`` = the keys
covariance partials launch alone (Triton), bf16 ``[B=8, H=8, T=2048, D=128]`` read through the
``[B, T, H, D]`` view, raw Gram (the ``sv`` convention), three launches. ``--small``: one launch
of each at a size a sanitizer gets through in seconds (2 matrices of 64, keys ``[1, 2, 64,
128]``). ``--dry-run``: CPU at tiny sizes (the solver's host twin, the Triton interpreter with
fp16, whose bf16 ``tl.dot`` is wrong), so the targets cannot rot where no GPU exists.

``ncu`` and ``sanitize`` first probe their tool on a one-line CUDA program (the tool may be
missing, or unable to read the hardware on this machine: "LibraryNotLoaded", "Device not
supported"); a tool that fails the probe, or fails on a target for a reason of its own, is
reported as ``<tool>: skipped: <reason>`` and the command exits 0. Only a finding exits 1: a
sanitizer error in a target (``--error-exitcode``), or a target that fails without any tool.
ncu runs with ``--clock-control none`` (locking clocks is what fails on some virtual machines,
and the kit compares against kernels timed at the clocks they really run at). Each run has its
own timeout inside ``--time-limit``; runs that no longer fit are reported as skipped. In a dry
run (or wherever the tool is unusable with ``--dry-run``) the targets run without the tool on CPU.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

SANITIZER_FINDING = 86  # compute-sanitizer --error-exitcode: a real error found in a target
PROBE_S = 60.0          # a probe's own timeout (it is cut to the time left)
TINY = "import torch; x = torch.ones(1024, device='cuda'); x.mul_(2); torch.cuda.synchronize()"


# ------------------------------------------------------------------------------------ targets
def eig(device, dry: bool, small: bool) -> None:
    import torch

    import fastspec
    from fastspec.bench.suites.eigvalsh import powerlaw_gram

    batch, n = (8, 32) if dry else (2, 64) if small else (4096, 128)
    A = powerlaw_gram(batch, n, device)
    backend = "host" if dry else "cuda"
    for _ in range(1 if small else 3):
        w = fastspec.eigvalsh(A, solver=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert w.shape == (batch, n) and bool(torch.isfinite(w).all()), "eigvalsh returned non-finite values"
    print(f"eig: {batch} × {n}×{n} fp32, backend={backend}: ok")


def cov(device, dry: bool, small: bool) -> None:
    import torch

    from fastspec.covariance.triton_update import covariance_partials_triton

    B, H, T, D = (1, 2, 32, 16) if dry else (1, 2, 64, 128) if small else (8, 8, 2048, 128)
    dtype = torch.float16 if dry else torch.bfloat16
    k = torch.randn(B, H, T, D, device=device).add_(0.5).to(dtype)
    for _ in range(1 if small else 3):
        p = covariance_partials_triton(k.transpose(1, 2), center=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert p.n.tolist() == [B * T] * H, f"rows counted {p.n.tolist()}, expected {B * T} per head"
    print(f"cov: keys [{B}, {H}, {T}, {D}] {dtype}, raw Gram: ok")


TARGETS = {"eig": eig, "cov": cov}
KERNELS = {"eig": "fastspec_eigvalsh", "cov": "_cov_partials_kernel"}


def target(names: list[str], dry: bool, small: bool) -> int:
    import torch

    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("gpu_tools.py target --dry-run: set TRITON_INTERPRET=1 (cov runs Triton on CPU)")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("gpu_tools.py target: no CUDA device (use --dry-run)")
    for name in names:
        TARGETS[name](device, dry, small)
    return 0


# ------------------------------------------------------------------------------------ tools
def _run(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, output) of ``argv``; status None when it ran past ``timeout`` (then its
    whole process group, the tool and the program under it, is killed)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
    except OSError as e:
        return 127, f"{type(e).__name__}: {e}"
    try:
        out, _ = proc.communicate(timeout=None if math.isinf(timeout) else max(timeout, 1.0))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def reason(rc: int | None, output: str) -> str:
    """One line saying why a tool run failed: its most telling output line."""
    if rc is None:
        return "timed out"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    telling = [ln for ln in lines if any(w in ln for w in ("ERR", "Error", "error", "not supported",
                                                           "LibraryNotLoaded", "failed", "Failed"))]
    last = (telling or lines or ["no output"])[-1]
    return f"rc {rc}: {last[:200]}"


def probe_ok(tool: str, rc: int | None, output: str) -> bool:
    """Whether a probe run shows ``tool`` working (not merely exiting 0)."""
    if rc != 0:
        return False
    if tool == "ncu":
        return "gpu__time_duration" in output
    return "ERROR SUMMARY: 0 errors" in output


def classify(tool: str, rc: int | None, output: str) -> tuple[str, str]:
    """(status, detail) of one tool run on a target: ``ok``, ``finding`` (a sanitizer error, or
    an assertion of the target itself) or ``skipped`` (the tool failed for its own reasons)."""
    if rc == 0:
        return "ok", ""
    if tool == "compute-sanitizer" and rc == SANITIZER_FINDING:
        return "finding", reason(rc, output)
    if "AssertionError" in output:
        return "finding", reason(rc, output)
    return "skipped", reason(rc, output)


class Clock:
    def __init__(self, limit: float | None):
        self.end = None if limit is None else time.monotonic() + limit

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()


def _tool_argv(tool: str, mode: str, names: list[str] | None) -> list[str]:
    """The tool's command line: probe (``names`` None) or a profile/check of targets."""
    me = os.path.abspath(__file__)
    if tool == "ncu":
        if names is None:
            return ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "-c", "1",
                    sys.executable, "-c", TINY]
        (name,) = names
        return ["ncu", "--set", "full", "--clock-control", "none", "--kernel-name", f"regex:{KERNELS[name]}",
                "--launch-skip", "2", "--launch-count", "1", sys.executable, me, "target", name]
    # --report-api-errors no: a failed host API call is no kernel memory error; on the first GPU run
    # (H200, 2026-11-26) every one of memcheck's 34 "errors" was cuda-bindings probing driver entry
    # points with cuGetProcAddress (CUDA_ERROR_INVALID_VALUE) while it loaded, none in a kernel
    base = ["compute-sanitizer", "--tool", mode, "--report-api-errors", "no",
            "--error-exitcode", str(SANITIZER_FINDING)]
    if names is None:
        return base + [sys.executable, "-c", TINY]
    return base + [sys.executable, me, "target", *names, "--small"]


def use_tool(tool: str, runs: list[tuple[str, list[str]]], dry: bool, limit: float | None) -> int:
    """Probe ``tool``, then each ``(mode, targets)`` run under it; exit status as the module says."""
    clock = Clock(limit)
    why = None
    if shutil.which(tool) is None:
        why = f"{tool} not found on PATH"
    else:
        t0 = time.monotonic()
        rc, out = _run(_tool_argv(tool, runs[0][0], None), min(PROBE_S, clock.left()))
        print(f"----- {tool} probe (rc {rc}, {time.monotonic() - t0:.1f} s)\n{out[-3000:]}", flush=True)
        if not probe_ok(tool, rc, out):
            why = f"probe failed: {reason(rc, out)}"
    status = 0
    if why is not None:
        print(f"{tool}: skipped: {why}", flush=True)
        if dry:  # nothing to profile here: rehearse the targets themselves, so they cannot rot
            names = sorted({n for _, names in runs for n in names})
            rc, out = _run([sys.executable, os.path.abspath(__file__), "target", *names, "--dry-run"],
                           clock.left())
            print(out, flush=True)
            if rc != 0:
                print(f"{tool}: targets FAILED without the tool: {reason(rc, out)}", flush=True)
                status = 1
        return status
    for i, (mode, names) in enumerate(runs):
        label = f"{tool} {mode} {'+'.join(names)}"
        if clock.left() < 5:
            print(f"{label}: skipped: time cap reached", flush=True)
            continue
        # an equal share of what is left for each run still to come: a slow first one cannot
        # starve the others; the seconds each took say where a capped step's time went
        t0, share = time.monotonic(), clock.left() / (len(runs) - i)
        rc, out = _run(_tool_argv(tool, mode, names), share)
        print(f"----- {label} (rc {rc}, {time.monotonic() - t0:.1f} s of {share:.0f})\n{out[-20000:]}", flush=True)
        state, detail = classify(tool, rc, out)
        print(f"{label}: {state}{': ' + detail if detail else ''}", flush=True)
        status |= state == "finding"
    return int(status)


def ncu(dry: bool, limit: float | None) -> int:
    # the keys covariance first: its HBM share is the open question (22% on the H100, 2026-11-27)
    return use_tool("ncu", [("full", ["cov"]), ("full", ["eig"])], dry, limit)


def sanitize(dry: bool, limit: float | None) -> int:
    return use_tool("compute-sanitizer", [("memcheck", ["eig", "cov"]), ("racecheck", ["eig", "cov"])],
                    dry, limit)


# ------------------------------------------------------------------------------------ env
def env() -> int:
    """Versions of everything the numbers depend on, and which tools exist."""
    def first_line(argv: list[str], pick: int = -1) -> str:
        rc, out = _run(argv, 20)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        return lines[pick].strip() if rc == 0 and lines else f"unavailable ({reason(rc, out)})"

    if shutil.which("nvidia-smi") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem"
        print("gpu:", first_line(["nvidia-smi", query, "--format=csv,noheader"], 0))
    else:
        print("gpu: nvidia-smi not used (dry run or not found)")
    for tool, args in (("nvcc", ["--version"]), ("ncu", ["--version"]), ("compute-sanitizer", ["--version"])):
        print(f"{tool}:", first_line([tool, *args]) if shutil.which(tool) else "not found")
    print("python", platform.python_version(), sys.executable)
    for name in ("torch", "triton", "numpy", "transformers", "cupy", "jax", "cuda.bindings", "pybind11", "setuptools"):
        try:
            print(name, importlib.import_module(name).__version__)
        except Exception as e:  # noqa: BLE001 - a version line, whatever went wrong
            print(name, "not importable:", type(e).__name__, str(e)[:120])
    import torch

    print("torch CUDA", torch.version.cuda, "| device:",
          torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible")
    from fastspec.cli import main as fastspec_main

    return fastspec_main(["info"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    t = sub.add_parser("target")
    t.add_argument("names", nargs="+", choices=[*TARGETS, "all"])
    t.add_argument("--small", action="store_true")
    t.add_argument("--dry-run", action="store_true")
    for name in ("ncu", "sanitize"):
        s = sub.add_parser(name)
        s.add_argument("--time-limit", type=float, default=None)
        s.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "env":
        return env()
    if args.cmd == "target":
        names = list(TARGETS) if "all" in args.names else list(dict.fromkeys(args.names))
        return target(names, args.dry_run, args.small)
    return (ncu if args.cmd == "ncu" else sanitize)(args.dry_run, args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
