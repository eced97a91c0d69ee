"""A CPU model of how the covariance kernels' tensor-core sums lose accuracy, and what fixes it.

    python benchmarks/tensor_core_sum_model.py [--rows 1024] [--seeds 2]

Why: on an H100 (2026-11-26) the centred hi + lo split of the covariance kernel was 35-59×
less accurate than torch float32 when its dots accumulated into ``G`` inside the matrix
instructions (``ACC=0``), and 1.2-1.4× when each row block was summed in its own tile and added
to ``G`` by an fp32 add (``ACC=2``). The next run (2026-11-27) found uncentred 16-bit sums
outside the tests' bound too. A GPU comes rarely; this model says on CPU what to expect.

The model: bf16/fp16 products are exact in fp32 and a matrix instruction sums 16 rows (one
``k`` step of ``HGMMA.64x128x16``) into its accumulator, the result truncated to fp32 (rounded
toward zero, as published measurements of NVIDIA tensor cores found) instead of rounded to
nearest. A chain of such steps drifts toward zero by about one half-ulp per step; torch's fp32
matmul rounds to nearest, so its error grows like a random walk. Every sum is done in float64
and rounded once per step, so the model's only error is that rounding.

Printed: for the split (``[1024, 128]`` fp16 rows, means near their spread, as
``benchmarks/gpu_diag.py``'s ``split`` case) the model's error ratio to torch fp32 with ACC 0
and 2, to set beside the H100's 35-59× and 1.2-1.4×; then uncentred rows (fp16/bf16, means 0
to 100) with the tile never flushed (ACC 0), flushed every block and every 128 rows (what the
kernel does, ``triton_kernels.FLUSH_ROWS``).
"""
from __future__ import annotations

import argparse

import torch

STEP = 16  # rows summed by one matrix instruction (k of HGMMA.64x128x16 for 16-bit inputs)


def truncate_fp32(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` rounded to float32 toward zero (what a truncating accumulator keeps)."""
    r = v.float()
    return torch.where(r.double().abs() > v.abs(), torch.nextafter(r, torch.zeros_like(r)), r)


def chained_gram(pairs: list[tuple[torch.Tensor, torch.Tensor]], block: int, flush_rows: int | None) -> torch.Tensor:
    """Σ aᵀb over every (a, b) in ``pairs`` (float64 ``[N, D]``, exact 16-bit values), summed as
    the kernel's loop does: row blocks of ``block``, each dot in ``STEP``-row instructions that
    truncate, into a tile added to ``G`` (fp32, round to nearest) every ``flush_rows`` rows
    (``None``: never, the dots accumulate into ``G`` itself: ACC=0)."""
    N, D = pairs[0][0].shape
    G = torch.zeros(D, D, dtype=torch.float32)
    tile = G if flush_rows is None else torch.zeros_like(G)
    for r0 in range(0, N, block):
        for a, b in pairs:
            for s in range(r0, min(r0 + block, N), STEP):
                tile = truncate_fp32(tile.double() + a[s:s + STEP].T @ b[s:s + STEP])
        if flush_rows is None:
            G = tile
        elif (r0 + block) % flush_rows == 0 or r0 + block >= N:
            G, tile = G + tile, torch.zeros_like(tile)
    return G


def _rel(G: torch.Tensor, truth: torch.Tensor) -> float:
    return ((G.double() - truth).norm() / truth.norm()).item()


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.float().to(torch.bfloat16).double()


def split_ratios(rows: int, seed: int, D: int = 128, block: int = 32) -> dict[str, float]:
    """The centred split's error / torch fp32's error, ACC 0 and 2 (the kernel's hi + lo dots)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=g) * torch.linspace(0.05, 2, D)
         + torch.linspace(-4, 4, D)).to(torch.float16).double()
    c = x.mean(0).to(torch.float16).double()  # the kernel's centre, rounded to the input dtype
    d = (x - c).float().double()
    hi = _bf16(d)
    lo = _bf16(d - hi)
    xc = x - x.mean(0)
    truth = xc.T @ xc
    s = d.sum(0)

    def centred(G):
        return G.double() - torch.outer(s, s) / rows

    xf = x.float() - x.float().mean(0)
    torch_err = _rel(xf.T @ xf, truth)
    # the dots in the kernel's order (_gram_dot): into G hi·hi first; in the block tile the
    # corrections first, hi·hi last
    into_g = [(hi, hi), (hi, lo), (lo, hi), (lo, lo)]
    in_tile = [(hi, lo), (lo, hi), (lo, lo), (hi, hi)]
    return {"acc0": _rel(centred(chained_gram(into_g, block, None)), truth) / torch_err,
            "acc2": _rel(centred(chained_gram(in_tile, block, block)), truth) / torch_err}


def raw_ratios(rows: int, seed: int, dtype: torch.dtype, mean: float, D: int = 128, block: int = 32,
               flush_rows: int = 128) -> dict[str, float]:
    """Uncentred Σxxᵀ error / torch fp32's error: never flushed (ACC 0), every block, every
    ``flush_rows`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=g) * 2 + mean * torch.rand(D, generator=g)).to(dtype)
    xd = x.double()
    truth = xd.T @ xd
    torch_err = _rel(x.float().T @ x.float(), truth)
    pairs = [(xd, xd)]
    return {"acc0": _rel(chained_gram(pairs, block, None), truth) / torch_err,
            "block": _rel(chained_gram(pairs, block, block), truth) / torch_err,
            f"{flush_rows}rows": _rel(chained_gram(pairs, block, flush_rows), truth) / torch_err}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024, help="rows summed by one program (default 1024)")
    p.add_argument("--seeds", type=int, default=2, help="draws per row (default 2)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.seeds < 1:
        p.error("--rows and --seeds: expected positive integers")
    print(f"error / torch fp32 error, {args.rows} rows of 128, worst of {args.seeds} draws")
    def worst(draws: list[dict[str, float]]) -> dict[str, float]:
        return {k: max(r[k] for r in draws) for k in draws[0]}

    split = worst([split_ratios(args.rows, s) for s in range(args.seeds)])
    print("split fp16 (measured on an H100: acc0 35-59x, acc2 1.2-1.4x): "
          + "  ".join(f"{k} {v:.1f}x" for k, v in split.items()))
    for dtype in (torch.float16, torch.bfloat16):
        for mean in (0.0, 3.0, 100.0):
            raw = worst([raw_ratios(args.rows, s, dtype, mean) for s in range(args.seeds)])
            print(f"raw {str(dtype).removeprefix('torch.'):<8} mean {mean:>5g}: "
                  + "  ".join(f"{k} {v:.1f}x" for k, v in raw.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
