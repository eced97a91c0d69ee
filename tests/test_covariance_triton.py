"""Triton covariance-update kernels vs the plain-torch reference and fp64 ground truth (docs/accumulators.md).

Every kernel test builds its tensors on ``DEVICE``: CUDA when available (the compiled kernels),
else CPU, where the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so sizes stay small.
The tolerance rule (``RATIO`` × torch's error against fp64, plus ``FLOOR``) and the helpers are
tests/_cov_triton.py's; the launch-setting candidates the GPU kit races are checked in
tests/test_covariance_triton_configs.py.
"""
from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton  # the GPU kit runs these on CUDA (benchmarks/gpu_run.py)

from _cov_triton import (  # noqa: E402, F401 - two autouse fixtures among them
    DEVICE,
    DT_ID,
    DTYPES,
    FLOOR,
    RATIO,
    _fp32_torch_yardstick,
    _nan_filled_buffers,
    _stats,
    check_against_fp64,
)
from _sm90 import compiled_for_sm90  # noqa: E402

import fastspec  # noqa: E402
from fastspec.covariance import triton_kernels as tri  # noqa: E402
from fastspec.covariance import triton_update as tu  # noqa: E402
from fastspec.covariance.reference import covariance_partials_reference as reference  # noqa: E402
from fastspec.covariance.triton_update import covariance_partials_triton as kernel  # noqa: E402


# ------------------------------------------------------------------ dtypes, widths, layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("center", [True, False], ids=["centered", "raw"])
def test_head_widths(dtype, D, center):
    x = torch.randn(2, 24, 2, D, device=DEVICE).to(dtype)  # [B, T, S, D], 48 rows per site
    check_against_fp64(x, center=center)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_ID.get)
def test_wide_ffn_tiles(dtype):
    # D = 1000: 8×8 tiles of 128 with a ragged last tile, upper triangle + mirrored lower; the
    # check's exact-symmetry assert covers the diagonal tiles (fp32: BLAS order under the
    # interpreter; bf16: the split's hi·lo vs lo·hi rounding)
    x = torch.randn(1, 40, 1, 1000, device=DEVICE) + torch.linspace(-3, 3, 1000, device=DEVICE)
    check_against_fp64(x.to(dtype), center=True)


def test_hf_keys_layout_no_copy():
    # keys [B, H, T, D] as HF returns them after RoPE, seen as a [B, T, H, D] view
    keys = torch.randn(2, 4, 20, 64, dtype=torch.bfloat16, device=DEVICE)
    x = keys.transpose(1, 2)
    assert not x.is_contiguous()
    got = check_against_fp64(x, center=False)
    flat = keys.double().permute(1, 0, 2, 3).reshape(4, -1, 64)  # [H, N, D]
    expected = flat.transpose(1, 2) @ flat
    assert ((got.G.double() - expected).norm() / expected.norm()).item() < 1e-6


@pytest.mark.parametrize("layout", ["BTHD", "ND", "strided_D", "channel_slice", "expanded"])
def test_layouts_and_strides(layout):
    if layout == "BTHD":
        x = torch.randn(2, 16, 3, 32, device=DEVICE)
    elif layout == "ND":
        x = torch.randn(50, 48, device=DEVICE)[None, :, None, :]  # [N, D] -> [1, N, 1, D]
    elif layout == "strided_D":
        x = torch.randn(2, 16, 2, 64, device=DEVICE)[..., ::2]  # stride 2 along D
    elif layout == "channel_slice":
        x = torch.randn(2, 16, 2, 100, device=DEVICE)[..., 10:58]  # offset storage, stride 100 rows
    else:
        x = torch.randn(1, 16, 1, 32, device=DEVICE).expand(3, 16, 2, 32)  # zero strides over B and S
    check_against_fp64(x.to(torch.float16), center=True)


def test_covariance_backends_agree_on_hf_keys():
    keys = torch.randn(2, 4, 30, 32, dtype=torch.float16, device=DEVICE) * 3 + 1
    covs = {}
    for backend in ("torch", "triton"):
        for track_mean in (True, False):
            cov = fastspec.Covariance((4, 32), backend=backend, track_mean=track_mean)
            cov.update(keys.transpose(1, 2))
            covs[backend, track_mean] = cov
    torch.testing.assert_close(covs["triton", True].covariance(), covs["torch", True].covariance(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(covs["triton", False].gram(), covs["torch", False].gram(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(covs["triton", True].n, covs["torch", True].n)


# ------------------------------------------------------------------------ masks, sampling
@pytest.mark.parametrize("D", [48, 200], ids=["fused", "tiled"])
@pytest.mark.parametrize("row_step", [1, 3])
def test_mask_and_row_step(D, row_step):
    x = torch.randn(3, 40, 2, D, device=DEVICE)
    mask = torch.rand(3, 40, device=DEVICE) > 0.3
    mask[1] = False  # a fully padded sequence
    mask[2, :25] = False  # left padding
    got = check_against_fp64(x, mask, row_step, center=True, split=2)
    assert got.n.tolist() == [int(mask[:, ::row_step].sum())] * 2


def test_mask_accepts_int_attention_mask():
    x = torch.randn(2, 20, 1, 32, device=DEVICE)
    am = (torch.rand(2, 20, device=DEVICE) > 0.5).long()
    cov = fastspec.Covariance(32, backend="triton").update(x[:, :, 0], mask=am)
    assert cov.n.item() == int(am.sum())


# ------------------------------------------------------------------------ accuracy edges
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("D", [64, 200])
def test_large_mean(dtype, D):
    # mean/std = 1e3: G − s sᵀ/n in fp32 cancels every digit; centering before products must not
    x = (torch.randn(2, 32, 2, D, device=DEVICE) + 1e3 * (1 + torch.rand(D, device=DEVICE))).to(dtype)
    check_against_fp64(x, center=True, split=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_means_near_the_spread(dtype):
    # the benchmark's FFN data: means -4..4, spreads 0.05..2, so many channels have |mean| ~ 2σ,
    # where leaving x unshifted makes Σxxᵀ ~5× the centered sum and loses its low bits
    D = 128
    x = torch.randn(1, 1024, 1, D, device=DEVICE) * torch.linspace(0.05, 2, D, device=DEVICE) \
        + torch.linspace(-4, 4, D, device=DEVICE)
    check_against_fp64(x.to(dtype), center=True, split=1)


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("D", [64, 200], ids=["fused", "tiled"])
@pytest.mark.parametrize("center", [True, False], ids=["centered", "raw"])
def test_the_block_accumulations_compute_the_same_sums(acc, D, center):
    # where a block's products are summed (_gram_dot's ACC: 1 = the split's corrections, 2 = the
    # whole block, in a per-block tile; 2 is the split's default, benchmarks/gpu_diag.py sweeps
    # all): each mode must give the partials, within the same fp64-tied bound, split and tiled
    x = torch.randn(1, 96, 2, D, device=DEVICE) * torch.linspace(0.1, 2, D, device=DEVICE) \
        + torch.linspace(-3, 3, D, device=DEVICE)
    check_against_fp64(x.to(torch.float16), center=center, split=2, acc=acc)


@pytest.mark.parametrize("D, blocks", [(64, 7), (200, 5)], ids=["fused", "tiled"])
def test_the_uncentred_block_tile_is_flushed_in_the_loop_and_after_it(D, blocks):
    # ACC=2 without the split: the tile is added to G every FLUSH_ROWS rows and once more after
    # the loop; one program over 7 blocks of 32 rows (fused: flushed after the 4th, 3 left) or
    # 5 of 64 (tiled: after the 2nd and 4th, 1 left). A flush that skipped its reset would count
    # rows twice, a missing last flush would drop them
    cfg = tu.launch_config(1, 1, D, torch.device(DEVICE), 2)
    rows = blocks * cfg.BT
    assert tri.FLUSH_ROWS.value // cfg.BT >= 2 and rows > tri.FLUSH_ROWS.value
    assert rows % tri.FLUSH_ROWS.value != 0
    x = torch.randn(1, rows, 1, D, device=DEVICE) * 3 + torch.linspace(-5, 40, D, device=DEVICE)
    got = check_against_fp64(x.to(torch.float16), center=False, split=1)
    assert got.n.tolist() == [rows]


def test_the_launcher_passes_the_measured_accumulation_and_pipeline_depth(monkeypatch):
    # what the H100 runs fixed (triton_update.block_accumulation, pipeline_stages): every
    # tensor-core launch (16-bit input, centred split or not) sums its products in a block tile
    # (ACC=2), fp32 input (FMA dots) accumulates in the dots; no launch asks for the 4 stages
    # that raced, nor for more stages than its loop has row blocks
    launches = []
    real = tu._cov_partials_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tu, "_cov_partials_kernel", Spy())
    x = torch.randn(2, 24, 2, 64, device=DEVICE) * 2 + 3
    cases = [(torch.float16, True, 2, True), (torch.float16, False, 2, False), (torch.float32, True, 0, False),
             (torch.float32, False, 0, False)]
    for dtype, center, acc, split in cases:
        check_against_fp64(x.to(dtype), center=center)
        kw = launches[-1]
        assert (kw["ACC"], kw["SPLIT_BF16"]) == (acc, split)
        assert kw["num_stages"] <= min(tu.STAGES, triton.cdiv(2 * 24, kw["BT"]))
    assert tu.STAGES == 3
    assert launches[1]["num_stages"] == 2  # 3 wanted; the one program has 2 blocks
    assert tu.launch_config(4096, 1, 128, torch.device(DEVICE), 2).num_stages == 3


def test_a_launch_configuration_can_be_given_and_acc_is_checked():
    x = torch.randn(2, 40, 2, 64, device=DEVICE).to(torch.float16)
    cfg = tu.launch_config(80, 2, 64, torch.device(DEVICE), 2, None)._replace(BT=16, num_warps=4,
                                                                              rows_per_split=48, split=2)
    got = check_against_fp64(x, center=False, config=cfg)
    assert got.n.tolist() == [80, 80]
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="acc"):
            kernel(x, center=False, acc=bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DT_ID.get)
def test_outlier_rows_stay_exact_in_the_split(dtype):
    # rows 200× the rest (activation outliers, off the center's sample of every 8th row here):
    # x − c must still fit the 16-bit hi + lo split (fp16 keeps 11 bits: c's grid matters)
    D = 64
    x = torch.randn(1, 512, 1, D, device=DEVICE) + torch.logspace(-4, 3, D, base=2, device=DEVICE)
    x[:, 5::128] *= 200
    check_against_fp64(x.to(dtype), center=True, split=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DT_ID.get)
def test_centered_split_covers_inexact_differences(dtype):
    # mean 2.5·std: the kernel shifts by c, and x near 0 makes x − c need more than 8 bits, so
    # the bf16 hi + lo split (not hi alone) carries the products
    x = (torch.randn(2, 64, 2, 64, device=DEVICE) + 2.5).to(dtype)
    got = check_against_fp64(x, center=True)
    d = x.float().reshape(-1, 2, 64) - got.c
    assert (got.c != 0).float().mean() > 0.5
    assert (d - d.bfloat16().float() != 0).float().mean() > 0.01


def test_large_mean_streamed_matches_fp64():
    D = 64
    f64 = dict(dtype=torch.float64, device=DEVICE)
    x = torch.randn(300, D, **f64) * 0.5 + 1e3 * (1 + torch.rand(D, **f64))
    cov = fastspec.Covariance(D, backend="triton")
    for chunk in x.float().split(70):
        cov.update(chunk)
    truth = torch.cov(x.float().double().T)
    err = ((cov.covariance() - truth).norm() / truth.norm()).item()
    ref = fastspec.Covariance(D, backend="torch")
    for chunk in x.float().split(70):
        ref.update(chunk)
    ref_err = ((ref.covariance() - truth).norm() / truth.norm()).item()
    assert err <= RATIO * ref_err + FLOOR


def test_empty_input():
    x = torch.randn(2, 0, 3, 32, device=DEVICE)
    p = kernel(x)
    assert p.n.tolist() == [0, 0, 0] and p.rejected.tolist() == [0, 0, 0]
    assert p.G.shape == (3, 32, 32) and not p.G.any() and not p.s.any()
    masked_out = kernel(torch.randn(2, 5, 1, 32, device=DEVICE), torch.zeros(2, 5, dtype=torch.bool, device=DEVICE))
    assert masked_out.n.tolist() == [0] and not masked_out.G.any() and not masked_out.s.any()


@pytest.mark.parametrize("D", [32, 300])
def test_one_row(D):
    # the centered sum of one row is exactly 0, so there is no relative error to compare
    x = torch.randn(1, 1, 2, D, device=DEVICE) + 100
    p = kernel(x)
    n, mean, m2 = _stats(p, center=True)
    assert n.tolist() == [1, 1] and p.rejected.tolist() == [0, 0]
    torch.testing.assert_close(mean, x[0, 0].double(), rtol=0, atol=1e-5)
    assert m2.abs().max() < 1e-6
    raw = kernel(x, center=False)
    torch.testing.assert_close(raw.G, x[0, 0, :, :, None] * x[0, 0, :, None, :], rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf − inf
@pytest.mark.parametrize("D", [40, 200], ids=["fused", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_ID.get)
def test_nan_inf_rows_are_counted_not_merged(D, dtype):
    x = torch.randn(2, 30, 3, D, device=DEVICE).to(dtype)
    x[0, 3, 0, 5] = float("nan")
    x[1, 7, 0, D - 1] = float("inf")
    x[1, 8, 2, 0] = float("-inf")
    x[0, 9, 1, :] = float("nan")  # masked out below: neither counted nor rejected
    mask = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
    mask[0, 9] = False
    got = check_against_fp64(x, mask, center=True, split=3)
    assert got.rejected.tolist() == [2, 0, 1]
    assert got.n.tolist() == [57, 59, 58]
    assert torch.isfinite(got.G).all() and torch.isfinite(got.s).all()
    cov = fastspec.Covariance((3, D), backend="triton").update(x, mask)
    assert cov.rejected.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="NaN/Inf"):
        cov.check_finite()


# ------------------------------------- fused fast path: one finiteness test per program
# The fused kernel merges every kept row without testing it, and a program whose Σd comes out
# non-finite redoes its rows with the exact per-row test. Rejecting a row must then give the
# same partials, bit for bit, as masking it out (same rows merged, same order), and the
# programs of the other splits never see the fallback.
def _same_partials(a, b, fields=("n", "c", "s", "G")):
    for f in fields:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("center", [True, False], ids=["centered", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_ID.get)
def test_fallback_rejects_exactly_what_masking_removes(dtype, center):
    # 4 row splits of 32 rows; bad rows only in split 1 of site 0 (and split 3 of site 2),
    # site 1 clean: +Inf and -Inf in one column (Σ = NaN, from two row slots), and a NaN
    x = torch.randn(2, 64, 3, 32, device=DEVICE).to(dtype)
    bad = [(0, 33, 0, 4, float("inf")), (0, 40, 0, 4, float("-inf")), (0, 50, 0, 7, float("nan")),
           (1, 40, 2, 31, float("-inf"))]
    for b, t, s_, d, v in bad:
        x[b, t, s_, d] = v
    mask = torch.ones(2, 64, dtype=torch.bool, device=DEVICE)
    mask[1, 3] = False
    got = kernel(x, mask, 1, center, split=4)
    assert got.rejected.tolist() == [3, 0, 1]
    assert got.n.tolist() == [124, 127, 126]
    assert torch.isfinite(got.G).all() and torch.isfinite(got.s).all()
    # those (b, t) rows made non-finite at every site vs masked out: bitwise equal partials
    masked = mask.clone()
    x2 = x.clone()
    for b, t, _, _, _ in bad:
        masked[b, t] = False
        x2[b, t, :, 0] = float("nan")
    both = kernel(x2, mask, 1, center, split=4)
    assert both.rejected.tolist() == [4, 4, 4]
    ref = kernel(x2, masked, 1, center, split=4)
    assert ref.rejected.tolist() == [0, 0, 0]
    _same_partials(both, ref)
    again = kernel(x2, mask, 1, center, split=4)
    _same_partials(again, both, ("n", "c", "s", "G", "rejected"))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fallback_inf_minus_inf_in_one_row_slot():
    # rows 0 and 32 of one split share the kernel's row slot (BT = 32): Σ over the slot is
    # inf − inf = NaN before the final reduction; both rows must be rejected, the rest kept
    x = torch.randn(1, 96, 1, 64, device=DEVICE)
    x[0, 0, 0, 9] = float("inf")
    x[0, 32, 0, 9] = float("-inf")
    got = check_against_fp64(x, None, 1, center=False, split=1)
    assert got.rejected.tolist() == [2] and got.n.tolist() == [94]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_finite_rows_whose_sums_overflow_stay_valid():
    # every row finite, but Σx (and x²) overflow fp32: the fast pass sees a non-finite Σd and
    # reruns exactly; no row may be rejected, and the sums are what fp32 makes of them
    x = torch.randn(1, 40, 2, 32, device=DEVICE)
    x[0, 3, 0, 5] = 3e38
    x[0, 17, 0, 5] = 3e38
    x[0, 20, 1, :] = 2e20  # finite x, x² = inf
    got = kernel(x, None, 1, center=False, split=2)
    ref = reference(x, None, 1, center=False)
    assert got.n.tolist() == [40, 40] and got.rejected.tolist() == [0, 0]
    assert got.n.tolist() == ref.n.tolist() and got.rejected.tolist() == ref.rejected.tolist()
    assert torch.isinf(got.s[0, 5]) and torch.isfinite(got.s[1]).all()
    assert torch.isinf(got.G[1, 3, 3]) and torch.isinf(got.G[0, 5, 5])
    # (near fp32's max, G's diagonal tile average (G + Gᵀ)/2 may overflow where torch's does not)
    fine = torch.isfinite(ref.G) & torch.isfinite(got.G)
    assert fine[0, :5, :5].all()
    torch.testing.assert_close(got.G[fine], ref.G[fine], rtol=1e-5, atol=1e-3)


# ------------------------------------------------------------------- row indexing variants
# Rows are x[b, t·row_step] for r = b·Tk + t. With Tk >= BT (32 rows per block) the kernel
# carries the block's first (b, t) and lets each row wrap into the next sequence at most
# once; otherwise it divides small int32s per row. Both must walk the same rows, so they give
# bitwise equal partials; blocks and splits start mid-sequence whenever Tk is not a multiple
# of 32.
@pytest.mark.parametrize("T,row_step", [(5, 1), (1, 1), (32, 1), (45, 1), (100, 3), (200, 6), (90, 7)],
                         ids=["Tk5", "Tk1", "Tk32", "Tk45", "Tk34-step3", "Tk34-step6", "Tk13-step7"])
@pytest.mark.parametrize("layout", ["contiguous", "keys_view", "sliced"])
def test_row_walk_variants(monkeypatch, T, row_step, layout):
    if layout == "contiguous":
        x = torch.randn(3, T, 2, 64, device=DEVICE)
    elif layout == "keys_view":  # [B, H, T, D] seen as [B, T, H, D]
        x = torch.randn(3, 2, T, 64, device=DEVICE).transpose(1, 2)
    else:  # every other sequence, a channel window, odd strides everywhere
        x = torch.randn(6, T + 3, 3, 70, device=DEVICE)[::2, 1:T + 1, 1:, 3:67]
    x = x.to(torch.bfloat16)
    mask = torch.rand(3, T, device=DEVICE) > 0.25
    mask[1, : T // 2] = False
    for split in (1, 3):
        carried = check_against_fp64(x, mask, row_step, center=True, split=split)
        raw = kernel(x, mask, row_step, False, split=split)
        monkeypatch.setattr(tu, "_ROW_CARRY", False)
        general = kernel(x, mask, row_step, True, split=split)
        general_raw = kernel(x, mask, row_step, False, split=split)
        monkeypatch.setattr(tu, "_ROW_CARRY", True)
        _same_partials(carried, general, ("n", "c", "s", "G", "rejected"))
        _same_partials(raw, general_raw, ("n", "c", "s", "G", "rejected"))
        assert carried.n.tolist() == [int(mask[:, ::row_step].sum())] * 2


def test_launch_config_one_wave_and_bounded_workspace(monkeypatch):
    monkeypatch.setattr(tu, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    keys = tu.launch_config(8 * 2048, 8, 128, cuda, 2)  # centred or not: the same tiling
    assert (keys.BT, keys.num_warps, keys.num_stages) == (32, 8, 3)  # 4 stages raced on an H100
    assert keys.split * 8 <= 132 and keys.split == 16 and keys.rows_per_split == 1024
    # the fp32 workspace stays under a quarter of the bytes of x it summarizes
    assert keys.split * 128 * 128 * 4 <= 8 * 2048 * 128 * 2 / 4
    # never more load-pipeline stages than the shortest program's row blocks: [2, 24, 2, 128]
    # raw is 2 blocks of 32 rows in one program
    assert tu.launch_config(2 * 24, 2, 128, cuda, 2).num_stages == 2
    assert tu.pipeline_stages(4, 16384, 1024, 16, 32) == 4
    assert tu.pipeline_stages(4, 3 * 32, 96, 1, 32) == 3
    assert tu.pipeline_stages(3, 1025, 1024, 2, 32) == 1  # the last program has one row
    assert tu.pipeline_stages(4, 0, 32, 1, 32) == 1
    for S in (1, 5, 12, 40, 200):  # never a partial second wave
        cfg = tu.launch_config(1 << 20, S, 128, cuda, 2)
        assert S * cfg.split <= max(132, S)


# --------------------------------------------------------------- streaming, determinism
def test_many_small_updates_equal_one_big():
    x = torch.randn(2, 60, 2, 64, dtype=torch.bfloat16, device=DEVICE) + 5
    big = fastspec.Covariance((2, 64), backend="triton").update(x)
    small = fastspec.Covariance((2, 64), backend="triton")
    for t0 in range(0, 60, 7):
        small.update(x[:, t0:t0 + 7])
    C = torch.stack([torch.cov(x[:, :, s].reshape(-1, 64).double().T) for s in range(2)])
    for cov in (big, small):
        assert ((cov.covariance() - C).norm() / C.norm()).item() < 1e-6
    torch.testing.assert_close(small.mean, big.mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("D,split", [(64, 3), (300, 2)], ids=["fused", "tiled"])
def test_bitwise_deterministic(D, split):
    x = torch.randn(2, 50, 2, D, dtype=torch.float16, device=DEVICE) * 10 + 3
    mask = torch.rand(2, 50, device=DEVICE) > 0.2
    a = kernel(x, mask, 1, True, split=split)
    b = kernel(x, mask, 1, True, split=split)
    for f in a._fields:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_row_splits_agree():
    x = torch.randn(1, 300, 2, 32, device=DEVICE)
    one = kernel(x, split=1)
    many = kernel(x, split=5)
    assert tu.launch_config(300, 2, 32, x.device, 4, split=5).split > 1
    n1, m1, c1 = _stats(one, True)
    n5, m5, c5 = _stats(many, True)
    assert torch.equal(n1, n5)
    torch.testing.assert_close(c5, c1, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(m5, m1, rtol=0, atol=1e-6)


# --------------------------------------------------------------------- dispatch and errors
def test_auto_selects_triton_on_cuda_and_torch_elsewhere(monkeypatch):
    from fastspec.covariance import policy

    cpu = torch.zeros(1)
    assert policy.update_plan(policy.UpdateSettings("auto", "auto"), True, cpu).backend == "torch"
    assert policy.update_plan(policy.UpdateSettings("auto", "triton"), True, cpu).backend == "triton"
    assert policy.update_plan(policy.UpdateSettings("auto", "triton"), False, cpu) == (torch.float32, "triton")  # explicit triton: fp32
    # update_plan looks only at .is_cuda/.dtype/.device; a stand-in lets the CPU suite check the CUDA branch
    monkeypatch.setattr(policy, "full_rate_fp64", lambda device: False)
    cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.float16, device=torch.device("cuda"))
    assert policy.update_plan(policy.UpdateSettings("auto", "auto"), False, cuda).backend == "triton"


def test_triton_backend_reaches_the_kernel(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tu, "covariance_partials_triton", spy)
    fastspec.Covariance((2, 32), backend="triton").update(torch.randn(2, 10, 2, 32, device=DEVICE))
    assert calls == [(2, 10, 2, 32)]


def test_cpu_tensor_without_the_interpreter_is_refused(monkeypatch):
    # what a GPU machine (TRITON_INTERPRET unset) says to backend="triton" on CPU data
    monkeypatch.setattr(tu, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="^x: the Triton covariance kernels need a CUDA tensor"):
        kernel(torch.randn(1, 4, 1, 32))


def test_float64_is_delegated_to_the_reference():
    x = torch.randn(1, 10, 1, 32, dtype=torch.float64, device=DEVICE)
    p = kernel(x)
    assert p.G.dtype == torch.float64
    torch.testing.assert_close(p.G, reference(x).G, rtol=0, atol=0)


@pytest.mark.parametrize("call,match", [
    (lambda: kernel(torch.randn(10, 32, device=DEVICE)), "x: expected a 4-D"),
    (lambda: kernel(torch.ones(1, 2, 1, 32, dtype=torch.int32, device=DEVICE)), "x: expected bf16"),
    (lambda: kernel(torch.randn(1, 2, 1, 32, device=DEVICE), torch.ones(1, 3, dtype=torch.bool, device=DEVICE)),
     "mask: expected"),
    (lambda: kernel(torch.randn(1, 2, 1, 32, device=DEVICE), None, 0), "row_step"),
    (lambda: kernel(torch.randn(1, 2, 1, 32, device=DEVICE), split=0), "split"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------- GPU compile, without a GPU
_COMPILE_SCRIPT = r"""
import json
import torch
from fastspec.covariance import triton_kernels as K
from fastspec.covariance import triton_update as tu
from benchmarks.sass import compile_sm90, triton_cubin

ptrs = {"p_mask": "*u8", "p_status": "*i8", "p_c": "*fp32", "p_G": "*fp32", "p_s": "*fp32",
        "p_n": "*i32", "p_rej": "*i32"}
# what the launcher's specialization gives a contiguous keys tensor and mask: unit strides and
# row_step are constants, pointers/sizes/strides multiples of 16
ONES = ("stride_xd", "stride_mt", "ROW_STEP")
DIV16 = ("p_x", "p_mask", "p_status", "p_c", "p_G", "p_s", "p_n", "p_rej", "N", "Tk", "D", "RPS",
         "stride_xb", "stride_xt", "stride_xs", "stride_mb")

def build(fn, types, consts, num_warps, num_stages=3, specialize=False):
    spec = dict(ones=ONES, div16=DIV16) if specialize else {}
    return compile_sm90(fn, types, consts, num_warps, num_stages, **spec)

def sass_stats(cubin):
    # registers/stack from the cubin's resource usage; ops of the first loop (the fast row loop)
    # from the disassembly (benchmarks/sass.py: a loop runs from a backward branch's target to
    # the branch)
    res, kernel = triton_cubin(cubin)
    loop = min(kernel.loops, key=lambda lp: (lp.start, lp.end))
    return {"regs": res["registers"], "stack": res["stack"],
            "spill_ops": kernel.ops["LDL"] + kernel.ops["STL"],
            "loop": loop.size, "BAR": loop.ops["BAR"], "SHFL": loop.ops["SHFL"], "HGMMA": loop.ops["HGMMA"],
            "LDGSTS": loop.ops["LDGSTS"], "CALL": loop.ops["CALL"], "FADD": loop.ops["FADD"],
            "div": loop.ops["I2F"] + loop.ops["MUFU"]
                   + sum(n for op, n in loop.full_ops.items() if op.startswith("IMAD.HI"))}

out = {}
for dt, center, D, ntile in [("bf16", True, 128, 1), ("fp16", False, 2048, 16), ("fp32", True, 128, 1)]:
    consts = dict(HAS_MASK=True, FUSED_STATUS=ntile == 1, CENTER=center, SPLIT_BF16=center and dt != "fp32",
                  UPCAST=False, PRECISION="ieee", ACC=tu.block_accumulation(dt != "fp32"), NTILE=ntile, TK_GE_BT=True, BT=32 if dt != "fp32" else 16,
                  BD=128)
    code = build(K._cov_partials_kernel, {"p_x": "*" + dt, **ptrs}, consts, 8).asm["ptx"]
    out[dt] = {"wgmma": code.count("wgmma.mma_async"), "tf32": code.count("tf32")}
# the keys kernel as the launcher configures it (bf16, D = 128, fused), both conventions
for center in (False, True):
    cfg = tu.launch_config(8 * 2048, 8, 128, torch.device("cpu"), 2, split=16)
    consts = dict(HAS_MASK=True, FUSED_STATUS=True, CENTER=center, SPLIT_BF16=center, UPCAST=False,
                  PRECISION="ieee", ACC=tu.block_accumulation(True), NTILE=cfg.NTILE, TK_GE_BT=True,
                  BT=cfg.BT, BD=cfg.BD)
    k = build(K._cov_partials_kernel, {"p_x": "*bf16", **ptrs}, consts, cfg.num_warps, cfg.num_stages, True)
    out["keys", center] = sass_stats(k.asm["cubin"])
# every raced candidate that runs _cov_partials_kernel (triton_configs.py), as the launcher
# specializes it: keys both conventions, the FFN kernel centred (its eig sites)
from fastspec.covariance import triton_configs as TC
for cand in (c for cs in TC.CANDIDATES.values() for c in cs if not c.presplit):
    keys = cand.kernel == "keys"
    for center in ((False, True) if keys else (True,)):
        consts = dict(HAS_MASK=True, FUSED_STATUS=keys, CENTER=center, SPLIT_BF16=center, UPCAST=False,
                      PRECISION="ieee", ACC=2, NTILE=1 if keys else 64, TK_GE_BT=True, BT=cand.BT, BD=128,
                      LOLO=cand.lolo, UNROLL=1 if center else cand.unroll)  # as the launcher passes it
        k = build(K._cov_partials_kernel, {"p_x": "*bf16", **ptrs}, consts, cand.num_warps, cand.num_stages, True)
        out["cand", cand.name, center] = sass_stats(k.asm["cubin"])
build(K._center_kernel, {"p_x": "*bf16", **ptrs}, dict(HAS_MASK=True, ROUND_TO_INPUT=True, NC=64, BD=64), 4)
build(K._row_status_kernel, {"p_x": "*bf16", **ptrs}, dict(HAS_MASK=True, BT=64, BD=128), 8)
fin = {"p_Gw": "*fp32", "p_sw": "*fp32", "p_cnt": "*i32", "p_status": "*i8", "p_G": "*fp32", "p_s": "*fp32",
       "p_c": "*fp32", "p_nr": "*i64"}
for from_status in (False, True):
    k = build(K._finish_kernel, fin, dict(FROM_STATUS=from_status, ZERO_C=True, BR=tu.FINISH_BR, BK=tu.FINISH_BK,
                                          BN=tu.FINISH_BN), 4)
    out["finish", from_status] = sass_stats(k.asm["cubin"])
print(json.dumps({str(k): v for k, v in out.items()}))
"""

# per 32-row iteration of the fused bf16 D = 128 row loop, per warp, on sm_90 (what Triton 3.6
# and 3.9 give, with some room): the design envelope in triton_kernels.py is built on these
KEYS_LOOP_BOUNDS = {
    # uncentred with its block tile (ACC=2, flushed every 128 rows by a select, no branch):
    # measured 452 / 451 (3.9 / 3.6), the tile's 64 adds and 2 x 64 selects every block;
    # 2 barriers (388 when the flush was an `if` every 4th block, which raced on an H100;
    # 184 when the dot accumulated into G, ACC=0)
    False: dict(loop=480, BAR=2, SHFL=0),
    # centred with its block tile (ACC=2): measured 502 (3.9) / 484 (3.6), 7 / 4 barriers
    # (414 / 399 when the dots accumulated into G, ACC=0)
    True: dict(loop=540, BAR=8, SHFL=0),
}


# candidates that keep a few spills on sm_90, with room: (name, centred) -> (stack bytes, spill
# instructions). Measured (Triton 3.9 / 3.6): the FFN kernel centred, 64-row blocks 16 B, 10 ops
# / none; 32-row blocks at 3 stages none / 16 B, 6 ops, at 4 stages 16 B, 8 ops / 8 B, 2 ops;
# the centred keys loop at 4 stages 24 B, 6 ops / 32 B, 8 ops; the uncentred one unrolled by 2
# at 3 stages 16 B, 10 ops / none. Every other candidate spills nothing under either
KNOWN_SPILLS = {("f64w8s3", True): (32, 24), ("f32w8s3", True): (32, 16), ("f32w8s4", True): (32, 16),
                ("k32w8s4", True): (48, 16), ("k32w8s3-u2", False): (32, 16)}


# slow: every kernel and candidate compiled for sm_90 (~30 s on 2 cores, with a cold Triton cache);
# the full tier runs it, and CI's gpu-stack stage under the GPU machines' Triton (.ci/run GPU_STACK_FULL)
@pytest.mark.slow
@pytest.mark.sm90
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs kernels as Python and misses compile errors (e.g. return types of
    constexpr-dead branches): compile every kernel for sm_90 with Triton's bundled ptxas.
    Also pins the precision (bf16 products on tensor cores, fp32 never through TF32) and the
    cost of the keys kernel's row loop in SASS: no spills, loads software-pipelined
    (cp.async), no per-row division or cross-thread reduction, bounded instructions/barriers."""
    out = compiled_for_sm90(_COMPILE_SCRIPT)
    assert out["bf16"]["wgmma"] > 0 and out["fp16"]["wgmma"] > 0
    assert out["fp32"]["wgmma"] == 0 and out["fp32"]["tf32"] == 0
    for center, bound in KEYS_LOOP_BOUNDS.items():
        got = out[str(("keys", center))]
        assert got["spill_ops"] == 0 and got["stack"] == 0, got
        assert got["regs"] <= 255, got
        assert got["HGMMA"] == (8 if center else 2), got  # 2 k-steps of 16 rows (x4: hi/lo split)
        # the block tile's fp32 add into G is in the loop (64 per thread, beside the 16 of Σd):
        # Triton folds `G + dot(a, b)` back into the dot when the tile starts from zero
        assert got["FADD"] >= 64 + 16, got
        assert got["LDGSTS"] > 0, got  # x arrives through the cp.async pipeline
        assert got["CALL"] == 0 and got["div"] == 0, got  # no per-row // or %
        assert got["loop"] <= bound["loop"], got
        assert got["BAR"] <= bound["BAR"] and got["SHFL"] <= bound["SHFL"], got
    for from_status in (False, True):  # the split sum: BK splits' loads in flight, no spills
        got = out[str(("finish", from_status))]
        assert got["stack"] == 0 and got["spill_ops"] == 0 and got["regs"] <= 128, got
    # the candidates the GPU kit races (triton_configs.py): none spills more than KNOWN_SPILLS
    # says (16 warps, 4 warps or 64-row blocks of keys spilled hundreds: not candidates)
    from fastspec.covariance import triton_configs as tcfg_

    for cand in (c for cs in tcfg_.CANDIDATES.values() for c in cs if not c.presplit):
        for center in ((False, True) if cand.kernel == "keys" else (True,)):
            got = out[str(("cand", cand.name, center))]
            dots = (4 if cand.lolo else 3) * cand.BT // 16 if center else cand.BT // 16 * cand.unroll
            assert got["HGMMA"] == dots, (cand.name, got)
            assert got["LDGSTS"] > 0, (cand.name, got)
            stack, spills = KNOWN_SPILLS.get((cand.name, center), (0, 0))
            assert got["stack"] <= stack and got["spill_ops"] <= spills, (cand.name, center, got)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_auto_uses_triton(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(True)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tu, "covariance_partials_triton", spy)
    fastspec.Covariance((8, 128)).update(torch.randn(2, 64, 8, 128, device="cuda", dtype=torch.bfloat16))
    assert calls == [True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("shape", [(2, 256, 8, 128), (1, 512, 1, 2048), (2, 128, 4, 96)],
                         ids=["keys-B2-T256-H8-D128", "ffn-N512-D2048", "B2-T128-H4-D96"])
@pytest.mark.parametrize("center", [True, False], ids=["centered", "raw"])
def test_gpu_against_fp64(dtype, shape, center):
    x = (torch.randn(shape, device="cuda") * 2 + 100 * torch.rand(shape[-1], device="cuda")).to(dtype)
    mask = torch.rand(shape[:2], device="cuda") > 0.1
    # also asserts G exactly symmetric, here with the default row split (> 1 on a GPU: the
    # launcher's sum of the split workspaces must keep the kernel's symmetry)
    check_against_fp64(x, mask, 1, center)


@pytest.mark.gpu
def test_gpu_fp32_is_not_tf32():
    # TF32 keeps 10 mantissa bits: its relative error on G here is ~1e-5 (per-product 2^-11 over
    # 4096 rows), far over 4× torch's fp32 error (~1e-7; _fp32_torch_yardstick keeps torch fp32)
    x = torch.randn(1, 4096, 2, 128, device="cuda")
    check_against_fp64(x, None, 1, center=False)


@pytest.mark.gpu
def test_gpu_deterministic_and_graph_capturable():
    x = torch.randn(4, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    a, b = kernel(x), kernel(x)
    for f in a._fields:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel(x)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernel(x)
    g.replay()
    torch.cuda.synchronize()
    for f in a._fields:
        assert torch.equal(getattr(out, f), getattr(a, f)), f
