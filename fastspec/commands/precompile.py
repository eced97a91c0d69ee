"""``fastspec precompile``: compile the CUDA kernels ahead of time into the kernel cache.

    fastspec precompile --arch 90 [--n 64 128 256] [--dtype float32 float64] [--algo block|all|NAME...]
                        [--cov-d 64 128] [--jobs N]

For a GPU that need not be here: a container image or a shared cluster cache built once, and the
GPU kit (``benchmarks/gpu_run.py``), which fills its cache before its timed steps. The work is
:func:`fastspec.eig.precompile.precompile`; ``python -m fastspec.eig.precompile`` runs this
command too. A compute capability without a kernel plan, or a size out of range, is a usage error
naming the flag; a machine where NVRTC cannot compile, or a kernel cache that is refused (not
private: :mod:`fastspec.eig.cache`) or cannot be written, is a one-line error and exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .. import _args

DTYPES = ("float32", "float64")  # fastspec.eig.cuda.ITEMSIZE's keys, here so --help imports no torch
ALGOS = ("all", "block", "packed", "regs", "split", "newton", "cusolverdx")  # fastspec.eig.variants.names() (tests check), likewise


def _arch(text: str) -> int:
    """``--arch``: a compute capability the kernel has a plan for (checked at parse time)."""
    from ..eig.cuda import DeviceSpec

    try:
        cc = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a compute capability such as 90, got {text!r}") from None
    try:
        DeviceSpec.for_arch(cc)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("cc: ")) from None
    return cc


def _size(text: str) -> int:
    """``--n``: a matrix size the CUDA solver takes, 1 to its ``MAX_N``."""
    from ..eig.cuda import MAX_N

    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_N:
        raise argparse.ArgumentTypeError(f"expected sizes in [1, {MAX_N}], got {text!r}")
    return n


def _cov_d(text: str) -> int:
    """``--cov-d``: a head width the covariance Gram kernel takes."""
    from ..covariance.gram_cuda import ENVELOPE_D

    try:
        d = int(text)
    except ValueError:
        d = 0
    if d not in ENVELOPE_D:
        raise argparse.ArgumentTypeError(f"expected head widths in {', '.join(map(str, ENVELOPE_D))}, got {text!r}")
    return d


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", type=_arch, required=True, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--n", type=_size, nargs="+", default=[64, 128, 256], help="matrix sizes (default 64 128 256)")
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--algo", nargs="+", default=["block"], choices=ALGOS,
                   help="the kernel's algorithms (fastspec/eig/variants.py); 'all': every one of fastspec's own "
                        "that takes the size; 'cusolverdx': NVIDIA cuSolverDx's heev, generated and linked (needs "
                        "the fastspec[mathdx] extra) (default: block)")
    p.add_argument("--cov-d", type=_cov_d, nargs="*", default=[64, 128], metavar="D",
                   help="head widths of the exact covariance update's Gram kernel (csrc/cov_gram.cu), every input "
                        "dtype; an empty list compiles none (default: 64 128)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel compiles (default: one per CPU core)")


def run(args: argparse.Namespace) -> int:
    _args.integer("--jobs", args.jobs, minimum=1)
    from ..eig import nvrtc
    from ..eig.nvrtc import KernelUnavailable
    from ..eig.precompile import cov_todo, precompile, todo

    try:
        ver = nvrtc.version()
        if nvrtc.private_cache() is None:  # refused or not writable: nothing compiled would be kept
            print(f"fastspec: the kernel cache {nvrtc.cache_dir()} cannot be used (the warning above says why and "
                  "what to do); nothing to precompile into", file=sys.stderr)
            return 1
        print(f"NVRTC {ver[0]}.{ver[1]}, cache {nvrtc.cache_dir()}, "
              f"{len(todo(args.arch, args.n, args.dtype, args.algo))} variants for sm_{args.arch}, "
              f"{len(cov_todo(args.arch, args.cov_d))} covariance Gram kernels")
        t0 = time.perf_counter()
        done = precompile(args.arch, args.n, args.dtype, args.jobs, args.algo, args.cov_d)
    except (KernelUnavailable, ValueError) as exc:  # ValueError: cusolverdx asked for where it cannot be built
        print(f"fastspec: {exc}", file=sys.stderr)
        return 1
    for tag, origin, seconds in done:
        print(f"  {tag:<44} {origin:<6} {seconds * 1e3:8.1f} ms")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
