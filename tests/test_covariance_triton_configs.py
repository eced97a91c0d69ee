"""The float32 Triton covariance kernels' launch-setting candidates (fastspec/covariance/triton_configs.py),
the ones the GPU kit races (benchmarks/triton_race.py): each against fp64 on adversarial input
under the tolerance rule of tests/_cov_triton.py, the launcher taking a candidate's settings, and
the measured table (its rows, the variable that forces a candidate, what `fastspec info` shows).
Their sm_90 compile (registers, spills, the SASS of each) is tests/test_covariance_triton.py's.
"""
from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton  # the GPU kit runs these on CUDA (benchmarks/gpu_run.py)

from _cov_triton import (  # noqa: F401 - two autouse fixtures among them
    DEVICE,
    _fp32_torch_yardstick,
    _nan_filled_buffers,
    check_against_fp64,
)

from fastspec.covariance import triton_configs as tcfg
from fastspec.covariance import triton_update as tu
from fastspec.covariance.triton_update import covariance_partials_triton as kernel

ALL_CANDIDATES = [c for cs in tcfg.CANDIDATES.values() for c in cs]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN arithmetic
@pytest.mark.parametrize("cand", ALL_CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("center", [True, False], ids=["centered", "raw"])
def test_every_candidate_against_fp64_on_adversarial_input(cand, center):
    # what the race checks on the GPU, at interpreter sizes: means well above the spread (many
    # channels with |mean| ~ 2-40σ, so x − c needs the lo half and dropping lo·lo shows), a
    # mask with a padded sequence, a NaN row and an Inf row (counted, never merged), a strided
    # view (never copied); keys as attention stores them, FFN inputs as a slice of a wider one
    D = 128 if cand.kernel == "keys" else 384
    if cand.kernel == "keys":
        base = torch.randn(2, 4, 3 * cand.BT, D, device=DEVICE)  # [B, H, T, D]
        x = base * torch.linspace(0.05, 2, D, device=DEVICE) + torch.linspace(-4, 40, D, device=DEVICE)
        x = x.to(torch.float16).transpose(1, 2)  # [B, T, H, D] view
    else:
        wide = torch.randn(1, 2 * cand.BT + 24, 1, D + 40, device=DEVICE)
        wide = wide * torch.linspace(0.05, 2, D + 40, device=DEVICE) + torch.linspace(-4, 40, D + 40, device=DEVICE)
        x = wide.to(torch.float16)[..., 20:20 + D]
    assert not x.is_contiguous()
    x[0, 2, 0, 7] = float("nan")
    x[-1, 5, -1, 0] = float("inf")
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=DEVICE)
    mask[0, -9:] = False
    got = check_against_fp64(x, mask, 1, center, candidate=cand)
    assert got.rejected.sum().item() == 2
    again = kernel(x, mask, 1, center, candidate=cand)
    for f in got._fields:  # fixed summation order: equal inputs, equal bits
        assert torch.equal(getattr(got, f), getattr(again, f)), f


def test_dropping_lolo_changes_the_sum_where_lo_is_not_zero():
    # the no-lo·lo candidate forms 3 dots, and only lo·lo is gone: on rows whose lo halves are
    # nonzero its G differs from the 4-dot G by no more than the bound of docs/kernels.md
    # (Σ|lo_i lo_j| <= 2^-16 Σ|d_i d_j|) plus the two fp32 sums' rounding; dropping a hi·lo
    # dot instead would miss by up to 2^-8 of it
    four = tcfg.BY_NAME["f64w8s3"]
    three = four._replace(name="f64w8s3-nolo", lolo=False)  # not a shipped candidate: see the docs
    x = (torch.randn(1, 96, 1, 256, device=DEVICE) + 2.5).to(torch.float16)
    a = kernel(x, None, 1, True, candidate=four)
    b = kernel(x, None, 1, True, candidate=three)
    assert torch.equal(a.c, b.c) and torch.equal(a.s, b.s)
    d = x.double().reshape(-1, 256) - a.c.double()
    A = d.abs().T @ d.abs()
    bound = (2.0**-16 + 96 * 2.0**-23) * A
    diff = (a.G.double() - b.G.double()).abs()[0]
    assert diff.max() > 0
    assert (diff <= bound).all()


@pytest.mark.parametrize("rows", [80, 200])
def test_unrolled_flush_with_a_ragged_last_group(rows):
    # the unrolled candidates add the block tile to G after each group of 2 blocks; a program's
    # last group may hold one partial block and one empty one (80 rows: 2.5 blocks), and the
    # row splits are cut at whole groups (200 rows in 2 splits: 128 + 72)
    cand = tcfg.BY_NAME["k32w8s2-u2"]
    x = torch.randn(1, rows, 2, 128, device=DEVICE) * 3 + torch.linspace(-5, 40, 128, device=DEVICE)
    for split in (1, 2):
        cfg = tu.launch_config(rows, 2, 128, torch.device(DEVICE), 2, split, cand)
        assert cfg.unroll == 2 and cfg.rows_per_split % (2 * cand.BT) == 0
        got = check_against_fp64(x.to(torch.float16), center=False, split=split, candidate=cand)
        assert got.n.tolist() == [rows, rows]


def test_launch_config_takes_the_candidates_settings():
    dev = torch.device(DEVICE)
    for cand in ALL_CANDIDATES:
        D = 128 if cand.kernel == "keys" else 4096
        cfg = tu.launch_config(1 << 16, 1, D, dev, 2, None, cand)
        assert (cfg.BT, cfg.num_warps, cfg.num_stages) == (cand.BT, cand.num_warps, cand.num_stages)
        assert (cfg.lolo, cfg.presplit, cfg.name) == (cand.lolo, cand.presplit, cand.name)
    # the default settings are the fixed rules every GPU run so far measured
    for kernel_name, D in (("keys", 128), ("ffn", 8192)):
        default = tu.launch_config(1 << 16, 1, D, dev, 2, None, tcfg.CANDIDATES[kernel_name][0])
        rules = tu.launch_config(1 << 16, 1, D, dev, 2)
        assert default._replace(name="") == rules
    with pytest.raises(ValueError, match="candidate"):
        tu.launch_config(64, 1, 128, dev, 2, None, tcfg.BY_NAME["f64w8s3"])
    with pytest.raises(ValueError, match="candidate"):
        tu.launch_config(64, 1, 128, dev, 4, None, tcfg.BY_NAME["k32w8s3"])  # fp32 is not raced


@pytest.fixture
def _table(tmp_path, monkeypatch):
    def write(rows):
        path = tmp_path / "triton_configs.json"
        path.write_text(json.dumps({"format": 1, "about": "test", "rows": rows}))
        monkeypatch.setattr(tcfg, "TABLE", path)
        tcfg.forget()
        return path

    yield write
    tcfg.forget()


def test_choose_env_table_default(monkeypatch, _table):
    import torch as _t

    monkeypatch.delenv(tcfg.ENV, raising=False)
    _table([{"arch": 90, "kernel": "ffn", "dtype": "bfloat16", "center": True, "config": "f64w8s3-pre",
             "device_us": 1.0}])
    assert tcfg.choose("ffn", 90, _t.bfloat16, True)[0].name == "f64w8s3-pre"
    assert tcfg.choose("ffn", 90, _t.float16, True)[0].name == "f64w8s3"  # no row: the default
    assert tcfg.choose("ffn", 80, _t.bfloat16, True)[0].name == "f64w8s3"
    assert tcfg.choose("ffn", None, _t.bfloat16, True)[0].name == "f64w8s3"  # the interpreter
    monkeypatch.setenv(tcfg.ENV, "f32w8s4-pre")
    assert tcfg.choose("ffn", 90, _t.bfloat16, True) == (tcfg.BY_NAME["f32w8s4-pre"], f"${tcfg.ENV}")
    with pytest.raises(ValueError, match=tcfg.ENV):
        tcfg.choose("keys", 90, _t.bfloat16, False)  # an ffn candidate forced on the keys kernel
    monkeypatch.setenv(tcfg.ENV, "nope")
    with pytest.raises(ValueError, match="not a candidate"):
        tcfg.choose("ffn", 90, _t.bfloat16, True)
    # the launcher runs what the variable forces (interpreter: no table row can match)
    calls = []
    real = tu.launch_config
    monkeypatch.setattr(tu, "launch_config", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setenv(tcfg.ENV, "f32w8s3")
    kernel(torch.randn(1, 20, 1, 200, device=DEVICE).half())
    assert calls[-1] is tcfg.BY_NAME["f32w8s3"]
    kernel(torch.randn(1, 20, 1, 200, device=DEVICE))  # fp32: fixed rules, the variable not read
    assert calls[-1] is None


@pytest.mark.parametrize("rows, match", [
    ([{"arch": 90, "kernel": "ffn", "dtype": "bfloat16", "center": True, "config": "k32w8s3"}], "not a ffn"),
    ([{"arch": 90, "kernel": "attn", "dtype": "bfloat16", "center": True, "config": "k32w8s3"}], "kernel"),
    ([{"arch": 90, "kernel": "keys", "dtype": "bfloat16", "center": True, "config": "k32w8s3"}] * 2, "two rows"),
])
def test_a_bad_table_is_refused(_table, rows, match):
    _table(rows)
    with pytest.raises(ValueError, match=match):
        tcfg.load_table()


def test_the_shipped_table_loads_and_info_reports_every_choice():
    tcfg.forget()
    tcfg.load_table()
    info = tcfg.info(torch.device("cpu"))
    assert len(info["choices"]) == 2 * 2 * 2
    assert {c["kernel"] for c in info["choices"]} == {"keys", "ffn"}
    assert all(c["config"].split()[0] in tcfg.BY_NAME for c in info["choices"])
