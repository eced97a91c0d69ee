"""``fastspec bench``: time fastspec against what one writes with torch.linalg, in one table.

Runs the cases of :mod:`fastspec.bench.cases` (the same ones ``pytest benchmarks`` runs) without
pytest: warmup, then the median of repeats (CUDA events on GPU, ``perf_counter`` on CPU), and
prints one table headed by device, driver/CUDA, torch, triton and fastspec versions.

    fastspec bench                              # GPU sizes with CUDA, CPU sizes otherwise
    fastspec bench --quick                      # seconds on a CPU (CI)
    fastspec bench --json benchmarks/results/h100-2026-11-21.json
    fastspec bench --accuracy                   # same as `fastspec compare`
    fastspec bench --table                      # regenerate README's table from benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cases import SUITES, TIERS

    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds on a CPU (same as --tier quick)")
    p.add_argument("--tier", choices=TIERS, help="size tier (default: gpu with CUDA, cpu otherwise)")
    p.add_argument("--suite", action="append", choices=SUITES,
                   help="run only this suite (repeatable; default: all)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per case (default 2, 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 5, 3 with --quick)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 gives steadier CPU numbers on a shared machine)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--accuracy", action="store_true", help="run the accuracy comparison only (fastspec compare)")
    p.add_argument("--table", action="store_true",
                   help="regenerate README.md's benchmark table from benchmarks/results/*.json and exit")


def resolve(args: argparse.Namespace):
    """``(device, tier)`` from the flags; ValueError naming the flag on a contradiction."""
    import torch

    from .cases import default_device, default_tier

    device = default_device() if args.device is None else torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device!r} requested but CUDA is not available")
    if args.quick and args.tier not in (None, "quick"):
        raise ValueError(f"--quick contradicts --tier {args.tier}")
    tier = "quick" if args.quick else (args.tier or default_tier(device))
    return device, tier


def print_header(env: dict, tier: str) -> None:
    from .table import describe_environment

    print(f"# {describe_environment(env)}")
    import torch

    print(f"# python {env['python']} · {env.get('cpu')} · {torch.get_num_threads()} torch threads · sizes: {tier}")


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    if args.table:
        from .table import update_readme

        fresh = update_readme(Path("README.md"), Path("benchmarks/results"))
        print("README.md benchmark table " + ("already up to date" if fresh else "rewritten"))
        return 0
    if args.accuracy:
        from .cli_compare import run as run_compare

        return run_compare(args)

    from .cases import SUITES, cases
    from .runner import report, run_cases
    from .table import BENCH_COLUMNS, bench_cells, render_text

    device, tier = resolve(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected an int >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (1 if tier == "quick" else 2)
    repeats = args.repeats if args.repeats is not None else (3 if tier == "quick" else 5)
    selected = [c for s in (args.suite or SUITES) for c in cases(s, tier, device)]
    doc = report("bench", tier, [])
    print_header(doc["environment"], tier)
    doc["results"] = run_cases(selected, device, warmup=warmup, repeats=repeats,
                               progress=lambda c: print(f"  {c.suite} {c.id} ...", file=sys.stderr, flush=True))
    print(render_text(BENCH_COLUMNS, [bench_cells(r) for r in doc["results"]]))
    if args.json:
        write_json(args.json, doc)
    return 1 if any("error" in r for r in doc["results"]) else 0
