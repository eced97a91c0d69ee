"""How long ``fastspec demo`` takes, as a new user runs it: wall-clock and CPU time, one JSON file.

The README's first screen states the demo's time on a 2-core CPU; that sentence is checked
against the file this writes (``tests/test_readme.py``), so the time it states was measured, not
typed. Each repeat runs the CLI in a fresh process, exactly as the README's set-up line does
(``fastspec demo``, default sizes, a new run folder), and counts everything that process does:
start-up, imports, training, probing, report and plots.

    python benchmarks/demo_time.py OUT.json      # committed as benchmarks/results/<machine>-<date>-demo-time.json
    python benchmarks/demo_time.py OUT.json --repeats 3 -- --quick     # flags after -- go to the demo

Measure on an idle machine: the wall time of a 2-core run doubles when another process holds a core.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_seconds_of_children() -> float:
    """User + system CPU seconds of every child process that has finished so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_demo(demo_args: list[str], repeats: int) -> list[dict]:
    """Run ``python -m fastspec demo --out NEW --no-progress *demo_args`` ``repeats`` times in
    fresh processes; per run: wall and CPU seconds and the exit code (a failed run is kept, marked)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="fastspec-demo-time-") as tmp:
        for i in range(repeats):
            cmd = [sys.executable, "-m", "fastspec", "demo", "--out", str(Path(tmp) / f"run{i}"),
                   "--no-progress", *demo_args]
            cpu0, t0 = cpu_seconds_of_children(), time.perf_counter()
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
            wall, cpu = time.perf_counter() - t0, cpu_seconds_of_children() - cpu0
            runs.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "exit_code": proc.returncode})
            print(f"run {i + 1}/{repeats}: {wall:.1f} s wall, {cpu:.1f} s CPU, exit {proc.returncode}", flush=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--repeats", type=int, default=3, help="demo runs, each in a fresh process (default 3)")
    p.add_argument("demo_args", nargs="*", help="flags for `fastspec demo` (after --)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: expected an integer >= 1, got {args.repeats}")

    from fastspec.sysinfo import environment

    env = environment()
    import torch

    env["torch_threads"] = torch.get_num_threads()
    env["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    runs = time_demo(args.demo_args, args.repeats)
    ok = [r for r in runs if r["exit_code"] == 0]
    doc = {
        "kind": "demo-time",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["fastspec", "demo", *args.demo_args]),
        "environment": env,
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in ok) if ok else None,
        "median_cpu_s": statistics.median(r["cpu_s"] for r in ok) if ok else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"median of {len(ok)} run(s): {doc['median_wall_s']} s wall, {doc['median_cpu_s']} s CPU -> {args.out}")
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
