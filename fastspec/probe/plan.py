"""The probe's memory plan: what it holds on each rank, where each FFN layer lives, and the search
that fits both to a budget. :class:`fastspec.Probe` and ``fastspec plan`` run the same code, so a
plan printed before a launch is the one the probe will follow (docs/scale.md).

**What a probe holds** (bytes on one rank; ``t`` the itemsize of the ``D × D`` totals):

* accumulators: per (site, layer) of ``S`` sites of width ``D``, ``S·(16 + 8·D + t·D²)``
  (``n`` and ``rejected`` int64, the float64 mean or sum, the ``m2``/``gram`` totals:
  ``Covariance``'s state, exactly);
* capture workspace (one capture runs at a time): for the wide sites under a budget, the
  in-place update's block of rows (``covariance.inplace.workspace_bytes``, a bound set before the
  first row) and, under tensor parallelism, the gathered rows (:func:`gather_bytes`); for the
  other sites a bound of the default path's buffers (:func:`default_capture_bytes`);
* emission workspace (sites solved one at a time, the small ones first in one batch): for a wide
  site the copy it is reduced or solved in (none when the emission may consume the totals: the
  probe resets them anyway) and the eigensolver's own copy of its input (torch's solvers copy
  the matrix they factor), :func:`wide_emission_bytes`; for the small sites a bound,
  :func:`default_emission_bytes`.

The peak on a rank is ``accumulators + max(capture workspace, emission workspace)``.

**Layouts of the FFN (wide) sites.** Keys, queries and module sites are small: every rank of the
data-parallel group keeps them and they are all-reduced at each emission (``replicated``). For
the FFN layers the search takes the first of these that fits the budget on every rank:

1. ``replicated``, float64 totals: every data-parallel rank keeps every layer (under tensor
   parallelism, the ranks of tensor-parallel slot ``i mod tp`` keep the stage's ``i``-th layer),
   all-reduced at emission: records of the whole batch, as without a budget;
2. ``owned``, float64 totals: layer ``i`` of the stage is kept by one rank of the data-parallel ×
   tensor-parallel grid, ``o = i mod (dp·tp)``: data-parallel rank ``o mod dp``, tensor-parallel
   rank ``o // dp``, from the rows of its own data-parallel replica; nothing is all-reduced and
   each rank solves its own layers;
3. the same with float32 totals (``eig`` sites only: an ``sv`` spectrum's small singular values
   need float64, ``covariance/policy.py``);
4. rotation: each rank's layers take turns, ``fit`` of them per emission window, so a layer is
   measured once every ``groups = ⌈most layers on a rank / fit⌉`` windows (float32 totals for
   ``eig``). Needs ``reset=True`` (running totals keep every layer).

A single process (or ``sync="none"``) has nothing to own across ranks: steps 2 and 3 become
float32 totals on that rank. Without a budget (``memory=None``) the probe keeps today's layout
(``default``: every layer on every rank, the default update kernels) and :func:`figures` bounds
what it holds.

Pure Python: no torch import, so ``fastspec plan`` starts fast.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .. import _args

#: ``Probe(memory=None)`` on a CUDA device: this fraction of the device's memory. Small beside
#: what training holds (4 GB of an 80 GB H100, 7 GB of an H200), large enough for every FFN layer
#: of a 1B-class model on one rank, and for an owned 8B layer in float32 with its workspace.
DEFAULT_FRACTION = 0.05

MODES = ("default", "replicated", "owned")
TOTALS = {"float64": 8, "float32": 4}

# the default update path's buffers (covariance/blocked.py), for the bounds below
_BLOCK_BYTES = {"cpu": (1 << 20) * 8, "cuda": (1 << 22) * 8}

#: predicted eigensolve rates (flop/s) for the solve-time estimate of ``fastspec plan``: a wide
#: ``D × D`` symmetric eigenvalue problem costs ~(4/3)·D³ flops (the tridiagonal reduction);
#: cuSOLVER's syevd reaches ~10 TFLOP/s on an H100 at D >= 8192 (predicted, not measured here);
#: the batched 128² solver was measured at 0.74 µs a float32 matrix, 4.5 µs a float64 one
#: (H100, docs/kernels.md).
WIDE_SOLVE_FLOPS = 1.0e13
SMALL_SOLVE_S = {"float32": 0.74e-6, "float64": 4.5e-6}


# --------------------------------------------------------------------------- the budget argument
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_arg(value) -> tuple[str, float] | None:
    """``Probe(memory=...)`` / ``fastspec plan --memory`` checked: ``None``, ``("bytes", n)``
    (an int, or a string such as ``"4GB"``, ``"512 MiB"``: GB = 10⁹, GiB = 2³⁰) or
    ``("fraction", f)`` (a float in (0, 1]: that share of the device's memory)."""
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"memory: expected bytes (an int), a size such as '4GB' or '512MiB', or a "
                             f"fraction of the device in (0, 1], got {value!r}")
        n = float(m.group(1)) * _UNITS[unit]
        if n < 1:
            raise ValueError(f"memory: expected a size of at least 1 byte, got {value!r}")
        return ("bytes", float(int(n)))
    if isinstance(value, float) and not isinstance(value, bool):
        if not 0 < value <= 1:
            raise ValueError(f"memory: a float is a fraction of the device's memory, in (0, 1]; got {value!r}")
        return ("fraction", value)
    n = _args.integer("memory", value, minimum=1)
    return ("bytes", float(n))


def human(n: float | None) -> str:
    """Bytes as ``'1.64 GB'`` (decimal units, as the budget strings)."""
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------- the sizes
def state_bytes(S: int, D: int, totals: int = 8) -> int:
    """Bytes of one ``Covariance((S, D))`` state (module docstring), ``totals`` bytes an entry of
    the ``D × D`` totals."""
    return S * (16 + 8 * D + totals * D * D)


def block_rows(S: int, D: int, totals: int) -> int:
    """Rows of one block of the in-place update (``fastspec.covariance.inplace.block_rows``,
    restated here without importing torch; a test holds the two equal)."""
    return max(1, min((64 << 20) // max(1, S * D * totals), max(256, min(4096, D))))


def inplace_capture_bytes(S: int, D: int, totals: int) -> int:
    """The in-place update's workspace bound (``fastspec.covariance.inplace.workspace_bytes``,
    restated here without importing torch; a test holds the two equal)."""
    R = block_rows(S, D, totals)
    return S * R * D * totals + S * R * (totals + 8) + 2 * 64 * S * D * (8 + 3 * totals + 3) + 8 * S * D * 8


def gather_bytes(D: int, tp: int, rows: int, itemsize: int) -> int:
    """A tensor-parallel gather of ``rows`` rows of width ``D`` (``D/tp`` columns a rank, one block
    of the in-place update): what the rank that keeps the layer holds at once (its own slab made
    contiguous, every rank's slab, the joined rows), which is more than a sender's."""
    return (2 * rows * D + rows * (D // tp)) * itemsize if tp > 1 else 0


def default_capture_bytes(S: int, D: int, device: str) -> int:
    """A bound of the default update path's buffers for one capture of ``S`` sites of width ``D``:
    the float64 Gram workspace and the float32 block Gram (``blocked.py``), the symmetrising pass's
    temporaries, the row block, a Triton launch's row-split partials (CUDA). Only a bound: the
    Triton FFN kernels also hold copies of the rows, which grow with the batch (the reason a
    budget moves the wide sites to the in-place update)."""
    return S * D * D * (8 + 4 + 8) + 2 * D * D + _BLOCK_BYTES.get(device, _BLOCK_BYTES["cuda"]) + 64 * S * D * 8 \
        + (S * D * D * 4 * 17 if device == "cuda" else 0)


def default_emission_bytes(small: list[tuple[int, int]]) -> int:
    """A bound of the batched emission of the small sites ``[(S, D), ...]``: the merged copies of
    an all-reduce, the matrices, their concatenation, the solve dtype's copy and the solver's
    own (six ``S·D²`` float64 matrices each), and per-site vectors."""
    return sum(6 * S * D * D * 8 + 64 * S * D * 8 for S, D in small)


def solve_itemsize(totals: int, convention: str, device: str) -> int:
    """Bytes an entry of a wide site's eigensolve: float32 totals solve in float32; float64 totals
    as ``covariance/policy.solve_dtype`` says (``sv``: float64; ``eig``: float32 on CUDA)."""
    if totals == 4:
        return 4
    return 8 if convention == "sv" or device != "cuda" else 4


def wide_emission_bytes(D: int, totals: int, convention: str, device: str, *, reduce: bool,
                        consume: bool) -> int:
    """Workspace of one wide site's emission: without ``consume`` a copy of the totals to reduce
    and scale in; a cast to the solve dtype where it differs; the eigensolver's copy of its input
    (what torch's ``eigvalsh`` allocates); the spectrum and its metrics (vectors)."""
    s = solve_itemsize(totals, convention, device)
    work = 0 if consume else D * D * totals
    cast = D * D * s if s != totals else 0
    vectors = 64 * D * 8
    return max(work + cast, cast + D * D * s, work + D * D * s) + vectors


# --------------------------------------------------------------------------------- the inputs
@dataclass(frozen=True)
class Stage:
    """What the plan needs of one rank's model (one pipeline stage):

    * ``wide``: ``(layer, d_ff)`` of each FFN site (whole width, also under tensor parallelism);
    * ``convention``: the FFN sites' (``"eig"`` or ``"sv"``);
    * ``small``: ``(site, S, D)`` per (site, layer) of the other sites known before the first
      step (keys: KV heads on this rank × head width), each kept on every data-parallel rank;
    * ``reset``: the totals are zeroed at each emission (the emission may consume them);
    * ``itemsize``: bytes of an activation entry (what a tensor-parallel gather moves).
    """

    wide: tuple[tuple[int, int], ...]
    convention: str = "eig"
    small: tuple[tuple[str, int, int], ...] = ()
    reset: bool = True
    itemsize: int = 2


@dataclass(frozen=True)
class Ranks:
    """The ranks a plan spreads the wide layers over: ``dp`` data-parallel ranks that merge (1
    without ``torch.distributed`` or with ``sync="none"``), ``tp`` tensor-parallel ranks across
    which the FFN input is split by columns (1: whole rows on every rank), this rank's
    coordinates, and the device kind (``"cuda"`` or ``"cpu"``)."""

    dp: int = 1
    tp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    device: str = "cuda"

    @property
    def grid(self) -> int:
        return self.dp * self.tp


# --------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Layout:
    """Where each wide (FFN) layer's accumulator lives, for every rank of one stage.

    ``mode``: ``"default"`` (no budget: every layer everywhere, the default kernels),
    ``"replicated"`` or ``"owned"`` (module docstring); ``totals``: ``"float64"``/``"float32"``;
    ``holders[layer]``: the ``(dp_rank, tp_rank)`` that keep it (``dp_rank`` None: every
    data-parallel rank of that tensor-parallel slot); ``group[layer]``: its turn in the rotation
    (0 .. ``groups`` − 1; ``groups`` = 1: every layer in every window)."""

    mode: str
    totals: str
    ranks: Ranks
    holders: dict[int, tuple[int | None, int]] = field(default_factory=dict)
    group: dict[int, int] = field(default_factory=dict)
    groups: int = 1

    @property
    def inplace(self) -> bool:
        """The wide sites take the in-place update (a budget rules; ``default`` keeps the kernels)."""
        return self.mode != "default"

    @property
    def itemsize(self) -> int:
        return TOTALS[self.totals]

    def held_by(self, layer: int, dp_rank: int, tp_rank: int) -> bool:
        h = self.holders.get(layer)
        if h is None:
            return False
        return h[1] == tp_rank and (h[0] is None or h[0] == dp_rank)

    def holds(self, layer: int) -> bool:
        """Whether this rank keeps ``layer``'s accumulator."""
        r = self.ranks
        return self.held_by(layer, r.dp_rank, r.tp_rank)

    def tp_holder(self, layer: int) -> int | None:
        """The tensor-parallel rank that keeps ``layer`` for this rank's data-parallel replica, or
        None when no rank of this replica does (an owned layer of another replica)."""
        h = self.holders.get(layer)
        if h is None or (h[0] is not None and h[0] != self.ranks.dp_rank):
            return None
        return h[1]

    def active(self, layer: int, window: int) -> bool:
        """Whether ``layer`` is measured in emission window ``window`` (rotation)."""
        return self.groups == 1 or self.group.get(layer, 0) == window % self.groups

    def layers_of(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [l for l in sorted(self.holders) if self.held_by(l, dp_rank, tp_rank)]

    def signature(self) -> dict:
        """What a checkpoint keeps of the layout (``Probe.state_dict`` compares it on restore)."""
        return {"mode": self.mode, "totals": self.totals, "dp": self.ranks.dp, "tp": self.ranks.tp,
                "groups": self.groups}

    @staticmethod
    def same(saved: dict, now: dict) -> bool:
        """Whether accumulators saved under layout ``saved`` (a :meth:`signature`) hold on each rank
        what they would under ``now``: the same mode, totals and turns, and, where layers are owned
        or split over tensor-parallel ranks, the same ranks. (A replicated or default layout holds
        every rank's rows merged on any world size: a change of world size alone changes nothing.)"""
        keys = ["mode", "totals", "groups"]
        if "owned" in (saved.get("mode"), now.get("mode")):
            keys.append("dp")
        if saved.get("tp", 1) > 1 or now.get("tp", 1) > 1:
            keys.append("tp")
        return all(saved.get(k) == now.get(k) for k in keys)

    def label(self) -> str:
        """What a record of a wide site says of its tokens (``Record.layout``): ``"owned"`` where one
        data-parallel replica's rows are measured (owned under dp > 1), else ``"replicated"``."""
        return "owned" if self.mode == "owned" and self.ranks.dp > 1 else "replicated"


def _assign(layers: list[int], ranks: Ranks, mode: str) -> dict[int, tuple[int | None, int]]:
    if mode in ("default", "replicated"):
        return {l: (None, i % ranks.tp) for i, l in enumerate(layers)}
    return {l: ((i % ranks.grid) % ranks.dp, (i % ranks.grid) // ranks.dp) for i, l in enumerate(layers)}


def _rotate(layout: Layout, fit: int) -> Layout:
    group, most = {}, 0
    for dp_rank in range(layout.ranks.dp):
        for tp_rank in range(layout.ranks.tp):
            mine = layout.layers_of(dp_rank, tp_rank)
            most = max(most, len(mine))
            for j, l in enumerate(mine):
                group[l] = j // fit
    groups = max(1, math.ceil(most / fit)) if most else 1
    return Layout(layout.mode, layout.totals, layout.ranks, layout.holders, group if groups > 1 else {}, groups)


# -------------------------------------------------------------------------------- the figures
@dataclass(frozen=True)
class Figures:
    """One rank's memory under a layout (bytes): ``small`` (accumulators of the replicated sites),
    ``wide`` (the FFN accumulators of the largest window), ``capture`` and ``emission``
    (workspace), ``peak`` = small + wide + max(capture, emission); ``layers`` the FFN layers it
    keeps, ``per_window`` how many of them at once."""

    small: int
    wide: int
    capture: int
    emission: int
    layers: tuple[int, ...]
    per_window: int

    @property
    def peak(self) -> int:
        return self.small + self.wide + max(self.capture, self.emission)

    def as_dict(self) -> dict:
        return {"small_bytes": self.small, "ffn_bytes": self.wide, "capture_workspace_bytes": self.capture,
                "emission_workspace_bytes": self.emission, "peak_bytes": self.peak,
                "ffn_layers": list(self.layers), "ffn_layers_per_window": self.per_window}


def figures(stage: Stage, layout: Layout, dp_rank: int, tp_rank: int, rows: int | None = None) -> Figures:
    """The memory of rank ``(dp_rank, tp_rank)`` under ``layout`` (module docstring). ``rows``: the
    rows one tensor-parallel gather moves at most (default: one block of the in-place update)."""
    ranks, t = layout.ranks, layout.itemsize
    width = dict(stage.wide)
    small_sites = [(S, D) for _, S, D in stage.small]
    small = sum(state_bytes(S, D) for S, D in small_sites)
    capture = max((default_capture_bytes(S, D, ranks.device) for S, D in small_sites), default=0)
    emission = default_emission_bytes(small_sites)
    mine = layout.layers_of(dp_rank, tp_rank)
    windows: dict[int, int] = {}
    for l in mine:
        g = layout.group.get(l, 0)
        windows[g] = windows.get(g, 0) + state_bytes(1, width[l], t)
    wide = max(windows.values(), default=0)
    per_window = max((sum(1 for l in mine if layout.group.get(l, 0) == g) for g in windows), default=0)
    if layout.inplace:
        reduce = layout.mode == "replicated" and ranks.dp > 1
        for l in mine:
            D = width[l]
            capture = max(capture, inplace_capture_bytes(1, D, t) + gather_bytes(
                D, ranks.tp, rows or block_rows(1, D, t), stage.itemsize))
            emission = max(emission, wide_emission_bytes(D, t, stage.convention, ranks.device, reduce=reduce,
                                                         consume=stage.reset))
        if ranks.tp > 1:  # a sender of the rows of the layers its tensor-parallel peers keep
            for l, D in stage.wide:
                h_dp, h_tp = layout.holders.get(l, (-1, tp_rank))
                if h_tp != tp_rank and h_dp in (None, dp_rank):
                    R = rows or block_rows(1, D, t)
                    capture = max(capture, R * (D // ranks.tp) * stage.itemsize)
    else:  # the default kernels, and the small sites' batched emission with every layer in it
        for l in mine:
            capture = max(capture, default_capture_bytes(1, width[l], ranks.device))
        emission = default_emission_bytes(small_sites + [(1, width[l]) for l in mine])
    return Figures(small, wide, capture, emission, tuple(mine), per_window)


def worst(stage: Stage, layout: Layout) -> Figures:
    """The figures of the rank with the largest peak."""
    return max((figures(stage, layout, d, t) for d in range(layout.ranks.dp) for t in range(layout.ranks.tp)),
               key=lambda f: f.peak)


# ---------------------------------------------------------------------------------- the search
class PlanError(ValueError):
    """The budget cannot hold what was asked (a one-line message naming the sizes)."""


def plan(stage: Stage, ranks: Ranks, budget: int | None) -> Layout:
    """The layout of the wide (FFN) layers under ``budget`` bytes a rank (module docstring);
    ``budget=None``: ``default``. Raises :class:`PlanError` when the small sites alone, or one
    FFN layer with its workspace, exceed the budget (or rotation is needed with ``reset=False``)."""
    layers = [l for l, _ in sorted(stage.wide)]
    if budget is None:
        # under tensor parallelism the rows must be gathered: that needs a layout of its own
        mode = "replicated" if ranks.tp > 1 else "default"
        return Layout(mode, "float64", ranks, _assign(layers, ranks, mode))
    base = Layout("replicated", "float64", ranks, {})
    small = worst(stage, base)
    if small.peak > budget:
        raise PlanError(f"memory: the budget {human(budget)} does not hold the replicated sites (keys/queries: "
                        f"{human(small.small)} of accumulators, {human(max(small.capture, small.emission))} of "
                        f"workspace); raise memory=, or probe fewer sites")
    if not layers:
        return base
    f32 = "float32" if stage.convention == "eig" else "float64"
    candidates = [("replicated", "float64")]
    if ranks.grid > 1:
        candidates.append(("owned", "float64"))
    mode = "owned" if ranks.grid > 1 else "replicated"
    if f32 != "float64":
        candidates.append((mode, f32))
    for m, totals in candidates:
        layout = Layout(m, totals, ranks, _assign(layers, ranks, m))
        if worst(stage, layout).peak <= budget:
            return layout
    layout = Layout(mode, f32, ranks, _assign(layers, ranks, mode))
    most = max(len(layout.layers_of(d, t)) for d in range(ranks.dp) for t in range(ranks.tp))
    fit = 0
    while fit < most and worst(stage, _rotate(layout, fit + 1)).peak <= budget:
        fit += 1
    if fit == 0:
        D = max(d for _, d in stage.wide)
        one = worst(stage, _rotate(layout, 1))
        raise PlanError(f"memory: one FFN layer (d_ff {D}) needs {human(one.wide)} of {f32} totals and "
                        f"{human(max(one.capture, one.emission))} of workspace beside {human(one.small)} of "
                        f"the other sites ({human(one.peak)} in all), over the budget {human(budget)}; "
                        f"raise memory=, or pass ffn=False")
    rotated = _rotate(layout, fit)
    if rotated.groups > 1 and not stage.reset:
        raise PlanError(f"memory: the budget {human(budget)} holds {fit} of the {most} FFN layers a rank keeps, "
                        f"so they would take turns, but reset=False keeps every layer's running totals; "
                        f"raise memory= or use reset=True")
    return rotated


# ------------------------------------------------------------------------- what a plan reports
def predicted_solve_seconds(stage: Stage, figs: Figures) -> float:
    """Predicted seconds of one emission's eigensolves on this rank (``WIDE_SOLVE_FLOPS``,
    ``SMALL_SOLVE_S``; not measured)."""
    width = dict(stage.wide)
    mats = sum(S for _, S, _ in stage.small)
    small = sum(S * SMALL_SOLVE_S["float64" if site.startswith("keys") else "float32"] * (D / 128) ** 3
                for site, S, D in stage.small) if mats else 0.0
    per_window = sorted(figs.layers, key=lambda l: -width[l])[:figs.per_window]
    return small + sum(4 / 3 * width[l] ** 3 / WIDE_SOLVE_FLOPS for l in per_window)


# ---------------------------------------------------------------------------- a whole model, offline
#: ``config.json`` model types whose MLP is gated (three projections of ``hidden × d_ff``)
GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "olmo",
         "olmo2", "olmo3", "phi3", "granite", "cohere", "deepseek_v3", "ernie4_5")
RECORD_VALUES = 16  # metrics per FFN layer in an owned layout's gather (RECORD_METRICS and a flag)


def matmul_parameters(arch: dict) -> int:
    """Parameters that do per-token matmul work in a model of ``arch`` (``config_architecture``'s
    fields plus ``vocab_size``): attention ``q, k, v, o``, the MLP (gated: three matrices), the
    output head; what ``ffn_sampling.matmul_parameters`` counts on a live model."""
    h, L, d_ff = arch["hidden_size"], arch["num_layers"], arch["d_ff"]
    heads, kv, hd = arch["num_heads"], arch["num_kv_heads"], arch["head_dim"]
    attn = h * heads * hd * 2 + 2 * h * kv * hd
    mlp = (3 if arch.get("model_type") in GATED else 2) * h * d_ff
    return L * (attn + mlp) + int(arch.get("vocab_size") or 0) * h


def model_stages(arch: dict, pp: int, tp: int, *, sites: tuple[str, ...], convention: str, reset: bool,
                 itemsize: int) -> list[Stage]:
    """One :class:`Stage` per pipeline stage of a model of ``arch``: its layers in contiguous
    blocks (the first ``L mod pp`` stages one layer more), keys/queries per tensor-parallel rank."""
    L, d_ff = arch["num_layers"], arch["d_ff"]
    kv, heads, hd = arch["num_kv_heads"], arch["num_heads"], arch["head_dim"]
    for name, n in (("num_kv_heads", kv), ("num_heads", heads), ("d_ff", d_ff)):
        if tp > 1 and n % tp:
            raise ValueError(f"--tp: {name} {n} does not split over {tp} tensor-parallel ranks")
    stages, start = [], 0
    for s in range(pp):
        n = L // pp + (1 if s < L % pp else 0)
        layers = range(start, start + n)
        start += n
        small = []
        for site, S in (("keys", kv // tp), ("queries", heads // tp)):
            if site in sites:
                small += [(site, S, hd)] * n
        wide = tuple((l, d_ff) for l in layers) if "ffn" in sites else ()
        stages.append(Stage(wide, convention, tuple(small), reset, itemsize))
    return stages


def report(arch: dict, *, dp: int, tp: int, pp: int, budget: int, tokens: int, ffn_row_step: int,
           sites: tuple[str, ...] = ("keys", "ffn"), convention: str = "eig", reset: bool = True,
           itemsize: int = 2, device: str = "cuda") -> dict:
    """What ``fastspec plan`` prints: the layout each pipeline stage gets under ``budget`` bytes a
    rank, and per kind of rank (ranks with the same figures together) the probe's memory, the FFN
    layers it keeps, the rows it samples per step (``tokens`` per data-parallel rank and step,
    every ``ffn_row_step``-th), the bytes it moves per step (the tensor-parallel gather) and per
    emission (its all-reduces, ring: ``2(g−1)/g`` of the bytes reduced), and the predicted seconds
    of one emission's eigensolves. Raises :class:`PlanError` where the budget cannot hold it."""
    stages = model_stages(arch, pp, tp, sites=sites, convention=convention, reset=reset, itemsize=itemsize)
    rows_step = -(-tokens // ffn_row_step)
    ring = (lambda g, nbytes: 2 * (g - 1) * nbytes // g if g > 1 else 0)
    kinds: dict[tuple, dict] = {}
    layouts = []
    for s, stage in enumerate(stages):
        wide_tp = tp if stage.wide else 1
        layout = plan(stage, Ranks(dp, wide_tp, 0, 0, device), budget)
        layouts.append(layout)
        for d in range(dp):
            for t in range(wide_tp):
                f = figures(stage, layout, d, t)
                sent = 0  # the tensor-parallel gather of the largest window's layers
                for g in range(layout.groups):
                    moved = 0
                    for l, D in stage.wide:
                        h_dp, h_tp = layout.holders[l]
                        if layout.group.get(l, 0) != g or h_dp not in (None, d) or wide_tp == 1:
                            continue
                        slab = rows_step * (D // wide_tp) * itemsize
                        moved += slab * (wide_tp - 1) if h_tp == t else slab
                    sent = max(sent, moved)
                small_state = sum(state_bytes(S, D) for _, S, D in stage.small)
                emission = ring(dp, small_state)
                if layout.mode == "replicated":
                    emission += ring(dp, f.wide)
                else:
                    active = max(1, len(stage.wide) // max(1, layout.groups))
                    emission += ring(wide_tp, active * RECORD_VALUES * 8) + ring(dp, active * RECORD_VALUES * 8)
                row = {"stage": s, "layout": layout.mode, "totals": layout.totals, "ffn_every": layout.groups,
                       **f.as_dict(), "ffn_rows_per_step": rows_step if f.layers else 0,
                       "bytes_per_step": sent, "bytes_per_emission": emission,
                       "solve_seconds_predicted": round(predicted_solve_seconds(stage, f), 4)}
                # ranks alike but for which layers (and stage) they keep are one kind
                key = tuple((k, len(v) if k == "ffn_layers" else v) for k, v in row.items() if k != "stage")
                if key in kinds:
                    kinds[key]["ranks"] += 1
                    kinds[key]["stages"] = sorted(set(kinds[key]["stages"]) | {s})
                else:
                    kinds[key] = {**row, "ranks": 1, "stages": [s],
                                  "example_rank": {"stage": s, "dp_rank": d, "tp_rank": t}}
                    del kinds[key]["stage"]
    rows = sorted(kinds.values(), key=lambda r: (-r["peak_bytes"], -r["bytes_per_step"]))
    return {"dp": dp, "tp": tp, "pp": pp, "budget_bytes": budget, "tokens_per_step": tokens,
            "ffn_row_step": ffn_row_step, "memory_peak_bytes": max(r["peak_bytes"] for r in rows),
            "ffn_every": max(l.groups for l in layouts),
            "ffn_all_reduced": any(l.mode == "replicated" and dp > 1 and st.wide for l, st in zip(layouts, stages)),
            "layouts": sorted({(l.mode, l.totals) for l, st in zip(layouts, stages) if st.wide}),
            "ranks": rows}
