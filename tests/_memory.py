"""What the memory tests share (tests/test_covariance_inplace.py, test_probe_memory.py,
test_probe_scale.py): an allocation tracker and the least budget a layout of the plan needs."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastspec.probe import plan


class Allocations(TorchDispatchMode):
    """The most bytes of new tensor storage alive at once among those created inside the mode
    (views of what came in are not new): what a piece of work allocates beside its inputs. Storage
    allocated inside a kernel (torch's eigensolver's copy of its input) is not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in inputs and key not in self._seen and st.nbytes():
                    self._seen.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, st.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def least_budget(stage: plan.Stage, mode: str, totals: str, fit: int | None = None,
                 ranks: plan.Ranks | None = None) -> int:
    """The least budget under which ``plan.plan`` picks this layout: its worst rank's peak."""
    ranks = ranks or plan.Ranks(device="cpu")
    layers = [l for l, _ in stage.wide]
    layout = plan.Layout(mode, totals, ranks, plan._assign(layers, ranks, mode))
    if fit is not None:
        layout = plan._rotate(layout, fit)
    return plan.worst(stage, layout).peak


class FFNRows:
    """Every FFN input a model's down projections receive, per layer (this rank's columns of a
    DTensor), as the probe sees them: ``rows[layer]`` a list, one tensor a forward."""

    def __init__(self, model):
        self.rows: dict[int, list[torch.Tensor]] = {}
        self._h = [layer.mlp.down_proj.register_forward_pre_hook(self._hook(i))
                   for i, layer in enumerate(model.model.layers)]

    def _hook(self, i):
        def hook(mod, args):
            x = args[0]
            self.rows.setdefault(i, []).append((x.to_local() if hasattr(x, "to_local") else x).detach().clone())
        return hook

    def take(self) -> dict[int, list[torch.Tensor]]:
        rows, self.rows = self.rows, {}
        return rows

    def remove(self) -> None:
        for h in self._h:
            h.remove()


def ffn_reference(rows: list[torch.Tensor], masks: list[torch.Tensor]) -> dict[str, float]:
    """Eig-convention metrics of the float64 covariance of the kept rows (``masks``: ``[B, T]``)."""
    from fastspec.metrics import summarize

    X = torch.cat([r.double()[m.bool()] for r, m in zip(rows, masks)])
    lam = torch.linalg.eigvalsh(torch.cov(X.T)).flip(-1).clamp_min(0)
    m = summarize(lam[None]).as_dict()
    return {"participation_ratio": m["participation_ratio"].item(), "entropy_rank": m["entropy_rank"].item(),
            "sui": m["sui"].item(), "n": float(X.shape[0])}
