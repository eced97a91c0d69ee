"""``fastspec demo``: the QK-norm key-rank study (docs/protocols.md) in miniature, on no-download text.

Three small decoders (Qwen3 with learned Q/K-norm γ, the same with γ frozen at 1, Llama without
Q/K norm) train from one seed on the interpreter's stdlib source as bytes; the probe measures
post-RoPE key PR per head and FFN post-activation metrics on a fixed held-out batch; the run
folder gets records, plots and a Markdown report (see :mod:`fastspec.report`).

    fastspec demo                     # a few minutes on a 2-core CPU
    fastspec demo --quick             # seconds, for tests
    fastspec demo --device cuda --layers 12 --d-model 768 --heads 12 --kv-heads 4 --seq-len 1024 --steps 3000
"""
from .models import CONDITIONS, ModelSize, build_model
from .train import DemoConfig, run_demo

__all__ = ["CONDITIONS", "DemoConfig", "ModelSize", "build_model", "run_demo"]
