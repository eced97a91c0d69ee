"""Every GPU generation fastspec's kernels are built for, compiled here without a GPU: sm_80 (A100),
sm_86 (RTX 30xx, A40), sm_89 (L40S, RTX 40xx), sm_90 (H100, H200), sm_100 (B200), sm_120 (RTX 50xx).

Only sm_90 has run on a GPU (docs/kernels.md, "Measured on a GPU"); every other arch is compiled
and predicted. These tests compile, for each arch, what a GPU of that arch would compile at first
use, through the paths users run, and check each kernel against its envelope, read from the
cubin (``cuobjdump -res-usage``, ``benchmarks/sass.py``):

* the CUDA eigensolver (NVRTC, :func:`fastspec.eig.nvrtc.compile_variant`) at the variant
  :func:`fastspec.eig.cuda.variant_for` plans from :meth:`~fastspec.eig.device.DeviceSpec.for_arch`:
  registers within its launch bounds (``registers · threads · min_blocks <= 65536``), dynamic plus
  static shared memory within the arch's per-block opt-in, no local memory, no stack (spills)
  but for the exceptions of :data:`EIG_SPILLS`. The fast tier: what runs by default (float32
  n = 128, :func:`~fastspec.eig.cuda.plan`'s choice); the full tier: every algorithm at float32
  n = 128 and float64 n = 64, and cuSolverDx's heev (float32 n = 128) where libmathdx is installed;
* the float64 DMMA Gram kernel (``csrc/cov_gram.cu``, :mod:`fastspec.covariance.gram_cuda`),
  D = 128 bf16 and fp64 in the fast tier (<= 128 registers for 2 blocks of 256 threads, <= 255
  for fp64's one; the blocks' shared memory on an SM; no stack, no local memory); the full tier
  adds fp16, fp32 and the narrower heads (D = 96 fits one block an SM where an SM has 100 KB:
  :data:`GRAM_ONE_BLOCK`), and finds its DMMAs in the SASS;
* the Triton kernels of ``fastspec/covariance/`` (full tier), one representative launch each, the
  settings the launcher picks by default (the empty tables of ``triton_configs.json``: each
  kernel's first candidate), compiled with the Triton wheel's ptxas in a child process
  (``tests/_sm90.py``: its helper runs any arch's script), ``compile_sm90``'s specialization
  aimed at the arch: registers <= 255 and within the warps' share of the register file, the
  launch's shared memory within the opt-in, no local memory, the dots on matrix instructions, and
  spills only where :data:`TRITON_SPILLS` bounds them. What cannot launch at all on an arch is
  listed in :data:`TRITON_BROKEN` and the test of that arch is an expected failure saying why.

An arch the installed NVRTC (or Triton's ptxas) does not know is skipped with one line saying so.
Cost on 2 cores, one process (docs/testing.md): the fast tier ~8 s (12 NVRTC compiles); the full
tier 2.5-3 min cold, the Triton compiles 13-22 s an arch of it (~2 min with Triton's cache warm;
the NVRTC compiles go to a fresh cache every run). CI's gpu-stack stage runs the module in full
under the GPU machines' NVRTC 13.0, Triton 3.6 and libmathdx (.ci/run GPU_STACK_FULL): ~2 min.
"""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from _sm90 import compiled_for_sm90

from benchmarks.sass import (  # a maintainer's tool
    disassemble,
    find_tool,
    kernels,
    resource_usage,
)
from fastspec.covariance import gram_cuda
from fastspec.eig import cuda, nvrtc, variants

ARCHES = (80, 86, 89, 90, 100, 120)
NAMES = {80: "A100", 86: "RTX 30xx, A40", 89: "L40S, RTX 40xx", 90: "H100, H200", 100: "B200", 120: "RTX 50xx"}
REGISTER_FILE = 65536  # 32-bit registers per SM, every arch here
CUOBJDUMP = find_tool("cuobjdump")
NEEDS_NVRTC = [pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}"),
               pytest.mark.skipif(CUOBJDUMP is None, reason="needs cuobjdump (CUDA toolkit or the triton wheel)")]


def per_arch(*marks):
    """One test per arch, ids ``sm80`` ... ``sm120``."""
    return pytest.mark.parametrize("arch", [pytest.param(a, id=f"sm{a}", marks=list(marks)) for a in ARCHES])


def _nvrtc_knows(arch: int) -> None:
    """Skip, in one line, where the installed NVRTC cannot generate a cubin for ``arch``."""
    known = nvrtc.supported_archs()
    if arch not in known:
        version = ".".join(map(str, nvrtc.version()))
        pytest.skip(f"NVRTC {version} cannot generate sm_{arch} code (it knows sm_{known[0]}..sm_{known[-1]})")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """Compiles once per module, in a fresh kernel cache: ``.eig(arch, dtype, n, algo)`` and
    ``.gram(arch, D, dtype)`` return ``(what, resources, path)`` of the bare cubin."""
    folder = tmp_path_factory.mktemp("arches-cache")
    made: dict[tuple, tuple] = {}

    def _compile(key: tuple, build):
        if key not in made:
            _nvrtc_knows(key[1])
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                what, img = build()
            assert img.target == nvrtc.Target(key[1]) and img.data[:4] == b"\x7fELF", img.target
            path = folder / ("-".join(map(str, key)) + ".cubin")  # the bare cubin (cache files carry a header)
            path.write_bytes(img.data)
            made[key] = what, resource_usage(str(path)), str(path)
        return made[key]

    class Cubins:
        @staticmethod
        def eig(arch: int, dtype: str, n: int, algo: str):
            def build():
                v = cuda.variant_for(n, dtype, cuda.DeviceSpec.for_arch(arch), algo)
                return v, nvrtc.compile_variant(v, nvrtc.choose_target(arch))
            return _compile(("eig", arch, dtype, n, algo), build)

        @staticmethod
        def gram(arch: int, D: int, dtype: str):
            def build():
                return None, nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(D, dtype),
                                                   gram_cuda.tag(D, dtype), nvrtc.choose_target(arch))
            return _compile(("gram", arch, D, dtype), build)

    return Cubins()


# ------------------------------------------------------------------------------- the eigensolver

# (arch, algorithm, dtype) -> stack bytes NVRTC leaves, with room: the kernel's header promises
# none (fastspec/eig/cuda.py: the launch bounds never go below an algorithm's register floor),
# and these are the exceptions, all at a 128-register cap (float32 n = 128, float64 n = 64).
# Measured (NVRTC 13.5 / 13.0, 2026-12-06): regs float32 on sm_80 none / 16 B, sm_86 and sm_89
# none / 16 B, sm_100 8 / 8 B, sm_120 16 / 8 B (2 spill stores, 2 loads); split float64 on sm_80
# 128 / 112 B (192 B of spill stores, 252 of loads); newton float64 on sm_100 8 / 8 B. None on
# sm_90, none of block and packed anywhere.
EIG_SPILLS = {(80, "regs", "float32"): 32, (86, "regs", "float32"): 32, (89, "regs", "float32"): 32,
              (100, "regs", "float32"): 16, (120, "regs", "float32"): 32,
              (80, "split", "float64"): 192, (100, "newton", "float64"): 16}
EIG_SIZES = (("float32", 128), ("float64", 64))


def _check_eig(cubins, arch: int, dtype: str, n: int, algo: str, stack: int = 0) -> dict:
    v, res, _ = cubins.eig(arch, dtype, n, algo)
    got = res[nvrtc.ENTRY]
    spec = cuda.DeviceSpec.for_arch(arch)
    assert got["local"] == 0 and got["stack"] <= stack, (f"sm_{arch}", v.tag, got)
    # the launch bounds' promise: min_blocks blocks of this size fit the register file
    assert got["registers"] * v.threads * v.min_blocks <= REGISTER_FILE, (f"sm_{arch}", v.tag, got)
    smem = cuda.smem_bytes(n, dtype, v.smem, v.algo)  # what the launch asks for (cuda.plan)
    assert smem + got["shared"] <= spec.smem_optin, (f"sm_{arch}", v.tag, smem, got)
    return got


@per_arch(*NEEDS_NVRTC)
def test_default_eigensolver_fits_its_launch_bounds(cubins, arch):
    """What a GPU of this arch runs for 4096 float32 128 x 128 matrices (the selection table's row,
    else the block algorithm) compiles within its launch bounds, without spills or local memory."""
    spec = cuda.DeviceSpec.for_arch(arch)
    p = cuda.plan(4096, 128, "float32", spec)
    assert p.variant == cuda.variant_for(128, "float32", spec, p.variant.algo)
    assert p.variant.smem, p.variant  # the matrix in shared memory on every arch here
    _check_eig(cubins, arch, "float32", 128, p.variant.algo)


# slow: 9 NVRTC compiles an arch (~5 s on 2 cores); the fast tier compiles what runs by default
@pytest.mark.slow
@per_arch(*NEEDS_NVRTC)
def test_every_eigensolver_algorithm_fits_its_launch_bounds(cubins, arch):
    """Every algorithm of fastspec/eig/variants.py at float32 n = 128 and float64 n = 64, as the
    launcher plans it on this arch (its shared memory table: 99 KB a block on sm_86/89/120, so
    fewer resident blocks and a higher register budget there)."""
    done = []
    for dtype, n in EIG_SIZES:
        for algo, a in variants.ALGORITHMS.items():
            if a.takes(n, dtype):
                _check_eig(cubins, arch, dtype, n, algo, EIG_SPILLS.get((arch, algo, dtype), 0))
                done.append((algo, dtype))
    assert len(done) == 9, done  # regs takes float32 only


# slow: cuSolverDx's heev is generated by libmathdx and linked by nvJitLink (~1 s an arch at
# float32 n = 128); only where the fastspec[mathdx] extra is installed (CI's gpu-stack stage)
@pytest.mark.slow
@per_arch(*NEEDS_NVRTC)
def test_cusolverdx_heev_fits_its_launch_bounds(tmp_path, monkeypatch, arch):
    """cuSolverDx's heev at float32 n = 128 (vendor code in fastspec's wrapper): no local memory,
    a stack of at most 16 bytes (cuSolverDx's own, tests/test_eig_mathdx.py), registers within the
    wrapper's launch bounds (:func:`fastspec.eig.mathdx.min_blocks`), shared memory within the
    opt-in."""
    from fastspec.bench.cubin import cuobjdump
    from fastspec.eig import mathdx

    why = mathdx.missing()
    if why:
        pytest.skip(f"cuSolverDx heev cannot be built here: {why}")
    _nvrtc_knows(arch)
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    spec = cuda.DeviceSpec.for_arch(arch)
    v = cuda.variant_for(128, "float32", spec, "cusolverdx")
    b = mathdx.build(128, "float32", arch)
    path = tmp_path / "heev.cubin"
    path.write_bytes(b.cubin)
    (got,) = resource_usage(str(path)).values()
    assert got["local"] == 0 and got["stack"] <= 16, got
    assert got["registers"] * b.heev.threads * b.heev.min_blocks <= REGISTER_FILE, (b.heev, got)
    assert v.threads == b.heev.threads and b.heev.smem + mathdx.STATIC_SMEM <= spec.smem_optin, b.heev
    (k,) = kernels(cuobjdump(str(path), "-sass"))
    assert k.ops["LD"] == k.ops["ST"] == 0, k.ops  # the matrix's accesses resolved to shared memory


# ------------------------------------------------------------------------------- the Gram kernel


# (arch, D, dtype) where the plan's 2 blocks per SM do not fit the SM's shared memory: D = 96
# stages 2 tiles of 32 rows x 100 doubles (50 KB) a block, and sm_86/89/120 have 100 KB an SM
# (2 x (50 KB + the driver's 1 KB) > 100 KB). One block resides, so gram_cuda.plan's one wave
# of sms x 2 blocks runs as two, with registers capped at 128 for a second block that never comes.
GRAM_ONE_BLOCK = {(a, 96, dt) for a in (86, 89, 120) for dt in ("bfloat16", "float16", "float32", "float64")}


def _check_gram(cubins, arch: int, D: int, dtype: str, sass: bool = False) -> dict:
    _, res, path = cubins.gram(arch, D, dtype)
    gram, reduce = res[gram_cuda.PROGRAM.entries[0]], res[gram_cuda.PROGRAM.entries[1]]
    for got in (gram, reduce):
        assert got["stack"] == 0 and got["local"] == 0, (f"sm_{arch}", D, dtype, got)
    blocks = gram_cuda.min_blocks(D, dtype)
    assert gram["registers"] * gram_cuda.THREADS * blocks <= REGISTER_FILE, (f"sm_{arch}", D, dtype, gram)
    assert reduce["registers"] * gram_cuda.REDUCE_THREADS <= REGISTER_FILE
    spec = cuda.DeviceSpec.for_arch(arch)
    p = gram_cuda.plan(16384, 8, D, dtype, spec.sms)
    assert p.smem + gram["shared"] <= spec.smem_optin
    # the blocks the launch bounds size registers for (and the plan's one wave counts on) fit
    # the SM's shared memory too, but where GRAM_ONE_BLOCK says they do not
    resident = spec.smem_per_sm // (p.smem + gram["shared"] + cuda.RESERVED_SMEM)
    if (arch, D, dtype) in GRAM_ONE_BLOCK:
        assert resident == 1 < blocks, (f"sm_{arch}", D, dtype, p.smem, "fits now: drop it from GRAM_ONE_BLOCK")
    else:
        assert resident >= blocks, (f"sm_{arch}", D, dtype, p.smem, resident)
    if sass:  # the float64 tensor cores: per 4-row step a warp's DMMAs (tests/test_cov_gram_cuda.py counts them)
        k = {k.name: k for k in kernels(disassemble(path))}[gram_cuda.PROGRAM.entries[0]]
        assert k.ops["DMMA"] > 0 and k.ops["LDL"] == k.ops["STL"] == k.ops["LD"] == k.ops["ST"] == 0, k.ops
    return gram


@per_arch(*NEEDS_NVRTC)
def test_gram_kernel_fits_its_launch_bounds(cubins, arch):
    """D = 128, bf16 (2 blocks of 256 threads: <= 128 registers) and fp64 (one block: <= 255);
    DMMA is sm_80 and newer, so every arch here takes it."""
    assert arch >= gram_cuda.MIN_ARCH
    assert _check_gram(cubins, arch, 128, "bfloat16")["registers"] <= 128
    assert _check_gram(cubins, arch, 128, "float64")["registers"] <= 255


# slow: 5 more NVRTC compiles an arch and their SASS (~3 s on 2 cores)
@pytest.mark.slow
@per_arch(*NEEDS_NVRTC)
def test_gram_kernel_every_input_and_head_width(cubins, arch):
    for D, dtype in [(128, "float16"), (128, "float32"), (32, "bfloat16"), (64, "bfloat16"), (96, "bfloat16")]:
        _check_gram(cubins, arch, D, dtype, sass=True)
    _check_gram(cubins, arch, 128, "bfloat16", sass=True)


# ----------------------------------------------------------------------- the Triton kernels

# The child script: compile_sm90's specialization (benchmarks/sass.py) aimed at sm_ARCH, one
# representative launch per kernel, the settings the launcher picks by default; prints one JSON
# line: {name: {regs, stack, local, spill_ops, smem, warps, mma} or {error}} or {"skip": why}.
_SCRIPT = r"""
import json, subprocess, sys
import torch, triton
import triton.backends.compiler as backend
from benchmarks.sass import compile_sm90, triton_cubin
from fastspec.covariance import triton_configs as TC, triton_exact as E, triton_kernels as K
from fastspec.covariance import triton_presplit as P, triton_update as tu
from fastspec.eig.device import DeviceSpec

try:  # which ptxas Triton runs for this arch, and whether it knows it
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    ptxas, name = get_ptxas(ARCH), sm_arch_from_capability(ARCH)
    usage = subprocess.run([ptxas.path, "--help"], capture_output=True, text=True).stdout
    if f"'{name}'" not in usage:
        print(json.dumps({"skip": f"Triton {triton.__version__}'s ptxas {ptxas.version} does not know {name}"}))
        sys.exit(0)
except ImportError:
    pass

GPUTarget = backend.GPUTarget
out = {}

def build(name, fn, types, consts, warps, stages=3, **spec):
    backend.GPUTarget = lambda b, arch, warp_size: GPUTarget(b, ARCH, warp_size)  # compile_sm90 aimed at ARCH
    try:
        k = compile_sm90(fn, types, consts, warps, stages, **spec)
    except Exception as exc:
        out[name] = {"error": (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]}
        return
    finally:
        backend.GPUTarget = GPUTarget
    res, kernel = triton_cubin(k.asm["cubin"])
    out[name] = {"regs": res["registers"], "stack": res["stack"], "local": res["local"],
                 "spill_ops": kernel.ops["LDL"] + kernel.ops["STL"], "smem": k.metadata.shared,
                 "warps": warps, "stages": stages, "mma": {op: n for op, n in kernel.ops.items() if "MMA" in op}}

# triton_kernels.py, as triton_update.py launches them: keys [8, 2048, 8, 128] bf16 (raw sums:
# what keys run where float64 is not full rate; centred), an FFN input D = 2048 centred (the
# eig convention), the centre, the row pre-pass and the split sum
ptrs = {"p_mask": "*u8", "p_status": "*i8", "p_c": "*fp32", "p_G": "*fp32", "p_s": "*fp32", "p_n": "*i32",
        "p_rej": "*i32"}
spec = dict(ones=("stride_xd", "stride_mt", "ROW_STEP"),
            div16=("p_x", "p_mask", "p_status", "p_c", "p_G", "p_s", "p_n", "p_rej", "N", "Tk", "D", "RPS",
                   "stride_xb", "stride_xt", "stride_xs", "stride_mb"))
for name, kernel, D, center in (("keys-raw", "keys", 128, False), ("keys-centred", "keys", 128, True),
                                ("ffn-centred", "ffn", 2048, True)):
    cand, _ = TC.choose(kernel, ARCH, torch.bfloat16, center)
    cfg = tu.launch_config(8 * 2048, 8, D, torch.device("cpu"), 2, split=16, candidate=cand)
    consts = dict(HAS_MASK=True, FUSED_STATUS=cfg.NTILE == 1, CENTER=center, SPLIT_BF16=center, UPCAST=False,
                  PRECISION="ieee", ACC=tu.block_accumulation(True), NTILE=cfg.NTILE, TK_GE_BT=True, BT=cfg.BT,
                  BD=cfg.BD, LOLO=cfg.lolo, UNROLL=1 if center else cfg.unroll)
    build(name, K._cov_partials_kernel, {"p_x": "*bf16", **ptrs}, consts, cfg.num_warps, cfg.num_stages, **spec)
    out[name]["config"] = cand.name
build("center", K._center_kernel, {"p_x": "*bf16", **ptrs},
      dict(HAS_MASK=True, ROUND_TO_INPUT=True, NC=tu.CENTER_ROWS, BD=64), 4)
build("row-status", K._row_status_kernel, {"p_x": "*bf16", **ptrs}, dict(HAS_MASK=True, BT=64, BD=128), 8)
build("finish", K._finish_kernel, {"p_Gw": "*fp32", "p_sw": "*fp32", "p_cnt": "*i32", "p_status": "*i8",
                                   "p_G": "*fp32", "p_s": "*fp32", "p_c": "*fp32", "p_nr": "*i64"},
      dict(FROM_STATUS=False, ZERO_C=True, BR=tu.FINISH_BR, BK=tu.FINISH_BK, BN=tu.FINISH_BN), 4)

# triton_presplit.py: the first pre-split candidate (what a race may pick for FFN inputs), its
# stages capped by the arch's shared memory as the launcher caps them
types = {"p_x": "*bf16", "p_status": "*i8", "p_c": "*fp32", "p_hi": "*bf16", "p_lo": "*bf16", "p_sum": "*fp32",
         "p_G": "*fp32"}
spec = dict(ones=("stride_xd", "ROW_STEP"), stride_type="i32",
            div16=("p_x", "p_status", "p_c", "p_hi", "p_lo", "p_sum", "p_G", "N", "Tk", "D", "NR", "r_start",
                   "stride_xb", "stride_xt", "stride_xs", "stride_ws", "stride_wr", "stride_pk", "stride_ps"))
cand = next(c for c in TC.CANDIDATES["ffn"] if c.presplit)
stages = P._gram_stages(cand.num_stages, cand.BT, 1 << 20, DeviceSpec.for_arch(ARCH).smem_optin)
build("presplit-gram", P._gram_presplit_kernel, types, dict(UPCAST=False, LOLO=cand.lolo, ACCUM=False, BT=cand.BT,
                                                            BD=P.BD), cand.num_warps, stages, **spec)
out["presplit-gram"]["config"] = cand.name
build("presplit-rows", P._split_rows_kernel, types, dict(ROWS=P.SPLIT_ROWS, BT=P.SPLIT_BT, BD=P.BD), P.SPLIT_WARPS, 3,
      **spec)

# triton_exact.py at the keys shape: the prep_gemm route's kernels, and triton_f64's where this
# Triton compiles a float64 dot (3.6 aborts the process: triton_exact._f64_dot_reason)
types = {"p_x": "*bf16", "p_mask": "*u8", "p_rows": "*fp64", "p_sp": "*fp64", "p_cnt": "*i32", "p_Gp": "*fp64",
         "p_G": "*fp64", "p_s": "*fp64", "p_c": "*fp64", "p_n": "*i64", "p_rej": "*i64"}
spec = dict(ones=("stride_xd", "stride_mt", "ROW_STEP"),
            div16=("p_x", "p_mask", "p_rows", "p_sp", "p_cnt", "p_Gp", "p_G", "p_s", "p_c", "p_n", "p_rej", "NC", "N",
                   "Tk", "D", "RPS", "RPP", "KS", "stride_xb", "stride_xt", "stride_xs", "stride_mb"))
BD, BT, warps = E._prep_config(128)
build("exact-prep", E._prep_rows_kernel, types, dict(HAS_MASK=True, ROWS64=False, BT=BT, BD=BD), warps, 3, **spec)
build("exact-finish", E._finish_kernel, types, dict(BR=E.FINISH_BR, BK=E.FINISH_BK, ACC=True), 4, 3, **spec)
if E._f64_dot_reason(triton.__version__) == "":
    BC, NT, BT, warps, _, _ = E._f64_config(8 * 2048, 8, 128)
    build("exact-f64", E._gram_f64_kernel, types, dict(HAS_MASK=True, ROWS64=False, HALVES=NT, BT=BT, BC=BC), warps, 1,
          **spec)
    BC, NT, BT, warps, _, _ = E._f64_config(8 * 2048, 8, 256)
    build("exact-f64-tiled", E._gram_f64_tiled_kernel, types, dict(HAS_MASK=True, ROWS64=False, NT=NT, BT=BT, BC=BC),
          warps, 1, **spec)
print(json.dumps({"triton": triton.__version__, "kernels": out}))
"""

TRITON_KERNELS = ("keys-raw", "keys-centred", "ffn-centred", "center", "row-status", "finish",  # triton_kernels.py
                  "presplit-gram", "presplit-rows",  # triton_presplit.py
                  "exact-prep", "exact-finish", "exact-f64", "exact-f64-tiled")  # triton_exact.py
DOTS = {"keys-raw", "keys-centred", "ffn-centred", "presplit-gram"}  # 16-bit dots: on the tensor cores


def _spills(stack: int, ops: int, *arches: int, kernel: str) -> dict:
    return {(a, kernel): (stack, ops) for a in arches}


# (arch, kernel) -> (stack bytes, spill instructions) ptxas leaves in Triton's cubin, with room;
# every other kernel spills nothing. Measured (Triton 3.9 / 3.6, 2026-12-06): the centred keys
# kernel 432-512 B, 324-369 ops / 440-552 B, 390-399 ops on sm_80/86/89/120 (the hi + lo split's
# four mma.sync dots: sm_90's wgmma and sm_100's tcgen05 keep the tiles out of registers, none);
# the centred FFN kernel 1,712-1,784 B, 922-1,184 ops / 1,720-1,784 B, 888-1,159 ops at 128
# registers there, 16 B and 10 ops / none on sm_90 (tests/test_covariance_triton.py's
# KNOWN_SPILLS); the pre-split Gram on sm_80 (2 stages) 2,032 B / 2,104 B, on sm_86/89/120 (1
# stage) none or 96 B / 96 B; triton_f64's dot on sm_86/89/120, where Triton 3.9 emits no DMMA
# (the FMA units), 344-368 B, 214-231 ops.
TRITON_SPILLS = {
    **_spills(640, 512, 80, 86, 89, 120, kernel="keys-centred"),
    **_spills(2240, 1536, 80, 86, 89, 120, kernel="ffn-centred"),
    **_spills(32, 24, 90, kernel="ffn-centred"),
    **_spills(2688, 1664, 80, kernel="presplit-gram"),
    **_spills(128, 96, 86, 89, 120, kernel="presplit-gram"),
    **_spills(512, 320, 86, 89, 120, kernel="exact-f64"),
}

class Broken(NamedTuple):
    """A launch that cannot run on an arch: ``what`` fails (``_envelope``'s kind), under which
    Triton versions (``"3.6"``; None: any), and why."""

    what: str
    versions: tuple[str, ...] | None
    why: str


# (arch, kernel) -> Broken. Each makes its arch's test an expected failure, once every other
# check has passed; anything else outside the envelope fails the test.
_SMEM_99K = Broken("smem", None, "the default FFN setting f64w8s3 (64-row blocks, 3 stages) needs 112 KB of "
                                 "shared memory and a block gets 99 KB: it cannot launch (f32w8s3, 32-row blocks, "
                                 "needs 64 KB)")
TRITON_BROKEN = {
    (86, "ffn-centred"): _SMEM_99K, (89, "ffn-centred"): _SMEM_99K, (120, "ffn-centred"): _SMEM_99K,
    (100, "keys-raw"): Broken("error", None, "Triton 3.6 and 3.9 fail to compile the uncentred keys kernel for "
                                             "sm_100 (the TritonGPUHoistTMEMAlloc pass; the unrolled candidates "
                                             "k32w8s2-u2 and k32w8s3-u2 compile)"),
    (100, "presplit-gram"): Broken("smem", ("3.6",), "Triton 3.6 gives the pre-split Gram 320 KB of shared memory "
                                                     "on sm_100 at 3 stages (3.9: 128 KB); a block gets 227 KB"),
}


def _triton_compiled(arch: int) -> dict:
    """``{"triton": version, "kernels": {...}}`` of :data:`_SCRIPT` for ``arch``, compiled in a
    child process with the interpreter off (:func:`_sm90.compiled_for_sm90`); skips where this
    Triton's ptxas does not know the arch."""
    out = compiled_for_sm90(f"ARCH = {arch}\n" + _SCRIPT)
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def _envelope(arch: int, name: str, got: dict) -> tuple[str, str]:
    """``(kind, text)`` of the first way ``got`` is outside its envelope on ``arch``, ``("", "")``
    when it is inside."""
    if "error" in got:
        return "error", got["error"]
    optin = cuda.DeviceSpec.for_arch(arch).smem_optin
    if got["smem"] > optin:
        return "smem", f"{got['smem']} bytes of shared memory, a block gets {optin}"
    if got["regs"] > min(255, REGISTER_FILE // (32 * got["warps"])):
        return "regs", f"{got['regs']} registers at {got['warps']} warps"
    stack, ops = TRITON_SPILLS.get((arch, name), (0, 0))
    if got["local"] or got["stack"] > stack or got["spill_ops"] > ops:
        return "spills", f"stack {got['stack']} B, {got['spill_ops']} spill instructions, local {got['local']} B"
    if name in DOTS and not got["mma"]:
        return "mma", "the dots are not on matrix instructions"
    return "", ""


# slow: the Triton kernels compiled for the arch, ~15 s on 2 cores with a cold Triton cache (one
# child process); the full tier runs it, and CI's gpu-stack stage under the GPU machines' Triton
# (.ci/run GPU_STACK_FULL). One test an arch, not one per kernel family: no compile is shared
# between tests, so workers that split the module (gpu-stack's --dist worksteal) compile nothing twice.
@pytest.mark.slow
@per_arch()
def test_triton_kernels_fit(arch):
    """The float32 update (triton_kernels.py): keys raw and centred (``k32w8s3``), an FFN input
    centred (``f64w8s3``), the centre, the row pre-pass and the split sum; the pre-split FFN Gram
    (triton_presplit.py, ``f64w8s3-pre``, its stages capped by the arch's shared memory: 3 on
    sm_90/100, 2 on sm_80, 1 on sm_86/89/120) and its row pre-pass; the exact routes' kernels
    (triton_exact.py): prep_gemm's rows and finish, triton_f64's float64 dot where this Triton
    compiles one (on DMMA where float64 runs at full rate). Every kernel within its envelope
    (:func:`_envelope`) but the launches :data:`TRITON_BROKEN` names, which make the test an
    expected failure once everything else has passed."""
    out = _triton_compiled(arch)
    version = ".".join(out["triton"].split(".")[:2])
    got = out["kernels"]
    unexpected, known = [], []
    for name in TRITON_KERNELS:
        if name not in got:
            assert name.startswith("exact-f64"), (name, sorted(got))  # only where this Triton compiles a float64 dot
            continue
        kind, text = _envelope(arch, name, got[name])
        if not kind:
            continue
        broken = TRITON_BROKEN.get((arch, name))
        if broken is not None and broken.what == kind and (broken.versions is None or version in broken.versions):
            known.append(f"{name}: {broken.why}")
        else:
            unexpected.append(f"sm_{arch} {name}: {text} ({got[name]})")
    assert got["keys-raw"]["config"] == "k32w8s3" and got["ffn-centred"]["config"] == "f64w8s3", got
    optin = cuda.DeviceSpec.for_arch(arch).smem_optin
    assert got["presplit-gram"]["stages"] == min(3, optin // (4 * 64 * 128 * 2)), got["presplit-gram"]
    if "exact-f64" in got and arch in (80, 90, 100):
        assert got["exact-f64"]["mma"].get("DMMA", 0) > 0, got["exact-f64"]
    assert not unexpected, f"Triton {out['triton']}:\n" + "\n".join(unexpected)
    if known:
        pytest.xfail(f"Triton {out['triton']} on sm_{arch}: " + "; ".join(known))


# ------------------------------------------------------------------------------------ the docs


def test_the_docs_say_what_runs_by_default_on_every_arch():
    """docs/kernels.md's "Every GPU generation": its two tables have a row per arch, the first
    naming the GPUs and the eigensolver's default algorithm for 4096 float32 128 x 128 matrices
    (the selection table's, else block), the second the default variant's algorithm again; the
    section names the Triton kernels' default settings (the empty triton_configs table: each
    kernel's first candidate)."""
    from pathlib import Path

    from fastspec.covariance import triton_configs

    text = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    section = text.split("\n## Every GPU generation\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| sm_"):
            rows.setdefault(line.split("|")[1].strip(), []).append(line)
    assert sorted(rows) == sorted(f"sm_{a}" for a in ARCHES), sorted(rows)
    for arch in ARCHES:
        assert len(rows[f"sm_{arch}"]) == 2, rows[f"sm_{arch}"]
        default, measured = rows[f"sm_{arch}"]
        v, _ = cuda.choose_variant(4096, 128, "float32", cuda.DeviceSpec.for_arch(arch))
        assert NAMES[arch] in default and f"`{v.algo}`" in default, (arch, v.algo, default)
        assert measured.split("|")[2].strip().startswith(f"`{v.algo}`"), (arch, v.algo, measured)
        for kernel in triton_configs.KERNELS:
            cand, _ = triton_configs.choose(kernel, arch, torch.bfloat16, kernel == "ffn")
            assert f"`{cand.name}`" in section, (arch, cand.name)
