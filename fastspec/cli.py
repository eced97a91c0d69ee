"""``fastspec`` command line: one sub-command per capability, each in its own module.

A sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is
imported only when its command runs, so optional dependencies stay optional.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("fastspec.cli_info", "show versions and which backends are available"),
    "bench": ("fastspec.bench.cli", "time fastspec against torch.linalg baselines (one table, --json)"),
    "compare": ("fastspec.bench.cli_compare", "accuracy only: fastspec vs torch.linalg fp32 vs fp64"),
    "demo": ("fastspec.demo.cli", "train three tiny models (QK-norm study, SPEC §5) and write a run folder"),
    "report": ("fastspec.report", "regenerate plots and report.md of a run folder"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastspec", description="Spectral metrics of activations.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
