"""Analysis tables and fits (docs/fits.md, docs/protocols.md) against values computed by hand from the records."""
from __future__ import annotations

import math

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

from fastspec import analysis  # noqa: E402
from fastspec.probe import Record  # noqa: E402


def _records(values: dict, site="keys", metric="participation_ratio", condition=None, width=None):
    """values: {(step, layer, head): value} -> list of record dicts."""
    rows = []
    for (step, layer, head), v in values.items():
        r = Record(step, step * 100, site, layer, head, metric, float(v)).as_dict()
        if condition is not None:
            r["condition"] = condition
        if width is not None:
            r["width"] = width
        rows.append(r)
    return rows


def _study():
    """Two conditions, 3 layers × 2 heads, steps 0/10/20, with known per-layer means."""
    rng = np.random.default_rng(0)
    recs, truth = [], {}
    for cond, decay in (("a", 0.9), ("b", 0.6)):
        for step in (0, 10, 20):
            for layer in range(3):
                # layer 2 of condition b collapses most; step 10 is b's minimum overall
                f = {0: 1.0, 10: decay, 20: decay ** (0.5 if cond == "b" else 2)}[step]
                if layer == 2 and cond == "b":
                    f = f ** 3
                mean = 10.0 * f
                d = rng.uniform(0.5, 1.5)
                truth[(cond, step, layer)] = mean
                recs += _records({(step, layer, 0): mean - d, (step, layer, 1): mean + d}, condition=cond)
        recs.append({**Record(20, 2000, "loss", None, None, "eval_loss", 1.5 if cond == "a" else 2.5).as_dict(),
                     "condition": cond})
    return recs, truth


def test_to_frame_accepts_records_dicts_and_frames():
    recs = [Record(0, None, "keys", 1, 2, "participation_ratio", 3.0)]
    a = analysis.to_frame(recs)
    b = analysis.to_frame([r.as_dict() for r in recs])
    c = analysis.to_frame(a)
    for df in (a, b, c):
        assert list(df.loc[0, ["site", "layer", "head_index", "value", "condition"]]) == ["keys", 1, 2, 3.0, ""]
    assert analysis.to_frame([]).empty
    # files written before the head column was renamed still load
    old = {k: v for k, v in recs[0].as_dict().items() if k not in ("head_index", "protocol")} | {"head": 2}
    df = analysis.to_frame([old])
    assert df.loc[0, "head_index"] == 2 and "head" not in df.columns


def test_every_reader_of_records_goes_through_the_one_schema_in_record_py(monkeypatch):
    from fastspec.integrations import as_dicts
    from fastspec.probe import record

    rec = Record(0, None, "keys", 1, 2, "participation_ratio", 3.0)
    readers = {  # each reads a list of row dicts -> the records as dicts of the Record fields
        "as_dicts": as_dicts,
        "from_dict": lambda rows: [Record.from_dict(r).as_dict() for r in rows],
        "to_frame": lambda rows: _frame_rows(analysis.to_frame(rows)),
        "to_frame(DataFrame)": lambda rows: _frame_rows(analysis.to_frame(pd.DataFrame(rows))),
    }
    calls = []
    normalize = record.normalize
    monkeypatch.setattr(record, "normalize", lambda r: calls.append(r) or normalize(r))
    old = {k: v for k, v in rec.as_dict().items() if k not in ("head_index", "protocol")} | {"head": 2}
    for name, read in readers.items():
        assert read([old]) == [rec.as_dict()], name  # a file written before head_index and protocol
    assert len(calls) == 3  # as_dicts, from_dict and to_frame's rows; a DataFrame goes by record.conform
    # a legacy name registered in record.py alone reaches every reader
    monkeypatch.setitem(record.LEGACY_NAMES, "hd", "head_index")
    older = {k: v for k, v in old.items() if k != "head"} | {"hd": 2}
    for name, read in readers.items():
        assert read([older]) == [rec.as_dict()], name
    # nullable fields may be absent; the others may not, with one error everywhere
    bare = {"step": 5, "site": "loss", "metric": "eval_loss", "value": 1.5}
    for name, read in readers.items():
        assert read([bare]) == [Record(5, None, "loss", None, None, "eval_loss", 1.5).as_dict()], name
        with pytest.raises(ValueError, match=r"^records: missing fields \['value'\]"):
            read([{k: v for k, v in bare.items() if k != "value"}])


def test_record_head_is_a_deprecated_alias_of_head_index():
    rec = Record(0, None, "keys", 1, 2, "participation_ratio", 3.0)
    with pytest.warns(DeprecationWarning, match="head_index"):
        assert rec.head == 2


def _frame_rows(df) -> list[dict]:
    """The Record fields of each row of a ``to_frame`` table, as plain Python values."""
    rows = df[list(Record.__dataclass_fields__)].astype(object).to_dict("records")
    return [{k: None if v is pd.NA or v is None or (isinstance(v, float) and math.isnan(v)) else v
             for k, v in r.items()} for r in rows]


@pytest.mark.parametrize("bad, exc, name", [
    (42, TypeError, "records"), ([1, 2], TypeError, "records"), ([{"step": 0}], ValueError, "records")])
def test_to_frame_rejects_bad_input(bad, exc, name):
    with pytest.raises(exc, match=name):
        analysis.to_frame(bad)


def test_layer_means_and_trajectory_match_hand_computation():
    recs, truth = _study()
    lm = analysis.layer_means(recs)
    for _, r in lm.iterrows():
        assert r["value"] == pytest.approx(truth[(r["condition"], r["step"], r["layer"])], rel=1e-12)
    traj = analysis.trajectory(recs)
    assert list(dict.fromkeys(traj["condition"])) == ["a", "b"]  # run order kept
    for _, r in traj.iterrows():
        layer_vals = [truth[(r["condition"], r["step"], l)] for l in range(3)]
        assert r["mean"] == pytest.approx(np.mean(layer_vals))
        assert (r["min"], r["max"]) == pytest.approx((min(layer_vals), max(layer_vals)))
        assert r["tokens_seen"] == r["step"] * 100


def test_summary_table_initial_min_final_and_collapsed_layer():
    recs, truth = _study()
    table = analysis.summary_table(recs).set_index("condition")
    for cond in ("a", "b"):
        means = {s: np.mean([truth[(cond, s, l)] for l in range(3)]) for s in (0, 10, 20)}
        row = table.loc[cond]
        assert row["initial"] == pytest.approx(means[0])
        assert row["final"] == pytest.approx(means[20])
        assert row["min"] == pytest.approx(min(means.values()))
        assert row["min_step"] == min(means, key=means.get)
        drops = {l: truth[(cond, 20, l)] / truth[(cond, 0, l)] for l in range(3)}
        assert row["collapsed_layer"] == min(drops, key=drops.get)
    assert table.loc["b", "collapsed_layer"] == 2
    assert table.loc["b", "min_step"] == 10
    assert (table.loc["a", "eval_loss"], table.loc["b", "eval_loss"]) == (1.5, 2.5)


def test_summary_table_of_a_diverged_condition_has_no_minimum():
    recs, _ = _study()
    recs += _records({(s, l, 0): float("nan") for s in (0, 10) for l in range(3)}, condition="nan")
    table = analysis.summary_table(recs).set_index("condition")
    assert table.loc["b", "min_step"] == 10 and table.loc["b", "collapsed_layer"] == 2  # ints, not 10.0
    row = table.loc["nan"]
    assert pd.isna(row["min"]) and pd.isna(row["final"]) and row["final_step"] == 10
    assert pd.isna(row["min_step"]) and pd.isna(row["collapsed_layer"])


def test_layer_table_and_zones():
    recs, truth = _study()
    fin = analysis.layer_table(recs, which="final")
    assert list(fin.columns) == ["a", "b"]
    assert fin.loc[2, "b"] == pytest.approx(truth[("b", 20, 2)])
    zones = analysis.layer_zones(recs, n_zones=3)
    assert list(zones["zone"][:3]) == ["early", "middle", "late"]
    late_b = zones[(zones.condition == "b") & (zones.zone == "late")].iloc[0]
    assert late_b["ratio"] == pytest.approx(truth[("b", 20, 2)] / truth[("b", 0, 2)])
    assert len(analysis.layer_zones(recs, n_zones=10)) == 2 * 3  # at most one zone per layer
    with pytest.raises(ValueError, match="which"):
        analysis.layer_table(recs, which="middle")
    with pytest.raises(ValueError, match="site, metric"):
        analysis.layer_means(recs, site="ffn")


def _sweep(beta: float, widths=(64, 128, 171, 256, 320, 384, 448, 512), layers=6, noise=0.0, c=0.7):
    rng = np.random.default_rng(1)
    recs = []
    for w in widths:
        for layer in range(layers):
            v = math.exp(c) * w ** beta * (math.exp(rng.normal(0, noise)) if noise else 1.0)
            recs += _records({(100, layer, None): v}, site="ffn", metric="participation_ratio", width=w)
            recs += _records({(100, layer, None): v / w}, site="ffn", metric="utilization", width=w)
    return recs


@pytest.mark.parametrize("beta", [0.37, 0.8, 1.0])
def test_width_fits_recover_exact_power_law(beta):
    fit = analysis.width_fits(_sweep(beta), ["participation_ratio"], n_boot=50).iloc[0]
    assert abs(fit["beta"] - beta) < 0.01
    assert fit["beta"] == pytest.approx(beta, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12)
    assert fit["intercept"] == pytest.approx(0.7, abs=1e-9)
    # every layer identical: each bootstrap replicate is the same fit
    assert fit["ci_low"] == pytest.approx(beta, abs=1e-9) and fit["ci_high"] == pytest.approx(beta, abs=1e-9)


def test_width_fit_bootstrap_ci_covers_truth_under_layer_noise():
    fit = analysis.width_fits(_sweep(0.6, layers=16, noise=0.05), ["participation_ratio"], n_boot=400).iloc[0]
    assert abs(fit["beta"] - 0.6) < 0.03
    assert fit["ci_low"] < 0.6 < fit["ci_high"]
    assert fit["ci_high"] - fit["ci_low"] > 0
    assert fit["r2"] < 1.0


def test_utilization_slope_is_hard_rank_beta_minus_one():
    recs = _sweep(0.55, noise=0.02)
    hard = analysis.width_fits(recs, ["participation_ratio"], n_boot=0).iloc[0]
    util = analysis.utilization_slopes(recs, n_boot=0).set_index("metric").loc["utilization"]
    assert util["beta"] == pytest.approx(hard["beta"] - 1, abs=1e-9)


def test_width_fits_need_widths():
    recs = _sweep(0.5, widths=(128,))
    with pytest.raises(ValueError, match="width"):
        analysis.width_fits(recs)
    with pytest.raises(ValueError, match="width_col"):
        analysis.width_fits(_records({(0, 0, None): 1.0}, site="ffn"))


def test_tail_fits_recover_exponent_and_lambda_max():
    k = np.arange(1, 257, dtype=float)
    spectra = {"a1.5": 3.0 * k ** -1.5, "a0.8": k ** -0.8}
    tf = analysis.tail_fits(spectra).set_index("name")
    assert tf.loc["a1.5", "a"] == pytest.approx(1.5, abs=1e-9)
    assert tf.loc["a0.8", "a"] == pytest.approx(0.8, abs=1e-9)
    assert tf.loc["a1.5", "r2"] == pytest.approx(1.0, abs=1e-12)
    assert tf.loc["a1.5", "lambda_max"] == 3.0
    batched = analysis.tail_fits(np.stack([spectra["a1.5"][::-1], spectra["a0.8"]]))  # any order
    assert list(batched["a"]) == pytest.approx([1.5, 0.8], abs=1e-9)


def _two_protocols():
    """Eval and streaming records of the same steps, layers and heads: eval values 10 + layer − step/10,
    streaming values 100 higher (they measure other tokens; any average of the two is wrong)."""
    rows = []
    for protocol, offset in (("eval", 0.0), ("stream", 100.0)):
        for step in (0, 10, 20):
            for layer in range(3):
                for head in range(2):
                    v = 10.0 + layer - step / 10 + offset + 0.5 * head
                    rows.append({**Record(step, step * 100, "keys", layer, head, "participation_ratio", v,
                                          protocol).as_dict(), "condition": "a"})
    return rows


def test_tables_never_average_protocols():
    rows = _two_protocols()
    for protocol, offset in (("auto", 0.0), ("eval", 0.0), ("stream", 100.0)):
        lm = analysis.layer_means(rows, protocol=protocol)
        assert len(lm) == 9  # one row per (step, layer): no duplicates from the other protocol
        for _, r in lm.iterrows():
            assert r["value"] == pytest.approx(10.25 + r["layer"] - r["step"] / 10 + offset)
        table = analysis.summary_table(rows, protocol=protocol).iloc[0]
        assert (table["initial"], table["final"]) == pytest.approx((11.25 + offset, 9.25 + offset))
        assert analysis.layer_table(rows, protocol=protocol).loc[2, "a"] == pytest.approx(10.25 + offset)
        zones = analysis.layer_zones(rows, protocol=protocol)
        assert list(zones["initial"]) == pytest.approx([10.25 + offset, 11.25 + offset, 12.25 + offset])
        assert list(analysis.trajectory(rows, protocol=protocol)["mean"]) == pytest.approx(
            [11.25 + offset, 10.25 + offset, 9.25 + offset])
    assert analysis.resolve_protocol(rows) == "eval"
    assert analysis.resolve_protocol([r for r in rows if r["protocol"] == "stream"]) == "stream"
    with pytest.raises(ValueError, match="protocol"):
        analysis.layer_means(rows, protocol="nightly")
    with pytest.raises(ValueError, match="protocol"):
        analysis.layer_means(rows, protocol=None)  # no unlabelled records here


def test_unlabelled_records_are_a_group_of_their_own():
    """protocol None (a user's own records, older files) or "": used when it is the only group,
    never mixed with eval/stream records, selectable with protocol=None."""
    rows = _two_protocols()
    mine = [{**r, "protocol": p, "value": r["value"] + 1000} for r, p in zip(
        [r for r in rows if r["protocol"] == "eval"], [None, ""] * 27)]
    assert analysis.resolve_protocol(mine) is None
    assert analysis.summary_table(mine).iloc[0]["initial"] == pytest.approx(1011.25)  # None and "" are one group
    stream = [r for r in rows if r["protocol"] == "stream"]
    assert analysis.summary_table(stream + mine).iloc[0]["initial"] == pytest.approx(111.25)  # stream preferred
    assert analysis.summary_table(stream + mine, protocol=None).iloc[0]["initial"] == pytest.approx(1011.25)
    other = [{**r, "protocol": "nightly"} for r in mine]
    with pytest.raises(ValueError, match="protocol"):  # two groups, neither eval nor stream: ambiguous
        analysis.layer_means(mine + other)
    assert analysis.layer_means(mine + other, protocol="nightly")["value"].iloc[0] == pytest.approx(1010.25)


def test_width_fits_read_one_protocol():
    recs = _sweep(0.5)
    noisy = [{**r, "protocol": "stream", "value": r["value"] * (1 + 0.5 * (i % 3))} for i, r in enumerate(recs)]
    clean = [{**r, "protocol": "eval"} for r in recs]
    fit = analysis.width_fits(clean + noisy, ["participation_ratio"], n_boot=0).iloc[0]
    assert fit["beta"] == pytest.approx(0.5, abs=1e-9) and fit["r2"] == pytest.approx(1.0, abs=1e-12)


def test_layer_and_head_columns_stay_nullable_ints():
    rows = _two_protocols() + [Record(20, None, "loss", None, None, "eval_loss", 1.0).as_dict()]
    df = analysis.to_frame(rows)
    assert all(str(df[c].dtype) == "Int64" for c in ("step", "tokens_seen", "layer", "head_index"))
    assert df["layer"].isna().sum() == 1 and df["layer"].max() == 2
    assert str(analysis.layer_means(rows)["layer"].dtype) == "Int64"
    assert str(analysis.layer_table(rows).index.dtype) == "Int64"


@pytest.mark.parametrize("layers, n_zones, labels", [
    ([0, 1, 2, 3, 4, 5], 3, ["0-1", "2-3", "4-5"]),
    ([0, 1, 2, 3, 4], 3, ["0-1", "2-3", "4"]),      # a one-layer zone reads "4", not "4-4"
    ([0, 1], 3, ["0", "1"]),                        # fewer layers than zones: one zone per layer
    ([0, 1], 1, ["0-1"]),
    ([0, 2, 5], 1, ["0,2,5"]),                      # layers missing in between are not a range
])
def test_layer_zone_labels(layers, n_zones, labels):
    recs = _records({(s, l, 0): 5.0 + l for s in (0, 10) for l in layers})
    zones = analysis.layer_zones(recs, n_zones=n_zones)
    assert list(zones["layers"]) == labels
    names = {1: ["all"], 2: ["early", "late"], 3: ["early", "middle", "late"]}[len(labels)]
    assert list(zones["zone"]) == names


def test_site_dimension_from_ghost_dims_or_utilization():
    pr = _records({(0, l, h): 3.0 + l + h for l in range(2) for h in range(2)})
    ghost = [{**r, "metric": "ghost_dims", "value": 16 - r["value"]} for r in pr]
    util = [{**r, "metric": "utilization", "value": r["value"] / 16} for r in pr]
    assert analysis.site_dimension(pr + ghost) == 16
    assert analysis.site_dimension(pr + util) == 16
    assert analysis.site_dimension(pr) is None
    mixed = ghost[:2] + [{**r, "value": 32 - r["value"] + 16} for r in ghost[2:]]  # widths differ (a sweep)
    assert analysis.site_dimension(pr + mixed) is None


def _changes_study():
    """Per-layer head means of known changes: "a" starts at 10 + l and moves by −(1 + l);
    "b" starts 2 lower and moves by −(1 + l) − 0.5 + 0.1·(−1)^l."""
    recs = []
    for cond, start, extra in (("a", 0.0, lambda l: 0.0), ("b", -2.0, lambda l: -0.5 + 0.1 * (-1) ** l)):
        for step in (0, 10, 20):
            for layer in range(4):
                v0 = 10 + layer + start
                v = v0 if step == 0 else v0 - (1 + layer) * step / 20 + (extra(layer) if step == 20 else 0.0)
                recs += _records({(step, layer, 0): v - 0.3, (step, layer, 1): v + 0.3}, condition=cond)
    return recs


def test_layer_changes_are_per_layer_changes_with_their_standard_error():
    """Each layer's change (last − first probe) is one unit: change = mean over layers, se = std
    (ddof=1) / √L, and the 95% Student-t interval (3 degrees of freedom: t = 3.182)."""
    t = analysis.layer_changes(_changes_study()).set_index("condition")
    da = -np.array([1.0, 2.0, 3.0, 4.0])
    db = da - 0.5 + 0.1 * np.array([1, -1, 1, -1])
    for cond, d, first in (("a", da, 11.5), ("b", db, 9.5)):
        row = t.loc[cond]
        assert row["change"] == pytest.approx(d.mean())
        assert row["se"] == pytest.approx(d.std(ddof=1) / 2)
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((d.mean() - 3.1824463 * row["se"],
                                                                 d.mean() + 3.1824463 * row["se"]))
        assert row["initial"] == pytest.approx(first) and row["final"] == pytest.approx(first + d.mean())
        assert (row["initial_step"], row["final_step"], row["n_layers"]) == (0, 20, 4)
    one = analysis.layer_changes([r for r in _changes_study() if r["layer"] == 0]).set_index("condition")
    assert one.loc["a", "change"] == pytest.approx(-1.0) and math.isnan(one.loc["a", "se"])
    with pytest.raises(ValueError, match="level"):
        analysis.layer_changes(_changes_study(), level=95)


def test_compare_changes_pairs_the_layers_and_splits_the_final_gap():
    """b vs a: the difference of changes is paired by layer (diff_l = −0.5 ± 0.1), the final gap
    (−2.5) = the gap at the first probe (−2) + the difference of changes (−0.5): 80% was there
    before training."""
    t = analysis.compare_changes(_changes_study())
    assert list(t["condition"]) == ["b"] and list(t["reference"]) == ["a"]
    row = t.iloc[0]
    d = -0.5 + 0.1 * np.array([1, -1, 1, -1])
    assert row["diff"] == pytest.approx(-0.5) and row["se"] == pytest.approx(d.std(ddof=1) / 2)
    assert row["initial_gap"] == pytest.approx(-2.0) and row["final_gap"] == pytest.approx(-2.5)
    assert row["share_at_start"] == pytest.approx(0.8)
    assert row["ci_low"] < -0.5 < row["ci_high"] and row["n_layers"] == 4
    # the paired SE (0.058) is far smaller than the unpaired one: the layers' own spread cancels
    unpaired = np.hypot(*analysis.layer_changes(_changes_study())["se"])
    assert row["se"] < unpaired / 10
    flipped = analysis.compare_changes(_changes_study(), reference="b").iloc[0]
    assert flipped["condition"] == "a" and flipped["diff"] == pytest.approx(0.5)
    assert analysis.compare_changes([r for r in _changes_study() if r["condition"] == "a"]).empty
    with pytest.raises(ValueError, match="reference"):
        analysis.compare_changes(_changes_study(), reference="c")
