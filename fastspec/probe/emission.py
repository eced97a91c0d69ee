"""Emission: from a probe's covariances to records (and spectra), without a host sync.

1. Under ``torch.distributed`` each (site, layer) covariance is all-reduced first
   (:meth:`fastspec.Covariance.all_reduce`, exact), unless ``sync="none"``.
2. One eigensolve per (convention, D, device) over every site and layer (one batched launch on
   CUDA), in the solve dtype of ``fastspec.covariance.policy.solve_dtype``: float64 for ``sv``,
   where ``σ = sqrt(λ)`` would turn a float32 solve's ``eps·λ_max`` into ``sqrt(eps)·σ_max``.

The FFN sites under a memory plan (``layout.WideSites``: a budget, or tensor parallelism) are
wide: each is reduced, scaled and solved on its own, in place in its totals when the emission may
consume them (``consume``: the probe resets or frees them right after) or in one copy, so the
workspace is the plan's (``plan.wide_emission_bytes``). A replicated one is all-reduced about the
global mean in its totals (the merge of ``covariance/distributed.py``, in place); an owned one is
solved by the rank that keeps it, and the metrics of every layer of the stage are then summed
into every rank (each layer's row is nonzero on its holder only: one all-reduce of ``[layers,
metrics]`` float64 values over the tensor-parallel group, one over the data-parallel group).
3. One :func:`~fastspec.metrics.summarize` per group, plus ``rank_at_90`` (on the variances:
   ``λ`` for ``eig``, ``σ²`` for ``sv``), ``lambda_max``, ``n``, ``rejected`` per head, and the
   layer's γ values (``gamma.py``), packed into one tensor that
   :class:`~fastspec.probe.pending.PendingRecords` copies to the host asynchronously. The spectra
   come from PSD matrices and are clamped, so the metrics skip their negative-value check (a sync).
"""
from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

import torch
from torch import Tensor, nn

from ..covariance import Covariance, spectra
from ..covariance.distributed import all_reduce_totals_, is_distributed
from ..covariance.policy import solve_dtype
from ..metrics import rank_at, summarize
from .families import Family
from .gamma import gamma_values
from .pending import PendingRecords, RecordKey
from .sites import Collector, SiteCovariance, SiteKey

#: the record every rotating FFN layer adds per emission: the step of the first optimizer step
#: its window accumulated (its window ends at the record's step)
WINDOW_METRIC = "window_start"

# per-site metrics, in record order (SpectrumMetrics field names, docs/metrics.md)
SPECTRUM_METRICS = (
    "participation_ratio", "hard_rank_normalized", "entropy_rank", "soft_rank_normalized",
    "spectral_concentration", "sui", "effective_dim", "utilization", "ghost_dims",
    "top1_share", "top10pct_share",
)
# what every headed site reports per head: the spectrum metrics, the components holding 90% of
# the variance, the top eigenvalue of the matrix the convention describes, rows merged, and rows
# refused for NaN/Inf
RECORD_METRICS = (*SPECTRUM_METRICS, "rank_at_90", "lambda_max", "n", "rejected")
SYNC_MODES = ("all", "rank0", "none")

Item = tuple[SiteKey, SiteCovariance, Covariance]


class Emitter:
    """Turns a :class:`~fastspec.probe.sites.Collector` into records or spectra.

    Args:
        model, family: for the γ values of Q/K-norm families (``family=None``: none).
        gamma: whether to report γ (the probe captures attention sites).
        sync: one of ``SYNC_MODES`` (checked by :class:`~fastspec.Probe`): under
            ``torch.distributed`` ``"all"`` ranks get the global metrics, only ``"rank0"``, or
            ``"none"`` (each rank its own tokens).
        process_group: the data-parallel group to merge over (default: the world).
    """

    def __init__(self, model: nn.Module, family: Family | None, *, gamma: bool, sync: str, process_group=None):
        self.model, self.family, self.gamma = model, family, gamma and family is not None
        self.sync, self.process_group = sync, process_group
        self.wide = None  # the memory plan's layout of the FFN sites (layout.WideSites), set by the probe

    def _wide(self, key: SiteKey) -> bool:
        """Whether ``key``'s site is solved on its own under the memory plan (module docstring)."""
        return key[0] == "ffn" and self.wide is not None and self.wide.managed

    def label(self) -> str:
        """``Record.layout`` of the sites every rank keeps: ``"replicated"`` where the records hold
        every data-parallel rank's rows (merged, or a single process), ``"owned"`` where each rank
        reports its own (``sync="none"`` under ``torch.distributed``)."""
        return "owned" if is_distributed() and not self.collective else "replicated"

    @property
    def collective(self) -> bool:
        """Whether emitting is a collective (every rank must emit the same number of times)."""
        return self.sync != "none" and is_distributed()

    def reports(self) -> bool:
        """Whether this rank emits records (all ranks, or rank 0 only with ``sync="rank0"``)."""
        if self.sync != "rank0" or not is_distributed():
            return True
        return torch.distributed.get_rank(self.process_group) == 0

    def _items(self, collector: Collector) -> list[Item]:
        """``(key, site covariance, merged covariance)`` of every site this rank reports."""
        reports = self.reports()
        items = []
        for key, acc in collector.sorted_items():
            if acc.cov.device is None or self._wide(key):
                continue
            cov = acc.cov.all_reduce(self.process_group) if self.collective else acc.cov
            if reports:
                items.append((key, acc, cov))
        return items

    @staticmethod
    def _solve(items: list[Item]) -> Iterator[tuple[str, Tensor, list[tuple[int, slice]]]]:
        """One eigensolve per (convention, D, device) group of items: ``(convention, spectra
        [ΣS, D] descending, [(item index, its rows of spectra)])``."""
        groups: dict[tuple, list[int]] = {}
        for i, (_, acc, cov) in enumerate(items):
            groups.setdefault((acc.convention, cov.D, cov.device), []).append(i)
        for (convention, D, _), idx in groups.items():
            mats = torch.cat([items[i][2].matrix(convention).reshape(-1, D, D) for i in idx])
            bounds = list(accumulate((items[i][2].num_sites for i in idx), initial=0))
            rows = [(i, slice(a, b)) for i, a, b in zip(idx, bounds, bounds[1:])]
            yield convention, spectra(mats, convention), rows

    def spectra(self, collector: Collector) -> dict[SiteKey, Tensor]:
        """Descending spectrum ``[*sites, D]`` of every (site, layer): eigenvalues (``eig``) or
        singular values (``sv``), as ``Covariance.spectrum`` computes them (the FFN layers this
        rank keeps, under a memory plan that owns them)."""
        items = self._items(collector)
        out = self._spectra(items, list(self._solve(items)))
        wide = self._wide_solve(collector, consume=False, spectra=True)
        return {**out, **{key: spec for key, _, spec in wide.spectra}}

    @staticmethod
    def _spectra(items: list[Item], solved: list) -> dict[SiteKey, Tensor]:
        out: list[Tensor | None] = [None] * len(items)
        for _, spec, parts in solved:
            for i, sl in parts:
                cov = items[i][2]
                out[i] = spec[sl].reshape(*cov.sites, cov.D)
        return {key: spec for (key, _, _), spec in zip(items, out)}  # in sorted_items order

    @classmethod
    def _blocks(cls, items: list[Item], solved: list) -> list[Tensor]:
        """Per item, its ``[len(RECORD_METRICS), S]`` float64 block of values (``solved``: the
        items' :meth:`_solve` groups): :meth:`_metric_block` of each group, split per item."""
        blocks: list[Tensor | None] = [None] * len(items)
        for convention, spec, parts in solved:
            n = torch.cat([items[i][2].n.double().reshape(-1) for i, _ in parts])
            rejected = torch.cat([items[i][2].rejected.double().reshape(-1) for i, _ in parts])
            block = cls._metric_block(spec, convention, n, rejected)
            for i, sl in parts:
                blocks[i] = block[:, sl]
        return blocks

    def records(self, collector: Collector, step: int, tokens_seen: int | None, protocol: str,
                extra: tuple[tuple[RecordKey, float], ...] = (), *, consume: bool = False,
                window_start: int | None = None) -> PendingRecords | None:
        """Metrics of every site, plus γ and ``extra`` records, packed into one tensor headed
        for the host; None when there is nothing to report (or this rank does not report).
        ``protocol``: ``"eval"`` or ``"stream"``, stamped on every record. ``consume``: the wide
        sites' totals may be overwritten (the caller resets or frees them next); ``window_start``:
        the first step of a rotating layout's window (:data:`WINDOW_METRIC`)."""
        items = self._items(collector)
        wide = self._wide_solve(collector, consume=consume, spectra=False)
        return self._pack(items, list(self._solve(items)), wide, step, tokens_seen, protocol, extra, window_start)

    def records_and_spectra(self, collector: Collector, step: int, tokens_seen: int | None,
                            protocol: str) -> tuple[PendingRecords | None, dict[SiteKey, Tensor]]:
        """:meth:`records` and :meth:`spectra` of ``collector`` from one eigensolve (one
        all-reduce under ``torch.distributed``)."""
        items = self._items(collector)
        solved = list(self._solve(items))
        wide = self._wide_solve(collector, consume=True, spectra=True)
        specs = {**self._spectra(items, solved), **{key: spec for key, _, spec in wide.spectra}}
        return self._pack(items, solved, wide, step, tokens_seen, protocol, ()), specs

    # ------------------------------------------------------------------------------ wide sites
    def _wide_solve(self, collector: Collector, *, consume: bool, spectra: bool) -> WideResult:
        """Every wide site measured now, one at a time (module docstring): ``[(key, block [M, 1])]``
        of the layers whose values this rank reports, and the spectra of those it keeps."""
        wide = self.wide
        result = WideResult()
        if wide is None or not wide.managed:
            return result
        layers = wide.solved()
        if not layers:
            return result
        reduce = wide.layout.mode == "replicated" and self.collective and wide.layout.ranks.dp > 1
        meter = collector.meter
        if meter is not None:
            meter.note("emission")
        device = collector.device or next(p.device for p in self.model.parameters())
        blocks: dict[int, Tensor] = {}
        for layer in layers:
            if not wide.layout.holds(layer):
                continue
            acc = collector.accs.get(("ffn", layer))
            if acc is None or acc.cov._state is None:
                if not reduce:  # never captured here (no forward reached it): no rows, NaN metrics
                    continue
                acc = collector.ensure("ffn", layer, (wide.width[layer],), wide.stage.convention, False, 0, device)
            block, spec = self._wide_block(acc, consume=consume, reduce=reduce)
            blocks[layer] = block
            if spectra:
                result.spectra.append((("ffn", layer), acc, spec))
        gathered = self.collective and (wide.layout.ranks.tp > 1 or wide.layout.mode == "owned")
        if not gathered:
            result.blocks = [(("ffn", l), b) for l, b in sorted(blocks.items())]
            return result
        # every layer's metrics on every rank: each layer's row is nonzero on one rank of the grid;
        # a last column flags a kept layer without rows (NaN metrics, once summed)
        import torch.distributed as dist

        M = len(RECORD_METRICS)
        values = torch.zeros(len(layers), M + 1, dtype=torch.float64, device=device)
        for i, layer in enumerate(layers):
            if layer in blocks:
                values[i, :M] = blocks[layer].reshape(M)
            elif wide.layout.holds(layer):
                values[i, M] = 1
        if wide.layout.ranks.tp > 1:
            dist.all_reduce(values, group=wide.tp_group)
        if wide.layout.mode == "owned" and wide.layout.ranks.dp > 1:
            dist.all_reduce(values, group=self.process_group)
        metrics = torch.where(values[:, M:] > 0, float("nan"), values[:, :M])
        n_col = RECORD_METRICS.index("n")
        metrics[:, n_col] = values[:, n_col]
        # under tensor parallelism every rank of the group now has them: tensor-parallel rank 0 reports
        if wide.layout.ranks.tp > 1 and wide.layout.ranks.tp_rank != 0:
            return result
        result.blocks = [(("ffn", l), metrics[i].reshape(M, 1)) for i, l in enumerate(layers)]
        return result

    def _wide_block(self, acc: SiteCovariance, *, consume: bool, reduce: bool) -> tuple[Tensor, Tensor]:
        """``([M, 1] float64 values, spectrum [1, D])`` of one wide site (module docstring)."""
        cov = acc.cov
        st = cov._state
        second = st["m2"] if cov.track_mean else st["gram"]
        work = second if consume else second.clone()
        n, rejected = st["n"], st["rejected"]
        if reduce:  # the exact merge of covariance/distributed.py, in the totals themselves
            n, rejected = all_reduce_totals_(st, work, cov.track_mean, self.process_group)
        if cov.track_mean:  # the unbiased covariance, as Covariance.covariance()
            work /= (n.double() - 1).to(work.dtype)[:, None, None]
        dtype = torch.float32 if work.dtype == torch.float32 else solve_dtype(acc.convention, work.device)
        mat = work if work.dtype == dtype else work.to(dtype)
        del work
        spec = spectra(mat, acc.convention, dtype=dtype)
        del mat
        block = self._metric_block(spec, acc.convention, n.double().reshape(-1), rejected.double().reshape(-1))
        return block, spec

    @staticmethod
    def _metric_block(spec: Tensor, convention: str, n: Tensor, rejected: Tensor) -> Tensor:
        """``[len(RECORD_METRICS), S]`` float64 values of spectra ``spec [S, D]`` of ``n`` rows each
        (``rejected`` refused): the spectrum metrics, ``rank_at_90``, ``lambda_max``, ``n``, ``rejected``."""
        m = summarize(spec, check_negative=False)
        cols = torch.stack([getattr(m, name).double() for name in SPECTRUM_METRICS])  # [M, S]
        # variance per direction: λ of C for eig; σ² (energy of the uncentred rows) for sv, as in
        # PCA's "components for 90% explained variance" of the key matrix
        r90 = rank_at(spec.square() if convention == "sv" else spec, 0.9, check_negative=False).double()
        top = spec[:, 0].double()
        lam_max = top if convention == "eig" else top.square() / n  # sv: top eigenvalue of XᵀX/n
        return torch.cat([cols, torch.stack([r90, lam_max, n, rejected])])

    def _pack(self, items: list[Item], solved: list, wide: WideResult, step: int, tokens_seen: int | None,
              protocol: str, extra: tuple[tuple[RecordKey, float], ...],
              window_start: int | None = None) -> PendingRecords | None:
        keys: list[RecordKey] = []
        values: list[Tensor] = []
        layouts: list[str | None] = []
        label = self.label()
        for ((site, layer), acc, _), block in zip(items, self._blocks(items, solved)):
            for name in RECORD_METRICS:
                for h in range(block.shape[1]):
                    keys.append((site, layer, acc.head_offset + h if acc.headed else None, name))
            values.append(block.reshape(-1))
            layouts += [label] * block.numel()
        reports = self.reports()
        if wide.blocks and reports:
            wlabel = self.wide.layout.label() if self.collective else label
            rotating = self.wide.rotating and window_start is not None
            for (site, layer), block in wide.blocks:
                keys += [(site, layer, None, name) for name in RECORD_METRICS]
                values.append(block.reshape(-1))
                layouts += [wlabel] * len(RECORD_METRICS)
                if rotating:
                    keys.append((site, layer, None, WINDOW_METRIC))
                    values.append(torch.full((1,), float(window_start), dtype=torch.float64, device=block.device))
                    layouts.append(wlabel)
        if self.gamma and reports and not (self.wide is not None and self.wide.eval_pass):
            gamma_keys, gamma_vals = gamma_values(self.model, self.family)
            keys += gamma_keys
            values += gamma_vals
            layouts += [None] * len(gamma_keys)
        device = values[0].device if values else None
        for key, value in extra if reports else ():
            keys.append(key)
            values.append(torch.tensor([float(value)], dtype=torch.float64, device=device))
            layouts.append(None)
        if not keys:
            return None
        return PendingRecords(step, tokens_seen, keys, torch.cat([v.to(device) for v in values]), protocol,
                              layouts=layouts)


class WideResult:
    """What the wide sites gave one emission: ``blocks`` ``[(key, [M, 1] values)]`` this rank
    reports, ``spectra`` ``[(key, site covariance, spectrum [1, D])]`` of the layers it keeps."""

    def __init__(self):
        self.blocks: list[tuple[SiteKey, Tensor]] = []
        self.spectra: list[tuple[SiteKey, SiteCovariance, Tensor]] = []
