"""``fastspec demo``: the QK-norm key-rank study (docs/protocols.md) in miniature, on no-download text.

Three small decoders (Qwen3 with learned Q/K-norm γ, the same with γ frozen at 1, Llama without
Q/K norm) train from one seed on the interpreter's stdlib source as bytes; the probe measures
post-RoPE key PR per head and FFN post-activation metrics on a fixed held-out batch; the run
folder gets records, plots and a Markdown report (see :mod:`fastspec.report`).

    fastspec demo                     # a few minutes on a 2-core CPU
    fastspec demo --quick             # about 10 s on a 2-core CPU, for tests
    fastspec demo --device cuda --layers 12 --d-model 768 --heads 12 --kv-heads 4 --seq-len 1024 --steps 3000
"""
from __future__ import annotations

import importlib

# the study's conditions (built in models.py); defined here, without torch, so that
# `fastspec demo --help` can list them without importing torch or transformers
CONDITIONS = ("qk_norm", "qk_norm_frozen", "no_qk_norm")

_LAZY = {"ModelSize": "models", "build_model": "models", "DemoConfig": "train", "run_demo": "train"}

__all__ = ["CONDITIONS", "DemoConfig", "ModelSize", "build_model", "run_demo"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
