"""The offline GPU kit: time caps that keep partial results, and ``gpu_run.sh --dry-run`` end to end.

The dry run is the same script a GPU session runs (build, tests, every benchmark suite, the
profiling targets), on CPU at tiny sizes with ``PIP_NO_INDEX=1``: if it breaks here, it would
have broken in the rare, short GPU window.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastspec.bench import runner
from fastspec.bench.case import Case
from fastspec.cli import main

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_run.sh"
CPU = torch.device("cpu")


def _strict_json(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"non-JSON constant {name} in {path}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _case(name: str, work=lambda: None) -> Case:
    """A tiny case whose fastspec side runs ``work()`` (sleep, or a signal to this process)."""
    return Case(suite="eigvalsh", size=name, variant="auto", setup=dict,
                fastspec=lambda inp: work(), baselines={"nothing": lambda inp: None},
                check=lambda inp: {"fastspec_error": 0.0, "baseline_error": 0.0}, error_kind="none")


# ------------------------------------------------------------------------- the runner's time cap
def test_deadline_stops_new_cases_and_shortens_the_timing_loop():
    saved = []
    deadline = time.monotonic() + 0.02
    rows = runner.run_cases([_case("slow", lambda: time.sleep(0.03)), _case("b"), _case("c")], CPU,
                            warmup=1, repeats=5, deadline=deadline, on_rows=lambda r: saved.append(list(r)))
    assert [r["size"] for r in rows] == ["slow", "b", "c"]
    assert rows[0]["fastspec_s"] >= 0.03
    assert rows[0]["repeats"] == 1  # past the deadline: one timed round, not five
    assert [r.get("skipped") for r in rows[1:]] == [runner.CAP_REACHED] * 2
    assert saved[0] == rows[:1]  # written after the first case, before the cap was noticed
    assert saved[-1] == rows and runner.capped(rows)


def test_without_a_deadline_nothing_is_capped():
    rows = runner.run_cases([_case("a"), _case("b")], CPU, warmup=0, repeats=3)
    assert [r["repeats"] for r in rows] == [3, 3] and not runner.capped(rows)


def test_sigterm_mid_case_writes_partial_results_and_exits_0(tmp_path, monkeypatch):
    """What `timeout -s TERM` does to a bench step: the case in flight is dropped, the finished
    ones stay in the JSON, the rest are marked, and the step is not a failure."""
    import fastspec.bench.cases as cases_mod

    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises here, as it would inside a long case

    fake = [_case("done"), _case("in-flight", sigterm), _case("not-started")]
    monkeypatch.setattr(cases_mod, "cases", lambda suite, tier, device=None: fake)
    before = signal.getsignal(signal.SIGTERM)
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--json", str(path)]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored
    rows = _strict_json(path)["results"]
    assert [r["size"] for r in rows] == ["done", "in-flight", "not-started"]
    assert "fastspec_s" in rows[0]
    assert [r["skipped"] for r in rows[1:]] == [runner.CAP_DURING, runner.CAP_REACHED]


def test_time_limit_already_spent_skips_every_case_and_exits_0(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--time-limit", "1e-9", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert rows and all(r.get("skipped") == runner.CAP_REACHED for r in rows)
    assert "time cap reached" in capsys.readouterr().err


def test_compare_time_limit_keeps_what_ran(tmp_path):
    path = tmp_path / "compare.json"
    assert main(["compare", "--quick", "--time-limit", "1e-9", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert rows and all(r.get("skipped") == runner.CAP_REACHED for r in rows)


@pytest.mark.parametrize("argv, match", [
    (["bench", "--quick", "--time-limit", "0"], "--time-limit"),
    (["bench", "--quick", "--suite", "eigvalsh", "--filter", "no-such-case"], "--filter"),
])
def test_bad_cap_flags_name_the_flag(argv, match, capsys):
    assert main(argv) == 2  # a one-line error, no traceback
    assert capsys.readouterr().err.startswith(f"fastspec bench: error: {match}")


def test_filter_selects_cases_by_suite_size_variant():
    from fastspec.bench.cli import select

    cs = [_case("B16-n32-fp32"), _case("B4-n64-fp32"), _case("B4-n64-fp64")]
    assert [c.size for c in select(cs, ["n64-fp32"])] == ["B4-n64-fp32"]
    assert [c.size for c in select(cs, ["fp64", "B16"])] == ["B16-n32-fp32", "B4-n64-fp64"]
    assert select(cs, None) == cs


def test_baseline_timed_on_a_slice_is_scaled_to_the_whole_batch():
    case = _case("x")
    case.baselines = {"looped": lambda inp: time.sleep(0.002)}
    case.baseline_scale = {"looped": 16.0}
    (row,) = runner.run_case(case, CPU, warmup=0, repeats=3)
    assert row["baseline_scale"] == 16.0 and row["baseline_s"] >= 16 * 0.002
    assert row["speedup"] == pytest.approx(row["baseline_s"] / row["fastspec_s"])


# --------------------------------------------------------------------------------- the summary
def test_summary_merges_suites_into_one_results_document(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_summary
    finally:
        sys.path.pop(0)
    env = {"device": "cpu", "driver": None, "cuda": None, "torch": "x", "triton": None, "fastspec": "0"}

    def doc(rows):
        return {"schema": 1, "kind": "bench", "tier": "quick", "date": "2026-01-01T00:00:00Z",
                "torch_threads": 1, "environment": env, "results": rows}

    row = lambda suite, size: {"suite": suite, "size": size, "variant": "auto", "skipped": "why"}  # noqa: E731
    (tmp_path / "bench.json").write_text(json.dumps(doc([row("keyrank", "old"), row("eigvalsh", "old")])))
    (tmp_path / "bench-eigvalsh.json").write_text(json.dumps(doc([row("eigvalsh", "new")])))
    (tmp_path / "bench-covariance.json").write_text(json.dumps(doc([row("covariance", "new")])))
    merged = gpu_summary.merge(tmp_path, {"tier": "full", "part": "2"})
    assert [(r["suite"], r["size"]) for r in merged["results"]] == [
        ("keyrank", "old"), ("eigvalsh", "new"), ("covariance", "new")]  # eigvalsh measured again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
    assert _strict_json(tmp_path / "bench.json") == merged
    assert merged["gpu_run"]["runs"][-1]["suites"] == ["covariance", "eigvalsh"]


def test_summary_line_of_a_compiled_row_says_what_compiling_cost():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_summary
    finally:
        sys.path.pop(0)
    row = {"suite": "train_step_compiled", "size": "L32", "variant": "inductor-emit_every=100",
           "baseline": "compiled training step without probe", "fastspec_s": 0.505, "baseline_s": 0.5,
           "speedup": 0.5 / 0.505, "overhead_pct": 1.0, "fastspec_error": 0.0, "baseline_error": None,
           "probed_compile_s": 95.2, "baseline_compile_s": 61.0, "probed_graphs": 1.0,
           "baseline_graphs": 1.0, "recompiles": 0.0, "graph_breaks": 0.0}
    line = gpu_summary.row_line(row)
    assert "overhead +1.0%" in line
    assert line.endswith("compile 95+61 s, graphs 1+1, recompiles 0, breaks 0")
    assert gpu_summary.SUITE_ORDER[-1] == "train_step_compiled"


# ------------------------------------------------------------------------------ the script itself
def test_every_suite_runs_in_some_full_part():
    text = SCRIPT.read_text()
    parts = dict(re.findall(r"^\s*full/(\d)\)(.*?);;", text, re.MULTILINE | re.DOTALL))
    assert sorted(parts) == ["1", "2", "3", "4"]
    from fastspec.bench.cases import SUITES

    for suite in SUITES:
        assert any(re.search(rf"\bbench {suite} \d+", body) for body in parts.values()), suite
    assert "--part: expected 1, 2, 3 or 4" in text


def test_script_has_no_network_step():
    text = SCRIPT.read_text()
    code = "\n".join(ln.split("#")[0] for ln in text.splitlines())  # comments may name pip
    for word in ("pip ", "pip3", "curl", "wget", "git clone", "http://", "https://", "huggingface-cli"):
        assert word not in code, f"gpu_run.sh must stay offline: found {word!r}"


@pytest.mark.parametrize("args, message", [
    (["--tier", "huge", "OUT"], "--tier"),
    (["--part", "2", "OUT"], "--part goes with --tier full"),
    (["--tier", "full", "--part", "5", "OUT"], "--part: expected 1, 2, 3 or 4"),
    (["--cap", "tests", "OUT"], "--cap"),
    ([], "OUT_DIR is required"),
])
def test_script_rejects_bad_arguments(args, message):
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                    reason="needs coreutils timeout and tar")
def test_dry_run_end_to_end_offline(tmp_path):
    """The acceptance check: the whole kit on CPU, no package index, valid JSON, a capped step."""
    out = tmp_path / "out"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    # the tests step gets 1 s: pytest cannot even import torch in that time, so `timeout` stops
    # it; the run must record that as capped, go on, and still exit 0
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--cap", "tests=1", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    log = (out / "gpu_run.log").read_text() if (out / "gpu_run.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + log[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8, files  # few flat files
    assert {"gpu_run.log", "bench.json", "steps.txt"} <= set(files), files
    assert "step tests: capped" in log and "step build: ok" in log
    for suite in ("bench-eigvalsh", "bench-covariance", "bench-keyrank", "bench-train_step"):
        assert f"step {suite}: ok" in log or f"step {suite}: capped" in log, log
    doc = _strict_json(out / "bench.json")
    assert doc["schema"] == runner.SCHEMA and doc["kind"] == "bench" and doc["tier"] == "quick"
    assert {"fastspec", "torch", "triton", "device", "driver", "cuda"} <= set(doc["environment"])
    assert {r["suite"] for r in doc["results"]} == {"eigvalsh", "covariance", "keyrank", "train_step"}
    assert not [r for r in doc["results"] if "error" in r]
    assert any("fastspec_s" in r for r in doc["results"])
    assert doc["gpu_run"]["runs"][-1]["dry_run"] is True
    assert "eig:" in (out / "ncu.txt").read_text() and "cov:" in (out / "ncu.txt").read_text()
    assert "===== summary" in proc.stdout


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                    reason="needs coreutils timeout and tar")
def test_dry_run_of_the_compiled_training_step_part(tmp_path):
    """Full tier, part 4 (the compiled training step alone), rehearsed on CPU: it compiles with
    the probe attached, measures, and reports no graph break and no recompile."""
    out = tmp_path / "out"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--tier", "full", "--part", "4", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    log = (out / "gpu_run.log").read_text() if (out / "gpu_run.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + log[-2000:]
    assert "step bench-train_step_compiled: ok" in log, log
    rows = [r for r in _strict_json(out / "bench.json")["results"] if r["suite"] == "train_step_compiled"]
    measured = [r for r in rows if "fastspec_s" in r]
    assert measured and not [r for r in rows if "error" in r]
    assert all(r["recompiles"] == 0 and r["graph_breaks"] == 0 and r["fastspec_error"] == 0 for r in measured)
