"""Weights & Biases: probe records as one ``run.log`` call (scalars + heatmap image)."""
from __future__ import annotations

from . import as_dicts, heatmap, heatmap_image, scalars


def log_to_wandb(records, *, run=None, step: int | None = None, prefix: str = "fastspec",
                 heatmap_of: tuple[str, str] | None = ("keys", "participation_ratio")) -> dict:
    """Log :func:`fastspec.integrations.scalars` of ``records`` (and the ``heatmap_of`` grid as a
    ``wandb.Image`` under ``{prefix}/{site}/{metric}/heatmap``) to ``run`` (default ``wandb.run``).

    ``step``: the W&B step (default: the records' largest ``step``; W&B requires it not to
    decrease between calls). Returns the logged dict.
    """
    import wandb

    run = run if run is not None else wandb.run
    if run is None:
        raise ValueError("run: no active W&B run; call wandb.init() first or pass run=")
    rows = as_dicts(records)
    if not rows:
        return {}
    step = max(int(r["step"]) for r in rows) if step is None else step
    payload: dict = dict(scalars(rows, prefix))
    if heatmap_of is not None and any(r["site"] == heatmap_of[0] and r["metric"] == heatmap_of[1]
                                      and r["head_index"] is not None for r in rows):
        payload[f"{prefix}/{heatmap_of[0]}/{heatmap_of[1]}/heatmap"] = wandb.Image(
            heatmap_image(heatmap(rows, *heatmap_of)), caption="rows: layers, columns: heads")
    run.log(payload, step=step)
    return payload
