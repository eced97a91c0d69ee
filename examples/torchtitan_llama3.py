"""A TorchTitan config registry with the fastspec probe on: TorchTitan's llama3 debug model,
streaming key and FFN spectra every 10 steps into its metrics (docs/torchtitan.md).

From a TorchTitan source checkout (its test assets hold the debug model's tokenizer and the
``c4_test`` dataset), with this repository on ``PYTHONPATH``::

    PYTHONPATH=/path/to/fastspec torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module examples.torchtitan_llama3 --config llama3_debugmodel_fastspec

Every other TorchTitan option works as usual (``--parallelism.tensor_parallel_degree 2``,
``--compile.enable``, ``--metrics.enable_tensorboard``), and so do the probe's own
(``--fastspec.emit_every 50``, ``--fastspec.no-ffn``, ``--fastspec.budget 0.01``).
"""
from __future__ import annotations

from dataclasses import fields

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from fastspec.integrations.torchtitan import FastspecConfig, FastspecTrainer


def with_fastspec(config, **fastspec) -> FastspecTrainer.Config:
    """Any ``Trainer.Config`` of a registry as a ``FastspecTrainer.Config`` with the probe on."""
    base = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return FastspecTrainer.Config(**base, fastspec=FastspecConfig(enable=True, **fastspec))


def llama3_debugmodel_fastspec() -> FastspecTrainer.Config:
    """TorchTitan's ``llama3_debugmodel`` with keys and FFN inputs streamed, metrics every 10 steps."""
    return with_fastspec(llama3_debugmodel(), emit_every=10)
