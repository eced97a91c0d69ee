"""External batched ``eigvalsh`` solvers timed next to fastspec in the eigvalsh suite ("anchors").

Each ``make_*(device)`` returns either a callable ``A: Tensor[B, n, n] -> Tensor[B, n]``
(eigenvalues ascending, on ``A``'s device, in ``A``'s dtype: float32 or float64) or a one-line
``str`` saying why that solver cannot run here; the suite turns the string into a ``skipped``
row. Nothing here imports jax or cupy until a ``make_*`` asks for it.

* :func:`make_cusolver`: cuSOLVER ``cusolverDnXsyevBatched`` (CUDA >= 12.6 update 2, cuSOLVER
  >= 11.7.1), eigenvalues only, called through ``ctypes`` on the libcusolver that torch's CUDA
  wheels ship. The truly batched cuSOLVER path that ``torch.linalg.eigvalsh`` only takes for
  n <= 32 (it loops one ``syevj``/``syevd`` call per matrix above that). Reasons: "needs a CUDA
  device", "CUDA is not available to torch", "libcusolver not found (...)", "libcusolver with
  cusolverDnXsyevBatched not found (needs CUDA >= 12.6 update 2) ...", "cuSOLVER unusable on
  cuda:0: ...".
* :func:`make_jax`: ``jax.numpy.linalg.eigvalsh`` jitted, on the GPU for CUDA tensors (the
  jax-cuda13 plugin), on JAX's CPU backend for CPU tensors; the tensor goes in and out through
  DLPack, without a copy. Reasons: "jax not installed" (or "jax not importable: <why>"), "jax
  has no CUDA backend (...)", "jax sees no CUDA device 1 (...)", "jax eigvalsh failed on cuda:0:
  ...".
* :func:`make_cupy`: ``cupy.linalg.eigvalsh`` (``syevjBatched`` for a batch), CUDA only, run on
  torch's current stream. Reasons: "needs a CUDA device", "cupy not installed", "cupy eigvalsh
  failed on cuda:0: ...".
* :func:`make_cusolverdx`: NVIDIA cuSolverDx's ``heev`` (eigenvalues only, the whole matrix in
  shared memory, one block per matrix or several), built at run time by :mod:`fastspec.eig.mathdx`
  and launched by :func:`fastspec.eig.cuda.launch` as the ``cusolverdx`` algorithm, on torch's
  current stream; CUDA only. Reasons: "needs a CUDA device", "CUDA is not available to torch",
  :func:`fastspec.eig.mathdx.missing`'s ("nvidia-libmathdx is not installed; pip install
  'fastspec[mathdx]' ..."), "cuSolverDx heev failed on cuda:0: ...". Its shared memory bounds the
  sizes it takes (float32 n = 256 does not fit an H100's 227 KiB): :meth:`HeevDx.unfit` says so per
  size, and the suite lists such a size's row as ``skipped`` with that reason.

Each ``make_*`` runs one tiny solve before handing the callable out, so that a broken install
(a plugin built for another CUDA, a library without a symbol) is a skip reason at case-building
time instead of an error that takes the whole benchmark case down with it. For the same reason a
callable that takes only some sizes has ``unfit(n, dtype) -> str``, the reason it cannot solve
``n x n`` ``dtype`` matrices here ("" when it can), asked per size when the cases are built.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import os
import re
import site
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Eigvalsh = Callable[[Tensor], Tensor]
Anchor = Eigvalsh | str

# baseline names in the results: what a user would call
ANCHORS = ("cusolverDnXsyevBatched", "jax.numpy.linalg.eigvalsh", "cupy.linalg.eigvalsh", "cusolverdx::heev")


def make_anchors(device: torch.device) -> dict[str, Anchor]:
    """``{name: callable or reason}`` for every anchor on ``device``, in :data:`ANCHORS` order."""
    makers = (make_cusolver, make_jax, make_cupy, make_cusolverdx)
    return {name: make(device) for name, make in zip(ANCHORS, makers)}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _smoke(fn: Eigvalsh, device: torch.device) -> None:
    """Solve one 2×2 matrix with a known spectrum; raises if the solver is broken here."""
    A = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=torch.float32, device=device)
    w = fn(A)
    expected = torch.tensor([[1.0, 3.0]], device=device)
    if tuple(w.shape) != (1, 2) or w.device != A.device or not torch.allclose(w.float(), expected, atol=1e-5):
        raise RuntimeError(f"expected eigenvalues [[1, 3]] on {device}, got {w.tolist()} on {w.device}")


# --------------------------------------------------------------------------------------------
# cuSOLVER cusolverDnXsyevBatched through ctypes
# --------------------------------------------------------------------------------------------
#
# Bound from the headers of the CUDA 13 pip wheels (nvidia/cu13/include): cusolverDn.h of
# nvidia-cusolver 12.4.1.2 (lines 100-103, 4553-4557, 4762-4795), cusolver_common.h (status and
# cusolverEigMode_t, lines 159-196; cusolverGetVersion, 282), cublas_api.h of nvidia-cublas
# 13.10.0.20 (cublasFillMode_t, line 102), library_types.h (cudaDataType, lines 63-65); the
# wheel's libcusolver.so.12 exports every symbol below:
#
#   cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t *handle);
#   cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle);
#   cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t streamId);
#   cusolverStatus_t cusolverDnCreateParams(cusolverDnParams_t *params);
#   cusolverStatus_t cusolverDnDestroyParams(cusolverDnParams_t params);
#   cusolverStatus_t cusolverGetVersion(int *version);
#   cusolverStatus_t cusolverDnXsyevBatched_bufferSize(
#       cusolverDnHandle_t handle, cusolverDnParams_t params, cusolverEigMode_t jobz,
#       cublasFillMode_t uplo, int64_t n, cudaDataType dataTypeA, const void *A, int64_t lda,
#       cudaDataType dataTypeW, const void *W, cudaDataType computeType,
#       size_t *workspaceInBytesOnDevice, size_t *workspaceInBytesOnHost, int64_t batchSize);
#   cusolverStatus_t cusolverDnXsyevBatched(
#       cusolverDnHandle_t handle, cusolverDnParams_t params, cusolverEigMode_t jobz,
#       cublasFillMode_t uplo, int64_t n, cudaDataType dataTypeA, void *A, int64_t lda,
#       cudaDataType dataTypeW, void *W, cudaDataType computeType,
#       void *bufferOnDevice, size_t workspaceInBytesOnDevice,
#       void *bufferOnHost, size_t workspaceInBytesOnHost, int *info, int64_t batchSize);
#
# C enums are passed as int. Handles, params and streams are opaque pointers.

CUSOLVER_STATUS_SUCCESS = 0
CUSOLVER_EIG_MODE_NOVECTOR = 0   # cusolverEigMode_t (cusolver_common.h)
CUBLAS_FILL_MODE_LOWER = 0       # cublasFillMode_t (cublas_api.h)
CUBLAS_FILL_MODE_UPPER = 1
CUDA_R_32F = 0                   # cudaDataType (library_types.h)
CUDA_R_64F = 1
CUDA_DTYPES = {torch.float32: CUDA_R_32F, torch.float64: CUDA_R_64F}

STATUS_NAMES = {
    0: "CUSOLVER_STATUS_SUCCESS", 1: "CUSOLVER_STATUS_NOT_INITIALIZED",
    2: "CUSOLVER_STATUS_ALLOC_FAILED", 3: "CUSOLVER_STATUS_INVALID_VALUE",
    4: "CUSOLVER_STATUS_ARCH_MISMATCH", 5: "CUSOLVER_STATUS_MAPPING_ERROR",
    6: "CUSOLVER_STATUS_EXECUTION_FAILED", 7: "CUSOLVER_STATUS_INTERNAL_ERROR",
    8: "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED", 9: "CUSOLVER_STATUS_NOT_SUPPORTED",
    31: "CUSOLVER_STATUS_INVALID_WORKSPACE",
}

_P, _I, _I64, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t
SIGNATURES: dict[str, list] = {
    "cusolverDnCreate": [ctypes.POINTER(_P)],
    "cusolverDnDestroy": [_P],
    "cusolverDnSetStream": [_P, _P],
    "cusolverDnCreateParams": [ctypes.POINTER(_P)],
    "cusolverDnDestroyParams": [_P],
    "cusolverDnXsyevBatched_bufferSize": [
        _P, _P, _I, _I, _I64, _I, _P, _I64, _I, _P, _I, ctypes.POINTER(_SZ), ctypes.POINTER(_SZ), _I64],
    "cusolverDnXsyevBatched": [
        _P, _P, _I, _I, _I64, _I, _P, _I64, _I, _P, _I, _P, _SZ, _P, _SZ, _P, _I64],
}
# Optional: only used to say which version lacks XsyevBatched.
_VERSION_SIGNATURE = ("cusolverGetVersion", [ctypes.POINTER(_I)])

# The cuSOLVER documentation limits one call to n * lda * batchSize <= INT32_MAX (elements);
# JAX's own XsyevBatched path (jaxlib/gpu/solver_kernels_ffi.cc) chunks by bytes, the stricter of
# the two, and so do we: a larger batch is solved in several calls on the same stream.
MAX_CALL_BYTES = 2**31 - 1

_NOT_FOUND = "libcusolver not found (looked in /proc/self/maps, site-packages nvidia/**/lib, torch/lib, " \
             "CUDA_HOME/lib64, the loader path)"
_NO_SYMBOL = "libcusolver with cusolverDnXsyevBatched not found (needs CUDA >= 12.6 update 2)"


def _check(status: int, fn: str) -> None:
    if status != CUSOLVER_STATUS_SUCCESS:
        raise RuntimeError(f"{fn} returned {STATUS_NAMES.get(status, 'an unknown status')} ({status})")


def bind(lib) -> object:
    """Set ``argtypes``/``restype`` of every function we call on ``lib`` (a ``ctypes.CDLL``)."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def loaded_libcusolver(maps: str) -> list[str]:
    """Paths of libcusolver mapped in a process, from the text of ``/proc/<pid>/maps``.

    The one torch already loaded (its linalg library links it) is the one to share: the same
    CUDA major version as torch, and no second copy of cuSOLVER in the process."""
    out = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and re.fullmatch(r"libcusolver\.so(\.\d+)*", os.path.basename(parts[5].strip())):
            out.append(parts[5].strip())
    return list(dict.fromkeys(out))


# libcusolver's soname major per CUDA major (CUDA 12.x ships cuSOLVER 11.x, CUDA 13.x 12.x)
_SONAME_MAJOR = {"11": 11, "12": 11, "13": 12}


def _version_key(path: str) -> tuple[int, ...]:
    m = re.search(r"\.so((?:\.\d+)*)$", path)
    return tuple(int(v) for v in m.group(1).split(".")[1:]) if m else ()


def candidate_paths(*, maps: str | None = None, site_dirs: list[str] | None = None,
                    cuda_homes: list[str] | None = None, cuda_major: str | None = None) -> list[str]:
    """Where libcusolver may be, best first (arguments default to this process and machine).

    1. already mapped in this process (``/proc/self/maps``);
    2. ``site-packages/nvidia/**/libcusolver.so*`` (the pip CUDA wheels: ``nvidia/cusolver/lib``
       for CUDA 12, ``nvidia/cu13/lib`` for CUDA 13), then ``torch/lib``; within a folder tree the
       one for torch's CUDA major (under ``cu{major}/`` or with that CUDA's soname) first, then the
       highest soname version;
    3. ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda`` ``lib64``;
    4. ``ctypes.util.find_library("cusolver")`` (the loader's path).
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            maps = ""
    if site_dirs is None:
        site_dirs = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages(), *sys.path]
    if cuda_homes is None:
        cuda_homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    if cuda_major is None:
        cuda_major = (torch.version.cuda or "").split(".")[0]
    pattern = re.compile(r"libcusolver\.so(\.\d+)*")

    soname = _SONAME_MAJOR.get(cuda_major)

    def matches_torch(p: str) -> bool:
        return bool(cuda_major) and (f"/cu{cuda_major}/" in p or _version_key(p)[:1] == (soname,))

    def ranked(paths: list[str]) -> list[str]:
        paths = [p for p in paths if pattern.fullmatch(os.path.basename(p))]
        return sorted(paths, key=lambda p: (not matches_torch(p), tuple(-v for v in _version_key(p))))

    found = loaded_libcusolver(maps)
    for d in dict.fromkeys(d for d in site_dirs if d and os.path.isdir(d)):
        found += ranked(glob.glob(os.path.join(d, "nvidia", "**", "libcusolver.so*"), recursive=True))
        found += ranked(glob.glob(os.path.join(d, "torch", "lib", "libcusolver.so*")))
    for home in dict.fromkeys(h for h in cuda_homes if h):
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            found += ranked(glob.glob(os.path.join(home, sub, "libcusolver.so*")))
    name = ctypes.util.find_library("cusolver")
    if name:
        found.append(name)
    seen, out = set(), []
    for p in found:  # the same file reached twice (symlinks, sys.path duplicates) is tried once
        key = os.path.realpath(p) if os.path.isabs(p) else p
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _version(lib) -> str:
    fn = getattr(lib, _VERSION_SIGNATURE[0], None)
    if fn is None:
        return "?"
    fn.argtypes, fn.restype = _VERSION_SIGNATURE[1], ctypes.c_int
    v = ctypes.c_int()
    if fn(ctypes.byref(v)) != CUSOLVER_STATUS_SUCCESS:
        return "?"
    return f"{v.value // 1000}.{v.value % 1000 // 100}.{v.value % 100}"


def find_libcusolver(candidates: list[str] | None = None):
    """The first of ``candidates`` (default :func:`candidate_paths`) that loads and has every
    symbol of :data:`SIGNATURES`, as a ``ctypes.CDLL``; else a one-line reason (str)."""
    candidates = candidate_paths() if candidates is None else candidates
    if not candidates:
        return _NOT_FOUND
    tried = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} does not load ({_one_line(e)})")
            continue
        missing = [s for s in SIGNATURES if not hasattr(lib, s)]
        if not missing:
            return lib
        tried.append(f"{path} (cuSOLVER {_version(lib)}) lacks {missing[0]}")
    more = f" and {len(tried) - 2} more" if len(tried) > 2 else ""
    return f"{_NO_SYMBOL}: {'; '.join(tried[:2])}{more}"


@dataclass
class _Workspace:
    """Buffers for one (n, batch, dtype): reused by every call of that shape (the timed ones)."""

    key: tuple
    chunk: int           # matrices per cuSOLVER call (see MAX_CALL_BYTES)
    a: Tensor            # [batch, n, n] copy of the input: cuSOLVER overwrites its A
    info: Tensor         # [batch] int32 on the device
    device_bytes: int
    device_buf: Tensor   # uint8 [device_bytes] (at least 1 byte: a valid pointer)
    host_bytes: int
    host_buf: ctypes.Array


class XsyevBatched:
    """``A: [B, n, n] -> [B, n]`` ascending, through ``cusolverDnXsyevBatched``, eigenvalues only.

    One cuSOLVER handle and ``cusolverDnParams_t`` per instance (created here, destroyed when the
    instance is collected). A call copies ``A`` into a cached workspace (``A`` is ``void *``,
    in/out: with ``CUSOLVER_EIG_MODE_VECTOR`` it receives the eigenvectors, and with ``NOVECTOR``
    it is workspace, its triangle destroyed as in LAPACK's ``syev``), sets the handle's
    stream to torch's current stream (so the work is ordered with torch's and CUDA events on that
    stream time it), and solves in one call per ``MAX_CALL_BYTES`` of input. The input copy,
    device/host workspaces and the ``info`` array are cached for the last (n, batch, dtype), so
    repeated (timed) calls allocate only their ``[B, n]`` output, from torch's caching allocator,
    as every other solver in the suite does.

    Row-major vs column-major: cuSOLVER reads a contiguous ``[n, n]`` block column-major, i.e. it
    sees ``Aᵀ``. We pass ``CUBLAS_FILL_MODE_UPPER``, the upper triangle of ``Aᵀ``, which is the
    lower triangle of ``A``: the triangle ``torch.linalg.eigvalsh``, fastspec and the fp64
    reference read, so a matrix whose two triangles differ in the last bit is the same matrix for
    every solver compared.

    Args:
        lib: the loaded libcusolver (``ctypes.CDLL``) or a stand-in with the same functions.
        device: where the input tensors live. CUDA in use; a CPU device only with a stand-in
            ``lib`` (tests), where there is no stream.
        stream: ``() -> cudaStream_t`` as an int; default torch's current stream on ``device``.
    """

    def __init__(self, lib, device: torch.device, *, stream: Callable[[], int] | None = None):
        self.lib = bind(lib)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        if stream is None:
            def stream() -> int:  # `device`, not `self`: no reference cycle to the finalizer
                return torch.cuda.current_stream(device).cuda_stream
        self._stream = stream
        self._ws: _Workspace | None = None
        handle, params = ctypes.c_void_p(), ctypes.c_void_p()
        with self._on_device():
            _check(self.lib.cusolverDnCreate(ctypes.byref(handle)), "cusolverDnCreate")
            status = self.lib.cusolverDnCreateParams(ctypes.byref(params))
            if status != CUSOLVER_STATUS_SUCCESS:
                self.lib.cusolverDnDestroy(handle)
                _check(status, "cusolverDnCreateParams")
        self.handle, self.params = handle, params
        # not at interpreter exit: the CUDA context may already be gone, and the process's end
        # frees the handle anyway
        weakref.finalize(self, _destroy, self.lib, handle, params).atexit = False

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _workspace(self, batch: int, n: int, dtype: torch.dtype) -> _Workspace:
        key = (batch, n, dtype)
        if self._ws is not None and self._ws.key == key:
            return self._ws
        self._ws = None  # free the previous shape's buffers before allocating (GPU memory)
        itemsize = torch.finfo(dtype).bits // 8
        chunk = max(1, min(batch, MAX_CALL_BYTES // max(1, n * n * itemsize)))
        a = torch.empty(batch, n, n, dtype=dtype, device=self.device)
        w = torch.empty(chunk, n, dtype=dtype, device=self.device)  # only its pointer is read
        dev, host = ctypes.c_size_t(), ctypes.c_size_t()
        dt = CUDA_DTYPES[dtype]
        _check(self.lib.cusolverDnXsyevBatched_bufferSize(
            self.handle, self.params, CUSOLVER_EIG_MODE_NOVECTOR, CUBLAS_FILL_MODE_UPPER, n, dt,
            a.data_ptr(), n, dt, w.data_ptr(), dt, ctypes.byref(dev), ctypes.byref(host), chunk),
            "cusolverDnXsyevBatched_bufferSize")
        self._ws = _Workspace(
            key=key, chunk=chunk, a=a, info=torch.zeros(batch, dtype=torch.int32, device=self.device),
            device_bytes=dev.value, device_buf=torch.empty(max(1, dev.value), dtype=torch.uint8, device=self.device),
            host_bytes=host.value, host_buf=(ctypes.c_ubyte * max(1, host.value))())
        return self._ws

    def __call__(self, A: Tensor, *, check_info: bool = True) -> Tensor:
        """Eigenvalues ``[B, n]`` of ``A: [B, n, n]`` (float32/float64, on ``device``).

        ``check_info``: read the per-matrix ``info`` back (a device sync) and raise if a matrix
        failed; the suite's timed calls pass False, its accuracy check (same inputs) True.
        """
        if A.dim() != 3 or A.shape[-1] != A.shape[-2]:
            raise ValueError(f"A: expected a batch of square matrices [B, n, n], got shape {list(A.shape)}")
        if A.dtype not in CUDA_DTYPES:
            raise TypeError(f"A: expected float32 or float64, got {A.dtype}")
        if A.device != self.device:
            raise ValueError(f"A: expected a tensor on {self.device}, got {A.device}")
        batch, n = A.shape[0], A.shape[-1]
        W = torch.empty(batch, n, dtype=A.dtype, device=A.device)
        if batch == 0 or n == 0:
            return W
        with self._on_device():
            ws = self._workspace(batch, n, A.dtype)
            ws.a.copy_(A)
            _check(self.lib.cusolverDnSetStream(self.handle, self._stream()), "cusolverDnSetStream")
            dt, item = CUDA_DTYPES[A.dtype], A.element_size()
            a_ptr, w_ptr, info_ptr = ws.a.data_ptr(), W.data_ptr(), ws.info.data_ptr()
            host_ptr = ctypes.addressof(ws.host_buf)
            for start in range(0, batch, ws.chunk):
                count = min(ws.chunk, batch - start)
                _check(self.lib.cusolverDnXsyevBatched(
                    self.handle, self.params, CUSOLVER_EIG_MODE_NOVECTOR, CUBLAS_FILL_MODE_UPPER, n, dt,
                    a_ptr + start * n * n * item, n, dt, w_ptr + start * n * item, dt,
                    ws.device_buf.data_ptr(), ws.device_bytes, host_ptr, ws.host_bytes,
                    info_ptr + start * 4, count), "cusolverDnXsyevBatched")
            if check_info:
                _check_info(ws.info)
        return W


def _first_failure(codes: Tensor) -> tuple[int, int, int] | None:
    """``(index, code, count)`` of the first non-zero per-matrix result code and how many there
    are (one read-back: a device sync), None when every matrix succeeded."""
    bad = torch.nonzero(codes).flatten()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    return i, int(codes[i]), bad.numel()


def _check_info(info: Tensor) -> None:
    failure = _first_failure(info)
    if failure is None:
        return
    i, v, count = failure
    if v < 0:
        raise RuntimeError(f"cusolverDnXsyevBatched: parameter {-v} is invalid (info[{i}] = {v})")
    raise RuntimeError(f"cusolverDnXsyevBatched did not converge for {count} matrices "
                       f"(first: matrix {i}, info = {v})")


def _destroy(lib, handle, params) -> None:
    lib.cusolverDnDestroyParams(params)
    lib.cusolverDnDestroy(handle)


_cusolver_solvers: dict[int, XsyevBatched] = {}


def make_cusolver(device: torch.device) -> Anchor:
    """``cusolverDnXsyevBatched`` on ``device`` (one solver per CUDA device), or why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _cusolver_solvers:
        return _cusolver_solvers[index]
    device = torch.device("cuda", index)
    try:
        # torch loads its linalg library, and the libcusolver it links, on the first linalg call:
        # make that happen so /proc/self/maps names the very library torch uses
        torch.linalg.eigvalsh(torch.eye(2, device=device))
    except Exception as e:  # noqa: BLE001 - a broken torch linalg is a reason, not a crash
        return f"torch.linalg.eigvalsh fails on {device}: {_one_line(e)}"
    lib = find_libcusolver()
    if isinstance(lib, str):
        return lib
    try:
        solver = XsyevBatched(lib, device)
        _smoke(solver, device)
    except Exception as e:  # noqa: BLE001
        return f"cuSOLVER unusable on {device}: {_one_line(e)}"
    _cusolver_solvers[index] = solver
    return solver


# --------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------

class JaxEigvalsh:
    """``A: [B, n, n] -> [B, n]`` through jitted ``jax.numpy.linalg.eigvalsh`` on one JAX device.

    ``A`` goes in through DLPack (no copy; for a CUDA tensor JAX's stream waits for torch's) and
    the result comes back the same way. The call blocks until JAX is done: JAX runs on its own
    stream, so CUDA events on torch's stream would not see its work otherwise. ``jax.jit``
    compiles once per input shape and dtype (the suite's accuracy check and warmup calls pay
    that, not the timed ones). ``UPLO="L", symmetrize_input=False``: read the lower triangle
    only, as torch, fastspec and the fp64 reference do (JAX's default averages both triangles).
    """

    def __init__(self, jax, jnp, jax_device, device: torch.device):
        self.jax, self.jax_device, self.device = jax, jax_device, torch.device(device)
        self._fn = jax.jit(functools.partial(jnp.linalg.eigvalsh, UPLO="L", symmetrize_input=False))

    def __call__(self, A: Tensor) -> Tensor:
        x = self.jax.dlpack.from_dlpack(A.detach().contiguous(), device=self.jax_device)
        w = self._fn(x)
        w.block_until_ready()
        return torch.from_dlpack(w)


def _import_reason(name: str, e: ImportError) -> str:
    """Why an anchor's package cannot be used: absent, or present but broken (its own message)."""
    if isinstance(e, ModuleNotFoundError) and e.name == name:
        return f"{name} not installed"
    return f"{name} not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def make_jax(device: torch.device) -> Anchor:
    """``jax.numpy.linalg.eigvalsh`` for tensors on ``device`` (CUDA or CPU), or why not."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return f"no jax backend for {device.type} tensors"
    # JAX preallocates 75% of GPU memory when its GPU backend starts, next to torch's allocator;
    # on demand instead. Read when the backend initialises, so set before jax is imported (a
    # user's own setting wins).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.dlpack  # jax.dlpack.from_dlpack below: a submodule, not always imported by jax
        import jax.numpy as jnp
    except ImportError as e:
        return _import_reason("jax", e)
    kind = "cuda" if device.type == "cuda" else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available to torch"
    try:
        devices = jax.devices(kind)
    except RuntimeError as e:
        return f"jax has no {kind.upper()} backend ({_one_line(e)})"
    if kind == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # JAX maps a DLPack CUDA ordinal through local_hardware_id; match the same way
        match = [d for d in devices if getattr(d, "local_hardware_id", d.id) == index]
        if not match:
            return f"jax sees no CUDA device {index} (it has {len(devices)})"
        device = torch.device("cuda", index)
    else:
        match = devices[:1]
    # float64 inputs must stay float64 (JAX computes them in float32 otherwise); process-wide,
    # set before any JAX array exists here
    jax.config.update("jax_enable_x64", True)
    fn = JaxEigvalsh(jax, jnp, match[0], device)
    try:
        _smoke(fn, device)
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA plugin built for another CUDA
        return f"jax eigvalsh failed on {device}: {_one_line(e)}"
    return fn


# --------------------------------------------------------------------------------------------
# CuPy
# --------------------------------------------------------------------------------------------

def make_cupy(device: torch.device) -> Anchor:
    """``cupy.linalg.eigvalsh`` for CUDA tensors on ``device``, or why not.

    CuPy solves a batch with ``syevjBatched`` (``cupyx.cusolver.syevj``), lower triangle, and
    checks its ``info`` itself. It runs on torch's current stream (``ExternalStream``), so the
    suite's CUDA events time it like the other solvers.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA device"
    try:
        import cupy
    except ImportError as e:
        return _import_reason("cupy", e)
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)

    def run(A: Tensor) -> Tensor:
        stream = torch.cuda.current_stream(device)
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream):
            return torch.from_dlpack(cupy.linalg.eigvalsh(cupy.from_dlpack(A.detach().contiguous())))

    try:
        _smoke(run, device)
    except Exception as e:  # noqa: BLE001 - e.g. a cupy wheel for another CUDA major
        return f"cupy eigvalsh failed on {device}: {_one_line(e)}"
    return run


# --------------------------------------------------------------------------------------------
# cuSolverDx heev (fastspec.eig.mathdx)
# --------------------------------------------------------------------------------------------

class HeevDx:
    """``A: [B, n, n] -> [B, n]`` ascending through cuSolverDx's ``heev``, eigenvalues only.

    The kernel is :mod:`fastspec.eig.mathdx`'s (built at the first call of an ``(n, dtype)``,
    cached like fastspec's own kernels), launched by :func:`fastspec.eig.cuda.launch` with
    ``algo="cusolverdx"`` on torch's current stream: asynchronous, so CUDA events on that stream
    time it as they time fastspec. It reads ``A``'s lower triangle, as fastspec, torch and the
    fp64 reference do, in place (no copy: its wrapper loads the triangle into shared memory).
    Per matrix it writes a status (0: solved; -1: non-finite input; > 0: not converged, and that
    row of the output is NaN) into an int32 ``[B]`` tensor kept for the last batch size, as the
    cuSOLVER anchor keeps its ``info``.

    Args:
        device: the CUDA device the inputs live on (a CPU device only with a stand-in ``launch``:
            tests).
        spec: that device's :class:`fastspec.eig.cuda.DeviceSpec`, which :meth:`unfit` judges
            the shared memory against.
        launch: ``(A, out, algo=, status=) -> None``; default :func:`fastspec.eig.cuda.launch`.
    """

    ALGO = "cusolverdx"

    def __init__(self, device: torch.device, spec, *, launch: Callable | None = None):
        # imported here: importing the anchors module imports no solver stack
        from fastspec.eig import cuda

        self.device, self.spec = torch.device(device), spec
        self._launch = cuda.launch if launch is None else launch
        self._unfit: dict[tuple[int, torch.dtype], str] = {}
        self._status: Tensor | None = None

    def unfit(self, n: int, dtype: torch.dtype) -> str:
        """Why ``n x n`` ``dtype`` matrices cannot be solved on this GPU ("" when they can), in
        one line that starts "cuSolverDx heev": not float32/float64, or its shared memory for them
        past the block's opt-in ("cuSolverDx heev needs 274448 bytes of shared memory for float32
        n = 256, sm_90 gives a block 232448"). Kept per (n, dtype): the timed call asks too, and
        pays one dictionary look-up."""
        key = (n, dtype)
        why = self._unfit.get(key)
        if why is None:
            from fastspec.eig import cuda

            name = str(dtype).removeprefix("torch.")
            try:
                cuda.variant_for(n, name, self.spec, self.ALGO)
                why = ""
            except ValueError as e:
                # "algo: 'cusolverdx' needs ... bytes of shared memory ...", as the launcher says it
                why = str(e).removeprefix(f"algo: {self.ALGO!r}")
                why = f"cuSolverDx heev{why}" if why != str(e) else f"cuSolverDx heev: {why}"
            self._unfit[key] = why
        return why

    def __call__(self, A: Tensor, *, check_status: bool = True) -> Tensor:
        """Eigenvalues ``[B, n]`` of ``A: [B, n, n]`` (float32/float64, on ``device``).

        ``check_status``: read the per-matrix status back (a device sync) and raise if a matrix
        failed; the suite's timed calls pass False, its accuracy check (same inputs) True. A size
        :meth:`unfit` refuses raises ValueError with its reason, before anything is launched.
        """
        if A.dim() != 3 or A.shape[-1] != A.shape[-2]:
            raise ValueError(f"A: expected a batch of square matrices [B, n, n], got shape {list(A.shape)}")
        if A.device != self.device:
            raise ValueError(f"A: expected a tensor on {self.device}, got {A.device}")
        batch, n = A.shape[0], A.shape[-1]
        W = torch.empty(batch, n, dtype=A.dtype, device=A.device)
        if batch == 0 or n == 0:
            return W
        why = self.unfit(n, A.dtype)
        if why:
            raise ValueError(why)
        status = self._status
        if status is None or status.shape[0] != batch:
            status = self._status = torch.empty(batch, dtype=torch.int32, device=A.device)
        self._launch(A, W, algo=self.ALGO, status=status)
        if check_status:
            _check_status(status)
        return W


def _check_status(status: Tensor) -> None:
    failure = _first_failure(status)
    if failure is None:
        return
    i, v, count = failure
    if v < 0:
        raise RuntimeError(f"cuSolverDx heev: matrix {i} has a non-finite element (status {v}); "
                           f"{count} matrices failed")
    raise RuntimeError(f"cuSolverDx heev did not converge for {count} matrices "
                       f"(first: matrix {i}, status = {v})")


def make_cusolverdx(device: torch.device) -> Anchor:
    """cuSolverDx's ``heev`` for CUDA tensors on ``device``, or why not (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    try:
        from fastspec.eig import cuda, mathdx

        why = mathdx.missing()  # the extra absent, or NVRTC or nvJitLink: the install command
    except Exception as e:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"cuSolverDx heev unusable: {_one_line(e)}"
    if why:
        return why
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    try:
        fn = HeevDx(device, cuda.DeviceSpec.of_device(index))
        _smoke(fn, device)  # n = 2 float32: cuSolverDx takes it (32 matrices per block)
    except Exception as e:  # noqa: BLE001 - e.g. NVRTC or nvJitLink failing for this GPU
        return f"cuSolverDx heev failed on {device}: {_one_line(e)}"
    return fn
