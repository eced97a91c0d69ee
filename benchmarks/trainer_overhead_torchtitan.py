"""What the fastspec probe costs inside TorchTitan's trainer: training-step times with and without it.

One ``torchrun`` run, 2 ranks, FSDP over both, on CPU (gloo)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/trainer_overhead_torchtitan.py OUT.json

committed as ``benchmarks/results/<machine>-<date>-torchtitan-overhead.json``. The model is the
tests' tiny llama3 (``tests/_torchtitan_configs.py``, with its CPU workarounds and those of
``tests/_torchtitan_train.py``) at a longer sequence; the probe streams keys and FFN inputs
(default FFN token sampling) and emits every ``--emit-every`` steps.

Both sides run in the same processes, on the same trainer, in alternating blocks of
``--block-steps`` steps (the probe attached for one block, detached for the next), after warm-up
steps of each: machine noise and drift hit both alike. Reported: the median step time of each
side, their ratio, and the mean ratio (which includes the emissions: one per probe block).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSON file to write (rank 0)")
    p.add_argument("--blocks", type=int, default=12, help="blocks per side (default 12)")
    p.add_argument("--block-steps", type=int, default=10, help="training steps per block (default 10)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per side (default 5)")
    p.add_argument("--emit-every", type=int, default=10, help="probe emission interval in steps (default 10)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-batch", type=int, default=8)
    return p.parse_args()


def main() -> None:
    args = _parse()
    sys.path.insert(0, str(ROOT))
    from tests._torchtitan_train import apply_cpu_workarounds

    apply_cpu_workarounds()  # before TorchTitan reads the device type at import
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    import fastspec
    from fastspec.sysinfo import environment

    init_logger()
    total = args.warmup * 2 + args.blocks * 2 * args.block_steps + 1
    config = ConfigManager().parse_args([
        "--module", "tests._torchtitan_configs", "--config", "tiny",
        # TorchTitan's outputs (comm traces, the tests' metrics log) go to a scratch folder
        "--dump_folder", str(Path(tempfile.gettempdir()) / "fastspec-torchtitan-overhead"),
        "--parallelism.data_parallel_shard_degree", "2",
        "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.local_batch),
        "--training.steps", str(total), "--metrics.log_freq", str(10 * total),
        "--fastspec.emit_every", str(args.emit_every), "--fastspec.ffn_rows", "auto"])
    trainer = config.build()
    probe = trainer.fastspec_probe
    batches = trainer.batch_generator(trainer.dataloader)

    def run(steps: int, with_probe: bool) -> list[float]:
        if with_probe:
            trainer.fastspec_probe = probe
            probe.attach()
        else:
            probe.detach()
            trainer.fastspec_probe = None
        times = []
        for _ in range(steps):
            trainer.step += 1
            t0 = time.perf_counter()
            trainer.train_step(batches)
            times.append(time.perf_counter() - t0)
        return times

    run(args.warmup, False)
    run(args.warmup, True)
    sides: dict[bool, list[float]] = {False: [], True: []}
    block_means: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.blocks):
        for with_probe in (False, True):
            t = run(args.block_steps, with_probe)
            sides[with_probe] += t
            block_means[with_probe].append(statistics.fmean(t))
    probe.detach()
    rank = torch.distributed.get_rank()
    mine = {"rank": rank, "median_without_s": statistics.median(sides[False]),
            "median_with_s": statistics.median(sides[True]),
            "mean_without_s": statistics.fmean(sides[False]), "mean_with_s": statistics.fmean(sides[True])}
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    if rank == 0:
        env = environment()
        env.update(torchtitan=torchtitan.__version__, fastspec=fastspec.__version__,
                   torch_threads=torch.get_num_threads(), world_size=len(ranks), backend="gloo")
        doc = {
            "kind": "torchtitan-overhead",
            "date": date.today().isoformat(),
            "command": "python -m torch.distributed.run --standalone --nproc_per_node 2 "
                       "benchmarks/trainer_overhead_torchtitan.py OUT.json",
            "environment": env,
            "setup": {"model": "tests/_torchtitan_configs.py tiny llama3 (2 layers, dim 64, 4 heads, 2 KV heads)",
                      "parallelism": "FSDP over 2 ranks", "seq_len": args.seq_len,
                      "local_batch_size": args.local_batch, "probe": "keys + ffn (ffn_rows auto)",
                      "emit_every": args.emit_every, "blocks_per_side": args.blocks,
                      "block_steps": args.block_steps, "warmup_steps_per_side": args.warmup,
                      "ffn_row_step": probe.ffn_row_step},
            "ranks": ranks,
            "step_s_without_probe": mine["median_without_s"],
            "step_s_with_probe": mine["median_with_s"],
            "ratio_median": mine["median_with_s"] / mine["median_without_s"],
            "ratio_mean": mine["mean_with_s"] / mine["mean_without_s"],
            "block_means_without_s": block_means[False],
            "block_means_with_s": block_means[True],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"step without probe {doc['step_s_without_probe'] * 1e3:.1f} ms, with {doc['step_s_with_probe'] * 1e3:.1f} "
              f"ms: ratio {doc['ratio_median']:.3f} (median), {doc['ratio_mean']:.3f} (mean, emissions included)")
    torch.distributed.barrier()  # rank 0 writes first: a rank that tears gloo down early aborts
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
