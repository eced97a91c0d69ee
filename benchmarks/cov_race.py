"""The covariance route race: every route of an exact keys update on the same keys, timed and
checked, and the route-table rows that the measurement says to commit.

    python benchmarks/cov_race.py --json OUT/cov_race.json [--time-limit S] [--dry-run]
    python benchmarks/cov_race.py --merge OUT/cov_race.json   # its rows into fastspec/covariance/routes.json

An *exact keys update* is the float64-product raw-sum update of ``Covariance.update`` for keys
(``precision="auto"``, ``track_mean=False`` on a full-rate-float64 GPU): ``n``, ``rejected``,
``Σx`` and ``Σxxᵀ`` per head. :mod:`fastspec.covariance.routes` has several ways to compute it
(``dmma``, ``triton_f64``, ``prep_gemm``, ``blocked``) and picks one from its table; this race
writes that table. Per shape of :data:`SHAPES`, in order of importance (a capped run keeps the
first): the bench's keys headline ``[8, 8, 2048, 128]`` bf16 (16384 rows per head), one layer of
the 1.5B probe ``[4, 8, 2048, 128]`` bf16 (8192), then fp16 and head_dim 64, each stored as
attention stores keys (``[B, H, T, D]``, read through the ``[B, T, H, D]`` view
``transpose(1, 2)``, as the probe reads them). Every route whose ``status`` is "" is raced (the
others are listed in ``not_raced`` with their reason; a status that raises, e.g. from a module
not written yet, reads ``unavailable: <exception>``), each one:

* checked, on a rank-deficient input of the same shape and layout (pre-RoPE rank ``D/16``, RoPE,
  a +0.5 offset, rounded to the dtype: a spectrum from ``σ_max`` down to ~1e-4 of it, where float32
  sums already miss by ~1e-4) with a mask (the last eighth of the first sequence is padding) and a
  NaN in one valid and one padded row: ``n`` and ``rejected`` exact; ``Σx`` and ``G`` against a
  float64 sum of the same rows, ``max|ΔG| / max|G_ref|`` within ``2·rows·eps64`` (the bound of any
  float64 summation order, for the route and the reference alike); each head's ``sv`` spectrum,
  ``sqrt`` of float64 ``eigvalsh(G)``, against float64 ``torch.linalg.svdvals`` of its valid rows,
  relative to ``σ_max``, and its participation ratio, both within 1e-8 (or 4x what the float64
  reference Gram itself gets, where that is more: the ``sqrt(eps64)`` limit of any Gram route); the
  whole ``Covariance.update`` forced to the route (``$FASTSPEC_COV_VARIANT``) gives the same ``G``
  and counts; and three calls give equal bits. A route that fails any of these cannot win, and
  fails the run (exit status 1);
* timed on the bench's keys (no mask), round-robin with the other routes (interleaved rounds,
  median and range of 5 after 2 warm-up rounds), each sample :data:`CALLS` calls, twice:
  ``partials``, the route's own call (``routes.partials``), and ``update``, the whole
  ``fastspec.Covariance((S, D), track_mean=False, precision="auto").update`` under
  ``FASTSPEC_COV_VARIANT=<route>`` (the float64 merge included, or folded into the route's last
  kernel where it has ``accumulate``): what the probe calls, and what the table decides. Each has
  ``device_us``, the device's time per call on CUDA events with a spin kernel queued ahead
  (:func:`fastspec.bench.timing.measure_interleaved`, ``device_only``), so the host's launch time
  is hidden; ``host_us``, the host's time per call to queue it while the GPU is still busy (what a
  training step pays on the CPU side); and ``launches``, the CUDA kernels one call runs, profiled
  once (``torch.profiler``, events of category ``kernel``; CUPTI records the ``dmma`` kernel,
  launched through the driver API, as one too).

The winner of a shape is the route whose whole update is fastest on the device (``update``'s
``device_us``) among those that passed their checks; its row (arch, dtype, D, the row counts the
shape stands for, the route, and every passing route's update times and launches, its partials'
beside them) goes to the JSON's ``rows``, ready for ``--merge``. Row ranges: the two bf16 D128
shapes split at 12288 rows per head, halfway between their 8192 and 16384, so the 16384-row shape
stands for 12288 rows and up, the 8192-row one for 0 to 12287; a dtype or ``D`` raced at one shape
only stands for every row count. ``--merge`` replaces
the table's rows of the same key (except where the table's route ties with the winner: repeat
ranges that overlap, :func:`fastspec.bench.table.noise_pct`'s rule), drops rows the new ones
overlap, and refuses a dry run's rows. The JSON is rewritten after every shape: a run stopped by
its time limit or a signal keeps what it finished.

``--dry-run``: CPU at tiny sizes (``[2, 2, 16, 32]`` fp16 and fp32: the interpreter's bf16 dot is
not exact), the Triton routes under ``TRITON_INTERPRET=1`` (set here when unset), so this file
cannot rot where no GPU exists (the GPU kit's dry run, in CI, runs it). Times are wall-clock CPU
stand-ins, labelled so, that say nothing about GPU speed; launches are null; the rows are marked
``dry_run`` and cannot be merged.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SCHEMA = "fastspec-cov-race-1"
EPS64 = float(torch.finfo(torch.float64).eps)
SV_TOL = 1e-8          # spectrum and participation ratio vs float64 svdvals (the policy's promise)
FLOOR_FACTOR = 4       # ... or this many times the float64 reference Gram's own error, where larger
CALLS = 10             # calls per timed sample on CUDA: ~1 ms of work per sample, well above the events' resolution
WARMUP, REPEATS = 2, 5
DRY_ARCH = 90          # the arch the kit targets: a dry run's rows are keyed as for it (and never merged)
SPLIT = 12288          # rows per head: the boundary between the two bf16 D128 shapes (module docstring)


@dataclass(frozen=True)
class Shape:
    """One race: keys ``[B, S, T, D]`` of ``dtype`` read as ``[B, T, S, D]``, standing for the
    table key ``dtype``, ``D`` and ``rows_range`` rows per head (``None``: no upper end)."""

    name: str
    dtype: str
    B: int
    T: int
    S: int
    D: int
    rows_range: tuple[int, int | None]
    why: str

    @property
    def rows(self) -> int:
        return self.B * self.T


SHAPES = (
    Shape("keys-B8-T2048-S8-D128-bf16", "bfloat16", 8, 2048, 8, 128, (SPLIT, None),
          "the bench's keys headline (fastspec bench --suite covariance): 16384 rows per head"),
    Shape("layer-B4-T2048-S8-D128-bf16", "bfloat16", 4, 2048, 8, 128, (0, SPLIT - 1),
          "one layer's keys of the 1.5B probe shape (batch 4 x 2048 tokens, 8 KV heads): 8192 rows per head"),
    Shape("keys-B8-T2048-S8-D128-fp16", "float16", 8, 2048, 8, 128, (0, None), "fp16 models, the bench's shape"),
    Shape("keys-B8-T2048-S8-D64-bf16", "bfloat16", 8, 2048, 8, 64, (0, None), "head_dim 64, the bench's shape"),
)
DRY_SHAPES = (
    Shape("dry-B2-T16-S2-D32-fp16", "float16", 2, 16, 2, 32, (0, None), "CPU stand-in, fp16 (the interpreter's bf16 dot is not exact)"),
    Shape("dry-B2-T16-S2-D32-fp32", "float32", 2, 16, 2, 32, (0, None), "CPU stand-in, fp32"),
)


# ------------------------------------------------------------------------------------ routes
def availability(device: torch.device, dtype: torch.dtype, D: int) -> dict[str, str]:
    """Every route: "" where it can run rows of ``dtype`` and width ``D`` on ``device``, else why
    not (:func:`fastspec.covariance.routes.status`). A status that raises (a route's module not
    written yet, a broken import) is the reason, not a crash."""
    from fastspec.covariance import routes

    out = {}
    for name in routes.ROUTES:
        try:
            out[name] = routes.status(name, device, dtype, D)
        except Exception as exc:  # noqa: BLE001 - any failure of a status is a reason not to race it
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


@contextlib.contextmanager
def forced(name: str):
    """``$FASTSPEC_COV_VARIANT=name`` inside the block, the previous value after it."""
    from fastspec.covariance.routes import ENV

    old = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


# ------------------------------------------------------------------------------------ inputs
def bench_keys(shape: Shape, device: torch.device) -> torch.Tensor:
    """The bench's keys (``fastspec.bench.suites.covariance``): ``[B, S, T, D]`` stored, returned
    as the ``[B, T, S, D]`` view the probe reads."""
    B, S, T, D = shape.B, shape.S, shape.T, shape.D
    k = torch.randn(B, S, T, D, device=device).mul_(torch.linspace(0.1, 3, D, device=device))
    return k.add_(0.5).to(getattr(torch, shape.dtype)).transpose(1, 2)


def checked_keys(shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, mask)``: rank-deficient keys (module docstring) as ``[B, T, S, D]`` over ``[B, S, T, D]``
    storage, a mask with the last eighth of the first sequence padded, a NaN in a valid row of
    head 0 (``rejected``) and in a padded row of the last head (not counted at all)."""
    B, S, T, D = shape.B, shape.S, shape.T, shape.D
    g = torch.Generator(device=device).manual_seed(7)
    r = max(1, D // 16)
    f64 = {"dtype": torch.float64, "device": device}
    z = torch.randn(B, S, T, r, generator=g, **f64)
    W = torch.randn(S, r, D, generator=g, **f64)
    k = torch.einsum("bstr,srd->bstd", z, W)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, **f64) / D)
    ang = torch.outer(torch.arange(T, **f64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-k[..., D // 2:], k[..., : D // 2]], -1)
    k = (k * cos + rot * sin + 0.5).to(getattr(torch, shape.dtype))
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    pad = max(1, T // 8)
    mask[0, T - pad:] = False
    k[B - 1, 0, T // 2, 1] = float("nan")    # valid row, head 0: rejected
    k[0, S - 1, T - 1, 0] = float("nan")     # padded row, last head: neither counted nor rejected
    return k.transpose(1, 2), mask


@dataclass
class Reference:
    """Float64 truth of the checked input: counts, ``Σx``, ``G`` per head, each head's float64
    ``svdvals`` and the spectrum error of the float64 reference Gram itself (the floor)."""

    n: torch.Tensor
    rejected: torch.Tensor
    s: torch.Tensor
    s_abs: torch.Tensor
    G: torch.Tensor
    sv: torch.Tensor
    floor_sv: float
    floor_pr: float

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor) -> Reference:
        B, T, S, D = x.shape
        xd = x.double().reshape(B * T, S, D)
        finite = torch.isfinite(xd).all(-1)
        keep = mask.reshape(B * T, 1)
        valid = keep & finite
        xz = torch.where(valid[..., None], xd, 0)
        G = torch.einsum("nsi,nsj->sij", xz, xz).cpu()
        xc, vc = xd.cpu(), valid.cpu()
        # fewer valid rows than D (a dry run's heads): the missing singular values are zeros
        sv = torch.stack([torch.nn.functional.pad(torch.linalg.svdvals(xc[vc[:, h], h]), (0, D))[:D]
                          for h in range(S)])
        ref = cls(valid.sum(0).cpu(), (keep & ~finite).sum(0).cpu(), xz.sum(0).cpu(), xz.abs().sum(0).cpu(),
                  G, sv, 0.0, 0.0)
        ref.floor_sv, ref.floor_pr = ref.spectrum_errors(G)
        return ref

    def spectrum_errors(self, G: torch.Tensor) -> tuple[float, float]:
        """(max over heads of ``max_i |σ_i − σ_i^svd| / σ_max^svd``, of the participation ratio's
        relative error) of ``G``'s sv spectrum."""
        from fastspec.metrics import participation_ratio

        G = G.double().cpu()
        if not bool(torch.isfinite(G).all()):  # a NaN row let in: no spectrum to compare
            return math.nan, math.nan
        sv = torch.linalg.eigvalsh(G).flip(-1).clamp_min(0).sqrt()
        spec = ((sv - self.sv).abs().amax(-1) / self.sv.amax(-1)).max()
        pr, pr_ref = participation_ratio(sv), participation_ratio(self.sv)
        return float(spec), float(((pr - pr_ref).abs() / pr_ref).max())


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return float((a.double().cpu() - b).abs().max()) / scale if scale > 0 else math.inf


def check_route(name: str, x: torch.Tensor, mask: torch.Tensor, ref: Reference) -> dict:
    """The checks of the module docstring for route ``name`` on the checked input; ``ok`` when all hold."""
    import fastspec
    from fastspec.covariance import routes

    calls = []
    for _ in range(3):  # clones: a route may return views of a reused workspace (blocked does)
        p = routes.partials(name, x, mask, 1)
        calls.append(tuple(t.detach().clone() for t in (p.n, p.rejected, p.s, p.G)))
    n, rejected, s, G = calls[0]
    steady = all(torch.equal(a, b) for c in calls[1:] for a, b in zip(calls[0], c))
    rows = x.shape[0] * x.shape[1]
    g_max = float(ref.G.abs().max())
    gram_err = _rel(G, ref.G, g_max)
    sum_err = _rel(s, ref.s, float(ref.s_abs.max()))
    spec_err, pr_err = ref.spectrum_errors(G)
    with forced(name):
        cov = fastspec.Covariance((x.shape[2], x.shape[3]), track_mean=False, precision="auto", device=x.device)
        cov.update(x, mask)
        update_err = _rel(cov.gram(), ref.G, g_max)
        update_counts = torch.equal(cov.n.cpu(), ref.n) and torch.equal(cov.rejected.cpu(), ref.rejected)
    gram_tol = 2 * rows * EPS64
    sv_tol = max(SV_TOL, FLOOR_FACTOR * ref.floor_sv)
    pr_tol = max(SV_TOL, FLOOR_FACTOR * ref.floor_pr)
    counts = torch.equal(n.cpu().long(), ref.n) and torch.equal(rejected.cpu().long(), ref.rejected)
    verdicts = {"counts": counts, "gram": gram_err <= gram_tol, "sum": sum_err <= gram_tol,
                "spectrum": spec_err <= sv_tol, "pr": pr_err <= pr_tol, "steady": steady,
                "update": update_counts and update_err <= gram_tol}
    errors = {"gram_rel_err": gram_err, "sum_rel_err": sum_err, "gram_tol": gram_tol, "sv_rel_err": spec_err,
              "pr_rel_err": pr_err, "sv_tol": sv_tol, "pr_tol": pr_tol, "floor_sv_rel_err": ref.floor_sv,
              "floor_pr_rel_err": ref.floor_pr, "update_gram_rel_err": update_err}
    # JSON has no NaN/Inf (a route that lets a NaN row into G): None, and "failed" says which check
    return {**{k: v if math.isfinite(v) else None for k, v in errors.items()},
            "n": n.cpu().tolist(), "rejected": rejected.cpu().tolist(),
            "failed": [k for k, v in verdicts.items() if not v], "ok": all(verdicts.values())}


# ------------------------------------------------------------------------------------ timing
def count_kernels(fn, device: torch.device) -> int | None:
    """CUDA kernels one ``fn()`` runs (torch.profiler's trace, category ``kernel``); None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    # CPU and CUDA together, as gpu_diag.py's profiles (which ran on the H100 and H200 runs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return sum(1 for e in events if e.get("cat") == "kernel")


def _times(t, calls: int) -> dict:
    """A :class:`~fastspec.bench.timing.Timing` of ``calls`` calls as µs per call."""
    per = 1e6 / calls
    return {"device_us": t.median * per, "device_us_min": t.min * per, "device_us_max": t.max * per,
            "host_us": None if t.host is None else t.host * per, "clock": t.clock, "repeats": t.repeats,
            "launches": None}


def race_shape(shape: Shape, device: torch.device, dry: bool, deadline: float | None, stop: list) -> dict:
    import fastspec
    from fastspec.bench.timing import measure_interleaved
    from fastspec.covariance import routes

    avail = availability(device, getattr(torch, shape.dtype), shape.D)
    out = {"shape": shape.name, "dtype": shape.dtype, "B": shape.B, "T": shape.T, "S": shape.S, "D": shape.D,
           "rows": shape.rows, "rows_range": list(shape.rows_range), "why": shape.why,
           "layout": "[B, S, T, D] stored, read as the [B, T, S, D] view transpose(1, 2)",
           "not_raced": {n: why for n, why in avail.items() if why}, "routes": {}}
    names = [n for n, why in avail.items() if not why]
    x, mask = checked_keys(shape, device)
    ref = Reference.of(x, mask)
    out["reference"] = {"n": ref.n.tolist(), "rejected": ref.rejected.tolist(),
                        "floor_sv_rel_err": ref.floor_sv, "floor_pr_rel_err": ref.floor_pr}
    raced = []
    for name in names:  # the checks also compile and load each route before any clock runs
        try:
            out["routes"][name] = {"check": check_route(name, x, mask, ref)}
            raced.append(name)
        except Exception as exc:  # a route that raises is a finding, not the end of the race
            if stop:  # an error raised while the run is being stopped is the signal's doing
                raise
            out["routes"][name] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
    del x, mask
    keys = bench_keys(shape, device)
    calls = 1 if dry else CALLS
    warmup, repeats = (0, 2) if dry else (WARMUP, REPEATS)

    def many(fn):
        def run():
            for _ in range(calls):
                fn()
        return run

    parts = [many(lambda n=n: routes.partials(n, keys)) for n in raced]
    S, D = shape.S, shape.D
    covs = {n: fastspec.Covariance((S, D), track_mean=False, precision="auto", device=device) for n in raced}
    updates = [many(lambda n=n: covs[n].update(keys)) for n in raced]
    ctx = [lambda n=n: forced(n) for n in raced]
    # the cached choices are per forced name, so one forget before and after serves every route
    # (a forget per call would put a table read inside the timed update)
    routes.forget()
    t_parts = measure_interleaved(parts, device=device, warmup=warmup, repeats=repeats, deadline=deadline,
                                  device_only=True) if raced else []
    t_updates = measure_interleaved(updates, contexts=ctx, device=device, warmup=warmup, repeats=repeats,
                                    deadline=deadline, device_only=True) if raced else []
    for name, tp, tu in zip(raced, t_parts, t_updates):
        r = out["routes"][name]
        r["partials"], r["update"] = _times(tp, calls), _times(tu, calls)
        try:
            r["partials"]["launches"] = count_kernels(lambda n=name: routes.partials(n, keys), device)
            with forced(name):
                r["update"]["launches"] = count_kernels(lambda n=name: covs[n].update(keys), device)
        except Exception as exc:  # no profiler (CUPTI) is a missing column, not a failed route
            if stop:
                raise
            r["launches_error"] = f"{type(exc).__name__}: {exc}"
        r["ok"] = r["check"]["ok"]
    routes.forget()
    out["winner"] = pick(out["routes"])
    return out


def pick(raced: dict[str, dict]) -> str | None:
    """The winner among a shape's raced routes: the fastest whole update on the device
    (``update``'s ``device_us``) of those that passed their checks (``ok``); None when none did."""
    passing = {n: r["update"]["device_us"] for n, r in raced.items() if r.get("ok")}
    return min(passing, key=passing.get) if passing else None


def table_row(result: dict, shape: Shape, arch: int, device_name: str, date: str, dry: bool) -> dict | None:
    """The route-table row a shape's result asks for (``routes.Row`` JSON), None without a winner.
    ``measured``'s ``device_us``, ``host_us`` and ``launches`` are the whole update's (what the
    table's choice costs), ``partials_*`` the route's own call; only the routes that passed their
    checks carry them: a wrong answer is no time to beat."""
    if result["winner"] is None:
        return None
    ok = {n: r for n, r in result["routes"].items() if r.get("ok")}

    def col(part: str, key: str) -> dict:  # µs to 0.01, launches and None as they are
        return {n: round(v, 2) if isinstance(v := r[part].get(key), float) else v for n, r in ok.items()}

    lo, hi = shape.rows_range
    measured = {"device": device_name, "date": date, "shape": result["shape"],
                **{key: col("update", key) for key in ("device_us", "host_us", "launches")},
                **{f"partials_{key}": col("partials", key) for key in ("device_us", "host_us", "launches")},
                **({"dry_run": True} if dry else {})}
    return {"arch": arch, "dtype": shape.dtype, "D": shape.D, "rows": [lo, hi], "route": result["winner"],
            "measured": measured}


def _line(res: dict) -> str:
    def one(n, r):
        if "error" in r:
            return f"{n} ERROR {r['error']}"
        u, p = r["update"], r["partials"]
        extra = [f"host {u['host_us']:.3g}" if u["host_us"] is not None else "",
                 f"{u['launches']} launches" if u["launches"] is not None else "",
                 f"partials {p['device_us']:.3g}" + (f" in {p['launches']}" if p["launches"] is not None else "")]
        bad = "" if r["ok"] else f" (FAILS {', '.join(r['check']['failed'])})"
        return f"{n} {u['device_us']:.3g} µs ({', '.join(e for e in extra if e)}){bad}"

    ranked = sorted(res["routes"].items(), key=lambda kv: kv[1].get("update", {}).get("device_us", math.inf))
    skipped = "; ".join(f"{n}: {why}" for n, why in res["not_raced"].items())
    return (f"{res['shape']}: winner {res['winner']}  {'  '.join(one(n, r) for n, r in ranked)}"
            + (f"  [not raced: {skipped}]" if skipped else ""))


@contextlib.contextmanager
def sigterm_stops():
    """``(stop, inside)`` lists: SIGTERM appends to ``stop``, and raises
    :class:`~fastspec.bench.runner.TimeCap` while ``inside`` is not empty (a shape is running: it
    ends now; between shapes the flag stops the run). The previous handler is back after the block."""
    from fastspec.bench.runner import TimeCap

    stop: list[bool] = []
    inside: list[bool] = []

    def on_sigterm(*_):
        stop.append(True)
        if inside:
            raise TimeCap("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield stop, inside
    finally:
        signal.signal(signal.SIGTERM, previous)


def attempt(name: str, race, not_run: list[str], stop: list, inside: list, late: bool):
    """``race()``'s result under :func:`sigterm_stops`'s ``(stop, inside)``; or None, with ``name``
    in ``not_run`` and a line printed, when it never starts (the run is stopped, or ``late``: past
    its time limit) or SIGTERM ends it while it runs."""
    if stop or late:
        not_run.append(name)
        print(f"{name}: not run (time limit)", flush=True)
        return None
    try:
        inside.append(True)
        return race()
    except BaseException:
        if not stop:
            raise
        not_run.append(name)
        print(f"{name}: stopped while it ran (SIGTERM)", flush=True)
        return None
    finally:
        inside.clear()


def run(json_path: Path, time_limit: float | None, dry: bool) -> int:
    from fastspec.commands._bench_common import write_json
    from fastspec.covariance import routes
    from fastspec.sysinfo import environment

    start = time.monotonic()
    deadline = start + time_limit if time_limit is not None else None
    if dry:
        device, arch, device_name = torch.device("cpu"), DRY_ARCH, "cpu (dry run: wall-clock stand-in)"
    else:
        if not torch.cuda.is_available():
            print("cov_race.py: no CUDA device; run with --dry-run on a machine without a GPU", file=sys.stderr)
            return 1
        device = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        arch, device_name = major * 10 + minor, torch.cuda.get_device_name(device)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    doc = {"schema": SCHEMA, "kind": "cov-race", "date": date, "dry_run": dry, "environment": environment(),
           "device": device_name, "arch": arch,
           "timing": ("cpu stand-in: wall clock of the CPU code (the Triton routes interpreted), not a GPU time "
                      "(says nothing about GPU speed)" if dry else
                      f"µs per call: {CALLS} calls per sample, median and range of {REPEATS} round-robin rounds "
                      f"after {WARMUP} warm-up rounds; device: CUDA events with a spin kernel ahead; host: the "
                      "host's time to queue the calls meanwhile"),
           "routes": {n: r.what for n, r in routes.ROUTES.items()}, "results": [], "rows": [], "not_run": []}

    def write() -> None:
        write_json(json_path, doc, quiet=True)

    write()
    failed = []
    with sigterm_stops() as (stop, inside):
        for shape in DRY_SHAPES if dry else SHAPES:
            t0 = time.monotonic()
            res = attempt(shape.name, functools.partial(race_shape, shape, device, dry, deadline, stop),
                          doc["not_run"], stop, inside, deadline is not None and t0 > deadline)
            if res is None:
                continue
            doc["results"].append(res)
            row = table_row(res, shape, arch, device_name, date, dry)
            if row is not None:
                doc["rows"].append(row)
            write()
            failed += [f"{n} fails on {shape.name}" for n, r in res["routes"].items() if not r.get("ok")]
            if res["winner"] is None:  # blocked runs everywhere: a shape without a winner is a bug here
                failed.append(f"no route passed on {shape.name}")
            print(f"{_line(res)}  [{time.monotonic() - t0:.1f}s]", flush=True)
        write()  # the shapes not run, too
    if doc["not_run"]:  # the words the GPU kit reads as a capped step
        print(f"cov_race.py: time cap reached: {len(doc['not_run'])} shape(s) not run", flush=True)
    for line in failed:
        print(f"check: {line}", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ merging
def tie(result: dict | None, winner: str, other: str) -> bool:
    """True when ``other`` passed this race's checks and its timed rounds of the whole update
    overlap the winner's (``device_us_min``..``device_us_max``): a lead inside the noise by ``fastspec
    bench``'s own rule (:func:`fastspec.bench.table.noise_pct`). False without the ranges or with a
    single round."""
    from fastspec.bench.table import noise_pct

    rs = (result or {}).get("routes", {})
    w, o = rs.get(winner), rs.get(other)
    if not (w and o and o.get("ok")):
        return False
    w, o = w.get("update", {}), o.get("update", {})
    return noise_pct({"repeats": min(w.get("repeats", 0), o.get("repeats", 0)),
                      "fastspec_min_s": w.get("device_us_min"), "fastspec_max_s": w.get("device_us_max"),
                      "baseline_min_s": o.get("device_us_min"), "baseline_max_s": o.get("device_us_max")}) is not None


EMPTY = " No race has run yet: the table is empty."  # a shipped table's "about", true until a merge


def race_result(json_path: Path, schema: str, what: str) -> dict | None:
    """The race result in ``json_path`` to merge; None, with a line on stderr, when it is not a
    ``what`` (its ``schema``) or is a dry run (the whole run, or any row, marked ``dry_run``)."""
    doc = json.loads(json_path.read_text())
    if doc.get("schema") != schema:
        print(f"--merge: {json_path} is not a {what} (schema {doc.get('schema')!r})", file=sys.stderr)
        return None
    if doc.get("dry_run") or any(r.get("dry_run") or r.get("measured", {}).get("dry_run") for r in doc.get("rows", [])):
        print(f"--merge: {json_path} is a dry run: its times are CPU stand-ins, not measurements", file=sys.stderr)
        return None
    return doc


def write_table(table: Path, data: dict) -> None:
    """Write a merged selection table; its "about" stops saying it is empty once it holds a row."""
    if data["rows"] and EMPTY in data.get("about", ""):
        data["about"] = data["about"].replace(EMPTY, "")
    table.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def merge(json_path: Path, table: Path | None = None) -> int:
    """Replace the table's rows of the same key (arch, dtype, D, row range) by ``json_path``'s rows;
    refuse a dry run's, and a row whose route failed its checks in that race.

    A table row whose route differs from the race's winner but ties with it in this race
    (:func:`tie`) stays: near-equal routes come out in either order from run to run, and a table
    that flips on noise says nothing. A table row of another key whose row range overlaps a merged
    row's (same arch, dtype and D) is dropped: the race measured those row counts now, and
    :func:`fastspec.covariance.routes.choose` takes the first matching row, which could be the old one."""
    from fastspec.covariance import routes

    doc = race_result(json_path, SCHEMA, "covariance race result")
    if doc is None:
        return 2
    new = [routes.Row.from_json(r) for r in doc["rows"]]
    routes.check_rows(new)
    results = {r.get("shape"): r for r in doc.get("results", [])}
    for r in new:
        res = results.get(r.measured.get("shape"))
        if res is not None and not res.get("routes", {}).get(r.route, {}).get("ok"):
            print(f"--merge: {json_path}: the row for {r.measured.get('shape')} names {r.route}, which failed "
                  "its checks in that race", file=sys.stderr)
            return 2
    table = table or routes.TABLE
    data = json.loads(table.read_text())

    def key(r: routes.Row) -> tuple:
        return r.arch, r.dtype, r.D, r.rows_lo, r.rows_hi

    def overlap(a: routes.Row, b: routes.Row) -> bool:
        return ((a.arch, a.dtype, a.D) == (b.arch, b.dtype, b.D) and a.rows_lo <= (math.inf if b.rows_hi is None else b.rows_hi)
                and b.rows_lo <= (math.inf if a.rows_hi is None else a.rows_hi))

    held = {key(routes.Row.from_json(d)): d for d in data.get("rows", [])}
    replaced, ties = [], []
    for r in new:
        h = held.get(key(r))
        if h is not None and h["route"] != r.route and tie(results.get(r.measured.get("shape")), r.route, h["route"]):
            ties.append(f"{r.measured.get('shape')}: {h['route']} kept ({r.route} won inside the noise)")
        else:
            replaced.append(r)
    keys = {key(r) for r in replaced}
    kept, dropped = [], []
    for k, d in held.items():
        if k in keys:
            continue
        old = routes.Row.from_json(d)
        (dropped if any(overlap(old, r) for r in replaced) else kept).append(d)
    data["rows"] = kept + [r.to_json() for r in replaced]
    write_table(table, data)
    print(f"{table}: {len(replaced)} rows merged from {json_path} ({len(kept)} other rows kept, "
          f"{len(dropped)} overlapped and dropped)")
    for line in ties:
        print(f"  tie: {line}")
    for d in dropped:
        print(f"  dropped: {d}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cov_race.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="result file (rewritten after every shape)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="no new shape after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreted Triton: stand-in times")
    p.add_argument("--merge", type=Path, metavar="RACE_JSON", help="merge a race's rows into the route table")
    args = p.parse_args(argv)
    if args.merge is not None:
        return merge(args.merge)
    if args.json is None:
        p.error("--json FILE is required (or --merge RACE_JSON)")
    if args.dry_run:  # before anything imports Triton: its kernels are interpreted only when it is set then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return run(args.json, args.time_limit, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
