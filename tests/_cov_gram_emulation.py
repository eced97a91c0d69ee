"""A numpy model of the DMMA Gram kernel (``csrc/cov_gram.cu``), for tests without a GPU.

It reproduces the kernel's work, not just its result: the row split of
:func:`fastspec.covariance.gram_cuda.plan`, the staging of ``FS_COV_ROWS``-row tiles (row ``r``
of a tile by warp ``r // (ROWS / 8)``), the validity rule (masked rows zeroed and not counted,
rows with a NaN/±Inf zeroed and counted as rejected), the warp roles (``FS_COV_ROLES``) that
cut the lower triangle into 8x8 tiles, the DMMA fragments lane by lane, the epilogue's packed
lower triangle, the order of every float64 sum, and the reduction over splits with its mirror.

Two sides of each ``mma.m8n8k4 .f64`` are kept apart on purpose:

* the instruction, as the PTX ISA defines it (:data:`PTX_A`, :data:`PTX_B`, :data:`PTX_C`):
  lane ``l`` holds ``A[l >> 2][l & 3]``, ``B[l & 3][l >> 2]`` and ``C[l >> 2][2 (l & 3) + v]``;
  ``D = C + A B``, modelled as four sequential float64 adds in k order (a product of two
  16/32-bit values is exact in float64, so this is fma-exact; whether the tensor core rounds
  once per k or once per instruction is not documented, which is why results are compared
  with tolerances, not bits, except on integer data where every order is exact);
* the kernel's use of it, read from the kernel's source (:func:`kernel_constants`): which element
  each lane loads (``FS_COV_FRAG_K``, ``FS_COV_FRAG_MN``) and where it stores its accumulators
  (``FS_COV_ACC_M``, ``FS_COV_ACC_N``), and the roles.

A kernel whose lanes load or store the wrong element therefore gives a wrong Gram here too.
What the model cannot see (the kernel's own address arithmetic, operand order, accumulator slots,
row carries) the host twin runs: ``csrc/cov_gram_host.cpp``, the kernel's code on a software GPU;
``tests/test_cov_gram_cuda.py`` checks the two against each other bit for bit.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastspec.covariance import gram_cuda
from fastspec.eig import nvrtc

SOURCE = Path(nvrtc.csrc_dir()) / gram_cuda.PROGRAM.source

LANES = np.arange(32)
# the PTX ISA's fragment layout of mma.m8n8k4 with .f64 (9.7.14.5.2): (row, column) per lane
PTX_A = (LANES >> 2, LANES & 3)                                   # A: 8 x 4
PTX_B = (LANES & 3, LANES >> 2)                                   # B: 4 x 8
PTX_C = tuple((LANES >> 2, 2 * (LANES & 3) + v) for v in (0, 1))  # C, D: 8 x 8, two per lane


@dataclass(frozen=True)
class KernelConstants:
    """What the model takes from the kernel's source text."""

    roles: tuple[tuple[int, int, int, int], ...]  # FS_COV_ROLES: {a, b, g, o} per warp
    frag_k: Callable[[np.ndarray], np.ndarray]     # lane -> row of the 4-row step it loads
    frag_mn: Callable[[np.ndarray], np.ndarray]    # lane -> column within the 8-column group
    acc_m: Callable[[np.ndarray], np.ndarray]      # lane -> row of its accumulators
    acc_n: Callable[[np.ndarray, int], np.ndarray]  # (lane, v) -> column of accumulator v
    defaults: dict[str, int]                       # the other FS_COV_* macros' default values


def kernel_constants(text: str | None = None) -> KernelConstants:
    """Parse ``cov_gram.cu`` (or ``text``): its roles table, its fragment macros (valid Python
    expressions too: ``&``, ``>>``, ``*``, ``+`` on non-negative ints) and its macro defaults."""
    text = (SOURCE.read_text() if text is None else text).replace("\\\n", " ")
    macros: dict[str, tuple[str | None, str]] = {}
    for m in re.finditer(r"^\s*#define\s+(FS_COV_\w+)(\(([^)]*)\))?[ \t]+(.+)$", text, re.MULTILINE):
        macros.setdefault(m.group(1), (m.group(3), m.group(4).strip()))

    def function(name: str):
        params, body = macros[name]
        return eval(f"lambda {params}: {body}")  # our own source's macro

    roles = eval("(" + macros["FS_COV_ROLES"][1].replace("{", "(").replace("}", ")") + ",)")
    defaults = {n: int(b) for n, (p, b) in macros.items() if p is None and re.fullmatch(r"-?\d+", b)}
    return KernelConstants(tuple(tuple(r) for r in roles), function("FS_COV_FRAG_K"), function("FS_COV_FRAG_MN"),
                           function("FS_COV_ACC_M"), function("FS_COV_ACC_N"), defaults)


def warp_tiles(roles, D: int) -> list[list[tuple[int, int]]]:
    """The 8x8 tiles ``(I, J)`` (tile row, tile column; ``J <= I``) each warp computes, by the
    kernel's rule (the header's "Warp roles"): an off-diagonal block ``a > b`` plus, for D >= 64,
    the diagonal tile ``kB g + kB - o``; a diagonal pair ``a < b`` less the last diagonal tile of
    block a and the last two of block b."""
    kB = D // 32
    share = kB >= 2
    out = []
    for a, b, g, o in roles:
        tiles = []
        if a > b:
            tiles += [(kB * a + i, kB * b + j) for i in range(kB) for j in range(kB)]
            if share:
                tiles.append((kB * g + kB - o, kB * g + kB - o))
        else:
            for blk, skip in ((a, {kB - 1} if share else set()), (b, {kB - 2, kB - 1} if share else set())):
                tiles += [(kB * blk + i, kB * blk + j) for i in range(kB) for j in range(i + 1)
                          if not (i == j and i in skip)]
        out.append(tiles)
    return out


@dataclass(frozen=True)
class Launch:
    """One launch as the kernel sees it: the plan's split, and the kernel's compile-time
    constants (tile rows, warps)."""

    D: int
    rows: int            # FS_COV_ROWS
    warps: int           # FS_COV_THREADS / 32
    split: int
    rows_per_split: int


def launch_for(N: int, S: int, D: int, dtype, sms: int) -> Launch:
    """The launch the launcher makes (:func:`gram_cuda.plan`), with the kernel's macros as
    :func:`gram_cuda.defines` sets them."""
    p = gram_cuda.plan(N, S, D, dtype, sms)
    macros = dict(d[2:].split("=") for d in gram_cuda.defines(D, dtype))
    assert int(macros["FS_COV_ROWS"]) == p.rows and int(macros["FS_COV_THREADS"]) == p.threads
    return Launch(D, p.rows, p.threads // 32, p.split, p.rows_per_split)


def rows_of(x: torch.Tensor, mask: torch.Tensor | None, row_step: int) -> tuple[np.ndarray, np.ndarray]:
    """``x: [B, T, S, D]`` -> (values ``[N, S, D]`` float64, widened exactly, NaN/Inf kept;
    keep ``[N]`` bool), rows ``r = b * Tk + t / row_step`` as the kernel numbers them."""
    xk = x[:, ::row_step]
    B, Tk, S, D = xk.shape
    vals = xk.to(torch.float64).reshape(B * Tk, S, D).cpu().numpy()
    keep = (np.ones(B * Tk, dtype=bool) if mask is None
            else mask[:, ::row_step].reshape(B * Tk).to(torch.bool).cpu().numpy())
    return vals, keep


def gram_kernel(vals: np.ndarray, keep: np.ndarray, launch: Launch, k: KernelConstants
                ) -> tuple[np.ndarray, np.ndarray]:
    """``fastspec_cov_gram`` on rows ``vals [N, S, D]``: (partials ``[split, S, D(D+1)/2 + D]``,
    counts ``[split, S, 2]`` int64 (valid, rejected))."""
    N, S, D = vals.shape
    L = launch
    assert L.rows % L.warps == 0 and L.rows_per_split % L.rows == 0 and L.split * L.rows_per_split >= N
    total = L.split * L.rows_per_split
    finite = np.isfinite(vals).all(-1)                                    # [N, S]
    valid = keep[:, None] & finite
    rejected = keep[:, None] & ~finite
    X = np.zeros((total, S, D))
    X[:N] = np.where(valid[..., None], np.nan_to_num(vals), 0.0)          # staged rows, invalid zeroed
    X = X.reshape(L.split, L.rows_per_split, S, D).transpose(0, 2, 1, 3)  # [split, S, rows, D]
    counts = np.zeros((L.split, S, 2), dtype=np.int64)
    pad = np.zeros((total - N, S), dtype=bool)
    counts[..., 0] = np.concatenate([valid, pad]).reshape(L.split, L.rows_per_split, S).sum(1)
    counts[..., 1] = np.concatenate([rejected, pad]).reshape(L.split, L.rows_per_split, S).sum(1)

    # the tiles of every warp, each exactly once
    tiles = [t for w in warp_tiles(k.roles, D) for t in w]
    nt = D // 8
    assert sorted(tiles) == sorted((i, j) for i in range(nt) for j in range(i + 1)), "roles do not cover G once"
    I = np.array([t[0] for t in tiles])
    J = np.array([t[1] for t in tiles])
    fk, fmn = k.frag_k(LANES), k.frag_mn(LANES)
    col_a = 8 * I[:, None] + fmn[None, :]                                 # [U, 32]
    col_b = 8 * J[:, None] + fmn[None, :]
    U = len(tiles)
    C = np.zeros((L.split, S, U, 8, 8))
    A = np.zeros((L.split, S, U, 8, 4))
    Bm = np.zeros((L.split, S, U, 4, 8))
    for step in range(L.rows_per_split // 4):
        Xs = X[:, :, 4 * step:4 * step + 4, :]                           # [split, S, 4, D]
        A[..., PTX_A[0], PTX_A[1]] = Xs[:, :, fk, col_a]                 # lane l's element, where PTX puts it
        Bm[..., PTX_B[0], PTX_B[1]] = Xs[:, :, fk, col_b]
        for kk in range(4):
            C += A[..., :, kk, None] * Bm[..., None, kk, :]

    # epilogue: lane l's accumulator v goes to (8I + ACC_M(l), 8J + ACC_N(l, v)) when on or below the diagonal
    P = D * (D + 1) // 2
    part = np.zeros((L.split, S, P + D))
    written = np.zeros(P, dtype=np.int64)
    for v in (0, 1):
        lane_val = C[..., PTX_C[v][0], PTX_C[v][1]]                       # [split, S, U, 32]
        r = 8 * I[:, None] + k.acc_m(LANES)[None, :]
        c = 8 * J[:, None] + k.acc_n(LANES, v)[None, :]
        low = r >= c
        idx = (r * (r + 1) // 2 + c)[low]
        part[..., idx] = lane_val[..., low]
        np.add.at(written, idx, 1)
    assert (written == 1).all(), "the epilogue does not write each lower element once"

    # row sums: each warp over its rows in tile order, then the warps in order
    rpw = L.rows // L.warps
    Xw = X.reshape(L.split, S, L.rows_per_split // L.rows, L.warps, rpw, D)
    warp_sums = np.zeros((L.split, S, L.warps, D))
    for t in range(Xw.shape[2]):
        for q in range(rpw):
            warp_sums += Xw[:, :, t, :, q, :]
    sums = warp_sums[:, :, 0]
    for w in range(1, L.warps):
        sums = sums + warp_sums[:, :, w]
    part[..., P:] = sums
    return part, counts


def reduce_kernel(part: np.ndarray, counts: np.ndarray, D: int, into=None):
    """``fastspec_cov_gram_reduce``: (G ``[S, D, D]``, s ``[S, D]``, c ``[S, D]`` zeros, n, rejected),
    the splits summed in order from 0.0, G mirrored from its packed lower triangle. ``into``:
    the accumulate mode, ``(G, s, n, rejected)`` totals the update is added to (G's lower
    triangle read, both mirrors written), returned with ``c`` None (not written)."""
    total = np.zeros(part.shape[1:])
    for k in range(part.shape[0]):
        total = total + part[k]
    P = D * (D + 1) // 2
    r, c = np.tril_indices(D)  # row by row: packed index r (r + 1) / 2 + c
    S = part.shape[1]
    cnt = counts.sum(0)
    if into is not None:
        G0, s0, n0, rej0 = into
        low = G0[:, r, c] + total[:, :P]
        G = G0.copy()
        G[:, r, c] = low
        G[:, c, r] = low
        return G, s0 + total[:, P:], None, n0 + cnt[:, 0], rej0 + cnt[:, 1]
    G = np.zeros((S, D, D))
    G[:, r, c] = total[:, :P]
    G[:, c, r] = total[:, :P]
    return G, total[:, P:], np.zeros((S, D)), cnt[:, 0], cnt[:, 1]


def emulate(x: torch.Tensor, mask: torch.Tensor | None = None, row_step: int = 1, sms: int = 132,
            k: KernelConstants | None = None):
    """The kernel pair on ``x: [B, T, S, D]`` as launched on a GPU of ``sms`` SMs: (G, s, c, n,
    rejected) as numpy arrays."""
    k = kernel_constants() if k is None else k
    vals, keep = rows_of(x, mask, row_step)
    N, S, D = vals.shape
    part, counts = gram_kernel(vals, keep, launch_for(N, S, D, x.dtype, sms), k)
    return reduce_kernel(part, counts, D)
