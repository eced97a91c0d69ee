"""Which code computes an exact covariance update on CUDA: the candidates and the route table.

An *exact* update (``policy.update_plan`` chose float64 products: the ``sv`` sites, e.g. keys,
under ``precision="auto"`` on a full-rate-float64 GPU, or ``precision="exact"``) of raw sums
(``track_mean=False``) adds, per site ``s`` of rows ``x: [B, T, S, D]``::

    n[s] += #valid rows      rejected[s] += #rows with a NaN/±Inf in site s (never merged)
    sum[s] += Σ_valid x      gram[s] += Σ_valid x xᵀ    (float64 products, float64 sums)

Every candidate computes exactly that (float64 products of 16/32-bit values are exact; only the
float64 summation order differs), bit for bit the same from run to run:

==============  ===================================================================  ===========
route           what one update runs                                                 launches
==============  ===================================================================  ===========
``dmma``        one CUDA kernel (``csrc/cov_gram.cu``, NVRTC at first use): rows      2 + merge
                widened to float64 in shared memory, the lower-triangular Gram of
                every head on the float64 tensor cores (DMMA), row sums and NaN/Inf
                flags in the same read; a fixed-order reduction of the row splits
``triton_f64``  the same in one Triton kernel (``tl.dot`` in float64); Triton >= 3.9   1 + merge
``prep_gemm``   one Triton kernel writes the float64 rows, their sums and flags; one   ~3 + merge
                batched cuBLAS float64 GEMM for all heads
``blocked``     the reference and fallback (``blocked.py``): rows converted block by   ~60 per layer
                block, masked and checked by torch ops, cuBLAS ``baddbmm``
==============  ===================================================================  ===========

Which one runs (:func:`choose`), first match wins:

1. ``$FASTSPEC_COV_VARIANT`` names a route (an unknown name is a ValueError, a route that cannot
   run here a RuntimeError saying why: forcing one is a request, not a hint);
2. CPU tensors: ``blocked`` (SciPy's ``syrk``, one triangle: the other routes are CUDA code);
3. the first row of the shipped table (:data:`TABLE`, written by the GPU kit's race,
   ``benchmarks/cov_race.py``) for this compute capability, input dtype, ``D`` and row count whose
   route can run here;
4. otherwise the first route of :data:`ROUTES` that can run here (``dmma``, ``triton_f64``,
   ``prep_gemm``, ``blocked``: the order a cost model predicts, until a race measures it).

``fastspec info`` prints the choice and why. The decision is cached per device, dtype, ``D`` and
row count, so an update pays a dict lookup for it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .reference import CovPartials

Accumulate = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, "Tensor | None", int], None]
"""``accumulate(n, rejected, sum, gram, x, mask, row_step)``: add an update to raw-sum totals in
place (``n``/``rejected`` ``[S]`` int64, ``sum [S, D]``, ``gram [S, D, D]`` float64, contiguous)."""

ENV = "FASTSPEC_COV_VARIANT"
"""Environment variable that forces a route by name."""

TABLE = Path(__file__).with_name("routes.json")
"""The route table: rows written by the GPU kit's race (``benchmarks/cov_race.py --merge``)."""


# --- the candidates ----------------------------------------------------------------------------


def _blocked_status(device: torch.device, dtype: torch.dtype, D: int) -> str:
    return ""


def _blocked_partials(x: Tensor, mask: Tensor | None, row_step: int) -> CovPartials:
    from . import blocked

    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    ws = blocked.Workspace() if capturing else blocked.shared_workspace()
    return CovPartials(*blocked.accumulate(x, mask, row_step, False, torch.float64, ws))


def _dmma_status(device: torch.device, dtype: torch.dtype, D: int) -> str:
    from . import gram_cuda

    return gram_cuda.status(device, D, dtype)


def _dmma_partials(x: Tensor, mask: Tensor | None, row_step: int) -> CovPartials:
    from . import gram_cuda

    return gram_cuda.partials_dmma(x, mask, row_step)


def _dmma_accumulate(n: Tensor, rejected: Tensor, sum_: Tensor, gram: Tensor, x: Tensor, mask: Tensor | None,
                     row_step: int) -> None:
    from . import gram_cuda

    gram_cuda.accumulate_dmma(n, rejected, sum_, gram, x, mask, row_step)


def _triton_status(name: str) -> Callable[[torch.device, torch.dtype, int], str]:
    def status(device: torch.device, dtype: torch.dtype, D: int) -> str:
        try:
            from . import triton_exact
        except ImportError as exc:  # no triton
            return f"Triton is not importable ({exc})"
        return getattr(triton_exact, f"{name}_status")(device)

    return status


def _triton_partials(name: str) -> Callable[[Tensor, Tensor | None, int], CovPartials]:
    def partials(x: Tensor, mask: Tensor | None, row_step: int) -> CovPartials:
        from . import triton_exact

        return getattr(triton_exact, f"partials_{name}")(x, mask, row_step)

    return partials


def _triton_accumulate(name: str) -> Accumulate:
    def accumulate(n: Tensor, rejected: Tensor, sum_: Tensor, gram: Tensor, x: Tensor, mask: Tensor | None,
                   row_step: int) -> None:
        from . import triton_exact

        getattr(triton_exact, f"accumulate_{name}")(n, rejected, sum_, gram, x, mask, row_step)

    return accumulate


@dataclass(frozen=True)
class Route:
    """One way to compute an exact raw-sum update: ``status(device, dtype, D)`` is "" where it
    can run rows of that dtype and width (else why not), ``partials(x, mask, row_step)`` returns
    the update's
    :class:`~fastspec.covariance.reference.CovPartials` (float64, about 0, ``G`` symmetric);
    ``accumulate`` (where the route has it) adds the update to the totals in place, bitwise what
    ``partials`` then :func:`~fastspec.covariance.ops.merge_sums` give, without the merge's
    launches: an update is then only the route's own kernels."""

    name: str
    what: str
    status: Callable[[torch.device, torch.dtype, int], str]
    partials: Callable[[Tensor, Tensor | None, int], CovPartials]
    accumulate: Accumulate | None = None


ROUTES: dict[str, Route] = {r.name: r for r in (
    Route("dmma", "CUDA kernel (NVRTC): one read, float64 tensor-core Gram, sums and flags fused",
          _dmma_status, _dmma_partials, _dmma_accumulate),
    Route("triton_f64", "Triton kernel: one read, float64 tl.dot Gram, sums and flags fused",
          _triton_status("triton_f64"), _triton_partials("triton_f64"), _triton_accumulate("triton_f64")),
    Route("prep_gemm", "Triton kernel writes float64 rows, sums and flags; one batched cuBLAS float64 GEMM",
          _triton_status("prep_gemm"), _triton_partials("prep_gemm"), _triton_accumulate("prep_gemm")),
    Route("blocked", "torch ops over row blocks, cuBLAS baddbmm (SciPy syrk on CPU): the reference",
          _blocked_status, _blocked_partials),
)}
"""Every route, in the order a cost model predicts them fastest (the fallback order)."""


# --- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One measured choice: on sm_``arch``, ``dtype`` input with ``D`` features per site and a row
    count (rows per site of one update) in ``[rows_lo, rows_hi]`` (None: no upper end) runs
    ``route``. ``measured`` says where and what each candidate took."""

    arch: int
    dtype: str
    D: int
    rows_lo: int
    rows_hi: int | None
    route: str
    measured: dict

    def matches(self, arch: int, dtype: str, D: int, rows: int) -> bool:
        return (self.arch == arch and self.dtype == dtype and self.D == D and self.rows_lo <= rows
                and (self.rows_hi is None or rows <= self.rows_hi))

    def describe(self) -> str:
        m = self.measured
        us = m.get("device_us") or {}
        times = ", ".join(f"{r} {t:.3g} µs" for r, t in sorted(us.items(), key=lambda kv: kv[1]))
        where = " ".join(str(v) for v in (m.get("device"), m.get("date"), m.get("shape")) if v)
        return f"measured{' on ' + where if where else ''}{': ' + times if times else ''}"

    def to_json(self) -> dict:
        return {"arch": self.arch, "dtype": self.dtype, "D": self.D, "rows": [self.rows_lo, self.rows_hi],
                "route": self.route, "measured": self.measured}

    @classmethod
    def from_json(cls, d: dict) -> Row:
        lo, hi = d["rows"]
        return cls(int(d["arch"]), str(d["dtype"]), int(d["D"]), int(lo), None if hi is None else int(hi),
                   str(d["route"]), dict(d.get("measured") or {}))


DTYPES = ("bfloat16", "float16", "float32", "float64")


def check_rows(rows: list[Row]) -> None:
    """ValueError naming the first row with an unknown route or dtype, or an empty row range."""
    for i, r in enumerate(rows):
        what = f"route table row {i} ({r.to_json()})"
        if r.route not in ROUTES:
            raise ValueError(f"{what}: route must be one of {sorted(ROUTES)}")
        if r.dtype not in DTYPES:
            raise ValueError(f"{what}: dtype must be one of {', '.join(DTYPES)}")
        if r.D < 1 or r.rows_lo < 0 or (r.rows_hi is not None and r.rows_hi < r.rows_lo):
            raise ValueError(f"{what}: D must be >= 1 and the row range non-empty")


_rows: list[list[Row]] = []


def load_table(path: Path | None = None) -> list[Row]:
    """The rows of ``path`` (default :data:`TABLE`, read once per process), checked."""
    if path is None and _rows:
        return _rows[0]
    data = json.loads((path or TABLE).read_text())
    rows = [Row.from_json(d) for d in data.get("rows", [])]
    check_rows(rows)
    if path is None:
        _rows.append(rows)
    return rows


# --- the choice --------------------------------------------------------------------------------


GPU_TYPES = ("cuda",)
"""Device types whose updates take the table and the CUDA routes (tests add the CPU, with the
kernels stood in)."""


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_chosen: dict[tuple, tuple[str, str]] = {}
_broken: dict[tuple[str, torch.device], str] = {}  # (route, device) -> why its kernel could not be built or loaded
_failed: dict[tuple, str] = {}  # (route, device, dtype, D) -> its self-check's failure


def status(name: str, device: torch.device, dtype: torch.dtype, D: int) -> str:
    """Why route ``name`` cannot run rows of ``dtype`` and width ``D`` on ``device`` ("" if it can):
    its own status, or the failure it had on this device in this process (a kernel that could
    not be built or loaded, or a configuration that failed its self-check)."""
    return (_broken.get((name, device)) or _failed.get((name, device, dtype, D))
            or ROUTES[name].status(device, dtype, D))


def mark_broken(name: str, why: str, device: torch.device) -> None:
    """Route ``name``'s kernel could not be built or loaded on ``device`` (a compile error, a
    driver that refuses it): no update on that device chooses it again in this process, and the
    choices made so far are made anew. Said once. (A shape past a kernel's limits is not a
    failure of the route: ``ops.exact_update`` falls back for that call only.)"""
    import logging

    _broken[name, device] = f"failed here: {why}"
    _chosen.clear()
    logging.getLogger("fastspec").warning("fastspec: the %s route of the exact covariance update failed on %s (%s); "
                                          "the next route takes its updates there", name, device, why)


def self_check(name: str, device: torch.device, dtype: torch.dtype, D: int) -> bool | None:
    """Route ``name``'s first-use self-check for ``dtype`` rows of width ``D`` on ``device``
    (:mod:`fastspec.selfcheck`): its ``partials`` and its ``accumulate`` on the adversarial rows
    against the float64 reference. True: it may serve; False: it failed (warned once; the
    configuration is then refused by :func:`status`); None: not checked now (a trace or a
    capture). ``blocked`` (the reference) and routes on devices that are not checked pass. A
    kernel that cannot be built raises (the caller marks the route broken on the device)."""
    from .. import selfcheck

    if name == "blocked" or not selfcheck.applies(device):
        return True
    route = ROUTES[name]

    def case() -> str:
        for x, mask in selfcheck.rows(D, dtype, device):
            why = selfcheck.compare_raw(route.partials(x, mask, 1), x, mask)
            if why:
                return f"partials: {why}"
            if route.accumulate is not None:
                S = x.shape[2]
                f64 = {"dtype": torch.float64, "device": device}
                n, rejected = (torch.zeros(S, dtype=torch.int64, device=device) for _ in range(2))
                sum_, gram = torch.zeros(S, D, **f64), torch.zeros(S, D, D, **f64)
                route.accumulate(n, rejected, sum_, gram, x, mask, 1)
                why = selfcheck.compare_raw(CovPartials(n, torch.zeros_like(sum_), sum_, gram, rejected), x, mask)
                if why:
                    return f"accumulate: {why}"
        return ""

    ok = selfcheck.run(("exact", name, device, dtype, D), f"the exact covariance route {name}",
                       f"{_dtype_name(dtype)} D={D}", device, case, "the next route")
    if ok is False:
        _failed[name, device, dtype, D] = "failed its self-check here (a wrong answer: see the warning)"
        _chosen.clear()
    return ok


def choose(x: Tensor, rows: int | None = None, skip: frozenset[str] = frozenset()) -> tuple[str, str]:
    """``(route, why)`` for an exact raw-sum update of ``x: [B, T, S, D]`` (``rows`` per site;
    default ``B·T``) on its device (module docstring), other than those in ``skip`` (a route that
    cannot take this call's shape: ``ops.exact_update``). The route chosen has passed its
    first-use self-check (:func:`self_check`); one that fails it, or whose kernel cannot be
    built, gives way to the next. Cached per device, dtype, D, rows, ``skip`` and
    ``$FASTSPEC_COV_VARIANT`` (not while its check could not run: a trace or a capture)."""
    rows = x.shape[0] * x.shape[1] if rows is None else rows
    forced = os.environ.get(ENV, "").strip()
    key = (x.device, x.dtype, x.shape[-1], rows, forced, skip)
    got = _chosen.get(key)
    if got is not None:
        return got
    from .. import selfcheck

    while True:
        got = _choose(x.device, x.dtype, x.shape[-1], rows, forced, skip)
        try:
            verdict = self_check(got[0], x.device, x.dtype, x.shape[-1])
        except Exception as exc:
            if forced or not selfcheck.is_build_failure(exc):
                raise
            mark_broken(got[0], str(exc), x.device)
            continue
        if verdict is False and forced:
            raise RuntimeError(f"{ENV}={forced}: the route failed its self-check here "
                               f"({_failed[forced, x.device, x.dtype, x.shape[-1]]})")
        if verdict is not False:
            break
    if verdict:
        _chosen[key] = got
    return got


def _choose(device: torch.device, dtype: torch.dtype, D: int, rows: int, forced: str,
            skip: frozenset[str] = frozenset()) -> tuple[str, str]:
    if forced:
        if forced not in ROUTES:
            raise ValueError(f"{ENV}: expected one of {', '.join(ROUTES)}, got {forced!r}")
        why = status(forced, device, dtype, D)
        if why:
            raise RuntimeError(f"{ENV}={forced} cannot run here: {why}")
        return forced, f"forced by {ENV}={forced}"
    if device.type not in GPU_TYPES:
        return "blocked", "CPU tensors: SciPy's float64 syrk (the other routes are CUDA code)"
    arch, dt = _arch(device), _dtype_name(dtype)
    skipped = []
    for r in load_table():
        if r.matches(arch, dt, D, rows) and r.route not in skip:
            why = status(r.route, device, dtype, D)
            if not why:
                return r.route, r.describe()
            skipped.append(f"the table's {r.route} ({why})")
    for name in ROUTES:
        why = "this call's shape is past its kernel's limits" if name in skip else status(name, device, dtype, D)
        if not why:
            head = f"no measured row for sm_{arch} {dt} D={D} with {rows} rows: the predicted order"
            return name, "; ".join([head, *(f"not {s}" for s in skipped)])
        skipped.append(f"{name} ({why})")
    raise AssertionError("unreachable: blocked runs everywhere")


def forget() -> None:
    """Drop the cached choices, table, failures and the dmma kernel's remembered statuses (tests;
    a new table or environment)."""
    import sys

    _chosen.clear()
    _rows.clear()
    _broken.clear()
    _failed.clear()
    gram_cuda = sys.modules.get(f"{__package__}.gram_cuda")  # only if imported: it loads the driver binding
    if gram_cuda is not None:
        gram_cuda._statuses.clear()


# --- the update --------------------------------------------------------------------------------


def partials(name: str, x: Tensor, mask: Tensor | None = None, row_step: int = 1) -> CovPartials:
    """The partials of route ``name`` (the race and the tests call each by name)."""
    if name not in ROUTES:
        raise ValueError(f"route: expected one of {', '.join(ROUTES)}, got {name!r}")
    return ROUTES[name].partials(x, mask, row_step)


def info(device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16, D: int = 128,
         rows: int = 16384) -> dict[str, object]:
    """What ``fastspec info`` prints: every route's availability on ``device`` (the current CUDA
    device, else the CPU), and the route chosen for the bench's keys shape and why."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out: dict[str, object] = {"device": str(device), "table": str(TABLE), "override": os.environ.get(ENV) or None,
                              "shape": f"{_dtype_name(dtype)} D={D}, {rows} rows per site"}
    try:
        out["routes"] = {n: status(n, device, dtype, D) or "available" for n in ROUTES}
        out["rows"] = len(load_table())
        out["choice"], out["why"] = _choose(device, dtype, D, rows, os.environ.get(ENV, "").strip())
    except Exception as exc:  # a bad FASTSPEC_COV_VARIANT or table, a broken CUDA setup: said, not raised
        out.setdefault("routes", {})
        out["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, RuntimeError)) else str(exc)
    return out
