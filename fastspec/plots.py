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


def _per_head(df, site: str, metric: str, protocol) -> str:
    """How a per-layer value was formed: "mean over heads" for per-head sites, nothing for FFN."""
    heads = analysis._select(df, site, metric, protocol)["head_index"].notna().any()
    return " (mean over heads)" if heads else ""


def trajectory_plot(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                    x: str = "tokens_seen", protocol="auto", ceiling="auto"):
    """Whole-model mean of ``metric`` vs ``x`` (``"tokens_seen"`` or ``"step"``), one line per
    condition, shaded between the lowest and highest layer. ``protocol``: which records
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
    for cond, t in traj.groupby("condition", sort=False):
        t = t.sort_values("step")
        xs = t[x].to_numpy(dtype=float)
        (line,) = ax.plot(xs, t["mean"], marker="o", ms=3, label=cond or "run")
        ax.fill_between(xs, t["min"], t["max"], color=line.get_color(), alpha=0.2, lw=0)
    _draw_ceiling(ax, _ceiling(df, site, metric, protocol, ceiling), traj["max"].max(), site)
    ax.set_xlabel("tokens seen" if x == "tokens_seen" else "step")
    ax.set_ylabel(_label(site, metric))
    heads = "heads, then " if _per_head(df, site, metric, protocol) else ""
    ax.set_title(f"mean over {heads}layers; band: lowest to highest layer")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def layer_heatmap(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                  condition: str | None = None, protocol="auto", percentiles=(2, 98)):
    """Layer × step heatmap of the per-layer head mean, one panel per condition (or just ``condition``).

    The colour limits are the ``percentiles`` of every value after each condition's first probe
    (the random-init step sits far from the rest and would swamp the scale); values outside are
    clipped to the end colours and the colorbar says so. ``percentiles=(0, 100)`` and one probe
    per condition give the full range."""
    lo, hi = percentiles
    if not 0 <= lo < hi <= 100:
        raise ValueError(f"percentiles: expected (lo, hi) with 0 <= lo < hi <= 100, got {percentiles!r}")
    df = analysis.to_frame(records)
    protocol = analysis.resolve_protocol(df, site, metric, protocol)
    lm = analysis.layer_means(df, site, metric, protocol)
    conds = list(dict.fromkeys(lm["condition"])) if condition is None else [condition]
    if condition is not None and condition not in set(lm["condition"]):
        raise ValueError(f"condition: {condition!r} not in records ({sorted(set(lm['condition']))})")
    later = lm.loc[lm["step"] != lm.groupby("condition")["step"].transform("min"), "value"].dropna()
    pool = later if len(later) else lm["value"].dropna()
    vmin, vmax = (np.percentile(pool, [lo, hi]) if len(pool) else (0.0, 1.0))
    fig = _figure(4.0 * len(conds) + 1.0, 3.6)
    axes = fig.subplots(1, len(conds), squeeze=False)[0]
    for ax, cond in zip(axes, conds):
        grid = lm[lm["condition"] == cond].pivot(index="layer", columns="step", values="value")
        im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", origin="lower", vmin=vmin, vmax=vmax,
                       cmap="viridis", interpolation="nearest")
        steps = grid.columns.to_numpy()
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(6, len(steps))).round().astype(int))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
        ax.set_title(cond or "run")
    values = lm["value"].dropna()
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[
        (bool((values < vmin).any()), bool((values > vmax).any()))]
    scale = "full range" if len(later) == 0 else f"colours: {lo:g}–{hi:g}th percentile, first probe excluded"
    fig.colorbar(im, ax=list(axes), extend=extend, label=f"{_label(site, metric)}\n({scale})")
    fig.suptitle(f"{_label(site, metric)} per layer{_per_head(df, site, metric, protocol)}")
    return fig


def layer_bars(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
               conditions: tuple[str, str] | None = None, protocol="auto", ceiling="auto",
               min_percent: float = 5.0):
    """Per-layer bars at the final step, one bar per condition; with two ``conditions`` (a, b)
    a second panel shows the relative difference ``100 · (a − b) / b`` per layer, in percent, on
    a symmetric axis of at least ``±min_percent`` (so that a 1–2% single-seed difference does not
    fill the panel). The legend sits above the panels, clear of the bars."""
    df = analysis.to_frame(records)
    protocol = analysis.resolve_protocol(df, site, metric, protocol)
    table = analysis.layer_table(df, site, metric, "final", protocol)
    if conditions is not None:
        bad = [c for c in conditions if c not in table.columns]
        if len(conditions) != 2 or bad:
            raise ValueError(f"conditions: expected two of {list(table.columns)}, got {conditions!r}")
    fig = _figure(6.4, 5.8 if conditions else 4.2)
    axes = fig.subplots(2 if conditions else 1, 1, squeeze=False)[:, 0]
    layers = table.index.to_numpy(dtype=int)
    width = 0.8 / len(table.columns)
    for i, cond in enumerate(table.columns):
        axes[0].bar(layers + (i - (len(table.columns) - 1) / 2) * width, table[cond], width, label=cond or "run")
    _draw_ceiling(axes[0], _ceiling(df, site, metric, protocol, ceiling), float(np.nanmax(table.to_numpy())), site)
    axes[0].set_ylabel(_label(site, metric))
    axes[0].set_title(f"final step, per layer{_per_head(df, site, metric, protocol)}")
    handles, labels = axes[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("ceiling"))  # conditions first
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside upper center",
               ncols=len(labels) if len(labels) <= 3 else 2, frameon=False)
    if conditions:
        a, b = conditions
        pct = (100 * (table[a] - table[b]) / table[b]).to_numpy(dtype=float)
        bars = axes[1].bar(layers, pct, 0.6, color=np.where(pct >= 0, "tab:green", "tab:red"))
        axes[1].bar_label(bars, fmt="%+.1f%%", fontsize="small")
        lim = max(min_percent, 1.25 * float(np.nanmax(np.abs(pct), initial=0.0)))
        axes[1].set_ylim(-lim, lim)
        axes[1].axhline(0, color="k", lw=0.8)
        axes[1].set_ylabel(f"vs {b}, %")
        axes[1].set_title(f"{a} relative to {b}", fontsize="medium")
        axes[1].text(0.01, 0.97, "one run per condition: a few % can be seed noise", transform=axes[1].transAxes,
                     ha="left", va="top", fontsize="small", color="0.3")
    axes[-1].set_xlabel("layer")
    for ax in axes:
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


def _spectra_items(spectra) -> list[tuple[str, np.ndarray]]:
    if isinstance(spectra, Mapping):
        items = list(spectra.items())
    else:
        items = [("", spectra)]
    out = []
    for name, v in items:
        v = v.detach().double().cpu().numpy() if hasattr(v, "detach") else np.asarray(v, dtype=float)
        if v.ndim != 1 or v.size == 0:
            raise ValueError(f"spectra: {name or 'spectrum'} must be a non-empty 1-D spectrum, got shape {v.shape}")
        out.append((str(name), np.sort(np.clip(v, 0, None))[::-1]))
    return out


def spectrum_plot(spectra, *, normalize: bool = True, title: str | None = None):
    """Eigen-spectra on log-log axes (rank k vs λ_k, divided by Σλ when ``normalize``).

    ``spectra``: a mapping name -> 1-D spectrum, or one spectrum. Zeros are not drawn.
    """
    fig = _figure()
    ax = fig.add_subplot()
    items = _spectra_items(spectra)
    for name, v in items:
        y = v / v.sum() if normalize and v.sum() > 0 else v
        k = np.arange(1, len(v) + 1)
        keep = y > 0
        ax.plot(k[keep], y[keep], label=name or None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rank k")
    ax.set_ylabel("λ_k / Σλ" if normalize else "λ_k")
    ax.set_title(title or ("eigen-spectrum, λ_k / Σλ" if normalize else "eigen-spectrum"))
    if any(name for name, _ in items):
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def cumulative_variance_plot(spectra, *, title: str | None = None, share: float = 0.9):
    """Cumulative share ``cum_k = Σ_{i≤k} λ_i / Σλ`` vs the number of components k = 1..D on a
    log axis (a linear k/D axis crowds every realistic curve into its first few percent). The
    dashed curve ``k/D`` is a flat spectrum of the widest D; the dotted line marks ``share``
    (where it crosses a curve is that spectrum's rank@90 for 0.9)."""
    if not 0 < share < 1:
        raise ValueError(f"share: expected a fraction in (0, 1), got {share!r}")
    fig = _figure()
    ax = fig.add_subplot()
    items = _spectra_items(spectra)
    for name, v in items:
        D = len(v)
        cum = np.cumsum(v) / v.sum() if v.sum() > 0 else np.zeros(D)
        ax.plot(np.arange(1, D + 1), cum, label=name or None)
    D = max(len(v) for _, v in items)
    k = np.arange(1, D + 1)
    ax.plot(k, k / D, "k--", lw=0.8, label=f"flat (D = {D})")
    ax.axhline(share, color="0.4", ls=":", lw=0.8, label=f"{share:.0%} of the variance")
    ax.set_xscale("log")
    ax.set_xlim(1, max(D, 2))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("number of components k (log)")
    ax.set_ylabel("cumulative variance share")
    ax.set_title(title or "cumulative variance of the top k components")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def save(fig, path) -> str:
    """Write ``fig`` as PNG at 120 dpi and return the path as a string."""
    fig.savefig(path, dpi=120)
    return str(path)
