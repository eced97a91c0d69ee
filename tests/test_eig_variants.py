"""The eigensolver's algorithms and their selection (fastspec/eig/variants.py), without a GPU.

* The Python copy of each algorithm's team size, shared-memory size and limits equals the C++
  one (``eig_algos.h``, through the host module) for every n, and the ids agree.
* The selection: the shipped table loads; the block algorithm wherever nothing was measured;
  a measured row applies inside its ranges and nowhere else; ``FASTSPEC_EIG_VARIANT`` forces an
  algorithm where it applies, says once where it does not, and a bad name is a one-line error;
  the launcher skips an algorithm whose shared memory does not fit, and falls back to the block
  algorithm when the chosen one cannot be compiled.
* ``fastspec info`` and ``fastspec precompile --algo`` show and build the choices.
* The race (``benchmarks/eig_race.py``): its rows are table rows; a dry run cannot be merged; a
  real run's rows replace the table's rows of the same key, except a row whose algorithm ties with
  the winner (overlapping repeat ranges). (Its dry run itself runs in
  tests/test_gpu_run.py, inside the kit's dry run, and below on one shape.)
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from fastspec.eig import cuda, limits, native, nvrtc, precompile, variants

needs_ext = pytest.mark.skipif(native._ext is None, reason="host-twin extension not built")
H100 = cuda.DeviceSpec.for_arch(90)


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(variants.ENV, raising=False)
    variants._said.clear()


@needs_ext
def test_python_and_cpp_agree_on_every_algorithm():
    h = native._ext
    assert h.ALGOS == {name: a.id for name, a in variants.ALGORITHMS.items()}
    for name, a in variants.ALGORITHMS.items():
        assert h.algo_max_n(a.id) == a.max_n, name
        for n in range(1, min(a.max_n, 300) + 1):
            assert h.algo_threads(a.id, n) == a.threads(n), (name, n)
            assert h.algo_smem_elems(a.id, n) == a.smem_elems(n), (name, n)
            assert a.threads(n) % 32 == 0 and a.threads(n) <= limits.MAX_THREADS, (name, n)
    for n in (1, 17, 128, 237, 256, 1024):
        assert variants.block_work_elems(n, True) == h.block_work_elems(n, True)


def test_every_header_the_kernel_includes_is_compiled_and_shipped():
    headers = {p.name for p in nvrtc.CSRC.glob("eig_*.h")} - {"eig_host.h"}
    assert set(nvrtc.HEADERS) == headers
    assert set(nvrtc.sources()) == {nvrtc.KERNEL_SOURCE, *headers}
    from fastspec.commands import precompile as command

    assert set(command.ALGOS) == {"all", *variants.names()}


def test_the_shipped_table_loads_and_block_is_the_default():
    rows = variants.load_table(variants.TABLE)
    assert json.loads(variants.TABLE.read_text())["format"] == 1
    for dtype, n, batch in cuda.SHOWN:
        choices = variants.choose(90, dtype, n, batch, rows=[])
        assert [c.algo for c in choices] == ["block"]
        assert choices[0].why == f"default: no measurement for sm_90 {dtype} n = {n}, batch {batch}"
    # whatever the shipped table says, the default comes last and every choice takes the problem
    for dtype, n, batch in cuda.SHOWN:
        choices = variants.choose(90, dtype, n, batch, rows=rows)
        assert choices[-1].algo == "block"
        assert all(variants.ALGORITHMS[c.algo].takes(n, dtype) for c in choices)


def _row(**kw) -> variants.Row:
    base = {"arch": 90, "dtype": "float32", "n_lo": 97, "n_hi": 128, "batch_lo": 1024, "batch_hi": None,
            "algo": "packed", "measured": {"device": "H100", "date": "2026-12-01", "shape": "B4096-n128-fp32",
                                           "ms": {"packed": 1.5, "block": 3.5}}}
    base.update(kw)
    return variants.Row(**base)


def test_a_measured_row_applies_inside_its_ranges_only():
    rows = [_row()]
    first = variants.choose(90, "float32", 128, 4096, rows=rows)
    assert [c.algo for c in first] == ["packed", "block"]
    assert first[0].why == "measured on H100 2026-12-01 B4096-n128-fp32: packed 1.5 ms, block 3.5 ms"
    for arch, dtype, n, batch in [(80, "float32", 128, 4096), (90, "float64", 128, 4096), (90, "float32", 96, 4096),
                                  (90, "float32", 129, 4096), (90, "float32", 128, 1023)]:
        assert [c.algo for c in variants.choose(arch, dtype, n, batch, rows=rows)] == ["block"], (arch, dtype, n, batch)
    assert [c.algo for c in variants.choose(90, "float32", 97, 10**6, rows=rows)] == ["packed", "block"]
    # the first matching row wins; a row whose algorithm does not take the problem is passed over
    rows = [_row(algo="regs", dtype="float64"), _row(algo="split", batch_hi=2048), _row()]
    assert variants.choose(90, "float32", 128, 2000, rows=rows)[0].algo == "split"
    assert variants.choose(90, "float64", 128, 4096, rows=rows)[0].algo == "block"  # regs takes float32 only


def test_rows_round_trip_and_bad_rows_are_named():
    r = _row()
    assert variants.Row.from_json(json.loads(json.dumps(r.to_json()))) == r
    for bad, msg in [(_row(algo="fast"), "algo must be one of"), (_row(dtype="float16"), "dtype must be"),
                     (_row(n_lo=200), "empty n or batch range"), (_row(batch_lo=5, batch_hi=4), "empty n or batch")]:
        with pytest.raises(ValueError, match=msg):
            variants.check_rows([r, bad])


def test_the_override_forces_where_it_applies(monkeypatch, caplog):
    monkeypatch.setenv(variants.ENV, "split")
    choices = variants.choose(90, "float64", 128, 256, rows=[])
    assert [c.algo for c in choices] == ["split", "block"] and choices[0].forced
    assert choices[0].why == "forced by FASTSPEC_EIG_VARIANT=split"
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        for _ in range(3):
            assert [c.algo for c in variants.choose(90, "float64", 256, 256, rows=[])] == ["block"]
    said = [r.getMessage() for r in caplog.records]
    assert said == [("fastspec.eigvalsh: FASTSPEC_EIG_VARIANT=split does not apply to float64 n = 256 (it takes "
                     "float32/float64, n <= 128); using the selection table there")]
    monkeypatch.setenv(variants.ENV, "fastest")
    with pytest.raises(ValueError, match=r"^FASTSPEC_EIG_VARIANT: expected one of \['block', 'cusolverdx', 'newton', 'packed', "
                                         r"'regs', 'split'\], got 'fastest'$"):
        variants.choose(90, "float32", 128, 4096, rows=[])


def test_the_launcher_takes_the_first_choice_whose_shared_memory_fits(monkeypatch):
    monkeypatch.setenv(variants.ENV, "packed")
    v, why = cuda.choose_variant(4096, 128, "float32", H100)
    assert v.algo == "packed" and why == "forced by FASTSPEC_EIG_VARIANT=packed"
    assert v.threads == variants.ALGORITHMS["packed"].threads(128) and v.smem
    # packed float64 n = 256 needs more than an H100 block's 227 KiB: block (on its workspace path)
    assert cuda.smem_bytes(256, "float64", True, "packed") > H100.smem_optin
    v, why = cuda.choose_variant(512, 256, "float64", H100)
    assert v.algo == "block" and not v.smem
    assert why.startswith("default: no measurement for sm_90 float64 n = 256, batch 512; not packed: algo: 'packed' "
                          "needs ")
    with pytest.raises(ValueError, match="algo: 'regs' takes float32 with n <= 128, got float64 n = 128"):
        cuda.variant_for(128, "float64", H100, "regs")
    with pytest.raises(ValueError, match="algo: expected one of"):
        cuda.variant_for(128, "float32", H100, "fast")
    p = cuda.plan(4096, 128, "float32", H100, algo="split")
    assert p.variant.algo == "split" and p.smem == cuda.smem_bytes(128, "float32", True, "split") and p.grid == 4096


class _Driver:
    """Enough of cuda.bindings.driver for prepare(): every call succeeds."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9

    def cuDeviceGet(self, index):
        return 0, index

    def cuKernelSetAttribute(self, *args):
        return (0,)


def test_a_chosen_algorithm_that_cannot_be_had_falls_back_to_block(monkeypatch, caplog):
    loaded = []

    def load(driver, variant, target):
        loaded.append(variant.algo)
        if variant.algo != "block":
            raise nvrtc.KernelUnavailable("NVRTC could not compile it: broken")
        return cuda._Loaded(object(), object(), set())

    monkeypatch.setattr(cuda, "_driver", _Driver)
    monkeypatch.setattr(cuda, "_load", load)
    monkeypatch.setattr(cuda, "_device_setup", lambda index: (H100, nvrtc.Target(90)))
    monkeypatch.setattr(cuda, "_loaded", {})
    monkeypatch.setattr(cuda, "_failed", {})
    monkeypatch.setenv(variants.ENV, "packed")
    monkeypatch.setenv("FASTSPEC_SELF_CHECK", "0")  # the stand-in kernels compute nothing to check
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        _, p = cuda.prepare(128, torch.float32, 0, batch=4096)
        _, again = cuda.prepare(128, torch.float32, 0, batch=4096)
    assert p.variant.algo == again.variant.algo == "block" and loaded == ["packed", "block"]
    assert [r.getMessage() for r in caplog.records] == [
        ("fastspec.eigvalsh: the packed algorithm (forced by FASTSPEC_EIG_VARIANT=packed) cannot be had (NVRTC could "
         "not compile it: broken); using block")]
    with pytest.raises(nvrtc.KernelUnavailable, match="broken"):  # asked for by name: no fallback
        cuda.prepare(128, torch.float32, 0, batch=4096, algo="packed")


def test_info_shows_the_choice_per_problem(monkeypatch, capsys):
    from fastspec.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "   variant: the kernel's algorithm per problem on sm_90 (no GPU here) (" in out
    for dtype, n, batch in cuda.SHOWN:
        assert f"{dtype} n {n:<3} x{batch:<5} " in out
    monkeypatch.setenv(variants.ENV, "nope")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "error: FASTSPEC_EIG_VARIANT: expected one of" in out and "Traceback" not in out
    assert main(["info", "--json"]) == 0
    sel = json.loads(capsys.readouterr().out)["eigvalsh_variants"]
    assert sel["override"] == "nope" and sel["error"].startswith("FASTSPEC_EIG_VARIANT")


def test_precompile_lists_every_algorithm_that_takes_the_size():
    work = precompile.todo(90, [64, 128, 256], ["float32", "float64"], ["all"])
    got = {(a, d, n) for _, d, n, a in work}
    for name, a in variants.ALGORITHMS.items():
        for d in ("float32", "float64"):
            for n in (64, 128, 256):
                fits = a.takes(n, d) and cuda.smem_bytes(n, d, True, name) <= H100.smem_optin or name == "block"
                assert ((name, d, n) in got) == fits, (name, d, n)
    assert precompile.todo(90, [128], ["float32"]) == [(90, "float32", 128, "block")]
    with pytest.raises(ValueError, match="algo: expected names of"):
        precompile.todo(90, [128], ["float32"], ["fast"])


# ------------------------------------------------------------------------------------ the race
def _race():
    import benchmarks.eig_race as race  # a maintainer's tool, outside the package

    return race


def test_race_rows_merge_into_the_table_and_a_dry_run_is_refused(tmp_path, capsys):
    race = _race()
    shape = race.SHAPES[0]
    result = {"shape": shape.name, "winner": "packed",
              "algorithms": {"packed": {"ms": 1.25, "ok": True}, "block": {"ms": 3.5, "ok": True},
                             "regs": {"ms": 0.5, "ok": False}}}
    row = race.table_row(result, shape, 90, "NVIDIA H100 80GB HBM3", "2026-12-01", dry=False)
    assert row["n"] == [97, 128] and row["batch"] == [1024, None] and row["algo"] == "packed"
    assert row["measured"]["ms"] == {"packed": 1.25, "block": 3.5}  # the inaccurate one is no time to beat
    assert race.table_row({**result, "winner": None}, shape, 90, "x", "d", dry=False) is None
    table = tmp_path / "selection.json"
    table.write_text(json.dumps({"format": 1, "rows": [
        _row(algo="block").to_json(), _row(n_lo=1, n_hi=96, algo="split").to_json()]}))
    doc = {"schema": race.SCHEMA, "dry_run": False, "rows": [row]}
    (tmp_path / "race.json").write_text(json.dumps(doc))
    assert race.merge(tmp_path / "race.json", table) == 0
    rows = variants.load_table(table)
    assert sorted((r.n_lo, r.algo) for r in rows) == [(1, "split"), (97, "packed")]  # same key replaced
    assert variants.choose(90, "float32", 128, 4096, rows=rows)[0].algo == "packed"
    (tmp_path / "race.json").write_text(json.dumps({**doc, "dry_run": True}))
    assert race.merge(tmp_path / "race.json", table) == 2
    assert "is a dry run" in capsys.readouterr().err


def test_race_merge_keeps_a_table_row_that_ties_with_the_winner(tmp_path, capsys):
    """The H100 (2026-11-27) and H200 (2026-11-28) races put packed and regs in either order at
    4096 x 64² fp32, 0.2-0.5% apart with overlapping repeats: merging must not flip the table on
    that, and must replace a row whose algorithm lost outside the noise or failed accuracy."""
    race = _race()
    shape = race.SHAPES[0]

    def result(regs_range, packed_ok=True):
        return {"shape": shape.name, "winner": "regs", "algorithms": {
            "regs": {"ms": sum(regs_range) / 2, "ms_min": regs_range[0], "ms_max": regs_range[1], "repeats": 10,
                     "ok": True},
            "packed": {"ms": 0.573, "ms_min": 0.561, "ms_max": 1.78, "repeats": 10, "ok": packed_ok},
            "block": {"ms": 0.64, "ms_min": 0.637, "ms_max": 0.658, "repeats": 10, "ok": True}}}

    table = tmp_path / "selection.json"
    held = _row(algo="packed", batch_lo=1024, batch_hi=None)
    assert race.tie(result((0.5644, 0.6397)), "regs", "packed")            # overlapping: a tie
    assert not race.tie(result((0.40, 0.45)), "regs", "packed")            # regs ahead beyond the noise
    assert not race.tie(result((0.5644, 0.6397), packed_ok=False), "regs", "packed")  # inaccurate: no tie
    assert not race.tie({"algorithms": {"regs": {"ms": 1.0}, "packed": {"ms": 1.0, "ok": True}}},
                        "regs", "packed")                                 # no ranges, no evidence of a tie
    for regs_range, packed_ok, want in (((0.5644, 0.6397), True, "packed"), ((0.40, 0.45), True, "regs"),
                                        ((0.5644, 0.6397), False, "regs")):
        table.write_text(json.dumps({"format": 1, "rows": [held.to_json()]}))
        res = result(regs_range, packed_ok)
        row = race.table_row(res, shape, 90, "NVIDIA H200", "2026-11-28", dry=False)
        (tmp_path / "race.json").write_text(json.dumps({"schema": race.SCHEMA, "dry_run": False, "rows": [row],
                                                        "results": [res]}))
        assert race.merge(tmp_path / "race.json", table) == 0
        rows = variants.load_table(table)
        assert [r.algo for r in rows] == [want], (regs_range, packed_ok)
        out = capsys.readouterr().out
        assert ("tie: " in out) == (want == "packed")


@needs_ext
def test_race_dry_run_of_one_shape_checks_every_algorithm(tmp_path, monkeypatch):
    race = _race()
    monkeypatch.setattr(race, "SHAPES", race.SHAPES[:1])
    assert race.main(["--dry-run", "--json", str(tmp_path / "race.json")]) == 0
    doc = json.loads((tmp_path / "race.json").read_text())
    assert doc["dry_run"] is True and doc["timing"].startswith("cpu stand-in")
    (res,) = doc["results"]
    from fastspec.eig import mathdx

    vendor = set() if mathdx.missing() else {"cusolverdx"}  # built for sm_90 where the extra is installed
    own = {n for n, a in variants.ALGORITHMS.items() if a.takes(128, "float32")}
    assert set(res["algorithms"]) == own | vendor
    for name in own:
        a = res["algorithms"][name]
        assert a["ok"] and a["battery"]["worst_ratio"] <= 1 and a["rel_err"] < 1e-5
    for name in vendor:  # nothing emulates it: built at the dry shape's n, not run, never the winner
        a = res["algorithms"][name]
        assert a["ms"] is None and not a["ok"] and a["dry_run_build"]["built"]
        assert a["dry_run_build"]["n"] == race.dry_shape(race.SHAPES[0]).n and res["winner"] in own
    if not vendor:
        assert "cusolverdx" in res["not_raced"] and "fastspec[mathdx]" in res["not_raced"]["cusolverdx"]
    (row,) = doc["rows"]
    assert row["measured"]["dry_run"] is True and row["algo"] == res["winner"]


def test_race_past_its_time_limit_records_the_shapes_not_run(tmp_path, capsys):
    race = _race()
    assert race.main(["--dry-run", "--time-limit", "0", "--json", str(tmp_path / "race.json")]) == 0
    doc = json.loads((tmp_path / "race.json").read_text())
    assert doc["results"] == [] and doc["not_run"] == [race.dry_shape(s).name for s in race.SHAPES]
    assert "B4096-n128-fp32-dry: not run (time limit)" in capsys.readouterr().out
