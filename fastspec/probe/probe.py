"""``fastspec.Probe``: per-layer, per-head spectral metrics from a live PyTorch / HF model.

Sites (docs/protocols.md):

* ``keys`` / ``queries``: what attention sees, after Q/K-norm and RoPE, per KV head (keys) or
  query head (queries), ``[B, T, H, d_head]`` rows, intercepted at the attention function
  (``hf_attention.py``) whatever backend the model uses; for models that call no attention
  interface (OLMo-core, TorchTitan), at the module that receives them, as their family says
  (``families.AttentionInputs``). Under tensor parallelism a ``DTensor`` sharded over heads
  gives each head its global index.
* ``keys_prerope``: keys after ``k_norm`` (or ``k_proj``) and before RoPE, for comparison.
* ``ffn``: the input of the down projection, ``[B, T, d_ff]`` (forward pre-hook; flattened
  ``[B·T, d_ff]`` rows, as OPT's, are viewed as ``[B, T, d_ff]`` so the mask reaches them); while
  streaming, by default only every k-th token, sized to the budget (``ffn_rows``, ``ffn_sampling.py``).
* ``modules``: any module by name pattern (:class:`ModuleSite`).
* ``gamma_k`` / ``gamma_q``: coefficient of variation of the Q/K-norm weight γ per layer.

Only tokens the 2-D ``attention_mask`` of the model call keeps are counted (padding is not); a
mask whose shape does not fit the call's ``[B, T]`` tokens raises (``hooks.check_mask``), and so
do a :meth:`Probe.measure` batch without a token or with a mask of zeros (``checks.py``).
A requested site that captures no rows warns (after :meth:`Probe.measure`, and once per site at a
streaming emission) with the likely reason; a site that matches no module raises at construction.
Rows with NaN/Inf are never merged (``Covariance.rejected``): the (site, layer)s that refused some
are named in a warning (after :meth:`Probe.measure`, and once each when streamed records arrive).
A capture counts only while the probed model's own ``forward`` is running, so the forward that
activation checkpointing recomputes during backward is never counted twice. Captures run under
``no_grad`` with autocast off and read the activations without changing them: the model's
outputs and gradients are bitwise the same with and without the probe.

Schedules: :meth:`Probe.measure` (eval protocol) and streaming (:meth:`Probe.attach`,
:meth:`Probe.step`), see their docstrings.
Streaming works inside ``torch.compile`` (``fullgraph=True`` included, no graph break, no
recompile as the schedule changes): each capture is one custom op (``routing.py``,
docs/compile.md).

:class:`Probe` is a facade over one module per job:

* ``sites.py``: the sites a user can choose, and one :class:`~fastspec.Covariance` per (site, layer);
* ``hooks.py``: installing and removing the hooks, the model's forward depth and padding mask;
* ``routing.py``: where each capture goes (an eval measurement, the streaming totals, nowhere);
* ``budget.py``: the streaming schedule and its overhead budget, from the work times of ``timer.py``;
* ``ffn_sampling.py``: the FFN sites' streaming token sampling, from a FLOP model;
* ``plan.py`` / ``layout.py``: the memory plan (``memory=``): what the probe may hold on a rank,
  which rank keeps each FFN layer, the rotation, the tensor-parallel gather (docs/scale.md);
* ``emission.py`` (and ``gamma.py``): metrics and spectra of the covariances, one eigensolve per shape;
* ``measurement.py``: an eval measurement over several forwards (:meth:`Probe.measurement`);
* ``checks.py``: the batch a measurement takes, and the sites whose rows were missing or refused;
* ``pending.py`` / ``history.py`` / ``record.py``: the records, handed to the host without a sync.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from .. import _args
from ..covariance.policy import UpdateSettings
from . import checks, plan
from .budget import OverheadBudget
from .emission import RECORD_METRICS, SPECTRUM_METRICS, SYNC_MODES, Emitter
from .families import ModelChunks, resolve_family
from .ffn_sampling import choose_ffn_rows
from .history import History
from .hooks import ForwardScope, Hooks, SitePlan, positional_index
from .layout import Meter, WideSites, ffn_split, resolve_budget, stage_of
from .measurement import Measurement
from .record import Record
from .routing import Router
from .sites import CONVENTIONS, Collector, module_sites
from .timer import StepClock, WorkTimer

__all__ = ["FORWARDS", "RECORD_METRICS", "ROW_SETTINGS", "SPECTRUM_METRICS", "SYNC_MODES", "Probe"]

#: :meth:`Probe.load_state_dict`: settings whose change makes saved accumulators mean other rows
#: (dropped on restore); the others (``every``, ``emit_every``, ``budget``) are the schedule's.
ROW_SETTINGS = ("sites", "modules", "key_convention", "ffn_convention", "precision", "row_step",
                "ffn_row_step", "reset", "tp_rank")

#: ``Probe(forwards=...)``: which forwards streaming captures: ``"train"`` (the model in training
#: mode with gradients enabled) or ``"all"`` (evaluation forwards too).
FORWARDS = ("train", "all")


# Megatron-core's wrappers around a model chunk (its DistributedDataParallel and FSDP in
# megatron.core.distributed, Float16Module), each holding the chunk as ``.module``
_MEGATRON_WRAPPERS = ("megatron.core.distributed.", "megatron.core.transformer.module.Float16Module")


def _is_megatron_wrapper(model: nn.Module) -> bool:
    path = f"{type(model).__module__}.{type(model).__qualname__}"
    return path.startswith(_MEGATRON_WRAPPERS) and isinstance(getattr(model, "module", None), nn.Module)


def _unwrap_compiled(model):
    """``torch.compile(model)``, torch's DDP and Megatron-core's DDP/``Float16Module`` return wrappers
    around the eager module: probe that one (its hooks are the compiled wrapper's too;
    :meth:`Probe.measure` runs it eagerly). A list or tuple of modules (Megatron's model chunks)
    becomes one :class:`~fastspec.probe.families.ModelChunks` of the unwrapped chunks."""
    if isinstance(model, (list, tuple)) and not isinstance(model, nn.Module):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("model: expected a torch.nn.Module or a non-empty list of them (model chunks)")
        chunks = [_unwrap_compiled(m) for m in model]
        return chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or _is_megatron_wrapper(model):
            model = model.module
            continue
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


def _force_eager():
    """Run every ``torch.compile``'d function eagerly inside this context (torch >= 2.6): a
    measurement is the eager protocol, and must not recompile (or skip) a graph traced for
    streaming, e.g. of submodules compiled in place. Free when nothing was ever compiled."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:  # nothing can be compiled yet
        return contextlib.nullcontext()
    return set_stance("force_eager")


class Probe:
    """Spectral probes on a model: ``probe.measure(batch, step=s)`` -> list of :class:`Record`.

    Args:
        model: an ``nn.Module``; attention sites need a Hugging Face ``PreTrainedModel``
            (a family listed in ``fastspec.probe.FAMILIES``, or any model using the attention
            interface) or a model of a family that says where its attention receives queries
            and keys (OLMo-core, TorchTitan, Megatron-core: ``family``); FFN sites need a known
            family; ``modules`` work on any module. Probe the model whose ``forward`` the
            training loop calls: only that forward counts (not a checkpoint's recompute in
            backward). A list of modules is probed as one model whose chunks are called one by
            one (Megatron's model chunks, each unwrapped from Megatron's DDP/``Float16Module``).
        keys, queries, ffn, prerope_keys: which built-in sites to probe.
        modules: extra sites: a glob, a :class:`ModuleSite`, or a list of them. A site that
            matches no module of the model raises here, as does a site name used twice.
        key_convention: ``"sv"`` (the key-rank protocol: raw singular values) or ``"eig"``; also
            used for queries and pre-RoPE keys.
        ffn_convention: ``"eig"`` (the FFN utilization protocol) or ``"sv"``.
        backend: covariance update backend (``"auto"``, ``"torch"``, ``"triton"``).
        precision: float64 (``"exact"``) or float32 (``"fast"``) products in the covariance
            updates. ``"auto"`` (default): exact for ``sv`` sites (the key rank then matches
            float64 ``svdvals`` to ~1e-8 even for rank-deficient heads) on CPU and on GPUs with
            full-rate float64, fast (the Triton kernels on CUDA) for ``eig`` sites and elsewhere.
            ``"fast"`` everywhere moves a rank-deficient head's key PR by up to ~4e-4. The
            policy and its accuracy: ``fastspec.covariance.policy``.
        exact_sv: deprecated spelling of ``precision``: ``True`` = ``"auto"``, ``False`` = ``"fast"``.
        every: streaming: capture the forwards of one step in ``every`` (at least; ``budget``
            may widen it).
        emit_every: streaming: compute metrics every ``emit_every`` calls of :meth:`step` (a
            ``budget`` may skip some when emission alone is too expensive).
        reset: streaming: zero the accumulators after each emission (``False``: running totals).
        row_step: token sampling: keep every ``row_step``-th token of each sequence.
        budget: streaming overhead budget, probe work as a fraction of the step time without
            the probe (e.g. ``0.01``). Capture *and* emission work are timed and both count:
            the capture interval and, when emission alone is too expensive, the emission
            interval widen to stay under it (``budget.py``). ``None``: no adaptation (the
            overhead is still measured and reported). Captures inside a compiled graph cannot
            be timed one by one: their cost is the step time of captured steps over that of
            idle ones (docs/compile.md).
        ffn_rows: streaming token sampling of the FFN sites, on top of ``row_step``:
            ``"auto"`` (default) keeps every k-th token with k chosen once from a FLOP model
            (full-rate FFN Grams cost ``2·N·Σd_ff²`` against ``6·N·P`` for a training step) so
            that the FFN share is at most ``budget``, or 1% of a step without one
            (``ffn_sampling.DEFAULT_FFN_SHARE``); ``"all"``: every token; an int k: every k-th token.
            Unbiased for the covariance, with ~k× its variance; :meth:`measure` keeps every
            token. The choice: :attr:`ffn_rows` (k), :attr:`ffn_row_step`, :meth:`overhead`.
        sync: under ``torch.distributed``: ``"all"`` ranks get the global metrics, only
            ``"rank0"``, or ``"none"`` (each rank its own tokens).
        process_group: the data-parallel group to merge over (default: the world).
        tp_rank: tensor-parallel rank; head indices become ``tp_rank * H_local + h``. Keys
            that arrive as a ``DTensor`` sharded over heads need none: its placement gives
            the global index.
        cuda_graphs: for ``torch.compile(mode="reduce-overhead")``: the capture schedule of a
            compiled model is then a tensor on the GPU, which a CUDA graph can hold, and idle
            steps do the capture work too (masked out). Default: a CPU tensor, which makes idle
            steps free but keeps Inductor from using CUDA graphs (docs/compile.md).
        clock: host clock for the overhead timer (seconds; default ``time.perf_counter``).
        forwards: which forwards streaming captures. ``"train"`` (default): training forwards
            only, the probed model in training mode (``model.train()``) with gradients enabled;
            a forward under ``model.eval()``, ``torch.no_grad()`` or ``torch.inference_mode()``
            (a trainer's evaluation, generation) is not captured, costs only that check, and
            its time (eager forwards) is not step time for the budget. ``"all"``: every forward of
            the model while attached, evaluation forwards included, their time counted as step
            time (what streaming did before this option existed). :meth:`measure` ignores it.
        family: where the built-in sites live: a name in ``fastspec.probe.FAMILIES`` or a
            :class:`~fastspec.probe.Family`. Default: found from the model, a Hugging Face
            model's ``config.model_type`` or the class of an OLMo-core or TorchTitan model
            (``Family.model_classes``); see ``families.py``.
        memory: the device memory the probe may hold on each rank (accumulators, capture and
            emission workspace): bytes, a size such as ``"4GB"`` or ``"512MiB"``, or a float in
            (0, 1], that share of the device's memory. Default: 5% of a CUDA device
            (``plan.DEFAULT_FRACTION``), no budget on the CPU. The probe plans before the first
            step how the FFN layers fit (``plan.py``): every layer on every rank where that fits,
            else each layer kept by one rank of the data-parallel group, float32 totals, layers
            taking turns; it raises here, naming ``d_ff``, the bytes needed and the budget, when
            not even one layer fits. :meth:`memory` says what it holds; :attr:`layout` how.
        tp_group: the tensor-parallel process group over which the FFN input is split by columns
            (Megatron-core's ``RowParallelLinear`` names its own, a ``DTensor`` its mesh: then
            none is needed). The sampled FFN rows are gathered over it to the rank that keeps
            the layer.

    Flags take Python or NumPy bools, counts Python or NumPy ints (never bools or floats); a bad
    argument raises naming it (``fastspec/_args.py`` holds the rules).

    Example::

        probe = fastspec.Probe(model)                      # keys (sv PR per head) + FFN
        records = probe.measure(eval_batch, step=step)     # eval protocol, every N steps
        df = probe.to_dataframe()
        spectra = probe.spectra(eval_batch)                # {(site, layer): [*heads, D]}

    Hooks stay on the model while streaming (:meth:`attach`) until :meth:`detach`, or its
    alias :meth:`close`; a probe is also a context manager that closes on exit, also on error::

        with fastspec.Probe(model) as probe:
            probe.attach()
            train(...)                                     # probe.step(step) per optimizer step
        # every hook is removed here; probe.records() still has the records
    """

    def __init__(self, model: nn.Module, *, keys: bool = True, queries: bool = False, ffn: bool = True,
                 prerope_keys: bool = False, modules=None, key_convention: str = "sv",
                 ffn_convention: str = "eig", backend: str = "auto", precision: str = "auto",
                 exact_sv: bool | None = None, every: int = 1,
                 emit_every: int = 100, reset: bool = True, row_step: int = 1,
                 budget: float | None = None, ffn_rows: int | str = "auto", sync: str = "all",
                 process_group=None, tp_rank: int = 0, cuda_graphs: bool = False,
                 clock: Callable[[], float] | None = None, family=None, forwards: str = "train",
                 memory=None, tp_group=None):
        if not isinstance(model, (nn.Module, list, tuple)):
            raise TypeError(f"model: expected a torch.nn.Module (or a list of model chunks), got {type(model).__name__}")
        keys, queries = _args.flag("keys", keys), _args.flag("queries", queries)
        ffn, prerope_keys = _args.flag("ffn", ffn), _args.flag("prerope_keys", prerope_keys)
        self.reset_after_emit = _args.flag("reset", reset)
        if exact_sv is not None:
            warnings.warn("fastspec.Probe: exact_sv= is deprecated; use precision='auto' (float64 products "
                          "for sv sites) or precision='fast'", DeprecationWarning, stacklevel=2)
            precision = "auto" if _args.flag("exact_sv", exact_sv) else "fast"
        _args.choice("key_convention", key_convention, CONVENTIONS)
        _args.choice("ffn_convention", ffn_convention, CONVENTIONS)
        _args.choice("sync", sync, SYNC_MODES)
        _args.choice("forwards", forwards, FORWARDS)
        tp_rank = _args.integer("tp_rank", tp_rank, minimum=0)
        # checked once here; every accumulator of the probe gets this object (covariance/policy.py)
        self.settings = UpdateSettings(precision, backend)
        self.row_step = _args.integer("row_step", row_step, minimum=1)
        self._budget = OverheadBudget(budget, every, emit_every)  # checks all three
        self.emit_every = self._budget.base_emit_every
        sites = module_sites(modules)
        if not (keys or queries or ffn or prerope_keys or sites):
            raise ValueError("keys/queries/ffn/prerope_keys/modules: no site selected; turn one on or "
                             "pass modules= (a glob or ModuleSite)")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(clock).__name__}")
        self.model = _unwrap_compiled(model)
        self.family = resolve_family(self.model, keys or queries or ffn or prerope_keys, prerope_keys, family)
        self.ffn_rows, self.ffn_share = choose_ffn_rows(self.model, self.family, ffn, ffn_rows,
                                                         self._budget.budget, self.row_step)
        self.sites = SitePlan(keys=keys, queries=queries, ffn=ffn, prerope_keys=prerope_keys,
                              modules=sites, key_convention=key_convention,
                              ffn_convention=ffn_convention, tp_rank=tp_rank,
                              ffn_row_step=self.row_step * self.ffn_rows)
        names = self.sites.names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # two sites of one name would merge their rows into one accumulator
            raise ValueError(f"modules: site name(s) {twice} used twice; give each ModuleSite its own label=")

        self._checked = False  # the first-use self-checks of attach() (_self_checks) have run
        self._timer = WorkTimer(clock)
        self._totals = Collector(self.settings)  # the streaming totals (all captures between emissions)
        scope = ForwardScope(self.model, self.family.mask if self.family is not None else "keep")
        self._router = Router(self._totals, scope, self._timer, self.row_step,
                              cuda_graphs=_args.flag("cuda_graphs", cuda_graphs), all_forwards=forwards == "all")
        self._hooks = Hooks(self.model, self.sites, self.family, self._router.capture, self._router.slot, scope,
                            wanted=self._router.wanted)
        self._hooks.check()  # a site that matches no module fails here, not at the first measure/attach
        self._emitter = Emitter(self.model, self.family, gamma=keys or queries or prerope_keys, sync=sync,
                                process_group=process_group)
        self._memory_arg = plan.memory_arg(memory)  # checked here; resolved on the model's device
        self._tp_group = tp_group
        self._wide: WideSites | None = None
        self._meter: Meter | None = None
        self._planned_world: tuple[int, int] | None = None  # (world size, rank) the plan was made under
        self._window_start: int | None = None  # first step of the current emission window
        self._plan_layout()  # the memory plan: raises here when the budget cannot hold one FFN layer
        self._history = History()
        self._steps_seen = 0
        self._clock = StepClock(self._timer.clock)  # each step's seconds, pauses while detached left out
        if forwards == "train":  # an eager forward that does not train is then not step time either
            scope.on_other = self._other_forward
        self._flush_allowed = False        # one step() after detach() is a final one, not a mistake
        self._paused = False               # pause() .. unpause(): attached, but not streaming nor timed
        self._warned_step = False
        self._warned_sites: set[str] = set()  # sites a streaming emission warned about (once each)
        self._warned_rejected: set[tuple] = set()  # (site, layer)s streamed NaN/Inf rows were named for
        # measure(tensor) calls model(tensor): its input_ids where forward takes them first (HF models)
        self._tensor_is_input_ids = positional_index(self.model.forward, "input_ids") == 0

    # ----------------------------------------------------------------- memory plan
    def _ranks(self, split) -> plan.Ranks:
        """The ranks the FFN layers may be spread over (``plan.Ranks``): the data-parallel group
        when emissions merge over it, the tensor-parallel ranks that split the FFN input."""
        import torch.distributed as dist

        dp, dp_rank = 1, 0
        if self._emitter.collective:
            group = self._emitter.process_group
            dp, dp_rank = dist.get_world_size(group), dist.get_rank(group)
        tp, tp_rank = (split[0], split[2]) if split is not None else (1, 0)
        return plan.Ranks(dp, tp, dp_rank, tp_rank, self._device().type)

    def _device(self) -> torch.device:
        param = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        device = torch.device("cpu") if param is None else param.device
        if device.type == "meta":  # a model built on meta (deferred init): its real device is CUDA if any
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return device

    def _plan_layout(self) -> None:
        """Plan the probe's memory (``plan.plan``) for this model, these ranks and the budget:
        the layout of the FFN layers (:attr:`layout`) and the meter of :meth:`memory`. Run at
        construction and again at :meth:`attach`/:meth:`measure` if the ranks changed since (a
        probe built before ``init_process_group``) while nothing was accumulated."""
        import torch.distributed as dist

        # what the plan depends on that can change after construction: the process group's state
        # (a dict lookup and two ints here, so measure() pays nothing when nothing changed)
        world = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else None
        if self._wide is not None and world == self._planned_world:
            return
        if self._wide is not None and self._totals.accs:
            return  # rows are held under the old plan: keep it (the state says which)
        self._planned_world = world
        sites = self.sites
        split = ffn_split(self.model, self.family, self._tp_group) if sites.ffn else None
        ranks = self._ranks(split)
        if self._wide is not None and self._wide.layout.ranks == ranks:
            return
        attention = len(self._hooks._attention_modules()) if (sites.keys or sites.queries or sites.prerope_keys) else 0
        stage = stage_of(self.model, self.family, ffn=sites.ffn, convention=sites.ffn_convention, keys=sites.keys,
                         queries=sites.queries, prerope_keys=sites.prerope_keys, reset=self.reset_after_emit,
                         tp=ranks.tp, attention_layers=attention)
        budget = resolve_budget(self._memory_arg, self._device())
        layout = plan.plan(stage, ranks, budget)
        wide = WideSites(layout, stage, budget, split, self._emitter.process_group, self._emitter.collective)
        planned = {site for site, _, _ in stage.small} | ({"ffn"} if stage.wide else set())
        meter = Meter(wide.figures, budget, planned)
        self._wide, self._meter = wide, meter
        self._totals.wide, self._totals.meter = wide, meter
        meter.watch(self._totals)
        self._hooks.wide = self._emitter.wide = wide
        # tensor-parallel ranks gather FFN rows together: their capture steps must not drift apart
        self._budget.adapt_capture = not wide.split

    def _next_window(self) -> None:
        """After a streaming emission: the next window starts; under rotation the FFN layers just
        measured give their memory back (the next turn's allocate at their first capture)."""
        wide = self._wide
        self._window_start = None
        if wide.rotating:
            for layer in wide.solved():
                acc = self._totals.accs.get(("ffn", layer))
                if acc is not None:
                    acc.cov.free()
        wide.window += 1

    @property
    def layout(self) -> plan.Layout:
        """The memory plan's layout of the FFN layers (``plan.Layout``): ``mode``
        (``"default"`` without a budget, ``"replicated"``, ``"owned"``), ``totals``, ``groups``
        (windows between two measurements of a layer), ``holders`` (the rank keeping each layer)."""
        return self._wide.layout

    def memory(self) -> dict:
        """What the probe holds on this rank, in bytes (docs/scale.md):

        * ``"now"``: its accumulators now, read from their tensors (the streaming totals, and an
          eval measurement's while it runs);
        * ``"peak"``: the most it held so far with the workspace of the work it did: the
          accumulators at each change, plus the plan's capture workspace (after a capture) or
          emission workspace (at an emission): the in-place update's row block and the
          tensor-parallel gather, the copies an emission reduces and solves in, the eigensolver's
          copy of its input (bounds for the default update kernels);
        * ``"budget"``: the budget (None: none), ``"planned_peak"``: the plan's figure for this rank
          once every layer it keeps has been captured and emitted (what ``fastspec plan`` prints);
        * ``"sites"``: ``"now"`` per site (``"keys"``, ``"ffn"``, ...), ``"workspace"``: the
          capture and emission workspace of the plan;
        * ``"layout"``, ``"totals"``, ``"ffn_every"`` (windows between two measurements of the
          same FFN layer), ``"ffn_layers"`` (the FFN layers this rank keeps)."""
        m, wide = self._meter, self._wide
        f = wide.figures
        return {"now": m.held(), "peak": m.peak, "budget": wide.budget, "planned_peak": f.peak,
                "sites": m.by_site(), "workspace": {"capture": m.capture, "emission": m.emission},
                "layout": wide.layout.mode, "totals": wide.layout.totals, "ffn_every": wide.layout.groups,
                "ffn_layers": list(f.layers)}

    def _other_forward(self, starts: bool) -> None:
        """``ForwardScope.on_other`` (``forwards="train"``): a forward that does not train starts or
        ends (eager only); while streaming its span is left out of the step."""
        if self._router.streaming:
            self._clock.other_forward(starts)

    # ------------------------------------------------------------- eval protocol
    def _as_batch(self, batch) -> dict | Tensor:
        """``batch`` as a dict of model kwargs (from any mapping, e.g. a tokenizer's
        ``BatchEncoding``) or an ``input_ids`` tensor, with at least one token to measure
        (``checks.check_batch``: raises naming ``input_ids``, ``inputs_embeds`` or ``attention_mask``)."""
        if isinstance(batch, Tensor):
            # a custom module's first input may be anything: its own to check
            checks.check_batch(batch, tensor_is_input_ids=self._tensor_is_input_ids)
            return batch
        if not isinstance(batch, Mapping) or not all(isinstance(k, str) for k in batch):
            raise TypeError(f"batch: expected a mapping of model kwargs (a dict, a tokenizer's BatchEncoding) "
                            f"or an input_ids tensor, got {type(batch).__name__}")
        batch = dict(batch)
        for key in ("input_ids", "attention_mask"):
            if key in batch and not isinstance(batch[key], Tensor) and batch[key] is not None:
                raise TypeError(f"batch: {key} is a {type(batch[key]).__name__}, expected a tensor "
                                f"(tokenize with return_tensors='pt')")
        checks.check_batch(batch, tensor_is_input_ids=True)
        return batch

    def _eval_forward(self, batch, collector: Collector):
        """One eval forward of ``batch`` with every capture going to ``collector``; returns the
        model's output.

        Puts the model in eval mode and runs it under ``no_grad``; restores each module's
        train/eval flag and removes the hooks it added, also when the forward raises.
        """
        model = self.model
        modes = [(m, m.training) for m in model.modules()]
        installed_here = not self._hooks.installed
        try:
            if installed_here:
                self._hooks.install()
            with self._router.measuring(collector):
                model.eval()
                # submodules compiled in place (module.compile(), e.g. under FSDP2) run eagerly too:
                # a graph traced for streaming drops measurement captures (routing.py)
                with torch.no_grad(), _force_eager():
                    return model(**batch) if isinstance(batch, dict) else model(batch)
        finally:
            if installed_here:
                self._hooks.remove()
            for m, was_training in modes:
                m.training = was_training

    def measure(self, batch, *, step: int, tokens_seen: int | None = None) -> list[Record]:
        """The eval protocol (docs/protocols.md): one forward of a fixed batch, metrics of exactly its tokens.

        Puts the model in eval mode, runs ``model(**batch)`` (a mapping of model kwargs with the
        ``attention_mask``: a dict, a tokenizer's ``BatchEncoding``) or ``model(batch)`` (an
        ``input_ids`` tensor) under ``no_grad``, computes every site's metrics, then restores
        each module's train/eval flag and removes the hooks it added, also when the forward raises. Streaming accumulators are untouched.
        A ``torch.compile``'d model is measured through its eager module (same parameters).
        Under ``torch.distributed`` every rank calls ``measure`` with its share of the batch and
        gets the metrics of the whole batch (``sync="all"``), as one process would.

        Returns the new records (also appended to :meth:`records`); waits for their values.
        Warns (``UserWarning``) for each site that captured no rows, with the likely reason (also
        a site that ran but whose every row the ``attention_mask`` left out), and, in one warning,
        names the (site, layer)s that rejected rows holding NaN/Inf (never merged; the ``rejected``
        metric counts them).
        Raises ``ValueError`` before the forward if ``input_ids`` is not an integer ``[B, T]``
        with at least one token (``inputs_embeds``: ``[B, T, d]``), or if the ``attention_mask``
        does not fit it or masks every token.
        """
        step = _args.integer("step", step)
        tokens_seen = _args.integer("tokens_seen", tokens_seen, minimum=0, optional=True)
        batch = self._as_batch(batch)
        self._plan_layout()
        records: list[Record] = []
        collectors = []
        for _ in self._eval_passes():
            collector = self._collector()
            self._eval_forward(batch, collector)
            pending = self._emitter.records(collector, step, tokens_seen, "eval", consume=True)
            records += [] if pending is None else pending.materialize()
            collectors.append(collector)
        self._keep_eval_records(collectors[0], records, stacklevel=3)
        return records

    def _collector(self, timer=None) -> Collector:
        """A collector for one eval measurement, under the probe's memory plan."""
        return Collector(self.settings, timer=timer, wide=self._wide, meter=self._meter)

    def _eval_passes(self) -> Iterator[int | None]:
        """The forwards one eval measurement takes: one, or under a memory plan as many as the
        budget needs beside what the probe holds already (its streaming accumulators): the FFN
        layers in groups, one group a forward, the first forward capturing every other site too
        (``WideSites.eval_passes``), with :attr:`WideSites.eval_pass` set for each."""
        wide = self._wide
        if not wide.managed:
            yield None
            return
        passes = wide.eval_passes(self._meter.held())
        try:
            for g in range(passes):
                wide.eval_pass = g
                yield g
        finally:
            wide.eval_pass = None

    def _keep_eval_records(self, collector: Collector, records: list[Record], *, stacklevel: int) -> None:
        """After an eval measurement (:meth:`measure`, ``Measurement.finish``): warn for its sites
        without rows and its rows refused for NaN/Inf, then add its records to the history.
        ``stacklevel`` as for a warning raised in the calling method (3: that method's caller)."""
        # the records hold n and rejected on the host: sites that ran but kept no row are found
        # too; a rank that reports nothing (sync="rank0") judges by what it captured itself
        self._warn_missing(collector, "in this measurement", stacklevel=stacklevel + 1,
                           records=records if self._emitter.reports() else None)
        self._warn_rejected(records, "in this measurement", stacklevel=stacklevel + 1)
        self._flush(stacklevel=stacklevel + 1)
        self._history.extend(records)

    def spectra(self, batch=None) -> dict[tuple[str, int | None], Tensor]:
        """Whole spectra, not just their metrics: ``{(site, layer): [*heads, D]}`` descending.

        Eigenvalues of the covariance (``eig`` sites, e.g. FFN) or singular values of the raw
        rows (``sv`` sites, e.g. keys), computed as :meth:`fastspec.Covariance.spectrum` does,
        with one eigensolve per shape. With ``batch``: of one eval forward of it (as
        :meth:`measure`, nothing recorded); without: of the streaming totals accumulated so
        far (an empty dict before the first capture). Global under ``torch.distributed``
        (a collective: every rank must call it). Spectra stay on the device of the activations.
        """
        if batch is None:
            return self._emitter.spectra(self._totals)
        batch = self._as_batch(batch)
        self._plan_layout()
        out: dict[tuple[str, int | None], Tensor] = {}
        for g in self._eval_passes():
            collector = self._collector()
            self._eval_forward(batch, collector)
            if not g:
                self._warn_missing(collector, "in this measurement", stacklevel=4)
            out.update(self._emitter.spectra(collector))
        return out

    def measurement(self, *, timed: bool = False) -> Measurement:
        """An eval measurement over several forwards (more tokens than one batch holds)::

            m = probe.measurement()
            for batch in batches:
                m.forward(batch)                          # each as measure() runs it
            records, spectra = m.finish(step=0, spectra=True)

        The records are those :meth:`measure` would give for all the batches' tokens in one
        batch; ``spectra=True`` adds :meth:`spectra`'s dict from the same eigensolve.
        ``timed=True``: the captures' work time is kept (``capture_seconds``), e.g. to report
        the probe's share of the forward time (``measurement.py``)."""
        return Measurement(self, timed=timed)

    def _missing_hints(self) -> dict[str, str]:
        """Every requested site, with the likely reason why it would capture nothing."""
        fam = self.family
        attention = ("this model never called the Hugging Face attention interface (older transformers "
                     "route some families around it, e.g. BERT before 5.0). Upgrade transformers, or "
                     "probe the projections with modules=ModuleSite(..., heads=H)")
        if fam is not None and fam.attention is not None:
            attention = (f"the modules matching {fam.attention.module!r} never ran with a tensor at the "
                         f"family's key position {fam.attention.key}; check the family, or pass keys=False")
        hints = {"keys": attention, "queries": attention,
                 "ffn": f"the modules matching {getattr(fam, 'ffn', None)!r} never ran with a floating-point "
                        f"input; register this model's family in fastspec.probe.FAMILIES, or pass ffn=False",
                 "keys_prerope": "the k_norm/k_proj modules of the family's patterns never ran; register this "
                                 "model's family in fastspec.probe.FAMILIES, or pass prerope_keys=False"}
        out = {site: hints[site] for site in self.sites.names if site in hints}
        for spec in self.sites.modules:
            out.setdefault(spec.site, f"no module matching {spec.pattern!r} ran with a floating-point "
                                      f"{spec.io} of at least 2 dims")
        return out

    def _warn_missing(self, collector: Collector, when: str, *, stacklevel: int,
                      once: set[str] | None = None, records: list[Record] | None = None,
                      other_forwards: int = 0) -> None:
        """Warn for each requested site without a row in ``collector``: by structure, a site that
        never captured (no value is read, so no sync); with the ``records`` of ``collector``
        (values on the host already), also a site that captured but merged and refused no row,
        its every row masked out. With ``once``, only for sites not in it yet (it records them)."""
        ran = {site for (site, _), acc in collector.accs.items() if acc.cov.device is not None}
        wide = self._wide
        if wide is not None and wide.managed and (
                not any(wide.layout.holds(l) for l in wide.layout.holders)
                or (collector is self._totals and not any(wide.captures(l) for l in wide.layout.holders))):
            ran.add("ffn")  # the memory plan gives this rank no FFN layer (now): nothing to capture here
        seen = ran if records is None else checks.sites_with_rows(records) | (ran & {"ffn"})
        for site, hint in self._missing_hints().items():
            if site in seen or (once is not None and site in once):
                continue
            if once is not None:
                once.add(site)
            if site in ran:  # its hooks ran: the mask, not the model, left it without rows
                hint = ("its module ran, but the attention_mask kept none of its token rows (the mask's last "
                        "T columns cover a site's [B, T] rows)")
            elif other_forwards:  # streaming saw forwards, none of them training ones (-1: compiled ones)
                seen = "compiled" if other_forwards < 0 else str(other_forwards)
                hint = (f"the {seen} forward(s) it saw did not train (model.eval(), torch.no_grad() or "
                        f"torch.inference_mode()), and streaming captures training forwards only; call "
                        f"model.train() for training, or pass forwards='all' to stream every forward")
            warnings.warn(f"fastspec.Probe: site {site!r} captured no rows {when}: {hint}.", stacklevel=stacklevel)

    def _warn_rejected(self, records: list[Record], when: str, *, stacklevel: int,
                       once: set[tuple] | None = None) -> None:
        """One warning naming every (site, layer) of ``records`` that rejected NaN/Inf rows (read
        off the records' ``rejected`` values, on the host: no sync); with ``once``, only those not
        in it yet (it records them)."""
        found = checks.rejected_rows(records)
        if once is not None:
            found = [f for f in found if (f.site, f.layer) not in once]
            once.update((f.site, f.layer) for f in found)
        if found:
            warnings.warn(checks.rejected_message(found, when), stacklevel=stacklevel)

    def _flush(self, *, stacklevel: int, block: bool = True) -> list[Record]:
        """The streamed records that reached the host (``block``: all, waiting) moved into the
        history, with a warning for the (site, layer)s whose NaN/Inf rows they report for the first
        time: only here are their values on the host without a sync. ``stacklevel`` as for a warning
        raised in this method (3: the user's frame, when a public method calls it)."""
        new = self._history.flush(block)
        stream = [r for r in new if r.protocol == "stream"]
        if stream:
            self._warn_rejected(stream, f"by step {stream[-1].step}", stacklevel=stacklevel + 1,
                                once=self._warned_rejected)
        return new

    # ---------------------------------------------------------------- streaming
    def attach(self) -> Probe:
        """Start streaming: hooks stay on and captures go to the running accumulators.

        Before or after ``torch.compile``: a compiled model traces the hooks with the rest of its
        forward (``fullgraph=True`` works; a model already compiled recompiles once, because its
        hooks changed), and each capture is one custom op in the graph. The schedule is a tensor
        the ops read, so steps that capture and steps that do not run the same graph.
        """
        self._self_checks()
        self._plan_layout()
        self._hooks.install()
        self._paused = False
        self._router.streaming = True
        self._clock.attached()
        return self

    def _self_checks(self) -> None:
        """The first-use self-checks (fastspec/selfcheck.py) the streaming sites will need, run
        now, before a compiled graph or a CUDA-graph capture could meet them unchecked: the
        update and the eigensolver of the keys/queries (``head_dim`` wide, one matrix per KV head)
        and of the FFN inputs (``hidden_size`` wide), at the dtype of the model's weights and
        bfloat16 (autocast's), on their GPU. Widths come from a Hugging Face ``config``; a model
        without one, and ``modules=`` sites, are checked at their first eager capture. Once per
        probe."""
        if self._checked:
            return
        self._checked = True
        from .. import preflight, selfcheck

        param = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if param is None or not selfcheck.enabled() or not selfcheck.applies(param.device):
            return
        from ..checkpoints.sources import config_architecture

        cfg = getattr(self.model, "config", None)
        arch = config_architecture(cfg.to_dict() if hasattr(cfg, "to_dict") else {})
        hidden, head_dim, kv = arch["hidden_size"], arch["head_dim"], arch["num_kv_heads"] or 1
        dtypes = tuple(dict.fromkeys((param.dtype, torch.bfloat16)))
        plan = self.sites
        wanted = []
        if (plan.keys or plan.queries or plan.prerope_keys) and isinstance(head_dim, int):
            wanted.append((head_dim, plan.key_convention == "eig", kv))
        if plan.ffn and isinstance(hidden, int):
            wanted.append((hidden, plan.ffn_convention == "eig", 1))
        for D, track_mean, sites in wanted:
            preflight.up_front(param.device, D, track_mean, self.settings, sites, dtypes)

    def detach(self) -> None:
        """Stop streaming and remove every hook (accumulators and history are kept). The next
        :meth:`step` may still emit what was accumulated (a final step after training). Until
        :meth:`attach`, time passes as a pause that no step's time includes, unless a
        :meth:`step` comes first (then the span is that step's: its backward ran in it)."""
        self._flush_allowed = self._router.streaming or self._paused or self._flush_allowed
        self._paused = False
        self._router.streaming = False
        self._hooks.remove()
        self._clock.detached()

    def close(self) -> None:
        """Remove every hook, as hook libraries' ``close()`` does: the same as :meth:`detach`
        (accumulators, records and the final :meth:`step` are kept). Safe to call more than once."""
        self.detach()

    def __enter__(self) -> Probe:
        """``with fastspec.Probe(model) as probe:`` -> the probe itself. Entering attaches nothing
        (call :meth:`attach`, or use :meth:`streaming`, to stream; :meth:`measure` needs neither)."""
        return self

    def __exit__(self, *exc_info) -> None:
        """:meth:`close` on leaving the block, also when it raised (the exception propagates)."""
        self.close()

    @contextlib.contextmanager
    def streaming(self) -> Iterator[Probe]:
        """``with probe.streaming(): train...`` attaches, and detaches also on error."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def pause(self) -> None:
        """Time from here to :meth:`unpause` is not training: no forward is captured and no step's
        time includes it, so the budget counts neither as the probe's cost nor as training. For
        the work a trainer does between two steps (evaluation, a checkpoint save, logging,
        fetching the next batch); the trainer callbacks pause from each :meth:`step` to the next
        step's first forward. Unlike :meth:`detach` the hooks stay installed, so pausing costs
        nothing. Call :meth:`unpause` before the next training forward and :meth:`step`. No-op
        when not attached or already paused."""
        if self._router.streaming and not self._paused:
            self._paused = True
            self._router.streaming = False
            self._clock.detached()

    def unpause(self) -> None:
        """End a :meth:`pause`: captures stream again and time counts as training again. No-op
        when not paused (a :meth:`detach` during a pause ends it too)."""
        if self._paused and self._hooks.installed:
            self._router.streaming = True
            self._clock.attached()
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[Probe]:
        """``with probe.paused(): evaluate()``: :meth:`pause`, and :meth:`unpause` on leaving, also on error."""
        self.pause()
        try:
            yield self
        finally:
            self.unpause()

    def step(self, step: int, tokens_seen: int | None = None) -> list[Record]:
        """Call once per optimizer step, after its forwards/backward. Streaming bookkeeping:

        * every ``emit_every`` calls, computes metrics of the accumulated tokens (global under
          ``torch.distributed``) and resets them (``reset=True``) or keeps running totals; with
          a ``budget``, an emission too expensive for it skips some of these steps (the effective
          interval, a multiple of ``emit_every``, is ``overhead()["emit_every"]``);
        * times the probe's work (captures and emission; captures in a compiled graph by
          comparing captured and idle step times) against the step time and, with ``budget``,
          chooses the capture and emission intervals (``budget.py``). The step time runs from
          the previous call, less any time the probe spent detached in between and the eager
          forwards that do not train (``forwards="train"``: an evaluation's forwards are not
          captured and not step time, ``timer.StepClock``); a step far longer than the recent
          ones (over 3× their median) is counted at that median, the rest set aside as a pause
          it was not told about (a checkpoint save, an evaluation loop, a stall:
          ``overhead()["paused_steps"]``, ``["paused_s"]``). Detaching for work that is not a
          training step stays the exact way to leave it out;
        * decides whether the next step's forwards are captured (one step in ``every``).

        Under ``torch.distributed`` (``sync`` not ``"none"``) emission is a collective: every rank
        must call ``step`` the same number of times (the emission interval is then not adapted).

        Never syncs the device: returns the records whose values have already reached the host
        (on CPU: this emission's; on CUDA usually the previous one's). :meth:`records` waits.

        Warns once (``UserWarning``) when called while the probe is not attached, which captures
        nothing: train inside ``with probe.streaming():`` or call :meth:`attach` first. One call
        right after :meth:`detach` is fine (a final step emitting what was accumulated), so a
        ``streaming()`` context around each step's forwards is too. An emission while attached
        warns, once per site, for each site that has captured no rows yet, with the likely reason.
        Streamed records that report rows rejected for NaN/Inf warn as they reach the host (here,
        or in :meth:`records`), naming each (site, layer) once.
        """
        step = _args.integer("step", step)
        tokens_seen = _args.integer("tokens_seen", tokens_seen, minimum=0, optional=True)
        paused = self._paused
        if paused:  # the pause so far is not this step's time; it goes on after the step
            self._clock.attached()
        attached = self._router.streaming or paused
        if not attached and not self._flush_allowed and not self._warned_step:
            self._warned_step = True
            warnings.warn("fastspec.Probe: step() was called while the probe is not attached: no forward is "
                          "captured, so streaming records nothing; train inside `with probe.streaming():` or "
                          "call probe.attach() first (probe.measure(batch, step=...) is the eval protocol)",
                          stacklevel=2)
        self._flush_allowed = False
        budget = self._budget
        # ranks time differently: a collective emission must not follow per-rank timings
        budget.adapt_emission = not self._emitter.collective
        self._steps_seen += 1
        if self._window_start is None:
            self._window_start = step
        emitting = budget.emit_due(self._steps_seen)
        if emitting:
            budget.emitted(self._steps_seen)
            token = self._timer.start(self._totals.device)
            overhead = budget.average_fraction
            extra = () if overhead is None else ((("probe", None, None, "overhead_fraction"), overhead),)
            if attached:
                # forwards seen, none of them training ones: the likely reason a site has no rows
                scope = self._router.scope
                # eager forwards are counted; a compiled one is known only from its trace (-1)
                skipped = (0 if scope.trained or scope.traced[True]
                           else self._clock.other_forwards or -int(scope.traced[False]))
                self._warn_missing(self._totals, f"by step {step}", stacklevel=3, once=self._warned_sites,
                                   other_forwards=skipped)
            self._meter.note("emission")
            self._history.add(self._emitter.records(self._totals, step, tokens_seen, "stream", extra=extra,
                                                    consume=self.reset_after_emit, window_start=self._window_start))
            if self.reset_after_emit:
                self._totals.reset()
            self._next_window()
            self._timer.stop(token, "emit")
        step_s = self._clock.lap()
        if paused:
            self._clock.detached()
        # each step's work is judged with that step's time and flags, once its CUDA events are done
        # captures inside a compiled graph are untimed: the budget judges them by step times
        in_graph = self._router.captured_in_graph
        self._router.end_step()
        tag = (step_s, self._router.capture_this_step, emitting, in_graph)
        for work, (s, captured, emitted, untimed) in self._timer.close_step(tag):
            if s is not None:
                budget.observe(None if untimed else work["capture"], work["emit"], s, captured, emitted)
        self._router.capture_this_step = budget.capture_due(self._steps_seen)
        return self._flush(block=False, stacklevel=3)

    # read-only views of the settings, under the attribute names they had before settings existed
    precision = property(lambda self: self.settings.precision, doc="Products' precision (``settings.precision``).")
    backend = property(lambda self: self.settings.backend, doc="Covariance update backend (``settings.backend``).")
    forwards = property(lambda self: "all" if self._router.all_forwards else "train",
                        doc="Which forwards streaming captures (the ``forwards`` argument, kept by the router).")

    @property
    def capturing(self) -> bool:
        """Whether the schedule captures the forwards of the current step (the one the next
        :meth:`step` call ends), while attached."""
        return self._router.capture_this_step

    @property
    def every(self) -> int:
        """Current capture interval (adapted when a ``budget`` is set)."""
        return self._budget.every

    def overhead(self) -> dict:
        """The probe's streaming cost, as fractions of the step time without the probe:

        * ``"average"``: expected overhead per step at the current intervals (captured and idle
          steps, emitting or not), ``"capture"`` + ``"emission"`` (``budget.py``); what the
          ``overhead_fraction`` record reports;
        * ``"measured"``: all probe work so far / all probe-free step time so far, i.e.
          ``"work_s"`` / ``"base_s"``, those two totals in seconds (their changes between two
          calls give the overhead of the steps in between);
        * ``"fraction"``: the last accounted step's work / its probe-free time;
        * ``"every"``, ``"emit_every"``: current capture and (effective) emission intervals;
        * ``"ffn_rows"``, ``"ffn_row_step"``, ``"ffn_share"``: FFN token sampling (every
          ``ffn_row_step``-th token streamed) and the FLOP share full-rate FFN would cost;
        * ``"paused_steps"``, ``"paused_s"``: steps that held a pause the probe was not told
          about (over 3× the recent median step, ``budget.py``) and the seconds set aside from
          them; ``"other_forwards"``, ``"other_s"``: eager forwards that did not train (not
          captured, ``forwards="train"``) and their seconds, left out of the step times.
        Values not measured yet are ``None``.
        """
        b, clock = self._budget, self._clock
        return {"fraction": b.last_fraction, "average": b.average_fraction, "capture": b.capture_fraction,
                "emission": b.emit_fraction, "measured": b.measured_fraction, "work_s": b.work_s,
                "base_s": b.base_s, "every": b.every,
                "emit_every": b.emit_every, "ffn_rows": self.ffn_rows, "ffn_row_step": self.sites.ffn_row_step,
                "ffn_share": self.ffn_share, "paused_steps": b.paused_steps, "paused_s": b.paused_s,
                "other_forwards": clock.other_forwards, "other_s": clock.other_s}

    @property
    def ffn_row_step(self) -> int:
        """Streaming FFN sites keep every ``ffn_row_step``-th token (``row_step × ffn_rows``)."""
        return self.sites.ffn_row_step

    # ------------------------------------------------------------------ records
    def records(self) -> list[Record]:
        """Every record so far (measure and streaming), waiting for values still in flight."""
        self._flush(stacklevel=3)
        return self._history.records()

    def to_dataframe(self):
        """:meth:`records` as a ``pandas.DataFrame`` with the :class:`Record` fields as columns."""
        self._flush(stacklevel=3)
        return self._history.to_dataframe()

    # --------------------------------------------------------------- checkpoint
    def _settings(self) -> dict:
        """The settings a saved state depends on (:meth:`state_dict`'s ``"settings"``): what the
        accumulated rows mean (:data:`ROW_SETTINGS`) and the schedule (:data:`SCHEDULE_SETTINGS`)."""
        plan, b = self.sites, self._budget
        return {"sites": list(plan.names), "modules": [repr(m) for m in plan.modules],
                "key_convention": plan.key_convention, "ffn_convention": plan.ffn_convention,
                "precision": self.settings.precision, "row_step": self.row_step,
                "ffn_row_step": plan.ffn_row_step, "reset": self.reset_after_emit, "tp_rank": plan.tp_rank,
                "every": b.base_every, "emit_every": b.base_emit_every, "budget": b.budget}

    def state_dict(self) -> dict:
        """Streaming accumulators, schedule, budget state, the record history, and the settings
        they were made under (:meth:`load_state_dict` compares them)."""
        self._flush(stacklevel=3)
        return {
            "version": 1,
            "accumulators": [{"site": s, "layer": l, **acc.state_dict()}
                             for (s, l), acc in self._totals.sorted_items()],
            "history": self._history.state_dict(),
            "steps_seen": self._steps_seen,
            "budget": self._budget.state_dict(),
            "settings": self._settings(),
            "layout": self._wide.layout.signature(),
            "window": self._wide.window,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (accumulators are replaced, not merged).

        The record history and the step count are always restored. When the state was saved
        under other settings (a run resumed with new ``Probe`` arguments), one ``UserWarning``
        names each change and:

        * a change of what the accumulated rows mean (:data:`ROW_SETTINGS`: the sites, their
          conventions, ``precision``, ``row_step``, the FFN sampling, ``reset``, ``tp_rank``)
          drops the saved accumulators, the tokens seen since the last emission (the next
          emission covers only tokens from here on; its ``n`` says how many);
        * a change of the schedule only (``every``, ``emit_every``, ``budget``) keeps them and
          the last emission's step; the new intervals apply from here, and the budget's
          measured costs are forgotten (they were judged against the old budget).

        A state saved before settings were kept (no ``"settings"``) is restored as it is.

        Under a memory plan (``memory=``) this rank takes the FFN accumulators of the layers it
        keeps now (of the current window, under rotation) and no others; a state saved under
        another layout (another world size, budget or precision of the totals) says so in one
        warning and what it keeps: each FFN layer's rows go to the rank that keeps it now, and its
        next record's ``n`` says how many it holds.
        """
        if not isinstance(sd, dict) or sd.get("version") != 1:
            raise ValueError("state_dict: not a fastspec.Probe state_dict (version 1)")
        saved, now = sd.get("settings"), self._settings()
        changed = [] if saved is None else [k for k in now if k in saved and saved[k] != now[k]]
        rows_changed = any(k in ROW_SETTINGS for k in changed)
        if changed:
            what = ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in changed)
            dropped = ("the tokens accumulated since its last emission are dropped" if rows_changed else
                       "its accumulators are kept, the new schedule applies from here")
            warnings.warn(f"fastspec.Probe: the state was saved under other settings ({what}): {dropped}",
                          stacklevel=2)
        self._totals.load([] if rows_changed else self._layout_entries(sd))
        self._history.load_state_dict(sd["history"])
        self._steps_seen = int(sd["steps_seen"])
        if changed:  # when it last emitted, not the intervals or costs of the old settings
            self._budget.last_emit = int(sd["budget"].get("last_emit", 0))
        else:
            self._budget.load_state_dict(sd["budget"])
        self._router.forget_slots()  # a compiled graph must not keep writing the replaced state
        self._router.capture_this_step = self._budget.capture_due(self._steps_seen)

    def _owned_entries(self, entries: list[dict]) -> list[dict]:
        """The entries of FFN layers this rank keeps alone (an ``owned`` layout over several
        data-parallel ranks): what a rank other than 0 takes back from a merged checkpoint
        (``integrations/_stream.py``), where rank 0 takes the sites every rank keeps."""
        wide = self._wide
        if not wide.managed or wide.layout.mode != "owned":
            return []
        return [e for e in entries if e["site"] == "ffn" and wide.layout.holds(e["layer"])]

    def _layout_entries(self, sd: dict) -> list[dict]:
        """The accumulator entries of state ``sd`` this rank takes under its memory plan (see
        :meth:`load_state_dict`), the rotation window restored, a change of layout warned about."""
        wide, entries = self._wide, sd["accumulators"]
        saved, now = sd.get("layout"), wide.layout.signature()
        same = saved is None or plan.Layout.same(saved, now)
        wide.window = int(sd.get("window", 0)) if same else 0
        kept = entries if not wide.managed else [e for e in entries if e["site"] != "ffn" or wide.captures(e["layer"])]
        if not same:
            what = ", ".join(f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k])
            # a layer another rank keeps now is that rank's to take; one whose turn has not come is dropped
            waiting = sorted({e["layer"] for e in entries if e["site"] == "ffn" and e not in kept
                              and wide.layout.holds(e["layer"])})
            dropped = (f"; the rows of FFN layers {waiting}, which this rank keeps but whose turn is later, are "
                       f"dropped" if waiting else "")
            warnings.warn(f"fastspec.Probe: the state was saved under another FFN layout ({what}): each FFN layer's "
                          f"accumulator goes to the rank that keeps it now, with the rows it holds (its next "
                          f"record's n says how many){dropped}; the rotation starts anew", stacklevel=3)
        return kept

    def __repr__(self) -> str:
        return (f"Probe({type(self.model).__name__}, sites={self.sites.names}, "
                f"streaming={self._router.streaming})")
