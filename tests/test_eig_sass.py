"""The CUDA eigensolver (csrc/eig_cuda.cu) compiled for sm_90 without a GPU: registers, spills and
the SASS instruction mix that the cost model in the kernel's header is built on.

nvcc compiles the kernel exactly as setup.py does (``-O3``, sm_90); ``cuobjdump -sass`` (on PATH
or in the Triton wheel) disassembles it and :mod:`fastspec.bench.sass` counts instructions per
loop iteration. Nothing runs. Bounds sit a little above what nvcc 13.0 produces, so a compiler
update passes and a code change that brings back generic pointers, spills, the IEEE division's
slow path or a serialized update loop fails.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fastspec.bench.sass import disassemble, find_tool, kernels, parse_ptxas

ROOT = Path(__file__).resolve().parent.parent
NVCC, CUOBJDUMP = find_tool("nvcc"), find_tool("cuobjdump")

pytestmark = pytest.mark.skipif(NVCC is None or CUOBJDUMP is None,
                                reason="needs nvcc and cuobjdump (CUDA toolkit or the triton wheel)")


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    cubin = tmp_path_factory.mktemp("sass") / "eig.cubin"
    proc = subprocess.run([NVCC, "-std=c++17", "-O3", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v",
                           "-I", str(ROOT / "csrc"), "-cubin", "-o", str(cubin), str(ROOT / "csrc" / "eig_cuda.cu")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resources = parse_ptxas(proc.stdout + proc.stderr)
    sass = {k.name: k for k in kernels(disassemble(str(cubin)))}
    return resources, sass


def _name(names, real: str, smem: bool) -> str:
    tag = f"eigvalsh_batched_kernelI{real}Lb{int(smem)}E"
    (hit,) = [n for n in names if tag in n]
    return hit


VARIANTS = [("f", True), ("f", False), ("d", True), ("d", False)]


@pytest.mark.parametrize("real,smem", VARIANTS, ids=["fp32-smem", "fp32-global", "fp64-smem", "fp64-global"])
def test_no_spills(sm90, real, smem):
    resources, _ = sm90
    res = resources[_name(resources, real, smem)]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res


def test_fp32_register_budget_allows_three_blocks(sm90):
    # 3 resident blocks of up to 256 threads (the shared-memory bound at n = 128) need <= 85
    # registers per thread in the 64K-register file (allocated in units of 8: <= 80)
    resources, _ = sm90
    assert resources[_name(resources, "f", True)]["registers"] <= 80


def test_matrix_accesses_are_shared_memory_instructions(sm90):
    """The matrix pointer is known to be __shared__ at compile time: LDS/STS, never generic LD/ST."""
    _, sass = sm90
    k = sass[_name(sass, "f", True)]
    assert k.ops["LD"] == 0 and k.ops["ST"] == 0, {op: k.full_ops[op] for op in k.full_ops if op.split(".")[0] in ("LD", "ST")}
    assert k.ops["LDS"] > 100 and k.ops["STS"] > 50
    assert k.full_ops["LDS.128"] >= 3  # the Householder vectors' broadcasts (load4)


def _update_loops(k):
    """The fused rank-2 update + next p loops: innermost loops with 3 FFMAs per shared store (one
    STS per matrix element). The generic one and the n = 128 one (constant row stride)."""
    return [lp for lp in k.innermost() if lp.ops["STS"] >= 4 and lp.ops["FFMA"] == 3 * lp.ops["STS"]]


def test_fused_update_loop(sm90):
    """Per matrix element and reflector: 3 FMAs (two for the update, one for the next p), one
    shared load and one store of the element, 3/4 of a broadcast of u, w, u_next: 2.75 shared
    instructions, ~8 instructions in all, ~7.4 with n = 128's constant row offsets (the model
    in the eig_cuda.cu header)."""
    _, sass = sm90
    loops = _update_loops(sass[_name(sass, "f", True)])
    assert len(loops) >= 2, "expected a generic and an n = 128 fused update loop"
    per_elem = []
    for lp in loops:
        elems = lp.ops["STS"]
        assert (lp.ops["LDS"] + lp.ops["STS"]) / elems <= 2.75, lp.ops
        per_elem.append(lp.size / elems)
    assert max(per_elem) <= 9.0 and min(per_elem) <= 7.6, per_elem


def test_sturm_loop_has_no_division_slow_path(sm90):
    """One Sturm step: one LDS.64 of (e^2, d), one MUFU reciprocal, no IEEE division (FCHK and a
    CALL to the slow path) and no denormal fix-up, about 8 instructions."""
    _, sass = sm90
    k = sass[_name(sass, "f", True)]
    sturm = [lp for lp in k.innermost() if lp.ops["MUFU"]]
    assert sturm, "no loop with a MUFU reciprocal: the Sturm count changed shape"
    for lp in sturm:
        steps = lp.ops["MUFU"]
        assert lp.ops["FCHK"] == 0 and lp.ops["CALL"] == 0 and lp.ops["BSSY"] == 0, lp.ops
        assert lp.ops["LDS"] == steps, lp.ops
        assert lp.size / steps <= 9.0, (lp.size, steps, lp.ops)
    assert k.ops["FCHK"] <= 4  # the few IEEE divisions left are once per reflector, not per step
