"""What float32 totals cost the FFN metrics: the accuracy battery of docs/scale.md.

A memory plan gives an FFN layer float32 ``D × D`` totals (``Covariance(totals=torch.float32)``,
the in-place update, and a float32 eigensolve) only where float64 does not fit. This measures what
that costs, per metric: each case of the battery streams the same rows through float64 totals
(the reference: float64 products, a float64 solve) and float32 totals, and reports the largest
relative error of every record metric over the case's sites, beside the sampling error the
metric has anyway (the spread of the same metric between two independent halves of the rows,
what an owned layer's ``1/dp`` of the tokens already costs), so the two can be compared.

The battery: anisotropic Gaussian rows (full rank), a power-law spectrum (``λ_k ∝ k^-1``, the
shape FFN spectra take), post-activation rows (ReLU of Gaussian: nonnegative, a large mean), low
rank plus noise (rank D/16, noise 1e-3: tiny eigenvalues), a mean 1e3 times the spread, bfloat16
input, and a long stream (400 updates of 32 rows: rounding accumulated over merges).

    python benchmarks/ffn_totals_accuracy.py OUT.json            # D = 512 and 2048 (~2 min on 2 cores)
    python benchmarks/ffn_totals_accuracy.py OUT.json --widths 256 --quick

``tests/test_probe_memory.py`` runs the battery at D = 256 and holds every metric to the bound
docs/scale.md states.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fastspec
from fastspec.metrics import rank_at, summarize

METRICS = ("participation_ratio", "hard_rank_normalized", "entropy_rank", "soft_rank_normalized",
           "spectral_concentration", "sui", "effective_dim", "top1_share", "top10pct_share", "rank_at_90",
           "lambda_max")
CASES = ("gaussian", "power_law", "relu", "low_rank", "large_mean", "bf16", "long_stream")


def _basis(D: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    return q


def rows(case: str, D: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """The updates of one case: a list of ``[rows, D]`` tensors (float32, or bfloat16)."""
    Q = _basis(D, g)
    k = torch.arange(1, D + 1, dtype=torch.float64)
    if case == "power_law":
        scale = k.pow(-0.5)  # variances ∝ k^-1
    elif case == "low_rank":
        scale = torch.where(k <= D // 16, 1.0, 1e-3)
    else:
        scale = torch.linspace(0.1, 3.0, D, dtype=torch.float64)
    z = torch.randn(n, D, generator=g, dtype=torch.float64) * scale
    x = z @ Q.T
    if case == "relu":
        x = torch.relu(x + 0.3)
    if case == "large_mean":
        x = x + 1e3 * torch.rand(D, generator=g, dtype=torch.float64)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    x = x.to(dtype)
    size = 32 if case == "long_stream" else max(32, n // 8)  # several updates: the merges too
    return list(x.split(size))


def metrics(cov: fastspec.Covariance) -> dict[str, float]:
    """Every record metric of the eig spectrum, as the probe's wide emission computes it (the
    totals' dtype is the solve's)."""
    m2 = cov._state["m2"]
    C = m2 / (cov.n.double().item() - 1)
    lam = torch.linalg.eigvalsh(C[0]).flip(-1).clamp_min(0)[None]
    s = summarize(lam, check_negative=False).as_dict()
    out = {name: float(s[name][0]) for name in METRICS if name in s}
    out["rank_at_90"] = float(rank_at(lam, 0.9, check_negative=False)[0])
    out["lambda_max"] = float(lam[0, 0])
    return out


def run_case(case: str, D: int, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    updates = rows(case, D, n, g)
    want = fastspec.Covariance(D, backend="inplace")
    got = fastspec.Covariance(D, backend="inplace", totals=torch.float32)
    halves = [fastspec.Covariance(D, backend="inplace"), fastspec.Covariance(D, backend="inplace")]
    for i, x in enumerate(updates):
        want.update(x)
        got.update(x)
        halves[i % 2].update(x)
    a, b, h0, h1 = metrics(want), metrics(got), metrics(halves[0]), metrics(halves[1])
    err = {m: abs(b[m] - a[m]) / max(abs(a[m]), 1e-300) for m in METRICS}
    sampling = {m: abs(h0[m] - h1[m]) / max(abs(a[m]), 1e-300) for m in METRICS}
    return {"case": case, "D": D, "rows": int(want.n.item()), "updates": len(updates), "float32_rel_err": err,
            "sampling_rel_diff": sampling, "reference": a}


def battery(widths=(512, 2048), quick: bool = False) -> list[dict]:
    out = []
    for D in widths:
        for case in CASES:
            n = (2 if quick else 4) * D if case != "long_stream" else 400 * 32
            out.append(run_case(case, D, n))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--widths", default="512,2048", help="comma-separated D")
    p.add_argument("--quick", action="store_true", help="2·D rows a case instead of 4·D")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    cases = battery(tuple(int(w) for w in args.widths.split(",")), args.quick)
    worst = {m: max(c["float32_rel_err"][m] for c in cases) for m in METRICS}
    doc = {"what": "float32 vs float64 FFN totals, per record metric (benchmarks/ffn_totals_accuracy.py)",
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "fastspec": fastspec.__version__, "seconds": round(time.perf_counter() - t0, 1),
           "worst_float32_rel_err": worst, "cases": cases}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for c in cases:
        e = c["float32_rel_err"]
        print(f"{c['case']:>12} D={c['D']:<5} PR {e['participation_ratio']:.1e}  eR {e['entropy_rank']:.1e}  "
              f"SUI {e['sui']:.1e}  r90 {e['rank_at_90']:.1e}  λmax {e['lambda_max']:.1e}  "
              f"(sampling: PR {c['sampling_rel_diff']['participation_ratio']:.1e})")
    print("worst:", {m: f"{v:.1e}" for m, v in worst.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
