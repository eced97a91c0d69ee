"""The eigensolver race: every algorithm of the CUDA kernel on the same batches, timed and checked,
and the selection-table rows that the measurement says to commit.

    python benchmarks/eig_race.py --json OUT/race.json [--time-limit S] [--dry-run [--real-n]]
    python benchmarks/eig_race.py --merge OUT/race.json     # its rows into fastspec/eig/selection.json

Per shape of :data:`SHAPES` (the kernel's target 4096 x 128² float32, the probe's float64 keys
solve 256 x 128², float32 n = 256, and the batch sizes a 1.5B model's probe produces), every
algorithm of :mod:`fastspec.eig.variants` that takes the shape and whose shared memory fits this
GPU is

* timed on the eigvalsh benchmark's inputs (power-law Gram matrices), round-robin with the other
  algorithms (CUDA events, median of the timed rounds; compile and load happen before, in the GPU
  kit's ``kernels`` step or the warm-up);
* checked on those inputs against float64 (``max_i |λ_i − λ_i^ref| / max |λ^ref|`` over the first
  matrices, beside ``torch.linalg.eigvalsh``'s own error in the same dtype) and on the hard battery
  (every family of :mod:`fastspec.eig.matrices`): per family the ratio of the error to the bound,
  ``2 × torch fp32 error + 8·eps32·‖A‖`` for float32 and ``n·eps64·‖A‖`` for float64 (the tests'
  criterion), reported as worst and mean; ``ok`` when every ratio is at most 1.

Beside fastspec's own algorithms races ``cusolverdx``: NVIDIA cuSolverDx's ``heev`` built for the shape
(``fastspec/eig/mathdx.py``; the ``fastspec[mathdx]`` extra, which the GPU kit carries as a wheel),
timed and checked the same way, and ``ok`` only if, besides, its status word is 0 for every matrix
of the checks (a matrix its QR iteration did not converge on cannot win). Where it cannot be built
or does not fit shared memory, ``not_raced`` says why.

The winner of a shape is the fastest algorithm that is ``ok``; its row (arch, dtype, the n and
batch ranges the shape stands for, the algorithm, and the times of all of them) goes to the JSON's
``rows``, ready for ``--merge``, which replaces the table's rows of the same key (except where the
table's algorithm ties with the winner: repeat ranges that overlap) and refuses a dry run's rows.
The JSON is rewritten after every shape: a run stopped by its time limit or a signal keeps what
it finished.

``--dry-run``: CPU at tiny sizes, so this file cannot rot where no GPU exists (CI runs it). The
``cusolverdx`` row is generated, compiled and linked for sm_90 at the shape's n (what the GPU run
loads), and not run: nothing emulates it; its entry says what was built. Each of fastspec's
algorithms runs as the team emulation (``fastspec.eig.native.team_eigvalsh``: its own code, one
rank per CUDA thread) and its time is the emulation's: a stand-in, labelled as such in the JSON, that says
nothing about GPU speed. The dry run's rows are marked ``dry_run`` and cannot be merged. With
``--real-n`` the dry run keeps each shape's own n (batches of 2, a battery of 4 per family):
slow (minutes), but its accuracy columns are the algorithms' own on the hard battery, the GPU
aside (the emulation runs the same code; the GPU's approximate reciprocals are modelled).
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SCHEMA = "fastspec-eig-race-1"
EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
REF_MATRICES = 64      # matrices of each timed batch the float64 reference covers
BATTERY_BATCH = 8      # matrices per family of the hard battery (1 in a dry run)
# a tiny dry run's families: the emulation solves ~14 small matrices a second on 2 cores, and all
# 21 families x every algorithm x 7 shapes took 34 s of a 46 s dry race, past the kit's 40 s cap
# (now 21 s in all). One of each kind of hardness; the whole battery runs on a GPU and with --real-n
DRY_FAMILIES = ("degenerate", "graded-1e-12", "large-mean", "powerlaw-1e30", "spd-1e-30", "subnormal-fp32",
                "wilkinson")


@dataclass(frozen=True)
class Shape:
    """One race: ``batch`` matrices ``n x n`` of ``dtype``, standing for the table key ``n_range``
    x ``batch_range`` (``None``: no upper end)."""

    name: str
    dtype: str
    n: int
    batch: int
    n_range: tuple[int, int]
    batch_range: tuple[int, int | None]
    why: str


SHAPES = (
    Shape("B4096-n128-fp32", "float32", 128, 4096, (97, 128), (1024, None), "the kernel's target (eig convention)"),
    Shape("B256-n128-fp64", "float64", 128, 256, (97, 128), (1, 383),
          "the probe's keys solve at the 1.5B shape: 32 layers x 8 KV heads, float64 (sv), one wave"),
    Shape("B512-n128-fp64", "float64", 128, 512, (97, 128), (384, 2047),
          "the probe's queries solve at the 1.5B shape: 32 layers x 16 heads"),
    Shape("B512-n256-fp32", "float32", 256, 512, (193, 256), (1, None), "head_dim 256 (Gemma 2/3)"),
    Shape("B256-n128-fp32", "float32", 128, 256, (97, 128), (1, 1023), "one probe's keys in float32, one wave"),
    Shape("B4096-n128-fp64", "float64", 128, 4096, (97, 128), (2048, None), "float64 at the kernel's target batch"),
    Shape("B4096-n64-fp32", "float32", 64, 4096, (1, 96), (1, None), "head_dim 64"),
)
DRY = {128: 20, 256: 30, 64: 12}  # the dry run's n for each shape's n (one warp: the emulation is slow)
DRY_BATCH = 2


def dry_shape(s: Shape, real_n: bool = False) -> Shape:
    return Shape(s.name + "-dry", s.dtype, s.n if real_n else DRY[s.n], DRY_BATCH, s.n_range, s.batch_range, s.why)


# ------------------------------------------------------------------------------------ solving
class HeevSolve:
    """``A -> eigenvalues`` by cuSolverDx's heev, its int32 status per matrix kept while
    ``checking`` (the timed calls read nothing back: no sync)."""

    def __init__(self) -> None:
        self.checking = False
        self.statuses: list[torch.Tensor] = []

    def __call__(self, A: torch.Tensor) -> torch.Tensor:
        from fastspec.eig import cuda

        out = torch.empty(A.shape[:2], dtype=A.dtype, device=A.device)
        status = torch.empty(A.shape[0], dtype=torch.int32, device=A.device)
        cuda.launch(A, out, algo="cusolverdx", status=status)
        if self.checking:
            self.statuses.append(status)
        return out

    def failures(self) -> int:
        """Matrices of the checks whose status was not 0."""
        return sum(int((s != 0).sum()) for s in self.statuses)


def solver(algo: str, dry: bool):
    """``A -> eigenvalues`` by algorithm ``algo``: the CUDA kernel forced to it, or its emulation."""
    from fastspec.eig import variants

    if algo in variants.EXTERNAL:
        return HeevSolve()
    if dry:
        from fastspec.eig.native import team_eigvalsh

        return lambda A: team_eigvalsh(A, algo)[0]
    from fastspec.eig import cuda

    def solve(A: torch.Tensor) -> torch.Tensor:
        out = torch.empty(A.shape[:2], dtype=A.dtype, device=A.device)
        cuda.launch(A, out, algo=algo)
        return out

    return solve


def candidates(shape: Shape, spec) -> tuple[list[str], dict[str, str]]:
    """The algorithms that take ``shape`` and fit this GPU; and why each other one does not."""
    from fastspec.eig import cuda, variants

    ok, why_not = [], {}
    for name in variants.names():
        a = variants.ALGORITHMS.get(name)
        if a is not None and not a.takes(shape.n, shape.dtype):
            why_not[name] = f"takes {'/'.join(a.dtypes)} with n <= {a.max_n}"
            continue
        try:
            cuda.variant_for(shape.n, shape.dtype, spec, name)
        except ValueError as exc:
            why_not[name] = str(exc)
            continue
        ok.append(name)
    return ok, why_not


# ------------------------------------------------------------------------------------ accuracy
@dataclass
class Battery:
    """The hard battery at one ``n`` and dtype: every family's matrices, their float64 LAPACK
    eigenvalues and the bound of the tests' criterion, computed once for all algorithms."""

    matrices: dict[str, torch.Tensor]
    refs: dict[str, torch.Tensor]
    bounds: dict[str, float]

    @classmethod
    def make(cls, n: int, dtype: torch.dtype, batch: int, families: tuple[str, ...] | None = None) -> Battery:
        """``families``: a subset of the battery's (None: all of them)."""
        from fastspec.eig.matrices import FAMILIES, make_batch

        mats, refs, bounds = {}, {}, {}
        for fam in sorted(FAMILIES if families is None else families):
            A = torch.from_numpy(make_batch(fam, n, batch, seed=7)).to(dtype)
            ref = torch.linalg.eigvalsh(A.double())
            norm = float(ref.abs().max())
            if dtype == torch.float64:  # the classical backward-stability bound (tests/test_eig_host.py)
                bound = n * EPS64 * norm
            else:  # twice torch's own float32 error, plus a floor
                bound = 2 * float((torch.linalg.eigvalsh(A).double() - ref).abs().max()) + 8 * EPS32 * norm
            mats[fam], refs[fam], bounds[fam] = A, ref, bound
        return cls(mats, refs, bounds)

    def check(self, solve, device: torch.device) -> dict:
        """Worst and mean ratio of the error to the bound over the families (<= 1 passes)."""
        ratios = {}
        for fam, A in self.matrices.items():
            err = float((solve(A.to(device)).double().cpu() - self.refs[fam]).abs().max())
            b = self.bounds[fam]
            ratios[fam] = err / b if b > 0 else (0.0 if err == 0 else math.inf)
        worst = max(ratios, key=ratios.get)
        return {"worst_ratio": ratios[worst], "worst_family": worst,
                "mean_ratio": sum(ratios.values()) / len(ratios), "ok": all(r <= 1 for r in ratios.values())}


# ------------------------------------------------------------------------------------ the race
def race_shape(shape: Shape, device: torch.device, spec, dry: bool, deadline: float | None,
               battery_batch: int = BATTERY_BATCH, families: tuple[str, ...] | None = None) -> dict:
    from fastspec.bench.case import max_rel_err
    from fastspec.bench.suites.eigvalsh import powerlaw_gram
    from fastspec.bench.timing import measure_interleaved
    from fastspec.eig import variants

    dtype = getattr(torch, shape.dtype)
    names, why_not = candidates(shape, spec)
    built = {}
    if dry:  # nothing emulates the vendor's code: built for sm_90 at this n, not run
        built = {name: dry_build(name, shape) for name in names if name in variants.EXTERNAL}
        names = [name for name in names if name not in built]
    A = powerlaw_gram(shape.batch, shape.n, device, dtype)
    k = min(shape.batch, REF_MATRICES)
    ref = torch.linalg.eigvalsh(A[:k].double().cpu())
    torch_err = max_rel_err(torch.linalg.eigvalsh(A[:k].cpu()), ref)
    hard = Battery.make(shape.n, dtype, battery_batch, families)
    solves = {name: solver(name, dry) for name in names}
    for name, solve in solves.items():  # compile and load before the clock (the kit's kernels step did most)
        solve(A[:1])
    warmup, repeats = (0, 1) if dry else (2, 10)
    timings = measure_interleaved([lambda s=s: s(A) for s in solves.values()], device=device,
                                  warmup=warmup, repeats=repeats, deadline=deadline)
    out = {"shape": shape.name, "dtype": shape.dtype, "n": shape.n, "batch": shape.batch, "why": shape.why,
           "torch_rel_err": torch_err, "not_raced": why_not, "algorithms": {}}
    for (name, solve), t in zip(solves.items(), timings):
        if isinstance(solve, HeevSolve):
            solve.checking = True
        err = max_rel_err(solve(A[:k]).cpu(), ref)
        bat = hard.check(solve, device)
        out["algorithms"][name] = {"ms": t.median * 1e3, "ms_min": t.min * 1e3, "ms_max": t.max * 1e3,
                                   "repeats": t.repeats, "us_per_matrix": t.median * 1e6 / shape.batch,
                                   "rel_err": err, "battery": bat, "ok": bat["ok"]}
        if isinstance(solve, HeevSolve):  # a status word != 0 (not converged, non-finite) cannot win
            failures = solve.failures()
            out["algorithms"][name].update(status_failures=failures, ok=bat["ok"] and failures == 0)
    for name, b in built.items():
        out["algorithms"][name] = {"ms": None, "ok": False, "dry_run_build": b,
                                   "why": "dry run: built for sm_90, not run (nothing emulates it)"}
    passing = {n: a["ms"] for n, a in out["algorithms"].items() if a["ok"]}
    out["winner"] = min(passing, key=passing.get) if passing else None
    return out


def dry_build(name: str, shape: Shape) -> dict:
    """A dry run's vendor row: built (generated, compiled, linked) for sm_90 at the shape's n, or why not."""
    from fastspec.eig import mathdx

    try:
        b = mathdx.build(shape.n, shape.dtype, 90)
    except Exception as exc:  # noqa: BLE001 - said in the row: the race goes on without it
        return {"built": False, "error": f"{type(exc).__name__}: {exc}"}
    h = b.heev
    return {"built": True, "arch": 90, "n": h.n, "threads": h.threads, "per_block": h.per_block,
            "workspace": h.workspace, "smem": h.smem, "registers": b.registers, "cubin_bytes": len(b.cubin),
            "cusolverdx": h.version, "origin": b.origin, "seconds": round(b.seconds, 3)}


def table_row(result: dict, shape: Shape, arch: int, device_name: str, date: str, dry: bool) -> dict | None:
    """The selection-table row a shape's result asks for (``variants.Row`` JSON), None without a winner."""
    if result["winner"] is None:
        return None
    ms = {n: round(a["ms"], 4) for n, a in result["algorithms"].items() if a["ok"]}
    return {"arch": arch, "dtype": shape.dtype, "n": list(shape.n_range), "batch": list(shape.batch_range),
            "algo": result["winner"],
            "measured": {"device": device_name, "date": date, "shape": result["shape"], "ms": ms,
                         **({"dry_run": True} if dry else {})}}


def run(json_path: Path, time_limit: float | None, dry: bool, real_n: bool = False) -> int:
    from fastspec.commands._bench_common import write_json
    from fastspec.eig import cuda
    from fastspec.sysinfo import environment

    start = time.monotonic()
    deadline = start + time_limit if time_limit is not None else None
    if dry:
        device, spec, arch = torch.device("cpu"), cuda.DeviceSpec.for_arch(90), 90
        device_name = "cpu (dry run: team emulation)"
    else:
        if not torch.cuda.is_available():
            print("eig_race.py: no CUDA device; run with --dry-run on a machine without a GPU", file=sys.stderr)
            return 1
        device = torch.device("cuda")
        spec = cuda.DeviceSpec.of_device(torch.cuda.current_device())
        arch, device_name = spec.cc, torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d", time.gmtime())
    doc = {"schema": SCHEMA, "kind": "eig-race", "date": date, "dry_run": dry, "environment": environment(),
           "timing": ("cpu stand-in: the team emulation on the host, not a GPU time (says nothing about GPU "
                      "speed)" if dry else "CUDA events, median of 10 round-robin rounds after 2 warm-up rounds"),
           "sizes": "real" if real_n or not dry else "tiny", "results": [], "rows": [], "not_run": []}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))

    def write() -> None:
        write_json(json_path, doc, quiet=True)

    write()
    for shape in SHAPES:
        s = dry_shape(shape, real_n) if dry else shape
        if stop or (deadline is not None and time.monotonic() > deadline):
            doc["not_run"].append(s.name)
            print(f"{s.name}: not run (time limit)", flush=True)
            continue
        t0 = time.monotonic()
        tiny = dry and not real_n
        res = race_shape(s, device, spec, dry, deadline, (4 if real_n else 1) if dry else BATTERY_BATCH,
                         DRY_FAMILIES if tiny else None)
        doc["results"].append(res)
        row = table_row(res, shape, arch, device_name, date, dry)
        if row is not None:
            doc["rows"].append(row)
        write()
        times = "  ".join(_says(n, a) for n, a in sorted(res["algorithms"].items(),
                                                          key=lambda kv: math.inf if kv[1]["ms"] is None else kv[1]["ms"]))
        print(f"{s.name}: winner {res['winner']}  {times}  [{time.monotonic() - t0:.1f}s]", flush=True)
    write()  # the shapes not run, too
    # a dry run's vendor row fails only when it could not be built (it is never run there)
    failed = [(r["shape"], n) for r in doc["results"] for n, a in r["algorithms"].items()
              if not a["ok"] and (a["ms"] is not None or not a["dry_run_build"]["built"])]
    for shape_name, name in failed:
        print(f"accuracy: {name} fails the bound on {shape_name}", flush=True)
    return 1 if failed else 0


def _says(name: str, a: dict) -> str:
    """One algorithm's part of a shape's line."""
    if a["ms"] is None:
        b = a.get("dry_run_build") or {}
        return (f"{name} built for sm_90 ({b.get('threads')} threads, {b.get('registers')} registers, "
                f"{b.get('smem')} B shared), not run" if b.get("built") else f"{name} NOT BUILT ({b.get('error')})")
    extra = "" if a["ok"] else " (FAILS accuracy)" if a.get("status_failures", 0) == 0 else \
        f" (status != 0 on {a['status_failures']} matrices)"
    return f"{name} {a['ms']:.3f} ms{extra}"


def tie(result: dict | None, winner: str, other: str) -> bool:
    """True when ``other`` passed this race's accuracy checks and its timed rounds overlap the
    winner's (``ms_min``..``ms_max``): a lead inside the noise by ``fastspec bench``'s own rule
    (:func:`fastspec.bench.table.noise_pct`). False without the ranges or with a single round."""
    from fastspec.bench.table import noise_pct

    algos = (result or {}).get("algorithms", {})
    w, o = algos.get(winner), algos.get(other)
    if not (w and o and o.get("ok")):
        return False
    return noise_pct({"repeats": min(w.get("repeats", 0), o.get("repeats", 0)),
                      "fastspec_min_s": w.get("ms_min"), "fastspec_max_s": w.get("ms_max"),
                      "baseline_min_s": o.get("ms_min"), "baseline_max_s": o.get("ms_max")}) is not None


def merge(json_path: Path, table: Path | None = None) -> int:
    """Replace the table's rows of the same key by ``json_path``'s rows; refuse a dry run's.

    A table row whose algorithm differs from the race's winner but ties with it in this race
    (:func:`tie`) stays: two sm_90 GPUs, or two runs of one, put near-equal algorithms in either
    order (4096 x 64² fp32: ``packed`` first by 0.2% on an H100, ``regs`` by 0.5% on an H200), and a
    table that flips on noise says nothing."""
    from fastspec.eig import variants

    doc = json.loads(json_path.read_text())
    if doc.get("schema") != SCHEMA:
        print(f"--merge: {json_path} is not an eig race result (schema {doc.get('schema')!r})", file=sys.stderr)
        return 2
    if doc.get("dry_run"):
        print(f"--merge: {json_path} is a dry run: its times are CPU stand-ins, not measurements", file=sys.stderr)
        return 2
    table = table or variants.TABLE
    data = json.loads(table.read_text())
    new = [variants.Row.from_json(r) for r in doc["rows"]]
    variants.check_rows(new)

    def key(r: variants.Row) -> tuple:
        return r.arch, r.dtype, r.n_lo, r.n_hi, r.batch_lo, r.batch_hi

    held = {key(variants.Row.from_json(d)): d for d in data["rows"]}
    results = {r.get("shape"): r for r in doc.get("results", [])}
    replaced, ties = [], []
    for r in new:
        h = held.get(key(r))
        if h is not None and h["algo"] != r.algo and tie(results.get(r.measured.get("shape")), r.algo, h["algo"]):
            ties.append(f"{r.measured.get('shape')}: {h['algo']} kept ({r.algo} won inside the noise)")
        else:
            replaced.append(r)
    keys = {key(r) for r in replaced}
    kept = [d for k, d in held.items() if k not in keys]
    data["rows"] = kept + [r.to_json() for r in replaced]
    table.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{table}: {len(replaced)} rows merged from {json_path} ({len(kept)} other rows kept)")
    for line in ties:
        print(f"  tie: {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eig_race.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="result file (rewritten after every shape)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="no new shape after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the team emulation as a stand-in")
    p.add_argument("--real-n", action="store_true", help="dry run at each shape's own n (slow; real accuracy)")
    p.add_argument("--merge", type=Path, metavar="RACE_JSON", help="merge a race's rows into the selection table")
    args = p.parse_args(argv)
    if args.merge is not None:
        return merge(args.merge)
    if args.json is None:
        p.error("--json FILE is required (or --merge RACE_JSON)")
    if args.real_n and not args.dry_run:
        p.error("--real-n: only with --dry-run (a GPU run always uses the real sizes)")
    return run(args.json, args.time_limit, args.dry_run, args.real_n)


if __name__ == "__main__":
    sys.exit(main())
