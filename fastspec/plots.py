"""Figures of probe records (matplotlib; each function returns a ``matplotlib.figure.Figure``).

Figures are built with the object API (``Figure()``, no pyplot), so nothing here touches the
global backend or leaks open figures; save with ``fig.savefig("x.png")``. Inputs are records
as accepted by :func:`fastspec.analysis.to_frame`, or tables from :mod:`fastspec.analysis`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import analysis

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


def trajectory_plot(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                    x: str = "tokens_seen"):
    """Whole-model mean of ``metric`` vs ``x`` (``"tokens_seen"`` or ``"step"``), one line per
    condition, shaded between the lowest and highest layer."""
    if x not in ("tokens_seen", "step"):
        raise ValueError(f"x: expected 'tokens_seen' or 'step', got {x!r}")
    traj = analysis.trajectory(records, site, metric)
    if x == "tokens_seen" and traj["tokens_seen"].isna().any():
        x = "step"
    fig = _figure()
    ax = fig.add_subplot()
    for cond, t in traj.groupby("condition", sort=False):
        t = t.sort_values("step")
        xs = t[x].to_numpy(dtype=float)
        (line,) = ax.plot(xs, t["mean"], marker="o", ms=3, label=cond or "run")
        ax.fill_between(xs, t["min"], t["max"], color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("tokens seen" if x == "tokens_seen" else "step")
    ax.set_ylabel(_label(site, metric))
    ax.set_title("mean over layers; band: lowest to highest layer")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def layer_heatmap(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
                  condition: str | None = None):
    """Layer × step heatmap of the per-layer head mean, one panel per condition (or just ``condition``)."""
    lm = analysis.layer_means(records, site, metric)
    conds = list(dict.fromkeys(lm["condition"])) if condition is None else [condition]
    if condition is not None and condition not in set(lm["condition"]):
        raise ValueError(f"condition: {condition!r} not in records ({sorted(set(lm['condition']))})")
    vmin, vmax = lm["value"].min(), lm["value"].max()
    fig = _figure(4.0 * len(conds) + 1.0, 3.6)
    axes = fig.subplots(1, len(conds), squeeze=False)[0]
    for ax, cond in zip(axes, conds):
        grid = lm[lm["condition"] == cond].pivot(index="layer", columns="step", values="value")
        im = ax.imshow(grid.to_numpy(), aspect="auto", origin="lower", vmin=vmin, vmax=vmax,
                       cmap="viridis", interpolation="nearest")
        steps = grid.columns.to_numpy()
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(6, len(steps))).round().astype(int))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
        ax.set_title(cond or "run")
    fig.colorbar(im, ax=list(axes), label=_label(site, metric))
    return fig


def layer_bars(records, site: str = analysis.KEY_SITE, metric: str = analysis.KEY_METRIC, *,
               conditions: tuple[str, str] | None = None):
    """Per-layer bars at the final step, one bar per condition; with two ``conditions`` (a, b)
    a second panel shows the difference ``a − b`` per layer."""
    table = analysis.layer_table(records, site, metric, "final")
    if conditions is not None:
        bad = [c for c in conditions if c not in table.columns]
        if len(conditions) != 2 or bad:
            raise ValueError(f"conditions: expected two of {list(table.columns)}, got {conditions!r}")
    fig = _figure(6.4, 5.6 if conditions else 4.0)
    axes = fig.subplots(2 if conditions else 1, 1, squeeze=False)[:, 0]
    layers = table.index.to_numpy()
    width = 0.8 / len(table.columns)
    for i, cond in enumerate(table.columns):
        axes[0].bar(layers + (i - (len(table.columns) - 1) / 2) * width, table[cond], width, label=cond or "run")
    axes[0].set_ylabel(_label(site, metric))
    axes[0].set_title("final step, per layer (mean over heads)")
    axes[0].legend()
    if conditions:
        a, b = conditions
        diff = table[a] - table[b]
        axes[1].bar(layers, diff, 0.6, color=np.where(diff >= 0, "tab:green", "tab:red"))
        axes[1].axhline(0, color="k", lw=0.8)
        axes[1].set_ylabel(f"{a} − {b}")
    axes[-1].set_xlabel("layer")
    for ax in axes:
        ax.set_xticks(layers)
    return fig


def width_fit_plot(records, metrics=("participation_ratio", "entropy_rank"), *, site: str = "ffn",
                   width_col: str = "width", fits=None, n_boot: int = 200):
    """Log-log layer medians vs width with the fitted power laws; β and R² in the legend.

    Error bars span the layers' interquartile range. ``fits``: a table from
    :func:`fastspec.analysis.width_fits` to reuse (computed here otherwise).
    """
    df = analysis.to_frame(records)
    if fits is None:
        fits = analysis.width_fits(df, metrics, site=site, width_col=width_col, n_boot=n_boot)
    fig = _figure()
    ax = fig.add_subplot()
    for _, f in fits.iterrows():
        per = analysis._per_width_layers(df, f["metric"], site, width_col, "final")
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


def spectrum_plot(spectra, *, normalize: bool = True):
    """Eigen-spectra on log-log axes (rank k vs λ_k, divided by Σλ when ``normalize``).

    ``spectra``: a mapping name -> 1-D spectrum, or one spectrum. Zeros are not drawn.
    """
    fig = _figure()
    ax = fig.add_subplot()
    for name, v in _spectra_items(spectra):
        y = v / v.sum() if normalize and v.sum() > 0 else v
        k = np.arange(1, len(v) + 1)
        keep = y > 0
        ax.plot(k[keep], y[keep], label=name or None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rank k")
    ax.set_ylabel("λ_k / Σλ" if normalize else "λ_k")
    if any(name for name, _ in _spectra_items(spectra)):
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def cumulative_variance_plot(spectra):
    """Cumulative share ``cum_k`` vs the fraction ``k/D`` of dimensions; the diagonal
    is a flat spectrum."""
    fig = _figure()
    ax = fig.add_subplot()
    for name, v in _spectra_items(spectra):
        D = len(v)
        cum = np.concatenate([[0.0], np.cumsum(v) / v.sum()]) if v.sum() > 0 else np.zeros(D + 1)
        ax.plot(np.arange(D + 1) / D, cum, label=name or None)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="flat")
    ax.set_xlabel("fraction of dimensions k/D")
    ax.set_ylabel("cumulative variance share")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def save(fig, path) -> str:
    """Write ``fig`` as PNG at 120 dpi and return the path as a string."""
    fig.savefig(path, dpi=120)
    return str(path)
