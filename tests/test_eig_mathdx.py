"""NVIDIA cuSolverDx's ``heev`` as the eigensolver's ``cusolverdx`` algorithm (fastspec/eig/mathdx.py,
csrc/cusolverdx_heev.cu): code generation by libmathdx, the wrapper compiled by NVRTC to LTO IR,
the link by nvJitLink, all on CPU for sm_90; the cache; the launcher's plan and launch against the
stand-in driver; the selection table and the override; and, without the ``fastspec[mathdx]``
extra, that everything else runs and says why it is absent. The GPU test checks it against float64.
"""
from __future__ import annotations

import re

import pytest
import torch

import _fake_gpu
from fastspec.bench.cubin import cuobjdump, find_tool, instructions
from fastspec.eig import cuda, mathdx, nvrtc, precompile, variants

WHY = mathdx.missing()
NEEDS = pytest.mark.skipif(bool(WHY), reason=f"cuSolverDx heev cannot be built here: {WHY}")
# the race's problems (benchmarks/eig_race.py SHAPES) and the bench's sizes
RACE = [(128, "float32"), (128, "float64"), (256, "float32"), (64, "float32")]
EVERY = [(n, d) for n in (64, 128, 256) for d in ("float32", "float64")]


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A private, empty kernel cache and nothing built in this process."""
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    mathdx.forget()
    nvrtc.forget()
    yield tmp_path / "cache" / "eig"
    mathdx.forget()


# --- code generation and the link (CPU, sm_90) ----------------------------------------------------


@NEEDS
@pytest.mark.parametrize("n,dtype", EVERY)
def test_describes_every_size_the_race_and_bench_use(n, dtype):
    h = mathdx.describe(n, dtype, 90)
    assert (h.n, h.dtype, h.arch) == (n, dtype, 90)
    assert h.threads % 32 == 0 and 32 <= h.threads <= 1024
    assert h.per_block >= 1 and h.workspace > 0
    assert re.fullmatch(r"[A-Za-z_]\w*", h.symbol)
    item = 4 if dtype == "float32" else 8
    assert h.smem == item * (h.per_block * (n * n + n) + h.workspace) + 4 * h.per_block
    assert mathdx.describe(n, dtype, 90) is h  # kept per process


def _res_usage(cubin: bytes, tmp_path) -> dict[str, int]:
    path = tmp_path / "heev.cubin"
    path.write_bytes(cubin)
    text = cuobjdump(str(path), "-res-usage")
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}


@NEEDS
@pytest.mark.parametrize("n,dtype", RACE)
def test_links_a_cubin_for_sm90_without_local_memory(n, dtype, kernel_cache, tmp_path):
    b = mathdx.build(n, dtype, 90)
    assert b.origin == "built" and b.cubin[:4] == b"\x7fELF"
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump: not on PATH and not in the Triton wheel")
    use = _res_usage(b.cubin, tmp_path)
    # no local memory at all; cuSolverDx keeps a small stack at fp32 n = 128 (16 bytes, 0.6.0) and
    # 496 bytes at n = 256 (where 255 registers do not hold it); its 1024 bytes of static shared memory
    assert use["LOCAL"] == 0
    assert use["SHARED"] <= mathdx.STATIC_SMEM
    assert b.registers == use["REG"]
    sass = cuobjdump(str(tmp_path / "heev.cubin"), "-sass")
    ops = [op.split(".")[0] for _, op, _ in instructions(sass)[mathdx.ENTRY]]
    # every access to the matrix, eigenvalues and workspace resolved to shared memory (the wrapper
    # hands generic pointers into its shared array): no generic LD/ST
    assert "LD" not in ops and "ST" not in ops and ops.count("LDS") > 100
    if (n, dtype) == (128, "float32"):  # the layout chosen for it (csrc/cusolverdx_heev.cu): 128, not 171-176
        assert use["REG"] <= 128 and use["STACK"] <= 16
        assert ops.count("LDL") + ops.count("STL") <= 8  # cuSolverDx's 16-byte stack frame, 3 + 3 at 0.6.0
    if (n, dtype) == (128, "float64"):
        assert use["STACK"] == 0 and "LDL" not in ops and "STL" not in ops


@NEEDS
def test_the_wrapper_takes_fastspec_eigvalsh_parameter_block(kernel_cache):
    """Three pointers and five 64-bit integers, in cuda.PARAMS's order: the launcher packs both alike."""
    h = mathdx.describe(128, "float32", 90)
    nv = nvrtc.binding("nvrtc")
    src = nvrtc.sources(mathdx.WRAPPER)[mathdx.WRAPPER.source]
    prog = nvrtc.unpack(nv.nvrtcCreateProgram(src.encode(), b"w.cu", 0, [], []), "create")
    opts = [o.encode() for o in ("--gpu-architecture=compute_90", "-rdc=true", *h.defines())]
    assert int(nv.nvrtcCompileProgram(prog, len(opts), opts)[0]) == 0
    ptx = bytearray(nvrtc.unpack(nv.nvrtcGetPTXSize(prog), "size"))
    nvrtc.unpack(nv.nvrtcGetPTX(prog, ptx), "ptx")
    nv.nvrtcDestroyProgram(prog)
    text = bytes(ptx).decode()
    entry = text[text.index(f".entry {mathdx.ENTRY}"):]
    params = re.findall(r"\.param \.(\w+) \w+", entry[:entry.index(")")])
    assert params == ["u64"] * 8
    assert cuda.PARAMS.size == 64


@NEEDS
def test_cache_hit_tamper_and_key(kernel_cache, monkeypatch):
    first = mathdx.build(64, "float32", 90)
    assert first.origin == "built" and first.path is not None and first.path.exists()
    mathdx.forget()
    again = mathdx.build(64, "float32", 90)
    assert again.origin == "disk" and again.cubin == first.cubin and again.heev == first.heev
    assert mathdx.build(64, "float32", 90).origin == "memory"
    # a torn file is built again and replaced
    mathdx.forget()
    first.path.write_bytes(first.path.read_bytes()[:-100])
    assert mathdx.build(64, "float32", 90).origin == "built"
    # the wrapper's source is in the key
    real = nvrtc.sources

    def edited(program=nvrtc.EIGVALSH):
        src = real(program)
        return {k: v + "\n// edited\n" for k, v in src.items()} if program is mathdx.WRAPPER else src

    monkeypatch.setattr(nvrtc, "sources", edited)
    mathdx.forget()
    assert mathdx.build(64, "float32", 90).origin == "built"


@NEEDS
def test_precompile_builds_it_by_name(kernel_cache):
    assert (90, "float32", 128, "cusolverdx") in precompile.todo(90, [128], ["float32"], ["cusolverdx"])
    # float32 n = 256 needs 273 KB of shared memory: not for sm_90
    assert precompile.todo(90, [256], ["float32"], ["cusolverdx"]) == []
    tag, origin, _ = precompile.precompile(90, [128], ["float32"], algos=["cusolverdx"])[0]
    assert tag == "cusolverdx-float32-n128" and origin == "nvrtc"
    assert precompile.precompile(90, [128], ["float32"], algos=["cusolverdx"])[0][1] in ("disk", "memory")
    # 'all' stays fastspec's own algorithms
    assert all(a != "cusolverdx" for *_, a in precompile.todo(90, [128], ["float32"], ["all"]))


# --- the launcher, the table, the override (stand-in driver) --------------------------------------


@NEEDS
@pytest.mark.parametrize("n,batch", [(128, 3), (32, 5)])
def test_forced_launch_loads_the_linked_cubin(n, batch, kernel_cache, monkeypatch):
    drv = _fake_gpu.install(monkeypatch, n)
    monkeypatch.setenv(variants.ENV, "cusolverdx")
    h = mathdx.describe(n, "float32", 90)
    A = torch.randn(batch, n, n, dtype=torch.float64)
    A = (A + A.mT).float()
    out = torch.empty(batch, n)
    status = torch.zeros(batch, dtype=torch.int32)
    cuda.launch(A, out, algo="cusolverdx", status=status)
    assert drv.loaded == [b"\x7fELF"]
    launch = drv.launches[-1]
    assert launch["kernel"] == ("kernel", mathdx.ENTRY.encode())
    assert launch["grid"] == (-(-batch // h.per_block), 1, 1) and launch["block"] == (h.threads, 1, 1)
    assert launch["smem"] == h.smem == drv.attributes["max_dynamic_smem"]
    assert launch["work"] == status.data_ptr()  # the third pointer: the status words
    # through the table's choice (the override), with no status
    p = cuda.plan(batch, n, "float32", _fake_gpu.H100)
    assert p.variant.algo == "cusolverdx" and "forced" in p.why
    cuda.launch(A, out)
    assert drv.launches[-1]["kernel"] == ("kernel", mathdx.ENTRY.encode()) and drv.launches[-1]["work"] == 0


def test_status_is_for_cusolverdx_only():
    A, out = torch.zeros(2, 4, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="status: a contiguous int32"):
        cuda.launch(A, out, algo="packed", status=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="status: a contiguous int32"):
        cuda.launch(A, out, algo="cusolverdx", status=torch.zeros(3, dtype=torch.int32))


def test_table_rows_and_override_name_it():
    row = variants.Row(90, "float32", 97, 128, 1, None, "cusolverdx")
    variants.check_rows([row])
    got = variants.choose(90, "float32", 128, 4096, [row])
    assert [c.algo for c in got] == ["cusolverdx", "block"]
    assert variants.choose(90, "float16", 128, 4096, [row])[0].algo == "block"
    with pytest.raises(ValueError, match="algo must be one of"):
        variants.check_rows([variants.Row(90, "float32", 1, 8, 1, None, "heevx")])


def test_without_the_extra_the_choice_falls_back(monkeypatch):
    """No libmathdx: a row or the override naming cusolverdx is passed over, with the reason."""
    monkeypatch.setattr(mathdx, "distribution", lambda: None)
    why = mathdx.missing()
    assert "fastspec[mathdx]" in why
    with pytest.raises(ValueError, match="cannot be built here"):
        cuda.variant_for(128, "float32", _fake_gpu.H100, "cusolverdx")
    monkeypatch.setenv(variants.ENV, "cusolverdx")
    monkeypatch.setattr(variants, "_rows", [[]])
    v, reason = cuda.choose_variant(4096, 128, "float32", _fake_gpu.H100)
    assert v.algo == "block" and "not cusolverdx" in reason
    with pytest.raises(nvrtc.KernelUnavailable, match="not installed"):
        mathdx.build(128, "float32", 90)
    assert mathdx.info()["available"] is False


@NEEDS
def test_too_large_for_shared_memory_is_refused_by_name():
    with pytest.raises(ValueError, match="bytes of shared memory"):
        cuda.variant_for(256, "float32", _fake_gpu.H100, "cusolverdx")


# --- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS
@pytest.mark.parametrize("n,dtype,batch", [(128, torch.float32, 37), (128, torch.float64, 5), (64, torch.float32, 9),
                                           (32, torch.float32, 7)])
def test_matches_float64_on_gpu(n, dtype, batch):
    from fastspec.bench.suites.eigvalsh import powerlaw_gram

    A = powerlaw_gram(batch, n, torch.device("cuda"), dtype)
    A[1, 3, 0] = float("nan")  # the lower triangle: that matrix's row is NaN, its status -1
    A[2, 0, 3] = float("nan")  # the upper triangle is never read
    out = torch.empty(batch, n, dtype=dtype, device="cuda")
    status = torch.full((batch,), 99, dtype=torch.int32, device="cuda")
    cuda.launch(A, out, algo="cusolverdx", status=status)
    torch.cuda.synchronize()
    st = status.cpu()
    assert st[1] == -1 and torch.isnan(out[1]).all()
    keep = [i for i in range(batch) if i != 1]
    assert (st[keep] == 0).all()
    Al = torch.tril(A[keep].double().cpu())
    ref = torch.linalg.eigvalsh(Al + torch.tril(Al, -1).mT)
    err = (out[keep].double().cpu() - ref).abs().max() / ref.abs().max()
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # a few eps32 x n: Householder + QR, not our bisection
    assert err < tol, f"relative error {err:.3g}"
