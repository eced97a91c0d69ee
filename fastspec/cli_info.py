"""``fastspec info``: versions and backend availability, as one would paste into a bug report."""
from __future__ import annotations

import argparse
import json
import platform


def environment() -> dict:
    """Library versions and the device this process sees."""
    import torch

    import fastspec

    env = {
        "fastspec": fastspec.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    import fastspec

    info = {"environment": environment(), "eigvalsh_backends": fastspec.backends()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info["environment"].items():
        print(f"{k:>10}: {v}")
    for name, b in info["eigvalsh_backends"].items():
        print(f"{'eigvalsh':>10}: {name:<6} {'yes' if b['available'] else 'no ':<4} {b['reason']}")
    return 0
