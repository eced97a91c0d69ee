"""The team emulation of the CUDA eigensolver's algorithms (``csrc/eig_host.cpp``) as
test helpers: run an algorithm by a team of ranks, the accuracy criterion, and the barrier-mutation
check. Used by ``tests/test_eig_host.py`` (the block algorithm) and the candidates' test files
(``tests/test_eig_packed.py``, ``tests/test_eig_regs.py``, ``tests/test_eig_split.py``).

The barrier-mutation check: every ``FS_SYNC`` barrier an algorithm passes is recorded with its
site (its header's ``FS_SITE_BASE`` + line); leaving one out (every thread skips it) merges two phases, and with the threads run
one at a time in rank order and then in reverse rank order, a read of something another thread
writes in the merged phase sees it written in one order and not yet in the other. A barrier site
whose removal changes no result in either order is either redundant or not exercised by the
input; :func:`unseen_sites` reads the sites annotated ``// unseen: <why>`` in the sources, and the
check asserts that the undetected sites are exactly those.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from fastspec.eig import native, nvrtc

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
CONCURRENT, FORWARD, REVERSE = 0, 1, 2

NO_EXT = pytest.mark.skipif(os.environ.get("FASTSPEC_NO_EXT") == "1",
                            reason="FASTSPEC_NO_EXT=1: native extension not built")
"""The emulation's test modules' ``pytestmark``: built on purpose without the extension, nothing to test."""


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Import it into a test module: its tests run torch on one thread. The emulation's
    concurrent schedule runs two OS threads and LAPACK's tiny reference calls gain nothing from
    more; on a shared 2-core box torch's own pool would only spin against them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


HARD_FAMILIES = ("indefinite", "graded-1e-8", "four-clusters", "rank-deficient", "wilkinson", "gram-activations",
                 "spd-1e30")
"""The families of :data:`fastspec.eig.matrices.FAMILIES` every candidate algorithm's battery runs."""


def battery_cases(sizes, slow, families=HARD_FAMILIES, dtypes=None) -> list:
    """The parameters of an emulation battery: ``(family, n)`` for every family and size, or
    ``(family, n, dtype)`` for every dtype too, with ids ``family-nN[-dtype]``; ``slow(family, n[,
    dtype])`` true marks a case for the full tier (``pytest --full``)."""
    from fastspec.eig.matrices import FAMILIES

    unknown = [f for f in families if f not in FAMILIES]
    assert not unknown, f"no such matrix families: {unknown}"
    out = []
    for family in families:
        for n in sizes:
            for dt in (None,) if dtypes is None else dtypes:
                args = (family, n) if dt is None else (family, n, dt)
                out.append(pytest.param(*args, id="-".join([family, f"n{n}", *([dt] if dt else [])]),
                                        marks=pytest.mark.slow if slow(*args) else ()))
    return out


def team(A: torch.Tensor, algo: str = "block", schedule: int = CONCURRENT, drop: int = -1
         ) -> tuple[torch.Tensor, list[int]]:
    """Eigenvalues of ``A: [B, n, n]`` by algorithm ``algo`` run by the team emulation, with the site of
    every ``FS_SYNC`` barrier passed, in order (:func:`fastspec.eig.native.team_eigvalsh`)."""
    return native.team_eigvalsh(A, algo, schedule, drop)


def reference(A: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.linalg.eigvalsh(A.double().numpy()))


def assert_within_torch_error(A32: torch.Tensor, ours: torch.Tensor) -> None:
    """``max |λ − λ_ref| <= 2 × torch fp32's error + 8·eps32·‖A‖`` (tests/test_eig_host.py says why)."""
    ref = reference(A32)
    torch_err = (torch.linalg.eigvalsh(A32).double() - ref).abs().max().item()
    our_err = (ours.double() - ref).abs().max().item()
    floor = 8 * EPS32 * ref.abs().max().item()
    assert our_err <= 2 * torch_err + floor, (
        f"error {our_err:.3g} > 2 x torch {torch_err:.3g} + floor {floor:.3g} (||A|| {ref.abs().max().item():.3g})")


def assert_fp64_close(A64: torch.Tensor, ours: torch.Tensor) -> None:
    """float64: within ``n·eps64·‖A‖`` of LAPACK (the classical bound; fails loudly on any fp32 step)."""
    ref = reference(A64)
    n = A64.shape[-1]
    assert (ours - ref).abs().max() <= n * EPS64 * ref.abs().max()


_SYNC = re.compile(r"FS_SYNC\(")
_UNSEEN = re.compile(r"//\s*unseen:")
_BASE = re.compile(r"^#define FS_SITE_BASE (\d+)", re.MULTILINE)


def headers_by_base() -> dict[int, str]:
    """``{FS_SITE_BASE: header}`` over the kernel's headers (each defines its own base)."""
    out = {}
    for h in nvrtc.HEADERS:
        m = _BASE.search((nvrtc.CSRC / h).read_text())
        if m:
            assert int(m.group(1)) not in out, f"{h} and {out.get(int(m.group(1)))} share FS_SITE_BASE"
            out[int(m.group(1))] = h
    return out


def site_name(site: int) -> str:
    """``eig_core.h:389`` for a recorded barrier site."""
    base = site // 10000 * 10000
    return f"{headers_by_base().get(base, f'base {base}')}:{site - base}"


def unseen_sites() -> set[int]:
    """The FS_SYNC sites annotated ``// unseen: <why>`` in the kernel's headers."""
    out = set()
    for base, h in headers_by_base().items():
        for i, ln in enumerate((nvrtc.CSRC / h).read_text().splitlines()):
            if _SYNC.search(ln) and _UNSEEN.search(ln):
                out.add(base + i + 1)
    return out


def mutation_check(A: torch.Tensor, algo: str, per_site: int = 3) -> dict[int, bool]:
    """Leave out each barrier site's first ``per_site`` instances in turn; ``{site: detected}``,
    detected when some instance's removal changes the results (bitwise) in forward or reverse order."""
    base, sites = team(A, algo, FORWARD)
    rev, _ = team(A, algo, REVERSE)
    assert torch.equal(base, rev), "the two serial orders disagree without any mutation: a race in the algorithm"
    tried: dict[int, int] = {}
    detected: dict[int, bool] = {}
    for k, site in enumerate(sites):
        if tried.get(site, 0) >= per_site or detected.get(site):
            continue
        tried[site] = tried.get(site, 0) + 1
        hit = any(not torch.equal(team(A, algo, order, drop=k)[0], base) for order in (FORWARD, REVERSE))
        detected[site] = detected.get(site, False) or hit
    return detected


def assert_barriers_needed(A: torch.Tensor, algo: str, per_site: int = 3) -> None:
    """Every barrier ``algo`` passes on ``A`` is shown needed by the mutation check, except the
    sites annotated ``// unseen: <why>``, which must stay undetected (an annotation the check
    contradicts is stale). Use a batch of 2 or more: barriers between matrices need a next one."""
    detected = mutation_check(A, algo, per_site)
    unseen = unseen_sites()
    missed = sorted(site_name(s) for s, hit in detected.items() if not hit and s not in unseen)
    stale = sorted(site_name(s) for s, hit in detected.items() if hit and s in unseen)
    assert not missed, f"leaving out these barriers changed nothing (redundant, or not exercised): {missed}"
    assert not stale, f"these barriers are marked '// unseen:' but the check detects them: {stale}"
