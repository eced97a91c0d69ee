"""Bad input to a probe fails up front or warns, never passes silently or cryptically: a batch
without a token (empty or 1-D ``input_ids``, an all-zero ``attention_mask``), a site whose every
row the mask leaves out, NaN/Inf activations (rows rejected, named per site and layer), and a
custom model without attention modules (the error names the ways out)."""
from __future__ import annotations

import types
import warnings

import pytest
import torch
from _tiny_models import batch, build, transformers

import fastspec


def _fastspec_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fastspec.Probe")]


def _measure(probe, inputs, **kw) -> tuple[list, list]:
    """``probe.measure(inputs)``: its records and its fastspec warnings (with where they point)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = probe.measure(inputs, step=0, **kw)
    return records, [(str(w.message), w.filename) for w in caught if str(w.message).startswith("fastspec.Probe")]


def _values(records, metric: str) -> dict:
    return {(r.site, r.layer, r.head_index): r.value for r in records if r.metric == metric}


# ---------------------------------------------------------------- tokens and mask
@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
def test_an_all_zero_attention_mask_raises_before_the_forward(dtype):
    """Without the check every site ran, merged nothing, and came back NaN with n = 0, silently."""
    model = build("llama")
    inputs = batch()
    inputs["attention_mask"] = torch.zeros_like(inputs["attention_mask"], dtype=dtype)
    probe = fastspec.Probe(model)
    message = r"attention_mask: every token is masked \(all zeros\); expected at least one 1"
    with pytest.raises(ValueError, match=message):
        probe.measure(inputs, step=0)
    with pytest.raises(ValueError, match=message):
        probe.spectra(transformers.BatchEncoding(inputs))
    assert probe.records() == [] and not probe._hooks.installed
    inputs["attention_mask"][0, -1] = 1  # one real token is enough
    assert set(_values(probe.measure(inputs, step=0), "n").values()) == {1}


@pytest.mark.parametrize("ids, got", [
    (torch.ones(5, dtype=torch.long), "shape (5,)"),
    (torch.ones(0, 5, dtype=torch.long), "shape (0, 5)"),
    (torch.ones(2, 0, dtype=torch.long), "shape (2, 0)"),
    (torch.ones(1, 2, 3, dtype=torch.long), "shape (1, 2, 3)"),
    (torch.ones(2, 3), "dtype torch.float32 (shape (2, 3))"),
], ids=["1d", "no-batch", "no-token", "3d", "float"])
def test_input_ids_without_a_token_raise_naming_the_argument(ids, got):
    """Before the check these failed deep in the model ("cannot reshape tensor of 0 elements")."""
    probe = fastspec.Probe(build("llama"))
    message = (r"input_ids: expected an integer tensor \[batch, tokens\] with at least one token, got "
               + got.replace("(", r"\(").replace(")", r"\)") + "$")
    for inputs in (ids, {"input_ids": ids}, transformers.BatchEncoding({"input_ids": ids})):
        with pytest.raises(ValueError, match=message):
            probe.measure(inputs, step=0)
        with pytest.raises(ValueError, match=message):
            probe.spectra(inputs)


def test_inputs_embeds_without_a_token_raise_naming_the_argument():
    model = build("llama")
    probe = fastspec.Probe(model)
    for embeds, got in ((torch.randn(2, 32), r"shape \(2, 32\)"), (torch.randn(2, 0, 32), r"shape \(2, 0, 32\)"),
                        (torch.ones(2, 3, 32, dtype=torch.long), r"dtype torch.int64")):
        with pytest.raises(ValueError, match=r"inputs_embeds: expected a floating-point tensor \[batch, tokens, d\] "
                                             r"with at least one token, got " + got):
            probe.measure({"inputs_embeds": embeds}, step=0)
    embeds = model.get_input_embeddings()(batch()["input_ids"])
    assert set(_values(probe.measure({"inputs_embeds": embeds}, step=0), "n").values()) == {36}


# ------------------------------------------------------------- sites without rows
class _TailNet(torch.nn.Module):
    """``tail`` sees only the last two tokens of each sequence (its rows are ``[B, 2, 8]``)."""

    def __init__(self):
        super().__init__()
        self.proj, self.tail = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)

    def forward(self, x, attention_mask=None):
        return self.tail(self.proj(x)[:, -2:])


def test_measure_warns_for_a_site_that_ran_but_whose_every_row_the_mask_left_out():
    """The site's accumulator exists (its hook ran), so the structural check saw it as captured:
    measure() now reads ``n`` off its records and warns, naming the mask."""
    net = _TailNet()
    x, mask = torch.randn(3, 6, 4), torch.ones(3, 6, dtype=torch.long)
    mask[:, -2:] = 0  # right padding: tail's tokens are all padding
    probe = fastspec.Probe(net, keys=False, ffn=False, modules=["proj", "tail"])
    records, msgs = _measure(probe, {"x": x, "attention_mask": mask})
    assert _values(records, "n") == {("proj", None, None): 12, ("tail", None, None): 0}
    assert len(msgs) == 1 and msgs[0][1] == __file__  # points at the caller
    assert msgs[0][0].startswith("fastspec.Probe: site 'tail' captured no rows in this measurement: ")
    assert "attention_mask kept none of its token rows" in msgs[0][0]
    mask[:, -1] = 1
    assert _measure(probe, {"x": x, "attention_mask": mask})[1] == []


# --------------------------------------------------------------------- NaN / Inf
def _nan_ffn_model():
    """Llama whose layer-1 FFN input (``act(gate) * up``) holds a NaN in every token's row."""
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    return model


def test_measure_names_the_site_layers_that_rejected_nan_rows():
    probe = fastspec.Probe(_nan_ffn_model(), ffn_rows="all")
    records, msgs = _measure(probe, batch())
    rejected = {k: v for k, v in _values(records, "rejected").items() if v}
    assert rejected == {("ffn", 1, None): 36}
    assert len(msgs) == 1 and msgs[0][1] == __file__
    msg = msgs[0][0]
    assert msg.startswith("fastspec.Probe: rows with NaN/Inf activations were rejected (not merged) in this "
                          "measurement at ffn layer 1 (36 of 36 rows); ")
    assert "NaN metrics" in msg and "'rejected' metric" in msg and "\n" not in msg
    # a clean model warns about nothing
    assert _measure(fastspec.Probe(build("llama")), batch())[1] == []


def test_streamed_nan_rows_warn_once_per_site_layer():
    model = _nan_ffn_model()
    # these forwards are eval ones: stream them too (which stream: tests/test_probe_forwards.py)
    probe = fastspec.Probe(model, emit_every=1, ffn_rows="all", forwards="all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.streaming():
            for step in range(3):
                model(**batch())
                probe.step(step)
        probe.records()
    msgs = [w for w in caught if str(w.message).startswith("fastspec.Probe")]
    assert len(msgs) == 1 and msgs[0].filename == __file__
    assert "rejected (not merged) by step 0 at ffn layer 1 (36 of 36 rows)" in str(msgs[0].message)


def test_nan_everywhere_lists_the_first_site_layers_and_counts_the_rest():
    """A diverged model rejects rows at every site: one readable line, not one per site layer."""
    model = build("llama")
    ids = batch()["input_ids"]
    with torch.no_grad():
        model.model.embed_tokens.weight[ids[0, 0]] = float("nan")  # one token poisons its sequence
    probe = fastspec.Probe(model, queries=True, ffn_rows="all")
    records, msgs = _measure(probe, {"input_ids": ids})
    bad = {(s, l) for (s, l, _), v in _values(records, "rejected").items() if v}
    assert len(bad) == 6  # keys, queries, ffn x 2 layers
    assert len(msgs) == 1
    msg = msgs[0][0]
    assert "in this measurement at 6 site layers: " in msg and ", and 2 more; " in msg and "\n" not in msg
    assert "ffn layer 0 (12 of 36 rows)" in msg  # the first of three sequences


# ----------------------------------------------------------- no attention modules
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)


class _CustomNet(torch.nn.Module):
    """A "Hugging Face-like" model: a config with an unregistered model_type, no attention interface."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="my_custom_net")
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block.mlp(block.attn(x))
        return x


@pytest.mark.filterwarnings("ignore:fastspec.Probe. model_type 'my_custom_net' is not in")
def test_no_attention_modules_error_names_the_ways_out():
    with pytest.raises(ValueError) as info:
        fastspec.Probe(_CustomNet(), ffn=False)
    msg = str(info.value)
    assert msg.startswith("keys/queries: found no attention module with a layer index in this model "
                          "(model_type 'my_custom_net'")
    for way_out in ("keys=False", "queries=False", "modules=[...]", "fastspec.probe.FAMILIES"):
        assert way_out in msg
    assert "\n" not in msg
    # the way out works
    probe = fastspec.Probe(_CustomNet(), keys=False, ffn=False, modules="blocks.*.attn")
    assert {(r.site, r.layer) for r in probe.measure(torch.randn(2, 5, 8), step=0)} == {
        ("blocks.*.attn", 0), ("blocks.*.attn", 1)}
