"""``fastspec analyze MODEL...``: key and FFN spectra of pretrained models or a series of
checkpoints, written to an output folder (:func:`fastspec.checkpoints.analyze`)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULTS = dict(tokens=32768, seq_len=1024, batch_size=4, seed=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..checkpoints.text import TEXT_FORMATS  # no torch there: --help stays light
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="a Hugging Face model folder, a .gguf file, or a folder of checkpoints "
                        "(checkpoint-*, step*, global_step*, or sub-folders holding a config), ordered by step")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: ./fastspec_runs/analyze-<timestamp>); one holding finished "
                        "models of the same settings is resumed")
    p.add_argument("--text", default=None,
                   help="a text file (any UTF-8 file; .jsonl: JSON lines) or a folder of .txt/.jsonl files "
                        "(default: the built-in corpus, offline)")
    p.add_argument("--text-field", default="text", help="the field of each .jsonl line holding its text (default text)")
    p.add_argument("--text-format", default="auto", choices=TEXT_FORMATS,
                   help="how --text's files are read: auto (.jsonl files as JSON lines, others as plain text), "
                        "plain or jsonl (every file so, whatever its name) (default auto)")
    p.add_argument("--tokens", type=int, default=DEFAULTS["tokens"],
                   help=f"tokens measured per model, the same for every checkpoint (default {DEFAULTS['tokens']})")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help=f"tokens per sequence (default {DEFAULTS['seq_len']})")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help=f"sequences per forward (default {DEFAULTS['batch_size']})")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed choosing the sequences (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--sites", nargs="+", default=None, choices=("keys", "keys_prerope", "queries", "ffn"),
                   help="what to measure (default: all the model's family allows)")
    p.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ..checkpoints import SITES, analyze

    out = args.out or Path("fastspec_runs") / time.strftime("analyze-%Y%m%d-%H%M%S")
    try:
        result = analyze(args.models, out, text=args.text, text_field=args.text_field,
                         text_format=args.text_format, tokens=args.tokens,
                         seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed, device=args.device,
                         dtype=args.dtype, sites=tuple(args.sites or SITES), progress=not args.no_progress,
                         report=not args.no_report)
    except KeyboardInterrupt:
        print(f"fastspec analyze: interrupted; the finished models are in {out}/ (run the same command to "
              f"resume)", file=sys.stderr)
        return 130
    done = len(result.measured) + len(result.skipped)
    where = f"open {result.report}" if result.report.is_file() else f"records in {out}/"
    print(f"{result.status}: {done} model(s) in {out}/ ({where})")
    return 0
