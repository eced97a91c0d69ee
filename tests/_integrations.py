"""What the trainer integrations' tests share: the environment of their subprocesses, a cached
runner of a training harness under torchrun, and the check of the version warning at import."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def env(*paths: Path) -> dict:
    """``os.environ`` with the fastspec under test (and ``paths``) first on ``PYTHONPATH`` and one
    OpenMP thread per process (two ranks on two cores)."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *map(str, paths), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out["OMP_NUM_THREADS"] = "1"
    return out


def runner(tmp_path_factory, harness: Path, *fixed: str, paths: tuple[Path, ...] = ()) -> Callable[..., list[dict]]:
    """``run(*args, nproc=2)`` -> each rank's ``rank{r}.json`` of ``harness --out DIR *fixed *args``
    under torchrun (``nproc`` ranks), cached per argument list for the life of the runner."""
    cache: dict[tuple, list[dict]] = {}

    def run(*args: str, nproc: int = 2) -> list[dict]:
        key = (nproc, *args)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{harness.stem.lstrip('_')}_run")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(harness), "--out", str(out), *fixed, *args]
            res = subprocess.run(cmd, check=False, env=env(*paths), capture_output=True, text=True, timeout=170)
            if res.returncode != 0:
                pytest.fail(f"{' '.join(cmd[3:])} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}", pytrace=False)
            cache[key] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
        return cache[key]

    return run


def check_version_warning(monkeypatch, module, dist: str, version: str, warns: bool) -> None:
    """Reimports ``module`` with ``dist`` reported at ``version``: one one-line warning naming the
    tested range (``module.TESTED``) and the version if ``warns``, none otherwise; ``module`` is
    reimported as it was afterwards."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: version if name == dist else real(name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.reload(module)
        mine = [w for w in caught if dist in str(w.message)]
        assert len(mine) == int(warns)
        if warns:
            message = str(mine[0].message)
            assert module.TESTED in message and version in message and "\n" not in message
    finally:
        monkeypatch.undo()
        importlib.reload(module)
