"""Last step of each ``benchmarks/gpu_run.py`` command: one ``bench.json`` and a summary that fits a terminal.

    python benchmarks/gpu_summary.py OUT_DIR [--command N] [--dry-run 0] [--failed "a b"]

* Merges ``OUT_DIR/bench-<step>.json`` (one ``fastspec bench --json`` document per bench step,
  each rewritten as its step ran) into ``OUT_DIR/bench.json``: the same schema as
  ``benchmarks/results/*.json`` (``schema``, ``kind``, ``tier``, ``date``, ``environment``,
  ``results``) plus ``gpu_run`` (command, dry run, failed steps, suites merged). The step files are
  removed once merged (only a few files come back from a GPU machine); a ``bench.json`` already
  there (another command's, copied in) is merged too, a case measured again replacing its rows.
* Prints one line per result row (times, speedup, throughput or share of the copy's bandwidth,
  errors and a broken accuracy claim, or why it was skipped), the accuracy summary of
  ``compare.json``, the exact covariance update's route race per shape (``cov_race.json``), the
  Triton covariance kernels' configuration race per case (``triton_race.json``: the winner, each
  candidate's time and rate or why it fails), the eigensolver race's winner and times per shape (``race.json``,
  ``eig_race.py``), the three largest phases per algorithm and the call's verdict (``phases.json``,
  ``eig_phases.py``), the tools' verdicts from ``tools.txt``, the accuracy rows and timing lines
  of ``diag.txt`` (``race_probe.py --kit``, ``gpu_diag.py``) and pytest's closing line from ``tests.txt``, each failing
  test with its assertion's message where the tests step printed it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from fastspec.bench.suites import SUITES as SUITE_ORDER
from fastspec.bench.table import budget_text, clocked_time, overhead_text

PYTEST_CLOSING = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|deselected|errors?)\b|no tests ran)")
# a failing test in ``pytest -v`` output: serial (``NODEID FAILED [ 3%]``), under xdist
# (``[gw2] [ 3%] FAILED NODEID``) and pytest's own -rfE summary (``FAILED NODEID - ...``)
# conftest.py's line as a test fails under a cap (FASTSPEC_TEST_DEADLINE)
FAILED_NOW = re.compile(r"^failed now: (tests/\S+) \((?:setup|call|teardown)\)")
PYTEST_FAILED = re.compile(r"(?:^|\s)(?:(FAILED|ERROR) (tests/\S+)|(tests/\S+) (FAILED|ERROR)\b)")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_summary: cannot read {path.name}: {e}", file=sys.stderr)
        return None


def merge(out: Path, meta: dict) -> dict | None:
    """``bench.json`` from the per-suite files (and an earlier ``bench.json``), or None if none."""
    def order(p: Path) -> tuple[int, str]:
        suite = p.stem[6:].removesuffix("-headline")
        return (SUITE_ORDER.index(suite) if suite in SUITE_ORDER else len(SUITE_ORDER), p.name)

    parts = sorted(out.glob("bench-*.json"), key=order)
    docs = [(p, d) for p in parts if (d := _load(p)) is not None]
    merged_path = out / "bench.json"
    earlier = _load(merged_path) if merged_path.exists() else None
    if not docs and earlier is None:
        return None
    base = dict(earlier if earlier is not None else docs[0][1])
    suites_now = {r["suite"] for _, d in docs for r in d["results"]}
    cases_now = {case_key(r) for _, d in docs for r in d["results"]}
    # rows of a case measured again replace the earlier ones (a repeated command), others stay
    results = [r for r in (earlier or {}).get("results", []) if case_key(r) not in cases_now]
    for _, d in docs:
        results += d["results"]
    if docs:
        newest = docs[-1][1]
        base.update(date=newest["date"], environment=newest["environment"], tier=newest["tier"],
                    torch_threads=newest["torch_threads"])
    runs = list((earlier or {}).get("gpu_run", {}).get("runs", []))
    runs.append({**meta, "suites": sorted(suites_now)})
    base["results"] = results
    base["gpu_run"] = {"runs": runs}
    tmp = merged_path.with_name("bench.json.tmp")
    tmp.write_text(json.dumps(base, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, merged_path)
    for p, _ in docs:
        p.unlink()
    return base


def case_key(row: dict) -> tuple[str, str, str]:
    return row["suite"], row["size"], row["variant"]


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.2f}%"


def row_line(r: dict) -> str:
    head = f"{r['suite']:<10} {r['size']:<34} {r['variant']:<14} {r.get('baseline', ''):<28}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "fastspec_s" not in r:
        return f"{head} ERROR: {r.get('error')}"
    # on the device clock each side's time says so, with the host's launch time it hid
    line = f"{head} {clocked_time(r, 'fastspec'):>9} vs {clocked_time(r, 'baseline'):>9}"
    if r.get("baseline_scale"):
        line += f" (slice x{r['baseline_scale']:g})"
    line += f"  {r['speedup']:.2f}x"
    if "overhead_pct" in r:
        line += f"  overhead {overhead_text(r)}"  # "≈0 (±X%)" when within the repeats' spread
    elif "pct_of_copy_bandwidth" in r:
        line += (f"  {r['fastspec_rate']:.3g} {r['rate_unit']} read = {r['pct_of_copy_bandwidth']:.0f}% of "
                 f"the copy's {r['copy_GBps']:.3g} GB/s")
    elif "rate_unit" in r:
        line += f"  {r['fastspec_rate']:.3g} vs {r['baseline_rate']:.3g} {r['rate_unit']}"
    line += f"  err {_e(r.get('fastspec_error'))} (baseline {_e(r.get('baseline_error'))})"
    if "recompiles" in r:  # train_step_compiled: what compiling cost, and whether it held
        line += (f"  compile {r['probed_compile_s']:.0f}+{r['baseline_compile_s']:.0f} s, graphs "
                 f"{r['probed_graphs']:g}+{r['baseline_graphs']:g}, recompiles {r['recompiles']:g}, "
                 f"breaks {r['graph_breaks']:g}")
    if "real_overhead_pct" in r:  # the budget suite: real vs reported over one paired run
        line += (f"  {budget_text(r)}, every {r['budget_every']:g}, emit every {r['budget_emit_every']:g}, "
                 f"{r['rounds']:g} rounds, {r['emissions']:g} emissions")
    elif r.get("budget_average_pct") is not None:  # a budget case: what the probe itself reports
        line += (f"  budget reports {r['budget_average_pct']:.2f}% (measured "
                 f"{_pct(r.get('budget_measured_pct'))}), every {r['budget_every']}, FFN row step {r['ffn_row_step']}")
    if "error" in r:
        line += f"  ERROR: {r['error']}"
    if r.get("claim_held") is False:  # fastspec bench exited 1 for it: the step shows FAILED
        line += f"  CLAIM FAILED: {r['claim_violation']}"
    return line


DIAG_LINE = r"^(launcher |time launcher |case |raw |split |not run|cov-call|eig-call|  partials|  Covariance|  eigvalsh|measure:|train step:|[\w-]+: (ERROR|not run))"


def _race_entry(name: str, a: dict) -> str:
    """One algorithm of a race line: its time and verdict; a dry run's vendor row (cuSolverDx's
    heev, built for sm_90 and not run) says what was built."""
    if a["ms"] is None:
        b = a.get("dry_run_build") or {}
        return f"{name} built, not run" if b.get("built") else f"{name} NOT BUILT: {b.get('error')}"
    if a["ok"]:
        return f"{name} {a['ms']:.3g} ms"
    bad = a.get("status_failures") or 0
    return f"{name} {a['ms']:.3g} ms " + (f"status != 0 on {bad} matrices" if bad else "FAILS accuracy")


def _triton_entry(name: str, a: dict, kernel: str) -> str:
    """One candidate of a Triton race line: its device time and rate (keys: share of the copy's
    bandwidth; ffn: TFLOP/s), and its verdict."""
    if "error" in a:
        return f"{name} ERROR {a['error'][:120]}"
    text = name
    if a.get("device_us") is not None:
        text += f" {a['device_us']:.3g} µs"
        if kernel == "ffn" and a.get("TFLOPs") is not None:
            text += f" {a['TFLOPs']:.3g} TFLOP/s"
        elif a.get("pct_of_copy_bandwidth") is not None:
            text += f" {a['pct_of_copy_bandwidth']:.0f}% of copy"
    else:
        text += " not timed"
    return text + ("" if a.get("ok") else " FAILS " + "; ".join(a.get("check", {}).get("failed", []))[:160])


def summary(out: Path, bench: dict | None) -> list[str]:
    lines = ["", "===== summary"]
    if bench is not None:
        env = bench["environment"]
        lines.append(f"{env.get('device')} · driver {env.get('driver')} · CUDA {env.get('cuda')} · torch "
                     f"{env.get('torch')} · triton {env.get('triton')} · fastspec {env.get('fastspec')}")
        lines += [row_line(r) for r in bench["results"]]
    else:
        lines.append("no bench results")
    comp = out / "compare.json"
    if comp.exists() and (doc := _load(comp)) is not None:
        rows = [r for r in doc["results"] if "skipped" not in r]
        ok = sum(bool(r.get("within_2x_torch")) for r in rows)
        bad = [f"{r['family']} n={r['n']} {r.get('variant')}" for r in rows if not r.get("within_2x_torch")]
        lines.append(f"compare: {ok}/{len(rows)} within 2x torch fp32 vs fp64"
                     + (f"; {len(doc['results']) - len(rows)} not run (time cap)" if len(rows) < len(doc["results"]) else "")
                     + (f"; NOT within: {', '.join(bad)}" if bad else ""))
    race = out / "race.json"
    if race.exists() and (doc := _load(race)) is not None:  # eig_race.py: winner and times per shape
        for r in doc["results"]:
            times = ", ".join(_race_entry(n, a) for n, a in sorted(
                r["algorithms"].items(), key=lambda kv: float("inf") if kv[1]["ms"] is None else kv[1]["ms"]))
            lines.append(f"race {r['shape']}: winner {r['winner']} ({times})")
        lines += [f"race {name}: not run (time limit)" for name in doc.get("not_run", [])]
    phases = out / "phases.json"
    if phases.exists() and (doc := _load(phases)) is not None:  # eig_phases.py: the two largest phases per algorithm
        for r in doc.get("results", []):
            if "summary" not in r:
                lines.append(f"phases {r['shape']} {r['algo']}: {r.get('error')}")
                continue
            top = sorted(r["summary"]["phases"].items(), key=lambda kv: -kv[1]["share"])[:3]
            shares = ", ".join(f"{p} {100 * v['share']:.0f}%" for p, v in top)
            ms = f"{r['ms']:.3g} ms (profiled {r['ms_profiled']:.3g}): " if r.get("ms") else ""
            lines.append(f"phases {r['shape']} {r['algo']}: {ms}{shares}")
        for shape in (doc.get("call") or {}).get("shapes", []):  # eig_call.py's decomposition of one call
            lines.append(f"eig call {shape.get('name')}: {shape.get('verdict')}")
    cov = out / "cov_race.json"
    if cov.exists() and (doc := _load(cov)) is not None:  # cov_race.py: the exact update's routes per shape
        for r in doc["results"]:
            times = ", ".join(
                f"{n} {a['update']['device_us']:.3g} µs"
                + (f" / host {a['update']['host_us']:.3g} µs" if a["update"].get("host_us") is not None else "")
                + (f" / {a['update']['launches']} launches" if a["update"].get("launches") is not None else "")
                + ("" if a["ok"] else " FAILS its checks")
                for n, a in sorted(r["routes"].items(), key=lambda kv: kv[1]["update"]["device_us"]))
            lines.append(f"cov-race {r['shape']}: winner {r['winner']} ({times})")
        lines += [f"cov-race {name}: not run (time limit)" for name in doc.get("not_run", [])]
    tri = out / "triton_race.json"
    if tri.exists() and (doc := _load(tri)) is not None:  # triton_race.py: the launch settings per case
        for r in doc.get("results", []):
            entries = ", ".join(_triton_entry(n, a, r["kernel"]) for n, a in sorted(
                r["candidates"].items(), key=lambda kv: kv[1].get("device_us", float("inf"))))
            cut = "" if r.get("complete") else f"; cut short, not raced: {', '.join(r.get('not_raced', {})) or '-'}"
            lines.append(f"triton-race {r['case']}: winner {r['winner']} ({entries}{cut})")
        lines += [f"triton-race {name}: not run (time limit)" for name in doc.get("not_run", [])]
    tools = out / "tools.txt"
    if tools.exists():  # each tool's verdict lines: "<tool> <mode> <targets>: ok|finding|skipped..."
        lines += [ln for ln in tools.read_text(errors="replace").splitlines()
                  if re.match(r"^(ncu|compute-sanitizer)\b[^:]*: (ok|finding|skipped|targets FAILED)", ln)]
    diag = out / "diag.txt"
    if diag.exists():  # race_probe.py --kit's rows and time; gpu_diag.py's sweep rows and timing lines,
        # not torch.profiler's tables (those stay in diag.txt)
        lines += [ln for ln in diag.read_text(errors="replace").splitlines()
                  if re.match(DIAG_LINE, ln)]
    tests = out / "tests.txt"
    if tests.exists():  # pytest's closing line of each tests step, and every failing test once
        text = tests.read_text(errors="replace").splitlines()
        lines += [f"tests: {ln.strip('= ')}" for ln in text if PYTEST_CLOSING.match(ln)]
        failed: dict[str, str] = {}
        for ln in text:
            for m in PYTEST_FAILED.finditer(ln):
                failed.setdefault(m[2] or m[3], m[1] or m[4])
        why = failure_reasons(text)
        lines += [f"tests: {what} {name}" + (f": {why[name]}" if name in why else "")
                  for name, what in failed.items()]
    return lines


def failure_reasons(text: list[str]) -> dict[str, str]:
    """Test id -> the first ``E`` line of the report the repository's conftest.py prints the
    moment a test fails under the kit's cap (``failed now: NODEID (call)``, then its report's
    last lines, indented), so a step cut before pytest's summary still says why."""
    why: dict[str, str] = {}
    name = None
    for ln in text:
        m = FAILED_NOW.match(ln)
        if m:
            name = m[1]
        elif name is not None and ln.startswith("    "):
            e = ln.strip()
            if e.startswith("E ") and name not in why:
                why[name] = e[1:].strip()[:200]
        else:
            name = None
    return why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--command", default="")
    p.add_argument("--dry-run", default="0")
    p.add_argument("--failed", default="")
    args = p.parse_args(argv)
    meta = {"kit": "benchmarks/gpu_run.py", "command": args.command,
            "dry_run": args.dry_run == "1", "failed_steps": args.failed.split()}
    bench = merge(args.out, meta)
    print("\n".join(summary(args.out, bench)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
