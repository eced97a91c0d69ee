"""The report of a ``fastspec analyze`` output folder: findings, per-layer tables, plots, report.md.

The folder (written by :mod:`fastspec.checkpoints.run`):

    config.json        ``{"command": "analyze", "status", "settings", "models": [{label, condition,
                       step, model_type, num_layers, num_heads, num_kv_heads, head_dim, d_ff, sites,
                       done, times}, ...]}``
    records.parquet    one row per record (``records.csv`` when pyarrow is absent): the
                       :class:`fastspec.Record` fields + ``condition`` (the series, or the model's own
                       label when alone) + ``model`` (the checkpoint's label)
    spectra.npz        ``"<label>/<site>/layer<l>"``: per-head singular values ``[heads, D]`` (keys,
                       keys_prerope, queries) or FFN eigenvalues ``[d_ff]`` (not read here: the
                       records carry every number the report states)

and what :func:`write_report` adds: ``report.md`` and ``plots/*.png``.

A *model* is one label (one checkpoint); a *series* is a condition with checkpoints at two or more
steps. The report describes each model that stands alone, and the first and last checkpoint of
each series (so a series of 100 checkpoints gives two tables and two heatmaps, not a hundred);
the series' own section follows every layer from its first checkpoint to its last.

The quantities (records of one protocol, :mod:`fastspec.analysis`):

* **rank@90** of a head: the smallest k whose top-k share of the variance (σ² of the singular
  values of the head's keys) reaches 90%; a layer's value is the mean over its heads, stated as a
  share of d_head (``5.50/8 (69%)``). Post-RoPE keys (``keys``, per KV head) are what attention
  reads; pre-RoPE keys (``keys_prerope``) are the projection's output before the rotation, so
  post − pre is what RoPE does to the rank.
* **PR** (participation ratio, ``(Σv)² / Σv²`` of the spectrum): keys in the sv convention (σ),
  FFN in the eig convention (λ of the down-projection input's covariance), the latter stated as a
  share of d_ff.
* **γ CV**: the coefficient of variation over d_head of a Q/K-norm's learned scale (per layer).
* **key rank collapse** (series only): a layer whose layer-mean post-RoPE rank@90 falls below
  :data:`COLLAPSE_HALF` of its value at the series' first checkpoint, or below
  :data:`COLLAPSE_FLOOR` of d_head when it started at or above that floor; the step reported is
  the first checkpoint where either holds.

This module does not import :mod:`fastspec.report`: that one delegates an analyze folder's
report (and reading a parquet/csv records table) to this one, and the package has no import cycles.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._run_folder import load_config  # the demo report's reader too

__all__ = ["COLLAPSE_FLOOR", "COLLAPSE_HALF", "RECORDS_TABLES", "Findings", "Section", "findings", "load_records",
           "read_records_table", "write_report"]

#: the records tables an analyze folder holds, in the order they are looked for
RECORDS_TABLES = ("records.parquet", "records.csv")
#: a layer's key rank collapses below this share of its first checkpoint's value ...
COLLAPSE_HALF = 0.5
#: ... or below this share of d_head (when it started at or above it)
COLLAPSE_FLOOR = 0.25
#: how many of the lowest-rank key heads are named per model
N_LOWEST = 5
# the phases of a model's time in config.json, in the order they run
_PHASES = ("load", "tokenize", "forward", "probe", "solve", "write")
_KEY_SITES = ("keys", "keys_prerope", "queries")
# series changes: (site, metric, name), in the order of the series table
_SERIES_QUANTITIES = (("keys", "rank_at_90", "key rank@90 (post-RoPE)"),
                      ("keys_prerope", "rank_at_90", "key rank@90 (pre-RoPE)"),
                      ("keys", "participation_ratio", "key PR (post-RoPE)"),
                      ("queries", "rank_at_90", "query rank@90"),
                      ("ffn", "participation_ratio", "FFN PR"),
                      ("gamma_k", "gamma_cv", "γ_k CV"),
                      ("gamma_q", "gamma_cv", "γ_q CV"))
_PARTIAL = {"running": "the run is still running", "interrupted": "the run was interrupted",
            "failed": "the run failed"}


# ----------------------------------------------------------------------------------------- reading
def read_records_table(path):
    """One records table (``.parquet`` or ``.csv``) as a DataFrame (:func:`fastspec.analysis.to_frame`:
    the record schema, plus ``condition`` and ``model`` as strings)."""
    import pandas as pd

    from .. import analysis

    path = Path(path)
    if path.suffix not in (".parquet", ".csv"):
        raise ValueError(f"records: expected a .parquet or .csv file, got {path}")
    try:
        if path.suffix == ".parquet":
            df = pd.read_parquet(path)
        else:  # labels such as "200" must stay strings, not become ints
            df = pd.read_csv(path, dtype={"condition": str, "model": str, "site": str, "metric": str,
                                          "protocol": str})
    except ImportError:  # pandas says which engine it lacks, over several lines
        raise ValueError(f"records: reading {path} needs pyarrow (pip install pyarrow)") from None
    except (OSError, ValueError) as e:  # a torn or foreign file: name it, in one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"records: cannot read {path} ({reason})") from None
    df = analysis.to_frame(df)
    if "model" in df.columns:
        df["model"] = df["model"].astype(object).where(df["model"].notna(), None)
    return df


def load_records(out_dir):
    """The records of an analyze folder: ``records.parquet``, else ``records.csv``
    (:func:`read_records_table`)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"out_dir: {out_dir} is not a folder")
    for name in RECORDS_TABLES:
        if (out_dir / name).is_file():
            return read_records_table(out_dir / name)
    raise FileNotFoundError(f"out_dir: no {' or '.join(RECORDS_TABLES)} in {out_dir}")


# -------------------------------------------------------------------------------------- formatting
def _n(v, digits: int = 2) -> str:
    """``v`` with ``digits`` decimals (2: ranks and PRs; 3: γ CV, a few hundredths); "–" when not finite."""
    if v is None or not math.isfinite(float(v)):
        return "–"
    return f"{v:.{digits}f}" if abs(v) < 1e4 else f"{v:.4g}"


def _signed(v: float, digits: int = 2) -> str:
    """``v`` with its sign and a real minus; one that rounds to zero reads "0.00"."""
    if not math.isfinite(v):
        return "–"
    if round(abs(v), digits) == 0:
        return _n(0.0, digits)
    return ("+" if v > 0 else "−") + _n(abs(v), digits)


def _rel(a: float, b: float) -> str:
    """The relative change a → b in percent ("−71.4%"), "" when a is 0 or either is not finite."""
    if not (math.isfinite(a) and math.isfinite(b)) or a == 0:
        return ""
    x = 100 * (b / a - 1)
    return "0.0%" if round(abs(x), 1) == 0 else f"{x:+.1f}%".replace("-", "−")


def _of(v: float, D: int | None) -> str:
    """A rank as a share of its ceiling: ``5.50/8 (69%)``; the value alone when D is unknown."""
    if D is None or not math.isfinite(v):
        return _n(v)
    return f"{_n(v)}/{D} ({100 * v / D:.0f}%)"


def _span(layers) -> str:
    layers = [int(l) for l in layers]
    if len(layers) == 1:
        return str(layers[0])
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(map(str, layers))


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # a label with a bar in it would split its row
    return "\n".join(out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows])


# --------------------------------------------------------------------------------------- the data
class _Data:
    """The records of an analyze folder by model (label), with each model's dimensions."""

    def __init__(self, records, config: dict | None):
        import pandas as pd

        from .. import analysis

        self.config = config or {}
        df = analysis.to_frame(records)
        if "model" not in df.columns:  # records of another writer: a model is a (condition, step)
            df["model"] = None
        fallback = df["condition"].astype(str) + "@" + df["step"].astype(str)
        df["model"] = df["model"].where(df["model"].notna(), fallback).astype(str)
        self.df = df
        entries = [m for m in self.config.get("models") or [] if isinstance(m, dict) and m.get("label") is not None]
        self.entries = {str(m["label"]): m for m in entries}
        have = list(dict.fromkeys(df["model"]))
        self.labels = [l for l in self.entries if l in set(have)] + [l for l in have if l not in self.entries]
        first = df.drop_duplicates("model").set_index("model")
        self.condition = {l: str(first.at[l, "condition"]) for l in self.labels}
        # a record without a step (None) is a model without one: step 0, as the run writes it
        self.step = {l: 0 if pd.isna(first.at[l, "step"]) else int(first.at[l, "step"]) for l in self.labels}
        self.conditions: dict[str, list[str]] = {}
        for l in self.labels:
            self.conditions.setdefault(self.condition[l], []).append(l)
        for ls in self.conditions.values():
            ls.sort(key=self.step.get)
        self._series = {c: ls for c, ls in self.conditions.items() if len({self.step[l] for l in ls}) >= 2}
        self._sel, self._layers, self._dims = {}, {}, {}

    def series(self) -> dict[str, list[str]]:
        """{condition: its labels in step order} of the conditions with checkpoints at two or more steps."""
        return self._series

    def described(self) -> list[str]:
        """The models described one by one: each standalone model, the first and last of each series."""
        out = []
        for c, ls in self.conditions.items():
            out += [ls[0], ls[-1]] if c in self._series else ls
        return out

    def finals(self) -> list[str]:
        """Each standalone model and the last checkpoint of each series."""
        out = []
        for c, ls in self.conditions.items():
            out += [ls[-1]] if c in self._series else ls
        return out

    def sel(self, site: str, metric: str):
        """The records of ``site``/``metric`` of one protocol (eval when there are any), or None."""
        from .. import analysis

        key = (site, metric)
        if key not in self._sel:
            df = self.df
            have = ((df["site"] == site) & (df["metric"] == metric)).any()
            sel = analysis._select(df, site, metric) if have else None
            self._sel[key] = None if sel is None else sel[sel["layer"].notna()]
        return self._sel[key]

    def layers(self, site: str, metric: str, label: str):
        """Per-layer values of one model (mean over its finite heads), a Series indexed by layer;
        layers without a finite value (a diverged model) are left out; empty when none."""
        import pandas as pd

        key = (site, metric)
        if key not in self._layers:
            sel = self.sel(site, metric)
            sel = None if sel is None else sel[np.isfinite(sel["value"])]
            self._layers[key] = ({} if sel is None else
                                 {m: g.groupby(g["layer"].astype(int))["value"].mean().sort_index()
                                  for m, g in sel.groupby("model", sort=False)})
        return self._layers[key].get(label, pd.Series(dtype=float))

    def heads(self, site: str, label: str, metrics=("rank_at_90", "participation_ratio")):
        """One model's per-head values of ``site``: columns layer, head, and one per metric present."""
        import pandas as pd

        out = None
        for metric in metrics:
            sel = self.sel(site, metric)
            if sel is None:
                continue
            g = sel[(sel["model"] == label) & sel["head_index"].notna()]
            if g.empty:
                continue
            g = g.groupby([g["layer"].astype(int).rename("layer"), g["head_index"].astype(int).rename("head")])[
                "value"].mean().rename(metric).reset_index()
            out = g if out is None else out.merge(g, on=["layer", "head"], how="outer")
        return out if out is not None else pd.DataFrame(columns=["layer", "head"])

    def dim(self, label: str, site: str) -> int | None:
        """d_head (attention sites) or d_ff (ffn) of a model: its config entry's, else from its
        records (``PR + ghost_dims``, the probe's ``ghost_dims = D − PR``)."""
        entry = self.entries.get(label, {})
        name = "d_ff" if site == "ffn" else "head_dim"
        if entry.get(name):
            return int(entry[name])
        if (label, site) not in self._dims:
            D = None
            pr, ghost = self.sel(site, "participation_ratio"), self.sel(site, "ghost_dims")
            if pr is not None and ghost is not None:
                keys = ["layer", "head_index"]
                a = pr[pr["model"] == label][keys + ["value"]]
                b = ghost[ghost["model"] == label][keys + ["value"]]
                both = a.merge(b, on=keys, suffixes=("", "_g"))
                dims = set(np.round((both["value"] + both["value_g"]).dropna()).astype(int).tolist())
                D = dims.pop() if len(dims) == 1 else None
            self._dims[(label, site)] = D
        return self._dims[(label, site)]

    def missing(self) -> list[str]:
        """Models in config.json that are not finished or have no records."""
        have = set(self.labels)
        return [l for l, m in self.entries.items() if not m.get("done") or l not in have]


# ------------------------------------------------------------------------------------- findings
@dataclass
class Section:
    """One part of the findings: a ``title``, an ``intro`` saying what its numbers mean, its
    ``sentences`` (one per model or series) and Markdown ``tables``."""

    title: str
    intro: str
    sentences: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"### {self.title}", "", self.intro, ""]
        out += [f"- {s}" for s in self.sentences] + ([""] if self.sentences else [])
        for t in self.tables:
            out += [t, ""]
        return "\n".join(out)


@dataclass
class Findings:
    """What an analyze folder shows, computed from its records by :func:`findings`.

    ``sections``: the :class:`Section` s that have data, in the order key rank@90 per layer
    (post- vs pre-RoPE), lowest-rank key heads, FFN PR by depth, one per series, Q/K-norm γ
    (a section whose records are absent is left out). ``partial``: a sentence when the run is not
    complete (its status, the models missing), else None. ``collapses``: one dict per layer of a
    series whose key rank collapses (keys: condition, layer, step and label of the first
    checkpoint where it holds, first_step, initial (the layer's rank@90 there), value (at step),
    final_step, final, D = d_head, reason "half" or "floor"). ``lowest_heads``: per described model its :data:`N_LOWEST`
    lowest-rank key heads (dicts layer, head, rank_at_90, participation_ratio)."""

    sections: list[Section] = field(default_factory=list)
    partial: str | None = None
    collapses: list[dict] = field(default_factory=list)
    lowest_heads: dict[str, list[dict]] = field(default_factory=dict)

    def section(self, title_start: str) -> Section | None:
        """The first section whose title starts with ``title_start``, or None."""
        return next((s for s in self.sections if s.title.startswith(title_start)), None)

    def lines(self) -> list[str]:
        """Every sentence (the partial-run note first), for a terminal."""
        return ([self.partial] if self.partial else []) + [s for sec in self.sections for s in sec.sentences]

    def markdown(self) -> str:
        """The report's "Findings" section."""
        out = ["## Findings", ""]
        out += [f"**Partial report**: {self.partial}", ""] if self.partial else []
        if not self.sections:
            out += ["No records to describe yet.", ""]
        return "\n".join(out + [s.markdown() for s in self.sections])


def _extreme_layers(s) -> tuple[int, int]:
    """The layers of the lowest and highest value (the shallower on ties)."""
    return int(s.idxmin()), int(s.idxmax())


def _key_rank_section(data: _Data) -> Section | None:
    intro = ("rank@90: the number of components holding 90% of a key head's variance (σ² of its singular "
             "values), mean over the layer's KV heads, as a share of d_head; post-RoPE keys, what attention reads.")
    prerope = data.sel("keys_prerope", "rank_at_90") is not None
    if prerope:
        intro += (" Pre-RoPE keys are the key projection's output before the rotation, so post − pre is what "
                  "RoPE does to the rank.")
    sec = Section("Key rank@90 per layer" + (" (post- vs pre-RoPE)" if prerope else " (post-RoPE)"), intro)
    for label in data.described():
        post = data.layers("keys", "rank_at_90", label)
        if post.empty:
            continue
        D = data.dim(label, "keys")
        lo, hi = _extreme_layers(post)
        s = (f"{label}: post-RoPE key rank@90 averages {_of(post.mean(), D)} over layers; lowest in layer {lo} at "
             f"{_of(post[lo], D)}, highest in layer {hi} at {_of(post[hi], D)}")
        pre = data.layers("keys_prerope", "rank_at_90", label)
        common = post.index.intersection(pre.index)
        if len(common):
            diff = (post[common] - pre[common]).round(9)  # rounding noise of equal means is no change
            s += f"; pre-RoPE averages {_of(pre[common].mean(), D)}."
            up, down = diff[diff > 0], diff[diff < 0]

            def say(l, pre=pre, post=post, diff=diff, D=D):
                return f"layer {l} ({_n(pre[l])} → {_n(post[l])} of {D or 'd_head'}, {_signed(diff[l])})"

            if len(up) == len(diff):
                s += f" RoPE raises the rank in every layer, most in {say(int(up.idxmax()))}."
            elif len(down) == len(diff):
                s += f" RoPE lowers the rank in every layer, most in {say(int(down.idxmin()))}."
            elif not len(up) and not len(down):
                s += " RoPE leaves the rank unchanged in every layer."
            else:
                parts = ([f"raises the rank most in {say(int(up.idxmax()))}"] if len(up) else []) + \
                        ([f"lowers it most in {say(int(down.idxmin()))}"] if len(down) else [])
                same = len(diff) - len(up) - len(down)
                s += " RoPE " + " and ".join(parts) + (f"; {same} layer{'s' if same > 1 else ''} unchanged." if same else ".")
        else:
            s += "."
            if "rotary" in _skipped(data, label, "keys_prerope"):  # e.g. BERT, GPT-2, OPT
                s += " This model has no rotary embedding: its keys are not rotated, pre- and post-RoPE are the same."
        sec.sentences.append(s)
    return sec if sec.sentences else None


def _skipped(data: _Data, label: str, site: str) -> str:
    """Why ``site`` was not measured for ``label`` (config.json's ``skipped_sites``), or ""."""
    for m in data.config.get("models") or []:
        if isinstance(m, dict) and m.get("label") == label:
            return str((m.get("skipped_sites") or {}).get(site, ""))
    return ""


def _lowest_heads_section(data: _Data, out: dict) -> Section | None:
    sec = Section("Lowest-rank key heads",
                  f"The {N_LOWEST} post-RoPE key heads (KV heads) of each model with the smallest rank@90 "
                  "(ties: the smaller PR first), with their participation ratio (sv convention).")
    for label in data.described():
        h = data.heads("keys", label)
        order = [c for c in ("rank_at_90", "participation_ratio") if c in h.columns]
        if h.empty or not order:
            continue
        h = h.sort_values(order + ["layer", "head"], kind="stable")
        low = h.head(N_LOWEST)
        D = data.dim(label, "keys")
        rows = [{"layer": int(r["layer"]), "head": int(r["head"]),
                 "rank_at_90": float(r["rank_at_90"]) if "rank_at_90" in h.columns else math.nan,
                 "participation_ratio": float(r["participation_ratio"]) if "participation_ratio" in h.columns
                 else math.nan} for _, r in low.iterrows()]
        out[label] = rows
        what = "; ".join(f"layer {r['layer']} head {r['head']}: rank@90 {_of(r['rank_at_90'], D)}, "
                         f"PR {_n(r['participation_ratio'])}" for r in rows)
        sec.sentences.append(f"{label} (lowest {len(rows)} of {len(h)} KV heads): {what}.")
    return sec if sec.sentences else None


def _zones(layers: list[int]) -> list[tuple[str, list[int]]]:
    """Layers split into first/middle/last third (fewer zones with fewer than 3 layers)."""
    n = min(3, len(layers))
    names = {1: ["all"], 2: ["early", "late"], 3: ["early", "middle", "late"]}[n]
    return [(name, chunk.tolist()) for name, chunk in zip(names, np.array_split(np.asarray(layers), n))]


def _ffn_section(data: _Data) -> Section | None:
    sec = Section("FFN participation ratio by depth",
                  "PR of the FFN down-projection input's covariance eigenvalues (eig convention), one per "
                  "layer, as a share of d_ff; the layers in thirds (early / middle / late), mean over each third.")
    for label in data.described():
        pr = data.layers("ffn", "participation_ratio", label)
        if pr.empty:
            continue
        D = data.dim(label, "ffn")

        def share(v, D=D):
            return f" ({100 * v / D:.1f}% of d_ff)" if D else ""

        zones = "; ".join(f"{name} ({'layer' if len(ls) == 1 else 'layers'} {_span(ls)}) PR {_n(pr[ls].mean())}"
                          f"{share(pr[ls].mean())}" for name, ls in _zones(list(pr.index)))
        lo, hi = _extreme_layers(pr)
        sec.sentences.append(f"{label}{f' (d_ff = {D})' if D else ''}: {zones}. Lowest in layer {lo} at "
                             f"{_n(pr[lo])}{share(pr[lo])}, highest in layer {hi} at {_n(pr[hi])}{share(pr[hi])}.")
    return sec if sec.sentences else None


def _collapses(data: _Data, cond: str, labels: list[str]) -> list[dict]:
    """The layers of a series whose key rank collapses (module docstring), each at its first step."""
    first = labels[0]
    v0 = data.layers("keys", "rank_at_90", first)
    D = data.dim(first, "keys")
    out = []
    for layer, a in v0.items():
        if not math.isfinite(a):
            continue
        for label in labels[1:]:
            s = data.layers("keys", "rank_at_90", label)
            if layer not in s.index or not math.isfinite(s[layer]):
                continue
            v = float(s[layer])
            half = v < COLLAPSE_HALF * a
            floor = D is not None and a >= COLLAPSE_FLOOR * D and v < COLLAPSE_FLOOR * D
            if half or floor:
                last = data.layers("keys", "rank_at_90", labels[-1])
                out.append({"condition": cond, "layer": int(layer), "step": data.step[label], "label": label,
                            "first_step": data.step[first], "initial": float(a), "value": v, "D": D,
                            "final_step": data.step[labels[-1]],
                            "final": float(last[layer]) if layer in last.index else math.nan,
                            "reason": "half" if half else "floor"})
                break
    return out


def _change(a: float, b: float, digits: int = 2) -> str:
    """``−5.00 (−71.4%)``: the change a → b and its relative size."""
    return _signed(b - a, digits) + (f" ({_rel(a, b)})" if _rel(a, b) else "")


def _series_section(data: _Data, cond: str, labels: list[str], collapses: list) -> Section | None:
    first, last = labels[0], labels[-1]
    a_step, b_step = data.step[first], data.step[last]
    sec = Section(f"Series {cond} (steps {a_step}–{b_step}, {len(labels)} checkpoints)",
                  f"Each quantity per layer (mean over heads) at the first checkpoint ({first}, step {a_step}) and "
                  f"the last ({last}, step {b_step}): the mean over layers, and the layer that changed most "
                  "(largest |last − first|).")
    rows, best = [], None
    for site, metric, name in _SERIES_QUANTITIES:
        a, b = data.layers(site, metric, first), data.layers(site, metric, last)
        common = a.index.intersection(b.index)
        if not len(common):
            continue
        a, b = a[common], b[common]
        change = (b - a).dropna()
        if change.empty:
            continue
        layer = int(change.abs().idxmax())
        k = 3 if metric == "gamma_cv" else 2
        rows.append([name, f"{_n(a.mean(), k)} → {_n(b.mean(), k)}", _change(a.mean(), b.mean(), k),
                     str(layer), f"{_n(a[layer], k)} → {_n(b[layer], k)}", _change(a[layer], b[layer], k)])
        # a relative change needs a non-zero start (γ CV of a frozen γ is 0 → 0) and some change
        rel = abs(b[layer] / a[layer] - 1) if a[layer] else None
        if rel and math.isfinite(rel) and (best is None or rel > best[0]):
            best = (rel, name, layer, a[layer], b[layer], k)
    if rows:
        sec.tables.append(_md_table(["quantity", "mean over layers, first → last", "change",
                                     "layer changed most", "its first → last", "its change"], rows))
    if best is not None:
        _, name, layer, a, b, k = best
        sec.sentences.append(f"Largest relative change of one layer between steps {a_step} and {b_step}: {name} in "
                             f"layer {layer}, {_n(a, k)} → {_n(b, k)} ({_signed(b - a, k)}, {_rel(a, b) or 'from 0'}).")
    if not data.layers("keys", "rank_at_90", first).empty:
        D = data.dim(first, "keys")
        rule = (f"layer-mean post-RoPE rank@90 below {COLLAPSE_HALF:.0%} of its value at step {a_step}, or below "
                f"{COLLAPSE_FLOOR:.0%} of d_head" + (f" ({_n(COLLAPSE_FLOOR * D)} of {D})" if D else "")
                + " having started above it")
        found = _collapses(data, cond, labels)
        collapses += found
        if found:
            for c in found:
                tail = (f"; at the last checkpoint (step {c['final_step']}) {_of(c['final'], D)}"
                        if c["final_step"] != c["step"] else "")
                sec.sentences.append(f"Key rank collapses in layer {c['layer']} at step {c['step']} ({c['label']}): "
                                     f"{_of(c['initial'], D)} at step {c['first_step']} → {_of(c['value'], D)}"
                                     f"{tail} (collapse: {rule}).")
        else:
            sec.sentences.append(f"No layer's key rank collapses between steps {a_step} and {b_step} "
                                 f"(collapse: {rule}).")
    return sec if sec.sentences or sec.tables else None


def _gamma_section(data: _Data) -> Section | None:
    sec = Section("Q/K-norm scale γ",
                  "Coefficient of variation over d_head of the learned Q/K-norm scale γ, per layer (0: a flat "
                  "scale that treats every key dimension alike).")
    for label in data.described():
        for site, name in (("gamma_k", "γ_k"), ("gamma_q", "γ_q")):
            cv = data.layers(site, "gamma_cv", label)
            if cv.empty:
                continue
            lo, hi = _extreme_layers(cv)
            spread = (f"{cv[lo]:.3f} in every layer" if f"{cv[lo]:.3f}" == f"{cv[hi]:.3f}" else
                      f"from {cv[lo]:.3f} in layer {lo} to {cv[hi]:.3f} in layer {hi}")
            sec.sentences.append(f"{label}: {name} CV averages {cv.mean():.3f} over layers, {spread}.")
    return sec if sec.sentences else None


def _partial(data: _Data) -> str | None:
    status = data.config.get("status")
    missing = data.missing()
    n = len(data.entries)
    if status in _PARTIAL or missing:
        what = _PARTIAL.get(status, f"the run's status is {status or 'unknown'}")
        done = f"{n - len(missing)} of {n} models measured" if n else f"{len(data.labels)} models measured"
        return f"{what}; {done}" + (f"; missing: {', '.join(missing)}." if missing else ".")
    return None


def findings(records, config: dict | None = None) -> Findings:
    """The findings of an analyze folder's records (``records``: anything
    :func:`fastspec.analysis.to_frame` takes, with a ``model`` column naming each checkpoint;
    ``config``: its config.json), every number computed from the records. See :class:`Findings`."""
    data = _Data(records, config)
    return _findings(data)


def _findings(data: _Data) -> Findings:
    f = Findings(partial=_partial(data))
    for sec in (_key_rank_section(data), _lowest_heads_section(data, f.lowest_heads), _ffn_section(data)):
        if sec is not None:
            f.sections.append(sec)
    for cond, labels in data.series().items():
        sec = _series_section(data, cond, labels, f.collapses)
        if sec is not None:
            f.sections.append(sec)
    gamma = _gamma_section(data)
    if gamma is not None:
        f.sections.append(gamma)
    return f


# ---------------------------------------------------------------------------------------- tables
def _layer_table(data: _Data, label: str) -> str | None:
    """One model's per-layer table: every quantity it has, a column each."""
    Dk, Df = data.dim(label, "keys"), data.dim(label, "ffn")
    get = {(site, metric): data.layers(site, metric, label) for site, metric in (
        ("keys", "rank_at_90"), ("keys_prerope", "rank_at_90"), ("keys", "participation_ratio"),
        ("queries", "rank_at_90"), ("ffn", "participation_ratio"), ("gamma_k", "gamma_cv"), ("gamma_q", "gamma_cv"))}
    post, pre, ffn = get["keys", "rank_at_90"], get["keys_prerope", "rank_at_90"], get["ffn", "participation_ratio"]
    layers = sorted({int(l) for s in get.values() for l in s.index})
    columns = {}  # header -> {layer: cell}

    def add(header: str, s, cell) -> None:
        if not s.empty:
            columns[header] = {l: cell(s[l]) if l in s.index else "–" for l in layers}

    add("key rank@90 post-RoPE", post, lambda v: _of(v, Dk))
    add("key rank@90 pre-RoPE", pre, lambda v: _of(v, Dk))
    if not post.empty and not pre.empty:
        add("RoPE: post − pre", (post - pre).dropna(), _signed)
    add("key PR", get["keys", "participation_ratio"], _n)
    add("query rank@90", get["queries", "rank_at_90"], lambda v: _of(v, data.dim(label, "queries")))
    add("FFN PR", ffn, _n)
    if Df:
        add("FFN PR / d_ff", ffn, lambda v: f"{100 * v / Df:.1f}%")
    add("γ_k CV", get["gamma_k", "gamma_cv"], lambda v: _n(v, 3))
    add("γ_q CV", get["gamma_q", "gamma_cv"], lambda v: _n(v, 3))
    if not columns:
        return None
    return _md_table(["layer", *columns], [[str(l)] + [c[l] for c in columns.values()] for l in layers])


def _models_table(data: _Data) -> str | None:
    entries = list(data.entries.values()) + [{"label": l} for l in data.labels if l not in data.entries]
    if not entries:
        return None
    phases = [p for p in _PHASES if any(p in (m.get("times") or {}) for m in entries)]
    phases += sorted({p for m in entries for p in (m.get("times") or {})} - set(phases))

    def get(m: dict, k: str) -> str:
        return "–" if m.get(k) is None else str(m[k])

    rows = []
    for m in entries:
        label = str(m["label"])
        heads = get(m, "num_heads")
        if m.get("num_kv_heads") not in (None, m.get("num_heads")):
            heads += f" (KV {m['num_kv_heads']})"
        times = m.get("times") or {}
        measured = label in data.labels and m.get("done", True)
        rows.append([label, get(m, "condition") if "condition" in m else data.condition.get(label, "–"),
                     get(m, "step") if m.get("step") is not None else str(data.step.get(label, "–")),
                     get(m, "model_type"), get(m, "num_layers"), heads, get(m, "head_dim"), get(m, "d_ff"),
                     "yes" if measured else "no"]
                    + [f"{times[p]:.2f}" if isinstance(times.get(p), (int, float)) else "–" for p in phases]
                    + ([f"{sum(v for v in times.values() if isinstance(v, (int, float))):.2f}"] if phases else []))
    header = ["model", "series", "step", "model_type", "layers", "heads", "head_dim", "d_ff", "measured"]
    return _md_table(header + [f"{p} s" for p in phases] + (["total s"] if phases else []), rows)


# ----------------------------------------------------------------------------------------- plots
def _slug(label: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "model"
    slug, i = base, 2
    while slug in taken:
        slug, i = f"{base}-{i}", i + 1
    taken.add(slug)
    return slug


def _plots(data: _Data, plot_dir: Path) -> list[tuple[str, str]]:
    """Render the figures the records support; returns [(title, path relative to the report)].

    Per described model a layer × head heatmap of key rank@90 / d_head (post-RoPE, and pre-RoPE
    beside it when measured); across the standalone models and each series' last checkpoint the
    per-layer key rank@90 / d_head (post solid, pre dashed) and FFN PR; per series the layer-mean
    trajectories over steps and a layer × step heatmap of each."""
    from .. import plots

    plot_dir.mkdir(exist_ok=True)
    made, taken = [], set()

    def emit(name: str, title: str, fig):
        plots.save(fig, plot_dir / f"{name}.png")
        made.append((title, f"{plot_dir.name}/{name}.png"))

    for label in data.described():
        panels = {}
        for site, name in (("keys", "post-RoPE keys"), ("keys_prerope", "pre-RoPE keys")):
            D = data.dim(label, site)
            h = data.heads(site, label, ("rank_at_90",))
            if D and not h.empty:
                panels[name] = h.pivot(index="layer", columns="head", values="rank_at_90") / D
        if panels:
            D = data.dim(label, "keys")
            emit(f"key_rank90_heads_{_slug(label, taken)}", f"{label}: key rank@90 / d_head per layer and KV head",
                 plots.layer_grid_heatmap(panels, label=f"key rank@90 / d_head (d_head = {D})", vmin=0.0, vmax=1.0,
                                          fmt="{:.0%}", title=f"{label}: key rank@90 per KV head"))
    finals = data.finals()
    keys = {}
    for label in finals:
        D = data.dim(label, "keys")
        per = {variant: data.layers(site, "rank_at_90", label) / D
               for site, variant in (("keys", "post-RoPE"), ("keys_prerope", "pre-RoPE"))
               if D and not data.layers(site, "rank_at_90", label).empty}
        if per:
            keys[label] = per
    if keys:
        both = any(len(per) > 1 for per in keys.values())
        emit("key_rank90_layers", "Key rank@90 / d_head per layer" + (", post- vs pre-RoPE" if both else " (post-RoPE)"),
             plots.layer_profile_plot(keys, ylabel="key rank@90 / d_head (mean over KV heads)", ceiling=1.0,
                                      ceiling_label="d_head",
                                      title="post-RoPE solid, pre-RoPE dashed" if both else "post-RoPE keys"))
    ffn = {label: {"FFN PR": data.layers("ffn", "participation_ratio", label)} for label in finals
           if not data.layers("ffn", "participation_ratio", label).empty}
    if ffn:
        emit("ffn_pr_layers", "FFN PR per layer (eig)",
             plots.layer_profile_plot(ffn, ylabel="FFN PR (eig)", title="FFN down-projection input"))
    series = data.series()
    if series:
        df = data.df[data.df["condition"].isin(list(series))]
        slugs = {cond: _slug(cond, taken) for cond in series}
        for site, metric, stem, what in (("keys", "rank_at_90", "key_rank90", "Key rank@90 (post-RoPE)"),
                                         ("ffn", "participation_ratio", "ffn_pr", "FFN PR")):
            if not ((df["site"] == site) & (df["metric"] == metric)).any():
                continue
            emit(f"series_{stem}_trajectory", f"{what} vs checkpoint step (mean over layers)",
                 plots.trajectory_plot(df, site, metric, x="step"))
            for cond, labels in series.items():
                grid = _layer_step_grid(data, site, metric, labels)
                if grid is None:
                    continue
                if site == "keys":  # a share of d_head on a fixed 0–1 scale, as the per-head heatmaps
                    D = data.dim(labels[0], "keys")
                    if not D:
                        continue
                    fig = plots.layer_grid_heatmap({cond: grid / D}, label=f"key rank@90 / d_head (d_head = {D})",
                                                   xlabel="step", vmin=0.0, vmax=1.0, fmt="{:.0%}",
                                                   title="key rank@90 per layer (mean over KV heads)")
                else:
                    fig = plots.layer_grid_heatmap({cond: grid}, label="FFN PR (eig)", xlabel="step", fmt="{:.1f}",
                                                   title="FFN PR per layer")
                emit(f"series_{slugs[cond]}_{stem}_heatmap", f"{cond}: {what}, layer × step", fig)
    return made


def _layer_step_grid(data: _Data, site: str, metric: str, labels: list[str]):
    """A series' per-layer values (mean over heads) as a DataFrame layer × step, or None without any."""
    import pandas as pd

    cols = {data.step[l]: data.layers(site, metric, l) for l in labels}
    cols = {s: v for s, v in cols.items() if not v.empty}
    return pd.DataFrame(cols) if cols else None


# ---------------------------------------------------------------------------------------- report
def write_report(out_dir) -> Path:
    """(Re)generate ``plots/*.png`` and ``report.md`` of an analyze folder; returns the report's path.

    report.md: the title, the status (and which models are missing when the run is partial), the
    settings, the models table (architecture and the seconds of each phase), the
    :func:`findings`, a per-layer table for each described model and the plots."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"out_dir: {out_dir} is not a folder")
    config = load_config(out_dir)
    data = _Data(load_records(out_dir), config)
    found = _findings(data)
    lines = ["# fastspec analyze report", "",
             (f"Status: **{config.get('status', 'unknown')}**. Models measured: {len(data.labels)}. "
              f"Records: {len(data.df)}."), ""]
    settings = config.get("settings") or {}
    if settings:
        text = settings.get("text")
        rest = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "text")
        lines += [f"Settings: {rest}." + (f" Text: {text}." if text else ""), ""]
    table = _models_table(data)
    if table:
        lines += ["## Models", "", table, "", ("Times in seconds per phase: load (from_pretrained), tokenize, "
                                               "forward (the model's own forward), probe (the captures' work), solve "
                                               "(the eigensolves), write."), ""]
    lines += [found.markdown()]
    tables = [(label, _layer_table(data, label)) for label in data.described()]
    tables = [(label, t) for label, t in tables if t]
    if tables:
        lines += ["## Per-layer tables", "",
                  ("Mean over heads per layer; a rank as rank/d_head (share). Each standalone model, and the "
                   "first and last checkpoint of each series."), ""]
        series = data.series()
        for label, t in tables:
            where = f" (series {data.condition[label]}, step {data.step[label]})" if data.condition[label] in series else ""
            lines += [f"### {label}{where}", "", t, ""]
    made = _plots(data, out_dir / "plots")
    if made:
        lines += ["## Plots", ""] + [f"### {title}\n\n![{title}]({path})\n" for title, path in made]
    out = out_dir / "report.md"
    out.write_text("\n".join(lines))
    return out
