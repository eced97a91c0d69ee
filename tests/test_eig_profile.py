"""The eigensolver's profiling build and its reader (``fastspec/eig/profile.py``).

Without a GPU: the phase ids agree between C++ and Python; the team emulation makes each
algorithm's marks where its header says (load, then per reflector its phases, then isolate, refine,
sort, end; every barrier a mark of its own that resumes the phase it interrupted); the decoder turns
a record into the cycles the record holds (synthesized from the emulation's own sequence with known
costs, a clock that wraps, a record too short); the profiling build compiles for sm_90 through the
solver's NVRTC path with the clock and timer reads in it, the normal build without them; the GPU
kit's phase step runs in its dry form. With a GPU (tests/test_eig_cuda.py's marker): the device's
record has exactly the emulation's sequence for the same matrix.
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import _eig_team
import numpy as np
import pytest
import torch

from fastspec.eig import profile, variants
from fastspec.eig.matrices import make_batch

REPO = Path(__file__).resolve().parents[1]
P = profile.PHASE_ID


def collapsed(seq: list[int]) -> list[str]:
    """The sequence without barrier marks, runs merged: the phases an algorithm walks through."""
    return [profile.PHASES[k] for k, _ in itertools.groupby(p for p in seq if p != P["barrier"])]


def matrix(n: int, family: str = "indefinite") -> torch.Tensor:
    return torch.from_numpy(make_batch(family, n, 1)[0]).float()


@_eig_team.NO_EXT
def test_phase_ids_are_the_headers():
    from fastspec.eig import _host

    assert _host.PHASES == profile.PHASE_ID


# per reflector, the phases each algorithm's header describes; regs runs its fused pass first
PER_REFLECTOR = {"block": ["reflector", "update"], "packed": ["reflector", "update", "product"],
                 "regs": ["update", "reflector"], "split": ["reflector", "update"],
                 "newton": ["reflector", "update", "product"]}  # newton: packed's tridiagonalization
REFLECTORS = {"block": lambda n: n - 2, "packed": lambda n: n - 2, "regs": lambda n: n - 1, "split": lambda n: n - 2,
              "newton": lambda n: n - 2}
TAIL = {"block": ["reflector"], "packed": ["reflector"], "regs": [], "split": ["reflector"], "newton": ["reflector"]}


@_eig_team.NO_EXT
@pytest.mark.parametrize("algo", sorted(PER_REFLECTOR))
@pytest.mark.parametrize("n", [5, 33])
def test_each_algorithm_marks_its_phases_in_order(algo, n):
    seq = profile.team_phases(matrix(n), algo)
    want = ["load", *PER_REFLECTOR[algo] * REFLECTORS[algo](n), *TAIL[algo], "isolate", "refine", "sort", "end"]
    assert collapsed(seq) == want
    # a barrier is a mark of its own, then the interrupted phase again; the sequence ends at "end"
    for i, p in enumerate(seq[:-1]):
        if p == P["barrier"]:
            assert i > 0 and seq[i + 1] == seq[i - 1], (i, seq[i - 1:i + 2])
    assert seq[-1] == P["end"] and seq.count(P["end"]) == 1
    # at least every FS_SYNC the algorithm passes (the reductions' barriers come on top)
    from fastspec.eig.native import team_eigvalsh

    sites = team_eigvalsh(matrix(n).unsqueeze(0), algo)[1]
    assert seq.count(P["barrier"]) >= len(sites) > 0


@_eig_team.NO_EXT
def test_every_algorithm_of_the_kernel_marks_its_phases():
    """A new algorithm cannot join the race without phase marks: each walks load ... end, through
    the tridiagonalization's and the eigenvalue stage's phases."""
    for algo in variants.ALGORITHMS:
        got = collapsed(profile.team_phases(matrix(9), algo))
        assert got[0] == "load" and got[-4:] == ["isolate", "refine", "sort", "end"], (algo, got)
        assert {"reflector", "update"} <= set(got), (algo, got)


@_eig_team.NO_EXT
@pytest.mark.parametrize("algo", sorted(variants.ALGORITHMS))
def test_a_matrix_with_nan_or_zeros_goes_from_load_to_end(algo):
    for A in (torch.zeros(7, 7), torch.full((7, 7), float("nan"))):
        assert collapsed(profile.team_phases(A, algo)) == ["load", "end"]


def test_team_phases_takes_one_matrix():
    with pytest.raises(ValueError, match="^A: expected one matrix"):
        profile.team_phases(torch.zeros(2, 3, 3))


# ------------------------------------------------------------------------------------ the decoder
@_eig_team.NO_EXT
def test_decode_gives_the_cycles_the_record_holds():
    seq = profile.team_phases(matrix(12), "packed")
    cost = {i: 10 * (i + 1) for i in range(len(profile.PHASES))}
    record = profile.synthetic_record(seq, blocks=5, cost=cost, sms=2)
    blocks = profile.decode(record)
    assert len(blocks) == 5
    want = np.zeros(len(profile.PHASES), np.int64)
    for p in seq[:-1]:  # the time after a mark belongs to its phase; "end" closes the last one
        want[p] += cost[p]
    for b in blocks:
        assert (b.cycles == want).all() and b.total == want.sum() and not b.truncated
        assert (b.entries == np.bincount(seq, minlength=len(profile.PHASES))).all()
        assert b.marks == len(seq)
    s = profile.summarize(blocks)
    assert s.blocks == 5 and s.total_median == want.sum()
    assert abs(sum(v["share"] for v in s.phases.values()) - 1) < 1e-12
    assert s.phases["update"]["median"] == want[P["update"]] and "end" not in s.phases
    assert s.phases["barrier"]["entries"] == seq.count(P["barrier"])
    assert s.ghz == pytest.approx(2.0) and s.resident > 0 and s.span_ns > 0
    assert sorted({b.sm for b in blocks}) == [0, 1]


def test_the_clock_may_wrap_and_a_short_record_says_so():
    seq = [P["load"], P["update"], P["refine"], P["end"]]
    rec = profile.synthetic_record(seq, blocks=1, cost={P["load"]: 5, P["update"]: 7, P["refine"]: 11})
    clk = rec[0, profile.HEAD:profile.HEAD + 4] & np.uint64(profile.CLOCK_MASK)
    start = np.uint64(profile.CLOCK_MASK - 8)  # the 56-bit clock wraps inside the update phase
    ids = rec[0, profile.HEAD:profile.HEAD + 4] >> np.uint64(profile.CLOCK_BITS)
    rec[0, profile.HEAD:profile.HEAD + 4] = (ids << np.uint64(profile.CLOCK_BITS)) | \
        ((clk - clk[0] + start) & np.uint64(profile.CLOCK_MASK))
    (b,) = profile.decode(rec)
    assert b.cycles[P["load"]] == 5 and b.cycles[P["update"]] == 7 and b.cycles[P["refine"]] == 11
    long_seq = [P["update"]] * (profile.SLOTS + 10) + [P["end"]]
    (t,) = profile.decode(profile.synthetic_record(long_seq, blocks=1, cost={P["update"]: 1}))
    assert t.truncated and t.marks == len(long_seq) and t.cycles[P["update"]] == profile.SLOTS - profile.HEAD - 1


def test_decode_refuses_what_is_not_a_record():
    with pytest.raises(ValueError, match=r"^record: expected \[blocks, 4096\]"):
        profile.decode(np.zeros((2, 10), np.uint64))
    bad = np.zeros((1, profile.SLOTS), np.uint64)
    bad[0, 0] = 2
    bad[0, profile.HEAD:profile.HEAD + 2] = np.uint64(40) << np.uint64(profile.CLOCK_BITS)
    with pytest.raises(ValueError, match="^words: phase id 40 unknown"):
        profile.decode(bad)
    with pytest.raises(ValueError, match="^blocks: no block made a mark"):
        profile.summarize(profile.decode(np.zeros((3, profile.SLOTS), np.int64)))  # int64: torch's record dtype


# ------------------------------------------------------------------------------------ the build
def _sass_skip() -> str:
    from fastspec.eig import nvrtc

    try:
        from benchmarks.sass import find_tool
    except ImportError:
        return "benchmarks/sass.py not importable"
    if find_tool("cuobjdump") is None:
        return "needs cuobjdump (CUDA toolkit or the triton wheel)"
    return f"needs NVRTC: {nvrtc.missing()}" if nvrtc.missing() else ""


@pytest.mark.parametrize("algo, dtype", [(a, d) for a in sorted(variants.ALGORITHMS) for d in ("float32", "float64")
                                         if variants.ALGORITHMS[a].takes(128, d)])
def test_the_profiling_build_compiles_for_sm90_and_the_normal_build_has_no_stamps(algo, dtype, tmp_path, monkeypatch):
    why = _sass_skip()
    if why:
        pytest.skip(why)
    from benchmarks.sass import disassemble, resource_usage
    from fastspec.eig import cuda, nvrtc

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc, "_memory", {})  # compiled here, into this cache: not an image of another test's
    v = cuda.variant_for(128, dtype, cuda.DeviceSpec.for_arch(90), algo)
    text = {}
    for name, opts in (("normal", ()), ("profile", profile.OPTIONS)):
        img = nvrtc.compile_variant(v, nvrtc.Target(90), opts)
        path = tmp_path / f"{name}.cubin"
        path.write_bytes(img.data)
        text[name] = disassemble(str(path))
        res = resource_usage(str(path))[nvrtc.ENTRY]
        assert res["local"] == 0, (name, res)
        # the stamps cost regs (128 registers at its launch bounds) a few bytes of stack, nobody else any
        assert res["stack"] <= (16 if algo == "regs" and name == "profile" else 0), (name, res)
    for reg in ("SR_CLOCKLO", "SR_GLOBALTIMERLO", "SR_VIRTUALSMID"):
        assert reg in text["profile"] and reg not in text["normal"], reg
    assert len(list((tmp_path / "cache" / "eig").glob("*.cubin"))) == 2  # two images, two cache entries


# ------------------------------------------------------------------------------------ the kit's step
@_eig_team.NO_EXT
def test_the_phase_step_runs_dry_and_its_file_says_so(tmp_path, monkeypatch):
    why = _sass_skip()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("eig_phases", None)
    import eig_phases

    out = tmp_path / "phases.json"
    assert eig_phases.main(["--json", str(out), "--dry-run"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == eig_phases.SCHEMA and doc["dry_run"] is True and not doc["not_run"]
    fp32 = {r["algo"]: r for r in doc["results"] if r["shape"] == "B4096-n128-fp32-dry"}
    assert set(fp32) == {a for a, x in variants.ALGORITHMS.items() if x.takes(128, "float32")}
    for r in doc["results"]:
        assert "error" not in r and r["profile_build_bytes"] > 0
        assert {"load", "reflector", "update", "barrier", "refine"} <= set(r["summary"]["phases"])
    assert eig_phases.main(["--show", str(out)]) == 0


def test_the_fitted_model_gives_back_what_it_was_fitted_on():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eig_phases_model", REPO / "benchmarks" / "eig_phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summary = {"phases": {"load": {"median": 1000.0}, "update": {"median": 6000.0}, "barrier": {"median": 500.0}},
               "resident_blocks_per_sm": 4.0, "sm_ghz": 2.0}
    model = {"load": 100.0, "update": 2000.0}
    cpi = mod.fit(summary, model)
    assert cpi == {"load": 10.0, "update": 3.0}
    # 7500 cycles a block, 4096 matrices on 128 SMs with 4 resident: 8 rounds = 60000 cycles at 2 GHz
    assert mod.predict(model, cpi, summary, 4096, 128) == pytest.approx(0.03)
    # half the update's instructions at the same CPI: 3000 cycles less a block
    assert mod.predict({"load": 100.0, "update": 1000.0}, cpi, summary, 4096, 128) == pytest.approx(4500 * 8 / 2e6)
    assert mod.predict({"load": 1.0, "sort": 1.0}, cpi, summary, 4096, 128) is None  # no CPI for sort
