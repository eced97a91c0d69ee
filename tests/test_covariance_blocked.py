"""The blocked torch update (``covariance/blocked.py``) and the precision policy (``policy.py``).

Ground truth is float64 numpy over the valid rows. Tolerances: float64 products are held to a few
eps64; float32 products to the error torch's own float32 matmul of the same rows makes (x4)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from _keys import lowrank_rope_keys

import fastspec
from fastspec.covariance import blocked, policy
from fastspec.metrics import participation_ratio


def _truth(x: torch.Tensor, mask, row_step: int = 1):
    """``(n, mean, m2, gram, rejected)`` per site, float64, from ``x: [B, T, S, D]``."""
    x = x[:, ::row_step].double()
    B, T, S, D = x.shape
    keep = torch.ones(B, T, dtype=torch.bool) if mask is None else mask[:, ::row_step]
    rows = x.reshape(B * T, S, D)
    keep = keep.reshape(B * T)
    out = []
    for s in range(S):
        r = rows[:, s]
        fin = torch.isfinite(r).all(-1)
        v = r[keep & fin]
        mean = v.mean(0)
        d = v - mean
        out.append((len(v), mean, d.T @ d, v.T @ v, int((keep & ~fin).sum())))
    n, mean, m2, gram, rej = zip(*out)
    return (torch.tensor(n), torch.stack(mean), torch.stack(m2), torch.stack(gram), torch.tensor(rej))


def _torch_fp32_err(x, mask) -> float:
    """Relative error of torch's float32 Gram of the same valid rows (the yardstick)."""
    xs = x.double()
    B, T, S, D = x.shape
    keep = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    errs = []
    for s in range(S):
        r = xs[:, :, s].reshape(-1, D)[keep.reshape(-1)]
        r = r[torch.isfinite(r).all(-1)]
        g64 = r.T @ r
        g32 = (r.float().T @ r.float()).double()
        errs.append(float((g32 - g64).norm() / g64.norm()))
    return max(errs)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _inputs(seed=0, B=3, T=37, S=2, D=24, layout="bhtd", mean=0.0):
    g = torch.Generator().manual_seed(seed)
    if layout == "bhtd":  # keys as attention stores them, seen as a [B, T, H, D] view
        x = (torch.randn(B, S, T, D, generator=g) + mean).transpose(1, 2)
    else:  # every axis strided
        x = (torch.randn(D, S, 2 * T, B, generator=g) + mean).permute(3, 2, 1, 0)[:, ::2]
    mask = torch.rand(B, T, generator=g) > 0.3
    return x, mask


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("track_mean", [True, False])
@pytest.mark.parametrize("layout", ["bhtd", "strided"])
@pytest.mark.parametrize("syrk", [True, False], ids=["syrk", "bmm"])
def test_blocked_update_matches_float64_truth(precision, track_mean, layout, syrk, monkeypatch):
    # syrk=False: the CUDA code path (bmm products, every block through the row check) on CPU
    monkeypatch.setattr(blocked, "_use_syrk", lambda device: syrk)
    monkeypatch.setattr(blocked, "BLOCK_ELEMS", 2 * 24 * 10)  # 10 rows a block: many blocks
    monkeypatch.setattr(blocked, "CUDA_BLOCK_ELEMS", 2 * 24 * 10)
    monkeypatch.setattr(blocked, "FP32_FLUSH_ROWS", 25)
    x, mask = _inputs(layout=layout, mean=3.0)
    x[1, 4, 0, 7] = float("nan")  # a real row: rejected for site 0 only
    x[~mask] = float("inf")  # padding may hold anything: never read into the sums
    cov = fastspec.Covariance((2, 24), track_mean=track_mean, precision=precision, backend="torch")
    cov.update(x[:2], mask[:2]).update(x[2:], mask[2:])
    n, mean, m2, gram, rej = _truth(x, mask)
    assert torch.equal(cov.n, n) and torch.equal(cov.rejected, rej)
    assert int(rej[0]) == (1 if mask[1, 4] else 0) and int(rej[1]) == 0
    tol = 1e-13 if precision == "exact" else 4 * max(_torch_fp32_err(x, mask), 1e-7)
    assert _rel(cov.gram(), gram) < tol
    assert _rel(cov.mean, mean) < tol
    if track_mean:
        assert _rel(cov.covariance(unbiased=False), m2 / n[:, None, None]) < tol * 10  # |mean| = 3σ
    assert torch.equal(cov.gram(), cov.gram().mT)  # exactly symmetric


def test_row_step_and_all_padded_rows():
    x, mask = _inputs(seed=1)
    cov = fastspec.Covariance((2, 24), track_mean=False).update(x, mask, row_step=3)
    n, _, _, gram, _ = _truth(x, mask, row_step=3)
    assert torch.equal(cov.n, n)
    assert _rel(cov.gram(), gram) < 1e-13
    empty = fastspec.Covariance((2, 24)).update(x, torch.zeros_like(mask))
    assert empty.n.tolist() == [0, 0] and empty.rejected.tolist() == [0, 0]
    assert torch.isfinite(empty.state_dict()["state"]["m2"]).all()


def test_large_mean_keeps_the_centred_covariance_accurate():
    g = torch.Generator().manual_seed(2)
    x = 1e4 + torch.randn(4, 64, 1, 16, generator=g)  # float32 rows with mean/std = 1e4
    cov = fastspec.Covariance(16, precision="fast").update(x[:, :, 0])
    _, _, m2, _, _ = _truth(x, None)
    # float32 x itself is rounded to ~1e4·eps32 = 6e-4 of std: products about the shift lose nothing more
    assert _rel(cov.covariance(unbiased=False), m2[0] / 256) < 1e-5


def test_finite_blocks_skip_the_row_path_and_a_bad_block_takes_it(monkeypatch):
    monkeypatch.setattr(blocked, "BLOCK_ELEMS", 2 * 24 * 37)  # one sequence a block
    calls = []
    real = blocked._reject_rows
    monkeypatch.setattr(blocked, "_reject_rows", lambda a, m: calls.append(a.shape) or real(a, m))
    x, mask = _inputs(seed=3)
    fastspec.Covariance((2, 24), track_mean=False).update(x, mask)
    assert calls == []  # finite data: O(D) check per block only
    x[2, 5, 1, 0] = float("-inf")
    mask[2, 5] = True
    cov = fastspec.Covariance((2, 24), track_mean=False).update(x, mask)
    assert len(calls) == 1  # only the third sequence's block
    assert cov.rejected.tolist() == [0, 1]


def test_workspace_is_reused_across_updates():
    x, mask = _inputs(seed=4)
    cov = fastspec.Covariance((2, 24), track_mean=True)
    cov.update(x, mask)
    ws = blocked.shared_workspace()
    ptrs = {k: t.data_ptr() for k, t in ws._bufs.items()}
    cov.update(x, mask)
    other = fastspec.Covariance((2, 24), track_mean=True)  # another accumulator shares the buffers
    other.update(x, mask)
    assert {k: t.data_ptr() for k, t in ws._bufs.items()} == ptrs


def test_sv_exact_precision_matches_float64_svdvals_on_rank_deficient_heads():
    k = lowrank_rope_keys(r=1)
    B, H, T, D = k.shape
    truth = torch.stack([participation_ratio(torch.linalg.svdvals(
        k[:, h].reshape(-1, D).double())) for h in range(H)])
    pr = {p: fastspec.Covariance((H, D), track_mean=False, precision=p).update(k.transpose(1, 2))
          .metrics("sv").participation_ratio for p in ("auto", "exact", "fast")}
    assert ((pr["exact"] - truth) / truth).abs().max() < 1e-7
    assert torch.equal(pr["auto"], pr["exact"])  # auto on CPU: float64 products for raw sums
    # the documented cost of float32 products on such heads: ~1e-4, never better than 1e-6 here
    assert 1e-6 < ((pr["fast"] - truth) / truth).abs().max() < 1e-3


def test_policy_plans(monkeypatch):
    cpu32 = torch.zeros(1)

    def plan(precision, backend, track_mean, x):
        return policy.update_plan(policy.UpdateSettings(precision, backend), track_mean, x)

    assert plan("auto", "auto", False, cpu32) == (torch.float64, "torch")
    assert plan("auto", "auto", True, cpu32) == (torch.float32, "torch")
    assert plan("fast", "auto", False, cpu32) == (torch.float32, "torch")
    assert plan("exact", "auto", True, cpu32) == (torch.float64, "torch")
    assert plan("fast", "auto", False, cpu32.double()) == (torch.float64, "torch")  # fp64 input stays
    with pytest.raises(ValueError, match="backend: 'triton'"):
        plan("exact", "triton", False, cpu32)
    # CUDA stand-ins: which products and backend each GPU class gets
    monkeypatch.setattr(policy, "_triton_importable", lambda: True)
    cuda = types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=True, device=torch.device("cuda", 0))
    for full_rate, products in ((True, torch.float64), (False, torch.float32)):
        monkeypatch.setattr(policy, "full_rate_fp64", lambda d, f=full_rate: f)
        assert plan("auto", "auto", False, cuda).products == products
        assert plan("auto", "auto", True, cuda) == (torch.float32, "triton")
    assert policy.solve_dtype("sv", torch.device("cuda")) == torch.float64
    assert policy.solve_dtype("eig", torch.device("cuda")) == torch.float32
    assert policy.solve_dtype("eig", torch.device("cpu")) == torch.float64
    with pytest.raises(ValueError, match="precision: expected one of"):
        fastspec.Covariance(4, precision="double")


def test_probe_exact_sv_is_a_deprecated_alias():
    from _tiny_models import build

    model = build("llama")
    with pytest.warns(DeprecationWarning, match="precision"):
        p = fastspec.Probe(model, ffn=False, exact_sv=False)
    assert p.precision == "fast"


def test_bf16_rows_exact_products_equal_float64_of_the_rounded_rows():
    x, mask = _inputs(seed=6)
    xb = x.to(torch.bfloat16)
    got = fastspec.Covariance((2, 24), track_mean=False).update(xb, mask).gram()
    ref = fastspec.Covariance((2, 24), track_mean=False).update(xb.double(), mask).gram()
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-13, atol=1e-12)
