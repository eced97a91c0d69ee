"""Training harness of tests/test_integration_olmo_core.py: a tiny OLMo-core run with the fastspec callback.

Run under torchrun (gloo, CPU), e.g.::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_olmo_core_train.py --out DIR --fsdp

The run is examples/olmo_core_train.py's (:func:`build_trainer`): a 2-layer OLMo-core transformer
(d_model 64, 4 query heads / 2 KV heads, sequences of 32 tokens) on fixed synthetic tokens. Global
batch ``k`` is the same on any number of ranks (each rank takes its rows of it), the weights start
from the same seed, and every forward is one micro-batch of ``--micro`` sequences (one rank:
gradient accumulation), so a 1-rank run and a 2-rank run run the same forwards with the same model.
The probe streams keys and FFN (``ffn_rows="all"``, float64 products) with ``emit_every=2``.
``--eval-every N`` adds OLMo-core's ``EvaluatorCallback`` with a small held-out evaluator
(:class:`HeldOut`: other synthetic tokens, mean cross-entropy) every N steps and at startup: its
forwards (eval mode, ``no_grad``) must not reach the streaming totals.
Each rank writes ``DIR/rank{r}.json``: ``{"records": [...], "metrics": {step: {name: value}},
"world_size": w, "global_step": s, "tokens_seen": t}``, the callback's records as dicts and every
metric OLMo-core handed its loggers (captured by a callback at ``log_metrics``, as a logger sees them).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from olmo_core.distributed.utils import get_rank, get_world_size
from olmo_core.eval.evaluator import Evaluator
from olmo_core.train import prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback, EvaluatorCallback

from fastspec.integrations import as_dicts
from fastspec.integrations.olmo_core import FastspecCallback

_spec = importlib.util.spec_from_file_location(
    "olmo_core_train_example", Path(__file__).resolve().parents[1] / "examples" / "olmo_core_train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@dataclass
class MetricsCapture(Callback):
    """Keeps every metric the trainer hands its loggers (after all ``pre_log_metrics``)."""

    priority = -100  # after every other callback, as a logger sees them
    seen: dict = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        # a step can be logged twice (the final checkpoint's metrics come after the loop's): merge
        self.seen.setdefault(int(step), {}).update({k: float(v) for k, v in metrics.items()})


class HeldOut(Evaluator):
    """Mean cross-entropy on 2 batches of held-out synthetic tokens (of this rank's share)."""

    def __init__(self, instances: int, seq: int):
        gen = torch.Generator().manual_seed(example.SEED + 7)
        tokens = torch.randint(1, example.VOCAB, (2, instances, seq), generator=gen)
        super().__init__(name="held_out", batches=[{"input_ids": t} for t in tokens])
        self.evaluations: list[float] = []  # each evaluation's mean loss: that it ran
        self.reset_metrics()

    def update_metrics(self, batch, ce_loss, logits) -> None:
        self.total += float(ce_loss.sum())
        self.count += ce_loss.numel()

    def compute_metrics(self) -> dict:
        self.evaluations.append(self.total / max(self.count, 1))
        return {"ce": torch.tensor(self.evaluations[-1])}

    def reset_metrics(self) -> None:
        self.total, self.count = 0.0, 0


def parse(argv=None) -> argparse.Namespace:
    p = example.add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.set_defaults(steps=4)
    p.add_argument("--probe", default="on", choices=["on", "none"], help="none: no fastspec callback")
    p.add_argument("--emit-on", default="all", choices=["all", "rank0"])
    p.add_argument("--emit-every", type=int, default=2)
    p.add_argument("--sync", default=None, help="probe_kwargs['sync'] (default: follows --emit-on)")
    p.add_argument("--precision", default="exact", choices=["auto", "exact", "fast"],
                   help="the probe's covariance products (exact: float64, so ranks' merge order does not show)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="OLMo-core's evaluator callback every N steps (and at startup) on held-out tokens")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    prepare_training_environment(seed=example.SEED, backend="gloo")
    try:
        callbacks: dict = {"capture": MetricsCapture()}
        if args.probe != "none":
            kw = {"emit_every": args.emit_every, "ffn_rows": "all", "precision": args.precision}
            if args.sync is not None:
                kw["sync"] = args.sync
            callbacks["fastspec"] = FastspecCallback(probe_kwargs=kw, emit_on=args.emit_on)
        if args.eval_every is not None:
            callbacks["evaluator"] = EvaluatorCallback(
                evaluators=[HeldOut(args.instances // get_world_size(), args.seq)],
                eval_interval=args.eval_every, eval_on_startup=True)
        trainer = example.build_trainer(args, callbacks)
        trainer.fit()
        cb = trainer.callbacks.get("fastspec")  # the trainer's own copies of the callbacks
        out = {"records": as_dicts(cb.records) if cb is not None else [], "metrics": trainer.callbacks["capture"].seen,
               "world_size": get_world_size(), "global_step": trainer.global_step,
               "tokens_seen": trainer.global_train_tokens_seen,
               "evaluations": trainer.callbacks["evaluator"].evaluators[0].evaluations if args.eval_every else []}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{get_rank()}.json").write_text(json.dumps(out))
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main()
