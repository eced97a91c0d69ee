"""``fastspec bench --quick`` and ``fastspec compare --quick`` run, print narrow tables and a
verdict, and write well-formed JSON; a case that breaks its accuracy claim is marked and fails
the run; bad flags are one-line errors before anything is written."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from fastspec.bench.accuracy import SIZES
from fastspec.bench.case import Case, no_worse_than
from fastspec.bench.suites import SUITES
from fastspec.bench.table import budget_text, fmt_time, noise_pct
from fastspec.cli import main
from fastspec.eig.matrices import FAMILIES

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
    # the README's table is regenerated on request only (benchmarks/readme_table.py)
    assert README.read_bytes() == readme, "fastspec bench rewrote README.md"
    return rc, _strict_json(path), out.getvalue()


@pytest.mark.slow
def test_bench_quick_json_is_well_formed(bench_doc):
    rc, doc, _ = bench_doc
    _check_header(doc, "bench")
    rows = doc["results"]
    assert {r["suite"] for r in rows} == set(SUITES)
    assert rc == (1 if any("error" in r or r.get("claim_held") is False for r in rows) else 0)
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
        assert r["claim"] and r["claim_held"] == ("claim_violation" not in r)
        if "rate_unit" in r:
            assert r["fastspec_rate"] > 0 and r["baseline_rate"] > 0
        if r["suite"].startswith("train_step") or "overhead_pct" in r:  # probe suite: measure, train_step
            assert math.isclose(r["overhead_pct"], (r["fastspec_s"] / r["baseline_s"] - 1) * 100)
        if r["suite"] == "train_step_compiled":  # compiled in the warm-up, and it held
            assert (r["recompiles"], r["graph_breaks"], r["fastspec_error"]) == (0, 0, 0)


@pytest.mark.slow
def test_bench_quick_has_no_errors(bench_doc):
    """Every case that can run here runs and holds its accuracy claim (as ``pytest benchmarks``
    asserts): a raised case shows up as an error row, a broken claim as ``claim_held: false``."""
    rc, doc, out = bench_doc
    assert [r for r in doc["results"] if "error" in r or r.get("claim_held") is False] == []
    assert rc == 0 and "FAIL" not in out


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_quick_prints_narrow_tables_of_every_row(bench_doc):
    _, doc, out = bench_doc
    header, sep, body = out.partition("\n# python")
    assert header.startswith("# ") and "median of 2 repeats after 1 warm-up" in body.splitlines()[0]
    # was ~340 in one table. The widest cells depend on the run: an "inconclusive (noisy: ±X%)"
    # speedup (wide spreads on a shared CPU) is 16+ characters wider than "≈1× (±X%)", and tiny GB/s
    # figures print long; a shared CI machine produced a 129-character row of both. The bound
    # catches a return to one wide table, not a column's exact width.
    assert max(len(line) for line in body.splitlines()[1:]) <= 140, body
    lines, flat = body.splitlines(), " ".join(body.split())
    for r in doc["results"]:
        if "fastspec_s" in r:
            assert f"{r['suite']} vs {r['baseline']} · error: {r['error_kind']}" in lines
            shown = [line for line in lines if line.split()[:2] == [r["size"], r["variant"]]]
            assert shown, r
            if "real_overhead_pct" in r:  # a budget row shows its paired run's means and overhead
                assert any(budget_text(r, compact=True) in line and fmt_time(r["probed_mean_s"]) in line
                           for line in shown), (r, shown)
            elif noise_pct(r) is not None:  # a difference inside the noise is said to be noise
                assert any("≈" in line or "inconclusive (noisy" in line for line in shown), (r, shown)
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
    from fastspec.bench import case, suites
    from fastspec.bench.case import FLOOR_EPS
    from fastspec.commands import _bench_common, compare

    assert _bench_common.TIERS == case.TIERS and _bench_common.SUITES == suites.SUITES == SUITES
    assert f"2 × torch.linalg.eigvalsh fp32's + {FLOOR_EPS}·eps_fp32" in compare.BOUND


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


# ------------------------------------------------------------------ a broken accuracy claim
def _case(size: str, err: float) -> Case:
    """A case that runs in microseconds, two baselines, whose fastspec error is ``err``; its
    claim: at most 2 × the baseline's 1e-7 + 8·eps_fp32 (1.15e-6)."""
    return Case(suite="eigvalsh", size=size, variant="auto", setup=dict, fastspec=lambda inp: None,
                baselines={"torch.linalg.eigvalsh": lambda inp: None, "another": lambda inp: None},
                check=lambda inp: {"fastspec_error": err, "baseline_error": 1e-7},
                error_kind="max rel err vs fp64", claim=no_worse_than())


@pytest.fixture
def one_broken_claim(monkeypatch):
    """``fastspec bench`` runs two cases: B1 holds its claim, B2 breaks it (error 1e-3)."""
    from fastspec.bench import suites

    monkeypatch.setattr(suites, "cases", lambda suite, tier, device=None: [_case("B1-n4-fp32", 1e-7),
                                                                            _case("B2-n4-fp32", 1e-3)])


def test_bench_marks_a_broken_claim_in_table_json_and_exit_status(one_broken_claim, tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--warmup", "0", "--repeats", "1",
                 "--json", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    rows = _strict_json(path)["results"]
    held = [r for r in rows if r["size"] == "B1-n4-fp32"]
    broken = [r for r in rows if r["size"] == "B2-n4-fp32"]
    assert len(held) == len(broken) == 2  # one row per baseline, each says it
    assert all(r["claim_held"] and "claim_violation" not in r for r in held)
    assert all(r["claim"] == "≤ 2 × baseline_error + 8·eps_fp32" for r in rows)
    for r in broken:
        assert r["claim_held"] is False and "error" not in r
        assert r["claim_violation"] == ("fastspec error 0.001 > 1.15e-06 "
                                        "(claim: ≤ 2 × baseline_error + 8·eps_fp32, baseline_error 1e-07)")
    table = [line for line in out if line.split()[:2] in (["B1-n4-fp32", "auto"], ["B2-n4-fp32", "auto"])]
    assert len(table) == 4 and all(line.endswith("FAIL") == ("B2" in line) for line in table), table
    notes = [line for line in out if line.startswith("  FAIL ")]  # the note, once (not per baseline)
    assert len(notes) == 1 and notes[0].startswith("  FAIL     B2-n4-fp32 auto — fastspec error 0.001 > ")
    assert f"FAIL B2-n4-fp32 auto — {broken[0]['claim_violation']}" in " ".join(" ".join(out).split())
    assert out[-1] == "FAIL: 1 case breaks its accuracy claim (the FAIL notes say how): eigvalsh B2-n4-fp32 auto"


def test_bench_wide_says_which_claim_broke(one_broken_claim, capsys):
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--warmup", "0", "--repeats", "1", "--wide"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines if " FAIL: fastspec error 0.001 > 1.15e-06" in line] == ["B2-n4-fp32"] * 2


@pytest.mark.parametrize("err", [float("nan"), float("inf")])
def test_a_non_finite_error_breaks_the_claim(err, monkeypatch, tmp_path):
    from fastspec.bench import suites

    monkeypatch.setattr(suites, "cases", lambda suite, tier, device=None: [_case("B1-n4-fp32", err)])
    path = tmp_path / "r.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--repeats", "1", "--json", str(path)]) == 1
    for r in _strict_json(path)["results"]:  # JSON has no NaN: the error is null, the claim says why
        assert r["fastspec_error"] is None and r["claim_held"] is False
        assert r["claim_violation"].startswith(f"fastspec error is {err}")


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
    assert main(argv + ["--json", str(out)]) == 2
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



@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
@pytest.mark.parametrize("command", ["bench", "compare"])
def test_a_json_path_that_cannot_be_created_is_refused_up_front(command, capsys, monkeypatch):
    """Permission bits say yes to root everywhere (os.access), yet /proc takes no new folder: the
    check creates for real, so this is one line naming --json before the header, not a traceback
    from the first rewrite of the JSON."""
    from fastspec.bench import accuracy, runner

    for module, name in ((runner, "run_cases"), (accuracy, "compare")):
        monkeypatch.setattr(module, name, lambda *a, **kw: pytest.fail("ran before checking --json"))
    assert main([command, "--quick", "--json", "/proc/nope/r.json"]) == 2
    std = capsys.readouterr()
    assert std.err.startswith(f"fastspec {command}: error: --json: ") and std.err.count("\n") == 1, std.err
    assert "/proc/nope" in std.err and std.out == "" and not Path("/proc/nope").exists()


@pytest.mark.gpu
def test_bench_quick_on_cuda_times_with_events(tmp_path):
    """On a GPU the same command runs the CUDA paths (and CuPy when installed) without errors."""
    path = tmp_path / "gpu.json"
    rc = main(["bench", "--quick", "--suite", "eigvalsh", "--suite", "covariance", "--json", str(path)])
    doc = _strict_json(path)
    assert rc == 0 and doc["environment"]["device"] != "cpu" and doc["environment"]["cuda"]
    assert not [r for r in doc["results"] if "error" in r]
    assert any(r["variant"] == "auto" and "fastspec_s" in r for r in doc["results"])
