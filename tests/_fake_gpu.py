"""The CUDA eigensolver's launcher (fastspec/eig/cuda.py) on a machine without a GPU: a stand-in
for ``cuda.bindings.driver`` whose cuLaunchKernel runs the host twin on the pointers and strides
the launcher packed, and :func:`install`, which points cuda.py at it with an H100's plan.

Shared by tests/test_eig_nvrtc.py (the launch plumbing) and tests/test_eig_call.py (what one call
costs: driver calls, torch ops, the cached plan).
"""
from __future__ import annotations

import ctypes
import types

import torch

from fastspec.eig import cuda, native, variants

H100 = cuda.DeviceSpec.for_arch(90)
STREAM = 1234
"""The raw stream handle the stand-in torch reports as current."""


class FakeDriver(types.SimpleNamespace):
    """``cuda.bindings.driver`` as far as cuda.py uses it. cuLaunchKernel reads the parameter
    array the launcher built (kept in ``params``: the 8 values, as unsigned 64-bit integers) and
    runs the host twin of ``dtype`` on those pointers and strides for ``n x n`` matrices.
    ``calls``: the name of every driver function cuda.py looked up, in order (one per call)."""

    def __init__(self, n: int, version: int = 13000, dtype: str = "float32"):
        super().__init__(launches=[], attributes={}, loaded=[], params=[], calls=[], n=n, version=version,
                         dtype=dtype)
        self.CUfunction_attribute = types.SimpleNamespace(
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic_smem",
            CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT="carveout")

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if name.startswith("cu") and callable(value):  # a driver function: counted as called
            super().__getattribute__("calls").append(name)
        return value

    def cuInit(self, flags):
        return (0,)

    def cuDriverGetVersion(self):
        return (0, self.version)

    def cuLibraryLoadData(self, data, *rest):
        self.loaded.append(bytes(data[:4]))
        return (0, "lib")

    def cuLibraryGetKernel(self, lib, name):
        return (0, ("kernel", name))

    def cuDeviceGet(self, index):
        return (0, index)

    def cuKernelSetAttribute(self, attr, value, kernel, dev):
        self.attributes[attr] = value
        return (0,)

    def cuCtxGetCurrent(self):
        return (0, 7)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (0, 7)

    def cuDevicePrimaryCtxRelease(self, dev):
        return (0,)

    def cuLaunchKernel(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        addr = (ctypes.c_void_p * 8).from_address(params)
        values = [ctypes.c_uint64.from_address(addr[i]).value for i in range(8)]
        self.params.append(values)
        ptrs = values[:3]
        batch, sb, sr, sc, osb = (ctypes.c_longlong.from_address(addr[i]).value for i in range(3, 8))
        self.launches.append({"kernel": kernel, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
                              "stream": stream, "work": ptrs[2], "batch": batch})
        solve = native._ext.host_eigvalsh_f32 if self.dtype == "float32" else native._ext.host_eigvalsh_f64
        solve(ptrs[0], ptrs[1], batch, self.n, sb, sr, sc, osb)
        return (0,)


def install(monkeypatch, n: int, version: int = 13000, dtype: str = "float32", self_check: bool = False
            ) -> FakeDriver:
    """Point cuda.py at a fresh :class:`FakeDriver` on CPU tensors: an H100's plan, device 0
    current, stream :data:`STREAM`, nothing loaded or planned yet. (The caller gives the kernel
    cache a folder of its own: NVRTC compiles for real.)

    The launch plumbing of the default (block) algorithm: the selection table is emptied, since
    the shipped one holds the H100 race's rows for sm_90 (test_eig_variants.py and the GPU tests
    cover the selection). First-use self-checks (fastspec/selfcheck.py) are off unless
    ``self_check``: the plumbing tests count launches and driver calls of the user's call alone;
    with them on, the check's matrices live on the CPU and every verdict is this test's own."""
    from fastspec import selfcheck

    monkeypatch.setenv(selfcheck.ENV, "1" if self_check else "0")
    monkeypatch.setattr(selfcheck, "_results", {})
    monkeypatch.setattr(cuda, "check_device", lambda index: torch.device("cpu"))
    drv = FakeDriver(n, version, dtype)
    monkeypatch.setattr(variants, "_rows", [[]])
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    monkeypatch.setattr(cuda.DeviceSpec, "of_device", classmethod(lambda cls, index: H100))
    for name in ("_loaded", "_failed", "_specs", "_targets", "_plans"):
        monkeypatch.setattr(cuda, name, {})
    monkeypatch.setattr(cuda, "_driver_ready", [])
    monkeypatch.setattr(cuda, "_thread", type(cuda._thread)())
    # torch's current device and stream: cuda.py's own handles (torch._C's functions on a CUDA
    # build of torch) and torch.cuda's public ones (device_index, the fallbacks of a CPU build)
    monkeypatch.setattr(cuda, "_current_device", lambda: 0)
    monkeypatch.setattr(cuda, "_raw_stream", lambda index: STREAM)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=STREAM))
    return drv
