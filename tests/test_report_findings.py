"""The report's Findings (fastspec.report.findings): each condition's change from its own first probe
with its uncertainty over layers, conditions compared by their changes (paired by layer), how much
of a final gap was there before training, and verdicts that tell a clear difference from a
near-tie. Then the report's figures of a run folder (fastspec.report.write_report)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from fastspec import report  # noqa: E402
from fastspec.probe import Record  # noqa: E402
from fastspec.report import findings  # noqa: E402

ONE_SEED = {"train": {"seed": 0}}
T95_3DF = 3.182446305284263  # Student's t, 97.5th percentile, 3 degrees of freedom (4 layers)


def _study(curves: dict, *, layers: int = 4, steps=range(0, 101, 10), D: int = 32, protocol="eval",
           condition: bool = True) -> list[dict]:
    """Key-PR records: ``curves`` {condition: f(step, layer)} is each layer's head mean (two heads
    at ±0.2 around it), with the ``ghost_dims = D − PR`` records the probe writes."""
    rows = []
    for cond, f in curves.items():
        for step in steps:
            for layer in range(layers):
                for head, d in ((0, -0.2), (1, 0.2)):
                    v = f(step, layer) + d
                    for metric, value in (("participation_ratio", v), ("ghost_dims", D - v)):
                        row = Record(step, step * 64, "keys", layer, head, metric, value, protocol).as_dict()
                        rows.append({**row, "condition": cond} if condition else row)
    return rows


def _falls(start: float, by, *, wiggle: float = 0.0):
    """A layer's head mean: ``start + layer`` at step 0, moving linearly to ``start + layer + by(layer)``
    at step 100, plus ``wiggle·(−1)^layer`` at the last probe only."""
    return lambda s, l: start + l + by(l) * s / 100 + (wiggle * (-1) ** l if s == 100 else 0.0)


def test_each_condition_reports_its_change_from_its_own_start_with_an_uncertainty():
    """``X → Y (change ± SE, relative)``: the change is the mean over layers of each layer's
    last − first value, ± its standard error over layers (std with ddof=1 / √L)."""
    by = lambda l: -(1.0 + l)  # noqa: E731  layers fall by 1, 2, 3, 4
    f = findings(_study({"a": _falls(10, by)}), ONE_SEED)
    se = np.std([-1, -2, -3, -4], ddof=1) / 2
    (row,) = f.table
    assert row["change"] == pytest.approx(-2.5) and row["se"] == pytest.approx(se) and row["n_layers"] == 4
    assert f.lines() == [f"a: 11.50 → 9.00 (change −2.50 ± {se:.2f}, −21.7%), steps 0–100"]
    assert "change ± standard error over 4 layers" in f.header()
    assert f.finding == f"Key PR fell: 11.50 → 9.00, change −2.50 ± {se:.2f} (−21.7%) between steps 0 and 100."
    assert not f.comparisons
    assert any(c.startswith("±: standard error over layers") and "not seed-to-seed noise" in c for c in f.caveats)


def test_a_gap_that_was_there_at_step_0_is_reported_as_such():
    """The issue's case: "late" starts 2.00 lower and then changes exactly as "ref" does. Its final
    gap (−2.00) was all there at step 0, and by their changes the two are a tie: the findings
    must not read the gap as an effect of the condition."""
    by = lambda l: -(3.0 + l)  # noqa: E731
    f = findings(_study({"ref": _falls(20, by), "late": _falls(18, by)}), ONE_SEED)
    (c,) = f.comparisons
    assert (c["condition"], c["reference"]) == ("late", "ref")
    assert c["initial_gap"] == pytest.approx(-2.0) and c["final_gap"] == pytest.approx(-2.0)
    assert c["share_at_start"] == pytest.approx(1.0) and c["diff"] == pytest.approx(0.0, abs=1e-9)
    assert c["verdict"] == "tie"
    (line,) = f.comparison_lines()
    assert line.startswith("late vs ref: final gap −2.00 (−11.8%), of which −2.00 (100%) was there at step 0 "
                           "already; difference of changes 0.00 ± 0.00")
    assert line.endswith("indistinguishable at this run's precision.")
    assert "no condition differs from ref beyond this run's precision" in f.finding
    for out in (f.text(), f.markdown()):
        assert line in out and f.comparison_header() in out
    assert "larger than" not in f.text()  # no yes/no against a single spread


def test_the_share_of_the_final_gap_present_at_the_start():
    """87% of the gap there at step 0 (the demo's no_qk_norm vs qk_norm): the part that training
    added is the difference of changes."""
    ref = _falls(23.36, lambda l: -5.20)
    other = _falls(21.58, lambda l: -5.47)
    (c,) = findings(_study({"qk_norm": ref, "no_qk_norm": other}), ONE_SEED).comparisons
    assert c["initial_gap"] == pytest.approx(-1.78) and c["final_gap"] == pytest.approx(-2.05)
    assert c["share_at_start"] == pytest.approx(1.78 / 2.05)
    line = findings(_study({"qk_norm": ref, "no_qk_norm": other}), ONE_SEED).comparison_lines()[0]
    assert "of which −1.78 (87%) was there at step 0 already" in line
    # a gap that narrowed, and one that flipped sign
    narrowed = findings(_study({"r": _falls(10, lambda l: 0.0), "n": _falls(7, lambda l: 2.0)}), ONE_SEED)
    assert "smaller than the gap of −3.00 at step 0: the gap narrowed" in narrowed.comparison_lines()[0]
    flipped = findings(_study({"r": _falls(10, lambda l: 0.0), "n": _falls(9, lambda l: 2.0)}), ONE_SEED)
    assert "the gap at step 0 was −1.00, the other way" in flipped.comparison_lines()[0]


@pytest.mark.parametrize("margin, verdict, words", [
    (3.0, "clear", "a clear difference at this run's precision"),
    (2.2, "borderline", "the interval only just excludes 0: a weak difference at this run's precision"),
    (1.0, "within", "within its uncertainty: indistinguishable at this run's precision"),
])
def test_verdicts_weigh_the_difference_of_changes_against_its_interval(margin, verdict, words):
    """Per-layer differences of changes m ± s (alternating over 4 layers): SE = s·√(4/3)/2 and the
    95% half-width 3.18·SE = 1.84 s. m = 3 s: the interval excludes 0 by a margin; m = 2.2 s: only
    just; m = s: it contains 0."""
    s = 0.5
    ref = _falls(20, lambda l: -4.0)
    other = _falls(20, lambda l: -4.0 - margin * s, wiggle=-s)
    f = findings(_study({"ref": ref, "other": other}), ONE_SEED)
    (c,) = f.comparisons
    se = s * math.sqrt(4 / 3) / 2
    assert c["diff"] == pytest.approx(-margin * s) and c["se"] == pytest.approx(se)
    assert (c["ci_low"], c["ci_high"]) == pytest.approx((-margin * s - T95_3DF * se, -margin * s + T95_3DF * se))
    assert c["verdict"] == verdict
    (line,) = f.comparison_lines()
    assert line.endswith(words + ".")
    assert f"difference of changes −{margin * s:.2f} ± {se:.2f} (95% CI " in line
    apart = verdict in ("clear", "borderline")
    assert ("other differs from ref beyond this run's precision" in f.finding) == apart
    assert f.caveats[0].startswith("One seed per condition: a single seed cannot separate")  # kept


def test_a_tiny_margin_reads_as_a_near_tie():
    """The issue's "−2.05 … larger than the run's spread (2.04)": a 0.01 margin must not read as an
    effect. Here two conditions whose changes differ by 0.01 (under 1% of the reference's first
    value) in every layer, which a zero spread over layers would otherwise call clear."""
    ref = _falls(20, lambda l: -4.0)
    f = findings(_study({"ref": ref, "other": _falls(20, lambda l: -4.01)}), ONE_SEED)
    (c,) = f.comparisons
    assert c["diff"] == pytest.approx(-0.01) and c["verdict"] == "tie"
    assert f.comparison_lines()[0].endswith("a near-tie: indistinguishable at this run's precision.")
    assert findings(_study({"ref": ref, "other": _falls(20, lambda l: -4.01)}), ONE_SEED,
                    tie=0).comparisons[0]["verdict"] == "clear"  # tie=0: the interval alone decides
    # a small but real uncertainty keeps two significant digits instead of reading "± 0.00"
    wiggly = findings(_study({"ref": ref, "other": _falls(20, lambda l: -4.01, wiggle=0.004)}), ONE_SEED)
    assert "difference of changes −0.01 ± 0.0023 (95% CI" in wiggly.comparison_lines()[0]


def test_findings_work_on_a_users_own_records_and_on_streaming_ones():
    """No ``condition`` column: one run, no comparison. Streaming records: the same sentences, and
    the header says which protocol."""
    rows = _study({"x": _falls(10, lambda l: -2.0)}, condition=False)
    f = findings(rows)
    assert f.lines()[0].startswith("run: 11.50 → 9.50 (change −2.00 ± 0.00, −17.4%)") and not f.comparisons
    assert not any("seeds" in c for c in f.caveats)  # one run: nothing to compare, no seed caveat
    stream = _study({"a": _falls(10, lambda l: -2.0), "b": _falls(10, lambda l: -1.0)}, protocol="stream")
    f = findings(stream, ONE_SEED)
    assert "protocol: stream" in f.header() and len(f.comparisons) == 1
    assert f.comparisons[0]["diff"] == pytest.approx(1.0)
    assert findings(iter(stream), ONE_SEED).lines() == f.lines()  # any iterable of records


def test_a_reference_can_be_chosen_and_relative_changes_never_read_minus_zero():
    curves = {"a": _falls(10, lambda l: -2.0), "b": _falls(10, lambda l: -1e-6), "c": _falls(10, lambda l: 0.0)}
    f = findings(_study(curves), ONE_SEED, reference="c")
    assert [c["condition"] for c in f.comparisons] == ["a", "b"] and f.comparisons[0]["reference"] == "c"
    assert f.lines()[1] == "b: 11.50 → 11.50 (change 0.00 ± 0.00, <0.1%), steps 0–100"
    assert f.lines()[2] == "c: 11.50 → 11.50 (change 0.00 ± 0.00, 0.0%), steps 0–100"
    assert "−0.0" not in f.text()
    with pytest.raises(ValueError, match="reference"):
        findings(_study(curves), ONE_SEED, reference="z")


def test_one_layer_has_no_uncertainty_and_a_diverged_condition_is_left_out_of_the_comparisons():
    one = findings(_study({"a": _falls(10, lambda l: -1.0), "b": _falls(10, lambda l: -2.0)}, layers=1), ONE_SEED)
    assert one.lines()[1] == "b: 10.00 → 8.00 (change −2.00, −20.0%), steps 0–100"  # no ± from one layer
    assert one.comparisons[0]["verdict"] == "unmeasured"
    assert one.comparison_lines()[0].endswith("difference of changes −1.00: no uncertainty can be measured from "
                                              "one layer.")
    assert "With one layer the uncertainty of these changes cannot be measured" in one.finding
    rows = _study({"a": _falls(10, lambda l: -1.0), "b": _falls(10, lambda l: -2.0), "c": _falls(10, lambda l: -1.5)})
    rows = [{**r, "value": float("nan")} if r["condition"] == "b" and r["step"] >= 50 else r for r in rows]
    f = findings(rows, ONE_SEED)
    assert f.lines()[1] == "b: not finite (diverged), steps 0–100"
    assert [c["condition"] for c in f.comparisons] == ["c"]


# ------------------------------------------------------------------ the report's figures of a run folder

def _write_run(path: Path, rows: list[dict], spectra: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.json").write_text(json.dumps({"status": "completed", **ONE_SEED}))
    if spectra:
        np.savez(path / "spectra.npz", **spectra)
    return path


@pytest.fixture
def figures(monkeypatch):
    """The figures write_report saves, by file stem (saved as usual)."""
    from fastspec import plots

    seen, save = {}, plots.save

    def keep(fig, path):
        seen[Path(path).stem] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    return seen


def test_report_spectra_show_the_layer_where_the_conditions_differ_most(tmp_path, figures):
    """The FFN spectrum and cumulative-variance figures show the layer whose conditions differ
    most (by the PR of their spectra), say so in their titles, and not the deepest layer where
    they are identical."""
    k = np.arange(1, 65, dtype=float)
    spectra = {}
    for cond, steep in (("a", 1.0), ("b", 2.5)):
        for layer in range(4):
            spectra[f"{cond}/ffn/layer{layer}"] = k ** -(steep if layer == 1 else 1.5)
    rows = [{**r, "site": "ffn", "head_index": None} for r in _study({"a": _falls(5, lambda l: 1.0),
                                                                        "b": _falls(5, lambda l: 1.0)})
            if r["head_index"] == 0 and r["metric"] == "participation_ratio"]
    run = _write_run(tmp_path / "run", rows, spectra)
    text = report.write_report(run).read_text()
    for stem in ("spectrum_ffn", "cumvar_ffn"):
        title = figures[stem].axes[0].get_title()
        assert title.startswith("ffn layer 1, last probe (where the conditions differ most)") and "PR " in title
    assert "### ffn spectrum, layer 1, last probe (where the conditions differ most: PR" in text
    assert figures["spectrum_ffn"].axes[0].get_ylabel() == "λ_k / Σλ"


def test_report_plots_key_spectra_when_the_run_saved_them(tmp_path, figures):
    """Per-head key spectra ``[heads, d_head]`` in spectra.npz (singular values) get their own
    figures, labelled σ, the mean over heads per condition; the tail-fit table keeps to 1-D spectra."""
    k = np.arange(1, 17, dtype=float)
    spectra = {f"{c}/keys/layer{l}": np.stack([k ** -(0.5 + 0.5 * (c == "b") * l + 0.1 * h) for h in range(2)])
               for c in ("a", "b") for l in range(3)}
    spectra.update({f"{c}/ffn/layer{l}": k ** -1.5 for c in ("a", "b") for l in range(3)})
    run = _write_run(tmp_path / "run", _study({"a": _falls(10, lambda l: -1.0), "b": _falls(10, lambda l: -2.0)},
                                              layers=3), spectra)
    text = report.write_report(run).read_text()
    ax = figures["spectrum_keys"].axes[0]
    assert ax.get_ylabel() == "σ_k / Σσ" and ax.get_title().startswith("keys layer 2, last probe")
    assert {l.get_label() for l in ax.get_lines()} == {"a", "b"} and len(ax.collections) == 2  # head bands
    assert "σ²" in figures["cumvar_keys"].axes[0].get_ylabel()
    assert "### keys spectrum (mean over heads), layer 2" in text
    assert "| a/ffn/layer0 |" in text and "a/keys/layer0" not in text.split("## Spectral tail index")[1]


def test_report_layer_bars_compare_every_condition_with_the_first(tmp_path, figures):
    """With three conditions the lower panel shows both others against the first (the findings'
    reference), not just the first pair."""
    rows = _study({"a": _falls(10, lambda l: -1.0), "b": _falls(10, lambda l: -1.05), "c": _falls(10, lambda l: -3.0)})
    report.write_report(_write_run(tmp_path / "run", rows))
    fig = figures["key_pr_layers"]
    assert fig.axes[1].get_title() == "each condition relative to a"
    assert len(fig.axes[1].patches) == 2 * 4
    assert [ax.get_xlabel() for ax in fig.axes] == ["layer", "layer"]
