"""``fastspec demo``: the flags of the QK-norm key-rank study and its run (:mod:`fastspec.demo`)."""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

# --quick: two layers of width 64 on short sequences, a handful of steps
QUICK = dict(d_model=64, layers=2, heads=4, kv_heads=2, seq_len=64, steps=8, batch_size=8,
             probe_every=4, warmup=2, corpus_bytes=400_000)
# What --quick costs, said in its help (one place, tests/test_commands.py checks the help uses it).
# Measured: 7.7 s on a shared 2-core AMD EPYC, start-up and report included. (It said "seconds".)
QUICK_TIME = "about 10 s on a 2-core CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..demo import CONDITIONS

    p.add_argument("--out", type=Path, default=None,
                   help="run folder (default: ./fastspec_runs/<timestamp>)")
    p.add_argument("--quick", action="store_true", help=f"tiny run ({QUICK_TIME}) that still writes every artifact")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--layers", type=int, help="decoder layers (default 4)")
    p.add_argument("--d-model", type=int, help="model width (default 128)")
    p.add_argument("--heads", type=int, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, help="key/value heads, GQA (default 2)")
    p.add_argument("--d-ff", type=int, help="FFN width (default 3 × d_model)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    p.add_argument("--steps", type=int, help="training steps per condition (default 120)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--probe-every", type=int, help="probe every N steps (default 10)")
    p.add_argument("--eval-sequences", type=int, help="sequences in the fixed eval batch (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed shared by every condition (default 0)")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS),
                   help="which conditions to train (default: all three)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _as_flag(message: str) -> str:
    """``"kv_heads: expected ..."`` (a DemoConfig field) -> ``"--kv-heads: expected ..."`` (its flag)."""
    m = re.match(r"(\w+): ", message)
    if not m:
        return message
    flag = {"out_dir": "out"}.get(m.group(1), m.group(1))
    return f"--{flag.replace('_', '-')}: " + message[m.end():]


def config_from_args(args: argparse.Namespace):
    """The :class:`DemoConfig` the flags describe (``--quick`` first, explicit flags override).

    Every flag is checked here, before anything is written, the device included (available
    here?); a bad one raises ValueError whose message starts with the flag, e.g.
    ``"--heads: expected a divisor of d_model (64), got 3"``."""
    from ..demo.models import ModelSize
    from ..demo.train import DemoConfig, check_device

    base = dict(QUICK) if args.quick else {}
    for name in ("layers", "d_model", "heads", "kv_heads", "d_ff", "seq_len", "steps", "batch_size", "lr",
                 "probe_every", "eval_sequences"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    size_keys = ("d_model", "layers", "heads", "kv_heads", "d_ff", "seq_len")
    size = {k: base.pop(k) for k in size_keys if k in base}
    if "d_ff" not in size:  # SwiGLU-style 3 × d_model unless given
        size["d_ff"] = 3 * size.get("d_model", ModelSize.d_model)
    try:
        cfg = DemoConfig(size=ModelSize(**size), seed=args.seed, device=args.device,
                         conditions=tuple(args.conditions), **base)
        check_device(cfg.device)
    except ValueError as e:
        raise ValueError(_as_flag(str(e))) from None
    return cfg


def run(args: argparse.Namespace) -> int:
    import torch

    from ..cli import show_tracebacks
    from ..demo.train import check_out_dir, run_demo
    from ..report import run_findings
    from ._paths import unwritable

    out = args.out or Path("fastspec_runs") / time.strftime("%Y%m%d-%H%M%S")
    try:  # user errors: one line on stderr, exit code 2, nothing written
        cfg = config_from_args(args)
        try:
            check_out_dir(out)
        except ValueError as e:
            raise ValueError(_as_flag(str(e))) from None
        # last: it creates the folder for a moment (and removes it), so only once all else holds;
        # without it, an --out nobody can create is a traceback after the header line
        reason = unwritable(out)
        if reason is not None:
            raise ValueError(f"--out: {reason}")
    except ValueError as e:
        print(f"fastspec demo: {e}", file=sys.stderr)
        return 2
    print(f"fastspec demo: {len(cfg.conditions)} conditions × {cfg.steps} steps, "
          f"d_model={cfg.size.d_model}, layers={cfg.size.layers}, device={cfg.device} -> {out}")
    try:
        run_dir, status = run_demo(cfg, out, progress=not args.no_progress)
    except (ValueError, torch.OutOfMemoryError) as e:  # e.g. a model too big for the device
        if show_tracebacks():
            raise
        print(f"fastspec demo: failed ({type(e).__name__}: {' '.join(str(e).split())}); "
              f"{out}/config.json says status failed", file=sys.stderr)
        return 1
    found = run_findings(run_dir)
    if found is not None:
        print(found.text())
    print(f"{status}: records, plots and report in {run_dir}/ (open {run_dir / 'report.md'})")
    return 0 if status == "completed" else 130
