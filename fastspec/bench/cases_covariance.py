"""covariance suite: streaming per-site accumulation, fastspec vs the plain-torch path.

* ``keys``: bf16 keys in the Hugging Face layout ``[B, H, T, D]`` (8 KV heads of 128 on GPU),
  accumulated per head as the raw Gram ``G = KᵀK`` (the ``sv`` convention of
  docs/conventions.md). fastspec reads the ``[B, T, H, D]`` transpose view without a copy; the
  baseline is what one writes by hand: ``(k.float().mT @ k.float()).sum(0)``.
* ``ffn``: bf16 FFN activations ``[N, D]`` (16384 × 8192 on GPU), centered unbiased covariance
  (the ``eig`` convention); baseline ``torch.cov(x.float().T)``.

fastspec is timed as a streaming update into a live accumulator (its real per-step cost,
including the float64 merge). Error: ``max|M − M^fp64| / max|M^fp64|`` per site, max over sites,
where ``M^fp64`` is computed in float64 from the same bf16 values. Rate: GB/s of input read.
"""
from __future__ import annotations

import os

import torch

from .case import Case, Inputs, max_rel_err

KEY_SIZES = {"quick": [(1, 2, 64, 16)], "cpu": [(2, 8, 512, 128)], "gpu": [(8, 8, 2048, 128)]}
FFN_SIZES = {"quick": [(256, 64)], "cpu": [(4096, 1024)], "gpu": [(16384, 8192)]}


def _triton_skip(device: torch.device) -> str | None:
    """Why ``backend="triton"`` cannot be timed separately here (None: it can)."""
    if device.type == "cuda":
        return "on CUDA 'auto' already is the Triton path"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton on CPU runs only under TRITON_INTERPRET=1"
    import fastspec

    try:
        fastspec.Covariance(4, backend="triton").update(torch.randn(8, 4))
    except (ImportError, RuntimeError) as e:
        return f"backend='triton' unavailable: {e}"
    return None


def _variants(tier: str, device: torch.device) -> list[tuple[str, str | None, torch.dtype]]:
    """(variant, skip, dtype). Under the Triton interpreter ``tl.dot`` on bf16 is wrong, so the
    interpreted Triton variant reads fp16 (same bytes per element) at quick size only."""
    out = [("auto", None, torch.bfloat16)]
    if device.type != "cuda":
        out.append(("triton", _triton_skip(device), torch.float16))
    return out


def _key_case(tier, device, shape, variant, skip, dtype) -> Case:
    import fastspec

    B, H, T, D = shape

    def setup() -> Inputs:
        k = torch.randn(B, H, T, D, device=device).mul_(torch.linspace(0.1, 3, D, device=device))
        k = k.add_(0.5).to(dtype)  # nonzero mean: keys are not centered, the sv convention keeps it
        acc = fastspec.Covariance((H, D), track_mean=False, backend=variant, device=device)
        kd = k.double()
        return {"k": k, "acc": acc, "ref": (kd.mT @ kd).sum(0)}

    def run(inp: Inputs):
        return inp["acc"].update(inp["k"].transpose(1, 2))

    def hand(inp: Inputs) -> torch.Tensor:
        kf = inp["k"].float()
        return (kf.mT @ kf).sum(0)

    def check(inp: Inputs) -> dict:
        fresh = fastspec.Covariance((H, D), track_mean=False, backend=variant, device=device)
        fresh.update(inp["k"].transpose(1, 2))
        return {"fastspec_error": max_rel_err(fresh.gram(), inp["ref"], (-2, -1)),
                "baseline_error": max_rel_err(hand(inp), inp["ref"], (-2, -1))}

    nbytes = B * H * T * D * torch.finfo(dtype).bits // 8
    return Case(suite="covariance", size=f"keys-B{B}-H{H}-T{T}-D{D}-{_dt(dtype)}", variant=variant,
                setup=setup, fastspec=run, baselines={"torch (k.mT @ k).sum(0)": hand}, check=check,
                error_kind="max rel err vs fp64", rate=("GB/s", lambda s: nbytes / s / 1e9), skip=skip)


def _ffn_case(tier, device, shape, variant, skip, dtype) -> Case:
    import fastspec

    N, D = shape

    def setup() -> Inputs:
        x = torch.randn(N, D, device=device).mul_(torch.linspace(0.05, 2, D, device=device))
        x = x.add_(torch.linspace(-4, 4, D, device=device)).to(dtype)  # large-mean channels
        acc = fastspec.Covariance(D, backend=variant, device=device)
        return {"x": x, "acc": acc, "ref": torch.cov(x.double().T)}

    def run(inp: Inputs):
        return inp["acc"].update(inp["x"])

    def hand(inp: Inputs) -> torch.Tensor:
        return torch.cov(inp["x"].float().T)

    def check(inp: Inputs) -> dict:
        fresh = fastspec.Covariance(D, backend=variant, device=device).update(inp["x"])
        return {"fastspec_error": max_rel_err(fresh.covariance(), inp["ref"], (-2, -1)),
                "baseline_error": max_rel_err(hand(inp), inp["ref"], (-2, -1))}

    nbytes = N * D * torch.finfo(dtype).bits // 8
    return Case(suite="covariance", size=f"ffn-N{N}-D{D}-{_dt(dtype)}", variant=variant,
                setup=setup, fastspec=run, baselines={"torch.cov(x.float().T)": hand}, check=check,
                error_kind="max rel err vs fp64", rate=("GB/s", lambda s: nbytes / s / 1e9), skip=skip)


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def covariance_cases(tier: str, device: torch.device) -> list[Case]:
    out = []
    for variant, skip, dtype in _variants(tier, device):
        # interpreted Triton is slow: its cases use the quick shapes whatever the tier
        sizes_tier = "quick" if variant == "triton" else tier
        for shape in KEY_SIZES[sizes_tier]:
            out.append(_key_case(tier, device, shape, variant, skip, dtype))
        for shape in FFN_SIZES[sizes_tier]:
            out.append(_ffn_case(tier, device, shape, variant, skip, dtype))
    return out
