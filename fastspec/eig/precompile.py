"""Fill the CUDA eigensolver's kernel cache ahead of time, for a GPU that need not be here.

    python -m fastspec.eig.precompile --arch 90 [--n 64 128 256] [--dtype float32 float64] [--jobs N]

Compiles, in parallel, the variants a GPU of compute capability ``--arch`` would compile at first
use (the same plan as :mod:`.cuda`, from the arch's shared-memory table) into ``$FASTSPEC_CACHE``
(:mod:`.nvrtc`), and prints each one's time: for a container image or a shared cluster cache
built once, and for the GPU kit, which fills its cache before its timed steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import nvrtc
from .cuda import ITEMSIZE, MAX_N, DeviceSpec, variant_for
from .nvrtc import KernelUnavailable


def _compile_one(args: tuple[int, str, int]) -> tuple[str, str, float]:
    arch, dtype, n = args
    img = nvrtc.compile_variant(variant_for(n, dtype, DeviceSpec.for_arch(arch)), nvrtc.choose_target(arch))
    return img.variant.tag, img.origin, img.seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastspec.eig.precompile",
                                description="Compile the CUDA eigensolver ahead of time into the kernel cache.")
    p.add_argument("--arch", type=int, required=True, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--n", type=int, nargs="+", default=[64, 128, 256], help="matrix sizes (default 64 128 256)")
    p.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=sorted(ITEMSIZE))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = p.parse_args(argv)
    bad = [n for n in args.n if not 1 <= n <= MAX_N]
    if bad:
        p.error(f"--n: sizes must be in [1, {MAX_N}], got {bad}")
    try:
        DeviceSpec.for_arch(args.arch)
    except ValueError as exc:
        p.error(f"--arch: {exc}")
    try:
        ver = nvrtc.version()
    except KernelUnavailable as exc:
        print(f"fastspec: {exc}", file=sys.stderr)
        return 1
    jobs = [(args.arch, d, n) for d in args.dtype for n in args.n]
    print(f"NVRTC {ver[0]}.{ver[1]}, cache {nvrtc.cache_dir()}, {len(jobs)} variants for sm_{args.arch}")
    t0 = time.perf_counter()
    try:
        if args.jobs > 1 and len(jobs) > 1:
            from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

            with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
                done = list(pool.map(_compile_one, jobs))
        else:
            done = [_compile_one(j) for j in jobs]
    except KernelUnavailable as exc:
        print(f"fastspec: {exc}", file=sys.stderr)
        return 1
    for tag, origin, seconds in done:
        print(f"  {tag:<36} {origin:<6} {seconds * 1e3:8.1f} ms")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
