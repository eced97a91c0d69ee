"""eigvalsh suite: batches of symmetric fp32 matrices, fastspec vs torch.linalg (vs CuPy on CUDA).

Inputs are Gram matrices with a power-law spectrum, the shape of real per-head activation
covariances: ``A = XᵀX / m`` with ``X: [B, 2n, n]`` whose columns are scaled by ``k^(−0.75)``.
Error: per matrix ``max_i |λ_i − λ_i^fp64| / max_i |λ_i^fp64|``, then the max over the batch.
Rate: µs per matrix.
"""
from __future__ import annotations

import torch

from .cases import Case, Inputs, max_rel_err

SIZES = {  # (batch, n)
    "quick": [(16, 32), (4, 64)],
    "cpu": [(256, 64), (64, 128), (16, 256)],
    "gpu": [(4096, 64), (256, 128), (4096, 128), (16384, 128), (4096, 256)],
}


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


def _variants(device: torch.device) -> list[tuple[str, str | None]]:
    """``auto`` plus every other available solver that can run on ``device`` (name, skip)."""
    import fastspec

    out: list[tuple[str, str | None]] = [("auto", None)]
    for name, info in fastspec.backends().items():
        if name in ("auto", "torch"):  # torch is the baseline itself
            continue
        if not info.get("available"):
            out.append((name, f"eigvalsh backend {name!r} unavailable: {info.get('reason')}"))
        elif name == "cuda" and device.type != "cuda":
            out.append((name, "the 'cuda' solver needs a CUDA device"))
        elif name == "host" and device.type == "cuda":
            out.append((name, "the 'host' solver is timed on CPU tensors (cpu tiers)"))
        else:
            out.append((name, None))
    return out


def _cupy_eigvalsh():
    try:
        import cupy
    except ImportError:
        return None

    def run(inp: Inputs) -> torch.Tensor:
        return torch.from_dlpack(cupy.linalg.eigvalsh(cupy.from_dlpack(inp["A"])))
    return run


def eigvalsh_cases(tier: str, device: torch.device) -> list[Case]:
    import fastspec

    baselines = {"torch.linalg.eigvalsh": lambda inp: torch.linalg.eigvalsh(inp["A"])}
    cupy_note = None
    if device.type == "cuda":
        cupy_run = _cupy_eigvalsh()
        if cupy_run is None:
            cupy_note = "cupy not installed"
        else:
            baselines["cupy.linalg.eigvalsh"] = cupy_run

    out = []
    for batch, n in SIZES[tier]:
        for variant, skip in _variants(device):
            def setup(batch=batch, n=n) -> Inputs:
                A = powerlaw_gram(batch, n, device)
                return {"A": A, "ref": torch.linalg.eigvalsh(A.double())}

            def run(inp: Inputs, variant=variant) -> torch.Tensor:
                return fastspec.eigvalsh(inp["A"], backend=variant)

            def check(inp: Inputs, run=run) -> dict:
                errs = {"fastspec_error": max_rel_err(run(inp), inp["ref"])}
                for name, base in baselines.items():
                    errs[f"{name}_error"] = max_rel_err(base(inp), inp["ref"])
                errs["baseline_error"] = errs["torch.linalg.eigvalsh_error"]
                return errs

            out.append(Case(
                suite="eigvalsh", size=f"B{batch}-n{n}-fp32", variant=variant, setup=setup,
                fastspec=run, baselines=dict(baselines), check=check,
                error_kind="max rel err vs fp64",
                rate=("µs/matrix", lambda s, batch=batch: s / batch * 1e6),
                skip=skip, notes={"cupy": cupy_note} if cupy_note else {}))
    return out
