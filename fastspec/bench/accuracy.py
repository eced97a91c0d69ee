"""Accuracy side of the eigvalsh claim: fastspec vs torch.linalg fp32 vs an fp64 reference.

The matrices are the solver tests' own families (:data:`fastspec.eig.matrices.FAMILIES`, built by
:func:`fastspec.eig.matrices.make_batch` with seed 0): for each family and size a batch of
``[b, n, n]`` symmetric matrices, random or built to be hard for a symmetric eigensolver, rounded
to fp32. The reference is ``torch.linalg.eigvalsh`` in float64 of the *same* fp32-rounded
matrices, so it is the exact spectrum of the input (up to ~1e-16). Error per matrix:
``max_i |λ_i − λ_i^fp64| / max_i |λ_i^fp64|`` (backward-stable solvers reach a few n·eps_fp32),
then the max over the batch. ``ratio`` = fastspec error / torch fp32 error; the library's claim,
"no worse than 2× torch.linalg fp32 vs fp64", is ``ratio ≤ 2`` up to an 8·eps floor
(:func:`within_bound`): the claim of the ``eigvalsh`` benchmark suite's fp32 cases too
(:func:`fastspec.bench.case.no_worse_than`).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..eig.matrices import FAMILIES, make_batch
from .case import max_rel_err, no_worse_than

CLAIM = no_worse_than("torch_fp32_error")
"""fastspec's error ≤ 2 × torch.linalg fp32's + 8·eps_fp32, both vs fp64 (:data:`~fastspec.bench.case.FLOOR_EPS`)."""


def within_bound(err: float, torch_err: float) -> bool:
    """Whether ``err`` holds :data:`CLAIM` against ``torch_err``."""
    return CLAIM.violated({"fastspec_error": err, "torch_fp32_error": torch_err}) is None


SIZES = {"quick": ([16, 48], 4), "cpu": ([64, 128, 256], 32), "gpu": ([64, 128, 256], 256)}


def _variants(device: torch.device) -> list[str]:
    import fastspec

    out = ["auto"]
    for name, info in fastspec.solvers().items():
        if name in ("auto", "torch") or not info.get("available"):
            continue
        if (name == "cuda") == (device.type == "cuda") or name not in ("cuda", "host"):
            out.append(name)
    return out


def compare(tier: str, device: torch.device, families: list[str] | None = None, *,
            deadline: float | None = None,
            on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One row per (family, n, fastspec variant): errors vs fp64 and their ratio.

    Time cap, as ``fastspec bench`` (:func:`fastspec.bench.runner.run_capped`): no new (family,
    n) starts after ``deadline`` (``time.monotonic()``) or SIGTERM, a
    :class:`~fastspec.bench.runner.TimeCap` raised during one ends the run, and the (family, n)
    not measured get rows with ``skipped`` naming the cap. ``on_rows(rows so far)`` after each
    (family, n), to write partial results.
    """
    from .runner import run_capped

    sizes, batch = SIZES[tier]
    for fam in families or ():
        if fam not in FAMILIES:
            raise ValueError(f"families: unknown family {fam!r}; expected some of {list(FAMILIES)}")
    todo = [(fam, n) for fam in families or list(FAMILIES) for n in sizes]
    return run_capped(todo, lambda item: _compare_one(*item, batch, device),
                      lambda item: {"family": item[0], "n": item[1], "batch": batch},
                      deadline=deadline, on_rows=on_rows)


def _compare_one(fam: str, n: int, batch: int, device: torch.device) -> list[dict]:
    """The rows of one (family, n): every fastspec variant against torch fp32, vs fp64."""
    import fastspec

    rows = []
    A = torch.from_numpy(make_batch(fam, n, batch)).to(torch.float32).to(device)
    ref = torch.linalg.eigvalsh(A.double())
    torch_err = max_rel_err(torch.linalg.eigvalsh(A), ref)
    for variant in _variants(device):
        head = {"family": fam, "n": n, "batch": batch, "variant": variant}
        try:
            err = max_rel_err(fastspec.eigvalsh(A, solver=variant), ref)
        except Exception as e:  # noqa: BLE001 - reported in the row, the CLI exits non-zero
            rows.append({**head, "error": f"{type(e).__name__}: {e}"})
            continue
        ok = within_bound(err, torch_err)
        rows.append({**head, "fastspec_error": err if math.isfinite(err) else None,
                     "torch_fp32_error": torch_err if math.isfinite(torch_err) else None,
                     "ratio": err / torch_err if torch_err > 0 and math.isfinite(err) else None,
                     "within_2x_torch": ok})
    return rows
