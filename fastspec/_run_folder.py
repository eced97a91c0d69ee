"""``config.json`` of a run folder, read the same way by both reports: ``fastspec report`` of a
``fastspec demo`` run (:mod:`fastspec.report`) and of a ``fastspec analyze`` folder
(:mod:`fastspec.checkpoints.report`, which may not import the former: the package has no import
cycles). Standard library only."""
from __future__ import annotations

import json
from pathlib import Path


def load_config(run_dir) -> dict:
    """``config.json`` of ``run_dir``, or {} when the run has none; a ValueError naming the file
    when it is not a JSON object."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:  # the decoder's message does not say which file
        raise ValueError(f"config.json: not JSON ({e.msg} at line {e.lineno}) in {run_dir}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config.json: expected a JSON object in {run_dir}, got {type(config).__name__}")
    return config
