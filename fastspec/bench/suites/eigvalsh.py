"""eigvalsh suite: batches of symmetric matrices, fastspec vs torch.linalg and the external anchors.

Inputs are Gram matrices with a power-law spectrum, the shape of real per-head activation
covariances: ``A = XᵀX / m`` with ``X: [B, 2n, n]`` whose columns are scaled by ``k^(−0.75)``,
built in fp64 and rounded to the case's dtype (fp32, or fp64 for the ``-fp64`` sizes).

Baselines: ``torch.linalg.eigvalsh`` always, plus each anchor of :mod:`fastspec.bench.anchors`
that is available here (cuSOLVER ``cusolverDnXsyevBatched``, ``jax.numpy.linalg.eigvalsh``,
``cupy.linalg.eigvalsh``, cuSolverDx's ``cusolverdx::heev``); an unavailable one gets a
``skipped`` row with its reason, and so does one that does not take a size (its ``unfit``:
cuSolverDx's heev past its shared memory, float32 n = 256 on an H100) in that size's cases. On
CPU the CUDA-only anchors (cuSOLVER, CuPy, cuSolverDx) are left out without a row: there is
nothing to explain.

Timing: every solver runs the whole batch, except ``torch.linalg.eigvalsh`` on CUDA for n > 32,
which loops one cuSOLVER ``syevj``/``syevd`` call per matrix (ATen's ``linalg_eigh_cusolver``;
only n <= 32 takes the batched ``syevjBatched``/``XsyevBatched`` path): it is timed on the first
:data:`TORCH_SLICE` matrices and its time multiplied by ``B / slice`` (``Case.baseline_scale``),
which a per-matrix loop makes exact up to launch overhead, and which saves tens of seconds per
timed call at B = 16384 (a millisecond or two per matrix). On CPU it runs the whole batch:
LAPACK is looped per matrix there too, but the CPU tiers' batches are small enough. The anchors
are batched (JAX >= 0.7.2 solves n > 32 with ``XsyevBatched``, eigenvectors included, on
cuSOLVER >= 11.7.1; CuPy uses ``syevjBatched``; cuSolverDx's heev is one launch for the batch),
so slicing them would understate their throughput; the slowest expected, CuPy's Jacobi at
B = 4096, n = 256, is ~2 s per call (the published 57.8 µs/matrix at n = 128 on H100, × n³).

Error: per matrix ``max_i |λ_i − λ_i^ref| / max_i |λ_i^ref|``, then the max over the first
:data:`REF_MATRICES` matrices (all of them when the batch is no larger), for every solver on the
same matrices: the outputs of its timed (full-batch) call, or for the sliced torch baseline a
call on those matrices. The reference, computed once per case setup: for fp32 inputs
``torch.linalg.eigvalsh`` in fp64 of the same rounded matrices on the case's device (cuSOLVER
fp64 on CUDA, LAPACK on CPU); for fp64 inputs LAPACK fp64 through torch on CPU, the same
precision as the input, so the numbers say how far each solver is from LAPACK (on CPU torch's
fp64 path *is* that LAPACK call, and its error is 0). On CUDA the fp64 reference loops per matrix
(~1 ms each): the subset keeps it under a second or two. Claim (:func:`claim`): no worse than
2 × torch's error, plus 8·eps_fp32 (fp32) or n·eps_fp64 (fp64).
Rate: µs per matrix.

The kernel's own build (``compile-n128-fp32``, ``compile-n128-fp64``, variant ``cache-hit``):
the first call's build of the CUDA kernel for one ``(n, dtype)`` with the disk cache warm
(read and verify the cached image; on CUDA also load it into the driver and configure it)
against the same build with an empty cache (NVRTC compiles it, then the same). On CPU there
is no driver: the image is built for sm_90, compile and cache read only. Error: 0 when the
cached image is the compiled one: byte for byte, or (NVRTC 13's float64 output differs from run
to run in the operand order of commutative DFMAs) the same SASS opcodes, counted by cuobjdump
(:func:`fastspec.bench.cubin.same_code`); claim: 0.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile

import torch

from ..anchors import make_anchors
from ..case import (
    EPS64,
    HEADLINE,
    Case,
    Inputs,
    exactly_zero,
    max_rel_err,
    no_worse_than,
)
from ..cubin import same_code

SIZES = {  # (batch, n, dtype)
    "quick": [(16, 32, torch.float32), (4, 64, torch.float32), (8, 32, torch.float64)],
    # cpu: B16-n32 too, where LAPACK takes ~0.3 ms and any fixed cost of fastspec's own (the NaN
    # guard's passes over the batch once cost as much again, and milliseconds on a busy CPU) shows
    "cpu": [(16, 32, torch.float32), (256, 64, torch.float32), (64, 128, torch.float32),
            (16, 256, torch.float32), (64, 128, torch.float64)],
    "gpu": [(4096, 64, torch.float32), (256, 128, torch.float32), (4096, 128, torch.float32),
            (16384, 128, torch.float32), (4096, 256, torch.float32), (256, 128, torch.float64),
            (4096, 128, torch.float64)],
}
HEADLINE_SIZES = {  # tagged ``headline``: the GPU kit's first numbers, and their CPU stand-ins
    # gpu: the README's headline size, and the probe's own keys solve at the 1.5B shape
    # (32 layers × 8 KV heads, float64 by the sv convention: one wave, so latency sets its cost)
    "quick": [(16, 32, torch.float32), (8, 32, torch.float64)],
    "cpu": [(64, 128, torch.float32), (64, 128, torch.float64)],
    "gpu": [(4096, 128, torch.float32), (256, 128, torch.float64)],
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp64"}

TORCH_SLICE = 256     # matrices the per-matrix-looping torch baseline is timed on (CUDA, n > 32)
REF_MATRICES = 512    # matrices the fp64 reference, and so every error, covers
TORCH = "torch.linalg.eigvalsh"
CUDA_ONLY = ("cusolverDnXsyevBatched", "cupy.linalg.eigvalsh", "cusolverdx::heev")
CHECKED = {"cusolverDnXsyevBatched": "check_info", "cusolverdx::heev": "check_status"}
"""Anchors that read their per-matrix result codes back (a device sync) unless told not to: the
keyword that tells them, False in the timed calls (:func:`_anchor_call`)."""


def torch_slice(batch: int, n: int, device: torch.device) -> int:
    """How many of ``batch`` matrices ``torch.linalg.eigvalsh`` is timed on (module docstring)."""
    if torch.device(device).type == "cuda" and n > 32:
        return min(batch, TORCH_SLICE)
    return batch


def ref_count(batch: int) -> int:
    """How many leading matrices the reference and the errors cover."""
    return min(batch, REF_MATRICES)


def powerlaw_gram(batch: int, n: int, device: torch.device, dtype=torch.float32,
                  alpha: float = 0.75, seed: int = 0) -> torch.Tensor:
    """``[batch, n, n]`` PSD matrices ``XᵀX/m`` with a power-law spectrum, built in fp64.

    The random numbers come from a CPU generator (the same matrices on every device); the
    products run on ``device``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    scale = (torch.arange(1, n + 1, dtype=torch.float64) ** -alpha).to(device)
    A = torch.empty(batch, n, n, dtype=dtype, device=device)
    step = max(1, (1 << 26) // (2 * n * n))  # keep the fp64 scratch around 512 MiB
    for i in range(0, batch, step):
        X = torch.randn(min(step, batch - i), 2 * n, n, generator=g, dtype=torch.float64).to(device) * scale
        A[i:i + len(X)] = (X.mT @ X / (2 * n)).to(dtype)
    return A


def reference(A: torch.Tensor) -> torch.Tensor:
    """fp64 eigenvalues ``[b, n]`` of ``A: [b, n, n]`` on ``A``'s device (module docstring)."""
    if A.dtype == torch.float64:
        return torch.linalg.eigvalsh(A.cpu()).to(A.device)
    return torch.linalg.eigvalsh(A.double())


def error_kind(batch: int, dtype: torch.dtype) -> str:
    kind = "max rel err vs LAPACK fp64 (same precision)" if dtype == torch.float64 else "max rel err vs fp64"
    count = ref_count(batch)
    return kind if count == batch else f"{kind}, first {count} of {batch} matrices"


def claim(n: int, dtype: torch.dtype):
    """No worse than 2 × torch in the same precision, plus a floor: 8·eps_fp32 for fp32, and for
    fp64 the classical backward-stability bound n·eps_fp64 (as tests/test_eig_host.py): against
    LAPACK fp64, which on CPU *is* torch (error 0), an fp32 floor would make the claim vacuous."""
    if dtype == torch.float64:
        return no_worse_than(floor=n * EPS64, floor_text=f"n·eps_fp64 (n = {n})")
    return no_worse_than()


def _variants(device: torch.device) -> list[tuple[str, str | None]]:
    """``auto`` plus every other available solver that can run on ``device`` (name, skip)."""
    import fastspec

    out: list[tuple[str, str | None]] = [("auto", None)]
    for name, info in fastspec.solvers().items():
        if name in ("auto", "torch"):  # torch is the baseline itself
            continue
        if not info.get("available"):
            out.append((name, f"eigvalsh backend {name!r} unavailable: {info.get('reason')}"))
        elif name == "cuda" and device.type != "cuda":
            out.append((name, "the 'cuda' solver needs a CUDA device"))
        elif name == "cuda":  # timing it twice would only halve what fits in a GPU run's time cap
            out.append((name, "on CUDA 'auto' is this solver for n <= 256: timed as 'auto'"))
        elif name == "host" and device.type == "cuda":
            out.append((name, "the 'host' solver is timed on CPU tensors (cpu tiers)"))
        else:
            out.append((name, None))
    return out


def _anchor_call(name: str, fn):
    """The timed call: the ctypes cuSOLVER wrapper skips its ``info`` read-back (a device sync)
    there, cuSolverDx's heev its status read-back (:data:`CHECKED`); the accuracy check calls
    ``fn`` directly, which reads them and raises on a failure."""
    if name in CHECKED:
        unchecked = {CHECKED[name]: False}
        return lambda inp: fn(inp["A"], **unchecked)
    return lambda inp: fn(inp["A"])


def _unfit(fn, n: int, dtype: torch.dtype) -> str:
    """Why anchor ``fn`` does not take ``n x n`` ``dtype`` matrices ("" when it does): its own
    ``unfit`` where it has one (:mod:`fastspec.bench.anchors`), else every size is taken."""
    unfit = getattr(fn, "unfit", None)
    return unfit(n, dtype) if unfit is not None else ""


def eigvalsh_cases(tier: str, device: torch.device) -> list[Case]:
    """Every (size, fastspec variant) of ``tier`` on ``device``; inputs ``A: [B, n, n]``, outputs
    ``[B, n]``; baselines, slices and errors as in the module docstring."""
    import fastspec

    anchors = make_anchors(device)
    available = {name: fn for name, fn in anchors.items() if not isinstance(fn, str)}
    notes = {name: why for name, why in anchors.items()
             if isinstance(why, str) and not (device.type != "cuda" and name in CUDA_ONLY)}

    out = compile_cases(tier, device)
    for batch, n, dtype in SIZES[tier]:
        sliced = torch_slice(batch, n, device)
        refs = ref_count(batch)
        # an anchor that does not take this size is a skipped row of its cases, not an error
        # raised in their accuracy check, which would take fastspec's and every baseline's rows down
        unfit = {name: _unfit(fn, n, dtype) for name, fn in available.items()}
        here = {name: fn for name, fn in available.items() if not unfit[name]}
        size_notes = {**notes, **{name: why for name, why in unfit.items() if why}}
        baselines = {TORCH: lambda inp: torch.linalg.eigvalsh(inp["A_torch"])}
        baselines.update({name: _anchor_call(name, fn) for name, fn in here.items()})
        scale = {TORCH: batch / sliced} if sliced < batch else {}

        def setup(batch=batch, n=n, dtype=dtype, sliced=sliced, refs=refs) -> Inputs:
            A = powerlaw_gram(batch, n, device, dtype)
            # leading slices of a contiguous batch are contiguous views: no copy, and nothing
            # left to do inside the timed call
            return {"A": A, "A_torch": A[:sliced], "A_ref": A[:refs], "ref": reference(A[:refs])}

        for variant, skip in _variants(device):
            def run(inp: Inputs, variant=variant) -> torch.Tensor:
                return fastspec.eigvalsh(inp["A"], solver=variant)

            def check(inp: Inputs, run=run, refs=refs, whole=sliced == batch, here=here) -> dict:
                ref = inp["ref"]
                # torch timed on a slice: solve the reference matrices themselves (it loops per
                # matrix, so that is what its timed call does to each of them)
                torch_out = torch.linalg.eigvalsh(inp["A"] if whole else inp["A_ref"])[:refs]
                errs = {"fastspec_error": max_rel_err(run(inp)[:refs], ref),
                        f"{TORCH}_error": max_rel_err(torch_out, ref)}
                for name, fn in here.items():
                    errs[f"{name}_error"] = max_rel_err(fn(inp["A"])[:refs], ref)
                errs["baseline_error"] = errs[f"{TORCH}_error"]
                return errs

            out.append(Case(
                suite="eigvalsh", size=f"B{batch}-n{n}-{DTYPE_NAMES[dtype]}", variant=variant,
                setup=setup, fastspec=run, baselines=dict(baselines), check=check,
                error_kind=error_kind(batch, dtype), claim=claim(n, dtype),
                rate=("µs/matrix", lambda s, batch=batch: s / batch * 1e6),
                skip=skip, notes=dict(size_notes), baseline_scale=dict(scale),
                tags=frozenset({HEADLINE}) if (batch, n, dtype) in HEADLINE_SIZES[tier] else frozenset()))
    return out


COMPILE_SIZES = {"quick": [(32, torch.float32)], "cpu": [(128, torch.float32), (128, torch.float64)],
                 "gpu": [(128, torch.float32), (128, torch.float64)]}


@contextlib.contextmanager
def _cache_at(folder: str):
    old = os.environ.get("FASTSPEC_CACHE")
    os.environ["FASTSPEC_CACHE"] = folder
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FASTSPEC_CACHE", None)
        else:
            os.environ["FASTSPEC_CACHE"] = old


def compile_cases(tier: str, device: torch.device) -> list[Case]:
    """The CUDA kernel's first-call build, cache warm vs cold (module docstring)."""
    from fastspec.eig import cuda, nvrtc

    why = nvrtc.missing()
    skip = f"the CUDA kernel cannot be compiled here: {why}" if why else None
    out = []
    for n, dtype in COMPILE_SIZES[tier]:
        name = str(dtype).removeprefix("torch.")

        def build(folder: str, n=n, name=name) -> bytes:
            """One first-call build with the cache in ``folder``; the image's bytes."""
            nvrtc.forget()
            cuda.forget()
            with _cache_at(folder):
                if device.type == "cuda":
                    index = cuda.device_index(device)
                    cuda.prepare(n, name, index)
                    spec = cuda.DeviceSpec.of_device(index)
                    target = nvrtc.choose_target(spec.cc)
                else:
                    spec, target = cuda.DeviceSpec.for_arch(90), nvrtc.Target(90)
                return nvrtc.compile_variant(cuda.variant_for(n, name, spec), target).data

        def setup(build=build) -> Inputs:
            root = tempfile.mkdtemp(prefix="fastspec-compile-bench-")
            warm = os.path.join(root, "warm")
            build(warm)  # the cached side's image, compiled once
            return {"root": root, "warm": warm, "cold": itertools.count()}

        def cold(inp: Inputs, build=build) -> bytes:
            return build(os.path.join(inp["root"], f"cold-{next(inp['cold'])}"))  # a new, empty cache each call

        def check(inp: Inputs, build=build, cold=cold) -> dict:
            return {"fastspec_error": 0.0 if same_code(build(inp["warm"]), cold(inp)) else 1.0,
                    "baseline_error": 0.0}

        def teardown(inp: Inputs) -> None:
            nvrtc.forget()
            shutil.rmtree(inp["root"], ignore_errors=True)

        out.append(Case(
            suite="eigvalsh", size=f"compile-n{n}-{DTYPE_NAMES[dtype]}", variant="cache-hit", setup=setup,
            fastspec=lambda inp, build=build: build(inp["warm"]), baselines={"nvrtc compile (empty cache)": cold},
            check=check, error_kind="cached image differs from a fresh compile (0: same code)",
            claim=exactly_zero(),
            skip=skip, teardown=teardown))
    return out
