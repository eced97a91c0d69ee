"""The offline GPU kit (``benchmarks/gpu_run.py``): a plan that fits its window, time caps that
keep partial results, and the dry run of all three commands end to end.

The dry run is the same plan a GPU session runs (build, every benchmark step, the GPU tests, the
profilers' probes and targets, the summary), on CPU at tiny sizes with ``PIP_NO_INDEX=1``, the
profilers broken and the optional anchors hidden: if it breaks here, it would have broken in the
rare, short GPU window.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastspec.bench import runner
from fastspec.bench.case import Case, exactly_zero
from fastspec.cli import main
from fastspec.eig import precompile, variants

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "benchmarks"
CPU = torch.device("cpu")
sys.path.insert(0, str(KIT))
try:
    import cov_race
    import eig_race
    import gpu_diag
    import gpu_run
    import gpu_summary
    import gpu_tools
    import triton_race
finally:
    sys.path.remove(str(KIT))


def _strict_json(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"non-JSON constant {name} in {path}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _case(name: str, work=lambda: None) -> Case:
    """A tiny case whose fastspec side runs ``work()`` (sleep, or a signal to this process)."""
    return Case(suite="eigvalsh", size=name, variant="auto", setup=dict,
                fastspec=lambda inp: work(), baselines={"nothing": lambda inp: None},
                check=lambda inp: {"fastspec_error": 0.0, "baseline_error": 0.0}, error_kind="none",
                claim=exactly_zero())


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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped TimeCap
def test_a_sigterm_whose_exception_python_drops_still_stops_the_run(tmp_path, monkeypatch):
    """Python ignores an exception raised in a weakref callback ("Exception ignored in ..."): the
    handler's flag must still stop the run before the next case."""
    import weakref

    import fastspec.bench.suites as cases_mod

    class Thing:
        pass

    sent = []

    def sigterm_inside_a_weakref_callback():
        if sent:
            return
        sent.append(1)
        obj = Thing()
        ref = weakref.ref(obj, lambda r: os.kill(os.getpid(), signal.SIGTERM) or time.sleep(0.5))
        del obj  # the callback runs, the signal arrives in it, its TimeCap is printed and dropped
        assert ref() is None

    fake = [_case("dropped", sigterm_inside_a_weakref_callback), _case("not-started")]
    monkeypatch.setattr(cases_mod, "cases", lambda suite, tier, device=None: fake)
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert [r["size"] for r in rows] == ["dropped", "not-started"]
    assert rows[1]["skipped"] == runner.CAP_REACHED
    assert not runner.STOP.is_set()  # cleared with the handler


def test_compare_killed_by_sigterm_keeps_the_finished_rows(tmp_path, monkeypatch):
    from fastspec.bench import accuracy

    real, calls = accuracy._compare_one, []

    def one(fam, n, batch, device):
        calls.append((fam, n))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        return real(fam, n, batch, device)

    monkeypatch.setattr(accuracy, "_compare_one", one)
    path = tmp_path / "compare.json"
    assert main(["compare", "--quick", "--family", "wishart", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert len(calls) == 2 and "within_2x_torch" in rows[0] and rows[0]["n"] == calls[0][1]
    assert [r.get("skipped") for r in rows if "within_2x_torch" not in r] == [runner.CAP_DURING]


def test_sigterm_mid_case_writes_partial_results_and_exits_0(tmp_path, monkeypatch):
    """What `timeout -s TERM` does to a bench step: the case in flight is dropped, the finished
    ones stay in the JSON, the rest are marked, and the step is not a failure."""
    import fastspec.bench.suites as cases_mod

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


def _sigterm_turned_into_another_error():
    """SIGTERM, whose TimeCap a library catches and replaces by its own error (as numpy's shape
    conversion did inside Triton 3.6's interpreter: a killed CI step reported ``InterpreterError:
    TypeError(...)`` for its case and exited 1)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except BaseException:  # noqa: BLE001 - the library's catch, which this stands for
        raise TypeError("expected a sequence of integers or a single integer, got '(64)'") from None


def test_an_error_that_the_signal_caused_is_the_cap_not_the_case(tmp_path, monkeypatch):
    import fastspec.bench.suites as cases_mod

    fake = [_case("done"), _case("in-flight", _sigterm_turned_into_another_error), _case("not-started")]
    monkeypatch.setattr(cases_mod, "cases", lambda suite, tier, device=None: fake)
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--suite", "eigvalsh", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert [r.get("skipped") for r in rows] == [None, runner.CAP_DURING, runner.CAP_REACHED]
    assert not any("error" in r for r in rows)
    # the same error with no SIGTERM behind it is the case's error, as before
    broken = _case("broken", lambda: (_ for _ in ()).throw(TypeError("a real bug")))
    rows = runner.run_cases([broken], CPU, warmup=0, repeats=1)
    assert rows == [{"suite": "eigvalsh", "size": "broken", "variant": "auto", "error": "TypeError: a real bug"}]


def test_compare_counts_an_error_that_the_signal_caused_as_the_cap(tmp_path, monkeypatch):
    import fastspec

    real, calls = fastspec.eigvalsh, []

    def eigvalsh(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _sigterm_turned_into_another_error()
        return real(*args, **kwargs)

    monkeypatch.setattr(fastspec, "eigvalsh", eigvalsh)
    path = tmp_path / "compare.json"
    assert main(["compare", "--quick", "--family", "wishart", "--json", str(path)]) == 0
    rows = _strict_json(path)["results"]
    assert not any("error" in r for r in rows)
    assert next(r.get("skipped") for r in rows if "within_2x_torch" not in r) == runner.CAP_DURING


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
    (["bench", "--quick", "--suite", "eigvalsh", "--exclude", "eigvalsh"], "--exclude"),
])
def test_bad_cap_flags_name_the_flag(argv, match, capsys):
    assert main(argv) == 2  # a one-line error, no traceback
    assert capsys.readouterr().err.startswith(f"fastspec bench: error: {match}")


def test_filter_and_exclude_select_cases_by_suite_size_variant_tags():
    from fastspec.bench.case import select

    cs = [_case("B16-n32-fp32"), _case("B4-n64-fp32"), _case("B4-n64-fp64")]
    cs[2].tags = frozenset({"headline"})
    assert [c.size for c in select(cs, ["n64-fp32"])] == ["B4-n64-fp32"]
    assert [c.size for c in select(cs, ["fp64", "B16"])] == ["B16-n32-fp32", "B4-n64-fp64"]
    assert select(cs, None) == cs
    assert [c.size for c in select(cs, ["headline"])] == ["B4-n64-fp64"]
    assert [c.size for c in select(cs, None, ["headline"])] == ["B16-n32-fp32", "B4-n64-fp32"]
    assert [c.size for c in select(cs, ["B4"], ["headline"])] == ["B4-n64-fp32"]


def test_baseline_timed_on_a_slice_is_scaled_to_the_whole_batch():
    case = _case("x")
    case.baselines = {"looped": lambda inp: time.sleep(0.002)}
    case.baseline_scale = {"looped": 16.0}
    (row,) = runner.run_case(case, CPU, warmup=0, repeats=3)
    assert row["baseline_scale"] == 16.0 and row["baseline_s"] >= 16 * 0.002
    assert row["speedup"] == pytest.approx(row["baseline_s"] / row["fastspec_s"])


# --------------------------------------------------------------------------------- the summary
def test_summary_merges_the_steps_into_one_results_document(tmp_path):
    env = {"device": "cpu", "driver": None, "cuda": None, "torch": "x", "triton": None, "fastspec": "0"}

    def doc(rows):
        return {"schema": 1, "kind": "bench", "tier": "quick", "date": "2026-01-01T00:00:00Z",
                "torch_threads": 1, "environment": env, "results": rows}

    def row(suite, size, why="why"):
        return {"suite": suite, "size": size, "variant": "auto", "skipped": why}

    # another command's bench.json copied in: its eigvalsh B1 case is measured again below
    (tmp_path / "bench.json").write_text(json.dumps(doc([row("keyrank", "K"), row("eigvalsh", "B1", "old"),
                                                         row("eigvalsh", "B2")])))
    (tmp_path / "bench-covariance.json").write_text(json.dumps(doc([row("covariance", "C")])))
    (tmp_path / "bench-eigvalsh-headline.json").write_text(json.dumps(doc([row("eigvalsh", "B1", "new")])))
    merged = gpu_summary.merge(tmp_path, {"command": "2"})
    assert [(r["suite"], r["size"], r["skipped"]) for r in merged["results"]] == [
        ("keyrank", "K", "why"), ("eigvalsh", "B2", "why"), ("eigvalsh", "B1", "new"), ("covariance", "C", "why")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
    assert _strict_json(tmp_path / "bench.json") == merged
    assert merged["gpu_run"]["runs"][-1] == {"command": "2", "suites": ["covariance", "eigvalsh"]}


def test_summary_race_entries_say_built_status_and_accuracy():
    say = gpu_summary._race_entry
    assert say("packed", {"ms": 2.574, "ok": True}) == "packed 2.57 ms"
    assert say("regs", {"ms": 2.88, "ok": False}) == "regs 2.88 ms FAILS accuracy"
    assert say("cusolverdx", {"ms": 9.5, "ok": False, "status_failures": 3}) == "cusolverdx 9.5 ms status != 0 on 3 matrices"
    assert say("cusolverdx", {"ms": None, "ok": False, "dry_run_build": {"built": True}}) == "cusolverdx built, not run"
    assert say("cusolverdx", {"ms": None, "ok": False, "dry_run_build": {"built": False, "error": "E: x"}}) == \
        "cusolverdx NOT BUILT: E: x"


def test_summary_line_of_a_copy_row_gives_the_share_of_the_copy_bandwidth():
    from fastspec.bench.suites.covariance import COPY

    row = {"suite": "covariance", "size": "keys", "variant": "triton-kernel", "baseline": COPY,
           "fastspec_s": 2e-5, "baseline_s": 1e-5, "speedup": 0.5, "rate_unit": "GB/s",
           "fastspec_rate": 1000.0, "baseline_rate": 2000.0, "copy_GBps": 4000.0,
           "pct_of_copy_bandwidth": 25.0, "fastspec_error": 1e-7, "baseline_error": None}
    assert "1e+03 GB/s read = 25% of the copy's 4e+03 GB/s" in gpu_summary.row_line(row)
    assert " 20 µs vs     10 µs " in gpu_summary.row_line(row)  # a row from before the device clock
    timed = {**row, "clock": "device", "baseline_clock": "device", "fastspec_host_s": 1.31e-4,
             "baseline_host_s": 2e-5}
    assert "20 µs (device; host 131 µs) vs 10 µs (device; host 20 µs)" in gpu_summary.row_line(timed)


def test_summary_line_of_a_compiled_row_says_what_compiling_cost():
    row = {"suite": "train_step_compiled", "size": "L32", "variant": "inductor-emit_every=100",
           "baseline": "compiled training step without probe", "fastspec_s": 0.505, "baseline_s": 0.5,
           "speedup": 0.5 / 0.505, "overhead_pct": 1.0, "fastspec_error": 0.0, "baseline_error": None,
           "probed_compile_s": 95.2, "baseline_compile_s": 61.0, "probed_graphs": 1.0,
           "baseline_graphs": 1.0, "recompiles": 0.0, "graph_breaks": 0.0}
    line = gpu_summary.row_line(row)
    assert "overhead +1.0%" in line
    assert line.endswith("compile 95+61 s, graphs 1+1, recompiles 0, breaks 0")
    assert gpu_summary.SUITE_ORDER[-1] == "train_step_compiled"


def test_summary_line_of_a_budget_row_sets_what_the_probe_reports_beside_the_measured():
    row = {"suite": "train_step", "size": "L32", "variant": "budget=0.01-emit_every=100",
           "baseline": "training step without probe", "fastspec_s": 0.303, "baseline_s": 0.3,
           "speedup": 0.3 / 0.303, "overhead_pct": 1.0, "fastspec_error": 0.0, "baseline_error": None,
           "budget_average_pct": 0.97, "budget_measured_pct": None, "budget_every": 3, "ffn_row_step": 16}
    line = gpu_summary.row_line(row)
    assert "overhead +1.0%" in line
    assert line.endswith("budget reports 0.97% (measured -), every 3, FFN row step 16")




# ------------------------------------------------------------------------------------- the plan
def test_the_plan_fits_its_window_and_prints_its_time_table(capsys):
    worst = gpu_run.worst_cases()
    assert sorted(worst) == [1, 2, 3] and gpu_run.problems() == []
    assert all(w <= gpu_run.COMMAND_LIMIT == 480 for w in worst.values()), worst
    # a 15-minute lease: commands 1 and 2 within 13 minutes, the machine's start in the rest
    assert gpu_run.CORE == (1, 2) and worst[1] + worst[2] <= gpu_run.PLAN_LIMIT == 780
    assert gpu_run.main(["--plan"]) == 0
    out = capsys.readouterr().out
    for c, steps in gpu_run.PLAN.items():
        for s in steps:  # every step's row: command, name, cap, grace, kill, worst
            assert re.search(rf"^\s*{c}\s+{re.escape(s.name)}\s+{s.cap}\s+{s.grace}\s+{gpu_run.KILL}\s+{s.worst}\s",
                             out, re.MULTILINE), (c, s.name)
    assert f"plan worst case (commands 1 and 2): {worst[1] + worst[2]} s" in out
    assert "extra: only when the lease has it left" in out


def test_the_readme_states_the_plan_the_code_runs():
    text = " ".join((KIT / "README.md").read_text().split())
    for c, steps in gpu_run.PLAN.items():
        row = ", ".join(("`*` " if s.headline else "") + s.name.removeprefix("bench-").replace("-", " ")
                        + f" {s.cap}" for s in steps)
        assert f"| {c} | {row} |" in text, row
    w = gpu_run.worst_cases()
    assert (f"the worst cases are {w[1]} and {w[2]} s, {w[1] + w[2]} s ({(w[1] + w[2]) / 60:.1f} minutes), "
            f"and {w[3]} s for command 3") in text


def test_a_plan_over_its_limits_is_refused():
    plan = dict(gpu_run.PLAN)
    plan[2] = plan[2] + (gpu_run.Step("more", "bench", 200, suite="eigvalsh"),)
    bad = gpu_run.problems(plan)
    assert any(b.startswith("command 2: worst case") for b in bad) and any(b.startswith("plan:") for b in bad)
    late = dict(gpu_run.PLAN)
    late[1] = (gpu_run.Step("slow", "build", 400),) + late[1]
    assert any("headline step" in b for b in gpu_run.problems(late))


def every_kind() -> list[str]:
    return [s.kind for steps in gpu_run.PLAN.values() for s in steps]


def test_the_headline_numbers_come_first_and_the_tools_once():
    first = gpu_run.PLAN[1]
    kinds = [s.kind for s in first]
    assert kinds[:3] == ["build", "kernels", "env"] and kinds[-1] == "summary"
    heads = [s for s in first if s.headline]
    assert [(s.suite, s.select) for s in heads] == [("eigvalsh", gpu_run.HEAD), ("covariance", gpu_run.HEAD),
                                                    ("probe", gpu_run.HEAD)]
    # after the numbers: the covariance route race, the eigensolver race and its phases, the covariance
    # race probe, every kernel configuration's self-check (fastspec info --check), the tests
    after = kinds[first.index(heads[-1]) + 1:]
    assert after == ["covrace", "race", "phases", "probe", "selfcheck", "tests", "summary"], after
    assert every_kind().count("covrace") == every_kind().count("race") == every_kind().count("probe") == 1
    assert every_kind().count("selfcheck") == 1
    step = next(s for s in first if s.kind == "selfcheck")
    argv = gpu_run.Run(1, first, Path("/nonexistent"), Path("/nonexistent"), False).argv(step)
    assert argv[1:] == ["-m", "fastspec", "info", "--check", "--time-limit", str(step.cap)]
    assert every_kind().count("phases") == 1
    every = [s.kind for steps in gpu_run.PLAN.values() for s in steps]
    assert every.count("ncu") == every.count("sanitize") == every.count("tests") == every.count("compare") == 1
    assert "ncu" not in kinds and "sanitize" not in kinds  # not in the command that gives the numbers
    diags = [s.suite for steps in gpu_run.PLAN.values() for s in steps if s.kind == "diag"]
    assert diags == ["profile"]
    # command 2: the Triton configuration race first (numbers before profiles), then the profiles
    assert [s.kind for s in gpu_run.PLAN[2]][:4] == ["build", "kernels", "tritonrace", "diag"]
    assert every_kind().count("tritonrace") == 1
    names = [s.name for steps in gpu_run.PLAN.values() for s in steps if s.kind == "bench"]
    assert len(names) == len(set(names))  # one JSON file per bench step


@pytest.mark.parametrize("tier", ["quick", "gpu"], ids=["tier=quick", "tier=gpu"])  # not the gpu mark
def test_every_case_is_measured_exactly_once_by_the_plan(tier):
    """The bench steps' selections partition every suite's cases (gpu: the real run; quick: the
    dry run, which must select the same way)."""
    from fastspec.bench.case import select
    from fastspec.bench.suites import SUITES, cases

    steps = [s for steps in gpu_run.PLAN.values() for s in steps if s.kind == "bench"]
    assert {s.suite for s in steps} == set(SUITES)
    for suite in SUITES:
        all_cases = cases(suite, tier, CPU)
        counts = {c: 0 for c in map(id, all_cases)}
        for s in (s for s in steps if s.suite == suite):
            flag, *text = s.select or (None,)
            chosen = select(all_cases, text if flag == "--filter" else None, text if flag == "--exclude" else None)
            assert chosen, (suite, s.name)
            for c in chosen:
                counts[id(c)] += 1
        assert set(counts.values()) == {1}, suite
    heads = [c for c in cases("eigvalsh", tier, CPU) if "headline" in c.tags]
    expect = {"gpu": {"B4096-n128-fp32", "B256-n128-fp64"}, "quick": {"B16-n32-fp32", "B8-n32-fp64"}}[tier]
    assert {c.size for c in heads} == expect
    assert {c.size.split("-")[0] for c in cases("covariance", tier, CPU) if "headline" in c.tags} == {"keys"}
    assert [c.size.split("-")[0] for c in cases("probe", tier, CPU) if "headline" in c.tags] == ["measure", "train_step"]


@pytest.mark.parametrize("args, message", [
    (["4", "OUT"], "invalid choice"),
    (["1"], "COMMAND (1, 2 or 3) and OUT are required"),
    (["--cap", "tests", "1", "OUT"], "--cap: expected STEP=SECONDS"),
    (["--cap", "nosuch=5", "1", "OUT"], "--cap: expected STEP=SECONDS"),
    (["--cap", "tests=900", "1", "OUT"], "--cap: command 1: worst case"),
])
def test_bad_arguments_are_refused_in_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        gpu_run.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "OUT").exists()  # refused before anything is written


def test_the_cov_race_step_writes_its_json_into_out_under_its_cap(tmp_path):
    step = next(s for s in gpu_run.PLAN[1] if s.kind == "covrace")
    assert (step.name, step.cap, step.grace) == ("cov-race", 25, 5)
    for dry in (False, True):
        argv = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path, dry).argv(step)
        assert argv[1:] == ["benchmarks/cov_race.py", "--json", str(tmp_path / "cov_race.json"),
                            "--time-limit", "25", *(["--dry-run"] if dry else [])]


def test_the_triton_race_step_writes_its_json_into_out_under_its_cap(tmp_path):
    step = next(s for s in gpu_run.PLAN[2] if s.kind == "tritonrace")
    assert (step.name, step.cap, step.grace) == ("triton-race", 25, 5) and step.worst <= 40
    for dry in (False, True):
        argv = gpu_run.Run(2, gpu_run.PLAN[2], tmp_path, tmp_path, dry).argv(step)
        assert argv[1:] == ["benchmarks/triton_race.py", "--json", str(tmp_path / "triton_race.json"),
                            "--time-limit", "25", *(["--dry-run"] if dry else [])]
    # its file is one of the few that come back from a GPU machine: command 2 stays within 8
    assert gpu_run.DEST.get("tritonrace", "steps.txt") == "steps.txt"


def test_the_kit_stays_offline():
    for path in (KIT / "gpu_run.py", KIT / "gpu_tools.py", KIT / "gpu_summary.py"):
        code = "\n".join(ln.split("#")[0] for ln in path.read_text().splitlines())
        for word in ("pip install", "pip3", "curl", "wget", "git clone", "http://", "https://",
                     "huggingface-cli", "from_pretrained"):
            assert word not in code, f"{path.name} must stay offline: found {word!r}"


def _tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel ``tinymod 1.0`` (one module), hashes in its RECORD as pip expects."""
    import base64
    import hashlib
    import zipfile

    files = {"tinymod.py": b"VALUE = 42\n",
             "tinymod-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinymod\nVersion: 1.0\n",
             "tinymod-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                           b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
                     f",{len(data)}\n" for name, data in files.items()) + "tinymod-1.0.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tinymod-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinymod-1.0.dist-info/RECORD", record)
    return path


def test_fetch_wheels_downloads_for_the_gpu_machines_python(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_run(argv, **kw):
        seen.append(argv)
        _tiny_wheel(Path(argv[argv.index("-d") + 1]))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(gpu_run.subprocess, "run", fake_run)
    assert gpu_run.fetch_wheels(tmp_path / "whl") == 0
    (argv,) = seen
    assert argv[1:4] == ["-m", "pip", "download"] and "--no-deps" in argv and "--only-binary=:all:" in argv
    assert argv[argv.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in argv
    assert argv[-len(gpu_run.WHEELS):] == list(gpu_run.WHEELS)
    assert "1 wheels in" in capsys.readouterr().out


def test_carried_wheels_are_installed_offline_onto_every_steps_path(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "WHEEL_DIR", tmp_path / "whl")
    _tiny_wheel(tmp_path / "whl")
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path / "work", True)
    run.src.mkdir(parents=True)
    run.install_wheels()
    assert (run.site / "tinymod.py").exists()
    assert str(run.site) in run.env["PYTHONPATH"].split(os.pathsep)
    got = subprocess.run([sys.executable, "-c", "import tinymod; print(tinymod.VALUE)"], env=run.env,
                         capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "42"
    log = run.log.read_text()
    assert "carried wheels: tinymod 1.0" in log and "cuSolverDx heev: " in log
    # without carried wheels: said, and the steps go on
    monkeypatch.setattr(gpu_run, "WHEEL_DIR", tmp_path / "none")
    run.install_wheels()
    assert "carried wheels: none in" in run.log.read_text()


def test_the_kernels_step_builds_cusolverdx_only_on_a_gpu_that_can(tmp_path, monkeypatch):
    step = next(s for s in gpu_run.PLAN[1] if s.kind == "kernels")
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path, True)
    assert run.argv(step)[-2:] == ["--algo", "all"]  # the dry run: 2 cores, the race builds it
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path, False)
    run.mathdx = "nvidia-libmathdx is not installed"
    monkeypatch.setattr(gpu_run, "_local_arch", lambda: "90")
    assert run.argv(step)[-2:] == ["--algo", "all"]
    run.mathdx = ""
    assert run.argv(step)[-3:] == ["--algo", "all", "cusolverdx"]


def test_a_step_past_its_cap_is_stopped_and_recorded_as_capped(tmp_path, monkeypatch):
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path / "work", True)
    run.src.mkdir(parents=True)
    # it ignores the polite signal: SIGKILL must end it
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('started', flush=True); time.sleep(60)"
    sleeper = [sys.executable, "-c", code]
    monkeypatch.setattr(run, "argv", lambda step: sleeper)
    monkeypatch.setattr(gpu_run, "KILL", 1)
    t0 = time.monotonic()
    status = run.run(gpu_run.Step("stuck", "bench", 1, 1))
    assert time.monotonic() - t0 < 15
    assert status.startswith("capped after") and "partial results kept" in status
    assert run.failed == []
    assert "step stuck: capped" in (tmp_path / "gpu_run.log").read_text()
    assert "started" in (tmp_path / "steps.txt").read_text()
    monkeypatch.setattr(run, "argv", lambda step: [sys.executable, "-c", "raise SystemExit(3)"])
    assert run.run(gpu_run.Step("broken", "bench", 5)).startswith("FAILED rc 3")
    assert run.failed == ["broken"]


def test_the_tests_step_tells_pytest_its_cap_and_no_other_step_gets_one(tmp_path, monkeypatch):
    """pytest starts no test past the step's cap (the conftest's deadline), so the SIGINT
    ``grace`` seconds later does not land inside a test: the dry run's last test once failed
    with ``ImportError: initialization failed``, a SIGINT during a pybind11 module's import."""
    assert f'DEADLINE_ENV = "{gpu_run.TEST_DEADLINE}"' in (KIT.parent / "conftest.py").read_text()
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path / "work", True)
    run.src.mkdir(parents=True)
    show = f"import os; print('deadline', os.environ.get({gpu_run.TEST_DEADLINE!r}))"
    monkeypatch.setattr(run, "argv", lambda step: [sys.executable, "-c", show])
    t0 = time.time()
    assert run.run(gpu_run.Step("tests", "tests", 40, 5)).startswith("ok")
    deadline = float((tmp_path / "tests.txt").read_text().split("deadline ")[1].split()[0])
    assert t0 + 40 - 1e-3 <= deadline <= time.time() + 40  # written to the millisecond
    assert run.run(gpu_run.Step("bench-x", "bench", 40, 5, suite="eigvalsh")).startswith("ok")
    assert "deadline None" in (tmp_path / "steps.txt").read_text()


# ------------------------------------------------------------------------------------ the tools
@pytest.mark.parametrize("tool, rc, output, expected", [
    ("compute-sanitizer", 0, "========= ERROR SUMMARY: 0 errors", "ok"),
    ("compute-sanitizer", gpu_tools.SANITIZER_FINDING, "========= Invalid __global__ read of size 4", "finding"),
    ("compute-sanitizer", 255, "========= Error: Device not supported", "skipped"),
    ("ncu", 1, "==ERROR== Failed to initialize the profiler: LibraryNotLoaded", "skipped"),
    ("ncu", None, "", "skipped"),
    ("ncu", 1, "Traceback ...\nAssertionError: eigvalsh returned non-finite values", "finding"),
])
def test_a_tool_run_is_ok_a_finding_or_skipped(tool, rc, output, expected):
    state, detail = gpu_tools.classify(tool, rc, output)
    assert state == expected
    if expected != "ok":
        assert detail and "\n" not in detail


def test_a_probe_must_show_the_tool_working():
    assert gpu_tools.probe_ok("ncu", 0, "  gpu__time_duration.sum   usecond   2.05")
    assert not gpu_tools.probe_ok("ncu", 0, "==PROF== No kernels were profiled.")
    assert gpu_tools.probe_ok("compute-sanitizer", 0, "========= ERROR SUMMARY: 0 errors")
    assert not gpu_tools.probe_ok("compute-sanitizer", 1, "========= ERROR SUMMARY: 0 errors")


def test_the_diagnostics_stop_at_their_time_limit_and_need_the_interpreter_on_cpu(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_diag.main(["accuracy", "--dry-run", "--time-limit", "0"]) == 0
    out = capsys.readouterr().out
    rows = len(gpu_diag.accuracy_rows(True))
    assert out.splitlines()[0].split()[:3] == ["case", "dtype", "BT"] and rows >= 4
    assert f"not run (time limit): {rows} settings" in out
    assert gpu_diag.main(["profile", "--dry-run", "--time-limit", "0"]) == 0
    assert [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines()] == ["cov-call", "eig-call", "measure",
                                                                                 "train-step"]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit, match="set TRITON_INTERPRET=1"):
        gpu_diag.main(["accuracy", "--dry-run"])


@pytest.mark.slow
def test_the_accuracy_sweep_still_runs_by_hand_interpreted():
    """gpu_diag.py accuracy left the plan (the race probe replaced it) but stays a tool: its dry
    run gives the launcher's own choice first, every row exact and steady."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(KIT / "gpu_diag.py"), "accuracy", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    accuracy = proc.stdout
    assert proc.returncode == 0, accuracy + proc.stderr[-2000:]
    # 2 load stages for the 2 row blocks of T = 24, and every 16-bit launch sums its dots in a
    # block tile (acc 2), uncentred or split; the long uncentred case also asks for acc 0
    assert re.search(r"^raw T=24 +float16 +32 +8 +2 +2 +[\d.e+-]+ +[\d.e+-]+ +[\d.e+-]+ +no$", accuracy, re.MULTILINE), accuracy
    assert re.search(r"^raw N=64 +float16 +32 +8 +2 +2 .* no$", accuracy, re.MULTILINE), accuracy
    assert re.search(r"^raw N=64 +float16 +32 +8 +2 +0 .* no$", accuracy, re.MULTILINE), accuracy
    assert re.search(r"^split +float16 +\d+ +\d+ +\d+ +2 .* no$", accuracy, re.MULTILINE), accuracy
    assert "ERROR" not in accuracy and "MOVING" not in accuracy, accuracy


def test_the_summary_keeps_the_diagnostics_rows_not_the_profiler_tables(tmp_path):
    (tmp_path / "diag.txt").write_text(
        "launcher  keys B8-T2048-H8-D128 bf16   stages=3 BT=32 split=16 err  1.94e-07 torch  6.96e-06 ratio 0.0278 steady 3.8s\n"
        "launcher  N1024 D128 fp16              not run: time cap reached\n"
        "time launcher  keys B8-T2048-H8-D128 bf16 uncentred, graphed:    44.7 us (stages=3)\n"
        "case       dtype   BT warps stages acc  kernel err\n"
        "raw T=24   float16  32     8      4   0    0.0172   1.1e-07   1.5e+05  no\n"
        "eig-call: B4096-n128-fp32; µs per call\n"
        "  eigvalsh (auto)                host     412.0   device 2550.1\n"
        "measure: L32-KV8: forward 88.6 ms, measure 112 ms\n"
        "-- top by self_cpu_time_total\n"
        "   aten::mm   11.26%   198.045us\n"
        "train-step: ERROR RuntimeError: out of memory\n")
    lines = gpu_summary.summary(tmp_path, None)
    assert [ln.split()[0] for ln in lines[3:]] == ["launcher", "launcher", "time", "case", "raw", "eig-call:", "eigvalsh", "measure:", "train-step:"], lines


def test_the_summary_names_each_failing_test_even_when_pytest_was_cut_off(tmp_path):
    # the H100 run's tests step was killed at its cap before pytest's summary: 5 F's, no names
    (tmp_path / "tests.txt").write_text(
        "[gw0] [  1%] PASSED tests/test_a.py::test_ok\n"
        "[gw3] [  2%] FAILED tests/test_covariance_triton.py::test_head_widths[raw-128-fp16]\n"
        "tests/test_b.py::test_serial[x] FAILED                [  3%]\n"
        "[gw1] [  4%] ERROR tests/test_c.py::test_setup\n"
        "FAILED tests/test_covariance_triton.py::test_head_widths[raw-128-fp16] - AssertionError: 0.017\n")
    lines = [ln for ln in gpu_summary.summary(tmp_path, None) if ln.startswith("tests:")]
    assert lines == ["tests: FAILED tests/test_covariance_triton.py::test_head_widths[raw-128-fp16]",
                     "tests: FAILED tests/test_b.py::test_serial[x]", "tests: ERROR tests/test_c.py::test_setup"]


def test_the_summary_gives_each_failure_its_reason_as_printed_when_it_failed(tmp_path):
    # conftest.py prints a failure's last report lines under the kit's cap (FASTSPEC_TEST_DEADLINE)
    (tmp_path / "tests.txt").write_text(
        "[gw6] [ 15%] FAILED tests/test_covariance_triton.py::test_gpu_against_fp64[raw-keys-bf16] \n"
        "\n"
        "failed now: tests/test_covariance_triton.py::test_gpu_against_fp64[raw-keys-bf16] (call)\n"
        "    [gw6] linux -- Python 3.12.3 /usr/bin/python3\n"
        "    >       assert e2 <= RATIO * r2 + FLOOR, f\"second moment: ...\"\n"
        "    E       AssertionError: second moment: kernel 3.1e-06 vs torch 2.4e-08\n"
        "    E       assert 3.1e-06 <= 5.7e-07\n"
        "    tests/test_covariance_triton.py:91: AssertionError\n"
        "[gw2] [ 16%] PASSED tests/test_a.py::test_ok\n"
        "[gw3] [ 17%] FAILED tests/test_b.py::test_cut_before_its_report\n")
    lines = [ln for ln in gpu_summary.summary(tmp_path, None) if ln.startswith("tests:")]
    reason = "AssertionError: second moment: kernel 3.1e-06 vs torch 2.4e-08"
    assert lines == [f"tests: FAILED tests/test_covariance_triton.py::test_gpu_against_fp64[raw-keys-bf16]: {reason}",
                     "tests: FAILED tests/test_b.py::test_cut_before_its_report"]


def test_the_sanitizer_counts_kernel_errors_not_host_api_errors():
    # the H200 run's memcheck failed on 34 cuGetProcAddress API errors of cuda-bindings' loader
    for mode in ("memcheck", "racecheck"):
        for names in (None, ["eig", "cov"]):
            argv = gpu_tools._tool_argv("compute-sanitizer", mode, names)
            i = argv.index("--report-api-errors")
            assert argv[i + 1] == "no" and argv.index("--tool") < i < argv.index(sys.executable)


@pytest.mark.parametrize("command", ["ncu", pytest.param("sanitize", marks=pytest.mark.slow)])
def test_a_missing_tool_is_skipped_and_its_targets_still_rehearsed(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it: the tool is missing
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_tools.main([command, "--dry-run", "--time-limit", "120"]) == 0
    out = capsys.readouterr().out
    tool = {"ncu": "ncu", "sanitize": "compute-sanitizer"}[command]
    assert f"{tool}: skipped: {tool} not found on PATH" in out
    assert "eig: 8 × 32×32 fp32, backend=host: ok" in out and "raw Gram: ok" in out


def _fake_tool(folder: Path, name: str, probe: str, target: str, target_rc: int) -> None:
    """A stand-in for a profiler: the probe (a ``python -c`` program) prints ``probe`` and exits
    0; a run on the kit's targets prints ``target`` and exits ``target_rc``."""
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"""#!/bin/sh
case "$*" in *" -c "*) echo '{probe}'; exit 0 ;; esac
echo '{target}'; exit {target_rc}
""")
    (folder / name).chmod(0o755)


def test_a_sanitizer_finding_fails_the_step_and_a_working_profiler_passes(tmp_path, monkeypatch, capsys):
    _fake_tool(tmp_path, "compute-sanitizer", "========= ERROR SUMMARY: 0 errors",
               "========= Invalid __shared__ write of size 4 bytes", gpu_tools.SANITIZER_FINDING)
    _fake_tool(tmp_path, "ncu", "    gpu__time_duration.sum   us   2.1", "  Duration  us  1234", 0)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_tools.main(["sanitize", "--time-limit", "60"]) == 1
    out = capsys.readouterr().out
    assert "compute-sanitizer memcheck eig+cov: finding: rc 86: ========= Invalid __shared__ write" in out
    assert "compute-sanitizer racecheck eig+cov: finding" in out
    assert gpu_tools.main(["ncu", "--time-limit", "60"]) == 0
    out = capsys.readouterr().out
    assert "ncu full eig: ok" in out and "ncu full cov: ok" in out and "skipped" not in out


def test_a_tool_run_past_its_timeout_is_killed_with_what_it_started():
    t0 = time.monotonic()
    rc, out = gpu_tools._run(["sh", "-c", "echo started; sleep 30 & sleep 30"], 1)
    assert rc is None and out == "started\n" and time.monotonic() - t0 < 10
    assert gpu_tools._run(["no-such-tool-here"], 1)[0] == 127


# ------------------------------------------------------------------------- the dry run, all of it
def _hidden(tmp_path: Path) -> dict[str, str]:
    """An environment with the profilers broken as on a gVisor machine, and CuPy and JAX hidden."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool, message, rc in (("ncu", "==ERROR== Failed to initialize the profiler: LibraryNotLoaded", 1),
                              ("compute-sanitizer", "========= Error: Device not supported", 255)):
        (bin_ / tool).write_text(f"#!/bin/sh\necho '{message}' >&2\nexit {rc}\n")
        (bin_ / tool).chmod(0o755)
    hide = tmp_path / "hide"
    for package in ("cupy", "jax"):
        (hide / package).mkdir(parents=True)
        (hide / package / "__init__.py").write_text(f"raise ImportError('{package} hidden by tests/test_gpu_run.py')\n")
    return {**os.environ, "PIP_NO_INDEX": "1", "TMPDIR": str(tmp_path),
            "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(hide), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.slow
def test_dry_run_of_the_whole_plan_offline_with_tools_and_anchors_missing(tmp_path):
    """The acceptance check: the three commands, exactly as a GPU session runs them, on CPU."""
    env = _hidden(tmp_path)
    logs = {}
    for command in (1, 2, 3):
        out = tmp_path / f"out{command}"
        proc = subprocess.run([sys.executable, str(KIT / "gpu_run.py"), "--dry-run", str(command), str(out)],
                              capture_output=True, text=True, env=env, timeout=600, check=False)
        log = (out / "gpu_run.log").read_text() if (out / "gpu_run.log").exists() else ""
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + log[-2000:]
        files = sorted(p.name for p in out.iterdir())
        assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8, files  # few flat files
        assert "===== summary" in proc.stdout and "===== summary" in log
        logs[command] = log
        doc = _strict_json(out / "bench.json")
        assert doc["schema"] == runner.SCHEMA and doc["kind"] == "bench" and doc["tier"] == "quick"
        assert {"fastspec", "torch", "triton", "device", "driver", "cuda"} <= set(doc["environment"])
        assert not [r for r in doc["results"] if "error" in r], [r for r in doc["results"] if "error" in r]
        assert any("fastspec_s" in r for r in doc["results"])
        assert doc["gpu_run"]["runs"][-1]["dry_run"] is True
        assert doc["gpu_run"]["runs"][-1]["command"] == str(command)
        for step in gpu_run.PLAN[command]:
            # the tests step may reach its cap (on the H100 too): its SIGINT still lets pytest
            # print its summary, checked below; on 2 CPU cores its interpreted tests took 67-82 s
            done = "ok|reused|capped after" if step.kind == "tests" else "ok|reused"
            assert re.search(rf"step {re.escape(step.name)}: ({done})", log), (command, step.name, log)
        skipped = [r["skipped"] for r in doc["results"] if r.get("baseline") == "jax.numpy.linalg.eigvalsh"]
        if command in (1, 2):
            assert skipped and all(s.startswith("jax not importable: ImportError: jax hidden by tests/")
                                   for s in skipped), skipped
    assert "step build: ok" in logs[1]
    assert "step build: reused" in logs[2] and "step build: reused" in logs[3]  # one build, three commands
    # NVRTC compiled every algorithm's kernels for sm_90 once; the later commands found them in the kit's cache
    k = len(precompile.todo(90, [int(n) for n in gpu_run.KERNEL_SIZES], ["float32", "float64"], ["all"]))
    assert k > 6  # the block algorithm's 6 and the candidates'
    # (the header line goes on to count the covariance Gram kernels, listed after the eigensolver's)
    assert re.search(rf"{k} variants for sm_90\b.*\n(.*nvrtc .*\n){{{k}}}", (tmp_path / "out1" / "steps.txt").read_text())
    assert re.search(rf"{k} variants for sm_90\b.*\n(.*disk .*\n){{{k}}}", (tmp_path / "out2" / "steps.txt").read_text())
    # the race ran every algorithm on CPU (the team emulation as a stand-in) and its rows are marked so
    race = _strict_json(tmp_path / "out1" / "race.json")
    assert race["dry_run"] is True and len(race["results"]) == len(eig_race.SHAPES) and not race["not_run"]
    # fastspec's own algorithms all ok; cuSolverDx's heev (where the mathdx extra is installed) built for sm_90
    assert all(a["ok"] for r in race["results"] for a in r["algorithms"].values() if a["ms"] is not None)
    assert all(a["dry_run_build"]["built"] for r in race["results"] for a in r["algorithms"].values()
               if a["ms"] is None)
    assert all(r["measured"]["dry_run"] for r in race["rows"])
    assert re.search(r"^race B4096-n128-fp32-dry: winner \w+ \(", logs[1], re.MULTILINE)
    # the eigensolver's phases: every algorithm's profiling build compiled for sm_90 and a record
    # synthesized from its emulated phase sequence decoded, its three largest phases in the summary
    phases = _strict_json(tmp_path / "out1" / "phases.json")
    assert phases["dry_run"] is True and not phases["not_run"] and phases["results"]
    assert not [r for r in phases["results"] if "error" in r]
    assert {r["algo"] for r in phases["results"]} == set(variants.ALGORITHMS)
    assert re.search(r"^phases B4096-n128-fp32-dry packed: \w+ \d+%", logs[1], re.MULTILINE)
    # the covariance route race: every route raced or listed with its reason, each raced one
    # exact on CPU (blocked, the Triton routes interpreted), its rows marked as a dry run's
    cov = _strict_json(tmp_path / "out1" / "cov_race.json")
    assert cov["dry_run"] is True and not cov["not_run"]
    assert [r["shape"] for r in cov["results"]] == [s.name for s in cov_race.DRY_SHAPES]
    for res in cov["results"]:
        assert set(res["routes"]) | set(res["not_raced"]) == set(cov["routes"]) and "blocked" in res["routes"]
        assert all(r["ok"] for r in res["routes"].values()), res["routes"]
    assert cov["rows"] and all(r["measured"]["dry_run"] for r in cov["rows"])
    assert re.search(r"^dry-B2-T16-S2-D32-fp16: winner \w+ ", (tmp_path / "out1" / "steps.txt").read_text(),
                     re.MULTILINE)
    assert re.search(r"^cov-race dry-B2-T16-S2-D32-fp16: winner \w+ \(", logs[1], re.MULTILINE)  # the summary
    # the Triton configuration race (command 2): every candidate of each case's kernel checked on
    # CPU (interpreted) and timed as a stand-in, the default passing, its rows marked as a dry run's
    tri = _strict_json(tmp_path / "out2" / "triton_race.json")
    assert tri["dry_run"] is True and not tri["not_run"]
    assert [r["case"] for r in tri["results"]] == [c.name for c in triton_race.DRY_CASES]
    for res in tri["results"]:
        assert res["complete"] and res["candidates"][res["default"]]["ok"], res["candidates"]
        assert all(r["ok"] for r in res["candidates"].values()), res["candidates"]
    assert tri["rows"] and all(r["dry_run"] for r in tri["rows"])
    assert re.search(r"^triton-race dry-keys-\S+-raw: winner \S+ \(", logs[2], re.MULTILINE)  # the summary
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == [
        "bench.json", "diag.txt", "gpu_run.log", "steps.txt", "tools.txt", "triton_race.json"]
    builds = [r for r in _strict_json(tmp_path / "out2" / "bench.json")["results"]
              if r["size"].startswith("compile-") and "fastspec_s" in r]
    assert builds and all(r["fastspec_error"] == 0 for r in builds)
    tests = (tmp_path / "out1" / "tests.txt").read_text()
    # the Triton tests, interpreted; -v names every test, so look for outcomes, not the word
    assert re.search(r"\d+ passed", tests) and not re.search(r"\d+ failed", tests), tests[-3000:]
    assert not gpu_summary.PYTEST_FAILED.search(tests), tests[-3000:]
    ncu, sanitizer = ((tmp_path / f"out{c}" / "tools.txt").read_text() for c in (2, 3))
    assert "ncu: skipped: probe failed: rc 1: ==ERROR== Failed to initialize the profiler: LibraryNotLoaded" in ncu
    assert "compute-sanitizer: skipped: probe failed: rc 255: ========= Error: Device not supported" in sanitizer
    for tools in (ncu, sanitizer):  # the targets rehearsed without the tools
        assert tools.count("eig: 8 × 32×32 fp32, backend=host: ok") == 1
    assert "ncu: skipped" in logs[2] and "compute-sanitizer: skipped" in logs[3]
    # the race probe and the profile ran, interpreted: their rows and timing lines reach the summary
    probe = (tmp_path / "out1" / "diag.txt").read_text()
    # the library's launch on each dry input, exact (the interpreter has no race) and steady
    rows = re.findall(r"^launcher +(keys B1-T160-H2-D128|D96 B2-T32-H2) .* err +(\S+) torch +(\S+) ratio +\S+ steady ",
                      probe, re.MULTILINE)
    assert [r[0] for r in rows] == ["keys B1-T160-H2-D128", "D96 B2-T32-H2"], probe
    assert all(float(k) <= 4 * float(t) + 1e-7 for _, k, t in rows), rows
    assert "MOVING" not in probe and "ERROR" not in probe and "not run" not in probe, probe
    # gpu_diag's own failure lines ("<row>  ERROR ...", "<part>: ERROR ..."); not Kineto's stderr,
    # which torch's CUDA builds print on a machine without a GPU ("ERROR:... gpuGetDeviceCount")
    own_error = re.compile(r"(  ERROR |^[\w-]+: ERROR )", re.MULTILINE)
    profile = (tmp_path / "out2" / "diag.txt").read_text()
    for line in ("cov-call: keys", "  partials, uncentred", "eig-call: B8-n16-fp32", "  eigvalsh (auto)", "measure: L",
                 "train step: L", "-- top by self_cpu_time_total"):
        assert line in profile, profile[-3000:]
    assert not own_error.search(profile), profile[-3000:]
    assert re.search(r"^launcher +keys B1-T160", logs[1], re.MULTILINE)
    assert re.search(r"^train step: L", logs[2], re.MULTILINE)
    compiled = [r for r in _strict_json(tmp_path / "out3" / "bench.json")["results"]
                if r["suite"] == "train_step_compiled" and "fastspec_s" in r]
    assert compiled and all(r["recompiles"] == 0 and r["graph_breaks"] == 0 and r["fastspec_error"] == 0
                            for r in compiled)
    comp = _strict_json(tmp_path / "out3" / "compare.json")
    assert comp["results"] and all(r.get("within_2x_torch") for r in comp["results"])


# ------------------------------------------------------------------------ SIGTERM keeps the JSON
def _json_steps() -> list:
    return [s for steps in gpu_run.PLAN.values() for s in steps if s.kind in ("bench", "compare")]


@pytest.mark.parametrize("step", [pytest.param(s, marks=() if s.name == "bench-covariance" else pytest.mark.slow)
                                  for s in _json_steps()], ids=lambda s: s.name)  # one step in the fast tier
def test_sigterm_to_any_step_leaves_valid_json_for_what_finished(step, tmp_path):
    """Each step that writes JSON, started as the kit starts it (dry), is sent SIGTERM as soon as
    one case has finished: its file is valid JSON holding that case, the rest marked skipped."""
    run = gpu_run.Run(1, gpu_run.PLAN[1], tmp_path, tmp_path, True)
    argv = run.argv(step)
    path = Path(argv[argv.index("--json") + 1])
    env = {**run.env, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    rows = []
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            rows = [r for r in _strict_json(path)["results"] if "skipped" not in r]
            if rows:
                break
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail(f"{step.name} ended before SIGTERM: {proc.stdout.read()[-2000:]}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # a capped run is not a failure (compare's 1 would be its verdict: no row says error below);
    # a SIGTERM that lands after the last case, once the handler is gone, ends it by the signal
    allowed = {0, -signal.SIGTERM} | ({1} if step.kind == "compare" else set())
    assert proc.returncode in allowed, out[-3000:]
    doc = _strict_json(path)
    finished = [r for r in doc["results"] if "skipped" not in r]
    assert len(finished) >= len(rows) >= 1
    assert not [r for r in doc["results"] if "error" in r], doc["results"]
    assert not (tmp_path / (path.name + ".tmp")).exists()
