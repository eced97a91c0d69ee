"""The "regs" algorithm of the CUDA eigensolver (``csrc/eig_regs.h``: float32, n <= 128,
the matrix in registers, two threads per column) run by the team emulation, and
its sm_90 SASS through NVRTC.

Emulation: the kernel's own code run by ``2 * round_up(n, 32)`` ranks with the kernel's barriers,
reduction order and shared-memory layout (``tests/_eig_team.py``); accuracy against fp64 LAPACK
with the host twin's criterion (2 x torch fp32's error + 8 eps ||A||). ~0.06 s per two 128 x 128
matrices on 2 cores: the fast tier keeps n = 128 to two families, ``--full`` runs the rest.

SASS (skipped without cuobjdump / NVRTC): no spills, no local memory (the register array ``a[64]`` is
indexed by constants only), registers within the launch bounds (256 threads, 2 blocks), no generic
LD/ST, and the per-reflector loop's instruction counts a little above what NVRTC 13 gives now
(the cost model in the header of eig_regs.h is built on them), and the Sturm count's steps.
"""
from __future__ import annotations

import _eig_team
import pytest
import torch
from _eig_team import (
    CONCURRENT,
    assert_barriers_needed,
    assert_within_torch_error,
    battery_cases,
    one_torch_thread,  # noqa: F401 - an autouse fixture: one torch thread
    team,
)

from fastspec.eig.matrices import make_batch

pytestmark = _eig_team.NO_EXT


def regs(A: torch.Tensor, schedule: int = CONCURRENT) -> torch.Tensor:
    return team(A, "regs", schedule)[0]


FAST_128 = ("indefinite", "gram-activations")  # n = 128 in the fast tier (1.7 s each)


def _battery() -> list:
    return battery_cases([1, 2, 3, 5, 17, 33, 100, 128],
                         lambda family, n: n == 100 or (n == 128 and family not in FAST_128))


@pytest.mark.parametrize("family, n", _battery())
def test_battery(family, n):
    A = torch.from_numpy(make_batch(family, n, 2)).float()
    ours = regs(A)
    assert ours.shape == (2, n) and ours.dtype == torch.float32
    assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all()
    assert_within_torch_error(A, ours)


@pytest.mark.slow
def test_more_seeds_at_n128():
    for family in ("graded-1e-8", "one-cluster", "wilkinson", "spd-1e30"):
        A = torch.from_numpy(make_batch(family, 128, 4, seed=1)).float()
        assert_within_torch_error(A, regs(A))


def test_scaling_at_the_ends_of_the_exponent_range():
    # max |a| in [2^126, 2^127): the internal scale 2^-127 is not a normal float (two exact steps);
    # eigenvalues stay below 2^127 (diagonally dominant, largest diagonal entry 0.5 * 2^127)
    n = 24
    A = torch.diag(torch.linspace(0.3, 0.5, n)) + 1e-3 * torch.from_numpy(make_batch("indefinite", n, 1))[0].float()
    A = ((A + A.T) / 2).unsqueeze(0)
    A[0, n - 1, n - 1] = 0.5
    big = A * 2.0**127
    assert torch.isfinite(big).all() and big.abs().max() == 2.0**126
    assert torch.equal(regs(big), regs(A) * 2.0**127)
    # subnormal input (max |a| < FLT_MIN): scaled up exactly in two steps; the output is one rounding
    # of the same internal result as for the input scaled by 2^140
    tiny = (torch.from_numpy(make_batch("spd", n, 1)) * 2.0**-140).float()
    assert tiny.abs().max() < torch.finfo(torch.float32).tiny
    up = regs((tiny.double() * 2.0**140).float())  # exact (2^140 itself is no float32)
    assert torch.equal(regs(tiny), (up.double() * 2.0**-140).float())


@pytest.mark.parametrize("n", [5, 40])
def test_every_barrier_is_needed(n):
    # the algorithm's own barriers: after the first x (column 0), the one per reflector (W's u, w,
    # x before the next F; the other per reflector is the team sum's own), and the eigenvalue
    # stage's two (grid counts, eigenvalues)
    A = torch.from_numpy(make_batch("indefinite", n, 2)).float()
    assert_barriers_needed(A, "regs")


def test_layout_formulas_agree_with_python():
    from fastspec.eig import _host, variants

    a = variants.ALGORITHMS["regs"]
    rid = _host.ALGOS["regs"]
    for n in range(1, 300):
        assert _host.algo_threads(rid, n) == a.threads(n) and _host.algo_smem_elems(rid, n) == a.smem_elems(n), n
    assert a.threads(128) == 256 and a.smem_elems(128) == 2 * 128 + 6 * 128
    assert a.takes(128, "float32") and not a.takes(129, "float32") and not a.takes(64, "float64")


# ------------------------------------------------------------------ sm_90 SASS through NVRTC


@pytest.fixture(scope="module")
def sass_of(tmp_path_factory):
    """``n -> (variant, cubin path, kernel)`` for float32 regs on sm_90, compiled once per module."""
    sass = pytest.importorskip("benchmarks.sass")
    from fastspec.eig import cuda, nvrtc

    if sass.find_tool("cuobjdump") is None:
        pytest.skip("needs cuobjdump (CUDA toolkit or the triton wheel)")
    if nvrtc.missing():
        pytest.skip(f"needs NVRTC: {nvrtc.missing()}")
    folder = tmp_path_factory.mktemp("eig-regs-cache")
    made = {}

    def get(n: int):
        if n not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                v = cuda.variant_for(n, "float32", cuda.DeviceSpec.for_arch(90), algo="regs")
                img = nvrtc.compile_variant(v, nvrtc.Target(90))
            path = folder / f"sm90-regs-{n}.cubin"
            path.write_bytes(img.data)
            (k,) = [k for k in sass.kernels(sass.disassemble(str(path))) if k.name == nvrtc.ENTRY]
            made[n] = v, str(path), k, sass.resource_usage(str(path))[nvrtc.ENTRY]
        return made[n]

    return get


@pytest.mark.parametrize("n", [128, 100, pytest.param(17, marks=pytest.mark.slow),
                               pytest.param(64, marks=pytest.mark.slow)])
def test_sass_registers_no_spills_no_generic_memory(sass_of, n):
    v, _, k, res = sass_of(n)
    assert (v.threads, v.min_blocks) == (2 * ((n + 31) // 32 * 32), 512 // (2 * ((n + 31) // 32 * 32)))
    assert res["stack"] == 0 and res["local"] == 0, res  # no spills, a[] never in local memory
    assert res["registers"] * v.threads * v.min_blocks <= 65536, res
    assert k.ops["LDL"] == 0 and k.ops["STL"] == 0
    generic = {op: c for op, c in k.full_ops.items() if op.split(".")[0] in ("LD", "ST")}
    assert not generic, generic  # every shared pointer derives from smem: LDS/STS


def _reflector_loop(k):
    """The per-reflector loop: the innermost loop holding the chunks' 24 FFMA and 6 LDS.128 each."""
    loops = [lp for lp in k.innermost() if lp.ops["FFMA"] >= 150]
    assert len(loops) == 1, [(hex(lp.start), lp.size) for lp in loops]
    return loops[0]


def test_sass_reflector_loop_at_n128(sass_of):
    """One reflector at n = 128, per warp: up to 8 chunks of 8 rows, each 6 LDS.128 broadcasts
    (u, w, x) + 24 FFMA (2 for the rank-2 update, 1 for A x, per element), run straight after a
    fall-through switch picks the first (~31 instructions, ~3.9 per element), no shared access to
    a matrix element; around them ONE team sum, one FS_SYNC, the reflector by MUFU (one
    sqrt.approx, two rcp.approx: no IEEE-division or sqrt slow path, no CALL), w and the next
    column. NVRTC 13.5 gives 515 instructions in the loop body (every path; 13.0: 535), 200 FFMA,
    63 LDS (48 LDS.128 in the chunks, 2 for the fold of the warp totals), 23 STS (16 STS.128 of the
    column publication), 3 MUFU, 2 BAR."""
    _, _, k, _ = sass_of(128)
    lp = _reflector_loop(k)
    assert lp.ops["FFMA"] >= 8 * 24 and lp.ops["FFMA"] <= 205, lp.ops
    assert lp.full_ops["LDS.128"] >= 8 * 6 and lp.ops["LDS"] <= 66, lp.full_ops
    assert lp.ops["STS"] <= 25 and lp.full_ops["STS.128"] == 16, lp.full_ops
    assert lp.ops["BAR"] == 2, lp.ops  # the team sum and the FS_SYNC
    assert lp.ops["MUFU"] == 3 and lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0, lp.full_ops
    assert lp.size <= 545, (lp.size, lp.ops)


def test_sass_sturm_loop_is_the_ieee_count(sass_of):
    """regs_count, unrolled (n = 128 is a compile-time constant): 127 steps of MUFU.RCP, FADD, FFMA
    and a sign-bit add, the (e^2, d) pairs by 63 LDS.128 + 1 LDS.64 broadcasts; no pivmin guard, no
    division slow path. NVRTC 13: 583 and 586 instructions for the grid pass and the bisection's
    count, 4.6 per step (eig_core.h's guarded step: 7.3)."""
    _, _, k, _ = sass_of(128)
    sturm = [lp for lp in k.innermost() if lp.ops["MUFU"] >= 100]
    assert len(sturm) == 2, [(hex(lp.start), lp.size) for lp in sturm]
    for lp in sturm:
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0 and lp.ops["FSEL"] <= 2, lp.ops
        assert lp.ops["MUFU"] == 127 and 2 * lp.full_ops["LDS.128"] + lp.full_ops["LDS.64"] == 127, lp.full_ops
        assert lp.size <= 590, (lp.size, lp.ops)
