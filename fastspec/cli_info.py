"""``fastspec info``: versions and backend availability, as one would paste into a bug report."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re


def _nvidia_driver() -> str | None:
    """NVIDIA kernel driver version from /proc (no subprocess), None without one."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        "driver": _nvidia_driver(),
        "cpu": f"{_cpu_model()} ({os.cpu_count()} cores)",
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

    from fastspec.eig.cuda import build_info

    info = {"environment": environment(), "eigvalsh_backends": fastspec.backends(), "eigvalsh_kernel": build_info()}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info["environment"].items():
        print(f"{k:>10}: {v}")
    for name, b in info["eigvalsh_backends"].items():
        print(f"{'eigvalsh':>10}: {name:<6} {'yes' if b['available'] else 'no ':<4} {b['reason']}")
    k = info["eigvalsh_kernel"]
    if k["compiler"] is None:
        print(f"{'kernel':>10}: cannot be compiled here: {k['reason']}")
    else:
        archs = k["archs"]
        where = (f"for {k['target']} (this GPU)" if k["target"] else
                 k.get("reason") or f"no GPU here (it targets sm_{archs[0]} to sm_{archs[-1]})")
        print(f"{'kernel':>10}: compiled at first use by {k['compiler']} ({k['binding']}): {where}")
    print(f"{'cache':>10}: {k['cache']} ({'writable' if k['cache_writable'] else 'NOT writable'}, "
          f"{k['cached_kernels']} kernels; FASTSPEC_CACHE moves it)")
    return 0
