"""The ``train_step`` and ``train_step_compiled`` suites, on the Llama-style models of
:mod:`fastspec.bench.models`.

* ``train_step``: one training step (forward, backward, AdamW) with and without a streaming
  ``fastspec.Probe`` on every layer's keys and FFN activations
  (:func:`~fastspec.bench.models.train_step_case`, layer fitting included); reported as overhead
  in % of the step. Three cases: ``emit_every=100``, the same under ``budget=0.01`` (its rows
  add what the probe's budget reports, ``Probe.overhead()``), and ``emit_every=1``. Accuracy:
  |Δloss| with the probe attached; claim: 0 (hooks must not change the numbers).
* ``train_step_compiled``: the same step, probe defaults (``emit_every=100``), both sides through
  ``torch.compile(model, fullgraph=True)``: inductor on CUDA, ``aot_eager`` on CPU (named in the
  variant). The probed side is the model compiled with the probe attached, the baseline a twin
  sharing its weights, compiled without hooks; compilation is warm-up, outside the timed rounds.
  Rows as ``train_step`` (overhead %, |Δloss|: probed vs baseline compiled loss) plus what the
  compilation cost and whether it held (graphs per side, recompiles, graph breaks; claim: |Δloss|,
  recompiles and graph breaks all 0); see :mod:`fastspec.bench.models`. One case only: emission
  is the same eager code as in ``train_step``, only the captures move into the graph.

Shapes: the tier's :data:`~fastspec.bench.models.MODEL_SHAPES` entry (``gpu``: the 1.5B shape in
bf16) with :data:`TRAIN_TOKENS` tokens; the compiled case at ``gpu`` runs
:data:`COMPILED_LAYERS` layers of it (the size says ``L8``).
"""
from __future__ import annotations

import torch

from .. import models
from ..case import Case

TRAIN_TOKENS = {"quick": (1, 32), "cpu": (2, 128), "gpu": (4, 2048)}  # (batch, sequence)


BUDGET = 0.01
"""The overhead budget of the ``budget=`` case: probe work at most 1% of the step."""


def train_step_cases(tier: str, device: torch.device) -> list[Case]:
    """Probe defaults (capture every step, metrics every 100 steps: the timed steps are capture
    only); the same under ``budget=0.01`` (the probe samples FFN tokens and widens its intervals
    to stay under 1%: measured here against interleaved plain steps, beside what the probe
    reports); and ``emit_every=1`` (metrics every step: the worst case; emission cost per step =
    the difference, amortized by ``emit_every``). In that order: a time cap cuts the last."""
    shape, tokens = models.MODEL_SHAPES[tier], TRAIN_TOKENS[tier]
    return [models.train_step_case(tier, device, 100, shape=shape, batch_shape=tokens),
            models.train_step_case(tier, device, 100, shape=shape, batch_shape=tokens, budget=BUDGET),
            models.train_step_case(tier, device, 1, shape=shape, batch_shape=tokens)]


COMPILED_LAYERS = {"gpu": 8}
"""Depth of the compiled case where it differs from the tier's shape. ``gpu``: 8 of the 1.5B
shape's 32 layers, every other dimension kept. Inductor compiles both sides before the timed
rounds, each compile tracing every layer again, and the GPU kit gives this case one ~3-minute
slot; the overhead per layer is what the case measures, and fewer layers raise the share of the
fixed embedding and LM head only slightly (see :mod:`fastspec.bench.models`)."""


def train_step_compiled_cases(tier: str, device: torch.device) -> list[Case]:
    """The ``train_step`` case (probe defaults) with both sides compiled."""
    shape = dict(models.MODEL_SHAPES[tier])
    shape["num_hidden_layers"] = COMPILED_LAYERS.get(tier, shape["num_hidden_layers"])
    return [models.train_step_case(tier, device, 100, shape=shape, batch_shape=TRAIN_TOKENS[tier],
                                   suite="train_step_compiled", compiled=True)]
