"""First-use self-checks: no unchecked GPU kernel serves a user's numbers.

Several kernels a GPU user gets by default were written and tested without a GPU (the exact
covariance routes, the Triton launch settings a race may pick, the eigensolver's candidate
algorithms, cuSolverDx's ``heev``), and none has run on most GPU generations. So the first time
a process uses a kernel *configuration* on a CUDA device, it runs one small adversarial case
through that configuration, compares the answer with a float64 reference under the accuracy the
docs claim for it, and only then lets it serve:

=============================  =====================================================  ==========
configuration                  the case                                               the claim
=============================  =====================================================  ==========
exact route × dtype × D        ``[2, 37, 3, D]`` rows seen through a transpose, a     counts exact, G exactly
(``routes.py``: dmma,          mean 100 times the spread, a NaN and an ±Inf row,      symmetric, G and s within
triton_f64, prep_gemm)         masked rows (one holding a NaN), then a contiguous     the float64 summation
                               ``[2, 32, 3, D]`` copy (one site past D = 512);        bound (N+2)·u₆₄·Σ|xᵢ||xⱼ|
                               ``partials`` and ``accumulate`` both
float32 Triton update ×        the same rows                                          counts exact; M2 and the
candidate × dtype × convention                                                         mean within 4× torch
× D (``triton_update.py``)                                                             float32's own error
eigensolver algorithm × n ×    6 matrices ``Q diag(λ) Qᵀ`` of known spectra:          2 × torch's own error on
dtype (``eig/cuda.py``, heev   clustered, rank-deficient, graded, ±, a scaled one,    the same matrices +
included)                      and one holding a NaN (all-NaN answer)                 8·eps·‖A‖₂ (csrc/README.md)
=============================  =====================================================  ==========

A configuration that fails: one :class:`SelfCheckWarning` naming the kernel, the configuration,
the device and the error; it is not used again in this process, and the next candidate serves
(the next exact route, the next Triton candidate, the block algorithm), ending at the reference
(``blocked.py``, ``torch.linalg.eigvalsh``). A check never runs while dynamo traces or while a
CUDA graph is captured (a host sync there is an error, and a captured launch would bake the case
into the graph): that use goes unchecked, and is checked at the configuration's next eager use.
:meth:`fastspec.Probe.attach` and ``fastspec.Covariance(device=...)`` run the checks their sites
will need up front for that reason, and ``fastspec info --check`` runs every configuration for
the visible GPU and prints a table (both in :mod:`fastspec.preflight`).

``FASTSPEC_SELF_CHECK=0`` turns them off. What they cost is one small case per configuration per
process, its references computed by torch on the kernel's device. Measured on a 2-core CPU with
the kernels stood in (``benchmarks/selfcheck_cost.py``: the cases, references and comparisons,
all of a check but the kernel's launch): 3-6 ms per covariance configuration up to D = 128,
2-10 ms per eigensolver configuration up to n = 128 (44 ms at 256), 1.6 s for an FFN width of
4096 (its float64 reference is 74 rows x 4096²). PREDICTED on an H100 (not measured yet): about
1-3 ms each (launches, a host sync, small device-side references; ~10 ms at D = 4096), plus a
compile of the case's own specialization where Triton specializes on the shapes (~1 s, once per
machine: Triton caches it on disk).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ENV", "Check", "SelfCheckWarning", "enabled", "forget", "results", "run"]

ENV = "FASTSPEC_SELF_CHECK"
"""Environment variable: ``0`` (or ``false``/``no``/``off``) turns the self-checks off."""

log = logging.getLogger("fastspec")


class SelfCheckWarning(RuntimeWarning):
    """A GPU kernel configuration failed its first-use self-check and is not used in this process."""


@dataclass(frozen=True)
class Check:
    """One configuration's self-check in this process."""

    kernel: str       # e.g. "exact route dmma", "Triton update", "eigensolver newton"
    config: str       # e.g. "bfloat16 D=128"
    device: str       # e.g. "cuda:0 (NVIDIA H100 80GB HBM3, sm_90)"
    ok: bool
    error: str        # "" when ok
    seconds: float    # the check's wall time


_results: dict[tuple, Check] = {}
_lock = threading.RLock()


def enabled() -> bool:
    """Whether first-use self-checks run (``$FASTSPEC_SELF_CHECK`` not ``0``/``false``/``no``/``off``)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def can_run_now(device: torch.device) -> bool:
    """False while dynamo traces, or while a CUDA graph is being captured on ``device``."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3, sm_90)``; the device itself where it is not a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda:{index} ({torch.cuda.get_device_name(index)}, sm_{major}{minor})"


def run(key: tuple, kernel: str, config: str, device: torch.device, case: Callable[[], str],
        fallback: str) -> bool | None:
    """The verdict on configuration ``key`` (a hashable naming the kernel and its settings, the
    device included): True where it may serve (its check passed, or checks are off), False where
    it failed (warned once, here, saying that ``fallback`` serves instead), None where its check
    cannot run now (:func:`can_run_now`): then it serves unchecked, and the caller asks again at
    its next use. ``case()`` runs the check: "" on a pass, else what was wrong; an exception it
    raises is a failure too (a kernel that crashes on the case must not serve either), except a
    build failure (:func:`is_build_failure`), which propagates, unrecorded, for the caller's own
    rule (the route or kernel is then disabled on the device)."""
    if not enabled():
        return True
    got = _results.get(key)
    if got is not None:
        return got.ok
    if not can_run_now(device):
        return None
    with _lock:
        got = _results.get(key)
        if got is not None:
            return got.ok
        start = time.perf_counter()
        try:
            error = case()
        except Exception as exc:  # any failure of the case fails the configuration
            if is_build_failure(exc):
                raise
            error = f"{type(exc).__name__}: {exc}".strip()
        got = _results[key] = Check(kernel, config, describe_device(device), not error, error,
                                    time.perf_counter() - start)
    if not got.ok:
        warnings.warn(f"fastspec self-check: {kernel} [{config}] on {got.device} gave a wrong answer: {error}; "
                      f"it is not used again in this process, {fallback} serves instead",
                      SelfCheckWarning, stacklevel=2)
    return got.ok


def applies(device: torch.device) -> bool:
    """Whether kernels on ``device`` are checked: CUDA devices (tests add the CPU, where the
    stand-in driver and the Triton interpreter run the kernels, through :data:`DEVICE_TYPES`)."""
    return device.type in DEVICE_TYPES


DEVICE_TYPES = ("cuda",)


def is_build_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a kernel could not be built or loaded (NVRTC, the driver, Triton's
    compiler or its resource check), not that it computed something: that disables the kernel on
    its device, which is not a self-check's verdict."""
    from .eig.nvrtc import KernelUnavailable, ShapeUnsupported

    if isinstance(exc, ShapeUnsupported):
        return False
    return isinstance(exc, KernelUnavailable) or type(exc).__module__.split(".")[0] == "triton"


def results() -> list[Check]:
    """Every self-check this process ran, in order."""
    return list(_results.values())


def forget() -> None:
    """Drop every verdict (tests): the next use of each configuration is checked again."""
    _results.clear()


# --- the cases ---------------------------------------------------------------------------------


def rows(D: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """The covariance cases: ``[(x, mask), ...]`` with ``x: [B, T, S, D]`` of ``dtype`` on
    ``device``. A strided view (``[B, S, T, D]`` memory seen as ``[B, T, S, D]``), T = 37 (no
    tile's multiple), a mean 100 times the spread, a NaN in one row of one site and an ±Inf in
    another, masked rows at the end (padding) and one masked row holding a NaN (neither counted
    nor rejected); then a contiguous ``T = 32`` copy of the first rows (the aligned
    specialization)."""
    g = torch.Generator().manual_seed(seed)
    B, T, S = 2, 37, 3 if D <= 512 else 1  # a wide D (FFN inputs) in one site: its CPU reference costs D²
    base = torch.randn(B, S, T, D, generator=g) + 100.0
    base[1, S // 2, 5, D // 2] = float("nan")
    base[0, S - 1, 9, 0] = float("inf")
    base[1, 0, 20, D - 1] = float("-inf")
    base[0, 0, 0, 1] = float("nan")   # in a masked-out row
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -3:] = False               # padding
    mask[0, 0] = False
    x = base.to(dtype).to(device).transpose(1, 2)  # [B, T, S, D], strided
    m = mask.to(device)
    return [(x, m), (x[:, :32].contiguous(), m[:, :32].contiguous())]


def _bound(x: Tensor, mask: Tensor, center: Tensor | None, u: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid [N, S], Σ|x−c|ᵢ|x−c|ⱼ [S, D, D], Σ|x−c| [S, D])`` in float64 on x's device, scaled
    by ``(N + 2)·u`` (recursive summation of N terms, a product's own rounding included)."""
    B, T, S, D = x.shape
    r = x.detach().to(torch.float64).reshape(B * T, S, D)
    valid = mask.to(x.device).reshape(-1, 1) & torch.isfinite(r).all(-1)
    a = torch.where(valid[..., None], r - (0 if center is None else center), 0).abs()
    scale = (B * T + 2) * u
    return valid, scale * torch.einsum("nsi,nsj->sij", a, a), scale * a.sum(0)


def _first_bad(what: str, got: Tensor, want: Tensor, tol: Tensor) -> str:
    """"" when ``|got − want| <= tol`` everywhere (NaN fails), else where and by how much."""
    err = (got.to(torch.float64) - want).abs()
    bad = ~(err <= tol)
    if not bad.any():
        return ""
    i = tuple(int(v) for v in bad.nonzero()[0])
    return f"{what}{list(i)} = {float(got[i]):.17g}, float64 reference {float(want[i]):.17g} " \
           f"(error {float(err[i]):.3g} > bound {float(tol[i]):.3g})"


def compare_raw(out, x: Tensor, mask: Tensor) -> str:
    """An exact raw-sum update ``out = CovPartials`` (about 0) of ``(x, mask)`` against the float64
    reference (torch, on x's device): "" or what is wrong (exact routes: float64 products, float64
    sums)."""
    from .covariance.reference import covariance_partials_reference

    ref = covariance_partials_reference(x.detach().to(torch.float64), mask.to(x.device), 1, center=False)
    n, rejected = out.n, out.rejected
    if not (torch.equal(n, ref.n) and torch.equal(rejected, ref.rejected)):
        return f"counts n = {n.tolist()}, rejected = {rejected.tolist()}; float64 reference {ref.n.tolist()}, " \
               f"{ref.rejected.tolist()}"
    G = out.G.to(torch.float64)
    if not torch.equal(G, G.mT):
        return "G is not exactly symmetric"
    if bool((out.c != 0).any()):
        return "raw sums must be about 0, got a non-zero center"
    _, G_tol, s_tol = _bound(x, mask, None, 2.0**-53)
    return _first_bad("G", G, ref.G, G_tol) or _first_bad("s", out.s, ref.s, s_tol)


def compare_fast(out, x: Tensor, mask: Tensor, center: bool) -> str:
    """A float32 update ``out = CovPartials`` about its shift ``c`` (``center``; else about 0)
    against float64: counts exact,
    G exactly symmetric, and per site the centred ``M2 = G − s sᵀ/n`` and the mean ``c + s/n``
    within 4× the relative (Frobenius) error torch float32 makes on the same rows (the fast
    path's claim, as the tests and the race hold it), plus ``(N+2)·u₃₂`` where torch happens to be
    exact. torch's own error is that of the same convention: about the mean, or raw sums."""
    from .covariance.reference import covariance_partials_reference

    xc, mc = x.detach(), mask.to(x.device)  # the references on x's device (torch's float64 there)
    ref = covariance_partials_reference(xc.double(), mc, 1, center=True)
    own = covariance_partials_reference(xc.float() if x.dtype != torch.float64 else xc, mc, 1, center=center)
    n, rejected = out.n, out.rejected
    if not (torch.equal(n, ref.n) and torch.equal(rejected, ref.rejected)):
        return f"counts n = {n.tolist()}, rejected = {rejected.tolist()}; float64 reference {ref.n.tolist()}, " \
               f"{ref.rejected.tolist()}"
    if not torch.equal(out.G, out.G.mT):
        return "G is not exactly symmetric"

    def moments(p) -> tuple[Tensor, Tensor]:
        c, s, G = (t.to(torch.float64) for t in (p.c, p.s, p.G))
        nn = p.n.double().clamp_min(1)[:, None]
        return c + s / nn, G - s[:, :, None] * s[:, None, :] / nn[..., None]

    def rel(a: Tensor, b: Tensor, dims: tuple[int, ...]) -> Tensor:
        return (a - b).square().sum(dims).sqrt() / b.square().sum(dims).sqrt().clamp_min(1e-300)

    (mean, m2), (mean_t, m2_t) = moments(out), moments(own)
    floor = (x.shape[0] * x.shape[1] + 2) * 2.0**-24
    for what, got, torch_err in (("M2", rel(m2, ref.G, (1, 2)), rel(m2_t, ref.G, (1, 2))),
                                 ("mean", rel(mean, ref.c, (1,)), rel(mean_t, ref.c, (1,)))):
        bound = 4 * torch_err + floor
        bad = ~(got <= bound)
        if bad.any():
            s = int(bad.nonzero()[0, 0])
            return (f"site {s}: relative error of the {what} {float(got[s]):.3g} > bound {float(bound[s]):.3g} "
                    f"(4 x torch float32's {float(torch_err[s]):.3g} + {floor:.2g})")
    return ""


def spectra(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The eigensolver's cases: ``(A [6, n, n] float64, λ [6, n] ascending)``, ``A = Q diag(λ) Qᵀ``
    with ``Q`` a fixed random orthogonal matrix: clustered (1 ± 1e-7), rank-deficient (half
    zeros), graded (1 ... 1e-12), both signs, scaled by 2^40, and one holding a NaN (its λ: NaN)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    i = torch.arange(n, dtype=torch.float64)
    lams = [1 + 1e-7 * torch.randn(n, generator=g, dtype=torch.float64),
            torch.where(i < n // 2, 0.0, 1 + i),
            10.0 ** (-12 * i / max(n - 1, 1)),
            torch.linspace(-1, 1, n, dtype=torch.float64) ** 3,
            2.0**40 * torch.rand(n, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64)]
    lam = torch.stack(lams).sort(-1).values
    A = Q @ torch.diag_embed(lam) @ Q.T
    A = (A + A.mT) / 2
    A[-1, n - 1, 0] = float("nan")
    lam[-1] = float("nan")
    return A, lam


def compare_eigenvalues(got: Tensor, A: Tensor, dtype: torch.dtype) -> str:
    """Eigenvalues ``got [B, n]`` of ``A [B, n, n]`` (as rounded to ``dtype``) against float64:
    ``max|λ − λ₆₄| <= 2 × torch's own error in dtype + 8·eps·‖A‖₂`` per matrix (the claim of
    csrc/README.md); a matrix holding a NaN must give n NaNs."""
    Ad = A.to(dtype)
    bad = ~torch.isfinite(Ad).all(-1).all(-1)
    ref = torch.linalg.eigvalsh(torch.where(bad[:, None, None], 0, Ad.double()))
    own = torch.linalg.eigvalsh(torch.where(bad[:, None, None], 0, Ad)).double()
    got = got.to("cpu", torch.float64)
    for b in range(A.shape[0]):
        if bad[b]:
            if not got[b].isnan().all():
                return f"matrix {b} holds a NaN: expected n NaNs, got {got[b, :4].tolist()}..."
            continue
        norm = float(ref[b].abs().max())
        tol = 2 * float((own[b] - ref[b]).abs().max()) + 8 * torch.finfo(dtype).eps * norm
        err = float((got[b] - ref[b]).abs().max()) if torch.isfinite(got[b]).all() else math.inf
        if not err <= tol:
            return f"matrix {b}: max |λ − λ64| = {err:.3g} > bound {tol:.3g} (‖A‖₂ = {norm:.3g})"
    return ""
