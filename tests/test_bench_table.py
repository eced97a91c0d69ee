"""The README benchmark table is generated from benchmarks/results/*.json and stays in sync."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastspec.bench.table import BEGIN, END, load_results, readme_block, splice, update_readme

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_readme_table_matches_result_files():
    assert update_readme(ROOT / "README.md", RESULTS, check=True), (
        "README.md's benchmark table is stale: run `python -m fastspec.bench.table`")


def test_committed_results_name_device_date_and_versions():
    docs = load_results(RESULTS)
    assert docs, "no benchmark result committed in benchmarks/results/"
    for path, doc in docs:
        env = doc["environment"]
        assert {"device", "torch", "triton", "fastspec", "cuda", "driver"} <= set(env), path
        assert doc["date"][:4].isdigit() and doc["results"], path
        # the file name says which device produced it
        stem = path.stem.lower()
        assert (env["device"] == "cpu" and stem.startswith("cpu")) or env["device"] != "cpu", path


def test_every_readme_number_comes_from_a_result_file():
    block = readme_block(RESULTS, ROOT)
    for path, doc in load_results(RESULTS):
        assert f"`{path.relative_to(ROOT).as_posix()}`" in block
        for r in doc["results"]:
            if "fastspec_s" in r:
                assert f"| {r['suite']} | {r['size']} | {r['variant']} |" in block
    for path, doc in load_results(RESULTS, "compare"):
        ok = sum(bool(r["within_2x_torch"]) for r in doc["results"])
        assert f"{ok}/{len(doc['results'])} (family, n, solver)" in block
        assert f"`{path.relative_to(ROOT).as_posix()}`" in block


def test_update_rewrites_only_the_marked_block(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nabove\n{BEGIN}\nold table\n{END}\nbelow\n")
    assert update_readme(readme, results) is False
    text = readme.read_text()
    assert text.startswith(f"# title\nabove\n{BEGIN}\n") and text.endswith(f"{END}\nbelow\n")
    assert "old table" not in text and "| suite | size |" in text
    assert update_readme(readme, results, check=True) is True


def test_a_new_result_file_makes_the_readme_stale(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update_readme(readme, results)
    path, doc = load_results(results)[0]
    doc = {**doc, "environment": {**doc["environment"], "device": "NVIDIA H100 80GB HBM3",
                                  "driver": "580.65.06", "cuda": "13.0"}}
    (results / "h100-test.json").write_text(json.dumps(doc))
    assert update_readme(readme, results, check=True) is False
    update_readme(readme, results)
    assert "NVIDIA H100 80GB HBM3 (driver 580.65.06, CUDA 13.0)" in readme.read_text()


@pytest.mark.parametrize("text", ["no markers", f"{END}\n{BEGIN}\n", f"{BEGIN}{BEGIN}{END}"])
def test_splice_refuses_a_readme_without_one_block(text):
    with pytest.raises(ValueError, match="readme"):
        splice(text, "x")
