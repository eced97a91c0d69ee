"""The memory plan at run time: which FFN layers this rank captures, the rows tensor parallelism
gathers for them, the rotation window, and what the probe holds (:meth:`fastspec.Probe.memory`).

``plan.py`` decides (pure arithmetic, shared with ``fastspec plan``); this module applies it to a
live model:

* :func:`resolve_budget`: ``Probe(memory=...)`` in bytes on the model's device;
* :func:`stage_of`: the :class:`~fastspec.probe.plan.Stage` of the model (its FFN layers and
  widths, the keys' shapes where the config tells them);
* :func:`ffn_split`: whether tensor parallelism splits the FFN input by columns, and over which
  group (a ``DTensor`` weight's mesh, Megatron-core's ``RowParallelLinear.tp_group``, or the
  ``tp_group`` the probe was given);
* :class:`WideSites`: the layout and its state (the rotation window, the pass of an eval
  measurement), asked by the FFN hook whether and where a capture goes, and by the emitter which
  layers to solve; :meth:`WideSites.gather` moves a layer's sampled rows to the rank that keeps it;
* :class:`Meter`: the peak of the bytes held (accumulators, measured from their tensors) plus the
  workspace the plan gives each kind of work.
"""
from __future__ import annotations

import os
import weakref

import torch
from torch import Tensor, nn

from . import plan as _plan
from .families import Family, ffn_modules


# ------------------------------------------------------------------------------- the budget
def device_total(device: torch.device) -> int:
    """Bytes of memory of ``device`` (a CUDA device's, else the host's RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_budget(arg: tuple[str, float] | None, device: torch.device) -> int | None:
    """``Probe(memory=...)`` (as ``plan.memory_arg`` checked it) in bytes: given bytes or a size
    string as they are, a fraction of ``device``'s memory, or (``None``)
    :data:`~fastspec.probe.plan.DEFAULT_FRACTION` of a CUDA device and no budget on the CPU (host
    memory is the system's to manage; nothing changes there unless asked)."""
    if arg is None:
        return int(_plan.DEFAULT_FRACTION * device_total(device)) if device.type == "cuda" else None
    kind, value = arg
    return int(value) if kind == "bytes" else int(value * device_total(device))


# --------------------------------------------------------------------- the model, as a plan sees it
def ffn_width(model: nn.Module, mod: nn.Module) -> int | None:
    """``d_ff`` of one FFN down projection: its whole input width (also when tensor parallelism
    splits it), from the module (``nn.Linear``, GPT-2's ``Conv1D``, Megatron-core's
    ``RowParallelLinear``) or the model's config."""
    for attr in ("input_size", "in_features", "nx"):  # Megatron's input_size is the whole width
        d = getattr(mod, attr, None)
        if isinstance(d, int) and not isinstance(d, bool) and d > 0:
            return d
    d = getattr(getattr(model, "config", None), "intermediate_size", None)
    return d if isinstance(d, int) and d > 0 else None


def _config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None and isinstance(model, nn.ModuleList) and len(model):  # Megatron's model chunks
        cfg = getattr(model[0], "config", None)
    return cfg


def key_shape(model: nn.Module, tp: int) -> tuple[int, int, int] | None:
    """``(KV heads, query heads, head width)`` on this rank, from a Hugging Face config or a
    Megatron-core ``TransformerConfig``; None when neither tells."""
    cfg = _config(model)
    if cfg is None:
        return None
    if hasattr(cfg, "kv_channels") and hasattr(cfg, "num_attention_heads"):  # Megatron-core
        heads = cfg.num_attention_heads
        groups = getattr(cfg, "num_query_groups", None) or heads
        return groups // tp, heads // tp, cfg.kv_channels
    from ..checkpoints.sources import config_architecture

    arch = config_architecture(cfg.to_dict() if hasattr(cfg, "to_dict") else {})
    if not isinstance(arch["head_dim"], int) or not isinstance(arch["num_heads"], int):
        return None
    return (arch["num_kv_heads"] or arch["num_heads"]) // tp, arch["num_heads"] // tp, arch["head_dim"]


def ffn_split(model: nn.Module, family: Family | None, tp_group=None) -> tuple[int, object, int] | None:
    """``(tp, group, tp_rank)`` when tensor parallelism splits the FFN input by columns over
    ``tp`` ranks (no rank holds whole rows), else None: a ``DTensor`` weight sharded over its input
    features (row-wise parallel, TorchTitan/DTensor), Megatron-core's ``RowParallelLinear`` with
    ``input_size_per_partition < input_size`` (its ``tp_group``), or ``tp_group`` given."""
    if family is None or family.ffn is None:
        return None
    import torch.distributed as dist

    for _, mod, _ in ffn_modules(model, family):
        part, whole = getattr(mod, "input_size_per_partition", None), getattr(mod, "input_size", None)
        if isinstance(part, int) and isinstance(whole, int) and part < whole:
            group = tp_group if tp_group is not None else getattr(mod, "tp_group", None)
            if group is None:
                raise ValueError("tp_group: the FFN input is split over tensor-parallel ranks and no group was "
                                 "given (pass Probe(tp_group=...), Megatron's tensor-parallel group)")
            if whole % part or dist.get_world_size(group) != whole // part:
                raise ValueError(f"tp_group: has {dist.get_world_size(group)} ranks, but the FFN down projection "
                                 f"takes {part} of {whole} input features on this rank ({whole / part:g} ranks)")
            return whole // part, group, dist.get_rank(group)
        weight = getattr(mod, "weight", None)
        placements = getattr(weight, "placements", None)
        if placements is not None and hasattr(weight, "device_mesh"):
            for mesh_dim, p in enumerate(placements):
                if p.is_shard() and p.dim % weight.dim() == weight.dim() - 1:  # [out, in]: the input features
                    mesh = weight.device_mesh
                    return mesh.size(mesh_dim), mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim)
        break
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        return dist.get_world_size(tp_group), tp_group, dist.get_rank(tp_group)
    return None


def stage_of(model: nn.Module, family: Family | None, *, ffn: bool, convention: str, keys: bool,
             queries: bool, prerope_keys: bool, reset: bool, tp: int, attention_layers: int) -> _plan.Stage:
    """The :class:`~fastspec.probe.plan.Stage` of ``model``: its FFN layers (when ``ffn``) with
    their widths, and the keys'/queries' accumulators (``attention_layers`` layers of them) where
    the config tells their shape (else they are not planned: admitted as they come, :class:`Meter`)."""
    wide = []
    if ffn and family is not None:
        for _, mod, layer in ffn_modules(model, family):
            d = ffn_width(model, mod)
            if layer is not None and d is not None:
                wide.append((layer, d))
    small = []
    shape = key_shape(model, tp) if attention_layers else None
    if shape is not None:
        kv, heads, hd = shape
        for site, on, S in (("keys", keys, kv), ("queries", queries, heads), ("keys_prerope", prerope_keys, kv)):
            if on and S > 0:
                small += [(site, S, hd)] * attention_layers
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    itemsize = 2 if param is None else max(2, param.element_size())
    return _plan.Stage(tuple(sorted(set(wide))), convention, tuple(small), reset, itemsize)


# ----------------------------------------------------------------------------- the layout at run time
class WideSites:
    """The plan's layout of the FFN layers, applied (module docstring).

    ``window`` counts the streaming emissions (the rotation's clock, kept in checkpoints);
    ``eval_pass`` is the group of FFN layers an eval measurement is capturing (:meth:`Probe.measure`
    runs one forward per group the budget needs, :meth:`eval_passes`), None while streaming.
    """

    def __init__(self, layout: _plan.Layout, stage: _plan.Stage, budget: int | None, split, process_group,
                 collective: bool):
        self.layout, self.stage, self.budget = layout, stage, budget
        self.tp_group = split[1] if split is not None else None
        self.process_group, self.collective = process_group, collective
        self.width = dict(stage.wide)
        self.window = 0
        self.eval_pass: int | None = None
        self._eval_group: dict[int, int] = {}
        self.figures = _plan.figures(stage, layout, layout.ranks.dp_rank, layout.ranks.tp_rank)

    @property
    def managed(self) -> bool:
        """Whether the FFN sites follow a layout of their own (a budget, or tensor parallelism);
        ``default``: the probe's sites are all alike, as without a plan."""
        return self.layout.inplace

    @property
    def split(self) -> bool:
        return self.layout.ranks.tp > 1

    @property
    def rotating(self) -> bool:
        return self.layout.groups > 1

    def active(self, layer: int) -> bool:
        """Whether ``layer`` is measured now: in this window (streaming), in this pass (an eval
        measurement, :meth:`eval_passes`)."""
        if self.eval_pass is not None:
            return self._eval_group.get(layer, 0) == self.eval_pass
        return self.layout.active(layer, self.window)

    def eval_passes(self, held: int) -> int:
        """Forwards an eval measurement takes so that its FFN accumulators, beside the ``held``
        bytes the probe holds already (the streaming totals), stay within the budget: this rank's
        layers in groups of ``fit``, the fewest that the budget leaves room for on every rank (a
        collective under ``torch.distributed``: every rank must agree, since a pass gathers and
        reduces). Raises when not even one FFN layer fits beside what is held."""
        layout, fig = self.layout, self.figures
        mine = layout.layers_of(layout.ranks.dp_rank, layout.ranks.tp_rank)
        per = max((_plan.state_bytes(1, d, layout.itemsize) for d in self.width.values()), default=1)
        most = max((len(layout.layers_of(d, t)) for d in range(layout.ranks.dp) for t in range(layout.ranks.tp)),
                   default=0)
        if self.budget is None:
            fit = max(1, most)
        else:
            room = self.budget - held - fig.small - max(fig.capture, fig.emission)
            fit = max(0, min(most, room // per)) if mine else most
        fit = self._agree(fit)
        if fit < 1:
            raise ValueError(f"memory: an eval measurement needs {_plan.human(per)} for one FFN layer beside the "
                             f"{_plan.human(held)} the probe holds (its streaming accumulators) and its workspace, "
                             f"over the budget {_plan.human(self.budget)}; measure before attach() or after an "
                             f"emission with reset, or raise Probe(memory=...)")
        group = {}
        for d in range(layout.ranks.dp):
            for t in range(layout.ranks.tp):
                for j, l in enumerate(layout.layers_of(d, t)):
                    group[l] = j // fit
        self._eval_group = group
        return max(1, -(-most // fit))

    def _agree(self, fit: int) -> int:
        """The smallest ``fit`` of every rank that shares this layout's layers."""
        import torch.distributed as dist

        if not _distributed():
            return fit
        t = torch.tensor([fit], dtype=torch.int64)
        if dist.get_backend(self.process_group if self.collective else None) == "nccl":
            t = t.cuda()
        if self.tp_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
        if self.collective:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(t.item())

    def captures(self, layer: int) -> bool:
        """Whether this rank merges rows of ``layer`` now (it keeps the layer, and it is its turn)."""
        return not self.managed or (self.layout.holds(layer) and self.active(layer))

    def holder(self, layer: int) -> int | None:
        """Under tensor parallelism: the tensor-parallel rank the rows of ``layer`` are gathered to
        now, or None when no rank of this replica keeps it (or it is not its turn)."""
        h = self.layout.tp_holder(layer)
        return h if h is not None and self.active(layer) else None

    def solved(self) -> list[int]:
        """The FFN layers of this stage measured at this emission (every rank agrees on them)."""
        return [l for l in sorted(self.layout.holders) if self.active(l)]

    # --------------------------------------------------------------------------- the gather
    def gather(self, x: Tensor, mask: Tensor | None, dst: int, row_step: int, take) -> None:
        """Move the sampled rows of ``x: [B, T, D/tp]`` (every ``row_step``-th token) to the
        tensor-parallel rank ``dst`` of this replica, one block of rows at a time (the plan's
        gather workspace), where ``take(rows [b, t, D], mask [b, t] or None)`` merges them. A
        collective of the tensor-parallel group: every rank of it calls it for the same layer,
        in the same order (the same forward). Padding is left to ``dst``'s mask (the ranks see
        the same tokens); nothing reads a device value (no sync)."""
        import torch.distributed as dist

        from ..covariance.blocked import _blocks

        group, tp = self.tp_group, self.layout.ranks.tp
        me = dist.get_rank(group)
        if row_step > 1:
            x = x[:, ::row_step]
            mask = None if mask is None else mask[:, ::row_step]
        B, T, part = x.shape
        D = part * tp
        rows = _plan.block_rows(1, D, self.layout.itemsize)
        dst_global = dist.get_global_rank(group, dst)
        for b0, b1, t0, t1 in _blocks(B, T, rows):
            chunk = x[b0:b1, t0:t1].contiguous()
            if me != dst:
                dist.gather(chunk, None, dst=dst_global, group=group)
                continue
            parts = [torch.empty_like(chunk) for _ in range(tp)]
            dist.gather(chunk, parts, dst=dst_global, group=group)
            joined = torch.cat(parts, dim=-1)
            del parts
            take(joined, None if mask is None else mask[b0:b1, t0:t1])


def _distributed() -> bool:
    from ..covariance.distributed import is_distributed

    return is_distributed()


class Meter:
    """The peak of what a probe holds (:meth:`fastspec.Probe.memory`): bytes of its accumulators,
    read from their tensors whenever they change (a first capture allocates, an emission of a
    rotating layout frees), plus the workspace the plan gives the work that follows (a capture,
    an emission). A site the plan did not count (``modules=``, keys without a config) is admitted
    at its first capture only if the peak stays within the budget.

    Args:
        figures: this rank's :class:`~fastspec.probe.plan.Figures` (the workspace of each kind
            of work; what the plan counted).
        budget: bytes, or None.
        planned: the sites whose accumulators the plan counted.
    """

    def __init__(self, figures: _plan.Figures, budget: int | None, planned: set[str]):
        self.capture, self.emission = figures.capture, figures.emission
        self.budget, self._planned = budget, planned
        self._collectors: weakref.WeakSet = weakref.WeakSet()
        self.peak = 0

    def watch(self, collector) -> None:
        """Count ``collector``'s accumulators (the streaming totals, an eval measurement's)."""
        self._collectors.add(collector)

    def held(self) -> int:
        return sum(c.nbytes for c in list(self._collectors))

    def by_site(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in list(self._collectors):
            for (site, _), acc in c.accs.items():
                out[site] = out.get(site, 0) + acc.cov.nbytes
        return out

    def note(self, work: str) -> None:
        """The held bytes changed, or ``work`` (``"capture"`` or ``"emission"``) is about to run."""
        self.peak = max(self.peak, self.held() + (self.capture if work == "capture" else self.emission))

    def planned(self, site: str) -> bool:
        return site in self._planned

    def admits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes of accumulators keep the peak within the budget."""
        return self.budget is None or self.held() + extra + max(self.capture, self.emission) <= self.budget
