"""The Triton configuration race: every launch setting of the two float32 Triton covariance
kernels, checked and timed on the same inputs, and the table rows the measurement says to commit.

    python benchmarks/triton_race.py --json OUT/triton_race.json [--time-limit S] [--dry-run] [--jobs N] [--case NAME]...
    python benchmarks/triton_race.py --merge OUT/triton_race.json   # its rows into fastspec/covariance/triton_configs.json

:mod:`fastspec.covariance.triton_configs` lists the candidates of each raced kernel (``keys``: the
fused row loop, ``64 < D <= 128``, memory bound; ``ffn``: the tiled Gram, ``D > 128``, tensor-core
bound) and picks one per (arch, kernel, input dtype, centred or not) from its table; this race
writes that table. Per case of :data:`CASES`, in order of importance (a capped run keeps the
first): the ``precision="fast"`` keys update ``[8, 2048, 8, 128]`` bf16 uncentred (the raw Gram of
the ``sv`` convention; keys stored as attention stores them, ``[B, H, T, D]``, and read through the
``[B, T, H, D]`` view ``transpose(1, 2)``), the same keys centred (``track_mean=True``), and the
bench's FFN ``[16384, 8192]`` bf16 centred (large-mean channels, as
``fastspec/bench/suites/covariance.py`` builds it, launched as ``[1, N, 1, D]``: one site). Every
candidate of the case's kernel is run through the library's launcher
(``covariance_partials_triton(..., candidate=...)``), each one:

* checked, as ``benchmarks/race_probe.py`` checks the shipped launch (every new pipelined launch
  must pass it: Triton's load pipeline raced on an H100): a few adversarial inputs at small sizes
  (channel means far above their spread, a mask with a NaN in a valid and in a padded row, keys
  read through the transposed view, a strided slice whose rows and columns are not contiguous,
  the bench's own distribution), :data:`LAUNCHES` launches each, which must give equal bits
  (``steady``: no atomics, a fixed summation order), ``n`` and ``rejected`` exact, and
  ``‖G − G64‖ / ‖G64‖`` (``G64``: float64 torch of the same valid rows about the launch's own
  center ``c``) within :data:`TOL_FACTOR` × what torch float32 (``einsum`` of float32 copies, TF32
  off) makes against the same reference, plus :data:`FLOOR` (``fastspec bench``'s
  ``8·eps_fp32``, so an exact torch cannot fail it); ``Σ(x − c)`` the same way, relative to
  ``Σ|x − c|``. A candidate that fails, or raises, cannot win and makes the run exit 1. Centred,
  each input also records (no verdict) the covariance the partials give against float64's beside
  ``torch.cov`` of float32 copies (``cov_rel_err``, ``torch_cov_rel_err``);
* timed at the case's full size on CUDA, round-robin with the case's other candidates
  (:func:`fastspec.bench.timing.measure_interleaved`, ``device_only``: CUDA events with a spin
  kernel queued ahead, so the host's launch time is hidden; median and range of :data:`REPEATS`
  rounds after :data:`WARMUP`, each sample :data:`CALLS` calls): ``device_us`` and ``host_us`` per
  call. The keys cases also time a device-to-device copy of the input's bytes in the same rounds
  and report each candidate's input GB/s and its share of the copy's (read + write) GB/s, as
  ``fastspec bench``'s covariance rows do; the FFN case reports TFLOP/s, the flops being
  ``2·N·D²/2`` per dot (the triangle of ``G``) times the candidate's dots: 4 (``lolo``) or 3.

Compiling dominates a GPU run (each candidate is its own kernel, and the check inputs and the
full size may be different specializations), so on CUDA ``--jobs`` worker processes (default:
the CPU cores less one, at most one per candidate) first run every candidate once on each input
(``--warm``), filling Triton's on-disk cache in parallel; the main process checks a case as soon
as its candidates are warm, and times only once no worker runs (a worker's kernels would share the
GPU with the timed ones).

The winner of a case is its fastest candidate (``device_us``) among those that passed their
checks; a case whose candidates were all checked and timed writes its row to the JSON's ``rows``:
``{"arch", "kernel", "dtype", "center", "config"}`` (what ``triton_configs`` reads) and
``measured`` (device, date, case, every passing candidate's ``device_us``, the kernel's default).
``--merge`` replaces the table's rows of the same (arch, kernel, dtype, center), keeps its other
rows, ``format`` and ``about``, and refuses a dry run's rows and a row whose candidate failed its
checks in that race. The JSON is rewritten after every case: a run stopped by its time limit
(``--time-limit S``: nothing new starts after S seconds; the cases left are ``not_run``, a case
cut inside has its candidates left in ``not_raced`` and no row) or a signal keeps what finished.

JSON: ``schema`` (``fastspec-triton-race-1``), ``kind``, ``date``, ``dry_run``, ``environment``,
``device``, ``arch``, ``timing`` and ``check`` (what the times and the checks are),
``candidates`` (per kernel, each candidate's settings), ``warm_jobs``, ``results`` (per case:
``case``, ``kernel``, ``dtype``, ``center``, ``shape``, ``layout``, ``why``, ``bytes``,
``default``, ``copy`` (keys: ``device_us``, ``GBps``), ``candidates`` (per name: ``config``,
``check`` with its per-input errors, tolerances, counts and ``failed``, ``device_us`` with its
range, ``host_us``, ``clock``, ``repeats``, ``GBps``, ``pct_of_copy_bandwidth`` (keys) or
``TFLOPs`` (ffn), ``warm``, ``ok``; or ``error``), ``not_raced``, ``winner``, ``complete``),
``rows``, ``not_run``.

``--dry-run``: CPU at tiny sizes (fp16 holding bf16-rounded values: the interpreter's bf16 dot is
not exact, and the values keep the bits a bf16 run has), the kernels under ``TRITON_INTERPRET=1``
(set here when unset), every candidate checked on one input that has every trait of the GPU's
three (an interpreted launch takes ~0.1-0.3 s) and timed once, so this file cannot rot where no
GPU exists (the GPU kit's dry run, in CI, runs it: about 10 s on 2 cores). Times are wall-clock
CPU stand-ins, labelled so, that say nothing about GPU speed; the rows are marked ``dry_run`` and
cannot be merged.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's fastspec, as the kit's other scripts
    sys.path.insert(0, str(ROOT))

# after the path: the checkout's fastspec; none of these imports Triton (--dry-run sets the interpreter
# first); the route race's SIGTERM handling (sigterm_stops, attempt) and merge steps are shared
from benchmarks.cov_race import attempt, race_result, sigterm_stops, write_table
from fastspec.bench.case import EPS32, FLOOR_EPS
from fastspec.covariance import triton_configs

SCHEMA = "fastspec-triton-race-1"
LAUNCHES = 3           # launches of each check input: equal bits from all of them
TOL_FACTOR = 2         # a candidate's error vs fp64 within this many times torch float32's ...
FLOOR = FLOOR_EPS * EPS32  # ... plus fastspec bench's floor (8·eps_fp32), relative like the errors
CALLS = {"keys": 10, "ffn": 1}  # calls per timed sample on CUDA: keys ~45 µs a call, ffn ~10 ms
WARMUP, REPEATS = 2, 5
DRY_ARCH = 90          # the arch the kit targets: a dry run's rows are keyed as for it (and never merged)


@dataclass(frozen=True)
class Case:
    """One race: ``kernel`` on ``[B, T, S, D]`` input of ``dtype``, centred or not."""

    name: str
    kernel: str
    dtype: str
    center: bool
    B: int
    T: int
    S: int
    D: int
    why: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.B, self.T, self.S, self.D

    @property
    def layout(self) -> str:
        return ("[B, S, T, D] stored, read as the [B, T, S, D] view transpose(1, 2)" if self.kernel == "keys"
                else "[N, D] stored, read as [1, N, 1, D] (one site)")


CASES = (
    Case("keys-B8-T2048-H8-D128-bf16-raw", "keys", "bfloat16", False, 8, 2048, 8, 128,
         "the precision='fast' keys update (raw Gram, the sv convention): the bench's keys headline"),
    Case("keys-B8-T2048-H8-D128-bf16-centred", "keys", "bfloat16", True, 8, 2048, 8, 128,
         "the same keys centred (track_mean=True)"),
    Case("ffn-N16384-D8192-bf16-centred", "ffn", "bfloat16", True, 1, 16384, 1, 8192,
         "the bench's FFN input [16384, 8192], large-mean channels, centred (the eig convention)"),
)
DRY_CASES = (
    Case("dry-keys-B1-T64-H2-D128-fp16-raw", "keys", "float16", False, 1, 64, 2, 128, "CPU stand-in of the raw keys"),
    Case("dry-keys-B1-T64-H2-D128-fp16-centred", "keys", "float16", True, 1, 64, 2, 128,
         "CPU stand-in of the centred keys"),
    Case("dry-ffn-N64-D256-fp16-centred", "ffn", "float16", True, 1, 64, 1, 256, "CPU stand-in of the FFN"),
)


def _now() -> float:
    """The race's clock for its time limit (``time.monotonic``; tests replace it)."""
    return time.monotonic()


def all_cases() -> dict[str, Case]:
    return {c.name: c for c in (*CASES, *DRY_CASES)}


# ------------------------------------------------------------------------------------ inputs
def _cast(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` in ``dtype``; fp16 (the dry run) holds bf16-rounded values, the bits a bf16 run sees."""
    if dtype == "float16":
        return x.to(torch.bfloat16).to(torch.float16)
    return x.to(getattr(torch, dtype))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _far_means(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Channel means up to ±100 over a spread of 2 (race_probe.py's inputs, both signs)."""
    return torch.randn(shape, generator=g) * 2 + 100 * (2 * torch.rand(shape[-1], generator=g) - 1)


def _bench_keys(shape: tuple[int, ...], g: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The bench's keys distribution (``_key_case``): per-channel spread 0.1..3, mean 0.5."""
    D = shape[-1]
    return torch.randn(shape, generator=g, device=device).mul_(torch.linspace(0.1, 3, D, device=device)).add_(0.5)


def _bench_ffn(shape: tuple[int, ...], g: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The bench's FFN distribution (``_ffn_case``): spread 0.05..2, channel means -4..4."""
    D = shape[-1]
    x = torch.randn(shape, generator=g, device=device).mul_(torch.linspace(0.05, 2, D, device=device))
    return x.add_(torch.linspace(-4, 4, D, device=device))


def _padded(B: int, T: int) -> torch.Tensor:
    """A mask: the last eighth of the first sequence padded, every 7th row of the others too."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T - max(1, T // 8):] = False
    mask[1:, ::7] = False
    return mask


def _mixed(shape: tuple[int, ...], bench, g: torch.Generator) -> torch.Tensor:
    """The bench's distribution with its first 8 channels (every other one read) far from zero
    (``_far_means``): few enough that the bench's channels weigh in ``G`` as in the GPU's inputs."""
    x = bench(shape, g)
    x[..., :8] = _far_means(shape, g)[..., :8]
    return x


def check_inputs(case: Case, device: torch.device, dry: bool) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(label, x [B, T, S, D], mask or None)``: the adversarial inputs of the case's kernel (module
    docstring), small; the same for every candidate. On CUDA three: far means, keys read through
    their view (or FFN rows) with a mask and NaN rows; far means, contiguous; the bench's
    distribution as a strided slice. A dry run, where each interpreted launch takes ~0.1-0.3 s,
    has them all in one input: the bench's distribution with a few channels far from zero, a
    slice of every other row (keys) and column of a wider tensor, a mask and NaN rows."""
    dt = case.dtype
    out = []
    if case.kernel == "keys":
        D = case.D
        g = _gen(1)
        if dry:  # stored [B, S, 2T, 2D]: the keys view, every other row and column
            B, T, S = 1, 40, 1
            wide = _cast(_mixed((B, S, 2 * T, 2 * D), _bench_keys, g), dt)
            k, label = wide[:, :, ::2, ::2], f"mixed means, strided keys view, mask, NaN [{B},{T},{S},{D}]"
        else:  # stored [B, S, T, D] as attention stores keys
            B, T, S = 2, 256, 4
            k, label = _cast(_far_means((B, S, T, D), g), dt), f"far means, keys view, mask, NaN [{B},{T},{S},{D}]"
        k[B - 1, 0, T // 2, 1] = float("nan")  # a valid row of site 0: rejected
        k[0, S - 1, T - 1, 0] = float("nan")   # a padded row of the last site: not counted at all
        out.append((label, k.transpose(1, 2), _padded(B, T)))
        if not dry:
            out.append((f"far means [{B},{T},{S},{D}]", _cast(_far_means((B, T, S, D), g), dt), None))
            # every other row and column of a wider tensor: strides 2 in T and in D, T not a multiple of BT
            Ts = 200
            wide = _cast(_bench_keys((B, 2 * Ts, S, 2 * D), g), dt)
            out.append((f"strided bench keys [{B},{Ts},{S},{D}]", wide[:, ::2, :, ::2], None))
    else:
        g = _gen(2)
        if dry:  # every other column of a wider tensor
            N, D = 40, 160
            x = _cast(_mixed((N, 2 * D), _bench_ffn, g), dt)[:, ::2]
            label = f"mixed means, strided, mask, NaN [1,{N},1,{D}]"
        else:
            N, D = 512, 1024
            x, label = _cast(_far_means((N, D), g), dt), f"far means, mask, NaN [1,{N},1,{D}]"
        x[N // 2, 3] = float("nan")   # valid: rejected
        x[N - 1, 5] = float("nan")    # padded: not counted
        out.append((label, x[None, :, None], _padded(1, N)))
        if not dry:
            out.append((f"bench ffn [1,{N},1,{D}]", _cast(_bench_ffn((N, D), g), dt)[None, :, None], None))
            Ns, Ds = 384, 640  # every other column: stride 2 in D
            wide = _cast(_bench_ffn((Ns, 2 * Ds), g), dt)
            out.append((f"strided bench ffn [1,{Ns},1,{Ds}]", wide[:, ::2][None, :, None], None))
    return [(label, x.to(device), None if m is None else m.to(device)) for label, x, m in out]


def timed_input(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, storage)``: the case's full-size input as the kernel reads it, and its contiguous
    storage (what the copy moves)."""
    torch.manual_seed(0)
    if case.kernel == "keys":
        k = _cast(_bench_keys((case.B, case.S, case.T, case.D), device=device), case.dtype)
        return k.transpose(1, 2), k
    x = _cast(_bench_ffn((case.T, case.D), device=device), case.dtype)
    return x[None, :, None], x


# ------------------------------------------------------------------------------------ checks
def _launch(x: torch.Tensor, mask, center: bool, cand):
    from fastspec.covariance.triton_update import covariance_partials_triton

    return covariance_partials_triton(x, mask, 1, center, candidate=cand)


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def reference(x: torch.Tensor, mask, c: torch.Tensor, center: bool = False) -> dict:
    """Float64 and torch float32 sums of the valid rows of ``x`` about ``c [S, D]``: counts,
    ``s``, ``G``, and the scale of ``s`` (``Σ|x − c|``); with ``center`` also the covariance
    about each side's own mean (float64, and float32 as ``torch.cov`` of float32 copies does it)."""
    B, T, S, D = x.shape
    xr = x.reshape(B * T, S, D)
    keep = (torch.ones(B * T, 1, dtype=torch.bool, device=x.device) if mask is None
            else mask.reshape(B * T, 1).bool())
    finite = torch.isfinite(xr).all(-1)
    valid = (keep & finite)[..., None]
    d64 = torch.where(valid, xr.double() - c.double(), 0)
    d32 = torch.where(valid, xr.float() - c.float(), 0)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # torch float32 is full fp32 here
    n = valid[..., 0].sum(0)
    out = {"n": n, "rejected": (keep & ~finite).sum(0), "G64": torch.einsum("nsi,nsj->sij", d64, d64),
           "s64": d64.sum(0), "s_abs": d64.abs().sum(0), "s32": d32.sum(0)}
    try:
        out["G32"] = torch.einsum("nsi,nsj->sij", d32, d32)
        if center:  # the covariance about the rows' own mean: what torch.cov(x.float().T) computes
            for bits, dt in ((64, torch.float64), (32, torch.float32)):
                xs = torch.where(valid, xr.to(dt), 0)
                e = torch.where(valid, xs - xs.sum(0) / n[:, None].to(dt), 0)
                out[f"cov{bits}"] = torch.einsum("nsi,nsj->sij", e, e) / (n[:, None, None] - 1).to(dt)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    den = float(scale.norm())
    return float((a.double() - b).norm()) / den if den > 0 else (0.0 if float((a.double() - b).norm()) == 0 else math.inf)


def check_one(cand, x: torch.Tensor, mask, center: bool) -> dict:
    """One input's verdicts for ``cand`` (module docstring); ``ok`` when all hold."""
    runs = []
    for _ in range(LAUNCHES):  # clones: the next launch must not write into what we compare
        p = _launch(x, mask, center, cand)
        runs.append(tuple(t.detach().clone() for t in (p.n, p.c, p.s, p.G, p.rejected)))
    n, c, s, G, rejected = runs[0]
    steady = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
    ref = reference(x, mask, c, center)
    gram, torch_gram = _rel(G, ref["G64"], ref["G64"]), _rel(ref["G32"], ref["G64"], ref["G64"])
    sums, torch_sums = _rel(s, ref["s64"], ref["s_abs"]), _rel(ref["s32"], ref["s64"], ref["s_abs"])
    gram_tol, sum_tol = TOL_FACTOR * torch_gram + FLOOR, TOL_FACTOR * torch_sums + FLOOR
    verdicts = {"counts": torch.equal(n.long(), ref["n"].long()) and torch.equal(rejected.long(), ref["rejected"].long()),
                "steady": steady, "gram": gram <= gram_tol, "sum": sums <= sum_tol}  # NaN: False
    return {"shape": list(x.shape), "strides": list(x.stride()), "mask": mask is not None,
            "gram_rel_err": _finite_or_none(gram), "torch_gram_rel_err": _finite_or_none(torch_gram),
            "gram_tol": _finite_or_none(gram_tol), "sum_rel_err": _finite_or_none(sums),
            "torch_sum_rel_err": _finite_or_none(torch_sums), "sum_tol": _finite_or_none(sum_tol),
            **(_cov_errors(n, s, G, ref) if center else {}),
            "n": n.cpu().tolist(), "rejected": rejected.cpu().tolist(),
            "failed": [k for k, v in verdicts.items() if not v], "ok": all(verdicts.values())}


def _cov_errors(n: torch.Tensor, s: torch.Tensor, G: torch.Tensor, ref: dict) -> dict:
    """Not a verdict, for the record: the covariance the partials give (``(G − s sᵀ/n)/(n − 1)``,
    formed in float64) and ``torch.cov`` of float32 copies, each against float64's."""
    nd = n.double()[:, None, None]
    cov = (G.double() - s.double()[:, :, None] * s.double()[:, None, :] / nd) / (nd - 1)
    return {"cov_rel_err": _finite_or_none(_rel(cov, ref["cov64"], ref["cov64"])),
            "torch_cov_rel_err": _finite_or_none(_rel(ref["cov32"], ref["cov64"], ref["cov64"]))}


def check_candidate(cand, inputs, center: bool) -> dict:
    """Every check input's verdicts for ``cand``; ``failed`` names ``input: check`` pairs."""
    per = {label: check_one(cand, x, m, center) for label, x, m in inputs}
    return {"inputs": per, "failed": [f"{label}: {k}" for label, r in per.items() for k in r["failed"]],
            "ok": all(r["ok"] for r in per.values())}


# ------------------------------------------------------------------------------------ warm pool
class WarmPool:
    """Worker processes that run every (case, candidate) once on each input (``--warm``), so
    Triton compiles the candidates in parallel into its on-disk cache; at most ``jobs`` at once,
    in the order given (the most important case first)."""

    def __init__(self, pairs: list[tuple[str, str]], jobs: int, dry: bool, folder: Path):
        self.todo = list(pairs)
        self.jobs, self.dry, self.folder = jobs, dry, folder
        self.running: dict[tuple[str, str], tuple[subprocess.Popen, float, Path]] = {}
        self.done: dict[tuple[str, str], str] = {}
        self._fill()

    def _fill(self) -> None:
        while self.todo and len(self.running) < self.jobs:
            case, cand = key = self.todo.pop(0)
            log = self.folder / f"warm-{case}-{cand}.txt"
            argv = [sys.executable, __file__, "--warm", case, cand, *(["--dry-run"] if self.dry else [])]
            with open(log, "w") as f:
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
            self.running[key] = (proc, time.monotonic(), log)

    def poll(self) -> None:
        for key, (proc, t0, log) in list(self.running.items()):
            rc = proc.poll()
            if rc is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                self.done[key] = (f"ok in {time.monotonic() - t0:.1f}s" if rc == 0 else
                                  f"rc {rc} after {time.monotonic() - t0:.1f}s: {' '.join(tail)[:300]}")
                del self.running[key]
        self._fill()

    def wait(self, keys, deadline: float | None) -> None:
        """Until every key of ``keys`` has finished (or ``deadline`` passed)."""
        keys = set(keys)
        while True:
            self.poll()
            if not keys & (set(self.running) | set(self.todo)):
                return
            if deadline is not None and _now() > deadline:
                return
            time.sleep(0.05)

    def busy(self) -> bool:
        self.poll()
        return bool(self.running or self.todo)

    def close(self) -> None:
        """Kill what still runs (a capped or stopped race)."""
        self.todo.clear()
        for key, (proc, _, _) in list(self.running.items()):
            proc.kill()
            proc.wait()
            self.done[key] = "killed (time limit or stop)"
        self.running.clear()


def warm(case_name: str, cand_name: str, dry: bool) -> int:
    """A worker of :class:`WarmPool`: one launch of the candidate on each check input and at the
    full size (each compile lands in Triton's on-disk cache)."""
    case, cand = all_cases()[case_name], triton_configs.BY_NAME[cand_name]
    device = _device(dry)
    t0 = time.monotonic()
    for _, x, m in check_inputs(case, device, dry):
        _launch(x, m, case.center, cand)
    x, _ = timed_input(case, device)
    _launch(x, None, case.center, cand)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"warm {case_name} {cand_name}: ok in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


# ------------------------------------------------------------------------------------ timing
def _times(t, calls: int) -> dict:
    per = 1e6 / calls
    return {"device_us": t.median * per, "device_us_min": t.min * per, "device_us_max": t.max * per,
            "host_us": None if t.host is None else t.host * per, "clock": t.clock, "repeats": t.repeats}


def flops(case: Case, cand) -> float:
    """Flops of one ffn call: ``2·N·D²/2`` per dot (the triangle of G), 4 dots (``lolo``) or 3."""
    N = case.B * case.T * case.S
    return 2 * N * case.D ** 2 / 2 * (4 if cand.lolo else 3)


def time_case(case: Case, cands: list, device: torch.device, dry: bool, deadline: float | None) -> dict:
    """``{name: times}`` of ``cands`` at the case's full size, and ``"copy"`` for keys cases."""
    from fastspec.bench.timing import measure_interleaved

    x, storage = timed_input(case, device)
    calls = 1 if dry else CALLS[case.kernel]
    warmup, repeats = (0, 1) if dry else (WARMUP, REPEATS)  # dry: one interpreted call each

    def many(fn):
        def run():
            for _ in range(calls):
                fn()
        return run

    fns = [many(lambda c=c: _launch(x, None, case.center, c)) for c in cands]
    names = [c.name for c in cands]
    if case.kernel == "keys":
        dst = torch.empty_like(storage)
        fns.append(many(lambda: dst.copy_(storage)))
        names.append("copy")
    timings = measure_interleaved(fns, device=device, warmup=warmup, repeats=repeats, deadline=deadline,
                                  device_only=True)
    return {n: _times(t, calls) for n, t in zip(names, timings)}


# ------------------------------------------------------------------------------------ one case
def race_case(case: Case, device: torch.device, dry: bool, deadline: float | None, stop: list,
              pool: WarmPool | None) -> dict:
    cands = list(triton_configs.CANDIDATES[case.kernel])
    nbytes = math.prod(case.shape) * torch.finfo(getattr(torch, case.dtype)).bits // 8
    out = {"case": case.name, "kernel": case.kernel, "dtype": case.dtype, "center": case.center,
           "shape": list(case.shape), "layout": case.layout, "why": case.why, "bytes": nbytes,
           "default": cands[0].name, "candidates": {}, "not_raced": {}, "winner": None, "complete": False}
    if pool is not None:
        t0 = time.monotonic()
        pool.wait([(case.name, c.name) for c in cands], deadline)
        out["warm_wait_s"] = round(time.monotonic() - t0, 2)
    inputs = check_inputs(case, device, dry)
    checked = []
    for cand in cands:  # the checks also load (or compile) each candidate before any clock runs
        if stop or (deadline is not None and _now() > deadline):
            out["not_raced"][cand.name] = "time limit"
            continue
        r = out["candidates"][cand.name] = {"config": cand.describe(), "lolo": cand.lolo, "presplit": cand.presplit}
        if pool is not None:
            r["warm"] = pool.done.get((case.name, cand.name), "not finished")
        try:
            r["check"] = check_candidate(cand, inputs, case.center)
            r["ok"] = r["check"]["ok"]
            checked.append(cand)
        except Exception as exc:  # a candidate that raises is a finding, not the end of the race
            if stop:  # raised while the run is being stopped: the signal's doing
                raise
            text = str(exc).strip().splitlines()
            r.update(error=f"{type(exc).__name__}: {text[0] if text else ''}"[:500], ok=False)
    del inputs
    if pool is not None:  # no worker's kernels on the GPU while the clocks run
        pool.wait([*pool.running, *pool.todo], deadline)
        if pool.busy():
            pool.close()
    if checked and (stop or (deadline is not None and _now() > deadline)):
        for cand in checked:
            out["candidates"][cand.name]["not_timed"] = "time limit"
        return out
    try:
        times = time_case(case, checked, device, dry, deadline) if checked else {}
    except Exception:  # one candidate that fails only at the full size: find it, time the others
        if stop:
            raise
        checked = [c for c in checked if _runs_full_size(case, c, device, out["candidates"][c.name])]
        times = time_case(case, checked, device, dry, deadline) if checked else {}
    copy = times.pop("copy", None)
    if copy is not None:
        out["copy"] = {**copy, "GBps": 2 * nbytes / (copy["device_us"] * 1e-6) / 1e9}
    for cand in checked:
        r = out["candidates"][cand.name]
        r.update(times[cand.name])
        t = r["device_us"] * 1e-6
        r["GBps"] = nbytes / t / 1e9
        if copy is not None:
            r["pct_of_copy_bandwidth"] = 100 * r["GBps"] / out["copy"]["GBps"]
        if case.kernel == "ffn":
            r["TFLOPs"] = flops(case, cand) / t / 1e12
    out["complete"] = not out["not_raced"]
    out["winner"] = pick(out["candidates"])
    return out


def _runs_full_size(case: Case, cand, device: torch.device, r: dict) -> bool:
    """Whether ``cand`` runs at the case's full size; if not, its error goes into ``r`` (not ok)."""
    x, _ = timed_input(case, device)
    try:
        _launch(x, None, case.center, cand)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except Exception as exc:  # noqa: BLE001 - the candidate's own failure, a finding like a failed check
        text = str(exc).strip().splitlines()
        r.update(error=f"at the full size: {type(exc).__name__}: {text[0] if text else ''}"[:500], ok=False)
        return False


def pick(cands: dict[str, dict]) -> str | None:
    """The fastest candidate (``device_us``) of those that passed their checks; None when none did."""
    passing = {n: r["device_us"] for n, r in cands.items() if r.get("ok") and "device_us" in r}
    return min(passing, key=passing.get) if passing else None


def table_row(res: dict, arch: int, device_name: str, date: str, dry: bool) -> dict | None:
    """The table row a case asks for (``triton_configs`` reads the first five keys), None without
    a winner or when the case was cut short (a candidate not raced could have been faster)."""
    if res["winner"] is None or not res["complete"]:
        return None
    ok = {n: round(r["device_us"], 2) for n, r in res["candidates"].items() if r.get("ok") and "device_us" in r}
    row = {"arch": arch, "kernel": res["kernel"], "dtype": res["dtype"], "center": res["center"],
           "config": res["winner"],
           "measured": {"device": device_name, "date": date, "case": res["case"], "device_us": ok,
                        "default": res["default"]}}
    if dry:
        row["dry_run"] = True
    return row


# ------------------------------------------------------------------------------------ printing
def _rate(r: dict, kernel: str) -> str:
    if kernel == "ffn":
        return f"{r['TFLOPs']:7.3g} TFLOP/s"
    pct = f" {r['pct_of_copy_bandwidth']:4.0f}% of copy" if "pct_of_copy_bandwidth" in r else ""
    return f"{r['GBps']:7.3g} GB/s{pct}"


def _g(v: float | None) -> str:
    return "nan" if v is None else f"{v:.2g}"


def lines(res: dict) -> list[str]:
    """The case's short table: winner, then each candidate's time, rate and verdict."""
    copy = res.get("copy")
    head = f"{res['case']}: winner {res['winner']}" + (
        f"  (copy {copy['device_us']:.3g} µs = {copy['GBps']:.3g} GB/s read + write)" if copy else "")
    out = [head]
    for name, r in sorted(res["candidates"].items(), key=lambda kv: kv[1].get("device_us", math.inf)):
        if "error" in r:
            out.append(f"  {name:<14} ERROR {r['error']}")
            continue
        worst = max(r["check"]["inputs"].values(), key=lambda v: (v["gram_rel_err"] is None, v["gram_rel_err"] or 0))
        cov = (f"; cov {_g(worst['cov_rel_err'])} vs torch.cov {_g(worst['torch_cov_rel_err'])}"
               if "cov_rel_err" in worst else "")
        verdict = ("ok" if r["ok"] else "FAILS " + ", ".join(r["check"]["failed"])) + (
            f" (G err {_g(worst['gram_rel_err'])} vs torch {_g(worst['torch_gram_rel_err'])}{cov})")
        if "device_us" in r:
            t = f"{r['device_us']:9.4g} µs ({r['device_us_min']:.4g}-{r['device_us_max']:.4g})  {_rate(r, res['kernel'])}"
        else:
            t = f"{'not timed: ' + r.get('not_timed', '?'):<40}"
        out.append(f"  {name:<14} {t}  {verdict}")
    out += [f"  {name:<14} not raced: {why}" for name, why in res["not_raced"].items()]
    return out


# ------------------------------------------------------------------------------------ the run
def _device(dry: bool) -> torch.device:
    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("triton_race.py --dry-run: TRITON_INTERPRET=1 must be set before Triton is imported")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("triton_race.py: no CUDA device; run with --dry-run on a machine without a GPU")
    return torch.device("cuda", torch.cuda.current_device())


def default_jobs(dry: bool, pairs: int) -> int:
    """Warm workers: none in a dry run (nothing to compile), else the CPU cores less one, at most one per pair."""
    return 0 if dry else max(0, min(pairs, (os.cpu_count() or 2) - 1))


def run(json_path: Path, time_limit: float | None, dry: bool, jobs: int | None = None,
        names: list[str] | None = None) -> int:
    from fastspec.commands._bench_common import write_json
    from fastspec.sysinfo import environment

    start = time.monotonic()
    deadline = _now() + time_limit if time_limit is not None else None
    device = _device(dry)
    if dry:
        arch, device_name = DRY_ARCH, "cpu (dry run: wall-clock stand-in)"
    else:
        arch, device_name = triton_configs.arch_of(device), torch.cuda.get_device_name(device)
    cases = [c for c in (DRY_CASES if dry else CASES) if not names or c.name in names]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    doc = {"schema": SCHEMA, "kind": "triton-race", "date": date, "dry_run": dry, "environment": environment(),
           "device": device_name, "arch": arch,
           "timing": ("cpu stand-in: wall clock of the interpreted kernels, not a GPU time (says nothing about "
                      "GPU speed)" if dry else
                      f"µs per call: {CALLS} calls per sample (by kernel), median and range of {REPEATS} "
                      f"round-robin rounds after {WARMUP} warm-up rounds; device: CUDA events with a spin kernel "
                      "ahead; host: the host's time to queue the calls meanwhile"),
           "check": (f"{LAUNCHES} launches per input, bitwise equal; n, rejected exact; |G - G64| / |G64| <= "
                     f"{TOL_FACTOR} x torch float32's + {FLOOR:.3g}; the same for the sums, relative to sum |x - c|"),
           "candidates": {k: {c.name: c._asdict() for c in cs} for k, cs in triton_configs.CANDIDATES.items()},
           "results": [], "rows": [], "not_run": []}

    def write() -> None:
        write_json(json_path, doc, quiet=True)

    write()
    pairs = [(c.name, cand.name) for c in cases for cand in triton_configs.CANDIDATES[c.kernel]]
    jobs = default_jobs(dry, len(pairs)) if jobs is None else jobs
    doc["warm_jobs"] = jobs
    failed: list[str] = []
    with sigterm_stops() as (stop, inside), tempfile.TemporaryDirectory(prefix="triton-race-") as folder:
        pool = WarmPool(pairs, jobs, dry, Path(folder)) if jobs > 0 else None
        try:
            for case in cases:
                t0 = time.monotonic()
                res = attempt(case.name, functools.partial(race_case, case, device, dry, deadline, stop, pool),
                              doc["not_run"], stop, inside, deadline is not None and _now() > deadline)
                if res is None:
                    continue
                doc["results"].append(res)
                row = table_row(res, arch, device_name, date, dry)
                if row is not None:
                    doc["rows"].append(row)
                write()
                failed += [f"{n} fails on {case.name}: " + (r.get("error") or ", ".join(r["check"]["failed"]))
                           for n, r in res["candidates"].items() if not r.get("ok")]
                if res["complete"] and res["winner"] is None:
                    failed.append(f"no candidate passed on {case.name}")
                print("\n".join(lines(res)) + f"\n  [{time.monotonic() - t0:.1f}s]", flush=True)
        finally:
            if pool is not None:
                pool.close()
            write()  # the cases not run, too
    cut = doc["not_run"] or any(not r["complete"] for r in doc["results"])
    if cut:  # the words the GPU kit reads as a capped step
        print(f"triton_race.py: time cap reached: {len(doc['not_run'])} case(s) not run, "
              f"{sum(not r['complete'] for r in doc['results'])} cut short", flush=True)
    for line in failed:
        print(f"check: {line}", flush=True)
    print(f"triton_race.py: {len(doc['rows'])} row(s) in {json_path} ({time.monotonic() - start:.1f}s)", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ merging
def merge(json_path: Path, table: Path | None = None) -> int:
    """Replace the table's rows of the same (arch, kernel, dtype, center) by ``json_path``'s rows;
    refuse a dry run's, and a row whose candidate failed its checks in that race. The table's
    other rows, ``format`` and ``about`` stay."""
    doc = race_result(json_path, SCHEMA, "Triton configuration race")
    if doc is None:
        return 2
    rows = doc.get("rows", [])
    results = {r["case"]: r for r in doc.get("results", [])}
    try:
        new = [(triton_configs._check_row(r), r) for r in rows]
    except (KeyError, ValueError) as exc:
        print(f"--merge: {json_path}: {exc}", file=sys.stderr)
        return 2
    for row, d in new:
        res = results.get(d.get("measured", {}).get("case"))
        if res is not None and not res.get("candidates", {}).get(row.config, {}).get("ok"):
            print(f"--merge: {json_path}: the row for {res['case']} names {row.config}, which failed its checks "
                  "in that race", file=sys.stderr)
            return 2
    table = table or triton_configs.TABLE
    data = json.loads(table.read_text())
    keys = {row.key() for row, _ in new}
    try:
        kept = [d for d in data.get("rows", []) if triton_configs._check_row(d).key() not in keys]
    except (KeyError, ValueError) as exc:
        print(f"--merge: {table}: a row the table holds is wrong ({exc}); fix it first", file=sys.stderr)
        return 2
    data["rows"] = kept + [d for _, d in new]
    write_table(table, data)
    triton_configs.forget()
    print(f"{table}: {len(new)} row(s) merged from {json_path} ({len(kept)} other row(s) kept)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="triton_race.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="result file (rewritten after every case)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="nothing new starts after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreted Triton: stand-in times")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="warm-up workers compiling the candidates in parallel (default: none in a dry run, "
                        "else the CPU cores less one)")
    p.add_argument("--case", action="append", choices=sorted(all_cases()), help="race only this case (repeatable)")
    p.add_argument("--merge", type=Path, metavar="RACE_JSON", help="merge a race's rows into the table")
    p.add_argument("--warm", nargs=2, metavar=("CASE", "CANDIDATE"), help=argparse.SUPPRESS)  # a pool worker
    args = p.parse_args(argv)
    if args.merge is not None:
        return merge(args.merge)
    if args.dry_run:  # before anything imports Triton: its kernels are interpreted only when it is set then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.warm is not None:
        case, cand = args.warm
        if case not in all_cases() or cand not in triton_configs.BY_NAME:
            p.error(f"--warm: unknown case or candidate {args.warm}")
        return warm(case, cand, args.dry_run)
    if args.json is None:
        p.error("--json FILE is required (or --merge RACE_JSON)")
    if args.time_limit is not None and args.time_limit < 0:
        p.error(f"--time-limit: expected seconds >= 0, got {args.time_limit:g}")
    if args.jobs is not None and args.jobs < 0:
        p.error(f"--jobs: expected a count >= 0, got {args.jobs}")
    if args.case:
        kind = {c.name for c in (DRY_CASES if args.dry_run else CASES)}
        bad = [c for c in args.case if c not in kind]
        if bad:
            p.error(f"--case: {', '.join(bad)} is not a {'dry-run' if args.dry_run else 'GPU'} case; "
                    f"expected one of {', '.join(sorted(kind))}")
    return run(args.json, args.time_limit, args.dry_run, args.jobs, args.case)


if __name__ == "__main__":
    sys.exit(main())
