"""Figures of probe records (matplotlib; each function returns a ``matplotlib.figure.Figure``).

Figures are built with the object API (``Figure()``, no pyplot), so nothing here touches the
global backend or leaks open figures; save with ``fig.savefig("x.png")``. Inputs are records
as accepted by :func:`fastspec.analysis.to_frame`, or tables from :mod:`fastspec.analysis`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _args, analysis

__all__ = [
    "trajectory_plot",
    "layer_heatmap",
    "layer_bars",
    "width_fit_plot",
    "spectrum_plot",
    "cumulative_variance_plot",
    "layer_grid_heatmap",
    "layer_profile_plot",
    "save",
]


def _figure(w: float = 6.4, h: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


def _label(site: str, metric: str) -> str:
    return f"{site} {metric.replace('_', ' ')}"


def _ceiling(df, site: str, metric: str, protocol, ceiling) -> float | None:
    """The ceiling D to draw: ``ceiling`` if a number, None if None, else (``"auto"``) the width of
    ``site``'s spectra from the records (:func:`fastspec.analysis.site_dimension`) for bounded metrics."""
    if ceiling is None or (ceiling == "auto" and metric not in analysis.BOUNDED):
        return None
    if ceiling == "auto":
        return analysis.site_dimension(df, site, protocol)
    return _args.real("ceiling", ceiling, "'auto', None or a positive number", lambda v: v > 0)


def _draw_ceiling(ax, D: float | None, top: float, site: str) -> None:
    """A dashed line at the ceiling D (``gid="ceiling"``); when D is over 4× the largest value
    (FFN PR ~4 under d_ff = 192) only a legend entry saying so, since the line would flatten the data."""
    if D is None:
        return
    name = analysis.dimension_name(site)
    if np.isfinite(top) and D > 4 * top:
        ax.plot([], [], ls="none", label=f"ceiling {name} = {D:g} (off scale)", gid="ceiling")
    else:
        ax.axhline(D, ls="--", lw=1, color="0.3", label=f"ceiling {name} = {D:g}", gid="ceiling")


# per condition a line style and a marker of its own (cycled), so that two conditions with the same
# values stay visible one over the other: solid/filled circles, dashed/open squares, dotted/open triangles...
_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P"))


def _style(i: int) -> dict:
    """Line style, marker and marker fill of the ``i``-th condition (the first filled, the rest
    open, so that a marker drawn over another leaves it visible)."""
    ls, marker = _STYLES[i % len(_STYLES)]
    return {"ls": ls, "marker": marker, "mfc": None if i == 0 else "none", "ms": 4 if i == 0 else 6}


def _per_head(df, site: str, metric: str, protocol) -> str:
    """How a per-layer value was formed: "mean over heads" for per-head sites, nothing for FFN."""
    heads = analysis._select(df, site, metric, protocol)["head_index"].notna().any()
    return " (mean over heads)" if heads else ""


def trajectory_plot(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                    x: str = "tokens_seen", protocol="auto", ceiling="auto"):
    """Whole-model mean of ``metric`` vs ``x`` (``"tokens_seen"`` or ``"step"``), one line per
    condition, shaded between the lowest and highest layer. Each condition has its own line style
    and marker (solid/filled circles, dashed/open squares, dotted/open triangles, ...), so lines
    that coincide stay visible. ``protocol``: which records
    (:mod:`fastspec.analysis`). ``ceiling``: the dashed line at D (``"auto"``: the spectrum width
    for PR-like metrics, from the records), a number, or None."""
    if x not in ("tokens_seen", "step"):
        raise ValueError(f"x: expected 'tokens_seen' or 'step', got {x!r}")
    df = analysis.to_frame(records)
    protocol = analysis.resolve_protocol(df, site, metric, protocol)
    traj = analysis.trajectory(df, site, metric, protocol)
    if x == "tokens_seen" and traj["tokens_seen"].isna().any():
        x = "step"
    fig = _figure()
    ax = fig.add_subplot()
    for i, (cond, t) in enumerate(traj.groupby("condition", sort=False)):
        t = t.sort_values("step")
        xs = t[x].to_numpy(dtype=float)
        (line,) = ax.plot(xs, t["mean"], lw=1.5, label=cond or "run", zorder=3 + i, **_style(i))
        ax.fill_between(xs, t["min"], t["max"], color=line.get_color(), alpha=0.12, lw=0, zorder=1)
    _draw_ceiling(ax, _ceiling(df, site, metric, protocol, ceiling), traj["max"].max(), site)
    ax.set_xlabel("tokens seen" if x == "tokens_seen" else "step")
    ax.set_ylabel(_label(site, metric))
    heads = "heads, then " if _per_head(df, site, metric, protocol) else ""
    ax.set_title(f"mean over {heads}layers; band: lowest to highest layer")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _edges(centres) -> np.ndarray:
    """Cell edges around sorted centres: the midpoints, the outer cells as wide as their
    neighbours (±0.5 around a single centre)."""
    c = np.asarray(centres, dtype=float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.r_[2 * c[0] - mid[0], mid, 2 * c[-1] - mid[-1]]


def _integer_ticks(axis, values, most: int = 7) -> None:
    """Regular integer ticks at the cells' values: every value when at most ``most`` (or 12
    consecutive integers, e.g. layers), every k-th of evenly spaced values for k in 1, 2, 5, 10, 20, ...
    (steps 0, 10, ..., 120 -> 0, 20, ..., 120), else a few round integers."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    v = np.asarray(values, dtype=float)
    gaps = np.diff(v)
    if len(v) <= most or (len(v) <= 12 and np.allclose(gaps, 1)):
        axis.set_major_locator(FixedLocator(v))
    elif np.allclose(gaps, gaps[0]) and float(gaps[0]).is_integer() and float(v[0]).is_integer():
        k = next(k for m in (1, 10, 100, 1000, 10 ** 9) for k in (m, 2 * m, 5 * m) if np.ceil(len(v) / k) <= most)
        axis.set_major_locator(FixedLocator(v[::k]))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, integer=True, steps=[1, 2, 5, 10]))


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Round colour-bar ticks 1, 2, 5 × 10^k between ``lo`` and ``hi`` (plain numbers, not 10^k)."""
    out = [m * 10.0 ** e for e in range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
           for m in (1, 2, 5)]
    return [t for t in out if lo <= t * (1 + 1e-9) and t <= hi * (1 + 1e-9)]


HEATMAP_SCALES = ("auto", "linear", "log")


def layer_heatmap(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                  condition: str | None = None, protocol="auto", percentiles=(2, 98), scale: str = "auto",
                  log_ratio: float = 4.0):
    """Layer × step heatmap of the per-layer head mean, one panel per condition (or just ``condition``).

    Each cell sits at its step (x) and layer (y), so both axes get regular integer ticks.
    ``scale`` of the colours, shared by the panels:

    * ``"linear"``: the limits are the ``percentiles`` of every value after each condition's
      first probe (the random-init step sits far from the rest and would swamp the scale);
      values outside are clipped to the end colours, the colorbar's arrows say so, and each
      clipped cell of the first probe is labelled with its value. ``percentiles=(0, 100)`` and
      one probe per condition give the full range.
    * ``"log"``: a log colour scale over the full range, first probe included, for values that
      span a large factor (an FFN PR that falls 15 → 2 in the first steps, then climbs to 6).
    * ``"auto"`` (default): ``"log"`` when every value is positive and the largest is at least
      ``log_ratio`` times the smallest, else ``"linear"``.
    """
    from matplotlib.colors import LogNorm, Normalize

    lo, hi = percentiles
    if not 0 <= lo < hi <= 100:
        raise ValueError(f"percentiles: expected (lo, hi) with 0 <= lo < hi <= 100, got {percentiles!r}")
    _args.choice("scale", scale, HEATMAP_SCALES)
    log_ratio = _args.real("log_ratio", log_ratio, "a ratio > 1", lambda v: v > 1)
    df = analysis.to_frame(records)
    protocol = analysis.resolve_protocol(df, site, metric, protocol)
    lm = analysis.layer_means(df, site, metric, protocol)
    conds = list(dict.fromkeys(lm["condition"])) if condition is None else [condition]
    if condition is not None and condition not in set(lm["condition"]):
        raise ValueError(f"condition: {condition!r} not in records ({sorted(set(lm['condition']))})")
    lm = lm[lm["condition"].isin(conds)]
    values = lm["value"].to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    if scale == "auto":
        positive = len(values) and values.min() > 0
        scale = "log" if positive and values.max() >= log_ratio * values.min() else "linear"
    if scale == "log":
        if not (len(values) and values.min() > 0):
            raise ValueError("scale: 'log' needs positive values")
        norm, later = LogNorm(values.min(), values.max()), None
        note = "log colour scale, full range"
    else:
        first = lm.groupby("condition")["step"].transform("min")
        later = lm.loc[lm["step"] != first, "value"].dropna()
        later = later[np.isfinite(later)]
        pool = later if len(later) else values
        vmin, vmax = (np.percentile(pool, [lo, hi]) if len(pool) else (0.0, 1.0))
        norm = Normalize(vmin, vmax)
        note = "full range" if len(later) == 0 else f"colours: {lo:g}–{hi:g}th percentile, first probe excluded"
    fig = _figure(4.0 * len(conds) + 1.0, 3.6)
    axes = fig.subplots(1, len(conds), squeeze=False)[0]
    for ax, cond in zip(axes, conds):
        grid = lm[lm["condition"] == cond].pivot(index="layer", columns="step", values="value")
        steps, layers = grid.columns.to_numpy(dtype=float), grid.index.to_numpy(dtype=float)
        z = np.ma.masked_invalid(grid.to_numpy(dtype=float))
        mesh = ax.pcolormesh(_edges(steps), _edges(layers), z, norm=norm, cmap="viridis")
        _integer_ticks(ax.xaxis, steps)
        _integer_ticks(ax.yaxis, layers)
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
        ax.set_title(cond or "run")
        if scale == "linear" and len(later) and len(layers) <= 16:
            # the clipped first-probe cells say their value, the colour cannot
            for li, v in zip(layers, grid.iloc[:, 0].to_numpy(dtype=float)):
                if np.isfinite(v) and not norm.vmin <= v <= norm.vmax:
                    ax.text(steps[0], li, f"{v:.3g}", ha="center", va="center", fontsize=6.5, rotation=90,
                            color="k" if v > norm.vmax else "w", gid="first-probe-value")
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[
        (bool((values < norm.vmin).any()), bool((values > norm.vmax).any()))]
    bar = fig.colorbar(mesh, ax=list(axes), extend=extend, label=f"{_label(site, metric)}\n({note})")
    if scale == "log":
        from matplotlib.ticker import FixedLocator, NullLocator, StrMethodFormatter

        bar.ax.yaxis.set_major_locator(FixedLocator(_log_ticks(norm.vmin, norm.vmax)))
        bar.ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        bar.ax.yaxis.set_minor_locator(NullLocator())
    fig.suptitle(f"{_label(site, metric)} per layer{_per_head(df, site, metric, protocol)}")
    return fig


def _pct_label(v: float) -> str:
    """A difference in percent for a bar label (and the report's findings): "+2.1%", "−12.6%" (a
    real minus), "0.0%" for an exact zero and "<0.1%" for one that would round to ±0.0% (never
    "−0.0%"); "" for NaN."""
    if not np.isfinite(v):
        return ""
    if abs(v) < 0.05:
        return "0.0%" if v == 0 else "<0.1%"
    return f"{v:+.1f}%".replace("-", "−")


def _layer_noise(lm, cond: str):
    """Step-to-step noise of each layer's value of ``cond`` near the end of its run: std (ddof=1)
    of the successive differences over its last third of probes (at least 3), over √2 (for
    white noise on a straight trend the differences have variance 2σ²). Empty with fewer than 3
    probes."""
    import pandas as pd

    g = lm[lm["condition"] == cond]
    steps = np.sort(g["step"].unique())
    if len(steps) < 3:
        return pd.Series(dtype=float)
    tail = g[g["step"].isin(steps[-max(3, int(np.ceil(len(steps) / 3))):])]
    grid = tail.pivot(index="step", columns="layer", values="value").sort_index()
    return grid.diff().iloc[1:].std(ddof=1) / np.sqrt(2)


def layer_bars(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
               conditions: tuple[str, str] | str | None = None, reference: str | None = None, protocol="auto",
               ceiling="auto", min_percent: float = 5.0, noise: float = 2.0):
    """Per-layer bars at the final step, one bar per condition, and optionally a second panel of
    relative differences ``100 · (c − ref) / ref`` per layer, in percent:

    * ``conditions=(a, b)``: ``a`` relative to ``b``;
    * ``conditions="all"``: every other condition relative to ``reference`` (default: the first
      condition in run order), side by side in the conditions' colours;
    * None: no second panel.

    The difference axis is symmetric, at least ``±min_percent`` (so that a 1–2% single-seed
    difference does not fill the panel). Each difference bar is labelled (``+2.1%``, ``−12.6%``;
    ``0.0%``/``<0.1%`` for tiny ones, never ``−0.0%``); a bar within the run's step-to-step noise is
    hatched and faded: a layer's noise is the std of the successive differences of its value over
    its condition's last third of probes (at least 3) over √2, the two conditions' noises add in
    quadrature, and a difference of at most ``noise`` times that is within noise (no marking with
    fewer than 3 probes). The conditions' legend sits above the panels, that of the differences
    below them, clear of the bars; both panels say "layer" on their x axis."""
    from matplotlib.patches import Patch

    df = analysis.to_frame(records)
    protocol = analysis.resolve_protocol(df, site, metric, protocol)
    table = analysis.layer_table(df, site, metric, "final", protocol)
    cols = list(table.columns)
    if isinstance(conditions, str):
        if conditions != "all":
            raise ValueError(f"conditions: expected 'all', two of {cols} or None, got {conditions!r}")
        ref = cols[0] if reference is None else reference
        if ref not in cols:
            raise ValueError(f"reference: {ref!r} not in records ({cols})")
        pairs = [(c, ref) for c in cols if c != ref]
    elif conditions is not None:
        bad = [c for c in conditions if c not in cols]
        if len(conditions) != 2 or bad:
            raise ValueError(f"conditions: expected two of {cols}, got {conditions!r}")
        pairs = [tuple(conditions)]
    else:
        pairs = []
    fig = _figure(6.4, 6.2 if pairs else 4.2)
    axes = fig.subplots(2 if pairs else 1, 1, squeeze=False)[:, 0]
    layers = table.index.to_numpy(dtype=int)
    width = 0.8 / len(cols)
    colours = {}
    for i, cond in enumerate(cols):
        bars = axes[0].bar(layers + (i - (len(cols) - 1) / 2) * width, table[cond], width, label=cond or "run")
        colours[cond] = bars.patches[0].get_facecolor() if bars.patches else None
    _draw_ceiling(axes[0], _ceiling(df, site, metric, protocol, ceiling), float(np.nanmax(table.to_numpy())), site)
    axes[0].set_ylabel(_label(site, metric))
    axes[0].set_title(f"final step, per layer{_per_head(df, site, metric, protocol)}")
    handles, labels = axes[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("ceiling"))  # conditions first
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside upper center",
               ncols=len(labels) if len(labels) <= 3 else 2, frameon=False)
    if pairs:
        lm = analysis.layer_means(df, site, metric, protocol)
        noises = {c: _layer_noise(lm, c) for c in cols}
        ax = axes[1]
        w = 0.7 / len(pairs)
        top, marked, legend = 0.0, False, []
        for j, (a, b) in enumerate(pairs):
            pct = (100 * (table[a] - table[b]) / table[b]).to_numpy(dtype=float)
            na, nb = noises[a].reindex(table.index), noises[b].reindex(table.index)
            band = (100 * noise * np.sqrt(na ** 2 + nb ** 2) / table[b].abs()).to_numpy(dtype=float)
            within = np.isfinite(band) & (np.abs(pct) <= band)
            colour = colours[a] if len(pairs) > 1 else "tab:blue"
            bars = ax.bar(layers + (j - (len(pairs) - 1) / 2) * w, pct, w, color=colour, label=f"{a} vs {b}")
            for patch, inside in zip(bars.patches, within):
                if inside:
                    patch.set_alpha(0.45)
                    patch.set_hatch("///")
                    marked = True
            ax.bar_label(bars, labels=[_pct_label(v) for v in pct], fontsize="small")
            top = max(top, float(np.nanmax(np.abs(pct), initial=0.0)))
            legend.append(Patch(color=colour, label=f"{a} vs {b}"))
        if any(len(n) for n in noises.values()):
            legend.append(Patch(facecolor="white", edgecolor="0.3", hatch="///",
                                label=f"within step-to-step noise (≤ {noise:g}σ)"))
        lim = max(min_percent, 1.25 * top)
        ax.set_ylim(-lim, lim)
        ax.axhline(0, color="k", lw=0.8)
        ref = pairs[0][1]
        ax.set_ylabel(f"vs {ref}, %")
        ax.set_title(f"{pairs[0][0]} relative to {ref}" if len(pairs) == 1 else f"each condition relative to {ref}",
                     fontsize="medium")
        ax.text(0.01, 0.97, "one run per condition: a few % can be seed noise", transform=ax.transAxes,
                ha="left", va="top", fontsize="small", color="0.3")
        if len(pairs) > 1 or marked:  # below the panels, clear of the bars
            fig.legend(handles=legend, loc="outside lower center", ncols=min(2, len(legend)), fontsize="small",
                       frameon=False)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.set_xticks(layers)
    return fig


def width_fit_plot(records, metrics=("participation_ratio", "entropy_rank"), *, site: str = "ffn",
                   width_col: str = "width", fits=None, n_boot: int = 200, protocol="auto"):
    """Log-log layer medians vs width with the fitted power laws; β and R² in the legend.

    Error bars span the layers' interquartile range. ``fits``: a table from
    :func:`fastspec.analysis.width_fits` to reuse (computed here otherwise).
    """
    df = analysis.to_frame(records)
    if fits is None:
        fits = analysis.width_fits(df, metrics, site=site, width_col=width_col, n_boot=n_boot, protocol=protocol)
    fig = _figure()
    ax = fig.add_subplot()
    for _, f in fits.iterrows():
        per = analysis._per_width_layers(df, f["metric"], site, width_col, "final", protocol)
        w = np.array(sorted(per))
        q = np.array([np.quantile(per[k], [0.25, 0.5, 0.75]) for k in w])
        (pts,) = ax.plot(w, q[:, 1], "o", ms=5)
        ax.errorbar(w, q[:, 1], yerr=[q[:, 1] - q[:, 0], q[:, 2] - q[:, 1]], fmt="none",
                    ecolor=pts.get_color(), capsize=3)
        grid = np.geomspace(w.min(), w.max(), 50)
        ax.plot(grid, np.exp(f["intercept"]) * grid ** f["beta"], "-", color=pts.get_color(),
                label=f"{f['metric'].replace('_', ' ')}: β={f['beta']:.3f}, R²={f['r2']:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"{width_col} (log)")
    ax.set_ylabel("layer median (log)")
    ax.set_title("layer median vs width; bars: interquartile range over layers")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return fig


# sites whose Probe spectra are singular values by default (Probe(key_convention="sv")); the rest are eig
SV_SITES = ("keys", "queries", "keys_prerope")
SPECTRUM_CONVENTIONS = ("eig", "sv")
HEADS = ("mean", "all")
_SYMBOL = {"eig": "λ", "sv": "σ"}


def _spectrum_name(key) -> str:
    """A legend name: ``("keys", 2)`` -> "keys layer 2", ``("ffn", None)`` -> "ffn", a string as is."""
    if isinstance(key, tuple) and len(key) == 2:
        site, layer = key
        return str(site) if layer is None else f"{site} layer {layer}"
    return str(key)


def _convention_of(key, convention) -> str:
    """The convention of the spectrum ``key``: ``convention`` if "eig"/"sv"; a mapping's entry for
    the key's site (or the key itself); else (None, or no entry) "sv" for (site, layer) keys of
    :data:`SV_SITES` and "eig" for the rest."""
    site = key[0] if isinstance(key, tuple) and len(key) == 2 else None
    if isinstance(convention, str):
        return convention
    if isinstance(convention, Mapping):
        for k in (site, key):
            if k is not None and k in convention:
                return _args.choice(f"convention: {k!r}", convention[k], SPECTRUM_CONVENTIONS)
    return "sv" if site in SV_SITES else "eig"


def _spectra_items(spectra, convention=None) -> list[tuple[str, str, np.ndarray]]:
    """``(name, convention, [rows, D])`` per spectrum, each row sorted descending, negatives as 0.

    A spectrum is 1-D ``[D]`` (one row) or ``[*heads, D]`` (e.g. :meth:`fastspec.Probe.spectra`'s
    ``[heads, D]`` of a key site; leading axes flattened); tensors may be on any device."""
    if convention is not None and not isinstance(convention, Mapping):
        _args.choice("convention", convention, SPECTRUM_CONVENTIONS)
    items = list(spectra.items()) if isinstance(spectra, Mapping) else [("", spectra)]
    if not items:
        raise ValueError("spectra: expected at least one spectrum, got an empty mapping")
    out = []
    for key, v in items:
        v = v.detach().double().cpu().numpy() if hasattr(v, "detach") else np.asarray(v, dtype=float)
        name = _spectrum_name(key)
        if v.ndim == 0 or v.size == 0:
            raise ValueError(f"spectra: {name or 'spectrum'} must be a non-empty spectrum [D] or per-head spectra "
                             f"[heads, D], got shape {v.shape}")
        rows = -np.sort(-np.clip(v.reshape(-1, v.shape[-1]), 0, None), axis=1)
        out.append((name, _convention_of(key, convention), rows))
    return out


def _ratio_label(conventions: set, normalize: bool = True) -> str:
    """"σ_k / Σσ" (sv), "λ_k / Σλ" (eig), both when mixed; without the sum unless ``normalize``."""
    one = {c: (f"{_SYMBOL[c]}_k / Σ{_SYMBOL[c]}" if normalize else f"{_SYMBOL[c]}_k") for c in conventions}
    if len(one) == 1:
        return one.popitem()[1]
    return f"{one['eig']} (eig), {one['sv']} (sv)"


def _draw_rows(ax, k, ys: np.ndarray, name: str, heads: str, mask_zeros: bool, ls="-"):
    """One line for ``ys`` ``[rows, len(k)]``: the mean over rows shaded min–max (``heads="mean"``),
    or a line per row in one colour (``"all"``), in line style ``ls``; zeros left out when
    ``mask_zeros`` (log axes)."""
    def clean(y):
        return np.where(y > 0, y, np.nan) if mask_zeros else y

    label = name or None
    if heads == "all" or len(ys) == 1:
        (line,) = ax.plot(k, clean(ys[0]), lw=1.2 if len(ys) == 1 else 0.8, ls=ls,
                          label=f"{name} ({len(ys)} heads)" if len(ys) > 1 and name else label)
        for y in ys[1:]:
            ax.plot(k, clean(y), lw=0.8, ls=ls, color=line.get_color(), label="_nolegend_")
        return line
    (line,) = ax.plot(k, clean(ys.mean(axis=0)), lw=1.4, ls=ls, label=label)
    ax.fill_between(k, clean(ys.min(axis=0)), clean(ys.max(axis=0)), color=line.get_color(), alpha=0.2, lw=0)
    return line


def _heads_note(items, heads: str) -> str:
    if not any(len(rows) > 1 for _, _, rows in items):
        return ""
    # a second title line: on one line with a mixed spectra title it ran past the figure's edge
    return "\nmean over heads, band: lowest to highest head" if heads == "mean" else "\none line per head"


def spectrum_plot(spectra, *, normalize: bool = True, title: str | None = None, convention=None,
                  heads: str = "mean"):
    """Spectra on log-log axes: rank k vs the eigenvalue λ_k (``eig`` sites, e.g. FFN) or the
    singular value σ_k (``sv`` sites, e.g. keys), divided by their sum when ``normalize``; each
    entry in a line style of its own (solid, dashed, dotted, ...), so coinciding ones stay visible.

    ``spectra``: a mapping name -> spectrum, or one spectrum. A spectrum is 1-D ``[D]`` or per
    head ``[heads, D]``, so :meth:`fastspec.Probe.spectra`'s ``{(site, layer): tensor}`` goes in as
    it is (legend "keys layer 2"). ``heads``: ``"mean"`` (one line per entry: the mean over heads of
    the normalized spectra, shaded from the lowest to the highest head) or ``"all"`` (a line per
    head, one colour per entry). ``convention``: ``"eig"``, ``"sv"``, a mapping {site or name:
    convention}, or None (auto: (site, layer) keys of keys/queries/keys_prerope sites are ``sv``,
    the Probe's default ``key_convention``, the rest ``eig``); the axis reads ``σ_k / Σσ`` for sv,
    ``λ_k / Σλ`` for eig (both, and a σ/λ mark per legend entry, when mixed). Zeros are not drawn.
    """
    _args.choice("heads", heads, HEADS)
    items = _spectra_items(spectra, convention)
    conventions = {c for _, c, _ in items}
    fig = _figure()
    ax = fig.add_subplot()
    for i, (name, conv, rows) in enumerate(items):
        sums = rows.sum(axis=1, keepdims=True)
        ys = np.divide(rows, sums, out=rows.copy(), where=sums > 0) if normalize else rows
        label = f"{name} ({_SYMBOL[conv]})" if name and len(conventions) > 1 else name
        _draw_rows(ax, np.arange(1, rows.shape[1] + 1), ys, label, heads, mask_zeros=True,
                   ls=_STYLES[i % len(_STYLES)][0])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rank k")
    ax.set_ylabel(_ratio_label(conventions, normalize))
    kind = ("eigen-spectrum" if conventions == {"eig"} else "singular-value spectrum" if conventions == {"sv"}
            else "spectra")
    default = f"{kind}, {_ratio_label(conventions)}" if normalize else kind
    ax.set_title(title or default + _heads_note(items, heads))
    if any(name for name, _, _ in items):
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def cumulative_variance_plot(spectra, *, title: str | None = None, share: float = 0.9, convention=None,
                             heads: str = "mean"):
    """Cumulative share of the variance ``cum_k = Σ_{i≤k} v_i / Σv`` vs the number of components
    k = 1..D on a log axis (a linear k/D axis crowds every realistic curve into its first few
    percent). The variance per direction ``v`` is λ for ``eig`` spectra and σ² for ``sv`` ones
    (as the probe's rank@90). The dashed curve ``k/D`` is a flat spectrum of the widest D; the
    dotted line marks ``share`` (where it crosses a curve is that spectrum's rank@90 for 0.9).

    ``spectra``, ``convention`` and ``heads`` as in :func:`spectrum_plot` (per-head spectra: the
    mean of the heads' curves, shaded min–max, or a line per head)."""
    if not 0 < share < 1:
        raise ValueError(f"share: expected a fraction in (0, 1), got {share!r}")
    _args.choice("heads", heads, HEADS)
    items = _spectra_items(spectra, convention)
    conventions = {c for _, c, _ in items}
    fig = _figure()
    ax = fig.add_subplot()
    for i, (name, conv, rows) in enumerate(items):
        v = rows ** 2 if conv == "sv" else rows
        total = v.sum(axis=1, keepdims=True)
        cum = np.divide(np.cumsum(v, axis=1), total, out=np.zeros_like(v), where=total > 0)
        label = f"{name} ({_SYMBOL[conv]}²)" if name and conv == "sv" and len(conventions) > 1 else name
        _draw_rows(ax, np.arange(1, v.shape[1] + 1), cum, label, heads, mask_zeros=False,
                   ls=_STYLES[i % len(_STYLES)][0])
    D = max(rows.shape[1] for _, _, rows in items)
    k = np.arange(1, D + 1)
    ax.plot(k, k / D, "k--", lw=0.8, label=f"flat (D = {D})")
    ax.axhline(share, color="0.4", ls=":", lw=0.8, label=f"{share:.0%} of the variance")
    ax.set_xscale("log")
    ax.set_xlim(1, max(D, 2))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("number of components k (log)")
    ax.set_ylabel("cumulative variance share" + (" (σ² of sv spectra)" if "sv" in conventions else ""))
    ax.set_title(title or "cumulative variance of the top k components" + _heads_note(items, heads))
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def layer_grid_heatmap(panels: Mapping, *, label: str, xlabel: str = "head", title: str | None = None,
                       vmin: float | None = None, vmax: float | None = None, fmt: str | None = None,
                       max_labels: int = 256):
    """Layer × head (or layer × step) heatmaps side by side on one colour scale: one model's
    per-head values of one or more sites, or a series' per-layer values over its checkpoints.

    ``panels``: {panel title: table}, each a ``pandas.DataFrame`` with the layers as its index and
    the heads (or steps: ``xlabel="step"``) as its numeric columns; each cell sits at its column's
    value, so uneven steps keep their spacing; NaN cells stay blank. ``label``: the colour bar's
    label. ``vmin``/``vmax``: the colour range (default: the data's full range, every cell
    included); a fixed range (0–1 for a share of d_head) lets panels and figures be compared.
    ``fmt``: a format for each cell's value (``"{:.0%}"``), written in the cell when a panel has at
    most ``max_labels`` cells (more would be unreadable)."""
    from matplotlib.colors import Normalize

    if not panels:
        raise ValueError("panels: expected at least one layer × head table, got none")
    values = np.concatenate([np.asarray(t, dtype=float).ravel() for t in panels.values()])
    values = values[np.isfinite(values)]
    lo = vmin if vmin is not None else (float(values.min()) if len(values) else 0.0)
    hi = vmax if vmax is not None else (float(values.max()) if len(values) else 1.0)
    norm = Normalize(lo, hi if hi > lo else lo + 1.0)
    fig = _figure(3.6 * len(panels) + 1.2, 3.8)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, table) in zip(axes, panels.items()):
        table = table.sort_index().sort_index(axis=1)
        heads = np.asarray(table.columns, dtype=float)
        layers = np.asarray(table.index, dtype=float)
        z = np.asarray(table, dtype=float)
        mesh = ax.pcolormesh(_edges(heads), _edges(layers), np.ma.masked_invalid(z), norm=norm, cmap="viridis")
        _integer_ticks(ax.xaxis, heads)
        _integer_ticks(ax.yaxis, layers)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize="medium")
        if fmt and z.size <= max_labels:
            for (i, j), v in np.ndenumerate(z):
                if np.isfinite(v):  # dark text on the bright end of viridis, light on the dark end
                    ax.text(heads[j], layers[i], fmt.format(v), ha="center", va="center", fontsize=6.5,
                            color="k" if norm(v) > 0.6 else "w", gid="cell-value")
    fig.colorbar(mesh, ax=list(axes), label=label)
    if title:
        fig.suptitle(title)
    return fig


def layer_profile_plot(profiles: Mapping, *, ylabel: str, title: str | None = None,
                       ceiling: float | None = None, ceiling_label: str | None = None):
    """Per-layer values as curves: a colour per entry (a model), a line style and marker per variant
    (e.g. post-RoPE solid, pre-RoPE dashed).

    ``profiles``: {entry: {variant: per-layer values}}, the values a ``pandas.Series`` indexed by
    layer (or a mapping layer -> value); the legend reads "entry, variant" (the entry alone when
    every entry has one variant). ``ceiling``: a dashed horizontal line (e.g. 1 for a share of
    d_head), labelled ``ceiling_label``."""
    import pandas as pd

    if not profiles:
        raise ValueError("profiles: expected at least one entry, got none")
    variants = list(dict.fromkeys(v for per in profiles.values() for v in per))
    several = len(variants) > 1
    fig = _figure()
    ax = fig.add_subplot()
    layers = set()
    for i, (entry, per) in enumerate(profiles.items()):
        colour = f"C{i % 10}"
        for variant, values in per.items():
            s = pd.Series(values, dtype=float).sort_index()
            layers.update(int(l) for l in s.index)
            ls, marker = _STYLES[variants.index(variant) % len(_STYLES)]
            ax.plot(s.index.to_numpy(dtype=float), s.to_numpy(), color=colour, ls=ls, marker=marker, ms=4,
                    mfc=None if variants.index(variant) == 0 else "none",
                    label=f"{entry}, {variant}" if several else str(entry))
    if ceiling is not None:
        ax.axhline(ceiling, ls="--", lw=1, color="0.3", label=ceiling_label, gid="ceiling")
    _integer_ticks(ax.xaxis, sorted(layers))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def save(fig, path) -> str:
    """Write ``fig`` as PNG at 120 dpi and return the path as a string."""
    fig.savefig(path, dpi=120)
    return str(path)
