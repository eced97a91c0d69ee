"""Integrations: push probe records to TensorBoard and W&B, and stream the probe inside the
Hugging Face, Lightning, OLMo-core and TorchTitan trainers and Megatron-core training loops.

Each integration lives in its own module and imports its library only there, so
``import fastspec`` (and this package) work without any of them:

=============================  ===============================================
``integrations.tensorboard``   ``log_to_tensorboard(writer, records)``
``integrations.wandb``         ``log_to_wandb(records, run=None)``
``integrations.lightning``     ``FastspecStreamCallback``: streaming over the training tokens, metrics in
                               the trainer's loggers, state in its checkpoints (docs/lightning.md);
                               ``FastspecCallback``: the eval protocol on a fixed batch
``integrations.hf``            ``FastspecStreamCallback``: streaming over the training tokens, metrics in
                               the Trainer's logs, state in its checkpoints (docs/hf.md);
                               ``FastspecTrainerCallback``: the eval protocol on a fixed batch
``integrations.olmo_core``     ``FastspecCallback`` (OLMo-core ``Callback``): streaming over the
                               training tokens, metrics in OLMo-core's loggers (docs/olmo_core.md)
``integrations.torchtitan``    ``FastspecTrainer`` (a TorchTitan ``Trainer``; config section ``fastspec``):
                               streaming during pre-training, FSDP/TP/compile (docs/torchtitan.md)
``integrations.megatron``      ``FastspecStream(model)``: streaming in a Megatron-core loop, one ``step(iteration)``
                               per optimizer step, DP/TP/PP, Megatron-LM's writers (docs/megatron.md)
``integrations.alerts``        ``RankCollapseAlert(threshold=, drop=).check(records)``: rank-collapse
                               alerts, also ``alerts=`` of both callbacks (docs/alerts.md)
=============================  ===============================================

All of them log the same flat scalars (:func:`scalars`) and optionally one layer × head
heatmap image (:func:`heatmap`).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ._records import as_dicts
from .alerts import Alert, RankCollapseAlert

__all__ = ["Alert", "RankCollapseAlert", "as_dicts", "heatmap", "heatmap_image", "scalars"]


def scalars(records, prefix: str = "fastspec") -> dict[str, float]:
    """Flat ``{tag: value}`` of records from one measurement (the aggregation of docs/protocols.md).

    ``{prefix}/{site}/{metric}/layer{l}``: mean over heads of layer l;
    ``{prefix}/{site}/{metric}/mean``: mean over layers of those;
    ``{prefix}/{site}/{metric}``: records outside the layer stack (``layer`` None), head-averaged.

    Streaming records (``protocol="stream"``) get their own tags, ``{prefix}/stream/{site}/...``:
    they measure other tokens than an eval measurement of the same step and are never averaged
    with it.
    """
    per_layer: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    loose: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in as_dicts(records):
        site = f"stream/{r['site']}" if r.get("protocol") == "stream" else r["site"]
        if r["layer"] is None:
            loose[(site, r["metric"])].append(float(r["value"]))
        else:
            per_layer[(site, r["metric"], int(r["layer"]))].append(float(r["value"]))
    out: dict[str, float] = {}
    layer_means: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (site, metric, layer), vals in sorted(per_layer.items()):
        v = float(np.mean(vals))
        out[f"{prefix}/{site}/{metric}/layer{layer}"] = v
        layer_means[(site, metric)].append(v)
    for (site, metric), vals in layer_means.items():
        out[f"{prefix}/{site}/{metric}/mean"] = float(np.mean(vals))
    for (site, metric), vals in loose.items():
        out[f"{prefix}/{site}/{metric}"] = float(np.mean(vals))
    return out


def heatmap(records, site: str = "keys", metric: str = "participation_ratio") -> np.ndarray:
    """``[layers, heads]`` array of one measurement's per-head values (NaN where absent).

    Rows are the sorted layer indices present, columns the sorted head indices present. Given
    both eval and streaming records, draws the eval ones.
    """
    rows = [r for r in as_dicts(records) if r["site"] == site and r["metric"] == metric
            and r["layer"] is not None and r["head_index"] is not None]
    if not rows:
        raise ValueError(f"records: no per-head records for {site}/{metric}")
    if len({r["protocol"] for r in rows}) > 1:  # an eval and a streaming measurement: draw the eval one
        rows = [r for r in rows if r["protocol"] == "eval"]
    layers = sorted({int(r["layer"]) for r in rows})
    heads = sorted({int(r["head_index"]) for r in rows})
    grid = np.full((len(layers), len(heads)), np.nan)
    li, hi = {layer: i for i, layer in enumerate(layers)}, {h: i for i, h in enumerate(heads)}
    for r in rows:
        grid[li[int(r["layer"])], hi[int(r["head_index"])]] = float(r["value"])
    return grid


def heatmap_image(grid: np.ndarray, scale: int = 16) -> np.ndarray:
    """``[H·scale, W·scale, 3]`` uint8 viridis rendering of ``grid`` (min..max; NaN black), one
    block of ``scale`` pixels per cell so small head grids stay visible in a dashboard."""
    grid = np.asarray(grid, dtype=float)
    finite = np.isfinite(grid)
    lo, hi = (grid[finite].min(), grid[finite].max()) if finite.any() else (0.0, 1.0)
    norm = np.where(finite, (grid - lo) / (hi - lo) if hi > lo else 0.5, 0.0)
    try:
        from matplotlib import colormaps

        rgb = colormaps["viridis"](norm)[..., :3]
    except ImportError:  # matplotlib is optional here: fall back to grey levels
        rgb = np.repeat(norm[..., None], 3, axis=-1)
    rgb[~finite] = 0.0
    img = (rgb * 255).round().astype(np.uint8)
    return img.repeat(scale, axis=0).repeat(scale, axis=1)

