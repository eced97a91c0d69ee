"""The CUDA eigensolver compiled for sm_80 and sm_90 without a GPU, through the path users run
(NVRTC, :func:`fastspec.eig.nvrtc.compile_variant`, the plan of :mod:`fastspec.eig.cuda`):
registers, spills and the SASS instruction mix that the cost model in the kernel's header
(``csrc/eig_kernel.cu``) is built on.

``cuobjdump`` (on PATH or in the Triton wheel) reads the cubin: ``-res-usage`` for registers and
stack, ``-sass`` for the per-loop counts of ``benchmarks/sass.py`` (a developer tool, outside the
installed package). Nothing runs. Bounds sit a little above what NVRTC 13.0 and 13.5 produce, so
a compiler update passes and a code change that brings back generic pointers, spills, the IEEE
division's slow path or a serialized update loop fails.
"""
from __future__ import annotations

import pytest

from benchmarks.sass import disassemble, find_tool, kernels, resource_usage  # a maintainer's tool
from fastspec.eig import cuda, nvrtc

CUOBJDUMP = find_tool("cuobjdump")


pytestmark = [
    pytest.mark.skipif(CUOBJDUMP is None, reason="needs cuobjdump (CUDA toolkit or the triton wheel)"),
    pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}"),
]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``(arch, dtype, n) -> (variant, cubin path)``, compiled once per module in a fresh cache."""
    folder = tmp_path_factory.mktemp("eig-cache")
    made: dict[tuple[int, str, int], tuple[nvrtc.Variant, str]] = {}

    def get(arch: int, dtype: str, n: int):
        if (arch, dtype, n) not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(arch))
                img = nvrtc.compile_variant(v, nvrtc.choose_target(arch))
            assert img.target == nvrtc.Target(arch) and img.data[:4] == b"\x7fELF", img.target
            path = folder / f"sm{arch}-{v.tag}.cubin"  # the bare cubin (cache files carry a header)
            path.write_bytes(img.data)
            made[arch, dtype, n] = v, str(path)
        return made[arch, dtype, n]

    get.folder = folder
    return get


def _sass(build, arch, dtype, n):
    v, path = build(arch, dtype, n)
    (k,) = [k for k in kernels(disassemble(path)) if k.name == nvrtc.ENTRY]
    return v, k


SIZES = [2, 17, 64, 100, 128, 170, 240, 256, 1024]


@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.slow), 90])  # sm_80 in the full tier
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_no_spills_and_registers_within_launch_bounds(build, arch, dtype):
    for n in SIZES:
        v, path = build(arch, dtype, n)
        res = resource_usage(path)[nvrtc.ENTRY]
        assert res["stack"] == 0 and res["local"] == 0, (v.tag, res)
        # the launch bounds' promise: min_blocks blocks of this size fit the 64K-register file
        assert res["registers"] * v.threads * v.min_blocks <= 65536, (v.tag, res)


def test_h100_plan_at_the_aimed_for_size():
    """fp32 n = 128 on an H100: matrix in shared memory, 67.75 KiB + scratch, 3 blocks per SM;
    fp64 n = 128 fits one block; fp32 n = 240 and fp64 n = 170 take the workspace."""
    h100 = cuda.DeviceSpec.for_arch(90)
    v = cuda.variant_for(128, "float32", h100)
    assert (v.smem, v.threads, v.min_blocks) == (True, 128, 3)
    assert cuda.smem_bytes(128, "float32", True) == 4 * (128 * 129 + 6 * 128 + 64)
    assert cuda.variant_for(128, "float64", h100).smem
    assert not cuda.variant_for(240, "float32", h100).smem and cuda.variant_for(237, "float32", h100).smem
    assert not cuda.variant_for(170, "float64", h100).smem and cuda.variant_for(166, "float64", h100).smem


@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.slow), 90])  # sm_80 in the full tier
@pytest.mark.parametrize("n", [64, 128])
def test_matrix_accesses_are_shared_memory_instructions(build, arch, n):
    """The matrix pointer is known to be __shared__ at compile time: LDS/STS, never generic LD/ST."""
    _, k = _sass(build, arch, "float32", n)
    generic = {op: n for op, n in k.full_ops.items() if op.split(".")[0] in ("LD", "ST")}
    assert k.ops["LD"] == 0 and k.ops["ST"] == 0, generic
    assert k.ops["LDS"] > 100 and k.ops["STS"] > 50
    assert k.full_ops["LDS.128"] >= 3  # the Householder vectors' broadcasts (load4)


def _update_loops(k):
    """The fused rank-2 update + next p loop: innermost loops with 3 FFMAs per shared store (one
    STS per matrix element)."""
    return [lp for lp in k.innermost() if lp.ops["STS"] >= 4 and lp.ops["FFMA"] == 3 * lp.ops["STS"]]


@pytest.mark.parametrize("n", [100, 128, 200])
def test_fused_update_loop(build, n):
    """Per matrix element and reflector: 3 FMAs (two for the update, one for the next p), one
    shared load and one store of the element, 3/4 of a broadcast of u, w, u_next: 2.75 shared
    instructions and ~6.9 instructions in all, for every n now that n (and so the row stride) is
    a compile-time constant (the model in the kernel's header)."""
    _, k = _sass(build, 90, "float32", n)
    loops = _update_loops(k)
    assert loops, "no fused update loop: the tridiagonalization changed shape"
    for lp in loops:
        elems = lp.ops["STS"]
        assert (lp.ops["LDS"] + lp.ops["STS"]) / elems <= 2.75, lp.ops
        assert lp.size / elems <= 7.2, (lp.size, elems, lp.ops)  # 6.75-6.9 from NVRTC 13


def test_sturm_loop_has_no_division_slow_path(build):
    """One Sturm step: one LDS.64 of (e^2, d), one MUFU reciprocal, no IEEE division (FCHK and a
    CALL to the slow path) and no denormal fix-up, 7.3-7.9 instructions (n is known at compile time:
    the loop is unrolled; 8.25 when n was a run-time argument)."""
    _, k = _sass(build, 90, "float32", 128)
    sturm = [lp for lp in k.innermost() if lp.ops["MUFU"]]
    assert sturm, "no loop with a MUFU reciprocal: the Sturm count changed shape"
    for lp in sturm:
        steps = lp.ops["MUFU"]
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0 and lp.ops["BSSY"] == 0, lp.ops
        assert lp.ops["LDS"] == steps, lp.ops
        assert lp.size / steps <= 8.25, (lp.size, steps, lp.ops)  # 7.3 (NVRTC 13.5), 7.9 (13.0) on sm_90
    assert k.ops["FCHK"] <= 4  # the few IEEE divisions left are once per reflector, not per step


@pytest.mark.parametrize("sizes", [pytest.param((64, 128, 256), id="n64-128-256"),
                                   pytest.param((17, 100, 200), id="n17-100-200", marks=pytest.mark.slow)])
def test_every_algorithm_compiles_without_spills_within_its_launch_bounds(build, sizes):
    """Every variant the GPU kit precompiles (each algorithm of fastspec/eig/variants.py at every
    size and dtype it takes and fits on sm_90), not only the sizes each algorithm's own tests
    read: no stack, no local memory, and its registers let the launch bounds' blocks reside."""
    from fastspec.eig import precompile

    work = precompile.todo(90, list(sizes), ["float32", "float64"], ["all"])
    assert {a for *_, a in work} == {"block", "packed", "regs", "split", "newton"}
    for _, dtype, n, algo in work:
        if algo == "block":
            continue  # test_no_spills_and_registers_within_launch_bounds
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FASTSPEC_CACHE", str(build.folder))
            v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(90), algo)
            img = nvrtc.compile_variant(v, nvrtc.Target(90))
        path = build.folder / f"sm90-{v.tag}.cubin"
        path.write_bytes(img.data)
        res = resource_usage(str(path))[nvrtc.ENTRY]
        assert res["stack"] == 0 and res["local"] == 0, (v.tag, res)
        assert res["registers"] * v.threads * v.min_blocks <= 65536, (v.tag, res)
