"""Train a Megatron-core GPTModel with fastspec's FastspecStream streaming key rank and FFN spectra.

Runs on CPUs (gloo) or GPUs (NCCL), one or more ranks, with no download and without
TransformerEngine or apex: a small GPTModel (``get_gpt_layer_local_spec()``, RoPE, grouped-query
attention) trained by Megatron's own schedules (``get_forward_backward_func()``) on synthetic
tokens (a Zipf-like draw over the vocabulary; the same global batches on any number of ranks).
Swap in your model and data; the fastspec lines stay the same: build the stream on the model
Megatron trains, call ``stream.step(iteration)`` after each optimizer step, ``stream.finish()`` at
the end (docs/megatron.md)::

    python examples/megatron_train.py --steps 20 --out /tmp/fs-megatron
    torchrun --standalone --nproc_per_node 2 examples/megatron_train.py --out /tmp/fs-megatron        # DP 2
    torchrun --standalone --nproc_per_node 2 examples/megatron_train.py --tp 2 --out /tmp/fs-megatron # TP 2
    torchrun --standalone --nproc_per_node 2 examples/megatron_train.py --pp 2 --out /tmp/fs-megatron # PP 2

The logging rank (the last one) prints one line per emission and writes every record to
``OUT/fastspec_records.json``. ``benchmarks/trainer_overhead_megatron.py`` builds its run with
:func:`setup` and :func:`build`.
"""
from __future__ import annotations

import argparse
import json
import os
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")  # the local spec needs neither
warnings.filterwarnings("ignore", message="full scope is deprecated")  # TransformerConfig's own default

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from fastspec.integrations import as_dicts, scalars
from fastspec.integrations.megatron import FastspecStream

VOCAB, SEED = 256, 1234
CUDA = torch.cuda.is_available()


def add_arguments(p: argparse.ArgumentParser, *, out_required: bool = True) -> argparse.ArgumentParser:
    """The run's arguments (model size, data, parallelism); the scripts built on this add their own."""
    p.add_argument("--out", required=out_required, default=None, help="output folder")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per step in the global batch (split over the data-parallel ranks)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="query groups (KV heads)")
    p.add_argument("--ffn", type=int, default=512, help="FFN hidden size")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (divides --layers)")
    p.add_argument("--lr", type=float, default=1e-3)
    return p


def install_cpu_shims() -> None:
    """What a CPU run of Megatron-core needs (never done on a GPU): Megatron allocates RoPE tables,
    pipeline receive buffers and its DDP grad buffers on ``torch.cuda.current_device()``, syncs the
    device around pipeline sends (``torch.cuda.synchronize()``), its DDP (0.17+) waits on
    ``torch.cuda.current_stream()``, and its schedules count tokens in ``torch.zeros([],
    device="cuda")``: here the first is the CPU, the second and the waits do nothing, and the
    schedules' zeros are made on the CPU."""
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # megatron-core 0.17+: DDP's grad sync waits on the current stream for CUDA-graph replays (none here)
    torch.cuda.current_stream = lambda *args, **kwargs: types.SimpleNamespace(
        wait_event=lambda event: None, wait_stream=lambda stream: None)

    class CpuTorch(types.ModuleType):  # torch as Megatron's schedules see it: zeros on the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, **kwargs)

    schedules.torch = CpuTorch("torch")


def setup(args) -> None:
    """``torch.distributed`` (one process, or the world torchrun sets) and Megatron's groups."""
    if not CUDA:
        install_cpu_shims()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if CUDA else "gloo")
    else:  # one process: no port to pick
        dist.init_process_group("nccl" if CUDA else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if CUDA:  # one GPU per rank (one node), before any collective
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    # on a CPU the tensor-parallel RNG tracker cannot hold CUDA generator states
    model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=not CUDA)
    torch.manual_seed(SEED)


def teardown() -> None:
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def tokens(args, step: int, g: int) -> torch.Tensor:
    """Global micro-batch ``g`` of step ``step``: ``[micro_batch, seq + 1]`` seeded token ids, a few
    ids far more often than others (activations with structure, not white noise)."""
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + g)
    probs = torch.arange(1, args.vocab + 1, dtype=torch.float64) ** -1.2
    return torch.multinomial(probs, args.micro_batch * (args.seq + 1), replacement=True,
                             generator=gen).view(args.micro_batch, args.seq + 1)


def build(args):
    """``(model, train_step)``: this rank's GPTModel (its layers under PP, its heads under TP) in
    Megatron's DistributedDataParallel, and ``train_step(iteration)``: one optimizer step over this
    rank's share of the ``--micro-batches``, returning the step's mean loss (None off the last stage)."""
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=args.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32, use_cpu_initialization=not CUDA)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq,
                   position_embedding_type="rope", pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage())
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
    cfg.no_sync_func, cfg.finalize_model_grads_func = model.no_sync, finalize_model_grads
    # Megatron-LM steps get_megatron_optimizer(...); a torch AdamW on the grads Megatron's DDP
    # reduced into main_grad keeps this example free of its mixed-precision (CUDA) state
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    device = torch.device("cuda") if CUDA else torch.device("cpu")
    # the local spec's attention takes an explicit mask: Megatron's boolean [1, 1, s, s], True = masked out
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(args.seq, device=device)[None]
    forward_backward = get_forward_backward_func()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if args.micro_batches % dp:
        raise ValueError(f"--micro-batches: {args.micro_batches} do not split over {dp} data-parallel ranks")
    mine = args.micro_batches // dp  # this data-parallel rank's micro-batches of each step

    def forward_step(data_iterator, model):
        ids = next(data_iterator).to(device)
        loss = model(ids[:, :-1], positions, mask, labels=ids[:, 1:])  # per-token loss [b, s] on the last stage

        def loss_func(output):
            mean = output.float().mean()
            return mean, {"lm loss": mean.detach().clone()}  # Megatron scales the loss in place
        return loss, loss_func

    def train_step(iteration: int) -> float | None:
        model.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        # this data-parallel rank's micro-batches of the global batch (every TP/PP rank of it the same)
        micro = [tokens(args, iteration, dp_rank * mine + m) for m in range(mine)]
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=model,
                               num_microbatches=mine, seq_length=args.seq,
                               micro_batch_size=args.micro_batch, forward_only=False)
        for p in params:
            p.grad = p.main_grad
        opt.step()
        if not ps.is_pipeline_last_stage():
            return None
        loss = torch.stack([d["lm loss"] for d in out]).mean()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        return float(loss) / dp

    return model, train_step


def report(records: list, losses: dict) -> None:
    """One line per emission among ``records`` (the logging rank's: every layer and query group)."""
    for step in sorted({r.step for r in records}):
        s = scalars([r for r in records if r.step == step])
        line = [f"step {step}"] + ([f"loss {losses[step]:.3f}"] if losses.get(step) is not None else [])
        for site in ("keys", "ffn"):
            pr = s.get(f"fastspec/stream/{site}/participation_ratio/mean")
            line += [f"{site} PR {pr:.2f}"] if pr is not None else []
        print("  ".join(line), flush=True)


def main(argv=None) -> None:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--emit-every", type=int, default=5, help="probe emission interval (steps)")
    args = p.parse_args(argv)
    setup(args)
    try:
        model, train_step = build(args)
        # under TP the FFN input is split over ranks: the stream leaves the FFN out (keys stay exact)
        probe_kwargs = {"emit_every": args.emit_every} | ({"ffn": False} if args.tp > 1 else {})
        stream = FastspecStream(model, probe_kwargs=probe_kwargs)
        losses = {}
        for iteration in range(1, args.steps + 1):
            losses[iteration] = train_step(iteration)
            report(stream.step(iteration), losses)  # every rank, after the optimizer step
        report(stream.finish(), losses)  # detaches; nothing new unless the last steps emitted
        if stream.emits:
            path = Path(args.out) / "fastspec_records.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(as_dicts(stream.records)))
            measured = stream.overhead()["measured"]  # this rank's probe work / its step time without it
            print(f"rank {dist.get_rank()}: {len(stream.records)} records -> {path}"
                  + (f"; probe overhead {measured:.1%} (its own estimate)" if measured is not None else ""))
    finally:
        teardown()


if __name__ == "__main__":
    main()
