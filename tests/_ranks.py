"""Two gloo ranks on CPU for the distributed tests (tests/test_probe_distributed.py,
test_probe_parallel.py, test_probe_native.py): :func:`start_ranks`.

The ranks are forked from a fork server, a fresh process started on first use (torch,
transformers and fastspec imported there once per test process), not from the test process
itself: under torch 2.11 a process that has compiled a function (``torch.compile``, an opcheck)
and then run a backward through it leaves the autograd engine unusable in a child it forks
("Unable to handle autograd's threading in combination with fork-based multiprocessing"). In one
process running the whole suite that depends on which tests ran before, so it surfaced when
pytest-xdist dealt the modules out in another order (CI's gpu-stack stage, 2026-12-06:
tests/test_eig_dispatch.py's compile and autograd tests before test_probe_parallel.py). A
spawned rank would import torch and transformers anew each time (~5 s); the fork server does it
once.
"""
from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch.multiprocessing as mp

PRELOAD = ["torch", "transformers", "fastspec"]


def start_ranks(worker, *args, nprocs: int = 2) -> None:
    """Run ``worker(rank, *args)`` for rank 0 .. nprocs - 1 in processes of their own and wait for
    them; a rank's exception is raised here (``torch.multiprocessing.ProcessRaisedException``).
    ``worker`` must be importable by name (a module-level function of a test module)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts, the first time
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_variant(out: dict, name: str, fn) -> None:
    """On a rank: ``out[name] = fn()``, or its error and traceback (the other variants go on; the
    parent's test reports it, :func:`results`)."""
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported by the parent's test
        out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def results(outs: list[dict], name: str) -> list[dict]:
    """Every rank's result of variant ``name``; fails the test with a rank's traceback if one raised."""
    res = [out[name] for out in outs]
    for r, x in enumerate(res):
        if isinstance(x, dict) and "error" in x and "traceback" in x:
            pytest.fail(f"rank {r}, {name}: {x['error']}\n{x['traceback']}")
    return res
