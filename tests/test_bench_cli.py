"""``fastspec bench --quick`` and ``fastspec compare --quick`` run, print narrow tables and a
verdict, and write well-formed JSON; bad flags are one-line errors before anything is written."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from fastspec.bench.accuracy import SIZES
from fastspec.bench.cases import SUITES
from fastspec.bench.table import noise_pct
from fastspec.cli import main
from fastspec.eig.cases import FAMILIES

ENV_KEYS = {"fastspec", "python", "torch", "cuda", "device", "driver", "cpu", "triton"}


def _strict_json(path) -> dict:
    """Parse as JSON proper: NaN/Infinity are not JSON and must never be written."""
    def refuse(name):
        raise ValueError(f"non-JSON constant {name} in {path}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _check_header(doc: dict, kind: str) -> None:
    assert doc["schema"] == 1 and doc["kind"] == kind and doc["tier"] == "quick"
    assert ENV_KEYS <= set(doc["environment"])
    assert isinstance(doc["torch_threads"], int) and doc["torch_threads"] >= 1
    assert doc["date"].endswith("Z") and len(doc["date"]) == 20


README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def bench_doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    readme = README.read_bytes()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "--quick", "--repeats", "2", "--warmup", "1", "--json", str(path)])
    # the README's table is regenerated on request only (python -m fastspec.bench.table)
    assert README.read_bytes() == readme, "fastspec bench rewrote README.md"
    return rc, _strict_json(path), out.getvalue()


def test_bench_quick_json_is_well_formed(bench_doc):
    rc, doc, _ = bench_doc
    _check_header(doc, "bench")
    rows = doc["results"]
    assert {r["suite"] for r in rows} == set(SUITES)
    assert rc == (1 if any("error" in r for r in rows) else 0)
    measured = [r for r in rows if "fastspec_s" in r]
    assert measured, "no case ran"
    for r in rows:
        assert r.keys() >= {"suite", "size", "variant"}
        assert ("skipped" in r) + ("fastspec_s" in r) + ("error" in r and "fastspec_s" not in r) == 1, r
    for r in measured:
        assert r["fastspec_s"] > 0 and r["baseline_s"] > 0 and r["repeats"] == 2
        # the spread of the repeats (what the noise rule reads); a sliced baseline scaled like its median
        assert r["fastspec_min_s"] <= r["fastspec_s"] <= r["fastspec_max_s"]
        assert r["baseline_min_s"] <= r["baseline_s"] <= r["baseline_max_s"]
        assert math.isclose(r["speedup"], r["baseline_s"] / r["fastspec_s"], rel_tol=1e-12)
        assert r["fastspec_error"] is None or r["fastspec_error"] >= 0
        if "rate_unit" in r:
            assert r["fastspec_rate"] > 0 and r["baseline_rate"] > 0
        if r["suite"].startswith("train_step") or "overhead_pct" in r:  # probe suite: measure, train_step
            assert math.isclose(r["overhead_pct"], (r["fastspec_s"] / r["baseline_s"] - 1) * 100)
        if r["suite"] == "train_step_compiled":  # compiled in the warm-up, and it held
            assert (r["recompiles"], r["graph_breaks"], r["fastspec_error"]) == (0, 0, 0)


def test_bench_quick_has_no_errors(bench_doc):
    """Every case that can run here runs: a raised case shows up as an error row."""
    _, doc, _ = bench_doc
    assert [r for r in doc["results"] if "error" in r] == []


def test_bench_rates_follow_their_definition(bench_doc):
    _, doc, _ = bench_doc
    for r in doc["results"]:
        if r.get("rate_unit") == "µs/matrix":
            batch = int(r["size"].split("-")[0][1:])  # B{batch}-n{n}-fp32
            assert math.isclose(r["fastspec_rate"], r["fastspec_s"] / batch * 1e6)
        elif r.get("rate_unit") == "GB/s":
            dims = [int(p[1:]) for p in r["size"].split("-")[1:-1]]  # keys-B-H-T-D / ffn-N-D
            nbytes = math.prod(dims) * 2  # bf16/fp16 inputs
            assert math.isclose(r["fastspec_rate"], nbytes / r["fastspec_s"] / 1e9)


def test_bench_quick_prints_narrow_tables_of_every_row(bench_doc):
    _, doc, out = bench_doc
    header, sep, body = out.partition("\n# python")
    assert header.startswith("# ") and "median of 2 repeats after 1 warm-up" in body.splitlines()[0]
    assert max(len(line) for line in body.splitlines()[1:]) <= 110, body  # was ~340 in one table
    lines, flat = body.splitlines(), " ".join(body.split())
    for r in doc["results"]:
        if "fastspec_s" in r:
            assert f"{r['suite']} vs {r['baseline']} · error: {r['error_kind']}" in lines
            shown = [line for line in lines if line.split()[:2] == [r["size"], r["variant"]]]
            assert shown, r
            if noise_pct(r) is not None:  # a difference inside the noise is said to be noise
                assert any("≈" in line for line in shown), (r, shown)
        else:
            assert " ".join(r["skipped"].split()) in flat, r


def test_bench_wide_prints_every_field_in_one_table(monkeypatch, capsys):
    from fastspec.bench import runner

    row = {"suite": "eigvalsh", "size": "B4-n64-fp32", "variant": "auto", "baseline": "torch.linalg.eigvalsh",
           "fastspec_s": 1e-3, "baseline_s": 2e-3, "speedup": 2.0, "repeats": 3, "error_kind": "max rel err",
           "fastspec_error": 1e-7, "baseline_error": 1e-7}
    monkeypatch.setattr(runner, "run_cases", lambda cases, device, **kw: [row])
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--wide"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split() == ["suite", "size", "variant", "fastspec", "baseline", "baseline",
                                           "time", "speedup", "throughput", "accuracy"]
    assert "eigvalsh  B4-n64-fp32  auto     1 ms      torch.linalg.eigvalsh  2 ms" in out


def test_cli_constants_match_the_registry():
    """The flags' choices are constants (``--help`` imports no torch); they must follow the registry."""
    from fastspec.bench import case, cases, cli_common, cli_compare
    from fastspec.bench.accuracy import FLOOR_EPS

    assert cli_common.TIERS == case.TIERS and cli_common.SUITES == cases.SUITES == SUITES
    assert f"2 × torch.linalg.eigvalsh fp32's + {FLOOR_EPS}·eps_fp32" in cli_compare.BOUND


def test_compare_quick_json_is_well_formed(tmp_path, capsys):
    path = tmp_path / "compare.json"
    rc = main(["compare", "--quick", "--json", str(path)])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("PASS: all " if rc == 0 else "FAIL: "), last
    doc = _strict_json(path)
    _check_header(doc, "compare")
    rows = doc["results"]
    sizes, batch = SIZES["quick"]
    assert {(r["family"], r["n"]) for r in rows} == {(f, n) for f in FAMILIES for n in sizes}
    for r in rows:
        assert r["batch"] == batch
        assert r["torch_fp32_error"] >= 0 and r["fastspec_error"] >= 0
        # the same bound the command enforces: 2× torch fp32 plus an 8·eps floor
        assert r["within_2x_torch"] == (r["fastspec_error"] <= 2 * r["torch_fp32_error"] + 8 * 2.0 ** -23)
    assert rc == (0 if all(r["within_2x_torch"] for r in rows) else 1)


def test_bench_accuracy_flag_is_compare(tmp_path, capsys):
    rc = main(["bench", "--accuracy", "--quick", "--json", str(tmp_path / "a.json")])
    doc = _strict_json(tmp_path / "a.json")
    assert doc["kind"] == "compare" and rc in (0, 1)
    assert "torch fp32 err" in capsys.readouterr().out


def test_compare_fails_with_a_pass_fail_line_and_exit_1(monkeypatch, capsys):
    from fastspec.bench import accuracy

    def rows(err: float) -> dict:
        return {"family": "wishart", "n": 16, "batch": 4, "variant": "host", "fastspec_error": err,
                "torch_fp32_error": 1e-7, "ratio": err / 1e-7, "within_2x_torch": accuracy.within_bound(err, 1e-7)}

    monkeypatch.setattr(accuracy, "compare", lambda *a, **kw: [rows(1e-7), rows(2.08e-7), rows(1e-5)])
    assert main(["compare", "--quick"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[4].endswith("1.000  ≤ 2×") and out[6].endswith("100.000  FAIL")
    assert out[5].endswith("2.080  ≤ 2× + 8·eps")  # not "≤ 2×": only the floor holds it
    assert out[-1].startswith("FAIL: 1 of 3 cases exceed 2× torch.linalg fp32's error vs fp64")


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--quick", "--tier", "gpu"], "--quick"),
    (["bench", "--quick", "--threads", "0"], "--threads"),
    (["bench", "--quick", "--repeats", "0"], "--repeats"),
    (["bench", "--quick", "--warmup", "-1"], "--warmup"),
    (["bench", "--quick", "--device", "nonsense"], "--device"),
    (["bench", "--quick", "--device", "meta"], "--device"),
    (["bench", "--quick", "--time-limit", "0"], "--time-limit"),
    (["bench", "--quick", "--suite", "eigvalsh", "--filter", "no-such-case"], "--filter"),
    (["bench", "--accuracy", "--suite", "probe"], "--suite"),
    (["bench", "--table", "--quick"], "--quick"),
    (["bench", "--readme", "README.md"], "--readme"),
    (["compare", "--device", "cuda:0"], "--device"),
    (["compare", "--quick", "--family", "no-such-family"], "--family"),
    (["compare", "--quick", "--tier", "cpu"], "--quick"),
    (["compare", "--time-limit", "-1"], "--time-limit"),
])
def test_bad_flags_are_one_line_errors_before_anything_is_written(argv, flag, tmp_path, capsys):
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("cuda is available here")
    out = tmp_path / "out.json"
    assert main(argv + (["--json", str(out)] if "--table" not in argv else [])) == 2
    std = capsys.readouterr()
    assert std.err.startswith(f"fastspec {argv[0]}: error: {flag}") and std.err.count("\n") == 1, std.err
    assert "Traceback" not in std.err and std.out == "" and not out.exists()


@pytest.mark.parametrize("value, raises", [("1", True), ("yes", True), ("", False), ("0", False)])
def test_fastspec_traceback_keeps_the_traceback_of_one_line_errors(value, raises, monkeypatch, capsys):
    monkeypatch.setenv("FASTSPEC_TRACEBACK", value)
    if raises:
        with pytest.raises(ValueError, match="--threads"):
            main(["bench", "--quick", "--threads", "0"])
    else:
        assert main(["bench", "--quick", "--threads", "0"]) == 2
        assert capsys.readouterr().err.startswith("fastspec bench: error: --threads")


@pytest.mark.parametrize("command", ["bench", "compare"])
def test_an_unwritable_json_path_is_refused_up_front(command, tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for path, expected in ((tmp_path, "expected a file path"), (afile / "sub" / "r.json", "is a file")):
        assert main([command, "--quick", "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fastspec {command}: error: --json: ") and expected in err, err
    assert afile.read_text() == "x"


@pytest.mark.gpu
def test_bench_quick_on_cuda_times_with_events(tmp_path):
    """On a GPU the same command runs the CUDA paths (and CuPy when installed) without errors."""
    path = tmp_path / "gpu.json"
    rc = main(["bench", "--quick", "--suite", "eigvalsh", "--suite", "covariance", "--json", str(path)])
    doc = _strict_json(path)
    assert rc == 0 and doc["environment"]["device"] != "cpu" and doc["environment"]["cuda"]
    assert not [r for r in doc["results"] if "error" in r]
    assert any(r["variant"] == "auto" and "fastspec_s" in r for r in doc["results"])
