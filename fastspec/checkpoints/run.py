"""The analysis loop of ``fastspec analyze``: one model at a time, the eval protocol over a fixed
token budget, each model's results written atomically so that a long series can be resumed.

Per model (``ModelSource``, ``sources.py``), in the series' step order:

1. **load**: ``transformers.AutoModel.from_pretrained``: the base model, without the language-model
   head (the analysis needs no logits, and the head is often the largest matmul of a small model),
   in ``dtype`` (bf16 on CUDA, fp32 on CPU by default), on ``device``;
2. **tokenize**: the text (``text.py``) with the model's own tokenizer, packed into
   ``ceil(tokens / seq_len)`` sequences chosen with ``seed``: every checkpoint of a series that
   shares a tokenizer sees the same tokens (the packed batch is cached by tokenizer);
3. **forward + probe**: :meth:`fastspec.Probe.measurement` over the batches: post-RoPE keys per
   KV head and queries per query head (``sv``), pre-RoPE keys where the family has a module for
   them, FFN inputs (``eig``) where the family is known, γ CV where the model has Q/K-norm;
   the captures' own work time is kept apart from the forward's;
4. **solve**: one eigensolve per shape; records and spectra together;
5. **write**: ``models/<label>/`` (``records.jsonl``, ``spectra.npz``, ``meta.json``) is written in a
   hidden temporary folder and renamed into place, so a model folder exists only complete. The
   folder-wide ``records.parquet`` (``records.csv`` without pyarrow) and ``config.json`` are
   rewritten (atomically) after every model; ``spectra.npz`` and the report when the run ends,
   also when it is interrupted (Ctrl-C: ``status`` "interrupted", the finished models intact).

The model is freed before the next one loads. An ``out`` that already holds finished models of the
same settings skips them (resume); one with other settings is refused.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import _args
from .text import TEXT_FORMATS

SITES = ("keys", "keys_prerope", "queries", "ffn")
DTYPES = ("float32", "bfloat16", "float16")
# settings that change the numbers: a folder is resumed only when they match
_SAME_FOR_RESUME = ("tokens", "seq_len", "seed", "text", "text_field", "text_format", "dtype", "sites")
# settings added later, and the value every folder written before them was made with
_BEFORE_IT_EXISTED = {"text_format": "auto"}


@dataclass
class Settings:
    """What one analysis measures (every field is checked by :func:`check_settings`)."""

    tokens: int = 32768
    seq_len: int = 1024
    batch_size: int = 4
    seed: int = 0
    text: str | None = None
    text_field: str = "text"
    text_format: str = "auto"   # text.TEXT_FORMATS: how --text's files are read
    device: str | None = None   # None: cuda when available, else cpu
    dtype: str | None = None    # None: bfloat16 on CUDA, float32 elsewhere
    sites: tuple[str, ...] = SITES


@dataclass
class Analysis:
    """What :func:`analyze` returns: the output folder, its status ("completed" or "interrupted"),
    the labels measured now and those a previous run had finished (``skipped``)."""

    out: Path
    status: str
    measured: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def records(self):
        """Every finished model's records as a DataFrame (:func:`fastspec.report.load_records`)."""
        from ..report import load_records

        return load_records(self.out)

    @property
    def report(self) -> Path:
        return self.out / "report.md"


def check_settings(s: Settings) -> Settings:
    """``s`` with its device and dtype resolved; raises ValueError naming the flag of a bad one."""
    import torch

    from ..demo.train import check_device

    s.tokens = _args.integer("--tokens", s.tokens, minimum=1)
    s.seq_len = _args.integer("--seq-len", s.seq_len, minimum=2)
    s.batch_size = _args.integer("--batch-size", s.batch_size, minimum=1)
    s.seed = _args.integer("--seed", s.seed, minimum=0)
    _args.text("--text-field", s.text_field)
    _args.choice("--text-format", s.text_format, TEXT_FORMATS)
    sites = tuple(s.sites)
    bad = [x for x in sites if x not in SITES]
    if bad or not sites:
        raise ValueError(f"--sites: expected some of {list(SITES)}, got {list(sites)}")
    s.sites = tuple(x for x in SITES if x in sites)
    if s.device is None:
        s.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(s.device)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    if s.dtype is None:
        s.dtype = "bfloat16" if torch.device(s.device).type == "cuda" else "float32"
    _args.choice("--dtype", s.dtype, DTYPES)
    return s


# ----------------------------------------------------------------------------- the output folder
def _write_atomic(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path``: a reader sees the old file or the new one."""
    # the suffix stays last: np.savez and to_parquet keep a name that ends in theirs as it is
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _write_json(path: Path, obj) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(obj, indent=1) + "\n"))


def _load_config(out: Path) -> dict | None:
    path = out / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def check_out(out: Path, settings: Settings) -> dict | None:
    """The config of a resumable analysis in ``out`` (None: a new folder); raises ValueError
    naming ``--out`` when ``out`` cannot be written, holds something else, or an analysis with
    other settings."""
    from .._paths import unwritable

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} is a file; expected a folder")
    config = _load_config(out)
    if out.is_dir() and config is None and any(out.iterdir()):
        raise ValueError(f"--out: {out} is not empty and holds no analysis (no config.json); choose a new folder")
    if config is not None:
        if config.get("command") != "analyze":
            raise ValueError(f"--out: {out} holds a run of another command ({config.get('command', 'demo')!r}); "
                             f"choose a new folder")
        old = config.get("settings", {})
        new = _settings_json(settings)
        for key in _SAME_FOR_RESUME:
            was = old.get(key, _BEFORE_IT_EXISTED.get(key))
            if was != new[key]:
                raise ValueError(f"--out: {out} holds an analysis with other settings ({key} {was!r}, "
                                 f"not {new[key]!r}); give the same settings to resume it, or another --out")
    reason = unwritable(out)
    if reason is not None:
        raise ValueError(f"--out: {reason}")
    return config


def _settings_json(s: Settings) -> dict:
    d = asdict(s)
    d["sites"] = list(s.sites)
    return d


def _done_models(out: Path) -> dict[str, dict]:
    """label -> meta of every finished model folder in ``out/models``."""
    done = {}
    root = out / "models"
    if root.is_dir():
        for meta in sorted(root.glob("*/meta.json")):
            with contextlib.suppress(json.JSONDecodeError, OSError):
                m = json.loads(meta.read_text())
                done[m["label"]] = m
    return done


def _write_records(out: Path, done: dict[str, dict], frames: dict) -> Path:
    """``records.parquet`` (``records.csv`` without pyarrow) of every finished model, atomically.
    ``frames`` (label -> DataFrame) keeps each model's records once read: rewriting the table after
    every model of a long series reads each model's file once, not once per model after it."""
    import pandas as pd

    for label in done:
        if label not in frames:
            frames[label] = pd.read_json(out / "models" / label / "records.jsonl", lines=True, dtype=False)
    df = pd.concat([frames[label] for label in done], ignore_index=True) if done else pd.DataFrame()
    for col in ("tokens_seen", "layer", "head_index"):
        if col in df:
            df[col] = df[col].astype("Int64")
    try:
        import pyarrow  # noqa: F401
        path = out / "records.parquet"
        _write_atomic(path, lambda p: df.to_parquet(p, index=False))
    except ImportError:
        path = out / "records.csv"
        _write_atomic(path, lambda p: df.to_csv(p, index=False))
    return path


def _write_spectra(out: Path, done: dict[str, dict]) -> None:
    """``spectra.npz`` of every finished model, keys ``<label>/<site>/layer<l>``, atomically."""
    import numpy as np

    arrays = {}
    for label in done:
        with np.load(out / "models" / label / "spectra.npz") as z:
            arrays.update({f"{label}/{k}": z[k] for k in z.files})
    # np.savez adds ".npz" to a name without it: give the temporary file the suffix
    _write_atomic(out / "spectra.npz", lambda p: np.savez(p, **arrays))


# ----------------------------------------------------------------------------------- one model
def _quiet_transformers():
    """Loading a base model from a causal-LM checkpoint lists the head's unused weights: expected
    here, so transformers' warnings are silenced while loading."""
    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet():
        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # "Loading weights": the analysis has its own bar per model
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()

    return quiet()


def _detail(e: Exception) -> str:
    """An exception from transformers as one short line (its messages span lines)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def load_tokenizer(source):
    """The tokenizer saved with ``source``; a folder without one (or one transformers cannot read)
    is a one-line ValueError naming it."""
    import transformers

    with _quiet_transformers():
        try:
            return transformers.AutoTokenizer.from_pretrained(source.folder, **source.load_kwargs())
        except Exception as e:  # noqa: BLE001 - any failure of the tokenizer's files is the user's to fix
            raise ValueError(f"models: no tokenizer loads from {source.path} ({_detail(e)}); save the "
                             f"tokenizer beside the weights (tokenizer.save_pretrained)") from None


def load_model(source, settings: Settings):
    """``(model, tokenizer)`` of ``source``: the base model in eval mode on the device."""
    import torch
    import transformers

    tok = load_tokenizer(source)
    with _quiet_transformers():
        model = transformers.AutoModel.from_pretrained(source.folder, dtype=getattr(torch, settings.dtype),
                                                       **source.load_kwargs())
    return model.to(settings.device).eval(), tok


def _max_positions(model_or_config) -> int | None:
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for name in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return None


def _check_positions(source, settings: Settings) -> None:
    """Raise naming ``--seq-len`` when it exceeds the positions ``source``'s config admits."""
    import transformers

    with _quiet_transformers():
        try:
            cfg = transformers.AutoConfig.from_pretrained(source.folder, **source.load_kwargs())
        except Exception as e:  # noqa: BLE001 - e.g. a model_type this transformers does not know
            raise ValueError(f"models: transformers {transformers.__version__} cannot read the config of "
                             f"{source.path} ({_detail(e)})") from None
    limit = _max_positions(cfg)
    if limit is not None and settings.seq_len > limit:
        raise ValueError(f"--seq-len: {settings.seq_len} is longer than {source.label}'s "
                         f"{limit} positions; pass --seq-len {limit} or less")


def make_probe(model, label: str, sites: tuple[str, ...]):
    """A :class:`fastspec.Probe` with every requested site the model's family allows; the sites
    left out, each with why (unknown family: keys only, FFN skipped with a warning)."""
    from ..probe import FAMILIES, Probe

    model_type = getattr(model.config, "model_type", None)
    skipped = {}
    want = dict(keys="keys" in sites, queries="queries" in sites, ffn="ffn" in sites,
                prerope_keys="keys_prerope" in sites)
    if model_type not in FAMILIES and (want["ffn"] or want["prerope_keys"]):
        warnings.warn(f"fastspec analyze: {label}: model_type {model_type!r} is not in fastspec.probe.FAMILIES: "
                      f"keys and queries measured, FFN and pre-RoPE keys skipped; register the family "
                      f"(fastspec.probe.FAMILIES[{model_type!r}] = fastspec.probe.Family(ffn=...), "
                      f"docs/protocols.md) to measure them", stacklevel=2)
        for name, site in (("ffn", "ffn"), ("prerope_keys", "keys_prerope")):
            if want[name]:
                skipped[site] = "unknown family"
                want[name] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unknown-family warning was given above, once
        if want["prerope_keys"]:
            try:
                return Probe(model, **want), skipped
            except ValueError as e:  # the family has no pre-RoPE key module (fused QKV, no RoPE, ...)
                skipped["keys_prerope"] = str(e).split(": ", 1)[-1]
                want["prerope_keys"] = False
        if not any(want.values()):
            raise ValueError(f"--sites: nothing to measure in {label} ({skipped})")
        return Probe(model, **want), skipped


def _tokenizer_key(tok) -> str:
    """Equal for tokenizers that tokenize alike (the packed batch is reused between them)."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


class _Clock:
    """Seconds per phase; on CUDA each phase waits for the device before it is read."""

    def __init__(self, device: str):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        import torch

        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0


class _Packed:
    """A packed batch ``ids [n_seq, seq_len]`` and the seconds packing it took, counted once."""

    def __init__(self, ids, seconds: float):
        self.ids, self._seconds = ids, seconds

    def take_seconds(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def _packed(cache: dict, tok, documents, settings: Settings) -> _Packed:
    """The packed batch of ``tok``'s tokenization (``text.pack``), made once per tokenizer."""
    from .text import pack

    key = _tokenizer_key(tok)
    if key not in cache:
        t0 = time.perf_counter()
        ids = pack(tok, documents, tokens=settings.tokens, seq_len=settings.seq_len, seed=settings.seed)
        cache[key] = _Packed(ids, time.perf_counter() - t0)
    return cache[key]


def measure_model(source, settings: Settings, documents, packed_cache: dict, *, progress: bool):
    """Load, tokenize, forward with the probe, solve: ``(rows, spectra {name: array}, meta)``.

    The model is freed before this returns (one model in memory at a time): the probe and its
    measurement, which hold it, live in :func:`_probe_model`'s frame only, and the collection
    here breaks their reference cycles."""
    import torch

    clock = _Clock(settings.device)
    with clock("load"):
        model, tok = load_model(source, settings)
    try:
        records, spectra, skipped, ids = _probe_model(model, tok, source, settings, documents, packed_cache,
                                                      clock, progress)
        model_type = getattr(model.config, "model_type", None)
    finally:
        del model
        gc.collect()
        if torch.device(settings.device).type == "cuda":
            torch.cuda.empty_cache()
    rows = [{**r.as_dict(), "condition": source.series, "model": source.label} for r in records]
    arrays = {f"{site}/layer{layer}": spec.detach().double().cpu().numpy() for (site, layer), spec in spectra.items()}
    sites = sorted({r["site"] for r in rows}, key=lambda s: (s not in SITES, SITES.index(s) if s in SITES else 0, s))
    meta = {"label": source.label, "condition": source.series, "step": source.step, "path": str(source.path),
            "kind": source.kind, "model_type": model_type, "sites": sites,
            "skipped_sites": skipped, "tokens": int(ids.numel()), "sequences": int(ids.shape[0]),
            "times": clock.times}
    return rows, arrays, meta


def _probe_model(model, tok, source, settings: Settings, documents, packed_cache: dict, clock: _Clock,
                 progress: bool):
    """Tokenize (or reuse the packed batch of the same tokenizer), run every batch through a
    timed :meth:`fastspec.Probe.measurement`, solve: ``(records, spectra, skipped sites, ids)``."""
    import torch

    with clock("tokenize"):
        packed = _packed(packed_cache, tok, documents, settings)
    ids = packed.ids
    # the first model of a tokenizer pays for packing, also when analyze() packed it ahead
    clock.times["tokenize"] += packed.take_seconds()
    probe, skipped = make_probe(model, source.label, settings.sites)
    m = probe.measurement(timed=True)
    batches = ids.split(settings.batch_size)
    bar = _progress(len(batches), source.label, progress)
    try:
        with clock("forward"):
            for b in batches:
                b = b.to(settings.device)
                m.forward({"input_ids": b, "attention_mask": torch.ones_like(b)})
                bar.update(1)
    finally:
        bar.close()
    probe_s = m.capture_seconds
    step = 0 if source.step is None else source.step
    records, spectra = m.finish(step=step, tokens_seen=int(ids.numel()), spectra=True)
    clock.times["solve"] = m.solve_seconds
    clock.times["forward"] -= probe_s  # the forward's own time; the captures' work is the probe's
    clock.times["probe"] = probe_s
    return records, spectra, skipped, ids


def _progress(total: int, label: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="batch", disable=not enabled, file=sys.stderr, leave=False)


def _write_model(out: Path, rows, arrays, meta) -> float:
    """``out/models/<label>/`` complete or not at all (written aside, then renamed); seconds taken."""
    import numpy as np

    t0 = time.perf_counter()
    root = out / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / meta["label"]
    tmp = root / f".{meta['label']}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with (tmp / "records.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        np.savez(tmp / "spectra.npz", **arrays)
        meta["times"]["write"] = time.perf_counter() - t0
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():  # an unfinished folder of an older fastspec: it has no meta.json
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta["times"]["write"]


def _time_line(meta: dict) -> str:
    t = meta["times"]
    parts = ", ".join(f"{k} {t[k]:.2f} s" for k in ("load", "tokenize", "forward", "probe", "solve", "write")
                      if k in t)
    return f"{meta['label']}: {meta['tokens']} tokens; {parts}"


# ------------------------------------------------------------------------------------ the run
def analyze(models, out, *, text=None, text_field: str = "text", text_format: str = "auto",
            tokens: int = 32768, seq_len: int = 1024,
            batch_size: int = 4, seed: int = 0, device: str | None = None, dtype: str | None = None,
            sites=SITES, progress: bool = True, report: bool = True, log=None) -> Analysis:
    """Spectra of pretrained models or a series of checkpoints (``fastspec analyze``).

    Args:
        models: a path or a list of paths: Hugging Face model folders, ``.gguf`` files, folders of
            checkpoints (``checkpoint-*``, ``step*``, ``global_step*`` or any sub-folders with a
            config), ordered by step (``sources.py``).
        out: the output folder; one holding finished models of the same settings is resumed.
        text: a text file (any UTF-8 file; a ``.jsonl`` file is JSON lines), a folder of
            ``.txt``/``.jsonl`` files, or None for the built-in corpus (``text.py``);
            ``text_field``: the JSON field of JSON lines; ``text_format``: ``"auto"`` (by the
            name), ``"plain"`` or ``"jsonl"`` (every file read so).
        tokens, seq_len, batch_size, seed: the token budget of every model, in sequences of
            ``seq_len`` tokens chosen with ``seed``, ``batch_size`` sequences per forward.
        device, dtype: default cuda (bfloat16) when available, else cpu (float32).
        sites: some of :data:`SITES` (default all; the family decides which it allows).
        progress: a progress bar per model; ``report``: write report.md and plots at the end;
            ``log``: where the per-model lines go (default: stdout).

    Returns an :class:`Analysis`; raises ValueError (a one-line message naming the flag) for bad
    input before anything is written. Ctrl-C stops after writing what is finished (status
    "interrupted") and re-raises ``KeyboardInterrupt``.
    """
    from .sources import architecture, check_series, find_models
    from .text import read_documents

    settings = check_settings(Settings(tokens=tokens, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                       text=None if text is None else str(text), text_field=text_field,
                                       text_format=text_format,
                                       device=device, dtype=dtype, sites=tuple(sites)))
    log = log or sys.stdout
    paths = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    sources = find_models(paths)
    check_series(sources)
    out = Path(out)
    documents, text_note = read_documents(text, text_field, text_format)
    # what the text is: its path as the user named it (a resumed run names it the same way), its size
    settings.text = text_note
    config = check_out(out, settings)
    done = _done_models(out) if config is not None else {}
    todo = [s for s in sources if s.label not in done]
    # the text must hold the budget before anything is written: try the first model's tokenizer
    packed_cache: dict = {}
    if todo:
        _packed(packed_cache, load_tokenizer(todo[0]), documents, settings)
        for source in todo:  # a sequence longer than a model's positions: refused now, not mid-run
            _check_positions(source, settings)
    out.mkdir(parents=True, exist_ok=True)
    entries = {s.label: {"label": s.label, "condition": s.series, "step": s.step, "path": str(s.path),
                         "kind": s.kind, **architecture(s), "done": s.label in done} for s in sources}
    for label, meta in done.items():  # finished by an earlier call, not named now: kept
        entries.setdefault(label, {"label": label, "condition": meta.get("condition"), "step": meta.get("step"),
                                   "path": meta.get("path"), "done": True})
    config = {"command": "analyze", "status": "running", "settings": _settings_json(settings),
              "models": list(entries.values())}

    def save_config(status: str) -> None:
        config["status"] = status
        for label, meta in done.items():
            entries[label].update(done=True, sites=meta.get("sites"), times=meta.get("times"),
                                  skipped_sites=meta.get("skipped_sites", {}))
        config["models"] = list(entries.values())
        _write_json(out / "config.json", config)

    save_config("running")
    result = Analysis(out, "running", skipped=[s.label for s in sources if s.label in done])
    if result.skipped:
        print(f"fastspec analyze: {len(result.skipped)} model(s) already done in {out}: skipped", file=log)
    status = "failed"
    frames: dict = {}
    tabled = None  # how many models the records table holds as last written here
    try:
        for i, source in enumerate(todo):
            rows, arrays, meta = measure_model(source, settings, documents, packed_cache, progress=progress)
            _write_model(out, rows, arrays, meta)
            done[source.label] = meta
            _write_records(out, done, frames)
            tabled = len(done)
            save_config("running")
            result.measured.append(source.label)
            line = f"[{len(result.skipped) + i + 1}/{len(sources)}] {_time_line(meta)}"
            print(line, file=log)
            with (out / "analyze.log").open("a") as f:
                f.write(line + "\n")
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:  # also on Ctrl-C and errors: the folder says what is finished, and is readable
        if done:
            if tabled != len(done):  # not yet written by this call (a resume with nothing left to do, an error)
                _write_records(out, done, frames)
            _write_spectra(out, done)
        save_config(status)
        result.status = status
        if report and done:
            from .report import write_report

            write_report(out)
    return result
