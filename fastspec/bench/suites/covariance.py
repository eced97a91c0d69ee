"""covariance suite: streaming per-site accumulation, fastspec vs the plain-torch path.

* ``keys``: bf16 keys in the Hugging Face layout ``[B, H, T, D]`` (8 KV heads of 128 on GPU),
  accumulated per head as the raw Gram ``G = KᵀK`` (the ``sv`` convention of
  docs/conventions.md). fastspec reads the ``[B, T, H, D]`` transpose view without a copy; the
  baseline is what one writes by hand: ``(k.float().mT @ k.float()).sum(0)``.
* ``ffn``: bf16 FFN activations ``[N, D]`` (16384 × 8192 on GPU), centered unbiased covariance
  (the ``eig`` convention); baseline ``torch.cov(x.float().T)``.

Variants: ``auto`` is a streaming update into a live accumulator as the probe runs it (its real
per-step cost, the float64 merge included; keys take float64 products on CPU and on
full-rate-float64 GPUs such as the H100, by the precision policy of docs/accumulators.md);
``triton`` the float32 Triton update, whole; ``triton-kernel`` the Triton partials launch alone,
no merge (what Nsight Compute profiles). Error: ``max|M − M^fp64| / max|M^fp64|`` per site, max
over sites, where ``M^fp64`` is computed in float64 from the same bf16 values; claim: no worse
than 2 × the torch baseline's (:func:`~fastspec.bench.case.no_worse_than`). Rate: GB/s of
input read. On CUDA every side is timed on the ``device`` clock of :mod:`fastspec.bench.timing`
(the host's launch time hidden behind a spin kernel, and reported beside it as ``*_host_s``):
one keys update is host-bound on its own, but in a training step its launches overlap the
layers' kernels. Beside the torch baseline every case times a device-to-device copy of the same
bytes (:data:`COPY`), so each row can say what share of the bandwidth measured in the same run
it reaches. The keys cases are tagged ``headline``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from ..case import HEADLINE, Case, Inputs, max_rel_err, no_worse_than

KEY_SIZES = {"quick": [(1, 2, 64, 16)], "cpu": [(2, 8, 512, 128)], "gpu": [(8, 8, 2048, 128)]}
FFN_SIZES = {"quick": [(256, 64)], "cpu": [(4096, 1024)], "gpu": [(16384, 8192)]}


COPY = "copy (same bytes, device to device)"
"""A baseline beside every case: ``dst.copy_(x)`` of the input's bytes, the bandwidth yardstick
measured in the same run. Its rows add ``copy_GBps`` (read + write: 2 × the input's bytes per
second) and ``pct_of_copy_bandwidth`` = fastspec's input GB/s ÷ ``copy_GBps`` × 100 (a kernel
that only reads its input at the copy's rate scores 100)."""
KERNEL = "triton-kernel"


def _triton_skip(device: torch.device) -> str | None:
    """Why the Triton variants cannot run here (None: they can)."""
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton on CPU runs only under TRITON_INTERPRET=1"
    import fastspec

    try:
        fastspec.Covariance(4, backend="triton").update(torch.randn(8, 4))
    except (ImportError, RuntimeError) as e:
        return f"backend='triton' unavailable: {e}"
    return None


def _variants(device: torch.device, track_mean: bool) -> list[tuple[str, str | None, torch.dtype]]:
    """(variant, skip, dtype): ``auto`` (what the probe runs: float64 products for keys on CPU and
    full-rate-float64 GPUs, by the precision policy), ``triton`` (the float32 Triton update,
    whole), ``triton-kernel`` (its partials launch alone). Under the Triton interpreter ``tl.dot``
    on bf16 is wrong, so the interpreted variants read fp16 (same bytes per element)."""
    from fastspec.covariance.policy import UpdateSettings, update_plan

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    skip = _triton_skip(device)
    same = skip is None and update_plan(
        UpdateSettings(), track_mean, torch.empty(0, dtype=dtype, device=device)).backend == "triton"
    # the launch alone first: the number a GPU run wants before its time cap can cut the rest
    return [(KERNEL, skip, dtype),
            ("triton", "'auto' already is the Triton update here" if same else skip, dtype),
            ("auto", None, torch.bfloat16)]


def _with_copy(nbytes: int) -> dict:
    """``row_extra`` of a case reading ``nbytes``: the copy row's bandwidth fields (see COPY)."""
    def extra(row: dict) -> dict:
        if row.get("baseline") != COPY:
            return {}
        copy_bw = 2 * nbytes / row["baseline_s"] / 1e9
        return {"copy_GBps": copy_bw, "pct_of_copy_bandwidth": 100 * (nbytes / row["fastspec_s"] / 1e9) / copy_bw}
    return extra


def _copy(inp: Inputs) -> torch.Tensor:
    return inp["copy_dst"].copy_(inp["x"])


def _partials(x: torch.Tensor, center: bool):
    """The Triton launch alone, ``x: [B, T, S, D]`` (imported late: Triton is optional)."""
    from fastspec.covariance.triton_update import covariance_partials_triton

    return covariance_partials_triton(x, center=center)


def _case(device, variant, skip, dtype, *, size: str, shape: tuple[int, ...], x: Callable,
          sites: tuple[int, int] | int, view: Callable, center: bool, ref: Callable,
          hand: tuple[str, Callable], result: Callable) -> Case:
    """One covariance case on the input ``x()`` of ``shape`` (built in ``setup``): ``view(x)`` is what fastspec
    reads (``[..., T, S, D]`` or ``[N, D]``), ``ref(x)`` the float64 answer, ``hand`` the plain
    torch baseline, ``result(acc)`` what an accumulator reports; the ``triton-kernel`` variant
    derives the same matrix from the launch's partials."""
    import fastspec

    def make() -> fastspec.Covariance:
        backend = "auto" if variant == "auto" else "triton"
        return fastspec.Covariance(sites, track_mean=center, backend=backend, device=device)

    def setup() -> Inputs:
        data = x()
        return {"x": data, "copy_dst": torch.empty_like(data), "ref": ref(data),
                "acc": None if variant == KERNEL else make()}

    def as_sites(v: torch.Tensor) -> torch.Tensor:  # [N, D] -> [1, N, 1, D] for the launch
        return v[None, :, None, :] if v.dim() == 2 else v

    def run(inp: Inputs):
        if variant == KERNEL:
            return _partials(as_sites(view(inp["x"])), center)
        return inp["acc"].update(view(inp["x"]))

    def from_partials(p) -> torch.Tensor:
        G = p.G.double()
        if center:  # unbiased covariance about the chunk's own mean
            s, n = p.s.double(), p.n.double()[:, None, None]
            G = (G - s[:, :, None] * s[:, None, :] / n) / (n - 1)
        return G if isinstance(sites, tuple) else G[0]

    def check(inp: Inputs) -> dict:
        if variant == KERNEL:
            got = from_partials(run(inp))
        else:
            fresh = make()
            fresh.update(view(inp["x"]))
            got = result(fresh)
        return {"fastspec_error": max_rel_err(got, inp["ref"], (-2, -1)),
                "baseline_error": max_rel_err(hand[1](inp["x"]), inp["ref"], (-2, -1)),
                f"{COPY}_error": None}

    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    return Case(suite="covariance", size=size, variant=variant, setup=setup, fastspec=run,
                baselines={hand[0]: lambda inp: hand[1](inp["x"]), COPY: _copy}, check=check,
                error_kind="max rel err vs fp64", claim=no_worse_than(),
                rate=("GB/s", lambda s: nbytes / s / 1e9), skip=skip,
                row_extra=_with_copy(nbytes), device_time=True)


def _key_case(tier, device, shape, variant, skip, dtype) -> Case:
    """Keys ``[B, H, T, D]`` (Hugging Face layout), raw Gram per head (the sv convention)."""
    B, H, T, D = shape

    def keys() -> torch.Tensor:
        k = torch.randn(B, H, T, D, device=device).mul_(torch.linspace(0.1, 3, D, device=device))
        return k.add_(0.5).to(dtype)  # nonzero mean: keys are not centered, the sv convention keeps it

    def ref(k: torch.Tensor) -> torch.Tensor:
        kd = k.double()
        return (kd.mT @ kd).sum(0)

    def hand(k: torch.Tensor) -> torch.Tensor:
        kf = k.float()
        return (kf.mT @ kf).sum(0)

    return _case(device, variant, skip, dtype, size=f"keys-B{B}-H{H}-T{T}-D{D}-{_dt(dtype)}", shape=shape, x=keys,
                 sites=(H, D), view=lambda k: k.transpose(1, 2), center=False, ref=ref,
                 hand=("torch (k.mT @ k).sum(0)", hand), result=lambda acc: acc.gram())


def _ffn_case(tier, device, shape, variant, skip, dtype) -> Case:
    """FFN inputs ``[N, D]`` with large-mean channels, centred covariance (the eig convention)."""
    N, D = shape

    def acts() -> torch.Tensor:
        x = torch.randn(N, D, device=device).mul_(torch.linspace(0.05, 2, D, device=device))
        return x.add_(torch.linspace(-4, 4, D, device=device)).to(dtype)  # large-mean channels

    return _case(device, variant, skip, dtype, size=f"ffn-N{N}-D{D}-{_dt(dtype)}", shape=shape, x=acts, sites=D,
                 view=lambda x: x, center=True, ref=lambda x: torch.cov(x.double().T),
                 hand=("torch.cov(x.float().T)", lambda x: torch.cov(x.float().T)),
                 result=lambda acc: acc.covariance())


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def covariance_cases(tier: str, device: torch.device) -> list[Case]:
    """Keys first (tagged ``headline``: the kit's first numbers), then FFN; per kind
    ``triton-kernel``, ``triton``, ``auto``. Interpreted Triton is slow: on CPU its variants use the quick
    shapes whatever the tier."""
    out = []
    for kind, sizes, build, tags in (("keys", KEY_SIZES, _key_case, frozenset({HEADLINE})),
                                     ("ffn", FFN_SIZES, _ffn_case, frozenset())):
        for variant, skip, dtype in _variants(device, track_mean=kind == "ffn"):
            sizes_tier = tier if variant == "auto" or device.type == "cuda" else "quick"
            for shape in sizes[sizes_tier]:
                case = build(tier, device, shape, variant, skip, dtype)
                case.tags = tags
                out.append(case)
    return out
