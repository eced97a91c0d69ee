"""``fastspec demo`` end to end (--quick), its Ctrl-C behaviour, ``fastspec report``, and its parts."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

from fastspec.cli import main  # noqa: E402
from fastspec.demo import CONDITIONS, ModelSize, build_model  # noqa: E402
from fastspec.demo.data import eval_batch, split, stdlib_corpus  # noqa: E402
from fastspec.probe import Record  # noqa: E402
from fastspec.report import findings, run_findings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["demo", "--quick", "--out", str(out), "--no-progress"])
    return out, rc, printed.getvalue()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _key_table(report: str) -> dict[str, dict[str, str]]:
    """The key-rank table of report.md as {condition: {header: cell}}."""
    lines = report.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("## Key rank"))
    header_i = next(i for i in range(start, len(lines)) if lines[i].startswith("| condition"))
    cells = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]  # noqa: E731
    header = cells(lines[header_i])
    rows = {}
    for line in lines[header_i + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, cells(line)))
        rows[row["condition"]] = row
    return rows


def _png_ok(path: Path) -> bool:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    return path.stat().st_size > 5_000 and img.shape[0] >= 200 and img[..., :3].std() > 0.02


def test_quick_demo_writes_every_artifact(quick_run):
    out, rc, _ = quick_run
    assert rc == 0
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "completed"
    records = _read_jsonl(out / "records.jsonl")
    have = defaultdict(set)
    for r in records:
        have[r["condition"]].add((r["site"], r["metric"]))
    assert list(have) == list(CONDITIONS)
    for cond in CONDITIONS:
        assert {("keys", "participation_ratio"), ("ffn", "participation_ratio"), ("ffn", "utilization"),
                ("loss", "eval_loss"), ("loss", "train_loss")} <= have[cond]
        assert (("gamma_k", "gamma_cv") in have[cond]) == (cond != "no_qk_norm")
    # the frozen γ never moves: its CV stays 0; the learned one leaves 0
    cv = defaultdict(list)
    for r in records:
        if r["metric"] == "gamma_cv":
            cv[r["condition"]].append(r["value"])
    assert max(cv["qk_norm_frozen"]) == 0 and max(cv["qk_norm"]) > 0
    # key PR per (layer, head) lies in [1, d_head]
    d_head = config["model"]["d_model"] // config["model"]["heads"]
    prs = [r["value"] for r in records if r["site"] == "keys" and r["metric"] == "participation_ratio"]
    assert prs and all(1 <= v <= d_head for v in prs)
    with np.load(out / "spectra.npz") as z:  # FFN eigenvalues [d_ff], key singular values [kv_heads, d_head]
        assert {k.split("/")[0] for k in z.files} == set(CONDITIONS)
        assert {k.split("/")[1] for k in z.files} == {"ffn", "keys"}
        kv_heads = config["model"]["kv_heads"]
        for k in z.files:
            assert z[k].shape == ((config["model"]["d_ff"],) if "/ffn/" in k else (kv_heads, d_head)), k
            assert np.all(np.diff(z[k], axis=-1) <= 0), k
    pngs = sorted((out / "plots").glob("*.png"))
    stems = {p.stem for p in pngs}
    assert {"key_pr_trajectory", "key_pr_heatmap", "key_pr_layers", "ffn_pr_trajectory"} <= stems
    for site in ("ffn", "keys"):  # keys are the subject: their spectra are plotted too
        assert any(s.startswith(f"spectrum_{site}") for s in stems) and any(s.startswith(f"cumvar_{site}") for s in stems)
    assert all(_png_ok(p) for p in pngs)
    report = (out / "report.md").read_text()
    assert all(f"]({'plots/' + p.name})" in report for p in pngs)


def test_report_table_matches_records(quick_run):
    out, *_ = quick_run
    records = _read_jsonl(out / "records.jsonl")
    table = _key_table((out / "report.md").read_text())
    assert list(table) == list(CONDITIONS)
    for cond in CONDITIONS:
        # independent of fastspec.analysis: mean over heads per layer, then over layers
        per = defaultdict(list)
        for r in records:
            if r["condition"] == cond and r["site"] == "keys" and r["metric"] == "participation_ratio":
                per[(r["step"], r["layer"])].append(r["value"])
        steps = sorted({s for s, _ in per})
        layer_mean = {k: float(np.mean(v)) for k, v in per.items()}
        model_mean = {s: np.mean([v for (st, _), v in layer_mean.items() if st == s]) for s in steps}
        row = table[cond]
        assert float(row["initial PR"]) == pytest.approx(model_mean[steps[0]], abs=6e-4)
        assert float(row["final PR"]) == pytest.approx(model_mean[steps[-1]], abs=6e-4)
        assert float(row["min PR"]) == pytest.approx(min(model_mean.values()), abs=6e-4)
        assert int(row["final step"]) == steps[-1]
        layers = sorted({l for _, l in layer_mean})
        drop = {l: layer_mean[(steps[-1], l)] / layer_mean[(steps[0], l)] for l in layers}
        assert int(row["most collapsed layer"]) == min(drop, key=drop.get)
        losses = [r for r in records if r["condition"] == cond and r["metric"] == "eval_loss"]
        last = max(losses, key=lambda r: r["step"])["value"]
        assert float(row["eval loss"]) == pytest.approx(last, abs=6e-4)


def test_report_command_regenerates(quick_run):
    out, *_ = quick_run
    before = (out / "report.md").read_text()
    (out / "report.md").unlink()
    for p in (out / "plots").glob("*.png"):
        p.unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == before
    assert len(list((out / "plots").glob("*.png"))) >= 6


def test_report_survives_a_diverged_condition(tmp_path):
    """A condition whose activations went NaN (key PR NaN at every probe, an empty FFN
    covariance) still gets a report: its cells are blank, the healthy condition's are intact."""
    rows = []
    for cond, pr in (("ok", lambda s, l: 6.0 - s / 10 - l), ("diverged", lambda s, l: float("nan"))):
        for step in (0, 10, 20):
            for layer in (0, 1):
                for head in (0, 1):
                    rows.append({"step": step, "tokens_seen": step * 64, "site": "keys", "layer": layer,
                                 "head_index": head, "metric": "participation_ratio", "value": pr(step, layer),
                                 "condition": cond})
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    np.savez(tmp_path / "spectra.npz", **{"ok/ffn/layer1": np.arange(64, 0, -1.0) ** -1.0,
                                          "diverged/ffn/layer1": np.zeros(64)})
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    table = _key_table(report)
    assert table["ok"]["min at step"] == "20" and table["ok"]["most collapsed layer"] == "1"
    assert table["diverged"]["min PR"] == "–" and table["diverged"]["min at step"] == "–"
    assert "| diverged/ffn/layer1 | 64 | 0 | – | – |" in report
    assert "| ok/ffn/layer1 | 64 | 1.000 | 1.000 | 1.000 |" in report


def test_report_of_a_width_sweep_fits_and_plots_it(tmp_path):
    """Records with a ``width`` column (an FFN width study) get the width-fit table and figure."""
    rows = []
    for width in (64, 128, 256, 512):
        for layer in range(3):
            for metric, beta in (("participation_ratio", 0.8), ("entropy_rank", 0.9)):
                rows.append({"step": 0, "tokens_seen": 0, "site": "ffn", "layer": layer, "head_index": None,
                             "metric": metric, "value": (1 + 0.05 * layer) * width ** beta, "width": width})
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## Width fits" in report and (tmp_path / "plots" / "width_fits.png").is_file()
    assert "| participation_ratio | 0.800 |" in report and "| entropy_rank | 0.900 |" in report


def test_report_pairs_only_conditions_that_have_the_site(tmp_path):
    """A condition with FFN records only must not be picked for the key-PR difference panel."""
    rows = []
    for cond, sites in (("ffn_only", ("ffn",)), ("a", ("keys", "ffn")), ("b", ("keys", "ffn"))):
        for site in sites:
            for step in (0, 10):
                for layer in (0, 1):
                    rows.append({"step": step, "tokens_seen": step, "site": site, "layer": layer, "head_index": 0,
                                 "metric": "participation_ratio", "value": 4.0 + layer - step / 10,
                                 "condition": cond})
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "key_pr_layers.png").is_file()


@pytest.mark.slow
def test_ctrl_c_leaves_a_valid_partial_run(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Ctrl-C as a user's terminal delivers it: a test runner started in the background by a
    # non-interactive shell ignores SIGINT, and a child inherits that (its Ctrl-C would do nothing);
    # a handler of our own is reset to the default in the child at exec
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "fastspec", "demo", "--quick", "--steps", "100000",
                                 "--no-progress", "--out", str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            f = out / "records.jsonl"
            if f.is_file() and f.stat().st_size > 0 or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(1.0)  # a few training steps in
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read().decode()
    assert rc == 130, log
    assert "interrupted" in log
    assert json.loads((out / "config.json").read_text())["status"] == "interrupted"
    records = _read_jsonl(out / "records.jsonl")  # every line parses
    assert records and {r["condition"] for r in records} == {"qk_norm"}
    report = (out / "report.md").read_text()
    assert "**interrupted**" in report and "qk_norm" in _key_table(report)
    assert (out / "plots" / "key_pr_trajectory.png").is_file()
    with np.load(out / "spectra.npz") as z:  # the stopped model's spectra are kept too
        assert {k.rsplit("/", 1)[0] for k in z.files} == {"qk_norm/ffn", "qk_norm/keys"}


def test_demo_refuses_to_overwrite_a_run(quick_run, capsys):
    out, *_ = quick_run
    before = (out / "records.jsonl").read_bytes()
    assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastspec demo: --out: ") and err.count("\n") == 1
    assert (out / "records.jsonl").read_bytes() == before



def _unwritable_outs(tmp_path: Path) -> list[Path]:
    """Run folders no user can create, root included: one under a regular file and, where /proc
    is mounted, one in /proc (its top level takes no new names, whatever the permissions say)."""
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    return [afile / "run"] + ([Path("/proc/nope/run")] if Path("/proc/self").exists() else [])


def test_demo_refuses_an_out_folder_it_cannot_write_before_training(tmp_path, capsys, monkeypatch):
    """An --out that cannot be created or written is a one-line error naming --out, exit code 2,
    found before the header line and before anything trains (was: a header, then a traceback)."""
    import fastspec.demo.train as train

    monkeypatch.setattr(train, "run_demo", lambda *a, **kw: pytest.fail("trained before checking --out"))
    for out in _unwritable_outs(tmp_path):
        assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 2, out
        err = _one_line_error(capsys, "fastspec demo: --out: ")
        assert str(out) in err and not out.exists()
    assert (tmp_path / "file.txt").read_text() == "x"


def test_demo_out_check_leaves_no_trace(tmp_path, capsys, monkeypatch):
    """The check makes the missing folders and a probe file for real, then removes them: a run
    refused for another reason, or a library run_demo, finds the place as it was."""
    import fastspec.demo.train as train

    seen = []
    monkeypatch.setattr(train, "run_demo", lambda cfg, out, **kw: seen.append(sorted(tmp_path.rglob("*")))
                        or (out, "completed"))
    monkeypatch.setattr("fastspec.report.run_findings", lambda run_dir: None)
    out = tmp_path / "a" / "b" / "run"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    assert seen == [[]]  # checked, and nothing left behind for run_demo to find
    capsys.readouterr()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_demo_out_in_proc_is_one_line_without_traceback_in_a_real_process():
    """The issue's command line as a user runs it: nothing but the error line on stderr."""
    proc = subprocess.run([sys.executable, "-m", "fastspec", "demo", "--quick", "--no-progress", "--out",
                           "/proc/nope/run"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("fastspec demo: --out: ") and "Traceback" not in proc.stderr


def test_flags_build_the_config():
    from fastspec.cli import build_parser
    from fastspec.commands.demo import config_from_args

    args = build_parser().parse_args(["demo", "--quick", "--d-model", "96", "--layers", "3", "--steps", "5",
                                      "--device", "cpu", "--conditions", "no_qk_norm"])
    cfg = config_from_args(args)
    assert (cfg.size.d_model, cfg.size.layers, cfg.size.d_ff, cfg.steps) == (96, 3, 288, 5)
    assert cfg.conditions == ("no_qk_norm",)
    bad = build_parser().parse_args(["demo", "--d-model", "100", "--heads", "3"])
    with pytest.raises(ValueError, match="heads"):
        config_from_args(bad)
    with pytest.raises(ValueError, match="steps"):
        config_from_args(build_parser().parse_args(["demo", "--steps", "0"]))


def test_corpus_is_stdlib_bytes_and_eval_batch_is_fixed():
    text = stdlib_corpus(200_000)
    assert text.dtype == torch.uint8 and len(text) == 200_000
    assert b"def " in bytes(text[:50_000].tolist())
    train, held = split(text)
    assert len(train) + len(held) == len(text)
    a, b = eval_batch(held, 4, 64, seed=3), eval_batch(held, 4, 64, seed=3)
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (4, 64)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(0)


def test_conditions_share_initial_weights_and_differ_in_qk_norm():
    size = ModelSize(d_model=32, layers=2, heads=2, kv_heads=1, d_ff=64, seq_len=16)
    models = {c: build_model(c, size, 256, seed=7) for c in CONDITIONS}
    ref = dict(models["no_qk_norm"].named_parameters())
    for cond in ("qk_norm", "qk_norm_frozen"):
        params = dict(models[cond].named_parameters())
        for name, p in ref.items():
            assert torch.equal(p, params[name]), name
        norms = {n: p for n, p in params.items() if n.endswith(("q_norm.weight", "k_norm.weight"))}
        assert len(norms) == 2 * size.layers
        assert all(p.requires_grad == (cond == "qk_norm") for p in norms.values())
    assert not any("k_norm" in n for n in ref)
    with pytest.raises(ValueError, match="condition"):
        build_model("post_norm", size, 256, seed=0)


def test_core_import_stays_light():
    code = ("import sys, fastspec; heavy = [m for m in ('transformers', 'matplotlib', 'pandas', 'wandb', "
            "'lightning', 'tensorboard') if m in sys.modules]; assert not heavy, heavy; "
            "assert fastspec.analysis.to_frame([]).empty and 'pandas' in sys.modules")  # lazy submodule
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------------ findings (report.md and the terminal)

def _study(curves: dict, *, D: int = 16, layers: int = 4, steps=range(0, 101, 10), gamma: dict | None = None,
           seeds=(None,)) -> list[dict]:
    """Key-PR records of known whole-model means: ``curves`` {condition: f(step, layer)} is each
    layer's head mean (two heads at ±0.1 around it), with the ``ghost_dims = D − PR`` records the
    probe writes. ``gamma`` {condition: final CV}: γ records, CV linear in the step from 0
    (a condition with final CV 0 is frozen)."""
    rows = []
    for seed in seeds:
        for cond, f in curves.items():
            for step in steps:
                for layer in range(layers):
                    for head, d in ((0, -0.1), (1, 0.1)):
                        v = f(step, layer) + d
                        for metric, value in (("participation_ratio", v), ("ghost_dims", D - v)):
                            row = {**Record(step, step * 64, "keys", layer, head, metric, value, "eval").as_dict(),
                                   "condition": cond}
                            rows.append(row if seed is None else {**row, "seed": seed})
                    if gamma and cond in gamma:
                        for metric, value in (("gamma_cv", gamma[cond] * step / max(steps)),
                                              ("gamma_trainable", float(gamma[cond] > 0))):
                            rows.append({**Record(step, step * 64, "gamma_k", layer, None, metric, value,
                                                  "eval").as_dict(), "condition": cond})
    return rows


ONE_SEED = {"train": {"seed": 0}}


def test_findings_name_a_clear_collapse():
    rows = _study({"steady": lambda s, l: 12 + 0.5 * l, "collapse": lambda s, l: (12 + 0.5 * l) * (1 - 0.0075 * s)})
    f = findings(rows, ONE_SEED)
    # whole-model means: 12.75 throughout for steady; 12.75 -> 12.75 * 0.25 = 3.1875 for collapse, whose
    # layers change by -0.75 * (12 + 0.5 l) = -9, -9.375, -9.75, -10.125: mean -9.56, SE 0.24 over layers
    assert f.lines() == ["steady: 12.75 → 12.75 (change 0.00 ± 0.00, 0.0%), steps 0–100",
                         "collapse: 12.75 → 3.19 (change −9.56 ± 0.24, −75.0%), steps 0–100"]
    assert f.finding == ("Key PR fell in collapse (−9.56 ± 0.24) and did not change in steady (0.00 ± 0.00). "
                         "Largest change in collapse: 12.75 → 3.19 (−75.0%) between steps 0 and 100. Compared by "
                         "these changes, collapse differs from steady beyond this run's precision (below).")
    assert f.ceiling == ("Ceiling: a head's key PR is at most d_head = 16; the means sit at 80% of it at the "
                         "first probe and at 20–80% at the last.")
    assert f.caveats[0].startswith("One seed per condition: a single seed cannot separate")
    # paired by layer: the differences of changes are collapse's own, 95% t interval ±3.18 SE
    assert f.comparison_lines() == [(
        "collapse vs steady: final gap −9.56 (−75.0%), none of it there at step 0 (the same start); difference "
        "of changes −9.56 ± 0.24 (95% CI −10.33 to −8.79): a clear difference at this run's precision.")]
    assert not any("γ" in c for c in f.caveats)  # no γ records, no γ caveat
    rose = findings(_study({"flat": lambda s, l: 5.0 + l, "grows": lambda s, l: 5.0 + l + s / 50 + s * l / 500}),
                    ONE_SEED)
    # grows: layers rise by 2 + l / 5 -> mean 2.30, SE std(0, .2, .4, .6) / 2 = 0.13
    assert rose.finding.startswith("Key PR rose in grows (+2.30 ± 0.13) and did not change in flat (0.00 ± 0.00). "
                                   "Largest change in grows: 6.50 → 8.80 (+35.4%)")


@pytest.mark.parametrize("factor, verdict", [(1.005, "a near-tie: indistinguishable at this run's precision"),
                                             (1.5, "a clear difference at this run's precision")])
def test_findings_compare_conditions_by_their_changes(factor, verdict):
    """Two conditions whose changes differ by 0.5% in every layer: a near-tie (under 1% of the
    reference's first value), not an effect; 50% apart: a clear difference."""
    a = lambda s, l: 10 - 0.02 * s + 0.3 * l + 0.1 * (-1) ** (s // 10)  # noqa: E731
    f = findings(_study({"a": a, "b": lambda s, l: factor * a(s, l)}), ONE_SEED)
    (pair,) = [c for c in f.comparison_lines() if c.startswith("b vs a")]
    assert pair.endswith(verdict + ".")
    assert ("indistinguishable at this run's precision" in pair) == (factor < 1.1)


@pytest.mark.parametrize("final_cv, told_apart", [(0.04, False), (0.3, True)])
def test_findings_say_whether_gamma_moved(final_cv, told_apart):
    rows = _study({"learned": lambda s, l: 10 - s / 50, "frozen": lambda s, l: 10 - s / 50},
                  gamma={"learned": final_cv, "frozen": 0.0})
    (gamma,) = [c for c in findings(rows, ONE_SEED).caveats if "γ" in c]
    assert f"went 0.000 → {final_cv:.3f} in 100 steps" in gamma and "learned" in gamma
    assert ("learned and frozen γ cannot be told apart in this run" in gamma) == (not told_apart)
    assert gamma.startswith("γ moved") == told_apart


def test_findings_take_the_ceiling_from_the_config_when_the_records_lack_it():
    """Records without ``ghost_dims``/``utilization`` (a user's own) give no D: it comes from the
    run's ``config["model"]`` (``head_dim``, else ``d_model // heads``, for keys; ``d_ff`` for the
    FFN), and without one there is no ceiling sentence."""
    rows = [r for r in _study({"a": lambda s, l: 8.0}) if r["metric"] == "participation_ratio"]

    def ceiling(records, model=None):
        config = {**ONE_SEED, **({} if model is None else {"model": model})}
        return findings(records, config, site=records[0]["site"]).ceiling

    sentence = ("Ceiling: a head's key PR is at most d_head = {}; the means sit at {} of it at the first probe "
                "and at {} at the last.")
    assert ceiling(rows) is None
    assert ceiling(rows, {"head_dim": 32, "d_model": 64, "heads": 4}) == sentence.format(32, "25%", "25%")
    assert ceiling(rows, {"d_model": 64, "heads": 4}) == sentence.format(16, "50%", "50%")
    assert ceiling(rows, {"d_ff": 80}) is None  # the FFN's width is not the keys'
    ffn = [{**r, "site": "ffn"} for r in rows]
    assert ceiling(ffn, {"d_ff": 80, "head_dim": 32}) == (
        "Ceiling: a layer's ffn participation ratio is at most d_ff = 80; the means sit at 10% of it at the first "
        "probe and at 10% at the last.")
    assert ceiling(ffn, {"head_dim": 32}) is None


def test_findings_count_seeds():
    curves = {"a": lambda s, l: 8.0 - s / 100, "b": lambda s, l: 8.0}
    assert "One seed per condition" in findings(_study(curves), ONE_SEED).caveats[0]
    assert "not recorded" in findings(_study(curves)).caveats[0]
    three = findings(_study(curves, seeds=(0, 1, 2)), ONE_SEED).caveats
    assert not any("seed" in c and ("One seed" in c or "not recorded" in c) for c in three)
    assert findings([Record(0, 0, "ffn", 0, None, "participation_ratio", 3.0).as_dict()]) is None


def test_quick_demo_prints_the_reports_findings(quick_run):
    out, _, printed = quick_run
    f = run_findings(out)
    assert f.text() in printed  # the terminal summary is the report's findings, same numbers
    report = (out / "report.md").read_text()
    assert f.markdown() in report and report.index("## Findings") < report.index("## Key rank")
    for line in [*f.lines(), f.finding, f.comparison_header(), *f.comparison_lines(), f.ceiling, *f.caveats]:
        assert line in printed and line in report
    assert "d_head = 16" in f.ceiling and "One seed per condition" in f.caveats[0]
    assert "| condition | zone | layers |" in report and "| early | 0 |" in report  # one-layer zones read "0"


def _write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_tables_read_one_protocol_and_say_which(tmp_path):
    """Eval and streaming records of the same steps: the report's tables read the eval ones only."""
    rows = _study({"a": lambda s, l: 6.0 - s / 50})
    stream = [{**r, "protocol": "stream", "value": r["value"] + 50} for r in rows]
    _write_run(tmp_path, rows + stream)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    row = _key_table(report)["a"]
    assert (row["initial PR"], row["final PR"]) == ("6.000", "4.000")
    assert report.count("Records of one protocol (protocol: eval, Probe.measure on a fixed batch).") == 1
    assert "(protocol: eval, Probe.measure on a fixed batch):" in report  # the findings say it too


def test_report_shows_rank_at_90_when_recorded(tmp_path):
    rows = _study({"a": lambda s, l: 6.0 - s / 50})
    _write_run(tmp_path / "without", rows)
    assert main(["report", str(tmp_path / "without")]) == 0
    assert "final rank@90" not in _key_table((tmp_path / "without" / "report.md").read_text())["a"]
    r90 = [{**r, "metric": "rank_at_90", "value": float(3 + r["layer"])} for r in rows
           if r["metric"] == "participation_ratio"]
    _write_run(tmp_path / "with", rows + r90)
    assert main(["report", str(tmp_path / "with")]) == 0
    table = _key_table((tmp_path / "with" / "report.md").read_text())
    assert table["a"]["final rank@90"] == "4.500"  # mean over layers 0..3 of 3 + layer


# ------------------------------------------------------------------ command-line errors

def _one_line_error(capsys, prefix: str) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith(prefix) and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def test_report_of_a_missing_folder_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    _one_line_error(capsys, "fastspec report: run_dir: ")
    assert main(["report", str(tmp_path)]) == 2  # a folder without records.jsonl
    assert "no records.jsonl" in _one_line_error(capsys, "fastspec report: run_dir: ")



def test_report_into_a_folder_it_cannot_write_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """A run folder that can be read but not written (here its plots/ is a file, which stops root
    too): one line naming run_dir, exit code 2, checked before any plot is drawn (was: a
    traceback from the plots' mkdir)."""
    run = _write_run(tmp_path / "run", _study({"a": lambda s, l: 6.0 - s / 50}))
    (run / "plots").write_text("x")
    monkeypatch.setattr("fastspec.report.write_report", lambda *a: pytest.fail("wrote before checking"))
    assert main(["report", str(run)]) == 2
    err = _one_line_error(capsys, "fastspec report: run_dir: ")
    assert "plots" in err and (run / "plots").read_text() == "x" and not (run / "report.md").exists()


@pytest.mark.parametrize("flags, flag", [
    (["--heads", "3"], "--heads"),                       # 64 is not divisible by 3
    (["--d-model", "60", "--heads", "4"], "--heads"),   # head width 15: rotary embeddings need it even
    (["--kv-heads", "3"], "--kv-heads"),                 # 4 heads are not divisible by 3 KV heads
    (["--layers", "0"], "--layers"),
    (["--d-ff", "-4"], "--d-ff"),
    (["--steps", "0"], "--steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--probe-every", "0"], "--probe-every"),
    (["--eval-sequences", "0"], "--eval-sequences"),
    (["--seq-len", "100000"], "--seq-len"),              # longer than the held-out text
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--seed", "-1"], "--seed"),
    (["--conditions", "qk_norm", "qk_norm"], "--conditions"),
    (["--device", "tpu"], "--device"),
    (["--device", "not a device"], "--device"),
])
def test_demo_rejects_bad_flags_before_writing(tmp_path, capsys, flags, flag):
    out = tmp_path / "run"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out), *flags]) == 2
    _one_line_error(capsys, f"fastspec demo: {flag}: ")
    assert not out.exists()


@pytest.mark.parametrize("device, patch", [
    ("cuda", {"torch.cuda.is_available": lambda: False}),
    ("cuda:7", {"torch.cuda.is_available": lambda: True, "torch.cuda.device_count": lambda: 1}),
    ("mps", {"torch.backends.mps.is_available": lambda: False}),
])
def test_demo_rejects_an_unavailable_device_before_writing(tmp_path, capsys, monkeypatch, device, patch):
    for name, fn in patch.items():
        monkeypatch.setattr(name, fn)
    out = tmp_path / "run"
    assert main(["demo", "--quick", "--no-progress", "--device", device, "--out", str(out)]) == 2
    _one_line_error(capsys, "fastspec demo: --device: ")
    assert not out.exists()


def test_a_failing_run_is_marked_failed(tmp_path, capsys, monkeypatch):
    """An error during training: config.json says "failed" (never "running"); a user error (here a
    ValueError) ends in one line on stderr and exit code 1, anything else propagates."""
    import fastspec.demo.train as train

    def broken(condition, *args, **kwargs):
        raise ValueError("seq_len: the text is too short\nfor this run")

    monkeypatch.setattr(train, "_train_condition", broken)
    out = tmp_path / "run"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 1
    _one_line_error(capsys, "fastspec demo: failed (ValueError: seq_len: the text is too short for this run)")
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "failed" and config["error"].startswith("ValueError: seq_len")

    def bug(condition, *args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(train, "_train_condition", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo", "--quick", "--no-progress", "--out", str(tmp_path / "run2")])
    assert json.loads((tmp_path / "run2" / "config.json").read_text())["status"] == "failed"
