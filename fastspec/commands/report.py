"""``fastspec report RUN_DIR``: regenerate the plots and ``report.md`` of a run folder
(:func:`fastspec.report.write_report`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder with records.jsonl (from `fastspec demo`) or records.parquet/.csv "
                                  "(from `fastspec analyze`)")


def run(args: argparse.Namespace) -> int:
    from ..report import RECORDS_FILES, write_report
    from ._paths import unwritable

    run_dir = Path(args.run_dir)
    if any((run_dir / name).is_file() for name in RECORDS_FILES):  # else write_report says what is missing
        # report.md goes in the run folder, the plots in plots/: checked before any is drawn, so a
        # folder that can be read but not written is one line here, not a traceback from the plots
        for folder in (run_dir, run_dir / "plots"):
            reason = unwritable(folder)
            if reason is not None:
                print(f"fastspec report: run_dir: {reason}", file=sys.stderr)
                return 2
    try:
        path = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as e:  # a user error (a missing or unreadable file): one line
        print(f"fastspec report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
