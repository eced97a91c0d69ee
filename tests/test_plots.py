"""Every figure renders to a non-trivial PNG; bad arguments raise naming the argument."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

from fastspec import plots  # noqa: E402
from fastspec.probe import Record  # noqa: E402


@pytest.fixture(scope="module")
def records():
    rng = np.random.default_rng(0)
    rows = []
    for cond, rate in (("learned", 0.02), ("frozen", 0.05)):
        for step in range(0, 50, 10):
            for layer in range(4):
                for head in range(3):
                    v = 30 * np.exp(-rate * step * (1 + layer / 4)) + rng.uniform(0, 1)
                    rows.append({**Record(step, step * 512, "keys", layer, head, "participation_ratio", v).as_dict(),
                                 "condition": cond})
    return rows


@pytest.fixture(scope="module")
def sweep():
    rows = []
    for w in (64, 128, 256, 512):
        for layer in range(5):
            for metric, beta in (("participation_ratio", 0.8), ("entropy_rank", 0.9)):
                v = 2.0 * w ** beta * (1 + 0.02 * layer)
                rows.append({**Record(10, None, "ffn", layer, None, metric, v).as_dict(), "width": w})
    return rows


def _with_width(rows, site: str, D: int) -> list[dict]:
    """``rows`` plus the ``ghost_dims = D − PR`` record of each PR record (what the probe writes),
    from which the plots read the ceiling D."""
    return rows + [{**r, "metric": "ghost_dims", "value": D - r["value"]} for r in rows
                   if r["site"] == site and r["metric"] == "participation_ratio"]


def _ceilings(ax) -> dict[str, object]:
    return {l.get_label(): l for l in ax.get_lines() if l.get_gid() == "ceiling"}


def _check_png(path, min_colors: int = 8):
    """A real image: decodes, has a sensible size and more than a handful of distinct colours."""
    import matplotlib.image as mpimg

    assert path.is_file() and path.stat().st_size > 5_000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 300
    colors = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) >= min_colors
    assert img[..., :3].std() > 0.02


def test_record_plots_render(records, tmp_path):
    figs = {
        "trajectory": plots.trajectory_plot(records),
        "trajectory_steps": plots.trajectory_plot(records, x="step"),
        "heatmap": plots.layer_heatmap(records),
        "heatmap_one": plots.layer_heatmap(records, condition="frozen"),
        "bars": plots.layer_bars(records, conditions=("learned", "frozen")),
        "bars_plain": plots.layer_bars(records),
    }
    for name, fig in figs.items():
        _check_png(Path(plots.save(fig, tmp_path / f"{name}.png")))
    assert len(figs["heatmap"].axes) == 2 + 1  # two panels and a colorbar
    assert len(figs["bars"].axes) == 2        # bars and the difference panel


def test_trajectory_lines_follow_layer_means(records):
    fig = plots.trajectory_plot(records, x="step")
    lines = {l.get_label(): l for l in fig.axes[0].get_lines()}
    assert set(lines) == {"learned", "frozen"}
    xs, ys = lines["learned"].get_data()
    exp = [np.mean([r["value"] for r in records if r["condition"] == "learned" and r["step"] == s]) for s in xs]
    assert np.allclose(ys, exp)


def test_width_fit_plot_legend_has_fit(sweep, tmp_path):
    fig = plots.width_fit_plot(sweep, n_boot=20)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("β=0.800" in t and "R²=1.000" in t for t in labels)
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"
    _check_png(Path(plots.save(fig, tmp_path / "width.png")))


def test_spectrum_plots_render(tmp_path):
    k = np.arange(1, 129, dtype=float)
    spectra = {"steep": k ** -1.5, "flat": np.ones(128), "with zeros": np.r_[k[:64] ** -1.0, np.zeros(64)]}
    for name, fig in (("spec", plots.spectrum_plot(spectra)), ("cum", plots.cumulative_variance_plot(spectra)),
                      ("single", plots.spectrum_plot(k ** -1.0, normalize=False))):
        _check_png(Path(plots.save(fig, tmp_path / f"{name}.png")))
    cum = plots.cumulative_variance_plot({"flat": np.ones(10)})
    x, y = cum.axes[0].get_lines()[0].get_data()
    assert np.allclose(x, np.arange(1, 11)) and np.allclose(y, x / 10)  # a flat spectrum: k/D


def test_cumulative_variance_uses_a_log_k_axis_with_references():
    """k = 1..D on a log axis (on a linear k/D axis every real curve hugs its first 5%), the flat
    spectrum and the 90% line for reference, and a title."""
    k = np.arange(1, 193, dtype=float)
    fig = plots.cumulative_variance_plot({"steep": k ** -2.0}, title="ffn layer 3")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlim() == (1, 192) and ax.get_title() == "ffn layer 3"
    lines = {l.get_label(): l for l in ax.get_lines()}
    x, y = lines["steep"].get_data()
    assert x[0] == 1 and x[-1] == 192 and np.allclose(y, np.cumsum(k ** -2.0) / np.sum(k ** -2.0))
    assert np.allclose(lines["flat (D = 192)"].get_ydata(), k / 192)
    assert lines["90% of the variance"].get_ydata()[0] == 0.9
    assert plots.cumulative_variance_plot(k).axes[0].get_title()  # a default title
    with pytest.raises(ValueError, match="share"):
        plots.cumulative_variance_plot(k, share=1.5)


def test_spectrum_plot_has_a_title():
    k = np.arange(1, 65, dtype=float)
    assert plots.spectrum_plot(k ** -1.0).axes[0].get_title() == "eigen-spectrum, λ_k / Σλ"
    assert plots.spectrum_plot({"a": k ** -1.0}, title="keys, layer 2").axes[0].get_title() == "keys, layer 2"


def test_plots_reject_bad_arguments(records):
    with pytest.raises(ValueError, match="x"):
        plots.trajectory_plot(records, x="time")
    with pytest.raises(ValueError, match="condition"):
        plots.layer_heatmap(records, condition="missing")
    with pytest.raises(ValueError, match="conditions"):
        plots.layer_bars(records, conditions=("learned", "missing"))
    with pytest.raises(ValueError, match="spectra"):
        plots.spectrum_plot({"bad": np.ones((2, 2))})


def test_pr_plots_draw_the_ceiling(records):
    """PR is at most the spectrum width D: a dashed line at D when it is within reach of the data,
    a legend entry only when it is far above (an FFN PR of ~4 under d_ff = 192)."""
    near = _with_width(records, "keys", 32)  # values up to ~31
    for fig in (plots.trajectory_plot(near), plots.layer_bars(near, conditions=("learned", "frozen"))):
        (line,) = _ceilings(fig.axes[0]).values()
        assert line.get_ydata()[0] == 32 and line.get_label() == "ceiling d_head = 32" and line.get_linestyle() == "--"
    far = _ceilings(plots.trajectory_plot(_with_width(records, "keys", 512)).axes[0])
    assert list(far) == ["ceiling d_head = 512 (off scale)"] and far[list(far)[0]].get_linestyle() == "None"
    assert not _ceilings(plots.trajectory_plot(records).axes[0])  # D unknown: no ceiling
    assert not _ceilings(plots.trajectory_plot(near, ceiling=None).axes[0])
    (line,) = _ceilings(plots.trajectory_plot(records, ceiling=40).axes[0]).values()
    assert line.get_ydata()[0] == 40
    with pytest.raises(ValueError, match="ceiling"):
        plots.trajectory_plot(records, ceiling=-1)


def test_layer_bars_legend_above_and_difference_in_percent(records):
    fig = plots.layer_bars(records, conditions=("learned", "frozen"))
    bars_ax, diff_ax = fig.axes
    assert bars_ax.get_legend() is None and len(fig.legends) == 1  # a figure legend, above the panels
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["learned", "frozen"]
    final = [r for r in records if r["step"] == 40]
    mean = lambda c, l: np.mean([r["value"] for r in final if r["condition"] == c and r["layer"] == l])  # noqa: E731
    expected = [100 * (mean("learned", l) - mean("frozen", l)) / mean("frozen", l) for l in range(4)]
    assert [p.get_height() for p in diff_ax.patches] == pytest.approx(expected)
    lo, hi = diff_ax.get_ylim()
    assert lo == -hi and hi >= max(5.0, max(abs(e) for e in expected))  # symmetric, never below ±5%
    # a 1% difference still gets the ±5% axis: it must not fill the panel
    learned = [r for r in records if r["condition"] == "learned"]
    small = [{**r, "value": 1.01 * r["value"]} for r in learned] + [{**r, "condition": "frozen"} for r in learned]
    lo, hi = plots.layer_bars(small, conditions=("learned", "frozen")).axes[1].get_ylim()
    assert (lo, hi) == (-5.0, 5.0)


def test_layer_bars_title_says_heads_only_for_per_head_sites(records):
    ffn = [{**r, "site": "ffn", "head_index": None} for r in records if r["head_index"] == 0]
    assert plots.layer_bars(ffn, "ffn").axes[0].get_title() == "final step, per layer"
    assert plots.layer_bars(records).axes[0].get_title() == "final step, per layer (mean over heads)"
    assert "heads" not in plots.trajectory_plot(ffn, "ffn").axes[0].get_title()
    assert "heads" in plots.trajectory_plot(records).axes[0].get_title()


def test_heatmap_colour_limits_exclude_the_first_probe(records):
    """The random-init probe would swamp the colour scale: limits are the 2nd and 98th percentile
    of the later probes' layer means, and the colorbar says so."""
    fig = plots.layer_heatmap(records)
    layer_means = {}
    for r in records:
        layer_means.setdefault((r["condition"], r["step"], r["layer"]), []).append(r["value"])
    later = [np.mean(v) for (c, s, l), v in layer_means.items() if s > 0]
    image = fig.axes[0].get_images()[0]
    assert image.get_clim() == pytest.approx(tuple(np.percentile(later, [2, 98])))
    colorbar = fig.axes[-1]
    assert "first probe excluded" in colorbar.get_ylabel()
    full = plots.layer_heatmap(records, percentiles=(0, 100)).axes[0].get_images()[0].get_clim()
    assert full == pytest.approx((min(later), max(later)))
    with pytest.raises(ValueError, match="percentiles"):
        plots.layer_heatmap(records, percentiles=(50, 10))
