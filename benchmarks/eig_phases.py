"""Where the eigensolver's time goes: every algorithm's profiling build, phase by phase (GPU kit command 1).

    python benchmarks/eig_phases.py --json OUT/phases.json [--time-limit S] [--dry-run]
    python benchmarks/eig_phases.py --show OUT/phases.json     # the tables of a result file again

Per shape (4096 x 128² float32, the kernel's target; 256 x 128² float64, the probe's keys solve) and
algorithm of :mod:`fastspec.eig.variants` that takes it: the normal kernel timed alone (CUDA events,
median of 5), then its profiling build (:mod:`fastspec.eig.profile`: member 0 of each block stamps
``clock64`` at every phase mark, barriers apart) run on the same batch, the record decoded, and per
phase the median and p90 SM cycles per block and the phase's share of all block cycles. Beside each
phase: the warp instructions per matrix the header's cost model assigns to it (:data:`MODEL`,
PREDICTED dynamic counts from the sm_90 SASS, not measured), and so the achieved instructions per
cycle of a block in that phase; and the fitted cost model (:func:`fit`, :func:`predict`):
cycles per instruction per phase from this run, which predict a kernel time from an algorithm's
instruction counts; printed for each algorithm against its measured time (the ratio says how well
the model holds), and for an algorithm without a measurement of its own from the one it shares
phases with. The profiling build's own kernel time is reported beside the normal one: the stamps
cost a few instructions per mark, and the gap says how far the profile is from the real kernel.

Then the call's own cost at the target shape (``benchmarks/eig_call.py``: host time per call,
events around one synchronized call, device time with the host hidden, CUDA-graphed, the raw
launch), so one file says both where the kernel's time goes and what a call adds to it.

``--dry-run``: CPU, no clocks. Each algorithm's phase sequence comes from the team emulation at a
small n (``fastspec.eig.profile.team_phases``), a record is synthesized from it with fixed costs
per phase, and decoded and summarized as a GPU record would be (so the reader cannot rot); the
profiling build is compiled for sm_90 by NVRTC at the real sizes. The times in a dry run's JSON are
stand-ins, labelled as such.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

SCHEMA = "fastspec-eig-phases-1"
SHAPES = (("B4096-n128-fp32", 4096, 128, torch.float32), ("B256-n128-fp64", 256, 128, torch.float64))
DRY_N = 24          # the dry run's emulation size (one warp)
DRY_COST = {0: 900, 1: 120, 2: 300, 3: 80, 4: 40, 5: 2000, 6: 9000, 7: 700}  # stand-in cycles per phase entry
REPEATS = 5

# Warp instructions per matrix per phase, fp32 n = 128: the cost models in the headers of csrc/
# (PREDICTED dynamic counts from the sm_90 SASS of NVRTC 13, eig_kernel.cu, eig_packed.h, eig_regs.h,
# eig_split.h; the barrier phase issues almost nothing of its own). Where a header gives a range,
# its middle. These are what the measured cycles are divided by: achieved IPC per phase.
MODEL: dict[str, dict[str, float]] = {
    "block": {"load": 12e3, "reflector": 60e3, "update": 178e3, "isolate": 4e3, "refine": 70e3, "sort": 3e3},
    "packed": {"load": 10e3, "reflector": 91e3, "update": 110e3, "product": 21e3, "isolate": 4e3, "refine": 70e3,
               "sort": 3e3},
    "regs": {"load": 11e3, "reflector": 70e3, "update": 126e3, "isolate": 3e3, "refine": 41e3, "sort": 5e3},
    "split": {"load": 12e3, "reflector": 200e3, "update": 176e3, "isolate": 8e3, "refine": 82e3, "sort": 3e3},
}
SHARES = {"newton": "packed"}
"""An algorithm without a measured CPI of its own is predicted from the one it shares phases with."""


# ------------------------------------------------------------------------------------ the model
def fit(summary: dict, model: dict[str, float]) -> dict[str, float]:
    """Cycles per warp instruction of a block, per phase: the measured median cycles over the
    model's instructions (phases the model has no count for are left out)."""
    out = {}
    for phase, counts in model.items():
        got = summary["phases"].get(phase)
        if got and counts > 0:
            out[phase] = got["median"] / counts
    return out


def predict(model: dict[str, float], cpi: dict[str, float], summary: dict, batch: int, sms: int) -> float | None:
    """Kernel milliseconds predicted from instruction counts per phase and cycles per instruction
    per phase: a block's cycles (the phases' instructions x CPI, plus the measured barrier time,
    which no instruction count carries), times the rounds of resident blocks the batch needs, at
    the measured clock. None where a phase has no CPI."""
    if any(p not in cpi for p in model):
        return None
    cycles = sum(model[p] * cpi[p] for p in model) + summary["phases"].get("barrier", {}).get("median", 0.0)
    resident, ghz = summary.get("resident_blocks_per_sm") or 0.0, summary.get("sm_ghz") or 0.0
    if resident <= 0 or ghz <= 0:
        return None
    return cycles * (batch / (sms * resident)) / (ghz * 1e6)


# ------------------------------------------------------------------------------------ running
def _events_ms(fn, repeats: int = REPEATS) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def profile_gpu(name: str, batch: int, n: int, dtype: torch.dtype, algo: str) -> dict:
    from fastspec.bench.suites.eigvalsh import powerlaw_gram
    from fastspec.eig import cuda, profile

    A = powerlaw_gram(batch, n, torch.device("cuda"), dtype)
    out = torch.empty(batch, n, dtype=dtype, device="cuda")
    ms = _events_ms(lambda: cuda.launch(A, out, algo=algo))
    t0 = time.perf_counter()
    res = {}
    profiled = _events_ms(lambda: res.update(zip(("out", "record", "plan"), profile.run_profiled(A, algo))), 2)
    build_s = time.perf_counter() - t0
    record = res["record"].cpu().numpy()
    summary = profile.summarize(profile.decode(record)).to_json()
    agree = float((res["out"] - out).abs().max() / out.abs().max().clamp_min(1e-30))
    p = res["plan"]
    return {"shape": name, "algo": algo, "variant": p.variant.tag, "grid": p.grid, "ms": ms, "ms_profiled": profiled,
            "profiling_cost": profiled / ms - 1, "profile_vs_normal_rel_diff": agree, "seconds": build_s,
            "summary": summary}


def profile_dry(name: str, n: int, dtype: torch.dtype, algo: str) -> dict:
    from fastspec.eig import cuda, nvrtc, profile
    from fastspec.eig.matrices import make_batch

    A = torch.from_numpy(make_batch("indefinite", DRY_N, 1)[0]).to(dtype)
    t0 = time.perf_counter()
    seq = profile.team_phases(A, algo)
    record = profile.synthetic_record(seq, blocks=8, cost=DRY_COST)
    summary = profile.summarize(profile.decode(record)).to_json()
    v = cuda.variant_for(n, str(dtype).removeprefix("torch."), cuda.DeviceSpec.for_arch(90), algo)
    img = nvrtc.compile_variant(v, nvrtc.Target(90), profile.OPTIONS)  # the real size's profiling build
    return {"shape": name + "-dry", "algo": algo, "variant": v.tag, "grid": 8, "ms": None, "ms_profiled": None,
            "profiling_cost": None, "marks_per_matrix": len(seq), "profile_build_bytes": len(img.data),
            "seconds": time.perf_counter() - t0, "summary": summary}


def _algorithms(n: int, dtype: torch.dtype, spec) -> list[str]:
    from fastspec.eig import cuda, variants

    names = []
    for name, a in variants.ALGORITHMS.items():
        dt = str(dtype).removeprefix("torch.")
        if not a.takes(n, dt):
            continue
        try:
            if cuda.variant_for(n, dt, spec, name).smem:
                names.append(name)
        except ValueError:
            continue
    return names


def add_model(results: list[dict], sms: int) -> None:
    """Each fp32 n = 128 result gets its fitted CPI per phase and the kernel time the fitted model
    predicts (from its own CPI, and for an algorithm in :data:`SHARES` from its partner's)."""
    by_algo = {r["algo"]: r for r in results if r["shape"].startswith("B4096-n128-fp32")}
    for algo, r in by_algo.items():
        model = MODEL.get(algo) or MODEL_EXTRA.get(algo)
        if model is None:
            continue
        r["model_instructions"] = model
        r["ipc_per_phase"] = {p: (model[p] / r["summary"]["phases"][p]["median"])
                              for p in model if r["summary"]["phases"].get(p, {}).get("median")}
        own = fit(r["summary"], model)
        r["cpi_per_phase"] = own
        batch = int(r["shape"].split("-")[0][1:])
        if r["ms"]:
            pred = predict(model, own, r["summary"], batch, sms)
            r["model_ms_own_cpi"] = pred
            r["model_ratio_own"] = pred / r["ms"] if pred else None
        partner = by_algo.get(SHARES.get(algo, ""))
        if partner is not None and r["ms"]:
            cpi = {**fit(partner["summary"], MODEL[partner["algo"]])}
            pred = predict(model, cpi, partner["summary"], batch, sms)
            r["model_ms_partner_cpi"] = pred
            r["model_partner"] = partner["algo"]
            r["model_ratio_partner"] = pred / r["ms"] if pred else None


MODEL_EXTRA: dict[str, dict[str, float]] = {
    # csrc/eig_newton.h's header: packed's load and tridiagonalization, its own eigenvalue stage (4
    # isolation rounds after the grid, ~4-6 Newton sweeps of 8.9 instructions a step, a scan)
    "newton": {**MODEL["packed"], "isolate": 16e3, "refine": 28e3, "sort": 3e3},
}
"""Instruction models of the algorithms no GPU has run yet (predicted from a measured one's CPI:
:data:`SHARES`)."""


def print_result(r: dict) -> None:
    s = r["summary"]
    head = (f"{r['shape']} {r['algo']}: kernel {r['ms']:.3f} ms, profiling build {r['ms_profiled']:.3f} ms "
            f"(+{100 * r['profiling_cost']:.1f}%)" if r["ms"] else f"{r['shape']} {r['algo']} (dry run: stand-in cycles)")
    print(head + f"; {s['blocks']} blocks, {s['resident_blocks_per_sm']:.2f} resident per SM, "
          f"{s['sm_ghz']:.2f} GHz; block total median {s['total_cycles_median']:,.0f} cycles, "
          f"p90 {s['total_cycles_p90']:,.0f}", flush=True)
    model = r.get("model_instructions", {})
    print(f"  {'phase':<10} {'median':>11} {'p90':>11} {'share':>6} {'entries':>8} {'model instr':>12} {'IPC':>5}")
    for phase, v in s["phases"].items():
        ins = model.get(phase)
        ipc = f"{ins / v['median']:.2f}" if ins and v["median"] else ""
        print(f"  {phase:<10} {v['median']:>11,.0f} {v['p90']:>11,.0f} {100 * v['share']:>5.1f}% {v['entries']:>8.0f} "
              f"{'' if ins is None else f'{ins:,.0f}':>12} {ipc:>5}")
    for key, label in (("model_ms_own_cpi", "own CPI"), ("model_ms_partner_cpi", f"{r.get('model_partner')}'s CPI")):
        if r.get(key):
            print(f"  fitted model ({label}): {r[key]:.3f} ms predicted, "
                  f"{r[key.replace('ms_own_cpi', 'ratio_own').replace('ms_partner_cpi', 'ratio_partner')]:.2f}x "
                  f"the measured {r['ms']:.3f} ms")


def _call_breakdown(out: Path, dry: bool, deadline: float | None) -> dict | None:
    """benchmarks/eig_call.py's decomposition of one call, when that script is here."""
    path = Path(__file__).with_name("eig_call.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("eig_call", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tmp = out.with_name(out.name + ".call.json")
    args = ["--json", str(tmp), *(["--dry-run"] if dry else [])]
    if deadline is not None:
        args += ["--time-limit", f"{max(1.0, deadline - time.monotonic()):.0f}"]
    rc = mod.main(args)
    doc = json.loads(tmp.read_text()) if tmp.exists() else {"error": f"eig_call.py exited {rc} without a result"}
    tmp.unlink(missing_ok=True)
    doc["rc"] = rc
    return doc


def run(json_path: Path, time_limit: float | None, dry: bool) -> int:
    from fastspec.commands._bench_common import write_json
    from fastspec.eig import cuda
    from fastspec.sysinfo import environment

    deadline = time.monotonic() + time_limit if time_limit is not None else None
    if not dry and not torch.cuda.is_available():
        print("eig_phases.py: no CUDA device; run with --dry-run on a machine without a GPU", file=sys.stderr)
        return 1
    spec = cuda.DeviceSpec.for_arch(90) if dry else cuda.DeviceSpec.of_device(torch.cuda.current_device())
    doc = {"schema": SCHEMA, "kind": "eig-phases", "date": time.strftime("%Y-%m-%d", time.gmtime()), "dry_run": dry,
           "environment": environment(), "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
           "timing": ("stand-in: the team emulation's phase sequence with fixed cycles per phase (no clocks)" if dry
                      else f"CUDA events, median of {REPEATS}; phases from clock64 stamps of the profiling build"),
           "model": "instructions per phase: the headers' cost models (PREDICTED from SASS); CPI fitted per phase",
           "results": [], "not_run": [], "call": None}
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))

    def write() -> None:
        write_json(json_path, doc, quiet=True)

    write()
    for name, batch, n, dtype in SHAPES:
        for algo in _algorithms(n, dtype, spec):
            if stop or (deadline is not None and time.monotonic() > deadline):
                doc["not_run"].append(f"{name} {algo}")
                continue
            try:
                r = profile_dry(name, n, dtype, algo) if dry else profile_gpu(name, batch, n, dtype, algo)
            except Exception as exc:  # noqa: BLE001 - one algorithm's failure is a row, not the end of the step
                r = {"shape": name, "algo": algo, "error": f"{type(exc).__name__}: {exc}"}
                print(f"{name} {algo}: FAILED {r['error']}", flush=True)
                doc["results"].append(r)
                write()
                continue
            doc["results"].append(r)
            add_model([x for x in doc["results"] if "summary" in x], spec.sms)
            print_result(r)
            write()
    if not stop and (deadline is None or time.monotonic() < deadline):
        doc["call"] = _call_breakdown(json_path, dry, deadline)
    write()
    for x in doc["not_run"]:
        print(f"not run (time limit): {x}")
    failed = [r for r in doc["results"] if "error" in r]
    return 1 if failed else 0


def show(path: Path) -> int:
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        print(f"--show: {path} is not an eig phases result (schema {doc.get('schema')!r})", file=sys.stderr)
        return 2
    for r in doc["results"]:
        if "summary" in r:
            print_result(r)
        else:
            print(f"{r['shape']} {r['algo']}: {r.get('error')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eig_phases.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="result file (rewritten after every algorithm)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="nothing new starts after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU: the emulation's phases, synthetic clocks")
    p.add_argument("--show", type=Path, metavar="PHASES_JSON", help="print a result file's tables")
    args = p.parse_args(argv)
    if args.show is not None:
        return show(args.show)
    if args.json is None:
        p.error("--json FILE is required (or --show PHASES_JSON)")
    return run(args.json, args.time_limit, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
