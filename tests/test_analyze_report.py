"""The report of a ``fastspec analyze`` folder (fastspec.checkpoints.report): findings computed from the
records (key rank@90 post- vs pre-RoPE per layer, the lowest-rank heads, FFN PR by depth, a series'
changes and key-rank collapses, γ), report.md with its tables and plots, and ``fastspec report`` on
such a folder, with its records as parquet or as csv.

The folders are synthetic, with known numbers: a series "runs" of three checkpoints (steps 100,
200, 300) of a 3-layer model with 2 KV heads of d_head 8 and d_ff 48, in which

* layer 1's post-RoPE key rank@90 goes 7 → 6 → 2 (heads 3 and 1 at the end): it collapses at step
  300 (below half of 7), and its head 1 is the lowest-rank head;
* layer 0 has post-RoPE rank@90 5.5 and pre-RoPE 4.0 throughout (RoPE raises it by 1.5), layer 1
  at step 300 has pre-RoPE 2.5 (RoPE lowers it by 0.5);
* FFN PR per layer ends at 10, 4, 20 (from 12, 6, 20);
* γ_k CV goes 0.10 → 0.12 in layer 1.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from fastspec.checkpoints import report as areport  # noqa: E402
from fastspec.cli import main  # noqa: E402

# the analyze run writes parquet, or csv where pyarrow is absent (it is not a dependency)
FMT = "parquet" if importlib.util.find_spec("pyarrow") else "csv"
D_HEAD, D_FF = 8, 48
STEPS = (100, 200, 300)
# post-RoPE key rank@90 per (step, layer): the two KV heads
POST = {100: [[6, 5], [7, 7], [7, 6]], 200: [[6, 5], [6, 6], [7, 6]], 300: [[6, 5], [3, 1], [7, 6]]}
PRE = {100: [[4, 4], [7, 7], [6, 6]], 200: [[4, 4], [6, 6], [6, 6]], 300: [[4, 4], [3, 2], [6, 6]]}
FFN = {100: [12.0, 6.0, 20.0], 200: [11.0, 5.0, 20.0], 300: [10.0, 4.0, 20.0]}
GAMMA = {100: [0.10, 0.10, 0.10], 200: [0.10, 0.11, 0.10], 300: [0.10, 0.12, 0.10]}


def _model_rows(label: str, condition: str, step: int, post, pre=None, ffn=None, gamma=None) -> list[dict]:
    """One model's records as the analyze run writes them (key PR = rank@90 − 0.5 per head, with
    ``ghost_dims = D − PR``)."""
    base = {"step": step, "tokens_seen": 4096, "protocol": "eval", "condition": condition, "model": label}
    rows = []
    for site, table in (("keys", post), ("keys_prerope", pre)):
        for layer, heads in enumerate(table or []):
            for head, r90 in enumerate(heads):
                pr = r90 - 0.5
                for metric, value in (("rank_at_90", r90), ("participation_ratio", pr), ("ghost_dims", D_HEAD - pr)):
                    rows.append({**base, "site": site, "layer": layer, "head_index": head, "metric": metric,
                                 "value": float(value)})
    for layer, pr in enumerate(ffn or []):
        for metric, value in (("participation_ratio", pr), ("ghost_dims", D_FF - pr)):
            rows.append({**base, "site": "ffn", "layer": layer, "head_index": None, "metric": metric, "value": value})
    for layer, cv in enumerate(gamma or []):
        rows.append({**base, "site": "gamma_k", "layer": layer, "head_index": None, "metric": "gamma_cv", "value": cv})
    return rows


def _entry(label: str, condition: str, step: int, done: bool = True) -> dict:
    return {"label": label, "condition": condition, "step": step, "path": f"/ckpt/{label}", "kind": "hf",
            "model_type": "llama", "num_layers": 3, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": D_HEAD, "d_ff": D_FF, "sites": ["keys", "keys_prerope", "queries", "ffn"], "done": done,
            "times": {"load": 0.1, "tokenize": 0.2, "forward": 1.0, "probe": 0.1, "solve": 0.05, "write": 0.01}}


def _write(out: Path, rows: list[dict], entries: list[dict], *, fmt: str = FMT, status: str = "completed") -> Path:
    out.mkdir(parents=True)
    settings = {"tokens": 4096, "seq_len": 128, "batch_size": 4, "seed": 0, "text": "built-in corpus (test)",
                "dtype": "float32", "device": "cpu"}
    (out / "config.json").write_text(json.dumps({"command": "analyze", "status": status, "settings": settings,
                                                 "models": entries}))
    df = pd.DataFrame(rows)
    for col in ("tokens_seen", "layer", "head_index"):
        df[col] = df[col].astype("Int64")
    if fmt == "parquet":
        df.to_parquet(out / "records.parquet", index=False)
    else:
        df.to_csv(out / "records.csv", index=False)
    spectra = {f"{e['label']}/keys/layer{l}": np.sort(np.random.default_rng(l).random((2, D_HEAD)))[:, ::-1]
               for e in entries if e["done"] for l in range(3)}
    np.savez(out / "spectra.npz", **spectra)
    return out


def _series(out: Path, *, fmt: str = FMT, steps=STEPS, status: str = "completed") -> Path:
    rows, entries = [], []
    for step in STEPS:
        label = f"checkpoint-{step}"
        done = step in steps
        entries.append(_entry(label, "runs", step, done))
        if done:
            rows += _model_rows(label, "runs", step, POST[step], PRE[step], FFN[step], GAMMA[step])
    return _write(out, rows, entries, fmt=fmt, status=status)


def _single(out: Path) -> Path:
    rows = _model_rows("tiny-gpt2", "tiny-gpt2", 0, [[2, 8], [4, 4]], ffn=[9.6, 24.0])
    entry = {**_entry("tiny-gpt2", "tiny-gpt2", 0), "num_layers": 2, "model_type": "gpt2", "sites": ["keys", "ffn"]}
    return _write(out, rows, [entry])


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory) -> Path:
    return _series(tmp_path_factory.mktemp("analyze") / "out")


@pytest.fixture(scope="module")
def series_findings(series_dir):
    return areport.findings(areport.load_records(series_dir), json.loads((series_dir / "config.json").read_text()))


def test_key_rank_per_layer_states_post_vs_pre_rope_as_shares_of_d_head(series_findings):
    sec = series_findings.section("Key rank@90 per layer")
    first, last = sec.sentences  # the first and last checkpoint of the series, not the middle one
    assert first.startswith("checkpoint-100: post-RoPE key rank@90 averages 6.33/8 (79%) over layers; lowest in "
                            "layer 0 at 5.50/8 (69%), highest in layer 1 at 7.00/8 (88%); pre-RoPE averages 5.67/8 (71%).")
    assert last.startswith("checkpoint-300: post-RoPE key rank@90 averages 4.67/8 (58%) over layers; lowest in "
                           "layer 1 at 2.00/8 (25%), highest in layer 2 at 6.50/8 (81%); pre-RoPE averages 4.17/8 (52%).")
    # layer 0: 4.0 → 5.5 (+1.5), layer 1: 2.5 → 2.0 (−0.5), layer 2: 6.0 → 6.5 (+0.5)
    assert last.endswith("RoPE raises the rank most in layer 0 (4.00 → 5.50 of 8, +1.50) and lowers it most in "
                         "layer 1 (2.50 → 2.00 of 8, −0.50).")
    assert "RoPE raises the rank in every layer" not in first  # layer 1 is 7 = 7 at step 100
    assert first.endswith("RoPE raises the rank most in layer 0 (4.00 → 5.50 of 8, +1.50); 1 layer unchanged.")


def test_the_lowest_rank_heads_are_named_with_their_values(series_findings):
    low = series_findings.lowest_heads["checkpoint-300"]
    assert [(h["layer"], h["head"], h["rank_at_90"]) for h in low] == [(1, 1, 1.0), (1, 0, 3.0), (0, 1, 5.0),
                                                                       (0, 0, 6.0), (2, 1, 6.0)]
    assert low[0]["participation_ratio"] == pytest.approx(0.5)
    sentence = series_findings.section("Lowest-rank key heads").sentences[1]
    assert sentence.startswith("checkpoint-300 (lowest 5 of 6 KV heads): layer 1 head 1: rank@90 1.00/8 (12%), "
                               "PR 0.50; layer 1 head 0: rank@90 3.00/8 (38%), PR 2.50;")


def test_ffn_pr_by_depth_names_the_thirds_and_the_extreme_layers(series_findings):
    last = series_findings.section("FFN participation ratio by depth").sentences[1]
    assert last == ("checkpoint-300 (d_ff = 48): early (layer 0) PR 10.00 (20.8% of d_ff); middle (layer 1) PR 4.00 "
                    "(8.3% of d_ff); late (layer 2) PR 20.00 (41.7% of d_ff). Lowest in layer 1 at 4.00 (8.3% of "
                    "d_ff), highest in layer 2 at 20.00 (41.7% of d_ff).")


def test_a_series_reports_its_largest_change_and_the_step_where_a_layer_collapses(series_findings):
    (collapse,) = series_findings.collapses  # layers 0 and 2 do not move: not flagged
    assert {k: collapse[k] for k in ("condition", "layer", "step", "label", "initial", "value", "reason")} == {
        "condition": "runs", "layer": 1, "step": 300, "label": "checkpoint-300", "initial": 7.0, "value": 2.0,
        "reason": "half"}
    sec = series_findings.section("Series runs")
    assert sec.title == "Series runs (steps 100–300, 3 checkpoints)"
    assert ("Key rank collapses in layer 1 at step 300 (checkpoint-300): 7.00/8 (88%) at step 100 → 2.00/8 (25%) "
            "(collapse: layer-mean post-RoPE rank@90 below 50% of its value at step 100") in " ".join(sec.sentences)
    # key PR of layer 1: 6.5 → 1.5 is the largest relative change of any layer and quantity
    assert sec.sentences[0] == ("Largest relative change of one layer between steps 100 and 300: key PR (post-RoPE) "
                                "in layer 1, 6.50 → 1.50 (−5.00, −76.9%).")
    table = sec.tables[0]
    assert "| key rank@90 (post-RoPE) | 6.33 → 4.67 | −1.67 (−26.3%) | 1 | 7.00 → 2.00 | −5.00 (−71.4%) |" in table
    assert "| FFN PR | 12.67 → 11.33 | −1.33 (−10.5%) | 0 | 12.00 → 10.00 | −2.00 (−16.7%) |" in table
    assert "| γ_k CV | 0.100 → 0.107 | +0.007 (+6.7%) | 1 | 0.100 → 0.120 | +0.020 (+20.0%) |" in table
    assert series_findings.section("Q/K-norm").sentences == [
        "checkpoint-100: γ_k CV averages 0.100 over layers, 0.100 in every layer.",
        "checkpoint-300: γ_k CV averages 0.107 over layers, from 0.100 in layer 0 to 0.120 in layer 1."]


def test_collapse_below_a_quarter_of_d_head_counts_only_for_a_layer_that_started_above_it():
    """Layer 0: 3 → 1.75 at step 10 (not below half of 3, but below 2 = 25% of 8): a collapse, reported
    at step 10, the first where it holds, though it goes on falling to 1. Layer 1: 1.5 → 1.0 (below
    25% from the start, and never below half): none."""
    rows = []
    for step, heads in ((0, [[3, 3], [1.5, 1.5]]), (10, [[1.75, 1.75], [1.5, 1.5]]), (20, [[1, 1], [1, 1]]),
                        (30, [[1, 1], [1, 1]])):
        rows += _model_rows(f"c{step}", "s", step, heads)
    f = areport.findings(rows, {"models": [_entry(f"c{s}", "s", s) for s in (0, 10, 20, 30)]})
    assert [(c["layer"], c["step"], c["reason"], c["final"]) for c in f.collapses] == [(0, 10, "floor", 1.0)]
    assert ("Key rank collapses in layer 0 at step 10 (c10): 3.00/8 (38%) at step 0 → 1.75/8 (22%); at the last "
            "checkpoint (step 30) 1.00/8 (12%)") in " ".join(f.section("Series s").sentences)


def test_no_collapse_is_said_so():
    f = areport.findings(_model_rows("a", "s", 1, [[4, 4]]) + _model_rows("b", "s", 2, [[3, 3]]))
    assert f.collapses == []
    assert f.section("Series s").sentences[-1].startswith("No layer's key rank collapses between steps 1 and 2")


def test_report_md_and_plots_of_a_series(series_dir):
    path = areport.write_report(series_dir)
    text = path.read_text()
    assert path == series_dir / "report.md"
    assert "Status: **completed**. Models measured: 3." in text and "Partial report" not in text
    assert "Settings: tokens=4096, seq_len=128, batch_size=4, seed=0, dtype=float32, device=cpu. Text: built-in" in text
    assert ("| checkpoint-200 | runs | 200 | llama | 3 | 4 (KV 2) | 8 | 48 | yes | 0.10 | 0.20 | 1.00 | 0.10 | 0.05 | "
            "0.01 | 1.46 |") in text
    assert "### checkpoint-300 (series runs, step 300)" in text and "### checkpoint-200 (series" not in text
    # layer 1 of the last checkpoint
    assert "| 1 | 2.00/8 (25%) | 2.50/8 (31%) | −0.50 | 1.50 | 4.00 | 8.3% | 0.120 |" in text
    expected = {"key_rank90_heads_checkpoint-100", "key_rank90_heads_checkpoint-300", "key_rank90_layers",
                "ffn_pr_layers", "series_key_rank90_trajectory", "series_ffn_pr_trajectory",
                "series_runs_key_rank90_heatmap", "series_runs_ffn_pr_heatmap"}
    assert {p.stem for p in (series_dir / "plots").glob("*.png")} == expected
    for stem in expected:
        assert f"](plots/{stem}.png)" in text


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_fastspec_report_reads_an_analyze_folder(tmp_path, fmt, capsys):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    out = _series(tmp_path / "out", fmt=fmt)
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out / 'report.md'}"
    text = (out / "report.md").read_text()
    assert text.startswith("# fastspec analyze report")
    assert "Key rank collapses in layer 1 at step 300" in text
    from fastspec import report

    df = report.load_records(out)
    assert set(df["model"]) == {"checkpoint-100", "checkpoint-200", "checkpoint-300"}
    assert df["head_index"].dtype == "Int64" and df.loc[df["site"] == "ffn", "head_index"].isna().all()


def test_a_partial_run_says_so_and_names_the_missing_models(tmp_path):
    out = _series(tmp_path / "out", steps=(100, 200), status="interrupted")
    text = areport.write_report(out).read_text()
    assert ("**Partial report**: the run was interrupted; 2 of 3 models measured; missing: checkpoint-300."
            in text)
    assert "| checkpoint-300 | runs | 300 | llama | 3 | 4 (KV 2) | 8 | 48 | no |" in text
    assert "Series runs (steps 100–200, 2 checkpoints)" in text


def test_a_single_model_has_no_series_section_and_no_pre_rope_comparison(tmp_path):
    out = _single(tmp_path / "out")
    f = areport.findings(areport.load_records(out), json.loads((out / "config.json").read_text()))
    assert [s.title for s in f.sections] == ["Key rank@90 per layer (post-RoPE)", "Lowest-rank key heads",
                                             "FFN participation ratio by depth"]
    assert f.sections[0].sentences == [("tiny-gpt2: post-RoPE key rank@90 averages 4.50/8 (56%) over layers; lowest "
                                        "in layer 1 at 4.00/8 (50%), highest in layer 0 at 5.00/8 (62%).")]
    assert f.sections[2].sentences[0].startswith("tiny-gpt2 (d_ff = 48): early (layer 0) PR 9.60 (20.0% of d_ff); "
                                                 "late (layer 1) PR 24.00 (50.0% of d_ff).")
    assert f.collapses == [] and f.partial is None
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "Series" not in text and "pre-RoPE" not in text and "### tiny-gpt2\n" in text
    assert {p.stem for p in (out / "plots").glob("*.png")} == {"key_rank90_heads_tiny-gpt2", "key_rank90_layers",
                                                               "ffn_pr_layers"}


def test_dimensions_come_from_the_records_when_config_lacks_them():
    rows = _model_rows("m", "m", 0, [[2, 6]], ffn=[12.0])
    f = areport.findings(rows, {"models": [{"label": "m", "done": True}]})
    assert f.section("Key rank@90").sentences[0].startswith("m: post-RoPE key rank@90 averages 4.00/8 (50%)")
    assert "(d_ff = 48)" in f.section("FFN").sentences[0]


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"^out_dir: no records.parquet or records.csv in "):
        areport.write_report(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "records.csv").write_text("step,site\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fastspec report: config.json: not JSON (Expecting property name enclosed in double quotes at line 1) in {tmp_path}"
    (tmp_path / "config.json").write_text(json.dumps({"command": "analyze", "status": "completed"}))
    (tmp_path / "records.parquet").write_bytes(b"not parquet")
    assert main(["report", str(tmp_path)]) == 2  # read before records.csv, and not a parquet file
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    if importlib.util.find_spec("pyarrow"):
        assert err.startswith(f"fastspec report: records: cannot read {tmp_path / 'records.parquet'} (")
    else:
        assert err == f"fastspec report: records: reading {tmp_path / 'records.parquet'} needs pyarrow (pip install pyarrow)"


def test_the_figures_show_the_shares_of_d_head(tmp_path, monkeypatch):
    """The per-head heatmap of the last checkpoint has a post- and a pre-RoPE panel on a fixed 0–1
    scale with each cell's share written in it; the per-layer figure draws rank@90 / d_head, post
    and pre; the series heatmap puts layer 1's 7 → 6 → 2 at its steps."""
    from fastspec import plots

    seen, save = {}, plots.save
    monkeypatch.setattr(plots, "save", lambda fig, path: (seen.__setitem__(Path(path).stem, fig), save(fig, path))[1])
    areport.write_report(_series(tmp_path / "out"))
    fig = seen["key_rank90_heads_checkpoint-300"]
    post, pre = fig.axes[:2]
    assert (post.get_title(), pre.get_title()) == ("post-RoPE keys", "pre-RoPE keys")
    assert post.collections[0].norm.vmin == 0.0 and post.collections[0].norm.vmax == 1.0
    cells = {(t.get_position(), t.get_text()) for t in post.texts}
    assert ((1.0, 1.0), "12%") in cells and ((0.0, 2.0), "88%") in cells  # head 1 of layer 1: 1/8; head 0 of layer 2: 7/8
    lines = {l.get_label(): l.get_ydata() for l in seen["key_rank90_layers"].axes[0].get_lines()}
    np.testing.assert_allclose(lines["checkpoint-300, post-RoPE"], [5.5 / 8, 2 / 8, 6.5 / 8])
    np.testing.assert_allclose(lines["checkpoint-300, pre-RoPE"], [4 / 8, 2.5 / 8, 6 / 8])
    grid = {(t.get_position(), t.get_text()) for t in seen["series_runs_key_rank90_heatmap"].axes[0].texts}
    assert {((100.0, 1.0), "88%"), ((200.0, 1.0), "75%"), ((300.0, 1.0), "25%")} <= grid
    ffn = seen["ffn_pr_layers"].axes[0].get_lines()[0]
    np.testing.assert_allclose(ffn.get_ydata(), FFN[300])
