"""Step-time overhead of fastspec's Megatron-core stream, measured inside one training run.

One process (or a torchrun job) trains a Megatron-core GPTModel (examples/megatron_train.py's
``build``: local layer spec, RoPE, Megatron's DDP and ``get_forward_backward_func()``) with a
``FastspecStream`` (keys + FFN, defaults otherwise), and alternates blocks of steps with the probe
streaming and with it detached (its hooks removed and ``stream.step`` not called: the training loop
without the probe). Alternating blocks in the same process see the same machine load, allocator
and thread state, so they compare the probe and nothing else. Attaching and detaching happen
between blocks, outside the timed steps; warm-up steps (with the probe, where a ``budget`` makes
its first plan) are left out. One case per ``--budgets`` entry, each with a stream of its own on
the same model, one after the other::

    python benchmarks/trainer_overhead_megatron.py \\
        --json benchmarks/results/cpu-amd-epyc-2core-2026-12-06-megatron-overhead.json
    python benchmarks/trainer_overhead_megatron.py --quick --json /tmp/megatron-overhead.json  # a check, ~30 s

Default run: the budget suite's CPU model as a GPTModel (hidden 256, 4 layers, 4 query heads and
4 query groups of 64, FFN 768, vocab 512), 2 micro-batches of 2 × 128 tokens per step (the
budget rows' 4 × 128), one torch thread, emission every 10 steps, without a budget and with ``budget=0.05``.

The logging rank writes the JSON: environment (device, torch, megatron-core, fastspec versions,
torch threads), the run's sizes, every timed step, and per case: the median step time without and
with the probe and their ratio (switch steps, the first of each block, left out: the steady-state
cost of capturing), the means over whole blocks and their ratio (emissions included: each probed
block of ``emit_every`` steps holds one emission step), the means with switch steps left out too,
and the probe's own overhead estimate (``stream.overhead()``) with what its totals say of the timed
window (Δ``work_s`` / Δ``base_s``) for comparison.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("megatron_train_example", ROOT / "examples" / "megatron_train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

from fastspec.integrations.megatron import FastspecStream
from fastspec.sysinfo import environment


def run_case(args, model, train_step, budget: float | None, first: int) -> dict:
    """One stream on ``model``: warm-up steps with it, then ``pairs`` of (detached, streaming)
    blocks. Returns the case's timings and the probe's estimates; steps count from ``first``."""
    kwargs = {"emit_every": args.emit_every} | ({} if budget is None else {"budget": budget})
    stream = FastspecStream(model, probe_kwargs=kwargs)
    it = first
    for _ in range(args.warmup):
        it += 1
        train_step(it)
        stream.step(it)
    start = stream.overhead()
    steps = []  # {"step", "probe", "first_of_block", "seconds"}
    for _ in range(args.pairs):
        for on in (False, True):
            stream.probe.attach() if on else stream.probe.detach()
            for k in range(args.block):
                it += 1
                t0 = time.perf_counter()
                train_step(it)
                if on:
                    stream.step(it)
                steps.append({"step": it, "probe": on, "first_of_block": k == 0,
                              "seconds": round(time.perf_counter() - t0, 6)})
    end = stream.overhead()
    stream.finish()

    def pick(on, switch=True):
        return [s["seconds"] for s in steps if s["probe"] == on and (switch or not s["first_of_block"])]

    off, on = statistics.median(pick(False, False)), statistics.median(pick(True, False))
    m_off, m_on = statistics.fmean(pick(False)), statistics.fmean(pick(True))
    n_off, n_on = statistics.fmean(pick(False, False)), statistics.fmean(pick(True, False))
    base = end["base_s"] - start["base_s"]
    window = (end["work_s"] - start["work_s"]) / base if base > 0 else None
    return {
        "budget": budget, "probe_kwargs": kwargs, "steps": steps,
        "step_s_without_probe": round(off, 6), "step_s_with_probe": round(on, 6), "ratio": round(on / off, 4),
        "mean_step_s_without_probe": round(m_off, 6), "mean_step_s_with_probe": round(m_on, 6),
        "ratio_of_means": round(m_on / m_off, 4),
        "ratio_of_means_without_switch_steps": round(n_on / n_off, 4),
        "probe_own_estimate": end,
        # what the probe's totals say of the timed steps: Δwork_s / Δbase_s
        "probe_reported_window": None if window is None else round(window, 4),
        "records": len(stream.records), "next_step": it,
    }


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv=None) -> None:
    p = example.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), out_required=False)
    p.set_defaults(hidden=256, layers=4, heads=4, groups=4, ffn=768, vocab=512, seq=128, micro_batch=2,
                   micro_batches=2)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--pairs", type=int, default=18, help="(detached, streaming) block pairs timed per case")
    p.add_argument("--warmup", type=int, default=20, help="steps with the probe before the timed blocks")
    p.add_argument("--emit-every", type=int, default=10, help="probe emission interval (steps with the probe)")
    p.add_argument("--budgets", default="none,0.05", help="one case per entry: none, or a budget fraction")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--quick", action="store_true",
                   help="a check of this script: blocks of 3, 2 pairs, 3 warm-up steps, emit_every 3")
    p.add_argument("--json", required=True, help="where the logging rank writes the results")
    args = p.parse_args(argv)
    if args.quick:
        args.block, args.pairs, args.warmup, args.emit_every = 3, 2, 3, 3
    budgets = [None if b.strip() == "none" else float(b) for b in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    wall, load_start = time.perf_counter(), os.getloadavg()
    example.setup(args)
    try:
        model, train_step = example.build(args)
        cases, it = [], 0
        for budget in budgets:
            t0 = time.perf_counter()
            case = run_case(args, model, train_step, budget, it)
            case["wall_s"] = round(time.perf_counter() - t0, 1)
            it = case.pop("next_step")
            cases.append(case)
            if dist.get_rank() == dist.get_world_size() - 1:
                est = case["probe_own_estimate"]
                print(f"budget {budget}: step without probe {case['step_s_without_probe'] * 1e3:.1f} ms, with "
                      f"{case['step_s_with_probe'] * 1e3:.1f} ms (median ratio {case['ratio']:.3f}, ratio of means "
                      f"{case['ratio_of_means']:.3f}); overhead() fraction {_f(est['fraction'])} average "
                      f"{_f(est['average'])}, window {_f(case['probe_reported_window'])}; {case['wall_s']} s",
                      flush=True)
        if dist.get_rank() == dist.get_world_size() - 1:
            env = environment()
            env.update({"megatron-core": metadata.version("megatron-core"), "torch_threads": torch.get_num_threads()})
            dp, tp, pp = (example.ps.get_data_parallel_world_size(), args.tp, args.pp)
            result = {
                "kind": "trainer-overhead", "trainer": "megatron", "date": datetime.date.today().isoformat(),
                "command": ("python benchmarks/trainer_overhead_megatron.py --json ..." if dist.get_world_size() == 1
                            else f"python -m torch.distributed.run --standalone --nproc_per_node "
                                 f"{dist.get_world_size()} benchmarks/trainer_overhead_megatron.py --json ...")
                           + (" --quick" if args.quick else ""),
                "environment": env, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
                "run": {"model": f"Megatron-core GPTModel (local spec, RoPE) hidden={args.hidden} layers={args.layers} "
                                 f"heads={args.heads} query_groups={args.groups} ffn={args.ffn} vocab={args.vocab}",
                        "parallel": f"dp={dp} tp={tp} pp={pp}, Megatron DDP, torch AdamW",
                        "global_batch": f"{args.micro_batches * args.micro_batch} x {args.seq} tokens",
                        "micro_batch": f"{args.micro_batches // dp} micro-batches of {args.micro_batch} x "
                                       f"{args.seq} tokens per data-parallel rank",
                        "probe": f"keys + ffn (defaults), emit_every={args.emit_every}",
                        "block_steps": args.block, "pairs": args.pairs, "warmup_steps": args.warmup},
                "wall_s": round(time.perf_counter() - wall, 1),
                # the machine's load (1, 5, 15-minute averages): other work on it slows both sides
                "loadavg_start": [round(x, 2) for x in load_start],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "cases": cases,
            }
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"-> {args.json}")
    finally:
        example.teardown()


if __name__ == "__main__":
    main()
