"""``fastspec bench --quick`` and ``fastspec compare --quick`` run and write well-formed JSON."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fastspec.bench.accuracy import SIZES
from fastspec.bench.cases import SUITES
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
    rc = main(["bench", "--quick", "--repeats", "2", "--warmup", "1", "--json", str(path)])
    # the README's table is regenerated on request only (python -m fastspec.bench.table)
    assert README.read_bytes() == readme, "fastspec bench rewrote README.md"
    return rc, _strict_json(path)


def test_bench_quick_json_is_well_formed(bench_doc):
    rc, doc = bench_doc
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
    _, doc = bench_doc
    assert [r for r in doc["results"] if "error" in r] == []


def test_bench_rates_follow_their_definition(bench_doc):
    _, doc = bench_doc
    for r in doc["results"]:
        if r.get("rate_unit") == "µs/matrix":
            batch = int(r["size"].split("-")[0][1:])  # B{batch}-n{n}-fp32
            assert math.isclose(r["fastspec_rate"], r["fastspec_s"] / batch * 1e6)
        elif r.get("rate_unit") == "GB/s":
            dims = [int(p[1:]) for p in r["size"].split("-")[1:-1]]  # keys-B-H-T-D / ffn-N-D
            nbytes = math.prod(dims) * 2  # bf16/fp16 inputs
            assert math.isclose(r["fastspec_rate"], nbytes / r["fastspec_s"] / 1e9)


def test_compare_quick_json_is_well_formed(tmp_path):
    path = tmp_path / "compare.json"
    rc = main(["compare", "--quick", "--json", str(path)])
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


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--quick", "--tier", "gpu"], "--quick"),
    (["bench", "--quick", "--threads", "0"], "--threads"),
    (["compare", "--device", "cuda:0"], "--device"),
])
def test_bad_flags_name_the_flag(argv, flag):
    import torch

    if flag == "--device" and torch.cuda.is_available():
        pytest.skip("cuda is available here")
    with pytest.raises(ValueError, match=flag):
        main(argv)


@pytest.mark.gpu
def test_bench_quick_on_cuda_times_with_events(tmp_path):
    """On a GPU the same command runs the CUDA paths (and CuPy when installed) without errors."""
    path = tmp_path / "gpu.json"
    rc = main(["bench", "--quick", "--suite", "eigvalsh", "--suite", "covariance", "--json", str(path)])
    doc = _strict_json(path)
    assert rc == 0 and doc["environment"]["device"] != "cpu" and doc["environment"]["cuda"]
    assert not [r for r in doc["results"] if "error" in r]
    assert any(r["variant"] == "auto" and "fastspec_s" in r for r in doc["results"])
