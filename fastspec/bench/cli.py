"""``fastspec bench``: time fastspec against what one writes with torch.linalg, in one table.

Runs the cases of :mod:`fastspec.bench.cases` (the same ones ``pytest benchmarks`` runs) without
pytest: warmup, then the median of repeats (CUDA events on GPU, ``perf_counter`` on CPU), and
prints one table headed by device, driver/CUDA, torch, triton and fastspec versions.

    fastspec bench                              # GPU sizes with CUDA, CPU sizes otherwise
    fastspec bench --quick                      # seconds on a CPU (CI)
    fastspec bench --json benchmarks/results/<device>-<date>.json
    fastspec bench --accuracy                   # same as `fastspec compare`
    fastspec bench --table                      # regenerate the repository README's table
    fastspec bench --time-limit 240 --json r.json   # stop cleanly after 240 s, keep what ran

Time cap: with ``--time-limit`` no case starts after the limit, and SIGTERM (``timeout``'s
signal) ends the case in flight; either way the cases not measured get ``skipped`` rows naming
the cap, ``--json`` holds every row measured so far (it is rewritten after each case, so even a
SIGKILL keeps the finished ones) and the exit status is 0 unless a case raised.

Layout: the flags both commands share are in :mod:`fastspec.bench.cli_common`; ``--accuracy``
hands over to :mod:`fastspec.bench.cli_compare`, which imports nothing from here.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from .cli_common import add_time_limit, deadline_of, print_header, resolve, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .case import TIERS
    from .cases import SUITES

    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds on a CPU (same as --tier quick)")
    p.add_argument("--tier", choices=TIERS, help="size tier (default: gpu with CUDA, cpu otherwise)")
    p.add_argument("--suite", action="append", choices=SUITES,
                   help="run only this suite (repeatable; default: all)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per case (default 2, 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 5, 3 with --quick)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 gives steadier CPU numbers on a shared machine)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the results as JSON to PATH (rewritten after every case)")
    p.add_argument("--filter", action="append", metavar="TEXT",
                   help="run only cases whose 'suite size variant' contains TEXT (repeatable: any)")
    add_time_limit(p)
    p.add_argument("--accuracy", action="store_true", help="run the accuracy comparison only (fastspec compare)")
    p.add_argument("--table", action="store_true",
                   help="regenerate the README's benchmark table from benchmarks/results/*.json and exit "
                        "(the same as python -m fastspec.bench.table)")
    p.add_argument("--readme", type=Path, metavar="PATH",
                   help="with --table: the README to rewrite (default: README.md of the repository "
                        "holding the fastspec package)")


@contextlib.contextmanager
def sigterm_as_time_cap():
    """SIGTERM raises :class:`~fastspec.bench.runner.TimeCap` inside the block (main thread only)."""
    from .runner import TimeCap

    def handler(signum, frame):
        raise TimeCap("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: no handler, the deadline still applies
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def select(cases: list, filters: list[str] | None) -> list:
    """Cases whose ``'suite size variant'`` contains any of ``filters`` (all without filters)."""
    if not filters:
        return cases
    return [c for c in cases if any(f in f"{c.suite} {c.size} {c.variant}" for f in filters)]


def run(args: argparse.Namespace) -> int:
    if args.readme is not None and not args.table:
        raise ValueError("--readme: goes with --table (the README is only rewritten when asked)")
    if args.table:
        from .table import regenerate

        readme, fresh = regenerate(args.readme)
        print(f"{readme} benchmark table " + ("already up to date" if fresh else "rewritten"))
        return 0
    if args.accuracy:
        from .cli_compare import run as run_compare

        return run_compare(args)

    from .cases import SUITES, cases
    from .runner import capped, report, run_cases
    from .table import BENCH_COLUMNS, bench_cells, render_text

    device, tier = resolve(args)
    deadline = deadline_of(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected an int >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (1 if tier == "quick" else 2)
    repeats = args.repeats if args.repeats is not None else (3 if tier == "quick" else 5)
    selected = select([c for s in (args.suite or SUITES) for c in cases(s, tier, device)], args.filter)
    if not selected:
        raise ValueError(f"--filter: no case matches {args.filter}")
    doc = report("bench", tier, [])
    print_header(doc["environment"], tier)

    def save(rows: list[dict]) -> None:
        doc["results"] = list(rows)
        if args.json:
            write_json(args.json, doc, quiet=True)

    with sigterm_as_time_cap():
        doc["results"] = run_cases(
            selected, device, warmup=warmup, repeats=repeats, deadline=deadline, on_rows=save,
            progress=lambda c: print(f"  {c.suite} {c.id} ...", file=sys.stderr, flush=True))
    print(render_text(BENCH_COLUMNS, [bench_cells(r) for r in doc["results"]]))
    if args.json:
        write_json(args.json, doc)
    if capped(doc["results"]):
        print("time cap reached: partial results (cases not measured are marked skipped)", file=sys.stderr)
    return 1 if any("error" in r for r in doc["results"]) else 0
