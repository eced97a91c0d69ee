"""The covariance route race (``benchmarks/cov_race.py``), the GPU kit's ``cov-race`` step.

* Its dry run (CPU, tiny, the Triton routes interpreted) lists every route, raced or with the
  reason it cannot run here, checks each raced one exact, and marks its rows ``dry_run``.
* The checks catch what they are for: an inexact route (float32-sized errors in ``G``) and a
  nondeterministic one fail, and cannot win.
* ``--merge`` refuses a dry run, replaces a table row of the same key, keeps a table row whose
  route ties with the winner, drops a row the new ones overlap, and writes a table that
  ``routes.load_table`` loads.
* A time limit or SIGTERM keeps the shapes that finished.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastspec.covariance import routes

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _race():
    import benchmarks.cov_race as race  # a maintainer's tool, outside the package

    return race


@pytest.fixture(autouse=True)
def _fresh_choices():
    routes.forget()
    yield
    routes.forget()


# ------------------------------------------------------------------------------------ the dry run
def test_dry_run_lists_every_route_checks_the_raced_ones_and_marks_its_rows(tmp_path, capsys):
    race = _race()
    path = tmp_path / "cov_race.json"
    assert race.main(["--dry-run", "--json", str(path)]) == 0, capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["schema"] == race.SCHEMA and doc["dry_run"] is True and doc["timing"].startswith("cpu stand-in")
    assert [r["shape"] for r in doc["results"]] == [s.name for s in race.DRY_SHAPES] and doc["not_run"] == []
    for res in doc["results"]:
        raced, why_not = set(res["routes"]), res["not_raced"]
        assert raced | set(why_not) == set(routes.ROUTES) and not raced & set(why_not)  # every route, once
        assert "blocked" in raced and all(why_not.values())
        assert "dmma" in why_not  # a CUDA kernel: never on CPU
        # the checked input's mask and NaN rows: one row rejected in head 0, the padded NaN not counted
        assert res["reference"]["rejected"] == [1, 0]
        for name, r in res["routes"].items():
            assert r["ok"], (name, r)
            assert r["check"]["n"] == res["reference"]["n"] and r["check"]["rejected"] == [1, 0]
            assert r["check"]["gram_rel_err"] <= r["check"]["gram_tol"] and r["check"]["sv_rel_err"] <= 1e-8
            for part in ("partials", "update"):
                assert r[part]["launches"] is None and r[part]["clock"] == "wall" and r[part]["device_us"] > 0
        assert res["winner"] in raced
    rows = [routes.Row.from_json(r) for r in doc["rows"]]
    routes.check_rows(rows)
    assert len(rows) == len(race.DRY_SHAPES) and all(r.measured["dry_run"] for r in rows)
    out = capsys.readouterr().out
    assert "dry-B2-T16-S2-D32-fp16: winner " in out and "time cap reached" not in out
    # and --merge will not take it
    table = tmp_path / "routes.json"
    table.write_text(routes.TABLE.read_text())
    assert race.main(["--merge", str(path)]) == 2  # refused before the shipped table is read
    assert race.merge(path, table) == 2
    assert capsys.readouterr().err.count("is a dry run") == 2
    assert table.read_text() == routes.TABLE.read_text()


def test_past_its_time_limit_the_race_records_the_shapes_not_run(tmp_path, capsys):
    race = _race()
    path = tmp_path / "cov_race.json"
    assert race.main(["--dry-run", "--time-limit", "0", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["results"] == [] and doc["rows"] == [] and doc["not_run"] == [s.name for s in race.DRY_SHAPES]
    out = capsys.readouterr().out
    assert "dry-B2-T16-S2-D32-fp16: not run (time limit)" in out and "time cap reached" in out


def test_sigterm_keeps_the_shapes_that_finished(tmp_path):
    """What the kit's cap does to the step: SIGTERM once a shape is in the JSON; the file stays
    valid, holds that shape, and names the others as not run; a capped race is no failure."""
    path = tmp_path / "cov_race.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "cov_race.py"), "--dry-run", "--json", str(path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and json.loads(path.read_text() or "{}").get("results"):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out[-3000:]  # -SIGTERM: it landed after the run
    doc = json.loads(path.read_text())
    names = [s.name for s in _race().DRY_SHAPES]
    assert doc["results"] and [r["shape"] for r in doc["results"]] + doc["not_run"] == names, out[-3000:]
    assert not (tmp_path / "cov_race.json.tmp").exists()


# ------------------------------------------------------------------------------------ the checks
def _route_like_blocked(monkeypatch, name: str, change) -> None:
    """Register route ``name``: blocked's partials with ``change(G, call)`` applied to G."""
    calls = []

    def partials(x, mask, row_step):
        p = routes.partials("blocked", x, mask, row_step)
        calls.append(1)
        return p._replace(G=change(p.G.clone(), len(calls)))

    monkeypatch.setitem(routes.ROUTES, name, routes.Route(name, "test", lambda device, dtype, D: "", partials))


def test_an_inexact_or_unsteady_route_fails_its_checks_and_cannot_win(monkeypatch):
    race = _race()
    shape = race.DRY_SHAPES[0]
    x, mask = race.checked_keys(shape, CPU)
    ref = race.Reference.of(x, mask)
    # float32 sums: every entry of G off by ~1e-7 of the largest
    _route_like_blocked(monkeypatch, "f32", lambda G, _: G + 1e-7 * G.abs().max())
    # one entry one ulp apart on every other call: exact enough, but not the same bits twice
    _route_like_blocked(monkeypatch, "moving", lambda G, i: G.index_put_(
        (torch.tensor(0), torch.tensor(0), torch.tensor(0)), G[0, 0, 0] * (1 + (i % 2) * race.EPS64)))
    # the NaN row let in (no reject of non-finite rows)
    _route_like_blocked(monkeypatch, "leaky", lambda G, _: G.index_fill_(1, torch.tensor([1]), float("nan")))
    good = race.check_route("blocked", x, mask, ref)
    bad = race.check_route("f32", x, mask, ref)
    moving = race.check_route("moving", x, mask, ref)
    leaky = race.check_route("leaky", x, mask, ref)
    assert good["ok"] and good["failed"] == []
    assert not leaky["ok"] and {"gram", "spectrum", "pr"} <= set(leaky["failed"])
    assert leaky["gram_rel_err"] is None and json.loads(json.dumps(leaky, allow_nan=False)) == leaky
    assert not bad["ok"] and {"gram", "update"} <= set(bad["failed"]) and bad["gram_rel_err"] > 1e-8
    assert not moving["ok"] and moving["failed"] == ["steady"]
    raced = {"f32": {"update": {"device_us": 1.0}, "ok": False}, "moving": {"update": {"device_us": 2.0}, "ok": False},
             "blocked": {"update": {"device_us": 50.0}, "ok": True}}
    assert race.pick(raced) == "blocked"  # the fastest is wrong, the next is not the same twice
    assert race.pick({"f32": raced["f32"]}) is None


def test_a_route_whose_status_raises_is_listed_with_the_exception(monkeypatch):
    race = _race()

    def status(device, dtype, D):
        raise ImportError("cannot import name 'gram_cuda'")

    monkeypatch.setitem(routes.ROUTES, "dmma", dataclasses.replace(routes.ROUTES["dmma"], status=status))
    got = race.availability(CPU, torch.float16, 32)
    assert got["dmma"] == "unavailable: ImportError: cannot import name 'gram_cuda'" and got["blocked"] == ""


def test_a_shape_that_no_route_passes_fails_the_race(tmp_path, monkeypatch, capsys):
    race = _race()

    def status(device, dtype, D):
        raise ImportError("broken")

    for name in routes.ROUTES:
        monkeypatch.setitem(routes.ROUTES, name, dataclasses.replace(routes.ROUTES[name], status=status))
    path = tmp_path / "cov_race.json"
    assert race.main(["--dry-run", "--json", str(path)]) == 1
    doc = json.loads(path.read_text())
    assert [r["winner"] for r in doc["results"]] == [None, None] and doc["rows"] == []
    assert f"check: no route passed on {race.DRY_SHAPES[0].name}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ merging
def _timed(us: float, spread: float, ok: bool = True) -> dict:
    """A raced route whose whole update takes ``us`` ± ``spread`` (its partials 5 µs less)."""
    def part(t, launches, host):
        return {"device_us": t, "device_us_min": t - spread, "device_us_max": t + spread, "host_us": host,
                "repeats": 5, "clock": "device", "launches": launches}
    return {"partials": part(us - 5, 2, 9.0), "update": part(us, 3, 30.0), "ok": ok,
            "check": {"ok": ok, "failed": [] if ok else ["gram"]}}


def _gpu_result(race, shape, timed: dict[str, dict]) -> dict:
    return {"shape": shape.name, "dtype": shape.dtype, "D": shape.D, "rows": shape.rows, "routes": timed,
            "not_raced": {n: "not here" for n in routes.ROUTES if n not in timed}, "winner": race.pick(timed)}


def _write_race(race, path: Path, results: list[tuple]) -> None:
    doc = {"schema": race.SCHEMA, "kind": "cov-race", "dry_run": False, "results": [], "rows": [], "not_run": []}
    for shape, res in results:
        doc["results"].append(res)
        doc["rows"].append(race.table_row(res, shape, 90, "NVIDIA H200", "2026-12-01", dry=False))
    path.write_text(json.dumps(doc))


def _table(path: Path, *rows: routes.Row) -> Path:
    data = json.loads(routes.TABLE.read_text())  # the shipped table's header, these rows
    data["rows"] = [r.to_json() for r in rows]
    path.write_text(json.dumps(data))
    return path


def _row(route: str, lo: int, hi: int | None, dtype: str = "bfloat16", D: int = 128) -> routes.Row:
    return routes.Row(90, dtype, D, lo, hi, route, {"device": "NVIDIA H100", "shape": "old"})


def test_merge_replaces_the_same_key_and_drops_overlapped_rows(tmp_path, capsys):
    race = _race()
    big, layer = race.SHAPES[0], race.SHAPES[1]
    res_big = _gpu_result(race, big, {"dmma": _timed(60, 1), "triton_f64": _timed(80, 1), "blocked": _timed(400, 5),
                                      "prep_gemm": _timed(20, 1, ok=False)})  # fastest, wrong: cannot win
    res_layer = _gpu_result(race, layer, {"dmma": _timed(35, 1), "blocked": _timed(210, 5)})
    assert res_big["winner"] == "dmma"
    row = race.table_row(res_big, big, 90, "NVIDIA H200", "2026-12-01", dry=False)
    assert row["rows"] == [race.SPLIT, None] and row["route"] == "dmma" and row["D"] == 128
    assert set(row["measured"]["device_us"]) == {"dmma", "triton_f64", "blocked"}  # no time for the wrong one
    m = row["measured"]
    assert m["device_us"]["dmma"] == 60 and m["launches"]["dmma"] == 3 and m["host_us"]["dmma"] == 30.0
    assert m["partials_device_us"]["dmma"] == 55 and m["partials_launches"]["dmma"] == 2
    assert "dry_run" not in row["measured"]
    assert race.table_row({**res_big, "winner": None}, big, 90, "x", "d", dry=False) is None
    table = _table(tmp_path / "routes.json",
                   _row("blocked", race.SPLIT, None),                 # the same key: replaced
                   _row("prep_gemm", 0, None, dtype="float16"),       # another dtype: kept
                   _row("triton_f64", 4096, 20000, D=64),             # another D: kept
                   _row("blocked", 0, 16383))                         # overlaps both new rows: dropped
    path = tmp_path / "cov_race.json"
    _write_race(race, path, [(big, res_big), (layer, res_layer)])
    assert race.merge(path, table) == 0
    out = capsys.readouterr().out
    assert "2 rows merged" in out and "2 other rows kept, 1 overlapped and dropped" in out
    rows = routes.load_table(table)
    got = {(r.dtype, r.D, r.rows_lo, r.rows_hi): r.route for r in rows}
    assert got == {("float16", 128, 0, None): "prep_gemm", ("bfloat16", 64, 4096, 20000): "triton_f64",
                   ("bfloat16", 128, race.SPLIT, None): "dmma", ("bfloat16", 128, 0, race.SPLIT - 1): "dmma"}
    first = next(r for r in rows if r.matches(90, "bfloat16", 128, 16384))
    assert first.route == "dmma" and first.measured["device"] == "NVIDIA H200"
    assert "dmma 60 µs" in first.describe()
    data = json.loads(table.read_text())
    assert race.EMPTY.strip() not in data["about"] and data["format"] == 1


def test_merge_keeps_a_table_row_that_ties_with_the_winner(tmp_path, capsys):
    race = _race()
    big = race.SHAPES[0]
    held = _row("triton_f64", race.SPLIT, None)

    def result(dmma_spread, triton_ok=True):
        return _gpu_result(race, big, {"dmma": _timed(60, dmma_spread), "triton_f64": _timed(61, 0.5, ok=triton_ok),
                                       "blocked": _timed(400, 5)})

    assert race.tie(result(2), "dmma", "triton_f64")                    # overlapping rounds: a tie
    assert not race.tie(result(0.1), "dmma", "triton_f64")              # dmma ahead beyond the noise
    assert not race.tie(result(2, triton_ok=False), "dmma", "triton_f64")  # the incumbent is wrong: no tie
    assert not race.tie({"routes": {"dmma": {"update": {"device_us": 1.0}},
                                    "triton_f64": {"update": {"device_us": 1.0}, "ok": True}}},
                        "dmma", "triton_f64")                           # no ranges, no evidence of a tie
    for spread, triton_ok, want in ((2, True, "triton_f64"), (0.1, True, "dmma"), (2, False, "dmma")):
        table = _table(tmp_path / "routes.json", held)
        path = tmp_path / "cov_race.json"
        _write_race(race, path, [(big, result(spread, triton_ok))])
        assert race.merge(path, table) == 0
        assert [r.route for r in routes.load_table(table)] == [want], (spread, triton_ok)
        assert ("tie: " in capsys.readouterr().out) == (want == "triton_f64")


def test_merge_refuses_other_files_and_a_row_naming_a_failed_route(tmp_path, capsys):
    race = _race()
    big = race.SHAPES[0]
    table = _table(tmp_path / "routes.json", _row("blocked", race.SPLIT, None))
    before = table.read_text()
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"schema": "fastspec-eig-race-1", "rows": []}))
    assert race.merge(path, table) == 2 and "not a covariance race result" in capsys.readouterr().err
    res = _gpu_result(race, big, {"dmma": _timed(60, 1), "blocked": _timed(400, 5)})
    _write_race(race, path, [(big, res)])
    doc = json.loads(path.read_text())
    doc["results"][0]["routes"]["dmma"]["ok"] = False  # a hand-edited result: its winner failed
    path.write_text(json.dumps(doc))
    assert race.merge(path, table) == 2 and "failed its checks" in capsys.readouterr().err
    assert table.read_text() == before
