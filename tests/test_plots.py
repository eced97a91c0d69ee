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
        plots.spectrum_plot({"bad": np.ones((2, 0))})  # [heads, D] is fine, D = 0 is not
    with pytest.raises(ValueError, match="spectra"):
        plots.cumulative_variance_plot({"bad": np.float64(3.0)})
    with pytest.raises(ValueError, match="heads"):
        plots.spectrum_plot({"a": np.ones((2, 4))}, heads="median")
    with pytest.raises(ValueError, match="convention"):
        plots.cumulative_variance_plot({"a": np.ones(4)}, convention="svd")
    with pytest.raises(ValueError, match="scale"):
        plots.layer_heatmap(records, scale="sqrt")
    with pytest.raises(ValueError, match="conditions"):
        plots.layer_bars(records, conditions="some")
    with pytest.raises(ValueError, match="reference"):
        plots.layer_bars(records, conditions="all", reference="missing")


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


def _mesh(ax):
    """The heatmap cells of a panel (a QuadMesh: the cells sit at their step and layer)."""
    (mesh,) = [c for c in ax.collections if hasattr(c, "get_clim")]
    return mesh


def test_heatmap_colour_limits_exclude_the_first_probe(records):
    """On a linear scale the random-init probe would swamp the colours: limits are the 2nd and 98th
    percentile of the later probes' layer means, the colorbar says so, and the clipped cells of
    the first probe say their value in text."""
    fig = plots.layer_heatmap(records, scale="linear")
    layer_means = {}
    for r in records:
        layer_means.setdefault((r["condition"], r["step"], r["layer"]), []).append(r["value"])
    later = [np.mean(v) for (c, s, l), v in layer_means.items() if s > 0]
    assert _mesh(fig.axes[0]).get_clim() == pytest.approx(tuple(np.percentile(later, [2, 98])))
    colorbar = fig.axes[-1]
    assert "first probe excluded" in colorbar.get_ylabel()
    first = [np.mean(v) for (c, s, l), v in sorted(layer_means.items()) if c == "learned" and s == 0]
    texts = [t for t in fig.axes[0].texts if t.get_gid() == "first-probe-value"]
    assert [t.get_text() for t in texts] == [f"{v:.3g}" for v in first]  # all above the clipped top
    assert [t.get_position() for t in texts] == [(0, layer) for layer in range(4)]
    full = _mesh(plots.layer_heatmap(records, percentiles=(0, 100), scale="linear").axes[0]).get_clim()
    assert full == pytest.approx((min(later), max(later)))
    with pytest.raises(ValueError, match="percentiles"):
        plots.layer_heatmap(records, percentiles=(50, 10))


def _ffn_like(steps=range(0, 121, 10), layers: int = 4) -> list[dict]:
    """An FFN-like PR per layer: 15 at the first probe, 2 at step 20, then a climb to 6 (the demo's)."""
    def pr(step, layer):
        return 15.0 + layer if step == 0 else 2.0 + 0.1 * layer if step <= 20 else 2.0 + 4.0 * (step - 20) / 100
    return [{**Record(s, s * 512, "ffn", l, None, "participation_ratio", pr(s, l)).as_dict(), "condition": c}
            for c in ("a", "b") for s in steps for l in range(layers)]


def test_heatmap_log_scale_shows_the_first_probe_and_the_evolution_after_it():
    """Values that span a factor of 4 or more (an FFN PR 15 → 2 → 6) get a log colour scale over
    their full range (default ``scale="auto"``): the first probe is not clipped, and the later
    values 2 → 6 still span over a third of the colours; a narrow range stays linear."""
    from matplotlib.colors import LogNorm

    fig = plots.layer_heatmap(_ffn_like(), "ffn")
    mesh = _mesh(fig.axes[0])
    assert isinstance(mesh.norm, LogNorm) and mesh.get_clim() == pytest.approx((2.0, 18.0))
    assert "log colour scale" in fig.axes[-1].get_ylabel()
    assert (np.log(6) - np.log(2)) / (np.log(18) - np.log(2)) > 1 / 3
    assert not [t for t in fig.axes[0].texts if t.get_gid() == "first-probe-value"]  # nothing clipped
    ticks = [t.get_text() for t in fig.axes[-1].get_yticklabels()]
    assert ticks == ["2", "5", "10"]  # plain round numbers, not 10^0
    narrow = [{**r, "value": 10 + r["value"] / 10} for r in _ffn_like()]  # 10.2 .. 11.8: linear
    assert not isinstance(_mesh(plots.layer_heatmap(narrow, "ffn").axes[0]).norm, LogNorm)
    assert isinstance(_mesh(plots.layer_heatmap(narrow, "ffn", scale="log").axes[0]).norm, LogNorm)


def _visible_ticks(ax, axis: str) -> list[float]:
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    ticks = ax.get_xticks() if axis == "x" else ax.get_yticks()
    return [float(t) for t in ticks if min(lo, hi) <= t <= max(lo, hi)]


@pytest.mark.parametrize("steps, expected", [
    (range(0, 121, 10), [0, 20, 40, 60, 80, 100, 120]),  # the demo's probes: every second one
    (range(0, 50, 10), [0, 10, 20, 30, 40]),             # few probes: each one
    (range(0, 1001, 50), [0, 250, 500, 750, 1000]),
])
def test_heatmap_ticks_are_regular_integers(steps, expected):
    """The step axis gets evenly spaced integer ticks that are probe steps, the layer axis every layer."""
    fig = plots.layer_heatmap(_ffn_like(steps), "ffn")
    for ax in fig.axes[:2]:
        assert _visible_ticks(ax, "x") == expected
        assert _visible_ticks(ax, "y") == [0, 1, 2, 3]
        assert ax.get_xlabel() == "step" and ax.get_ylabel() == "layer"


def _three(records):
    """``records`` plus a third condition "none" at 80% of "learned"."""
    return records + [{**r, "condition": "none", "value": 0.8 * r["value"]} for r in records
                      if r["condition"] == "learned"]


def test_trajectory_conditions_have_their_own_line_style_and_marker(records):
    """Two conditions with the same values (the demo's qk_norm and frozen γ): both stay visible,
    each with its own line style and marker, the later ones open."""
    same = records + [{**r, "condition": "twin"} for r in records if r["condition"] == "learned"]
    lines = {l.get_label(): l for l in plots.trajectory_plot(same).axes[0].get_lines()}
    conds = ["learned", "frozen", "twin"]
    assert len({lines[c].get_linestyle() for c in conds}) == 3
    assert len({lines[c].get_marker() for c in conds}) == 3
    assert np.array_equal(lines["learned"].get_ydata(), lines["twin"].get_ydata())
    assert lines["twin"].get_markerfacecolor() == "none" and lines["learned"].get_markerfacecolor() != "none"


def test_layer_bars_label_both_axes_and_compare_every_condition_to_the_reference(records):
    """``conditions="all"``: every other condition relative to the reference (default: the first),
    side by side per layer, and "layer" on both panels' x axes."""
    rows = _three(records)
    fig = plots.layer_bars(rows, conditions="all")
    bars_ax, diff_ax = fig.axes
    assert bars_ax.get_xlabel() == "layer" and diff_ax.get_xlabel() == "layer"
    final = [r for r in rows if r["step"] == 40]
    mean = lambda c, l: np.mean([r["value"] for r in final if r["condition"] == c and r["layer"] == l])  # noqa: E731
    expected = [100 * (mean(c, l) - mean("learned", l)) / mean("learned", l) for c in ("frozen", "none")
                for l in range(4)]
    assert [p.get_height() for p in diff_ax.patches] == pytest.approx(expected)
    assert diff_ax.get_title() == "each condition relative to learned"
    labels = [t.get_text() for t in fig.legends[1].get_texts()]
    assert labels[:2] == ["frozen vs learned", "none vs learned"]
    other = plots.layer_bars(rows, conditions="all", reference="none").axes[1]
    assert other.get_title() == "each condition relative to none" and len(other.patches) == 8
    # x labels also on the one-panel and the two-condition figures
    assert plots.layer_bars(records).axes[0].get_xlabel() == "layer"
    assert [ax.get_xlabel() for ax in plots.layer_bars(records, conditions=("learned", "frozen")).axes] == ["layer"] * 2


def test_layer_bars_mark_differences_within_step_to_step_noise():
    """A difference no larger than twice the step-to-step noise of the last probes is hatched;
    a larger one is not."""
    rows = []
    for step in range(0, 100, 10):
        jitter = 0.5 * (-1) ** (step // 10)  # alternating ±0.5 around a flat 20: noise ~0.7 per condition
        for layer in range(2):
            for cond, value in (("ref", 20 + jitter), ("near", 20.2 + jitter), ("far", 30 + jitter)):
                v = value if layer == 0 else 20 + jitter
                rows.append({**Record(step, step, "keys", layer, 0, "participation_ratio", v).as_dict(),
                             "condition": cond})
    fig = plots.layer_bars(rows, conditions="all")
    hatched = [bool(p.get_hatch()) for p in fig.axes[1].patches]
    # near: layer 0 +1% (within), layer 1 0% (within); far: layer 0 +50% (beyond), layer 1 0% (within)
    assert hatched == [True, True, False, True]
    assert "within step-to-step noise (≤ 2σ)" in [t.get_text() for t in fig.legends[1].get_texts()]


def test_bar_labels_never_read_minus_zero(records):
    """A difference that rounds to 0.0% reads "<0.1%" (or "0.0%" when exactly 0), never "-0.0%"."""
    learned = [r for r in records if r["condition"] == "learned"]
    tiny = learned + [{**r, "condition": "frozen", "value": r["value"] * (1 - 1e-5 * (r["layer"] != 0))}
                      for r in learned]
    labels = [t.get_text() for t in plots.layer_bars(tiny, conditions=("frozen", "learned")).axes[1].texts
              if t.get_text().endswith("%")]
    assert labels == ["0.0%", "<0.1%", "<0.1%", "<0.1%"]
    big = [{**r, "value": r["value"] * 0.5} if r["condition"] == "frozen" else r for r in records]
    labels = [t.get_text() for t in plots.layer_bars(big, conditions=("frozen", "learned")).axes[1].texts
              if t.get_text().endswith("%")]
    assert all(l.startswith("−") and "-" not in l for l in labels)  # a real minus sign


@pytest.fixture(scope="module")
def probe_spectra():
    """What a user gets from ``Probe(model).spectra(batch)``: ``{(site, layer): tensor}``, keys
    ``[kv_heads, d_head]`` (sv), FFN ``[d_ff]`` (eig), of a tiny Llama (2 layers, 2 KV heads of 8)."""
    from _tiny_models import batch, build

    import fastspec

    return fastspec.Probe(build("llama")).spectra(batch())


def _named_lines(ax) -> dict:
    return {l.get_label(): l for l in ax.get_lines() if not l.get_label().startswith("_")}


def test_spectrum_plots_take_probe_spectra_as_they_are(probe_spectra, tmp_path):
    """``spectrum_plot(probe.spectra(batch))`` and ``cumulative_variance_plot(...)`` render: one line
    per (site, layer), the mean over heads of the normalized per-head spectra shaded min–max over
    heads; keys are singular values (σ), FFN eigenvalues (λ), and the axis says so."""
    import torch

    assert probe_spectra[("keys", 0)].shape == (2, 8) and probe_spectra[("ffn", 0)].shape == (48,)
    keys = {k: v for k, v in probe_spectra.items() if k[0] == "keys"}
    fig = plots.spectrum_plot(keys)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "σ_k / Σσ" and "singular-value spectrum" in ax.get_title()
    lines = _named_lines(ax)
    assert set(lines) == {"keys layer 0", "keys layer 1"}
    k0 = keys[("keys", 0)].double()
    expected = (k0 / k0.sum(dim=1, keepdim=True)).mean(dim=0).numpy()
    assert np.allclose(lines["keys layer 0"].get_ydata(), expected)
    assert len(ax.collections) == 2  # a min–max band over heads per line
    _check_png(Path(plots.save(fig, tmp_path / "keys.png")))

    both = plots.spectrum_plot(probe_spectra).axes[0]
    assert both.get_ylabel() == "λ_k / Σλ (eig), σ_k / Σσ (sv)"
    assert set(_named_lines(both)) == {"keys layer 0 (σ)", "keys layer 1 (σ)", "ffn layer 0 (λ)", "ffn layer 1 (λ)"}
    ffn = {k: v for k, v in probe_spectra.items() if k[0] == "ffn"}
    assert plots.spectrum_plot(ffn).axes[0].get_ylabel() == "λ_k / Σλ"

    cum = plots.cumulative_variance_plot(probe_spectra)
    ax = cum.axes[0]
    lines = _named_lines(ax)
    assert {"keys layer 0 (σ²)", "keys layer 1 (σ²)", "ffn layer 0", "ffn layer 1"} <= set(lines)
    var = k0 ** 2  # sv: the variance per direction is σ², as the probe's rank@90
    expected = (torch.cumsum(var, dim=1) / var.sum(dim=1, keepdim=True)).mean(dim=0).numpy()
    assert np.allclose(lines["keys layer 0 (σ²)"].get_ydata(), expected)
    assert "σ²" in ax.get_ylabel()
    _check_png(Path(plots.save(cum, tmp_path / "cum.png")))


def test_spectrum_plots_draw_every_head_or_follow_a_given_convention(probe_spectra):
    keys = {k: v for k, v in probe_spectra.items() if k[0] == "keys"}
    ax = plots.spectrum_plot(keys, heads="all").axes[0]
    assert len(ax.get_lines()) == 4 and set(_named_lines(ax)) == {"keys layer 0 (2 heads)", "keys layer 1 (2 heads)"}
    assert len({l.get_color() for l in ax.get_lines()}) == 2  # a colour per (site, layer)
    assert len(plots.cumulative_variance_plot(keys, heads="all").axes[0].get_lines()) == 4 + 2  # + flat, 90%
    # a probe built with key_convention="eig" (or a user's sv module site) says so
    assert plots.spectrum_plot(keys, convention="eig").axes[0].get_ylabel() == "λ_k / Σλ"
    assert plots.spectrum_plot(probe_spectra, convention={"keys": "eig"}).axes[0].get_ylabel() == "λ_k / Σλ"
    k = np.arange(1, 33, dtype=float)
    sv = plots.spectrum_plot({"mine": k ** -1.0}, convention="sv").axes[0]
    assert sv.get_ylabel() == "σ_k / Σσ" and sv.get_title() == "singular-value spectrum, σ_k / Σσ"
    assert plots.spectrum_plot(k ** -1.0, normalize=False, convention="sv").axes[0].get_ylabel() == "σ_k"
