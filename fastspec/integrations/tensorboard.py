"""TensorBoard: probe records as scalars plus a layer × head heatmap image.

Works with ``torch.utils.tensorboard.SummaryWriter`` (or tensorboardX's, same methods).
"""
from __future__ import annotations

from . import as_dicts, heatmap, heatmap_image, scalars


def log_to_tensorboard(writer, records, *, step: int | None = None, prefix: str = "fastspec",
                       heatmap_of: tuple[str, str] | None = ("keys", "participation_ratio"),
                       alerts=None) -> dict[str, float]:
    """Write :func:`fastspec.integrations.scalars` of ``records`` with ``writer.add_scalar`` and,
    when those records exist, the ``heatmap_of=(site, metric)`` grid as image
    ``{prefix}/{site}/{metric}/heatmap`` (rows = layers, columns = heads).

    ``alerts``: the :class:`~fastspec.integrations.alerts.Alert` list that
    ``RankCollapseAlert.check`` returned for these records: their number goes to scalar
    ``{prefix}/alerts`` and, when there are any, their messages to text ``{prefix}/alerts/messages``.
    ``step``: default the records' largest ``step``. Returns the logged scalars.
    """
    rows = as_dicts(records)
    if not rows:
        return {}
    step = max(int(r["step"]) for r in rows) if step is None else step
    values = scalars(rows, prefix)
    if alerts is not None:
        values[f"{prefix}/alerts"] = float(len(alerts))
        if alerts:
            writer.add_text(f"{prefix}/alerts/messages", "\n\n".join(a.message for a in alerts), global_step=step)
    for tag, v in values.items():
        writer.add_scalar(tag, v, global_step=step)
    if heatmap_of is not None and any(r["site"] == heatmap_of[0] and r["metric"] == heatmap_of[1]
                                      and r["head_index"] is not None for r in rows):
        img = heatmap_image(heatmap(rows, *heatmap_of))
        writer.add_image(f"{prefix}/{heatmap_of[0]}/{heatmap_of[1]}/heatmap", img, global_step=step,
                         dataformats="HWC")
    writer.flush()
    return values
