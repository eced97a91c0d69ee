"""``fastspec report RUN_DIR``: regenerate the plots and ``report.md`` of a run folder
(:func:`fastspec.report.write_report`)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder with records.jsonl (e.g. from `fastspec demo`)")


def run(args: argparse.Namespace) -> int:
    from ..report import write_report

    try:
        path = write_report(args.run_dir)
    except FileNotFoundError as e:  # a user error: one line, no traceback
        print(f"fastspec report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
