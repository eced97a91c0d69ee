"""What this process runs on: library versions, the device, the NVIDIA driver, the CPU.

Printed by ``fastspec info`` (:mod:`fastspec.commands.info`) and recorded in every benchmark
result file (:func:`fastspec.bench.runner.report`), so a number always says where it was taken.
"""
from __future__ import annotations

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
