"""What a first-use self-check costs (fastspec/selfcheck.py), measured where it can be: on the CPU.

    python benchmarks/selfcheck_cost.py [--repeat 5]

A check is one small case per kernel configuration per process: the case's inputs, the kernel's
launch on them (microseconds on a GPU: a few hundred rows, or six n x n matrices), one host sync,
and the float64 reference and the comparison on the CPU. All of it but the launch runs here as it
would next to a GPU; the launch is stood in by the reference itself (the covariance cases) or by
torch's solver (the eigensolver's), so each row is the check's whole cost less the kernel's
microseconds. Prints the median of ``--repeat`` runs per configuration kind, in milliseconds.
(Triton compiling the case's own specialization, ~1 s once per machine where it differs from the
user's, is not counted: it is a compile, cached on disk.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastspec import selfcheck
from fastspec.covariance.reference import covariance_partials_reference


def exact_route(D: int, dtype: torch.dtype) -> None:
    for x, mask in selfcheck.rows(D, dtype, torch.device("cpu")):
        out = covariance_partials_reference(x.double(), mask, 1, center=False)  # the kernel's answer
        assert selfcheck.compare_raw(out, x, mask) == ""
        assert selfcheck.compare_raw(out, x, mask) == ""  # partials, then accumulate


def triton_update(D: int, dtype: torch.dtype, center: bool) -> None:
    for x, mask in selfcheck.rows(D, dtype, torch.device("cpu")):
        out = covariance_partials_reference(x, mask, 1, center)
        assert selfcheck.compare_fast(out, x, mask, center) == ""


def eigensolver(n: int, dtype: torch.dtype) -> None:
    A, _ = selfcheck.spectra(n)
    Ad = A.to(dtype)
    bad = ~torch.isfinite(Ad).all(-1).all(-1)
    out = torch.linalg.eigvalsh(torch.where(bad[:, None, None], 0, Ad))  # the kernel's answer
    out[bad] = float("nan")
    assert selfcheck.compare_eigenvalues(out, A, dtype) == ""


CASES = [
    ("exact route, bf16 D=64", lambda: exact_route(64, torch.bfloat16)),
    ("exact route, bf16 D=128", lambda: exact_route(128, torch.bfloat16)),
    ("Triton update, bf16 D=128 raw", lambda: triton_update(128, torch.bfloat16, False)),
    ("Triton update, bf16 D=128 centred", lambda: triton_update(128, torch.bfloat16, True)),
    ("Triton update, bf16 D=4096 centred (FFN)", lambda: triton_update(4096, torch.bfloat16, True)),
    ("eigensolver, float32 n=64", lambda: eigensolver(64, torch.float32)),
    ("eigensolver, float32 n=128", lambda: eigensolver(128, torch.float32)),
    ("eigensolver, float64 n=128", lambda: eigensolver(128, torch.float64)),
    ("eigensolver, float32 n=256", lambda: eigensolver(256, torch.float32)),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, run in CASES:
        run()  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        print(f"{name:<44} {1e3 * statistics.median(times):8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
