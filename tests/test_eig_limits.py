"""The eigensolver's limits are written once, in fastspec/eig/limits.py, and every consumer agrees:
setup.py's build of the host twin (which reports what it was built with), NVRTC's options and the
kernel's own compile-time checks, the launch plan, the dispatch (``"auto"``'s envelope:
tests/test_eig_dispatch.py) and the precompile command. A copy of a limit anywhere else in the op's
sources fails here too."""
from __future__ import annotations

import ast
import re
import runpy
import sys
import types
from pathlib import Path

import pytest
import setuptools
import torch

import fastspec
from fastspec.eig import cuda, limits, native, nvrtc, precompile

EIG = Path(limits.__file__).parent
ROOT = EIG.parents[1]
needs_ext = pytest.mark.skipif(native._ext is None, reason=f"host twin unavailable: {native._EXT_ERROR}")
needs_nvrtc = pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}")
H100 = cuda.DeviceSpec.for_arch(90)


def test_the_single_source_is_consistent_and_stands_alone():
    """setup.py runs limits.py by path, before the package (or torch) can be imported."""
    tree = ast.parse((EIG / "limits.py").read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    alone = runpy.run_path(str(EIG / "limits.py"))
    assert alone["MACROS"] == limits.MACROS and alone["defines"]() == limits.defines()
    assert limits.MACROS == {"FS_MAX_N": limits.MAX_N, "FS_MAX_THREADS": limits.MAX_THREADS,
                             "FS_GRID": limits.GRID, "FS_SCRATCH": limits.SCRATCH}
    assert limits.defines() == [f"-D{k}={v}" for k, v in limits.MACROS.items()]
    assert 1 <= limits.AUTO_MAX_N <= limits.MAX_N and limits.MAX_THREADS % 32 == 0
    assert limits.SCRATCH >= 2 * (limits.MAX_THREADS // 32)  # two halves, one real per warp


def test_no_other_file_of_the_op_writes_a_limit():
    """The C++/CUDA sources take the limits from macros only; no Python module of the op assigns one."""
    assign = re.compile(r"^\s*(AUTO_MAX_N|CUDA_MAX_N|MAX_N|MAX_THREADS|K?GRID|SCRATCH)\s*(:[^=]*)?=", re.MULTILINE)
    for path in sorted(EIG.glob("*.py")):
        if path.name != "limits.py":
            assert not assign.search(path.read_text()), f"{path.name} assigns a limit"
    define = re.compile(r"#\s*define\s+(" + "|".join(limits.MACROS) + r")\b")
    for path in sorted(p for p in nvrtc.CSRC.iterdir() if p.suffix in (".h", ".cu", ".cpp")):
        text = path.read_text()
        assert not define.search(text), f"{path.name} defines a limit macro"
        # the numbers in code, not in comments: a constant of the op is an FS_* macro or derived from one
        code = "\n".join(line.split("//")[0] for line in text.splitlines())
        assert not re.search(r"\b(kGrid|kMaxN|kMaxThreads|kScratch|kMaxLanes)\s*=\s*\d", code), path.name


def test_setup_builds_the_host_twin_with_the_limits(monkeypatch):
    """What setup.py hands setuptools: the module fastspec.eig._host, the limits as macros, and
    limits.py among its dependencies (an edit rebuilds it)."""
    pytest.importorskip("pybind11")
    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: got.update(kw))
    monkeypatch.delenv("FASTSPEC_NO_EXT", raising=False)
    monkeypatch.chdir(ROOT)
    runpy.run_path("setup.py")
    if not got["ext_modules"]:
        pytest.skip("no C++ compiler: setup.py builds no extension here")
    (ext,) = got["ext_modules"]
    assert ext.name == "fastspec.eig._host"
    assert dict(ext.define_macros) == {k: str(v) for k, v in limits.MACROS.items()}
    assert "fastspec/eig/limits.py" in ext.depends


@needs_ext
def test_the_host_twin_was_built_with_the_limits_and_enforces_max_n():
    for macro, value in limits.MACROS.items():
        assert getattr(native._ext, macro.removeprefix("FS_")) == value, macro
    native._ext.host_eigvalsh_f32(0, 0, 0, limits.MAX_N, 0, 0, 0, 0)  # n checked even for an empty batch
    with pytest.raises(ValueError, match=rf"^n: must be in \[1, {limits.MAX_N}\], got {limits.MAX_N + 1}$"):
        native._ext.host_eigvalsh_f32(0, 0, 0, limits.MAX_N + 1, 0, 0, 0, 0)


def test_a_host_build_with_other_limits_is_not_used(monkeypatch):
    stale = types.ModuleType("fastspec.eig._host")
    stale.MAX_N, stale.MAX_THREADS, stale.GRID = 4096, limits.MAX_THREADS, limits.GRID  # no SCRATCH at all
    monkeypatch.setitem(sys.modules, "fastspec.eig._host", stale)
    monkeypatch.setattr(fastspec.eig, "_host", stale, raising=False)
    mod, why = native._load_host()
    assert mod is None and "built with other limits" in why and "'FS_MAX_N': 4096" in why and "rebuild" in why


def test_nvrtc_compiles_every_variant_with_the_limits():
    for n, dtype in ((1, "float32"), (128, "float64"), (limits.MAX_N, "float64")):
        options = nvrtc._options(nvrtc.variant_defines(cuda.variant_for(n, dtype, H100)), nvrtc.Target(90), ())
        assert set(limits.defines()) <= set(options), options


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    nvrtc.forget()
    yield
    nvrtc.forget()


@needs_nvrtc
def test_the_kernel_checks_the_limits_at_compile_time(cache, monkeypatch):
    """Past the limits (which the plan never asks for) the kernel does not compile; and it gets the
    limits from NVRTC's options alone: without them it stops with #error."""
    past = [nvrtc.Variant("float32", limits.MAX_N + 1, False, limits.MAX_THREADS, 1),
            nvrtc.Variant("float32", 64, True, limits.MAX_THREADS + 32, 1)]
    for variant, what in zip(past, ("FS_N: outside", "FS_THREADS: above")):
        with pytest.raises(nvrtc.KernelUnavailable, match=f"static assertion failed.*{what}"):
            nvrtc.compile_variant(variant, nvrtc.Target(90))
    monkeypatch.setattr(limits, "defines", list)
    with pytest.raises(nvrtc.KernelUnavailable, match=r"#error.*fastspec/eig/limits.py"):
        nvrtc.compile_variant(cuda.variant_for(32, "float32", H100), nvrtc.Target(90))


def test_the_launch_plan_uses_the_limits():
    top = cuda.variant_for(limits.MAX_N, "float64", H100)
    assert top.threads == limits.MAX_THREADS and not top.smem
    with pytest.raises(ValueError, match=rf"^n: must be in \[1, {limits.MAX_N}\], got {limits.MAX_N + 1}$"):
        cuda.variant_for(limits.MAX_N + 1, "float32", H100)
    # MAX_N's promise: the largest block's vectors (the matrix in global memory) fit every known GPU
    for cc in (80, 86, 87, 89, 90, 100, 103, 110, 120, 121):
        spec = cuda.DeviceSpec.for_arch(cc)
        assert cuda.smem_bytes(limits.MAX_N, "float64", False) <= spec.smem_optin, cc
        assert cuda.variant_for(limits.MAX_N, "float64", spec).threads == limits.MAX_THREADS
    assert cuda.smem_bytes(1, "float32", True) == 4 * (4 + 5 * 4 + limits.GRID + limits.SCRATCH)


@pytest.mark.parametrize("solver", ["cuda", "host"])
def test_dispatch_refuses_n_over_the_limit_for_both_native_solvers(solver):
    n = limits.MAX_N + 1
    with pytest.raises(ValueError, match=rf"^A: n = {n} exceeds the native solvers' limit {limits.MAX_N} .*'torch'"):
        fastspec.eigvalsh(torch.empty(0, n, n), solver=solver)  # before the device check: any tensor shows it
    assert fastspec.eigvalsh(torch.empty(0, n, n), solver="torch").shape == (0, n)


@needs_ext
def test_dispatch_takes_max_n_itself():
    n = limits.MAX_N
    assert fastspec.eigvalsh(torch.empty(0, n, n), solver="host").shape == (0, n)


def test_precompile_refuses_sizes_past_the_limit(capsys):
    with pytest.raises(SystemExit):
        precompile.main(["--arch", "90", "--n", str(limits.MAX_N + 1)])
    err = capsys.readouterr().err
    assert "--n" in err and f"[1, {limits.MAX_N}]" in err, err
