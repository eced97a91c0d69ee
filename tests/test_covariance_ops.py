"""The covariance update as a custom op (fastspec/covariance/ops.py): opcheck, the gate, and
``Covariance.update`` inside ``torch.compile(fullgraph=True)``."""
from __future__ import annotations

import pytest
import torch

import fastspec
from fastspec.covariance import ops

OP = torch.ops.fastspec.covariance_update_


def _state(S: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    """A non-trivial state (as if some rows had been merged already)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(S, 7, D, generator=g, dtype=torch.float64)
    return [torch.full((S,), 7, dtype=torch.int64), torch.zeros(S, dtype=torch.int64),
            a.mean(1), (a - a.mean(1, keepdim=True)).mT @ (a - a.mean(1, keepdim=True))]


def _rows(B=2, T=6, S=3, D=4, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, S, D, generator=g) * 3 + 10).to(dtype)


@pytest.mark.parametrize("track_mean", [True, False])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("gate", [None, True, False])
def test_opcheck(track_mean, with_mask, gate):
    x = _rows()
    mask = torch.tensor([[True] * 6, [True, True, False, True, False, False]]) if with_mask else None
    g = None if gate is None else torch.tensor(gate)
    args = (*_state(3, 4), x, mask, g, 2, track_mean, "auto", "torch")
    torch.library.opcheck(OP, args)


def test_op_equals_the_eager_update_and_a_closed_gate_changes_nothing():
    x = _rows()
    for gate, expect_change in ((None, True), (torch.tensor(True), True), (torch.tensor(False), False)):
        st = _state(3, 4)
        before = [t.clone() for t in st]
        OP(*st, x, None, gate, 1, True, "auto", "torch")
        want = [t.clone() for t in before]
        ops.covariance_update(*want, x, None, None, 1, True, "auto", "torch")
        for got, w, b in zip(st, want, before):
            assert torch.equal(got, w if expect_change else b)


@pytest.mark.parametrize("track_mean", [True, False])
def test_a_gate_folded_into_the_mask_merges_nothing_bit_for_bit(track_mean):
    """The device path (CUDA) never reads the gate on the host: it masks every row instead, and
    the merge of an empty chunk must leave the totals exactly as they were."""
    x = _rows()
    mask = torch.tensor([[True] * 6, [True, False] * 3])
    for gate, rows in ((torch.tensor(False), 0), (torch.tensor(True), 9)):
        st = _state(3, 4)
        if not track_mean:
            st[2], st[3] = st[2] * 7, st[3] + 7 * st[2][:, :, None] * st[2][:, None, :]
        before = [t.clone() for t in st]
        folded = ops.fold_gate(x, mask, gate)
        assert folded.shape == mask.shape and folded.dtype == torch.bool
        ops.covariance_update(*st, x, folded, None, 1, track_mean, "auto", "torch")
        assert torch.equal(st[0] - before[0], torch.full((3,), rows))
        if rows == 0:
            for got, b in zip(st, before):
                assert torch.equal(got, b)


def test_fake_impl_checks_state_shapes():
    x = _rows()
    n, rej, mean, m2 = _state(3, 4)
    narrow = mean[:, :3].clone()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        OP(*(mode.from_tensor(t) for t in (n, rej, mean, m2)), fx, None, None, 1, True, "auto", "torch")
        with pytest.raises(RuntimeError, match="state"):
            OP(mode.from_tensor(n), mode.from_tensor(rej), mode.from_tensor(narrow), mode.from_tensor(m2),
               fx, None, None, 1, True, "auto", "torch")


@pytest.mark.parametrize("track_mean", [True, False])
def test_covariance_update_compiles_fullgraph_and_matches_eager(track_mean):
    torch._dynamo.reset()
    xs = [_rows(seed=s) for s in range(3)]
    xs[1][0, 2, 1, 3] = float("nan")  # one refused row, counted inside the graph too
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    eager = fastspec.Covariance((3, 4), track_mean=track_mean)
    compiled = fastspec.Covariance((3, 4), device="cpu", track_mean=track_mean)

    def update(cov, x, gate):
        cov.update(x, mask, row_step=2, gate=gate)

    step = torch.compile(update, fullgraph=True, backend="aot_eager")
    gate = torch.tensor(True)
    for i, x in enumerate(xs * 2):
        gate.fill_(i % 3 != 2)  # the schedule is data: no recompile when it changes
        if i % 3 != 2:
            eager.update(x, mask, row_step=2)
        step(compiled, x, gate)
    for name in ("n", "rejected"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name))
    assert compiled.rejected.tolist() == [0, 2, 0]
    conv = "eig" if track_mean else "sv"
    torch.testing.assert_close(compiled.matrix(conv), eager.matrix(conv), rtol=1e-12, atol=1e-12)


def test_gate_must_be_one_element_on_the_data_device():
    cov = fastspec.Covariance(4)
    with pytest.raises(ValueError, match="gate: expected a one-element tensor"):
        cov.update(torch.randn(5, 4), gate=torch.ones(2, dtype=torch.bool))


@pytest.mark.gpu  # on CPU the products are SciPy BLAS, which autocast never touches
def test_autocast_around_a_compiled_update_does_not_lower_the_products():
    """A compiled graph called under autocast runs the op with autocast still on: the blocked
    path's float32 bmm must not drop to bf16."""
    torch._dynamo.reset()
    x = _rows(B=2, T=64, S=2, D=16, seed=3).cuda()
    want = fastspec.Covariance((2, 16), precision="fast", backend="torch").update(x)
    cov = fastspec.Covariance((2, 16), device="cuda", precision="fast", backend="torch")
    step = torch.compile(lambda c, x: c.update(x), fullgraph=True, backend="aot_eager")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        step(cov, x)
    assert torch.equal(cov.covariance(), want.covariance())
