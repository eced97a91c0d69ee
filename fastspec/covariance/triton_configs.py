"""Which launch settings the float32 Triton covariance kernels use: the candidates and their table.

Two kernels of ``triton_kernels.py`` carry the float32 (``precision="fast"``) updates of 16-bit
activations, and each has a few launch settings worth racing on a GPU:

* ``keys``: the fused row loop (whole rows in one 128-wide tile, ``64 < D <= 128``: attention
  heads), memory bound. Settings: rows per block ``BT``, warps, load-pipeline stages.
* ``ffn``: the tiled Gram (``D > 128``: FFN inputs, any wide module), tensor-core bound. Settings:
  ``BT``, warps, stages, whether the centred split forms its ``lo·loᵀ`` product (``lolo``; the error
  analysis is in docs/kernels.md, "Dropping lo·lo"), and ``presplit``: a pre-pass writes each valid
  row's centred ``hi``/``lo`` bf16 halves once, so the Gram loop only loads and multiplies (its
  operands go to the tensor cores straight from shared memory), instead of every tile program
  centring and splitting its two column strips itself (``D/128`` times per element).

Which one runs (:func:`choose`), first match wins:

1. ``$FASTSPEC_COV_TRITON_CONFIG`` names a candidate (an unknown name, or one of the other
   kernel, is a ValueError naming the variable: forcing one is a request, not a hint);
2. the shipped table's (:data:`TABLE`) row for this compute capability, kernel, input dtype and
   convention (centred or not), written by the GPU kit's race (``benchmarks/triton_race.py
   --merge``);
3. the kernel's default (the first candidate: the settings every GPU run so far measured).

No autotuning at run time: a pick that differed between processes would change the summation
order, and the sums must be bitwise reproducible. The table rows are measurements of one GPU
generation; a candidate never raced on an arch keeps the default there.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["CANDIDATES", "ENV", "KERNELS", "TABLE", "TritonConfig", "choose", "info", "kernel_of", "load_table"]

ENV = "FASTSPEC_COV_TRITON_CONFIG"
"""Environment variable that forces a candidate by name (:func:`choose`)."""

TABLE = Path(__file__).with_name("triton_configs.json")
"""The table: rows written by the GPU kit's race (``benchmarks/triton_race.py --merge``)."""

KERNELS = ("keys", "ffn")


class TritonConfig(NamedTuple):
    """One candidate's launch settings (:mod:`fastspec.covariance.triton_configs`)."""

    name: str
    kernel: str       # "keys" (fused rows, 64 < D <= 128) or "ffn" (tiled Gram, D > 128)
    BT: int           # rows per block of the row loop
    num_warps: int
    num_stages: int   # Triton's software-pipelining depth (capped by pipeline_stages)
    lolo: bool = True     # centred 16-bit split: form lo·loᵀ (False: 3 dots, not 4)
    presplit: bool = False  # ffn: hi/lo written by a pre-pass, Gram from bf16 arrays
    unroll: int = 1       # keys, uncentred: row blocks per unrolled group, the block tile flushed per group

    def describe(self) -> str:
        extra = (("" if self.lolo else ", no lo·lo") + (", pre-split" if self.presplit else "")
                 + (f", {self.unroll} blocks unrolled per flush" if self.unroll > 1 else ""))
        return f"{self.name} (BT {self.BT}, {self.num_warps} warps, {self.num_stages} stages{extra})"


CANDIDATES: dict[str, tuple[TritonConfig, ...]] = {
    # keys: the 128 x 128 fp32 G and its block tile (ACC=2) alone are 128 registers a thread at
    # 8 warps, so one program per SM whatever the row block: 4 warps (or 64-row blocks) spill
    # hundreds of registers and 16 warps are capped at 128 registers and spill too (sm_90 SASS,
    # docs/kernels.md). What the candidates change is the bytes in flight per SM ((stages − 1)
    # row blocks of BT x 128 x 2 bytes) against the issue slots per row
    "keys": (
        TritonConfig("k32w8s3", "keys", 32, 8, 3),  # every GPU run so far (the default): 16 KB in flight
        TritonConfig("k32w8s4", "keys", 32, 8, 4),  # 24 KB: what Little's law asks of an H100 SM
        TritonConfig("k16w8s4", "keys", 16, 8, 4),  # 12 KB, fewer registers (240 / 215)
        # the uncentred block tile flushed after every 2 blocks of an unrolled loop instead of
        # by a select every block: 206 instead of 454 instructions per 32 rows and warp on sm_90,
        # where the select version is issue bound (~16.6 µs of issue for ~11 µs of HBM time)
        TritonConfig("k32w8s2-u2", "keys", 32, 8, 2, unroll=2),  # 16 KB in flight, no spills
        TritonConfig("k32w8s3-u2", "keys", 32, 8, 3, unroll=2),  # 32 KB; 10 spill ops (Triton 3.9)
    ),
    # ffn: one 128 x 128 tile of G (the triangle only) per program, all four split products:
    # dropping lo·lo (``lolo=False``) measured 3-20x torch float32's error on the bench's rows at
    # 512-2048 rows (docs/kernels.md, "Dropping lo·lo"), outside the accuracy claim
    "ffn": (
        TritonConfig("f64w8s3", "ffn", 64, 8, 3),   # the default: every GPU run so far
        TritonConfig("f32w8s3", "ffn", 32, 8, 3),   # 32-row blocks: no spills
        TritonConfig("f32w8s4", "ffn", 32, 8, 4),
        # pre-split: 64-row blocks at 3 stages fill 192 KB of shared memory (4 stages would need
        # 256, over an H100's 227); 4 warps spill (G and its block tile are 256 registers a thread)
        TritonConfig("f64w8s3-pre", "ffn", 64, 8, 3, presplit=True),
        TritonConfig("f32w8s4-pre", "ffn", 32, 8, 4, presplit=True),
    ),
}

BY_NAME = {c.name: c for cs in CANDIDATES.values() for c in cs}


def kernel_of(D: int) -> str | None:
    """Which raced kernel a 16-bit update with ``D`` features per site runs (None: ``D <= 64``,
    whose fixed settings are not raced)."""
    if D > 128:
        return "ffn"
    return "keys" if D > 64 else None


class Row(NamedTuple):
    """One measured choice: on sm_``arch``, ``kernel`` with ``dtype`` input, centred or not."""

    arch: int
    kernel: str
    dtype: str
    center: bool
    config: str

    def key(self) -> tuple[int, str, str, bool]:
        return self.arch, self.kernel, self.dtype, self.center


def _check_row(d: dict) -> Row:
    row = Row(int(d["arch"]), str(d["kernel"]), str(d["dtype"]), bool(d["center"]), str(d["config"]))
    if row.kernel not in KERNELS:
        raise ValueError(f"{TABLE.name}: kernel {row.kernel!r} is not one of {KERNELS}")
    cand = BY_NAME.get(row.config)
    if cand is None or cand.kernel != row.kernel:
        raise ValueError(f"{TABLE.name}: config {row.config!r} is not a {row.kernel} candidate "
                         f"({', '.join(c.name for c in CANDIDATES[row.kernel])})")
    return row


@functools.cache
def load_table(path: Path | None = None) -> tuple[Row, ...]:
    """The table's rows (checked: every row names a candidate of its kernel, keys unique)."""
    data = json.loads((path or TABLE).read_text())
    rows = tuple(_check_row(d) for d in data["rows"])
    keys = [r.key() for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{(path or TABLE).name}: two rows for one (arch, kernel, dtype, center)")
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _forced(kernel: str) -> TritonConfig | None:
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    cand = BY_NAME.get(name)
    if cand is None:
        raise ValueError(f"${ENV}: {name!r} is not a candidate; expected one of {', '.join(BY_NAME)}")
    if cand.kernel != kernel:
        raise ValueError(f"${ENV}: {name!r} is a {cand.kernel} candidate, this update runs the {kernel} kernel")
    return cand


def choose(kernel: str, arch: int | None, dtype: torch.dtype, center: bool) -> tuple[TritonConfig, str]:
    """``(candidate, why)`` for one launch of ``kernel`` on sm_``arch`` (None: not CUDA, e.g. the
    interpreter: the default) with ``dtype`` input (module docstring: first match wins)."""
    forced = _forced(kernel)
    if forced is not None:
        return forced, f"${ENV}"
    return _choose(kernel, arch, _dtype_name(dtype), bool(center))


@functools.cache
def _choose(kernel: str, arch: int | None, dtype: str, center: bool) -> tuple[TritonConfig, str]:
    if arch is not None:
        for r in load_table():
            if r.key() == (arch, kernel, dtype, center):
                return BY_NAME[r.config], f"measured row for sm_{arch} {dtype} {'centred' if center else 'raw'}"
    where = f"sm_{arch}" if arch is not None else "this device"
    return CANDIDATES[kernel][0], f"no measured row for {where}: the default"


@functools.cache
def arch_of(device: torch.device) -> int | None:
    """``major·10 + minor`` of a CUDA device, None elsewhere (cached: every update asks)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def forget() -> None:
    """Drop the cached table and choices (tests)."""
    load_table.cache_clear()
    _choose.cache_clear()
    arch_of.cache_clear()


def info(device: torch.device | None = None) -> dict:
    """What each kernel runs on ``device`` (default: the current CUDA device, else the CPU), for
    ``fastspec info``: per kernel, dtype and convention, the candidate's description and why."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    arch = arch_of(device)
    out: dict = {"device": f"sm_{arch}" if arch is not None else str(device), "choices": []}
    for kernel in KERNELS:
        for dtype in (torch.bfloat16, torch.float16):
            for center in (True, False):
                try:
                    cand, why = choose(kernel, arch, dtype, center)
                    text = cand.describe()
                except ValueError as exc:
                    text, why = "error", str(exc)
                out["choices"].append({"kernel": kernel, "dtype": _dtype_name(dtype),
                                       "center": center, "config": text, "why": why})
    return out
