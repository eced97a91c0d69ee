"""NVIDIA cuSolverDx's ``heev``, built at run time, raced and benchmarked beside fastspec's eigensolver.

cuSolverDx is NVIDIA's device-side dense solver library: block-wide device functions that solve
small matrices held in shared memory, several per block if asked, inside a kernel of one's own.
``heev`` computes eigenvalues (here: only those) of symmetric matrices: a Householder reduction to
tridiagonal form, then the implicit QR iteration on the tridiagonal. It is the vendor design
closest to fastspec's (one block per matrix, the matrix in shared memory, one launch for a batch),
so it is the one to measure against.

How it is built, with no CUDA toolkit (the ``fastspec[mathdx]`` extra: ``nvidia-libmathdx-cu13``,
NVIDIA's run-time code generator for the MathDx libraries, and ``nvidia-nvjitlink``):

1. libmathdx (bound here with ``ctypes``: a dozen C functions) describes the solver (size n x n,
   real, float32/float64, ``sm_XX``, block execution, shared-memory API, ``heev``, fill mode
   upper, no vectors), reports the block size and matrices per block it suggests and the
   workspace it needs, then generates the device function as LTO IR; cuSolverDx's own code comes
   as a fatbin.
2. NVRTC compiles the wrapper kernel ``csrc/cusolverdx_heev.cu`` (load A's lower triangle into
   shared memory, call the function, write the eigenvalues and a status) to LTO IR (``-dlto``).
3. nvJitLink links the three into one cubin for the GPU's arch (``cuda.bindings.nvjitlink``).

The cubin and the traits it was built with are cached like every other kernel (:mod:`.nvrtc`'s
private folder, a file framed with its SHA-256, keyed by the wrapper source, n, dtype, arch and the
versions of libmathdx, NVRTC and nvJitLink); ``fastspec precompile --algo cusolverdx`` fills it.
Loaded and launched by :mod:`.cuda` with the launch contract of fastspec's own kernel (the same
parameter block), as the pseudo-algorithm ``cusolverdx`` of :mod:`.variants`: the race times it,
the selection table may pick it where it wins, ``FASTSPEC_EIG_VARIANT=cusolverdx`` forces it.

:func:`missing` says in one line why it cannot be built here ("" when it can).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import re
import threading
import time
from dataclasses import dataclass

from . import cache, nvrtc
from .device import RESERVED_SMEM, DeviceSpec
from .nvrtc import KernelUnavailable

NAME = "cusolverdx"
"""The pseudo-algorithm's name in :mod:`.variants`, the race and the selection table."""
ENTRY = "fastspec_cusolverdx_heev"
WRAPPER = nvrtc.Program("cusolverdx", "cusolverdx_heev.cu", (), (ENTRY,))
DISTRIBUTIONS = ("nvidia-libmathdx-cu13", "nvidia-libmathdx-cu12")
INSTALL = "pip install 'fastspec[mathdx]' (nvidia-libmathdx-cu13 and nvidia-nvjitlink)"
FORMAT = b"fastspec-cusolverdx-image-1\n"
DTYPES = ("float32", "float64")
STATIC_SMEM = 1040
"""Static shared memory of the linked kernel (``cuobjdump -res-usage``: SHARED 1040, cuSolverDx heev's 1024 and the wrapper's flags, at
cuSolverDx 0.6.0, n 64-256): added to the dynamic bytes where the fit is judged without a GPU; on a
GPU the loaded kernel's own attribute is used."""
ITEMSIZE = {"float32": 4, "float64": 8}

# libmathdx's enums (libcusolverdx.h, libcommondx.h of nvidia-libmathdx-cu13 0.4.2)
_OP_SIZE, _OP_TYPE, _OP_PRECISION, _OP_SM, _OP_EXECUTION, _OP_BLOCK_DIM, _OP_API, _OP_FUNCTION = range(8)
_OP_ARRANGEMENT, _OP_FILL_MODE, _OP_BATCHES_PER_BLOCK, _OP_JOB = 8, 9, 14, 15
_TRAIT_SYMBOL, _TRAIT_BLOCK_DIM, _TRAIT_SUGGESTED_BLOCK_DIM, _TRAIT_SUGGESTED_BPB, _TRAIT_WORKSPACE = 2, 3, 5, 6, 12
_TYPE_REAL, _EXECUTION_BLOCK, _API_SMEM, _FUNCTION_HEEV, _JOB_NO_VECTORS = 0, 1, 0, 19, 0
_COL_MAJOR, _ROW_MAJOR, _UPPER, _LOWER = 0, 1, 0, 1
LAYOUT = (_COL_MAJOR, _LOWER)  # the layout cuSolverDx's heev runs best in (csrc/cusolverdx_heev.cu)
_PRECISION = {"float32": 5, "float64": 6}
_OPTION_TARGET_SM = 1


@dataclass(frozen=True)
class Heev:
    """What cuSolverDx generated for one problem: the traits the wrapper is compiled with."""

    n: int
    dtype: str
    arch: int
    threads: int              # block size (cuSolverDx's suggestion)
    per_block: int            # matrices per block (its suggestion)
    workspace: int            # reals of workspace per block (all its matrices)
    symbol: str               # the generated device function
    version: str              # cuSolverDx's version
    min_blocks: int = 1       # resident blocks per SM the launch bounds ask for (:func:`min_blocks`)

    @property
    def smem(self) -> int:
        """Dynamic shared memory of one block, bytes: the matrices, eigenvalues, workspace, status."""
        return ITEMSIZE[self.dtype] * (self.per_block * (self.n * self.n + self.n) + self.workspace) + 4 * self.per_block

    def defines(self) -> tuple[str, ...]:
        real = "float" if self.dtype == "float32" else "double"
        return (f"-DFS_REAL={real}", f"-DFS_N={self.n}", f"-DFS_THREADS={self.threads}", f"-DFS_BPB={self.per_block}",
                f"-DFS_WORK={self.workspace}", f"-DFS_HEEV={self.symbol}", f"-DFS_MIN_BLOCKS={self.min_blocks}")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("n", "dtype", "arch", "threads", "per_block", "workspace", "symbol",
                                              "version", "min_blocks")}


def min_blocks(threads: int, smem: int, arch: int) -> int:
    """The launch bounds' resident blocks per SM: as many as shared memory lets reside, but never
    so many that a thread gets fewer than 128 registers (fastspec's own kernel's rule,
    :func:`.cuda.variant_for`). Left alone, nvJitLink 13.0 gives heev at float32 n = 128 167-174
    registers (one 256-thread block per SM) where 13.5 gives 128 (two); bounded to 2 blocks, 13.0
    gives 128 with an 8-byte stack. float64 n = 128 (143 KB of shared memory: one block) stays
    unbounded."""
    try:
        per_sm = DeviceSpec.for_arch(arch).smem_per_sm
    except ValueError:  # an arch without a table: no bound asked for
        return 1
    resident = per_sm // (smem + STATIC_SMEM + RESERVED_SMEM)
    return max(1, min(resident, 65536 // (threads * 128)))


@dataclass(frozen=True)
class Built:
    """A linked cubin and what it was built from."""

    heev: Heev
    cubin: bytes
    registers: int | None     # per thread, from nvJitLink's log (None when it did not say)
    origin: str               # "built" (now), "disk" (cache file), "memory" (this process)
    seconds: float
    path: object = None       # the cache file, None when in memory only

    def image(self) -> nvrtc.Image:
        """As :mod:`.cuda` loads images."""
        return nvrtc.Image(None, nvrtc.Target(self.heev.arch), self.cubin, self.origin, self.seconds, self.path)


# --- libmathdx --------------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: list = []
_built: dict[str, Built] = {}
_heevs: dict[tuple[int, str, int], Heev] = {}


def distribution() -> tuple[str, str] | None:
    """``(name, version)`` of the installed libmathdx wheel, None without one."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _library_path() -> str:
    """Where ``libmathdx.so.0`` is: in the wheel's files, else where cuda-pathfinder finds it."""
    dist = distribution()
    if dist is not None:
        for f in importlib.metadata.distribution(dist[0]).files or ():
            if f.name.startswith("libmathdx.so"):
                return str(f.locate())
    try:
        from cuda import pathfinder  # noqa: PLC0415

        return pathfinder.load_nvidia_dynamic_lib("mathdx").abs_path
    except Exception as exc:  # noqa: BLE001 - absent, or an older pathfinder that does not know it
        raise KernelUnavailable(f"libmathdx not found ({type(exc).__name__}); {INSTALL}") from None


def _mathdx():
    """``ctypes.CDLL`` of libmathdx, loaded once, with NVRTC (which it needs) loaded before it."""
    if _lib:
        return _lib[0]
    nvrtc.version()  # KernelUnavailable without NVRTC; loads libnvrtc.so, which libmathdx links to
    try:
        from cuda import pathfinder  # noqa: PLC0415

        ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path, mode=ctypes.RTLD_GLOBAL)
    except Exception:  # noqa: BLE001, S110 - a toolkit's NVRTC on the library path serves as well
        pass
    path = _library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise KernelUnavailable(f"libmathdx at {path} does not load ({exc})") from None
    LL, P = ctypes.c_longlong, ctypes.POINTER
    sigs = {
        "cusolverdxGetVersion": [P(ctypes.c_int)] * 3,
        "cusolverdxCreateDescriptor": [P(LL)],
        "cusolverdxDestroyDescriptor": [LL],
        "cusolverdxSetOperatorInt64": [LL, ctypes.c_int, LL],
        "cusolverdxSetOperatorInt64s": [LL, ctypes.c_int, ctypes.c_size_t, P(LL)],
        "cusolverdxGetTraitInt64": [LL, ctypes.c_int, P(LL)],
        "cusolverdxGetTraitInt64s": [LL, ctypes.c_int, ctypes.c_size_t, P(LL)],
        "cusolverdxGetTraitStrSize": [LL, ctypes.c_int, P(ctypes.c_size_t)],
        "cusolverdxGetTraitStr": [LL, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p],
        "cusolverdxFinalizeCode": [LL, LL],
        "cusolverdxGetUniversalFATBINSize": [LL, P(ctypes.c_size_t)],
        "cusolverdxGetUniversalFATBIN": [LL, ctypes.c_size_t, ctypes.c_void_p],
        "commondxCreateCode": [P(LL)],
        "commondxDestroyCode": [LL],
        "commondxSetCodeOptionInt64": [LL, ctypes.c_int, LL],
        "commondxGetCodeLTOIRSize": [LL, P(ctypes.c_size_t)],
        "commondxGetCodeLTOIR": [LL, ctypes.c_size_t, ctypes.c_void_p],
        "commondxGetLastErrorStrSize": [P(ctypes.c_size_t)],
        "commondxGetLastErrorStr": [P(ctypes.c_int), ctypes.c_size_t, ctypes.c_char_p],
    }
    try:
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    except AttributeError as exc:
        raise KernelUnavailable(f"libmathdx at {path} lacks {exc.args[0].split()[-1]} (too old); {INSTALL}") from None
    _lib.append(lib)
    return lib


def _ok(lib, status: int, what: str) -> None:
    if status != 0:
        size = ctypes.c_size_t(0)
        text = ""
        if lib.commondxGetLastErrorStrSize(ctypes.byref(size)) == 0 and size.value:
            buf, code = ctypes.create_string_buffer(size.value), ctypes.c_int()
            if lib.commondxGetLastErrorStr(ctypes.byref(code), size, buf) == 0:
                text = buf.value.decode(errors="replace").strip()
        raise KernelUnavailable(f"libmathdx {what} failed (status {status}){': ' + text if text else ''}")


def cusolverdx_version() -> str:
    """cuSolverDx's ``major.minor.patch`` (KernelUnavailable without libmathdx)."""
    lib = _mathdx()
    v = [ctypes.c_int() for _ in range(3)]
    _ok(lib, lib.cusolverdxGetVersion(*(ctypes.byref(x) for x in v)), "version")
    return ".".join(str(x.value) for x in v)


def missing() -> str:
    """Why cuSolverDx's heev cannot be built here ("" when it can): libmathdx, NVRTC or nvJitLink absent."""
    if distribution() is None:
        return f"nvidia-libmathdx is not installed; {INSTALL}"
    try:
        _mathdx()
        _nvjitlink_version()
    except KernelUnavailable as exc:
        return str(exc)
    return ""


def _check_problem(n: int, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: cuSolverDx heev is built for float32/float64, got {dtype}")
    if not 1 <= n <= 1024:
        raise ValueError(f"n: must be in [1, 1024], got {n}")


def describe(n: int, dtype: str, arch: int) -> Heev:
    """cuSolverDx's heev for ``n x n`` ``dtype`` matrices on sm_``arch``: the block size and
    matrices per block it suggests (taken as they are), its workspace and its function's name.
    Kept per process. KernelUnavailable without libmathdx or when it refuses the problem."""
    _check_problem(n, dtype)
    key = (n, dtype, arch)
    with _lock:
        if key not in _heevs:
            _heevs[key] = _generate(n, dtype, arch)[0]
        return _heevs[key]


def _generate(n: int, dtype: str, arch: int, code: bool = False) -> tuple[Heev, bytes, bytes]:
    """Describe (and with ``code``, generate) heev: ``(traits, LTO IR, cuSolverDx's fatbin)``.
    Two descriptors: the first says what cuSolverDx suggests (a descriptor takes no operator once
    a trait was read), the second fixes those suggestions and builds the code."""
    lib = _mathdx()
    version = cusolverdx_version()
    LL = ctypes.c_longlong
    handles: list[int] = []
    code_handle = None

    def new(block: list[int] | None = None, per_block: int | None = None) -> int:
        h = LL()
        _ok(lib, lib.cusolverdxCreateDescriptor(ctypes.byref(h)), "create descriptor")
        handles.append(h.value)
        for which, *values in ((_OP_SIZE, n, n), (_OP_TYPE, _TYPE_REAL), (_OP_PRECISION, _PRECISION[dtype]),
                               (_OP_SM, arch * 10), (_OP_EXECUTION, _EXECUTION_BLOCK), (_OP_API, _API_SMEM),
                               (_OP_FUNCTION, _FUNCTION_HEEV),
                               (_OP_ARRANGEMENT, LAYOUT[0]), (_OP_FILL_MODE, LAYOUT[1]), (_OP_JOB, _JOB_NO_VECTORS),
                               *(((_OP_BLOCK_DIM, *block), (_OP_BATCHES_PER_BLOCK, per_block)) if block else ())):
            if len(values) == 1:
                _ok(lib, lib.cusolverdxSetOperatorInt64(h.value, which, values[0]), f"operator {which}")
            else:
                arr = (LL * len(values))(*values)
                _ok(lib, lib.cusolverdxSetOperatorInt64s(h.value, which, len(values), arr), f"operator {which}")
        return h.value

    def trait(handle: int, which: int) -> int:
        v = LL()
        _ok(lib, lib.cusolverdxGetTraitInt64(handle, which, ctypes.byref(v)), f"trait {which}")
        return v.value

    def trait3(handle: int, which: int) -> list[int]:
        v = (LL * 3)()
        _ok(lib, lib.cusolverdxGetTraitInt64s(handle, which, 3, v), f"trait {which}")
        return list(v)

    try:
        first = new()
        suggested = trait3(first, _TRAIT_SUGGESTED_BLOCK_DIM), max(1, trait(first, _TRAIT_SUGGESTED_BPB))
        handle = new(*suggested)
        x, y, z = trait3(handle, _TRAIT_BLOCK_DIM)
        workspace = trait(handle, _TRAIT_WORKSPACE)
        size = ctypes.c_size_t()
        _ok(lib, lib.cusolverdxGetTraitStrSize(handle, _TRAIT_SYMBOL, ctypes.byref(size)), "symbol size")
        buf = ctypes.create_string_buffer(size.value)
        _ok(lib, lib.cusolverdxGetTraitStr(handle, _TRAIT_SYMBOL, size, buf), "symbol")
        symbol = buf.value.decode()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol):  # it becomes a -D macro of the wrapper
            raise KernelUnavailable(f"libmathdx named the heev function {symbol!r}: not a C identifier")
        if y * z != 1:  # the wrapper numbers its threads by threadIdx.x alone
            raise KernelUnavailable(f"cuSolverDx suggests a {x} x {y} x {z} block for heev at {dtype} n = {n}: "
                                    "the wrapper takes one-dimensional blocks")
        heev = Heev(n, dtype, arch, x, suggested[1], workspace, symbol, version)
        heev = Heev(n, dtype, arch, x, suggested[1], workspace, symbol, version, min_blocks(x, heev.smem, arch))
        if not code:
            return heev, b"", b""
        c = LL()
        _ok(lib, lib.commondxCreateCode(ctypes.byref(c)), "create code")
        code_handle = c.value
        _ok(lib, lib.commondxSetCodeOptionInt64(code_handle, _OPTION_TARGET_SM, arch * 10), "target sm")
        _ok(lib, lib.cusolverdxFinalizeCode(code_handle, handle), "code generation")
        size = ctypes.c_size_t()
        _ok(lib, lib.commondxGetCodeLTOIRSize(code_handle, ctypes.byref(size)), "LTO IR size")
        lto = ctypes.create_string_buffer(size.value)
        _ok(lib, lib.commondxGetCodeLTOIR(code_handle, size, lto), "LTO IR")
        fsize = ctypes.c_size_t()
        _ok(lib, lib.cusolverdxGetUniversalFATBINSize(handle, ctypes.byref(fsize)), "fatbin size")
        fat = ctypes.create_string_buffer(fsize.value)
        _ok(lib, lib.cusolverdxGetUniversalFATBIN(handle, fsize, fat), "fatbin")
        return heev, lto.raw, fat.raw
    finally:
        if code_handle is not None:
            lib.commondxDestroyCode(code_handle)
        for h in handles:
            lib.cusolverdxDestroyDescriptor(h)


# --- NVRTC (-dlto) and nvJitLink ----------------------------------------------------------------------


def _nvjitlink():
    return nvrtc.binding("nvjitlink")


def _nvjitlink_version() -> tuple[int, int]:
    try:
        return tuple(_nvjitlink().version())
    except KernelUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - the binding found no libnvJitLink (its error types vary)
        raise KernelUnavailable(f"nvJitLink not found ({type(exc).__name__}: {exc}); {INSTALL}") from None


def _wrapper_ltoir(heev: Heev) -> bytes:
    """NVRTC: the wrapper kernel as LTO IR for sm_``arch`` (:func:`.nvrtc._compile`, its error log
    saved like any compile's)."""
    tag = f"heev-{heev.dtype}-n{heev.n}"
    return nvrtc._compile(WRAPPER, nvrtc.sources(WRAPPER), heev.defines(), tag, nvrtc.Target(heev.arch),
                          ("-dlto", "-rdc=true"), ltoir=True)[0]


def _link(arch: int, parts: list[tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """nvJitLink: LTO IR and fatbins -> a cubin for sm_``arch``; ``(cubin, info log)``."""
    jit = _nvjitlink()
    options = [f"-arch=sm_{arch}", "-lto", "-O3", "-verbose"]
    handle = jit.create(len(options), options)
    try:
        for kind, data, name in parts:
            jit.add_data(handle, getattr(jit.InputType, kind), data, len(data), name)
        try:
            jit.complete(handle)
        except Exception as exc:  # noqa: BLE001 - nvJitLinkError; its log says why
            log = bytearray(jit.get_error_log_size(handle))
            jit.get_error_log(handle, log)
            text = bytes(log).rstrip(b"\0").decode(errors="replace").strip()
            raise KernelUnavailable(f"nvJitLink could not link cuSolverDx heev for sm_{arch}: "
                                    f"{text.splitlines()[-1] if text else exc}") from None
        info = bytearray(jit.get_info_log_size(handle))
        jit.get_info_log(handle, info)
        cubin = bytearray(jit.get_linked_cubin_size(handle))
        jit.get_linked_cubin(handle, cubin)
        return bytes(cubin), bytes(info).rstrip(b"\0").decode(errors="replace")
    finally:
        jit.destroy(handle)


# --- the cache -----------------------------------------------------------------------------------------


def _key(n: int, dtype: str, arch: int) -> str:
    """The cache key: the wrapper's source and every version the cubin depends on (no library
    call but NVRTC's and nvJitLink's versions: a warm cache needs no code generation)."""
    dist = distribution()
    h = hashlib.sha256(FORMAT)
    h.update(nvrtc.sources(WRAPPER)[WRAPPER.source].encode())
    h.update(repr((n, dtype, arch, dist, nvrtc.version(), _nvjitlink_version())).encode())
    return h.hexdigest()[:24]


def _pack(b: Built) -> bytes:
    meta = {**b.heev.to_json(), "registers": b.registers}
    return json.dumps(meta, sort_keys=True).encode() + b"\n" + b.cubin


def _unpack(payload: bytes) -> tuple[Heev, int | None, bytes] | None:
    head, _, cubin = payload.partition(b"\n")
    try:
        meta = json.loads(head)
        registers = meta.pop("registers")
        return Heev(**meta), registers, cubin
    except (ValueError, TypeError, KeyError):
        return None


def build(n: int, dtype: str, arch: int) -> Built:
    """The linked cubin of cuSolverDx's heev for ``n x n`` ``dtype`` on sm_``arch``: from this
    process, the kernel cache, or generated, compiled and linked now (and cached). Thread-safe.
    KernelUnavailable when libmathdx, NVRTC or nvJitLink is missing or a step fails."""
    _check_problem(n, dtype)
    if distribution() is None:
        raise KernelUnavailable(f"nvidia-libmathdx is not installed; {INSTALL}")
    key = _key(n, dtype, arch)
    with _lock:
        if key in _built:
            b = _built[key]
            return Built(b.heev, b.cubin, b.registers, "memory", 0.0, b.path)
        folder = nvrtc.private_cache()
        path = None if folder is None else folder / f"cusolverdx-heev-{dtype}-n{n}-sm_{arch}-{key}.cubin"
        t0 = time.perf_counter()
        got = None
        try:
            blob = None if path is None else cache.read(path)
        except cache.Untrusted as exc:
            cache.warn_once(str(path), f"fastspec: kernel cache file not read, {exc}: delete it (it is then "
                                       "built again); building into memory for this process")
            path, blob = None, None
        payload = None if blob is None else nvrtc._unframe(blob)
        if payload is not None and payload.startswith(b"{"):
            got = _unpack(payload)
        if got is not None:
            heev, registers, cubin = got
            b = Built(heev, cubin, registers, "disk", time.perf_counter() - t0, path)
        else:
            heev, lto, fatbin = _generate(n, dtype, arch, code=True)
            cubin, info = _link(arch, [("LTOIR", _wrapper_ltoir(heev), "wrapper"), ("LTOIR", lto, "heev"),
                                       ("FATBIN", fatbin, "cusolverdx")])
            regs = re.search(r"Used (\d+) registers", info)
            b = Built(heev, cubin, int(regs.group(1)) if regs else None, "built", time.perf_counter() - t0, path)
            if path is not None:
                try:
                    nvrtc._write_atomic(path, nvrtc._frame(_pack(b)))
                except OSError:
                    b = Built(b.heev, b.cubin, b.registers, b.origin, b.seconds, None)
        _heevs.setdefault((n, dtype, arch), b.heev)
        _built[key] = b
        return b


def forget() -> None:
    """Drop what this process built or read (tests: the next build reads the disk cache)."""
    with _lock:
        _built.clear()
        _heevs.clear()


def info() -> dict[str, object]:
    """For ``fastspec info``: whether heev can be built here, and the versions it would be built with."""
    why = missing()
    dist = distribution()
    out: dict[str, object] = {"available": not why, "reason": why or None,
                              "libmathdx": f"{dist[0]} {dist[1]}" if dist else None}
    if not why:
        out["cusolverdx"] = cusolverdx_version()
        out["nvjitlink"] = ".".join(map(str, _nvjitlink_version()))
    return out
