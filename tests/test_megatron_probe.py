"""``fastspec.Probe`` on Megatron-core's ``GPTModel`` (family ``"megatron"``), in this process: one
gloo rank, tiny models from ``get_gpt_layer_local_spec()`` (tests/_megatron.py), trained on CPU.

* key PR per (layer, query group) equals that of float64 ``svdvals`` of the post-RoPE keys the
  core attention received (1e-6), with and without Q/K layernorm; the FFN PR equals the float64
  eigenvalues of the ``linear_fc2`` inputs' covariance; padding (Megatron's boolean mask, True =
  masked out) is not counted, a ``[1, 1, T, T]`` mask broadcast over the batch counts every token;
* activation recomputation (``full``, selective ``core_attn``) replays forwards in backward: the
  records equal those of the run without it (each token counted once);
* model chunks (a list, as Megatron's pipeline schedules take them) are one model, their layers
  numbered by Megatron's ``layer_number``; Megatron's DDP wrapper is seen through;
* ``FastspecStream`` (fastspec.integrations.megatron) over a 4-layer model trained 20 steps: records
  every ``emit_every`` steps whose key PR matches the reference of the keys of those steps, the
  scalars in the TensorBoard writer at those steps, ``overhead()`` reported, the state restored;
* bad arguments: one-line errors naming them.

Several ranks (data, tensor, pipeline parallelism, Megatron's distributed checkpoints) are
tests/test_integration_megatron.py's, under torchrun.
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from _integrations import check_version_warning

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

import _megatron as M

from fastspec import Probe
from fastspec.metrics import participation_ratio


@pytest.fixture(scope="module", autouse=True)
def megatron():
    """One gloo rank and Megatron's groups for this module; torch.cuda's originals put back after."""
    restore = M.install_shims()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        M.init()
    yield
    M.shutdown()
    restore()


class Inputs:
    """What the core attentions and ``linear_fc2`` modules of a model received while its own
    forward ran with gradients on (a training forward; not a recompute in backward; ``training=False``:
    any forward of the model's own, e.g. ``measure()``'s under ``no_grad``):
    ``keys[layer]`` rows ``[N, groups, d]`` and ``ffn[layer]`` rows ``[N, d_ff]`` of the real tokens
    (``keep`` of each call), float64."""

    def __init__(self, model, number=lambda i: i, training=True):
        self.keys, self.ffn, self.keep, self._in, self.training = {}, {}, None, False, training
        self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._end)]
        for i, layer in enumerate(model.decoder.layers):
            self.handles.append(layer.self_attention.core_attention.register_forward_pre_hook(
                self._grab(self.keys, number(i), 1)))
            self.handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(self._grab(self.ffn, number(i), 0)))

    def _start(self, module, args):
        self._in = torch.is_grad_enabled() or not self.training

    def _end(self, module, args, out):
        self._in = False

    def _grab(self, store, layer, pos):
        def hook(module, args):
            if self._in:
                rows = args[pos].detach().transpose(0, 1)[self.keep].double()  # [s, b, ...] -> real tokens
                store[layer] = torch.cat([store[layer], rows]) if layer in store else rows
        return hook

    def reset(self):
        self.keys.clear()
        self.ffn.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def _train(model, steps, probe_step=None, seed=0, pad=(0, 5), inputs=None, b=2):
    """``steps`` SGD steps on fixed-seed batches; ``probe_step(step)`` after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(1, steps + 1):
        data = M.batch(seed * 1000 + step, b=b, pad=pad)
        if inputs is not None:
            inputs.keep = data["keep"]
        M.call(model, data).mean().backward()
        opt.step()
        opt.zero_grad()
        if probe_step is not None:
            out += probe_step(step)
    return out


def _values(records, site=None, metric=None):
    return {(r.step, r.site, r.layer, r.head_index, r.metric): r.value for r in records
            if r.site != "probe" and (site is None or r.site == site) and (metric is None or r.metric == metric)}


def _key_pr(rows):
    """``{group: PR}`` of ``sv`` spectra (float64 svdvals) of key rows ``[N, groups, d]``."""
    return {g: float(participation_ratio(torch.linalg.svdvals(rows[:, g]))) for g in range(rows.shape[1])}


def _ffn_pr(rows):
    """PR of the ``eig`` spectrum (float64 eigenvalues of the centred covariance) of ``[N, d_ff]``."""
    x = rows - rows.mean(0)
    return float(participation_ratio(torch.linalg.eigvalsh(x.T @ x).clamp_min(0)))


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_keys_and_ffn_match_float64_references(qk_layernorm):
    torch.manual_seed(1)
    model = M.gpt(M.config(qk_layernorm=qk_layernorm))
    inputs = Inputs(model)
    probe = Probe(model, emit_every=2, ffn_rows="all")
    assert probe.family.mask == "megatron"
    probe.attach()
    records = _train(model, 2, probe.step, inputs=inputs)
    probe.detach()
    keys, ffn = _values(records, "keys", "participation_ratio"), _values(records, "ffn", "participation_ratio")
    assert {k[2] for k in keys} == {0, 1} and {k[3] for k in keys} == {0, 1}  # 2 layers x 2 query groups
    for layer, rows in inputs.keys.items():
        assert rows.shape[1:] == (2, 16)
        for g, want in _key_pr(rows).items():
            assert keys[(2, "keys", layer, g, "participation_ratio")] == pytest.approx(want, rel=1e-6)
        n = _values(records, "keys", "n")[(2, "keys", layer, 0, "n")]
        assert n == rows.shape[0] == 2 * (2 * M.SEQ - 5)  # padding not counted
    for layer, rows in inputs.ffn.items():
        # eig sites take float32 products (precision="auto"): float32's rounding, not float64's
        assert ffn[(2, "ffn", layer, None, "participation_ratio")] == pytest.approx(_ffn_pr(rows), rel=1e-5)


def test_broadcast_mask_counts_every_token():
    model = M.gpt(M.config(layers=1))
    probe = Probe(model, emit_every=1, ffn_rows="all")
    data = M.batch(3, b=3)
    data["attention_mask"] = data["attention_mask"][:1]  # one [1, 1, T, T] causal mask for the batch
    with probe.streaming():
        M.call(model, data).mean().backward()
    n = _values(probe.step(1), metric="n")
    assert set(n.values()) == {3 * M.SEQ}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_counts_each_token_once(recompute):
    runs = {}
    for how in (None, recompute):
        torch.manual_seed(2)
        model = M.gpt(M.config(recompute=how))
        probe = Probe(model, emit_every=2, ffn_rows="all")
        probe.attach()
        runs[how] = _values(_train(model, 2, probe.step))
        probe.detach()
    assert runs[recompute].keys() == runs[None].keys()
    for k, v in runs[None].items():
        assert runs[recompute][k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_model_chunks_take_megatron_layer_numbers():
    """A list of chunks (virtual pipeline stages) is one model: each chunk's forward counts, and
    layer l of a chunk is Megatron's ``layer_number - 1`` (here the second chunk's layers are
    renumbered 3, 4 as a pipeline offset would)."""
    torch.manual_seed(3)
    chunks = [M.gpt(M.config()), M.gpt(M.config())]
    for layer in chunks[1].decoder.layers:
        layer.layer_number += 2
    probe = Probe(chunks, emit_every=1, ffn_rows="all")
    inputs = [Inputs(chunks[0]), Inputs(chunks[1], number=lambda i: i + 2)]
    data = M.batch(4, pad=(2, 0))
    for i in inputs:
        i.keep = data["keep"]
    with probe.streaming():
        for chunk in chunks:
            M.call(chunk, data).mean().backward()
    keys = _values(probe.step(1), "keys", "participation_ratio")
    assert sorted({k[2] for k in keys}) == [0, 1, 2, 3]
    for i in inputs:
        for layer, rows in i.keys.items():
            for g, want in _key_pr(rows).items():
                assert keys[(1, "keys", layer, g, "participation_ratio")] == pytest.approx(want, rel=1e-6)
    with pytest.raises(TypeError, match="model chunks"):
        probe.measure({"input_ids": data["input_ids"]}, step=0)


def test_measure_and_wrappers():
    """``measure`` (the eval protocol) calls the model with Megatron's arguments; a model wrapped in
    Megatron's ``DistributedDataParallel`` is probed through the wrapper."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    torch.manual_seed(4)
    model = M.gpt(M.config())
    wrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    probe = Probe(wrapped, ffn_rows="all")
    assert probe.model is model
    data = M.batch(5, pad=(0, 3))
    inputs = Inputs(model, training=False)  # measure() runs under no_grad
    inputs.keep = data["keep"]
    got = _values(probe.measure({k: data[k] for k in ("input_ids", "position_ids", "attention_mask")}, step=0),
                  "keys", "participation_ratio")
    inputs.remove()
    assert sorted(inputs.keys) == [0, 1]
    for layer, rows in inputs.keys.items():
        for g, want in _key_pr(rows).items():
            assert got[(0, "keys", layer, g, "participation_ratio")] == pytest.approx(want, rel=1e-6)


def test_ffn_split_over_tensor_parallel_ranks_takes_the_layer_s_group():
    """Under tensor parallelism ``linear_fc2`` (a RowParallelLinear) takes ``input_size_per_partition``
    of ``input_size`` hidden units (faked here on one rank): the probe gathers the FFN rows over the
    module's own ``tp_group``, which must have as many ranks as the split (the gather itself:
    tests/test_integration_megatron.py, 2 ranks)."""
    model = M.gpt(M.config(layers=1))
    fc2 = model.decoder.layers[0].mlp.linear_fc2
    fc2.input_size_per_partition = 64
    with pytest.raises(ValueError, match=r"^tp_group: has 1 ranks, but the FFN down projection takes 64 of 128 "
                                         r"input features on this rank \(2 ranks\)"):
        Probe(model)
    fc2.tp_group = None
    with pytest.raises(ValueError, match=r"^tp_group: the FFN input is split over tensor-parallel ranks and no "
                                         r"group was given"):
        Probe(model)
    assert Probe(model, ffn=False).sites.names == ["keys"]


def test_layer_number_missing_is_an_error():
    model = M.gpt(M.config(layers=1))
    model.decoder.layers[0].layer_number = None
    with pytest.raises(ValueError, match="layer_number: the layer module 'decoder.layers.0'"):
        Probe(model)


class Writer:
    """The TensorBoard ``SummaryWriter`` methods the stream uses, recording ``add_scalar``."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.setdefault(global_step, {})[tag] = value

    def add_image(self, *args, **kwargs):
        pass

    def add_text(self, *args, **kwargs):
        pass

    def flush(self):
        pass


def test_stream_trains_20_steps():
    """The issue's run: a 4-layer GPTModel trained 20 steps with FastspecStream (emit_every 5):
    records at steps 5, 10, 15, 20, each key PR that of the keys of its 5 steps; the scalars reach
    the writer at those steps; ``overhead()`` reports the probe's share; a stream restored from
    the state at step 10 continues to the same records."""
    from fastspec.integrations.megatron import FastspecStream

    torch.manual_seed(5)
    model = M.gpt(M.config(layers=4))
    start = copy.deepcopy(model.state_dict())
    inputs = Inputs(model)
    writer = Writer()
    stream = FastspecStream(model, probe_kwargs={"emit_every": 5}, tensorboard=writer)
    states = {}

    def step(s):
        new = stream.step(s)
        want = {}
        if s % 5 == 0:
            for layer, rows in inputs.keys.items():
                for g, pr in _key_pr(rows).items():
                    want[(s, "keys", layer, g, "participation_ratio")] = pr
            inputs.reset()
            got = _values(new, "keys", "participation_ratio")
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert got[k] == pytest.approx(v, rel=1e-6), k
        if s == 10:
            states[s] = (copy.deepcopy(stream.state_dict()), copy.deepcopy(model.state_dict()))
        return new

    _train(model, 20, step, inputs=inputs)
    stream.finish()
    assert sorted({r.step for r in stream.records}) == [5, 10, 15, 20]
    assert sorted(writer.scalars) == [5, 10, 15, 20]
    assert "fastspec/stream/keys/participation_ratio/mean" in writer.scalars[20]
    over = stream.overhead()
    assert over["fraction"] > 0 and over["emit_every"] == 5 and over["work_s"] > 0

    # resume at step 10: a fresh model and stream, the saved states, steps 11..20 again
    inputs.remove()
    torch.manual_seed(5)
    model2 = M.gpt(M.config(layers=4))
    model2.load_state_dict(start)
    sd, weights = states[10]
    model2.load_state_dict(weights)
    stream2 = FastspecStream(model2, probe_kwargs={"emit_every": 5})
    stream2.load_state_dict(sd)
    opt = torch.optim.SGD(model2.parameters(), lr=0.05)
    for s in range(11, 21):
        M.call(model2, M.batch(s, pad=(0, 5))).mean().backward()
        opt.step()
        opt.zero_grad()
        stream2.step(s)
    stream2.finish()
    a, b = _values(stream.records), _values(stream2.records)
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert b[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_stream_bad_arguments():
    from fastspec.integrations.megatron import FastspecStream

    model = M.gpt(M.config(layers=1))
    with pytest.raises(TypeError, match="tensorboard: expected an object with .add_scalar"):
        FastspecStream(model, tensorboard=object())
    with pytest.raises(ValueError, match="log_rank: expected a rank below the world size 1"):
        FastspecStream(model, log_rank=1)
    with pytest.raises(ValueError, match="probe_kwargs: given together with probe="):
        FastspecStream(model, probe=lambda m, **kw: None, probe_kwargs={})
    with pytest.raises(ValueError, match="probe_kwargs: sync='rank0'"):
        FastspecStream(model, probe_kwargs={"sync": "rank0"})
    with pytest.raises(TypeError, match="the factory returned a NoneType"):
        FastspecStream(model, probe=lambda m, **kw: None)
    stream = FastspecStream(model)
    with pytest.raises(ValueError, match="state: not a FastspecStream state"):
        stream.load_state_dict({"version": 0})
    with pytest.raises(ValueError, match="iteration"):
        stream.step(-1)
    stream.finish()
    assert math.isfinite(len(stream.records))


@pytest.mark.slow  # dynamo traces Megatron's GPTModel: ~20 s on 2 CPU cores
def test_compiled_model_streams_the_eager_records():
    """``torch.compile`` of a GPTModel with the probe attached (dynamo traces the hooks, each capture
    one custom op; ``aot_eager``, as Inductor's code generation adds nothing the probe depends on):
    the records of the eager run, padding left out inside the graph."""
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(6)
        model = M.gpt(M.config())
        probe = Probe(model, emit_every=2, ffn_rows="all")
        probe.attach()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        records = []
        for step in (1, 2):
            data = M.batch(step, pad=(0, 5))
            M.call(run, data).mean().backward()
            opt.step()
            opt.zero_grad()
            records += probe.step(step)
        probe.detach()
        runs[compiled] = _values(records)
    assert runs[True].keys() == runs[False].keys()
    assert runs[True][(2, "keys", 0, 0, "n")] == 2 * (2 * M.SEQ - 5)
    for k, v in runs[False].items():
        assert runs[True][k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


@pytest.mark.parametrize("version, warns", [("0.20.0", True), ("0.15.2", True), ("0.16.0", False), ("0.19.2", False)])
def test_untested_megatron_core_version_warns_once_at_import(monkeypatch, version, warns):
    import fastspec.integrations.megatron as module

    check_version_warning(monkeypatch, module, "megatron-core", version, warns)


def test_version_range_without_packaging(monkeypatch):
    """The fallback compare (no ``packaging``) agrees with the specifier."""
    import sys

    import fastspec.integrations.megatron as module
    from fastspec.integrations._versions import in_range

    monkeypatch.setitem(sys.modules, "packaging.specifiers", None)  # import raises ImportError
    assert [in_range(v, module.TESTED) for v in ("0.16.0", "0.19.2", "0.20.0", "0.15.9", "1.0", "dev")] == [
        True, True, False, False, False, False]


def test_import_fastspec_does_not_import_megatron():
    import subprocess
    import sys

    code = ("import sys, fastspec, fastspec.integrations, fastspec.probe\n"
            "from fastspec.probe import FAMILIES\n"
            "assert 'megatron' in FAMILIES\n"
            "assert not [m for m in sys.modules if m.startswith('megatron')]\n")
    root = Path(__file__).resolve().parents[1]  # the fastspec under test, first on sys.path
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]


def test_stream_under_tensor_parallelism_hands_the_probe_its_group(monkeypatch):
    """Under TP > 1 (the world size faked here) the stream keeps the FFN site and gives the probe
    Megatron's tensor-parallel group (the FFN rows are gathered over it), and refuses ``keys``
    when the query groups do not split over the ranks."""
    import fastspec.integrations.megatron as module

    monkeypatch.setattr(module.parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    model = M.gpt(M.config(layers=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing is left out
        stream = module.FastspecStream(model)
    assert stream.probe.sites.names == ["keys", "ffn"]
    assert stream.probe._tp_group is module.parallel_state.get_tensor_model_parallel_group()
    stream.finish()
    with pytest.raises(ValueError, match="keys: 1 query groups do not split over 2 tensor-parallel ranks"):
        module.FastspecStream(M.gpt(M.config(layers=1, groups=1)))
