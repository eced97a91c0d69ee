"""fastspec.checkpoints.sources: which models a path names, their architectures, series checks.

Also checks the fixtures of ``tests/_checkpoints.py`` that other analyze tests rely on: every
family's folder loads offline with Auto classes, and the GGUF file loads with the same logits
and token ids as the model and tokenizer it was written from.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import _checkpoints as ck
import pytest

from fastspec.checkpoints import sources as src
from fastspec.checkpoints.sources import (
    ModelSource,
    architecture,
    check_series,
    find_models,
)

transformers = pytest.importorskip("transformers")

TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "head_dim": 8, "d_ff": 48}


def _fake_model(folder: Path, config: dict | None = None) -> Path:
    """A folder that looks like a model to find_models (config.json + an empty weights file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _one_line_error(excinfo, start: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(start), message
    return message


# --- find_models --------------------------------------------------------------------------------

def test_single_hf_folder(tmp_path):
    folder = ck.write_checkpoint(tmp_path / "tiny-llama", "llama")
    (found,) = find_models([folder])
    assert found == ModelSource(path=folder, label="tiny-llama", step=None, series="tiny-llama", kind="hf")
    assert found.folder == folder and found.load_kwargs() == {}
    # one path alone, as a str, works too; a checkpoint given alone keeps its step
    (alone,) = find_models(str(_fake_model(tmp_path / "runs" / "checkpoint-200")))
    assert (alone.label, alone.step, alone.series) == ("checkpoint-200", 200, "checkpoint-200")


@pytest.mark.parametrize("names, steps", [
    (["checkpoint-1000", "checkpoint-200", "checkpoint-30"], [30, 200, 1000]),
    (["step1000", "step200", "step_3"], [3, 200, 1000]),
    (["global_step50", "global_step5", "global_step500"], [5, 50, 500]),
])
def test_series_is_ordered_by_step_number(tmp_path, names, steps):
    run = tmp_path / "runA"
    for name in names:
        _fake_model(run / name)
    (run / "logs").mkdir()  # other sub-folders without a config are not checkpoints
    (run / "trainer_state.json").write_text("{}")
    found = find_models([run])
    assert [s.step for s in found] == steps
    assert [s.label for s in found] == sorted(names, key=src.parse_step)
    assert {s.series for s in found} == {"runA"} and {s.kind for s in found} == {"hf"}
    assert all(s.path.parent == run for s in found)


def test_series_of_real_checkpoints_and_their_architecture(tmp_path):
    run = ck.write_series(tmp_path / "run", "llama", steps=(1000, 200, 300))
    found = find_models([run])
    assert [s.label for s in found] == ["checkpoint-200", "checkpoint-300", "checkpoint-1000"]
    check_series(found)  # one architecture: no error
    assert architecture(found[0]) == architecture(found[-1])


def test_sub_folders_with_a_config_but_other_names(tmp_path):
    run = tmp_path / "sweep"
    for name in ("final", "best", "checkpoint-10", "ckpt_5"):
        _fake_model(run / name)
    found = find_models([run])
    # numbered first (5, 10), then the rest by name
    assert [s.label for s in found] == ["ckpt_5", "checkpoint-10", "best", "final"]
    assert [s.step for s in found] == [5, 10, None, None]
    assert {s.series for s in found} == {"sweep"}


def test_parse_step():
    assert src.parse_step("checkpoint-200") == 200
    assert src.parse_step("step1000") == 1000
    assert src.parse_step("global_step50") == 50
    assert src.parse_step("step_3") == 3
    assert src.parse_step("tiny-llama-step-7.Q8_0") == 7
    for name in ("gpt2", "Qwen3-0.6B", "final", "llama-3.2-1b", "stepwise"):
        assert src.parse_step(name) is None, name


def test_folder_of_gguf_files(tmp_path):
    run = tmp_path / "quantized"
    run.mkdir()
    for name in ("model-step200.gguf", "model-step1000.gguf", "model-step30.gguf"):
        (run / name).write_bytes(b"GGUF")
    (run / "README.md").write_text("not a model")
    found = find_models([run])
    assert [s.label for s in found] == ["model-step30", "model-step200", "model-step1000"]
    assert [s.step for s in found] == [30, 200, 1000]
    assert {s.kind for s in found} == {"gguf"} and {s.series for s in found} == {"quantized"}
    assert found[0].folder == run and found[0].load_kwargs() == {"gguf_file": "model-step30.gguf"}
    # a .gguf file given on its own
    (one,) = find_models([run / "model-step200.gguf"])
    assert (one.label, one.step, one.series, one.kind) == ("model-step200", 200, "model-step200", "gguf")


def test_several_paths_concatenate_and_clashing_labels_get_their_parent(tmp_path):
    for run in ("runA", "runB"):
        for step in (100, 200):
            _fake_model(tmp_path / run / f"checkpoint-{step}")
    single = _fake_model(tmp_path / "base" / "tiny")
    found = find_models([tmp_path / "runB", single, tmp_path / "runA"])
    assert [s.label for s in found] == ["runB-checkpoint-100", "runB-checkpoint-200", "tiny",
                                        "runA-checkpoint-100", "runA-checkpoint-200"]
    assert [s.series for s in found] == ["runB", "runB", "tiny", "runA", "runA"]
    assert [s.step for s in found] == [100, 200, None, 100, 200]
    assert all("/" not in s.label for s in found)


def test_runs_with_the_same_folder_name_stay_separate_series(tmp_path):
    for parent in ("x", "y"):
        _fake_model(tmp_path / parent / "run" / "checkpoint-1")
    lone = _fake_model(tmp_path / "z" / "run")  # a lone model called like the series folders
    found = find_models([tmp_path / "x" / "run", tmp_path / "y" / "run", lone])
    labels, series = [s.label for s in found], [s.series for s in found]
    assert len(set(labels)) == 3 and len(set(series)) == 3, (labels, series)
    assert labels[0] == "x-run-checkpoint-1" and series[:2] == ["x-run", "y-run"]
    assert found[2].label == found[2].series == "z-run"


def test_relative_and_dot_paths_are_named(tmp_path, monkeypatch):
    run = tmp_path / "myrun"
    _fake_model(run / "checkpoint-1")
    monkeypatch.chdir(run)
    (found,) = find_models(["."])
    assert found.series == "myrun" and found.label == "checkpoint-1"
    assert found.path == Path(".") / "checkpoint-1"
    monkeypatch.chdir(run / "checkpoint-1")
    (found,) = find_models(["."])
    assert found.label == found.series == "checkpoint-1" and found.step == 1


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError) as e:
        find_models([])
    assert _one_line_error(e, "models: ") == \
        "models: expected at least one model folder, .gguf file or folder of checkpoints"

    with pytest.raises(ValueError) as e:
        find_models([tmp_path / "nope"])
    assert _one_line_error(e, "models: ") == f"models: {tmp_path / 'nope'} does not exist"

    empty = tmp_path / "empty"
    (empty / "logs").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        find_models([empty])
    assert _one_line_error(e, f"models: {empty} is not a model: ") == (
        f"models: {empty} is not a model: no config.json, no .gguf file and no checkpoint sub-folders")

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError) as e:
        find_models([text])
    _one_line_error(e, f"models: {text} is not a model")

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        find_models([no_weights])
    assert "no weights" in _one_line_error(e, f"models: {no_weights} ")

    # a checkpoint-named sub-folder that is no model is reported, not skipped
    run = tmp_path / "run"
    _fake_model(run / "checkpoint-1")
    (run / "checkpoint-2").mkdir()
    with pytest.raises(ValueError) as e:
        find_models([run])
    assert "no config.json" in _one_line_error(e, f"models: {run / 'checkpoint-2'} ")

    half = tmp_path / "half"
    _fake_model(half / "checkpoint-1")
    (half / "checkpoint-2").mkdir()
    (half / "checkpoint-2" / "config.json").write_text("{}")  # written, weights not yet
    with pytest.raises(ValueError) as e:
        find_models([half])
    assert "no weights" in _one_line_error(e, f"models: {half / 'checkpoint-2'} ")


def test_the_same_model_twice_is_an_error(tmp_path):
    model = _fake_model(tmp_path / "m")
    with pytest.raises(ValueError) as e:
        find_models([model, tmp_path / "." / "m"])
    assert "given twice" in _one_line_error(e, "models: ")
    run = tmp_path / "run"
    _fake_model(run / "checkpoint-1")
    with pytest.raises(ValueError) as e:
        find_models([run, run / "checkpoint-1"])
    message = _one_line_error(e, f"models: {run / 'checkpoint-1'} is given twice")
    assert str(run) in message


# --- architecture ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family, model_type, kv_heads", [
    ("llama", "llama", 2), ("qwen3", "qwen3", 2), ("gpt2", "gpt2", 4), ("gemma3", "gemma3_text", 2),
])
def test_architecture_of_each_family(tmp_path, family, model_type, kv_heads):
    folder = ck.write_checkpoint(tmp_path / family, family, layers=3)
    (source,) = find_models([folder])
    assert architecture(source) == {**TINY, "model_type": model_type, "num_layers": 3, "num_kv_heads": kv_heads}


def test_architecture_defaults(tmp_path):
    gpt2 = _fake_model(tmp_path / "gpt2", {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                            "n_inner": None})
    assert architecture(find_models([gpt2])[0]) == {
        "model_type": "gpt2", "num_layers": 12, "hidden_size": 768, "num_heads": 12, "num_kv_heads": 12,
        "head_dim": 64, "d_ff": 3072}
    partial = _fake_model(tmp_path / "partial", {"model_type": "mystery", "hidden_size": 64})
    assert architecture(find_models([partial])[0]) == {
        "model_type": "mystery", "num_layers": None, "hidden_size": 64, "num_heads": None,
        "num_kv_heads": None, "head_dim": None, "d_ff": None}
    # multimodal configs keep the language model's shape in text_config
    vlm = _fake_model(tmp_path / "vlm", {"model_type": "gemma3", "text_config": {
        "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 16, "intermediate_size": 256}})
    assert architecture(find_models([vlm])[0])["num_kv_heads"] == 4
    bad = _fake_model(tmp_path / "bad")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        architecture(find_models([bad])[0])
    _one_line_error(e, f"models: {bad / 'config.json'} ")


def test_gguf_file_loads_like_the_model_it_was_written_from(tmp_path):
    pytest.importorskip("gguf")
    import torch

    path = ck.write_gguf(tmp_path / "gguf" / "tiny.gguf", seed=3)
    ck.skip_unless_gguf_tokenizer_loads(path)
    (source,) = find_models([path])
    assert architecture(source) == {**TINY, "model_type": "llama", "num_kv_heads": 2}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(source.folder, **source.load_kwargs()).eval()
    tok = transformers.AutoTokenizer.from_pretrained(source.folder, **source.load_kwargs())
    text = "def f(x):\n    return x + 1  # ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ck.tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id == ck.tokenizer().eos_token_id == 0
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = ck.model("llama", seed=3)(batch).logits
        torch.testing.assert_close(loaded(batch).logits, expected, atol=1e-5, rtol=1e-5)
    # the base model (what the probe loads) too
    assert type(transformers.AutoModel.from_pretrained(source.folder, **source.load_kwargs())).__name__ == "LlamaModel"


def test_gguf_without_the_gguf_package_gives_the_install_hint(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    (source,) = find_models([path])
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ValueError) as e:
        architecture(source)
    assert _one_line_error(e, "models: ") == \
        f'models: reading {path} needs the gguf package: pip install "fastspec[gguf]"'


def test_a_broken_gguf_file_is_one_line(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError) as e:
        architecture(find_models([path])[0])
    _one_line_error(e, f"models: {path} is not a readable GGUF file")


# --- check_series ---------------------------------------------------------------------------------

def test_a_series_with_two_architectures_names_both(tmp_path):
    run = tmp_path / "runs" / "a"
    ck.write_checkpoint(run / "checkpoint-200", "llama", layers=2)
    ck.write_checkpoint(run / "checkpoint-300", "llama", layers=4)
    found = find_models([run])
    with pytest.raises(ValueError) as e:
        check_series(found)
    assert _one_line_error(e, "models: ") == (
        f"models: checkpoint-200 and checkpoint-300 in {run} differ in num_layers (2 vs 4); "
        f"a series must share one architecture")


def test_separate_models_may_differ(tmp_path):
    a = ck.write_checkpoint(tmp_path / "a", "llama", layers=2)
    b = ck.write_checkpoint(tmp_path / "b", "gpt2", layers=3)
    run = _fake_model(tmp_path / "run" / "checkpoint-1", {"model_type": "llama", "num_hidden_layers": 5})
    check_series(find_models([a, b, run.parent]))  # three series of one: nothing to compare


def test_check_series_compares_fields_in_order(tmp_path):
    run = tmp_path / "run"
    _fake_model(run / "step1", {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48})
    _fake_model(run / "step2", {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64})
    with pytest.raises(ValueError, match=r"step1 and step2 in .* differ in d_ff \(48 vs 64\)"):
        check_series(find_models([run]))
