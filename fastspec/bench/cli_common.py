"""What ``fastspec bench`` (:mod:`fastspec.bench.cli`) and ``fastspec compare``
(:mod:`fastspec.bench.cli_compare`) share: the time-limit flag, device and tier resolution, the
header line and the atomic JSON writer.

Both commands import this module and neither imports the other's helpers, so ``bench
--accuracy`` can hand over to ``compare`` without an import cycle.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


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


def resolve(args: argparse.Namespace):
    """``(device, tier)`` from the flags; ValueError naming the flag on a contradiction."""
    import torch

    from .case import default_device, default_tier

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


def write_json(path: Path, doc: dict, *, quiet: bool = False) -> None:
    """Write ``doc`` atomically (a reader, or a kill mid-write, never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")
