"""Start-up stays cheap: ``import fastspec``, ``import fastspec.cli`` and ``fastspec --help``
import no torch, no compiler stack, no optional library and no sub-command module (the public
names load on first use); ``fastspec CMD`` imports CMD's module alone, and the light commands'
``--help`` imports no torch either.

Each check runs in a fresh interpreter, since this pytest process has long imported everything.
No timing assertions (timing belongs to benchmarks); the import time is printed for ``-s`` runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import fastspec
from fastspec._trace import assume_constant_result
from fastspec.cli import COMMANDS, main
from fastspec.eig import cuda as eig_cuda

# what `import fastspec` must leave out (a name covers its submodules)
HEAVY = ("torch._dynamo", "scipy", "triton", "pandas", "matplotlib", "transformers")
LAZY = ("fastspec.analysis", "fastspec.plots", "fastspec.report", "fastspec.integrations", "fastspec.demo",
        "fastspec.bench")
# commands whose --help builds its parser without torch (all of them)
LIGHT = ("info", "bench", "compare", "report", "demo", "precompile", "plan")
# the library package each command runs (its module is fastspec.commands.<name>): a command's
# --help may import its own, never another command's module or package
UNITS = {"info": "fastspec.sysinfo", "bench": "fastspec.bench", "compare": "fastspec.bench",
         "demo": "fastspec.demo", "report": "fastspec.report", "precompile": "fastspec.eig",
         "analyze": "fastspec.checkpoints", "plan": "fastspec.probe"}

# the child imports the fastspec under test (the repository root first on sys.path), not another install
ROOT = str(Path(fastspec.__file__).resolve().parents[1])

CHILD_PRELUDE = """
import contextlib, io, json, sys, time

def loaded(names):
    # {name: how many of its modules are imported} for each of names (a package or a module) present
    counts = {n: sum(m == n or m.startswith(n + ".") for m in sys.modules) for n in names}
    return {n: c for n, c in counts.items() if c}

def captured(run):
    # exit code and output of a CLI entry point; SystemExit (--help, usage errors) caught
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run()
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
"""


def _child(body: str) -> dict:
    """Run ``body`` in a fresh interpreter; its last stdout line is a JSON object, returned."""
    code = CHILD_PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, f"child interpreter failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _leaks(got: dict) -> str:
    return ", ".join(f"{name} ({n} modules)" for name, n in got["leaked"].items())


def test_import_fastspec_leaves_heavy_and_lazy_modules_out():
    got = _child(f"""
        t0 = time.perf_counter()
        import torch
        t1 = time.perf_counter()
        import fastspec
        t2 = time.perf_counter()
        print(json.dumps({{"file": fastspec.__file__, "torch_s": t1 - t0, "fastspec_s": t2 - t1,
                          "leaked": loaded({HEAVY + LAZY!r})}}))
    """)
    print(f"import torch: {got['torch_s']:.2f} s, then import fastspec: {got['fastspec_s']:.2f} s")
    assert Path(got["file"]).resolve() == Path(fastspec.__file__).resolve()
    assert not got["leaked"], f"`import fastspec` imported {_leaks(got)}"


def test_import_fastspec_and_its_cli_leave_torch_out():
    got = _child(f"""
        import fastspec
        res = {{"fastspec": loaded(("torch",) + {HEAVY + LAZY!r})}}
        import fastspec.cli
        res["leaked"] = loaded(("torch",) + {HEAVY + LAZY!r})
        print(json.dumps(res))
    """)
    assert not got["fastspec"], f"`import fastspec` imported {', '.join(got['fastspec'])}"
    assert not got["leaked"], f"`import fastspec.cli` imported {_leaks(got)}"


def test_public_names_load_on_first_use_and_all_of_them_resolve():
    got = _child("""
        import fastspec
        res = {"dir": dir(fastspec), "all": fastspec.__all__}
        ns = {}
        exec("from fastspec import " + ", ".join(fastspec.__all__), ns)  # every name, the star-less way
        res["torch_after_from"] = "torch" in sys.modules
        res["same"] = [n for n in fastspec.__all__ if ns[n] is not getattr(fastspec, n)]
        res["home"] = {n: getattr(ns[n], "__module__", None) or ns[n].__name__ for n in fastspec.__all__}
        res["submodule"] = fastspec.probe.ModuleSite.__module__  # README: fastspec.probe.ModuleSite
        print(json.dumps(res))
    """)
    assert set(got["all"]) <= set(got["dir"]) and {"analysis", "probe"} <= set(got["dir"])
    assert got["torch_after_from"] and got["same"] == []
    assert all(home.startswith("fastspec.") for home in got["home"].values()), got["home"]
    assert got["submodule"] == "fastspec.probe.sites"
    # and in this process: the lazy names are the objects their modules define
    from fastspec.covariance import Covariance
    from fastspec.probe import Probe, Record

    assert (fastspec.Probe, fastspec.Record, fastspec.Covariance) == (Probe, Record, Covariance)
    with pytest.raises(AttributeError, match="no_such_name"):
        fastspec.no_such_name


def test_help_lists_every_command_without_importing_any():
    # `python -m fastspec --help`, run by runpy in the child so that sys.modules can be read after
    got = _child(f"""
        import runpy
        sys.argv = ["fastspec", "--help"]
        res = captured(lambda: runpy.run_module("fastspec", run_name="__main__"))
        res["leaked"] = loaded(("torch", "fastspec.commands") + {HEAVY + LAZY + tuple(UNITS.values())!r})
        print(json.dumps(res))
    """)
    assert got["code"] == 0, got["stderr"]
    help_text = " ".join(got["stdout"].split())  # argparse wraps long help lines
    for name, (_, help_) in COMMANDS.items():
        assert f"{name} {help_}" in help_text, f"{name!r} or its help missing from `fastspec --help`"
    assert not got["leaked"], f"`fastspec --help` imported {_leaks(got)}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_command_help_imports_that_command_only(command):
    module = COMMANDS[command][0]
    others = tuple(sorted({u for u in UNITS.values() if u != UNITS[command]}
                          | {m for m, _ in COMMANDS.values() if m != module}))
    got = _child(f"""
        from fastspec.cli import main
        res = captured(lambda: main([{command!r}, "--help"]))
        res["own"] = {module!r} in sys.modules
        res["leaked"] = loaded({others!r})
        res["torch"] = "torch" in sys.modules
        print(json.dumps(res))
    """)
    assert got["code"] == 0, got["stderr"]
    assert got["stdout"].startswith(f"usage: fastspec {command}"), got["stdout"]
    assert got["own"], f"`fastspec {command} --help` did not import {module}"
    assert not got["leaked"], f"`fastspec {command} --help` imported {_leaks(got)}"
    if command in LIGHT:
        assert not got["torch"], f"`fastspec {command} --help` imported torch"


def test_bench_help_leaves_demo_out():
    got = _child("""
        from fastspec.cli import main
        res = captured(lambda: main(["bench", "--help"]))
        res["bench"] = "fastspec.commands.bench" in sys.modules
        res["leaked"] = loaded(("fastspec.demo",))
        print(json.dumps(res))
    """)
    assert got["code"] == 0 and got["bench"], got
    assert not got["leaked"], f"`fastspec bench --help` imported {_leaks(got)}"


def test_lazy_submodules_resolve_on_first_use():
    names = ("analysis", "plots", "report", "integrations", "demo")
    got = _child(f"""
        import fastspec
        res = {{}}
        for name in {names!r}:
            before = "fastspec." + name in sys.modules
            mod = getattr(fastspec, name)
            res[name] = [before, mod is sys.modules["fastspec." + name]]
        try:
            fastspec.no_such_thing
            res["missing"] = "resolved"
        except AttributeError as exc:
            res["missing"] = str(exc)
        print(json.dumps(res))
    """)
    for name in names:
        assert got[name] == [False, True], f"fastspec.{name}: (imported before use, resolved) = {got[name]}"
    assert "no_such_thing" in got["missing"]


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "invalid choice: 'no-such-command'" in err and "Traceback" not in err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_build_parser_rejects_unknown_command_names():
    from fastspec.cli import build_parser

    with pytest.raises(ValueError, match="with_arguments"):
        build_parser(["no-such-command"])


# ---------------------------------------------------------------- assume_constant_result at import
# cuda._binding_status (imports cuda.bindings, asks NVRTC its version) must trace as a constant
# under torch.compile; cuda.py marks it without importing torch._dynamo (see fastspec/_trace.py)


def test_native_mark_is_what_torch_sets():
    def by_torch():
        return 0

    def by_fastspec():
        return 0

    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert assume_constant_result(by_fastspec) is by_fastspec
    assert vars(by_fastspec) == vars(by_torch) == {"_dynamo_marked_constant": True}


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_cuda_binding_status_traces_as_a_constant(monkeypatch):
    # os.cpu_count stands in for the binding's import and NVRTC call: a builtin dynamo cannot
    # trace (the unmarked copy below proves it), so fullgraph succeeds only when the mark makes
    # dynamo run it eagerly
    monkeypatch.setattr(eig_cuda, "_driver", os.cpu_count)
    monkeypatch.setattr(eig_cuda.nvrtc, "version", lambda: (13, 0))
    fn = eig_cuda._binding_status
    unmarked = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__)

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(lambda x: x + len(unmarked()[1]), backend="eager", fullgraph=True)(torch.zeros(3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + len(eig_cuda._binding_status()[1]), backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(3)), torch.full((3,), float(len("NVRTC 13.0"))))
