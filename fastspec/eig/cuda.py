"""Launcher of the CUDA eigensolver: launch plan, NVRTC image -> driver kernel, launch on torch's stream.

``launch(A3, out)`` for CUDA ``A3: [B, n, n]`` float32/float64 -> ``out: [B, n]`` ascending
(lower triangle read; ``native.cuda_eigvalsh`` flattens ``[..., n, n]`` to it). The kernel
(``csrc/eig_kernel.cu``) is compiled by :mod:`.nvrtc` for the device's arch and
this ``(n, dtype)`` on first use, loaded with ``cuLibraryLoadData`` (context-independent: one
load serves every device) and launched with ``cuLaunchKernel`` on
``torch.cuda.current_stream()``: asynchronous, no host sync, capturable in a CUDA graph once
the first call (compile and load) has happened outside the capture.

The steady state (every call after a problem's first): one dictionary look-up of the problem's
launch (:data:`_plans`, keyed by device, n, dtype, batch, ``$FASTSPEC_EIG_VARIANT`` and the
algorithm asked for), the parameters packed into this thread's buffer, one ``cuLaunchKernel``.
No allocation (but the workspace of the rare global-workspace path), no pass over the input, no
host sync; the plan, the selection table and the driver binding are not consulted again until
:func:`forget`.

The plan (what :func:`plan` decides per problem, from :class:`DeviceSpec`):

* threads = ``round_up(n, 32)``, at most ``MAX_THREADS``: one column, later one eigenvalue, per
  thread (the limits and layout numbers are :mod:`.limits`'s, the one place they are written);
* the matrix in shared memory when ``sizeof(real) * (block_work_elems(n) + SCRATCH)`` fits the
  per-block opt-in (227 KiB on H100: fp32 n <= 237, fp64 n <= 166); else a global workspace of
  one n x n matrix per block, the grid capped at 4 blocks per SM;
* register budget (launch bounds): sized for the blocks that shared memory lets reside on one SM
  (at most 4 on the workspace path), but never below the algorithm's register floor per thread
  (:meth:`.variants.Algorithm.registers`: 128, 96 for packed float32): no spills on sm_80/sm_90
  from NVRTC 13.0 or 13.5.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import struct
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from .._trace import assume_constant_result
from . import cache, nvrtc, variants
from .limits import MAX_N, SCRATCH
from .device import RESERVED_SMEM, DeviceSpec
from .nvrtc import KernelUnavailable, Variant

ITEMSIZE = {"float32": 4, "float64": 8}


def block_work_elems(n: int, matrix_here: bool) -> int:
    """Reals of one block's work arrays of the block algorithm (:func:`.variants.block_work_elems`,
    eig_core.h's ``block_work_elems``; tests/test_eig_nvrtc.py checks the two equal)."""
    return variants.block_work_elems(n, matrix_here)


def smem_bytes(n: int, dtype: str, matrix_here: bool, algo: str = "block") -> int:
    """Dynamic shared memory of one block: the work arrays, then the reduction scratch."""
    elems = block_work_elems(n, matrix_here) if algo == "block" else variants.ALGORITHMS[algo].smem_elems(n)
    return ITEMSIZE[dtype] * (elems + SCRATCH)


def variant_for(n: int, dtype: str, spec: DeviceSpec, algo: str = "block") -> Variant:
    """The compile-time specialization of algorithm ``algo`` for ``n`` and ``dtype`` on this GPU;
    ValueError when the algorithm does not take them or its shared memory does not fit (the block
    algorithm takes every n: past shared memory, its matrix goes to a global workspace)."""
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n: must be in [1, {MAX_N}], got {n}")
    if algo in variants.EXTERNAL:
        return _external_variant(n, dtype, spec, algo)
    a = variants.ALGORITHMS.get(algo)
    if a is None:
        raise ValueError(f"algo: expected one of {sorted(variants.names())}, got {algo!r}")
    if not a.takes(n, dtype):
        raise ValueError(f"algo: {algo!r} takes {'/'.join(a.dtypes)} with n <= {a.max_n}, got {dtype} n = {n}")
    smem = smem_bytes(n, dtype, True, algo) <= spec.smem_optin
    if not smem and algo != "block":
        raise ValueError(f"algo: {algo!r} needs {smem_bytes(n, dtype, True, algo)} bytes of shared memory for "
                         f"{dtype} n = {n}, sm_{spec.cc} gives a block {spec.smem_optin}")
    threads = a.threads(n)
    resident = spec.smem_per_sm // (smem_bytes(n, dtype, smem, algo) + RESERVED_SMEM)
    if not smem:
        resident = min(resident, 4)  # the workspace grid's blocks per SM
    # the launch bounds ask for every block shared memory lets reside, down to the algorithm's
    # register floor per thread: 128 (with n a compile-time constant the loops unroll further, and
    # at 64-93 registers NVRTC 13.0 spills the block algorithm: float32 n = 64 and n = 240 for
    # sm_90, float64 at most sizes), 96 for packed float32
    return Variant(dtype, n, smem, threads, max(1, min(resident, 65536 // (threads * a.registers(dtype)))), algo)


def _external_variant(n: int, dtype: str, spec: DeviceSpec, algo: str) -> Variant:
    """cuSolverDx's heev (:mod:`.mathdx`) as a variant: its block size and matrices per block, as
    cuSolverDx suggests them; ValueError when it cannot be built here (the ``fastspec[mathdx]``
    extra absent, NVRTC or nvJitLink missing) or its shared memory does not fit this GPU."""
    from . import mathdx  # noqa: PLC0415 - only for this algorithm: loads libmathdx

    if not variants.takes(algo, n, dtype):
        raise ValueError(f"algo: {algo!r} takes {'/'.join(variants.EXTERNAL[algo])}, got {dtype}")
    why = mathdx.missing()
    if why:
        raise ValueError(f"algo: {algo!r} cannot be built here: {why}")
    try:
        h = mathdx.describe(n, dtype, spec.cc)
    except KernelUnavailable as exc:
        raise ValueError(f"algo: {algo!r}: {exc}") from None
    if h.smem + mathdx.STATIC_SMEM > spec.smem_optin:
        raise ValueError(f"algo: {algo!r} needs {h.smem + mathdx.STATIC_SMEM} bytes of shared memory for {dtype} "
                         f"n = {n}, sm_{spec.cc} gives a block {spec.smem_optin}")
    return Variant(dtype, n, True, h.threads, 1, algo, h.per_block)


def _external_smem(v: Variant, spec: DeviceSpec) -> int:
    from . import mathdx  # noqa: PLC0415

    return mathdx.describe(v.n, v.dtype, spec.cc).smem


@dataclass(frozen=True)
class Plan:
    variant: Variant
    smem: int        # dynamic shared memory per block, bytes
    grid: int
    workspace: int   # reals of global workspace (0 when the matrix is in shared memory)
    why: str = ""    # why this algorithm (variants.choose)


def choose_variant(batch: int, n: int, dtype: str, spec: DeviceSpec) -> tuple[Variant, str]:
    """The variant that runs ``batch`` matrices ``n x n`` on this GPU and why: the first of
    :func:`.variants.choose`'s answers whose shared memory fits (the block algorithm always does)."""
    skipped = []
    for c in variants.choose(spec.cc, dtype, n, batch):
        try:
            v = variant_for(n, dtype, spec, c.algo)
        except ValueError as exc:  # shared memory does not fit this GPU
            skipped.append(f"{c.algo}: {exc}")
            continue
        return v, "; ".join([c.why, *(f"not {s}" for s in skipped)])
    raise AssertionError("unreachable: the block algorithm takes every n")


def plan(batch: int, n: int, dtype: str, spec: DeviceSpec, algo: str | None = None) -> Plan:
    """The launch of ``batch`` matrices: ``algo`` when given, else :func:`choose_variant`'s."""
    if algo is None:
        v, why = choose_variant(batch, n, dtype, spec)
    else:
        v, why = variant_for(n, dtype, spec, algo), f"asked for {algo}"
    if v.algo in variants.EXTERNAL:  # per_block matrices per block, all in shared memory
        return Plan(v, _external_smem(v, spec), min(-(-batch // v.per_block), 2**31 - 1), 0, why)
    grid = min(batch, 2**31 - 1) if v.smem else min(batch, 4 * spec.sms)
    return Plan(v, smem_bytes(n, dtype, v.smem, v.algo), grid, 0 if v.smem else grid * n * n, why)


# --- the driver --------------------------------------------------------------------------------


def _driver():
    """``cuda.bindings.driver``, or KernelUnavailable saying what to install."""
    return nvrtc.binding("driver")


def _check(result, what: str):
    """Unpack a ``cuda.bindings.driver`` call's ``(CUresult, *values)``; raise on failure."""
    return nvrtc.unpack(result, f"CUDA driver {what}")


@dataclass
class _Loaded:
    kernel: object          # CUkernel
    library: object         # CUlibrary, kept alive with the kernel
    devices: set            # ordinals whose attributes are set


_lock = threading.Lock()
_loaded: dict[tuple[Variant, int], _Loaded] = {}  # (variant, target arch) -> the loaded kernel
_failed: dict[tuple, str] = {}  # (variant, target arch) or (program, defines, arch) -> why it cannot be had
_specs: dict[int, DeviceSpec] = {}
_targets: dict[int, nvrtc.Target] = {}
_driver_ready: list[bool] = []


@assume_constant_result
def _binding_status() -> tuple[bool, str]:
    """Whether the binding and NVRTC are here (no GPU or driver needed); asked once."""
    try:
        _driver()
        major, minor = nvrtc.version()
    except KernelUnavailable as exc:
        return False, str(exc)
    return True, f"NVRTC {major}.{minor}"


_binding: list[tuple[bool, str]] = []


def _binding_ok() -> tuple[bool, str]:
    """:func:`_binding_status`, asked once per process: ``(True, "NVRTC 13.0")`` or ``(False, why)``."""
    if not _binding:
        _binding.append(_binding_status())
    return _binding[0]


def binding_ok() -> bool:
    """:func:`_binding_ok`'s verdict alone: all of :func:`status` a caller holding a CUDA tensor
    needs (a GPU is then visible to torch), without asking torch for its devices again."""
    return _binding_ok()[0]


def status() -> tuple[bool, str]:
    """``(available, reason)`` of the CUDA solver in this process (cheap after the first call)."""
    ok, why = _binding_ok()
    if not ok:
        return False, why
    if not torch.cuda.is_available():
        return False, f"no CUDA device visible to torch ({why} is here to compile the kernel)"
    return True, f"batched block-per-matrix kernel compiled by {why} at first use, float32/float64, n <= {MAX_N}"


def build_info() -> dict[str, object]:
    """Whether the kernel can be compiled here, for which arch, and where the cache is, its owner
    and mode and whether it is used (``fastspec info``)."""
    folder = nvrtc.cache_dir()
    info: dict[str, object] = {"compiler": None, "binding": None, "target": None, "cache": str(folder),
                               "cache_writable": _writable(folder), **cache.describe(folder),
                               "cached_kernels": len([f for f in folder.iterdir() if f.suffix in (".cubin", ".ptx")])
                               if folder.is_dir() else 0}
    ok, compiler = _binding_ok()
    if not ok:
        info["reason"] = compiler
        return info
    try:
        archs = nvrtc.supported_archs()
    except KernelUnavailable as exc:
        info["reason"] = str(exc)
        return info
    try:
        binding = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:  # importable, but not installed as a distribution
        binding = "?"
    info["compiler"] = compiler
    info["binding"] = f"cuda-bindings {binding}"
    info["archs"] = archs
    if torch.cuda.is_available():
        cc = DeviceSpec.of_device(torch.cuda.current_device()).cc
        try:
            info["target"] = nvrtc.choose_target(cc, archs).name
        except KernelUnavailable as exc:
            info["reason"] = str(exc)
    return info


SHOWN = (("float32", 128, 4096), ("float64", 128, 256), ("float32", 256, 512), ("float32", 64, 4096))
"""The problems ``fastspec info`` shows the algorithm choice for: the race's shapes."""


def selection_info() -> dict[str, object]:
    """Which algorithm :func:`choose_variant` picks, and why, for the problems of :data:`SHOWN` on
    this GPU (sm_90 without one), plus the table and the override (``fastspec info``)."""
    if torch.cuda.is_available():
        spec = DeviceSpec.of_device(torch.cuda.current_device())
    else:
        spec = DeviceSpec.for_arch(90)
    out: dict[str, object] = {"arch": spec.cc, "gpu": torch.cuda.is_available(), "table": str(variants.TABLE),
                              "override": os.environ.get(variants.ENV) or None, "choices": []}
    try:
        out["rows"] = len(variants.load_table())
        for dtype, n, batch in SHOWN:
            v, why = choose_variant(batch, n, dtype, spec)
            out["choices"].append({"dtype": dtype, "n": n, "batch": batch, "algo": v.algo, "why": why})
    except ValueError as exc:  # a bad FASTSPEC_EIG_VARIANT or table: said, not raised
        out["error"] = str(exc)
    return out


def _writable(folder) -> bool:
    """Whether ``folder`` can be written, or created under its nearest existing parent."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def _device_setup(index: int) -> tuple[DeviceSpec, nvrtc.Target]:
    if index not in _specs:
        spec = DeviceSpec.of_device(index)
        _targets[index] = nvrtc.choose_target(spec.cc)
        _specs[index] = spec
    return _specs[index], _targets[index]


def _init_driver(driver) -> None:
    if not _driver_ready:
        _check(driver.cuInit(0), "cuInit")
        version = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        if version < 12000:  # cuLibraryLoadData and cuKernelSetAttribute are CUDA 12.0 driver APIs
            raise KernelUnavailable(f"the NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
                                    "the eigensolver's run-time loading needs a driver for CUDA 12.0 or newer")
        _driver_ready.append(True)


_thread = threading.local()


def _ensure_context(driver, index: int) -> None:
    """Device ``index``'s primary context (torch's) current on this thread for the driver API:
    torch's caching allocator may serve a thread its tensors without ever making it current."""
    seen = getattr(_thread, "devices", None)
    if seen is None:
        seen = _thread.devices = set()
    if index in seen:
        return
    ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    primary = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    if int(ctx) != int(primary):
        _check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    _check(driver.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")  # torch holds it alive
    seen.add(index)


def _load(driver, variant: Variant, target: nvrtc.Target) -> _Loaded:
    if variant.algo in variants.EXTERNAL:  # cuSolverDx's heev: generated, compiled and linked (mathdx.py)
        from . import mathdx  # noqa: PLC0415

        if target.ptx:
            raise KernelUnavailable(f"cuSolverDx heev is linked into a cubin: this NVRTC cannot target "
                                    f"the GPU (PTX for {target.name})")
        built = mathdx.build(variant.n, variant.dtype, target.arch)
        lib, kernels = _load_image(driver, built.image(), (mathdx.ENTRY,), "cuSolverDx heev")
        return _Loaded(kernels[mathdx.ENTRY], lib, set())
    image = nvrtc.compile_variant(variant, target)
    lib, kernels = _load_image(driver, image, (nvrtc.ENTRY,), "the compiled eigensolver")
    return _Loaded(kernels[nvrtc.ENTRY], lib, set())


def _load_image(driver, image: nvrtc.Image, entries: tuple[str, ...], what: str) -> tuple[object, dict[str, object]]:
    """``(CUlibrary, {entry: CUkernel})`` of a compiled image."""
    _init_driver(driver)
    # context-independent loading: one library for every device; the driver loads the kernel
    # into a context at its first launch there
    lib = _check(driver.cuLibraryLoadData(image.data, None, None, 0, None, None, 0),
                 f"loading {what} ({image.path or 'in memory'})")
    return lib, {e: _check(driver.cuLibraryGetKernel(lib, e.encode()), f"cuLibraryGetKernel({e})") for e in entries}


# --- any other program of csrc/ (the exact covariance update's Gram kernel) ------------------------

_programs: dict[tuple, tuple[object, dict[str, object]]] = {}  # (program, defines, arch) -> (library, kernels)


def load_program(program: nvrtc.Program, defines: tuple[str, ...], tag: str, device: torch.device | int
                 ) -> dict[str, object]:
    """The entry points of ``program`` built with ``defines`` for ``device``'s arch: compiled (or
    found in the kernel cache) and loaded on first use, then kept for the process. Returns
    ``{entry name: CUkernel}``; KernelUnavailable with the reason."""
    index = device_index(device)
    driver = _driver()
    with _lock:
        _, target = _device_setup(index)
        key = (program, tuple(defines), target.arch)
        if key in _failed:
            raise KernelUnavailable(_failed[key])
        got = _programs.get(key)
        if got is None:
            try:
                image = nvrtc.compile_program(program, tuple(defines), tag, target)
                got = _programs[key] = _load_image(driver, image, program.entries, program.source)
            except KernelUnavailable as exc:
                _failed[key] = str(exc)
                raise
    return got[1]


def set_max_smem(kernel, smem: int, device: torch.device | int) -> None:
    """Let ``kernel`` take ``smem`` bytes of dynamic shared memory on ``device`` (past 48 KiB a
    kernel must opt in)."""
    driver = _driver()
    dev = _check(driver.cuDeviceGet(device_index(device)), "cuDeviceGet")
    _check(driver.cuKernelSetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       smem, kernel, dev), "setting the kernel's shared memory")


def launch_kernel(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, args: list,
                  device: torch.device | int) -> None:
    """``cuLaunchKernel`` of ``kernel`` with the ctypes values ``args`` (in the order and widths of
    its parameters), asynchronous on torch's current stream of ``device``."""
    index = device_index(device)
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    # the driver copies the parameter values during this call: args may go out of scope after
    _launch_on(_driver(), index, kernel, grid, block, smem, ctypes.addressof(params))


def _launch_on(driver, index: int, kernel, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
               params: int) -> None:
    """``cuLaunchKernel`` with the parameter array at address ``params`` on torch's current stream
    of device ``index``; ``torch.cuda.device(index)`` entered only when ``index`` is not already
    current (a no-op then, and the costliest step of a launch)."""
    if _current_device() == index:
        _ensure_context(driver, index)
        result = driver.cuLaunchKernel(kernel, *grid, *block, smem, _raw_stream(index), params, 0)
    else:
        with torch.cuda.device(index):
            _ensure_context(driver, index)
            result = driver.cuLaunchKernel(kernel, *grid, *block, smem, _raw_stream(index), params, 0)
    if result[0]:  # CUresult is an int: CUDA_SUCCESS is 0
        _check(result, "cuLaunchKernel")


# torch's current device and current stream (a raw cudaStream_t) without a Python object per call:
# torch._C's own functions (those torch.cuda.current_device and inductor's generated code call),
# else, where this torch lacks them (a CPU build), torch.cuda's public functions, looked up per call
_current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())
_raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
               or (lambda index: torch.cuda.current_stream(index).cuda_stream))


def device_index(device: torch.device | int) -> int:
    """The CUDA ordinal of ``device`` (the current device for a bare ``"cuda"``)."""
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def forget() -> None:
    """Drop the kernels loaded in this process and the launch plans made of them: the next
    :func:`prepare` (or :func:`launch`) loads them again (after :func:`nvrtc.forget`, from the
    disk cache or NVRTC), as a process's first call does."""
    with _lock:
        _loaded.clear()
        _programs.clear()
        _plans.clear()


def prepare(n: int, dtype: torch.dtype | str, device: torch.device | int, batch: int = 1,
            algo: str | None = None) -> tuple[_Loaded, Plan]:
    """Compile (or find in the cache), load and configure the kernel for ``n``/``dtype`` on
    ``device``; returns it with the plan of a ``batch``-matrix solve: algorithm ``algo``, or the
    one :func:`choose_variant` picks (the block algorithm when the picked one cannot be had, said
    once on the ``fastspec`` logger). KernelUnavailable with the reason."""
    dt = str(dtype).removeprefix("torch.")
    if dt not in ITEMSIZE:
        raise KernelUnavailable(f"the CUDA eigensolver takes float32/float64, got {dt}")
    index = device_index(device)
    driver = _driver()
    with _lock:
        spec, target = _device_setup(index)
        p = plan(batch, n, dt, spec, algo)
        try:
            entry = _get_checked(driver, p, spec, target, index)
        except KernelUnavailable as exc:
            if algo is not None or p.variant.algo == "block":
                raise
            variants.say_once(f"the {p.variant.algo} algorithm ({p.why}) cannot be had ({exc}); using block")
            p = plan(batch, n, dt, spec, "block")
            entry = _get_checked(driver, p, spec, target, index)
    return entry, p


def _get_checked(driver, p: Plan, spec: DeviceSpec, target: nvrtc.Target, index: int) -> _Loaded:
    """The loaded kernel of ``p``'s variant, configured for device ``index`` and past its
    first-use self-check there (caller holds _lock). A kernel that fails the check is
    KernelUnavailable from then on, in this process, like one that does not compile."""
    entry = _get(driver, p.variant, target)
    if index not in entry.devices:
        dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        attr = driver.CUfunction_attribute
        _check(driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, p.smem,
                                           entry.kernel, dev), "setting the kernel's shared memory")
        # all of the unified L1/shared array as shared memory: the default carveout may leave
        # room for fewer resident blocks than the shared-memory footprint allows
        _check(driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100,
                                           entry.kernel, dev), "setting the kernel's carveout")
        entry.devices.add(index)
    if _self_check(driver, entry, p.variant, spec, index) is False:
        key = (p.variant, target.arch)
        _failed[key] = f"the {p.variant.algo} algorithm failed its self-check here ({p.variant.dtype} n = {p.variant.n})"
        _loaded.pop(key, None)
        raise KernelUnavailable(_failed[key])
    return entry


def check_device(index: int) -> torch.device:
    """Where the self-check's matrices live: CUDA device ``index`` (tests with the stand-in
    driver point it at the CPU)."""
    return torch.device("cuda", index)


def _self_check(driver, entry: _Loaded, variant: Variant, spec: DeviceSpec, index: int) -> bool | None:
    """The variant's first-use self-check on device ``index`` (:mod:`fastspec.selfcheck`): six
    matrices of known spectra (clustered, rank-deficient, graded, both signs, scaled by 2^40, one
    holding a NaN) solved by the loaded kernel, against float64 within 2x torch's own error +
    8·eps·‖A‖₂. True/False: passed/failed (warned once); None: not now (a trace or a capture)."""
    from .. import selfcheck

    dev = check_device(index)
    if not selfcheck.applies(torch.device("cuda", index)):
        return True
    dtype = getattr(torch, variant.dtype)

    def case() -> str:
        A, _ = selfcheck.spectra(variant.n)
        A3 = A.to(dtype).to(dev)
        B = A3.shape[0]
        out = torch.full((B, variant.n), 7.0, dtype=dtype, device=dev)  # a kernel that skips rows is caught
        p = plan(B, variant.n, variant.dtype, spec, variant.algo)
        status = torch.zeros(B, dtype=torch.int32, device=dev)  # heev's per-matrix status
        ws = torch.empty(p.workspace, dtype=dtype, device=dev) if p.workspace else None  # alive until the sync
        work = ws.data_ptr() if ws is not None else status.data_ptr() if variant.algo in variants.EXTERNAL else 0
        # this thread's parameter block, as run() packs it (no launch of this thread is in flight)
        PARAMS.pack_into(_params.block, 0, A3.data_ptr(), out.data_ptr(), work, B, *A3.stride(), out.stride(0))
        _launch_on(driver, index, entry.kernel, (p.grid, 1, 1), (variant.threads, 1, 1), p.smem, _params.address)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return selfcheck.compare_eigenvalues(out, A, dtype)

    return selfcheck.run(("eig", variant, index), f"the CUDA eigensolver's {variant.algo} algorithm",
                         f"{variant.dtype} n={variant.n}", torch.device("cuda", index), case,
                         "the block algorithm" if variant.algo != "block" else "torch.linalg.eigvalsh")


def _get(driver, variant: Variant, target: nvrtc.Target) -> _Loaded:
    """The loaded kernel of ``variant`` (compiled and loaded on first use; caller holds _lock)."""
    key = (variant, target.arch)
    if key in _failed:  # a kernel that could not be had is not tried again in this process
        raise KernelUnavailable(_failed[key])
    entry = _loaded.get(key)
    if entry is None:
        try:
            entry = _loaded[key] = _load(driver, variant, target)
        except KernelUnavailable as exc:
            _failed[key] = str(exc)
            raise
    return entry


def launch_args(in_ptr: int, out_ptr: int, work_ptr: int, batch: int, strides: tuple[int, int, int],
                out_stride: int) -> list:
    """The kernel's parameters as ctypes values, in the order and widths of ``fastspec_eigvalsh``:
    three pointers, then batch and four strides as 64-bit integers (tests compare this with the
    parameter list NVRTC's PTX declares)."""
    sb, sr, sc = strides
    return [ctypes.c_void_p(in_ptr), ctypes.c_void_p(out_ptr), ctypes.c_void_p(work_ptr),
            *(ctypes.c_longlong(v) for v in (batch, sb, sr, sc, out_stride))]


def launch(A3: Tensor, out: Tensor, algo: str | None = None, status: Tensor | None = None) -> None:
    """Eigenvalues of ``A3: [B, n, n]`` (lower triangle, B and n >= 1, any strides) into
    ``out: [B, n]`` (ascending, contiguous rows), asynchronous on the current stream of their
    device; float32/float64. ``algo``: an algorithm of :mod:`.variants` (the race times each),
    else the one the selection table picks. ``status``: an int32 ``[B]`` tensor that cuSolverDx's
    heev (``algo="cusolverdx"``) fills with its per-matrix status (0: solved; -1: non-finite input;
    > 0: its iteration did not converge); the other algorithms take none."""
    B, n = out.shape
    if status is not None and (algo not in variants.EXTERNAL or status.dtype != torch.int32
                               or tuple(status.shape) != (B,) or not status.is_contiguous()):
        raise ValueError(f"status: a contiguous int32 [{B}] tensor, with algo='cusolverdx' only; got "
                         f"{status.dtype} {tuple(status.shape)} with algo={algo!r}")
    run(A3, A3.stride(), B, n, out.data_ptr(), out.stride(0), algo, 0 if status is None else status.data_ptr())


# --- the steady-state launch ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Launch:
    """One problem's launch, decided once by :func:`prepare`: what each later call passes to
    ``cuLaunchKernel`` besides the pointers and strides."""

    driver: object    # cuda.bindings.driver, as prepare had it
    kernel: object    # CUkernel, loaded and configured for the device
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    workspace: int    # reals of global workspace per call (0: the matrix is in shared memory)
    plan: Plan


_plans: dict[tuple, _Launch] = {}
"""(device index, n, torch dtype, batch, $FASTSPEC_EIG_VARIANT or None, algo) -> its launch. The
variable is part of the key, so a changed override takes effect at the next call; :func:`forget`
empties it with the kernels."""
PLANS_MAX = 4096
"""Launches kept; past it the cache starts over (a process solving ever new batch sizes)."""

PARAMS = struct.Struct("=3Q5q")
"""The kernel's parameters as :func:`launch_args` makes them: three pointers (in, out, workspace),
then batch and the strides of A (batch, row, column) and of out's rows, each 64-bit."""


class _Params(threading.local):
    """This thread's parameter block: 8 values, then the 8 pointers to them that cuLaunchKernel
    reads. The driver copies the values during the call (a captured launch too), and a thread
    makes one launch at a time, so one block per thread serves every launch: no allocation."""

    def __init__(self) -> None:
        self.block = (ctypes.c_uint64 * 16)()
        base = ctypes.addressof(self.block)
        self.block[8:] = [base + 8 * i for i in range(8)]
        self.address = base + 64  # the void*[8] kernelParams


_params = _Params()


def run(A: Tensor, strides: tuple[int, int, int], batch: int, n: int, out_ptr: int, out_stride: int,
        algo: str | None = None, status_ptr: int = 0) -> None:
    """Launch the solve of ``batch`` matrices ``n x n`` (batch, n >= 1) at ``A.data_ptr()`` with
    element ``strides`` (batch, row, column) into the rows ``out_stride`` apart at ``out_ptr``,
    on ``A``'s device and its current stream (``A``: the first matrix's tensor; its dtype and
    device are the problem's). The launch plan of the problem is made at its first call
    (:func:`prepare`: compile, load, configure; KernelUnavailable with the reason) and kept.
    ``status_ptr``: cuSolverDx's heev's int32 status per matrix (:func:`launch`), 0 for none."""
    index = A.get_device()
    if index < 0:  # not a CUDA tensor (the CPU tests' stand-in): the current device, as device_index
        index = _current_device()
    key = (index, n, A.dtype, batch, os.environ.get(variants.ENV), algo)
    lp = _plans.get(key)
    if lp is None:
        lp = _plan_launch(key)
    work = status_ptr  # the third pointer: fastspec's workspace, heev's status (csrc/cusolverdx_heev.cu)
    if lp.workspace:  # past shared memory: one n x n matrix per block, in torch's allocator (stream-ordered)
        ws = torch.empty(lp.workspace, dtype=A.dtype, device=A.device)
        work = ws.data_ptr()
    p = _params
    PARAMS.pack_into(p.block, 0, A.data_ptr(), out_ptr, work, batch, *strides, out_stride)
    _launch_on(lp.driver, index, lp.kernel, lp.grid, lp.block, lp.smem, p.address)


def _plan_launch(key: tuple) -> _Launch:
    """The launch of ``key``'s problem (:data:`_plans`), made by :func:`prepare` and kept."""
    index, n, dtype, batch, _, algo = key
    entry, p = prepare(n, dtype, index, batch=batch, algo=algo)
    lp = _Launch(_driver(), entry.kernel, (p.grid, 1, 1), (p.variant.threads, 1, 1), p.smem, p.workspace, p)
    with _lock:
        if len(_plans) >= PLANS_MAX:
            _plans.clear()
        _plans[key] = lp
    return lp
