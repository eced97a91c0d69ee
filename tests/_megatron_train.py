"""Training harness of the Megatron-core integration tests: a tiny GPTModel, Megatron's schedules.

A tiny GPTModel trained with Megatron's own pipeline schedules and the fastspec stream.

Run under torchrun (gloo, CPU), or as one plain process, e.g.::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_megatron_train.py \\
        --out DIR --steps 6 --pp 2 --micro-batches 2

Each step is one ``forward_backward_func`` (``megatron.core.pipeline_parallel.get_forward_backward_func``:
no pipelining, 1F1B, or interleaved 1F1B with ``--vp``) over ``--micro-batches`` micro-batches of 2
sequences of 16 tokens per data-parallel rank, then ``config.finalize_model_grads_func`` (Megatron's
``finalize_model_grads`` under ``--dp-wrap megatron``: its ``DistributedDataParallel`` all-reduces
the grads; ``--dp-wrap none``: a plain all-reduce of ``.grad`` over the data-parallel group, if there
is one) and a torch optimizer step (SGD, or Adam), then ``stream.step(iteration, tokens_seen)``.

The stream is ``fastspec.integrations.megatron.FastspecStream(model, probe_kwargs=...)``; with
``--api probe`` a plain ``fastspec.Probe`` over the model chunks stands in (``process_group`` = the
data-parallel group, ``tp_rank``, ``sync="all"``; attach, ``step``, ``records``): its records are
then those of this rank's layers (and, under TP, its query groups).

Data. The global batch of step ``s`` is ``dp × M`` micro-batches; data-parallel rank ``r`` runs
micro-batches ``g = r·M .. r·M + M - 1`` of it (``batch_of(s, g)``: seeded by ``(seed, s, g)``), so
2 data-parallel ranks × M micro-batches see the sequences of 1 rank × 2M micro-batches, whatever the
TP/PP layout (every TP and PP rank of a data-parallel rank runs the same micro-batches). The loss
of a micro-batch is the mean per-token loss over its real tokens; Megatron divides it by the
micro-batch count and averages the grads over data-parallel ranks, so both layouts take the same
optimizer steps. The weights come from ``--seed``: with ``--init global`` (default) each weight
matrix is drawn from its global name and cut to the rank's TP part (:func:`global_init`), so every
TP/PP/VP/DP layout trains the same model as one process (records equal to ~2e-7 relative under
DP/TP, where float32 sums are reordered; bit for bit under PP/VP); ``--init megatron`` keeps
Megatron's own init (the same on every DP rank, not across TP/PP layouts). ``--pad``: some sequences end in padding (``_megatron.batch``: masked as
keys in Megatron's boolean mask, left out of the loss and of the reference keys).
Stage inputs follow Megatron-LM's ``get_batch``: a stage without the embedding gets
``input_ids=None, position_ids=None``, one without the output layer ``labels=None``; every stage
gets the attention mask (``--stage-inputs all`` gives every stage everything).

Pipeline p2p: ``--batch-p2p`` follows Megatron-LM (``batch_p2p_comm`` without virtual stages,
``overlap_p2p_comm`` with them). Batched p2p under virtual stages on gloo with 2 stages (where
the previous and next stage are the same rank) trains a wrong model once the schedule has a
steady state (micro-batches > stages): the step-1 loss already differs and it turns NaN by step 5.

Checkpoints. ``--save DIR`` (after the last step) writes a Megatron distributed checkpoint
(``dist_checkpointing.save``) of ``{"model" (or "model0", "model1", ...): chunk.sharded_state_dict(),
"fastspec": stream.sharded_state_dict()}`` and each rank's torch optimizer (``train_rank{r}.pt``);
``--load DIR`` restores them (``stream.load_sharded_state_dict``) and trains the steps after it.

Reference keys. A forward pre-hook on every ``core_attention`` records the keys it receives
(``[s, b, groups, d_head]`` after RoPE, this rank's query groups) of the real tokens (the batch's
``keep``), only while a model chunk's own forward runs, so the forwards that activation
recomputation (``--recompute full|selective``) repeats in backward are not recorded again; per
(step, global layer = ``layer_number - 1``, global group = ``tp_rank · local groups + j``).
:func:`key_pr` turns the ranks' outputs into the key participation ratio of each (layer, group)
over an emission window (float64 ``torch.linalg.svdvals``), what the stream's ``keys`` records of
that emission should be.

Each rank writes ``DIR/rank{r}.json``::

    {"records": [...],            # the stream's records as dicts (fastspec.integrations.as_dicts)
     "keys": [{"step", "layer", "group", "rows": [[d_head floats], ...]}, ...],
     "losses": {step: global mean loss},     # the same on every rank (all-reduced)
     "layers": [global layers of this rank], "groups": [global query groups of this rank],
     "core_attention_calls": {"forward": n, "recomputed": m},  # m > 0: recomputation ran
     "rank", "world_size", "dp", "tp", "pp", "vp", "dp_rank", "tp_rank", "pp_rank",
     "api": "stream" | "probe", "tokens_per_step", "real_tokens": {step: n}, "seconds": s,
     "first_step": 1, or the resumed checkpoint's iteration + 1 (--load)}
"""
from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from collections import defaultdict
from functools import partial
from pathlib import Path

import _megatron as M
import torch

MICRO_BATCH = 2  # sequences per micro-batch


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank{r}.json")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None, help="model chunks per pipeline stage (interleaved 1F1B)")
    p.add_argument("--layers", type=int, default=None, help="default: 2, or pp × vp (one layer per chunk)")
    p.add_argument("--dp-wrap", default="megatron", choices=["none", "megatron"],
                   help="megatron: Megatron's DistributedDataParallel + finalize_model_grads")
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective"])
    p.add_argument("--micro-batches", type=int, default=2, help="per data-parallel rank per step")
    p.add_argument("--emit-every", type=int, default=2)
    p.add_argument("--ffn", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the FFN too (default: on; under TP its rows are gathered)")
    p.add_argument("--pad", action="store_true", help="some sequences end in padding")
    p.add_argument("--stage-inputs", default="megatron", choices=["megatron", "all"])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-p2p", action=argparse.BooleanOptionalAction, default=None,
                   help="TransformerConfig.batch_p2p_comm (else overlap_p2p_comm); default: Megatron-LM's, "
                        "batched without virtual stages, overlapped with them")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--init", default="global", choices=["global", "megatron"],
                   help="global: every weight matrix drawn from its global name (the same model in every "
                        "TP/PP/VP layout); megatron: Megatron's own initialization")
    p.add_argument("--precision", default="exact", choices=["auto", "exact", "fast"])
    p.add_argument("--api", default="stream", choices=["stream", "probe", "none"],
                   help="stream: FastspecStream; probe: a plain Probe over the chunks; none: no probe")
    p.add_argument("--log-rank", type=int, default=None, help="FastspecStream(log_rank=...)")
    p.add_argument("--save", default=None, help="at the last step, save a Megatron distributed checkpoint here: "
                   "the model chunks' and the stream's sharded state dicts (+ each rank's optimizer, torch.save)")
    p.add_argument("--load", default=None, help="resume from a --save folder: its iteration + 1 .. --steps")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = max(2, args.pp * (args.vp or 1))
    if args.batch_p2p is None:
        args.batch_p2p = args.vp is None
    return args


# ------------------------------------------------------------------ data
def pad_of(step: int, g: int) -> tuple[int, int]:
    """Padding at the end of the 2 sequences of global micro-batch ``g`` of step ``step``."""
    return (3 if (g + step) % 2 == 0 else 0, 5 if g % 3 == 1 else 0)


def batch_of(seed: int, step: int, g: int, pad: bool) -> dict:
    """Global micro-batch ``g`` of step ``step``: the same whatever the parallel layout."""
    return M.batch(seed * 100_003 + step * 1_009 + g, b=MICRO_BATCH, pad=pad_of(step, g) if pad else ())


# ------------------------------------------------------------------ model
def unwrap(module):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers."""
    while type(module).__module__.startswith("megatron.core.distributed") or type(module).__name__ == "Float16Module":
        module = module.module
    return module


def build(args, cfg):
    """This rank's model chunks (GPTModels; ``vp`` of them under virtual pipeline parallelism)."""
    from megatron.core import parallel_state as ps

    chunks = []
    for i in range(args.vp or 1):
        vp_stage = i if args.vp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(M.gpt(cfg, pre_process=pre, post_process=post, vp_stage=vp_stage))
    return chunks


def global_init(chunks, seed: int, tp: int, tp_rank: int) -> None:
    """Every weight matrix (2-D and up) drawn from a generator seeded by its global name (its
    layer's global number), at the full size and then cut to this rank's tensor-parallel part:
    the same model in every TP/PP/VP layout. Vectors (norms, biases) keep Megatron's
    layout-independent init (ones, zeros)."""
    with torch.no_grad():
        for chunk in chunks:
            chunk = unwrap(chunk)
            numbers = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                       for i, layer in enumerate(chunk.decoder.layers)}
            for name, p in chunk.named_parameters():
                if p.dim() < 2:
                    continue
                for local, whole in numbers.items():
                    if name.startswith(local):
                        name = whole + name[len(local):]
                        break
                shape = list(p.shape)
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
                if dim >= 0:
                    shape[dim] *= tp
                g = torch.Generator().manual_seed(seed * 7_919 + zlib.crc32(name.encode()))
                full = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
                p.copy_(full.chunk(tp, dim)[tp_rank] if dim >= 0 else full)


class KeyCapture:
    """The post-RoPE keys each ``core_attention`` receives in the model chunks' own forwards (not
    the recomputation in backward), real tokens only: ``rows[(step, layer, group)]``."""

    def __init__(self, chunks, tp_rank: int):
        self.tp_rank, self.depth, self.data, self.step = tp_rank, 0, None, None
        self.rows: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
        self.layers: set[int] = set()
        self.groups: set[int] = set()
        self.calls = {"forward": 0, "recomputed": 0}  # core_attention calls in forwards / outside them
        for chunk in chunks:
            chunk.register_forward_pre_hook(self._enter)
            chunk.register_forward_hook(self._exit, always_call=True)
            for layer in chunk.decoder.layers:
                self.layers.add(layer.layer_number - 1)
                layer.self_attention.core_attention.register_forward_pre_hook(partial(self._key, layer.layer_number - 1))

    def _enter(self, module, args):
        self.depth += 1

    def _exit(self, module, args, output):
        self.depth -= 1

    def _key(self, layer: int, module, args):
        if self.depth == 0 or self.step is None:  # recomputation in backward
            self.calls["recomputed"] += 1
            return
        self.calls["forward"] += 1
        key = args[1].detach()  # [s, b, groups, d_head]
        keep = self.data["keep"]  # [b, s]
        rows = key.transpose(0, 1)[keep].double()  # [n, groups, d_head]
        for j in range(rows.shape[1]):
            g = self.tp_rank * rows.shape[1] + j
            self.groups.add(g)
            self.rows[(self.step, layer, g)].append(rows[:, j].clone())

    def as_list(self) -> list[dict]:
        return [{"step": s, "layer": l, "group": g, "rows": torch.cat(v).tolist()}
                for (s, l, g), v in sorted(self.rows.items())]


# ------------------------------------------------------------------ stream
def make_stream(args, chunks, ps):
    """``(api, stream)``: FastspecStream, or a plain Probe standing in for it."""
    kw = {"emit_every": args.emit_every, "ffn": args.ffn, "precision": args.precision}
    if args.ffn:
        kw["ffn_rows"] = "all"
    api = args.api
    if api == "none":
        return api, None
    if api == "stream":
        from fastspec.integrations.megatron import FastspecStream

        extra = {} if args.log_rank is None else {"log_rank": args.log_rank}
        return "stream", FastspecStream(chunks if len(chunks) > 1 else chunks[0], probe_kwargs=kw, **extra)
    import fastspec

    probe = fastspec.Probe(chunks, process_group=ps.get_data_parallel_group(with_context_parallel=True),
                           tp_rank=ps.get_tensor_model_parallel_rank(), sync="all", **kw)
    probe.attach()
    return "probe", probe


def stream_step(api, stream, iteration, tokens_seen):
    if api in ("stream", "probe"):  # FastspecStream.step / Probe.step: the same call
        stream.step(iteration, tokens_seen=tokens_seen)


def stream_finish(api, stream):
    if api == "stream":
        stream.finish()
        return list(stream.records)
    if api == "probe":
        stream.detach()
        return [r for r in stream.records() if r.protocol == "stream"]
    return []


# ------------------------------------------------------------------ checkpoint
def _sharded(chunks, stream, api) -> dict:
    """Megatron-LM's layout: ``model`` (or ``model0``, ``model1``, ... for virtual stages) and,
    beside them, the stream's entry."""
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = {name: unwrap(c).sharded_state_dict() for name, c in zip(names, chunks)}
    if api == "stream":
        state["fastspec"] = stream.sharded_state_dict()
    return state


def save_checkpoint(folder: str, iteration: int, chunks, opt, stream, api, rank: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(folder)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(chunks, stream, api), str(path))
    extra = {"iteration": iteration, "optimizer": opt.state_dict()}
    if api == "probe":
        extra["probe"] = stream.state_dict()
    torch.save(extra, path / f"train_rank{rank}.pt")
    dist.barrier()


def load_checkpoint(folder: str, chunks, opt, stream, api, rank: int) -> int:
    """Restores what :func:`save_checkpoint` wrote; returns its iteration."""
    from megatron.core import dist_checkpointing

    path = Path(folder)
    loaded = dist_checkpointing.load(_sharded(chunks, stream, api), str(path))
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for name, c in zip(names, chunks):
        unwrap(c).load_state_dict(loaded[name])
    extra = torch.load(path / f"train_rank{rank}.pt", weights_only=False)
    opt.load_state_dict(extra["optimizer"])
    if api == "stream":
        stream.load_sharded_state_dict(loaded["fastspec"])
    elif api == "probe":
        stream.load_state_dict(extra["probe"])
    return int(extra["iteration"])


# ------------------------------------------------------------------ training
def loss_func(keep, output):
    """Mean per-token loss over the real tokens of a micro-batch (``output``: [b, s])."""
    k = keep.to(output.dtype)
    loss = (output * k).sum() / k.sum()
    return loss, {"lm loss": loss.detach().clone()}  # Megatron divides the loss in place


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    M.init(args.tp, args.pp, args.vp, args.seed)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)

    cfg = M.config(layers=args.layers, recompute=None if args.recompute == "none" else args.recompute,
                   tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                   virtual_pipeline_model_parallel_size=args.vp,
                   batch_p2p_comm=args.batch_p2p, overlap_p2p_comm=not args.batch_p2p)
    chunks = build(args, cfg)
    if args.init == "global":
        global_init(chunks, args.seed, args.tp, tp_rank)
    capture = KeyCapture(chunks, tp_rank)
    params = [p for c in chunks for p in c.parameters()]

    if args.dp_wrap == "megatron":
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        model = [DistributedDataParallel(cfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        cfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
    else:
        model = chunks

        def all_reduce_grads(model_chunks, num_tokens=None, **kw):
            if dp > 1:
                for p in params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=dp_group)
                        p.grad.div_(dp)

        cfg.finalize_model_grads_func = all_reduce_grads

    opt = (torch.optim.SGD(params, lr=args.lr) if args.optimizer == "sgd"
           else torch.optim.Adam(params, lr=args.lr))
    api, stream = make_stream(args, model, ps)
    forward_backward = get_forward_backward_func()
    n_chunks = len(chunks)
    tokens_per_step = dp * args.micro_batches * MICRO_BATCH * M.SEQ
    losses, real_tokens = {}, {}

    def forward_step(data_iterator, chunk):
        data = next(data_iterator)
        capture.data = data
        inner = unwrap(chunk)
        ids, pos, labels = data["input_ids"], data["position_ids"], data["labels"]
        if args.stage_inputs == "megatron":
            ids, pos = (ids, pos) if inner.pre_process else (None, None)
            labels = labels if inner.post_process else None
        out = chunk(ids, pos, data["attention_mask"], labels=labels)
        return out, partial(loss_func, data["keep"])

    first = 1
    if args.load is not None:
        first = load_checkpoint(args.load, chunks, opt, stream, api, rank) + 1
    start = time.perf_counter()
    for it in range(first, args.steps + 1):
        micro = [batch_of(args.seed, it, dp_rank * args.micro_batches + m, args.pad)
                 for m in range(args.micro_batches)]
        real = torch.tensor(float(sum(int(b["keep"].sum()) for b in micro)))
        dist.all_reduce(real, group=dp_group)
        real_tokens[it] = int(real)
        iters = [iter(micro) for _ in range(n_chunks)]
        if args.dp_wrap == "megatron":
            for m in model:
                m.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)
        capture.step = it
        out = forward_backward(forward_step_func=forward_step, data_iterator=iters if n_chunks > 1 else iters[0],
                               model=model, num_microbatches=args.micro_batches, seq_length=M.SEQ,
                               micro_batch_size=MICRO_BATCH, forward_only=False)
        capture.step = None
        if args.dp_wrap == "megatron":
            for p in params:
                p.grad = p.main_grad if getattr(p, "main_grad", None) is not None else None
        opt.step()
        # the step's mean loss over the global batch: on the last stage, summed over data-parallel ranks
        loss = torch.tensor(sum(float(d["lm loss"]) for d in out) if out else 0.0, dtype=torch.float64)
        dist.all_reduce(loss)  # every rank; only last-stage TP ranks contribute (tp of them)
        losses[it] = float(loss) / (args.tp * dp * args.micro_batches)
        stream_step(api, stream, it, tokens_per_step * it)
    seconds = time.perf_counter() - start
    if args.save is not None:
        save_checkpoint(args.save, args.steps, chunks, opt, stream, api, rank)

    records = stream_finish(api, stream)
    from fastspec.integrations import as_dicts

    out = {"records": as_dicts(records), "keys": capture.as_list(), "losses": losses,
           "layers": sorted(capture.layers), "groups": sorted(capture.groups), "core_attention_calls": capture.calls,
           "rank": rank, "world_size": world, "dp": dp, "tp": args.tp, "pp": args.pp, "vp": args.vp,
           "dp_rank": dp_rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "api": api,
           "tokens_per_step": tokens_per_step, "real_tokens": real_tokens, "seconds": seconds,
           "first_step": first}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# ------------------------------------------------------------------ for the tests
def key_pr(outs: list[dict], steps) -> dict[tuple[int, int], float]:
    """``{(layer, group): participation ratio}`` of the keys all ranks recorded in ``steps`` (the
    steps of one emission window): float64 ``svdvals`` of each (layer, group)'s rows, the rows of
    every data-parallel rank together (a TP or PP rank holds other groups or layers)."""
    from fastspec.metrics import participation_ratio

    steps = set(steps)
    rows: dict[tuple[int, int], list] = defaultdict(list)
    for out in outs:
        for k in out["keys"]:
            if k["step"] in steps:
                rows[(k["layer"], k["group"])].extend(k["rows"])
    return {lg: float(participation_ratio(torch.linalg.svdvals(torch.tensor(r, dtype=torch.float64))))
            for lg, r in sorted(rows.items())}


def key_rows(outs: list[dict], steps) -> dict[tuple[int, int], int]:
    """``{(layer, group): rows}`` all ranks recorded in ``steps``: each emission's ``n``."""
    steps = set(steps)
    n: dict[tuple[int, int], int] = defaultdict(int)
    for out in outs:
        for k in out["keys"]:
            if k["step"] in steps:
                n[(k["layer"], k["group"])] += len(k["rows"])
    return dict(n)


if __name__ == "__main__":
    main()
