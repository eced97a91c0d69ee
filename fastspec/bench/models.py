"""Llama-style models for the model suites (``keyrank``, ``train_step``, ``probe``): building
them, their inputs, the hand-written key-rank protocol, and the training-step case with layer
fitting.

Shared by the suite modules :mod:`fastspec.bench.suites.keyrank`,
:mod:`fastspec.bench.suites.train_step` and :mod:`fastspec.bench.suites.probe`; it imports only
:mod:`fastspec.bench.case` and :mod:`fastspec.bench.timing`, so no suite module imports another. Models are ``transformers.LlamaForCausalLM`` built from a config (:data:`MODEL_SHAPES`)
with random weights: timings and protocol agreement do not depend on training. The ``gpu``
shape is the 1.5B model of the key-rank protocol (docs/protocols.md: d_model 2048, 32 layers,
16 query / 8 KV heads of 128, d_ff 8192) in bf16; ``cpu``/``quick`` are small fp32 models of
the same layout.

Layer fitting (:func:`train_step_case`, every tier, see :func:`fit_layers`): a bf16 training
step with AdamW at the 1.5B shape needs ~17 GB of weights, grads and Adam state plus tens of GB
of activations and the probe's FFN accumulators, which may not fit next to anything else on an
80 GB GPU, and ``emit_every=1`` may be too slow for the tier's time cap. So ``setup()`` runs a
trial step at the requested depth and halves the layer count on out-of-memory or when the trial
says the timed rounds would overrun :data:`STEP_BUDGET_S`. How it is recorded, given that the
runner reads ``size`` before ``setup()`` runs (``--filter``, time-cap rows and the row head are
all keyed on it): ``size`` stays the requested shape (``L32-...``); every measured row gets the
numeric extras ``layers`` (what ran) and ``layers_requested``; a reduced case also gets a note
row ``{"baseline": "32 layers", "skipped": "reduced to 16 layers: <why>"}``. Fewer layers lower
``overhead_pct`` slightly (the embedding and LM head are a fixed share of the step).

Compiled (``train_step_case(..., compiled=True)``, the ``train_step_compiled`` suite): the same
step through ``torch.compile(model, fullgraph=True)``, :func:`compile_backend` (inductor on CUDA,
``aot_eager`` elsewhere: it traces forward and backward the same way but generates no code, so a
CPU run needs no C++ compiler). Each side has its own compiled module: the probed one is the
model with the probe attached before compiling (attached for the whole case: detaching would
change the hooks its graph was traced with), the baseline a twin (:func:`shared_twin`) sharing
the model's parameters but not its hooks, so one set of weights and one AdamW train both sides,
as in the eager case. Compilation happens in the trial's warm-up (two steps per side, untimed),
never in a timed round; ``check()`` adds what it cost (``probed_compile_s``,
``baseline_compile_s``: first step − second step), the dynamo graphs each side compiled
(``probed_graphs``, ``baseline_graphs``: 1 each expected), ``recompiles`` after the first step
of each side (0 expected: the probe's schedule is data on the device) and ``graph_breaks``
(``fullgraph=True`` raises on a break, so a measured row has 0).
"""
from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .case import Case, Inputs, exactly_zero, free_memory
from .timing import time_once

# Catch the allocator's own error only: any other failure of the trial is a real error of the case.
# torch.OutOfMemoryError is the public name since torch 2.5; older ones only have the CUDA alias.
OutOfMemory = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

MIN_LAYERS = 4
"""Fewest layers a reduced ``train_step`` case may run (below it the overhead would be mostly the
fixed embedding/LM-head cost, not the per-layer cost the suite measures)."""
STEP_BUDGET_S = 60.0
"""Seconds the timed rounds of one ``train_step`` case may take (probed + plain step per round):
the GPU run caps each tier at a few minutes, shared by two ``train_step`` cases and ``keyrank``."""
TIMED_CALLS = 7
"""Rounds the budget is computed for: ``fastspec bench``'s default warmup 2 + repeats 5."""

MODEL_SHAPES: dict[str, dict[str, int]] = {
    "quick": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=128),
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=688, vocab_size=512),
    "gpu": dict(hidden_size=2048, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, intermediate_size=8192, vocab_size=32000),
}


def requirements() -> str | None:
    """Why the model suites cannot run here (None: they can)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers not installed (pip install 'fastspec[hf]')"
    import fastspec

    if not hasattr(fastspec, "Probe"):
        return "fastspec.Probe is not available in this version"
    return None


def compile_backend(device: torch.device) -> str:
    """``torch.compile`` backend of the compiled training step: inductor (the default) on CUDA;
    ``aot_eager`` elsewhere (dynamo and AOT autograd trace the same graphs, without inductor's
    C++ compile on CPU, so CI stays cheap)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def compile_requirements(device: torch.device) -> str | None:
    """Why the compiled training step cannot run here (None: it can)."""
    import importlib.util

    if not hasattr(torch, "compile"):
        return "torch.compile is not available in this torch"
    if compile_backend(device) == "inductor" and importlib.util.find_spec("triton") is None:
        return "torch.compile's inductor backend needs triton on CUDA"
    return None


def shared_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that shares its parameters and buffers (the same tensors, so one
    optimizer trains both) but none of the hooks registered on ``model`` after this call."""
    return copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})


def _dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _reset_dynamo() -> None:
    """Drop every compiled graph of this process (a case compiles, and counts, its own)."""
    import torch._dynamo

    torch._dynamo.reset()


def model_dtype(tier: str) -> torch.dtype:
    """bf16 at the ``gpu`` tier (what training runs in), fp32 below it."""
    return torch.bfloat16 if tier == "gpu" else torch.float32


def build_llama(tier: str, device: torch.device, layers: int | None = None, *,
                shape: dict[str, int] | None = None) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` of the tier's shape on ``device``;
    ``layers`` overrides the tier's layer count, ``shape`` the tier's :data:`MODEL_SHAPES` entry
    (the dtype stays the tier's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(MODEL_SHAPES[tier] if shape is None else shape)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(model_dtype(tier))


def tokens(batch_shape: tuple[int, int], vocab: int, device: torch.device) -> torch.Tensor:
    """``[batch, sequence]`` random token ids below ``vocab``, the same on every device."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    return torch.randint(vocab, batch_shape, generator=g).to(device)


def size_id(tier: str, shape: dict[str, int], batch_shape: tuple[int, int]) -> str:
    """The readable ``size`` of a model case: ``L32-KV8-d128-ff8192-N4x2048-bf16``."""
    dt = "bf16" if model_dtype(tier) == torch.bfloat16 else "fp32"
    return (f"L{shape['num_hidden_layers']}-KV{shape['num_key_value_heads']}-d{shape['head_dim']}"
            f"-ff{shape['intermediate_size']}-N{batch_shape[0]}x{batch_shape[1]}-{dt}")


def hand_key_rank(model: Any, batch: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Key-rank PR per (layer, KV head), ``[L, H_kv]``, the way one writes the key-rank
    protocol (docs/protocols.md) by hand.

    ``dtype`` is the precision of ``svdvals`` (the protocol says fp32; float64 gives the truth
    both fp32 paths are measured against).

    Forward hooks take every layer's ``k_proj`` output and the rotary ``(cos, sin)`` handed to its
    attention; post-RoPE keys are rebuilt with the model's own ``apply_rotary_pos_emb`` (so they
    are bit-identical to what attention sees), then ``svdvals`` of each head's ``[n, d]`` keys.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    cfg = model.config
    H, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    keys: dict[int, torch.Tensor] = {}
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        handles.append(attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: rope.__setitem__(i, kwargs["position_embeddings"]), with_kwargs=True))
        handles.append(attn.k_proj.register_forward_hook(
            lambda m, args, out, i=i: keys.__setitem__(i, out)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    prs = []
    for i in range(len(layers)):
        B, T = keys[i].shape[:2]
        k = keys[i].view(B, T, H, d).transpose(1, 2)  # [B, H, T, d]
        cos, sin = rope[i]
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        for h in range(H):
            s = torch.linalg.svdvals(k[:, h].reshape(B * T, d).to(dtype))
            prs.append(s.sum().square() / s.square().sum())
    return torch.stack(prs).view(len(layers), H).cpu()


def probe_key_rank(records: list, L: int, H: int) -> torch.Tensor:
    """``[L, H]`` key PR from Probe records (site ``keys``, metric ``participation_ratio``)."""
    out = torch.full((L, H), float("nan"), dtype=torch.float64)
    for r in records:
        if r.site == "keys" and r.metric == "participation_ratio":
            out[r.layer, r.head_index] = r.value
    return out


@dataclass(frozen=True)
class LayerFit:
    """Outcome of :func:`fit_layers`: the depth that ran, and why it is less than requested."""

    requested: int
    layers: int
    reasons: tuple[str, ...] = ()  # one per reduction, in order
    round_s: float | None = None   # trial seconds of one timed round at ``layers``

    def notes(self) -> dict[str, str]:
        """``{what: why}`` for :attr:`Case.notes` (the runner makes it a ``skipped`` row): empty
        unless reduced, so an unreduced case looks exactly as before."""
        if self.layers == self.requested:
            return {}
        return {f"{self.requested} layers": f"reduced to {self.layers} layers: " + "; ".join(self.reasons)}

    def extras(self) -> dict[str, float]:
        """Numeric ``check()`` extras copied into every measured row (the runner keeps numbers only)."""
        return {"layers": self.layers, "layers_requested": self.requested}


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def fit_layers(requested: int, build: Callable[[int], Inputs], trial: Callable[[Inputs], float], *,
               floor: int | None = None, budget_s: float | None = None, calls: int | None = None,
               free: Callable[[], None] = lambda: None) -> tuple[Inputs, LayerFit]:
    """The inputs of the deepest model (``requested`` layers, halved as needed) whose trial fits.

    ``build(layers)`` makes the case's inputs at that depth; ``trial(inputs)`` runs what one timed
    round runs and returns its seconds (steady state: warm-up and lazily allocated state such as
    AdamW's moments must come before the timed part, so the memory peak is reached too). A depth
    fits when neither raises out-of-memory and ``trial seconds × calls <= budget_s``.

    On out-of-memory the layers are halved; when too slow they jump to the largest halving whose
    estimate (step time ~ linear in depth) fits, then that depth is trialled in turn. Between
    tries everything of the failed one is dropped and ``free()`` runs (gc + CUDA cache), outside
    the ``except`` block: the exception's traceback holds the failed step's frames and tensors.
    Never goes below ``min(floor, requested)`` (a tier that starts at or below the floor is never
    reduced): too slow there, it runs anyway (the reason is kept); out of memory there, a
    RuntimeError naming every reason. Other exceptions propagate unchanged.
    Defaults: :data:`MIN_LAYERS`, :data:`STEP_BUDGET_S`, :data:`TIMED_CALLS` (read at call time,
    so tests can patch them).
    """
    floor = min(MIN_LAYERS if floor is None else floor, requested)
    budget_s = STEP_BUDGET_S if budget_s is None else budget_s
    calls = TIMED_CALLS if calls is None else calls
    if floor < 1 or calls < 1 or not budget_s > 0:
        raise ValueError(f"fit_layers: expected floor >= 1, calls >= 1, budget_s > 0; "
                         f"got {floor}, {calls}, {budget_s}")
    layers, reasons = requested, []
    while True:
        inputs, oom = None, None
        try:
            inputs = build(layers)
            round_s = trial(inputs)
        except OutOfMemory as e:
            oom = _first_line(e)
        if oom is None:
            estimate = round_s * calls
            if estimate <= budget_s:
                return inputs, LayerFit(requested, layers, tuple(reasons), round_s)
            why = (f"at {layers} layers {calls} timed rounds × {round_s:.3g} s = {estimate:.3g} s "
                   f"> budget {budget_s:g} s")
            if layers <= floor:
                # Too slow but it fits: a measurement over budget beats none (the run's time cap
                # still cuts its repeats), and a loaded CI machine must not turn into an error.
                why += ", ran anyway at the floor"
                return inputs, LayerFit(requested, layers, (*reasons, why), round_s)
        else:
            why = f"out of memory at {layers} layers ({oom})"
        inputs = None
        free()
        if layers <= floor:
            raise RuntimeError(f"fit_layers: no depth from {requested} down to {floor} layers fits: "
                               + "; ".join([*reasons, why]))
        nxt = max(layers // 2, floor)
        if oom is None:  # skip the halvings that the linear estimate already rules out
            while nxt > floor and round_s * calls * nxt / layers > budget_s:
                nxt = max(nxt // 2, floor)
        reasons.append(why)
        layers = nxt


def train_step_case(tier: str, device: torch.device, emit_every: int, *, shape: dict[str, int],
                    batch_shape: tuple[int, int], keys: bool = True, ffn: bool = True,
                    suite: str = "train_step", size_prefix: str = "", variant: str | None = None,
                    compiled: bool = False, budget: float | None = None) -> Case:
    """A training step (forward, backward, AdamW) on a ``shape`` model and ``batch_shape``
    tokens, with vs without a streaming ``Probe(model, keys=keys, ffn=ffn,
    emit_every=emit_every)``, layers fitted as in the module docstring. The defaults name the
    ``train_step`` suite's case (keys + FFN); the ``probe`` suite passes its own sites and names.
    ``compiled``: both sides through ``torch.compile(fullgraph=True)`` (module docstring); the
    default variant then names the backend (``aot_eager-emit_every=100``). ``budget``: the
    probe's overhead budget (``Probe(budget=...)``, variant ``budget=0.01-emit_every=100``); its
    rows add what the probe itself reports after the timed rounds (``Probe.overhead()``:
    ``budget_average_pct``, ``budget_measured_pct``, ``budget_every``, ``ffn_row_step``), next
    to the overhead the runner measured against the interleaved plain steps."""
    skip = requirements() or (compile_requirements(device) if compiled else None)
    backend = compile_backend(device) if compiled else None
    requested = shape["num_hidden_layers"]
    # Filled by setup() with the layer-fit note: the runner reads ``notes`` after setup and
    # timing, while ``size`` (and so the requested depth) is fixed before setup.
    notes: dict[str, str] = {}

    def build(layers: int) -> Inputs:
        import fastspec

        if compiled:
            _reset_dynamo()
        model = build_llama(tier, device, layers, shape=shape).train()
        inp = {"model": model, "ids": tokens(batch_shape, shape["vocab_size"], device),
               "opt": torch.optim.AdamW(model.parameters(), lr=1e-5), "step": [0]}
        if not compiled:
            probe = fastspec.Probe(model, keys=keys, ffn=ffn, emit_every=emit_every, budget=budget)
            return {**inp, "probe": probe, "probed_model": model, "plain_model": model}
        twin = shared_twin(model)  # before the probe exists: no hooks of its own
        probe = fastspec.Probe(model, keys=keys, ffn=ffn, emit_every=emit_every, budget=budget).attach()
        attached.append(probe)  # detached by free() (a failed depth) or teardown()
        return {**inp, "probe": probe,
                "probed_model": torch.compile(model, fullgraph=True, backend=backend),
                "plain_model": torch.compile(twin, fullgraph=True, backend=backend)}

    def train(model, inp: Inputs) -> None:
        loss = model(input_ids=inp["ids"], labels=inp["ids"]).loss
        loss.backward()
        inp["opt"].step()
        inp["opt"].zero_grad(set_to_none=True)

    def plain(inp: Inputs) -> None:
        train(inp["plain_model"], inp)

    def probed(inp: Inputs) -> None:
        train(inp["probed_model"], inp)
        inp["probe"].step(inp["step"][0])
        inp["step"][0] += 1

    def streaming(inp: Inputs):
        # compiled: attached since build(), before compiling (see the module docstring)
        return contextlib.nullcontext() if compiled else inp["probe"].streaming()

    def compile_warmup(inp: Inputs) -> dict[str, float]:
        """Two untimed steps per side, probed first: the first compiles, the second must not."""
        stats: dict[str, float] = {}
        graphs0, breaks0 = _dynamo_counts()
        for name, fn in (("probed", probed), ("baseline", plain)):
            before = _dynamo_counts()[0]
            first = time_once(lambda fn=fn: fn(inp), device)
            stats[f"{name}_graphs"] = _dynamo_counts()[0] - before
            stats[f"{name}_compile_s"] = first - time_once(lambda fn=fn: fn(inp), device)
        graphs, breaks = _dynamo_counts()
        stats["recompiles"] = graphs - graphs0 - stats["probed_graphs"] - stats["baseline_graphs"]
        stats["graph_breaks"] = breaks - breaks0
        # compiling leaves ~10^5 new Python objects: collect them now, not in a timed round
        gc.collect()
        return stats

    def trial(inp: Inputs) -> float:
        """One timed round as the runner runs it: probed step (hooks on), then the plain one.
        A first probed step comes before, untimed: it allocates AdamW's moments (so the second
        step reaches the steady-state memory peak) and pays one-time costs (kernel loading,
        autotuning; compiled: the compilation of both sides) that would otherwise inflate the
        estimate."""
        if compiled:
            inp["compile"] = compile_warmup(inp)
        else:
            with streaming(inp):
                probed(inp)
        with streaming(inp):
            t = time_once(lambda: probed(inp), device)
        return t + time_once(lambda: plain(inp), device)

    attached: list = []  # compiled: probes attached in build(), for the whole case
    held: dict = {}  # the probe of the depth fit_layers kept (setup), for reported()

    def reported(row: dict) -> dict:
        """What the probe's own budget says, read after the timed rounds (budget cases only)."""
        o = held["probe"].overhead()

        def pct(v):
            return None if v is None else 100 * v

        return {"budget_average_pct": pct(o["average"]), "budget_measured_pct": pct(o["measured"]),
                "budget_every": o["every"], "ffn_row_step": o["ffn_row_step"]}

    def detach_all() -> None:
        # the hooks and the process-wide attention wrapper must not outlive the case
        while attached:
            attached.pop().detach()

    def free() -> None:
        if compiled:
            detach_all()
            _reset_dynamo()  # compiled graphs of a failed depth must not keep its memory
        free_memory(device)

    def release(inp: Inputs) -> None:
        """After the case: the probe off, then dynamo's compiled graphs and guards dropped while
        the models they guard are still alive. Dropping the models first leaves torch 2.11's guard
        managers to clean up after dicts already freed (its dict-watcher cleanup has had
        use-after-free bugs); a CI run aborted once right where this case's inputs were freed."""
        detach_all()
        _reset_dynamo()

    def setup() -> Inputs:
        notes.clear()
        inputs, fit = fit_layers(requested, build, trial, free=free)
        held["probe"] = inputs["probe"]
        notes.update(fit.notes())
        return {**inputs, "fit": fit}

    def check(inp: Inputs) -> dict:
        ids = inp["ids"]
        if compiled:  # grad mode on, as in training: the graphs compiled in the warm-up
            before = _dynamo_counts()[0]
            base = inp["plain_model"](input_ids=ids, labels=ids).loss.detach()
            probed_loss = inp["probed_model"](input_ids=ids, labels=ids).loss.detach()
            stats = dict(inp["compile"])
            stats["recompiles"] += _dynamo_counts()[0] - before
        else:
            # training forwards (gradients on, no backward): what streaming captures
            model, stats = inp["model"], {}
            base = model(input_ids=ids, labels=ids).loss.detach()
            with inp["probe"].streaming():
                probed_loss = model(input_ids=ids, labels=ids).loss.detach()
        return {"fastspec_error": float((probed_loss.double() - base.double()).abs()),
                "baseline_error": None, **inp["fit"].extras(), **stats}

    if variant is None:
        variant = f"{backend}-emit_every={emit_every}" if compiled else f"emit_every={emit_every}"
        if budget is not None:
            variant = f"budget={budget:g}-{variant}"
    baseline = "compiled training step without probe" if compiled else "training step without probe"
    return Case(suite=suite, size=size_prefix + size_id(tier, shape, batch_shape), variant=variant,
                setup=setup, fastspec=probed, baselines={baseline: plain},
                check=check, error_kind="|Δloss| with probe",
                # hooks must not change the numbers; compiled, the probe must not break the graph
                # (fullgraph=True would raise) nor make a step recompile (its schedule is data)
                claim=exactly_zero("graph_breaks", "recompiles") if compiled else exactly_zero(),
                skip=skip, notes=notes,
                fastspec_context=streaming, overhead=True,
                row_extra=reported if budget is not None and not compiled else None,
                teardown=release if compiled else None)
