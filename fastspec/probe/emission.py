"""Emission: from a probe's covariances to records (and spectra), without a host sync.

1. Under ``torch.distributed`` each (site, layer) covariance is all-reduced first
   (:meth:`fastspec.Covariance.all_reduce`, exact), unless ``sync="none"``.
2. One eigensolve per (convention, D, device) over every site and layer (one batched launch on
   CUDA), in the solve dtype of ``fastspec.covariance.policy.solve_dtype``: float64 for ``sv``,
   where ``σ = sqrt(λ)`` would turn a float32 solve's ``eps·λ_max`` into ``sqrt(eps)·σ_max``.
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
from ..covariance.distributed import is_distributed
from ..metrics import rank_at, summarize
from .families import Family
from .gamma import gamma_values
from .pending import PendingRecords, RecordKey
from .sites import Collector, SiteCovariance, SiteKey

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
            if acc.cov.device is None:
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
        singular values (``sv``), as ``Covariance.spectrum`` computes them."""
        items = self._items(collector)
        return self._spectra(items, list(self._solve(items)))

    @staticmethod
    def _spectra(items: list[Item], solved: list) -> dict[SiteKey, Tensor]:
        out: list[Tensor | None] = [None] * len(items)
        for _, spec, parts in solved:
            for i, sl in parts:
                cov = items[i][2]
                out[i] = spec[sl].reshape(*cov.sites, cov.D)
        return {key: spec for (key, _, _), spec in zip(items, out)}  # in sorted_items order

    @staticmethod
    def _blocks(items: list[Item], solved: list) -> list[Tensor]:
        """Per item, its ``[len(RECORD_METRICS), S]`` float64 block of values (``solved``: the
        items' :meth:`_solve` groups)."""
        blocks: list[Tensor | None] = [None] * len(items)
        for convention, spec, parts in solved:
            m = summarize(spec, check_negative=False)
            cols = torch.stack([getattr(m, name).double() for name in SPECTRUM_METRICS])  # [M, ΣS]
            # variance per direction: λ of C for eig; σ² (energy of the uncentred rows) for sv, as in
            # PCA's "components for 90% explained variance" of the key matrix
            r90 = rank_at(spec.square() if convention == "sv" else spec, 0.9, check_negative=False).double()
            for i, sl in parts:
                cov = items[i][2]
                n = cov.n.double().reshape(-1)
                top = spec[sl, 0].double()
                lam_max = top if convention == "eig" else top.square() / n  # sv: top eigenvalue of XᵀX/n
                rest = [r90[sl], lam_max, n, cov.rejected.double().reshape(-1)]
                blocks[i] = torch.cat([cols[:, sl], torch.stack(rest)])
        return blocks

    def records(self, collector: Collector, step: int, tokens_seen: int | None, protocol: str,
                extra: tuple[tuple[RecordKey, float], ...] = ()) -> PendingRecords | None:
        """Metrics of every site, plus γ and ``extra`` records, packed into one tensor headed
        for the host; None when there is nothing to report (or this rank does not report).
        ``protocol``: ``"eval"`` or ``"stream"``, stamped on every record."""
        items = self._items(collector)
        return self._pack(items, list(self._solve(items)), step, tokens_seen, protocol, extra)

    def records_and_spectra(self, collector: Collector, step: int, tokens_seen: int | None,
                            protocol: str) -> tuple[PendingRecords | None, dict[SiteKey, Tensor]]:
        """:meth:`records` and :meth:`spectra` of ``collector`` from one eigensolve (one
        all-reduce under ``torch.distributed``)."""
        items = self._items(collector)
        solved = list(self._solve(items))
        return self._pack(items, solved, step, tokens_seen, protocol, ()), self._spectra(items, solved)

    def _pack(self, items: list[Item], solved: list, step: int, tokens_seen: int | None, protocol: str,
              extra: tuple[tuple[RecordKey, float], ...]) -> PendingRecords | None:
        keys: list[RecordKey] = []
        values: list[Tensor] = []
        for ((site, layer), acc, _), block in zip(items, self._blocks(items, solved)):
            for name in RECORD_METRICS:
                for h in range(block.shape[1]):
                    keys.append((site, layer, acc.head_offset + h if acc.headed else None, name))
            values.append(block.reshape(-1))
        reports = self.reports()
        if self.gamma and reports:
            gamma_keys, gamma_vals = gamma_values(self.model, self.family)
            keys += gamma_keys
            values += gamma_vals
        device = values[0].device if values else None
        for key, value in extra if reports else ():
            keys.append(key)
            values.append(torch.tensor([float(value)], dtype=torch.float64, device=device))
        if not keys:
            return None
        return PendingRecords(step, tokens_seen, keys, torch.cat([v.to(device) for v in values]), protocol)
