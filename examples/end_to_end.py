"""fastspec end to end: eval measurements and streaming during a training run, a table, plots.

Runs as is on a CPU in under a minute, with no download: a small Llama built from its config
(transformers), trained on the bytes of Python's own standard-library source (byte-level
tokens, vocabulary 256). Swap in your model, tokenizer and data; the fastspec lines stay the same.

    python examples/end_to_end.py                      # writes ./fastspec_example/
    python examples/end_to_end.py --steps 60 --out /tmp/fs

What it shows, in order:

1. ``Probe(model)``: key rank per KV head (post-RoPE keys, singular values) and FFN inputs
   (eigenvalues of their covariance), found by the model family, nothing edited in the model;
2. ``probe.measure(eval_batch, step=...)``: the eval protocol, the same held-out batch every
   ``--eval-every`` steps (records with ``protocol="eval"``);
3. ``with probe.streaming(): ... probe.step(step)``: the training tokens themselves, summed
   as they pass and emitted every ``emit_every`` steps (``protocol="stream"``);
4. ``probe.to_dataframe()`` and :mod:`fastspec.analysis`: tidy records and per-layer tables;
5. :mod:`fastspec.plots`: trajectories, a layer × step heatmap and the final spectra
   (``probe.spectra(batch)`` goes straight into ``spectrum_plot``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fastspec
from fastspec import analysis, plots


def byte_batches(seq_len: int, batch_size: int, seed: int):
    """Byte-level token windows of Python's stdlib source: a held-out eval batch (the last tenth
    of the text) and an endless iterator of random training batches (the first nine tenths)."""
    text = b"".join(Path(m.__file__).read_bytes() for m in (json, argparse, torch.nn.modules.module))
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = len(tokens) * 9 // 10
    train, held_out = tokens[:cut], tokens[cut:]
    eval_ids = held_out[: 4 * seq_len].view(4, seq_len)
    gen = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            start = torch.randint(len(train) - seq_len, (batch_size,), generator=gen)
            yield torch.stack([train[s: s + seq_len] for s in start.tolist()])

    return {"input_ids": eval_ids}, batches()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--eval-every", type=int, default=20, help="eval measurement every N steps (default 20)")
    p.add_argument("--out", type=Path, default=Path("fastspec_example"), help="output folder")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    eval_batch, train_batches = byte_batches(seq_len=128, batch_size=8, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # 1. the probe: keys per KV head (sv convention) and FFN inputs (eig), per layer
    probe = fastspec.Probe(model, emit_every=10)
    # 2. eval protocol before training: the reference every later measurement compares with
    #    (measure() runs the batch in eval mode under no_grad, then restores train mode)
    probe.measure(eval_batch, step=0)

    # 3. streaming: the training forwards are summed as they pass, emitted every 10 steps
    tokens = 0
    with probe.streaming():
        for step in range(1, args.steps + 1):
            ids = next(train_batches)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += ids.numel()
            probe.step(step, tokens_seen=tokens)
            if step % args.eval_every == 0 or step == args.steps:  # leaves the streaming sums alone
                probe.measure(eval_batch, step=step, tokens_seen=tokens)

    # 4. tidy records: one row per (step, site, layer, head, metric, protocol)
    df = probe.to_dataframe()
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "records.csv", index=False)
    layers = analysis.layer_table(df, "keys", "participation_ratio", which="final", protocol="eval")
    first = analysis.layer_table(df, "keys", "participation_ratio", which="initial", protocol="eval")
    print("key PR per layer (eval protocol, mean over KV heads): step 0 -> last")
    for layer in layers.index:
        print(f"  layer {layer}: {first.loc[layer].iloc[0]:6.2f} -> {layers.loc[layer].iloc[0]:6.2f}"
              f"  (at most {config.hidden_size // config.num_attention_heads}, the head width)")

    # 5. plots: each function returns a matplotlib Figure
    figures = {
        "key_pr_eval": plots.trajectory_plot(df, "keys", "participation_ratio", x="step", protocol="eval"),
        "key_pr_stream": plots.trajectory_plot(df, "keys", "participation_ratio", x="step", protocol="stream"),
        "ffn_pr_heatmap": plots.layer_heatmap(df, "ffn", "participation_ratio", protocol="eval"),
    }
    spectra = probe.spectra(eval_batch)  # {(site, layer): [heads, D] for keys, [D] for FFN}
    for site in ("keys", "ffn"):  # σ of the keys, λ of the FFN inputs: one figure each
        figures[f"final_spectra_{site}"] = plots.spectrum_plot({k: v for k, v in spectra.items() if k[0] == site})
    for name, fig in figures.items():
        plots.save(fig, args.out / f"{name}.png")
    probe.close()
    print(f"{len(df)} records and {len(figures)} plots in {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
