"""Build hook for fastspec's optional native extension ``fastspec._eig_ext`` (csrc/).

All package metadata lives in pyproject.toml. This file only adds the extension:

* nvcc found (and ``FASTSPEC_NO_CUDA`` unset): one module with the CUDA batched eigensolver and its
  host twin; csrc/eig_cuda.cu is compiled by nvcc for ``FASTSPEC_CUDA_ARCH_LIST`` (default
  ``80;90+PTX``: sm_80, sm_90 and PTX for newer GPUs), cudart linked statically so the module
  needs only the driver at run time and never links against torch.
* no nvcc but a C++ compiler: the same module with the host twin only.
* no compiler, or ``FASTSPEC_NO_EXT=1``: no extension; the package installs as pure Python and
  ``fastspec.eigvalsh`` uses torch.linalg.eigvalsh.

A missing toolchain skips the build with one message; a compile error fails the install (CI must
see a broken build).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("csrc")
DEFAULT_ARCHS = "80;90+PTX"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _say(msg: str) -> None:
    print(f"fastspec setup: {msg}", file=sys.stderr)


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_lib_dir(nvcc: str) -> str:
    """Directory holding libcudart_static.a, asked from nvcc itself (wrappers hide the real path)."""
    dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    tops = re.findall(r"^#\$ TOP=(.*)$", dry, flags=re.M)
    roots = [Path(t.strip()) for t in tops] + [Path(nvcc).resolve().parent.parent]
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (root / sub / "libcudart_static.a").is_file():
                return str((root / sub).resolve())
    raise RuntimeError(f"nvcc at {nvcc} found, but not libcudart_static.a next to it; set CUDA_HOME")


def _gencode_flags(spec: str) -> list[str]:
    """``"80;90+PTX"`` or ``"8.0 9.0+PTX"`` -> nvcc -gencode flags (SASS each, PTX where +PTX)."""
    flags = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        ptx = item.upper().endswith("+PTX")
        arch = item[:-4] if ptx else item
        m = re.fullmatch(r"(\d+)\.?(\d+)([af]?)", arch)
        if not m:
            raise ValueError(f"FASTSPEC_CUDA_ARCH_LIST: cannot parse {item!r} (expected e.g. '80;90+PTX')")
        cc = m.group(1) + m.group(2) + m.group(3)
        flags += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{cc},code=compute_{cc}"]
    if not flags:
        raise ValueError("FASTSPEC_CUDA_ARCH_LIST: no architectures given")
    return flags


class BuildExt(build_ext):
    """Compiles csrc/eig_cuda.cu with nvcc into an object linked into the pybind11 module."""

    def build_extension(self, ext: Extension) -> None:
        nvcc = getattr(ext, "fastspec_nvcc", None)
        if nvcc:
            obj = Path(self.build_temp) / "eig_cuda.o"
            obj.parent.mkdir(parents=True, exist_ok=True)
            archs = os.environ.get("FASTSPEC_CUDA_ARCH_LIST", DEFAULT_ARCHS)
            cmd = [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", *_gencode_flags(archs),
                   "-I", str(CSRC), "-c", str(CSRC / "eig_cuda.cu"), "-o", str(obj)]
            _say("building the CUDA eigensolver: " + " ".join(cmd))
            try:
                subprocess.check_call(cmd)  # a compile error fails the install, by design
            except (subprocess.CalledProcessError, OSError) as exc:
                raise RuntimeError(f"fastspec setup: nvcc failed to build csrc/eig_cuda.cu ({exc}); set "
                                   "FASTSPEC_NO_CUDA=1 to build the host twin only, or FASTSPEC_NO_EXT=1 "
                                   "for a pure-Python install") from exc
            ext.extra_objects.append(str(obj))
            ext.library_dirs.append(_cuda_lib_dir(nvcc))
            ext.libraries += ["cudart_static", "rt", "pthread", "dl"]
        super().build_extension(ext)


def _extensions() -> list[Extension]:
    if _flag("FASTSPEC_NO_EXT"):
        _say("FASTSPEC_NO_EXT set: no native extension, eigvalsh uses torch.linalg")
        return []
    cxx = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(cxx) is None:
        _say(f"no C++ compiler ({cxx}): no native extension, eigvalsh uses torch.linalg")
        return []
    try:
        import pybind11
    except ImportError:
        _say("pybind11 not importable at build time: no native extension, eigvalsh uses torch.linalg")
        return []
    nvcc = None if _flag("FASTSPEC_NO_CUDA") else _find_nvcc()
    if nvcc is None:
        _say("no nvcc (or FASTSPEC_NO_CUDA set): building the host twin only, no CUDA solver")
    ext = Extension(
        "fastspec._eig_ext",
        sources=[str(CSRC / "bindings.cpp"), str(CSRC / "eig_host.cpp")],
        include_dirs=[pybind11.get_include(), str(CSRC)],
        depends=[str(p) for p in sorted(CSRC.glob("*.h"))] + [str(CSRC / "eig_cuda.cu")],
        define_macros=[("FASTSPEC_WITH_CUDA", "1")] if nvcc else [],
        extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread"],
        extra_link_args=["-pthread"],  # std::thread in the test-only team emulation (eig_host.cpp)
        language="c++",
    )
    ext.fastspec_nvcc = nvcc
    return [ext]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
