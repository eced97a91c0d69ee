"""The "packed" algorithm of the CUDA eigensolver (``csrc/eig_packed.h``, FS_ALGO 1):
the lower triangle only, in shared memory, so float32 n = 256 fits one block and n = 128 takes
~45 KB (5 blocks per H100 SM instead of the block algorithm's 3).

Two halves, both without a GPU:

* the team emulation (``csrc/eig_host.cpp``: the algorithm by round_up(n, 32) ranks with the
  kernel's barriers, reduction order and shared-memory layout, poisoned with NaN before the first
  matrix) against LAPACK: the families of :mod:`fastspec.eig.matrices` at several n (tiny, not a
  multiple of 32, the largest), in the free-running and a serial schedule; and the
  barrier-mutation check (every FS_SYNC the algorithm passes is needed, except those annotated
  ``// unseen:``). The contract every algorithm shares (non-finite input sparing its neighbours,
  zeros, exact 2^k scaling, the strict upper triangle never read, a batch solved in turn by one
  team, no race) is tests/test_eig_algorithms.py's.
* the kernel compiled for sm_90 by NVRTC through the launcher's plan, read by ``cuobjdump``:
  no spills, no generic loads/stores, registers within the launch bounds (and within 5 blocks per
  SM at n = 128), and the hot loops' instruction counts of the cost model in the header.

Accuracy criteria: ``tests/_eig_team.py`` (fp32: within 2 x torch's error + 8 eps ||A||; fp64:
n eps ||A|| of LAPACK).
"""
from __future__ import annotations

import _eig_team
import pytest
import torch
from _eig_team import (
    CONCURRENT,
    FORWARD,
    REVERSE,
    assert_barriers_needed,
    assert_fp64_close,
    assert_within_torch_error,
    battery_cases,
    one_torch_thread,  # noqa: F401 - an autouse fixture: one torch thread
    team,
)

from fastspec.eig import variants
from fastspec.eig.matrices import make_batch

pytestmark = _eig_team.NO_EXT

ALGO = "packed"


def packed(A: torch.Tensor, schedule: int = CONCURRENT) -> torch.Tensor:
    return team(A, ALGO, schedule)[0]


def test_python_formulas_match_the_header():
    from fastspec.eig import _host

    a = variants.ALGORITHMS[ALGO]
    assert a.max_n == _host.algo_max_n(a.id) == 256
    for n in range(1, 257):
        assert a.threads(n) == _host.algo_threads(a.id, n)
        assert a.smem_elems(n) == _host.algo_smem_elems(a.id, n)
    # the point of the layout: fp32 n = 256 fits an H100 block, n = 128 is ~45 KB
    assert 4 * (a.smem_elems(256) + 64) <= 227 * 1024
    assert 4 * (a.smem_elems(128) + 64) == 45312


def _battery() -> list:
    """Every family at every n, one serial order besides the free-running one. The fast tier leaves
    out n = 128 and 256 (~0.07 s and ~0.25 s a case of two matrices on 2 cores) and n = 100 for all but two families;
    test_fp32_n256 keeps the largest size in it."""
    return battery_cases([1, 2, 3, 5, 17, 33, 70, 100, 128, 256],
                         lambda family, n: n >= 128 or (n == 100 and family not in ("indefinite", "wilkinson")))


@pytest.mark.parametrize("family, n", _battery())
def test_fp32_battery(family, n):
    A = torch.from_numpy(make_batch(family, n, 2)).float()
    for schedule in (CONCURRENT, REVERSE if n % 2 else FORWARD):
        ours = packed(A, schedule)
        assert ours.shape == (2, n) and ours.dtype == torch.float32
        assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all(), "not finite / not ascending"
        assert_within_torch_error(A, ours)


def test_fp32_n256():
    # the size the algorithm exists for (the block layout does not fit an H100 block): 8 warps
    A = torch.from_numpy(make_batch("gram-activations", 256, 1)).float()
    assert_within_torch_error(A, packed(A))


def test_fp32_n128():
    A = torch.from_numpy(make_batch("indefinite", 128, 1)).float()
    assert_within_torch_error(A, packed(A, FORWARD))


@pytest.mark.slow
def test_fp32_more_seeds_at_n128():
    # the aimed-for size: a larger batch, so the torch error is not a lucky small-sample minimum
    for family in ("graded-1e-8", "four-clusters"):
        A = torch.from_numpy(make_batch(family, 128, 4, seed=1)).float()
        assert_within_torch_error(A, packed(A))


@pytest.mark.parametrize("n, family", [
    (5, "indefinite"), (40, "indefinite"), (40, "spd-1e30"), (100, "graded-1e-8"),
    pytest.param(160, "gram-activations", marks=pytest.mark.slow),
    pytest.param(220, "indefinite", marks=pytest.mark.slow),  # about the largest fp64 n of an H100 block
])
def test_fp64(n, family):
    A = torch.from_numpy(make_batch(family, n, 2))
    ours = packed(A, FORWARD if n % 2 == 0 else CONCURRENT)
    assert ours.dtype == torch.float64
    assert_fp64_close(A, ours)


def test_fp64_sizes_that_fit_an_h100_block():
    a = variants.ALGORITHMS[ALGO]
    assert 8 * (a.smem_elems(220) + 64) <= 227 * 1024 < 8 * (a.smem_elems(224) + 64)


# two panels (n = 40) and three, with a partial last panel (n = 70; ~8 s)
@pytest.mark.parametrize("n", [40, pytest.param(70, marks=pytest.mark.slow)])
def test_every_barrier_is_needed(n):
    A = torch.from_numpy(make_batch("indefinite", n, 2)).float()
    assert_barriers_needed(A, ALGO)


# ------------------------------------------------------------------ the kernel, compiled for sm_90

def _sass_tools():
    from fastspec.eig import nvrtc

    try:
        from benchmarks.sass import find_tool  # a maintainer's tool
    except ImportError:
        return "benchmarks/sass.py not importable"
    if find_tool("cuobjdump") is None:
        return "needs cuobjdump (CUDA toolkit or the triton wheel)"
    return f"needs NVRTC: {nvrtc.missing()}" if nvrtc.missing() else ""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``(dtype, n) -> (variant, cubin path)`` for sm_90, compiled once per module in a fresh cache."""
    why = _sass_tools()
    if why:
        pytest.skip(why)
    from fastspec.eig import cuda, nvrtc

    folder = tmp_path_factory.mktemp("eig-packed-cache")
    made: dict = {}

    def get(dtype: str, n: int):
        if (dtype, n) not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(90), algo=ALGO)
                img = nvrtc.compile_variant(v, nvrtc.Target(90))
            assert img.data[:4] == b"\x7fELF"
            path = folder / f"sm90-{v.tag}.cubin"
            path.write_bytes(img.data)
            made[dtype, n] = v, str(path)
        return made[dtype, n]

    return get


def _kernel(build, dtype, n):
    from benchmarks.sass import disassemble, kernels
    from fastspec.eig import nvrtc

    v, path = build(dtype, n)
    (k,) = [k for k in kernels(disassemble(path)) if k.name == nvrtc.ENTRY]
    return v, path, k


SASS_SIZES = [("float32", 5), ("float32", 100), ("float32", 128), ("float32", 256), ("float64", 128),
              ("float64", 200)]


@pytest.mark.parametrize("dtype, n", SASS_SIZES, ids=lambda x: str(x))
def test_sass_no_spills_no_generic_memory(build, dtype, n):
    from benchmarks.sass import resource_usage
    from fastspec.eig import nvrtc

    v, path, k = _kernel(build, dtype, n)
    res = resource_usage(path)[nvrtc.ENTRY]
    assert res["stack"] == 0 and res["local"] == 0, (v.tag, res)
    assert res["registers"] * v.threads * v.min_blocks <= 65536, (v.tag, res)
    generic = {op: c for op, c in k.full_ops.items() if op.split(".")[0] in ("LD", "ST")}
    assert not generic, generic  # every shared pointer derives from smem: LDS/STS only


def test_sass_five_blocks_per_sm_at_n128(build):
    """fp32 n = 128: 45.3 KB of shared memory and <= 96 registers x 128 threads: 5 blocks (20 warps)
    fit an H100 SM (NVRTC 13.0 gives 80 registers); the launch bounds ask for the 5 (the packed
    algorithm's register budget in variants.py is 96), so a compiler update cannot take them away."""
    from benchmarks.sass import resource_usage
    from fastspec.eig import cuda, nvrtc

    v, path, _ = _kernel(build, "float32", 128)
    assert cuda.smem_bytes(128, "float32", True, ALGO) + cuda.RESERVED_SMEM <= 228 * 1024 // 5
    assert v.min_blocks == 5
    assert resource_usage(path)[nvrtc.ENTRY]["registers"] <= 96


def _column_loops(k):
    """The column pass: rank-2 update + column part of p, 12 FFMA per STS.128 (4 rows)."""
    return [lp for lp in k.innermost() if lp.full_ops["STS.128"] >= 1 and lp.ops["FFMA"] == 12 * lp.full_ops["STS.128"]]


def _row_loops(k):
    """The row pass: one scalar LDS and one FFMA per element, no store, a u2 broadcast per 4."""
    return [lp for lp in k.innermost()
            if lp.ops["STS"] == 0 and lp.ops["LDS"] >= 4 and lp.ops["FFMA"] == lp.full_ops["LDS"]
            and lp.full_ops["LDS.128"] * 4 == lp.ops["FFMA"]]


@pytest.mark.parametrize("n", [100, 128, 256])
def test_sass_column_pass(build, n):
    """Per element and reflector: 3 FFMA, 1/4 LDS.128 + 1/4 STS.128 of the element (4 wavefronts
    each per warp: 2 per element), 3/4 LDS.128 broadcast of u, w, u2: 2.75 shared wavefronts and
    5.25 instructions (42 per 8 rows from NVRTC 13.0; block: 6.75-6.9)."""
    _, _, k = _kernel(build, "float32", n)
    loops = _column_loops(k)
    assert loops, "no column-pass loop: the tridiagonalization changed shape"
    for lp in loops:
        rows = 4 * lp.full_ops["STS.128"]
        assert lp.full_ops["LDS.128"] == 4 * lp.full_ops["STS.128"], lp.full_ops  # u, w, u2, matrix
        assert lp.ops["LDS"] == lp.full_ops["LDS.128"] and lp.ops["STS"] == lp.full_ops["STS.128"], lp.full_ops
        assert lp.size / rows <= 5.6, (lp.size, rows, lp.ops)


@pytest.mark.parametrize("n", [128, 256])
def test_sass_row_pass(build, n):
    """Per element and reflector: 1 LDS (consecutive lanes: one wavefront) + 1 FFMA + 1/4 LDS.128
    broadcast of u2 = 1.25 wavefronts and 2.875 instructions (23 per 8 elements from NVRTC 13.0),
    with constant offsets: one loop per panel (the panel loop unrolled, its stride a constant)."""
    _, _, k = _kernel(build, "float32", n)
    loops = [lp for lp in _row_loops(k) if lp.ops["FFMA"] == 8]  # the unroll-2 bodies
    assert len(loops) >= n // 32 - 1, [lp.ops for lp in _row_loops(k)]
    for lp in loops:
        assert lp.size / lp.ops["FFMA"] <= 3.1, (lp.size, lp.ops)


def test_sass_sturm_loop_has_no_division_slow_path(build):
    """bisect_all from eig_core.h, unchanged: one MUFU reciprocal per Sturm step, no IEEE slow path."""
    _, _, k = _kernel(build, "float32", 128)
    sturm = [lp for lp in k.innermost() if lp.ops["MUFU"]]
    assert sturm
    for lp in sturm:
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0, lp.ops
        assert lp.size / lp.ops["MUFU"] <= 8.25, (lp.size, lp.ops)
