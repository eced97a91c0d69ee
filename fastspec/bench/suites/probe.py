"""``probe`` suite ("probe overhead near the floor"): what the probe costs on top of the work it
rides on, and the key-rank computation on its own.

Three cases per tier; each times fastspec and its baseline in the same run, round by round
(:func:`fastspec.bench.timing.measure_interleaved`), so load drifting over the run hits both:

* ``measure-…`` (variant ``keys``): ``Probe(model, keys=True, ffn=False).measure(batch, step=0)``
  vs the plain eval forward of the same model and batch under ``torch.no_grad()``. Rows get
  ``overhead_pct = (t_measure / t_forward − 1)·100`` (target: ≤ 5). Accuracy: max over (layer,
  head) of |PR − PR_fp64| / PR_fp64 (PR_fp64: float64 ``svdvals`` of the post-RoPE keys, the
  ``keyrank`` suite's hand protocol); ``svdvals_fp32_pr_rel_err`` is the same error of the hand
  protocol with fp32 ``svdvals``, for scale.
* ``train_step-…`` (variant ``keys-emit_every=100``): forward + backward + AdamW with a streaming
  ``Probe(model, keys=True, ffn=False, emit_every=100)`` (``probe.step`` every step) vs the same
  step without it; ``overhead_pct`` (target: ≤ 1, ≤ 2 acceptable). The ``train_step`` suite's case
  (:func:`fastspec.bench.models.train_step_case`, layer fitting included) with keys only.
  Accuracy: |Δloss| with the probe attached (must be 0).
* ``rank-…`` (variant ``covariance-sv``): the rank computation alone, from keys already in memory.
  fastspec: per layer ``Covariance((H, D), track_mean=False)``, ``update(k.transpose(1, 2))`` (a
  ``[B, T, H, D]`` view, no copy), ``metrics("sv").participation_ratio``; baseline: ``svdvals`` of
  each head's ``[B·T, D]`` fp32 keys, PR = (Σσ)²/Σσ². Accuracy: max rel err of PR vs float64
  ``svdvals`` of the same keys, for both (target: fastspec ≥ 2× faster with error ≤ 1e-4).

Synthetic keys for ``rank`` (:func:`synthetic_keys`): ``[B, H, T, D]`` fp32 per layer, half the
heads full-rank Gaussian (anisotropic, with a mean offset), the other half rank-deficient before
RoPE (``z [B, T, r] @ W [r, D]``, r cycling through 1, 2, 4, 8), then a standard rotary rotation
over positions. RoPE spreads a rank-r head over all D dimensions with a long tail of small singular
values (the slow rotary pairs barely turn over T positions): the hard case for fp32 Gram sums,
which cannot resolve singular values below ~3e-4·σ_max.

The ``measure`` and ``train_step`` cases are tagged ``headline``: ``benchmarks/gpu_run.py``
measures them in its first command.

Shapes: ``cpu`` is a small Llama (d_model 512, 8 layers, 8 query and 8 KV heads of 128,
d_ff 1536, vocab 8192, 4 × 256 tokens, fp32; rank: 8 layers × 8 heads × 4·2048 rows × 128);
``gpu`` the 1.5B shape of :data:`~fastspec.bench.models.MODEL_SHAPES` in bf16 with 4 × 2048
tokens (rank: 32 layers × 8 heads × 4·2048 × 128, fp32); ``quick`` tiny.
"""
from __future__ import annotations

import torch

from .. import models
from ..case import HEADLINE, Case, Inputs, at_most, no_worse_than

PROBE_SHAPES: dict[str, dict[str, int]] = {
    "quick": models.MODEL_SHAPES["quick"],
    "cpu": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                head_dim=128, intermediate_size=1536, vocab_size=8192),
    "gpu": models.MODEL_SHAPES["gpu"],
}
PROBE_TOKENS = {"quick": (1, 32), "cpu": (4, 256), "gpu": (4, 2048)}  # (batch, sequence)
RANK_SHAPES = {  # (layers, batch, heads, tokens per sequence, head_dim)
    "quick": (2, 1, 8, 128, 16),
    "cpu": (8, 4, 8, 2048, 128),
    "gpu": (32, 4, 8, 2048, 128),
}
DEFICIENT_RANKS = (1, 2, 4, 8)
PR_TARGET = 1e-4
"""Parity target of the ``rank`` case: max |PR − PR_fp64| / PR_fp64 (its claim, held by
``benchmarks/bench_probe.py`` and ``fastspec bench``; the timings' targets are read from the
rows, never asserted)."""
FAST_PR_BOUND = 1e-3
"""What ``precision="fast"`` (float32 products) may cost on the rank-deficient heads (~3e-4 seen)."""
ROPE_THETA = 10000.0
EMIT_EVERY = 100


def probe_cases(tier: str, device: torch.device) -> list[Case]:
    shape, tokens = PROBE_SHAPES[tier], PROBE_TOKENS[tier]
    headline = [  # the GPU kit's first numbers: what the probe adds to a forward and to a step
        _measure_case(tier, device, shape, tokens),
        models.train_step_case(tier, device, EMIT_EVERY, shape=shape, batch_shape=tokens, keys=True,
                               ffn=False, suite="probe", size_prefix="train_step-",
                               variant=f"keys-emit_every={EMIT_EVERY}"),
    ]
    for case in headline:
        case.tags = frozenset({HEADLINE})
    return [*headline, _rank_case(tier, device, RANK_SHAPES[tier]),
            _rank_case(tier, device, RANK_SHAPES[tier], precision="fast")]


# --------------------------------------------------------------------------------------- measure
def _measure_case(tier: str, device: torch.device, shape: dict[str, int], tokens: tuple[int, int]) -> Case:
    L, H = shape["num_hidden_layers"], shape["num_key_value_heads"]

    def setup() -> Inputs:
        import fastspec

        model = models.build_llama(tier, device, shape=shape).eval()
        ids = models.tokens(tokens, shape["vocab_size"], device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"model": model, "batch": batch, "probe": fastspec.Probe(model, keys=True, ffn=False)}

    def run(inp: Inputs) -> list:
        return inp["probe"].measure(inp["batch"], step=0)

    def forward(inp: Inputs):
        with torch.no_grad():
            return inp["model"](**inp["batch"])

    def check(inp: Inputs) -> dict:
        probe_pr = models.probe_key_rank(run(inp), L, H)
        truth = models.hand_key_rank(inp["model"], inp["batch"], torch.float64)
        hand32 = models.hand_key_rank(inp["model"], inp["batch"]).double()
        return {"fastspec_error": _worst_rel(probe_pr, truth), "baseline_error": None,
                "svdvals_fp32_pr_rel_err": _worst_rel(hand32, truth)}

    return Case(suite="probe", size="measure-" + models.size_id(tier, shape, tokens), variant="keys",
                setup=setup, fastspec=run, baselines={"plain forward (eval, no_grad)": forward},
                check=check, error_kind="max rel err of PR vs fp64",
                claim=no_worse_than("svdvals_fp32_pr_rel_err"),  # the keyrank claim, vs the fp32 hand protocol
                skip=models.requirements(), overhead=True)


def _worst_rel(pr: torch.Tensor, truth: torch.Tensor) -> float:
    """max |pr − truth| / truth; NaN if a head is missing (a head not reported is not a 0 error)."""
    d = (pr.double().cpu() - truth.double().cpu()) / truth.double().cpu()
    return float("nan") if d.isnan().any() else float(d.abs().max())


# ------------------------------------------------------------------------------------------ rank
def rope_tables(T: int, D: int, device: torch.device,
                theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, D]`` fp32: the standard (Llama, ``rotate_half``) rotary tables."""
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``k [..., T, D]`` rotated by position: ``k·cos + rotate_half(k)·sin``."""
    k1, k2 = k.chunk(2, dim=-1)
    return k * cos + torch.cat([-k2, k1], dim=-1) * sin


def synthetic_keys(L: int, B: int, H: int, T: int, D: int, device: torch.device,
                   seed: int = 0) -> list[torch.Tensor]:
    """``L`` post-RoPE-like key tensors ``[B, H, T, D]`` fp32 (deterministic for a device and seed).

    Heads ``[0, H/2)``: full-rank Gaussian, per-dimension scales 0.1…3 and a mean offset 0.5.
    Heads ``[H/2, H)``: ``z [B, T, r] @ W [r, D]`` with r cycling through 1, 2, 4, 8 (rank r
    before RoPE). Then every head is rotated by the rotary tables over positions ``0..T-1``.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    cos, sin = rope_tables(T, D, device)
    scale = torch.linspace(0.1, 3.0, D, device=device)
    full = H // 2
    out = []
    for _ in range(L):
        k = torch.empty(B, H, T, D, device=device)
        k[:, :full] = torch.randn(B, full, T, D, generator=g, device=device) * scale + 0.5
        for j, h in enumerate(range(full, H)):
            r = DEFICIENT_RANKS[j % len(DEFICIENT_RANKS)]
            z = torch.randn(B, T, r, generator=g, device=device)
            w = torch.randn(r, D, generator=g, device=device) / r ** 0.5
            k[:, h] = z @ w
        out.append(apply_rope(k, cos, sin))
    return out


def svdvals_key_rank(keys: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[L, H]`` PR = (Σσ)²/Σσ² from ``svdvals`` of each head's ``[B·T, D]`` keys in ``dtype``."""
    prs = []
    for k in keys:
        B, H, T, D = k.shape
        for h in range(H):
            s = torch.linalg.svdvals(k[:, h].reshape(B * T, D).to(dtype))
            prs.append(s.sum().square() / s.square().sum())
    return torch.stack(prs).view(len(keys), -1)


def covariance_key_rank(keys: list[torch.Tensor], precision: str = "auto") -> torch.Tensor:
    """``[L, H]`` PR from one ``fastspec.Covariance((H, D), track_mean=False)`` per layer (``sv``)."""
    import fastspec

    prs = []
    for k in keys:
        B, H, T, D = k.shape
        cov = fastspec.Covariance((H, D), track_mean=False, precision=precision)
        cov.update(k.transpose(1, 2))  # [B, T, H, D] view, no copy
        prs.append(cov.metrics("sv").participation_ratio)
    return torch.stack(prs)


def _rank_case(tier: str, device: torch.device, dims: tuple[int, int, int, int, int],
               precision: str = "auto") -> Case:
    """``precision="auto"``: the default (float64 products for these raw sums on CPU and
    full-rate-fp64 GPUs); ``"fast"``: float32 products, the trade-off the policy declines."""
    L, B, H, T, D = dims

    def setup() -> Inputs:
        return {"keys": synthetic_keys(L, B, H, T, D, device)}

    def run(inp: Inputs) -> torch.Tensor:
        return covariance_key_rank(inp["keys"], precision)

    def hand(inp: Inputs) -> torch.Tensor:
        return svdvals_key_rank(inp["keys"])

    def check(inp: Inputs) -> dict:
        truth = svdvals_key_rank(inp["keys"], torch.float64)
        return {"fastspec_error": _worst_rel(run(inp), truth), "baseline_error": _worst_rel(hand(inp), truth)}

    variant = "covariance-sv" if precision == "auto" else f"covariance-sv-{precision}"
    return Case(suite="probe", size=f"rank-L{L}-H{H}-N{B}x{T}-D{D}-fp32", variant=variant,
                setup=setup, fastspec=run, baselines={"svdvals per head": hand}, check=check,
                error_kind="max rel err of PR vs fp64",
                claim=at_most(FAST_PR_BOUND if precision == "fast" else PR_TARGET))
