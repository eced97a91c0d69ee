"""The "newton" algorithm of the CUDA eigensolver (``csrc/eig_newton.h``, FS_ALGO 4): packed's
tridiagonalization (``csrc/eig_packed.h``, shared code), then an eigenvalue stage of team-wide
isolation rounds and a safeguarded Newton iteration per eigenvalue instead of bisection.

Two halves, both without a GPU:

* the team emulation (``csrc/eig_host.cpp``: the algorithm by round_up(n, 32) ranks with the
  kernel's barriers, reduction order and shared-memory layout, poisoned with NaN before the first
  matrix) against LAPACK: the families of :mod:`fastspec.eig.matrices` at several n, in the
  free-running and a serial schedule, float32 and float64, and the benchmark's power-law Gram
  matrices; the eigenvalue stage against packed's bisection on the same T (both certify brackets
  of width eps ||T||, so they agree to a few ulps of ||T||, far tighter than the accuracy bound);
  and the barrier-mutation check. The contract every algorithm shares is
  tests/test_eig_algorithms.py's, the phase marks tests/test_eig_profile.py's.
* the kernel compiled for sm_90 by NVRTC through the launcher's plan, read by ``cuobjdump``: no
  spills, no local memory, no generic loads/stores, registers within the launch bounds (5 blocks
  per SM at float32 n = 128, as packed), and the two sweeps' instructions per Sturm step (the cost
  model in the header), without an IEEE division slow path.

How many sweeps the refinement takes is not observable here (the header's measurements come from an
instrumented build: its FS_NEWTON_SWEEP hook); the battery bounds its accuracy, the SASS its cost
per sweep.
"""
from __future__ import annotations

import _eig_team
import pytest
import torch
from _eig_team import (
    CONCURRENT,
    FORWARD,
    HARD_FAMILIES,
    REVERSE,
    assert_barriers_needed,
    assert_fp64_close,
    assert_within_torch_error,
    battery_cases,
    one_torch_thread,  # noqa: F401 - an autouse fixture: one torch thread
    team,
)

from fastspec.eig import variants
from fastspec.eig.matrices import FAMILIES, make_batch

pytestmark = _eig_team.NO_EXT

ALGO = "newton"


def newton(A: torch.Tensor, schedule: int = CONCURRENT) -> torch.Tensor:
    return team(A, ALGO, schedule)[0]


def check_fp32(A: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == A.shape[:-1] and ours.dtype == torch.float32
    assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all(), "not finite / not ascending"
    assert_within_torch_error(A, ours)


def test_python_formulas_match_the_header():
    from fastspec.eig import _host

    a, p = variants.ALGORITHMS[ALGO], variants.ALGORITHMS["packed"]
    assert _host.ALGOS[ALGO] == a.id == 4
    assert a.max_n == _host.algo_max_n(a.id) == 256 and a.dtypes == ("float32", "float64")
    for n in range(1, 257):
        assert a.threads(n) == _host.algo_threads(a.id, n) == p.threads(n)
        # the eigenvalue stage's vectors fit packed's memory: the same layout, the same blocks per SM
        assert a.smem_elems(n) == _host.algo_smem_elems(a.id, n) == p.smem_elems(n)
    assert a.registers("float32") == p.registers("float32") == 96


def _battery() -> list:
    """Packed's battery: the hard families at every n, one serial order besides the free-running one;
    n = 128 and 256 (and n = 100 for all but two families) in the full tier, where
    test_fp32_n128 / test_fp32_n256 keep one case each in the fast one."""
    return battery_cases([1, 2, 3, 5, 17, 33, 70, 100, 128, 256],
                         lambda family, n: n >= 128 or (n == 100 and family not in ("indefinite", "wilkinson")))


@pytest.mark.parametrize("family, n", _battery())
def test_fp32_battery(family, n):
    A = torch.from_numpy(make_batch(family, n, 2)).float()
    for schedule in (CONCURRENT, REVERSE if n % 2 else FORWARD):
        check_fp32(A, newton(A, schedule))


OTHER_FAMILIES = tuple(f for f in FAMILIES if f not in HARD_FAMILIES)


@pytest.mark.parametrize("family, n", battery_cases([33, 128], lambda family, n: n == 128, families=OTHER_FAMILIES))
def test_fp32_every_other_family(family, n):
    # the refinement meets every kind of spectrum: exact multiples (repeated, degenerate), tight
    # clusters, graded ones, zeros, the extreme scales
    A = torch.from_numpy(make_batch(family, n, 2)).float()
    check_fp32(A, newton(A))


def test_fp32_n128():
    A = torch.from_numpy(make_batch("indefinite", 128, 1)).float()
    check_fp32(A, newton(A, FORWARD))


def test_fp32_n256():
    A = torch.from_numpy(make_batch("gram-activations", 256, 1)).float()
    check_fp32(A, newton(A))


def test_fp32_the_benchmarks_matrices():
    """The race's batches (fastspec.bench's power-law Gram matrices): ~100 of the 128 eigenvalues fall
    in one cell of the first grid, which the isolation rounds exist for."""
    from fastspec.bench.suites.eigvalsh import powerlaw_gram

    A = powerlaw_gram(2, 128, torch.device("cpu"))
    assert A.dtype == torch.float32
    check_fp32(A, newton(A))


@pytest.mark.slow
def test_fp32_more_seeds_at_n128():
    for family in ("graded-1e-8", "four-clusters", "repeated", "wilkinson"):
        A = torch.from_numpy(make_batch(family, 128, 4, seed=1)).float()
        check_fp32(A, newton(A))


@pytest.mark.parametrize("n, family", [
    (5, "indefinite"), (40, "indefinite"), (40, "spd-1e30"), (64, "four-clusters"), (64, "wilkinson"),
    (64, "repeated"), (100, "graded-1e-8"),
    pytest.param(128, "graded-1e-12", marks=pytest.mark.slow),
    pytest.param(160, "gram-activations", marks=pytest.mark.slow),
    pytest.param(220, "indefinite", marks=pytest.mark.slow),  # about the largest fp64 n of an H100 block
])
def test_fp64(n, family):
    A = torch.from_numpy(make_batch(family, n, 2))
    ours = newton(A, FORWARD if n % 2 == 0 else CONCURRENT)
    assert ours.dtype == torch.float64 and (ours.diff(dim=-1) >= 0).all()
    assert_fp64_close(A, ours)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [33, pytest.param(128, marks=pytest.mark.slow)])
def test_the_stage_agrees_with_bisection_on_the_same_tridiagonal(dtype, n):
    """packed and newton share the tridiagonalization (the same code, the same T bit for bit); their
    eigenvalue stages each certify a bracket of width eps ||T|| (u ||T||, u the unit round-off) by
    Sturm counts, so they agree to a few u ||T|| (the two counts' rounding differs: IEEE vs
    xSTEBZ-guarded), whatever the spectrum: a far tighter check of the refinement than the battery,
    whose bound is dominated by the tridiagonalization's error."""
    u = torch.finfo(getattr(torch, dtype)).eps / 2
    for family in FAMILIES:
        A = torch.from_numpy(make_batch(family, n, 2)).to(getattr(torch, dtype))
        ours, bisection = newton(A).double(), team(A, "packed")[0].double()
        scale = bisection.abs().amax(dim=-1, keepdim=True)
        assert ((ours - bisection).abs() <= 8 * u * scale).all(), (family, ((ours - bisection).abs() / scale).max() / u)


# the grid's barrier, the isolation rounds' and the refinement's, with packed's: two panels (n = 40)
# and three, with a partial last panel (n = 70). A graded spectrum: several eigenvalues per grid
# cell, so the rounds' shared points change the brackets (with one eigenvalue per cell, as the
# indefinite family mostly has at n = 40, a round without its barrier only bisects a little less,
# and the refinement often ends on the same bits)
@pytest.mark.parametrize("n", [40, pytest.param(70, marks=pytest.mark.slow)])
def test_every_barrier_is_needed(n):
    A = torch.from_numpy(make_batch("graded-1e-8", n, 2)).float()
    assert_barriers_needed(A, ALGO)


def test_every_barrier_is_needed_in_float64():
    A = torch.from_numpy(make_batch("gram-activations", 40, 2))
    assert_barriers_needed(A, ALGO)


# ------------------------------------------------------------------ the kernel, compiled for sm_90

@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``(dtype, n) -> (variant, cubin path, kernel, resources)`` for sm_90, compiled once per module."""
    sass = pytest.importorskip("benchmarks.sass")
    from fastspec.eig import cuda, nvrtc

    if sass.find_tool("cuobjdump") is None:
        pytest.skip("needs cuobjdump (CUDA toolkit or the triton wheel)")
    if nvrtc.missing():
        pytest.skip(f"needs NVRTC: {nvrtc.missing()}")
    folder = tmp_path_factory.mktemp("eig-newton-cache")
    made: dict = {}

    def get(dtype: str, n: int):
        if (dtype, n) not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(90), algo=ALGO)
                img = nvrtc.compile_variant(v, nvrtc.Target(90))
            path = folder / f"sm90-{v.tag}.cubin"
            path.write_bytes(img.data)
            (k,) = [k for k in sass.kernels(sass.disassemble(str(path))) if k.name == nvrtc.ENTRY]
            made[dtype, n] = v, str(path), k, sass.resource_usage(str(path))[nvrtc.ENTRY]
        return made[dtype, n]

    return get


SASS_SIZES = [("float32", 5), ("float32", 100), ("float32", 128), ("float32", 256), ("float64", 128),
              ("float64", 200)]


@pytest.mark.parametrize("dtype, n", SASS_SIZES, ids=lambda x: str(x))
def test_sass_no_spills_no_generic_memory(build, dtype, n):
    v, _, k, res = build(dtype, n)
    assert res["stack"] == 0 and res["local"] == 0, (v.tag, res)
    assert res["registers"] * v.threads * v.min_blocks <= 65536, (v.tag, res)
    generic = {op: c for op, c in k.full_ops.items() if op.split(".")[0] in ("LD", "ST")}
    assert not generic, generic  # every shared pointer derives from smem: LDS/STS only


def test_sass_five_blocks_per_sm_at_n128(build):
    """packed's occupancy is kept: the same 45.3 KB of shared memory and <= 96 registers x 128
    threads, 5 blocks (20 warps) per H100 SM (70 registers from NVRTC 13.5)."""
    from fastspec.eig import cuda

    v, _, _, res = build("float32", 128)
    assert cuda.smem_bytes(128, "float32", True, ALGO) + cuda.RESERVED_SMEM <= 228 * 1024 // 5
    assert v.min_blocks == 5 and res["registers"] <= 96, res


def _sweeps(k):
    """The two Sturm sweeps' loops, eight pairs of steps per iteration: the plain count (grid and
    rounds; no FMUL) and the Newton sweep (two FMUL a step: e2 r and q' r)."""
    loops = [lp for lp in k.innermost() if lp.ops["MUFU"] >= 8]
    newton_loops = [lp for lp in loops if lp.ops["FMUL"] + lp.ops["DMUL"] == 2 * lp.ops["MUFU"]]
    counts = [lp for lp in loops if lp.ops["FMUL"] + lp.ops["DMUL"] == 0]
    return counts, newton_loops


# instructions per Sturm step (loop size / MUFU), NVRTC 13.5 for sm_90 with a little slack:
# float32 count 4.875 (78 per 16 steps: FADD, MUFU.RCP, FFMA, LEA.HI, half an LDS.128, 4 of loop),
# Newton 8.875 (142: + FMUL e2 r, FFMA q', FMUL q'/q, FADD g); float64 12.4 and 16.4 (the guard's
# DSETP and 2 FSEL, the seed's MUFU.RCP64H and 3 DFMA for the reciprocal)
PER_STEP = {"float32": (5.0, 9.0), "float64": (12.75, 16.75)}


@pytest.mark.parametrize("dtype, n", [("float32", 100), ("float32", 128), ("float32", 256), ("float64", 128)])
def test_sass_sweeps(build, dtype, n):
    _, _, k, _ = build(dtype, n)
    counts, newton_loops = _sweeps(k)
    assert len(counts) == 2 and len(newton_loops) == 1, [(hex(lp.start), lp.size, lp.ops) for lp in k.innermost()]
    count_bound, newton_bound = PER_STEP[dtype]
    for lp in counts:
        assert lp.ops["MUFU"] == 16 and lp.full_ops["LDS.128"] == (8 if dtype == "float32" else 16), lp.full_ops
        assert lp.size / lp.ops["MUFU"] <= count_bound, (lp.size, lp.ops)
    (lp,) = newton_loops
    assert lp.ops["MUFU"] == 16 and lp.size / lp.ops["MUFU"] <= newton_bound, (lp.size, lp.ops)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sass_no_division_slow_path_in_the_eigenvalue_stage(build, dtype):
    """Every loop with a reciprocal (the sweeps, the refinement around the Newton sweep, the rounds
    around the count) is free of IEEE division: no FCHK, no CALL to a slow path; the kernel's few
    divisions are the reflectors' (packed's, once per reflector; the loops around them hold the
    reductions' shuffles)."""
    _, _, k, _ = build(dtype, 128)
    stage = [lp for lp in k.loops if lp.ops["MUFU"] and not lp.ops["SHFL"]]
    assert len(stage) >= 5, [(hex(lp.start), lp.size) for lp in k.loops]
    for lp in stage:
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0, (hex(lp.start), lp.ops)
