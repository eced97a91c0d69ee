"""``fastspec.Covariance``: streaming per-site accumulator of ``n, Σx, Σxxᵀ``.

State per site, on the device of the data, with no host sync on :meth:`Covariance.update`
(CUDA; on CPU a finite-block check reads one flag per block):

    n        [*sites]         int64   rows merged
    mean     [*sites, D]      float64 running mean (track_mean=True)
    m2       [*sites, D, D]   float64 centered sum Σ(x − mean)(x − mean)ᵀ (track_mean=True)
    gram     [*sites, D, D]   float64 raw Σxxᵀ (track_mean=False)
                              (both float32 with ``totals=torch.float32``)
    sum      [*sites, D]      float64 raw Σx (track_mean=False)
    rejected [*sites]         int64   rows refused because they held NaN/Inf

Each update is reduced to sums about a per-update shift ``c`` (centred accumulators) or about 0
(raw sums), with float32 or float64 products as ``policy.py`` decides (``precision=``), and
merged into the float64 totals in place: raw sums are added; centred ones with Chan's
parallel-variance correction, ``m2 += G − s sᵀ/n_b + δδᵀ·n_a n_b/n`` (``δ`` = difference of
the means), exact for any shift. Float64 totals and int64 counts keep long streams from stalling
(a float32 running sum stops moving after ~2^24 similar additions). Memory is O(sites·D²).

NaN/Inf: a row whose D values are not all finite is *not* merged for that site; it is counted
in ``rejected`` (and reported in :meth:`Covariance.metrics`). :meth:`check_finite` raises if any
row was refused (it syncs; call it when you want to stop on bad data).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import _args
from ..metrics import SpectrumMetrics, summarize
from . import ops
from .policy import UpdateSettings, solve_dtype

CONVENTIONS = ("eig", "sv")
#: dtypes the ``[*sites, D, D]`` totals may have (``Covariance(totals=...)``)
TOTALS = (torch.float64, torch.float32)


def _shape_arg(dim: Any) -> tuple[int, ...]:
    try:
        shape = (_args.index(dim),)
    except TypeError:  # not one int: a tuple/list/torch.Size of them (a str is neither)
        try:
            shape = () if isinstance(dim, (str, bytes)) else tuple(_args.index(d) for d in dim)
        except TypeError:
            shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"dim: expected D or a tuple (*sites, D) of positive ints, got {dim!r}")
    return shape


def _device_arg(device: Any) -> torch.device:
    """``device`` as the device its tensors report: ``'cuda'`` is ``cuda:<current>``, ``'cpu:0'``
    is ``cpu``, so a later ``x.device != self.device`` compares like with like."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a torch.device or a device string such as 'cpu' or "
                         f"'cuda:0', got {device!r}") from None
    try:  # an empty tensor allocates nothing; torch resolves the index (or drops cpu's) for us
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError) as e:  # AssertionError: a torch built without CUDA
        raise ValueError(f"device: {device} is not usable here ({str(e).splitlines()[0]})") from None


def spectra(mat: Tensor, convention: str, *, dtype: torch.dtype | None = None) -> Tensor:
    """Descending spectra ``[..., D]`` of a batch of matrices ``mat: [..., D, D]`` (one eigensolve).

    ``mat`` holds covariances (``eig``: eigenvalues) or Gram matrices (``sv``: ``sqrt`` of the
    eigenvalues); ``dtype`` as in :meth:`Covariance.spectrum`. A matrix with a NaN/Inf entry (an
    undefined site) gets an all-NaN spectrum without disturbing the others.
    """
    from ..eig import eigvalsh

    _args.choice("convention", convention, CONVENTIONS)
    if dtype is None:
        dtype = solve_dtype(convention, mat.device)
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
        raise ValueError(f"dtype: expected None or a real floating torch.dtype (the eigensolve's "
                         f"precision, e.g. torch.float64), got {dtype!r}")
    # every eigvalsh solver gives an undefined site (NaN/Inf sums) a NaN row without a sync and
    # leaves its neighbours alone; clamp_min keeps those NaNs
    lam = eigvalsh(mat.to(dtype)).flip(-1).clamp_min(0)
    return lam.sqrt() if convention == "sv" else lam


def _as_bt(x: Tensor, lead: int, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """View the ``lead`` leading row axes of x (and of mask) as two axes ``[B, T]``.

    T keeps its own stride, so row sampling along T and HF layouts need no copy; axes before
    T are flattened (a copy only if their strides do not allow a view).
    """
    if lead == 1:
        return x.unsqueeze(0), None if mask is None else mask.unsqueeze(0)
    if lead > 2:
        x = x.flatten(0, lead - 2)
        mask = None if mask is None else mask.flatten(0, lead - 2)
    return x, mask


class Covariance:
    """Streaming covariance of activation rows, batched over sites.

    Args:
        dim: ``D`` or ``(*sites, D)``, e.g. ``(H, D)`` for H heads of width D: positive ints
            (NumPy ints and ``torch.Size`` too; a float or a bool is an error).
        device: where the state lives (a ``torch.device`` or a string such as ``"cuda:0"``);
            default: the device of the first update.
        track_mean: keep the centered covariance (needed by the ``eig`` convention). With
            ``False`` only raw ``Σx``/``Σxxᵀ`` are kept (the ``sv`` convention), and the update
            skips centering.
        backend: ``"auto"`` (Triton for float32 products of CUDA tensors when available, the
            blocked torch path elsewhere), ``"torch"`` or ``"triton"`` (on CPU only under
            ``TRITON_INTERPRET=1``).
        precision: products in float64 (``"exact"``) or float32 (``"fast"``); ``"auto"``: exact
            for raw sums (``track_mean=False``) on CPU and full-rate-float64 GPUs, fast
            otherwise. Accuracy of each choice: ``fastspec.covariance.policy``.
        settings: ``precision`` and ``backend`` as one
            :class:`~fastspec.covariance.policy.UpdateSettings`, already checked (what a
            :class:`fastspec.Probe` hands its accumulators); instead of ``precision``/``backend``,
            not with them. The choice in effect: :attr:`settings` (``.precision``, ``.backend``).
        totals: dtype of the ``[*sites, D, D]`` totals (``m2`` or ``gram``): ``torch.float64``
            (default) or ``torch.float32``, half the memory for a wide site, at the cost
            docs/scale.md measures per metric (the counts, means and sums stay int64/float64).
            ``backend="inplace"`` then forms its products in float32 too (``policy.py``).

    Example::

        cov = fastspec.Covariance((8, 128))        # 8 KV heads of width 128
        cov.update(keys.transpose(1, 2))            # keys [B, H, T, D] -> [B, T, H, D] view
        cov.metrics("sv").participation_ratio       # [8]
    """

    def __init__(self, dim: int | tuple[int, ...], *, device: torch.device | str | None = None,
                 track_mean: bool = True, backend: str = "auto", precision: str = "auto",
                 settings: UpdateSettings | None = None, totals: torch.dtype = torch.float64):
        shape = _shape_arg(dim)
        self.sites: tuple[int, ...] = shape[:-1]
        self.D: int = shape[-1]
        self.track_mean = _args.flag("track_mean", track_mean)
        if totals not in TOTALS:
            raise ValueError(f"totals: expected torch.float64 or torch.float32, got {totals!r}")
        self.totals: torch.dtype = totals
        if settings is None:
            settings = UpdateSettings(precision, backend)
        elif not isinstance(settings, UpdateSettings):
            raise _args.ArgumentTypeError(f"settings: expected a fastspec.covariance.policy.UpdateSettings "
                                          f"or None, got {type(settings).__name__}")
        elif (precision, backend) != ("auto", "auto"):
            raise ValueError(f"precision, backend: given as settings={settings!r}; pass them there, not "
                             f"also as precision={precision!r}, backend={backend!r}")
        self.settings = settings
        self._device = None if device is None else _device_arg(device)
        self._state: dict[str, Tensor] | None = None
        if self._device is not None:
            self._init_state(self._device)
            # a GPU's kernels are checked at their first use, but never inside a CUDA-graph capture
            # or a trace: given the device, the checks its updates (of bfloat16 rows, what
            # training activations are) and its spectrum need run now (fastspec/selfcheck.py)
            from .. import preflight

            preflight.up_front(self._device, self.D, self.track_mean, self.settings, self.num_sites)

    # read-only views of the settings, under the attribute names they had before settings existed
    precision = property(lambda self: self.settings.precision, doc="``settings.precision``")
    backend = property(lambda self: self.settings.backend, doc="``settings.backend``")

    # ------------------------------------------------------------------ state
    @property
    def num_sites(self) -> int:
        return math.prod(self.sites)

    @property
    def device(self) -> torch.device | None:
        return self._device

    def _init_state(self, device: torch.device) -> None:
        S, D = self.num_sites, self.D
        f64 = dict(dtype=torch.float64, device=device)
        st = {
            "n": torch.zeros(S, dtype=torch.int64, device=device),
            "rejected": torch.zeros(S, dtype=torch.int64, device=device),
        }
        if self.track_mean:
            st["mean"] = torch.zeros(S, D, **f64)
            st["m2"] = torch.zeros(S, D, D, dtype=self.totals, device=device)
        else:
            st["sum"] = torch.zeros(S, D, **f64)
            st["gram"] = torch.zeros(S, D, D, dtype=self.totals, device=device)
        self._state = st
        self._device = device

    def _require_data(self) -> dict[str, Tensor]:
        if self._state is None:
            raise RuntimeError("Covariance has seen no data yet: call update(x) first")
        return self._state

    def to(self, device: torch.device | str) -> "Covariance":
        """Move the accumulators (e.g. a checkpoint loaded on CPU) to ``device``, in place."""
        device = _device_arg(device)
        if self._state is not None:
            self._state = {k: v.to(device) for k, v in self._state.items()}
        self._device = device
        return self

    def allocate(self, device: torch.device | str) -> "Covariance":
        """Create the (zero) state on ``device`` now if there is none yet, e.g. before a compiled
        graph that updates it is traced; an existing state must already be on ``device``."""
        device = _device_arg(device)
        if self._state is None:
            self._init_state(device)
        elif self._device != device:
            raise ValueError(f"device: this Covariance lives on {self._device}, not {device}")
        return self

    def reset(self) -> None:
        """Zero every accumulator (the device and settings stay)."""
        if self._state is not None:
            for t in self._state.values():
                t.zero_()

    def free(self) -> None:
        """Drop the state (its memory goes back to the allocator); the next update allocates it
        anew, zero, on the device of its rows. For a probe whose wide sites take turns."""
        self._state = None

    @property
    def nbytes(self) -> int:
        """Bytes of the state tensors (0 before the first update or after :meth:`free`)."""
        return 0 if self._state is None else sum(t.numel() * t.element_size() for t in self._state.values())

    def _out(self, t: Tensor, trailing: int) -> Tensor:
        return t.reshape((*self.sites, *t.shape[t.dim() - trailing:]))

    @property
    def n(self) -> Tensor:
        """Rows merged per site, ``[*sites]`` int64."""
        return self._out(self._require_data()["n"], 0)

    @property
    def rejected(self) -> Tensor:
        """Rows refused per site because they held NaN/Inf, ``[*sites]`` int64."""
        return self._out(self._require_data()["rejected"], 0)

    def check_finite(self) -> None:
        """Raise ``ValueError`` naming the sites that refused NaN/Inf rows (host sync)."""
        rej = self.rejected
        bad = rej.nonzero().tolist()
        if bad:
            detail = ", ".join(f"site {tuple(i)}: {int(rej[tuple(i)])} rows" for i in bad[:8])
            raise ValueError(f"x: NaN/Inf activations were refused ({detail}"
                             f"{', ...' if len(bad) > 8 else ''})")

    # ----------------------------------------------------------------- update
    def _check_update(self, x: Tensor, mask: Tensor | None, row_step: int) -> tuple[int, int]:
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.is_complex() or not x.is_floating_point():
            raise TypeError(f"x: expected a real floating dtype (bf16/fp16/fp32/fp64), got {x.dtype}")
        trailing = (*self.sites, self.D)
        lead = x.dim() - len(trailing)
        if lead < 1 or tuple(x.shape[lead:]) != trailing:
            raise ValueError(f"x: expected shape [N, {', '.join(map(str, trailing))}] (any number of "
                             f"leading row axes), got {list(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"x: empty update (shape {list(x.shape)}); pass at least one row")
        if self._device is not None and x.device != self._device:
            raise ValueError(f"x: is on {x.device} but this Covariance lives on {self._device}")
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask: expected a bool tensor, got {type(mask).__name__}")
            if tuple(mask.shape) != tuple(x.shape[:lead]):
                raise ValueError(f"mask: expected shape {list(x.shape[:lead])} (the row axes of x), "
                                 f"got {list(mask.shape)}")
            if mask.device != x.device:
                raise ValueError(f"mask: is on {mask.device}, x is on {x.device}")
        return lead, _args.integer("row_step", row_step, minimum=1)

    def update(self, x: Tensor, mask: Tensor | None = None, *, row_step: int = 1,
               gate: Tensor | None = None) -> "Covariance":
        """Merge rows ``x: [*rows, *sites, D]`` (e.g. ``[N, D]``, ``[B, T, H, D]``).

        Args:
            x: activations in any float dtype and any strides; never copied to fp32 on CUDA.
            mask: optional bool ``[*rows]``; rows where it is False (padding) are not counted.
            row_step: keep every k-th row along the last row axis (token sampling).
            gate: optional 0-d bool tensor: merge only if it is True. On the CPU it is read on
                the host (no sync: a closed gate skips the work); on the data's device it is
                applied there (CUDA-graph safe, the rows are still read). Either way a compiled
                graph does not depend on its value (``fastspec/covariance/ops.py``).

        Inside ``torch.compile`` the update is one custom op, ``torch.ops.fastspec.covariance_update_``
        (no graph break); give ``device=`` at construction so the state exists before tracing.
        """
        lead, row_step = self._check_update(x, mask, row_step)
        if self._state is None:
            self._init_state(x.device)
        if gate is not None and (not isinstance(gate, Tensor) or gate.numel() != 1
                                 or gate.device not in (x.device, torch.device("cpu"))):
            raise ValueError(f"gate: expected a one-element tensor on {x.device} or the CPU, got "
                             f"{gate if not isinstance(gate, Tensor) else f'shape {list(gate.shape)} on {gate.device}'}")
        if mask is not None and mask.dtype != torch.bool:
            mask = mask != 0
        xs = x.reshape(*x.shape[:lead], self.num_sites, self.D) if self.sites else x.unsqueeze(-2)
        x4, m2d = _as_bt(xs, lead, mask)
        st = self._state
        first, second = ("mean", "m2") if self.track_mean else ("sum", "gram")
        update = ops.covariance_update_op if torch.compiler.is_compiling() else ops.covariance_update
        settings = self.settings
        update(st["n"], st["rejected"], st[first], st[second], x4.detach(), m2d,
               None if gate is None else gate.reshape(()), row_step, self.track_mean, settings.precision,
               settings.backend)
        return self

    def _merge_sums(self, n_b: Tensor, c: Tensor, s: Tensor, G: Tensor, rejected: Tensor) -> None:
        """Merge one update's sums about shift ``c`` (``s = Σ(x−c)``, ``G = Σ(x−c)(x−c)ᵀ``), in place."""
        ops.merge_sums(self._state, self.track_mean, n_b, c, s, G, rejected)

    def merge(self, other: "Covariance") -> "Covariance":
        """Add another accumulator's rows into this one, exactly (docs/accumulators.md)."""
        if not isinstance(other, Covariance):
            raise TypeError(f"other: expected a fastspec.Covariance, got {type(other).__name__}")
        if (other.sites, other.D, other.track_mean) != (self.sites, self.D, self.track_mean):
            raise ValueError(f"other: shape/track_mean {(*other.sites, other.D)}/{other.track_mean} "
                             f"does not match {(*self.sites, self.D)}/{self.track_mean}")
        if other._state is None:
            return self
        if self._state is None:
            self._init_state(other._device)
        ost = {k: v.to(self._device) for k, v in other._state.items()}
        self._state["rejected"] += ost["rejected"]
        if self.track_mean:
            ops.chan_merge(self._state, ost["n"], ost["mean"], ost["m2"])
        else:
            for k in ("n", "sum", "gram"):
                self._state[k] += ost[k]
        return self

    def _sums_about(self, shift: Tensor | None) -> tuple[Tensor, Tensor]:
        """This accumulator's rows as new sums about ``shift`` ``[S, D]`` (``None``: about 0):
        ``s = Σ(x − c) = n (mean − c)`` and ``G = Σ(x − c)(x − c)ᵀ = M2 + n (mean − c)(mean − c)ᵀ``.

        Sums about a common shift add exactly, so :meth:`all_reduce` sums these across ranks
        and merges the total with :meth:`_merge_sums`, the path every update takes.
        """
        st = self._require_data()
        if not self.track_mean:
            if shift is not None:
                raise ValueError("shift: raw-sum accumulators (track_mean=False) are kept about 0")
            return st["sum"].clone(), st["gram"].clone()
        n = st["n"].double()
        delta = st["mean"] if shift is None else st["mean"] - shift
        # (δ_i δ_j)·n: entries (i, j) and (j, i) are the same products, so G is exactly symmetric
        G = st["m2"] + delta[:, :, None] * delta[:, None, :] * n[:, None, None]
        return delta * n[:, None], G

    def all_reduce(self, group=None) -> "Covariance":
        """A new Covariance holding the rows of every rank in ``group`` (default: the world).

        A collective: every rank calls it, in the same order for every accumulator. Raw sums
        add as they are. Centred state is merged about the global mean ``μ = Σ n_r mean_r / N``
        (one all-reduce first): each rank's rows become sums about ``μ``, which add exactly, and
        the total goes through the same merge as an update. Nothing cancels even when the mean
        is far larger than the spread (docs/accumulators.md). This rank's accumulator is not
        changed. Every rank must have seen data (so that the state exists on a device).
        """
        from .distributed import all_reduce_covariance

        return all_reduce_covariance(self, group)

    # ---------------------------------------------------------------- results
    @property
    def mean(self) -> Tensor:
        """Per-site mean ``Σx / n``, ``[*sites, D]`` float64."""
        st = self._require_data()
        if self.track_mean:
            return self._out(st["mean"], 1)
        return self._out(st["sum"] / st["n"].double().clamp_min(1)[:, None], 1)

    def gram(self) -> Tensor:
        """``G = Σxxᵀ = XᵀX`` per site, ``[*sites, D, D]`` float64."""
        g = self._sums_about(None)[1] if self.track_mean else self._require_data()["gram"]
        return self._out(g, 2)

    def second_moment(self) -> Tensor:
        """Uncentered ``M = G / n``, ``[*sites, D, D]`` float64 (NaN where n = 0)."""
        n = self._require_data()["n"].double()
        return self.gram() / self._out(n, 0)[..., None, None]

    def covariance(self, unbiased: bool = True) -> Tensor:
        """Centered ``C = (G − s sᵀ/n)/(n − 1)`` (or ``/n``), ``[*sites, D, D]`` float64."""
        st = self._require_data()
        if not self.track_mean:
            raise ValueError("covariance() needs track_mean=True; this accumulator keeps only raw "
                             "sums (use second_moment() or gram(), or the 'sv' convention)")
        n = st["n"].double() - (1 if _args.flag("unbiased", unbiased) else 0)
        return self._out(st["m2"] / n[:, None, None], 2)

    def participation_ratio(self) -> Tensor:
        """``eig``-convention PR without an eigensolve: ``tr(C)² / ‖C‖_F²`` (docs/metrics.md), ``[*sites]``."""
        st = self._require_data()
        if not self.track_mean:
            raise ValueError("participation_ratio() is the eig convention and needs track_mean=True")
        m2 = st["m2"]
        pr = torch.diagonal(m2, dim1=-2, dim2=-1).sum(-1).square() / m2.square().sum((-2, -1))
        return self._out(pr, 0)

    def matrix(self, convention: str = "eig") -> Tensor:
        """The matrix whose spectrum :meth:`spectrum` reports, ``[*sites, D, D]`` float64: the
        unbiased covariance (``eig``) or the raw Gram matrix ``XᵀX`` (``sv``)."""
        _args.choice("convention", convention, CONVENTIONS)
        return self.covariance() if convention == "eig" else self.gram()

    def spectrum(self, convention: str = "eig", *, dtype: torch.dtype | None = None) -> Tensor:
        """Spectrum per site, sorted descending, ``[*sites, D]``.

        ``eig``: eigenvalues of the unbiased centered covariance. ``sv``: singular values of the
        raw uncentered data matrix, ``σ = sqrt(λ(G))`` (docs/conventions.md). ``dtype`` is the precision of
        the eigensolve; by default float64 for ``sv`` (a float32 solve would blur every singular
        value below ~3e-4·σ_max) and for ``eig`` float32 on CUDA (the fast batched solver),
        float64 elsewhere (``fastspec.covariance.policy``). An ``eig`` site with one row (an
        undefined covariance) gets an all-NaN spectrum, a site with no rows an all-zero one;
        their metrics are NaN either way.
        """
        return spectra(self.matrix(convention), convention, dtype=dtype)

    def metrics(self, convention: str = "eig", *, dtype: torch.dtype | None = None) -> SpectrumMetrics:
        """Every metric of ``fastspec.metrics.summarize`` (docs/metrics.md) per site (each ``[*sites]``), plus ``n`` and ``rejected``."""
        m = summarize(self.spectrum(convention, dtype=dtype), check_negative=False)  # clamped already: no sync
        return SpectrumMetrics(**{**m.as_dict(), "n": self.n, "rejected": self.rejected})

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Accumulators and settings; tensors are the live ones (clone to snapshot)."""
        return {
            "dim": (*self.sites, self.D),
            "track_mean": self.track_mean,
            "totals": str(self.totals).removeprefix("torch."),
            "state": None if self._state is None else dict(self._state),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the shape and ``track_mean`` must match."""
        if not isinstance(sd, dict) or "state" not in sd:
            raise TypeError(f"state_dict: expected the dict of Covariance.state_dict(), got {type(sd).__name__}")
        if tuple(sd.get("dim", ())) != (*self.sites, self.D) or sd.get("track_mean") != self.track_mean:
            raise ValueError(f"state_dict: dim/track_mean {sd.get('dim')}/{sd.get('track_mean')} do "
                             f"not match {(*self.sites, self.D)}/{self.track_mean}")
        state = sd["state"]
        if state is None:
            self._state = None
            return
        device = self._device or next(iter(state.values())).device
        second = "m2" if self.track_mean else "gram"
        # the totals keep this accumulator's dtype (a float64 state loaded into float32 totals
        # is rounded once, a float32 one widened exactly)
        self._state = {k: v.detach().to(device=device, dtype=self.totals if k == second else v.dtype).clone()
                       for k, v in state.items()}
        self._device = device

    def __repr__(self) -> str:
        where = "empty" if self._state is None else str(self._device)
        totals = "" if self.totals == torch.float64 else ", totals=torch.float32"
        return (f"Covariance(dim={(*self.sites, self.D)}, track_mean={self.track_mean}, "
                f"backend={self.backend!r}{totals}, {where})")
