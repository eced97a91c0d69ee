"""What ``fastspec analyze`` costs against the plain forward passes over the same tokens, one JSON file.

The analysis of one model (load, tokenize, forward with the probe, eigensolve, write; the report
left out, it is per folder, not per model) is timed against two baselines over the very same
token batches, in the same process, alternating (round-robin, so drift hits all sides alike):

* ``causal_lm_forward``: ``AutoModelForCausalLM`` forward of every batch under ``no_grad``: the
  loop a user writes by hand (load, tokenize, forward, measure), the forward part of it;
* ``base_forward``: the base model's forward (no language-model head), which is what analyze
  itself runs, so ``analysis / base_forward`` is the probe's whole cost including loading.

The model is a 100M-class Llama config (d_model 768, 12 layers, 12 query / 4 KV heads of 64,
d_ff 2048, vocabulary 32000: 125M parameters), random weights saved with ``save_pretrained``; the
text is the built-in corpus through a byte-level tokenizer built offline. CPU, 1 thread by default.

    python benchmarks/analyze_time.py OUT.json            # committed as benchmarks/results/<machine>-<date>-analyze-time.json
    python benchmarks/analyze_time.py OUT.json --quick    # a tiny config, seconds (tests/test_analyze_run.py runs it)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (ids 0..255 + one end-of-text), built offline."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spell = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(spell))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def write_model(folder: Path, config: dict) -> int:
    """A random ``LlamaForCausalLM`` of ``config`` and the tokenizer saved in ``folder``; its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def plain_forward(folder: Path, ids, batch_size: int, causal: bool) -> float:
    """Seconds of the forward passes alone (model already loaded, as a by-hand loop would)."""
    import torch
    import transformers

    from fastspec.checkpoints.run import _quiet_transformers

    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    with _quiet_transformers():  # the base model leaves the head's weights unused, and says so
        model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in ids.split(batch_size):
            model(input_ids=b, attention_mask=torch.ones_like(b))
    return time.perf_counter() - t0


def analysis(folder: Path, out: Path, tokens: int, seq_len: int, batch_size: int) -> tuple[float, dict]:
    """Seconds of ``fastspec.analyze`` of one model (no report) and its per-phase times."""
    from fastspec.checkpoints import analyze

    t0 = time.perf_counter()
    analyze(folder, out, tokens=tokens, seq_len=seq_len, batch_size=batch_size, device="cpu", progress=False,
            report=False, log=open("/dev/null", "w"))
    total = time.perf_counter() - t0
    meta = json.loads(next((out / "models").glob("*/meta.json")).read_text())
    return total, meta["times"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a tiny config and 256 tokens (a smoke run)")
    args = p.parse_args(argv)
    import torch

    from fastspec.checkpoints.text import pack, read_documents
    from fastspec.sysinfo import environment

    torch.set_num_threads(args.threads)
    config = QUICK if args.quick else FULL
    tokens, seq_len = (256, 64) if args.quick else (args.tokens, args.seq_len)
    rows = {"analysis": [], "causal_lm_forward": [], "base_forward": []}
    phases = []
    with tempfile.TemporaryDirectory(prefix="fastspec-analyze-time-") as tmp:
        folder = Path(tmp) / "model"
        params = write_model(folder, config)
        docs, _ = read_documents(None)
        ids = pack(byte_tokenizer(), docs, tokens=tokens, seq_len=seq_len, seed=0)
        for i in range(args.repeats):
            total, times = analysis(folder, Path(tmp) / f"out{i}", tokens, seq_len, args.batch_size)
            rows["analysis"].append(total)
            phases.append(times)
            rows["causal_lm_forward"].append(plain_forward(folder, ids, args.batch_size, causal=True))
            rows["base_forward"].append(plain_forward(folder, ids, args.batch_size, causal=False))
            print(f"repeat {i + 1}/{args.repeats}: analysis {total:.1f} s, causal-LM forward "
                  f"{rows['causal_lm_forward'][-1]:.1f} s, base forward {rows['base_forward'][-1]:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    phase_med = {k: statistics.median(t[k] for t in phases) for k in phases[0]}
    # finding the model, reading the text, the records table and config.json: the rest of the total
    phase_med["other"] = med["analysis"] - sum(phase_med.values())
    result = {
        "what": "fastspec analyze of one model vs the plain forward passes over the same tokens",
        "environment": environment(), "threads": args.threads, "config": config, "parameters": params,
        "tokens": int(ids.numel()), "seq_len": seq_len, "batch_size": args.batch_size, "repeats": args.repeats,
        "seconds": rows, "median_s": med, "analysis_phases_median_s": phase_med,
        "ratio_vs_causal_lm_forward": med["analysis"] / med["causal_lm_forward"],
        "ratio_vs_base_forward": med["analysis"] / med["base_forward"],
        "goal": "analysis <= 1.15 x the plain forward passes",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"analysis / causal-LM forward = {result['ratio_vs_causal_lm_forward']:.3f}, "
          f"analysis / base forward = {result['ratio_vs_base_forward']:.3f}; phases (median s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in phase_med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
