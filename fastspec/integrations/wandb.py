"""Weights & Biases: probe records as one ``run.log`` call (scalars + heatmap image)."""
from __future__ import annotations

from . import as_dicts, heatmap, heatmap_image, scalars


def log_to_wandb(records, *, run=None, step: int | None = None, prefix: str = "fastspec",
                 heatmap_of: tuple[str, str] | None = ("keys", "participation_ratio"), alerts=None) -> dict:
    """Log :func:`fastspec.integrations.scalars` of ``records`` (and the ``heatmap_of`` grid as a
    ``wandb.Image`` under ``{prefix}/{site}/{metric}/heatmap``) to ``run`` (default ``wandb.run``).

    ``alerts``: the :class:`~fastspec.integrations.alerts.Alert` list that
    ``RankCollapseAlert.check`` returned for these records: their number is logged as
    ``{prefix}/alerts`` and each one is sent as a W&B alert (``run.alert``, level WARN: the
    run's page and the notifications set up in W&B).
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
    if alerts is not None:
        payload[f"{prefix}/alerts"] = len(alerts)
    run.log(payload, step=step)
    for a in alerts or ():
        layer = "" if a.layer is None else f" layer {a.layer}"
        run.alert(title=f"fastspec {a.kind}: {a.site}{layer}"[:63], text=a.message, level="WARN")
    return payload
