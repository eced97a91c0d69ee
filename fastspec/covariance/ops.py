"""One streaming-covariance update as a ``torch.library`` custom op, so it lives inside graphs.

``torch.ops.fastspec.covariance_update_`` merges the rows of one activation tensor into a
:class:`~fastspec.Covariance`'s float64 totals, *in place*::

    fastspec::covariance_update_(Tensor(a!) n, Tensor(b!) rejected, Tensor(c!) first,
                                 Tensor(d!) second, Tensor x, Tensor? mask, Tensor? gate,
                                 int row_step, bool track_mean, str precision, str backend) -> ()

    n        [S]        int64    rows merged per site
    rejected [S]        int64    rows refused for NaN/Inf
    first    [S, D]     float64  running mean (track_mean) or raw Σx
    second   [S, D, D]  float64  centred M2 (track_mean) or raw Σxxᵀ
    x        [B, T, S, D]         rows (any float dtype, any strides), never copied to fp32 on CUDA
    mask     [B, T] bool or None  rows to count (padding False)
    gate     0-d bool or None     merge only if True: the streaming schedule as *data*
                                  (on the CPU, or on the device of x)

It is the whole of :meth:`Covariance.update` after argument checks: the precision policy
(``policy.update_plan``), the per-update sums (the Triton kernels, ``blocked.py``, or for exact
raw sums the route ``routes.py`` picks), and the
exact Chan merge (:func:`merge_sums`). Eager updates call :func:`covariance_update` directly;
under ``torch.compile`` they call the op, which dynamo and Inductor keep as one opaque node
with four mutated inputs (functionalised by AOTAutograd, no graph break), with a fake
implementation that checks shapes and does nothing.

**The gate** makes a compiled graph independent of the capture schedule, so it never
recompiles when the schedule changes. It is a 0-d bool tensor in one of two places:

* on the CPU (also for CUDA data): read on the host, which waits for nothing, and a closed
  gate returns at once: an idle step costs nothing but the call. A CPU tensor in a graph keeps
  Inductor from turning it into a CUDA graph, though;
* on the data's device, for CUDA graphs: never read on the host (that would sync, and a CUDA
  graph would bake the answer in), it is folded into the row mask (:func:`fold_gate`), so a
  closed gate merges zero rows, which leaves the totals bit-for-bit unchanged (the Chan merge
  of an empty chunk adds exact zeros). The rows are still read and the products formed: an
  idle step costs as much as a captured one.

CUDA graphs (``mode="reduce-overhead"``): the state tensors are allocated before the first
capture and marked static (``torch._dynamo.mark_static_address``), so cudagraph trees accept
their mutation; the update allocates its temporaries afresh while a stream is being captured
(a buffer cached across calls would otherwise live in the graph's private pool).
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from . import blocked, routes
from .policy import UpdateSettings, update_plan

# the op's (precision, backend) strings -> their checked UpdateSettings: an update pays a dict
# lookup, not a dataclass and two checks (a bad pair raises each time: exceptions are not cached)
_settings = functools.lru_cache(maxsize=None)(UpdateSettings)

__all__ = ["chan_merge", "covariance_update", "covariance_update_op", "exact_update", "fold_gate", "merge_sums"]


def merge_sums(st: dict[str, Tensor], track_mean: bool, n_b: Tensor, c: Tensor, s: Tensor, G: Tensor | None,
               rejected: Tensor) -> None:
    """Merge one chunk's sums about shift ``c`` (``s = Σ(x−c)``, ``G = Σ(x−c)(x−c)ᵀ``, ``n_b``
    rows, ``rejected`` refused) into the totals ``st`` (``n``, ``rejected`` and ``mean``/``m2``
    or ``sum``/``gram``), in place. ``G=None``: it was added to the ``D × D`` totals already
    (``inplace.py``)."""
    nb = n_b.to(torch.int64)
    st["rejected"] += rejected.to(torch.int64)
    s64 = s.double()
    if not track_mean:
        # raw sums: every path takes them about c = 0
        st["sum"] += s64
        if G is not None:
            st["gram"] += G
        st["n"] += nb
        return
    inv_nb = 1 / nb.double().clamp_min(1)
    mean_b = c.double() + s64 * inv_nb[:, None]
    chan_merge(st, nb, mean_b, G, s64, inv_nb)


def chan_merge(st: dict[str, Tensor], nb: Tensor, mean_b: Tensor, G: Tensor | None,
               s: Tensor | None = None, inv_nb: Tensor | None = None) -> None:
    """Chan et al.: merge chunk ``(nb, mean_b, m2_b)`` into the running (n, mean, m2), in place.

    ``m2_b = G − s sᵀ/nb`` (``s``/``inv_nb`` given: sums about a shift) or ``G`` itself;
    ``G=None``: it was added to ``m2`` already (``inplace.py`` multiplies its rows straight into
    it). The D×D updates are in place (one batched rank-2 or rank-1 product), with no D×D
    temporaries, in the dtype of ``m2`` (float64, or float32 totals). An empty chunk
    (``nb = 0``, ``s = G = 0``) adds exact zeros: the totals do not change.
    """
    na = st["n"].double()
    nbd = nb.double()
    n = (na + nbd).clamp_min(1)
    delta = mean_b - st["mean"]
    st["mean"].addcmul_(delta, (nbd / n)[:, None])
    m2 = st["m2"]
    if G is not None:
        m2 += G
    w = na * nbd / n  # [S]
    # m2 += −s sᵀ/nb + δ δᵀ·w as one batched rank-2 update U Vᵀ with U = [a | b], V = [−a | b],
    # a = s/√nb, b = δ√w: entry (i, j) and (j, i) are the same two products, so m2 stays
    # exactly symmetric
    b = delta * w.sqrt()[:, None]
    if s is not None:
        a = s * inv_nb.sqrt()[:, None]
        m2.baddbmm_(torch.stack((a, b), -1).to(m2.dtype), torch.stack((-a, b), -2).to(m2.dtype))
    else:
        m2.baddbmm_(b[:, :, None].to(m2.dtype), b[:, None, :].to(m2.dtype))
    st["n"] += nb


def _state(n: Tensor, rejected: Tensor, first: Tensor, second: Tensor, track_mean: bool) -> dict[str, Tensor]:
    return {"n": n, "rejected": rejected, **({"mean": first, "m2": second} if track_mean
                                               else {"sum": first, "gram": second})}


def fold_gate(x: Tensor, mask: Tensor | None, gate: Tensor) -> Tensor:
    """The row mask ``[B, T]`` of ``x: [B, T, S, D]`` with ``gate`` folded in, computed on the
    device (no host read): every row is dropped where the gate is False."""
    keep = gate.to(torch.bool).expand(x.shape[:2])
    return keep if mask is None else mask & keep


def _gated_mask(x: Tensor, mask: Tensor | None, gate: Tensor | None) -> tuple[bool, Tensor | None]:
    """``(whether to run at all, the row mask to use)`` (module docstring)."""
    if gate is None:
        return True, mask
    if gate.device.type == "cpu":
        return bool(gate), mask  # a host read costs nothing here
    return True, fold_gate(x, mask, gate)


def covariance_update(n: Tensor, rejected: Tensor, first: Tensor, second: Tensor, x: Tensor,
                      mask: Tensor | None, gate: Tensor | None, row_step: int, track_mean: bool,
                      precision: str, backend: str) -> None:
    """Merge rows ``x: [B, T, S, D]`` into the state, in place (the op's implementation; see the
    module docstring for the arguments). Arguments are checked by :meth:`Covariance.update`;
    ``precision``/``backend`` are those of its :class:`~fastspec.covariance.policy.UpdateSettings`,
    passed as strings because an op's schema holds only tensors and scalars."""
    run, mask = _gated_mask(x, mask, gate)
    if not run:
        return
    if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
        # a compiled graph called under autocast still has it on here: the products must stay
        # in the precision the policy chose, not the autocast dtype
        with torch.autocast(x.device.type, enabled=False):
            covariance_update(n, rejected, first, second, x, mask, None, row_step, track_mean, precision, backend)
        return
    st = _state(n, rejected, first, second, track_mean)
    if backend == "inplace":  # rows straight into the totals, a bounded workspace (inplace.py)
        from . import inplace

        n_b, c, s, rej = inplace.accumulate(second, x, mask, row_step, track_mean)
        merge_sums(st, track_mean, n_b, c, s, None, rej)
        return
    # rebuilt from the strings, which checks them (the op can also be called directly), once per pair
    plan = update_plan(_settings(precision, backend), track_mean, x)
    if plan.backend == "triton":
        from .. import selfcheck
        from . import triton_update as tu

        settings = tu.serving(x, track_mean)  # checked at its first use: a failed kernel never serves
        if settings is not tu.REFERENCE:
            try:
                merge_sums(st, track_mean, *tu.covariance_partials_triton(x, mask, row_step, track_mean,
                                                                          candidate=settings))
                return
            except Exception as exc:
                if not selfcheck.is_build_failure(exc) or os.environ.get(tu.ENV, "").strip():
                    raise
                # built for the check's shapes but not for this call's (Triton specializes on
                # them): disabled on this device; the torch path takes this update
                tu.mark_broken(x, track_mean, settings, str(exc))
        plan = plan._replace(backend="torch")
    if plan.products == torch.float64 and not track_mean:
        exact_update(st, x, mask, row_step)
        return
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    ws = blocked.Workspace() if capturing else blocked.shared_workspace()
    merge_sums(st, track_mean, *blocked.accumulate(x, mask, row_step, track_mean, plan.products, ws))


def exact_update(st: dict[str, Tensor], x: Tensor, mask: Tensor | None, row_step: int,
                 skip: frozenset[str] = frozenset()) -> None:
    """Exact raw sums (the ``sv`` sites): the route the table or the cost model picks
    (``routes.py``; checked at its first use, :func:`routes.self_check`), its merge folded into
    its last kernel where it has one. Unless ``$FASTSPEC_COV_VARIANT`` forced the route:

    * a shape past the route's kernel's limits (ShapeUnsupported: more heads than its grid
      takes, an index past 32 bits) sends this call to the next route, and this call only;
    * a kernel that cannot be built or loaded (KernelUnavailable, a Triton compile error) marks
      the route broken on this device, and the next route takes this update and the later ones.
    """
    from .. import selfcheck
    from ..eig.nvrtc import ShapeUnsupported

    rows = x.shape[0] * -(-x.shape[1] // row_step)
    name, _ = routes.choose(x, rows, skip)
    route = routes.ROUTES[name]
    totals = (st["n"], st["rejected"], st["sum"], st["gram"])
    try:
        # the merge folded into the route's last kernel, which writes the totals as contiguous
        # arrays (a compiled graph may hand the op strided views: those take the merge)
        if route.accumulate is not None and all(t.is_contiguous() for t in totals):
            route.accumulate(*totals, x, mask, row_step)
        else:
            merge_sums(st, False, *route.partials(x, mask, row_step))
    except Exception as exc:
        # the kernels check shapes before they write anything, and fail to build before they run:
        # the totals are untouched when either happens
        shape = isinstance(exc, ShapeUnsupported)
        if name == "blocked" or os.environ.get(routes.ENV, "").strip() or not (shape or selfcheck.is_build_failure(exc)):
            raise
        if shape:
            exact_update(st, x, mask, row_step, skip | {name})
            return
        routes.mark_broken(name, str(exc), x.device)
        exact_update(st, x, mask, row_step, skip)


covariance_update_op = torch.library.custom_op(
    "fastspec::covariance_update_", mutates_args=("n", "rejected", "first", "second"))(covariance_update)


@covariance_update_op.register_fake
def _covariance_update_fake(n, rejected, first, second, x, mask, gate, row_step, track_mean, precision,
                            backend) -> None:
    S, D = x.shape[-2], x.shape[-1]
    torch._check(x.dim() == 4, lambda: f"x: expected [B, T, S, D], got {list(x.shape)}")
    torch._check(tuple(n.shape) == (S,) and tuple(rejected.shape) == (S,),
                 lambda: f"n/rejected: expected [{S}], got {list(n.shape)}/{list(rejected.shape)}")
    torch._check(tuple(first.shape) == (S, D) and tuple(second.shape) == (S, D, D),
                 lambda: f"state: expected [{S}, {D}] and [{S}, {D}, {D}], got "
                         f"{list(first.shape)} and {list(second.shape)}")
    return None
