"""``budget`` suite: is the overhead the probe reports what it really costs, and does its budget hold?

Two cases per budget (:data:`BUDGETS`, 2% and 5%): a Llama-shaped model in a plain training loop
(forward, backward, AdamW) with ``Probe(model, keys=True, ffn=True, budget=B, emit_every=10)``,
against two probe-free baselines timed in the same run, once with the steps interleaved one by
one and the probe detached between its own (the variant ``budget=B-emit_every=10``), once in
blocks of :data:`TWIN_BLOCK` steps with the probe left attached while the twin trains
(``budget=B-attached``, also ``emit_every=10``: the twin's block is a pause the probe is not told about, which its
pause rule must set aside, ``fastspec/probe/budget.py``). The baselines:

* the **twin**: a deep copy of the model with its own AdamW, trained on the same batch;
* the **same model** with the probe detached (no hook, no ``probe.step``): the same tensors at the
  same addresses, so what differs from the probed step is the probe alone. The twin's own
  difference (memory placement) shows as the gap between the two real overheads.

**How it is timed** (:func:`paired_run`). Steps are interleaved one by one, a round = one step
of each kind in an order that cycles through all six (:data:`ORDERS`), so load drifting over the
run and the cache cost of switching models land on all three alike; per-step times are so noisy
on a shared CPU (the 10th to 90th percentile of one step spans ±20%) that blocks of 15 steps,
five rounds of them, moved the real overhead by ±5 points between runs. The probe is attached just before its
step and detached after it, both outside the timed part; a detached span between two
``probe.step`` calls is a pause the probe leaves out of its step time (``fastspec/probe/timer.py``),
so its accounting sees exactly the probed steps. After :data:`WARMUP_ROUNDS` rounds (at the
``cpu`` and ``gpu`` tiers the first emission and the budget's first plan land there; the
``quick`` tier's 3 rounds only check the code) the window runs for the tier's
:data:`WINDOW_S` seconds and then to the next emission (for at most as long again), so that it
holds whole emission periods.

Row fields (besides the runner's, whose times are the short interleaved medians every case gets):

* ``probed_mean_s``, ``twin_mean_s``, ``same_model_mean_s``: mean step times over the window
  (``fastspec bench``'s narrow tables show the first two: the runner's medians of a few steps are
  no measure of a few percent);
* ``real_overhead_pct``: Σ probed step times / Σ twin step times − 1 over the window, in %
  (means, not medians: the emissions are part of the cost); ``same_model_overhead_pct``: the
  same against the detached steps of the same model;
* ``reported_pct``: what the probe's own totals say over the same steps
  (Δ ``overhead()["work_s"]`` / Δ ``overhead()["base_s"]``), and ``reported_to_real`` its ratio
  to ``real_overhead_pct``; ``budget_measured_pct`` and ``budget_average_pct``: ``overhead()``'s
  ``"measured"`` (since the probe started: the warm-up included) and ``"average"`` at the end;
* ``budget_pct``, ``real_to_budget``; ``budget_every``, ``budget_emit_every``, ``ffn_row_step``:
  the intervals the budget chose; ``rounds`` (steps of each kind), ``emissions`` in the window;
  ``block`` (1: interleaved); ``paused_steps``, ``paused_s``: the steps the pause rule counted at
  a typical duration in the window, and the seconds it set aside (in the attached-blocks row, one
  per twin block that came between two probed steps);
* where it goes (:func:`_per_kind`): for the probed steps that were idle, captured or emitted,
  ``{idle,capture,emit}_steps`` (how many), ``_excess_ms`` (the mean excess over the same
  model's step of the same round) and, on CPU, ``{capture,emit}_reported_ms`` (the mean work
  the probe timed for them).

Accuracy: |Δloss| of the probed model with the probe attached (claim 0: the hooks must not
change the numbers). The overhead figures are measurements, reported, never asserted.

Shapes: ``cpu`` and ``gpu`` (the same row on a GPU, fp32) are d_model 256, 4 layers, 4 query and
4 KV heads of 64, d_ff 768, vocab 512, 4 × 128 tokens; ``quick`` is tiny, for CI. The untimed
pytest check (``benchmarks/bench_budget.py``) runs every tier with the ``quick`` window.
"""
from __future__ import annotations

import copy
import itertools
import math
import time

import torch

from .. import models
from ..case import Case, Inputs, exactly_zero
from ..timing import time_once

BUDGETS = (0.02, 0.05)
EMIT_EVERY = 10
TWIN_BLOCK = 15
"""The attached-blocks row: steps of each kind in blocks of this many, the probe left attached while
the twin trains (a pause it is not told about: ``fastspec/probe/budget.py``'s pause rule)."""
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             head_dim=64, intermediate_size=768, vocab_size=512)
SHAPES = {"quick": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        head_dim=16, intermediate_size=192, vocab_size=128),
          "cpu": SHAPE, "gpu": SHAPE}
TOKENS = {"quick": (2, 32), "cpu": (4, 128), "gpu": (4, 128)}  # (batch, sequence)
WARMUP_ROUNDS = {"quick": 3, "cpu": 15, "gpu": 30}
WINDOW_S = {"quick": 0.2, "cpu": 240.0, "gpu": 4.0}
"""Seconds of timed rounds per case before the window waits for its closing emission: on the
2-core CPU a round is ~0.65 s, so 240 s hold ~370 probed steps, about two emission periods
under the 2% budget (~190 steps each)."""
KINDS = ("twin", "same model", "probed")
ORDERS = tuple(itertools.permutations(KINDS))
"""A round's order, cycling through all six: each kind follows each other kind equally often (a
step right after one of the same model finds its weights in cache; after the twin's, it does not)."""


def budget_cases(tier: str, device: torch.device) -> list[Case]:
    return ([_budget_case(tier, device, b) for b in BUDGETS]
            + [_budget_case(tier, device, b, block=TWIN_BLOCK) for b in BUDGETS])


def _train(model, opt, ids: torch.Tensor) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def paired_run(inp: Inputs, device: torch.device, warmup_rounds: int, window_s: float, block: int = 1) -> dict:
    """The interleaved run of the module docstring; returns the row fields it defines.

    ``block > 1``: the attached-blocks layout. A round runs ``block`` steps of each kind in turn,
    and the probe stays attached but for the same model's block: the twin's block is a pause
    between two ``probe.step`` calls that the probe is not told about. Steps of the three kinds
    are paired by their place in their block; the warm-up is ``warmup_rounds`` steps of each kind
    (whole blocks), and the window ends at the last probed step that emitted."""
    probe, model, twin, ids = inp["probe"], inp["model"], inp["twin"], inp["ids"]
    step = inp["step"]
    state: dict = {}
    at_emit: dict = {}  # the probe's totals right after the last probed step that emitted
    attached = block > 1  # the probe stays on: only the same model's steps detach it

    def probed() -> None:
        probe.step(step[0])
        # whether this step emitted (its records reach the host later on CUDA): the budget knows
        state["emitted"] = probe._budget.last_emit == probe._steps_seen
        step[0] += 1

    def probed_step() -> float:
        if not attached:
            probe.attach()  # outside the timed part: a pause for the probe's step clock, too
        state["captured"], before = probe.capturing, probe.overhead()["work_s"]
        try:
            return time_once(lambda: (_train(model, inp["opt"], ids), probed()), device)
        finally:
            if not attached:
                probe.detach()
            state["work"] = probe.overhead()["work_s"] - before
            if state.get("emitted"):  # the totals a window ending here reports (untimed)
                at_emit["totals"] = probe.overhead()

    def blocks(kind: str) -> list[dict]:
        """``block`` steps of ``kind``: each one's seconds (and, probed, what it did)."""
        if kind == "same model" and attached:
            probe.detach()  # a pause it is told about: the probe must not capture these
        try:
            return [{kind: timed[kind](), **(state if kind == "probed" else {})} for _ in range(block)]
        finally:
            if kind == "same model" and attached:
                probe.attach()

    timed = {"twin": lambda: time_once(lambda: _train(twin, inp["twin_opt"], ids), device),
             "same model": lambda: time_once(lambda: _train(model, inp["opt"], ids), device),
             "probed": probed_step}
    rounds: list[dict] = []  # the window's, one per place in a block: each kind's seconds, what the probed step did
    start = deadline = None
    warmup = math.ceil(warmup_rounds / block)
    if attached:
        probe.attach()
    try:
        for r in itertools.count():
            if r == warmup:  # the window starts: what came before is not counted
                start, deadline = probe.overhead(), time.monotonic() + window_s
            steps = {kind: blocks(kind) for kind in ORDERS[r % len(ORDERS)]}
            if start is None:
                continue
            rows = [{k: v for kind in KINDS for k, v in steps[kind][i].items()} for i in range(block)]
            emits = [i for i, row in enumerate(rows) if row["emitted"]]
            now = time.monotonic()
            # whole emission periods: once the time is up, stop at an emission (at the latest after
            # as long again, e.g. when the budget has spaced emissions out beyond the window)
            if now > deadline and (emits or now > deadline + window_s):
                # the probe's totals as of its last emission, and the steps up to it
                rounds.extend(rows[:emits[-1] + 1] if emits else rows)
                end = at_emit["totals"] if emits else probe.overhead()
                break
            rounds.extend(rows)
    finally:
        if attached:
            probe.detach()
    totals = {kind: sum(r[kind] for r in rounds) for kind in KINDS}
    work, base = end["work_s"] - start["work_s"], end["base_s"] - start["base_s"]
    real = 100 * (totals["probed"] / totals["twin"] - 1)
    reported = 100 * work / base if base > 0 else None
    budget = 100 * inp["budget"]

    def pct(v):
        return None if v is None else 100 * v

    return {"probed_mean_s": totals["probed"] / len(rounds), "twin_mean_s": totals["twin"] / len(rounds),
            "same_model_mean_s": totals["same model"] / len(rounds),
            "real_overhead_pct": real,
            "same_model_overhead_pct": 100 * (totals["probed"] / totals["same model"] - 1),
            "reported_pct": reported,
            "reported_to_real": None if reported is None or real == 0 else reported / real,
            "budget_measured_pct": pct(end["measured"]), "budget_average_pct": pct(end["average"]),
            "budget_pct": budget, "real_to_budget": real / budget,
            "budget_every": end["every"], "budget_emit_every": end["emit_every"],
            "ffn_row_step": end["ffn_row_step"], "rounds": len(rounds), "block": block,
            "paused_steps": end["paused_steps"] - start["paused_steps"], "paused_s": end["paused_s"] - start["paused_s"],
            "emissions": sum(r["emitted"] for r in rounds),
            **_per_kind(rounds, per_step_work=device.type != "cuda")}


def _per_kind(rounds: list[dict], per_step_work: bool) -> dict:
    """Where the overhead goes, per kind of probed step (idle, captured, emitting): how many,
    the mean paired excess over the same model's step of the same round, in ms, and (on CPU,
    where a step's work is accounted within its own ``step()``; on CUDA it is read later) the
    mean work the probe reported for them."""
    groups = {"idle": [r for r in rounds if not r["captured"] and not r["emitted"]],
              "capture": [r for r in rounds if r["captured"] and not r["emitted"]],
              "emit": [r for r in rounds if r["emitted"]]}
    out = {}
    for name, rs in groups.items():
        out[f"{name}_steps"] = len(rs)
        out[f"{name}_excess_ms"] = 1e3 * sum(r["probed"] - r["same model"] for r in rs) / len(rs) if rs else None
        if name != "idle":
            out[f"{name}_reported_ms"] = 1e3 * sum(r["work"] for r in rs) / len(rs) if rs and per_step_work else None
    return out


def _budget_case(tier: str, device: torch.device, budget: float, block: int = 1) -> Case:
    shape, tokens = SHAPES[tier], TOKENS[tier]

    def setup() -> Inputs:
        import fastspec

        # fp32 on every tier (build_llama's "cpu" dtype): the GPU runs the same row as the CPU
        model = models.build_llama("cpu", device, shape=shape).train()
        twin = copy.deepcopy(model)  # its own tensors, trained by its own optimizer
        probe = fastspec.Probe(model, keys=True, ffn=True, budget=budget, emit_every=EMIT_EVERY)
        return {"model": model, "twin": twin, "probe": probe, "budget": budget, "step": [0],
                "ids": models.tokens(tokens, shape["vocab_size"], device),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
                "twin_opt": torch.optim.AdamW(twin.parameters(), lr=1e-5)}

    def probed(inp: Inputs) -> None:  # the runner's short timing, under the streaming context
        _train(inp["model"], inp["opt"], inp["ids"])
        inp["probe"].step(inp["step"][0])
        inp["step"][0] += 1

    def twin(inp: Inputs) -> None:
        _train(inp["twin"], inp["twin_opt"], inp["ids"])

    def check(inp: Inputs) -> dict:
        model, ids = inp["model"], inp["ids"]
        # training forwards (gradients on): what streaming captures; no backward, the weights stay
        base = model(input_ids=ids, labels=ids).loss.detach()
        with inp["probe"].streaming():
            probed_loss = model(input_ids=ids, labels=ids).loss.detach()
        fields = paired_run(inp, device, WARMUP_ROUNDS[tier], WINDOW_S[tier], block=block)
        return {"fastspec_error": float((probed_loss.double() - base.double()).abs()),
                "baseline_error": None, **fields}

    return Case(suite="budget", size="train_step-" + models.size_id("cpu", shape, tokens),
                # the attached rows' name stays short: the terminal's tables are at most 140 columns
                variant=f"budget={budget:g}-attached" if block > 1 else f"budget={budget:g}-emit_every={EMIT_EVERY}",
                setup=setup, fastspec=probed,
                baselines={"twin training step (deep copy, own AdamW)": twin}, check=check,
                error_kind="|Δloss| with probe", claim=exactly_zero(), skip=models.requirements(),
                fastspec_context=lambda inp: inp["probe"].streaming())
