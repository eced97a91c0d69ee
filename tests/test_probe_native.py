"""Sites of models that call no Hugging Face attention interface (the trainers' own modules).

A family with :class:`fastspec.probe.AttentionInputs` says which modules receive the post-RoPE
queries and keys, at which positions of their inputs and in which layout; the probe reads them
there with a forward pre-hook. Checked on plain PyTorch models built like OLMo-core's (one
``(q, k, v)`` tuple, ``[B, T, H, D]``) and TorchTitan's (``q, k, v`` positional) attention, so
that they run without either trainer installed (tests/test_integration_*.py run the real ones):

* each head's record equals float64 ``svdvals`` of that head's keys, for both input shapes and
  both layouts; queries per query head;
* the family is found from the model's class (``Family.model_classes``, also through a subclass
  such as FSDP2's), by name or as an object, and bad families or positions raise one line;
* the recompute of activation checkpointing in backward is not counted: ``n`` is the tokens once;
* blocks compiled in place (``fullgraph=True``) trace the pre-hooks and stream the eager records;
* tensor parallelism: keys arriving as a ``DTensor`` sharded over heads (2 gloo ranks) are
  reported under their global head index, each equal to that head of one process's records.
"""
from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from _ranks import start_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastspec
from fastspec.probe import FAMILIES, AttentionInputs, Family
from fastspec.probe.hooks import local_part

B, T, D_MODEL, HQ, HKV, D = 2, 12, 32, 4, 2, 8


class Core(nn.Module):
    """The attention kernel module: receives q, k, v and computes causal attention."""

    def __init__(self, packed: bool, layout: str):
        super().__init__()
        self.packed, self.layout = packed, layout

    def forward(self, *args):
        q, k, v = args[0] if self.packed else args[:3]
        if self.layout == "BTHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        return out.transpose(1, 2).flatten(2)


class Attention(nn.Module):
    def __init__(self, packed: bool, layout: str):
        super().__init__()
        self.wq, self.wk = nn.Linear(D_MODEL, HQ * D), nn.Linear(D_MODEL, HKV * D)
        self.wv, self.wo = nn.Linear(D_MODEL, HKV * D), nn.Linear(HQ * D, D_MODEL)
        self.core, self.packed, self.layout = Core(packed, layout), packed, layout

    def forward(self, x):
        q = self.wq(x).unflatten(-1, (HQ, D))  # [B, T, H, D]
        k = self.wk(x).unflatten(-1, (HKV, D))
        v = self.wv(x).unflatten(-1, (HKV, D))
        q, k = torch.sin(q) + q, torch.cos(k) + k  # a stand-in for RoPE: the probe must see what core sees
        if self.layout == "BHTD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.wo(self.core((q, k, v)) if self.packed else self.core(q, k, v))


class Block(nn.Module):
    def __init__(self, packed: bool, layout: str):
        super().__init__()
        self.attn = Attention(packed, layout)
        self.w1, self.w2 = nn.Linear(D_MODEL, 48), nn.Linear(48, D_MODEL)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.w2(torch.relu(self.w1(x)))


class TinyNative(nn.Module):
    """A decoder of two blocks; ``checkpointed``: each block under activation checkpointing."""

    def __init__(self, packed: bool = False, layout: str = "BTHD", checkpointed: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, D_MODEL)
        self.blocks = nn.ModuleList(Block(packed, layout) for _ in range(2))
        self.checkpointed = checkpointed

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return h


def family(packed: bool = False, layout: str = "BTHD") -> Family:
    return Family(ffn=r"blocks\.(\d+)\.w2",
                  attention=AttentionInputs(r"blocks\.(\d+)\.attn\.core", query=(0, 0) if packed else 0,
                                            key=(0, 1) if packed else 1, layout=layout),
                  model_classes=(f"{__name__}.TinyNative",))


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def reference_keys(model: nn.Module, x: torch.Tensor, layout: str, packed: bool, which: int = 1) -> dict:
    """{layer: [B, T, H, D]} float64 of what each core received at input ``which`` (1: keys)."""
    got = {}

    def hook(i):
        def fn(module, args):
            t = (args[0] if packed else args)[which].detach().double()
            got[i] = t.transpose(1, 2) if layout == "BHTD" else t
        return fn
    handles = [b.attn.core.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return got


def sv_pr(rows: torch.Tensor) -> float:
    s = torch.linalg.svdvals(rows)
    return float(s.sum() ** 2 / s.square().sum())


def values(records) -> dict:
    return {(r.site, r.layer, r.head_index, r.metric): r.value for r in records}


@pytest.mark.parametrize("packed,layout", [(False, "BTHD"), (True, "BTHD"), (False, "BHTD")])
def test_records_equal_svdvals_of_what_the_module_received(packed, layout):
    torch.manual_seed(0)
    model, x = TinyNative(packed, layout), tokens()
    recs = values(fastspec.Probe(model, queries=True, family=family(packed, layout)).measure(x, step=0))
    for site, which, heads in (("keys", 1, HKV), ("queries", 0, HQ)):
        ref = reference_keys(model, x, layout, packed, which)
        for layer in range(2):
            for h in range(heads):
                want = sv_pr(ref[layer][:, :, h].reshape(-1, D))
                got = recs[(site, layer, h, "participation_ratio")]
                assert got == pytest.approx(want, rel=1e-9), (site, layer, h)
                assert recs[(site, layer, h, "n")] == B * T
    assert {k[0] for k in recs} >= {"keys", "queries", "ffn"}


def test_family_found_from_the_model_class(monkeypatch):
    monkeypatch.setitem(FAMILIES, "tiny_native", family())
    model = TinyNative()
    assert fastspec.Probe(model).family is FAMILIES["tiny_native"]
    # a wrapper class that subclasses the model (as FSDP2's fully_shard makes) keeps it
    wrapped = type("FSDPTinyNative", (TinyNative,), {})()
    assert fastspec.Probe(wrapped).family is FAMILIES["tiny_native"]
    assert fastspec.Probe(model, family="tiny_native").family is FAMILIES["tiny_native"]


def test_trainer_families_are_registered_for_their_classes():
    for name, prefix in (("olmo_core", "olmo_core.nn.transformer."), ("torchtitan", "torchtitan.models.")):
        fam = FAMILIES[name]
        assert fam.attention is not None and fam.model_classes == (prefix,)
        assert fam.attention.layout == "BTHD"
    assert FAMILIES["olmo_core"].attention.key == (0, 1)  # backend((q, k, v), ...)
    assert FAMILIES["torchtitan"].attention.key == (1,)   # inner_attention(q, k, v, ...)


def test_bad_families_and_positions_raise_one_line():
    model = TinyNative()
    with pytest.raises(ValueError, match=r"^family: expected a name in fastspec.probe.FAMILIES or a Family, got 'nope'"):
        fastspec.Probe(model, family="nope")
    with pytest.raises(TypeError, match=r"^family: expected a name"):
        fastspec.Probe(model, family=3)
    with pytest.raises(ValueError, match=r"^model: keys/queries/ffn/prerope_keys sites need"):
        fastspec.Probe(model)  # no family registered for this class
    with pytest.raises(ValueError, match=r"^keys/queries: no module matches the attention pattern"):
        fastspec.Probe(model, ffn=False, family=Family(ffn=None, attention=AttentionInputs(r"nowhere\.(\d+)")))
    with pytest.raises(ValueError, match=r"^key: expected a position"):
        AttentionInputs("x", key=-1)
    with pytest.raises(ValueError, match=r"^query: expected a position"):
        AttentionInputs("x", query="q")
    with pytest.raises(ValueError, match=r"^layout: expected one of"):
        AttentionInputs("x", layout="HTBD")
    with pytest.raises(TypeError, match=r"^attention: expected a fastspec.probe.AttentionInputs"):
        Family(ffn=None, attention="blocks")
    for err in (ValueError, TypeError):
        try:
            fastspec.Probe(model, family="nope" if err is ValueError else 3)
        except err as e:
            assert "\n" not in str(e)


def _wrapped() -> TinyNative:
    """Each block inside torch's checkpoint wrapper, as TorchTitan and OLMo-core apply it: module
    names gain a ``_checkpoint_wrapped_module`` segment, which site patterns look through."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    model = TinyNative()
    model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    return model


@pytest.mark.parametrize("how", ["checkpoint", "wrapper"])
def test_checkpoint_recompute_is_not_counted(how):
    torch.manual_seed(0)
    model, x = (TinyNative(checkpointed=True) if how == "checkpoint" else _wrapped()), tokens()
    probe = fastspec.Probe(model, family=family(), ffn_rows="all", emit_every=1)
    with probe.streaming():
        model(x).square().mean().backward()  # backward recomputes each block's forward
        streamed = values(probe.step(0))
    ns = {v for k, v in streamed.items() if k[3] == "n"}
    assert ns == {B * T}, ns
    # and equal to the same tokens measured without checkpointing
    plain = TinyNative()
    plain.load_state_dict({k.replace("._checkpoint_wrapped_module", ""): v for k, v in model.state_dict().items()})
    measured = values(fastspec.Probe(plain, family=family(), ffn_rows="all").measure(x, step=0))
    for k, v in measured.items():
        assert streamed[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


# ----------------------------------------------------------------- tensor parallelism (DTensor)
WORLD = 2


def _tp_worker(rank: int, tmpdir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4)  # [B, T, H=5, D]
        x = distribute_tensor(full, mesh, [Shard(2)])
        local, offset = local_part(x, 2, "keys")
        out["uneven"] = (offset, local.shape[2], torch.equal(local, full[:, :, offset:offset + local.shape[2]]))
        rows, offset = local_part(distribute_tensor(full, mesh, [Shard(1)]), 2, "keys")  # sharded over tokens
        out["rows"] = (offset, torch.equal(rows, full.chunk(WORLD, dim=1)[rank]))
        for name, bad in (("partial", DTensor.from_local(full, mesh, [Partial()])),
                          ("features", distribute_tensor(full, mesh, [Shard(3)]))):
            try:
                local_part(bad, 2, "keys")
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
        # a model whose key/query projections are column-parallel, their outputs kept as DTensors
        torch.manual_seed(0)
        model = TinyNative()
        for block in model.blocks:
            parallelize_module(block.attn, mesh, {"wq": ColwiseParallel(use_local_output=False),
                                                  "wk": ColwiseParallel(use_local_output=False),
                                                  "wv": ColwiseParallel(use_local_output=False)})
        _cut(model)
        probe = fastspec.Probe(model, queries=True, ffn=False, family=family(), sync="none")
        out["records"] = values(probe.measure(tokens(), step=0))
    except Exception as e:  # noqa: BLE001 - reported by the parent's test
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _cut(model: TinyNative) -> None:
    """Every core returns zeros (the probe's hook has run before it): the rest of the model
    then needs no tensor-parallel plan, and the reference runs the same."""
    for block in model.blocks:
        block.attn.core.forward = lambda *args: torch.zeros(B, T, D_MODEL)
        block.attn.wo = nn.Identity()


def test_dtensor_keys_get_their_global_head_index(tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    torch.manual_seed(0)
    model, x = TinyNative(), tokens()
    _cut(model)
    want = values(fastspec.Probe(model, queries=True, ffn=False, family=family()).measure(x, step=0))
    start_ranks(_tp_worker, str(tmp_path), nprocs=WORLD)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, out in enumerate(outs):
        assert "error" not in out, out["error"]
        assert out["uneven"] == ((0, 3, True) if r == 0 else (3, 2, True))  # 5 heads: 3 + 2, torch's split
        assert out["rows"] == (0, True)
        assert out["partial"].startswith("keys: the activations are a DTensor with a partial placement")
        assert out["features"].startswith("keys: the activations are a DTensor sharded over their features")
    got = {**outs[0]["records"], **outs[1]["records"]}
    for site, heads in (("keys", HKV), ("queries", HQ)):
        per_rank = heads // WORLD
        for r, out in enumerate(outs):
            assert {k[2] for k in out["records"] if k[0] == site} == set(range(r * per_rank, (r + 1) * per_rank))
    assert got.keys() == want.keys()
    for k, v in want.items():  # a rank's columns of the fp32 projection sum in another order: ~1e-7
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


def test_compiled_blocks_capture_in_the_graph():
    """Each block compiled in place with ``fullgraph=True``: the pre-hooks on the cores are traced
    (no graph break), and the streamed records equal the eager ones."""
    torch.manual_seed(0)
    x = tokens()
    eager, compiled = TinyNative(packed=True), TinyNative(packed=True)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend="aot_eager")
    got = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        probe = fastspec.Probe(model, family=family(packed=True), ffn_rows="all", emit_every=1)
        with probe.streaming():
            model(x).square().mean().backward()
            in_graph = probe._router.captured_in_graph
            got[name] = values(probe.step(0))
        assert in_graph == (name == "compiled")
    assert got["eager"].keys() == got["compiled"].keys() and got["eager"]
    for k, v in got["eager"].items():
        assert got["compiled"][k] == pytest.approx(v, rel=1e-6, abs=1e-12), k
