"""The eigensolver kernel's algorithms (``csrc/eig_algos.h``) and which one runs where.

Every algorithm is a compile-time variant of the same kernel entry (``FS_ALGO``), with its own
team size and shared-memory layout, written here once for the launcher (:mod:`.cuda`) and checked
against the C++ formulas by ``tests/test_eig_variants.py``:

* ``block``: today's kernel (``eig_core.h``): the matrix in shared memory, rows padded to n + 1,
  one thread per column; every n up to ``limits.MAX_N`` (a global workspace past what shared
  memory holds). The default wherever nothing was measured.
* ``packed``: the lower triangle only, in shared memory (``eig_packed.h``): half the bytes, so
  float32 n = 256 fits an SM and n = 128 leaves room for twice the resident blocks.
* ``regs``: float32 n <= 128 with the matrix in registers, two threads per column (``eig_regs.h``):
  no shared-memory load or store of a matrix element in the update.
* ``split``: two threads per column of the block layout and two bisection points per eigenvalue
  (``eig_split.h``): for small batches (one wave, e.g. the probe's float64 keys solve), where
  the latency of one matrix, not the throughput of many, sets the time.
* ``newton``: packed's tridiagonalization, then a faster eigenvalue stage (``eig_newton.h``): team-wide
  isolation rounds and a safeguarded Newton iteration on det(T - xI) per eigenvalue, a few Sturm
  sweeps each instead of bisection's ~18 (float32) / ~47 (float64), every bracket end still
  certified by a count.

Which algorithm runs is :func:`choose`'s answer, from the table ``selection.json`` beside this
file (rows keyed by GPU arch, dtype, n range and batch range, each written by a measurement: the
race step of the GPU kit, ``benchmarks/eig_race.py``); ``block`` where no row matches;
``FASTSPEC_EIG_VARIANT=<name>`` forces one wherever it applies.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .limits import GRID, MAX_N, MAX_THREADS

log = logging.getLogger("fastspec")


def _round_up4(x: int) -> int:
    return (x + 3) & ~3


def _round_up32(x: int) -> int:
    return (x + 31) // 32 * 32


def block_work_elems(n: int, matrix_here: bool) -> int:
    """Reals of one block's work arrays of the block algorithm: eig_core.h's ``block_work_elems``
    ``[matrix n x (n + 1)] [d, e, v, w, v2] [p2]``."""
    n4 = _round_up4(n)
    return (_round_up4(n * (n + 1)) if matrix_here else 0) + 5 * n4 + max(n4, GRID)


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of the kernel: its id (``FS_ALGO``), what it takes, its team and its memory."""

    name: str
    id: int
    dtypes: tuple[str, ...]
    max_n: int
    # n -> reals of shared work memory, the reduction scratch after it: eig_algos.h's algo_smem_elems
    smem_elems: Callable[[int], int] = field(compare=False)
    per_column: int = 1  # team members per matrix column (eig_algos.h's algo_threads)
    registers32: int = 128  # float32's per-thread register floor of the launch bounds (float64: 128 always)

    def registers(self, dtype: str) -> int:
        """The fewest registers per thread the launch bounds may leave this algorithm
        (:func:`.cuda.variant_for`): below 128 NVRTC spills the block algorithm at some sizes, and
        float64 (register pairs) everywhere."""
        return self.registers32 if dtype == "float32" else 128

    def threads(self, n: int) -> int:
        """The team (CUDA block) size for ``n x n`` matrices: eig_algos.h's ``algo_threads``."""
        if self.per_column == 1:  # one member per column, striding over columns past the largest block
            return min(_round_up32(n), MAX_THREADS)
        return self.per_column * _round_up32(n)  # within max_n, never past MAX_THREADS

    def takes(self, n: int, dtype: str) -> bool:
        return dtype in self.dtypes and 1 <= n <= self.max_n


def packed_matrix_elems(n: int) -> int:
    """Reals of eig_packed.h's triangle (``packed_detail::matrix_elems``): panels of 32 columns,
    column c of panel w holding rows [32w, n) at a stride of ``((n + 3) & ~7) + 4 - 32w`` (= 4 mod 8),
    the last panel only its ``n - 32(P - 1)`` columns."""
    s0 = ((n + 3) & ~7) + 4
    last = (n + 31) // 32 - 1
    base = 32 * last * s0 - 512 * last * (last - 1)
    return base + (n - 32 * last) * (s0 - 32 * last)


def packed_smem_elems(n: int) -> int:
    """Reals of eig_packed.h's shared memory (``packed_smem_elems``): the triangle (its dead space
    later holds the bisection's v, w, v2, p2), then four vectors u, u2, w, p (d and e at the end)."""
    n4 = _round_up4(n)
    return max(packed_matrix_elems(n), 3 * n4 + max(n4, GRID)) + 4 * n4


def regs_smem_elems(n: int) -> int:
    """Reals of eig_regs.h's shared memory (``regs_smem_elems``): d and e, then one region that
    holds six vectors of ``round_up(n, 16)`` during the tridiagonalization and the eigenvalue
    stage's vectors (the (e^2, d) pairs of ``2 n4``, the eigenvalues of ``n4``, the grid counts of
    ``max(n4, GRID)``) after it."""
    n4, length = _round_up4(n), (n + 15) // 16 * 16
    return 2 * n4 + max(6 * length, 3 * n4 + max(n4, GRID))


def split_smem_elems(n: int) -> int:
    """Reals of eig_split.h's shared memory (``split_smem_elems``): the block layout, then 6 x
    round_up(n, 32) reals (the second half's partial p; the bisection's grid and sweep counts)."""
    return block_work_elems(n, True) + 6 * _round_up32(n)


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("block", 0, ("float32", "float64"), MAX_N, lambda n: block_work_elems(n, True)),
    # packed: 80 registers from NVRTC 13 at n = 128, so its fifth block per SM is asked for (<= 102)
    Algorithm("packed", 1, ("float32", "float64"), 256, packed_smem_elems, registers32=96),
    Algorithm("regs", 2, ("float32",), 128, regs_smem_elems, per_column=2),
    Algorithm("split", 3, ("float32", "float64"), 128, split_smem_elems, per_column=2),
    # newton: packed's layout, team and memory; its own eigenvalue stage
    Algorithm("newton", 4, ("float32", "float64"), 256, packed_smem_elems, registers32=96),
)}
"""Every algorithm, by name; ids are eig_algos.h's ``Algo`` (tests check them equal)."""

EXTERNAL: dict[str, tuple[str, ...]] = {"cusolverdx": ("float32", "float64")}
"""Algorithms built from vendor code rather than this kernel's sources, by name, with the dtypes
they take: ``cusolverdx`` is NVIDIA cuSolverDx's ``heev`` in a wrapper with this kernel's launch
contract (:mod:`.mathdx`; the ``fastspec[mathdx]`` extra). The race times them beside
:data:`ALGORITHMS` and the table may pick them; where one cannot be built (the extra absent) or its
shared memory does not fit, the launcher takes the next choice."""


def known(name: str) -> bool:
    """Whether ``name`` is an algorithm of :data:`ALGORITHMS` or :data:`EXTERNAL`."""
    return name in ALGORITHMS or name in EXTERNAL


def takes(name: str, n: int, dtype: str) -> bool:
    """Whether algorithm ``name`` takes ``n x n`` ``dtype`` matrices (shared memory aside)."""
    if name in EXTERNAL:
        return dtype in EXTERNAL[name] and 1 <= n <= MAX_N
    return ALGORITHMS[name].takes(n, dtype)


def names() -> list[str]:
    """Every algorithm's name: :data:`ALGORITHMS`, then :data:`EXTERNAL`."""
    return [*ALGORITHMS, *EXTERNAL]


# --- which algorithm runs where ------------------------------------------------------------------

ENV = "FASTSPEC_EIG_VARIANT"
"""Environment variable that forces an algorithm by name wherever it applies."""

DEFAULT = "block"
"""The algorithm wherever the table has no measurement: the kernel first measured on a GPU."""

TABLE = Path(__file__).with_name("selection.json")
"""The selection table: rows written by the GPU kit's race (``benchmarks/eig_race.py``)."""


@dataclass(frozen=True)
class Row:
    """One measured choice: on sm_``arch``, ``dtype`` matrices with ``n`` in ``[n_lo, n_hi]`` and a
    batch in ``[batch_lo, batch_hi]`` (``batch_hi`` None: no upper end) run ``algo``."""

    arch: int
    dtype: str
    n_lo: int
    n_hi: int
    batch_lo: int
    batch_hi: int | None
    algo: str
    measured: dict = field(default_factory=dict, compare=False)  # device, date, times per algorithm

    def matches(self, arch: int, dtype: str, n: int, batch: int) -> bool:
        return (self.arch == arch and self.dtype == dtype and self.n_lo <= n <= self.n_hi
                and self.batch_lo <= batch and (self.batch_hi is None or batch <= self.batch_hi))

    def describe(self) -> str:
        m = self.measured
        ms = m.get("ms") or {}
        times = ", ".join(f"{a} {t:.3g} ms" for a, t in sorted(ms.items(), key=lambda kv: kv[1]))
        where = " ".join(str(x) for x in (m.get("device"), m.get("date"), m.get("shape")) if x)
        return f"measured{' on ' + where if where else ''}{': ' + times if times else ''}"

    def to_json(self) -> dict:
        return {"arch": self.arch, "dtype": self.dtype, "n": [self.n_lo, self.n_hi],
                "batch": [self.batch_lo, self.batch_hi], "algo": self.algo, "measured": self.measured}

    @classmethod
    def from_json(cls, d: dict) -> Row:
        (n_lo, n_hi), (b_lo, b_hi) = d["n"], d["batch"]
        return cls(int(d["arch"]), str(d["dtype"]), int(n_lo), int(n_hi), int(b_lo),
                   None if b_hi is None else int(b_hi), str(d["algo"]), dict(d.get("measured") or {}))


def check_rows(rows: list[Row]) -> None:
    """ValueError naming the first row that names an unknown algorithm or dtype, or an empty range."""
    for i, r in enumerate(rows):
        what = f"selection row {i} ({r.to_json()})"
        if not known(r.algo):
            raise ValueError(f"{what}: algo must be one of {sorted(names())}")
        if r.dtype not in ("float32", "float64"):
            raise ValueError(f"{what}: dtype must be float32 or float64")
        if not (1 <= r.n_lo <= r.n_hi) or r.batch_lo < 1 or (r.batch_hi is not None and r.batch_hi < r.batch_lo):
            raise ValueError(f"{what}: empty n or batch range")


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


@dataclass(frozen=True)
class Choice:
    """An algorithm for one problem, and why."""

    algo: str
    why: str
    forced: bool = False


def choose(arch: int, dtype: str, n: int, batch: int, rows: list[Row] | None = None) -> list[Choice]:
    """The algorithms to try for ``batch`` matrices ``n x n`` of ``dtype`` on sm_``arch``, best
    first, each with its reason; the last is always :data:`DEFAULT`. ``$FASTSPEC_EIG_VARIANT``
    first where it names an algorithm that takes the problem; then the first table row that
    matches; then the default. (Whether shared memory fits is the launcher's check: it takes the
    first choice that fits.) ValueError when the variable names no algorithm."""
    out: list[Choice] = []
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if not known(forced):
            raise ValueError(f"{ENV}: expected one of {sorted(names())}, got {forced!r}")
        if takes(forced, n, dtype):
            out.append(Choice(forced, f"forced by {ENV}={forced}", True))
        else:
            a = ALGORITHMS.get(forced)
            dtypes, max_n = (a.dtypes, a.max_n) if a is not None else (EXTERNAL[forced], MAX_N)
            say_once(f"{ENV}={forced} does not apply to {dtype} n = {n} (it takes {'/'.join(dtypes)}, "
                      f"n <= {max_n}); using the selection table there")
    row = next((r for r in (load_table() if rows is None else rows)
                if r.matches(arch, dtype, n, batch) and takes(r.algo, n, dtype)), None)
    if row is not None:
        out.append(Choice(row.algo, row.describe()))
    out.append(Choice(DEFAULT, "default" if row is not None else
                      f"default: no measurement for sm_{arch} {dtype} n = {n}, batch {batch}"))
    return out


_said: set[str] = set()


def say_once(text: str) -> None:
    """One warning on the ``fastspec`` logger per distinct text."""
    if text not in _said:
        _said.add(text)
        log.warning("fastspec.eigvalsh: %s", text)
