"""The eigvalsh suite's external anchors (fastspec.bench.anchors) and how the suite uses them.

No GPU is needed: the cuSOLVER ctypes wrapper runs against a stand-in library whose functions
are real ``ctypes`` callbacks with the prototypes of cusolverDn.h (so arguments are marshalled as
they would be for the real library) and that solves with numpy on the memory it is pointed at;
the JAX adapter runs against a numpy-backed stand-in module, and against real JAX on its CPU
backend where jax is installed; cuSolverDx's heev runs against a stand-in launch, and its sizes are
judged by the real launcher (by libmathdx itself where the ``fastspec[mathdx]`` extra is
installed). A test marked ``gpu`` runs the real cuSolverDx anchor.
"""
from __future__ import annotations

import ctypes
import gc
import math
import os
import re
import subprocess
import sys
import types
from ctypes import POINTER, c_double, c_float, c_int, c_int64, c_size_t, c_void_p

import numpy as np
import pytest
import torch

from fastspec.bench import anchors
from fastspec.bench.suites import cases
from fastspec.bench.suites import eigvalsh as eigvalsh_suite
from fastspec.eig import cuda as eig_cuda
from fastspec.eig import mathdx

CPU = torch.device("cpu")
CUDA = torch.device("cuda")

# Prototypes copied from cusolverDn.h (nvidia-cusolver 12.4.1.2 wheel, nvidia/cu13/include),
# independently of the module under test: enums are C ints, handles/params/streams pointers.
HEADER = {
    "cusolverDnCreate": (POINTER(c_void_p),),
    "cusolverDnDestroy": (c_void_p,),
    "cusolverDnSetStream": (c_void_p, c_void_p),
    "cusolverDnCreateParams": (POINTER(c_void_p),),
    "cusolverDnDestroyParams": (c_void_p,),
    "cusolverDnXsyevBatched_bufferSize": (
        c_void_p, c_void_p, c_int, c_int, c_int64, c_int, c_void_p, c_int64, c_int, c_void_p, c_int,
        POINTER(c_size_t), POINTER(c_size_t), c_int64),
    "cusolverDnXsyevBatched": (
        c_void_p, c_void_p, c_int, c_int, c_int64, c_int, c_void_p, c_int64, c_int, c_void_p, c_int,
        c_void_p, c_size_t, c_void_p, c_size_t, c_void_p, c_int64),
}
STREAM = 0xABC0


class FakeCusolver:
    """A libcusolver stand-in: every function is a ctypes callback with the header's prototype.

    ``cusolverDnXsyevBatched`` reads the batch where it is told to (column-major, ``lda``,
    ``uplo``), writes ascending eigenvalues to ``W`` and ``info``, and then scribbles NaN over
    ``A`` as the real solver may (it destroys its input)."""

    DEVICE_BYTES, HOST_BYTES = 4096 + 17, 33

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.status: dict[str, int] = {}
        self.info_for: dict[int, int] = {}  # matrix index (within a call) -> info value
        self._next = 0x1000
        for name, proto in HEADER.items():
            impl = getattr(self, "_" + name)
            fn = ctypes.CFUNCTYPE(c_int, *proto)(self._recording(name, impl))
            setattr(self, name, fn)

    def _recording(self, name, impl):
        def call(*args):
            self.calls.append((name, args))
            status = self.status.get(name, 0)
            if status:
                return status
            impl(*args)
            return 0
        return call

    def named(self, name):
        return [args for n, args in self.calls if n == name]

    def _new(self, out):
        self._next += 0x10
        out[0] = self._next

    def _cusolverDnCreate(self, out):
        self._new(out)

    def _cusolverDnCreateParams(self, out):
        self._new(out)

    def _cusolverDnDestroy(self, handle):
        pass

    def _cusolverDnDestroyParams(self, params):
        pass

    def _cusolverDnSetStream(self, handle, stream):
        pass

    def _cusolverDnXsyevBatched_bufferSize(self, handle, params, jobz, uplo, n, dta, a, lda, dtw, w, ct,
                                           dev, host, batch):
        dev[0], host[0] = self.DEVICE_BYTES, self.HOST_BYTES

    def _cusolverDnXsyevBatched(self, handle, params, jobz, uplo, n, dta, a, lda, dtw, w, ct,
                                dbuf, dbytes, hbuf, hbytes, info, batch):
        ctype, dtype = (c_float, np.float32) if dta == 0 else (c_double, np.float64)
        buf = np.ctypeslib.as_array((ctype * (lda * n * batch)).from_address(a))
        M = buf.reshape(batch, n, lda)[:, :, :n].transpose(0, 2, 1).astype(np.float64)  # M[k, i, j]
        if uplo == 0:
            S = np.tril(M) + np.swapaxes(np.tril(M, -1), 1, 2)
        else:
            S = np.triu(M) + np.swapaxes(np.triu(M, 1), 1, 2)
        out = np.ctypeslib.as_array((ctype * (n * batch)).from_address(w)).reshape(batch, n)
        out[:] = np.linalg.eigvalsh(S).astype(dtype)
        buf[:] = np.nan
        infos = np.ctypeslib.as_array((c_int * batch).from_address(info))
        infos[:] = 0
        for k, v in self.info_for.items():
            if k < batch:
                infos[k] = v


def solver(fake=None):
    fake = fake or FakeCusolver()
    return anchors.XsyevBatched(fake, CPU, stream=lambda: STREAM), fake


def nonsymmetric(batch, n, dtype, seed=0):
    """Random matrices whose two triangles differ: only the triangle a solver reads decides."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, n, generator=g, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# cuSOLVER through ctypes
# --------------------------------------------------------------------------------------------

def test_cusolver_binds_the_header_signatures():
    _, fake = solver()
    assert set(anchors.SIGNATURES) == set(HEADER)
    for name, proto in HEADER.items():
        fn = getattr(fake, name)
        assert tuple(fn.argtypes) == proto, name
        assert fn.restype is c_int, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cusolver_solves_the_lower_triangle_like_torch_and_leaves_the_input(dtype):
    A = nonsymmetric(5, 7, dtype)
    before = A.clone()
    s, _ = solver()
    w = s(A)
    assert w.dtype == dtype and w.shape == (5, 7)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(w, torch.linalg.eigvalsh(A), atol=tol, rtol=tol)  # UPLO='L'
    assert torch.equal(A, before)  # the solver scribbled over its own copy, not over A
    assert not torch.allclose(w, torch.linalg.eigvalsh(A, UPLO="U"), atol=1e-3)  # the triangle matters


@pytest.mark.parametrize("dtype, code", [(torch.float32, 0), (torch.float64, 1)])
def test_cusolver_passes_enums_lda_batch_workspaces_and_stream(dtype, code):
    s, fake = solver()
    A = nonsymmetric(6, 9, dtype)
    s(A)
    assert len(fake.named("cusolverDnCreate")) == 1
    handle, params = s.handle.value, s.params.value
    (size,) = fake.named("cusolverDnXsyevBatched_bufferSize")
    assert size[:6] == (handle, params, 0, 1, 9, code)  # NOVECTOR, FILL_MODE_UPPER (= A's lower), n, type
    assert size[7:9] == (9, code) and size[10] == code and size[13] == 6  # lda, W type, compute type, batch
    (call,) = fake.named("cusolverDnXsyevBatched")
    h, p, jobz, uplo, n, dta, a, lda, dtw, _w, ct, dbuf, dbytes, hbuf, hbytes, info, batch = call
    assert (h, p, jobz, uplo, n, dta, lda, dtw, ct, batch) == (handle, params, 0, 1, 9, code, 9, code, code, 6)
    ws = s._ws
    assert a == ws.a.data_ptr() and info == ws.info.data_ptr()
    assert (dbuf, dbytes) == (ws.device_buf.data_ptr(), fake.DEVICE_BYTES) and ws.device_buf.numel() >= dbytes
    assert (hbuf, hbytes) == (ctypes.addressof(ws.host_buf), fake.HOST_BYTES)
    assert len(ws.host_buf) >= hbytes
    # the stream is set on the handle before every solve (torch's current stream may change)
    order = [n for n, _ in fake.calls if n in ("cusolverDnSetStream", "cusolverDnXsyevBatched")]
    assert order == ["cusolverDnSetStream", "cusolverDnXsyevBatched"]
    assert fake.named("cusolverDnSetStream") == [(handle, STREAM)]


def test_cusolver_reuses_handle_and_workspace_per_shape():
    s, fake = solver()
    A = nonsymmetric(4, 6, torch.float32)
    for _ in range(3):
        s(A)
    assert len(fake.named("cusolverDnCreate")) == 1
    assert len(fake.named("cusolverDnXsyevBatched_bufferSize")) == 1
    assert len(fake.named("cusolverDnXsyevBatched")) == 3
    s(nonsymmetric(4, 5, torch.float32))  # a new shape: new workspace, same handle
    assert len(fake.named("cusolverDnXsyevBatched_bufferSize")) == 2
    assert len(fake.named("cusolverDnCreate")) == 1


def test_cusolver_splits_batches_past_the_32_bit_limit(monkeypatch):
    n = 5
    monkeypatch.setattr(anchors, "MAX_CALL_BYTES", 3 * n * n * 8 + 7)  # 3 fp64 matrices per call
    s, fake = solver()
    A = nonsymmetric(7, n, torch.float64)
    torch.testing.assert_close(s(A), torch.linalg.eigvalsh(A), atol=1e-12, rtol=1e-12)
    calls = fake.named("cusolverDnXsyevBatched")
    assert [c[16] for c in calls] == [3, 3, 1]
    base = s._ws.a.data_ptr()
    assert [c[6] for c in calls] == [base, base + 3 * n * n * 8, base + 6 * n * n * 8]
    info = s._ws.info.data_ptr()
    assert [c[15] for c in calls] == [info, info + 3 * 4, info + 6 * 4]  # int info per matrix
    assert fake.named("cusolverDnXsyevBatched_bufferSize")[0][13] == 3  # workspace for one chunk
    fake.info_for = {1: 2}  # the 2nd matrix of every chunk: matrices 1 and 4 of the batch
    with pytest.raises(RuntimeError, match=r"did not converge for 2 matrices \(first: matrix 1, info = 2\)"):
        s(A)


def test_cusolver_status_errors_name_the_function():
    fake = FakeCusolver()
    fake.status["cusolverDnCreate"] = 1
    with pytest.raises(RuntimeError, match=r"^cusolverDnCreate returned CUSOLVER_STATUS_NOT_INITIALIZED \(1\)$"):
        solver(fake)
    s, fake = solver()
    fake.status["cusolverDnXsyevBatched"] = 3
    with pytest.raises(RuntimeError, match=r"^cusolverDnXsyevBatched returned CUSOLVER_STATUS_INVALID_VALUE \(3\)$"):
        s(nonsymmetric(2, 3, torch.float32))
    fake.status["cusolverDnXsyevBatched"] = 0
    fake.status["cusolverDnSetStream"] = 77
    with pytest.raises(RuntimeError, match=r"cusolverDnSetStream returned an unknown status \(77\)"):
        s(nonsymmetric(2, 3, torch.float32))


def test_cusolver_failed_create_params_releases_the_handle():
    fake = FakeCusolver()
    fake.status["cusolverDnCreateParams"] = 2
    with pytest.raises(RuntimeError, match="cusolverDnCreateParams returned CUSOLVER_STATUS_ALLOC_FAILED"):
        solver(fake)
    assert len(fake.named("cusolverDnCreate")) == 1
    assert len(fake.named("cusolverDnDestroy")) == 1


def test_cusolver_nonzero_info_is_an_error_unless_not_checked():
    s, fake = solver()
    A = nonsymmetric(4, 3, torch.float32)
    fake.info_for = {2: 5}
    with pytest.raises(RuntimeError, match=r"did not converge for 1 matrices \(first: matrix 2, info = 5\)"):
        s(A)
    assert s(A, check_info=False).shape == (4, 3)  # the timed call does not read info back
    fake.info_for = {0: -4}
    with pytest.raises(RuntimeError, match=r"parameter 4 is invalid \(info\[0\] = -4\)"):
        s(A)


def test_cusolver_refuses_inputs_it_cannot_solve():
    s, _ = solver()
    with pytest.raises(ValueError, match=r"\[B, n, n\]"):
        s(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="float32 or float64"):
        s(torch.zeros(2, 3, 3, dtype=torch.float16))
    assert s(torch.zeros(0, 3, 3)).shape == (0, 3)


def test_cusolver_destroys_handle_and_params_when_collected():
    s, fake = solver()
    handle, params = s.handle.value, s.params.value
    del s
    gc.collect()
    assert fake.named("cusolverDnDestroyParams") == [(params,)]
    assert fake.named("cusolverDnDestroy") == [(handle,)]


def test_cusolver_reasons_without_cuda(monkeypatch):
    assert anchors.make_cusolver(CPU) == "needs a CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert anchors.make_cusolver(CUDA) == "CUDA is not available to torch"


def test_find_libcusolver_reasons(tmp_path):
    assert anchors.find_libcusolver([]).startswith("libcusolver not found")
    broken = tmp_path / "libcusolver.so.12"
    broken.write_bytes(b"not an ELF file")
    reason = anchors.find_libcusolver([str(broken)])
    assert reason.startswith("libcusolver with cusolverDnXsyevBatched not found (needs CUDA >= 12.6 update 2)")
    assert "does not load" in reason and "\n" not in reason
    libc = ctypes.util.find_library("c")
    if libc:  # loads, but has none of the symbols
        reason = anchors.find_libcusolver([libc])
        assert "lacks cusolverDnCreate" in reason and "\n" not in reason


def test_candidate_paths_cover_the_wheel_layouts(tmp_path):
    site_dir = tmp_path / "site-packages"
    cu13 = site_dir / "nvidia" / "cu13" / "lib"
    cu12 = site_dir / "nvidia" / "cusolver" / "lib"
    torch_lib = site_dir / "torch" / "lib"
    home = tmp_path / "cuda"
    for d in (cu13, cu12, torch_lib, home / "lib64"):
        d.mkdir(parents=True)
    for f in (cu13 / "libcusolver.so.12", cu13 / "libcusolverMg.so.12", cu12 / "libcusolver.so.11",
              torch_lib / "libcusolver.so.11", home / "lib64" / "libcusolver.so.11"):
        f.write_bytes(b"")
    maps = ("7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /opt/loaded/libcusolver.so.12\n"
            "7f0000001000-7f0000002000 r-xp 00000000 08:01 124 /opt/loaded/libcusolverMg.so.12\n")
    got = anchors.candidate_paths(maps=maps, site_dirs=[str(site_dir)], cuda_homes=[str(home)], cuda_major="13")
    got = [p for p in got if p.startswith(("/opt/loaded", str(tmp_path)))]
    assert got == ["/opt/loaded/libcusolver.so.12", str(cu13 / "libcusolver.so.12"), str(cu12 / "libcusolver.so.11"),
                   str(torch_lib / "libcusolver.so.11"), str(home / "lib64" / "libcusolver.so.11")]
    got = anchors.candidate_paths(maps="", site_dirs=[str(site_dir)], cuda_homes=[], cuda_major="12")
    assert next(p for p in got if "nvidia" in p) == str(cu12 / "libcusolver.so.11")  # torch's CUDA major first


def test_loaded_libcusolver_reads_proc_maps():
    maps = ("00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3\n"
            "7f1-7f2 r--p 00000000 08:01 9 /x/nvidia/cu13/lib/libcusolver.so.12\n"
            "7f2-7f3 r-xp 00001000 08:01 9 /x/nvidia/cu13/lib/libcusolver.so.12\n"
            "7f3-7f4 rw-p 00000000 00:00 0 \n"
            "7f4-7f5 r-xp 00000000 08:01 10 /x/lib/libcusolverMg.so.12\n")
    assert anchors.loaded_libcusolver(maps) == ["/x/nvidia/cu13/lib/libcusolver.so.12"]


@pytest.mark.skipif(not os.environ.get("FASTSPEC_TEST_LIBCUSOLVER"),
                    reason="set FASTSPEC_TEST_LIBCUSOLVER to a real libcusolver.so to check its symbols")
def test_real_libcusolver_has_every_symbol_we_bind():
    lib = anchors.find_libcusolver([os.environ["FASTSPEC_TEST_LIBCUSOLVER"]])
    assert not isinstance(lib, str), lib
    anchors.bind(lib)
    assert re.fullmatch(r"\d+\.\d+\.\d+", anchors._version(lib))
    if not torch.cuda.is_available():  # no GPU: the library answers, with an error status
        with pytest.raises(RuntimeError, match=r"^cusolverDnCreate returned CUSOLVER_STATUS_\w+ \(\d+\)$"):
            anchors.XsyevBatched(lib, CPU, stream=lambda: 0)


# --------------------------------------------------------------------------------------------
# JAX and CuPy
# --------------------------------------------------------------------------------------------

class FakeJaxArray:
    def __init__(self, a):
        self.a = np.asarray(a)
        self.ready = False

    def block_until_ready(self):
        self.ready = True
        return self

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def fake_jax(monkeypatch, *, cuda_devices=None):
    """A numpy-backed ``jax`` with the functions the adapter calls; returns its call log."""
    log = {"jit": [], "eigvalsh": [], "from_dlpack": [], "config": [], "results": [],
           "prealloc_at_devices": []}

    class Device:
        def __init__(self, id, platform):
            self.id, self.platform = id, platform

    def devices(kind):
        log["prealloc_at_devices"].append(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
        if kind == "cpu":
            return [Device(0, "cpu")]
        if cuda_devices is None:
            raise RuntimeError("Unknown backend: 'cuda' requested, but no platforms that are instances of cuda are present")
        return [Device(i, "cuda") for i in range(cuda_devices)]

    def jit(fn):
        log["jit"].append(fn)

        def compiled(x):
            out = FakeJaxArray(fn(x))
            log["results"].append(out)
            return out
        return compiled

    def eigvalsh(a, UPLO="L", *, symmetrize_input=True):
        log["eigvalsh"].append((UPLO, symmetrize_input))
        return np.linalg.eigvalsh(a.a, UPLO=UPLO)

    def from_dlpack(x, device=None, copy=None):
        log["from_dlpack"].append(device)
        return FakeJaxArray(np.from_dlpack(x))

    jax = types.ModuleType("jax")
    jnp = types.ModuleType("jax.numpy")
    jnp.linalg = types.SimpleNamespace(eigvalsh=eigvalsh)
    dlpack = types.ModuleType("jax.dlpack")
    dlpack.from_dlpack = from_dlpack
    jax.numpy, jax.dlpack, jax.devices, jax.jit = jnp, dlpack, devices, jit
    jax.config = types.SimpleNamespace(update=lambda k, v: log["config"].append((k, v)))
    for name, mod in (("jax", jax), ("jax.numpy", jnp), ("jax.dlpack", dlpack)):
        monkeypatch.setitem(sys.modules, name, mod)
    return log


def test_jax_adapter_plumbing_with_a_stand_in(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    log = fake_jax(monkeypatch)
    fn = anchors.make_jax(CPU)
    assert isinstance(fn, anchors.JaxEigvalsh), fn
    assert log["prealloc_at_devices"] == ["false"]  # set before JAX starts a backend
    assert ("jax_enable_x64", True) in log["config"]
    for dtype in (torch.float32, torch.float64):
        A = nonsymmetric(3, 6, dtype)
        log["results"].clear()
        w = fn(A)
        assert w.dtype == dtype and w.device == A.device
        torch.testing.assert_close(w, torch.linalg.eigvalsh(A), atol=1e-5, rtol=1e-5)
        assert [r.ready for r in log["results"]] == [True]  # blocked until JAX was done
    assert len(log["jit"]) == 1  # one jitted function; jax.jit caches per shape
    assert set(log["eigvalsh"]) == {("L", False)}  # lower triangle only, like torch and the reference
    assert {d.platform for d in log["from_dlpack"]} == {"cpu"}


def test_jax_keeps_a_users_preallocation_setting(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    fake_jax(monkeypatch)
    anchors.make_jax(CPU)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_jax_reasons(monkeypatch):
    fake_jax(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert anchors.make_jax(CUDA) == "CUDA is not available to torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no CUDA call happens below
    assert anchors.make_jax(CUDA).startswith("jax has no CUDA backend (RuntimeError: Unknown backend")
    fake_jax(monkeypatch, cuda_devices=1)
    assert anchors.make_jax(torch.device("cuda", 1)) == "jax sees no CUDA device 1 (it has 1)"
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax -> ImportError
    assert anchors.make_jax(CPU) == "jax not installed"
    assert anchors.make_jax(CUDA) == "jax not installed"


def test_jax_broken_solver_is_a_reason(monkeypatch):
    fake_jax(monkeypatch)
    sys.modules["jax.numpy"].linalg.eigvalsh = lambda a, **kw: (_ for _ in ()).throw(
        RuntimeError("cuSOLVER plugin built for CUDA 12\nsecond line"))
    assert anchors.make_jax(CPU) == "jax eigvalsh failed on cpu: RuntimeError: cuSOLVER plugin built for CUDA 12"


def test_real_jax_on_cpu_matches_torch():
    pytest.importorskip("jax")
    fn = anchors.make_jax(CPU)
    assert not isinstance(fn, str), fn
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        A = nonsymmetric(4, 8, dtype)
        w = fn(A)
        assert w.dtype == dtype
        torch.testing.assert_close(w, torch.linalg.eigvalsh(A), atol=tol, rtol=tol)


def test_cupy_reasons(monkeypatch):
    assert anchors.make_cupy(CPU) == "needs a CUDA device"
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert anchors.make_cupy(CUDA) == "cupy not installed"


def test_a_broken_install_says_why_it_cannot_be_imported():
    broken = ImportError("libcudart.so.13: cannot open shared object file\nmore")
    assert anchors._import_reason("cupy", broken) == (
        "cupy not importable: ImportError: libcudart.so.13: cannot open shared object file")
    missing = ModuleNotFoundError("No module named 'jax'", name="jax")
    assert anchors._import_reason("jax", missing) == "jax not installed"
    inner = ModuleNotFoundError("No module named 'jaxlib'", name="jaxlib")  # jax there, jaxlib not
    assert anchors._import_reason("jax", inner) == "jax not importable: ModuleNotFoundError: No module named 'jaxlib'"


# --------------------------------------------------------------------------------------------
# cuSolverDx heev
# --------------------------------------------------------------------------------------------

SM90 = eig_cuda.DeviceSpec.for_arch(90)
MATHDX_MISSING = mathdx.missing()


class FakeLaunch:
    """A stand-in for ``fastspec.eig.cuda.launch`` with cuSolverDx's contract: ascending
    eigenvalues of ``A``'s lower triangle into ``out``, a status per matrix (``status_for``:
    matrix index -> status; that row NaN, as the wrapper kernel writes it)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.status_for: dict[int, int] = {}

    def __call__(self, A, out, algo=None, status=None):
        self.calls.append({"algo": algo, "status": status, "shape": tuple(A.shape), "dtype": A.dtype})
        out.copy_(torch.linalg.eigvalsh(A))
        status.zero_()
        for k, v in self.status_for.items():
            if k < len(status):
                status[k] = v
                out[k] = float("nan")


def heev(launch=None):
    launch = launch or FakeLaunch()
    return anchors.HeevDx(CPU, SM90, launch=launch), launch


def test_cusolverdx_reasons_without_cuda(monkeypatch):
    assert anchors.make_cusolverdx(CPU) == "needs a CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert anchors.make_cusolverdx(CUDA) == "CUDA is not available to torch"


def test_cusolverdx_reason_without_the_extra_touches_no_gpu(monkeypatch):
    """The extra absent: mathdx's own reason (it names the install command), before any CUDA call."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call was made")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "get_device_properties", "synchronize", "current_stream", "device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(eig_cuda.DeviceSpec, "of_device", classmethod(no_cuda))
    monkeypatch.setattr(eig_cuda, "launch", no_cuda)
    monkeypatch.setattr(mathdx, "missing", lambda: "nvidia-libmathdx is not installed; pip install 'fastspec[mathdx]'")
    assert anchors.make_cusolverdx(CUDA) == "nvidia-libmathdx is not installed; pip install 'fastspec[mathdx]'"
    monkeypatch.setattr(mathdx, "missing", lambda: (_ for _ in ()).throw(OSError("libmathdx.so.0: bad ELF\nmore")))
    assert anchors.make_cusolverdx(CUDA) == "cuSolverDx heev unusable: OSError: libmathdx.so.0: bad ELF"


def test_cusolverdx_reason_names_the_install_command(monkeypatch):
    """The real :func:`mathdx.missing` without the wheel."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("a CUDA call was made"))
    monkeypatch.setattr(mathdx, "distribution", lambda: None)
    why = anchors.make_cusolverdx(CUDA)
    assert why == f"nvidia-libmathdx is not installed; {mathdx.INSTALL}" and "pip install 'fastspec[mathdx]'" in why


def test_make_anchors_lists_every_anchor_in_order():
    got = anchors.make_anchors(CPU)
    assert tuple(got) == anchors.ANCHORS and anchors.ANCHORS[-1] == "cusolverdx::heev"
    assert got["cusolverdx::heev"] == "needs a CUDA device"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cusolverdx_launches_the_cusolverdx_algorithm_with_a_status(dtype, monkeypatch):
    monkeypatch.setattr(eig_cuda, "variant_for", lambda n, dt, spec, algo="block": None)  # every size fits
    fn, launch = heev()
    A = nonsymmetric(5, 7, dtype)
    w = fn(A)
    assert w.dtype == dtype and w.shape == (5, 7)
    torch.testing.assert_close(w, torch.linalg.eigvalsh(A))  # the lower triangle
    (call,) = launch.calls
    status = call["status"]
    assert call["algo"] == "cusolverdx" and call["shape"] == (5, 7, 7)
    assert status.dtype == torch.int32 and status.shape == (5,) and status.is_contiguous()
    fn(A, check_status=False)
    assert launch.calls[-1]["status"] is status  # kept for the batch size, like cuSOLVER's info
    fn(nonsymmetric(3, 7, dtype))
    assert launch.calls[-1]["status"].shape == (3,)
    assert fn(torch.empty(0, 7, 7, dtype=dtype)).shape == (0, 7) and len(launch.calls) == 3  # nothing to launch
    with pytest.raises(ValueError, match=r"expected a batch of square matrices"):
        fn(torch.zeros(2, 3, 4, dtype=dtype))


def test_cusolverdx_status_is_read_by_the_check_alone(monkeypatch):
    """The timed call (check_status=False) reads nothing back; the checked call raises, naming why."""
    monkeypatch.setattr(eig_cuda, "variant_for", lambda n, dt, spec, algo="block": None)
    fn, launch = heev()
    reads = []
    real = anchors._check_status
    monkeypatch.setattr(anchors, "_check_status", lambda status: reads.append(status) or real(status))
    A = nonsymmetric(4, 6, torch.float32)
    launch.status_for = {2: 3}
    w = fn(A, check_status=False)
    assert not reads and torch.isnan(w[2]).all()
    with pytest.raises(RuntimeError, match=r"^cuSolverDx heev did not converge for 1 matrices \(first: matrix 2, "
                                           r"status = 3\)$"):
        fn(A)
    launch.status_for = {1: -1, 3: 5}
    with pytest.raises(RuntimeError, match=r"^cuSolverDx heev: matrix 1 has a non-finite element \(status -1\); "
                                           r"2 matrices failed$"):
        fn(A)
    assert len(reads) == 2
    launch.status_for = {}
    fn(A)
    assert len(reads) == 3


def test_cusolverdx_unfit_sizes_say_why_and_launch_nothing(monkeypatch):
    fn, launch = heev()
    # what the launcher decides without libmathdx: the dtype first
    assert fn.unfit(32, torch.float16) == "cuSolverDx heev takes float32/float64, got float16"
    assert fn.unfit(2000, torch.float32).startswith("cuSolverDx heev: n: must be in [1, ")

    def variant_for(n, dtype, spec, algo="block"):
        assert (spec, algo) == (SM90, "cusolverdx")
        if n > 200:
            raise ValueError(f"algo: 'cusolverdx' needs 274448 bytes of shared memory for {dtype} n = {n}, "
                             f"sm_90 gives a block 232448")

    monkeypatch.setattr(eig_cuda, "variant_for", variant_for)
    fn, launch = heev()
    assert fn.unfit(128, torch.float32) == ""
    why = fn.unfit(256, torch.float32)
    assert why == "cuSolverDx heev needs 274448 bytes of shared memory for float32 n = 256, sm_90 gives a block 232448"
    with pytest.raises(ValueError) as exc:
        fn(torch.zeros(2, 256, 256))
    assert str(exc.value) == why and not launch.calls


@pytest.mark.skipif(bool(MATHDX_MISSING), reason=f"needs the fastspec[mathdx] extra: {MATHDX_MISSING}")
def test_cusolverdx_unfit_asks_libmathdx_for_the_shared_memory():
    """sm_90 without a GPU: libmathdx describes heev, the launcher judges its shared memory."""
    fn, _ = heev()
    assert fn.unfit(2, torch.float32) == "" and fn.unfit(128, torch.float32) == ""  # the smoke test's, the headline
    assert fn.unfit(128, torch.float64) == ""
    assert re.fullmatch(r"cuSolverDx heev needs \d+ bytes of shared memory for float32 n = 256, sm_90 gives a block "
                        r"232448", fn.unfit(256, torch.float32))


def test_cusolverdx_without_the_extra_is_unfit_for_every_size(monkeypatch):
    monkeypatch.setattr(mathdx, "distribution", lambda: None)
    fn, _ = heev()
    assert fn.unfit(64, torch.float32) == (f"cuSolverDx heev cannot be built here: nvidia-libmathdx is not installed; "
                                           f"{mathdx.INSTALL}")


@pytest.mark.gpu
def test_real_cusolverdx_matches_float64_on_gpu():
    fn = anchors.make_cusolverdx(CUDA)
    if isinstance(fn, str):
        assert mathdx.missing(), fn  # with the extra installed it must run
        pytest.skip(fn)
    for n, dtype, tol in ((64, torch.float32, 1e-5), (32, torch.float64, 1e-12)):
        A = eigvalsh_suite.powerlaw_gram(9, n, CUDA, dtype)
        A = A + A.triu(1)  # the upper triangle doubled: never read
        w = fn(A)
        ref = torch.linalg.eigvalsh(A.double().cpu()).to(dtype)
        assert w.dtype == dtype and w.device.type == "cuda"
        torch.testing.assert_close(w.cpu(), ref, atol=tol * ref.abs().max().item(), rtol=0)
        A[4, 3, 1] = float("nan")
        w = fn(A, check_status=False)  # no read-back: the NaN row is the only sign
        assert torch.isnan(w[4]).all() and not torch.isnan(w[3]).any()
        with pytest.raises(RuntimeError, match="matrix 4 has a non-finite element"):
            fn(A)


def test_importing_anchors_imports_no_optional_dependency():
    code = ("import sys, fastspec.bench.anchors, fastspec.bench.suites.eigvalsh; "
            "print([m for m in ('jax', 'cupy', 'fastspec.eig.mathdx') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# The eigvalsh cases
# --------------------------------------------------------------------------------------------

def test_slice_and_reference_sizes():
    assert eigvalsh_suite.torch_slice(16384, 128, CUDA) == eigvalsh_suite.TORCH_SLICE == 256
    assert eigvalsh_suite.torch_slice(100, 128, CUDA) == 100
    assert eigvalsh_suite.torch_slice(16384, 32, CUDA) == 16384  # torch is batched (syevjBatched) there
    assert eigvalsh_suite.torch_slice(16384, 128, CPU) == 16384
    assert eigvalsh_suite.ref_count(16384) == 512 and eigvalsh_suite.ref_count(64) == 64


def _solver_cases(tier, device):
    """The eigvalsh suite's solver cases (the ``compile-*`` cases time the kernel's build)."""
    return [c for c in cases("eigvalsh", tier, device) if not c.size.startswith("compile-")]


def test_sizes_keep_the_id_pattern_and_have_fp64_cases():
    for tier in ("quick", "cpu", "gpu"):
        sizes = {c.size for c in _solver_cases(tier, CPU)}
        assert all(re.fullmatch(r"B\d+-n\d+-fp(32|64)", s) for s in sizes), sizes
        assert any(s.endswith("-fp64") for s in sizes), tier
    assert "B4096-n128-fp64" in {c.size for c in cases("eigvalsh", "gpu", CPU)}


def test_gpu_cases_scale_the_sliced_torch_baseline(monkeypatch):
    """Cases for a CUDA device are built without touching CUDA (setup runs later)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", None)
    built = _solver_cases("gpu", CUDA)
    assert built
    for case in built:
        batch, n = (int(x) for x in re.match(r"B(\d+)-n(\d+)", case.size).groups())
        if n > 32 and batch > 256:
            assert case.baseline_scale == {"torch.linalg.eigvalsh": batch / 256}, case.id
        else:
            assert case.baseline_scale == {}, case.id
        assert ("first 512 of" in case.error_kind) == (batch > 512)
        assert ("LAPACK fp64" in case.error_kind) == case.size.endswith("fp64")
        # on CUDA every anchor is listed: run, or skipped with its reason
        assert set(case.baselines) | set(case.notes) >= set(anchors.ANCHORS)
        assert case.notes["cupy.linalg.eigvalsh"] == "cupy not installed"


def test_cpu_cases_time_the_whole_batch_and_leave_cuda_only_anchors_out():
    for case in cases("eigvalsh", "cpu", CPU):
        assert case.baseline_scale == {}
        assert not set(case.notes) & {"cusolverDnXsyevBatched", "cupy.linalg.eigvalsh", "cusolverdx::heev"}
    assert set(eigvalsh_suite.CUDA_ONLY) == {"cusolverDnXsyevBatched", "cupy.linalg.eigvalsh", "cusolverdx::heev"}


def _fake_anchor_cases(monkeypatch, tier="quick"):
    """Quick CPU cases with the ctypes cuSOLVER wrapper (on the stand-in library) as an anchor."""
    fake_solver, fake = solver()
    monkeypatch.setattr(eigvalsh_suite, "make_anchors", lambda device: {
        "cusolverDnXsyevBatched": fake_solver, "jax.numpy.linalg.eigvalsh": "jax not installed",
        "cupy.linalg.eigvalsh": "needs a CUDA device"})
    return _solver_cases(tier, CPU), fake


def test_quick_cases_run_on_cpu_with_small_errors_for_every_baseline(monkeypatch):
    built, _ = _fake_anchor_cases(monkeypatch)
    ran = 0
    for case in built:
        if case.skip:
            continue
        assert case.notes == {"jax.numpy.linalg.eigvalsh": "jax not installed"}
        inp = case.setup()
        errs = case.check(inp)
        assert set(errs) == {"fastspec_error", "baseline_error", *(f"{b}_error" for b in case.baselines)}
        assert errs["baseline_error"] == errs["torch.linalg.eigvalsh_error"]
        bound = 1e-13 if case.size.endswith("fp64") else 2e-6
        assert all(math.isfinite(v) and 0 <= v < bound for v in errs.values()), (case.id, errs)
        for name, base in case.baselines.items():  # the timed calls run and give [B, n]
            batch, n = inp["A"].shape[:2]
            assert base(inp).shape == (batch, n), name
        ran += 1
    assert ran >= 3


def test_sliced_torch_baseline_is_timed_on_the_slice_and_checked_on_the_reference(monkeypatch):
    from fastspec.bench.runner import run_case

    monkeypatch.setattr(eigvalsh_suite, "torch_slice", lambda batch, n, device: min(batch, 5))
    monkeypatch.setattr(eigvalsh_suite, "REF_MATRICES", 12)
    built, fake = _fake_anchor_cases(monkeypatch)
    case = next(c for c in built if c.size == "B16-n32-fp32" and c.variant == "auto")
    assert case.baseline_scale == {"torch.linalg.eigvalsh": 16 / 5}
    assert case.error_kind == "max rel err vs fp64, first 12 of 16 matrices"
    inp = case.setup()
    assert inp["A_torch"].shape[0] == 5 and inp["A_ref"].shape[0] == 12 and inp["ref"].shape == (12, 32)
    assert case.baselines["torch.linalg.eigvalsh"](inp).shape == (5, 32)
    rows = run_case(case, CPU, warmup=1, repeats=2)
    by_name = {r["baseline"]: r for r in rows}
    assert set(by_name) == {"torch.linalg.eigvalsh", "cusolverDnXsyevBatched", "jax.numpy.linalg.eigvalsh"}
    assert by_name["jax.numpy.linalg.eigvalsh"]["skipped"] == "jax not installed"
    torch_row, cusolver_row = by_name["torch.linalg.eigvalsh"], by_name["cusolverDnXsyevBatched"]
    assert torch_row["baseline_scale"] == 16 / 5 and "baseline_scale" not in cusolver_row
    for row in (torch_row, cusolver_row):
        assert "error" not in row and 0 <= row["baseline_error"] < 2e-6
    # the timed cuSOLVER calls skip the info read-back, the accuracy check does not
    assert len(fake.named("cusolverDnXsyevBatched")) == 1 + 1 + 2  # check + warmup + repeats


def _heev_cases(monkeypatch, launch):
    """Quick CPU cases with cuSolverDx's heev (on a stand-in launch) as the one anchor; the
    launcher refuses it n = 64 as it refuses float32 n = 256 on sm_90 (shared memory)."""
    real = eig_cuda.variant_for

    def variant_for(n, dtype, spec, algo="block"):
        if algo != "cusolverdx":
            return real(n, dtype, spec, algo)
        if n == 64:
            raise ValueError(f"algo: 'cusolverdx' needs 300000 bytes of shared memory for {dtype} n = 64, "
                             f"sm_90 gives a block 232448")
        return None

    monkeypatch.setattr(eig_cuda, "variant_for", variant_for)
    fn = anchors.HeevDx(CPU, SM90, launch=launch)
    monkeypatch.setattr(eigvalsh_suite, "make_anchors", lambda device: {
        "cusolverDnXsyevBatched": "needs a CUDA device", "jax.numpy.linalg.eigvalsh": "jax not installed",
        "cupy.linalg.eigvalsh": "needs a CUDA device", "cusolverdx::heev": fn})
    return _solver_cases("quick", CPU)


def test_cusolverdx_is_a_baseline_where_it_fits_and_a_skipped_row_where_not(monkeypatch):
    from fastspec.bench.runner import run_case

    launch = FakeLaunch()
    built = _heev_cases(monkeypatch, launch)
    unfit = "cuSolverDx heev needs 300000 bytes of shared memory for float32 n = 64, sm_90 gives a block 232448"
    for case in built:
        if case.size == "B4-n64-fp32":
            assert "cusolverdx::heev" not in case.baselines
            assert case.notes == {"jax.numpy.linalg.eigvalsh": "jax not installed", "cusolverdx::heev": unfit}
        else:
            assert "cusolverdx::heev" in case.baselines
            assert case.notes == {"jax.numpy.linalg.eigvalsh": "jax not installed"}
    # the size it does not take: fastspec and torch are timed, the anchor's row says why not
    case = next(c for c in built if c.size == "B4-n64-fp32" and c.variant == "auto")
    rows = run_case(case, CPU, warmup=1, repeats=2)
    assert not [r for r in rows if "error" in r], rows
    by_name = {r["baseline"]: r for r in rows}
    assert by_name["cusolverdx::heev"]["skipped"] == unfit
    assert "fastspec_s" in by_name["torch.linalg.eigvalsh"] and not launch.calls
    # a size it takes: timed without the status read-back, checked with it
    reads = []
    real = anchors._check_status
    monkeypatch.setattr(anchors, "_check_status", lambda status: reads.append(status) or real(status))
    case = next(c for c in built if c.size == "B16-n32-fp32" and c.variant == "auto")
    rows = run_case(case, CPU, warmup=1, repeats=2)
    row = next(r for r in rows if r["baseline"] == "cusolverdx::heev")
    assert "error" not in row and 0 <= row["baseline_error"] < 2e-6
    assert len(launch.calls) == 1 + 1 + 2 and len(reads) == 1  # check + warmup + repeats; the check reads
    # a failed matrix is the check's error, as cuSOLVER's info is
    launch.status_for = {5: 7}
    case = next(c for c in built if c.size == "B8-n32-fp64" and c.variant == "auto")
    with pytest.raises(RuntimeError, match="did not converge for 1 matrices"):
        case.check(case.setup())


def test_compile_cases_time_the_kernels_first_call_build():
    """One ``compile-*`` case per (n, dtype) of the tier: the build with a warm cache against an
    empty one, both through the users' path; same code either way."""
    from fastspec.eig import nvrtc

    built = [c for c in cases("eigvalsh", "quick", CPU) if c.size.startswith("compile-")]
    assert [c.size for c in built] == ["compile-n32-fp32"]
    (case,) = built
    assert case.variant == "cache-hit" and list(case.baselines) == ["nvrtc compile (empty cache)"]
    if nvrtc.missing():
        assert case.skip and nvrtc.missing() in case.skip
        return
    inp = case.setup()
    try:
        cold = case.baselines["nvrtc compile (empty cache)"](inp)
        assert cold[:4] == b"\x7fELF" and case.fastspec(inp) == cold  # float32: byte for byte
        assert case.check(inp) == {"fastspec_error": 0.0, "baseline_error": 0.0}
    finally:
        case.close(inp)
    assert not os.path.exists(inp["root"])
