"""Checks of what a user hands the probe and of what it captured, so that bad input fails up
front and bad data never passes silently:

* :func:`check_batch`: the tokens of a :meth:`Probe.measure` / :meth:`Probe.spectra` batch,
  ``input_ids [B, T]`` (integer) or ``inputs_embeds [B, T, d]`` (floating point) with at least
  one token, and an ``attention_mask`` that keeps at least one of them. Raised before the
  forward with one line naming the argument: the model's own error would come from deep inside
  it ("cannot reshape tensor of 0 elements"), and an all-zero mask would run silently and
  return NaN metrics with ``n = 0`` everywhere.
* :func:`sites_with_rows` and :func:`rejected_rows`: which sites merged or refused rows, and
  which (site, layer)s refused NaN/Inf rows (``Covariance.rejected``, emitted as the
  ``rejected`` metric), read off records already on the host (no device sync);
  :func:`rejected_message` is the warning naming them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _args
from .record import Record

# how many (site, layer)s a warning lists by name before "and N more": every layer of a diverged
# model rejects rows, and a warning listing 64 of them is not read
SHOWN = 4


def _tokens_error(name: str, expected: str, x: Tensor, dtype_ok: bool) -> Exception:
    got = f"shape {tuple(x.shape)}" if dtype_ok else f"dtype {x.dtype} (shape {tuple(x.shape)})"
    message = f"{name}: expected {expected} with at least one token, got {got}"
    return ValueError(message) if dtype_ok else _args.ArgumentTypeError(message)


def check_input_ids(ids: Tensor) -> None:
    """Raise unless ``ids`` is an integer tensor ``[B, T]`` with ``B, T >= 1``."""
    integer = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    if not integer or ids.dim() != 2 or ids.numel() == 0:
        raise _tokens_error("input_ids", "an integer tensor [batch, tokens]", ids, integer)


def check_inputs_embeds(embeds: Tensor) -> None:
    """Raise unless ``embeds`` is a floating-point tensor ``[B, T, d]`` with ``B, T, d >= 1``."""
    floating = embeds.is_floating_point()
    if not floating or embeds.dim() != 3 or embeds.numel() == 0:
        raise _tokens_error("inputs_embeds", "a floating-point tensor [batch, tokens, d]", embeds, floating)


def check_batch(batch: dict | Tensor, *, tensor_is_input_ids: bool) -> None:
    """Raise ``ValueError`` naming the argument if ``batch`` (a dict of model kwargs or a tensor)
    has no token to measure: malformed ``input_ids``/``inputs_embeds``, or a 2-D
    ``attention_mask`` of zeros. ``tensor_is_input_ids``: a bare tensor is the ``input_ids`` of a
    model whose forward takes them first (Hugging Face models); another module's first input may
    be anything, and is its own to check.

    Reads the mask's values (one host sync on CUDA): a measurement waits for its values anyway.
    The mask's shape is checked where the model is called (``hooks.check_mask``)."""
    if isinstance(batch, Tensor):
        if tensor_is_input_ids:
            check_input_ids(batch)
        return
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if isinstance(ids, Tensor):
        check_input_ids(ids)
    if isinstance(embeds, Tensor):
        check_inputs_embeds(embeds)
    mask = batch.get("attention_mask")
    # 4-D masks are the model's to read (the probe counts every token then, hooks.check_mask)
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.numel() > 0 and not bool(mask.any()):
        raise ValueError("attention_mask: every token is masked (all zeros); expected at least one 1")


def sites_with_rows(records: Iterable[Record]) -> set[str]:
    """Sites that merged a row or refused one (for NaN/Inf) in ``records``."""
    return {r.site for r in records if r.metric in ("n", "rejected") and r.value > 0}


@dataclass(frozen=True)
class Rejected:
    """NaN/Inf rows one (site, layer) refused: ``rows`` (the most of any head) of ``seen`` (that
    head's rows, merged and refused), in ``heads`` (None: every head, or a per-layer site);
    ``uneven``: the heads refused different numbers of rows."""

    site: str
    layer: int | None
    rows: int
    seen: int
    heads: tuple[int, ...] | None
    uneven: bool

    def __str__(self) -> str:
        where = self.site if self.layer is None else f"{self.site} layer {self.layer}"
        if self.heads is not None:
            where += f" head{'s' if len(self.heads) > 1 else ''} {', '.join(map(str, self.heads))}"
        return f"{where} ({'up to ' if self.uneven else ''}{self.rows} of {self.seen} rows)"


def rejected_rows(records: Iterable[Record]) -> list[Rejected]:
    """Every (site, layer) of ``records`` that refused NaN/Inf rows, in record order."""
    n: dict[tuple, float] = {}
    rejected: dict[tuple, float] = {}
    for r in records:
        if r.metric in ("n", "rejected"):
            (n if r.metric == "n" else rejected)[(r.site, r.layer, r.head_index)] = r.value
    groups: dict[tuple, list[tuple]] = {}  # (site, layer) -> [(head, rejected, seen)]
    for (site, layer, head), count in rejected.items():
        groups.setdefault((site, layer), []).append((head, int(count), int(count + n.get((site, layer, head), 0))))
    out = []
    for (site, layer), heads in groups.items():
        bad = [h for h in heads if h[1] > 0]
        if not bad:
            continue
        worst = max(bad, key=lambda h: h[1])
        some = heads[0][0] is not None and len(bad) < len(heads)  # name the heads only if not all
        out.append(Rejected(site, layer, worst[1], worst[2], tuple(h[0] for h in bad) if some else None,
                            len({h[1] for h in bad}) > 1))
    return out


def rejected_message(found: list[Rejected], when: str) -> str:
    """The warning for ``found`` (not empty): a site whose rows hold NaN/Inf is never merged
    silently, and its metrics are NaN once no row is left."""
    if len(found) == 1:
        where = f"at {found[0]}"
    else:
        more = f", and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        where = f"at {len(found)} site layers: {'; '.join(map(str, found[:SHOWN]))}{more}"
    return (f"fastspec.Probe: rows with NaN/Inf activations were rejected (not merged) {when} {where}; "
            f"a head or layer left with no rows has NaN metrics (the 'rejected' metric counts them: "
            f"check the model's weights and inputs).")
