"""Self-checks run ahead of use (:mod:`fastspec.selfcheck` runs each one at its first use).

* :func:`up_front`: what ``Covariance(device=...)`` and :meth:`fastspec.Probe.attach` call, so the
  checks their sites will need run before a compiled graph or a CUDA-graph capture could meet
  the kernels unchecked (a check never runs inside either);
* :func:`every_configuration` and :func:`check_everything`: ``fastspec info --check``, every
  kernel configuration of the visible GPU, as a table (the GPU kit's first command runs it).

Apart from :mod:`fastspec.selfcheck` because it reaches into every kernel's module (routes, the
Triton launcher, the eigensolver's launcher), which all import that one.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from . import selfcheck
from .selfcheck import Check, SelfCheckWarning

__all__ = ["check_everything", "every_configuration", "up_front"]


def up_front(device: torch.device, D: int, track_mean: bool, settings=None, sites: int = 1,
             dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,), rows: int = 16384) -> list[Check]:
    """Run now the checks an accumulator's updates and spectra will need on ``device`` (what
    ``Covariance(device=...)`` and :meth:`fastspec.Probe.attach` call): the update of ``D``-wide
    rows of each of ``dtypes`` as the precision policy plans it (``settings``; the exact route
    ``rows`` rows per site take, or the float32 Triton settings), and the CUDA eigensolver at
    ``n = D`` in the spectrum's dtype for ``sites`` matrices. Nothing where checks are off, the
    device is not checked, or a trace or a capture is running. Returns the checks this call ran
    or found (a configuration checked before is not checked again)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # as the tensors' devices will say
    if not selfcheck.enabled() or not selfcheck.applies(device) or not selfcheck.can_run_now(device):
        return []
    from .covariance import routes
    from .covariance.policy import UpdateSettings, solve_dtype, update_plan

    settings = UpdateSettings() if settings is None else settings
    before = len(selfcheck._results)
    for dtype in dtypes:
        x = torch.empty(1, 1, 1, D, dtype=dtype, device=device)  # [B, T, S, D]: only its kind is read
        plan = update_plan(settings, track_mean, x)
        if plan.backend == "triton":
            from .covariance import triton_update

            triton_update.serving(x, track_mean)
        elif plan.products == torch.float64 and not track_mean:
            routes.choose(x, rows)
    from .eig import limits, native

    if device.type == "cuda" and D <= limits.AUTO_MAX_N and native.status("cuda")[0]:
        from .eig import cuda
        from .eig.nvrtc import KernelUnavailable

        try:
            cuda.prepare(D, solve_dtype("eig" if track_mean else "sv", device), device, batch=max(1, sites))
        except KernelUnavailable as exc:  # no kernel here: the solve falls back to torch (said at that call)
            selfcheck.log.debug("fastspec self-check: no CUDA eigensolver to check (%s)", exc)
    return list(selfcheck._results.values())[before:]


def every_configuration(device: torch.device) -> list[tuple[str, str, Callable[[], bool | None]]]:
    """What ``fastspec info --check`` runs on a GPU: ``[(kernel, config, check), ...]``, each
    ``check()`` a configuration's self-check (True/False; it raises where the kernel cannot be
    built). The exact routes that can run here at D 64 and 128 for each 16/32-bit dtype; every
    float32 Triton candidate (keys at D 128, raw and centred; FFN at D 512, centred) in bf16 and
    the fixed settings (fp32 at D 128, 16-bit at D 64); every eigensolver algorithm at float32
    n 64 and 128 and float64 n 128 where it takes them (cuSolverDx's heev where it can be built)."""
    from .covariance import routes

    out: list[tuple[str, str, Callable[[], bool | None]]] = []
    for name in routes.ROUTES:
        if name == "blocked":
            continue
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for D in (64, 128):
                why = routes.status(name, device, dtype, D)
                out.append((f"exact route {name}", f"{str(dtype)[6:]} D={D}",
                            (lambda n=name, t=dtype, d=D: routes.self_check(n, device, t, d)) if not why
                            else _not_here(why)))
    try:
        from .covariance import triton_configs, triton_update
    except ImportError as exc:
        out.append(("float32 Triton update", "every candidate", _not_here(f"Triton is not importable ({exc})")))
    else:
        triton_cases = [(c, torch.bfloat16, 128, center) for c in triton_configs.CANDIDATES["keys"]
                        for center in (False, True)]
        triton_cases += [(c, torch.bfloat16, 512, True) for c in triton_configs.CANDIDATES["ffn"]]
        triton_cases += [(None, torch.float32, 128, False), (None, torch.float32, 128, True),
                         (None, torch.bfloat16, 64, False), (None, torch.bfloat16, 64, True)]
        for cand, dtype, D, center in triton_cases:
            out.append((f"float32 Triton update ({'fixed settings' if cand is None else cand.name})",
                        f"{str(dtype)[6:]} D={D} {'centred' if center else 'raw sums'}",
                        lambda c=cand, t=dtype, d=D, ce=center: triton_update._self_check(device, t, d, ce, c)))
    from .eig import native, variants

    ok, why = native.status("cuda")
    for algo in variants.names():
        for dtype, n in (("float32", 64), ("float32", 128), ("float64", 128)):
            if not variants.takes(algo, n, dtype):
                continue
            out.append((f"eigensolver {algo}", f"{dtype} n={n}",
                        (lambda a=algo, t=dtype, m=n: _eig_check(device, a, t, m)) if ok else _not_here(why)))
    return out


def _not_here(why: str) -> Callable[[], bool | None]:
    def check() -> bool | None:
        raise _NotHere(why)

    return check


class _NotHere(Exception):
    """A configuration that cannot run here (no kernel to check)."""


def _eig_check(device: torch.device, algo: str, dtype: str, n: int) -> bool | None:
    from .eig import cuda

    index = device.index if device.index is not None else torch.cuda.current_device()
    cuda.prepare(n, dtype, index, batch=8, algo=algo)  # KernelUnavailable: not built, or failed its check
    return True


def check_everything(device: torch.device, time_limit: float | None = None) -> list[dict]:
    """Run :func:`every_configuration` on ``device`` (no new check after ``time_limit``
    seconds): one row per configuration, ``{"kernel", "config", "verdict", "seconds", "error"}``
    with verdict ``passed``, ``FAILED``, ``cannot run here`` (the reason in ``error``) or
    ``not run`` (the time limit)."""
    from .eig.nvrtc import KernelUnavailable

    start = time.perf_counter()
    rows_out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SelfCheckWarning)  # the table says it, once per row
        for kernel, config, check in every_configuration(device):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                rows_out.append({"kernel": kernel, "config": config, "verdict": "not run", "seconds": 0.0,
                                 "error": f"past --time-limit {time_limit:g} s"})
                continue
            t0, before = time.perf_counter(), len(selfcheck._results)
            try:
                ok = check()
                new = list(selfcheck._results.values())[before:]
                error = next((c.error for c in new if not c.ok), "")
                verdict = "passed" if ok and not error else "FAILED"
            except _NotHere as exc:
                verdict, error = "cannot run here", str(exc)
            except KernelUnavailable as exc:
                failed = "self-check" in str(exc)
                verdict, error = ("FAILED" if failed else "cannot run here"), str(exc)
            except Exception as exc:  # a build failure of a Triton kernel, say: reported, the rest go on
                verdict, error = "FAILED", f"{type(exc).__name__}: {exc}"
            rows_out.append({"kernel": kernel, "config": config, "verdict": verdict,
                             "seconds": round(time.perf_counter() - t0, 4), "error": error})
    return rows_out
