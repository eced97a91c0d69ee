"""What a newcomer reads and runs first works as written.

* the README's first screen (everything above ``## Benchmarks``: set-up and example) gives the
  CPU install line of PyTorch and the demo's time, and that time is the one measured by
  ``benchmarks/demo_time.py`` in ``benchmarks/results/*-demo-time.json``;
* every package the set-up commands install is explained in the prose around them;
* the README's examples (blocks after a ``<!-- readme-example: NAME -->`` marker) run as written,
  and so do docs/analysis.md's, which continue the README's probe example;
* ``examples/end_to_end.py`` runs, writes its records and plots, and reads both protocols.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
RESULTS = REPO / "benchmarks" / "results"
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _first_screen() -> str:
    """The README up to its first benchmark table: what it is, set-up, the example."""
    return README[: README.index("## Benchmarks")]


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def test_first_screen_gives_the_cpu_install_line_before_the_set_up_commands():
    blocks = _code_blocks(_first_screen(), "bash")
    assert blocks, "no bash block on the README's first screen"
    cpu = [i for i, b in enumerate(blocks) if CPU_TORCH in b]
    demo = [i for i, b in enumerate(blocks) if "fastspec demo" in b]
    assert cpu, f"the first screen lacks the CPU build of torch: {CPU_TORCH!r}"
    assert demo and cpu[0] < demo[0], "the CPU install line must come before `fastspec demo`"


def _demo_time_file() -> tuple[Path, dict]:
    files = sorted(RESULTS.glob("*-demo-time.json"))
    assert files, "no benchmarks/results/*-demo-time.json: run benchmarks/demo_time.py"
    path = files[-1]
    doc = json.loads(path.read_text())
    assert doc["kind"] == "demo-time" and doc["command"] == "fastspec demo", doc["command"]
    assert all(r["exit_code"] == 0 for r in doc["runs"]), f"{path.name}: a timed demo run failed"
    return path, doc


DEMO_TIME = re.compile(r"about (\d+) minutes? on a (\d+)-core CPU \((\d+) s wall, (\d+) s CPU, median of (\d+) "
                       r"runs, `benchmarks/results/([\w.-]+)`\)")


def test_first_screen_states_the_measured_demo_time():
    path, doc = _demo_time_file()
    m = DEMO_TIME.search(" ".join(_first_screen().split()))
    assert m, "the first screen must state the demo time as 'about N minutes on a K-core CPU (W s wall, C s CPU, " \
              "median of R runs, `benchmarks/results/FILE`)'"
    minutes, cores, wall, cpu, runs, name = m.groups()
    assert name == path.name
    assert int(wall) == round(doc["median_wall_s"]) and int(cpu) == round(doc["median_cpu_s"])
    assert int(minutes) == max(1, round(doc["median_wall_s"] / 60))
    assert int(runs) == len(doc["runs"])
    assert f"({cores} cores)" in doc["environment"]["cpu"]


def test_every_package_the_set_up_installs_is_explained():
    """``pip install ... NAME`` in a set-up command: NAME appears in the prose around it, saying why."""
    screen = _first_screen()
    prose = _prose(screen)
    for block in _code_blocks(screen, "bash"):
        for cmd in re.findall(r"pip install ([^&\n]+)", block):
            names = [w for w in cmd.split() if not w.startswith("-") and not w.startswith("https://")]
            for name in names:
                if name in ("torch", ".", '".[test]"', "-e"):
                    continue
                assert f"`{name}`" in prose, f"the README installs {name} without saying why"


def _examples() -> dict[str, str]:
    found = re.findall(r"<!-- readme-example: (\w+) -->\n```python\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
    return dict(found)


def test_readme_marks_its_examples():
    assert set(_examples()) == {"covariance", "probe", "trainer"}


def test_readme_trainer_example_runs_with_a_model_args_and_data(tmp_path):
    """The trainer block, given what it leaves to the reader (a model, TrainingArguments, a
    training set and ``Trainer``): it streams, emits at its ``emit_every`` and logs the scalars."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from _tiny_models import demo_model
    from transformers import Trainer, TrainingArguments

    # emissions every 2 steps of 4; no budget, which could space them out on a slow machine
    code = _examples()["trainer"].replace('"emit_every": 100', '"emit_every": 2').replace('"budget": 0.01', '"budget": None')
    assert code.count("None") == 1, "the example no longer sets emit_every=100, budget=0.01"
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=2, disable_tqdm=True)
    namespace = {"__name__": "__readme__", "Trainer": Trainer, "model": demo_model().train(), "args": args,
                 "train_dataset": [{"input_ids": i, "labels": i} for i in ids]}
    exec(compile(code, "README.md:trainer", "exec"), namespace)  # noqa: S102 - the README's own code
    df, trainer = namespace["df"], namespace["trainer"]
    assert set(df["protocol"]) == {"stream"} and set(df["step"]) == {2, 4}
    logged = [h for h in trainer.state.log_history if "fastspec/stream/keys/participation_ratio/mean" in h]
    assert [h["step"] for h in logged] == [2, 4]


@pytest.mark.parametrize("name", ["covariance", "probe"])  # "trainer" needs a model and data: its own test
def test_readme_example_runs_as_written(name, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    code = _examples()[name]
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md:{name}", "exec"), namespace)  # noqa: S102 - the README's own code
    if name == "probe":
        df, fig = namespace["df"], namespace["fig"]
        assert set(df["protocol"]) == {"eval", "stream"}
        assert set(df.loc[df.protocol == "eval", "step"]) == {0, 20}
        assert set(df.loc[df.protocol == "stream", "step"]) == {10, 20}
        assert fig.axes and fig.axes[0].get_lines(), "spectrum_plot drew nothing"


def test_docs_analysis_examples_run_after_the_readme_probe_example(tmp_path, monkeypatch):
    """docs/analysis.md's snippets continue the README's probe example (its ``probe``, ``eval_batch``)."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(_examples()["probe"], "README.md:probe", "exec"), namespace)  # noqa: S102
    blocks = _code_blocks((REPO / "docs" / "analysis.md").read_text(encoding="utf-8"), "python")
    assert blocks, "docs/analysis.md has no example"
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/analysis.md:{i}", "exec"), namespace)  # noqa: S102
    fig = namespace["fig"]
    assert fig.axes[0].get_lines(), "the docs' last plot drew nothing"


def test_end_to_end_example_runs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "example"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "end_to_end.py"), "--steps", "20",
                           "--eval-every", "10", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(out / "records.csv")
    assert set(df["protocol"]) == {"eval", "stream"}
    assert set(df.loc[df.protocol == "eval", "step"]) == {0, 10, 20}
    assert {"keys", "ffn"} <= set(df["site"])
    for png in ("key_pr_eval", "key_pr_stream", "ffn_pr_heatmap", "final_spectra_keys", "final_spectra_ffn"):
        assert (out / f"{png}.png").stat().st_size > 10_000, png
    assert "key PR per layer" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
