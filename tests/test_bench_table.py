"""The README benchmark table is generated from benchmarks/results/*.json and stays in sync; it is
rewritten only on request (``benchmarks/readme_table.py``, a developer tool outside the package),
by default in the repository's README whatever the current directory. Also the terminal tables
of ``fastspec bench`` and ``fastspec compare`` (:mod:`fastspec.bench.table`)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fastspec.bench.table import (
    bench_cells,
    bench_text,
    bound_label,
    compare_cells,
    compare_verdict,
    noise_pct,
    overhead_text,
    speedup_text,
    time_ratio_band,
)
from benchmarks.readme_table import (
    BEGIN,
    END,
    load_results,
    main,
    newest_gpu_runs,
    readme_block,
    splice,
    update_readme,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_readme_table_matches_result_files():
    assert update_readme(ROOT / "README.md", RESULTS, check=True), (
        "README.md's benchmark table is stale: run `python benchmarks/readme_table.py`")


def test_committed_results_name_device_date_and_versions():
    docs = load_results(RESULTS)
    assert docs, "no benchmark result committed in benchmarks/results/"
    for path, doc in docs:
        env = doc["environment"]
        assert {"device", "torch", "triton", "fastspec", "cuda", "driver"} <= set(env), path
        assert doc["date"][:4].isdigit() and doc["results"], path
        # the file name says which device produced it
        stem = path.stem.lower()
        assert (env["device"] == "cpu" and stem.startswith("cpu")) or env["device"] != "cpu", path


def test_every_readme_number_comes_from_a_result_file():
    block = readme_block(RESULTS, ROOT)
    shown, earlier = newest_gpu_runs(load_results(RESULTS))
    for path, doc in earlier:  # named, not tabulated
        assert f"`{path.relative_to(ROOT).as_posix()}`" in block.split("Earlier GPU runs")[1]
    for path, doc in shown:
        assert f"`{path.relative_to(ROOT).as_posix()}`" in block
        for r in doc["results"]:
            if "fastspec_s" in r:  # the size cell may carry a note, e.g. "(run with 16 layers to fit)"
                row = rf"\| {re.escape(r['suite'])} \| {re.escape(r['size'])}( \([^|]*\))? \| {re.escape(r['variant'])} \|"
                assert re.search(row, block), row
    for path, doc in newest_gpu_runs(load_results(RESULTS, "compare"))[0]:
        ran = [r for r in doc["results"] if "skipped" not in r]  # rows a time cap cut are not counted
        ok = sum(bool(r["within_2x_torch"]) for r in ran)
        assert f"{ok}/{len(ran)} (family, n, solver)" in block
        assert f"`{path.relative_to(ROOT).as_posix()}`" in block


def test_each_gpu_shows_its_newest_run_and_names_the_earlier_ones(tmp_path):
    # two runs of one GPU: the newer one's files are tabulated, the older ones only named; the
    # CPU files and another GPU's only run stay
    src = max(RESULTS.glob("nvidia-h100-*-1-headline.json"))
    doc = json.loads(src.read_text())
    for date in ("2026-12-01", "2026-12-09"):
        doc["date"] = date + doc["date"][10:]
        doc["results"][0]["variant"] = f"run-of-{date}"
        (tmp_path / f"nvidia-h100-{date}-1-headline.json").write_text(json.dumps(doc))
    cpu = next(p for p, d in load_results(RESULTS) if d["environment"]["device"] == "cpu")
    shutil.copy(cpu, tmp_path / cpu.name)
    block = readme_block(tmp_path, tmp_path)
    assert "| run-of-2026-12-09 |" in block and "| run-of-2026-12-01 |" not in block
    assert block.split("Earlier GPU runs")[1].count("`nvidia-h100-2026-12-01-1-headline.json`") == 1
    assert f"from `{cpu.name}`" in block
    shown, earlier = newest_gpu_runs(load_results(tmp_path))
    assert [p.name for p, _ in earlier] == ["nvidia-h100-2026-12-01-1-headline.json"]
    assert len(shown) == 2


def test_two_runs_of_one_gpu_on_one_day_are_told_apart(tmp_path):
    # one day, two leases: the morning run's commands (9 minutes apart: one run) are named as
    # earlier, the evening run's two commands tabulated
    src = max(RESULTS.glob("nvidia-h100-*-1-headline.json"))
    doc = json.loads(src.read_text())
    names = {"2026-12-01T09:46:00Z": "a-1", "2026-12-01T09:55:00Z": "a-3",
             "2026-12-01T18:00:00Z": "b-1", "2026-12-01T18:05:00Z": "b-2"}
    for date, name in names.items():
        doc["date"] = date
        (tmp_path / f"nvidia-h100-2026-12-01{name}.json").write_text(json.dumps(doc))
    shown, earlier = newest_gpu_runs(load_results(tmp_path))
    assert sorted(p.stem[-3:] for p, _ in shown) == ["b-1", "b-2"]
    assert sorted(p.stem[-3:] for p, _ in earlier) == ["a-1", "a-3"]


def test_update_rewrites_only_the_marked_block(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nabove\n{BEGIN}\nold table\n{END}\nbelow\n")
    assert update_readme(readme, results) is False
    text = readme.read_text()
    assert text.startswith(f"# title\nabove\n{BEGIN}\n") and text.endswith(f"{END}\nbelow\n")
    assert "old table" not in text and "| suite | size |" in text
    assert update_readme(readme, results, check=True) is True


def test_a_new_result_file_makes_the_readme_stale(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update_readme(readme, results)
    path, doc = load_results(results)[0]
    doc = {**doc, "date": "2099-01-01", "environment": {**doc["environment"], "device": "NVIDIA H100 80GB HBM3",
                                                        "driver": "580.65.06", "cuda": "13.0"}}
    (results / "h100-test.json").write_text(json.dumps(doc))
    assert update_readme(readme, results, check=True) is False
    update_readme(readme, results)
    assert "NVIDIA H100 80GB HBM3 (driver 580.65.06, CUDA 13.0)" in readme.read_text()


@pytest.mark.parametrize("text", ["no markers", f"{END}\n{BEGIN}\n", f"{BEGIN}{BEGIN}{END}"])
def test_splice_refuses_a_readme_without_one_block(text):
    with pytest.raises(ValueError, match="readme"):
        splice(text, "x")


# --------------------------------------------------------------- which README, and only on request
def _stale_results(tmp_path: Path) -> Path:
    """A copy of the committed results plus one more file: the README's table no longer matches."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    _, doc = load_results(results)[0]
    doc = {**doc, "environment": {**doc["environment"], "device": "NVIDIA H200", "driver": "580", "cuda": "13.0"}}
    (results / "h200-test.json").write_text(json.dumps(doc))
    return results


def test_the_default_readme_is_the_repository_one_whatever_the_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no README.md here: the old cwd-relative default failed or hit another file
    assert main(["--check"]) == 0
    assert f"{ROOT / 'README.md'} benchmark table is up to date" in capsys.readouterr().out
    # stale against other results: --check says so, names the repository README, and writes nothing
    before = (ROOT / "README.md").read_bytes()
    assert main(["--check", "--results", str(_stale_results(tmp_path))]) == 1
    assert f"{ROOT / 'README.md'} benchmark table is out of date" in capsys.readouterr().err
    assert (ROOT / "README.md").read_bytes() == before


def test_readme_flag_rewrites_that_file_with_the_results_next_to_it(tmp_path, monkeypatch, capsys):
    checkout = tmp_path / "checkout"
    shutil.copytree(RESULTS, checkout / "benchmarks" / "results")
    readme = checkout / "README.md"
    readme.write_text(f"# copy\n{BEGIN}\nold table\n{END}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--readme", str(readme), "--check"]) == 1
    assert "old table" in readme.read_text()  # --check never writes
    assert main(["--readme", str(readme)]) == 0
    assert f"{readme} benchmark table rewritten" in capsys.readouterr().out
    text = readme.read_text()
    assert "old table" not in text and "`benchmarks/results/" in text  # links relative to the README
    assert main(["--readme", str(readme), "--check"]) == 0


@pytest.mark.parametrize("text", ["# a README without the markers\n", f"{BEGIN}\n{BEGIN}\n{END}\n"])
def test_a_readme_without_one_block_is_a_one_line_error(tmp_path, capsys, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert main(["--readme", str(readme), "--results", str(RESULTS)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--readme: {readme} has no single {BEGIN}" in err
    assert readme.read_text() == text


def test_a_missing_results_folder_is_refused_not_rendered_as_no_results(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\nkept\n{END}\n")
    assert main(["--readme", str(readme)]) == 2  # default: tmp_path/benchmarks/results, absent
    assert "--results:" in capsys.readouterr().err and "kept" in readme.read_text()


# ------------------------------------------------------------------------- noise: the repeats' spread
def _timed(fast: tuple[float, float, float], base: tuple[float, float, float], *, repeats: int = 3,
           overhead: bool = False, **extra) -> dict:
    """A measured row with (min, median, max) seconds of each side, fields as the runner writes them."""
    row = {"suite": "train_step", "size": "L2", "variant": "emit_every=100", "baseline": "step without probe",
           "fastspec_s": fast[1], "baseline_s": base[1], "speedup": base[1] / fast[1], "repeats": repeats,
           "fastspec_min_s": fast[0], "fastspec_max_s": fast[2], "baseline_min_s": base[0],
           "baseline_max_s": base[2], "error_kind": "|Δloss| with probe", "fastspec_error": 0.0,
           "baseline_error": None, **extra}
    if overhead:
        row["overhead_pct"] = (fast[1] / base[1] - 1) * 100
    return row


def test_a_difference_inside_the_repeats_spread_prints_as_noise():
    # medians say −31.9%, but the slowest fastspec repeat is slower than the fastest baseline one
    row = _timed((0.60, 0.681, 1.05), (0.70, 1.0, 1.20), overhead=True)
    lo, hi = time_ratio_band(row)
    assert (lo, hi) == pytest.approx((0.60 / 1.20, 1.05 / 0.70))
    assert noise_pct(row) == pytest.approx(100 * max(1 - lo, hi - 1))
    assert overhead_text(row) == f"≈0 (±{noise_pct(row):.0f}%)" and "-" not in overhead_text(row)
    assert speedup_text(row) == f"≈1× (±{noise_pct(row):.0f}%)"
    assert bench_cells(row)["throughput"] == f"overhead ≈0 (±{noise_pct(row):.0f}%) of step"



def test_a_huge_spread_is_inconclusive_never_zero():
    """The issue's row: medians 1.09 s vs 98.5 ms (+1007%), one fastspec repeat faster than the
    slowest baseline one and one 40× slower (±3874%). The repeats overlap, but "≈0 (±3874%)"
    reads as "no overhead" beside medians eleven times apart: it says inconclusive instead."""
    row = _timed((0.090, 1.09, 3.7753), (0.095, 0.0985, 0.110), overhead=True)
    assert f"{noise_pct(row):.0f}" == "3874" and row["overhead_pct"] == pytest.approx(1006.6, abs=0.1)
    assert overhead_text(row) == "inconclusive (noisy: ±3874%)"
    assert speedup_text(row) == "inconclusive (noisy: ±3874%)"
    assert "≈" not in overhead_text(row) + speedup_text(row) + bench_cells(row)["throughput"]
    text = bench_text([row])
    assert "inconclusive (noisy: ±3874%)" in text and "≈0" not in text.split("\n\n")[0]
    assert "inconclusive" in text.split("\n\n")[-1]  # the legend below says what it means


@pytest.mark.parametrize("fast, base, noise", [
    ((0.60, 0.681, 1.05), (0.70, 1.0, 1.20), 50),      # the widest spread that still reads ≈0
    ((0.97, 1.00, 1.04), (0.98, 1.01, 1.03), 6),       # a tight one
])
def test_a_narrow_overlap_is_zero_a_wider_one_inconclusive(fast, base, noise):
    row = _timed(fast, base, overhead=True)
    assert (overhead_text(row), speedup_text(row)) == (f"≈0 (±{noise}%)", f"≈1× (±{noise}%)")
    wider = _timed((fast[0] * 0.98, fast[1], fast[2]), base, overhead=True)  # ±51%: past NOISY_PCT
    if noise == 50:
        assert overhead_text(wider) == speedup_text(wider) == "inconclusive (noisy: ±51%)"


@pytest.mark.parametrize("fast, base, overhead, speedup", [
    ((1.10, 1.20, 1.25), (0.95, 1.0, 1.05), "+20.0%", "0.83×"),   # every fastspec repeat slower
    ((0.40, 0.50, 0.55), (0.95, 1.0, 1.05), "-50.0%", "2.00×"),   # every one faster: a real speed-up
    ((0.50, 1.09, 3.80), (0.095, 0.0985, 0.11), "+1006.6%", "0.09×"),  # wide, but 0 is outside it
])
def test_a_difference_beyond_the_spread_prints_as_a_number(fast, base, overhead, speedup):
    row = _timed(fast, base, overhead=True)
    assert noise_pct(row) is None
    assert (overhead_text(row), speedup_text(row)) == (overhead, speedup)


def test_without_a_spread_the_number_is_printed_and_one_repeat_says_so():
    old = _timed((1.0, 1.1, 1.2), (0.5, 1.0, 1.5), overhead=True)
    for k in ("fastspec_min_s", "fastspec_max_s", "baseline_min_s", "baseline_max_s"):
        del old[k]  # a result file from before the spread was recorded: as it was printed then
    assert time_ratio_band(old) is None and overhead_text(old) == "+10.0%"
    single = _timed((1.1, 1.1, 1.1), (1.0, 1.0, 1.0), repeats=1, overhead=True)
    assert time_ratio_band(single) is None
    assert overhead_text(single) == "+10.0% (1 repeat)" and speedup_text(single) == "0.91× (1 repeat)"


# ------------------------------------------------------------------------ the terminal view of bench
def _eig(size: str, variant: str, **extra) -> dict:
    return {**_timed((0.9e-3, 1e-3, 1.1e-3), (1.9e-3, 2e-3, 2.1e-3)), "suite": "eigvalsh", "size": size,
            "variant": variant, "baseline": "torch.linalg.eigvalsh", "error_kind": "max rel err vs fp64",
            "fastspec_error": 4.5e-7, "baseline_error": 4.4e-7, "rate_unit": "µs/matrix",
            "fastspec_rate": 62.5, "baseline_rate": 125.0, **extra}


def test_bench_text_is_one_narrow_table_per_baseline_with_notes_below():
    long_reason = "eigvalsh backend 'cuda' unavailable: " + "no CUDA device visible to torch " * 4
    rows = [_eig("B16-n32-fp32", "auto"), _eig("B16-n32-fp32", "host", baseline_scale=16.0),
            {"suite": "eigvalsh", "size": "B16-n32-fp32", "variant": "auto", "baseline": "jax.numpy.linalg.eigvalsh",
             "skipped": "jax not installed"},
            {"suite": "eigvalsh", "size": "B4-n64-fp32", "variant": "auto", "baseline": "jax.numpy.linalg.eigvalsh",
             "skipped": "jax not installed"},
            {"suite": "eigvalsh", "size": "B16-n32-fp32", "variant": "cuda", "skipped": long_reason},
            {"suite": "eigvalsh", "size": "B4-n64-fp32", "variant": "cuda", "error": "RuntimeError: boom"},
            _timed((0.60, 0.681, 1.05), (0.70, 1.0, 1.20), overhead=True)]
    text = bench_text(rows)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, text
    assert lines[0] == "eigvalsh vs torch.linalg.eigvalsh · error: max rel err vs fp64"
    assert lines[1].split() == ["size", "variant", "fastspec", "baseline", "speedup", "µs/matrix", "error",
                                "(baseline)"]
    auto, host = lines[3].split(), lines[4].split()
    assert auto == ["B16-n32-fp32", "auto", "1", "ms", "2", "ms", "2.00×", "62.5", "vs", "125", "4.5e-07", "(4.4e-07)"]
    assert host[5] == "ms*" and "* timed on a slice of the batch and scaled to all of it (×16)" in text
    assert "  not run  jax.numpy.linalg.eigvalsh (2 cases) — jax not installed" in lines
    assert "  ERROR    B4-n64-fp32 cuda — RuntimeError: boom" in lines
    assert "skipped  variant cuda — eigvalsh backend 'cuda' unavailable:" in text
    assert " ".join(text.split()).count("no CUDA device visible to torch") == 4  # wrapped, not cut
    # the probe's overhead replaces the speedup column, and its noise is said as such
    i = lines.index("train_step vs step without probe · error: |Δloss| with probe")
    assert lines[i + 1].split() == ["size", "variant", "fastspec", "baseline", "overhead", "error"]
    assert "≈0 (±" in lines[i + 3] and "-31.9" not in text
    assert text.split("\n\n")[-1].startswith("≈1× / ≈0: within noise")  # the legend, last


def test_device_clock_times_are_marked_and_the_host_time_is_shown_beside_them():
    """A row timed on the device clock (the host's launch time hidden) says so in every view;
    one timed on events, like the GPU runs before the device clock, stays unmarked."""
    keys = {**_timed((20e-6, 21e-6, 22e-6), (60e-6, 64e-6, 70e-6)), "suite": "covariance", "size": "keys",
            "variant": "auto", "baseline": "torch", "clock": "device", "baseline_clock": "device",
            "fastspec_host_s": 131e-6, "baseline_host_s": 90e-6}
    cells = bench_cells(keys)
    assert cells["fastspec"] == "21 µs (device; host 131 µs)"
    assert cells["baseline time"] == "64 µs (device; host 90 µs)"
    half = {**keys, "baseline_clock": "events"}  # a baseline that synced: its launches stayed in
    assert bench_cells(half)["baseline time"] == "64 µs"
    text = bench_text([keys])
    assert text.splitlines()[3].split()[2:6] == ["21", "µs†", "64", "µs†"]
    assert text.split("\n\n")[-1].startswith("† device time")
    events = {**keys, "clock": "events", "baseline_clock": "events"}
    assert "†" not in bench_text([events]) and "device" not in bench_cells(events)["fastspec"]


# ------------------------------------------------------------------------- fastspec compare: the bound
def _acc(err: float, torch_err: float, family: str = "wishart") -> dict:
    from fastspec.bench.accuracy import within_bound

    return {"family": family, "n": 48, "batch": 4, "variant": "host", "fastspec_error": err,
            "torch_fp32_error": torch_err, "ratio": err / torch_err if torch_err else None,
            "within_2x_torch": within_bound(err, torch_err)}


def test_compare_labels_come_from_the_exact_errors_not_the_rounded_ratio():
    from fastspec.bench.case import EPS32

    assert bound_label(_acc(2e-7, 1e-7)) == "≤ 2×"
    floor = _acc(2.08e-7, 1e-7)  # ratio 2.08: within the bound only thanks to the 8·eps floor
    assert floor["within_2x_torch"] and bound_label(floor) == "≤ 2× + 8·eps"
    assert compare_cells(floor)["ratio"] == "2.080"
    over = _acc(2 * 1e-7 + 9 * EPS32, 1e-7)
    assert not over["within_2x_torch"] and bound_label(over) == "FAIL"
    assert bound_label(_acc(0.0, 0.0)) == "≤ 2×"


def test_compare_verdict_counts_every_case_that_ran():
    ok, floor = _acc(1e-7, 1e-7), _acc(2.08e-7, 1e-7, "powerlaw")
    capped = {"family": "zero", "n": 48, "batch": 4, "skipped": "time cap reached before this case started"}
    assert compare_verdict([ok, floor, capped]) == (True, (
        "PASS: all 2 cases within 2× torch.linalg fp32's error vs fp64 (+ 8·eps floor); "
        "1 within it only by the floor; 1 not run (time cap)"))
    raised = {"family": "spd", "n": 16, "batch": 4, "variant": "auto", "error": "RuntimeError: x"}
    passed, line = compare_verdict([ok, _acc(1e-5, 1e-7, "wilkinson"), raised])
    assert not passed and line.startswith("FAIL: 2 of 3 cases exceed 2× torch.linalg fp32's error")
    assert "wilkinson n=48 host ratio 100.000" in line and "spd n=16 auto raised" in line
    assert compare_verdict([capped]) == (True, "NO RESULT: no case ran; 1 not run (time cap)")
