"""``fastspec bench``: time fastspec against what one writes with torch.linalg.

Runs the cases of :mod:`fastspec.bench.suites` (the same ones ``pytest benchmarks`` runs)
without pytest: warmup, then the median of repeats (CUDA events on GPU, the covariance cases
on the device clock of :mod:`fastspec.bench.timing`; ``perf_counter`` on CPU), and prints,
under a header naming device, driver/CUDA, torch, triton and fastspec versions, one narrow
table per suite and baseline (:func:`fastspec.bench.table.bench_text`; ``--wide``:
every field in one table, as in the README). A speedup or overhead within the spread of the
repeats prints as noise (:data:`fastspec.bench.table.NOISE_RULE`); ``--json`` keeps every number.

    fastspec bench                              # GPU sizes with CUDA, CPU sizes otherwise
    fastspec bench --quick                      # about 25 s on an idle 2-core CPU (CI)
    fastspec bench --json benchmarks/results/<device>-<date>.json
    fastspec bench --accuracy                   # same as `fastspec compare`
    fastspec bench --time-limit 240 --json r.json   # stop cleanly after 240 s, keep what ran

Accuracy: each case carries its claim (:class:`fastspec.bench.case.Claim`, the rule ``pytest
benchmarks`` asserts too). A case whose errors break it is marked ``FAIL`` in the tables, its rows
in ``--json`` get ``claim_held: false`` and ``claim_violation``, the last line says
``FAIL: ...`` and the exit status is 1, as for a case that raised.

Time cap: with ``--time-limit`` no case starts after the limit, and SIGTERM (``timeout``'s
signal) ends the case in flight; either way the cases not measured get ``skipped`` rows naming
the cap, ``--json`` holds every row measured so far (it is rewritten after each case, so even a
SIGKILL keeps the finished ones) and a capped run is not a failure.

Bad flags (and flags the chosen mode would ignore) are refused with a one-line ValueError naming
the flag before anything runs or is written.

Layout: the flags both commands share are in :mod:`fastspec.commands._bench_common`;
``--accuracy`` hands over to :mod:`fastspec.commands.compare`, which imports nothing from here.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ._bench_common import (
    SUITES,
    TIERS,
    add_time_limit,
    check_flags,
    deadline_of,
    partial_json,
    print_header,
    resolve,
    sigterm_as_time_cap,
    write_json,
)

# What --quick costs, said in its help (one place, tests/test_commands.py checks the help uses it).
# Measured: 23.6 s on a shared 2-core AMD EPYC (load ~1.4, 2 torch threads, every suite); a
# newcomer's busy 2-core CPU took 2.5 minutes. (It said "seconds on a CPU".)
QUICK_TIME = "about 25 s on an idle 2-core CPU, minutes on a busy one"

# flags that only a timing run reads: refused with --accuracy rather than ignored
RUN_ONLY = {"suite": "--suite", "filter": "--filter", "exclude": "--exclude", "warmup": "--warmup", "repeats": "--repeats",
            "threads": "--threads", "wide": "--wide"}


CLAIM_RULE = ("Accuracy: every case holds fastspec's error to the claim its suite makes (the rule "
              "`pytest benchmarks` asserts too); a case that breaks it is marked FAIL in the tables and "
              "in --json (claim_held: false) and the exit status is 1, as when a case raises.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.table import NOISE_RULE

    p.epilog = f"{CLAIM_RULE} {NOISE_RULE}"
    p.add_argument("--quick", action="store_true", help=f"tiny sizes, {QUICK_TIME} (same as --tier quick)")
    p.add_argument("--tier", choices=TIERS, help="size tier (default: gpu with CUDA, cpu otherwise)")
    p.add_argument("--suite", action="append", choices=SUITES,
                   help="run only this suite (repeatable; default: all)")
    p.add_argument("--device", help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed calls per case (default 2, 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="timed calls per case (default 5, 3 with --quick); their spread is the noise")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's; 1 gives steadier CPU numbers on a shared machine)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="also write the results, every field, as JSON to PATH (rewritten after every case)")
    p.add_argument("--wide", action="store_true",
                   help="print every field in one wide table (the README's layout) instead of one per suite")
    p.add_argument("--filter", action="append", metavar="TEXT",
                   help="run only cases whose 'suite size variant tags' contains TEXT (repeatable: any; "
                        "the tag 'headline' marks the GPU kit's first numbers)")
    p.add_argument("--exclude", action="append", metavar="TEXT",
                   help="skip cases whose 'suite size variant tags' contains TEXT (repeatable)")
    add_time_limit(p)
    p.add_argument("--accuracy", action="store_true", help="run the accuracy comparison only (fastspec compare)")


def refuse(args: argparse.Namespace, flags: dict[str, str], mode: str) -> None:
    """ValueError naming the first of ``flags`` given on the command line, which ``mode`` ignores."""
    for dest, flag in flags.items():
        if getattr(args, dest, None) not in (None, False):
            raise ValueError(f"{flag}: not used with {mode}; drop it")


def check_run_flags(args: argparse.Namespace) -> None:
    """The numeric flags of a timing run (ValueError naming the flag)."""
    for flag, value, least in (("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                               ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag}: expected an int >= {least}, got {value}")


def run(args: argparse.Namespace) -> int:
    if args.accuracy:
        refuse(args, RUN_ONLY, "--accuracy (fastspec compare)")
        from .compare import run as run_compare

        return run_compare(args)

    check_flags(args)
    check_run_flags(args)
    device, tier = resolve(args)
    deadline = deadline_of(args)
    from ..bench.case import select
    from ..bench.runner import TimeCap, capped, report, run_cases
    from ..bench.suites import cases
    from ..bench.table import (
        BENCH_COLUMNS,
        bench_cells,
        bench_text,
        claims_verdict,
        render_text,
    )

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (1 if tier == "quick" else 2)
    repeats = args.repeats if args.repeats is not None else (3 if tier == "quick" else 5)
    suites = dict.fromkeys(args.suite or SUITES)  # in order, each once
    selected = select([c for s in suites for c in cases(s, tier, device)], args.filter, args.exclude)
    if not selected:
        flag = "--filter" if args.filter else "--exclude"
        given = [*(args.filter or ()), *(args.exclude or ())]
        raise ValueError(f"{flag}: expected text that leaves some case's 'suite size variant tags' "
                         f"selected, got {', '.join(map(repr, given))}")
    doc = report("bench", tier, [])
    print_header(doc["environment"], tier, f" · median of {repeats} repeats after {warmup} warm-up")

    save = partial_json(args.json, doc)
    with sigterm_as_time_cap():
        doc["results"] = run_cases(
            selected, device, warmup=warmup, repeats=repeats, deadline=deadline, on_rows=save,
            progress=lambda c: print(f"  {c.suite} {c.id} ...", file=sys.stderr, flush=True))
        verdict = claims_verdict(doc["results"])  # None: every measured case held its claim
        # a SIGTERM now finds every row saved already: the tables are all it can cut short
        with contextlib.suppress(TimeCap):
            if args.wide:
                print(render_text(BENCH_COLUMNS, [bench_cells(r) for r in doc["results"]]))
            else:
                print(bench_text(doc["results"]))
            if args.json:
                write_json(args.json, doc)
            if verdict is not None:
                print(verdict)
    if capped(doc["results"]):
        print("time cap reached: partial results (cases not measured are marked skipped)", file=sys.stderr)
    return 1 if verdict is not None or any("error" in r for r in doc["results"]) else 0
