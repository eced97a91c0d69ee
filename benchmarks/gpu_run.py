"""The offline GPU kit: fastspec measured on an H100/H200 in two capped commands, 13 minutes.

    python benchmarks/gpu_run.py 1 OUT          # headline numbers (first 4 minutes), covariance route race, eigensolver race and phases, race probe, every kernel's self-check, GPU tests
    python benchmarks/gpu_run.py 2 OUT          # Triton config race, profiles, every other size, training steps, Nsight Compute
    python benchmarks/gpu_run.py 3 OUT          # extra, when the lease has time left: key rank, sanitizers, compiled step
    python benchmarks/gpu_run.py --plan         # the time table; exit 1 if the plan breaks a limit
    python benchmarks/gpu_run.py --dry-run N OUT    # command N on CPU at tiny sizes (CI runs all 3)
    python benchmarks/gpu_run.py --fetch-wheels     # CPU side, with a network: the wheels to carry (.whl/)
    options: [--cap STEP=SECONDS]... [--work DIR]

A GPU comes rarely, for 15 minutes of device time (the machine's start included), 10 minutes a
command, and is released 30 s after a command ends; so a visit is two prepared commands run back
to back, each at most :data:`COMMAND_LIMIT` seconds in the worst case, :data:`PLAN_LIMIT` for
the two, the most wanted numbers first. Command 3 holds what the first run (H200, 2026-11-26)
already measured once, and the budget row (the CPU row's model: seconds); run it only when the
lease has its worst case left. Every step is its
own process group under a time cap: a ``fastspec bench`` / ``compare`` / tool step gets its cap
as ``--time-limit`` (no new case starts after it), the tests step as ``FASTSPEC_TEST_DEADLINE``
(no test starts after it: the repository's conftest.py), a signal (SIGTERM; SIGINT for pytest,
which then prints its summary) comes ``grace`` seconds later and ends the case in flight, keeping
what finished in its JSON, and SIGKILL :data:`KILL` seconds after that. A step's worst case is
cap + grace + KILL, a command's the sum of its steps: ``--plan`` prints both, and a command
refuses to start when ``--cap`` would take it past its limit.

Offline: no pip, no downloads (``PIP_NO_INDEX`` and the Hugging Face offline switches are set,
models are built from configs). What the GPU machines lack comes as wheels: ``--fetch-wheels``
downloads :data:`WHEELS` (for the GPU machines' Python 3.12, x86-64) into the checkout's ignored
``.whl/`` on the CPU side, the device run carries that folder (``carry: [".whl"]``, 14 MB of the
64 MiB), and the build step installs them offline (``pip --no-index --no-deps --target WORK/site``,
on every step's ``PYTHONPATH``). Today: NVIDIA's libmathdx, which builds cuSolverDx's ``heev`` for
the race's ``cusolverdx`` row (``fastspec/eig/mathdx.py``); without it the row says why it is absent. The checkout's sources are copied to ``WORK/src`` (``--work``,
else ``$FASTSPEC_GPU_RUN_WORK``, else ``$TMPDIR/fastspec-gpu-run``, kept after the command) and
the host-twin extension is built there in place with the installed setuptools and pybind11; a
later command on the still-warm machine reuses that build when the native sources, Python and
torch are unchanged (the Python sources are copied afresh every time, so a fix between commands
is picked up). Then NVRTC compiles the CUDA eigensolver for the local GPU's arch, every size
and dtype the benchmarks use, into the kit's own kernel cache (``WORK/kernel-cache``, the
``FASTSPEC_CACHE`` of every step): what a user's first call would compile, timed per variant in
``steps.txt``; the ``compile-*`` rows of the eigvalsh suite time a first call with the cache cold
and warm.

OUT receives a few flat files (at most 8 come back from a GPU machine): ``gpu_run.log`` (each
step's start, cap, status and seconds, the versions, the summary), ``bench.json`` (this command's
``fastspec bench`` results merged: the ``benchmarks/results`` schema plus a ``gpu_run`` record),
``compare.json`` (command 3), ``cov_race.json`` (command 1: ``cov_race.py``), ``race.json`` (command 1:
``eig_race.py``), ``phases.json`` (command 1: ``eig_phases.py``), ``triton_race.json`` (command 2:
``triton_race.py``), ``tests.txt`` (command 1), ``diag.txt`` (``race_probe.py`` in command 1, ``gpu_diag.py`` in
2), ``tools.txt`` (ncu in command 2, compute-sanitizer in 3), ``steps.txt`` (every other step's own output):
8 in command 1, 6 in command 2, 5 in command 3. Exit status: 0 when every step passed,
was capped or skipped an optional tool; 1 when a step failed; 2 on bad arguments.

``--dry-run`` runs exactly the same steps, in the same order and under the same caps, on CPU:
``CUDA_VISIBLE_DEVICES`` emptied, ``TRITON_INTERPRET=1``, ``--quick`` sizes instead of
``--tier gpu``, the solver's host twin, the CUDA kernel still compiled for sm_90 (NVRTC runs
without a GPU).
``tests/test_gpu_run.py`` runs all three commands that way in CI.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL = 5              # seconds from the step's signal to SIGKILL
TEST_DEADLINE = "FASTSPEC_TEST_DEADLINE"  # the repository's conftest.py: no test starts after it
COMMAND_LIMIT = 480   # worst case of one command: 8 of the 10 minutes a device command may take
PLAN_LIMIT = 780      # worst case of commands 1 and 2: 13 of the 15 minutes of device time (start: ~1)
CORE = (1, 2)         # the commands a 15-minute lease runs; 3 only when time is left
HEADLINE_BY = 240     # command 1's headline steps end within its first 4 minutes, worst case
ARCH_DRY = "90"       # the arch the kit targets: the CUDA build is checked even without a GPU
# csrc/: the extension and NVRTC sources (moved out of fastspec/eig/; setup.py builds from it)
# LICENSE: pyproject's license-files names it, and a build without it is an error from 2027 (setuptools)
COPIED = ("fastspec", "csrc", "tests", "benchmarks", "conftest.py", "setup.py", "pyproject.toml", "README.md",
          "LICENSE")
# what the host-twin extension is built from (setup.py): the eigensolver's files of csrc/ and the
# Gram kernel's host twin, which compiles cov_gram.cu's own code (so an edit there rebuilds it too:
# a twin built from an older kernel would test code that no longer runs)
NATIVE = ("csrc/bindings.cpp", "csrc/eig_host.cpp", "csrc/eig_host.h", "csrc/eig_core.h", "csrc/eig_algos.h",
          "csrc/eig_packed.h", "csrc/eig_regs.h", "csrc/eig_split.h", "csrc/eig_newton.h", "csrc/cov_gram.cu",
          "csrc/cov_gram_host.cpp", "csrc/cov_gram_host.h", "fastspec/eig/limits.py", "setup.py")
KERNEL_SIZES = ("64", "128", "256")  # the eigvalsh suite's n (fastspec.bench.suites.eigvalsh.SIZES["gpu"])
# the wheels a GPU machine lacks (--fetch-wheels, carried as .whl/): libmathdx for the race's cusolverdx
# row (the GPU image has NVRTC, nvJitLink and cuda-bindings already: torch's CUDA 13 wheels need them)
WHEELS = ("nvidia-libmathdx-cu13==0.4.2.37",)
WHEEL_DIR = ROOT / ".whl"  # ignored by git (.gitignore); travels only when a run's carry names it
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


HEAD = ("--filter", "headline")   # the cases tagged headline (fastspec.bench.case.HEADLINE)
REST = ("--exclude", "headline")  # the others


@dataclass(frozen=True)
class Step:
    """One step of a command: ``kind`` says what runs (see :func:`argv`)."""

    name: str
    kind: str            # build | kernels | env | bench | covrace | race | phases | probe | tritonrace | diag | tests | ncu | sanitize | compare | summary
    cap: int             # seconds of work (a bench/compare/tool step's --time-limit)
    grace: int = 0       # from the cap to the signal
    what: str = ""
    suite: str = ""      # bench: the suite; diag: accuracy or profile
    select: tuple[str, ...] = ()  # bench: --filter/--exclude arguments

    @property
    def headline(self) -> bool:
        return self.select == HEAD

    @property
    def worst(self) -> int:
        return self.cap + self.grace + KILL


# caps from the H100 run (2026-11-26): build 24 s there, 34 s on a 2-core CPU (the dry run);
# kernels 6 s (13 s on CPU), again 4 s; the keys covariance headline 7 s, the probe's 27 s;
# the tests step's pytest alone 67 s in the dry run (the interpreted Triton tests)
BUILD = Step("build", "build", 45, what="copy the sources, build the host-twin extension (reused when unchanged)")
KERNELS = Step("kernels", "kernels", 20, 5, what="NVRTC: the CUDA eigensolver for this GPU, n 64/128/256, "
               "fp32/fp64, every algorithm, and the covariance Gram kernel (dmma route), into the kit's kernel cache")
# commands 2 and 3 follow command 1 on the same machine: its cache holds every kernel already
KERNELS_AGAIN = replace(KERNELS, cap=15, what="the same, found in the kit's kernel cache (compiled by command 1)")
ENV = Step("env", "env", 15, what="versions: GPU, driver, NVRTC, ncu, Python, torch, Triton, CuPy, JAX; fastspec info")
SUMMARY = Step("summary", "summary", 10, what="merge bench.json, print the summary")


def _bench(suite: str, cap: int, grace: int, what: str, select: tuple[str, ...] = ()) -> Step:
    name = f"bench-{suite}" + ("-headline" if select == HEAD else "")
    return Step(name, "bench", cap, grace, what, suite, select)


def _diag(what: str, cap: int, grace: int, text: str) -> Step:
    return Step(f"diag-{what}", "diag", cap, grace, text, suite=what)


PLAN: dict[int, tuple[Step, ...]] = {
    1: (BUILD, KERNELS, ENV,
        _bench("eigvalsh", 35, 10, "eigvalsh B4096-n128-fp32 and B256-n128-fp64 vs torch, cuSOLVER, CuPy, JAX",
               HEAD),
        _bench("covariance", 15, 10, "keys [8,8,2048,128] bf16: Triton kernel alone, whole update, "
               "beside a copy of the same bytes", HEAD),
        _bench("probe", 35, 10, "1.5B shape: measure() vs the forward, keys streaming vs the train step",
               HEAD),
        # which code computes the probe's exact keys update (fastspec/covariance/routes.py): the
        # route table's rows, right after the headline numbers that the winner changes
        Step("cov-race", "covrace", 25, 5, "cov_race.py: every exact keys-update route (dmma, triton_f64, "
             "prep_gemm, blocked) timed (device, host, launches; whole update too) and checked (fp64 Gram, "
             "svdvals, bitwise) at the bench's keys and a 1.5B layer's; the route-table rows to commit"),
        # 30 s (was 40): the H200 run of 2026-11-28 raced all 7 shapes in 22 s (the dry run: 6-12 s)
        Step("race", "race", 30, 10, "eig_race.py: every algorithm of the eigensolver timed and checked on "
             "the same batches; the selection-table rows to commit"),
        # where the eigensolver's time goes: right after the race that times the same
        # kernels. 20 s: ~1-2 s per algorithm and shape (a 64 MiB record per launch) and the call's
        # decomposition (eig_call.py) ~5 s; the dry run ~3 s. Paid for by the tests step (60 -> 45 s)
        # and command 2's every-other-size eigvalsh (40 -> 30) and ncu (35 -> 30), which run to their caps
        Step("phases", "phases", 20, 5, "eig_phases.py: every algorithm's profiling build (clock64 per phase "
             "mark): cycles per phase, share, IPC against the cost model; the fitted model's predictions; "
             "the call's own cost (host, events, device, graphed, raw launch)"),
        # the check of the race the H100 found on 2026-11-27 (each GPU brings its own Triton); it
        # replaced gpu_diag.py's sweep of the 2026-11-26 failures over launch settings, which
        # that race explained (the sweep still runs by hand). 15 s (was 25): 11 s on the H200
        # (2026-11-28), 2 s in the dry run
        Step("race-probe", "probe", 15, 5, "race_probe.py --kit: the library's uncentred 16-bit covariance "
             "launch, 8 inputs x 3 launches, exact vs fp64 and bitwise steady; its keys time, graphed"),
        # 60 s (was 75): it runs to its cap wherever it runs (the H200, 2026-11-28: SIGINT at 85 s,
        # killed at 90), so its cap is what the plan can spare; 15 s of it went to cov-race, whose
        # rows choose the route of every exact keys update
        # fastspec info --check: every kernel configuration's first-use self-check on this GPU
        # (fastspec/selfcheck.py; no check starts after the cap), after the headline numbers,
        # whose first uses ran their own checks. 20 s, paid for by the tests step (45 -> 35),
        # command 2's every-other-size eigvalsh (20 -> 10) and ncu (30 -> 25), each of which
        # always runs to its cap
        Step("selfcheck", "selfcheck", 20, 0, "fastspec info --check: every kernel configuration (exact routes, "
             "Triton candidates, eigensolver algorithms) run once on its adversarial case against float64"),
        Step("tests", "tests", 35, 10, "pytest -m '(gpu or triton) and not sm90' (8 workers, one per core at "
             "most, where pytest-xdist is installed): CUDA solver, Triton kernels on CUDA"),
        SUMMARY),
    2: (BUILD, KERNELS_AGAIN,
        # which launch settings the float32 Triton covariance kernels use
        # (fastspec/covariance/triton_configs.py): the table's rows, first in command 2 (numbers
        # before profiles). 25 s: each candidate is a kernel of its own (~16, more with the check
        # inputs' specializations), compiled in parallel by warm workers, then checks and timing
        # of a second or two; the dry run ~10 s on 2 cores. Paid for by the every-other-size
        # eigvalsh (30/15 -> 20/10), which always runs to its cap, the FFN covariance bench
        # (20/10 -> 15/5: 8-10 s on every H100 and H200 run, and the race has just compiled its
        # default launch) and diag-profile (45 -> 35: 29-34 s on every run)
        Step("triton-race", "tritonrace", 25, 5, "triton_race.py: every launch setting of the float32 Triton "
             "covariance kernels (keys raw and centred, FFN centred) checked (fp64, bitwise over 3 launches) "
             "and timed (device µs, share of a copy's bandwidth, TFLOP/s); the table rows to commit"),
        _diag("profile", 35, 10, "host vs device time of a keys update; torch.profiler of measure() and "
              "of a keys-streaming train step at the 1.5B shape"),
        _bench("eigvalsh", 10, 10, "every other eigvalsh size (n 64/128/256, B up to 16384, fp64 B4096)", REST),
        _bench("covariance", 15, 5, "FFN [16384, 8192] bf16: update, kernel, copy", REST),
        _bench("train_step", 45, 15, "1.5B train step, keys + FFN streaming: emit_every 100, budget=0.01, "
               "emit_every 1"),
        # 35 s: at 30 both profiles ran out of time on the H100 (2026-11-27); 5 s from eigvalsh,
        # whose every-other-size step always runs to its cap
        Step("ncu", "ncu", 25, 5, "Nsight Compute --set full: one keys covariance launch, one eig launch"),
        SUMMARY),
    3: (BUILD, KERNELS_AGAIN,
        _bench("keyrank", 30, 15, "1.5B key rank: measure() vs hooks + svdvals per head"),
        _bench("probe", 35, 10, "key rank from keys in memory vs svdvals (exact, fast)", REST),
        Step("sanitize", "sanitize", 40, 5, "compute-sanitizer memcheck + racecheck: one small eig and cov launch"),
        Step("compare", "compare", 30, 10, "accuracy on the hard matrix families (fastspec compare)"),
        _bench("budget", 25, 5, "the budget row: overhead the probe reports vs real (twin, same model), "
               "budgets 2% and 5%, the CPU row's d_model-256 model"),
        _bench("train_step_compiled", 125, 15, "compiled train step (inductor), 8 layers of the 1.5B shape"),
        SUMMARY),
}
DEST = {"tests": "tests.txt", "ncu": "tools.txt", "sanitize": "tools.txt", "diag": "diag.txt", "probe": "diag.txt"}


def worst_cases(plan: dict[int, tuple[Step, ...]] = PLAN) -> dict[int, int]:
    return {c: sum(s.worst for s in steps) for c, steps in plan.items()}


def problems(plan: dict[int, tuple[Step, ...]] = PLAN) -> list[str]:
    """Every limit the plan breaks (empty: it fits)."""
    out = []
    worst = worst_cases(plan)
    for c, w in worst.items():
        if w > COMMAND_LIMIT:
            out.append(f"command {c}: worst case {w} s > {COMMAND_LIMIT} s")
    core = sum(w for c, w in worst.items() if c in CORE)
    if core > PLAN_LIMIT:
        out.append(f"plan: worst case of commands {' and '.join(map(str, CORE))} {core} s > {PLAN_LIMIT} s")
    t = 0
    for s in plan[1]:
        t += s.worst
        if s.headline and t > HEADLINE_BY:
            out.append(f"command 1: headline step {s.name} may end at {t} s > {HEADLINE_BY} s")
    return out


def table(plan: dict[int, tuple[Step, ...]] = PLAN) -> str:
    """The time table: every step's cap, grace, kill, worst case and when it may end at the latest."""
    lines = [f"{'cmd':>3}  {'step':<30} {'cap':>4} {'grace':>5} {'kill':>4} {'worst':>5} {'ends by':>7}  what"]
    core = 0
    for c, steps in plan.items():
        t = 0
        for s in steps:
            t += s.worst
            lines.append(f"{c:>3}  {s.name:<30} {s.cap:>4} {s.grace:>5} {KILL:>4} {s.worst:>5} {t:>7}  "
                         f"{'* ' if s.headline else ''}{s.what}")
        core += t if c in CORE else 0
        extra = "" if c in CORE else "; extra: only when the lease has it left"
        lines.append(f"{c:>3}  {'worst case of the command':<30} {'':>4} {'':>5} {'':>4} {t:>5}"
                     f"  (limit {COMMAND_LIMIT} s{extra})")
    lines.append(f"plan worst case (commands {' and '.join(map(str, CORE))}): {core} s = {core / 60:.1f} min "
                 f"(limit {PLAN_LIMIT} s = {PLAN_LIMIT / 60:.0f} min), plus the machine's start; "
                 f"* = headline, done by {HEADLINE_BY} s into command 1")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ running
class Run:
    """One command being run: paths, environment, log, and the steps' outcomes."""

    def __init__(self, command: int, steps: tuple[Step, ...], out: Path, work: Path, dry: bool):
        self.command, self.steps, self.out, self.work, self.dry = command, steps, out, work, dry
        self.src = work / "src"
        self.site = work / "site"  # the carried wheels, installed offline by the build step
        self.mathdx = ""  # why cuSolverDx's heev cannot be built in the steps' environment ("" when it can)
        self.start = time.monotonic()
        self.failed: list[str] = []
        self.log = out / "gpu_run.log"
        self.env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                    # JAX (an eigvalsh anchor) must not take 75% of GPU memory next to torch
                    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                    # compiled kernels shared by the commands of one visit (a warm machine keeps them)
                    "FASTSPEC_CACHE": str(work / "kernel-cache"),
                    "PYTHONPATH": os.pathsep.join([str(self.src), str(self.site),
                                                   *filter(None, [os.environ.get("PYTHONPATH")])])}
        if dry:  # CPU even on a GPU machine
            self.env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1",
                            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))

    def say(self, text: str) -> None:
        line = f"[gpu_run {time.strftime('%H:%M:%S', time.gmtime())} +{time.monotonic() - self.start:.0f}s] {text}"
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def argv(self, step: Step) -> list[str]:
        py, cap = sys.executable, str(step.cap)
        size = ["--quick"] if self.dry else ["--tier", "gpu"]
        dry = ["--dry-run"] if self.dry else []
        if step.kind == "build":
            return [py, "setup.py", "-q", "build_ext", "--inplace"]
        if step.kind == "kernels":
            # cuSolverDx's heev too on a GPU where it can be built (n 64 links for ~6 s of one core:
            # the 16-core GPU machine builds it beside the others; the 2-core dry run leaves it to the race)
            vendor = ["cusolverdx"] if not self.dry and not self.mathdx else []
            return [py, "-m", "fastspec", "precompile", "--arch", ARCH_DRY if self.dry else _local_arch(),
                    "--n", *KERNEL_SIZES, "--dtype", "float32", "float64", "--algo", "all", *vendor]
        if step.kind == "env":
            return [py, "benchmarks/gpu_tools.py", "env"]
        if step.kind == "selfcheck":
            return [py, "-m", "fastspec", "info", "--check", "--time-limit", cap]
        if step.kind == "bench":
            return [py, "-m", "fastspec", "bench", "--suite", step.suite, *step.select, *size,
                    "--json", str(self.out / f"{step.name}.json"), "--time-limit", cap]
        if step.kind == "covrace":
            return [py, "benchmarks/cov_race.py", "--json", str(self.out / "cov_race.json"), "--time-limit", cap,
                    *dry]
        if step.kind == "race":
            return [py, "benchmarks/eig_race.py", "--json", str(self.out / "race.json"), "--time-limit", cap, *dry]
        if step.kind == "phases":
            return [py, "benchmarks/eig_phases.py", "--json", str(self.out / "phases.json"), "--time-limit", cap,
                    *dry]
        if step.kind == "compare":
            return [py, "-m", "fastspec", "compare", *size, "--json", str(self.out / "compare.json"),
                    "--time-limit", cap]
        if step.kind == "tests":
            # not the sm90 tests: CPU compiles that CI's gpu-stack stage runs under the same Triton,
            # each longer than the step's grace, so the cap's SIGINT cut them mid-compile into a
            # failure (the dry run's, 2026-12-06, once two workers ran the step).
            # The GPU tests are mostly Triton compiles (CPU work): 8 workers where xdist is
            # installed (the GPU machines have it; 16 cores), at most one per core (the dry run's
            # 2-core CPU: 8 workers there spent the whole cap starting); serial, 130 s ran 30%
            # of them (2026-11-26).
            # -v names each test as it ends: a step cut by its cap (SIGKILL before pytest's
            # summary) still says which failed; the H100 run's had 5 F's and no names
            workers = ["-n", str(min(8, len(os.sched_getaffinity(0))))] if importlib.util.find_spec("xdist") else []
            return [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--full",
                    *workers, "-m", "(gpu or triton) and not sm90", "tests"]
        if step.kind == "diag":
            return [py, "benchmarks/gpu_diag.py", step.suite, "--time-limit", cap, *dry]
        if step.kind == "probe":
            return [py, "benchmarks/race_probe.py", "--kit", "--time-limit", cap, *dry]
        if step.kind == "tritonrace":
            return [py, "benchmarks/triton_race.py", "--json", str(self.out / "triton_race.json"), "--time-limit",
                    cap, *dry]
        if step.kind in ("ncu", "sanitize"):
            return [py, "benchmarks/gpu_tools.py", step.kind, "--time-limit", cap, *dry]
        if step.kind == "summary":
            return [py, "benchmarks/gpu_summary.py", str(self.out), "--command", str(self.command),
                    "--dry-run", str(int(self.dry)), "--failed", " ".join(self.failed)]
        raise ValueError(f"step {step.name}: unknown kind {step.kind!r}")

    def run(self, step: Step, env: dict[str, str] | None = None) -> str:
        """Run ``step`` under its cap; its status: ok, capped, FAILED rc N (also in the log)."""
        argv = self.argv(step)
        dest = self.out / DEST.get(step.kind, "steps.txt")
        sig = signal.SIGINT if step.kind == "tests" else signal.SIGTERM
        env = env or self.env
        if step.kind == "tests":  # no test starts past the cap, so the SIGINT a grace later finds none running
            env = {**env, TEST_DEADLINE: f"{time.time() + step.cap:.3f}"}
        self.say(f"step {step.name}: start (cap {step.cap}s, {sig.name} {step.grace}s later, SIGKILL "
                 f"{KILL}s after): {shlex.join(argv)}")
        with open(dest, "a") as f:
            f.write(f"===== {step.name}: {shlex.join(argv)}\n")
            f.flush()
            offset = f.tell()
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=self.src,
                                    env=env, start_new_session=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=step.cap + step.grace)
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = _stop(proc, sig)
        dt = time.monotonic() - t0
        text = dest.read_bytes()[offset:].decode(errors="replace")
        if timed_out:
            status = f"capped after {dt:.0f}s ({sig.name} at {step.cap + step.grace}s, rc {rc}); partial results kept"
        elif rc != 0:
            status = f"FAILED rc {rc} after {dt:.0f}s"
            self.failed.append(step.name)
        elif "time cap reached" in text:
            status = f"capped after {dt:.0f}s; partial results kept"
        else:
            status = f"ok in {dt:.0f}s"
        tool = step.kind in ("ncu", "sanitize")  # an unusable tool is a skip, said on the status line
        skipped = [ln.strip() for ln in text.splitlines() if re.match(r"^[\w-]+: skipped: ", ln)] if tool else []
        self.say(f"step {step.name}: {status}" + (f" ({'; '.join(skipped)})" if skipped else ""))
        if rc != 0 and not timed_out:
            tail = text.splitlines()[-15:]
            with open(self.log, "a") as f:
                f.writelines(f"    {ln}\n" for ln in tail)
        return status

    def install_wheels(self) -> None:
        """The carried wheels (``.whl/``, :data:`WHEELS`) into ``WORK/site``, offline; then whether
        cuSolverDx's heev can be built in the steps' environment (:attr:`mathdx`), said in the log."""
        wheels = sorted(WHEEL_DIR.glob("*.whl"))
        if wheels:
            shutil.rmtree(self.site, ignore_errors=True)
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(self.site),
                                   *map(str, wheels)], env=self.env, capture_output=True, text=True, check=False)
            names = ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in wheels)
            self.say(f"carried wheels: {names} -> {self.site}" if done.returncode == 0 else
                     f"carried wheels: pip could not install them (rc {done.returncode}): "
                     f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        else:
            self.say(f"carried wheels: none in {WHEEL_DIR} (run --fetch-wheels on the CPU side and carry .whl)")
        check = subprocess.run([sys.executable, "-c", "from fastspec.eig import mathdx; print(mathdx.missing())"],
                               cwd=self.src, env=self.env, capture_output=True, text=True, check=False)
        self.mathdx = check.stdout.strip() if check.returncode == 0 else f"mathdx.py failed: {check.stderr[-200:]}"
        self.say(f"cuSolverDx heev: {'can be built here' if not self.mathdx else 'absent: ' + self.mathdx}")

    def build(self, step: Step) -> None:
        """Fresh Python sources in ``WORK/src``; the extension rebuilt unless its stamp matches."""
        try:
            self._build(step)
        finally:
            self.install_wheels()

    def _build(self, step: Step) -> None:
        stamp = _stamp()
        keep = self.work / "keep"
        if keep.exists():
            shutil.rmtree(keep)
        keep.mkdir(parents=True)
        old = self.src / "fastspec" / "eig"
        for so in old.glob("_host.*") if old.exists() else ():
            shutil.move(str(so), keep / so.name)
        if self.src.exists():
            shutil.rmtree(self.src)
        self.src.mkdir(parents=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build", "*.egg-info")
        for name in COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, self.src / name, ignore=ignore)
            elif src.exists():
                shutil.copy2(src, self.src / name)
        stamp_file = self.work / "build.stamp"
        kept = list(keep.iterdir())
        if kept and stamp_file.exists() and stamp_file.read_text() == stamp:
            for so in kept:
                shutil.move(str(so), self.src / "fastspec" / "eig" / so.name)
            self.say(f"step build: reused the extension built earlier in {self.work} (stamp {stamp[:12]})")
            return
        self.say(f"sources copied to {self.src}; building the host-twin extension")
        stamp_file.unlink(missing_ok=True)
        status = self.run(step)
        check = subprocess.run([sys.executable, "-c", "import fastspec.eig._host, fastspec; print(fastspec.__file__)"],
                               cwd=self.src, env=self.env, capture_output=True, text=True, check=False)
        if check.returncode != 0:
            self.say("build: fastspec.eig._host not importable (is pybind11 installed?); the solver "
                     "benchmarks fall back to torch")
            self.failed.append("build-extension")
        elif not check.stdout.strip().startswith(str(self.src)):
            self.say(f"build: python imports a fastspec other than {self.src}: {check.stdout.strip()}")
            self.failed.append("build-import")
        elif status.startswith("ok"):
            stamp_file.write_text(stamp)


def _stop(proc: subprocess.Popen, sig: signal.Signals) -> int:
    """Signal the step's process group, SIGKILL it :data:`KILL` seconds later; its exit status."""
    for s, wait in ((sig, KILL), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _local_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _stamp() -> str:
    """What the built extension depends on: native sources, Python and torch versions."""
    import torch

    h = hashlib.sha256(f"{sys.version}|{torch.__version__}|{torch.version.cuda}".encode())
    for name in NATIVE:
        path = ROOT / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file():
                h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def parse_caps(items: list[str]) -> dict[str, int]:
    names = {s.name for steps in PLAN.values() for s in steps}
    caps = {}
    for item in items:
        m = re.fullmatch(r"([a-z_-]+)=(\d+)", item)
        if not m or m.group(1) not in names:
            raise ValueError(f"--cap: expected STEP=SECONDS with STEP one of {', '.join(sorted(names))}; got {item!r}")
        caps[m.group(1)] = int(m.group(2))
    return caps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_run.py", description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?", type=int, choices=sorted(PLAN), help="which command of the plan")
    p.add_argument("out", nargs="?", type=Path, help="folder for the result files")
    p.add_argument("--plan", action="store_true", help="print the time table and exit")
    p.add_argument("--fetch-wheels", action="store_true",
                   help=f"download the wheels the GPU machines lack ({', '.join(WHEELS)}) into .whl/ and exit")
    p.add_argument("--dry-run", action="store_true", help="the same steps on CPU at tiny sizes")
    p.add_argument("--cap", action="append", default=[], metavar="STEP=SECONDS", help="override a step's cap")
    p.add_argument("--work", type=Path, help="build folder (default $FASTSPEC_GPU_RUN_WORK or $TMPDIR/fastspec-gpu-run)")
    args = p.parse_args(argv)
    try:
        caps = parse_caps(args.cap)
    except ValueError as e:
        p.error(str(e))
    if args.fetch_wheels:
        return fetch_wheels()
    if args.plan:
        print(table())
        bad = problems()
        for line in bad:
            print(f"OVER: {line}")
        return 1 if bad else 0
    if args.command is None or args.out is None:
        p.error("COMMAND (1, 2 or 3) and OUT are required (or --plan)")
    chosen = {c: tuple(replace(s, cap=caps.get(s.name, s.cap)) for s in steps) for c, steps in PLAN.items()}
    over = [x for x in problems(chosen) if x.startswith(f"command {args.command}:")]
    if over:
        p.error(f"--cap: {over[0]}")
    work = args.work or Path(os.environ.get("FASTSPEC_GPU_RUN_WORK")
                             or Path(os.environ.get("TMPDIR", "/tmp")) / "fastspec-gpu-run")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_run.py: no CUDA device visible to torch: run with --dry-run on a machine without a GPU",
                  file=sys.stderr)
            return 1
    run = Run(args.command, chosen[args.command], args.out.resolve(), work.resolve(), args.dry_run)
    run.say(f"fastspec GPU run: command {args.command} of {len(PLAN)}, dry_run={int(args.dry_run)}, "
            f"worst case {sum(s.worst for s in run.steps)}s, out={run.out}, work={run.work}")
    for step in run.steps:
        if step.kind == "build":
            run.build(step)
        elif step.kind == "env":
            run.run(step)
            with open(run.log, "a") as f:  # the versions belong in the log that always comes back
                f.write(_section(run.out / "steps.txt", f"===== {step.name}: "))
        else:
            run.run(step)
    summary = _section(run.out / "steps.txt", "\n===== summary\n")  # to the log and the terminal
    print(summary, end="", flush=True)
    with open(run.log, "a") as f:
        f.write(summary)
    if run.failed:
        run.say(f"done: FAILED steps: {' '.join(run.failed)}")
        return 1
    run.say("done: every step passed, was capped, or skipped an optional tool")
    return 0


def fetch_wheels(dest: Path = WHEEL_DIR) -> int:
    """Download :data:`WHEELS` for the GPU machines (CPython 3.12, x86-64 Linux) into ``dest``:
    the CPU side's preparation; the device run carries the folder and the build step installs it."""
    dest.mkdir(parents=True, exist_ok=True)
    plats = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", *plats, "-d", str(dest), *WHEELS]
    rc = subprocess.run(argv, check=False).returncode
    got = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in got) / 2**20
    print(f"gpu_run.py: {len(got)} wheels in {dest} ({size:.1f} MiB): {', '.join(w.name for w in got)}"
          + ("" if rc == 0 else f"; pip download failed (rc {rc})"))
    return 0 if rc == 0 else 1


def _section(path: Path, start: str) -> str:
    """``path``'s text from the last ``start`` on (empty without one)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    i = text.rfind(start)
    return text[i:].lstrip("\n") if i >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())
