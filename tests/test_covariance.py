"""fastspec.Covariance on the torch path: against fp64 ground truth (docs/accumulators.md,
docs/conventions.md, docs/metrics.md)."""
import pytest
import torch

import fastspec
from fastspec import metrics as M


def fp64_truth(x: torch.Tensor):
    """Centered unbiased covariance and raw Gram per site from x: [N, S, D], in float64."""
    x = x.double()
    n = x.shape[0]
    mean = x.mean(0)
    xc = x - mean
    cov = torch.einsum("nsi,nsj->sij", xc, xc) / (n - 1)
    gram = torch.einsum("nsi,nsj->sij", x, x)
    return mean, cov, gram


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_single_update_matches_fp64():
    x = torch.randn(500, 3, 24)
    cov = fastspec.Covariance((3, 24)).update(x)
    mean, C, G = fp64_truth(x)
    assert cov.n.tolist() == [500] * 3
    torch.testing.assert_close(cov.mean, mean, rtol=0, atol=1e-6)
    assert rel_err(cov.covariance(), C) < 1e-6
    assert rel_err(cov.gram(), G) < 1e-6
    assert rel_err(cov.second_moment(), G / 500) < 1e-6
    assert rel_err(cov.covariance(unbiased=False), C * 499 / 500) < 1e-6


def test_large_mean_stays_accurate_in_fp32():
    # mean/std = 1e3: G − s sᵀ/n in fp32 would lose every digit; chunk centering must not.
    D = 32
    x = torch.randn(4096, D) + 1e3 * (1 + torch.rand(D))
    cov = fastspec.Covariance(D)
    for chunk in x.split(1000):
        cov.update(chunk)
    _, C, _ = fp64_truth(x[:, None])
    assert rel_err(cov.covariance()[None], C) <= 1e-5
    naive = (x.T @ x - torch.outer(x.sum(0), x.sum(0)) / len(x)) / (len(x) - 1)  # plain fp32
    assert rel_err(naive.double()[None], C) > 1e-2  # the failure mode this guards against is real


def test_long_stream_does_not_stall():
    # 40 updates of 2^20 rows = 2^25.3 rows: an fp32 running n or Σx would stop moving at 2^24.
    cov = fastspec.Covariance(2)
    chunk = torch.tensor([[1.0, 3.0], [3.0, 5.0]]).repeat(2**19, 1)  # mean (2, 4), var 1 each
    for _ in range(40):
        cov.update(chunk)
    N = 40 * 2**20
    assert cov.n.item() == N
    torch.testing.assert_close(cov.mean, torch.tensor([2.0, 4.0], dtype=torch.float64), rtol=0, atol=1e-12)
    expected = torch.ones(2, 2, dtype=torch.float64) * N / (N - 1)
    torch.testing.assert_close(cov.covariance(), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(cov.gram()[0, 0], torch.tensor(5.0 * N, dtype=torch.float64))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("k", [2, 5, 9])
def test_merge_of_k_chunks_equals_one_update(k, dtype, tol):
    # float64 input makes the partials exact enough to pin the Chan merge itself at 1e-12;
    # float32 input adds only the fp32 rounding of each chunk's partials.
    x = (torch.randn(900, 2, 16, dtype=torch.float64) * 3 + 5).to(dtype)
    whole = fastspec.Covariance((2, 16)).update(x)
    parts = [fastspec.Covariance((2, 16)).update(c) for c in x.tensor_split(k)]
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    assert merged.n.tolist() == whole.n.tolist()
    assert rel_err(merged.covariance(), whole.covariance()) < tol
    assert rel_err(merged.mean, whole.mean) < tol
    streamed = fastspec.Covariance((2, 16))
    for c in x.tensor_split(k):
        streamed.update(c)
    assert rel_err(streamed.covariance(), whole.covariance()) < tol


def test_merge_into_empty_and_of_empty():
    x = torch.randn(50, 8)
    a = fastspec.Covariance(8).update(x)
    empty = fastspec.Covariance(8)
    torch.testing.assert_close(fastspec.Covariance(8).merge(a).covariance(), a.covariance())
    before = a.covariance().clone()
    a.merge(empty)
    torch.testing.assert_close(a.covariance(), before)


@pytest.mark.parametrize("track_mean", [True, False])
def test_state_dict_round_trip(track_mean):
    cov = fastspec.Covariance((4, 8), track_mean=track_mean).update(torch.randn(64, 4, 8))
    sd = cov.state_dict()
    clone = fastspec.Covariance((4, 8), track_mean=track_mean)
    clone.load_state_dict(sd)
    torch.testing.assert_close(clone.gram(), cov.gram())
    clone.update(torch.randn(10, 4, 8))  # the restored copy is independent of the original
    assert clone.n[0].item() == 74 and cov.n[0].item() == 64
    with pytest.raises(ValueError, match="state_dict"):
        fastspec.Covariance((4, 9)).load_state_dict(sd)
    buf = __import__("io").BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = fastspec.Covariance((4, 8), track_mean=track_mean)
    again.load_state_dict(torch.load(buf))
    torch.testing.assert_close(again.gram(), cov.gram())


def test_sv_convention_matches_svdvals_of_raw_matrix():
    X = torch.randn(300, 3, 20) + 0.5
    cov = fastspec.Covariance((3, 20), track_mean=False).update(X)
    for track_mean in (False, True):
        c = fastspec.Covariance((3, 20), track_mean=track_mean).update(X)
        pr = c.metrics("sv").participation_ratio
        for h in range(3):
            ref = M.participation_ratio(torch.linalg.svdvals(X[:, h].double()))
            assert abs(pr[h].item() - ref.item()) / ref.item() < 1e-6
    sv = cov.spectrum("sv")
    ref = torch.linalg.svdvals(X.transpose(0, 1).double())
    torch.testing.assert_close(sv, ref, rtol=1e-6, atol=1e-6)


def test_eig_convention_and_trace_participation_ratio():
    x = torch.randn(400, 5, 12) @ torch.randn(12, 12)  # correlated features
    cov = fastspec.Covariance((5, 12)).update(x)
    _, C, _ = fp64_truth(x)
    lam = cov.spectrum("eig")
    assert (lam[..., :-1] >= lam[..., 1:]).all()  # descending
    ref = torch.linalg.eigvalsh(C).flip(-1)
    assert ((lam - ref).abs().amax(-1) / ref[..., 0]).max() < 1e-6  # relative to λmax
    torch.testing.assert_close(cov.participation_ratio(), cov.metrics("eig").participation_ratio,
                               rtol=1e-10, atol=0)
    torch.testing.assert_close(cov.participation_ratio(), M.participation_ratio(torch.linalg.eigvalsh(C)),
                               rtol=1e-6, atol=0)


def test_low_precision_inputs_accumulate_in_fp32_or_better():
    x64 = torch.randn(256, 2, 16, dtype=torch.float64) * 2 + 1
    ref = fastspec.Covariance((2, 16)).update(x64).covariance()
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        xd = x64.to(dt)
        got = fastspec.Covariance((2, 16)).update(xd).covariance()
        exact = fastspec.Covariance((2, 16)).update(xd.double()).covariance()  # same rounded inputs
        # float32 sums of 256 products (bf16/fp16 products are exact, so this is all summation
        # error): ~sqrt(N)·eps32 = 1e-6 typical; 4x that as the bound
        assert rel_err(got, exact) < 4 * 256 ** 0.5 * 2.0 ** -24 * 2, dt
        assert rel_err(got, ref) < (4e-6 if dt == torch.float32 else 2e-2)


def test_float64_input_keeps_float64_precision():
    x = torch.randn(200, 6, dtype=torch.float64) + 1e6
    cov = fastspec.Covariance(6).update(x)
    _, C, _ = fp64_truth(x[:, None])
    assert rel_err(cov.covariance()[None], C) < 1e-10


def test_layouts_masks_and_row_sampling():
    B, H, T, D = 2, 3, 10, 8
    keys = torch.randn(B, H, T, D)  # HF layout
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, -4:] = False  # right padding
    cov = fastspec.Covariance((H, D)).update(keys.transpose(1, 2), mask)
    rows = keys.transpose(1, 2)[mask]  # [valid, H, D]
    assert cov.n.tolist() == [mask.sum().item()] * H
    _, C, _ = fp64_truth(rows)
    assert rel_err(cov.covariance(), C) < 1e-6
    sub = fastspec.Covariance((H, D)).update(keys.transpose(1, 2), row_step=3)
    _, C3, _ = fp64_truth(keys.transpose(1, 2)[:, ::3].reshape(-1, H, D))
    assert sub.n[0].item() == B * 4 and rel_err(sub.covariance(), C3) < 1e-6
    both = fastspec.Covariance((H, D)).update(keys.transpose(1, 2), mask, row_step=2)
    assert both.n[0].item() == mask[:, ::2].sum().item()


def test_flat_rows_and_extra_leading_axes():
    x = torch.randn(2, 3, 4, 6)  # [a, b, t, D] -> all leading axes are rows
    cov = fastspec.Covariance(6).update(x)
    _, C, _ = fp64_truth(x.reshape(-1, 1, 6))
    assert cov.n.item() == 24 and rel_err(cov.covariance()[None], C) < 1e-6
    sites = fastspec.Covariance((2, 3, 6)).update(torch.randn(40, 2, 3, 6))
    assert sites.covariance().shape == (2, 3, 6, 6) and sites.metrics().participation_ratio.shape == (2, 3)


def test_nan_and_inf_rows_are_counted_per_site_not_merged():
    x = torch.randn(100, 2, 8)
    x[5, 0, 3] = float("nan")
    x[7, 0, 0] = float("inf")
    x[9, 1, 1] = float("-inf")
    cov = fastspec.Covariance((2, 8)).update(x)
    assert cov.rejected.tolist() == [2, 1]
    assert cov.n.tolist() == [98, 99]
    clean0 = torch.cat([x[:5, 0], x[6:7, 0], x[8:, 0]])
    _, C, _ = fp64_truth(clean0[:, None])
    assert rel_err(cov.covariance()[0:1], C) < 1e-6
    assert torch.isfinite(cov.covariance()).all()
    m = cov.metrics()
    assert m.rejected.tolist() == [2, 1] and m.n.tolist() == [98, 99]
    with pytest.raises(ValueError, match="site \\(0,\\): 2 rows"):
        cov.check_finite()
    padded = torch.zeros(1, 4, 2, 8)
    padded[0, 0] = float("nan")  # a NaN in a padding row is padding, not a rejected row
    c2 = fastspec.Covariance((2, 8)).update(padded, torch.tensor([[False, True, True, True]]))
    assert c2.rejected.tolist() == [0, 0] and c2.n.tolist() == [3, 3]


def test_reset_keeps_settings_and_zeroes_sums():
    cov = fastspec.Covariance(4).update(torch.randn(10, 4))
    cov.reset()
    assert cov.n.item() == 0 and cov.gram().abs().sum().item() == 0
    cov.update(torch.ones(3, 4))
    assert cov.n.item() == 3


def test_track_mean_false_keeps_raw_sums_only():
    x = torch.randn(64, 6) + 2
    cov = fastspec.Covariance(6, track_mean=False).update(x)
    torch.testing.assert_close(cov.gram(), (x.double().T @ x.double()), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(cov.mean, x.double().mean(0), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="track_mean"):
        cov.covariance()
    with pytest.raises(ValueError, match="track_mean"):
        cov.spectrum("eig")


def test_results_before_any_update_raise():
    with pytest.raises(RuntimeError, match="update"):
        fastspec.Covariance(4).covariance()


@pytest.mark.parametrize("x,err,match", [
    (torch.randn(10, 5), ValueError, "x: expected shape"),
    (torch.randn(4), ValueError, "x: expected shape"),
    (torch.randint(0, 3, (10, 4)), TypeError, "x: expected a real floating"),
    (torch.randn(10, 4, dtype=torch.complex64), TypeError, "x: expected a real floating"),
    (torch.randn(0, 4), ValueError, "x: empty update"),
    ("rows", TypeError, "x: expected a torch.Tensor"),
])
def test_bad_updates_name_the_argument(x, err, match):
    with pytest.raises(err, match=match):
        fastspec.Covariance(4).update(x)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="dim"):
        fastspec.Covariance((4, 0))
    with pytest.raises(ValueError, match="dim"):
        fastspec.Covariance("8")
    with pytest.raises(ValueError, match="backend"):
        fastspec.Covariance(4, backend="cuda")
    cov = fastspec.Covariance(4)
    with pytest.raises(ValueError, match="mask: expected shape"):
        cov.update(torch.randn(2, 5, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="row_step"):
        cov.update(torch.randn(5, 4), row_step=0)
    with pytest.raises(ValueError, match="convention"):
        cov.update(torch.randn(5, 4)).spectrum("svd")
    with pytest.raises(ValueError, match="other"):
        cov.merge(fastspec.Covariance(5))
    with pytest.raises(TypeError, match="other"):
        cov.merge(torch.zeros(4))


def test_sites_without_enough_rows_get_nan_spectra_not_an_error():
    x = torch.randn(1, 2, 4, 3)  # one row per site: the unbiased covariance is undefined
    x[0, 0, 1] = float("nan")  # site 1 also refuses that row: n = 0 there
    cov = fastspec.Covariance((4, 3)).update(x.reshape(2, 4, 3))
    assert cov.n.tolist() == [2, 1, 2, 2]
    lam = cov.spectrum("eig")
    assert torch.isnan(lam[1]).all() and torch.isfinite(lam[[0, 2, 3]]).all()
    torch.testing.assert_close(lam[0], torch.linalg.eigvalsh(cov.covariance()[0]).flip(-1).clamp_min(0))
    assert torch.isnan(cov.metrics("eig").participation_ratio[1])
    single = fastspec.Covariance(3).update(torch.randn(1, 3))
    assert torch.isnan(single.spectrum("eig")).all()
    assert torch.isfinite(single.spectrum("sv")).all()  # the raw Gram of one row is defined


def test_to_moves_the_state():
    cov = fastspec.Covariance(4).update(torch.randn(10, 4, dtype=torch.float64))
    ref = cov.covariance().clone()
    moved = cov.to("cpu")
    assert moved is cov and cov.device == torch.device("cpu")
    torch.testing.assert_close(cov.covariance(), ref)
    empty = fastspec.Covariance(4).to("cpu")
    assert empty.device == torch.device("cpu")
    empty.update(torch.randn(3, 4))
    assert empty.n.item() == 3


def test_device_without_an_index_accepts_the_tensors_it_makes():
    # found on the first GPU run: Covariance(device="cuda") lived on "cuda" while its inputs
    # were on "cuda:0", and every update was refused. "cpu:0" vs "cpu" is the same mismatch on
    # a machine without a GPU: the device is kept as the tensors report it
    x = torch.randn(5, 6, 3)
    for make in (lambda: fastspec.Covariance(3, device="cpu:0"),
                 lambda: fastspec.Covariance(3).to(torch.device("cpu", 0)),
                 lambda: fastspec.Covariance(3).allocate("cpu:0")):
        cov = make()
        assert cov.device == x.device == torch.device("cpu")
        cov.update(x).allocate("cpu:0")  # an existing state on the same device passes
        assert cov.n.item() == 30
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda is not usable here"):
            fastspec.Covariance(3, device="cuda")


def test_constructor_arguments_name_the_argument_and_take_numpy_ints():
    np = pytest.importorskip("numpy")
    for dim in (16.0, True, -3, 0, (4, 2.0), (4, False), (), "8", None, np.float32(4)):
        with pytest.raises(ValueError, match=r"dim: expected D or a tuple \(\*sites, D\) of positive ints"):
            fastspec.Covariance(dim)
    for dim, want in ((np.int64(16), ((), 16)), ((np.int32(2), 8), ((2,), 8)), (torch.Size([3, 4]), ((3,), 4)),
                      ([2, 5], ((2,), 5))):
        cov = fastspec.Covariance(dim)
        assert (cov.sites, cov.D) == want and type(cov.D) is int
    with pytest.raises(TypeError, match="track_mean: expected True or False"):
        fastspec.Covariance(4, track_mean="no")
    assert not fastspec.Covariance(4, track_mean=np.bool_(False)).track_mean
    with pytest.raises(ValueError, match="device: expected a torch.device"):
        fastspec.Covariance(4, device="gpu")
    cov = fastspec.Covariance(4).update(torch.randn(2, 6, 4), row_step=np.int64(2))
    assert cov.n.item() == 6
    for bad in (2.0, True, np.int64(0)):
        with pytest.raises(ValueError, match="row_step"):
            cov.update(torch.randn(2, 6, 4), row_step=bad)
    with pytest.raises(ValueError, match="dtype"):
        cov.spectrum(dtype="float64")
    with pytest.raises(ValueError, match="dtype"):
        cov.metrics("sv", dtype=torch.int64)
    with pytest.raises(TypeError, match="unbiased"):
        cov.covariance(unbiased="no")
    with pytest.raises(TypeError, match="state_dict"):
        cov.load_state_dict(None)
    with pytest.raises(ValueError, match="device"):
        cov.to("gpu")
