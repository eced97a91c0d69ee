"""``fastspec precompile`` (:mod:`fastspec.commands.precompile`): bad flags are one-line usage
errors naming the flag, the work is the library's, and ``python -m fastspec.eig.precompile`` is
the same command. Also what every command's ``--help`` promises about time, and ``fastspec info``'s
cuSolverDx line. (Every command's ``--help`` staying light is tests/test_imports.py; the other
commands have their own test files, and ``fastspec info``'s other lines are tested with what they
report: tests/test_eig_nvrtc.py, tests/test_eig_variants.py, tests/test_covariance_routes.py.)"""
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
                           "--dtype", "float32", "--cov-d", "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "float32-n32" in proc.stdout and " disk " in proc.stdout
    # the covariance Gram kernel: every input dtype of one head width, into the same cache
    assert main(["precompile", "--arch", "90", "--n", "32", "--dtype", "float32", "--cov-d", "32", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 variants for sm_90, 4 covariance Gram kernels" in out
    assert out.count("cov_gram-") == 4 and len(list((tmp_path / "eig").glob("cov_gram-*"))) == 4
    bad = subprocess.run([sys.executable, "-m", "fastspec.eig.precompile", "--arch", "91"],
                         capture_output=True, text=True, timeout=300)
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
