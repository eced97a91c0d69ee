"""CUDA batched eigensolver (csrc/eig_kernel.cu, ``solver="cuda"``, compiled at first
use by NVRTC): same battery and criterion as the host twin (tests/test_eig_host.py), against
torch.linalg.eigvalsh's fp32 *CUDA* error, plus the kernel-only concerns: shared-memory vs
global-workspace paths, streams, CUDA graphs, large batches, the kernel cache. All tests need a
GPU (marked ``gpu``; skipped on CPU CI). No timing is asserted here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastspec
from fastspec.eig.matrices import FAMILIES, make_batch

pytestmark = pytest.mark.gpu

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)


def cuda(A: torch.Tensor) -> torch.Tensor:
    return fastspec.eigvalsh(A, solver="cuda")


def reference(A: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.linalg.eigvalsh(A.double().cpu().numpy()))


def assert_within_torch_error(A32: torch.Tensor, ours: torch.Tensor) -> None:
    # criterion and floor justified in tests/test_eig_host.py
    ref = reference(A32)
    torch_err = (torch.linalg.eigvalsh(A32).double().cpu() - ref).abs().max().item()
    our_err = (ours.double().cpu() - ref).abs().max().item()
    floor = 8 * EPS32 * ref.abs().max().item()
    assert our_err <= 2 * torch_err + floor, f"error {our_err:.3g} > 2 x torch {torch_err:.3g} + {floor:.3g}"


def test_cuda_solver_available():
    assert fastspec.solvers()["cuda"]["available"], fastspec.solvers()["cuda"]["reason"]


@pytest.mark.parametrize("n", [2, 8, 17, 32, 64, 100, 128, 200, 240, 256], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_battery(family, n):
    A = torch.from_numpy(make_batch(family, n, 16)).float().cuda()
    ours = cuda(A)
    assert ours.shape == (16, n) and ours.dtype == torch.float32 and ours.is_cuda
    assert torch.isfinite(ours).all() and (ours.diff(dim=-1) >= 0).all()
    assert_within_torch_error(A, ours)


@pytest.mark.parametrize("n", [64, 128, 170, 256])  # fp64 n > 168 takes the global-workspace path
def test_fp64(n):
    A = torch.from_numpy(make_batch("indefinite", n, 8)).cuda()
    ref = reference(A)
    assert (cuda(A).cpu() - ref).abs().max() <= n * EPS64 * ref.abs().max()


@pytest.mark.parametrize("n", [17, 128, 256])
def test_matches_host_twin(n):
    # same numerics, different summation order (block reductions): agree to rounding level
    A = torch.from_numpy(make_batch("spd", n, 8)).float()
    torch.testing.assert_close(cuda(A.cuda()).cpu(), fastspec.eigvalsh(A, solver="host"),
                               atol=16 * EPS32 * n**0.5, rtol=0)


def test_large_batch_4096x128():
    A = torch.from_numpy(make_batch("gram-activations", 128, 64)).float().cuda().repeat(64, 1, 1)
    out = cuda(A)
    assert out.shape == (4096, 128)
    assert torch.equal(out, out[:64].repeat(64, 1))  # every block computes the same as its twin
    assert_within_torch_error(A[:64], out[:64])


def test_nonfinite_matrix_gives_nan_and_spares_neighbours():
    A = torch.from_numpy(make_batch("spd", 128, 4)).float().cuda()
    solo = cuda(A)
    A[1, 100, 3] = float("nan")
    A[2, 127, 127] = float("inf")
    out = cuda(A)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.equal(out[0], solo[0]) and torch.equal(out[3], solo[3])


def test_strides_batch_dims_and_empty():
    A = torch.from_numpy(make_batch("indefinite", 64, 8)).float().cuda()
    for view in (A.mT, A[:, ::2, ::2], A[::2], A[:1].expand(5, -1, -1), A.reshape(2, 4, 64, 64)):
        assert torch.equal(cuda(view), cuda(view.contiguous()))
    assert cuda(A[:0]).shape == (0, 64)


def test_runs_on_the_current_stream():
    A = torch.from_numpy(make_batch("spd", 128, 256)).float().cuda()
    expected = cuda(A)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = cuda(A)
    s.synchronize()
    assert torch.equal(out, expected)


def test_auto_picks_cuda_and_compiles():
    A = torch.from_numpy(make_batch("spd", 128, 32)).float().cuda()
    assert torch.equal(fastspec.eigvalsh(A), cuda(A))
    compiled = torch.compile(lambda x: fastspec.eigvalsh(x).sum(-1), fullgraph=True)
    torch.testing.assert_close(compiled(A), cuda(A).sum(-1))


def test_side_stream_and_cuda_graph():
    """Launched on the current stream (no host sync), so it orders with torch's work on a side
    stream and is captured by a CUDA graph once the first call has compiled and loaded it."""
    A = torch.from_numpy(make_batch("spd", 128, 64)).float().cuda()
    want = cuda(A)  # compile + load outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        B = A * 2  # on the side stream: the solve must see it finished
        got = cuda(B)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, 2 * want, rtol=1e-5, atol=1e-5)
    static = A.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda(static)
    static.copy_(A * 3)
    g.replay()
    torch.testing.assert_close(out, 3 * want, rtol=1e-5, atol=1e-5)


def test_kernel_cache_holds_the_variants_used(tmp_path, monkeypatch):
    from fastspec.eig import cuda as eig_cuda
    from fastspec.eig import nvrtc

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    nvrtc.forget()
    monkeypatch.setattr(eig_cuda, "_loaded", {})
    monkeypatch.setattr(eig_cuda, "_plans", {})  # an earlier test's plan of this size would skip the load
    A = torch.from_numpy(make_batch("spd", 96, 4)).cuda()
    cuda(A)
    (f,) = (tmp_path / "eig").iterdir()
    assert f.name.startswith("eigvalsh-float64-n96-smem-") and nvrtc._unframe(f.read_bytes())


# ------------------------------------------------------ every algorithm of the kernel (variants.py)
def _algorithm_cases() -> list:
    from fastspec.eig.variants import ALGORITHMS

    out = []
    for name, a in ALGORITHMS.items():
        for dtype in a.dtypes:
            for n in sorted({2, 17, 33, 100, min(a.max_n, 128), min(a.max_n, 256)}):
                if n <= a.max_n:
                    out.append(pytest.param(name, dtype, n, id=f"{name}-{dtype}-n{n}"))
    return out


@pytest.mark.parametrize("algo, dtype, n", _algorithm_cases())
def test_every_algorithm_on_the_battery(algo, dtype, n):
    """Each algorithm forced (as the race forces it), on every family: the kernel's criterion
    (float32: 2 x torch's CUDA float32 error + floor; float64: n·eps64·‖A‖ against LAPACK), NaN
    rows sparing their neighbours, ascending output. An algorithm whose shared memory does not
    fit this GPU is skipped (the launcher would not choose it)."""
    from fastspec.eig import cuda as kernel

    spec = kernel.DeviceSpec.of_device(torch.cuda.current_device())
    try:
        kernel.variant_for(n, dtype, spec, algo)
    except ValueError as exc:
        pytest.skip(str(exc))
    for family in sorted(FAMILIES):
        A = torch.from_numpy(make_batch(family, n, 6)).to(getattr(torch, dtype)).cuda()
        A[3, n - 1, 0] = float("nan")
        out = torch.empty(A.shape[:2], dtype=A.dtype, device=A.device)
        kernel.launch(A, out, algo=algo)
        assert torch.isnan(out[3]).all(), family
        ok = torch.cat([out[:3], out[4:]])
        A_ok = torch.cat([A[:3], A[4:]])
        assert torch.isfinite(ok).all() and (ok.diff(dim=-1) >= 0).all(), family
        if dtype == "float32":
            assert_within_torch_error(A_ok, ok)
        else:
            ref = reference(A_ok)
            assert (ok.cpu() - ref).abs().max() <= n * EPS64 * ref.abs().max(), family


@pytest.mark.parametrize("algo", ["block", "packed", "regs", "split", "newton"])
def test_profiling_build_marks_what_the_emulation_marks(algo):
    """The profiling build (fastspec/eig/profile.py) on the GPU: the same results as the normal
    kernel, and member 0's record of each block is exactly the team emulation's phase sequence,
    with cycles that add up to the block's total and a plausible clock."""
    from fastspec.eig import cuda as eig_cuda
    from fastspec.eig import profile

    A = torch.from_numpy(make_batch("indefinite", 40, 6)).float()
    out, record, _ = profile.run_profiled(A.cuda(), algo)
    normal = torch.empty(6, 40, device="cuda")
    eig_cuda.launch(A.cuda(), normal, algo=algo)
    torch.cuda.synchronize()
    assert torch.equal(out, normal)  # the stamps change no arithmetic
    rec = record.cpu().numpy()
    for b, row in enumerate(rec[:6]):
        want = profile.team_phases(A[b], algo)  # split's sweep count (a barrier each) depends on the matrix
        words = row.view(np.uint64)
        marks = int(words[0] & np.uint64(0xFFFFFFFF))
        ids = (words[profile.HEAD:profile.HEAD + marks] >> np.uint64(profile.CLOCK_BITS)).tolist()
        assert ids == want, (algo, b)
    s = profile.summarize(profile.decode(rec))
    assert s.blocks == 6 and not s.truncated and 0.5 < s.ghz < 3.5
