"""The pre-split wide-``D`` path (``triton_presplit.py``) against float64 ground truth.

``presplit_partials`` takes the centre ``c`` and the row status from the launcher's own kernels
(``_center_kernel``, ``_row_status_kernel``), so each test runs those first, then compares
``G = Σ d dᵀ`` and ``s = Σ d`` (``d = x − c`` over the valid rows) with the same sums in
float64. Tolerance, as in ``test_covariance_triton.py``: the kernel's error against fp64 is at
most ``RATIO`` × the error torch makes in float32 on the same rows, plus ``FLOOR``.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), with ``upcast`` (fp32
dots: the interpreter's bf16 dot is wrong); where there is a GPU the compiled kernels run.
"""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton  # the GPU kit runs these on CUDA (benchmarks/gpu_run.py)

from _sm90 import compiled_for_sm90

from fastspec.covariance import triton_kernels as tk
from fastspec.covariance import triton_presplit as tp

RATIO = 4.0
FLOOR = 8 * 2.0**-24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UPCAST = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the launcher's FFN setting (64-row blocks, 8 warps, 3 stages) and a short-block one
LAUNCH = {"BT": 64, "num_warps": 8, "num_stages": 3}
SHORT = {"BT": 32, "num_warps": 8, "num_stages": 4}


@pytest.fixture(autouse=True)
def _nan_filled_buffers(monkeypatch):
    """Every buffer the module allocates starts as NaN: an unwritten entry of G or s, or a
    workspace row the Gram loop reads before the pre-pass wrote it, cannot pass as 0."""
    made = []

    def empty(*shape, dtype=torch.float32, device=None):
        made.append((shape, dtype))
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(tp, "_empty", empty)
    return made


def _prepare(x, mask=None, row_step=1):
    """(N, Tk, common, c, status) as the launcher makes them for ``x: [B, T, S, D]``."""
    B, T, S, D = x.shape
    Tk = triton.cdiv(T, row_step)
    N = B * Tk
    if mask is not None:
        mask = mask.view(torch.uint8)
        smb, smt = mask.stride()
    else:
        mask, smb, smt = x, 0, 0
    sxb, sxt, sxs, sxd = x.stride()
    common = {"stride_xb": sxb, "stride_xt": sxt, "stride_xs": sxs, "stride_xd": sxd,
              "stride_mb": smb, "stride_mt": smt, "ROW_STEP": row_step, "HAS_MASK": mask is not x}
    c = torch.empty(S, D, dtype=torch.float32, device=x.device)
    status = torch.empty(S, N, dtype=torch.int8, device=x.device)
    if N:
        tk._center_kernel[(S,)](x, mask, c, N, Tk, D, **common, ROUND_TO_INPUT=True, NC=64, BD=64)
        tk._row_status_kernel[(triton.cdiv(N, 64), S)](x, mask, status, N, Tk, D, **common, BT=64, BD=128)
    return N, Tk, common, c, status


def _rows(x, row_step, dtype):
    """The sampled rows as [S, N, D]: row r = x[r // Tk, (r % Tk)·row_step]."""
    xs = x[:, ::row_step].to(dtype)
    return xs.reshape(-1, x.shape[2], x.shape[3]).transpose(0, 1)


def _sums(x, status, c, row_step, dtype):
    """(G, s, d) over the valid rows of each site, computed in ``dtype`` by torch."""
    rows = _rows(x, row_step, dtype)
    G, s, ds = [], [], []
    for i in range(x.shape[2]):
        d = rows[i][status[i] == 1] - c[i].to(dtype)
        G.append(d.T @ d)
        s.append(d.sum(0))
        ds.append(d)
    return torch.stack(G), torch.stack(s), ds


def _errors(G, s, G64, s64):
    n_trace = sum(float(t) for t in G64.diagonal(dim1=1, dim2=2).sum(-1))
    g = ((G.double() - G64).norm() / G64.norm().clamp_min(1e-300)).item()
    scale = s64.norm().item() + (s64.shape[-1] * n_trace) ** 0.5
    return g, ((s.double() - s64).norm() / max(scale, 1e-300)).item()


def run(x, mask=None, row_step=1, c=None, *, lolo=True, launch=LAUNCH):
    """(G, s, status, c) of ``presplit_partials`` on ``x`` (c from ``_center_kernel`` unless given)."""
    N, Tk, common, c0, status = _prepare(x, mask, row_step)
    c = c0 if c is None else c
    G, s = tp.presplit_partials(x, status, c, N, Tk, common, lolo=lolo, upcast=UPCAST, **launch)
    return G, s, status, c


def check_against_fp64(x, mask=None, row_step=1, c=None, *, lolo=True, launch=LAUNCH):
    G, s, status, c = run(x, mask, row_step, c, lolo=lolo, launch=launch)
    S, D = x.shape[2], x.shape[3]
    assert G.shape == (S, D, D) and s.shape == (S, D)
    assert G.dtype == s.dtype == torch.float32
    # every entry written (the buffers started as NaN), no rejected row merged
    assert torch.isfinite(G).all() and torch.isfinite(s).all()
    assert torch.equal(G, G.mT)  # bitwise symmetric
    G64, s64, ds = _sums(x, status, c, row_step, torch.float64)
    G32, s32, _ = _sums(x, status, c, row_step, torch.float32)
    e_g, e_s = _errors(G, s, G64, s64)
    r_g, r_s = _errors(G32, s32, G64, s64)
    assert e_s <= RATIO * r_s + FLOOR, f"s: kernel {e_s:.3g} vs torch fp32 {r_s:.3g}"
    if lolo:
        assert e_g <= RATIO * r_g + FLOOR, f"G: kernel {e_g:.3g} vs torch fp32 {r_g:.3g}"
    else:
        # 3 dots: each dropped lo_i lo_j is <= 2^-16 |d_i d_j| (|lo| <= 2^-8 |d|), plus the
        # rounding of the fp32 sums (the bound of test_covariance_triton's no-lo·lo test)
        for i, d in enumerate(ds):
            A = d.abs().T @ d.abs()
            assert ((G[i].double() - G64[i]).abs() <= (2.0**-16 + d.shape[0] * 2.0**-23) * A).all()
    return G, s, status, c


# --------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [256, 384, 200], ids=["D256", "D384", "D200-ragged"])
def test_large_means_against_fp64(dtype, D):
    # means ≫ spread: G of uncentred rows would cancel every digit; 2 and 3 tiles a side (200:
    # the last strip is ragged, the workspace's columns past D are zeros)
    x = torch.randn(2, 75, 2, D, device=DEVICE) + 100 + 50 * torch.rand(D, device=DEVICE)
    _, _, status, c = check_against_fp64(x.to(dtype))
    assert (status == 1).all() and (c != 0).all()


@pytest.mark.parametrize("launch", [LAUNCH, SHORT], ids=["BT64", "BT32"])
def test_means_near_the_spread_need_the_lo_half(launch):
    # x near 0 with a mean of 2.5σ: x − c needs more than bf16's 8 bits, so lo carries bits
    x = (torch.randn(1, 200, 2, 256, device=DEVICE) * torch.linspace(0.1, 2, 256, device=DEVICE) + 2.5)
    x = x.to(torch.float16)
    _, _, _, c = check_against_fp64(x, launch=launch)
    d = _rows(x, 1, torch.float32) - c[:, None]
    assert (d - d.bfloat16().float() != 0).float().mean() > 0.01


def test_a_given_centre_and_uncentred_rows():
    # c = 0 (the uncentred sums) and c = a rounded per-channel mean: any shift of the rows
    x = (torch.randn(2, 60, 1, 256, device=DEVICE) * 3 + 1).to(torch.float16)
    check_against_fp64(x, c=torch.zeros(1, 256, device=DEVICE))
    mean = x.float().mean((0, 1)).to(torch.float16).float()
    check_against_fp64(x, c=mean)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf − inf
def test_mask_and_nonfinite_rows_are_never_merged():
    x = (torch.randn(3, 50, 2, 256, device=DEVICE) + 20).to(torch.bfloat16)
    x[0, 3, 0, 5] = float("nan")
    x[1, 7, 0, 255] = float("inf")
    x[2, 8, 1, 0] = float("-inf")
    x[0, 9, 1, :] = float("nan")  # masked out: neither valid nor rejected
    mask = torch.rand(3, 50, device=DEVICE) > 0.2
    mask[0, 9] = False
    mask[1] = False  # a fully padded sequence
    mask[0, 3] = mask[1, 7] = mask[2, 8] = True
    _, _, status, _ = check_against_fp64(x, mask)
    kept = int(mask.sum())
    assert (status == 2).sum(1).tolist() == [2, 1]
    assert (status == 1).sum(1).tolist() == [kept - 2, kept - 1]


@pytest.mark.parametrize("layout", ["keys_view", "sliced"])
@pytest.mark.parametrize("row_step", [1, 3])
def test_strides_and_row_step(layout, row_step):
    f16 = {"dtype": torch.float16, "device": DEVICE}
    if layout == "keys_view":  # [B, S, T, D] seen as [B, T, S, D]
        x = (torch.randn(2, 2, 70, 384) + 40).to(**f16).transpose(1, 2)
    else:  # every other sequence, a window of time and channels, stride 2 along D
        x = (torch.randn(4, 75, 3, 2 * 256 + 10) + 40).to(**f16)[::2, 2:72, 1:, 5:5 + 2 * 256:2]
    assert not x.is_contiguous() and x.dtype == torch.float16
    mask = torch.rand(x.shape[:2], device=DEVICE) > 0.25
    _, _, status, _ = check_against_fp64(x, mask, row_step)
    assert status.shape[1] == x.shape[0] * triton.cdiv(x.shape[1], row_step)


@pytest.mark.parametrize("lolo", [True, False], ids=["lolo", "no-lolo"])
def test_lolo_is_the_only_difference(lolo):
    # without lo·loᵀ (3 dots) G moves by no more than the bound, and only where lo is nonzero
    x = (torch.randn(1, 96, 1, 256, device=DEVICE) + 2.5).to(torch.float16)
    G, s, _, _ = check_against_fp64(x, lolo=lolo)
    G4, s4, _, _ = run(x, lolo=True)
    assert torch.equal(s, s4)
    if not lolo:
        assert (G - G4).abs().max() > 0


# -------------------------------------------------------------------- chunks, workspaces
def test_rows_are_chunked_to_bound_the_workspace(monkeypatch, _nan_filled_buffers):
    # 200 rows of D = 256 in workspaces of 96 rows: 3 chunks (96, 96, 8 rows padded to 32), the
    # Gram kernel adding into G after the first; the last chunk's workspace rows past its own
    # (stale rows of the chunk before) must not be read
    x = (torch.randn(2, 100, 1, 256, device=DEVICE) * 2 + 30).to(torch.float16)
    one, _, _, _ = run(x, launch=SHORT)
    monkeypatch.setattr(tp, "PRESPLIT_ELEMS", 96 * 256)
    assert tp._chunks(1, 200, 256, 32) == (1, 3, 96)
    _nan_filled_buffers.clear()
    G, _, _, _ = check_against_fp64(x, launch=SHORT)
    hi = [shape for shape, dtype in _nan_filled_buffers if dtype == torch.bfloat16]
    assert hi == [(1, 96, 256)] * 2  # hi and lo, each within the bound
    assert ((G - one).abs() <= 1e-6 * one.abs().max()).all()


def test_sites_are_grouped_when_one_sites_rows_fill_the_workspace(monkeypatch):
    # 3 sites with room for fewer than one site's rows (3 groups of one site, 2 row chunks
    # each), for one site's rows (3 groups, 1 chunk), for two sites' rows (2 groups, 1 chunk)
    x = (torch.randn(1, 150, 3, 256, device=DEVICE) + 10).to(torch.bfloat16)
    monkeypatch.setattr(tp, "PRESPLIT_ELEMS", 128 * 256)
    assert tp._chunks(3, 150, 256, 64) == (1, 2, 128)
    check_against_fp64(x)
    monkeypatch.setattr(tp, "PRESPLIT_ELEMS", 200 * 256)
    assert tp._chunks(3, 150, 256, 64) == (1, 1, 192)
    check_against_fp64(x)
    monkeypatch.setattr(tp, "PRESPLIT_ELEMS", 2 * 192 * 256)
    assert tp._chunks(3, 150, 256, 64) == (2, 1, 192)  # 2 sites, then 1
    check_against_fp64(x)


def test_chunk_sizes_and_pipeline_stages():
    # default budget: the FFN case [16384, 8192] bf16 is 2^27 elements, 2 chunks of 8192 rows
    assert tp._chunks(1, 16384, 8192, 64) == (1, 2, 8192)
    assert tp._chunks(8, 1000, 1024, 64) == (8, 1, 1024)
    for S, N, Dp, BT in [(1, 1, 256, 64), (5, 12345, 4096, 64), (40, 3000, 8192, 32), (1, 10**6, 16384, 64)]:
        sites, n_chunks, rows = tp._chunks(S, N, Dp, BT)
        assert rows % BT == 0 and n_chunks * rows >= N > (n_chunks - 1) * rows
        assert sites * rows * Dp <= tp.PRESPLIT_ELEMS or rows == BT
    # 4 strips of BT x 128 bf16 a stage: 64 KB at BT = 64, 3 fit an H100's 227 KB, not 4
    h100 = 232448
    assert tp._gram_stages(4, 64, 8192, h100) == 3
    assert tp._gram_stages(4, 32, 8192, h100) == 4
    assert tp._gram_stages(3, 64, 128, h100) == 2  # never more than the loop's blocks
    assert tp._gram_stages(4, 64, 64, None) == 1


def test_no_rows():
    x = torch.randn(2, 0, 2, 256, device=DEVICE).to(torch.float16)
    N, Tk, common, c, status = _prepare(x)
    G, s = tp.presplit_partials(x, status, c, N, Tk, common, lolo=True, upcast=UPCAST, **LAUNCH)
    assert G.shape == (2, 256, 256) and s.shape == (2, 256)
    assert not G.any() and not s.any()


def test_every_buffer_comes_from_the_nan_filled_empty(_nan_filled_buffers):
    # G, the Σd partials and both workspaces: so the finiteness asserts above cover them all
    x = (torch.randn(1, 40, 2, 384, device=DEVICE) + 3).to(torch.float16)
    check_against_fp64(x)
    made = {(shape, dtype) for shape, dtype in _nan_filled_buffers}
    assert ((2, 384, 384), torch.float32) in made
    assert ((1, 2, 384), torch.float32) in made  # one row group of the pre-pass
    assert ((2, 64, 384), torch.bfloat16) in made  # hi and lo: 40 rows padded to a 64-row block


def test_bitwise_deterministic():
    x = (torch.randn(2, 50, 2, 256, device=DEVICE) * 10 + 3).to(torch.float16)
    a, b = run(x), run(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------- GPU compile, without a GPU
_COMPILE_SCRIPT = r"""
import json
from fastspec.covariance import triton_presplit as P
from benchmarks.sass import compile_sm90, triton_cubin

TYPES = {"p_x": "*bf16", "p_status": "*i8", "p_c": "*fp32", "p_hi": "*bf16", "p_lo": "*bf16",
         "p_sum": "*fp32", "p_G": "*fp32"}
# what the launch of a contiguous input gives: unit strides and row_step constant, pointers,
# sizes and strides multiples of 16 (the workspace's are, by construction)
ONES = ("stride_xd", "ROW_STEP")
DIV16 = ("p_x", "p_status", "p_c", "p_hi", "p_lo", "p_sum", "p_G", "N", "Tk", "D", "NR", "r_start",
         "stride_xb", "stride_xt", "stride_xs", "stride_ws", "stride_wr", "stride_pk", "stride_ps")

def build(fn, consts, num_warps, num_stages):
    return compile_sm90(fn, TYPES, consts, num_warps, num_stages, ones=ONES, div16=DIV16, stride_type="i32")

def stats(k):
    res, kernel = triton_cubin(k.asm["cubin"])
    loop = max(kernel.innermost(), key=lambda lp: lp.size)  # the row loop
    return {"regs": res["registers"], "stack": res["stack"],
            "spill_ops": kernel.ops["LDL"] + kernel.ops["STL"], "smem": k.metadata.shared,
            "loop": loop.size, "HGMMA": loop.ops["HGMMA"], "LDGSTS": loop.ops["LDGSTS"],
            "LDG": loop.ops["LDG"], "CALL": loop.ops["CALL"], "FADD": loop.ops["FADD"],
            # operands read from shared memory into registers (the loop's plain LDS are
            # never-executed @!PT placeholders of the async fences)
            "LDS_operands": loop.ops["LDSM"] + sum(n for op, n in loop.full_ops.items() if op.startswith("LDS.")),
            "wgmma_ptx": k.asm["ptx"].count("wgmma.mma_async")}

out = {}
for BT, warps, stages in [(64, 8, 3), (64, 8, 4), (32, 8, 4), (32, 4, 4)]:
    k = build(P._gram_presplit_kernel, dict(UPCAST=False, LOLO=False, ACCUM=False, BT=BT, BD=128), warps, stages)
    out[f"gram-{BT}-{warps}-{stages}"] = stats(k)
k = build(P._gram_presplit_kernel, dict(UPCAST=False, LOLO=True, ACCUM=True, BT=64, BD=128), 8, 3)
out["gram-lolo-accum"] = stats(k)
# the pre-split candidates the GPU kit races (triton_configs.py), as the launcher builds them
from fastspec.covariance import triton_configs as TC
for cand in (c for c in TC.CANDIDATES["ffn"] if c.presplit):
    k = build(P._gram_presplit_kernel, dict(UPCAST=False, LOLO=cand.lolo, ACCUM=False, BT=cand.BT, BD=128),
              cand.num_warps, cand.num_stages)
    out["cand-" + cand.name] = stats(k)
k = build(P._split_rows_kernel, dict(ROWS=P.SPLIT_ROWS, BT=P.SPLIT_BT, BD=P.BD), P.SPLIT_WARPS, 3)
out["split"] = stats(k)
print(json.dumps(out))
"""

H100_SMEM = 232448  # shared memory one block may opt into on sm_90


# slow: the pre-split kernels compiled for sm_90 (~15 s on 2 cores, with a cold Triton cache); the full tier runs it,
# and CI's gpu-stack stage under the GPU machines' Triton (.ci/run GPU_STACK_FULL)
@pytest.mark.slow
@pytest.mark.sm90
def test_kernels_compile_for_sm90_without_a_gpu():
    """Compile both kernels for sm_90 with Triton's bundled ptxas (the interpreter misses
    compile errors) and pin what the design rests on: the Gram loop's dots on wgmma (HGMMA)
    fed by cp.async (LDGSTS), no spills at 8 warps, the block tile's fp32 add in the loop,
    the shared memory of the pipeline stages; the pre-pass without spills or int64 division."""
    out = compiled_for_sm90(_COMPILE_SCRIPT)
    for name, got in out.items():
        if name == "split":
            continue
        assert got["wgmma_ptx"] > 0 and got["HGMMA"] > 0, (name, got)
        assert got["LDGSTS"] > 0 and got["LDG"] == 0, (name, got)  # strips arrive by cp.async
        assert got["LDS_operands"] == 0, (name, got)  # and wgmma reads them in shared memory
        # G + the block tile: one fp32 add per accumulator register (128 x 128 / threads)
        threads = 32 * int(name.split("-")[2]) if name.startswith("gram-") and name != "gram-lolo-accum" else 256
        assert got["FADD"] >= 128 * 128 // threads, (name, got)
    # 3 dots of 128 x BT x 128 (4 with lo·lo): 64x..x16 instructions, one 64-row half a warpgroup
    assert out["gram-64-8-3"]["HGMMA"] == 3 * 4 and out["gram-lolo-accum"]["HGMMA"] == 4 * 4
    from fastspec.covariance import triton_configs as tcfg

    for cand in (c for c in tcfg.CANDIDATES["ffn"] if c.presplit):
        got = out["cand-" + cand.name]
        assert got["HGMMA"] == (4 if cand.lolo else 3) * cand.BT // 16, (cand.name, got)
        assert got["smem"] <= H100_SMEM, (cand.name, got)
    names = ["gram-64-8-3", "gram-64-8-4", "gram-32-8-4", "gram-lolo-accum"]
    for name in names + [n for n in out if n.startswith("cand-")]:
        got = out[name]
        assert got["spill_ops"] == 0 and got["stack"] == 0 and got["regs"] <= 255, (name, got)
    # 4 strips of BT x 128 bf16 per stage: 64-row blocks fit 3 stages, not 4 (_gram_stages caps)
    assert out["gram-64-8-3"]["smem"] <= H100_SMEM < out["gram-64-8-4"]["smem"]
    assert out["gram-32-8-4"]["smem"] <= H100_SMEM
    # (4 warps would hold G and the block tile in 2 x 128 registers a thread: they spill, and
    # only the matrix instructions and cp.async loads are checked there, above)
    split = out["split"]
    assert split["spill_ops"] == 0 and split["stack"] == 0 and split["CALL"] == 0, split
