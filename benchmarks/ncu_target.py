"""One profiling target per headline kernel, for Nsight Compute (``benchmarks/gpu_run.sh``).

    ncu --set full --kernel-id ::regex:eigvalsh_batched_kernel:3 -c 1 python benchmarks/ncu_target.py eig
    ncu --set full --kernel-id ::regex:_cov_partials_kernel:3 -c 1 python benchmarks/ncu_target.py cov

Each target launches its kernel three times (two warm-ups, then the third, the one profiled) at the headline shape: ``eig`` = ``fastspec.eigvalsh`` of 4096 fp32 128×128 power-law
Gram matrices on the CUDA solver; ``cov`` = one keys covariance update, bf16 ``[B=8, H=8,
T=2048, D=128]`` read through the ``[B, T, H, D]`` view (the ``sv`` convention, raw Gram).
``--dry-run`` runs the same code on CPU at tiny sizes (host twin, Triton interpreter with fp16:
the interpreter's bf16 ``tl.dot`` is wrong) so the script cannot rot where no GPU exists.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def eig(device: torch.device, dry: bool) -> None:
    import fastspec
    from fastspec.bench.cases_eigvalsh import powerlaw_gram

    batch, n = (8, 32) if dry else (4096, 128)
    A = powerlaw_gram(batch, n, device)
    backend = "host" if dry else "cuda"
    for _ in range(3):
        w = fastspec.eigvalsh(A, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert w.shape == (batch, n) and bool(torch.isfinite(w).all()), "eigvalsh returned non-finite values"
    print(f"eig: {batch} × {n}×{n} fp32, backend={backend}: ok")


def cov(device: torch.device, dry: bool) -> None:
    from fastspec.covariance.triton_update import covariance_partials_triton

    B, H, T, D = (1, 2, 32, 16) if dry else (8, 8, 2048, 128)
    dtype = torch.float16 if dry else torch.bfloat16
    k = torch.randn(B, H, T, D, device=device).add_(0.5).to(dtype)
    for _ in range(3):
        p = covariance_partials_triton(k.transpose(1, 2), center=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert p.n.tolist() == [B * T] * H, f"rows counted {p.n.tolist()}, expected {B * T} per head"
    print(f"cov: keys [{B}, {H}, {T}, {D}] {dtype}, raw Gram: ok")


TARGETS = {"eig": eig, "cov": cov}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", choices=[*TARGETS, "all"])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (needs TRITON_INTERPRET=1 for cov)")
    args = p.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--dry-run: set TRITON_INTERPRET=1 (the cov target runs Triton on CPU tensors)")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        p.error("no CUDA device: use --dry-run")
    for name in TARGETS if args.target == "all" else [args.target]:
        TARGETS[name](device, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
