"""``fastspec compare``: the accuracy side only — fastspec eigvalsh vs torch.linalg fp32 vs fp64.

Random and hard matrix families (:data:`fastspec.eig.matrices.FAMILIES`, the ones the solver's tests
use; see :mod:`fastspec.bench.accuracy`). The bound each (family, n, variant) must hold is
:func:`fastspec.bench.accuracy.within_bound`: fastspec's error ≤ 2 × torch.linalg fp32's error
+ 8·eps_fp32, both relative to the fp64 spectrum. The table labels each row from the exact
errors (``≤ 2×``, ``≤ 2× + 8·eps`` when only the floor holds it, ``FAIL``); the last line is
``PASS: ...`` or ``FAIL: ...`` (:func:`fastspec.bench.table.compare_verdict`), and the exit
status is 1 on FAIL (a variant over the bound, or one that raised).

Time cap, as ``fastspec bench``: with ``--time-limit`` no (family, n) starts after the limit,
SIGTERM ends the one in flight, the rest get ``skipped`` rows, and ``--json`` is rewritten after
every (family, n), so a kill keeps what finished.

    fastspec compare --quick --json compare.json   # about 3 s on a 2-core CPU
    fastspec compare                               # on CPU the cpu tier: about 25 s there
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from . import _bench_common as common

BOUND = ("Bound: each (family, n, variant) passes when fastspec's max relative eigenvalue error vs "
         "fp64 is at most 2 × torch.linalg.eigvalsh fp32's + 8·eps_fp32 (the floor keeps a baseline "
         "that rounds almost exactly from making the bound ~0). The last line says PASS or FAIL; "
         "exit status 1 on FAIL.")


# What --quick costs, said in its help (one place, tests/test_commands.py checks the help uses it).
# Measured: 3.0 s on a shared 2-core AMD EPYC (4.3 s with both cores busy with other work); the
# default cpu tier took 24.7 s there, a newcomer measured 27 s. (It said "well under a second".)
QUICK_TIME = "about 3 s on a 2-core CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = BOUND
    p.add_argument("--quick", action="store_true", help=f"small sizes, {QUICK_TIME}")
    p.add_argument("--tier", choices=common.TIERS, help="size tier (default: gpu with CUDA, cpu otherwise)")
    # names checked when the command runs: listing them here would import torch for --help
    p.add_argument("--family", action="append", metavar="NAME",
                   help="only this matrix family of fastspec.eig.matrices.FAMILIES, e.g. wishart or "
                        "wilkinson (repeatable; default: all; a wrong name lists them)")
    p.add_argument("--device", help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    common.add_time_limit(p)


def run(args: argparse.Namespace) -> int:
    common.check_flags(args)
    families = getattr(args, "family", None)
    if families:
        from ..eig.matrices import FAMILIES

        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"--family: expected names from {', '.join(FAMILIES)}; got {', '.join(unknown)}")
        families = list(dict.fromkeys(families))
    device, tier = common.resolve(args)
    deadline = common.deadline_of(args)
    from ..bench.accuracy import compare
    from ..bench.runner import TimeCap, report
    from ..bench.table import (
        COMPARE_COLUMNS,
        compare_cells,
        compare_verdict,
        render_text,
    )

    doc = report("compare", tier, [])
    common.print_header(doc["environment"], tier)

    save = common.partial_json(args.json, doc)  # rewritten after every (family, n)
    with common.sigterm_as_time_cap():
        doc["results"] = compare(tier, device, families, deadline=deadline, on_rows=save)
        passed, line = compare_verdict(doc["results"])
        # a SIGTERM now finds every row saved already: only the printing is cut short
        with contextlib.suppress(TimeCap):
            print(render_text(COMPARE_COLUMNS, [compare_cells(r) for r in doc["results"]], right=("ratio",)))
            if args.json:
                common.write_json(args.json, doc)
            print(line)
    return 0 if passed else 1
