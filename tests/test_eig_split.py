"""The "split" algorithm of the CUDA eigensolver (``csrc/eig_split.h``, FS_ALGO 3):
two threads per column in the tridiagonalization, two Sturm counts per eigenvalue and sweep
(trisection) in the bisection, a division-free fp64 Sturm step.

Without a GPU: the team emulation (``csrc/eig_host.cpp``: one rank per CUDA thread, the
kernel's barriers, reduction order and shared-memory layout, poisoned with NaN) runs the algorithm
in the concurrent and in a serial schedule, against LAPACK; the barrier-mutation check shows each
barrier needed; NVRTC compiles it for sm_90 and the SASS is checked (spills, address spaces, the
hot loops' instruction counts of the header's cost model).
"""
from __future__ import annotations

import os

import _eig_team
import pytest
import torch
from _eig_team import (
    CONCURRENT,
    assert_barriers_needed,
    assert_fp64_close,
    assert_within_torch_error,
    battery_cases,
    one_torch_thread,  # noqa: F401 - an autouse fixture: one torch thread
    team,
)

from fastspec.eig.matrices import make_batch

pytestmark = _eig_team.NO_EXT

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def split(A: torch.Tensor, schedule: int = CONCURRENT) -> torch.Tensor:
    return team(A, "split", schedule)[0]


def check(A: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == A.shape[:-1] and ours.dtype == A.dtype
    assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all()
    (assert_within_torch_error if A.dtype == torch.float32 else assert_fp64_close)(A, ours)


def _battery() -> list:
    """Every family at tiny n, non-multiples of 32 and the max n (128), both dtypes; the fast tier
    takes n <= 33 and one family at n = 128 per dtype (~0.1 s each on 2 cores)."""
    return battery_cases([1, 2, 3, 5, 17, 33, 100, 128], lambda family, n, dt: n == 100 or (
        n == 128 and family != ("indefinite" if dt == "fp64" else "gram-activations")), dtypes=list(DTYPES))


@pytest.mark.parametrize("family, n, dt", _battery())
def test_battery(family, n, dt):
    A = torch.from_numpy(make_batch(family, n, 2)).to(DTYPES[dt])
    check(A, split(A))


def test_identity_and_diagonal():
    # zero off-diagonals everywhere (the Sturm pivots' pivmin guard) and exactly repeated eigenvalues
    for dt in DTYPES.values():
        out = split(torch.eye(9, dtype=dt).expand(2, 9, 9))
        eps = torch.finfo(dt).eps
        assert (out - 1).abs().max() <= 2 * eps
        D = torch.diag_embed(torch.tensor([[3.0, -1.0, 2.0, -1.0, 0.5]], dtype=dt))
        torch.testing.assert_close(split(D), torch.tensor([[-1.0, -1.0, 0.5, 2.0, 3.0]], dtype=dt),
                                   atol=4 * eps * 3, rtol=0)


@pytest.mark.parametrize("n, dt", [(5, "fp32"), (17, "fp64")])
def test_every_barrier_is_needed(n, dt):
    assert_barriers_needed(torch.from_numpy(make_batch("indefinite", n, 2)).to(DTYPES[dt]), "split")


# ------------------------------------------------------------------ SASS for sm_90 through NVRTC

def _sm90(dtype: str, n: int):
    """``(variant, kernel SASS, resources)`` of the split variant, compiled by NVRTC in a fresh cache."""
    import tempfile

    from benchmarks.sass import disassemble, kernels, resource_usage
    from fastspec.eig import cuda, nvrtc

    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTSPEC_CACHE", folder)
        v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(90), algo="split")
        img = nvrtc.compile_variant(v, nvrtc.Target(90))
        path = os.path.join(folder, "split.cubin")
        with open(path, "wb") as f:
            f.write(img.data)
        (k,) = [k for k in kernels(disassemble(path)) if k.name == nvrtc.ENTRY]
        return v, k, resource_usage(path)[nvrtc.ENTRY]


def _needs_sass():
    from benchmarks.sass import find_tool
    from fastspec.eig import nvrtc

    if find_tool("cuobjdump") is None:
        pytest.skip("needs cuobjdump (CUDA toolkit or the triton wheel)")
    if nvrtc.missing():
        pytest.skip(f"needs NVRTC: {nvrtc.missing()}")


@pytest.fixture(scope="module")
def sass():
    _needs_sass()
    made = {}

    def get(dtype, n):
        if (dtype, n) not in made:
            made[dtype, n] = _sm90(dtype, n)
        return made[dtype, n]

    return get


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [5, 100, 128])
def test_sm90_no_spills_no_generic_accesses(sass, dtype, n):
    v, k, res = sass(dtype, n)
    assert res["stack"] == 0 and res["local"] == 0, (v.tag, res)
    assert res["registers"] * v.threads * v.min_blocks <= 65536, (v.tag, res)
    generic = {op: c for op, c in k.full_ops.items() if op.split(".")[0] in ("LD", "ST", "ATOM", "RED")}
    assert not generic, generic  # every shared pointer derives from smem: LDS/STS only
    # only the team reductions' butterflies (5 per inlined team.max/team.sum and 32-bit word: NVRTC 13
    # gives 30 (fp32) / 60 (fp64) for the 3 reduction sites); the algorithm exchanges through shared memory
    assert k.ops["SHFL"] <= (32 if dtype == "float32" else 64), k.ops["SHFL"]


def _update_loops(k, fma: str):
    """The split fused update: innermost loops with 3 FMAs (two update, one p) per matrix store."""
    return [lp for lp in k.innermost() if lp.ops["STS"] >= 4 and lp.ops[fma] == 3 * lp.ops["STS"]]


@pytest.mark.parametrize("dtype, fma, per_elem", [("float32", "FFMA", 7.2), ("float64", "DFMA", 7.9)])
def test_sm90_fused_update_loop(sass, dtype, fma, per_elem):
    """Per element and reflector: 3 FMAs, one LDS + one STS of the element, 3/4 of a broadcast
    of u, w, u_next (fp32: LDS.128; fp64: two LDS.128 per 4 rows and vector): at most 2.75 (fp32)
    / 3.5 (fp64) shared instructions, and 6.9 (fp32) / 7.5 (fp64) instructions per element from
    NVRTC 13 (bounds 7.2 / 7.9)."""
    _, k, _ = sass(dtype, 128)
    loops = _update_loops(k, fma)
    assert loops, "no fused update loop: the tridiagonalization changed shape"
    for lp in loops:
        elems = lp.ops["STS"]
        assert (lp.ops["LDS"] + lp.ops["STS"]) / elems <= (2.75 if dtype == "float32" else 3.5), lp.ops
        assert lp.size / elems <= per_elem, (lp.size, elems, lp.ops)


@pytest.mark.parametrize("dtype, per_step", [("float32", 8.25), ("float64", 14.75)])
def test_sm90_sturm_loop(sass, dtype, per_step):
    """One Sturm step: one LDS.64/LDS.128 of (e^2, d), one MUFU reciprocal, no IEEE division (no
    FCHK, no CALL to a slow path, no BSSY); fp32 7.3-7.9 instructions per step, fp64 13.5 from
    NVRTC 13.5 and 14.6 from 13.0 (LDS.128, MUFU.RCP64H and the zero low word, DADD d - x, 3 DFMA, DMUL, DADD, the guard DSETP + 2 FSEL, the count as one LEA.HI of the sign bit)."""
    _, k, _ = sass(dtype, 128)
    sturm = [lp for lp in k.innermost() if lp.ops["MUFU"] >= 4]
    assert sturm, "no loop with MUFU reciprocals: the Sturm count changed shape"
    for lp in sturm:
        steps = lp.ops["MUFU"]
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0 and lp.ops["BSSY"] == 0, lp.ops
        assert lp.ops["LDS"] == steps, lp.ops
        assert lp.size / steps <= per_step, (lp.size, steps, lp.ops)
