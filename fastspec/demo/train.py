"""The demo's training loop: three conditions, same seed and data order, probed on a schedule.

Every ``probe_every`` steps (and before the first and after the last step) each model runs the
eval protocol (docs/protocols.md) through :class:`fastspec.Probe` on the fixed held-out batch: post-RoPE
key PR per head (``sv``), FFN post-activation metrics (``eig``) and, for QK-norm models, the
γ coefficient of variation. Eval and train loss are recorded at the same steps. Records are
appended to ``records.jsonl`` as they are produced, so Ctrl-C leaves a readable run folder;
the report is written in a ``finally`` either way.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from .. import _args
from .data import VOCAB_SIZE, eval_batch, random_windows, split, stdlib_corpus
from .models import CONDITIONS, ModelSize, build_model


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (saved as ``config.json``)."""

    size: ModelSize = dataclasses.field(default_factory=ModelSize)
    steps: int = 120
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 20
    probe_every: int = 10
    eval_sequences: int = 4
    corpus_bytes: int = 4_000_000
    seed: int = 0
    device: str = "cpu"
    conditions: tuple[str, ...] = CONDITIONS

    def __post_init__(self):
        minimum = dict.fromkeys(("steps", "batch_size", "probe_every", "eval_sequences", "corpus_bytes"), 1)
        minimum.update(warmup=0, seed=0)
        for name, low in minimum.items():  # (frozen: store plain ints and floats)
            object.__setattr__(self, name, _args.integer(name, getattr(self, name), minimum=low))
        object.__setattr__(self, "lr", _args.real("lr", self.lr, "a finite number > 0", lambda v: v > 0))
        object.__setattr__(self, "weight_decay", _args.real("weight_decay", self.weight_decay,
                                                            "a finite number >= 0", lambda v: v >= 0))
        bad = [c for c in self.conditions if c not in CONDITIONS]
        if bad or not self.conditions or len(set(self.conditions)) != len(self.conditions):
            raise ValueError(f"conditions: expected a non-empty subset of {CONDITIONS} without repeats, "
                             f"got {self.conditions}")
        # the fixed eval batch is cut from the held-out tail (a tenth of the corpus)
        if self.size.seq_len >= self.corpus_bytes // 10:
            raise ValueError(f"seq_len: expected fewer than {self.corpus_bytes // 10} tokens (the held-out "
                             f"text), got {self.size.seq_len}")
        if not isinstance(self.device, str):
            raise ValueError(f"device: expected a device name such as 'cpu' or 'cuda', got {self.device!r}")


def check_device(device: str) -> None:
    """Raise ValueError naming ``device`` unless torch can use it here: ``cpu``, ``cuda``/``cuda:N``
    with CUDA available and N below the device count, or ``mps`` where available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected cpu, cuda, cuda:N or mps, got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} but CUDA is not available here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device: expected cuda:0 to cuda:{n - 1} ({n} CUDA device(s)), got {device!r}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device: {device!r} but MPS is not available here (torch.backends.mps.is_available() "
                             "is False)")
    elif dev.type != "cpu":
        raise ValueError(f"device: expected cpu, cuda, cuda:N or mps, got {device!r}")


def check_out_dir(out: Path) -> None:
    """Raise ValueError naming ``out_dir`` unless ``out`` can hold a new run: a folder (or a path
    still to be made) without a ``records.jsonl``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} is a file; expected a folder")
    if (out / "records.jsonl").exists():
        raise ValueError(f"out_dir: {out} already holds a run (records.jsonl); choose another folder")


class RecordWriter:
    """Appends records as JSON lines and flushes each batch, so a killed run stays readable."""

    def __init__(self, path: Path):
        self._f = path.open("a")

    def write(self, rows) -> None:
        for r in rows:
            self._f.write(json.dumps(r) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _optimizer(model: torch.nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    # decay matrices only; norm scales (γ included) and nothing frozen go to the optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _lr_factor(step: int, cfg: DemoConfig) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, batch: dict) -> float:
    was_training = model.training
    model.eval()
    try:
        return float(model(**batch, labels=batch["input_ids"]).loss)
    finally:
        model.train(was_training)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True)


def _train_condition(condition: str, cfg: DemoConfig, train_tokens, batch_eval: dict,
                     writer: RecordWriter, spectra: dict, progress: bool) -> None:
    from ..probe import Probe

    device = torch.device(cfg.device)
    model = build_model(condition, cfg.size, VOCAB_SIZE, cfg.seed).to(device)
    model.train()
    opt = _optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)  # same data order for every condition
    probe = Probe(model, keys=True, ffn=True)
    tokens_per_step = cfg.batch_size * cfg.size.seq_len
    losses: list[torch.Tensor] = []  # kept on device: no host sync per step

    bar = _progress(cfg.steps, condition, progress)

    def measure(step: int) -> None:
        tokens = step * tokens_per_step
        rows = [{**r.as_dict(), "condition": condition}
                for r in probe.measure(batch_eval, step=step, tokens_seen=tokens)]
        loss_row = {"step": step, "tokens_seen": tokens, "site": "loss", "layer": None, "head_index": None,
                    "protocol": None, "condition": condition}  # a loss is no probe measurement: no protocol
        eval_loss = _eval_loss(model, batch_eval)
        rows.append({**loss_row, "metric": "eval_loss", "value": eval_loss})
        if losses:  # mean training loss since the previous probe
            rows.append({**loss_row, "metric": "train_loss", "value": float(torch.stack(losses).mean())})
            losses.clear()
        writer.write(rows)
        if bar is not None:
            bar.set_postfix(eval_loss=f"{eval_loss:.3f}")

    try:
        measure(0)
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * _lr_factor(step, cfg)
            ids = random_windows(train_tokens, cfg.batch_size, cfg.size.seq_len, gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if bar is not None:
                bar.update(1)
            done = step + 1
            if done % cfg.probe_every == 0 or done == cfg.steps:
                measure(done)
    except KeyboardInterrupt:
        spectra.update(_final_spectra(condition, probe, batch_eval))  # the stopped model is plotted too
        raise
    finally:
        if bar is not None:
            bar.close()
    spectra.update(_final_spectra(condition, probe, batch_eval))


def _final_spectra(condition: str, probe, batch: dict) -> dict[str, np.ndarray]:
    """Every probed site's spectra per layer, for the spectrum plots, from one eval forward of
    the probe (:meth:`fastspec.Probe.spectra`): ``{"<condition>/<site>/layer<l>": ...}`` with the
    FFN post-activation covariance eigenvalues (``eig``, docs/protocols.md) ``λ [d_ff]`` and the
    post-RoPE keys' singular values (``sv``) per KV head ``σ [kv_heads, d_head]``, descending."""
    return {f"{condition}/{site}/layer{layer}": spec.cpu().numpy()
            for (site, layer), spec in probe.spectra(batch).items()}


def run_demo(cfg: DemoConfig, out_dir, *, progress: bool = True) -> tuple[Path, str]:
    """Train and probe every condition of ``cfg``, writing a run folder at ``out_dir``.

    Returns (run folder, status) with status ``"completed"`` or ``"interrupted"`` (Ctrl-C);
    ``config.json``, ``records.jsonl``, ``spectra.npz``, ``plots/`` and ``report.md`` exist
    in both cases. The device and ``out_dir`` are checked before anything is written (ValueError
    naming them); an exception during the run marks ``config.json`` ``"failed"`` (with the error)
    and propagates.
    """
    from ..report import write_report

    check_device(cfg.device)
    out = Path(out_dir)
    check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "model": dataclasses.asdict(cfg.size),
            "train": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "size"},
            "corpus": "Python standard library source (bytes)", "torch": torch.__version__}
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    writer = None
    spectra: dict[str, np.ndarray] = {}
    status = "failed"  # until the loop ends or Ctrl-C stops it
    try:
        torch.manual_seed(cfg.seed)
        train_tokens, held_out = split(stdlib_corpus(cfg.corpus_bytes))
        batch_eval = {k: v.to(cfg.device) for k, v in
                      eval_batch(held_out, cfg.eval_sequences, cfg.size.seq_len, cfg.seed + 1).items()}
        writer = RecordWriter(out / "records.jsonl")
        for condition in cfg.conditions:
            _train_condition(condition, cfg, train_tokens, batch_eval, writer, spectra, progress)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
    except BaseException as e:
        meta["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if writer is not None:
            writer.close()
        if spectra:
            np.savez(out / "spectra.npz", **spectra)
        meta["status"] = status
        meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        (out / "config.json").write_text(json.dumps(meta, indent=2))
        if status != "failed":
            write_report(out)
        elif writer is not None:
            try:  # what the failed run measured, if anything; the run's own error is the one raised
                write_report(out)
            except Exception:  # noqa: BLE001
                pass
    return out, status
