"""Is the uncentred 16-bit covariance kernel exact and steady? The library beside the variants
that raced on an H100 (Triton 3.6, 2026-11-27).

    python benchmarks/race_probe.py                  # every variant in its own process (in parallel), then timing
    python benchmarks/race_probe.py --one VARIANT    # one variant's accuracy rows
    python benchmarks/race_probe.py --time VARIANT   # one variant's keys kernel, CUDA-graphed
    python benchmarks/race_probe.py --kit [--time-limit S]   # the GPU kit's step: the library's rows, then its time
    TRITON_INTERPRET=1 python benchmarks/race_probe.py --dry-run [--one VARIANT | --kit]   # CPU, tiny sizes

Each row: one input, its raw Gram ``G = Σ x xᵀ`` from three launches of the same variant,
``‖G − G64‖ / ‖G64‖`` against float64 truth for the worst launch (``err``) beside torch float32's
(``torch``), and ``MOVING`` when the three launches differ bitwise (a race: the kernel has no
atomics and a fixed summation order, so equal inputs must give equal bits).

Variants (``_gram_dot``'s ``ACC=2`` block tile, uncentred rows; a variant replaces the library's
``_gram_dot`` before anything compiles, Triton hashing a kernel's dependencies once per process):

* ``launcher``: the library as it is (the tile flushed into ``G`` every 128 rows by a select).
* ``branch``: the flush under an ``if`` every 4th block (the library before): on the H100 it
  raced at 3 stages (``stages1`` / ``stages2``: the same at 1 / 2 stages; 1 was exact).
* ``acc0``: no block tile, the dots accumulating into ``G`` (raced on masked inputs).
* ``endonly``: the tile carried over the whole loop, added once after it (raced too).

``--kit`` is command 1's ``race-probe`` step (``benchmarks/gpu_run.py``): the library's rows and
its keys time in one process, so every GPU run checks that the shipped launch is still exact and
steady on that machine's Triton. ``--time-limit S``: no row (and no timing) starts after S
seconds; each one left out is printed ``not run: time cap reached``, and the exit status is the
rows' that ran.

What the H100 gave is in ``benchmarks/results/nvidia-h100-2026-11-27b-logs/race-probe-*.txt``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# gpu_tools (the kit's Clock) is found in benchmarks/, this script's folder, first on sys.path
import triton
import triton.language as tl
from gpu_tools import Clock

from fastspec.covariance import triton_kernels as tk

VARIANTS = {  # name: (_gram_dot, stages or None (the launcher's), acc or None (the launcher's))
    "launcher": ("library", None, None),
    "branch": ("branch", None, None),
    "stages1": ("branch", 1, None),
    "stages2": ("branch", 2, None),
    "acc0": ("library", None, 0),
    "endonly": ("end", None, None),
}
SPAWN_LIMIT = 110  # seconds for the parallel accuracy pass
TIME_LIMIT = 30    # seconds per variant's timing process

LIBRARY_GRAM = tk._gram_dot
FLUSH: tl.constexpr = tk.FLUSH_ROWS


@triton.jit
def _variant_dot(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, ACC: tl.constexpr, LOLO: tl.constexpr, FLUSH_SELECT: tl.constexpr,
                 FLUSH_IF: tl.constexpr):
    """Uncentred ACC=2 rows into the block tile, flushed under an ``if`` every FLUSH rows
    (FLUSH_IF) or never (``_gram_flush`` adds it after the loop); anything else: the library."""
    if SPLIT_BF16 or ACC != 2 or not FLUSH_SELECT:  # the split, or the library's unrolled flush
        b_acc, b_blk = LIBRARY_GRAM(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16, UPCAST, PRECISION, ACC, LOLO,
                                    FLUSH_SELECT)
    else:
        if UPCAST:  # the interpreter (--dry-run): 16-bit products exact in fp32
            b_a, b_b = b_a.to(tl.float32), b_b.to(tl.float32)
        BT: tl.constexpr = b_a.shape[0]
        b_blk = tl.dot(tl.trans(b_a), b_b, b_blk, input_precision=PRECISION)
        if FLUSH_IF:  # noqa: SIM102 - compile-time choice; the runtime `if` inside is the one that raced
            if i_blk % (FLUSH // BT) == FLUSH // BT - 1:
                b_acc = b_acc + b_blk
                b_blk = tl.zeros_like(b_blk)
    return b_acc, b_blk


@triton.jit
def gram_branch(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr, ACC: tl.constexpr, LOLO: tl.constexpr = True,
                FLUSH_SELECT: tl.constexpr = True):
    """The tile flushed under an ``if`` every FLUSH rows (what raced)."""
    return _variant_dot(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16, UPCAST, PRECISION, ACC, LOLO, FLUSH_SELECT, True)


@triton.jit
def gram_end(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16: tl.constexpr, UPCAST: tl.constexpr,
             PRECISION: tl.constexpr, ACC: tl.constexpr, LOLO: tl.constexpr = True,
             FLUSH_SELECT: tl.constexpr = True):
    """The tile carried over the whole loop (``_gram_flush`` adds it after)."""
    return _variant_dot(b_a, b_b, b_acc, b_blk, i_blk, SPLIT_BF16, UPCAST, PRECISION, ACC, LOLO, FLUSH_SELECT,
                        False)


def install(variant: str) -> None:
    gram = VARIANTS[variant][0]
    tk._gram_dot = {"library": LIBRARY_GRAM, "branch": gram_branch, "end": gram_end}[gram]


def cases(dev, dry: bool):
    """(label, input maker) in the order they run: the keys case, then the H100's failures."""
    import torch

    def big(shape, dtype, mask):  # the GPU tests' inputs: channel means up to 100, 10 % masked
        def make():
            x = (torch.randn(shape, device=dev) * 2 + 100 * torch.rand(shape[-1], device=dev)).to(dtype)
            return x, (torch.rand(shape[:2], device=dev) > 0.1) if mask else None
        return make

    def keys(shape, dtype):
        return lambda: (torch.randn(shape, device=dev).to(dtype), None)

    bf, fp = torch.bfloat16, torch.float16
    if dry:  # the interpreter: fp16 (its bf16 dot is not exact), tiny
        return [("keys B1-T160-H2-D128 fp16", keys((1, 160, 2, 128), fp)),
                ("D96 B2-T32-H2 fp16 mask", big((2, 32, 2, 96), fp, True))]
    return [
        ("keys B8-T2048-H8-D128 bf16", keys((8, 2048, 8, 128), bf)),
        ("D96 B2-T128-H4 bf16 mask", big((2, 128, 4, 96), bf, True)),
        ("D96 B2-T128-H4 fp16 mask", big((2, 128, 4, 96), fp, True)),
        ("D96 B2-T128-H4 bf16", big((2, 128, 4, 96), bf, False)),
        ("D128 B2-T256-H8 bf16 mask", big((2, 256, 8, 128), bf, True)),
        ("N1024 D128 fp16", big((1, 1024, 1, 128), fp, False)),
        ("keys B8-T2048-H8-D64 bf16", keys((8, 2048, 8, 64), bf)),
        ("ffn N512-D2048 fp16 mask", big((1, 512, 1, 2048), fp, True)),
    ]


def _device(dry: bool):
    import torch

    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("race_probe.py --dry-run: set TRITON_INTERPRET=1 before starting")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("race_probe.py: no CUDA device (use --dry-run)")
    return torch.device("cuda")


def _config(x, dev, stages):
    from fastspec.covariance.triton_update import launch_config

    B, T, S, D = x.shape
    cfg = launch_config(B * T, S, D, dev, x.element_size())
    return cfg if stages is None else cfg._replace(num_stages=stages)


def one(variant: str, dry: bool, clock: Clock) -> int:
    """Print one row per case; 1 when a row is MOVING or far outside torch's error. No case
    starts once ``clock`` has no time left."""
    import torch

    from fastspec.covariance.reference import covariance_partials_reference as reference
    from fastspec.covariance.triton_update import covariance_partials_triton as kernel

    _, stages, acc = VARIANTS[variant]
    install(variant)
    dev = _device(dry)
    bad = 0
    for label, make in cases(dev, dry):
        if clock.left() <= 0:
            print(f"{variant:<9} {label:<28} not run: time cap reached", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            errs, moving = [], False
            for seed in range(1 if dry else 2):
                torch.manual_seed(seed)
                x, m = make()
                cfg = _config(x, dev, stages)
                runs = [kernel(x, m, 1, False, config=cfg, acc=acc) for _ in range(3)]
                moving |= not all(torch.equal(r.G, runs[0].G) for r in runs[1:])
                truth = reference(x.double(), m, 1, False).G
                ours = max(((r.G.double() - truth).norm() / truth.norm()).item() for r in runs)
                torch32 = ((reference(x, m, 1, False).G.double() - truth).norm() / truth.norm()).item()
                errs.append((ours, torch32))
            k, t = max(e[0] for e in errs), max(e[1] for e in errs)
            bad += moving or k > 100 * t + 1e-6
            print(f"{variant:<9} {label:<28} stages={cfg.num_stages} BT={cfg.BT} split={cfg.split} "
                  f"err {k:9.3g} torch {t:9.3g} ratio {k / max(t, 1e-30):9.3g} "
                  f"{'MOVING' if moving else 'steady'} {time.perf_counter() - t0:5.1f}s", flush=True)
        except Exception as ex:  # noqa: BLE001 - a variant that fails to compile is a finding
            bad += 1
            print(f"{variant:<9} {label:<28} ERROR {type(ex).__name__}: {str(ex).splitlines()[0][:160]}",
                  flush=True)
    return int(bad > 0)


def timing(variant: str) -> int:
    """Device µs per call of the keys update ``[8, 2048, 8, 128]`` bf16 uncentred, CUDA-graphed."""
    import torch

    from fastspec.covariance.triton_update import covariance_partials_triton as kernel

    _, stages, acc = VARIANTS[variant]
    install(variant)
    dev = _device(False)
    x = torch.randn(8, 2048, 8, 128, device=dev, dtype=torch.bfloat16)
    cfg = _config(x, dev, stages)

    def call():
        return kernel(x, None, 1, False, config=cfg, acc=acc)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()  # compile and warm up off the capture, as torch's docs ask
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    end.synchronize()
    print(f"time {variant:<9} keys B8-T2048-H8-D128 bf16 uncentred, graphed: "
          f"{start.elapsed_time(end) / 200 * 1e3:7.1f} us (stages={cfg.num_stages})", flush=True)
    return 0


def every_variant(dry: bool) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    flag = ["--dry-run"] if dry else []
    t0 = time.perf_counter()
    procs = {v: subprocess.Popen([sys.executable, __file__, "--one", v, *flag], env=env) for v in VARIANTS}
    for v, p in procs.items():
        try:
            p.wait(timeout=max(1, SPAWN_LIMIT - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"{v}: not finished in {SPAWN_LIMIT}s", flush=True)
    print(f"--- accuracy: {time.perf_counter() - t0:.0f}s", flush=True)
    if not dry:  # one at a time: the timings must not share the GPU
        for v in VARIANTS:
            try:
                subprocess.run([sys.executable, __file__, "--time", v], env=env, timeout=TIME_LIMIT, check=False)
            except subprocess.TimeoutExpired:
                print(f"time {v}: not finished in {TIME_LIMIT}s", flush=True)
    return procs["launcher"].returncode or 0  # the library's own rows decide


def kit(dry: bool, limit: float | None) -> int:
    """The GPU kit's step: the library's accuracy rows, then (GPU) its keys time, under ``limit``."""
    clock = Clock(limit)
    status = one("launcher", dry, clock)
    if dry:
        return status
    if clock.left() <= 0:
        print("time launcher: not run: time cap reached", flush=True)
    else:
        timing("launcher")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", choices=sorted(VARIANTS), help="one variant's accuracy rows")
    p.add_argument("--time", choices=sorted(VARIANTS), help="one variant's keys kernel time (GPU)")
    p.add_argument("--kit", action="store_true", help="the GPU kit's step: the library's rows, then its time")
    p.add_argument("--time-limit", type=float, metavar="S", help="--kit: no row or timing starts after S seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny sizes")
    args = p.parse_args(argv)
    if args.time_limit is not None and not args.kit:
        p.error(f"--time-limit: expected seconds >= 0 with --kit; got {args.time_limit:g} without --kit")
    if args.time_limit is not None and args.time_limit < 0:
        p.error(f"--time-limit: expected seconds >= 0 with --kit; got {args.time_limit:g}")
    if args.kit and (args.one or args.time):
        p.error("--kit: runs the library's rows and time itself; drop --one/--time")
    if args.kit:
        return kit(args.dry_run, args.time_limit)
    if args.time:
        if args.dry_run:
            p.error("--time: needs a GPU (no --dry-run)")
        return timing(args.time)
    if args.one:
        return one(args.one, args.dry_run, Clock(None))
    return every_variant(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
