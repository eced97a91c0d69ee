"""FFN token sampling (``Probe(ffn_rows=)``), sized by a FLOP model of a training step.

Full-rate FFN streaming is inherently expensive: the Gram of the down projection's
input costs ``GRAM_FLOPS · N · d_ff²`` per layer for ``N`` tokens, against about
``STEP_FLOPS · N · P`` for a training step of a model with ``P`` (matmul) parameters: about
30% of a step for GPT-2 small, 20% for Llama-7B, 15% for Qwen3-0.6B. ``Probe(ffn_rows="auto")``
(the default) therefore keeps every ``k``-th token of each sequence at the FFN sites while
streaming (``k=20`` for Llama-7B without a budget), with ``k`` the smallest
integer that brings this FLOP share under the target (the ``budget`` when set, else
``DEFAULT_FFN_SHARE``), see :func:`ffn_flop_share` and :func:`auto_ffn_rows`. Sampling every
``k``-th token leaves the covariance estimator unbiased (same expectation, ``1/k`` of the rows,
so its variance grows about ``k``-fold, less when neighbouring tokens are correlated); the
``eig``-convention FFN metrics are those of ``1/k`` of the streamed tokens, and being
spectra of a finite sample, they move when the row count per emission approaches ``d_ff``.
``ffn_rows="all"`` streams every token; :meth:`Probe.measure` always uses every token.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from .. import _args
from .families import Family, matches

#: FLOP model of the FFN subsampling: FLOPs per row and per entry of a ``d x d`` Gram (a full
#: GEMM; the symmetric Triton kernel does about half of that) and a training step's FLOPs per
#: token and parameter (forward 2 + backward 4).
GRAM_FLOPS = 2
STEP_FLOPS = 6
#: FFN share of a training step that ``ffn_rows="auto"`` aims at when no ``budget`` is set.
DEFAULT_FFN_SHARE = 0.01


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that do per-token matmul work: every distinct parameter except those used
    only by ``nn.Embedding`` modules (a lookup; a tied output head still counts, once)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def ffn_flop_share(ffn_widths: Iterable[int], n_params: int) -> float:
    """Full-rate FFN streaming cost as a fraction of a training step:
    ``GRAM_FLOPS · Σ d_ff² / (STEP_FLOPS · P)`` (the token count cancels)."""
    if n_params <= 0:
        raise ValueError(f"n_params: expected > 0, got {n_params!r}")
    return GRAM_FLOPS * sum(d * d for d in ffn_widths) / (STEP_FLOPS * n_params)


def auto_ffn_rows(share: float, target: float, row_step: int = 1) -> int:
    """Smallest ``k >= 1`` with ``share / (row_step · k) <= target``: FFN sites then keep every
    ``row_step · k``-th token."""
    if not target > 0:
        raise ValueError(f"target: expected > 0, got {target!r}")
    return max(1, math.ceil(share / (row_step * target) - 1e-9))


def ffn_widths(model: nn.Module, family: Family | None) -> list[int]:
    """``d_ff`` of every FFN site (the down projection's input width), where it can be told."""
    widths = []
    for _, mod, _ in matches(model, family.ffn if family is not None else None):
        d = getattr(mod, "in_features", None)  # nn.Linear
        if not isinstance(d, int):
            d = getattr(mod, "nx", None)  # transformers Conv1D (GPT-2)
        if not isinstance(d, int):
            d = getattr(mod, "input_size", None)  # Megatron-core's RowParallelLinear (whole width)
        if not isinstance(d, int):
            d = getattr(getattr(model, "config", None), "intermediate_size", None)
        if isinstance(d, int) and d > 0:
            widths.append(d)
    return widths


def check_ffn_rows(name: str, value: int | str) -> int | str:
    """``value`` of ``Probe(ffn_rows=)`` (``"auto"``, ``"all"`` or a count >= 1, as an ``int``),
    or a one-line error naming the argument ``name``."""
    if isinstance(value, str) and value in ("auto", "all"):
        return value
    try:
        return _args.integer(name, value, minimum=1)
    except ValueError as e:  # (an ArgumentTypeError is one too) the message names every option
        raise type(e)(f"{name}: expected 'auto', 'all' or an int >= 1, got {value!r}") from None


def choose_ffn_rows(model: nn.Module, family: Family | None, ffn: bool, ffn_rows: int | str,
                     budget: float | None, row_step: int) -> tuple[int, float | None]:
    """``(k, FLOP share of full-rate FFN streaming)``: see ``Probe(ffn_rows=)`` and the module docstring."""
    ffn_rows = check_ffn_rows("ffn_rows", ffn_rows)
    if not ffn:
        return 1, None
    widths, params = ffn_widths(model, family), matmul_parameters(model)
    share = ffn_flop_share(widths, params) if widths and params > 0 else None
    if ffn_rows == "all":
        return 1, share
    if ffn_rows != "auto":
        return ffn_rows, share
    if share is None:  # cannot size it: stream every token
        return 1, None
    target = DEFAULT_FFN_SHARE if budget is None else budget
    return auto_ffn_rows(share, target, row_step), share
