"""``fastspec plan``: the probe's memory on every rank of a parallel run, before the launch.

Reads a Hugging Face ``config.json`` (or the folder holding one) and runs the same planner the
probe runs at construction (:mod:`fastspec.probe.plan`) for every rank of a ``--dp × --tp × --pp``
layout under ``--memory`` a rank: which layout the FFN layers get (every layer on every rank,
each kept by one rank, float32 totals, layers taking turns), and per kind of rank the probe's
peak memory (accumulators and the capture and emission workspace), the FFN layers it keeps,
the rows it samples per step, the bytes it moves per step and per emission, and the predicted
seconds of one emission's eigensolves (labelled: a model, not a measurement). ``--json`` prints
the same as one object (``memory_peak_bytes``: the largest over ranks; ``ffn_every``: windows
between two measurements of the same FFN layer). A budget too small raises the probe's own
one-line error. docs/scale.md explains the layouts and the figures.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SITES = ("keys", "queries", "ffn")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="a Hugging Face config.json, or the folder holding one")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="what the probe may hold on a rank: bytes, a size such as 4GB or 512MiB, or a fraction "
                        "of --gpu-memory (default: the probe's default, 5%% of the GPU)")
    p.add_argument("--gpu-memory", default="80GB", metavar="SIZE",
                   help="memory of one GPU, for fractions and the default (default 80GB: an H100)")
    p.add_argument("--budget", type=float, default=None, metavar="F",
                   help="the probe's overhead budget (Probe(budget=)): sizes the FFN token sampling")
    p.add_argument("--tokens", type=int, default=16384, metavar="N",
                   help="tokens each data-parallel rank trains on per optimizer step (default 16384)")
    p.add_argument("--sites", default="keys,ffn", help=f"comma-separated, of {', '.join(SITES)} (default keys,ffn)")
    p.add_argument("--ffn-convention", default="eig", choices=("eig", "sv"))
    p.add_argument("--ffn-rows", default="auto", metavar="K",
                   help="FFN token sampling as Probe(ffn_rows=): auto, all, or every K-th token")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the activations' dtype (default bf16)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where the probe runs: its solves' precision and the default kernels' buffers differ "
                        "(default cuda)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _config(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"config: no file {p} (a Hugging Face config.json, or the folder holding one)")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config: {p} is not a JSON file ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config: {p} does not hold a JSON object")
    return cfg


def _arch(cfg: dict) -> dict:
    from ..checkpoints.sources import config_architecture

    arch = config_architecture(cfg)
    missing = [k for k in ("num_layers", "hidden_size", "num_heads", "head_dim", "d_ff") if not arch.get(k)]
    if missing:
        raise ValueError(f"config: no {', '.join(missing)} in it (a decoder's config.json: num_hidden_layers, "
                         f"hidden_size, num_attention_heads, intermediate_size)")
    arch["vocab_size"] = cfg.get("vocab_size") or 0
    return arch


def _sampling(arch: dict, args, row_step: int = 1) -> int:
    """Every k-th token the FFN sites stream, as ``Probe(ffn_rows=...)`` chooses it (the FLOP model of
    ``fastspec.probe.ffn_sampling``, with the parameters the config implies)."""
    from ..probe import ffn_sampling, plan

    k = ffn_sampling.check_ffn_rows("--ffn-rows", args.ffn_rows if args.ffn_rows in ("auto", "all")
                                    else _int("--ffn-rows", args.ffn_rows))
    if k == "all":
        return row_step
    if k != "auto":
        return row_step * k
    share = ffn_sampling.ffn_flop_share([arch["d_ff"]] * arch["num_layers"], plan.matmul_parameters(arch))
    target = ffn_sampling.DEFAULT_FFN_SHARE if args.budget is None else args.budget
    return row_step * ffn_sampling.auto_ffn_rows(share, target, row_step)


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an int, got {value!r}") from None


def run(args: argparse.Namespace) -> int:
    from ..probe import plan

    for name in ("dp", "tp", "pp", "tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.budget is not None and not 0 < args.budget < 1:
        raise ValueError(f"--budget: expected a fraction in (0, 1), got {args.budget}")
    sites = tuple(s.strip() for s in args.sites.split(",") if s.strip())
    bad = [s for s in sites if s not in SITES]
    if bad or not sites:
        raise ValueError(f"--sites: expected some of {', '.join(SITES)}, got {args.sites!r}")
    gpu = plan.memory_arg(args.gpu_memory)
    if gpu[0] != "bytes":
        raise ValueError(f"--gpu-memory: expected a size such as 80GB, got {args.gpu_memory!r}")
    memory = plan.memory_arg(_number(args.memory)) if args.memory is not None else ("fraction", plan.DEFAULT_FRACTION)
    budget = int(memory[1]) if memory[0] == "bytes" else int(memory[1] * gpu[1])
    arch = _arch(_config(args.config))
    if arch["num_layers"] < args.pp:
        raise ValueError(f"--pp: {args.pp} stages for {arch['num_layers']} layers")
    out = plan.report(arch, dp=args.dp, tp=args.tp, pp=args.pp, budget=budget, tokens=args.tokens,
                      ffn_row_step=_sampling(arch, args), sites=sites, convention=args.ffn_convention,
                      itemsize=DTYPES[args.dtype], device=args.device)
    out = {"config": str(args.config), "model_type": arch.get("model_type"), "layers": arch["num_layers"],
           "d_ff": arch["d_ff"], **out}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out)
    return 0


def _number(text: str):
    """``--memory``: a fraction (``0.1``) as a float, anything else as the probe takes it."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if 0 < value <= 1 and "." in text else int(value) if value.is_integer() else text


def _print(out: dict) -> None:
    from ..probe.plan import human

    h = human
    layouts = ", ".join(f"{m} ({t} totals)" for m, t in out["layouts"]) or "no FFN site"
    print(f"{out['model_type'] or 'model'}: {out['layers']} layers, d_ff {out['d_ff']}; dp {out['dp']} × tp {out['tp']} "
          f"× pp {out['pp']}; budget {h(out['budget_bytes'])} a rank")
    print(f"FFN layout: {layouts}; each FFN layer measured every {out['ffn_every']} emission window(s); "
          f"FFN accumulators all-reduced: {'yes' if out['ffn_all_reduced'] else 'no'}")
    print(f"FFN sampling: 1 token in {out['ffn_row_step']} of the {out['tokens_per_step']} each data-parallel "
          f"rank trains on per step")
    print(f"peak probe memory on the busiest rank: {h(out['memory_peak_bytes'])} (emission workspace included)")
    cols = ("ranks", "stages", "FFN layers kept", "per window", "accumulators", "capture ws", "emission ws", "peak",
            "FFN rows/step", "moved/step", "moved/emission", "solve s (predicted)")
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in out["ranks"]:
        cells = (r["ranks"], ",".join(map(str, r["stages"])), len(r["ffn_layers"]), r["ffn_layers_per_window"],
                 h(r["small_bytes"] + r["ffn_bytes"]), h(r["capture_workspace_bytes"]),
                 h(r["emission_workspace_bytes"]), h(r["peak_bytes"]), r["ffn_rows_per_step"],
                 h(r["bytes_per_step"]), h(r["bytes_per_emission"]), r["solve_seconds_predicted"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
