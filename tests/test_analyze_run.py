"""``fastspec analyze`` end to end on tiny checkpoints written with ``save_pretrained``: what it
measures (against per-head ``svdvals`` by hand), the output folder, resume, Ctrl-C and the bad
inputs of the CLI (one line, exit 2, nothing written)."""
from __future__ import annotations

import json
import warnings

import _checkpoints as ck
import numpy as np
import pytest
import torch
from _tiny_models import attention_keys

from fastspec.checkpoints import run as analyze_run
from fastspec.cli import main

transformers = pytest.importorskip("transformers")

SMALL = dict(tokens=256, seq_len=32, batch_size=4, progress=False, report=False)


def _records(out):
    from fastspec.report import load_records

    return load_records(out)


def _value(df, model, site, metric, layer, head=None):
    sel = df[(df.model == model) & (df.site == site) & (df.metric == metric) & (df.layer == layer)]
    if head is not None:
        sel = sel[sel.head_index == head]
    assert len(sel) >= 1, (model, site, metric, layer, head)
    return sel.value.to_numpy()


def _low_rank_series(root):
    """checkpoint-100 and -200 the same weights, -300 with layer 1's key projection of rank 1 per
    KV head (pre-RoPE keys then lie on one line: rank@90 = 1)."""
    net = ck.model("llama", seed=3)
    for step in (100, 200):
        net.save_pretrained(root / f"checkpoint-{step}")
        ck.tokenizer().save_pretrained(root / f"checkpoint-{step}")
    with torch.no_grad():
        w = net.model.layers[1].self_attn.k_proj.weight  # [kv_heads · head_dim, hidden]
        for h in range(ck.KV_HEADS):
            rows = w[h * ck.HEAD_DIM:(h + 1) * ck.HEAD_DIM]
            rows.copy_(torch.linspace(1, 2, ck.HEAD_DIM)[:, None] * rows[0])
    # the keys site is post-RoPE: rotation spreads the line over pairs of dimensions, so only the
    # pre-RoPE site shows rank 1
    net.save_pretrained(root / "checkpoint-300")
    ck.tokenizer().save_pretrained(root / "checkpoint-300")
    return root


def test_a_series_is_measured_in_step_order_with_the_same_tokens(tmp_path):
    series = _low_rank_series(tmp_path / "run")
    out = tmp_path / "out"
    result = analyze_run.analyze(series, out, **SMALL)
    assert result.status == "completed" and result.measured == ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    df = _records(out)
    assert set(df.condition) == {"run"}
    assert sorted(set(zip(df.model, df.step))) == [("checkpoint-100", 100), ("checkpoint-200", 200),
                                                   ("checkpoint-300", 300)]
    assert set(df.site) >= {"keys", "keys_prerope", "queries", "ffn"}
    # same weights, same tokens: the same numbers, bit for bit
    for site in ("keys", "ffn", "keys_prerope"):
        a = _value(df, "checkpoint-100", site, "participation_ratio", 1)
        b = _value(df, "checkpoint-200", site, "participation_ratio", 1)
        np.testing.assert_array_equal(a, b)
    # the known change: layer 1's pre-RoPE keys are rank 1 at step 300 only
    assert (_value(df, "checkpoint-300", "keys_prerope", "rank_at_90", 1) == 1).all()
    assert (_value(df, "checkpoint-100", "keys_prerope", "rank_at_90", 1) > 1).all()
    assert (_value(df, "checkpoint-300", "keys_prerope", "rank_at_90", 0)
            == _value(df, "checkpoint-100", "keys_prerope", "rank_at_90", 0)).all()
    # every model measured the budget: ceil(256 / 32) = 8 sequences of 32 tokens
    assert (_value(df, "checkpoint-300", "keys", "n", 0) == 256).all()
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "completed" and config["command"] == "analyze"
    for m in config["models"]:
        assert m["done"] and set(m["times"]) == {"load", "tokenize", "forward", "probe", "solve", "write"}
        assert m["num_layers"] == 2 and m["head_dim"] == ck.HEAD_DIM
    with np.load(out / "spectra.npz") as z:
        assert z["checkpoint-300/keys/layer1"].shape == (ck.KV_HEADS, ck.HEAD_DIM)
        assert z["checkpoint-300/ffn/layer0"].shape == (ck.FFN,)
    log = (out / "analyze.log").read_text().splitlines()
    assert len(log) == 3 and all("forward" in line and "solve" in line for line in log)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2"])
def test_each_family_matches_per_head_svdvals(tmp_path, family):
    from fastspec.checkpoints.text import pack, read_documents
    from fastspec.metrics import participation_ratio

    folder = ck.write_checkpoint(tmp_path / family, family, seed=1)
    out = tmp_path / "out"
    analyze_run.analyze(folder, out, **SMALL)
    df = _records(out)
    docs, _ = read_documents(None)
    ids = pack(ck.tokenizer(), docs, tokens=SMALL["tokens"], seq_len=SMALL["seq_len"], seed=0)
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for layer, k in attention_keys(model, ids, batch_size=4).items():
        for head in range(k.shape[1]):
            want = participation_ratio(torch.linalg.svdvals(k[:, head])).item()
            got = _value(df, family, "keys", "participation_ratio", layer, head)
            assert got == pytest.approx(want, rel=1e-6), (layer, head)
    sites = set(df.site)
    assert "ffn" in sites
    # pre-RoPE keys where the family has them (GPT-2 has no rotary embedding); γ with Q/K-norm
    assert ("keys_prerope" in sites) == (family != "gpt2")
    assert ("gamma_k" in sites) == (family in ("qwen3", "gemma3"))
    meta = json.loads((out / "models" / family / "meta.json").read_text())
    assert ("keys_prerope" in meta["skipped_sites"]) == (family == "gpt2")


def test_gguf_file_is_analyzed_like_its_folder(tmp_path):
    pytest.importorskip("gguf")
    path = ck.write_gguf(tmp_path / "tiny.gguf", seed=2)
    ck.skip_unless_gguf_tokenizer_loads(path)
    out = tmp_path / "out"
    analyze_run.analyze(path, out, **SMALL)
    df = _records(out)
    assert set(df.model) == {"tiny"} and {"keys", "ffn"} <= set(df.site)
    assert (df[df.metric == "n"].value > 0).all()


def test_resume_skips_finished_models(tmp_path, monkeypatch):
    series = ck.write_series(tmp_path / "run", steps=(1, 2, 3))
    out = tmp_path / "out"
    first = analyze_run.analyze([series / "checkpoint-1", series / "checkpoint-2"], out, **SMALL)
    assert first.measured == ["checkpoint-1", "checkpoint-2"]
    before = (out / "models" / "checkpoint-1" / "records.jsonl").read_bytes()
    loaded = []
    real = analyze_run.load_model
    monkeypatch.setattr(analyze_run, "load_model", lambda s, settings: loaded.append(s.label) or real(s, settings))
    second = analyze_run.analyze(series, out, **SMALL)
    assert loaded == ["checkpoint-3"] and second.skipped == ["checkpoint-1", "checkpoint-2"]
    assert (out / "models" / "checkpoint-1" / "records.jsonl").read_bytes() == before
    assert sorted(set(_records(out).model)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # other settings in the same folder: refused, nothing changed
    with pytest.raises(ValueError, match=r"^--out: .*other settings \(tokens 256, not 512\)"):
        analyze_run.analyze(series, out, **{**SMALL, "tokens": 512})


def test_ctrl_c_leaves_a_valid_partial_folder_that_resumes(tmp_path, monkeypatch):
    series = ck.write_series(tmp_path / "run", steps=(10, 20, 30))
    out = tmp_path / "out"
    real = analyze_run.measure_model
    calls = []

    def interrupted(source, *a, **kw):
        calls.append(source.label)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(source, *a, **kw)

    monkeypatch.setattr(analyze_run, "measure_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        analyze_run.analyze(series, out, **{**SMALL, "report": True})
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "interrupted"
    assert [m["label"] for m in config["models"] if m["done"]] == ["checkpoint-10"]
    assert sorted(p.name for p in (out / "models").iterdir()) == ["checkpoint-10"]  # no temporary folder
    assert set(_records(out).model) == {"checkpoint-10"}
    assert (out / "report.md").is_file() and (out / "spectra.npz").is_file()
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    monkeypatch.setattr(analyze_run, "measure_model", real)
    again = analyze_run.analyze(series, out, **SMALL)
    assert again.measured == ["checkpoint-20", "checkpoint-30"] and again.status == "completed"


def test_cli_exit_code_130_on_ctrl_c(tmp_path, monkeypatch, capsys):
    folder = ck.write_checkpoint(tmp_path / "m", "llama")

    def stop(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze_run, "measure_model", stop)
    rc = main(["analyze", str(folder), "--out", str(tmp_path / "out"), "--tokens", "64", "--seq-len", "32",
               "--no-progress"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err


def test_cli_runs_and_writes_the_report(tmp_path, capsys):
    folder = ck.write_checkpoint(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "out"
    rc = main(["analyze", str(folder), "--out", str(out), "--tokens", "128", "--seq-len", "32", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "completed: 1 model(s)" in text and "tiny-llama: 128 tokens; load" in text
    assert (out / "report.md").is_file() and (out / "plots").is_dir()
    assert main(["report", str(out)]) == 0


def _fails(capsys, argv, match):
    capsys.readouterr()  # the fixtures' own output (transformers' "Writing model shards" bars)
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert match in err, err
    return err


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    good = ck.write_checkpoint(tmp_path / "good", "llama")
    out = tmp_path / "out"
    base = ["--out", str(out), "--tokens", "64", "--seq-len", "32", "--no-progress"]
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["analyze", str(tmp_path / "empty"), *base], "is not a model")
    _fails(capsys, ["analyze", str(tmp_path / "nope"), *base], "does not exist")
    mixed = tmp_path / "mixed"
    ck.write_checkpoint(mixed / "checkpoint-1", "llama", layers=2)
    ck.write_checkpoint(mixed / "checkpoint-2", "llama", layers=3)
    err = _fails(capsys, ["analyze", str(mixed), *base], "checkpoint-1")
    assert "checkpoint-2" in err
    short = tmp_path / "short.txt"
    short.write_text("too short")
    err = _fails(capsys, ["analyze", str(good), "--text", str(short), *base], "text: 9 tokens")
    _fails(capsys, ["analyze", str(good), *base[:-3], "--seq-len", "4096", "--no-progress"], "--seq-len: 4096")
    _fails(capsys, ["analyze", str(good), *base, "--tokens", "0"], "--tokens")
    _fails(capsys, ["analyze", str(good), *base, "--device", "cuda:7"] if not torch.cuda.is_available()
           else ["analyze", str(good), *base, "--device", "nope"], "--device")
    assert not out.exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(capsys, ["analyze", str(good), "--out", str(blocker / "sub"), "--tokens", "64", "--seq-len", "32"],
           "--out")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    _fails(capsys, ["analyze", str(good), "--out", str(taken), "--tokens", "64", "--seq-len", "32"], "--out")
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"]


def test_text_of_any_name_binary_refused_and_its_reading_kept_for_resume(tmp_path, capsys):
    good = ck.write_checkpoint(tmp_path / "good", "llama")
    out = tmp_path / "out"
    base = ["--out", str(out), "--tokens", "64", "--seq-len", "32", "--no-progress"]
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02 not text")
    err = _fails(capsys, ["analyze", str(good), "--text", str(binary), *base],
                 f"fastspec analyze: error: text: {binary} is a binary file")
    assert "Traceback" not in err
    copying = tmp_path / "COPYING"  # plain text without an extension (the GPL's file name)
    copying.write_text("GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007\n" * 40)
    _fails(capsys, ["analyze", str(good), "--text", str(copying), "--text-format", "jsonl", *base],
           f"text: line 1 of {copying} is not JSON")
    assert not out.exists()
    assert main(["analyze", str(good), "--text", str(copying), *base, "--no-report"]) == 0
    settings = json.loads((out / "config.json").read_text())["settings"]
    assert settings["text"].startswith(f"{copying} (") and settings["text_format"] == "auto"
    # another reading of the same file: other documents, so the folder is not resumed
    with pytest.raises(ValueError, match=r"^--out: .*other settings \(text_format 'auto', not 'plain'\)"):
        analyze_run.analyze(good, out, text=copying, text_format="plain", **{**SMALL, "tokens": 64})
    # a folder written before --text-format existed was read as auto: it resumes with the default
    config = json.loads((out / "config.json").read_text())
    del config["settings"]["text_format"]
    (out / "config.json").write_text(json.dumps(config))
    again = analyze_run.analyze(good, out, text=copying, **{**SMALL, "tokens": 64})
    assert again.skipped == ["good"] and not again.measured


def test_unknown_family_measures_keys_and_says_how_to_register(tmp_path, monkeypatch):
    from fastspec.probe import FAMILIES

    folder = ck.write_checkpoint(tmp_path / "m", "llama")
    monkeypatch.delitem(FAMILIES, "llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analyze_run.analyze(folder, tmp_path / "out", **SMALL)
    msgs = [str(w.message) for w in caught if "FAMILIES" in str(w.message)]
    assert len(msgs) == 1 and "FFN and pre-RoPE keys skipped" in msgs[0] and "register" in msgs[0]
    sites = set(_records(tmp_path / "out").site)
    assert "keys" in sites and "ffn" not in sites


def test_api_is_fastspec_analyze(tmp_path):
    import fastspec

    folder = ck.write_checkpoint(tmp_path / "m", "qwen3")
    result = fastspec.analyze(folder, tmp_path / "out", **SMALL)
    assert result.status == "completed" and set(result.records.model) == {"m"}


def test_cost_benchmark_runs_and_the_docs_state_its_committed_numbers(tmp_path):
    """``benchmarks/analyze_time.py --quick`` runs (so the benchmark does not rot), and the cost
    table of docs/analyze.md states the ratios of the committed result files."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("analyze_time", root / "benchmarks" / "analyze_time.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "t.json"
    assert bench.main([str(out), "--quick", "--repeats", "1"]) == 0
    got = json.loads(out.read_text())
    assert got["tokens"] == 256 and got["ratio_vs_causal_lm_forward"] > 0
    assert set(got["analysis_phases_median_s"]) >= {"load", "tokenize", "forward", "probe", "solve", "write"}
    doc = (root / "docs" / "analyze.md").read_text()
    for name in ("cpu-amd-epyc-2core-2026-11-26-analyze-time.json",
                 "cpu-amd-epyc-2core-2026-11-26-analyze-time-4k-tokens.json"):
        res = json.loads((root / "benchmarks" / "results" / name).read_text())
        assert name in doc
        assert f"| {res['ratio_vs_causal_lm_forward']:.2f}×" in doc.replace("**", "")
        assert f"| {res['ratio_vs_base_forward']:.2f}×" in doc


def test_one_model_in_memory_at_a_time(tmp_path, monkeypatch):
    """When a checkpoint loads, the one before it is gone (no reference left to it anywhere)."""
    import weakref

    series = ck.write_series(tmp_path / "run", steps=(1, 2, 3))
    real = analyze_run.load_model
    alive_at_load, refs = [], []

    def tracked(source, settings):
        alive_at_load.append(sum(r() is not None for r in refs))
        model, tok = real(source, settings)
        refs.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(analyze_run, "load_model", tracked)
    analyze_run.analyze(series, tmp_path / "out", **SMALL)
    assert alive_at_load == [0, 0, 0]
    assert all(r() is None for r in refs)
