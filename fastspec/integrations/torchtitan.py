"""TorchTitan: stream the probe through pre-training with ``FastspecTrainer``, a ``Trainer`` subclass.

Needs ``torchtitan`` (tested: 0.3.x; another version warns once at import). Only this module
imports it: ``import fastspec`` and ``fastspec.integrations`` work without it.

TorchTitan builds its trainer from a config (``Trainer.Config``, a ``Configurable``); a
config-registry function returning ``FastspecTrainer.Config(..., fastspec=FastspecConfig(enable=True))``
(or ``--fastspec.enable`` on the command line of such a config) turns the probe on. Then
:class:`FastspecTrainer`:

* builds ``fastspec.Probe`` on the root model (``model_parts[0]``, the ``Decoder`` whose forward the
  trainer calls; FSDP2, TP, activation checkpointing and per-block compile are applied by then)
  and attaches it, with the data-parallel group (``parallel_dims`` mesh ``"loss"``: the
  data-parallel and context-parallel ranks, which see other tokens) as ``process_group``;
* after each ``train_step`` calls ``probe.step(step, tokens_seen=...)``, and sends
  :func:`fastspec.integrations.scalars` of the records that arrived to the metrics processor's
  logger (TensorBoard / W&B as configured), at the records' own step;
* under tensor parallelism each rank measures its own heads (records carry the global head
  index): on emission steps the records are gathered over the TP group, so the logging rank
  logs every head. All TP ranks emit on the same steps;
* saves the probe's state in TorchTitan checkpoints: its ``state_dict`` (``"train_state"``) holds
  ``fastspec/rank{r}``, the bytes of rank r's probe state, one key per rank because streaming
  accumulators hold each rank's own tokens until an emission merges them (DCP would keep only
  one copy of a key that all ranks share).

Pipeline parallelism (several model parts) is not supported: the config refuses it.
The page: docs/torchtitan.md.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torchtitan
from torchtitan.trainer import Trainer

from .. import _args
from ..covariance.distributed import is_distributed
from ..probe.ffn_sampling import check_ffn_rows

__all__ = ["TESTED_VERSIONS", "FastspecConfig", "FastspecTrainer"]

TESTED_VERSIONS = "0.3.x"


def _check_version(version: str) -> None:
    """One warning if ``version`` (TorchTitan's) is outside the tested range: its trainer and
    config classes change between minor releases."""
    if not str(version).startswith("0.3."):
        warnings.warn(f"fastspec.integrations.torchtitan: tested with torchtitan {TESTED_VERSIONS}, "
                      f"found {version}", UserWarning, stacklevel=3)


_check_version(getattr(torchtitan, "__version__", "unknown"))


def _rank() -> int:
    """This process's global rank (0 without ``torch.distributed``)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@dataclass(kw_only=True, slots=True)
class FastspecConfig:
    """The ``fastspec`` section of :class:`FastspecTrainer.Config` (CLI: ``--fastspec.emit_every 10``).

    Fields as :class:`fastspec.Probe` takes them: ``keys``, ``queries``, ``ffn`` (sites),
    ``every`` (capture one step in ``every``), ``emit_every`` (metrics every ``emit_every`` steps),
    ``budget`` (overhead budget, a fraction of the step time, or None), ``ffn_rows`` (FFN token
    sampling: ``"auto"``, ``"all"`` or k), ``reset`` (zero the totals after each emission),
    ``modules`` (extra sites: module-name globs, e.g. ``"layers.*.feed_forward.w1"``).
    ``enable``: build the probe at all. ``emit_on``: which ranks send scalars to their metrics
    logger: ``"rank0"`` (global rank 0, where TorchTitan logs) or ``"all"`` (each rank, e.g. with
    ``metrics.save_for_all_ranks``). ``prefix``: of the scalar tags.
    """

    enable: bool = False
    keys: bool = True
    queries: bool = False
    ffn: bool = True
    every: int = 1
    emit_every: int = 100
    budget: float | None = None
    ffn_rows: int | Literal["auto", "all"] = "auto"
    reset: bool = True
    modules: list[str] = field(default_factory=list)
    emit_on: Literal["rank0", "all"] = "rank0"
    prefix: str = "fastspec"

    def __post_init__(self):
        # one-line errors naming the field as the command line spells it
        for name in ("enable", "keys", "queries", "ffn", "reset"):
            _args.flag(f"fastspec.{name}", getattr(self, name))
        _args.integer("fastspec.every", self.every, minimum=1)
        _args.integer("fastspec.emit_every", self.emit_every, minimum=1)
        _args.real("fastspec.budget", self.budget, "a fraction in (0, 1) or None", lambda b: 0 < b < 1, optional=True)
        check_ffn_rows("fastspec.ffn_rows", self.ffn_rows)
        _args.choice("fastspec.emit_on", self.emit_on, ("rank0", "all"))
        _args.text("fastspec.prefix", self.prefix)
        for pattern in self.modules:
            _args.text("fastspec.modules: pattern", pattern)
        if self.enable and not (self.keys or self.queries or self.ffn or self.modules):
            raise ValueError("fastspec.keys/queries/ffn/modules: no site selected; turn one on or set "
                             "fastspec.enable=False")

    def probe_kwargs(self) -> dict[str, Any]:
        """The :class:`fastspec.Probe` arguments of this section."""
        return {"keys": self.keys, "queries": self.queries, "ffn": self.ffn, "every": self.every,
                "emit_every": self.emit_every, "budget": self.budget, "ffn_rows": self.ffn_rows,
                "reset": self.reset, "modules": list(self.modules) or None}


class FastspecTrainer(Trainer):
    """TorchTitan's ``Trainer`` with a streaming :class:`fastspec.Probe` (module docstring).

    ``trainer.fastspec_probe``: the probe (None while ``fastspec.enable`` is off);
    ``trainer.fastspec_records``: the records this rank sent to its logger (under TP, on the
    logging rank, every TP rank's heads).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fastspec: FastspecConfig = field(default_factory=FastspecConfig)

        def __post_init__(self):
            # before TorchTitan's checks, which may refuse a pipeline-parallel config for another reason
            if self.fastspec.enable and self.parallelism.pipeline_parallel_degree > 1:
                raise NotImplementedError(
                    f"parallelism.pipeline_parallel_degree: fastspec.integrations.torchtitan does not support "
                    f"pipeline parallelism (several model parts), got {self.parallelism.pipeline_parallel_degree}; "
                    f"set it to 1 or fastspec.enable=False")
            Trainer.Config.__post_init__(self)  # (slots dataclasses: no zero-argument super())

    def __init__(self, config: Config):
        super().__init__(config)
        self.fastspec_probe = None
        self.fastspec_records: list = []
        self._fastspec_calls = 0   # probe.step() calls: the emission schedule all TP ranks share
        self._fastspec_gathered = 0  # under TP: records of the probe's history already gathered
        self._fastspec_tp_group = None
        self._fastspec_dp_size = 1
        if config.fastspec.enable:
            self._build_probe(config.fastspec)

    # ------------------------------------------------------------------ set-up
    def _build_probe(self, cfg: FastspecConfig) -> None:
        from ..probe import Probe

        if len(self.model_parts) != 1:
            raise NotImplementedError(f"model_parts: fastspec.integrations.torchtitan probes one model part, "
                                      f"got {len(self.model_parts)} (pipeline parallelism is not supported)")
        pd = self.parallel_dims
        group = None
        if is_distributed():
            # the ranks whose tokens differ (data and context parallel) merge their covariances;
            # without them, a group of this rank alone: never None, which would merge over the
            # world, TP ranks (other heads) included. A collective emission also keeps every
            # TP rank's emission schedule identical.
            mesh = pd.get_optional_mesh("loss") or pd.get_optional_mesh("loss", include_singleton_axes=True)
            group, self._fastspec_dp_size = mesh.get_group(), mesh.size()
            tp = pd.get_optional_mesh("tp")
            self._fastspec_tp_group = None if tp is None else tp.get_group()
        self.fastspec_probe = Probe(self.model_parts[0], sync="all", process_group=group, **cfg.probe_kwargs())
        self.fastspec_probe.attach()

    # ---------------------------------------------------------------- training
    def train_step(self, data_iterator) -> None:
        super().train_step(data_iterator)
        if self.fastspec_probe is not None:
            self._fastspec_step()

    def _fastspec_step(self) -> None:
        probe, cfg = self.fastspec_probe, self.config.fastspec
        # ntokens_seen counts this rank's tokens; every data/context-parallel rank sees as many
        tokens = self.ntokens_seen * self._fastspec_dp_size
        new = probe.step(self.step, tokens_seen=tokens)
        self._fastspec_calls += 1
        if self._fastspec_tp_group is not None:
            # gather on emission steps only (the same steps on every TP rank), waiting for what is in
            # flight: every record of the history since the last gather, those step() returned included
            if self._fastspec_calls % probe.emit_every:
                return
            everything = probe.records()
            new, self._fastspec_gathered = everything[self._fastspec_gathered:], len(everything)
            parts = [None] * torch.distributed.get_world_size(self._fastspec_tp_group)
            torch.distributed.all_gather_object(parts, new, group=self._fastspec_tp_group)
            new = [r for part in parts for r in part]
        if not new:
            return
        self.fastspec_records.extend(new)
        if cfg.emit_on == "all" or _rank() == 0:
            self._fastspec_log(new, cfg.prefix)

    def _fastspec_log(self, records: list, prefix: str) -> None:
        from . import scalars

        by_step: dict[int, list] = {}
        for r in records:  # on CUDA, an emission's values may reach the host a step later
            by_step.setdefault(int(r.step), []).append(r)
        for step, group in sorted(by_step.items()):
            self.metrics_processor.logger.log(scalars(group, prefix), step)

    # -------------------------------------------------------------- checkpoint
    def _fastspec_key(self) -> str:
        return f"fastspec/rank{_rank()}"

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.fastspec_probe is not None:
            buf = io.BytesIO()
            torch.save({"probe": self.fastspec_probe.state_dict(), "calls": self._fastspec_calls}, buf)
            sd[self._fastspec_key()] = buf.getvalue()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        key = self._fastspec_key()
        if self.fastspec_probe is not None and key in state_dict:
            # weights_only=False: the state holds records (dataclasses) next to the tensors
            saved = torch.load(io.BytesIO(state_dict[key]), weights_only=False)
            self.fastspec_probe.load_state_dict(saved["probe"])
            self._fastspec_calls = int(saved["calls"])
            self._fastspec_gathered = len(self.fastspec_probe.records())

    def close(self) -> None:
        if self.fastspec_probe is not None:
            self.fastspec_probe.detach()
        super().close()
