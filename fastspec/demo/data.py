"""Demo text that needs no download: the running interpreter's own standard library source.

Tokens are bytes (vocabulary 256), so there is no tokenizer to fetch. Files are read in sorted
order from ``os.path.dirname(os.__file__)``, so the corpus is the same on every run of the
same Python version. The last ``eval_fraction`` of the bytes is held out for the fixed
evaluation batch: fixed batch, fixed seed, identical across conditions (the key-rank eval protocol
of docs/protocols.md).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from .. import _args

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int = 4_000_000) -> Tensor:
    """Up to ``max_bytes`` of concatenated ``*.py`` files of the stdlib as uint8 ``[N]``."""
    max_bytes = _args.integer("max_bytes", max_bytes, minimum=1)
    root = Path(os.path.dirname(os.__file__))
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no Python source found under {root} to train the demo on")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def split(tokens: Tensor, eval_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """(train, held-out) byte tensors; the held-out part is the tail of the corpus."""
    cut = int(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def random_windows(tokens: Tensor, batch: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """``[batch, seq_len]`` int64 windows at random offsets drawn from ``generator``."""
    if len(tokens) <= seq_len:
        raise ValueError(f"seq_len: {seq_len} is not shorter than the text ({len(tokens)} bytes)")
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=generator)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()]).long()


def eval_batch(held_out: Tensor, batch: int, seq_len: int, seed: int = 1234) -> dict[str, Tensor]:
    """The fixed evaluation batch: ``input_ids``/``attention_mask`` ``[batch, seq_len]``."""
    ids = random_windows(held_out, batch, seq_len, torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
