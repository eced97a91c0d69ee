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
    assert np.allclose(x, y)  # a flat spectrum lies on the diagonal


def test_plots_reject_bad_arguments(records):
    with pytest.raises(ValueError, match="x"):
        plots.trajectory_plot(records, x="time")
    with pytest.raises(ValueError, match="condition"):
        plots.layer_heatmap(records, condition="missing")
    with pytest.raises(ValueError, match="conditions"):
        plots.layer_bars(records, conditions=("learned", "missing"))
    with pytest.raises(ValueError, match="spectra"):
        plots.spectrum_plot({"bad": np.ones((2, 2))})
