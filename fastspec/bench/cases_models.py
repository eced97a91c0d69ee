"""Model-level suites on a Llama-style transformer built from ``transformers.LlamaConfig``.

* ``keyrank``: the SPEC §5 key-rank protocol end to end, ``fastspec.Probe.measure`` vs the hand
  protocol (eval mode, forward hooks on every layer's ``k_proj`` plus its rotary embedding, one
  ``torch.linalg.svdvals(K.float())`` per KV head, PR of σ). Accuracy: max over heads of
  |PR − PR_fp64| / PR_fp64 for both (PR_fp64: the hand protocol with float64 svdvals), and the max
  |ΔPR| between fastspec and the hand protocol (``pr_diff_vs_baseline``).
* ``train_step``: one training step (forward, backward, AdamW) with and without a streaming
  ``fastspec.Probe`` on every layer's keys and FFN activations; reported as overhead in % of the
  step. Accuracy: |Δloss| with the probe attached (hooks must not change the numbers).

``gpu`` tier: the 1.5B shape of SPEC §5 (d_model 2048, 32 layers, 16 query / 8 KV heads of 128,
d_ff 8192) in bf16 with 4 × 2048 tokens; ``cpu``/``quick``: small fp32 models of the same layout.
Weights are random: timings and protocol agreement do not depend on training.

Layer fitting (``train_step`` and the ``probe`` suite's train step, every tier, see
:func:`fit_layers`): a bf16 training step with AdamW at the 1.5B shape needs ~17 GB of weights,
grads and Adam state plus tens of GB of
activations and the probe's FFN accumulators, which may not fit next to anything else on an
80 GB GPU, and ``emit_every=1`` may be too slow for the tier's time cap. So ``setup()`` runs a
trial step at the requested depth and halves the layer count on out-of-memory or when the trial
says the timed rounds would overrun :data:`STEP_BUDGET_S`. How it is recorded, given that the
runner reads ``size`` before ``setup()`` runs (``--filter``, time-cap rows and the row head are
all keyed on it): ``size`` stays the requested shape (``L32-...``); every measured row gets the
numeric extras ``layers`` (what ran) and ``layers_requested``; a reduced case also gets a note
row ``{"baseline": "32 layers", "skipped": "reduced to 16 layers: <why>"}``. Fewer layers lower
``overhead_pct`` slightly (the embedding and LM head are a fixed share of the step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .cases import Case, Inputs
from .runner import _free
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
KEYRANK_TOKENS = {"quick": (1, 64), "cpu": (2, 256), "gpu": (4, 2048)}  # (batch, sequence)
TRAIN_TOKENS = {"quick": (1, 32), "cpu": (2, 128), "gpu": (4, 2048)}


def _requirements() -> str | None:
    """Why the model suites cannot run here (None: they can)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers not installed (pip install 'fastspec[hf]')"
    import fastspec

    if not hasattr(fastspec, "Probe"):
        return "fastspec.Probe is not available in this version"
    return None


def _dtype(tier: str) -> torch.dtype:
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
    return model.to(_dtype(tier))


def _tokens(tier: str, shape: tuple[int, int], device: torch.device,
            vocab: int | None = None) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1234)
    vocab = MODEL_SHAPES[tier]["vocab_size"] if vocab is None else vocab
    return torch.randint(vocab, shape, generator=g).to(device)


def hand_key_rank(model: Any, batch: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SPEC §5 key-rank PR per (layer, KV head), ``[L, H_kv]``, the way one writes it by hand.

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
            out[r.layer, r.head] = r.value
    return out


def _size(tier: str, tokens: tuple[int, int], shape: dict[str, int] | None = None) -> str:
    s = MODEL_SHAPES[tier] if shape is None else shape
    dt = "bf16" if _dtype(tier) == torch.bfloat16 else "fp32"
    return (f"L{s['num_hidden_layers']}-KV{s['num_key_value_heads']}-d{s['head_dim']}"
            f"-ff{s['intermediate_size']}-N{tokens[0]}x{tokens[1]}-{dt}")


def keyrank_cases(tier: str, device: torch.device) -> list[Case]:
    skip = _requirements()
    tokens = KEYRANK_TOKENS[tier]
    L, H = MODEL_SHAPES[tier]["num_hidden_layers"], MODEL_SHAPES[tier]["num_key_value_heads"]

    def setup() -> Inputs:
        import fastspec

        model = build_llama(tier, device)
        ids = _tokens(tier, tokens, device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"model": model, "batch": batch, "probe": fastspec.Probe(model, keys=True, ffn=False)}

    def run(inp: Inputs) -> list:
        return inp["probe"].measure(inp["batch"], step=0)

    def hand(inp: Inputs) -> torch.Tensor:
        return hand_key_rank(inp["model"], inp["batch"])

    def check(inp: Inputs) -> dict:
        probe_pr, hand_pr = probe_key_rank(run(inp), L, H), hand(inp).double()
        truth = hand_key_rank(inp["model"], inp["batch"], torch.float64)

        def worst(d: torch.Tensor) -> float:  # a head the probe did not report is NaN, not 0
            return float("nan") if d.isnan().any() else float(d.abs().max())
        return {"fastspec_error": worst((probe_pr - truth) / truth),
                "baseline_error": worst((hand_pr - truth) / truth),
                "pr_diff_vs_baseline": worst(probe_pr - hand_pr)}

    return [Case(suite="keyrank", size=_size(tier, tokens), variant="auto", setup=setup, fastspec=run,
                 baselines={"hooks + svdvals per head": hand}, check=check,
                 error_kind="max rel err of PR vs fp64", skip=skip)]


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


def train_step_cases(tier: str, device: torch.device) -> list[Case]:
    """Probe defaults (capture every step, metrics every 100 steps: the timed steps are capture
    only), and ``emit_every=1`` (metrics every step: the worst case; emission cost per step =
    the difference, amortized by ``emit_every``)."""
    return [_train_step_case(tier, device, emit_every) for emit_every in (100, 1)]


def _train_step_case(tier: str, device: torch.device, emit_every: int, *, keys: bool = True,
                     ffn: bool = True, shape: dict[str, int] | None = None,
                     tokens: tuple[int, int] | None = None, suite: str = "train_step",
                     size_prefix: str = "", variant: str | None = None) -> Case:
    """A training step with vs without a streaming ``Probe(model, keys=keys, ffn=ffn,
    emit_every=emit_every)``. Defaults: the ``train_step`` suite (keys + FFN, the tier's
    :data:`MODEL_SHAPES` and :data:`TRAIN_TOKENS`); the ``probe`` suite passes its own shape,
    tokens, sites and names (``fastspec.bench.cases_probe``)."""
    skip = _requirements()
    tokens = TRAIN_TOKENS[tier] if tokens is None else tokens
    requested = (MODEL_SHAPES[tier] if shape is None else shape)["num_hidden_layers"]
    over = {} if shape is None else {"shape": shape}  # the default path calls build_llama as before
    vocab = None if shape is None else shape["vocab_size"]
    # Filled by setup() with the layer-fit note: the runner reads ``notes`` after setup and
    # timing, while ``size`` (and so the requested depth) is fixed before setup.
    notes: dict[str, str] = {}

    def build(layers: int) -> Inputs:
        import fastspec

        model = build_llama(tier, device, layers, **over).train()
        return {"model": model, "ids": _tokens(tier, tokens, device, vocab),
                "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
                "probe": fastspec.Probe(model, keys=keys, ffn=ffn, emit_every=emit_every), "step": [0]}

    def plain(inp: Inputs) -> None:
        loss = inp["model"](input_ids=inp["ids"], labels=inp["ids"]).loss
        loss.backward()
        inp["opt"].step()
        inp["opt"].zero_grad(set_to_none=True)

    def probed(inp: Inputs) -> None:
        plain(inp)
        inp["probe"].step(inp["step"][0])
        inp["step"][0] += 1

    def streaming(inp: Inputs):
        return inp["probe"].streaming()

    def trial(inp: Inputs) -> float:
        """One timed round as the runner runs it: probed step (hooks on), then the plain one.
        A first probed step comes before, untimed: it allocates AdamW's moments (so the second
        step reaches the steady-state memory peak) and pays one-time costs (kernel loading,
        autotuning) that would otherwise inflate the estimate."""
        with streaming(inp):
            probed(inp)
        with streaming(inp):
            t = time_once(lambda: probed(inp), device)
        return t + time_once(lambda: plain(inp), device)

    def setup() -> Inputs:
        notes.clear()
        inputs, fit = fit_layers(requested, build, trial, free=lambda: _free(device))
        notes.update(fit.notes())
        return {**inputs, "fit": fit}

    def check(inp: Inputs) -> dict:
        model, ids = inp["model"], inp["ids"]
        with torch.no_grad():
            base = model(input_ids=ids, labels=ids).loss
            with inp["probe"].streaming():
                probed_loss = model(input_ids=ids, labels=ids).loss
        return {"fastspec_error": float((probed_loss.double() - base.double()).abs()),
                "baseline_error": None, **inp["fit"].extras()}

    return Case(suite=suite, size=size_prefix + _size(tier, tokens, shape),
                variant=f"emit_every={emit_every}" if variant is None else variant,
                setup=setup, fastspec=probed, baselines={"training step without probe": plain},
                check=check, error_kind="|Δloss| with probe", skip=skip, notes=notes,
                fastspec_context=streaming, overhead=True)
