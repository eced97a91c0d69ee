"""What ``fastspec bench`` (:mod:`fastspec.commands.bench`) and ``fastspec compare``
(:mod:`fastspec.commands.compare`) share: the flags' constants, their validation, device and
tier resolution, the header line and the atomic JSON writer.

Both commands import this module and neither imports the other's helpers, so ``bench
--accuracy`` can hand over to ``compare`` without an import cycle. Nothing here imports torch
at module level: ``fastspec bench --help`` builds its parser from the constants below
(tests/test_bench_cli.py checks they match :data:`fastspec.bench.case.TIERS` and
:data:`fastspec.bench.suites.SUITES`).

Bad input raises ValueError with a one-line message that starts with the flag; ``fastspec``'s
dispatcher (:func:`fastspec.cli.main`) prints it as a usage error. Every check runs before
anything is measured or written.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

TIERS = ("quick", "cpu", "gpu")
SUITES = ("eigvalsh", "covariance", "keyrank", "train_step", "probe", "budget", "train_step_compiled")


def add_time_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop cleanly after SECONDS: no new case starts, the rest are recorded as skipped")


def deadline_of(args: argparse.Namespace) -> float | None:
    """``time.monotonic()`` deadline from ``--time-limit`` (None without one)."""
    limit = getattr(args, "time_limit", None)
    if limit is None:
        return None
    if not limit > 0:
        raise ValueError(f"--time-limit: expected seconds > 0, got {limit}")
    return time.monotonic() + limit


def check_json_path(path: Path | None) -> None:
    """``--json PATH`` can be written: not a directory, and a file can be made in its folder,
    which is created if missing (checked before a run, whose first rewrite of the file would
    otherwise raise after the header; tried for real by :func:`._paths.unwritable`, which leaves
    nothing behind: permission bits say yes to root even in ``/proc``)."""
    from ._paths import unwritable

    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"--json: expected a file path, got the directory {path}")
    reason = unwritable(path.parent)  # also a path through a regular file: "... is a file, not a folder"
    if reason is not None:
        raise ValueError(f"--json: {reason}")


def parse_device(text: str | None):
    """``--device`` as a ``torch.device``: ``cpu`` or ``cuda[:N]`` of a visible GPU (default:
    cuda if available, else cpu)."""
    import torch

    from ..bench.case import default_device

    if text is None:
        return default_device()
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device: {text!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device: expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}, got {text!r}")
    return device


def resolve(args: argparse.Namespace):
    """``(device, tier)`` from the flags; ValueError naming the flag on a contradiction."""
    from ..bench.case import default_tier

    if args.quick and args.tier not in (None, "quick"):
        raise ValueError(f"--quick contradicts --tier {args.tier}: give one of them")
    device = parse_device(args.device)
    tier = "quick" if args.quick else (args.tier or default_tier(device))
    return device, tier


def check_flags(args: argparse.Namespace) -> None:
    """Checks of the flags both commands have, before anything runs (ValueError naming the flag)."""
    deadline_of(args)
    check_json_path(args.json)


def print_header(env: dict, tier: str, extra: str = "") -> None:
    from ..bench.table import describe_environment

    print(f"# {describe_environment(env)}")
    import torch

    print(f"# python {env['python']} · {env.get('cpu')} · {torch.get_num_threads()} torch threads · "
          f"sizes: {tier}{extra}")


@contextlib.contextmanager
def sigterm_as_time_cap():
    """SIGTERM raises :class:`~fastspec.bench.runner.TimeCap` inside the block (main thread only)
    and sets :data:`~fastspec.bench.runner.STOP`, which still ends the run at the next case if
    Python drops the exception (raised inside a weakref callback or a destructor)."""
    from ..bench.runner import STOP, TimeCap

    def handler(signum, frame):
        STOP.set()
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
        STOP.clear()


def partial_json(path: Path | None, doc: dict):
    """``save(rows)``: puts ``rows`` in ``doc`` and rewrites ``path`` (if any) at once, and is
    called here with no rows, so the file exists before the first case: a run killed at any
    point leaves valid JSON holding every case that finished."""
    def save(rows: list[dict]) -> None:
        doc["results"] = list(rows)
        if path:
            write_json(path, doc, quiet=True)

    save([])
    return save


@contextlib.contextmanager
def _sigterm_held():
    """SIGTERM held back inside the block (delivered, and :func:`sigterm_as_time_cap`'s handler run,
    as it ends): a write and its rename are not cut apart. Where signals cannot be masked
    (Windows), nothing is held."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        yield
        return
    previous = mask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


def write_json(path: Path, doc: dict, *, quiet: bool = False) -> None:
    """Write ``doc`` atomically (a reader, or a kill mid-write, never sees half a file); a SIGTERM
    during the write waits for it and its rename, so no ``.tmp`` file is left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    with _sigterm_held():
        tmp.write_text(text)
        os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")
