"""``fastspec.Probe``: per-layer, per-head spectral metrics from a live PyTorch / HF model.

Sites (SPEC §5):

* ``keys`` / ``queries``: what attention sees, after Q/K-norm and RoPE, per KV head (keys) or
  query head (queries), ``[B, T, H, d_head]`` rows, intercepted at the attention function
  (``hf_attention.py``) whatever backend the model uses.
* ``keys_prerope``: keys after ``k_norm`` (or ``k_proj``) and before RoPE, for comparison.
* ``ffn``: the input of the down projection, ``[B, T, d_ff]`` (forward pre-hook); while
  streaming, by default only every k-th token, sized to the budget (``ffn_rows``, ``budget.py``).
* ``modules``: any module by name pattern (:class:`ModuleSite`).
* ``gamma_k`` / ``gamma_q``: coefficient of variation of the Q/K-norm weight γ per layer.

Only tokens the 2-D ``attention_mask`` of the model call keeps are counted (padding is not).
A capture counts only while the probed model's own ``forward`` is running, so the forward that
activation checkpointing recomputes during backward is never counted twice. Captures run under
``no_grad`` with autocast off and read the activations without changing them: the model's
outputs and gradients are bitwise the same with and without the probe.

Schedules: :meth:`Probe.measure` (eval protocol) and streaming (:meth:`Probe.attach`,
:meth:`Probe.step`), see their docstrings. Records and their async hand-off: ``record.py``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..metrics import summarize
from . import hf_attention
from .budget import DEFAULT_FFN_SHARE, OverheadBudget, WorkTimer, auto_ffn_rows, ffn_flop_share, matmul_parameters
from .distributed import all_reduce_covariance, is_distributed
from .families import DEFAULT_FAMILY, FAMILIES, Family
from .record import PendingRecords, Record, RecordKey
from .sites import (
    CONVENTIONS,
    Accumulator,
    Collector,
    ModuleSite,
    as_bool_mask,
    first_tensor,
    layer_of,
)

# per-site metrics, in record order (SpectrumMetrics field names, SPEC §3)
SPECTRUM_METRICS = (
    "participation_ratio", "hard_rank_normalized", "entropy_rank", "soft_rank_normalized",
    "spectral_concentration", "sui", "effective_dim", "utilization", "ghost_dims",
    "top1_share", "top10pct_share",
)
SYNC_MODES = ("all", "rank0", "none")


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def _check_pos_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """``torch.compile(model)`` and DDP return wrappers around the eager module: probe that one."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    orig = getattr(model, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        return orig, True
    return model, getattr(model, "_compiled_call_impl", None) is not None


class Probe:
    """Spectral probes on a model: ``probe.measure(batch, step=s)`` -> list of :class:`Record`.

    Args:
        model: an ``nn.Module``; attention sites need a Hugging Face ``PreTrainedModel``
            (a family listed in ``fastspec.probe.FAMILIES``, or any model using the attention
            interface); FFN sites need a known family; ``modules`` work on any module.
        keys, queries, ffn, prerope_keys: which built-in sites to probe.
        modules: extra sites: a glob, a :class:`ModuleSite`, or a list of them.
        key_convention: ``"sv"`` (SPEC §5 key rank, raw singular values) or ``"eig"``; also
            used for queries and pre-RoPE keys.
        ffn_convention: ``"eig"`` (SPEC §5 FFN protocol) or ``"sv"``.
        backend: covariance update backend (``"auto"``, ``"torch"``, ``"triton"``).
        precision: float64 (``"exact"``) or float32 (``"fast"``) products in the covariance
            updates. ``"auto"`` (default): exact for ``sv`` sites (the key rank then matches
            float64 ``svdvals`` to ~1e-8 even for rank-deficient heads) on CPU and on GPUs with
            full-rate float64, fast (the Triton kernels on CUDA) for ``eig`` sites and elsewhere.
            ``"fast"`` everywhere moves a rank-deficient head's key PR by up to ~2e-4. The
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
            overhead is still measured and reported).
        ffn_rows: streaming token sampling of the FFN sites, on top of ``row_step``:
            ``"auto"`` (default) keeps every k-th token with k chosen once from a FLOP model
            (full-rate FFN Grams cost ``2·N·Σd_ff²`` against ``6·N·P`` for a training step) so
            that the FFN share is at most ``budget``, or 1% of a step without one
            (``budget.DEFAULT_FFN_SHARE``); ``"all"``: every token; an int k: every k-th token.
            Unbiased for the covariance, with ~k× its variance; :meth:`measure` keeps every
            token. The choice: :attr:`ffn_rows` (k), :attr:`ffn_row_step`, :meth:`overhead`.
        sync: under ``torch.distributed``: ``"all"`` ranks get the global metrics, only
            ``"rank0"``, or ``"none"`` (each rank its own tokens).
        process_group: the data-parallel group to merge over (default: the world).
        tp_rank: tensor-parallel rank; head indices become ``tp_rank * H_local + h``.
        clock: host clock for the overhead timer (seconds; default ``time.perf_counter``).

    Example::

        probe = fastspec.Probe(model)                      # keys (sv PR per head) + FFN
        records = probe.measure(eval_batch, step=step)     # eval protocol, every N steps
        df = probe.to_dataframe()
    """

    def __init__(self, model: nn.Module, *, keys: bool = True, queries: bool = False, ffn: bool = True,
                 prerope_keys: bool = False, modules=None, key_convention: str = "sv",
                 ffn_convention: str = "eig", backend: str = "auto", precision: str = "auto",
                 exact_sv: bool | None = None, every: int = 1,
                 emit_every: int = 100, reset: bool = True, row_step: int = 1,
                 budget: float | None = None, ffn_rows: int | str = "auto", sync: str = "all",
                 process_group=None,
                 tp_rank: int = 0, clock: Callable[[], float] | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.keys, self.queries = _check_flag("keys", keys), _check_flag("queries", queries)
        self.ffn, self.prerope_keys = _check_flag("ffn", ffn), _check_flag("prerope_keys", prerope_keys)
        self.reset_after_emit = _check_flag("reset", reset)
        if exact_sv is not None:
            warnings.warn("fastspec.Probe: exact_sv= is deprecated; use precision='auto' (float64 products "
                          "for sv sites) or precision='fast'", DeprecationWarning, stacklevel=2)
            precision = "auto" if _check_flag("exact_sv", exact_sv) else "fast"
        for name, conv in (("key_convention", key_convention), ("ffn_convention", ffn_convention)):
            if conv not in CONVENTIONS:
                raise ValueError(f"{name}: expected one of {CONVENTIONS}, got {conv!r}")
        if sync not in SYNC_MODES:
            raise ValueError(f"sync: expected one of {SYNC_MODES}, got {sync!r}")
        if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or tp_rank < 0:
            raise ValueError(f"tp_rank: expected an int >= 0, got {tp_rank!r}")
        from ..covariance.policy import check_backend, check_precision

        self.backend = check_backend(backend)
        self.precision = check_precision(precision)
        self.key_convention, self.ffn_convention = key_convention, ffn_convention
        self.emit_every = _check_pos_int("emit_every", emit_every)
        self.row_step = _check_pos_int("row_step", row_step)
        self.sync, self.process_group, self.tp_rank = sync, process_group, tp_rank
        self._budget = OverheadBudget(budget, _check_pos_int("every", every), self.emit_every)
        if not (ffn_rows in ("auto", "all") or (isinstance(ffn_rows, int) and not isinstance(ffn_rows, bool)
                                                 and ffn_rows >= 1)):
            raise ValueError(f"ffn_rows: expected 'auto', 'all' or an int >= 1, got {ffn_rows!r}")
        self._timer = WorkTimer(clock)
        self.model, self._compiled = _unwrap_compiled(model)
        self.module_sites = self._module_sites(modules)
        self.family = self._resolve_family()
        self.ffn_rows, self.ffn_share = self._choose_ffn_rows(ffn_rows, budget)

        self._stream = Collector(self.backend, self.precision)
        self._target: Collector | None = None   # where captures go right now
        self._depth = 0                          # >0 while the model's own forward runs
        self._mask: Tensor | None = None
        self._handles: list | None = None
        self._streaming = False
        self._steps_seen = 0
        self._capture_this_step = True
        self._last_step_t: float | None = None
        self._history: list[Record] = []
        self._pending: list[PendingRecords] = []
        self._forward_sig = self._signature(self.model)
        # In a model compiled after attach(), dynamo breaks the graph at these and runs them
        # eagerly instead of tracing the probe's Python state into the graph. (Wrapped here, not
        # with a decorator, so that `import fastspec` does not import torch._dynamo.)
        self._capture = torch.compiler.disable(self._capture_eager)
        self._on_forward_start = torch.compiler.disable(self._forward_start)
        self._on_forward_end = torch.compiler.disable(self._forward_end)

    # ------------------------------------------------------------ configuration
    @staticmethod
    def _module_sites(modules) -> tuple[ModuleSite, ...]:
        if modules is None:
            return ()
        items = [modules] if isinstance(modules, (str, ModuleSite)) else list(modules)
        out = []
        for m in items:
            if isinstance(m, str):
                m = ModuleSite(m)
            if not isinstance(m, ModuleSite):
                raise TypeError(f"modules: expected glob strings or ModuleSite, got {type(m).__name__}")
            out.append(m)
        return tuple(out)

    def _resolve_family(self) -> Family | None:
        config = getattr(self.model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type is None:
            if self.keys or self.queries or self.prerope_keys or self.ffn:
                raise ValueError("model: keys/queries/ffn/prerope_keys sites need a Hugging Face model "
                                 "(with .config.model_type); for other models pass keys=False, ffn=False "
                                 "and choose sites with modules=")
            return None
        family = FAMILIES.get(model_type)
        if family is None:
            warnings.warn(f"fastspec.Probe: model_type {model_type!r} is not in fastspec.probe.FAMILIES; "
                          f"assuming the Llama layout for FFN/Q-K-norm sites (see README: adding a family)",
                          stacklevel=3)
            family = DEFAULT_FAMILY
        if self.prerope_keys and family.k_norm is None and family.k_proj is None:
            raise ValueError(f"prerope_keys: {model_type!r} has no rotary embedding, so its keys are "
                             f"already pre-RoPE; use keys=True")
        return family

    @staticmethod
    def _signature(model: nn.Module):
        try:
            return inspect.signature(model.forward)
        except (TypeError, ValueError):
            return None

    # ------------------------------------------------------------------ capture
    def _mask_for(self, x: Tensor) -> Tensor | None:
        """``[B, T]`` keep-mask for rows ``x: [B, T, ...]``: the last T columns of the model's mask."""
        mask = self._mask
        if mask is None or x.dim() < 3 or mask.shape[0] != x.shape[0] or mask.shape[1] < x.shape[1]:
            return None
        mask = mask[:, mask.shape[1] - x.shape[1]:]
        return mask if mask.device == x.device else mask.to(x.device, non_blocking=True)

    def _capture_eager(self, site: str, layer: int | None, x: Tensor, *, headed: bool, convention: str,
                 head_offset: int = 0, stream_row_step: int | None = None) -> None:
        target = self._target
        if target is None or self._depth == 0:
            return  # outside the model's own forward: e.g. the checkpoint recompute in backward
        # only streaming work is the budget's to time: measure() captures would pile up CUDA
        # events (never popped without step()) and count against the streaming interval
        streaming = target is self._stream
        token = self._timer.start(x.device) if streaming else None
        # a site's own streaming row step (FFN: ffn_row_step); measure() is the eval protocol
        row_step = stream_row_step if streaming and stream_row_step is not None else self.row_step
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            # inference-mode tensors may be read outside inference mode; the state must not become one
            stack.enter_context(torch.inference_mode(False))
            if x.device.type in ("cuda", "cpu"):
                stack.enter_context(torch.autocast(x.device.type, enabled=False))
            x = x.detach()
            target.update(site, layer, x, self._mask_for(x), headed=headed, convention=convention,
                          head_offset=head_offset, row_step=row_step)
        if token is not None:
            self._timer.stop(token, "capture")

    def _on_attention(self, layer: int):
        def callback(module, query: Tensor, key: Tensor) -> None:
            if key.dim() != 4 or query.dim() != 4:
                return
            tq = query.shape[-2]
            if self.keys:
                k = key[:, :, key.shape[-2] - tq:] if key.shape[-2] > tq else key  # new tokens only (KV cache)
                self._capture("keys", layer, k.transpose(1, 2), headed=True,
                              convention=self.key_convention, head_offset=self.tp_rank * k.shape[1])
            if self.queries:
                self._capture("queries", layer, query.transpose(1, 2), headed=True,
                              convention=self.key_convention, head_offset=self.tp_rank * query.shape[1])
        return callback

    def _matches(self, pattern: str | None) -> list[tuple[str, nn.Module, int | None]]:
        if pattern is None:
            return []
        rx = re.compile(pattern)
        out = []
        for name, mod in self.model.named_modules():
            m = rx.fullmatch(name)
            if m:
                out.append((name, mod, int(m.group(1)) if m.groups() else layer_of(name, mod)))
        return out

    def _install(self) -> None:
        """Register every hook; :meth:`_remove` undoes all of them."""
        handles: list = []
        try:
            self._install_into(handles)
        except BaseException:
            for h in handles:
                h.remove()
            raise
        self._handles = handles

    def _install_into(self, handles: list) -> None:
        model = self.model
        handles.append(model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True))
        handles.append(model.register_forward_hook(self._on_forward_end, always_call=True))
        if self.keys or self.queries:
            callbacks = {}
            for name, mod in model.named_modules():
                if "Attention" not in type(mod).__name__ or getattr(mod, "is_cross_attention", False) \
                        or "Cross" in type(mod).__name__:
                    continue
                layer = layer_of(name, mod)
                if layer is not None:
                    callbacks[mod] = self._on_attention(layer)
            if not callbacks:
                raise ValueError("keys/queries: found no attention modules with a layer index in this model")
            handles.append(hf_attention.watch(callbacks, getattr(model.config, "_attn_implementation", None)))
        if self.ffn:
            found = self._matches(self.family.ffn)
            if not found:
                raise ValueError(f"ffn: no module matches the FFN down projection pattern "
                                 f"{self.family.ffn!r}; register the family in fastspec.probe.FAMILIES")
            for _, mod, layer in found:
                handles.append(mod.register_forward_pre_hook(self._ffn_hook(layer)))
        if self.prerope_keys:
            self._install_prerope(handles)
        for spec in self.module_sites:
            found = [(n, m) for n, m in model.named_modules() if fnmatch.fnmatchcase(n, spec.pattern)]
            if not found:
                raise ValueError(f"modules: no module name matches {spec.pattern!r}")
            for name, mod in found:
                hook = self._module_hook(spec, layer_of(name, mod))
                handles.append(mod.register_forward_hook(hook) if spec.io == "output"
                               else mod.register_forward_pre_hook(hook))

    def _install_prerope(self, handles: list) -> None:
        fam = self.family
        use_norm = fam.k_norm is not None and bool(self._matches(fam.k_norm))
        found = self._matches(fam.k_norm if use_norm else fam.k_proj)
        if not found:
            raise ValueError("prerope_keys: found no k_norm/k_proj modules in this model")
        mods = dict(self.model.named_modules())
        for name, mod, layer in found:
            head_dim = getattr(mods.get(name.rsplit(".", 1)[0]), "head_dim", None)
            if not use_norm and not isinstance(head_dim, int):
                raise ValueError(f"prerope_keys: cannot tell the head width of {name}")

            def hook(module, args, output, layer=layer, head_dim=head_dim, use_norm=use_norm):
                k = output if use_norm else output.unflatten(-1, (-1, head_dim))  # [B, T, H, d_head]
                self._capture("keys_prerope", layer, k, headed=True, convention=self.key_convention,
                              head_offset=self.tp_rank * k.shape[-2])
            handles.append(mod.register_forward_hook(hook))

    def _ffn_hook(self, layer: int | None):
        def hook(module, args):
            x = first_tensor(args)
            if x is not None and x.is_floating_point():
                self._capture("ffn", layer, x, headed=False, convention=self.ffn_convention,
                              stream_row_step=self.ffn_row_step)
        return hook

    @property
    def ffn_row_step(self) -> int:
        """Streaming FFN sites keep every ``ffn_row_step``-th token (``row_step × ffn_rows``)."""
        return self.row_step * self.ffn_rows

    def _ffn_widths(self) -> list[int]:
        """``d_ff`` of every FFN site (the down projection's input width), where it can be told."""
        widths = []
        for _, mod, _ in self._matches(self.family.ffn if self.family is not None else None):
            d = getattr(mod, "in_features", None)  # nn.Linear
            if not isinstance(d, int):
                d = getattr(mod, "nx", None)  # transformers Conv1D (GPT-2)
            if not isinstance(d, int):
                d = getattr(getattr(self.model, "config", None), "intermediate_size", None)
            if isinstance(d, int) and d > 0:
                widths.append(d)
        return widths

    def _choose_ffn_rows(self, ffn_rows: int | str, budget: float | None) -> tuple[int, float | None]:
        """``(k, FLOP share of full-rate FFN streaming)``: see ``ffn_rows`` and ``budget.py``."""
        if not self.ffn:
            return 1, None
        widths, params = self._ffn_widths(), matmul_parameters(self.model)
        share = ffn_flop_share(widths, params) if widths and params > 0 else None
        if ffn_rows == "all":
            return 1, share
        if ffn_rows != "auto":
            return ffn_rows, share
        if share is None:  # cannot size it: stream every token
            return 1, None
        target = DEFAULT_FFN_SHARE if budget is None else budget
        return auto_ffn_rows(share, target, self.row_step), share

    def _module_hook(self, spec: ModuleSite, layer: int | None):
        def hook(module, args, output=None):
            x = first_tensor(output if spec.io == "output" else args)
            if x is None or not x.is_floating_point() or x.dim() < 2:
                return
            if spec.heads is not None:
                if x.shape[-1] % spec.heads:
                    raise ValueError(f"modules: {spec.pattern!r} width {x.shape[-1]} is not divisible "
                                     f"by heads={spec.heads}")
                x = x.unflatten(-1, (spec.heads, -1))
            self._capture(spec.site, layer, x, headed=spec.heads is not None, convention=spec.convention,
                          head_offset=self.tp_rank * (spec.heads or 0))
        return hook

    def _forward_start(self, module, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            mask = kwargs.get("attention_mask")
            if mask is None and self._forward_sig is not None:
                try:
                    mask = self._forward_sig.bind_partial(*args, **kwargs).arguments.get("attention_mask")
                except TypeError:
                    mask = None
            self._mask = as_bool_mask(mask)

    def _forward_end(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._mask = None

    def _remove(self) -> None:
        handles, self._handles = self._handles or [], None
        for h in handles:
            h.remove()
        self._depth, self._mask = 0, None

    # ------------------------------------------------------------- eval protocol
    def measure(self, batch, *, step: int, tokens_seen: int | None = None) -> list[Record]:
        """SPEC §5 eval protocol: one forward of a fixed batch, metrics of exactly its tokens.

        Puts the model in eval mode, runs ``model(**batch)`` (a dict of model kwargs with the
        ``attention_mask``) or ``model(batch)`` (an ``input_ids`` tensor) under ``no_grad``,
        computes every site's metrics, then restores each module's train/eval flag and removes
        the hooks it added, also when the forward raises. Streaming accumulators are untouched.
        A ``torch.compile``'d model is measured through its eager module (same parameters).
        Under ``torch.distributed`` every rank calls ``measure`` with its share of the batch and
        gets the metrics of the whole batch (``sync="all"``), as one process would.

        Returns the new records (also appended to :meth:`records`); waits for their values.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        if not isinstance(batch, (dict, Tensor)):
            raise TypeError(f"batch: expected a dict of model kwargs or an input_ids tensor, "
                            f"got {type(batch).__name__}")
        model = self.model
        modes = [(m, m.training) for m in model.modules()]
        installed_here = self._handles is None
        previous_target, collector = self._target, Collector(self.backend, self.precision)
        try:
            if installed_here:
                self._install()
            self._target = collector
            model.eval()
            with torch.no_grad():
                model(**batch) if isinstance(batch, dict) else model(batch)
            self._target = previous_target
            self._warn_missing(collector)
            pending = self._emit(collector, step, tokens_seen, extra=())
        finally:
            self._target = previous_target
            if installed_here:
                self._remove()
            for m, was_training in modes:
                m.training = was_training
        records = [] if pending is None else pending.materialize()
        self._flush()
        self._history.extend(records)
        return records

    def _warn_missing(self, collector: Collector) -> None:
        seen = {site for site, _ in collector.accs}
        for site, wanted in (("keys", self.keys), ("queries", self.queries)):
            if wanted and site not in seen:
                warnings.warn(f"fastspec.Probe: no {site} were captured: this model never called the Hugging "
                              f"Face attention interface (older transformers route some families, e.g. "
                              f"BERT before 4.50, around it). Upgrade transformers, or probe the projections "
                              f"with modules=ModuleSite(..., heads=H).", stacklevel=3)

    # ---------------------------------------------------------------- streaming
    def attach(self) -> Probe:
        """Start streaming: hooks stay on and captures go to the running accumulators."""
        if self._compiled:
            raise RuntimeError("attach: this model is already torch.compile'd, and a compiled graph would "
                               "not see hooks added now. Attach the probe to the uncompiled model first and "
                               "compile afterwards (captures then run eagerly at graph breaks), or use "
                               "probe.measure(), which runs the eager module.")
        if self._streaming:
            return self
        if self._handles is None:
            self._install()
        self._streaming = True
        self._target = self._stream if self._capture_this_step else None
        return self

    def detach(self) -> None:
        """Stop streaming and remove every hook (accumulators and history are kept)."""
        self._streaming = False
        self._target = None
        if self._handles is not None:
            self._remove()

    @contextlib.contextmanager
    def streaming(self) -> Iterator[Probe]:
        """``with probe.streaming(): train...`` attaches, and detaches also on error."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def step(self, step: int, tokens_seen: int | None = None) -> list[Record]:
        """Call once per optimizer step, after its forwards/backward. Streaming bookkeeping:

        * every ``emit_every`` calls, computes metrics of the accumulated tokens (global under
          ``torch.distributed``) and resets them (``reset=True``) or keeps running totals; with
          a ``budget``, an emission too expensive for it skips some of these steps (the effective
          interval, a multiple of ``emit_every``, is ``overhead()["emit_every"]``);
        * times the probe's work (captures and emission) against the step time and, with
          ``budget``, chooses the capture and emission intervals (``budget.py``);
        * decides whether the next step's forwards are captured (one step in ``every``).

        Under ``torch.distributed`` (``sync`` not ``"none"``) emission is a collective: every rank
        must call ``step`` the same number of times (the emission interval is then not adapted).

        Never syncs the device: returns the records whose values have already reached the host
        (on CPU: this emission's; on CUDA usually the previous one's). :meth:`records` waits.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        budget = self._budget
        # ranks time differently: a collective emission must not follow per-rank timings
        budget.adapt_emission = self.sync == "none" or not is_distributed()
        self._steps_seen += 1
        emitting = budget.emit_due(self._steps_seen)
        if emitting:
            budget.emitted(self._steps_seen)
            token = self._timer.start(self._device())
            overhead = budget.average_fraction
            extra = () if overhead is None else ((("probe", None, None, "overhead_fraction"), overhead),)
            pending = self._emit(self._stream, step, tokens_seen, extra=extra)
            if pending is not None:
                self._pending.append(pending)
            if self.reset_after_emit:
                self._stream.reset()
            self._timer.stop(token, "emit")
        now = self._timer.clock()
        step_s = None if self._last_step_t is None else now - self._last_step_t
        # each step's work is judged with that step's time and flags, once its CUDA events are done
        for work, (s, captured, emitted) in self._timer.close_step((step_s, self._capture_this_step, emitting)):
            if s is not None:
                budget.observe(work["capture"], work["emit"], s, captured, emitted)
        self._last_step_t = now
        self._capture_this_step = budget.capture_due(self._steps_seen)
        if self._streaming:
            self._target = self._stream if self._capture_this_step else None
        return self._flush(block=False)

    @property
    def every(self) -> int:
        """Current capture interval (adapted when a ``budget`` is set)."""
        return self._budget.every

    def overhead(self) -> dict:
        """The probe's streaming cost, as fractions of the step time without the probe:

        * ``"average"``: expected overhead per step at the current intervals (captured and idle
          steps, emitting or not), ``"capture"`` + ``"emission"`` (``budget.py``); what the
          ``overhead_fraction`` record reports;
        * ``"measured"``: all probe work so far / all probe-free step time so far;
        * ``"fraction"``: the last accounted step's work / its probe-free time;
        * ``"every"``, ``"emit_every"``: current capture and (effective) emission intervals;
        * ``"ffn_rows"``, ``"ffn_row_step"``, ``"ffn_share"``: FFN token sampling (every
          ``ffn_row_step``-th token streamed) and the FLOP share full-rate FFN would cost.
        Values not measured yet are ``None``.
        """
        b = self._budget
        return {"fraction": b.last_fraction, "average": b.average_fraction, "capture": b.capture_fraction,
                "emission": b.emit_fraction, "measured": b.measured_fraction, "every": b.every,
                "emit_every": b.emit_every, "ffn_rows": self.ffn_rows, "ffn_row_step": self.ffn_row_step,
                "ffn_share": self.ffn_share}

    def _device(self) -> torch.device | None:
        for acc in self._stream.accs.values():
            if acc.cov.device is not None:
                return acc.cov.device
        return None

    # ------------------------------------------------------------------ metrics
    def _reports(self) -> bool:
        """Whether this rank emits records (all ranks, or rank 0 only with ``sync="rank0"``)."""
        if self.sync != "rank0" or not is_distributed():
            return True
        return torch.distributed.get_rank(self.process_group) == 0

    def _merge_ranks(self, acc: Accumulator):
        if self.sync == "none" or not is_distributed():
            return acc.cov, True
        return all_reduce_covariance(acc.cov, self.process_group), self._reports()

    def _spectral_blocks(self, collector: Collector):
        """``(key, acc, cov, block [M, S])`` per reported accumulator, in ``sorted_items`` order.

        One eigensolve per (convention, D) over every site and layer (one batched launch on
        CUDA), and one :func:`~fastspec.metrics.summarize` per group. The solve dtype is the
        policy's (``fastspec.covariance.policy.solve_dtype``): float64 for ``sv``, where
        ``σ = sqrt(λ)`` would turn a float32 solve's ``eps·λ_max`` into ``sqrt(eps)·σ_max``.
        """
        from ..covariance import spectra

        items = []
        for key, acc in collector.sorted_items():
            if acc.cov.device is None:
                continue
            cov, report = self._merge_ranks(acc)
            if report:
                items.append((key, acc, cov))
        groups: dict[tuple, list[int]] = {}
        for i, (_, acc, cov) in enumerate(items):
            groups.setdefault((acc.convention, cov.D, cov.device), []).append(i)
        blocks: dict[int, Tensor] = {}
        for (convention, D, _), idx in groups.items():
            mats = torch.cat([items[i][2].matrix(convention).reshape(-1, D, D) for i in idx])
            spec = spectra(mats, convention)  # [ΣS, D], descending
            m = summarize(spec)
            cols = torch.stack([getattr(m, name).double() for name in SPECTRUM_METRICS])  # [M, ΣS]
            start = 0
            for i in idx:
                cov = items[i][2]
                S = cov.num_sites
                sl = slice(start, start + S)
                start += S
                n = cov.n.double().reshape(-1)
                top = spec[sl, 0].double()
                lam_max = top if convention == "eig" else top.square() / n  # sv: top eigenvalue of XᵀX/n
                blocks[i] = torch.cat([cols[:, sl], torch.stack([lam_max, n, cov.rejected.double().reshape(-1)])])
        for i, (key, acc, cov) in enumerate(items):
            yield key, acc, cov, blocks[i]

    def _emit(self, collector: Collector, step: int, tokens_seen: int | None,
              extra: tuple) -> PendingRecords | None:
        """Metrics of every accumulator, packed into one tensor headed for the host."""
        keys: list[RecordKey] = []
        values: list[Tensor] = []
        device = None
        names = (*SPECTRUM_METRICS, "lambda_max", "n", "rejected")
        for (site, layer), acc, cov, block in self._spectral_blocks(collector):
            heads = range(block.shape[1])
            for name in names:
                for h in heads:
                    keys.append((site, layer, acc.head_offset + h if acc.headed else None, name))
            device = block.device if device is None else device
            values.append(block.reshape(-1))
        gamma_sites = (("gamma_k", self.family.k_norm), ("gamma_q", self.family.q_norm)) \
            if self.family is not None and (self.keys or self.queries or self.prerope_keys) else ()
        for site, pattern in gamma_sites if self._reports() else ():
            for _, mod, layer in self._matches(pattern):
                w = getattr(mod, "weight", None)
                if not isinstance(w, Tensor):
                    continue
                gamma = w.detach().double() + self.family.gamma_offset
                trainable = bool(w.requires_grad)
                # SPEC §5: population std / mean over the d_head entries; 0 when γ is frozen
                cv = gamma.std(unbiased=False) / gamma.mean() if trainable else gamma.new_zeros(())
                keys += [(site, layer, None, "gamma_cv"), (site, layer, None, "gamma_trainable")]
                device = cv.device if device is None else device
                values.append(torch.stack([cv, cv.new_tensor(float(trainable))]))
        for key, value in extra if self._reports() else ():
            keys.append(key)
            values.append(torch.tensor([float(value)], dtype=torch.float64, device=device))
        if not keys:
            return None
        return PendingRecords(step, tokens_seen, keys, torch.cat([v.to(device) for v in values]))

    # ------------------------------------------------------------------ records
    def _flush(self, block: bool = True) -> list[Record]:
        new: list[Record] = []
        while self._pending and (block or self._pending[0].ready()):
            new.extend(self._pending.pop(0).materialize())
        self._history.extend(new)
        return new

    def records(self) -> list[Record]:
        """Every record so far (measure and streaming), waiting for values still in flight."""
        self._flush()
        return list(self._history)

    def to_dataframe(self):
        """:meth:`records` as a ``pandas.DataFrame`` with the :class:`Record` fields as columns."""
        try:
            import pandas as pd
        except ImportError as e:  # optional dependency
            raise ImportError("to_dataframe needs pandas: pip install 'fastspec[plot]'") from e
        from dataclasses import fields

        cols = [f.name for f in fields(Record)]
        return pd.DataFrame([r.as_dict() for r in self.records()], columns=cols)

    # --------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Streaming accumulators, schedule, budget state and the record history."""
        self._flush()
        return {
            "version": 1,
            "accumulators": [{"site": s, "layer": l, **acc.state_dict()}
                             for (s, l), acc in self._stream.sorted_items()],
            "history": [r.as_dict() for r in self._history],
            "steps_seen": self._steps_seen,
            "budget": self._budget.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (accumulators are replaced, not merged)."""
        if not isinstance(sd, dict) or sd.get("version") != 1:
            raise ValueError("state_dict: not a fastspec.Probe state_dict (version 1)")
        self._flush()
        self._stream.load(sd["accumulators"])
        self._history = [Record(**r) for r in sd["history"]]
        self._steps_seen = int(sd["steps_seen"])
        self._budget.load_state_dict(sd["budget"])
        self._capture_this_step = self._steps_seen % self._budget.every == 0
        if self._streaming:
            self._target = self._stream if self._capture_this_step else None

    def __repr__(self) -> str:
        sites = [s for s, on in (("keys", self.keys), ("queries", self.queries), ("ffn", self.ffn),
                                 ("keys_prerope", self.prerope_keys)) if on]
        sites += [m.site for m in self.module_sites]
        return f"Probe({type(self.model).__name__}, sites={sites}, streaming={self._streaming})"
