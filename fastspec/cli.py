"""``fastspec`` command line: the dispatcher of the sub-commands in :mod:`fastspec.commands`.

Each sub-command is one thin module there, exposing ``add_arguments(parser)`` and ``run(args) ->
int``; the work it asks for stays in the library's capability packages. ``COMMANDS``
holds each command's one-line help, so ``fastspec --help`` lists them all without importing any
of those modules, and ``fastspec CMD ...`` imports CMD's module alone: start-up stays cheap and
optional dependencies stay optional. ``import fastspec`` itself imports no torch (its names
load on first use), so ``fastspec --help`` costs a few tens of milliseconds.

Bad input: a sub-command raises ValueError with a one-line message that starts with the flag it
is about (``--threads: expected an int >= 1, got 0``); :func:`main` prints it as argparse prints
its usage errors, ``fastspec CMD: error: MESSAGE`` on stderr, and returns 2. Sub-commands check
their flags before they measure or write anything. Any other exception keeps its traceback, and
``FASTSPEC_TRACEBACK=1`` keeps it for these too.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence

# name -> (module, one-line help); every command's module is in fastspec/commands/
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("fastspec.commands.info", "show versions and which eigvalsh solvers are available"),
    "bench": ("fastspec.commands.bench", "time fastspec against torch.linalg baselines (a table per suite, --json)"),
    "compare": ("fastspec.commands.compare", "accuracy only: fastspec vs torch.linalg fp32 vs fp64"),
    "demo": ("fastspec.commands.demo", "train three tiny models (QK-norm key-rank study) and write a run folder"),
    "analyze": ("fastspec.commands.analyze", "key and FFN spectra of pretrained models or a series of checkpoints"),
    "report": ("fastspec.commands.report", "regenerate plots and report.md of a run folder"),
    "precompile": ("fastspec.commands.precompile", "compile the CUDA eigensolver ahead of time into the kernel cache"),
    "plan": ("fastspec.commands.plan", "the probe's memory on every rank of a dp × tp × pp run, before the launch"),
}

_HELP_FLAGS = ("-h", "--help")


def build_parser(with_arguments: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``fastspec`` parser; the sub-commands named in ``with_arguments`` (default: all) get
    their arguments, which imports their modules. The others are listed with their help only."""
    full = set(COMMANDS if with_arguments is None else with_arguments)
    if full - COMMANDS.keys():
        raise ValueError(f"with_arguments: expected names from COMMANDS {list(COMMANDS)}, "
                         f"got {sorted(full - COMMANDS.keys())}")
    parser = argparse.ArgumentParser(prog="fastspec", description="Spectral metrics of activations.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name in full:
            importlib.import_module(module).add_arguments(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` runs, or None when argparse will stop before reaching one (top-level
    ``--help``, no command) or will reject it (unknown name: argparse's usage error)."""
    for arg in argv:
        if arg in _HELP_FLAGS:
            return None  # argparse acts on the top-level help before it looks at the command
        if arg.startswith("-"):
            continue  # not a top-level option: argparse reports it
        return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    parser = build_parser(() if command is None else (command,))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ValueError as e:
        if show_tracebacks():
            raise
        print(f"fastspec {args.command}: error: {e}", file=sys.stderr)
        return 2


def show_tracebacks() -> bool:
    """``FASTSPEC_TRACEBACK=1``: let the errors that are normally one line raise with their traceback
    (to debug a ValueError that is not a user mistake)."""
    return os.environ.get("FASTSPEC_TRACEBACK", "").strip().lower() in ("1", "true", "yes", "on")


if __name__ == "__main__":
    sys.exit(main())
