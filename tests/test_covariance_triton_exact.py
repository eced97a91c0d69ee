"""The exact float64 keys-update candidates (``fastspec/covariance/triton_exact.py``) against float64 truth.

Both candidates (``prep_gemm``: float64 rows + one batched GEMM; ``triton_f64``: float64
``tl.dot`` of widened tiles) must give the raw partials of the valid rows with float64 products
and sums: counts exactly, ``Σx`` and ``Σxxᵀ`` to float64 rounding (products of 16/32-bit values
are exact in float64, so only the additions round). Tensors live on ``DEVICE``: CUDA when there
is one (the compiled kernels), else CPU under ``TRITON_INTERPRET=1`` (conftest), so sizes stay
small.
"""
from __future__ import annotations

import math
import types

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.triton,  # the GPU kit runs these on CUDA (benchmarks/gpu_run.py)
    # the interpreter's numpy computes inf - inf on the way to flagging a row
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

from _sm90 import compiled_for_sm90

from fastspec.covariance import blocked
from fastspec.covariance import triton_exact as te
from fastspec.metrics import participation_ratio

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_F64_DOT = te.triton_f64_status(DEVICE) == ""
CANDIDATES = {
    "prep_gemm": te.partials_prep_gemm,
    "triton_f64": pytest.param(
        te.partials_triton_f64,
        marks=pytest.mark.skipif(not HAS_F64_DOT, reason=te.triton_f64_status(DEVICE) or "usable")),
}
DT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
# float64 rounding of the sums: the kernels and the einsum truth add in different orders
RTOL = 1e-13


def candidates():
    return pytest.mark.parametrize("fn", list(CANDIDATES.values()), ids=list(CANDIDATES))


def truth(x, mask=None, row_step=1):
    """(n, s, G, rejected) of the valid rows, float64 on the CPU."""
    x = x[:, ::row_step].cpu()
    mask = None if mask is None else mask[:, ::row_step].cpu()
    B, T, S, D = x.shape
    xf = x.reshape(B * T, S, D).double()
    finite = torch.isfinite(xf).all(-1)
    keep = torch.ones(B * T, 1, dtype=torch.bool) if mask is None else mask.reshape(B * T, 1).bool()
    valid = keep & finite
    xz = torch.where(valid[..., None], xf, 0)  # a where, not a product: NaN·0 is NaN
    return valid.sum(0), xz.sum(0), torch.einsum("nsi,nsj->sij", xz, xz), (keep & ~finite).sum(0)


def check(p, x, mask=None, row_step=1, rtol=RTOL):
    """The partials' contract (dtypes, device, c = 0, G exactly symmetric) and their values."""
    S, D = x.shape[2], x.shape[3]
    n, s, G, rejected = truth(x, mask, row_step)
    assert p.n.dtype == p.rejected.dtype == torch.int64
    assert p.s.dtype == p.G.dtype == p.c.dtype == torch.float64
    assert tuple(p.G.shape) == (S, D, D) and tuple(p.s.shape) == tuple(p.c.shape) == (S, D)
    assert all(t.device == x.device for t in p)
    assert torch.equal(p.n.cpu(), n) and torch.equal(p.rejected.cpu(), rejected), (p.n, n, p.rejected, rejected)
    assert torch.equal(p.c.cpu(), torch.zeros(S, D, dtype=torch.float64))
    assert torch.equal(p.G, p.G.mT)
    for got, want in ((p.s.cpu(), s), (p.G.cpu(), G)):
        assert torch.isfinite(got).all()
        err = (got - want).abs().max().item() if want.numel() else 0.0
        assert err <= rtol * max(want.abs().max().item() if want.numel() else 0.0, 1e-300), err


def rows(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + offset).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------- values
@candidates()
@pytest.mark.parametrize("D,dtype", [(24, torch.float16), (32, torch.float32), (64, torch.bfloat16),
                                     (96, torch.float16), (96, torch.bfloat16), (128, torch.bfloat16),
                                     (128, torch.float32), (128, torch.float64), (160, torch.float32)],
                         ids=lambda v: DT.get(v, v))
def test_random_rows_against_fp64(fn, D, dtype):
    # D = 24 / 96 / 160: padded tiles; 160 > 128 is triton_f64's tiled kernel (outside the envelope)
    x = rows(2, 40, 3, D, dtype=dtype, scale=3.0, offset=0.5)
    mask = torch.rand(2, 40, device=DEVICE) > 0.2
    check(fn(x, mask), x, mask)


@candidates()
@pytest.mark.parametrize("D", [1, 3])
def test_tiny_widths(fn, D):
    x = rows(2, 9, 2, D)
    check(fn(x), x)


@candidates()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DT.get)
def test_nan_inf_rows_are_rejected_for_their_site_only(fn, dtype):
    x = rows(2, 24, 3, 64, dtype=dtype)
    x[0, 3, 1, 7] = float("nan")
    x[0, 5, 0, 63] = float("inf")
    x[1, 5, 2, 0] = -float("inf")
    x[1, 6, :, 10] = float("nan")  # every site
    x[1, 9, 0, 1] = float("nan")  # masked out: neither valid nor rejected
    mask = torch.ones(2, 24, dtype=torch.bool, device=DEVICE)
    mask[1, 9] = False
    p = fn(x, mask)
    check(p, x, mask)
    assert p.rejected.tolist() == [2, 2, 2]
    assert p.n.tolist() == [45, 45, 45]


@candidates()
def test_padding_holding_inf_is_never_summed(fn):
    x = rows(3, 20, 2, 32, dtype=torch.bfloat16)
    mask = torch.ones(3, 20, dtype=torch.bool, device=DEVICE)
    mask[0, 15:] = False  # right padding
    mask[1, :6] = False  # left padding
    mask[2] = False  # a whole sequence
    x[~mask] = float("inf")
    x[0, 17, 1] = float("nan")
    p = fn(x, mask)
    check(p, x, mask)
    assert p.rejected.tolist() == [0, 0] and p.n.tolist() == [29, 29]


@candidates()
def test_huge_finite_values_stay_valid(fn):
    # fp32 rows near the top of the range: their squares only fit in float64; float64 rows
    # beyond float32's range: a float32 finiteness test would call them Inf
    x = rows(2, 10, 2, 32) * 1e37
    x[0, 0, 0, 0] = 3.3e38
    check(fn(x), x)
    y = rows(2, 10, 2, 32, dtype=torch.float64) * 1e100
    check(fn(y), y)


@candidates()
def test_strided_views_are_read_in_place(fn):
    # HF keys [B, H, T, D] seen as [B, T, H, D]
    k = rows(2, 3, 24, 64, dtype=torch.bfloat16)
    x = k.transpose(1, 2)
    assert not x.is_contiguous()
    mask = torch.rand(2, 24, device=DEVICE) > 0.3
    check(fn(x, mask), x, mask)
    # every axis strided (a slice of a larger tensor), and a transposed mask
    big = rows(4, 30, 5, 80, dtype=torch.float16)
    y = big[::2, 1::3, ::2, 3:67:2]
    assert [st > 1 for st in y.stride()] == [True] * 4 and y.shape[-1] == 32
    m = (torch.rand(10, 2, device=DEVICE) > 0.4).T
    check(fn(y, m), y, m)


@candidates()
@pytest.mark.parametrize("row_step", [2, 3])
def test_row_step(fn, row_step):
    x = rows(2, 50, 2, 64, dtype=torch.float16)
    x[1, 1, 0, 5] = float("nan")  # skipped by row_step: never looked at
    x[1, 2 * row_step, 1, 5] = float("nan")  # sampled: rejected
    mask = torch.rand(2, 50, device=DEVICE) > 0.25
    mask[1, 2 * row_step] = True
    p = fn(x, mask, row_step)
    check(p, x, mask, row_step)
    assert p.rejected.tolist() == [0, 1]


@candidates()
def test_int_mask(fn):
    x = rows(2, 12, 1, 32)
    mask = (torch.rand(2, 12, device=DEVICE) > 0.5).to(torch.int64)
    check(fn(x, mask), x, mask.bool())


def _exact_gram(x):
    """Σ x xᵀ over all rows, each entry correctly rounded (math.fsum of exact float64 products)."""
    N, S, D = x.shape
    prods = (x[:, :, :, None] * x[:, :, None, :]).permute(1, 2, 3, 0).reshape(-1, N).tolist()
    return torch.tensor([math.fsum(v) for v in prods], dtype=torch.float64).reshape(S, D, D)


@candidates()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DT.get)
def test_large_mean_keeps_float64_accuracy(fn, dtype):
    # rows about a mean of 1e4 (spread 1): Σxxᵀ ~ 1e8 per row; the products are exact, so the
    # error is that of N = 128 float64 additions only: ~sqrt(N)·2^-53 ≈ 1e-15 relative, bounded
    # here by 4x that (float32 sums would lose ~1e-5)
    x = rows(4, 32, 2, 32, dtype=dtype, offset=1e4)
    p = fn(x)
    exact = _exact_gram(x.reshape(-1, 2, 32).double().cpu())
    rel = ((p.G.cpu() - exact).abs().max() / exact.abs().max()).item()
    assert rel <= 4 * math.sqrt(128) * 2.0**-53, rel
    assert torch.equal(p.G, p.G.mT)


@candidates()
def test_empty_updates(fn):
    for x, mask in [(rows(2, 8, 3, 32), torch.zeros(2, 8, dtype=torch.bool, device=DEVICE)),
                    (rows(0, 8, 3, 32), None), (rows(2, 0, 3, 32), None)]:
        p = fn(x, mask)
        check(p, x, mask)
        assert p.n.tolist() == [0, 0, 0] and not p.G.any() and not p.s.any()
    # row_step beyond T: the first row of every sequence only
    x = rows(2, 3, 1, 32)
    check(fn(x, None, 5), x, None, 5)


@candidates()
def test_rank_deficient_heads_give_the_svd_spectrum(fn):
    """``sv`` spectra (sqrt of float64 eigvalsh of G) against float64 svdvals of the rows.

    Head 0: rank 8 exactly (small integers: rows, products and sums all exact, so G is the
    exact Gram matrix, bit for bit); head 1: rank 8 rounded to fp16/bf16 (full rank, trailing
    singular values 1e-5..1e-4 of the largest); head 2: full rank. Every singular value is within
    1e-8·σ_max, except head 0's exact null space, where sqrt(λ) of any float64 eigensolve of a
    Gram matrix sits at ~sqrt(2^-52)·σ_max ≈ 1.5e-8·σ_max (eigvalsh's λ error is ~2^-52·λ_max;
    G itself is exact there). The participation ratio agrees to 1e-8 (head 0: 1e-6, the same
    floor).
    """
    N, D = 96, 64
    z = torch.randint(-3, 4, (N, 8), dtype=torch.float64)
    w = torch.randint(-2, 3, (8, D), dtype=torch.float64)
    heads = [z @ w, torch.randn(N, 8, dtype=torch.float64) @ torch.randn(8, D, dtype=torch.float64),
             torch.randn(N, D, dtype=torch.float64)]
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.stack(heads, 1).to(dtype).reshape(2, N // 2, 3, D).to(DEVICE)
        p = fn(x)
        assert torch.equal(p.G[0].cpu(), heads[0].T @ heads[0])  # exact integer Gram
        sv = torch.linalg.eigvalsh(p.G.cpu()).flip(-1).clamp_min(0).sqrt()
        want = torch.linalg.svdvals(x.reshape(N, 3, D).transpose(0, 1).double().cpu())
        top = want[:, :1]
        null = want < 1e-12 * top  # head 0's exact null space (svdvals: ~1e-16·σ_max)
        assert null[0, 8:].all() and not null[1:].any()
        err = (sv - want).abs() / top
        assert err[~null].max().item() <= 1e-8, err[~null].max().item()
        assert err[null].max().item() <= 4 * 2.0**-26, err[null].max().item()
        pr, pr_want = participation_ratio(sv), participation_ratio(want)
        pr_err = ((pr - pr_want).abs() / pr_want).tolist()
        # head 0: its 56 null values of ~1.5e-8·σ_max add ~1e-7·σ_max to Σv (the eigensolve's floor)
        assert pr_err[1] <= 1e-8 and pr_err[2] <= 1e-8 and pr_err[0] <= 1e-6, pr_err
        assert pr[0] < 8


# ------------------------------------------------------------ symmetry, determinism, buffers
@candidates()
def test_bitwise_deterministic_and_symmetric(fn):
    x = rows(3, 64, 2, 96, dtype=torch.float32, scale=10.0)
    mask = torch.rand(3, 64, device=DEVICE) > 0.1
    a, b = fn(x, mask), fn(x, mask)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert torch.equal(a.G, a.G.mT)
    assert a.G.data_ptr() != b.G.data_ptr()  # fresh outputs, not workspace views


@candidates()
def test_the_workspace_is_reused_across_calls(fn, monkeypatch):
    got = []
    buffer = te._buffer

    def spy(ws, name, *args, **kwargs):
        t = buffer(ws, name, *args, **kwargs)
        assert ws is blocked.shared_workspace()
        got.append((name, t.data_ptr()))
        return t

    monkeypatch.setattr(te, "_buffer", spy)
    fn(rows(2, 40, 2, 64, dtype=torch.bfloat16))
    first, got[:] = list(got), []
    assert first, "no workspace buffer"
    fn(rows(2, 40, 2, 64, dtype=torch.bfloat16))
    assert got == first
    got.clear()
    fn(rows(1, 20, 2, 64, dtype=torch.float16))  # smaller: the same buffers
    assert dict(got) == {name: ptr for name, ptr in first if name in dict(got)}


def test_graph_capture_gets_fresh_buffers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert te._workspace(types.SimpleNamespace(is_cuda=True)) is None
    assert te._workspace(torch.zeros(1)) is blocked.shared_workspace()


@candidates()
@pytest.mark.parametrize("D", [96, 160])
def test_no_unwritten_buffer_entry_is_read(fn, D, monkeypatch):
    """Every buffer starts as NaN (-1 for ints) and none is reused: what the finish kernel
    reads must all have been written (lower tiles of the partials, every split's sums)."""

    def empty(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    monkeypatch.setattr(te, "_empty", empty)
    monkeypatch.setattr(te, "_workspace", lambda x: None)
    x = rows(2, 40, 2, D, dtype=torch.float16)
    mask = torch.rand(2, 40, device=DEVICE) > 0.3
    check(fn(x, mask), x, mask)


def test_prep_gemm_chunks_and_many_splits(monkeypatch):
    # 3 chunks of 32, 32 and 18 rows, one row per program: 82 partial sums, more than one
    # of the finish kernel's blocks of FINISH_BK = 64
    monkeypatch.setattr(te, "CHUNK_ELEMS", 2 * 32 * 32)
    monkeypatch.setattr(te, "PREP_ROWS", 1)
    assert te.FINISH_BK < 82
    x = rows(2, 41, 2, 32, dtype=torch.bfloat16)
    x[1, 40, 0, 0] = float("nan")
    mask = torch.rand(2, 41, device=DEVICE) > 0.2
    mask[1, 40] = True
    check(te.partials_prep_gemm(x, mask), x, mask)


@pytest.mark.skipif(not HAS_F64_DOT, reason=te.triton_f64_status(DEVICE) or "usable")
def test_triton_f64_many_splits(monkeypatch):
    # 9 row splits of 32 rows: the finish kernel's four-at-a-time loop with a partial last step
    monkeypatch.setattr(te, "F64_MIN_ROWS", 32)
    monkeypatch.setattr(te, "F64_PROGRAMS", 1000)
    x = rows(3, 96, 1, 96, dtype=torch.float16)
    mask = torch.rand(3, 96, device=DEVICE) > 0.2
    assert te._f64_config(288, 1, 96)[4] == 9
    check(te.partials_triton_f64(x, mask), x, mask)


# ------------------------------------------------------------------------ status, arguments
def test_triton_f64_status_refuses_triton_36_without_compiling(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled something")

    monkeypatch.setattr(triton, "compile", no_compile)
    monkeypatch.setattr(te, "_gram_f64_kernel", None)  # a launch would fail on None[...]
    monkeypatch.setattr(te, "_INTERPRET", False)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    te._f64_dot_reason.cache_clear()
    reason = te.triton_f64_status("cuda")
    assert reason == ("Triton 3.6's fp64 dot lowering aborts on widened 16-bit operands "
                      "(fixed upstream in triton-lang/triton PR 11664)")
    assert te.triton_f64_status(torch.device("cuda", 0)) == reason
    assert te._f64_dot_reason.cache_info().misses == 1  # decided once per version
    # the public function refuses before launching anything (a CPU tensor passed off as CUDA)
    monkeypatch.setattr(te, "_cuda_reason", lambda device, what: "")
    with pytest.raises(RuntimeError, match="Triton 3.6's fp64 dot"):
        te.partials_triton_f64(torch.randn(1, 4, 1, 32, dtype=torch.bfloat16))
    for version, usable in [("3.9.0", True), ("3.10.1+git", True), ("4.0.0", True), ("3.7.0", False),
                            ("3.8.2", False), ("2.3.1", False), ("main", False)]:
        monkeypatch.setattr(triton, "__version__", version)
        assert (te.triton_f64_status("cuda") == "") == usable, version
    te._f64_dot_reason.cache_clear()


def test_status_off_cuda_without_the_interpreter(monkeypatch):
    assert te.prep_gemm_status(DEVICE) == ""
    monkeypatch.setattr(te, "_INTERPRET", False)
    assert "CUDA tensor" in te.prep_gemm_status("cpu")
    assert "CUDA tensor" in te.triton_f64_status("cpu")
    assert te.prep_gemm_status("cuda") == ""
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        te.partials_prep_gemm(torch.randn(1, 4, 1, 32))


@pytest.mark.parametrize("call,match", [
    (lambda: te.partials_prep_gemm(torch.randn(10, 32, device=DEVICE)), "x: expected a 4-D"),
    (lambda: te.partials_prep_gemm(torch.ones(1, 2, 1, 32, dtype=torch.int32, device=DEVICE)), "x: expected bf16"),
    (lambda: te.partials_triton_f64(torch.randn(1, 2, 1, 32, device=DEVICE),
                                    torch.ones(1, 3, dtype=torch.bool, device=DEVICE)), "mask: expected"),
    (lambda: te.partials_prep_gemm(torch.randn(1, 2, 1, 32, device=DEVICE), None, 0), "row_step"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------- the merge folded in
ACCUMULATE = {
    "prep_gemm": (te.partials_prep_gemm, te.accumulate_prep_gemm),
    "triton_f64": pytest.param(
        te.partials_triton_f64, te.accumulate_triton_f64,
        marks=pytest.mark.skipif(not HAS_F64_DOT, reason=te.triton_f64_status(DEVICE) or "usable")),
}


@pytest.mark.parametrize(("partials", "accumulate"), list(ACCUMULATE.values()), ids=list(ACCUMULATE))
@pytest.mark.parametrize("D", [24, 128])
def test_accumulate_equals_partials_then_merge_bit_for_bit(partials, accumulate, D):
    """The finish kernel adding into an accumulator's totals (``ACC``) makes exactly the
    additions of partials + ``ops.merge_sums``: bitwise equal totals over two updates, starting
    from non-zero symmetric totals, with a NaN row and a mask; the Gram stays exactly symmetric."""
    from fastspec.covariance.ops import merge_sums

    S = 3
    g = torch.Generator().manual_seed(D)
    a = torch.randn(S, D, D, generator=g, dtype=torch.float64)
    start = {"n": torch.tensor([5, 0, 7]), "rejected": torch.tensor([1, 2, 0]),
             "sum": torch.randn(S, D, generator=g, dtype=torch.float64), "gram": a + a.mT}
    via_merge = {k: v.clone().to(DEVICE) for k, v in start.items()}
    folded = {k: v.clone().to(DEVICE) for k, v in start.items()}
    for seed in (1, 2):
        x = rows(2, 19, S, D, dtype=torch.float16, offset=seed)
        x[1, 3, 2, 0] = float("nan")
        mask = (torch.arange(19) % 5 != 2).expand(2, 19).contiguous().to(DEVICE)
        merge_sums(via_merge, False, *partials(x, mask, 1))
        accumulate(folded["n"], folded["rejected"], folded["sum"], folded["gram"], x, mask, 1)
    for k in start:
        assert torch.equal(folded[k], via_merge[k]), k
    assert torch.equal(folded["gram"], folded["gram"].mT)
    empty = {k: v.clone() for k, v in folded.items()}
    accumulate(empty["n"], empty["rejected"], empty["sum"], empty["gram"], x[:0], mask[:0], 1)
    assert all(torch.equal(empty[k], folded[k]) for k in start)  # an empty update changes nothing


def test_accumulate_refuses_totals_of_the_wrong_shape():
    x = rows(1, 4, 2, 8)
    n = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="gram: expected a contiguous torch.float64 tensor of shape"):
        te.accumulate_prep_gemm(n, n.clone(), torch.zeros(2, 8, dtype=torch.float64, device=DEVICE),
                                torch.zeros(2, 8, 8, dtype=torch.float64, device=DEVICE).mT.contiguous()[:, :4],
                                x)


# ------------------------------------------------------------- GPU compile, without a GPU
_COMPILE_SCRIPT = r"""
import json
import triton
from fastspec.covariance import triton_exact as E
from benchmarks.sass import compile_sm90, triton_cubin

ptrs = {"p_mask": "*u8", "p_rows": "*fp64", "p_sp": "*fp64", "p_cnt": "*i32", "p_Gp": "*fp64",
        "p_G": "*fp64", "p_s": "*fp64", "p_c": "*fp64", "p_n": "*i64", "p_rej": "*i64"}
# what a launch on a contiguous keys tensor and mask specializes: unit strides and row_step
# constant, pointers/sizes/strides multiples of 16 (S = 8 is not)
ONES = ("stride_xd", "stride_mt", "ROW_STEP")
DIV16 = ("p_x", "p_mask", "p_rows", "p_sp", "p_cnt", "p_Gp", "p_G", "p_s", "p_c", "p_n", "p_rej", "NC", "N", "Tk",
         "D", "RPS", "RPP", "KS", "stride_xb", "stride_xt", "stride_xs", "stride_mb")

def build(fn, dt, consts, num_warps, num_stages):
    return compile_sm90(fn, {"p_x": "*" + dt, **ptrs}, consts, num_warps, num_stages, ones=ONES, div16=DIV16)

def stats(k):
    res, kernel = triton_cubin(k.asm["cubin"])
    loop = min(kernel.loops, key=lambda lp: (lp.start, lp.end))  # the row loop
    return {"regs": res["registers"], "stack": res["stack"],
            "spill_ops": kernel.ops["LDL"] + kernel.ops["STL"], "loop": loop.size,
            "DMMA": loop.ops["DMMA"], "F2F": loop.ops["F2F"]}

out = {}
BD, BT, warps = E._prep_config(128)
out["prep"] = stats(build(E._prep_rows_kernel, "bf16", dict(HAS_MASK=True, ROWS64=False, BT=BT, BD=BD), warps, 3))
out["finish"] = stats(build(E._finish_kernel, "bf16", dict(BR=E.FINISH_BR, BK=E.FINISH_BK, ACC=False), 4, 3))
out["finish-acc"] = stats(build(E._finish_kernel, "bf16", dict(BR=E.FINISH_BR, BK=E.FINISH_BK, ACC=True), 4, 3))
if E._f64_dot_reason(triton.__version__) == "":  # Triton 3.6 would abort right here
    for D in (128, 64):
        BC, NT, BT, warps, split, rps = E._f64_config(8 * 2048, 8, D)
        consts = dict(HAS_MASK=True, ROWS64=False, HALVES=NT, BT=BT, BC=BC)
        out["f64", D] = stats(build(E._gram_f64_kernel, "bf16", consts, warps, 1))
        out["f64", D]["BT"], out["f64", D]["warps"] = BT, warps
    out["f64", "fp32"] = stats(build(E._gram_f64_kernel, "fp32", dict(HAS_MASK=True, ROWS64=False, HALVES=2,
                                                                       BT=16, BC=64), 8, 1))
    out["f64", "tiled"] = stats(build(E._gram_f64_tiled_kernel, "bf16", dict(HAS_MASK=True, ROWS64=False, NT=4,
                                                                            BT=32, BC=64), 4, 1))
print(json.dumps({str(k): v for k, v in out.items()}))
"""


# slow: the exact route's kernels compiled for sm_90 (~9 s on 2 cores, with a cold Triton cache); the full tier runs it,
# and CI's gpu-stack stage under the GPU machines' Triton (.ci/run GPU_STACK_FULL)
@pytest.mark.slow
@pytest.mark.sm90
def test_kernels_compile_for_sm90_without_a_gpu():
    """Compile for sm_90 with Triton's bundled ptxas (the interpreter misses compile errors):
    the prep and finish kernels on any Triton; the float64 dot kernels only where
    :func:`triton_f64_status` allows it (Triton 3.6 aborts the process compiling them), where
    their row loop must run on DMMA without spilling."""
    out = compiled_for_sm90(_COMPILE_SCRIPT)
    for name in ("prep", "finish", "finish-acc"):
        assert out[name]["spill_ops"] == 0 and out[name]["stack"] == 0, (name, out[name])
    # the prep kernel: two 8-warp programs per SM (<= 128 registers), one float64 widening per
    # element (32 rows x 128 columns / 256 threads = 16 per thread per block)
    assert out["prep"]["regs"] <= 128 and out["prep"]["F2F"] == 16, out["prep"]
    reason = te._f64_dot_reason(triton.__version__)
    if reason:
        pytest.skip(f"float64 dot kernels not compiled: {reason}")
    keys = out[str(("f64", 128))]
    # three 64² accumulators over 16-row blocks, 8 warps: 3·(64²/64)·(16/4) / 8 = 96 DMMA
    # (m8n8k4) per warp per block, no spills (measured on Triton 3.9: 244 registers, 417
    # instructions per iteration)
    assert keys["DMMA"] == 96 and keys["spill_ops"] == 0 and keys["stack"] == 0, keys
    assert keys["loop"] <= 8 * keys["DMMA"], keys  # issue stays under the DMMA time (8 cycles each)
    narrow = out[str(("f64", 64))]
    assert narrow["DMMA"] == 128 and narrow["spill_ops"] == 0, narrow  # 64²/64 · 32/4 / 4 warps
    for name in ("fp32", "tiled"):
        got = out[str(("f64", name))]
        assert got["DMMA"] > 0 and got["spill_ops"] == 0 and got["stack"] == 0, (name, got)
