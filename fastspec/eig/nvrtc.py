"""Run-time compilation of fastspec's CUDA kernels (top-level ``csrc/``) with NVRTC, cached on disk.

Two programs are compiled this way: the eigensolver (``csrc/eig_kernel.cu`` and its headers,
:class:`Variant`) and the float64 Gram of the exact covariance update (``csrc/cov_gram.cu``,
``fastspec/covariance/gram_cuda.py``). A :class:`Program` names a kernel's source files and
entry points; :func:`compile_program` turns it, a set of ``-D`` macros and a :class:`Target` into
an :class:`Image`, through one cache.

Why at run time: every CUDA build of PyTorch ships NVRTC, NVIDIA's run-time compiler, and no
CUDA toolkit is needed to use it; so ``pip install fastspec`` needs no ``nvcc`` and every CUDA
install gets the kernel, compiled for exactly the GPU it runs on. The binding is NVIDIA's
``cuda-bindings`` (``cuda.bindings.nvrtc`` here, ``cuda.bindings.driver`` in :mod:`.cuda`): public,
maintained with the toolkit, and a dependency of PyTorch's own CUDA 13 wheels (docs/kernels.md
says why not CuPy or ``torch.cuda._compile_kernel``). Nothing here needs a GPU or the driver:
CPU-only CI compiles for sm_80 and sm_90 through exactly this path (``tests/test_eig_sass.py``).

The sources ship in the wheel as the package ``fastspec._csrc`` (``csrc/`` mapped onto it by
setup.py), so NVRTC finds them in an editable install, an installed wheel and a bare checkout
alike (:func:`csrc_dir`).

One compiled image per :class:`Variant` (n, dtype, layout, block size, register budget: each a
compile-time constant of the kernel) and :class:`Target` (``sm_XX`` cubin, or PTX for
``compute_XX`` when the GPU is newer than this NVRTC knows; the driver then finishes it).

The cache: ``$FASTSPEC_CACHE/eig`` (default ``$XDG_CACHE_HOME/fastspec/eig``, else
``~/.cache/fastspec/eig``); one file per image, named by the variant and target and keyed by a
hash of the sources, the target, the NVRTC version and the options. Files are written to a
temporary name and renamed, so processes and ranks compiling at once never read half a file;
each starts with the SHA-256 of its payload, and a file that fails the check is compiled again
and replaced. That hash catches a torn file, not a planted one, so the cache must be private
(:mod:`.cache`): folders are created ``0700``; a folder (or the ``$FASTSPEC_CACHE`` above it)
owned by another user or writable by group or others is not used, nor a cache file that is, or
that is a symbolic link (one warning naming it and the fix). A cache folder that is refused or
cannot be written leaves the images in memory (one warning). A compile error raises
:class:`KernelUnavailable` naming the file that holds NVRTC's log: in the private cache, else a
``mkstemp`` name in the temporary folder.

``python -m fastspec.eig.precompile --arch 90`` compiles ahead of time (:mod:`.precompile`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import cache, limits

log = logging.getLogger("fastspec")



def csrc_dir() -> Path:
    """The folder of the CUDA/C++ sources: the installed package ``fastspec._csrc`` (a wheel, or
    an editable install, which maps it onto the checkout's ``csrc/``), else the ``csrc/`` of the
    checkout this module was imported from."""
    try:
        spec = importlib.util.find_spec("fastspec._csrc")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return Path(__file__).resolve().parents[2] / "csrc"


CSRC = csrc_dir()
KERNEL_SOURCE = "eig_kernel.cu"
# the headers the kernel includes (eig_host.h is the host twin's): the core and every algorithm
HEADERS = ("eig_core.h", "eig_algos.h", "eig_packed.h", "eig_regs.h", "eig_split.h", "eig_newton.h")
ENTRY = "fastspec_eigvalsh"  # the kernel's extern "C" name
FORMAT = b"fastspec-eig-image-1\n"  # first line of every cache file; a new format is a new key
OPTIONS = ("-std=c++17", "--generate-line-info")  # line info: Nsight Compute's source view; no cost
_REALS = {"float32": "float", "float64": "double"}


class KernelUnavailable(RuntimeError):
    """The CUDA kernel cannot be had here: the message says why and what to do."""


class ShapeUnsupported(KernelUnavailable):
    """This call's shape is past the kernel's limits (too many heads for its grid, an index past
    32 bits): the next route serves this call only; the kernel stays in use for the others."""


@dataclass(frozen=True)
class Program:
    """A kernel's sources: ``source`` (compiled) and ``headers`` (what it includes), files of
    :data:`CSRC`, and its ``extern "C"`` entry points. ``name`` prefixes its cache files."""

    name: str
    source: str
    headers: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()


EIGVALSH = Program("eigvalsh", KERNEL_SOURCE, HEADERS, (ENTRY,))
"""The eigensolver: every :class:`Variant` is this program with its macros."""


@dataclass(frozen=True)
class Variant:
    """What one image is specialized for (the kernel's ``FS_*`` macros)."""

    dtype: str        # "float32" | "float64"
    n: int            # matrix size
    smem: bool        # the matrix in shared memory (else a global workspace)
    threads: int      # block size: round_up(n, 32), at most limits.MAX_THREADS
    min_blocks: int   # resident blocks per SM the register budget is sized for (launch bounds)
    algo: str = "block"  # the algorithm (fastspec/eig/variants.py, eig_algos.h)
    per_block: int = 1  # matrices per block: 1 but for cuSolverDx's heev (variants.EXTERNAL, mathdx.py)

    def defines(self) -> list[str]:
        from .variants import ALGORITHMS  # noqa: PLC0415 - variants imports nothing of this module

        return [f"-DFS_REAL={_REALS[self.dtype]}", f"-DFS_N={self.n}", f"-DFS_SMEM={int(self.smem)}",
                f"-DFS_THREADS={self.threads}", f"-DFS_MIN_BLOCKS={self.min_blocks}",
                f"-DFS_ALGO={ALGORITHMS[self.algo].id}"]

    @property
    def tag(self) -> str:
        algo = "" if self.algo == "block" else f"{self.algo}-"
        return f"{algo}{self.dtype}-n{self.n}-{'smem' if self.smem else 'global'}-t{self.threads}-b{self.min_blocks}"


@dataclass(frozen=True)
class Target:
    """What NVRTC generates: a cubin for ``sm_<arch>``, or PTX for ``compute_<arch>``."""

    arch: int   # compute capability as major * 10 + minor (90 for an H100)
    ptx: bool = False

    @property
    def name(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.arch}"

    @property
    def option(self) -> str:
        return f"--gpu-architecture={self.name}"


@dataclass(frozen=True)
class Image:
    """A compiled kernel: ``data`` is a cubin or PTX (NUL-terminated) for the driver to load."""

    variant: Variant | None  # the eigensolver's variant; None for another program
    target: Target
    data: bytes
    origin: str       # "nvrtc" (compiled now), "disk" (cache file), "memory" (this process)
    seconds: float    # compile, or read and verify
    path: Path | None  # the cache file; None when the cache is refused, not writable or the file is refused
    log: str = ""     # NVRTC's log of a compile in this process (ptxas lines with -v)


_lock = threading.Lock()
_memory: dict[str, Image] = {}
_warned_unwritable: set[str] = set()


# --- the binding ------------------------------------------------------------------------------


def binding(module: str):
    """``cuda.bindings.<module>`` (``nvrtc`` here, ``driver`` in :mod:`.cuda`), imported on first
    use, or KernelUnavailable saying what to install."""
    try:
        return importlib.import_module(f"cuda.bindings.{module}")
    except ImportError as exc:
        raise KernelUnavailable(f"cuda-bindings is not installed ({exc}); {install_hint()}") from None


def _nvrtc():
    """``cuda.bindings.nvrtc``, or KernelUnavailable saying what to install."""
    return binding("nvrtc")


def install_hint() -> str:
    """The install line that brings the binding and NVRTC for this torch's CUDA major version."""
    import torch  # noqa: PLC0415 - torch is imported by then anyway

    major = (torch.version.cuda or "13").split(".")[0]
    nvrtc = "nvidia-cuda-nvrtc" if int(major) >= 13 else f"nvidia-cuda-nvrtc-cu{major}"
    return f"pip install 'cuda-bindings=={major}.*' {nvrtc} (PyTorch's CUDA {major} wheels bring NVRTC already)"


def unpack(result, what: str):
    """A ``cuda.bindings`` call's ``(status, *values)`` -> its value (a tuple of several, None of
    none); KernelUnavailable ``"<what> failed: <status name>"`` on a failed status."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise KernelUnavailable(f"{what} failed: {getattr(status, 'name', status)}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def _call(result, what: str):
    """Unpack a ``cuda.bindings.nvrtc`` call (:func:`unpack`)."""
    return unpack(result, f"NVRTC {what}")


def version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)``; KernelUnavailable when the binding or the library is missing."""
    nvrtc = _nvrtc()
    try:
        return tuple(_call(nvrtc.nvrtcVersion(), "version"))
    except KernelUnavailable:
        raise
    except Exception as exc:  # the binding found no libnvrtc (cuda.pathfinder's error types vary)
        raise KernelUnavailable(f"NVRTC library not found ({type(exc).__name__}: {exc}); {install_hint()}") from None


def missing() -> str:
    """Why NVRTC cannot compile here (the binding or the library is missing), "" when it can."""
    try:
        version()
    except KernelUnavailable as exc:
        return str(exc)
    return ""


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC can generate code for, e.g. ``[75, 80, ..., 90, 100, 120]``."""
    version()
    return sorted(int(a) for a in _call(_nvrtc().nvrtcGetSupportedArchs(), "supported archs"))


def choose_target(cc: int, supported: list[int] | None = None) -> Target:
    """The target for a GPU of compute capability ``cc`` (e.g. 90): its own cubin when NVRTC
    knows it; PTX for the newest arch NVRTC knows below it otherwise (the driver compiles that
    PTX for the GPU at load time: a GPU newer than the NVRTC still gets the kernel)."""
    supported = supported_archs() if supported is None else sorted(supported)
    if cc in supported:
        return Target(cc)
    older = [a for a in supported if a < cc]
    if not older:
        raise KernelUnavailable(f"NVRTC {'.'.join(map(str, version()))} cannot generate code for sm_{cc} "
                                f"(it supports sm_{supported[0]} and newer)")
    return Target(older[-1], ptx=True)


# --- the cache ---------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where compiled images live: ``$FASTSPEC_CACHE/eig``, else the user's cache folder."""
    root = os.environ.get("FASTSPEC_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "fastspec")
    return Path(root) / "eig"


def sources(program: Program = EIGVALSH) -> dict[str, str]:
    """A program's source files, by name (what is compiled and what the key hashes)."""
    return {name: (CSRC / name).read_text() for name in (program.source, *program.headers)}


def _options(defines: tuple[str, ...], target: Target, extra: tuple[str, ...]) -> list[str]:
    """NVRTC's options: the target, :data:`OPTIONS`, the program's macros, then ``extra``."""
    return [target.option, *OPTIONS, *defines, *extra]


def variant_defines(variant: Variant) -> tuple[str, ...]:
    """The eigensolver's macros: the limits every build of its sources gets
    (:func:`.limits.defines`), then the variant's own."""
    return (*limits.defines(), *variant.defines())


def _key(src: dict[str, str], defines: tuple[str, ...], target: Target, nvrtc_version: tuple[int, int],
         extra: tuple[str, ...]) -> str:
    h = hashlib.sha256(FORMAT)
    for name, text in sorted(src.items()):
        h.update(f"\0{name}\0{len(text)}\0".encode() + text.encode())
    h.update(repr((nvrtc_version, _options(defines, target, extra))).encode())
    return h.hexdigest()[:24]


def _file_name(program: Program, tag: str, target: Target, key: str) -> str:
    return f"{program.name}-{tag}-{target.name}-{key}.{'ptx' if target.ptx else 'cubin'}"


def _frame(payload: bytes) -> bytes:
    return FORMAT + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _unframe(blob: bytes) -> bytes | None:
    """The payload of a cache file, or None when the file is truncated, altered or foreign."""
    head = len(FORMAT) + 65
    if len(blob) <= head or not blob.startswith(FORMAT) or blob[head - 1:head] != b"\n":
        return None
    payload = blob[head:]
    return payload if hashlib.sha256(payload).hexdigest().encode() == blob[len(FORMAT):head - 1] else None


def _write_atomic(path: Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` in its (existing, private) folder: a ``mkstemp`` file (``0600``)
    renamed over it, so that readers never see half a file and a link there is replaced, not followed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _warn_unwritable(folder: Path, exc: OSError) -> None:
    if str(folder) not in _warned_unwritable:
        _warned_unwritable.add(str(folder))
        log.warning("fastspec: kernel cache %s is not writable (%s); compiled eigensolver kernels stay in "
                    "memory for this process (set FASTSPEC_CACHE to a writable folder)", folder, exc.strerror or exc)


def private_cache() -> Path | None:
    """:func:`cache_dir`, created ``0700`` where missing, when it may be used (:mod:`.cache`);
    None, with one warning, when it is refused or cannot be created: images then stay in memory."""
    folder = cache_dir()
    try:
        return cache.private_folder(folder)
    except OSError as exc:
        _warn_unwritable(folder, exc)
        return None


# --- compiling ---------------------------------------------------------------------------------


def _compile(program: Program, src: dict[str, str], defines: tuple[str, ...], tag: str, target: Target,
             extra: tuple[str, ...], ltoir: bool = False) -> tuple[bytes, str]:
    """NVRTC: the sources ``src`` (:func:`sources`) -> (cubin or PTX, log); with ``ltoir`` (and
    ``-dlto`` among ``extra``) LTO IR for nvJitLink instead (:mod:`.mathdx`). KernelUnavailable on
    a compile error, with the log written to a file the message names."""
    nvrtc = _nvrtc()
    heads = program.headers
    prog = _call(nvrtc.nvrtcCreateProgram(src[program.source].encode(), program.source.encode(), len(heads),
                                          [src[h].encode() for h in heads], [h.encode() for h in heads]),
                 "create program")
    try:
        opts = [o.encode() for o in _options(defines, target, extra)]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        # output buffers are bytearrays: the binding writes into whatever it is given, and a
        # bytes object of length 0 or 1 is an interpreter-wide singleton (b" " * 1 is b" ")
        buf = bytearray(_call(nvrtc.nvrtcGetProgramLogSize(prog), "log size"))
        _call(nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        text = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if int(status) != 0:
            where = _save_error_log(f"{program.name}-{tag}-{target.name}", text)
            first = next((ln.strip() for ln in text.splitlines() if "error" in ln), text.strip()[:200])
            raise KernelUnavailable(f"NVRTC could not compile {program.source} ({tag}, {target.name}): "
                                    f"{first}; full log: {where}")
        get_size, get = ((nvrtc.nvrtcGetLTOIRSize, nvrtc.nvrtcGetLTOIR) if ltoir
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if target.ptx
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        out = bytearray(_call(get_size(prog), "image size"))
        _call(get(prog, out), "image")
        return bytes(out), text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _save_error_log(stem: str, text: str) -> Path:
    """Write NVRTC's log of a failed compile where only this user can: ``<stem>.error.log`` in the
    private cache, else a fresh ``mkstemp`` name in the temporary folder (never a fixed name in a
    shared folder, where another user could have planted a link). Returns its path."""
    folder = private_cache()
    if folder is not None:
        try:
            _write_atomic(folder / f"{stem}.error.log", text.encode())
            return folder / f"{stem}.error.log"
        except OSError:
            pass
    try:
        fd, name = tempfile.mkstemp(prefix=f"fastspec-{stem}.", suffix=".error.log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return Path("(log not saved: no writable folder)")


def compile_variant(variant: Variant, target: Target, extra_options: tuple[str, ...] = ()) -> Image:
    """The eigensolver's image for ``variant`` on ``target`` (:func:`compile_program`)."""
    return compile_program(EIGVALSH, variant_defines(variant), variant.tag, target, extra_options, variant)


def compile_program(program: Program, defines: tuple[str, ...], tag: str, target: Target,
                    extra_options: tuple[str, ...] = (), variant=None) -> Image:
    """The image of ``program`` built with the macros ``defines`` (``"-DNAME=value"``) for
    ``target``: from this process, from the disk cache, or compiled now (and cached). ``tag``
    names the specialization in the cache file's name; ``variant`` is carried on the image.
    Thread-safe. KernelUnavailable when NVRTC is missing or the compile fails."""
    ver = version()
    src = sources(program)  # read once: what the key hashes is what a miss compiles
    defines, extra_options = tuple(defines), tuple(extra_options)
    key = _key(src, defines, target, ver, extra_options)
    with _lock:
        if key in _memory:
            img = _memory[key]
            return Image(img.variant, img.target, img.data, "memory", 0.0, img.path, img.log)
        folder = private_cache()  # None: refused or unwritable, the image stays in memory
        path = None if folder is None else folder / _file_name(program, tag, target, key)
        t0 = time.perf_counter()
        payload = None
        try:
            blob = None if path is None else cache.read(path)
        except cache.Untrusted as exc:  # not read, not replaced: the warning says what to do
            cache.warn_once(str(path), f"fastspec: kernel cache file not read, {exc}: delete it (it is then "
                                       "compiled again); compiling into memory for this process")
            path = None
        else:
            payload = None if blob is None else _unframe(blob)
            if blob is not None and payload is None:
                log.warning("fastspec: corrupt kernel cache file %s: compiling it again", path)
        if payload is not None:
            img = Image(variant, target, payload, "disk", time.perf_counter() - t0, path)
        else:
            t0 = time.perf_counter()
            data, text = _compile(program, src, defines, tag, target, extra_options)
            seconds = time.perf_counter() - t0
            if path is not None:
                try:
                    _write_atomic(path, _frame(data))
                except OSError as exc:
                    _warn_unwritable(path.parent, exc)
                    path = None
            img = Image(variant, target, data, "nvrtc", seconds, path, text)
        _memory[key] = img
        return img


def forget() -> None:
    """Drop the images kept in this process (tests: the next call reads the disk cache)."""
    with _lock:
        _memory.clear()
