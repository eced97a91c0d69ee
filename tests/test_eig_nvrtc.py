"""The CUDA eigensolver's run-time build (fastspec/eig/nvrtc.py) and launcher (fastspec/eig/cuda.py)
on a machine without a GPU: NVRTC compiles for real; the driver is a stand-in that runs the host
twin on the pointers and strides the launcher packed, so the launch arguments are checked for what
they do, not only for their shape.

The cache: a hit on the second call, a corrupt file compiled again, an unwritable folder kept in
memory, processes compiling at once, a compile error with its log on disk (the cache's privacy
rules: tests/test_kernel_cache.py). The fallbacks: no
binding, no NVRTC, a GPU newer than NVRTC knows (PTX), an old driver. Timings are in the
benchmark (``fastspec bench --suite eigvalsh``, case ``nvrtc-compile``), not here.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import re
import sys
import types
from pathlib import Path

import _fake_gpu
import numpy as np
import pytest
import torch
from _fake_gpu import FakeDriver

import fastspec
from fastspec.eig import cuda, dispatch, limits, native, nvrtc, precompile
from fastspec.eig.matrices import make_batch
from fastspec.eig.reference import eigvalsh_reference

needs_nvrtc = pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}")
needs_ext = pytest.mark.skipif(native._ext is None, reason="host-twin extension not built")
H100 = cuda.DeviceSpec.for_arch(90)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty kernel cache for the test, nothing kept in memory."""
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    nvrtc.forget()
    yield tmp_path / "cache" / "eig"
    nvrtc.forget()


def _v128():
    return cuda.variant_for(128, "float32", H100)


# ------------------------------------------------------------------------------------ the cache


@needs_nvrtc
def test_compiles_for_sm90_then_hits_the_disk_cache(cache):
    first = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    assert first.origin == "nvrtc" and first.data[:4] == b"\x7fELF" and first.path.parent == cache
    assert first.path.name.startswith("eigvalsh-float32-n128-smem-t128-b3-sm_90-")
    assert [p.name for p in cache.iterdir()] == [first.path.name]  # no temporary file left behind
    assert (cache.stat().st_mode & 0o777, first.path.stat().st_mode & 0o777) == (0o700, 0o600)  # private
    assert nvrtc.compile_variant(_v128(), nvrtc.Target(90)).origin == "memory"
    # NVRTC's one-byte log was once written into the interpreter's shared b" " (which then broke
    # torch.save far away): output buffers must be the caller's own
    space = bytes([0x20])  # built at run time: the interpreter's one-byte object, not a folded constant
    assert space[0] == 0x20 and space.decode() == " "
    nvrtc.forget()  # a new process: the image comes from disk, byte for byte
    second = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    assert second.origin == "disk" and second.data == first.data and second.path == first.path


@needs_nvrtc
def test_key_covers_variant_target_options_and_sources(cache, monkeypatch):
    paths = {nvrtc.compile_variant(v, t, extra).path for v, t, extra in [
        (_v128(), nvrtc.Target(90), ()),
        (_v128(), nvrtc.Target(80), ()),
        (cuda.variant_for(128, "float64", H100), nvrtc.Target(90), ()),
        (_v128(), nvrtc.Target(90), ("-DFS_UNUSED=1",)),
    ]}
    assert len(paths) == 4
    src = nvrtc.sources()
    monkeypatch.setattr(nvrtc, "sources", lambda *_: {**src, "eig_core.h": src["eig_core.h"] + "\n// edited\n"})
    nvrtc.forget()
    again = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    assert again.origin == "nvrtc" and again.path not in paths  # an edited header is a new key


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_corrupt_cache_file_is_compiled_again(cache, caplog, damage):
    good = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    blob = good.path.read_bytes()
    bad = {"truncate": blob[: len(blob) // 2], "flip": blob[:-1] + bytes([blob[-1] ^ 1]),
           "foreign": good.data}[damage]
    good.path.write_bytes(bad)
    nvrtc.forget()
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        again = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    assert again.origin == "nvrtc" and again.data == good.data
    assert good.path.read_bytes() == blob  # replaced by a good file
    assert any("corrupt kernel cache file" in r.getMessage() for r in caplog.records)


@needs_nvrtc
def test_unwritable_cache_keeps_images_in_memory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FASTSPEC_CACHE", str(blocker / "cache"))  # below a file: mkdir fails even as root
    nvrtc.forget()
    monkeypatch.setattr(nvrtc, "_warned_unwritable", set())
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        img = nvrtc.compile_variant(_v128(), nvrtc.Target(90))
        nvrtc.compile_variant(cuda.variant_for(64, "float32", H100), nvrtc.Target(90))
    assert img.origin == "nvrtc" and img.path is None and img.data[:4] == b"\x7fELF"
    warnings = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert len(warnings) == 1 and "FASTSPEC_CACHE" in warnings[0]  # said once, not per kernel
    assert nvrtc.compile_variant(_v128(), nvrtc.Target(90)).origin == "memory"
    nvrtc.forget()


def _compile_in_child(folder: str) -> bytes:
    import os  # noqa: PLC0415

    os.environ["FASTSPEC_CACHE"] = folder
    from fastspec.eig import cuda as c  # noqa: PLC0415
    from fastspec.eig import nvrtc as n

    return n.compile_variant(c.variant_for(128, "float32", c.DeviceSpec.for_arch(90)), n.Target(90)).data


@needs_nvrtc
@pytest.mark.slow
def test_processes_compiling_at_once_never_read_half_a_file(tmp_path):
    folder = str(tmp_path / "shared-cache")
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        images = pool.map(_compile_in_child, [folder] * 6)
    assert len(set(images)) == 1
    files = list((tmp_path / "shared-cache" / "eig").iterdir())
    assert len(files) == 1 and nvrtc._unframe(files[0].read_bytes()) == images[0]


@needs_nvrtc
def test_compile_error_names_the_saved_log(cache, monkeypatch):
    src = nvrtc.sources()
    broken = src["eig_kernel.cu"].replace("eigvalsh_one(team,", "eigvalsh_one(team, no_such_name,", 1)
    monkeypatch.setattr(nvrtc, "sources", lambda *_: {**src, "eig_kernel.cu": broken})
    with pytest.raises(nvrtc.KernelUnavailable, match=r"could not compile .*full log: ") as info:
        nvrtc.compile_variant(_v128(), nvrtc.Target(90))
    log_path = re.search(r"full log: (\S+)$", str(info.value)).group(1)
    assert "no_such_name" in open(log_path).read()
    assert "no_such_name" in str(info.value)  # the first error line is in the message itself


# ------------------------------------------------------------------------- targets and sources


def test_choose_target():
    known = [75, 80, 86, 89, 90, 100, 120]
    assert nvrtc.choose_target(90, known) == nvrtc.Target(90)
    assert nvrtc.choose_target(130, known) == nvrtc.Target(120, ptx=True)  # newer GPU: PTX, driver JITs it
    assert nvrtc.choose_target(95, known) == nvrtc.Target(90, ptx=True)
    with pytest.raises(nvrtc.KernelUnavailable, match="sm_70"):
        nvrtc.choose_target(70, known)


@needs_nvrtc
def test_ptx_target_and_the_kernels_parameter_list(cache):
    """PTX for a GPU newer than NVRTC knows; its entry declares exactly the parameters (order and
    width) that cuda.launch_args packs."""
    img = nvrtc.compile_variant(_v128(), nvrtc.Target(90, ptx=True))
    assert img.path.suffix == ".ptx" and img.data.endswith(b"\0")  # the driver wants a C string
    text = img.data.rstrip(b"\0").decode()
    assert ".target sm_90" in text
    entry = re.search(r"\.entry\s+" + nvrtc.ENTRY + r"\s*\((.*?)\)", text, re.S).group(1)
    widths = [int(w) // 8 for w in re.findall(r"\.param\s+\.[us](\d+)", entry)]
    packed = cuda.launch_args(1, 2, 3, 4, (5, 6, 7), 8)
    assert widths == [ctypes.sizeof(a) for a in packed] == [8] * 8


def test_nvrtc_constants_match_cfloat():
    """eig_core.h spells <cfloat>'s constants for NVRTC (which has no standard headers)."""
    header = (nvrtc.CSRC / "eig_core.h").read_text()
    rtc = header[header.index("#if defined(__CUDACC_RTC__)"):header.index("#else")]
    defs = dict(re.findall(r"#define (\w+) (\S+)", rtc))
    f32, f64 = np.finfo(np.float32), np.finfo(np.float64)

    def value(s: str) -> float:
        return float.fromhex(s.rstrip("f"))

    assert value(defs["FLT_EPSILON"]) == f32.eps and value(defs["DBL_EPSILON"]) == f64.eps
    assert value(defs["FLT_MIN"]) == f32.tiny and value(defs["DBL_MIN"]) == f64.tiny
    assert value(defs["FLT_MAX"]) == f32.max and value(defs["DBL_MAX"]) == f64.max
    assert int(defs["FLT_MIN_EXP"].strip("()")) == f32.minexp + 1 and int(defs["FLT_MAX_EXP"]) == f32.maxexp
    assert int(defs["DBL_MIN_EXP"].strip("()")) == f64.minexp + 1 and int(defs["DBL_MAX_EXP"]) == f64.maxexp


@needs_ext
def test_launcher_shared_memory_formula_matches_the_kernels():
    for n in range(1, limits.MAX_N + 1):
        for here in (True, False):
            assert cuda.block_work_elems(n, here) == native._ext.block_work_elems(n, here), (n, here)


def test_plan_rejects_sizes_outside_the_limit():
    for n in (0, limits.MAX_N + 1):
        with pytest.raises(ValueError, match="^n: "):
            cuda.variant_for(n, "float32", H100)


# ------------------------------------------------------------------- the launcher, driver stubbed


@pytest.fixture
def fake_gpu(monkeypatch, cache):
    """cuda.py against FakeDriver on CPU tensors: an H100's plan, stream 1234 (tests/_fake_gpu.py)."""
    def install(n: int, version: int = 13000) -> FakeDriver:
        return _fake_gpu.install(monkeypatch, n, version)
    return install


@needs_nvrtc
@needs_ext
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "batch-strided"])
def test_launch_packs_pointers_and_strides_the_kernel_reads(fake_gpu, layout):
    drv = fake_gpu(100)
    base = torch.from_numpy(make_batch("indefinite", 100, 6)).float()
    want = torch.linalg.eigvalsh(base.double()).float()
    # NaN above the diagonal, which the kernel never reads: a stride mixed up reads it
    M = base.tril() + torch.full_like(base, float("nan")).triu(1)
    A = {"contiguous": M, "transposed": M.mT.contiguous().mT, "batch-strided": torch.stack([M, M], 1)[:, 0]}[layout]
    out = native.cuda_eigvalsh(A.reshape(2, 3, 100, 100) if layout == "contiguous" else A)
    torch.testing.assert_close(out.reshape(want.shape), want, atol=1e-4, rtol=0)
    (launch,) = drv.launches
    v = cuda.variant_for(100, "float32", H100)
    assert launch["block"] == (v.threads, 1, 1) and launch["grid"] == (6, 1, 1) and launch["batch"] == 6
    assert launch["smem"] == cuda.smem_bytes(100, "float32", True) == drv.attributes["max_dynamic_smem"]
    assert launch["stream"] == 1234 and launch["work"] == 0 and drv.attributes["carveout"] == 100
    assert drv.loaded == [b"\x7fELF"] and launch["kernel"] == ("kernel", nvrtc.ENTRY.encode())
    native.cuda_eigvalsh(base)  # loaded once, configured once
    assert len(drv.loaded) == 1 and len(drv.launches) == 2


@needs_nvrtc
@needs_ext
def test_workspace_path_grid_and_buffer(fake_gpu):
    drv = fake_gpu(240)  # fp32 n = 240 does not fit in an H100 block's shared memory
    A = torch.from_numpy(make_batch("spd", 240, 3)).float()
    out = native.cuda_eigvalsh(A)
    torch.testing.assert_close(out, torch.linalg.eigvalsh(A.double()).float(), atol=1e-4, rtol=0)
    (launch,) = drv.launches
    assert launch["work"] != 0 and launch["grid"] == (3, 1, 1)
    assert launch["smem"] == cuda.smem_bytes(240, "float32", False)
    big = cuda.plan(10_000, 240, "float32", H100)
    assert big.grid == 4 * H100.sms and big.workspace == big.grid * 240 * 240


@needs_nvrtc
@needs_ext
@needs_nvrtc
def test_forget_makes_the_next_prepare_load_the_kernel_again(fake_gpu):
    """The compile benchmark's cold side (fastspec.bench.suites.eigvalsh) relies on it."""
    drv = fake_gpu(64)
    for _ in range(2):
        cuda.prepare(64, torch.float32, 0)
    assert len(drv.loaded) == 1
    cuda.forget()
    cuda.prepare(64, torch.float32, 0)
    assert len(drv.loaded) == 2


def test_old_driver_is_a_reason_not_a_crash(fake_gpu):
    fake_gpu(64, version=11080)
    with pytest.raises(nvrtc.KernelUnavailable, match="CUDA 12.0 or newer"):
        cuda.prepare(64, torch.float32, 0)


@needs_ext
def test_a_kernel_that_failed_is_not_compiled_again(fake_gpu, monkeypatch):
    """Under "auto" every solve of that size falls back: it must not pay NVRTC again each time."""
    fake_gpu(64)
    calls = []

    def broken(variant, target):
        calls.append(variant)
        raise nvrtc.KernelUnavailable("NVRTC could not compile the eigensolver (test); full log: /x.log")

    monkeypatch.setattr(nvrtc, "compile_variant", broken)
    for _ in range(3):
        with pytest.raises(nvrtc.KernelUnavailable, match="could not compile"):
            cuda.prepare(64, torch.float32, 0)
    assert len(calls) == 1
    A = torch.from_numpy(make_batch("spd", 64, 2)).float()
    torch.testing.assert_close(native.cuda_eigvalsh(A), eigvalsh_reference(A))  # the op's fallback


# ------------------------------------------------------------------------- fallbacks and status


def test_missing_binding_gives_the_install_line(monkeypatch):
    for mod in ("cuda.bindings", "cuda.bindings.nvrtc", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    monkeypatch.setattr(cuda, "_binding", [])
    with pytest.raises(nvrtc.KernelUnavailable, match=r"cuda-bindings is not installed.*pip install 'cuda-bindings=="):
        nvrtc.version()
    ok, reason = cuda.status()
    assert not ok and "pip install" in reason
    monkeypatch.setattr(cuda, "_binding", [])


def test_missing_nvrtc_library_gives_the_install_line(monkeypatch):
    def no_library():
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: types.SimpleNamespace(nvrtcVersion=no_library))
    with pytest.raises(nvrtc.KernelUnavailable, match=r"NVRTC library not found .*libnvrtc.*pip install"):
        nvrtc.version()


def test_op_falls_back_to_torch_once_per_reason(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise nvrtc.KernelUnavailable("NVRTC could not compile the eigensolver (test)")

    monkeypatch.setattr(cuda, "run", broken)
    monkeypatch.setattr(native, "_fallback_reasons", set())
    A = torch.from_numpy(make_batch("spd", 16, 3)).float()
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        for _ in range(3):
            assert torch.equal(native.cuda_eigvalsh(A), eigvalsh_reference(A))
    lines = [r.getMessage() for r in caplog.records if r.name == "fastspec"]
    assert len(lines) == 1 and "could not compile" in lines[0] and "torch.linalg.eigvalsh" in lines[0]


def test_explicit_cuda_solver_raises_with_the_reason(monkeypatch):
    monkeypatch.setattr(native, "status", lambda solver: (True, "pretend"))

    def fail(n, dtype, device, batch=1):
        raise nvrtc.KernelUnavailable("NVRTC could not compile the eigensolver (test); full log: /x.log")

    monkeypatch.setattr(cuda, "prepare", fail)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # eigvalsh() itself insists on a CUDA tensor, which a CPU box cannot make: its helper takes any
    with pytest.raises(RuntimeError, match=r"^solver: 'cuda' unavailable: NVRTC could not compile.*full log"):
        dispatch._prepare_cuda(torch.eye(4))




def test_status_without_a_gpu_still_says_nvrtc_is_here(monkeypatch):
    monkeypatch.setattr(cuda, "_binding", [(True, "NVRTC 13.0")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, reason = cuda.status()
    assert not ok and "no CUDA device" in reason and "NVRTC 13.0" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ok, reason = cuda.status()
    assert ok and "NVRTC 13.0" in reason and fastspec.solvers()["cuda"]["available"]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "x"))
    assert nvrtc.cache_dir() == tmp_path / "x" / "eig"
    monkeypatch.delenv("FASTSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc.cache_dir() == tmp_path / "xdg" / "fastspec" / "eig"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert nvrtc.cache_dir() == tmp_path / "home" / ".cache" / "fastspec" / "eig"


@needs_nvrtc
def test_ahead_of_time_cli(cache, capsys):
    assert precompile.main(["--arch", "90", "--n", "32", "64", "--dtype", "float32", "--cov-d", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "float32-n32-smem" in out and "float32-n64-smem" in out and "nvrtc" in out
    assert len(list(cache.iterdir())) == 2
    nvrtc.forget()
    assert precompile.main(["--arch", "90", "--n", "32", "--dtype", "float32", "--cov-d", "--jobs", "1"]) == 0
    assert " disk " in capsys.readouterr().out
    for bad in (["--arch", "90", "--n", "0"], ["--arch", "91"]):
        with pytest.raises(SystemExit):
            precompile.main(bad)


# ------------------------------------------------------------------------------ fastspec info


def test_info_says_whether_the_kernel_compiles_here_and_where_the_cache_is(cache, capsys, monkeypatch):
    from fastspec.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {cache} (not created yet: made 0700 at the first compile, writable, 0 kernels; " \
           "FASTSPEC_CACHE moves it)" in out  # owner and mode once made: tests/test_kernel_cache.py
    if nvrtc.missing():
        assert "kernel: cannot be compiled here: " in out
    else:
        assert re.search(r"kernel: compiled at first use by NVRTC \d+\.\d+ \(cuda-bindings [\d.]+\): ", out)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU newer than NVRTC knows
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda.DeviceSpec, "of_device", classmethod(lambda cls, i: cuda.DeviceSpec(990, 1, 1, 1)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "future GPU")
    assert main(["info", "--json"]) == 0
    import json

    k = json.loads(capsys.readouterr().out)["eigvalsh_kernel"]
    assert k["cache"] == str(cache) and k["cache_writable"] is True
    assert (k["cache_owner"], k["cache_mode"], k["cache_refused"]) == (None, None, "")
    if not nvrtc.missing():
        assert k["target"].startswith("compute_")  # PTX of the newest arch NVRTC knows


def test_info_without_the_binding(cache, capsys, monkeypatch):
    from fastspec.cli import main

    for mod in ("cuda.bindings", "cuda.bindings.nvrtc", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setattr(cuda, "_binding", [])
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel: cannot be compiled here: cuda-bindings is not installed" in out and "pip install" in out
    monkeypatch.setattr(cuda, "_binding", [])


def _program_files() -> set:
    """Every file NVRTC compiles or includes, of every program (the eigensolver, the Gram kernel)."""
    from fastspec.covariance import gram_cuda

    programs = [nvrtc.EIGVALSH, *(getattr(gram_cuda, n) for n in ("PROGRAM",) if hasattr(gram_cuda, n))]
    return {nvrtc.CSRC / f for p in programs for f in (p.source, *p.headers)}


def test_the_wheel_ships_the_kernel_sources():
    """NVRTC compiles from the installed package: setup.py maps csrc/ onto fastspec._csrc and
    pyproject's package data must cover every source there."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    assert nvrtc.CSRC == root / "csrc"  # an editable install (or the bare checkout) compiles the checkout's files
    assert '"fastspec._csrc"' in (root / "setup.py").read_text()
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fastspec._csrc"]
    shipped = {p for pat in patterns for p in nvrtc.CSRC.glob(pat)}
    sources = {p for p in nvrtc.CSRC.iterdir() if p.suffix in (".h", ".cu", ".cpp")}
    assert sources <= shipped and _program_files() <= shipped


_INSTALLED = """
import json, sys
import fastspec
from fastspec.eig import nvrtc
out = {"fastspec": fastspec.__file__, "csrc": str(nvrtc.CSRC)}
img = nvrtc.compile_variant(nvrtc.Variant("float32", 128, True, 128, 1), nvrtc.Target(90))
out["eig"] = len(img.data)
from fastspec.covariance import gram_cuda
if hasattr(gram_cuda, "PROGRAM"):
    img = nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(128, "bfloat16"), "test", nvrtc.Target(90))
    out["cov_gram"] = len(img.data)
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_nvrtc
def test_a_wheel_built_from_the_checkout_compiles_its_kernels_outside_it(tmp_path):
    """Build a wheel from the checkout's files (what git tracks or would add), install it into a
    folder outside the checkout, and compile every CUDA program for sm_90 from there."""
    import importlib.util
    import json
    import os
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs a git checkout (the files a clean clone has)")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for f in filter(None, files):
        if (root / f).is_file() and not f.startswith("benchmarks/results/"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, src / f)
    env = {**os.environ, "FASTSPEC_NO_EXT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # the sources, not the twin
    isolation = [] if importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel") else None
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(tmp_path / "wheel")]
    subprocess.run(cmd + ([] if isolation is None else ["--no-build-isolation"]), env=env, check=True, timeout=600)
    wheel = next((tmp_path / "wheel").glob("fastspec-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   env=env, check=True, timeout=600)
    proc = subprocess.run([sys.executable, "-c", _INSTALLED], cwd=tmp_path, capture_output=True, text=True, check=False,
                          env={**env, "PYTHONPATH": str(site), "FASTSPEC_CACHE": str(tmp_path / "cache")},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fastspec"].startswith(str(site)) and out["csrc"] == str(site / "fastspec" / "_csrc")
    assert out["eig"] > 0 and out.get("cov_gram", 1) > 0