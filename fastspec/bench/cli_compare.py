"""``fastspec compare``: the accuracy side only — fastspec eigvalsh vs torch.linalg fp32 vs fp64.

Random and hard matrix families (:data:`fastspec.eig.cases.FAMILIES`, the ones the solver's tests
use; see :mod:`fastspec.bench.accuracy`); exit status 1 if any fastspec variant is worse than 2×
torch.linalg fp32 (plus an 8·eps floor) or raised.

    fastspec compare --quick --json compare.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .cli_common import add_time_limit, deadline_of, print_header, resolve, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..eig.cases import FAMILIES
    from .case import TIERS

    p.add_argument("--quick", action="store_true", help="small sizes, well under a second on a CPU")
    p.add_argument("--tier", choices=TIERS, help="size tier (default: gpu with CUDA, cpu otherwise)")
    p.add_argument("--family", action="append", choices=list(FAMILIES),
                   help="only this matrix family (repeatable; default: all)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    add_time_limit(p)


def run(args: argparse.Namespace) -> int:
    from .accuracy import compare
    from .runner import report
    from .table import COMPARE_COLUMNS, compare_cells, render_text

    device, tier = resolve(args)
    deadline = deadline_of(args)
    doc = report("compare", tier, [])
    print_header(doc["environment"], tier)
    doc["results"] = compare(tier, device, getattr(args, "family", None), deadline=deadline)
    print(render_text(COMPARE_COLUMNS, [compare_cells(r) for r in doc["results"]]))
    if args.json:
        write_json(args.json, doc)
    # a (family, n) the time cap left out is not a failure; everything that ran must hold
    return 0 if all(r.get("within_2x_torch") for r in doc["results"] if "skipped" not in r) else 1
