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

**The Hugging Face Trainer row** (variant ``budget=0.05-hf-trainer``, :func:`hf_trainer_case`):
does what a trainer does between its steps stay out of the probe's cost? The same model trained
by a ``transformers.Trainer`` with :class:`fastspec.integrations.hf.FastspecStreamCallback`
(``probe_kwargs``: keys, FFN, ``budget=0.05``, ``emit_every=10``), against a probe-free twin
trainer (a deep copy of the model, the same ``TrainingArguments``, its own output folder and
optimizer). Both evaluate and save a checkpoint every :data:`SAVE_EVERY` steps
(``save_only_model=False``: weights, optimizer, scheduler, RNG and trainer state, and on the
probed side the probe's state) and log every :data:`LOG_EVERY`; a persistent buffer of
:data:`BALLAST_MIB` MiB registered on the model (random float32, read by no step) makes each
checkpoint hold ≥ 200 MB at the ``cpu`` and ``gpu`` tiers. The two ``train()`` calls run in two
threads of one process, one at a time, in lockstep (:class:`_Lockstep`): round k is the two
trainers' optimizer step k, one after the other, so load drift lands on both alike; which trainer
goes first swaps every :data:`SAVE_EVERY` rounds (:func:`first_in_round`), so each is as often
the first of the two to save (the slower save). Each optimizer step is timed from a callback
placed first at ``on_step_begin`` (before the fastspec callback unpauses the probe) to one placed
last at ``on_step_end`` (after its ``probe.step`` and emission), which then hands over to the
other trainer and waits; the run checks that order and that the trainers took turns. What a trainer does between two of its steps (logging, evaluation, the
checkpoint save, fetching the batch, waiting for the other trainer) is outside both sides' step
times: the span the callback pauses the probe over. The window: :data:`WARMUP_ROUNDS` steps of
each, then :data:`WINDOW_S` seconds of wall time (saves and evaluations included) and on to the
probed side's next emission, at most as long again; ``real_overhead_pct`` and ``reported_pct``
as above over the window's steps. Fields as above, with the twin as the only baseline
(``same_model_*`` None, the ``_excess_ms`` against the twin's step of the same round), plus
``checkpoint_mb``, ``twin_checkpoint_mb`` (the smallest checkpoint folder each trainer wrote, MB =
10⁶ bytes), ``ballast_mib``, ``saves_in_window``, ``evals_in_window`` (those before a window's
step), ``probed_between_steps_s``, ``twin_between_steps_s`` (seconds each trainer spent between
two of the window's steps on its own logging, evaluation, saves and data; the wait for the other
trainer not included), ``save_every``, ``eval_every``, ``log_every``, ``last_step``. The bar it is read
against: ``|reported_to_real − 1| ≤ 0.25``, a measurement reported, not asserted.
:func:`hf_trainer_case` with ``pauses=False`` (variant ``budget=0.05-hf-no-pause``, not a row of
the suite) steps the same probe from a plain callback that never pauses it (but over the wait for
the other trainer, which a real run does not have): a diagnostic of what the pauses change.

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
            + [_budget_case(tier, device, b, block=TWIN_BLOCK) for b in BUDGETS]
            + [hf_trainer_case(tier, device)])


def _probed_step(inp: Inputs) -> None:
    """The runner's short timing of a case's probed side: a plain training step and ``probe.step``
    (under the streaming context in the plain rows; the HF row's is its trainer's probe)."""
    _train(inp["model"], inp["opt"], inp["ids"])
    inp["probe"].step(inp["step"][0])
    inp["step"][0] += 1


def _twin_step(inp: Inputs) -> None:
    """The runner's short timing of the twin: the same step of the deep copy, its own AdamW."""
    _train(inp["twin"], inp["twin_opt"], inp["ids"])


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


def _per_kind(rounds: list[dict], per_step_work: bool, baseline: str = "same model") -> dict:
    """Where the overhead goes, per kind of probed step (idle, captured, emitting): how many,
    the mean paired excess over the ``baseline``'s step of the same round (the same model's; the
    twin's in the HF Trainer row), in ms, and (on CPU,
    where a step's work is accounted within its own ``step()``; on CUDA it is read later) the
    mean work the probe reported for them."""
    groups = {"idle": [r for r in rounds if not r["captured"] and not r["emitted"]],
              "capture": [r for r in rounds if r["captured"] and not r["emitted"]],
              "emit": [r for r in rounds if r["emitted"]]}
    out = {}
    for name, rs in groups.items():
        out[f"{name}_steps"] = len(rs)
        out[f"{name}_excess_ms"] = 1e3 * sum(r["probed"] - r[baseline] for r in rs) / len(rs) if rs else None
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
                setup=setup, fastspec=_probed_step,
                baselines={"twin training step (deep copy, own AdamW)": _twin_step}, check=check,
                error_kind="|Δloss| with probe", claim=exactly_zero(), skip=models.requirements(),
                fastspec_context=lambda inp: inp["probe"].streaming())


# ------------------------------------------------------------------ the Hugging Face Trainer row
HF_BUDGET = 0.05
SAVE_EVERY = 10
"""The HF Trainer row: a checkpoint (``save_only_model=False``: weights, optimizer, scheduler, RNG
and trainer state, and the probe's state on the probed side) and an evaluation every this many
optimizer steps, on each of the two trainers."""
LOG_EVERY = 2
"""The HF Trainer row's ``logging_steps``."""
EVAL_ROWS = 8
"""The HF Trainer row's evaluation set: this many sequences of the training batch's length."""
BALLAST_MIB = {"quick": 1, "cpu": 200, "gpu": 200}
"""The HF Trainer row: a persistent buffer of this many MiB (float32, random) registered on the
model and so copied to the twin: every checkpoint holds it (a state of ≥ 200 MB) while
no step reads it, so the steps stay as fast as the other rows'."""
MAX_STEPS = 100_000
"""The HF Trainer row: ``max_steps`` of both trainers, a bound never reached: the window's end
stops them (``control.should_training_stop``)."""


def first_in_round(k: int) -> int:
    """The HF row's lockstep: which trainer (0 probed, 1 twin) runs first in round ``k`` (the
    round of both trainers' optimizer step ``k``, from 1). The two swap every :data:`SAVE_EVERY`
    rounds, so each saves first after every other save step: a save right after the other
    trainer's is faster (0.06 s against ~0.9 s for the first of the two, 254 MB each, on the
    2-core AMD EPYC; the page cache's doing), and the first saver's next step comes right after
    its slower save. At a swap one trainer runs two steps in a row."""
    return ((k - 1) // SAVE_EVERY) % 2


def lockstep_order(rounds: int) -> list[tuple[int, int]]:
    """``(trainer, step)`` in the order the HF row's lockstep runs them (:func:`first_in_round`)."""
    return [(i, k) for k in range(1, rounds + 1) for i in (first_in_round(k), 1 - first_in_round(k))]


class _Lockstep:
    """Two threads that run one at a time, taking turns: :meth:`hand_over` lets the other run and
    waits for it to hand back (or to finish: then this thread runs on alone)."""

    def __init__(self):
        import threading

        self._turn = [threading.Semaphore(0), threading.Semaphore(0)]
        self.done = [False, False]

    def wait(self, i: int) -> None:
        self._turn[i].acquire()

    def hand_over(self, i: int, to: int) -> None:
        """Thread ``i`` lets thread ``to`` run and waits for its turn (``to == i``: runs on)."""
        if to != i and not self.done[to]:
            self._turn[to].release()
            self._turn[i].acquire()

    def finish(self, i: int) -> None:
        self.done[i] = True
        self._turn[1 - i].release()


def _dir_mb(path) -> float:
    import os

    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6


class _TrainerSide:
    """One of the HF row's two trainers: its timing callbacks, the time of each of its optimizer
    steps, and what the probe did in it (on the probed side)."""

    def __init__(self, run: _TrainerRun, index: int, name: str):
        from transformers import TrainerCallback

        self.run, self.index, self.name = run, index, name
        self.trainer = self.stream = None
        self.steps: dict[int, dict] = {}  # global_step -> {"s": seconds, "captured", "emitted", "work"}
        self.between: dict[int, float] = {}  # global_step -> seconds from its hand-back to the next step
        self.saves: dict[int, float] = {}  # global_step -> checkpoint MB
        self.evals: list[int] = []
        self._t0 = self._resumed = None
        self._pending: dict = {}
        side = self

        class Begin(TrainerCallback):
            """First callback of ``on_step_begin``: the step's clock starts."""

            def on_train_begin(self, args, state, control, **kwargs):
                # after the fastspec callback's own on_train_begin moved it first (_go_first): a
                # callback moved from a later place to the front is safe while the handler iterates
                cbs = side.trainer.callback_handler.callbacks
                cbs.remove(self)
                cbs.insert(0, self)

            def on_step_begin(self, args, state, control, **kwargs):
                side.step_begins(state)

        class End(TrainerCallback):
            """Last callback of ``on_step_end`` (after the fastspec callback's ``probe.step``):
            the step's clock stops, then the other trainer runs one step. Last at ``on_save`` too:
            the checkpoint it measures holds the probe's state (written by the fastspec callback)."""

            def on_step_end(self, args, state, control, **kwargs):
                side.step_ends(state, control)

            def on_evaluate(self, args, state, control, **kwargs):
                side.evals.append(int(state.global_step))

            def on_save(self, args, state, control, **kwargs):
                import os

                step = int(state.global_step)
                side.saves[step] = _dir_mb(os.path.join(args.output_dir, f"checkpoint-{step}"))

        self.begin, self.end = Begin(), End()

    @property
    def probe(self):
        return None if self.stream is None else self.stream.probe

    def _sync(self) -> None:
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)

    def _check_order(self) -> None:
        """The timed span holds every other callback: this side's Begin first, End last."""
        cbs = self.trainer.callback_handler.callbacks
        names = [type(c).__name__ for c in cbs]
        if cbs[0] is not self.begin or cbs[-1] is not self.end or (
                self.stream is not None and self.stream not in cbs):
            raise RuntimeError(f"budget: the {self.name} trainer's callbacks are in the wrong order: {names}")

    def step_begins(self, state) -> None:
        step = int(state.global_step) + 1  # the step this one will end as
        if self._resumed is not None:  # what the trainer did between its steps: log, evaluate, save, fetch
            self.between[step - 1] = time.perf_counter() - self._resumed
        if not self.steps:
            self._check_order()
        probe = self.probe
        # read before the clock starts: not part of the step
        self._pending = {} if probe is None else {"captured": probe.capturing,
                                                  "work0": probe.overhead()["work_s"]}
        self._sync()
        self._t0 = time.perf_counter()

    def step_ends(self, state, control) -> None:
        self._sync()
        seconds = time.perf_counter() - self._t0
        step = int(state.global_step)
        row = {"s": seconds}
        probe = self.probe
        if probe is not None:
            row.update(captured=self._pending["captured"], work=probe.overhead()["work_s"] - self._pending["work0"],
                       emitted=probe._budget.last_emit == probe._steps_seen)
        self.steps[step] = row
        self.run.sequence.append((self.index, step))
        self.run.after_step(self, step)
        first = first_in_round(step)
        # the other trainer's step of this round, or the first of the next round (maybe this one)
        to = 1 - self.index if self.index == first else first_in_round(step + 1)
        # the unpaused diagnostic's probe is paused over the other trainer's turn alone: the lockstep's
        # wait is no part of a real run, the trainer's own logging, evaluation and saves are
        unpaused = self.run.pause_wait and probe is not None and to != self.index
        if unpaused:
            probe.pause()
        self.run.lock.hand_over(self.index, to)
        if unpaused:
            probe.unpause()
        self._resumed = time.perf_counter()
        if (self.run.stop_at is not None and step >= self.run.stop_at or self.run.lock.done[1 - self.index]
                or self.run.aborted):
            control.should_training_stop = True


class _TrainerRun:
    """The HF row's lockstep run: round k is both trainers' step k (:func:`first_in_round`); its
    window (after ``warmup`` steps, ``window_s`` seconds, then to the probed side's next
    emission, at most as long again)."""

    def __init__(self, device: torch.device, warmup: int, window_s: float):
        self.device, self.warmup, self.window_s = device, warmup, window_s
        self.lock = _Lockstep()
        self.stop_at: int | None = None
        self.start = self.end = self.deadline = None
        self.pause_wait = False  # the unpaused diagnostic: pause its probe over the other trainer's turn
        self.aborted = False  # the calling thread stopped waiting (a time cap, Ctrl-C): the trainers stop too
        self.sequence: list[tuple[int, int]] = []  # (side, global step) of every step, in the order they ran

    def after_step(self, side: _TrainerSide, step: int) -> None:
        if side.stream is None:  # the twin follows the probed side's window
            return
        probe = side.probe
        if step == self.warmup:
            self.start, self.deadline = probe.overhead(), time.monotonic() + self.window_s
        elif step > self.warmup and self.stop_at is None:
            now = time.monotonic()
            if now > self.deadline and (side.steps[step]["emitted"] or now > self.deadline + self.window_s):
                self.stop_at, self.end = step, probe.overhead()

    def train(self, sides: list[_TrainerSide]) -> None:
        import threading

        errors: list[BaseException] = []

        def body(side: _TrainerSide) -> None:
            try:
                self.lock.wait(side.index)
                side.trainer.train()
            except BaseException as e:  # noqa: BLE001 - re-raised by the calling thread
                errors.append(e)
            finally:
                self.lock.finish(side.index)

        # daemons: a run stopped from the calling thread (the CLI's time cap) does not wait for them
        threads = [threading.Thread(target=body, args=(s,), name=f"budget-hf-{s.name}", daemon=True) for s in sides]
        for t in threads:
            t.start()
        self.lock._turn[first_in_round(1)].release()
        try:
            for t in threads:
                t.join()
        except BaseException:
            self.aborted = True  # each trainer stops at its next step's end
            raise
        if errors:
            raise errors[0]


class _Rows(torch.utils.data.Dataset):
    """``n`` rows: row ``i`` is the batch's row ``i % batch`` as input and label (a causal LM)."""

    def __init__(self, ids: torch.Tensor, n: int):
        self.ids, self.n = ids.cpu(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "labels": row}


def hf_trainer_run(inp: Inputs, device: torch.device, warmup: int, window_s: float, pauses: bool = True) -> dict:
    """The HF Trainer row's lockstep run (the module docstring, :func:`hf_trainer_case`);
    returns its row fields."""
    import os

    from transformers import (
        PrinterCallback,
        ProgressCallback,
        Trainer,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    from ...integrations.hf import FastspecStreamCallback

    batch, _ = inp["ids"].shape
    run = _TrainerRun(device, warmup, window_s)
    run.pause_wait = not pauses
    sides = [_TrainerSide(run, 0, "probed"), _TrainerSide(run, 1, "twin")]
    kwargs = {"keys": True, "ffn": True, "budget": inp["budget"], "emit_every": EMIT_EVERY}
    for side, model in zip(sides, (inp["model"], inp["twin"])):
        args = TrainingArguments(
            output_dir=os.path.join(inp["dir"], side.name), max_steps=MAX_STEPS, per_device_train_batch_size=batch,
            per_device_eval_batch_size=batch, learning_rate=1e-5, lr_scheduler_type="constant",
            save_strategy="steps", save_steps=SAVE_EVERY, save_only_model=False, save_total_limit=1,
            eval_strategy="steps", eval_steps=SAVE_EVERY, prediction_loss_only=True,
            logging_strategy="steps", logging_steps=LOG_EVERY, report_to="none", disable_tqdm=True,
            use_cpu=device.type != "cuda", dataloader_pin_memory=False, seed=0)
        callbacks = [side.begin]
        if side.name == "probed":
            if pauses:
                side.stream = FastspecStreamCallback(probe_kwargs=kwargs)
            else:  # the same probe stepped by a plain callback that never pauses it
                side.stream = _UnpausedStream(kwargs)
            callbacks.insert(0, side.stream)
        data = _Rows(inp["ids"], MAX_STEPS * batch)
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=_Rows(inp["ids"], EVAL_ROWS),
                          callbacks=callbacks)
        for printer in (PrinterCallback, ProgressCallback):  # no console lines for every log
            trainer.remove_callback(printer)
        trainer.add_callback(side.end)  # last: after every callback the Trainer has
        side.trainer = trainer
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar at every save
    try:
        run.train(sides)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    probed, twin = sides
    inp["probe"] = probed.probe
    if run.sequence != lockstep_order(run.stop_at):
        raise RuntimeError(f"budget: the trainers did not take turns step by step: {run.sequence[:12]} ...")
    window = range(run.warmup + 1, run.stop_at + 1)
    rounds = [{"probed": probed.steps[s]["s"], "twin": twin.steps[s]["s"], **probed.steps[s]} for s in window]
    start, end = run.start, run.end
    totals = {kind: sum(r[kind] for r in rounds) for kind in ("probed", "twin")}
    work, base = end["work_s"] - start["work_s"], end["base_s"] - start["base_s"]
    real = 100 * (totals["probed"] / totals["twin"] - 1)
    reported = 100 * work / base if base > 0 else None
    budget = 100 * inp["budget"]
    # the trainers' untimed spans between two of their steps in the window: log, evaluate, save, fetch
    gaps = range(run.warmup, run.stop_at)  # the spans before the window's steps: a save at step s is before s + 1
    between = {side.name: sum(side.between.get(s, 0.0) for s in gaps) for side in sides}
    saved = [s for s in probed.saves if s in gaps]
    return {"probed_mean_s": totals["probed"] / len(rounds), "twin_mean_s": totals["twin"] / len(rounds),
            "same_model_mean_s": None, "same_model_overhead_pct": None,
            "real_overhead_pct": real, "reported_pct": reported,
            "reported_to_real": None if reported is None or real == 0 else reported / real,
            "budget_measured_pct": None if end["measured"] is None else 100 * end["measured"],
            "budget_average_pct": None if end["average"] is None else 100 * end["average"],
            "budget_pct": budget, "real_to_budget": real / budget,
            "budget_every": end["every"], "budget_emit_every": end["emit_every"],
            "ffn_row_step": end["ffn_row_step"], "rounds": len(rounds), "block": 1,
            "paused_steps": end["paused_steps"] - start["paused_steps"], "paused_s": end["paused_s"] - start["paused_s"],
            "emissions": sum(r["emitted"] for r in rounds),
            "save_every": SAVE_EVERY, "eval_every": SAVE_EVERY, "log_every": LOG_EVERY,
            "saves_in_window": len(saved), "evals_in_window": sum(s in gaps for s in probed.evals),
            "checkpoint_mb": min(probed.saves.values(), default=None),
            "twin_checkpoint_mb": min(twin.saves.values(), default=None),
            "ballast_mib": inp["ballast_mib"],
            "probed_between_steps_s": between["probed"], "twin_between_steps_s": between["twin"],
            "last_step": max(probed.steps),
            **_per_kind(rounds, per_step_work=device.type != "cuda", baseline="twin")}


class _UnpausedStream:
    """The HF row without the callback's pauses (diagnostic, :func:`hf_trainer_case` with
    ``pauses=False``): a plain callback that builds the same probe, attaches it when training
    begins and steps it at every optimizer step's end, never pausing it, so the trainer's logging,
    evaluation, saves and data fetching between two steps count as training time (left to the
    budget's pause rule). Only the lockstep's wait for the other trainer, no part of a real run, is
    paused over (:meth:`_TrainerSide.step_ends`)."""

    Callback = None  # the TrainerCallback subclass, made on first use (transformers is optional)

    def __new__(cls, probe_kwargs: dict):
        if cls.Callback is None:
            from transformers import TrainerCallback

            class Unpaused(TrainerCallback):
                def __init__(self, probe_kwargs: dict):
                    self.probe_kwargs, self.probe = probe_kwargs, None

                def on_train_begin(self, args, state, control, model=None, **kwargs):
                    from ...probe import Probe

                    self.probe = Probe(model, **self.probe_kwargs)
                    self.probe.attach()

                def on_step_end(self, args, state, control, **kwargs):
                    self.probe.step(int(state.global_step))

                def on_train_end(self, args, state, control, **kwargs):
                    self.probe.detach()

            cls.Callback = Unpaused
        return cls.Callback(probe_kwargs)


def hf_trainer_case(tier: str, device: torch.device, pauses: bool = True) -> Case:
    """The HF Trainer row (module docstring): ``budget=0.05-hf-trainer``; ``pauses=False`` gives
    the diagnostic ``budget=0.05-hf-no-pause`` (:class:`_UnpausedStream`), not one of the
    suite's rows."""
    shape, tokens = SHAPES[tier], TOKENS[tier]
    mib = BALLAST_MIB[tier]

    def setup() -> Inputs:
        import tempfile

        model = models.build_llama("cpu", device, shape=shape).train()
        # the checkpoint's bulk: saved with the model's state, read by no step
        model.register_buffer("ballast", torch.rand(mib * 2**20 // 4, device=device), persistent=True)
        twin = copy.deepcopy(model)
        return {"model": model, "twin": twin, "probe": None, "budget": HF_BUDGET, "step": [0],
                "ids": models.tokens(tokens, shape["vocab_size"], device), "ballast_mib": mib,
                "dir": tempfile.mkdtemp(prefix="fastspec-budget-hf-"),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
                "twin_opt": torch.optim.AdamW(twin.parameters(), lr=1e-5)}

    def check(inp: Inputs) -> dict:
        import shutil

        try:
            fields = hf_trainer_run(inp, device, WARMUP_ROUNDS[tier], WINDOW_S[tier], pauses=pauses)
        finally:
            shutil.rmtree(inp["dir"], ignore_errors=True)
        inp["step"][0] = fields["last_step"] + 1  # the runner's short timing steps the probe on from there
        model, ids = inp["model"].train(), inp["ids"]
        base = model(input_ids=ids, labels=ids).loss.detach()
        with inp["probe"].streaming():  # the probe the trainer's callback built
            probed_loss = model(input_ids=ids, labels=ids).loss.detach()
        return {"fastspec_error": float((probed_loss.double() - base.double()).abs()),
                "baseline_error": None, **fields}

    def teardown(inp: Inputs) -> None:
        import shutil

        shutil.rmtree(inp["dir"], ignore_errors=True)
        if inp["probe"] is not None:
            inp["probe"].detach()

    return Case(suite="budget", size="train_step-" + models.size_id("cpu", shape, tokens),
                variant=f"budget={HF_BUDGET:g}-hf-trainer" if pauses else f"budget={HF_BUDGET:g}-hf-no-pause",
                setup=setup, fastspec=_probed_step,
                baselines={"twin Trainer (deep copy, same TrainingArguments)": _twin_step}, check=check,
                error_kind="|Δloss| with probe", claim=exactly_zero(), skip=models.requirements(),
                fastspec_context=lambda inp: inp["probe"].streaming(), teardown=teardown)
