"""The README benchmark table is generated from benchmarks/results/*.json and stays in sync; it is
rewritten only on request, and by default in the repository's README whatever the current directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastspec.bench.table import (
    BEGIN,
    END,
    load_results,
    main,
    readme_block,
    repository_readme,
    splice,
    update_readme,
)

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


# --------------------------------------------------------------- which README, and only on request
def _stale_results(tmp_path: Path) -> Path:
    """A copy of the committed results plus one more file: the README's table no longer matches."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    _, doc = load_results(results)[0]
    doc = {**doc, "environment": {**doc["environment"], "device": "NVIDIA H200", "driver": "580", "cuda": "13.0"}}
    (results / "h200-test.json").write_text(json.dumps(doc))
    return results


def test_the_default_readme_is_the_repository_one_whatever_the_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no README.md here: the old cwd-relative default failed or hit another file
    assert repository_readme() == ROOT / "README.md"
    assert main(["--check"]) == 0
    assert f"{ROOT / 'README.md'} benchmark table is up to date" in capsys.readouterr().out
    # stale against other results: --check says so, names the repository README, and writes nothing
    before = (ROOT / "README.md").read_bytes()
    assert main(["--check", "--results", str(_stale_results(tmp_path))]) == 1
    assert f"{ROOT / 'README.md'} benchmark table is out of date" in capsys.readouterr().err
    assert (ROOT / "README.md").read_bytes() == before


def test_readme_flag_rewrites_that_file_with_the_results_next_to_it(tmp_path, monkeypatch, capsys):
    checkout = tmp_path / "checkout"
    shutil.copytree(RESULTS, checkout / "benchmarks" / "results")
    readme = checkout / "README.md"
    readme.write_text(f"# copy\n{BEGIN}\nold table\n{END}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--readme", str(readme), "--check"]) == 1
    assert "old table" in readme.read_text()  # --check never writes
    assert main(["--readme", str(readme)]) == 0
    assert f"{readme} benchmark table rewritten" in capsys.readouterr().out
    text = readme.read_text()
    assert "old table" not in text and "`benchmarks/results/" in text  # links relative to the README
    assert main(["--readme", str(readme), "--check"]) == 0


@pytest.mark.parametrize("text", ["# a README without the markers\n", f"{BEGIN}\n{BEGIN}\n{END}\n"])
def test_a_readme_without_one_block_is_a_one_line_error(tmp_path, capsys, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert main(["--readme", str(readme), "--results", str(RESULTS)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--readme: {readme} has no single {BEGIN}" in err
    assert readme.read_text() == text


def test_outside_a_checkout_the_error_says_to_pass_readme(tmp_path, monkeypatch, capsys):
    import fastspec

    installed = tmp_path / "site-packages" / "fastspec" / "__init__.py"  # no README.md above it
    monkeypatch.setattr(fastspec, "__file__", str(installed))
    with pytest.raises(ValueError, match=r"^--readme: no README\.md .* pass --readme PATH$"):
        repository_readme()
    assert main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --readme PATH" in err


def test_a_missing_results_folder_is_refused_not_rendered_as_no_results(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\nkept\n{END}\n")
    assert main(["--readme", str(readme)]) == 2  # default: tmp_path/benchmarks/results, absent
    assert "--results:" in capsys.readouterr().err and "kept" in readme.read_text()


def test_fastspec_bench_rewrites_the_readme_only_with_table(tmp_path, capsys):
    from fastspec.cli import main as fastspec_main

    checkout = tmp_path / "checkout"
    shutil.copytree(RESULTS, checkout / "benchmarks" / "results")
    readme = checkout / "README.md"
    readme.write_text(f"{BEGIN}\nold\n{END}\n")
    with pytest.raises(ValueError, match="--readme: goes with --table"):
        fastspec_main(["bench", "--readme", str(readme)])
    assert readme.read_text() == f"{BEGIN}\nold\n{END}\n"
    assert fastspec_main(["bench", "--table", "--readme", str(readme)]) == 0
    assert "old" not in readme.read_text() and "rewritten" in capsys.readouterr().out
