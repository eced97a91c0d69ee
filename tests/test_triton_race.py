"""The Triton configuration race (``benchmarks/triton_race.py``), the GPU kit's ``triton-race`` step.

* Its dry run (CPU, tiny, the kernels interpreted), end to end in its own process as the kit
  starts it: every candidate of each case's kernel checked and timed (CPU stand-ins, labelled),
  the JSON's schema, the rows marked ``dry_run``, the exit status the checks ask for.
* The checks catch what they are for: a candidate whose sums are off, one whose bits move from
  launch to launch, and one that raises, each fail, cannot win, and make the run exit 1.
* ``--merge`` replaces the table's rows of the same key, keeps the others and the table's
  ``format`` and ``about``, and refuses a dry run, a failed candidate and a name that is no
  candidate of its kernel.
* A time limit or SIGTERM keeps the cases that finished.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.cov_race import EMPTY  # the merge steps both races share
from fastspec.covariance import triton_configs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "triton_race.py"
RAW = "dry-keys-B1-T64-H2-D128-fp16-raw"


def _race():
    import benchmarks.triton_race as race  # a maintainer's tool, outside the package

    return race


def _env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture(autouse=True)
def _fresh_choices():
    triton_configs.forget()
    yield
    triton_configs.forget()


# ------------------------------------------------------------------------------------ the dry run
@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """The whole dry run, as the kit's dry run starts it (its own process, the interpreter)."""
    path = tmp_path_factory.mktemp("race") / "triton_race.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    return proc, json.loads(path.read_text()), time.monotonic() - t0


def test_dry_run_checks_and_times_every_candidate_and_marks_its_rows(dry):
    race = _race()
    proc, doc, seconds = dry
    out = proc.stdout
    assert doc["schema"] == race.SCHEMA and doc["kind"] == "triton-race" and doc["dry_run"] is True
    assert doc["arch"] == race.DRY_ARCH and doc["timing"].startswith("cpu stand-in") and doc["not_run"] == []
    assert {k: list(v) for k, v in doc["candidates"].items()} == {
        k: [c.name for c in cs] for k, cs in triton_configs.CANDIDATES.items()}
    assert [r["case"] for r in doc["results"]] == [c.name for c in race.DRY_CASES]
    failing = []
    for res, case in zip(doc["results"], race.DRY_CASES):
        names = [c.name for c in triton_configs.CANDIDATES[case.kernel]]
        assert (res["kernel"], res["dtype"], res["center"], res["shape"]) == (
            case.kernel, case.dtype, case.center, list(case.shape))
        assert list(res["candidates"]) == names and res["not_raced"] == {} and res["complete"]
        assert res["default"] == names[0]
        for name, r in res["candidates"].items():
            if not r["ok"]:
                failing.append((res["case"], name))
            if "error" in r:
                continue
            assert r["clock"] == "wall" and r["device_us"] > 0 and r["repeats"] == 1 and r["GBps"] > 0
            assert ("TFLOPs" in r) == (case.kernel == "ffn")
            assert ("pct_of_copy_bandwidth" in r) == (case.kernel == "keys")
            checks = r["check"]["inputs"]
            (masked,) = checks.values()  # the dry run's one input per kernel: strided, mask, NaN rows
            assert masked["mask"] and masked["strides"][-1] == 2
            assert masked["rejected"][0] == 1 and sum(masked["rejected"]) == 1  # the padded NaN row: not counted
            for v in checks.values():
                assert "steady" not in v["failed"] and "counts" not in v["failed"], (name, v)
                assert v["gram_tol"] == pytest.approx(race.TOL_FACTOR * v["torch_gram_rel_err"] + race.FLOOR)
        # the default is the launch every GPU run so far measured: it passes everywhere
        assert res["candidates"][res["default"]]["ok"], res["candidates"][res["default"]]
        assert res["winner"] is not None and res["candidates"][res["winner"]]["ok"]
        assert ("copy" in res) == (case.kernel == "keys")
    rows = doc["rows"]
    assert [(r["kernel"], r["dtype"], r["center"]) for r in rows] == [
        (c.kernel, c.dtype, c.center) for c in race.DRY_CASES]
    assert all(r["dry_run"] and r["arch"] == race.DRY_ARCH for r in rows)
    for r in rows:  # what the table reads, and the times behind the choice
        triton_configs._check_row(r)
        assert r["config"] in r["measured"]["device_us"]
    # the exit status is the checks': 1 with a failing candidate (each named), else 0
    assert proc.returncode == (1 if failing else 0), out[-3000:] + proc.stderr[-3000:]
    for case, name in failing:
        assert f"check: {name} fails on {case}" in out
    assert f"{RAW}: winner " in out and "time cap reached" not in out
    assert seconds < 60, seconds  # the kit's dry run runs it under a 25 s cap, on 2 CPU cores in CI


def test_the_dry_run_cannot_be_merged(dry, tmp_path, capsys):
    race = _race()
    _, doc, _ = dry
    path = tmp_path / "triton_race.json"
    path.write_text(json.dumps(doc))
    table = tmp_path / "triton_configs.json"
    table.write_text(triton_configs.TABLE.read_text())
    assert race.merge(path, table) == 2
    assert race.main(["--merge", str(path)]) == 2  # refused before the shipped table is read
    assert capsys.readouterr().err.count("is a dry run") == 2
    assert table.read_text() == triton_configs.TABLE.read_text()
    # a row marked on its own is refused too
    doc = {**doc, "dry_run": False}
    path.write_text(json.dumps(doc))
    assert race.merge(path, table) == 2


def test_the_summary_prints_each_cases_winner_and_every_candidate(dry, tmp_path):
    from benchmarks import gpu_summary

    _, doc, _ = dry
    (tmp_path / "triton_race.json").write_text(json.dumps({**doc, "not_run": ["later-case"]}))
    lines = [ln for ln in gpu_summary.summary(tmp_path, None) if ln.startswith("triton-race ")]
    assert len(lines) == len(doc["results"]) + 1
    for ln, res in zip(lines, doc["results"]):
        assert ln.startswith(f"triton-race {res['case']}: winner {res['winner']} (")
        for name, r in res["candidates"].items():
            assert name in ln
            assert (f"{name} ERROR" in ln) if "error" in r else (f"{name} {r['device_us']:.3g} µs" in ln)
            if not r["ok"]:
                assert f"{name}" in ln and ("FAILS" in ln or "ERROR" in ln)
    assert lines[-1] == "triton-race later-case: not run (time limit)"


# ------------------------------------------------------------------------------------ the checks
def _with_bad_candidates(monkeypatch):
    """The keys kernel's default beside three bad candidates: ``drift`` (G off by 1e-4 of its
    largest entry), ``moving`` (one entry an ulp apart on every other launch) and ``raises``."""
    race = _race()
    default = triton_configs.CANDIDATES["keys"][0]
    bad = [default._replace(name=n) for n in ("drift", "moving", "raises")]
    monkeypatch.setitem(triton_configs.CANDIDATES, "keys", (default, *bad))
    monkeypatch.setattr(triton_configs, "BY_NAME", {c.name: c for cs in triton_configs.CANDIDATES.values() for c in cs})
    real, calls = race._launch, []

    def launch(x, mask, center, cand):
        if cand.name == "raises":
            raise RuntimeError("out of resources: shared memory\nmore")
        p = real(x, mask, center, default)
        calls.append(cand.name)
        if cand.name == "drift":
            return p._replace(G=p.G + 1e-4 * p.G.abs().max())
        if cand.name == "moving" and calls.count("moving") % 2:
            G = p.G.clone()
            G[0, 0, 0] = torch.nextafter(G[0, 0, 0], torch.tensor(float("inf")))
            return p._replace(G=G)
        return p

    monkeypatch.setattr(race, "_launch", launch)
    return default


def test_a_wrong_unsteady_or_broken_candidate_fails_cannot_win_and_fails_the_run(monkeypatch, tmp_path, capsys):
    race = _race()
    default = _with_bad_candidates(monkeypatch)
    path = tmp_path / "triton_race.json"
    assert race.main(["--dry-run", "--case", RAW, "--json", str(path)]) == 1
    doc = json.loads(path.read_text())
    (res,) = doc["results"]
    cands = res["candidates"]
    assert cands[default.name]["ok"] and res["winner"] == default.name
    drift, moving, raises = cands["drift"], cands["moving"], cands["raises"]
    assert not drift["ok"] and {f.split(": ")[-1] for f in drift["check"]["failed"]} == {"gram"}
    assert max(v["gram_rel_err"] for v in drift["check"]["inputs"].values()) > 1e-5
    assert not moving["ok"] and {f.split(": ")[-1] for f in moving["check"]["failed"]} == {"steady"}
    assert raises == {"config": raises["config"], "lolo": True, "presplit": False, "ok": False,
                      "error": "RuntimeError: out of resources: shared memory"}
    # the failing ones were timed too (a wrong answer is no time to beat, but the time is a finding)
    assert "device_us" in drift and "device_us" in moving and "device_us" not in raises
    assert [r["config"] for r in doc["rows"]] == [default.name]
    assert race.pick(cands) == default.name
    out = capsys.readouterr().out
    for name in ("drift", "moving", "raises"):
        assert f"check: {name} fails on {RAW}" in out
    assert "ERROR RuntimeError: out of resources" in out


def test_the_fastest_passing_candidate_wins_and_a_cut_case_writes_no_row():
    race = _race()
    cands = {"a": {"ok": True, "device_us": 50.0}, "b": {"ok": False, "device_us": 10.0},
             "c": {"ok": True, "device_us": 40.0}, "d": {"ok": False, "error": "E"}}
    assert race.pick(cands) == "c"
    assert race.pick({"b": cands["b"], "d": cands["d"]}) is None
    res = {"case": "x", "kernel": "keys", "dtype": "bfloat16", "center": False, "default": "a",
           "candidates": cands, "winner": "c", "complete": True}
    row = race.table_row(res, 90, "H", "2026-12-01", False)
    assert row == {"arch": 90, "kernel": "keys", "dtype": "bfloat16", "center": False, "config": "c",
                   "measured": {"device": "H", "date": "2026-12-01", "case": "x",
                                "device_us": {"a": 50.0, "c": 40.0}, "default": "a"}}
    assert race.table_row({**res, "complete": False}, 90, "H", "d", False) is None
    assert race.table_row(res, 90, "H", "d", True)["dry_run"] is True


def test_flops_count_the_triangle_and_the_candidates_dots():
    race = _race()
    case = race.CASES[-1]
    four = next(c for c in triton_configs.CANDIDATES["ffn"] if c.lolo)
    assert race.flops(case, four) == 16384 * 8192 ** 2 * 4
    assert race.flops(case, four._replace(lolo=False)) == 16384 * 8192 ** 2 * 3


def test_the_check_inputs_are_adversarial():
    race = _race()
    for case in race.CASES:  # the GPU's inputs: built on CPU here, never launched
        inputs = race.check_inputs(case, torch.device("cpu"), dry=False)
        assert len(inputs) == 3 and all(x.dtype == torch.bfloat16 for _, x, _ in inputs)
        assert any(m is not None for _, _, m in inputs)  # a mask
        assert any(not x.is_contiguous() for _, x, _ in inputs)  # a view
        assert any(x.stride(-1) != 1 for _, x, _ in inputs)  # columns not contiguous
        assert any(bool(torch.isnan(x).any()) for _, x, _ in inputs)  # NaN rows
        far = inputs[0][1].double().reshape(-1, inputs[0][1].shape[-1])
        far = far[torch.isfinite(far).all(-1)]
        assert far.mean(0).abs().mean() > 10 * far.std(0).mean()  # channel means far above their spread
        assert all(triton_configs.kernel_of(x.shape[-1]) == case.kernel for _, x, _ in inputs)
    for case in race.DRY_CASES:  # one input with every trait; fp16 holding bf16 values, the bits a bf16 run sees
        ((_, x, mask),) = race.check_inputs(case, torch.device("cpu"), dry=True)
        assert mask is not None and not mask.all() and x.stride(-1) == 2 and bool(torch.isnan(x).any())
        v = x[torch.isfinite(x)]
        assert x.dtype == torch.float16 and torch.equal(v.to(torch.bfloat16).to(torch.float16), v)
        rows = x.double().reshape(-1, x.shape[-1])
        rows = rows[torch.isfinite(rows).all(-1)]
        assert rows[:, :4].mean(0).abs().mean() > 10 * rows[:, :4].std(0).mean()  # a few channels far
        assert rows[:, 4:].mean(0).abs().max() < 5  # the others the bench's


# ------------------------------------------------------------------------------------ merging
def _result_doc(rows: list[dict], ok: dict[str, bool]) -> dict:
    race = _race()
    results = [{"case": r["measured"]["case"], "candidates": {r["config"]: {"ok": ok.get(r["config"], True)}}}
               for r in rows]
    return {"schema": race.SCHEMA, "dry_run": False, "results": results, "rows": rows}


def _row(kernel: str, center: bool, config: str, dtype: str = "bfloat16", arch: int = 90) -> dict:
    return {"arch": arch, "kernel": kernel, "dtype": dtype, "center": center, "config": config,
            "measured": {"device": "NVIDIA H200", "date": "2026-12-01", "case": f"{kernel}-{center}-{dtype}",
                         "device_us": {config: 1.0}}}


def test_merge_replaces_same_key_rows_and_keeps_the_rest(tmp_path, capsys):
    race = _race()
    keys, ffn = triton_configs.CANDIDATES["keys"], triton_configs.CANDIDATES["ffn"]
    table = tmp_path / "triton_configs.json"
    shipped = json.loads(triton_configs.TABLE.read_text())
    held = [_row("keys", False, keys[0].name), _row("ffn", True, ffn[0].name, arch=80),
            _row("keys", True, keys[0].name, dtype="float16")]
    table.write_text(json.dumps({**shipped, "about": shipped["about"].rstrip() + EMPTY, "rows": held}))
    new = [_row("keys", False, keys[-1].name), _row("ffn", True, ffn[-1].name)]
    path = tmp_path / "race.json"
    path.write_text(json.dumps(_result_doc(new, {})))
    assert race.merge(path, table) == 0
    data = json.loads(table.read_text())
    assert data["format"] == shipped["format"] and EMPTY not in data["about"]
    assert data["about"].startswith(shipped["about"].replace(EMPTY, "")[:60])
    got = {(r["arch"], r["kernel"], r["dtype"], r["center"]): r["config"] for r in data["rows"]}
    assert got == {(90, "keys", "bfloat16", False): keys[-1].name,   # replaced
                   (80, "ffn", "bfloat16", True): ffn[0].name,        # another arch: kept
                   (90, "keys", "float16", True): keys[0].name,       # another dtype: kept
                   (90, "ffn", "bfloat16", True): ffn[-1].name}       # added
    assert len(data["rows"]) == 4
    rows = triton_configs.load_table(table)  # the table loads, keys unique
    assert len(rows) == 4
    assert "2 row(s) merged" in capsys.readouterr().out
    # the library reads it (a measured row for sm_90)
    triton_configs.forget()
    try:
        triton_configs.TABLE, saved = table, triton_configs.TABLE
        cand, why = triton_configs.choose("keys", 90, torch.bfloat16, False)
        assert cand.name == keys[-1].name and "measured row" in why
    finally:
        triton_configs.TABLE = saved
        triton_configs.forget()


@pytest.mark.parametrize("bad, message", [
    ("failed", "failed its checks in that race"),
    ("other-kernel", "is not a keys candidate"),
    ("schema", "is not a Triton configuration race"),
])
def test_merge_refuses_a_failed_or_unknown_candidate(bad, message, tmp_path, capsys):
    race = _race()
    table = tmp_path / "triton_configs.json"
    table.write_text(triton_configs.TABLE.read_text())
    config = triton_configs.CANDIDATES["ffn"][0].name if bad == "other-kernel" else triton_configs.CANDIDATES["keys"][1].name
    doc = _result_doc([_row("keys", False, config)], {config: bad != "failed"})
    if bad == "schema":
        doc["schema"] = "fastspec-cov-race-1"
    path = tmp_path / "race.json"
    path.write_text(json.dumps(doc))
    assert race.merge(path, table) == 2
    assert message in capsys.readouterr().err
    assert table.read_text() == triton_configs.TABLE.read_text()


# ------------------------------------------------------------------------------------ caps
def test_past_its_time_limit_the_race_records_the_cases_not_run(tmp_path, capsys):
    race = _race()
    path = tmp_path / "triton_race.json"
    assert race.main(["--dry-run", "--time-limit", "0", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["results"] == [] and doc["rows"] == [] and doc["not_run"] == [c.name for c in race.DRY_CASES]
    out = capsys.readouterr().out
    assert f"{RAW}: not run (time limit)" in out and "time cap reached" in out


def test_a_case_cut_inside_keeps_its_checks_and_writes_no_row(monkeypatch, tmp_path, capsys):
    race = _race()
    real = race.check_candidate
    clock = [0.0]

    def slow_check(*a, **k):  # each check takes "an hour": the limit passes after the first
        clock[0] += 3600
        return real(*a, **k)

    monkeypatch.setattr(race, "check_candidate", slow_check)
    monkeypatch.setattr(race, "_now", lambda: clock[0])
    path = tmp_path / "triton_race.json"
    assert race.run(path, 10.0, True, 0, [RAW]) == 0
    (res,) = json.loads(path.read_text())["results"]
    first = triton_configs.CANDIDATES["keys"][0].name
    assert list(res["candidates"]) == [first] and res["candidates"][first]["not_timed"] == "time limit"
    assert set(res["not_raced"]) == {c.name for c in triton_configs.CANDIDATES["keys"][1:]}
    assert not res["complete"] and res["winner"] is None
    assert json.loads(path.read_text())["rows"] == []
    assert "time cap reached" in capsys.readouterr().out


def test_sigterm_keeps_the_cases_that_finished(tmp_path):
    """What the kit's cap does to the step: SIGTERM once a case is in the JSON; the file stays
    valid, holds that case, and names the others as not run; a capped race is no failure."""
    race = _race()
    path = tmp_path / "triton_race.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--json", str(path)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and json.loads(path.read_text() or "{}").get("results"):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    doc = json.loads(path.read_text())
    names = [c.name for c in race.DRY_CASES]
    assert doc["results"] and [r["case"] for r in doc["results"]] + doc["not_run"] == names, out[-3000:]
    # -SIGTERM: it landed after the run; 1: a candidate of a finished case failed its checks
    failed = any(not r["ok"] for res in doc["results"] for r in res["candidates"].values())
    assert proc.returncode in ((0, 1, -signal.SIGTERM) if failed else (0, -signal.SIGTERM)), out[-3000:]
    assert not (tmp_path / "triton_race.json.tmp").exists()


@pytest.mark.slow
def test_warm_workers_fill_the_cache_before_the_checks(tmp_path):
    """``--jobs``: the workers run each candidate once (here interpreted: nothing to compile, the
    same code path); the race then checks and times as without them, each candidate's warm-up
    recorded."""
    path = tmp_path / "triton_race.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--jobs", "2", "--case", RAW, "--json", str(path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    doc = json.loads(path.read_text())
    (res,) = doc["results"]
    assert doc["warm_jobs"] == 2 and res["warm_wait_s"] >= 0
    assert all(r["warm"].startswith("ok in ") for r in res["candidates"].values()), res["candidates"]
    assert proc.returncode == (0 if all(r["ok"] for r in res["candidates"].values()) else 1), proc.stdout[-3000:]


def test_bad_arguments_are_refused(capsys):
    race = _race()
    for argv, message in ((["--dry-run"], "--json FILE is required"),
                          (["--json", "x.json", "--time-limit", "-1"], "--time-limit"),
                          (["--json", "x.json", "--jobs", "-2"], "--jobs"),
                          (["--json", "x.json", "--case", RAW], "is not a GPU case")):
        with pytest.raises(SystemExit) as e:
            race.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_candidate_that_fails_only_at_the_full_size_is_found_and_the_others_timed(monkeypatch, tmp_path):
    race = _race()
    default = triton_configs.CANDIDATES["keys"][0]
    big = default._replace(name="big")
    monkeypatch.setitem(triton_configs.CANDIDATES, "keys", (default, big))
    monkeypatch.setattr(triton_configs, "BY_NAME", {c.name: c for cs in triton_configs.CANDIDATES.values() for c in cs})
    real = race._launch

    def launch(x, mask, center, cand):
        if cand.name == "big" and x.shape[1] == race.DRY_CASES[0].T:  # the timed input only
            raise RuntimeError("out of resources: shared memory")
        return real(x, mask, center, default)

    monkeypatch.setattr(race, "_launch", launch)
    path = tmp_path / "triton_race.json"
    assert race.run(path, None, True, 0, [RAW]) == 1
    (res,) = json.loads(path.read_text())["results"]
    assert res["candidates"]["big"]["check"]["ok"] and not res["candidates"]["big"]["ok"]
    assert res["candidates"]["big"]["error"] == "at the full size: RuntimeError: out of resources: shared memory"
    assert res["winner"] == default.name and "device_us" in res["candidates"][default.name]
