"""The DMMA Gram kernel (``csrc/cov_gram.cu``) and its launcher (``fastspec/covariance/gram_cuda.py``).

Without a GPU:

* the build: NVRTC compiles every ``D`` of the envelope and every input dtype for sm_90 (and, in
  the full tier, sm_80) through the path users run (:func:`fastspec.eig.nvrtc.compile_program`,
  the launcher's macros); the SASS has the float64 tensor-core loops the cost model counts (per
  4-row step a warp's ``D/32``-tile blocks: its DMMAs and fragment loads), no spills, no local
  memory, and registers within the launch bounds; the PTX entry points declare exactly the
  parameters the launcher packs;
* the arithmetic, two ways that check each other bit for bit:

  - the model: ``tests/_cov_gram_emulation.py`` replays the kernel's work (row split, tile
    staging, validity rule, warp roles, DMMA fragments lane by lane, packed epilogue, summation
    order, split reduction) in numpy, driven by the kernel's own macros and the launcher's plan,
    against the float64 reference on adversarial inputs (NaN/±Inf rows, masks, strided and
    transposed views, large means, empty updates, row_step > 1, rank-deficient heads, every D);
  - the host twin: the kernels' own code (``csrc/cov_gram.cu`` compiled by the C++ compiler into
    ``fastspec.eig._host``, ``csrc/cov_gram_host.cpp``) on a software GPU, one fiber per CUDA
    thread, warp collectives and a software ``mma.m8n8k4 .f64`` per the PTX ISA's fragments: its
    address arithmetic, operand order, ``pair_slot``/``put`` and ``fetch``/``advance`` carries
    run, on every D and dtype, against the reference and bit for bit against the model (a swapped
    ``dmma`` operand pair or a transposed fragment fails here; the model alone cannot see them);
    skipped, with the reason, where the extension lacks it (a stale build, no ``<ucontext.h>``);
* the launcher end to end: :func:`gram_cuda.partials_dmma` on CPU tensors with the driver
  replaced by a stand-in whose "kernels" run the host twin (or the model) on the raw pointers,
  strides, grid and block it was given, so the launch arguments are checked for what they do,
  not only for their widths.

With a GPU (``gpu`` marker): the kernel against the float64 reference and the emulation, three
launches bit for bit equal, and a CUDA-graph replay.
"""
from __future__ import annotations

import ctypes
import re
import threading

import _cov_gram_emulation as emu
import numpy as np
import pytest
import torch

from benchmarks.sass import disassemble, find_tool, kernels, resource_usage
from fastspec.covariance import blocked, gram_cuda
from fastspec.covariance.reference import covariance_partials_reference
from fastspec.eig import cuda, nvrtc

GRAM, REDUCE = gram_cuda.PROGRAM.entries


def _twin_missing() -> str:
    """Why the host twin of the kernels (``fastspec.eig._host.cov_gram_launch``) cannot run here, or ""."""
    try:
        from fastspec.eig import _host
    except ImportError as exc:
        return f"the Gram kernel's host twin is in the extension fastspec.eig._host, not importable ({exc})"
    if not hasattr(_host, "cov_gram_launch"):
        return ("fastspec.eig._host has no Gram kernel twin (built before csrc/cov_gram_host.cpp): rebuild it "
                "(pip install -e .)")
    if not _host.COV_GRAM_TWIN:
        return "the Gram kernel's host twin needs <ucontext.h>: not built on this platform"
    return ""


TWIN_MISSING = _twin_missing()
needs_twin = pytest.mark.skipif(bool(TWIN_MISSING), reason=TWIN_MISSING)
CUOBJDUMP = find_tool("cuobjdump")
needs_nvrtc = pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}")
needs_sass = [needs_nvrtc, pytest.mark.skipif(CUOBJDUMP is None, reason="needs cuobjdump (CUDA toolkit or triton)")]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}


# ------------------------------------------------------------------------------- inputs, checks


def adversarial(B: int, T: int, S: int, D: int, dtype: torch.dtype, seed: int = 0, offset: float = 0.0):
    """``(x [B, T, S, D], mask [B, T])``: random rows, a quarter masked out, and NaN, +Inf and -Inf
    planted in single values of some rows (of some heads only), some of them in masked-out rows."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T, S, D, generator=g) * 3 + offset).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.25
    if B * T * S:
        for value, k in ((float("nan"), 0), (float("inf"), 1), (float("-inf"), 2)):
            for _ in range(3):
                b, t, s, d = (int(torch.randint(n, (1,), generator=g)) for n in (B, T, S, D))
                x[b, t, s, d] = value
        mask[0, 0] = False
        x[0, 0, 0, 0] = float("nan")  # masked out: neither counted nor rejected
    return x, mask


def bounds(x: torch.Tensor, mask, row_step: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 summation bounds ``(N + 2) u Σ|terms|`` of G ``[S, D, D]`` and s ``[S, D]``
    (recursive summation of N terms, u = 2^-53; a float64 product's own rounding included)."""
    xk = x.double()[:, ::row_step]
    B, Tk, S, D = xk.shape
    rows = xk.reshape(B * Tk, S, D)
    keep = torch.isfinite(rows).all(-1)
    if mask is not None:
        keep &= mask.bool()[:, ::row_step].reshape(-1, 1)
    a = torch.where(keep[..., None], rows, 0).abs()
    u = (B * Tk + 2) * 2.0**-53
    return (u * torch.einsum("nsi,nsj->sij", a, a)).cpu().numpy(), (u * a.sum(0)).cpu().numpy()


def check(out, x: torch.Tensor, mask, row_step: int) -> None:
    """``out = (G, s, c, n, rejected)`` against the float64 reference: counts exact, G exactly
    symmetric, G and s within the float64 summation bound (:func:`bounds`)."""
    G, s, c, n, rejected = (t.cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in out)
    ref = covariance_partials_reference(x.double(), mask, row_step, center=False)
    ref_G, ref_s, ref_n, ref_rej = (t.cpu().numpy() for t in (ref.G, ref.s, ref.n, ref.rejected))
    assert (n == ref_n).all() and (rejected == ref_rej).all(), (n, ref_n, rejected, ref_rej)
    assert (c == 0).all() and (G == G.transpose(0, 2, 1)).all()
    G_tol, s_tol = bounds(x, mask, row_step)
    assert (np.abs(G - ref_G) <= G_tol).all(), np.abs(G - ref_G).max()
    assert (np.abs(s - ref_s) <= s_tol).all(), np.abs(s - ref_s).max()


# ----------------------------------------------------------------------------- plan and macros


def test_plan_for_the_keys_shape():
    """B 8 (and 4), T 2048, S 8, D 128 bf16 on an H100: one wave of 256 blocks, 2 per SM."""
    p = gram_cuda.plan(8 * 2048, 8, 128, "bfloat16", 132)
    assert (p.split, p.rows_per_split, p.rows, p.threads, p.grid) == (32, 512, 16, 256, (32, 8, 1))
    assert p.smem == 2 * 16 * 132 * 8 and p.record == 128 * 129 // 2 + 128
    assert p.reduce_grid == (-(-(p.record + 2) // 256), 8, 1)
    assert gram_cuda.plan(4 * 2048, 8, 128, torch.bfloat16, 132).rows_per_split == 256


@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
@pytest.mark.parametrize("dtype", list(gram_cuda.DTYPES))
def test_plan_covers_every_row_once_in_one_wave(D, dtype):
    for N in (0, 1, 15, 16, 17, 100, 1000, 16384, 123457):
        for S in (1, 3, 8, 40, 300):
            for sms in (1, 108, 132):
                p = gram_cuda.plan(N, S, D, dtype, sms)
                assert p.rows_per_split % p.rows == 0 and p.grid == (p.split, S, 1)
                assert (p.split - 1) * p.rows_per_split < max(N, 1) <= p.split * p.rows_per_split
                assert S * p.split <= max(S, sms * gram_cuda.min_blocks(D, dtype))  # one wave when it can be


def test_defines_match_the_kernel_defaults_and_layout():
    """The launcher's constants are the kernel's: block size, row padding, tile rows a multiple of
    the 8 warps, and the macros it sets are the ones the kernel reads."""
    k = emu.kernel_constants()
    text = emu.SOURCE.read_text()
    assert k.defaults["FS_COV_THREADS"] == gram_cuda.THREADS == 32 * len(k.roles)
    assert int(re.search(r"kPitch = kD \+ (\d+);", text).group(1)) == gram_cuda.PAD
    assert "__launch_bounds__(256)" in text and gram_cuda.REDUCE_THREADS == 256
    for D in gram_cuda.ENVELOPE_D:
        for dtype in gram_cuda.DTYPES:
            macros = dict(d[2:].split("=") for d in gram_cuda.defines(D, dtype))
            assert set(macros) == set(k.defaults)  # every macro, no stray one
            assert int(macros["FS_COV_ROWS"]) % 8 == 0 and int(macros["FS_COV_D"]) == D
    assert gram_cuda.tag(128, torch.bfloat16) == "bfloat16-d128-r16-b2"


def test_the_kernels_fragment_mapping_is_the_ptx_isas():
    """The kernel's lanes load A[l >> 2][l & 3] and B[l & 3][l >> 2] and hold C[l >> 2][2 (l & 3) + v]."""
    k = emu.kernel_constants()
    assert (k.frag_mn(emu.LANES) == emu.PTX_A[0]).all() and (k.frag_k(emu.LANES) == emu.PTX_A[1]).all()
    assert (k.frag_k(emu.LANES) == emu.PTX_B[0]).all() and (k.frag_mn(emu.LANES) == emu.PTX_B[1]).all()
    for v in (0, 1):
        assert (k.acc_m(emu.LANES) == emu.PTX_C[v][0]).all() and (k.acc_n(emu.LANES, v) == emu.PTX_C[v][1]).all()


@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
def test_warp_roles_cover_the_lower_triangle_once_and_balance(D):
    tiles = emu.warp_tiles(emu.kernel_constants().roles, D)
    nt = D // 8
    flat = [t for w in tiles for t in w]
    assert sorted(flat) == sorted((i, j) for i in range(nt) for j in range(i + 1))
    counts = [len(w) for w in tiles]
    if D == 128:  # 136 tiles: 17 per warp, so the 4 SMSPs (warps w, w + 4) get 34 each
        assert counts == [17] * 8


def test_outside_the_envelope_is_refused_with_a_reason(monkeypatch):
    assert "D = 80" in gram_cuda.supports(80) and "int8" in gram_cuda.supports(64, torch.int8)
    assert gram_cuda.supports(96, "float16") == ""
    assert "CUDA" in gram_cuda.status("cpu") and "D = 256" in gram_cuda.status("cpu", 256)
    with pytest.raises(ValueError, match="D = 48"):
        gram_cuda.defines(48, "float32")
    with pytest.raises(ValueError, match="D = 200"):
        gram_cuda.plan(10, 2, 200, "float32", 132)
    with pytest.raises(nvrtc.KernelUnavailable, match="CUDA"):
        gram_cuda.partials_dmma(torch.zeros(1, 2, 3, 64))
    monkeypatch.setattr(cuda, "status", lambda: (True, "NVRTC"))
    monkeypatch.setattr(cuda, "device_index", lambda device: 0)
    monkeypatch.setattr(gram_cuda, "_arch", lambda index: (75, 40))
    assert "sm_75 has no float64 tensor cores" in gram_cuda.status("cuda")


# ------------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("sms", [132, 1])
@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_emulated_kernel_matches_the_float64_reference(dtype, D, sms):
    """Masks, NaN/±Inf rows, row_step 2; the split of an H100 (many splits of one tile) and of a
    1-SM GPU (one split of many tiles, the last one partial)."""
    x, mask = adversarial(3, 41, 3, D, DTYPES[dtype], seed=D)
    check(emu.emulate(x, mask, 2, sms), x, mask, 2)
    check(emu.emulate(x, None, 1, sms), x, None, 1)


VIEWS = ["bhtd", "d_strided", "sliced"]


def strided_view(view: str, dtype: torch.dtype, seed: int, bad: float):
    """``(x [2, 37, 3, 64], mask [2, 37])`` through a non-contiguous view: ``bhtd`` ([B, H, T, D] seen
    as [B, T, H, D]), ``d_strided`` (D not contiguous: [B, T, D, S] transposed) or ``sliced`` (a
    slice of a larger tensor); one value of one row set to ``bad``."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x = {"bhtd": lambda: rand(2, 3, 37, 64).transpose(1, 2),
         "d_strided": lambda: rand(2, 37, 64, 3).transpose(2, 3),
         "sliced": lambda: rand(2, 40, 5, 160)[:, 2:39, 1:4, 16:80]}[view]()
    x[1, 5, 2, 7] = bad
    mask = torch.rand(2, 37, generator=g) > 0.3
    assert not x.is_contiguous()
    return x, mask


@pytest.mark.parametrize("view", VIEWS)
def test_emulated_kernel_on_strided_views(view):
    """[B, H, T, D] seen as [B, T, H, D]; D not contiguous ([B, T, D, S] transposed); a slice."""
    x, mask = strided_view(view, torch.bfloat16, 1, float("inf"))
    for row_step in (1, 3):
        check(emu.emulate(x, mask, row_step, 7), x, mask, row_step)


def test_emulated_kernel_with_a_large_mean():
    """Raw sums of rows 1e4 away from 0 (float32): every product exact, sums within the bound."""
    x, mask = adversarial(2, 60, 2, 96, torch.float32, seed=3, offset=1e4)
    check(emu.emulate(x, mask, 1, 132), x, mask, 1)


@pytest.mark.parametrize("shape", [(0, 16, 2, 64), (3, 0, 2, 64), (2, 5, 1, 32)])
def test_emulated_kernel_on_empty_updates(shape):
    """No rows (B = 0, T = 0), or every row masked out: zeros, and counts of zero."""
    x = torch.randn(shape).to(torch.float16)
    mask = torch.zeros(shape[:2], dtype=torch.bool)
    for m in (None, mask):
        G, s, c, n, rejected = emu.emulate(x, m, 2)
        if m is not None or 0 in shape:
            assert (G == 0).all() and (s == 0).all() and (n == 0).all() and (rejected == 0).all()
        check((G, s, c, n, rejected), x, m, 2)


@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
def test_emulated_kernel_on_rank_deficient_heads(D):
    """Rank-3 heads of small integers (exact in bf16): every sum is an integer below 2^53, so G is
    exactly the reference's; its spectrum is svdvals² of the float64 rows (rank 3, then ~0)."""
    g = torch.Generator().manual_seed(D)
    B, T, S = 2, 45, 2
    Z = torch.randint(-3, 4, (B, T, S, 3), generator=g).double()
    W = torch.randint(-3, 4, (S, 3, D), generator=g).double()
    x = torch.einsum("btsr,srd->btsd", Z, W).to(torch.bfloat16)
    x[1, 4, 0, 3] = float("nan")
    mask = torch.rand(B, T, generator=g) > 0.2
    G, s, _, n, _ = emu.emulate(x, mask, 1, 132)
    ref = covariance_partials_reference(x.double(), mask, 1, center=False)
    assert (G == ref.G.numpy()).all() and (s == ref.s.numpy()).all() and (n == ref.n.numpy()).all()
    rows = x.double().reshape(B * T, S, D)
    valid = mask.reshape(-1, 1) & torch.isfinite(rows).all(-1)
    for h in range(S):
        sv = torch.linalg.svdvals(rows[valid[:, h], h])
        lam = torch.linalg.eigvalsh(torch.from_numpy(G[h])).flip(0)
        expected = torch.zeros(D, dtype=torch.float64)
        expected[:sv.numel()] = sv**2
        assert (lam - expected).abs().max() <= 1e-8 * lam[0], (h, lam[:5], expected[:5])
        assert (lam[3:].abs() <= 1e-8 * lam[0]).all()  # rank 3


def test_emulation_catches_a_wrong_fragment_mapping():
    """The model is sensitive to the kernel's side of the layout: a kernel whose lanes loaded the
    column-major fragment (lane l: m = l & 7, k = l >> 3), or stored their two accumulators in
    each other's column, would fail the reference check; so the checks above passing means the
    kernel's macros are right."""
    text = emu.SOURCE.read_text()
    x, mask = adversarial(2, 20, 2, 64, torch.float32, seed=5)
    check(emu.emulate(x, mask, 1, 132), x, mask, 1)
    k_old, mn_old = "#define FS_COV_FRAG_K(lane) ((lane) & 3)", "#define FS_COV_FRAG_MN(lane) ((lane) >> 2)"
    n_old = "#define FS_COV_ACC_N(lane, v) (2 * ((lane) & 3) + (v))"
    mutants = [text.replace(k_old, "#define FS_COV_FRAG_K(lane) ((lane) >> 3)")
                   .replace(mn_old, "#define FS_COV_FRAG_MN(lane) ((lane) & 7)"),
               text.replace(n_old, "#define FS_COV_ACC_N(lane, v) (2 * ((lane) & 3) + 1 - (v))")]
    for mutant in mutants:
        assert mutant != text
        with pytest.raises(AssertionError):
            check(emu.emulate(x, mask, 1, 132, emu.kernel_constants(mutant)), x, mask, 1)


# -------------------------------------------------------------- the launcher, driver stood in


class FakeDevice:
    """``cuda.load_program``, ``set_max_smem`` and ``launch_kernel`` for :func:`partials_dmma` on
    CPU tensors of an sm_90 GPU with ``sms`` SMs: the two "kernels" read the memory the launch
    arguments point at (pointers, element strides, the macros the image was built with) and write
    their outputs there. ``kernels="twin"``: the kernels' own code on the host twin's software GPU
    (the launch's grid, block, dynamic shared memory and parameter list as packed; threads of a
    block in thread order, or reversed with ``order=1``; what it counted in ``stats``);
    ``"model"``: the numpy emulation, reading the same arguments."""

    def __init__(self, kernels: str = "model", sms: int = 132, order: int = 0):
        self.kernels, self.sms, self.order = kernels, sms, order
        self.loaded, self.smem, self.carveout, self.launches, self.stats = [], [], [], [], []

    def load_program(self, program, defines, tag, device):
        assert program is gram_cuda.PROGRAM
        self.loaded.append(tag)
        macros = {k: int(v) for k, v in (d[2:].split("=") for d in defines)}
        return {e: (e, macros) for e in program.entries}

    def set_max_smem(self, kernel, smem, device):
        self.smem.append((kernel[0], smem))

    def launch_kernel(self, kernel, grid, block, smem, args, device):
        name, m = kernel
        vals = [a.value or 0 for a in args]
        self.launches.append((name, grid, block, smem))
        D = m["FS_COV_D"]
        if name == GRAM:
            assert block == (m["FS_COV_THREADS"], 1, 1) and smem == 2 * m["FS_COV_ROWS"] * (D + gram_cuda.PAD) * 8
        else:
            assert block == (256, 1, 1) and grid[0] * 256 >= D * (D + 1) // 2 + D + 2 and smem == 0
        if self.kernels == "twin":
            from fastspec.eig import _host

            self.stats.append((name, _host.cov_gram_launch(name, m, grid, block, smem, vals, self.order)))
        elif name == GRAM:
            self._gram(m, grid, *vals)
        else:
            self._reduce(D, grid, *vals)

    @staticmethod
    def _array(ptr, ctype, n):
        return np.ctypeslib.as_array((ctype * max(n, 1)).from_address(ptr))[:n]

    def _gram(self, m, grid, x, mask, part, counts, B, Tk, row_step, sb, st, ss, sd, mb, mt, rows_per_split):
        split, S, _ = grid
        D = m["FS_COV_D"]
        N = B * Tk
        if N:
            ctype, widen = {0: (ctypes.c_uint16, lambda a: (a.astype(np.uint32) << 16).view(np.float32)),
                            1: (ctypes.c_uint16, lambda a: a.view(np.float16)),
                            2: (ctypes.c_float, lambda a: a), 3: (ctypes.c_double, lambda a: a)}[m["FS_COV_IN"]]
            strides = (sb, row_step * st, ss, sd)
            extent = 1 + sum((n - 1) * st_ for n, st_ in zip((B, Tk, S, D), strides))
            raw = self._array(x, ctype, extent)
            view = np.lib.stride_tricks.as_strided(raw, (B, Tk, S, D), [s * raw.itemsize for s in strides])
            vals = widen(np.ascontiguousarray(view)).astype(np.float64).reshape(N, S, D)
            keep = np.ones(N, dtype=bool)
            if mask:
                mraw = self._array(mask, ctypes.c_uint8, 1 + (B - 1) * mb + (Tk - 1) * row_step * mt)
                keep = np.lib.stride_tricks.as_strided(mraw, (B, Tk), (mb, row_step * mt)).reshape(N) != 0
        else:
            vals, keep = np.zeros((0, S, D)), np.zeros(0, dtype=bool)
        launch = emu.Launch(D, m["FS_COV_ROWS"], m["FS_COV_THREADS"] // 32, split, rows_per_split)
        p, c = emu.gram_kernel(vals, keep, launch, emu.kernel_constants())
        self._array(part, ctypes.c_double, p.size)[:] = p.ravel()
        self._array(counts, ctypes.c_int64, c.size)[:] = c.ravel()

    def _reduce(self, D, grid, part, counts, splits, G, s, c, n, rejected, accumulate):
        S = grid[1]
        record = D * (D + 1) // 2 + D
        into = None
        if accumulate:
            into = (self._array(G, ctypes.c_double, S * D * D).reshape(S, D, D).copy(),
                    self._array(s, ctypes.c_double, S * D).reshape(S, D).copy(),
                    self._array(n, ctypes.c_int64, S).copy(), self._array(rejected, ctypes.c_int64, S).copy())
        outs = emu.reduce_kernel(self._array(part, ctypes.c_double, splits * S * record).reshape(splits, S, record),
                                 self._array(counts, ctypes.c_int64, splits * S * 2).reshape(splits, S, 2), D, into)
        for ptr, ctype, value in zip((G, s, c, n, rejected), (ctypes.c_double,) * 3 + (ctypes.c_int64,) * 2, outs):
            if value is not None:
                self._array(ptr, ctype, value.size)[:] = value.ravel()


def install_fake(monkeypatch, kernels: str = "model") -> FakeDevice:
    """partials_dmma on CPU tensors: an sm_90 GPU of 132 SMs (``.sms``) that runs ``kernels``."""
    dev = FakeDevice(kernels)
    capturing = [False]
    for name in ("load_program", "set_max_smem", "launch_kernel"):
        monkeypatch.setattr(cuda, name, getattr(dev, name))
    monkeypatch.setattr(cuda, "device_index", lambda device: 0)
    monkeypatch.setattr(gram_cuda, "status", lambda device, D=None, dtype=None: gram_cuda.supports(D, dtype))
    monkeypatch.setattr(gram_cuda, "_arch", lambda index: (90, dev.sms))
    monkeypatch.setattr(gram_cuda, "_prefer_shared_memory", lambda kernel, index: dev.carveout.append(kernel[0]))
    monkeypatch.setattr(gram_cuda, "_configured", set())
    monkeypatch.setattr(blocked, "_local", threading.local())  # a fresh shared workspace per test
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    dev.capturing = capturing
    return dev


@pytest.fixture(params=[pytest.param("twin", marks=needs_twin), "model"])
def fake(monkeypatch, request):
    """The stand-in GPU running the kernels' host twin, then (a second run) the numpy model."""
    return install_fake(monkeypatch, request.param)


@pytest.fixture
def twin(monkeypatch):
    """The stand-in GPU running the kernels' host twin (skipped where the extension lacks it)."""
    if TWIN_MISSING:
        pytest.skip(TWIN_MISSING)
    return install_fake(monkeypatch, "twin")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_launcher_arguments_do_what_the_kernel_expects(fake, dtype):
    """The pointers, strides, Tk, row_step and split the launcher passes, read back by the stand-in
    kernels (the kernels' own code on the host twin, or the model), give the reference's partials,
    bit for bit the model's (the same arithmetic)."""
    base, mask = adversarial(2, 30, 3, 96, DTYPES[dtype], seed=7)
    x = base.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, S, D] over [B, S, T, D] memory
    for m, row_step in ((mask, 2), (None, 1), (mask.to(torch.uint8), 3)):
        out = gram_cuda.partials_dmma(x, m, row_step)
        got = (out.G, out.s, out.c, out.n, out.rejected)
        check(got, x, m, row_step)
        want = emu.emulate(x, m, row_step, 132)
        assert all((np.asarray(a) == b).all() for a, b in zip(got, want))
    assert [n for n, *_ in fake.launches] == [GRAM, REDUCE] * 3
    assert fake.smem == [(GRAM, gram_cuda.plan(2 * 15, 3, 96, dtype, 132).smem)]  # configured once
    assert fake.carveout == [GRAM]


def test_launcher_reuses_its_buffers_except_under_graph_capture(fake):
    x, mask = adversarial(2, 33, 2, 128, torch.bfloat16, seed=8)
    first = gram_cuda.partials_dmma(x, mask)
    ws = blocked.shared_workspace()
    ptrs = {k: t.data_ptr() for k, t in ws._bufs.items()}
    assert {k[0] for k in ptrs} == {"cov_gram.partials", "cov_gram.counts"}
    again = gram_cuda.partials_dmma(x, mask)
    assert {k: t.data_ptr() for k, t in ws._bufs.items()} == ptrs  # the same partials workspace
    assert torch.equal(again.G, first.G) and again.G.data_ptr() != first.G.data_ptr()  # fresh outputs
    fake.capturing[0] = True
    captured = gram_cuda.partials_dmma(x, mask)
    assert {k: t.data_ptr() for k, t in ws._bufs.items()} == ptrs and torch.equal(captured.G, first.G)
    assert first.G.shape == (2, 128, 128) and first.n.dtype == torch.int64 and first.s.dtype == torch.float64


def test_accumulate_adds_into_the_totals_bit_for_bit_as_partials_then_merge(fake):
    """The reduction kernel's accumulate mode makes the merge's additions: bitwise equal totals
    over two updates from non-zero symmetric totals; an update without rows launches nothing;
    once the workspace holds the shape, an update dispatches no torch op at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastspec.covariance.ops import merge_sums

    S, D = 3, 64
    g = torch.Generator().manual_seed(4)
    a = torch.randn(S, D, D, generator=g, dtype=torch.float64)
    start = {"n": torch.tensor([5, 0, 7]), "rejected": torch.tensor([1, 2, 0]),
             "sum": torch.randn(S, D, generator=g, dtype=torch.float64), "gram": a + a.mT}
    merged = {k: v.clone() for k, v in start.items()}
    folded = {k: v.clone() for k, v in start.items()}
    for seed in (1, 2):
        x, mask = adversarial(2, 21, S, D, torch.float16, seed=seed)
        merge_sums(merged, False, *gram_cuda.partials_dmma(x, mask, 2))
        gram_cuda.accumulate_dmma(folded["n"], folded["rejected"], folded["sum"], folded["gram"], x, mask, 2)
    for k in start:
        assert torch.equal(folded[k], merged[k]), k
    assert torch.equal(folded["gram"], folded["gram"].mT)
    launched = len(fake.launches)
    gram_cuda.accumulate_dmma(folded["n"], folded["rejected"], folded["sum"], folded["gram"], x[:0], mask[:0])
    assert len(fake.launches) == launched and torch.equal(folded["gram"], merged["gram"])

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        gram_cuda.accumulate_dmma(folded["n"], folded["rejected"], folded["sum"], folded["gram"], x, mask, 2)
    assert ops.seen == [] and len(fake.launches) == launched + 2
    with pytest.raises(ValueError, match=r"sum: expected a contiguous torch.float64 tensor of shape \[3, 64\]"):
        gram_cuda.accumulate_dmma(folded["n"], folded["rejected"], folded["sum"].float(), folded["gram"], x, mask)


def test_launcher_with_no_heads_or_no_rows(fake):
    out = gram_cuda.partials_dmma(torch.zeros(2, 3, 0, 32))
    assert out.G.shape == (0, 32, 32) and not fake.launches  # nothing to launch
    out = gram_cuda.partials_dmma(torch.zeros(0, 3, 2, 32, dtype=torch.float16))
    assert (out.n == 0).all() and (out.G == 0).all() and len(fake.launches) == 2


# ------------------------------------------------------------- the host twin: the kernels' own code


def run_twin(dev: FakeDevice, x: torch.Tensor, mask, row_step: int, sms: int, order: int = 0):
    """:func:`partials_dmma` through the launcher onto the host twin, on a GPU of ``sms`` SMs:
    ``(G, s, c, n, rejected)`` as numpy arrays; ``dev.stats`` holds what the two launches counted."""
    dev.sms, dev.order = sms, order
    dev.stats.clear()
    out = gram_cuda.partials_dmma(x, mask, row_step)
    return tuple(t.numpy() for t in (out.G, out.s, out.c, out.n, out.rejected))


def same_bits(got, want) -> bool:
    return all(np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b) for a, b in zip(got, want))


def counted(N: int, S: int, D: int, dtype, sms: int) -> dict:
    """What the Gram launch of ``N`` rows must do, per the kernel's structure (header): a block runs a
    barrier per staged tile and two at the end, a vote per staged row (one per warp for its
    ``ROWS / 8``), and per 4-row step one DMMA per 8x8 tile of the lower triangle, spread over
    the warps (136 at D = 128)."""
    p = gram_cuda.plan(N, S, D, dtype, sms)
    tiles = [-(-max(0, min(p.rows_per_split, N - k * p.rows_per_split)) // p.rows) for k in range(p.split)]
    nt = D // 8
    return {"blocks": p.split * S, "syncthreads": S * sum(t + 2 for t in tiles), "all_sync": S * sum(tiles) * p.rows,
            "mma": S * sum(tiles) * (p.rows // 4) * nt * (nt + 1) // 2}


@needs_twin
def test_twin_is_compiled_with_the_launchers_macros():
    """One twin per (D, dtype) of the envelope, each built with the macros gram_cuda.defines() gives
    the NVRTC build (a stale extension shows here)."""
    from fastspec.eig import _host

    want = [{k: int(v) for k, v in (d[2:].split("=") for d in gram_cuda.defines(D, dt))}
            for D in gram_cuda.ENVELOPE_D for dt in gram_cuda.DTYPES]
    assert sorted(_host.COV_GRAM_CONFIGS, key=str) == sorted(want, key=str), "rebuild the extension (pip install -e .)"


@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_twin_matches_the_reference_and_the_model_bit_for_bit(twin, dtype, D):
    """The kernels' own code, launched as the launcher packs it: NaN/±Inf rows, bool and uint8
    masks, row_step 1 and 2, tails (N not a multiple of the tile rows), the splits of 132 SMs
    (many splits of one tile) and 1 SM (one split of many tiles, the last partial); against the
    float64 reference, bit for bit the model's, and doing the work the kernel's structure says
    (blocks, barriers, votes, DMMAs)."""
    twin_cases(twin, 2, 37, 2, D, dtype, (("bool", 2, 132), ("uint8", 1, 1)), seed=D + 1)


@pytest.mark.slow
@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_twin_on_longer_updates(twin, dtype, D):
    """More rows: without a mask, row_step 3, the splits of 7 and 132 SMs (a few tiles per block)."""
    twin_cases(twin, 3, 100, 3, D, dtype, ((None, 3, 7), ("bool", 1, 132), ("uint8", 2, 7)), seed=D + 2)


def twin_cases(twin: FakeDevice, B: int, T: int, S: int, D: int, dtype: str, cases, seed: int) -> None:
    """:func:`adversarial` ``[B, T, S, D]`` through the twin for each ``(mask: None, "bool" or
    "uint8", row_step, sms)``: the reference, the model's bits, the work counted."""
    x, mask = adversarial(B, T, S, D, DTYPES[dtype], seed=seed)
    for kind, row_step, sms in cases:
        m = None if kind is None else mask.to(getattr(torch, kind))
        got = run_twin(twin, x, m, row_step, sms)
        check(got, x, m, row_step)
        assert same_bits(got, emu.emulate(x, m, row_step, sms)), (m is None, row_step, sms)
        (gram, done), (reduce, _) = twin.stats
        assert (gram, reduce) == (GRAM, REDUCE)
        assert {k: done[k] for k in ("blocks", "syncthreads", "all_sync", "mma")} == counted(
            B * -(-T // row_step), S, D, dtype, sms)


@pytest.mark.parametrize("view", VIEWS)
def test_twin_on_strided_views(twin, view):
    """The views of :func:`test_emulated_kernel_on_strided_views`: the kernel's stepping of rows
    and columns through any element strides, with the sequence carries of row_step 3."""
    x, mask = strided_view(view, torch.float16, 2, float("-inf"))
    for row_step, sms in ((1, 7), (3, 132)):
        got = run_twin(twin, x, mask, row_step, sms)
        check(got, x, mask, row_step)
        assert same_bits(got, emu.emulate(x, mask, row_step, sms))


@pytest.mark.parametrize("D", gram_cuda.ENVELOPE_D)
def test_twin_on_integer_heads_exactly(twin, D):
    """Heads of small integers (rank 3 plus a per-column offset, exact in bf16): every sum is exact,
    so G, s and n are the reference's exactly, whatever the order; each of G's off-diagonal tiles
    differs from its transpose (a transposed tile or a swapped operand pair cannot pass)."""
    g = torch.Generator().manual_seed(D)
    B, T, S = 2, 45, 2
    Z = torch.randint(-3, 4, (B, T, S, 3), generator=g).double()
    W = torch.randint(-3, 4, (S, 3, D), generator=g).double()
    x = torch.einsum("btsr,srd->btsd", Z, W).to(torch.bfloat16) + torch.arange(D).to(torch.bfloat16) % 5
    x[1, 4, 0, 3] = float("nan")
    mask = torch.rand(B, T, generator=g) > 0.2
    G, s, _, n, _ = run_twin(twin, x, mask, 1, 132)
    ref = covariance_partials_reference(x.double(), mask, 1, center=False)
    assert (G == ref.G.numpy()).all() and (s == ref.s.numpy()).all() and (n == ref.n.numpy()).all()
    tiles = ref.G.numpy().reshape(S, D // 8, 8, D // 8, 8).transpose(0, 1, 3, 2, 4)  # [S, I, J, 8, 8]
    for I in range(D // 8):
        for J in range(I):
            assert (tiles[:, I, J] != tiles[:, I, J].transpose(0, 2, 1)).any(), (I, J)


@pytest.mark.parametrize("shape", [(0, 16, 2, 64), (3, 0, 2, 64), (2, 5, 1, 32)])
def test_twin_on_empty_updates(twin, shape):
    """No rows (B = 0, T = 0), or every row masked out: zeros and counts of zero, the model's bits."""
    x = torch.randn(shape).to(torch.float32)
    mask = torch.zeros(shape[:2], dtype=torch.bool)
    for m in (None, mask):
        got = run_twin(twin, x, m, 2, 132)
        if m is not None or 0 in shape:
            assert all((a == 0).all() for a in got)
        check(got, x, m, 2)
        assert same_bits(got, emu.emulate(x, m, 2, 132))


def test_twin_widens_every_float16_exactly(twin):
    """Every finite float16 (subnormals, ±0, the largest) through the twin's cvt.f32.f16: the
    sums and products of all of them, bit for bit the model's (numpy's conversion)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits[torch.isfinite(bits)].reshape(1, -1, 1, 32)  # 63488 values: 1984 rows of D = 32
    got = run_twin(twin, x, None, 1, 1)
    assert got[3][0] == 1984 and same_bits(got, emu.emulate(x, None, 1, 1))
    check(got, x, None, 1)


def test_twin_results_do_not_depend_on_the_thread_order(twin):
    """A block's threads in thread order, then reversed: the same bits (every value a thread reads
    was written before a barrier or collective it passed)."""
    x, mask = adversarial(2, 50, 2, 96, torch.bfloat16, seed=12)
    first = run_twin(twin, x, mask, 2, 132)
    assert same_bits(run_twin(twin, x, mask, 2, 132, order=1), first)
    assert same_bits(run_twin(twin, x, mask, 2, 1, order=1), run_twin(twin, x, mask, 2, 1))


@needs_twin
def test_twin_refuses_what_a_gpu_would_not_run():
    """The software GPU's own checks: a configuration the build lacks, a parameter list of the wrong
    length, a block past the launch bounds, too little dynamic shared memory (the kernel's write
    past it is caught), a collective the warp cannot take; a launch after a failed one runs."""
    from fastspec.eig import _host

    D, dtype, N = 64, "float32", 40
    x = torch.randn(1, N, 1, D)
    record = D * (D + 1) // 2 + D
    part, counts = torch.zeros(record, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)
    # one block of 2 tiles (32 rows each at D = 64): both staging buffers
    args = [a.value or 0 for a in gram_cuda.launch_args(x.data_ptr(), 0, part.data_ptr(), counts.data_ptr(), 1, N, 1,
                                                          x.stride(), (0, 0), 64)]
    macros = {k: int(v) for k, v in (d[2:].split("=") for d in gram_cuda.defines(D, dtype))}
    smem = 2 * 32 * (D + gram_cuda.PAD) * 8
    launch = {"entry": GRAM, "defines": macros, "grid": (1, 1, 1), "block": (256, 1, 1), "smem": smem, "args": args}
    with pytest.raises(ValueError, match="no configuration compiled"):
        _host.cov_gram_launch(**{**launch, "defines": {**macros, "FS_COV_ROWS": 16}})
    with pytest.raises(ValueError, match="takes 14 parameters"):
        _host.cov_gram_launch(**{**launch, "args": args[:-1]})
    with pytest.raises(ValueError, match="launch bounds"):
        _host.cov_gram_launch(**{**launch, "block": (512, 1, 1)})
    with pytest.raises(RuntimeError, match="wrote past its 17408 bytes of dynamic shared memory"):
        _host.cov_gram_launch(**{**launch, "smem": smem // 2})
    with pytest.raises(RuntimeError, match="__all_sync: the twin takes the full mask"):
        _host.cov_gram_launch(**{**launch, "block": (200, 1, 1)})  # warp 6 has 8 lanes
    done = _host.cov_gram_launch(**launch)
    assert done["blocks"] == 1 and done["mma"] == 2 * 8 * 36 and counts.tolist() == [N, 0]
    want, _ = emu.gram_kernel(x.double().reshape(N, 1, D).numpy(), np.ones(N, dtype=bool), emu.Launch(D, 32, 8, 1, 64),
                              emu.kernel_constants())
    assert np.array_equal(part.numpy(), want.ravel())


# ---------------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``(arch, D, dtype) -> cubin path``, compiled once per module in a fresh cache, through
    :func:`nvrtc.compile_program` with the launcher's macros and the target users get."""
    folder = tmp_path_factory.mktemp("cov-gram-cache")
    made: dict[tuple, str] = {}

    def get(arch: int, D: int, dtype: str) -> str:
        if (arch, D, dtype) not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FASTSPEC_CACHE", str(folder))
                img = nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(D, dtype), gram_cuda.tag(D, dtype),
                                            nvrtc.choose_target(arch))
            assert img.target == nvrtc.Target(arch) and img.data[:4] == b"\x7fELF"
            path = folder / f"sm{arch}-{gram_cuda.tag(D, dtype)}.cubin"
            path.write_bytes(img.data)
            made[arch, D, dtype] = str(path)
        return made[arch, D, dtype]

    return get


_FAST = {(90, D, "bfloat16") for D in gram_cuda.ENVELOPE_D} | {(90, 128, dt) for dt in gram_cuda.DTYPES}
BUILDS = [pytest.param(arch, D, dt, id=f"sm{arch}-d{D}-{dt}",
                       marks=[*needs_sass, *([] if (arch, D, dt) in _FAST else [pytest.mark.slow])])
          for arch in (90, 80) for D in gram_cuda.ENVELOPE_D for dt in gram_cuda.DTYPES]


@pytest.mark.parametrize("arch, D, dtype", BUILDS)
def test_compiled_kernel_uses_dmma_without_spills(build, arch, D, dtype):
    """Registers within the launch bounds (2 blocks of 256 threads per SM: <= 128), no stack or
    local memory, no generic loads/stores, shared memory for 2 blocks per SM; the DMMA loops of
    the two warp roles: per 4-row step, an off-diagonal warp's kB² (+1) DMMAs on 2 kB (+1)
    fragment loads, a diagonal pair's kB(kB+1) (-3) on 2 kB (kB = D/32)."""
    path = build(arch, D, dtype)
    res = resource_usage(path)
    for entry in (GRAM, REDUCE):
        assert res[entry]["stack"] == 0 and res[entry]["local"] == 0, (entry, res[entry])
    blocks = gram_cuda.min_blocks(D, dtype)
    assert res[GRAM]["registers"] * gram_cuda.THREADS * blocks <= 65536, res[GRAM]
    spec = cuda.DeviceSpec.for_arch(arch)
    p = gram_cuda.plan(16384, 8, D, dtype, spec.sms)
    assert p.smem <= spec.smem_optin
    assert blocks * (p.smem + res[GRAM]["shared"] + cuda.RESERVED_SMEM) <= spec.smem_per_sm
    k = {k.name: k for k in kernels(disassemble(path))}[GRAM]
    assert k.ops["LDL"] == k.ops["STL"] == k.ops["LD"] == k.ops["ST"] == 0, k.ops
    kB, share = D // 32, int(D >= 64)
    expected = {(kB * kB + share, 2 * kB + share), (kB * (kB + 1) - 3 * share, 2 * kB)}  # (DMMA, LDS) per step
    loops = [lp for lp in k.innermost() if lp.ops["DMMA"]]
    seen = set()
    for lp in loops:
        match = [(d, s) for d, s in expected if lp.ops["DMMA"] % d == 0 and lp.ops["LDS"] * d == s * lp.ops["DMMA"]]
        assert match, (lp.ops["DMMA"], lp.ops["LDS"], expected)
        seen.update(match)
    assert seen == expected, (seen, expected)


@needs_nvrtc
def test_ptx_entry_points_declare_what_the_launcher_packs(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    img = nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(128, "bfloat16"), "ptx",
                                nvrtc.Target(90, ptx=True))
    text = img.data.rstrip(b"\0").decode()
    packed = {GRAM: gram_cuda.launch_args(1, 2, 3, 4, 5, 6, 7, (8, 9, 10, 11), (12, 13), 14),
              REDUCE: gram_cuda.reduce_args(1, 2, 3, 4, 5, 6, 7, 8, True)}
    for entry, args in packed.items():
        params = re.search(r"\.entry\s+" + entry + r"\s*\((.*?)\)", text, re.DOTALL).group(1)
        widths = [int(w) // 8 for w in re.findall(r"\.param\s+\.[usb](\d+)", params)]
        assert widths == [ctypes.sizeof(a) for a in args], entry
    assert len(packed[GRAM]) == 14 and len(packed[REDUCE]) == 9


@needs_nvrtc
@pytest.mark.parametrize("bad, message", [("-DFS_COV_D=80", "FS_COV_D"), ("-DFS_COV_ROWS=12", "FS_COV_ROWS"),
                                          ("-DFS_COV_THREADS=128", "FS_COV_THREADS")])
def test_the_kernel_refuses_macros_outside_its_envelope(tmp_path, monkeypatch, bad, message):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    name = bad[2:].split("=")[0]
    defines = tuple(bad if d.startswith(f"-D{name}=") else d for d in gram_cuda.defines(128, "float32"))
    with pytest.raises(nvrtc.KernelUnavailable, match=message):
        nvrtc.compile_program(gram_cuda.PROGRAM, defines, "bad", nvrtc.Target(90))


# ------------------------------------------------------------------------------------ on a GPU


def _gpu():
    device = torch.device("cuda")
    why = gram_cuda.status(device)
    if why:
        pytest.skip(why)
    return device


GPU_CASES = [(3, 41, 3, 32, "float16", 1), (3, 41, 3, 64, "bfloat16", 2), (2, 37, 5, 96, "float32", 3),
             (2, 50, 2, 128, "float64", 1), (4, 300, 8, 128, "bfloat16", 1), (0, 16, 2, 64, "bfloat16", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, S, D, dtype, row_step", GPU_CASES)
def test_gpu_kernel_matches_reference_and_emulation_bitwise_repeatably(B, T, S, D, dtype, row_step):
    device = _gpu()
    x, mask = adversarial(B, T, S, D, DTYPES[dtype], seed=B * T + D)
    x, mask = x.to(device), mask.to(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    runs = []
    for _ in range(3):
        out = gram_cuda.partials_dmma(x, mask, row_step)
        runs.append([t.clone() for t in (out.G, out.s, out.c, out.n, out.rejected)])
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))  # bit for bit
    check(runs[0], x, mask, row_step)
    want = emu.emulate(x.cpu(), mask.cpu(), row_step, sms)  # the same split: only DMMA's rounding may differ
    G_tol, s_tol = bounds(x, mask, row_step)
    assert (np.abs(runs[0][0].cpu().numpy() - want[0]) <= G_tol).all()
    assert (np.abs(runs[0][1].cpu().numpy() - want[1]) <= s_tol).all()
    assert all((a.cpu().numpy() == b).all() for a, b in zip(runs[0][3:], want[3:]))
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided view: the same partials
    out = gram_cuda.partials_dmma(xt, mask, row_step)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], (out.G, out.s, out.c, out.n, out.rejected)))


@pytest.mark.gpu
def test_gpu_keys_shape_and_cuda_graph():
    """The keys shape [8, 2048, 8, 128] bf16 against the float64 reference, then a CUDA-graph
    replay of the same update (fresh buffers inside the capture) with the same bits."""
    device = _gpu()
    x, mask = adversarial(8, 2048, 8, 128, torch.bfloat16, seed=11)
    x, mask = x.to(device), mask.to(device)
    eager = [t.clone() for t in gram_cuda.partials_dmma(x, mask)]
    check((eager[3], eager[2], eager[1], eager[0], eager[4]), x, mask, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gram_cuda.partials_dmma(x, mask)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))
