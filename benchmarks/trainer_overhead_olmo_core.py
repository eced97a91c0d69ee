"""Step-time overhead of fastspec's OLMo-core callback, measured inside one training run.

One torchrun job (default: the 2-rank CPU row of benchmarks/results; FSDP, gloo) trains an
OLMo-core transformer (examples/olmo_core_train.py's ``build_trainer``) with the callback, and
alternates blocks of steps with the probe streaming and with it detached (its hooks removed and
``probe.step`` not called: the trainer without the probe). Alternating blocks in the same process
see the same machine load, allocator and thread state, so their medians compare the probe and
nothing else. The first step of each block (the switch) and a warm-up block are left out.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/trainer_overhead_olmo_core.py \\
        --json benchmarks/results/cpu-amd-epyc-2core-2026-11-26-olmo-core-overhead.json

Rank 0 writes the JSON: environment (device, torch, ai2-olmo-core, fastspec versions), the run's
sizes, every timed step, the median step time without and with the probe and their ratio (the
steady-state cost of capturing), the same for the means (emissions included, spread over the
steps), and the probe's own overhead estimate (``probe.overhead()``) for comparison.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
from olmo_core.distributed.utils import get_rank, get_world_size
from olmo_core.train import prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback

from fastspec.integrations.olmo_core import FastspecCallback
from fastspec.sysinfo import environment

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("olmo_core_train_example", ROOT / "examples" / "olmo_core_train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@dataclass
class SwitchableFastspec(FastspecCallback):
    """The callback, with the probe switched off between blocks: detached (no hook on the model)
    and ``probe.step`` not called, as if the callback were not there."""

    on: bool = True

    def switch(self, on: bool) -> None:
        if self.on and not on and self._attached:
            self.probe.detach()
            self._attached = False  # pre_step attaches again when switched on
        self.on = on

    def pre_step(self, batch):
        if self.on:
            super().pre_step(batch)

    def pre_optim_step(self):
        if self.on:
            super().pre_optim_step()


@dataclass
class BlockTimer(Callback):
    """Switches the probe per block of steps (before any other callback runs) and times each step
    from its ``pre_step`` to the next one's: data, forward, backward, optimizer, callbacks, logging."""

    priority = 100
    block: int = 5
    warmup: int = 5
    times: list = field(default_factory=list)  # (step, probe on, seconds)
    _last: tuple | None = None

    def phase(self, step: int) -> bool:
        """Probe on in the warm-up and in every other block after it (off first)."""
        return step <= self.warmup or ((step - self.warmup - 1) // self.block) % 2 == 1

    def pre_step(self, batch):
        del batch
        now, step = time.perf_counter(), self.trainer.global_step
        if self._last is not None:
            last_step, on, t0 = self._last
            first_of_block = (last_step - self.warmup - 1) % self.block == 0
            if last_step > self.warmup and not first_of_block:
                self.times.append((last_step, on, now - t0))
        on = self.phase(step)
        self.trainer.callbacks["fastspec"].switch(on)
        self._last = (step, on, time.perf_counter())


def main(argv=None) -> None:
    p = example.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), out_required=False)
    p.set_defaults(d_model=256, layers=4, heads=8, kv_heads=4, seq=128, instances=8, micro=4, fsdp=True)
    p.set_defaults(steps=0)
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--pairs", type=int, default=8, help="(off, on) block pairs timed")
    p.add_argument("--emit-every", type=int, default=10, help="probe emission interval (steps with the probe)")
    p.add_argument("--json", required=True, help="where rank 0 writes the results")
    args = p.parse_args(argv)
    args.steps = args.block * (1 + 2 * args.pairs) + 1  # warm-up block, pairs, and one to close the last
    prepare_training_environment(seed=example.SEED, backend="gloo")
    try:
        # one folder for all ranks (the checkpointer's): rank 0 makes it and tells the others
        scratch = args.out is None
        if scratch:
            name = [tempfile.mkdtemp(prefix="fastspec-olmo-overhead-") if get_rank() == 0 else None]
            dist.broadcast_object_list(name, src=0)
            args.out = name[0]
        timer = BlockTimer(block=args.block, warmup=args.block)
        fs = SwitchableFastspec(probe_kwargs={"emit_every": args.emit_every}, emit_on="rank0")
        trainer = example.build_trainer(args, {"fastspec": fs, "timer": timer})
        trainer.fit()
        timer, fs = trainer.callbacks["timer"], trainer.callbacks["fastspec"]
        if get_rank() == 0 and scratch:  # fit() ends with a collective checkpoint: every rank is done with it
            shutil.rmtree(args.out, ignore_errors=True)
        if get_rank() == 0:
            off = [t for _, on, t in timer.times if not on]
            on = [t for _, on, t in timer.times if on]
            without, with_probe = statistics.median(off), statistics.median(on)
            env = environment()
            env["ai2-olmo-core"] = metadata.version("ai2-olmo-core")
            result = {
                "kind": "trainer-overhead", "trainer": "olmo_core", "date": datetime.date.today().isoformat(),
                "command": (f"python -m torch.distributed.run --standalone --nproc_per_node {get_world_size()} "
                            "benchmarks/trainer_overhead_olmo_core.py --json ..."),
                "environment": env, "world_size": get_world_size(), "backend": "gloo",
                "run": {"model": f"OLMo-core llama_like d_model={args.d_model} layers={args.layers} "
                                 f"heads={args.heads} kv_heads={args.kv_heads} vocab={example.VOCAB}",
                        "parallel": "fsdp" if args.fsdp else "ddp", "activation_checkpointing": args.ac,
                        "global_batch": f"{args.instances} x {args.seq} tokens",
                        "micro_batch": f"{args.micro} x {args.seq} tokens per rank",
                        "probe": f"keys + ffn (defaults), emit_every={args.emit_every}, sync=rank0",
                        "block_steps": args.block, "pairs": args.pairs},
                "steps": [{"step": s, "probe": on, "seconds": round(t, 6)} for s, on, t in timer.times],
                "step_s_without_probe": round(without, 6), "step_s_with_probe": round(with_probe, 6),
                "ratio": round(with_probe / without, 4),
                # the median leaves out the few emission steps; the mean spreads them over the steps
                "mean_step_s_without_probe": round(statistics.fmean(off), 6),
                "mean_step_s_with_probe": round(statistics.fmean(on), 6),
                "ratio_of_means": round(statistics.fmean(on) / statistics.fmean(off), 4),
                "probe_own_estimate": fs.probe.overhead(),
            }
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"step without probe {without * 1e3:.1f} ms, with {with_probe * 1e3:.1f} ms, "
                  f"ratio {with_probe / without:.3f} -> {args.json}")
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    torch.set_num_threads(1)  # two ranks on two cores
    main()
