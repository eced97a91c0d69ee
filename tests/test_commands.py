"""``fastspec precompile`` (:mod:`fastspec.commands.precompile`): bad flags are one-line usage
errors naming the flag, the work is the library's, and ``python -m fastspec.eig.precompile`` is
the same command. Also what every command's ``--help`` promises about time, and ``fastspec info``'s
cuSolverDx line and its ``triton cfg`` section. (Every command's ``--help`` staying light is
tests/test_imports.py; the other commands have their own test files, and ``fastspec info``'s other
lines are tested with what they report: tests/test_eig_nvrtc.py, tests/test_eig_variants.py, tests/test_covariance_routes.py.)"""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest

from fastspec.cli import main
from fastspec.eig import nvrtc


@pytest.mark.parametrize("argv, message", [
    (["--arch", "91"], "argument --arch: no shared-memory table for sm_91; known: ["),
    (["--arch", "ninety"], "argument --arch: expected a compute capability such as 90, got 'ninety'"),
    (["--arch", "90", "--n", "0"], "argument --n: expected sizes in [1, "),
    (["--arch", "90", "--n", "64", "x"], "argument --n: expected sizes in [1, "),
    (["--arch", "90", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--arch", "90", "--cov-d", "80"], "argument --cov-d: expected head widths in 32, 64, 96, 128, got '80'"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["precompile", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"fastspec precompile: error: {message}"), err


def test_jobs_below_one_is_refused_before_anything_compiles(capsys, monkeypatch):
    import fastspec.eig.precompile as library

    monkeypatch.setattr(library, "precompile", lambda *a, **kw: pytest.fail("compiled"))
    assert main(["precompile", "--arch", "90", "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "fastspec precompile: error: --jobs: expected an int >= 1, got 0\n"


def test_dtype_choices_are_the_solvers_dtypes():
    """The choices are a constant (``--help`` imports no torch); they must follow the solver."""
    from fastspec.commands.precompile import DTYPES
    from fastspec.eig.cuda import ITEMSIZE

    assert DTYPES == tuple(sorted(ITEMSIZE))


@pytest.mark.skipif(bool(nvrtc.missing()), reason=f"needs NVRTC: {nvrtc.missing()}")
def test_precompile_fills_the_cache_and_the_module_runs_the_same_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    nvrtc.forget()
    try:
        assert main(["precompile", "--arch", "90", "--n", "32", "--dtype", "float32", "--cov-d", "--jobs", "1"]) == 0
    finally:
        nvrtc.forget()
    out = capsys.readouterr().out
    assert f"cache {tmp_path / 'eig'}, 1 variants for sm_90, 0 covariance Gram kernels" in out
    assert "float32-n32" in out and "nvrtc" in out
    assert len(list((tmp_path / "eig").iterdir())) == 1
    # python -m fastspec.eig.precompile: the same command, now a cache hit
    proc = subprocess.run([sys.executable, "-m", "fastspec.eig.precompile", "--arch", "90", "--n", "32",
                           "--dtype", "float32", "--cov-d", "--jobs", "1"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "float32-n32" in proc.stdout and " disk " in proc.stdout
    # the covariance Gram kernel: every input dtype of one head width, into the same cache
    assert main(["precompile", "--arch", "90", "--n", "32", "--dtype", "float32", "--cov-d", "32", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 variants for sm_90, 4 covariance Gram kernels" in out
    assert out.count("cov_gram-") == 4 and len(list((tmp_path / "eig").glob("cov_gram-*"))) == 4
    bad = subprocess.run([sys.executable, "-m", "fastspec.eig.precompile", "--arch", "91"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "fastspec precompile: error: argument --arch" in bad.stderr


# ------------------------------------------------------------------ what --help promises about time
def _subparser(command: str):
    from fastspec.cli import build_parser

    parser = build_parser((command,))
    return next(a for a in parser._actions if a.dest == "command").choices[command]


def _help(command: str) -> str:
    return " ".join(_subparser(command).format_help().split())  # argparse wraps lines: compare the words


def _quick_help(command: str) -> str:
    return next(a.help for a in _subparser(command)._actions if "--quick" in a.option_strings)


@pytest.mark.parametrize("command", ["bench", "compare", "demo"])
def test_quick_help_states_the_measured_time(command):
    """--quick promised "seconds on a CPU" (bench: 24 s measured on a 2-core CPU, 2.5 minutes on
    a newcomer's busy one), "well under a second" (compare: 3 s) and "seconds" (demo: 8 s): each
    command now states what was measured, in one constant, QUICK_TIME, beside how it was measured."""
    module = importlib.import_module(f"fastspec.commands.{command}")
    stated = module.QUICK_TIME
    assert re.search(r"\b(about|under|up to)\b", stated) and "2-core CPU" in stated, stated
    assert stated in _quick_help(command)


def test_no_help_promises_seconds_for_a_run():
    """No command's help claims a sub-second or seconds-long run: the old wordings are gone, and
    any new time claim goes through a QUICK_TIME constant (above)."""
    from fastspec.cli import COMMANDS

    for command in COMMANDS:
        text = _help(command)
        for claim in ("under a second", "seconds on a CPU", "(seconds)", "runs in seconds"):
            assert claim not in text, (command, claim, text)


# ------------------------------------------------------------------------------ fastspec info


def _info(capsys, *flags) -> str:
    assert main(["info", *flags]) == 0
    return capsys.readouterr().out


def test_info_reports_cusolverdx_heev_with_its_versions(monkeypatch, capsys):
    from fastspec.eig import mathdx

    got = {"available": True, "reason": None, "libmathdx": "nvidia-libmathdx-cu13 0.4.2.37", "cusolverdx": "0.6.0",
           "nvjitlink": "13.5"}
    monkeypatch.setattr(mathdx, "info", lambda: dict(got))
    out = _info(capsys)
    line = next(ln for ln in out.splitlines() if ln.startswith("cusolverdx: "))
    assert line.startswith("cusolverdx: cuSolverDx heev available (cuSolverDx 0.6.0, nvidia-libmathdx-cu13 0.4.2.37, "
                           "nvJitLink 13.5): ")
    assert "FASTSPEC_EIG_VARIANT=cusolverdx" in line
    assert json.loads(_info(capsys, "--json"))["eigvalsh_cusolverdx"] == got


def test_info_says_why_cusolverdx_heev_is_absent(monkeypatch, capsys):
    from fastspec.eig import mathdx

    monkeypatch.setattr(mathdx, "distribution", lambda: None)  # the real info(), without the wheel
    out = _info(capsys)
    why = f"nvidia-libmathdx is not installed; {mathdx.INSTALL}"
    assert f"cusolverdx: cuSolverDx heev cannot be built here: {why}\n" in out
    assert "pip install 'fastspec[mathdx]'" in out
    d = json.loads(_info(capsys, "--json"))["eigvalsh_cusolverdx"]
    assert d["available"] is False and d["reason"] == why
    # asking failing is a reason too, not a traceback: the rest of the report still prints
    monkeypatch.setattr(mathdx, "info", lambda: (_ for _ in ()).throw(OSError("libmathdx.so.0: bad ELF\nmore")))
    out = _info(capsys)
    assert "cusolverdx: cuSolverDx heev cannot be built here: OSError: libmathdx.so.0: bad ELF\n" in out
    assert "cov route: " in out
    d = json.loads(_info(capsys, "--json"))["eigvalsh_cusolverdx"]
    assert d == {"available": False, "reason": "OSError: libmathdx.so.0: bad ELF", "libmathdx": None}


def test_info_reports_the_triton_launch_settings(monkeypatch, capsys):
    from fastspec.covariance import triton_configs

    monkeypatch.delenv(triton_configs.ENV, raising=False)
    triton_configs.forget()
    out = _info(capsys)
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("triton cfg: "))
    assert lines[i].startswith("triton cfg: float32 Triton covariance kernels' launch settings on cpu (")
    assert f"measured rows in {triton_configs.TABLE.name}; FASTSPEC_COV_TRITON_CONFIG forces one)" in lines[i]
    choices = triton_configs.info(None)["choices"]
    body = lines[i + 1:i + 1 + len(choices)]
    assert len(body) == len(choices) == 8
    for ln, c in zip(body, choices):  # kernel, dtype, convention, the candidate and why
        assert ln.split()[:3] == [c["kernel"], c["dtype"], "centred" if c["center"] else "raw"]
        assert ln.strip().endswith(f"{c['config']} ({c['why']})")
        assert ln.split()[3] in triton_configs.BY_NAME
    d = json.loads(_info(capsys, "--json"))["covariance_triton_configs"]
    assert d["device"] == "cpu" and d["choices"] == choices and d["table"] == triton_configs.TABLE.name
    assert d["override"] is None and d["rows"] == len(triton_configs.load_table())
    # a forced candidate is named in the header and in every line of its kernel
    name = triton_configs.CANDIDATES["ffn"][-1].name
    monkeypatch.setenv(triton_configs.ENV, name)
    out = _info(capsys)
    assert f"FASTSPEC_COV_TRITON_CONFIG={name})" in out
    assert sum("ffn  " in ln and name in ln for ln in out.splitlines()) == 4
    # keys: the forced name is an ffn candidate, so each keys line says why it cannot run
    assert sum(ln.split()[:1] == ["keys"] and " error " in ln for ln in out.splitlines()) == 4


def test_info_reports_a_triton_table_or_query_that_fails_in_a_line(monkeypatch, capsys, tmp_path):
    from fastspec.covariance import triton_configs

    monkeypatch.delenv(triton_configs.ENV, raising=False)
    bad = tmp_path / "triton_configs.json"
    bad.write_text(json.dumps({"format": 1, "about": "x", "rows": [
        {"arch": 90, "kernel": "keys", "dtype": "bfloat16", "center": True, "config": "no-such"}]}))
    monkeypatch.setattr(triton_configs, "TABLE", bad)
    triton_configs.forget()
    try:
        out = _info(capsys)
        assert "triton cfg: float32 Triton covariance kernels' launch settings on cpu (? measured rows" in out
        assert "  error: ValueError: triton_configs.json: config 'no-such' is not a keys candidate" in out
        d = json.loads(_info(capsys, "--json"))["covariance_triton_configs"]
        assert d["rows"] is None and d["error"].startswith("ValueError: ")
        # asking failing outright is a line too, and the rest of the report still prints
        monkeypatch.setattr(triton_configs, "info", lambda device=None: (_ for _ in ()).throw(RuntimeError("no\nmore")))
        out = _info(capsys)
        assert "triton cfg: cannot tell: RuntimeError: no\n" in out and "cov route: " in out
        assert json.loads(_info(capsys, "--json"))["covariance_triton_configs"] == {"error": "RuntimeError: no",
                                                                                    "choices": []}
    finally:
        triton_configs.forget()
