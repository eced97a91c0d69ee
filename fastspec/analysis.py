"""Analysis of probe records: trajectories, summary tables, width-sweep fits, tail fits.

Every function takes *records* in the tidy format of :class:`fastspec.Record` — a list of
``Record``s, a list of dicts, or a ``pandas.DataFrame`` with the columns

    step, tokens_seen, site, layer, head_index, metric, value, protocol, layout   (+ optional ``condition``, ``width``)

of which ``tokens_seen``, ``layer``, ``head_index``, ``protocol`` and ``layout`` may be absent (None), and
``head`` is read as ``head_index`` (older files): the schema of ``fastspec/probe/record.py``.

and returns a ``pandas.DataFrame``. Records hold one value per (layer, head); per-layer values
are the mean over heads, whole-model values the mean over layers of those (the aggregation of
docs/protocols.md). Fits build on :func:`fastspec.fit_power_law` and :func:`fastspec.tail_index`
(docs/fits.md).

Protocols are never mixed. An eval measurement (``protocol="eval"``, :meth:`fastspec.Probe.measure`
on a fixed batch) and a streaming emission (``"stream"``, the training tokens since the last
emission) of the same step share every other column but measure different tokens, so every
function here reads one protocol: its ``protocol`` argument, by default ``"auto"`` =
:func:`resolve_protocol`: ``"eval"`` when the selected site/metric has eval records, else
``"stream"``, else the unlabelled records (``protocol`` None or ``""``, e.g. a user's own),
which form a group of their own. Pass ``"eval"``, ``"stream"`` or ``None`` to choose.

Layouts are never mixed either: a site's records that hold every data-parallel rank's tokens
(``layout="replicated"``) and records of one rank's (``"owned"``, an FFN layer kept by one rank
under a memory budget, docs/scale.md) estimate the same spectrum from different numbers of
tokens; a selection holding both raises, naming ``layout``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd

from . import _args
from .fits import fit_power_law, tail_index
from .probe import record

__all__ = [
    "to_frame",
    "resolve_protocol",
    "site_dimension",
    "dimension_name",
    "layer_means",
    "trajectory",
    "summary_table",
    "layer_table",
    "layer_zones",
    "layer_changes",
    "compare_changes",
    "width_fits",
    "utilization_slopes",
    "tail_fits",
]

RECORD_COLUMNS = list(record.FIELDS)  # (kept for code that read it here; the schema is record.py's)
# The key-rank study's headline quantity (docs/protocols.md) and the default everywhere below.
KEY_SITE, KEY_METRIC = "keys", "participation_ratio"
AUTO = "auto"


def to_frame(records) -> pd.DataFrame:
    """Records (``Record``s, dicts or a DataFrame) -> DataFrame with at least the
    ``fastspec.probe.record.FIELDS`` columns, each record normalised by
    ``fastspec.probe.record.normalize`` (a DataFrame's columns by ``record.conform``).

    A ``condition`` column is added (``""``) when absent, so every table can group by it.
    """
    if isinstance(records, pd.DataFrame):
        renames, absent = record.conform(records.columns)
        df = records.rename(columns=renames)  # a copy: the caller's frame is left alone
        for col in absent:
            df[col] = None
    elif isinstance(records, Iterable) and not isinstance(records, (str, bytes, Mapping)):
        rows = [record.normalize(r) for r in records]
        df = pd.DataFrame(rows, columns=None if rows else list(record.FIELDS))
    else:
        raise TypeError(f"records: expected a list of Records/dicts or a DataFrame, got {type(records).__name__}")
    if "condition" not in df.columns:
        df["condition"] = ""
    df["condition"] = df["condition"].fillna("").astype(str)
    for col in record.INT_FIELDS:  # nullable ints: None stays <NA>, 3 stays 3
        df[col] = pd.to_numeric(df[col], errors="coerce").astype("Int64")
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    return df


def _in_condition_order(out: pd.DataFrame, df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """Sort by condition in order of first appearance in ``df`` (run order), then ``cols``."""
    order = {c: i for i, c in enumerate(dict.fromkeys(df["condition"]))}
    out = out.assign(_o=out["condition"].map(order)).sort_values(["_o", *cols], kind="stable")
    return out.drop(columns="_o").reset_index(drop=True)


def _protocols(df: pd.DataFrame) -> pd.Series:
    """The ``protocol`` column with None/NaN as ``""``: the unlabelled records are one group."""
    p = df["protocol"]
    return p.astype(object).where(p.notna(), "").astype(str)


def _pick_protocol(have: set[str], protocol, what: str) -> str:
    """The protocol group (``""`` = unlabelled) that ``protocol`` selects among ``have``."""
    show = [h or None for h in sorted(have)]
    if protocol == AUTO:
        for preferred in ("eval", "stream"):
            if preferred in have:
                return preferred
        if len(have) == 1:
            return next(iter(have))
        raise ValueError(f"protocol: {what} has records of protocols {show}; pass one of them")
    if protocol is not None and not isinstance(protocol, str):
        raise ValueError(f"protocol: expected 'auto', 'eval', 'stream' or None, got {protocol!r}")
    want = protocol or ""
    if want not in have:
        raise ValueError(f"protocol: no {what} records with protocol {protocol!r}; have {show}")
    return want


def _select(df: pd.DataFrame, site: str, metric: str, protocol=AUTO) -> pd.DataFrame:
    """Records of ``site``/``metric`` from one protocol (see the module docstring)."""
    sel = df[(df["site"] == site) & (df["metric"] == metric)]
    if sel.empty:
        have = sorted({f"{s}/{m}" for s, m in zip(df["site"], df["metric"])})
        raise ValueError(f"site, metric: no records for {site}/{metric}; have {have}")
    groups = _protocols(sel)
    sel = sel[groups == _pick_protocol(set(groups), protocol, f"{site}/{metric}")]
    if "layout" in sel.columns:
        layouts = sorted({x for x in sel["layout"] if isinstance(x, str)})
        if len(layouts) > 1:  # every data-parallel rank's tokens, or one rank's: never averaged together
            raise ValueError(f"layout: the {site}/{metric} records come from layouts {layouts} (replicated: every "
                             f"data-parallel rank's tokens; owned: one rank's, docs/scale.md); keep one, e.g. "
                             f"records[records.layout == {layouts[0]!r}], before reading them together")
    return sel


def resolve_protocol(records, site: str = KEY_SITE, metric: str = KEY_METRIC, protocol=AUTO) -> str | None:
    """The protocol the functions of this module read for ``site``/``metric``: ``"eval"``,
    ``"stream"``, another label, or None for unlabelled records (see the module docstring).

    Raises ValueError naming ``protocol`` when the requested group has no records, or when
    ``"auto"`` finds neither eval nor stream records but more than one other group.
    """
    return _protocols(_select(to_frame(records), site, metric, protocol)).iloc[0] or None


def site_dimension(records, site: str = KEY_SITE, protocol=AUTO) -> int | None:
    """The width D of ``site``'s spectra (d_head for keys, d_ff for FFN), the ceiling of its PR
    and entropy rank: ``D = participation_ratio + ghost_dims`` (``ghost_dims = D − PR``), or
    ``PR / utilization`` without ghost dims. None when the records hold neither, or when D
    differs between records (a width sweep)."""
    df = to_frame(records)
    keys = ["condition", "step", "layer", "head_index"]
    for other, combine in (("ghost_dims", np.add), ("utilization", np.divide)):
        if not ((df["site"] == site) & (df["metric"] == other)).any():
            continue
        try:
            pr = _select(df, site, "participation_ratio", protocol)
            ot = _select(df, site, other, _protocols(pr).iloc[0])
        except ValueError:
            return None
        both = pr.merge(ot, on=keys, suffixes=("", "_o"))
        dims = set(np.round(combine(both["value"], both["value_o"]).dropna()).astype(int).tolist())
        return dims.pop() if len(dims) == 1 else None
    return None


# metrics whose per-head (per-layer for FFN) value is at most the spectrum width D, their ceiling
BOUNDED = ("participation_ratio", "entropy_rank", "effective_dim", "rank_at_90")


def dimension_name(site: str) -> str:
    """What the width D of ``site``'s spectra is called: ``d_ff``, ``d_head`` (attention sites) or ``D``."""
    return "d_ff" if site == "ffn" else "d_head" if site.startswith(("keys", "quer")) else "D"


def layer_means(records, site: str = KEY_SITE, metric: str = KEY_METRIC, protocol=AUTO) -> pd.DataFrame:
    """Mean over heads per (condition, step, layer) of one protocol (module docstring):
    columns condition, step, tokens_seen, layer (nullable Int64), value."""
    df = _select(to_frame(records), site, metric, protocol)
    keys = ["condition", "step", "layer"]
    out = (df.groupby(keys, dropna=False, sort=False)
             .agg(tokens_seen=("tokens_seen", "first"), value=("value", "mean"))
             .reset_index())
    return _in_condition_order(out[["condition", "step", "tokens_seen", "layer", "value"]], df, "step", "layer")


def trajectory(records, site: str = KEY_SITE, metric: str = KEY_METRIC, protocol=AUTO) -> pd.DataFrame:
    """Per (condition, step): mean, min, max and std across layers of the per-layer means.

    Columns: condition, step, tokens_seen, mean, min, max, std (std is 0 for one layer).
    """
    lm = layer_means(records, site, metric, protocol)
    out = (lm.groupby(["condition", "step"], sort=False)
             .agg(tokens_seen=("tokens_seen", "first"), mean=("value", "mean"),
                  min=("value", "min"), max=("value", "max"), std=("value", lambda v: v.std(ddof=0)))
             .reset_index())
    return _in_condition_order(out, lm, "step")


def summary_table(records, site: str = KEY_SITE, metric: str = KEY_METRIC, protocol=AUTO) -> pd.DataFrame:
    """The demo's headline table, one row per condition (the key-rank study).

    ``initial``/``min``/``final``: whole-model mean (over layers of head means) at the first
    step, its minimum over steps (with ``min_step``), and at the last step. ``collapsed_layer``:
    the layer whose final per-layer mean dropped most relative to its initial value, with its
    ``collapsed_initial``/``collapsed_final``. ``train_loss``/``eval_loss``: last value of the
    ``site="loss"`` records of those names, when present (losses are read whatever their protocol).
    """
    df = to_frame(records)
    protocol = resolve_protocol(df, site, metric, protocol)  # once, so both tables read the same group
    traj = trajectory(df, site, metric, protocol)
    lm = layer_means(df, site, metric, protocol)
    rows = []
    for cond, t in traj.groupby("condition", sort=False):
        t = t.sort_values("step")
        finite = t["mean"].dropna()  # a diverged condition (NaN ranks throughout) has no minimum
        i_min = finite.idxmin() if len(finite) else None
        layers = lm[lm["condition"] == cond]
        first = layers[layers["step"] == t["step"].iloc[0]].set_index("layer")["value"]
        last = layers[layers["step"] == t["step"].iloc[-1]].set_index("layer")["value"]
        drop = (last / first).dropna()
        worst = drop.idxmin() if len(drop) else None
        row = {
            "condition": cond,
            "initial": float(t["mean"].iloc[0]),
            "min": float("nan") if i_min is None else float(t.loc[i_min, "mean"]),
            "min_step": None if i_min is None else int(t.loc[i_min, "step"]),
            "final": float(t["mean"].iloc[-1]),
            "final_step": int(t["step"].iloc[-1]),
            "collapsed_layer": None if worst is None else int(worst),
            "collapsed_initial": None if worst is None else float(first[worst]),
            "collapsed_final": None if worst is None else float(last[worst]),
        }
        for loss in ("train_loss", "eval_loss"):
            sel = df[(df["condition"] == cond) & (df["site"] == "loss") & (df["metric"] == loss)]
            if not sel.empty:
                row[loss] = float(sel.sort_values("step")["value"].iloc[-1])
        rows.append(row)
    # nullable ints: a missing step/layer (a diverged condition) stays <NA> and the others stay ints
    return pd.DataFrame(rows).astype({"min_step": "Int64", "collapsed_layer": "Int64"})


def layer_table(records, site: str = KEY_SITE, metric: str = KEY_METRIC, which: str = "final",
                protocol=AUTO) -> pd.DataFrame:
    """Per-layer head means at the ``"initial"`` or ``"final"`` step: index layer (Int64), one
    column per condition."""
    if which not in ("initial", "final"):
        raise ValueError(f"which: expected 'initial' or 'final', got {which!r}")
    lm = layer_means(records, site, metric, protocol)
    pick = lm.groupby("condition")["step"].transform("min" if which == "initial" else "max")
    table = lm[lm["step"] == pick].pivot(index="layer", columns="condition", values="value")
    return table[list(dict.fromkeys(lm["condition"]))]  # run order, not alphabetical


def _span(layers: list[int]) -> str:
    """``[2]`` -> "2", ``[0, 1, 2]`` -> "0-2", ``[0, 2, 5]`` (layers missing between) -> "0,2,5"."""
    if len(layers) == 1:
        return str(layers[0])
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def layer_zones(records, site: str = KEY_SITE, metric: str = KEY_METRIC, n_zones: int = 3,
                protocol=AUTO) -> pd.DataFrame:
    """Layers split into ``n_zones`` contiguous depth zones (early / middle / late for 3).

    One row per (condition, zone): the zone's layers (``"2"``, ``"0-3"``), the mean over its
    layers at the initial and final step, and their ratio. With fewer layers than ``n_zones``
    every layer is its own zone (named as for that many zones: early / late for 2, all for 1).
    """
    n_zones = _args.integer("n_zones", n_zones, minimum=1)
    df = to_frame(records)
    protocol = resolve_protocol(df, site, metric, protocol)
    ini, fin = layer_table(df, site, metric, "initial", protocol), layer_table(df, site, metric, "final", protocol)
    layers = [int(i) for i in sorted(ini.index)]
    n_zones = min(n_zones, len(layers))  # never an empty zone
    names = {1: ["all"], 2: ["early", "late"], 3: ["early", "middle", "late"]}.get(
        n_zones, [f"zone{i}" for i in range(n_zones)])
    rows = []
    for cond in ini.columns:
        for name, chunk in zip(names, np.array_split(np.asarray(layers), n_zones)):
            chunk = chunk.tolist()
            a, b = float(ini.loc[chunk, cond].mean()), float(fin.loc[chunk, cond].mean())
            rows.append({"condition": cond, "zone": name, "layers": _span(chunk),
                         "initial": a, "final": b, "ratio": b / a})
    return pd.DataFrame(rows)


def _mean_interval(units: pd.Series, level: float) -> dict:
    """Mean of the finite ``units`` (one per layer), its standard error (std with ddof=1 over
    √n) and the two-sided ``level`` Student-t interval (n − 1 degrees of freedom) as
    ``{mean, se, ci_low, ci_high, n_layers}``; se and interval NaN below 2 units, all NaN with none."""
    from scipy import stats

    d = units.dropna().to_numpy(dtype=float)
    d = d[np.isfinite(d)]
    n = len(d)
    mean = float(np.mean(d)) if n else float("nan")
    se = float(np.std(d, ddof=1) / np.sqrt(n)) if n >= 2 else float("nan")
    hw = float(stats.t.ppf((1 + level) / 2, n - 1) * se) if n >= 2 else float("nan")
    return {"mean": mean, "se": se, "ci_low": mean - hw, "ci_high": mean + hw, "n_layers": n}


def _per_layer_changes(lm: pd.DataFrame) -> dict[str, tuple[int, int, pd.Series, pd.Series]]:
    """Per condition: its first and last probe steps and the per-layer values there."""
    out = {}
    for cond, g in lm.groupby("condition", sort=False):
        first, last = g["step"].min(), g["step"].max()
        by_step = g.set_index("layer").groupby(g["step"].to_numpy())["value"]
        out[cond] = (int(first), int(last), by_step.get_group(first), by_step.get_group(last))
    return out


def layer_changes(records, site: str = KEY_SITE, metric: str = KEY_METRIC, protocol=AUTO,
                  level: float = 0.95) -> pd.DataFrame:
    """Each condition's change from its own first probe to its last, with its uncertainty over layers.

    The units are the layers: a layer's change is ``final_l − initial_l`` of its head mean at the
    condition's last and first probe; ``change`` is their mean over the ``n_layers`` layers finite
    at both probes (the whole-model ``final − initial`` when every layer is), ``se`` their standard
    error (std with ddof=1 over √L) and ``ci_low``/``ci_high`` the two-sided ``level`` interval
    ``change ± t·se`` (Student's t with L − 1 degrees of freedom). The spread is that of the
    layers' changes: how consistently the layers moved, not seed-to-seed noise. ``se`` and the
    interval are NaN with fewer than 2 layers.

    Columns: condition, initial_step, final_step, initial, final (whole-model means: mean over
    layers at the first/last probe), change, se, ci_low, ci_high, n_layers.
    """
    level = _args.real("level", level, "a level in (0, 1)", lambda c: 0 < c < 1)
    lm = layer_means(records, site, metric, protocol)
    rows = []
    for cond, (first, last, a, b) in _per_layer_changes(lm).items():
        m = _mean_interval(b - a, level)
        rows.append({"condition": cond, "initial_step": first, "final_step": last,
                     "initial": float(a.mean()) if len(a) else float("nan"),
                     "final": float(b.mean()) if len(b) else float("nan"),
                     "change": m.pop("mean"), **m})
    return pd.DataFrame(rows, columns=["condition", "initial_step", "final_step", "initial", "final", "change",
                                       "se", "ci_low", "ci_high", "n_layers"])


def compare_changes(records, site: str = KEY_SITE, metric: str = KEY_METRIC, reference: str | None = None,
                    protocol=AUTO, level: float = 0.95) -> pd.DataFrame:
    """Each condition compared with ``reference`` (default: the first condition in run order) by
    its change from its own first probe (:func:`layer_changes`), not by its final value.

    Paired by layer (conditions of one study share layer indices, seed and data): per layer
    ``diff_l = change_l(condition) − change_l(reference)`` over the layers finite in both;
    ``diff`` is their mean, ``se`` their standard error (std with ddof=1 over √L) and
    ``ci_low``/``ci_high`` the two-sided ``level`` Student-t interval (L − 1 degrees of freedom;
    NaN with fewer than 2 layers). ``initial_gap``/``final_gap``: the whole-model difference
    (condition − reference) at the first and at the last probe, so that ``final_gap =
    initial_gap + diff`` when every layer is finite; ``share_at_start = initial_gap / final_gap``
    is how much of the final gap was there before training (NaN when the final gap is 0).

    Columns: condition, reference, initial_gap, final_gap, share_at_start, diff, se, ci_low,
    ci_high, n_layers. No rows with a single condition.
    """
    level = _args.real("level", level, "a level in (0, 1)", lambda c: 0 < c < 1)
    lm = layer_means(records, site, metric, protocol)
    per = _per_layer_changes(lm)
    if reference is None:
        reference = next(iter(per), None)
    elif reference not in per:
        raise ValueError(f"reference: {reference!r} not in records ({list(per)})")
    rows = []
    for cond, (_, _, a, b) in per.items():
        if cond == reference:
            continue
        ra, rb = per[reference][2], per[reference][3]
        m = _mean_interval((b - a) - (rb - ra), level)
        initial_gap, final_gap = float(a.mean() - ra.mean()), float(b.mean() - rb.mean())
        share = initial_gap / final_gap if final_gap != 0 and np.isfinite(final_gap) else float("nan")
        rows.append({"condition": cond, "reference": reference, "initial_gap": initial_gap, "final_gap": final_gap,
                     "share_at_start": share, "diff": m.pop("mean"), **m})
    return pd.DataFrame(rows, columns=["condition", "reference", "initial_gap", "final_gap", "share_at_start",
                                       "diff", "se", "ci_low", "ci_high", "n_layers"])


def _per_width_layers(df: pd.DataFrame, metric: str, site: str, width_col: str, step,
                      protocol=AUTO) -> dict[float, np.ndarray]:
    sel = _select(df, site, metric, protocol)
    if step == "final":
        sel = sel[sel["step"] == sel.groupby(width_col)["step"].transform("max")]
    elif step is not None:
        sel = sel[sel["step"] == step]
    per_layer = sel.groupby([width_col, "layer"], dropna=False)["value"].mean()
    out = {float(w): g.to_numpy() for w, g in per_layer.groupby(level=0)}
    if len(out) < 2:
        raise ValueError(f"{width_col}: a width fit needs records of at least 2 widths, got {len(out)}")
    return out


def width_fits(records, metrics=("participation_ratio", "entropy_rank"), *, site: str = "ffn",
               width_col: str = "width", step="final", n_boot: int = 1000, ci: float = 0.95,
               seed: int = 0, protocol=AUTO) -> pd.DataFrame:
    """Power-law fits of layer-median ``metric`` vs width across a width sweep (docs/fits.md).

    ``records`` must carry a ``width_col`` column (the FFN width D of the model each record
    came from). Per width the per-layer value (mean over heads, if any) is reduced to the
    median over layers; ``log median = β log D + c`` is fitted with :func:`fastspec.fit_power_law`.
    The CI on β is a percentile bootstrap over layers: each replicate resamples every width's
    layers with replacement and refits. ``step``: ``"final"`` (each width's last step), an int,
    or None (all steps pooled). ``protocol``: which records (module docstring), per metric.

    Returns one row per metric: metric, beta, intercept, r2, stderr, ci_low, ci_high, n_widths,
    widths, medians.
    """
    df = to_frame(records)
    if width_col not in df.columns:
        raise ValueError(f"width_col: records have no {width_col!r} column")
    ci = _args.real("ci", ci, "a level in (0, 1)", lambda c: 0 < c < 1)
    if isinstance(metrics, str):
        metrics = (metrics,)
    rng = np.random.default_rng(seed)
    rows = []
    for metric in metrics:
        per = _per_width_layers(df, metric, site, width_col, step, protocol)
        widths = np.array(sorted(per))
        medians = np.array([np.median(per[w]) for w in widths])
        fit = fit_power_law(widths, medians)
        betas = np.empty(n_boot)
        for b in range(n_boot):
            boot = [np.median(rng.choice(per[w], size=len(per[w]), replace=True)) for w in widths]
            betas[b] = fit_power_law(widths, boot).beta
        lo, hi = np.quantile(betas, [(1 - ci) / 2, (1 + ci) / 2]) if n_boot else (np.nan, np.nan)
        rows.append({"metric": metric, "beta": fit.beta, "intercept": fit.intercept, "r2": fit.r2,
                     "stderr": fit.stderr, "ci_low": float(lo), "ci_high": float(hi),
                     "n_widths": len(widths), "widths": widths.tolist(), "medians": medians.tolist()})
    return pd.DataFrame(rows)


def utilization_slopes(records, *, site: str = "ffn", width_col: str = "width", **kwargs) -> pd.DataFrame:
    """Width fits of the utilization-type metrics present (``utilization = PR/D`` and the
    normalized hard/soft ranks): β < 0 means wider layers use a smaller share of their width.
    For ``utilization`` β equals the hard-rank β minus 1 on the same data (PR = D·utilization)."""
    df = to_frame(records)
    present = [m for m in ("utilization", "hard_rank_normalized", "soft_rank_normalized")
               if ((df["site"] == site) & (df["metric"] == m)).any()]
    if not present:
        raise ValueError(f"records: no utilization metrics for site {site!r}")
    return width_fits(df, present, site=site, width_col=width_col, **kwargs)


def tail_fits(spectra, start: int | None = None, stop: int | None = None) -> pd.DataFrame:
    """Tail index ``a`` of ``λ_k ∝ k^(−a)`` and ``λ_max`` for each spectrum (docs/fits.md).

    ``spectra``: a mapping name -> 1-D spectrum, or an array/tensor ``[..., D]`` (each leading
    index is one spectrum, named by its index tuple). Window as in :func:`fastspec.tail_index`.
    Columns: name, D, lambda_max, a, r2, stderr, start, stop.
    """
    if isinstance(spectra, Mapping):
        items = list(spectra.items())
    else:
        try:
            import torch
            if isinstance(spectra, torch.Tensor):
                spectra = spectra.detach().double().cpu().numpy()
        except ImportError:
            pass
        arr = np.asarray(spectra, dtype=float)
        if arr.ndim == 0:
            raise ValueError("spectra: expected [..., D] or a mapping of 1-D spectra, got a scalar")
        flat = arr.reshape(-1, arr.shape[-1])
        idx = list(np.ndindex(arr.shape[:-1])) or [()]
        items = [(i if len(i) != 1 else i[0], flat[k]) for k, i in enumerate(idx)]
    rows = []
    for name, v in items:
        fit = tail_index(v, start, stop)
        v = np.asarray(v.detach().cpu().double() if hasattr(v, "detach") else v, dtype=float)
        rows.append({"name": name, "D": len(v), "lambda_max": float(np.max(v)), "a": fit.a,
                     "r2": fit.r2, "stderr": fit.stderr, "start": fit.start, "stop": fit.stop})
    return pd.DataFrame(rows)
