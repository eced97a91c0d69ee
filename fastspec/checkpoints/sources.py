"""Which models ``fastspec analyze`` measures: model folders, GGUF files and checkpoint series on disk.

:func:`find_models` turns the paths a user gives into :class:`ModelSource` entries, one per model
to load, in the order they are measured:

* a Hugging Face model folder (``config.json`` plus weights) -> one model;
* a ``.gguf`` file -> one model, loaded with ``from_pretrained(folder, gguf_file=name)``;
* a folder without ``config.json`` whose sub-folders are checkpoints (``checkpoint-200``,
  ``step1000``, ``global_step50``, or any sub-folder with a ``config.json``), or which holds
  ``.gguf`` files -> a *series*: one model per checkpoint, ordered by the step number in its name.

Design: everything here reads file names and small JSON/GGUF metadata only, never weights, so
a wrong path fails in milliseconds, before any model is loaded; torch and transformers are not
imported. The step comes from the name alone (``checkpoint-200`` -> 200) because that is where
every trainer (HF Trainer, DeepSpeed, Megatron-style ``step_3``) writes it; a name without one
sorts after the numbered ones. Labels name a model in tables and plots, so they are unique within
one :func:`find_models` result: a label that two paths share gets its parent folder's name in
front (``runA-checkpoint-100``). :func:`architecture` reads a model's shape from ``config.json``
(or the GGUF metadata), and :func:`check_series` refuses a series whose checkpoints differ in
shape: its curves over steps would compare different models.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelSource", "architecture", "check_series", "find_models", "parse_step"]

# A step number in a checkpoint's name: "checkpoint-200", "step1000", "global_step50", "step_3",
# also inside a longer name ("run1-step_3", "tiny-checkpoint-200.Q8_0"). The keyword is required:
# a bare number would read "gpt2" as step 2 and "Qwen3-0.6B" as step 0.
_STEP_RE = re.compile(r"(?:^|[^a-z0-9])(?:checkpoint|ckpt|global_step|step|iter)[-_]?(\d+)(?![0-9])", re.IGNORECASE)
# Sub-folder names that mark a checkpoint even before we look inside (so a broken one is reported
# rather than skipped): checkpoint-<n>, step<n>, step_<n>, step-<n>, global_step<n>.
_CHECKPOINT_DIR_RE = re.compile(r"(?:checkpoint-|step[-_]?|global_step)\d+", re.IGNORECASE)
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")
_FIELDS = ("model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "d_ff")
_GGUF_HINT = 'pip install "fastspec[gguf]"'


@dataclass(frozen=True)
class ModelSource:
    """One model to measure.

    ``path``: the model folder (``kind == "hf"``) or the ``.gguf`` file (``kind == "gguf"``).
    ``label``: its name in tables and plots (folder name or file stem, unique within one
    :func:`find_models` result, no ``/``). ``step``: the training step parsed from the name, None
    if it has none. ``series``: the run it belongs to: the checkpoint folder's name for a series,
    else the label itself (a model on its own is a series of one)."""

    path: Path
    label: str
    step: int | None
    series: str
    kind: str

    @property
    def folder(self) -> Path:
        """The folder ``from_pretrained`` gets: ``path`` itself for "hf", its parent for "gguf"."""
        return self.path if self.kind == "hf" else self.path.parent

    def load_kwargs(self) -> dict:
        """Extra ``from_pretrained`` keyword arguments: ``{}`` for "hf", ``{"gguf_file": name}`` for "gguf"."""
        return {} if self.kind == "hf" else {"gguf_file": self.path.name}


def parse_step(name: str) -> int | None:
    """The step number in a checkpoint's name (``checkpoint-200`` -> 200, ``step1000`` -> 1000,
    ``global_step50`` -> 50, ``step_3`` -> 3; the last such number if several), else None."""
    found = _STEP_RE.findall(name)
    return int(found[-1]) if found else None


def _has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in _WEIGHT_GLOBS)


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _hf_model(folder: Path) -> Path:
    """``folder`` if it is a loadable Hugging Face model folder, else ValueError."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"models: {folder} is not a model: no config.json")
    if not _has_weights(folder):
        raise ValueError(f"models: {folder} has a config.json but no weights "
                         f"(no *.safetensors, pytorch_model*.bin or *.index.json)")
    return folder


def _series_members(folder: Path) -> list[tuple[Path, str]]:
    """``(path, kind)`` of each checkpoint in a folder of checkpoints, in step order; [] if none."""
    members = []
    for child in folder.iterdir():
        if child.is_dir() and ((child / "config.json").is_file() or _CHECKPOINT_DIR_RE.fullmatch(child.name)):
            members.append((_hf_model(child), "hf"))
        elif child.is_file() and _is_gguf(child):
            members.append((child, "gguf"))

    def order(member):
        name = _name(member[0], member[1])
        step = parse_step(name)
        # numbered first, by number; then the rest by name
        return (step is None, step if step is not None else 0, name)

    return sorted(members, key=order)


def _name(path: Path, kind: str) -> str:
    """A model's own name: the folder name, or the file name without ``.gguf``."""
    return path.stem if kind == "gguf" else _display_name(path)


def _expand(path: Path) -> tuple[list[tuple[Path, str]], str | None]:
    """The models one given path stands for: ``([(path, kind)], None)`` for a single model,
    ``(members, series_name)`` for a folder of checkpoints."""
    if not path.exists():
        raise ValueError(f"models: {path} does not exist")
    if path.is_file():
        if _is_gguf(path):
            return [(path, "gguf")], None
        raise ValueError(f"models: {path} is not a model: a file, but not a .gguf file "
                         f"(give the model's folder)")
    if (path / "config.json").is_file():
        return [(_hf_model(path), "hf")], None
    members = _series_members(path)
    if not members:
        raise ValueError(f"models: {path} is not a model: no config.json, no .gguf file "
                         f"and no checkpoint sub-folders")
    return members, _display_name(path)


def _display_name(path: Path) -> str:
    # "." or "runs/a/" have no usable .name; the resolved path does
    return path.name or Path(os.path.abspath(path)).name


def _unique(names: list[str], paths: list[Path]) -> list[str]:
    """``names`` with each repeated one prefixed by its path's parent folders, one more level at a
    time (``runA-checkpoint-100``), until it is unique; a numeric suffix as the last resort."""
    out = list(names)
    for depth in range(1, 64):
        repeated = {n for n in out if out.count(n) > 1}
        if not repeated:
            return out
        for i, name in enumerate(names):
            if out[i] in repeated:
                parents = Path(os.path.abspath(paths[i])).parts[:-1][-depth:]
                parents = [p for p in parents if p not in ("/", "\\") and not p.endswith(":\\")]
                out[i] = "-".join([*parents, name])
    seen: dict[str, int] = {}
    for i, name in enumerate(out):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            out[i] = f"{name}-{seen[name]}"
    return out


def find_models(paths) -> list[ModelSource]:
    """The models at ``paths`` (a list of folders/``.gguf`` files; one path alone is accepted too),
    in the given order, each series in step order. See the module docstring for what each kind of
    path stands for. Raises ValueError (``"models: ..."``) for a missing path, a path that is no
    model, a model folder without weights, an empty list, or a model reached twice."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("models: expected at least one model folder, .gguf file or folder of checkpoints")

    groups = []  # (given path, [(path, kind)], series folder name or None), one per given path
    given_at: dict[Path, Path] = {}
    seen: dict[Path, Path] = {}  # resolved model path -> the given path it came from
    for given in paths:
        members, series = _expand(given)
        if given.resolve() in given_at:
            raise ValueError(f"models: {given} is given twice")
        given_at[given.resolve()] = given
        for path, _ in members:
            key = path.resolve()
            if key in seen:  # e.g. a checkpoint given alone and with its series folder
                raise ValueError(f"models: {path} is given twice (also in {seen[key]})")
            seen[key] = given
        groups.append((given, members, series))

    flat = [(path, kind, gi) for gi, (_, members, _) in enumerate(groups) for path, kind in members]
    labels = _unique([_name(path, kind) for path, kind, _ in flat], [path for path, _, _ in flat])
    # One name per given path, unique: the series folder's name, or a lone model's label (a model
    # on its own is a series of one, and must not merge with a series folder of the same name).
    firsts = {gi: i for i, (_, _, gi) in reversed(list(enumerate(flat)))}
    names = [labels[firsts[gi]] if series is None else series for gi, (_, _, series) in enumerate(groups)]
    names = _unique(names, [g if series is not None else groups[gi][1][0][0]
                            for gi, (g, _, series) in enumerate(groups)])
    sources = []
    for (path, kind, gi), label in zip(flat, labels):
        single = groups[gi][2] is None
        sources.append(ModelSource(path=path, label=names[gi] if single else label,
                                   step=parse_step(_name(path, kind)), series=names[gi], kind=kind))
    if len({s.label for s in sources}) < len(sources):  # only when renaming made new clashes
        raise ValueError("models: two models end up with the same label; rename one of their folders")
    return sources


def _config_value(config: dict, *keys):
    """The first of ``keys`` set (not None) in ``config``, else in its ``text_config`` (multimodal
    checkpoints keep the language model's shape there), else None."""
    for where in (config, config.get("text_config") or {}):
        if not isinstance(where, dict):
            continue
        for key in keys:
            if where.get(key) is not None:
                return where[key]
    return None


def _hf_architecture(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"models: {path} cannot be read as JSON: {_one_line(err)}") from None
    if not isinstance(config, dict):
        raise ValueError(f"models: {path} is not a JSON object")  # noqa: TRY004 - bad data, not a bad argument
    return config_architecture(config)


def config_architecture(config: dict) -> dict:
    """:func:`architecture`'s fields from a Hugging Face config as a dict (``config.json``, or a
    loaded model's ``model.config.to_dict()``)."""
    arch = {
        "model_type": config.get("model_type"),
        "num_layers": _config_value(config, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": _config_value(config, "hidden_size", "n_embd", "d_model"),
        "num_heads": _config_value(config, "num_attention_heads", "n_head", "num_heads"),
        "num_kv_heads": _config_value(config, "num_key_value_heads", "num_kv_heads"),
        "head_dim": _config_value(config, "head_dim"),
        "d_ff": _config_value(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    }
    if arch["d_ff"] is None and config.get("model_type") == "gpt2" and arch["hidden_size"] is not None:
        arch["d_ff"] = 4 * arch["hidden_size"]  # GPT-2's n_inner=None means 4·n_embd
    return _defaults(arch)


def _defaults(arch: dict) -> dict:
    """Fill the fields every attention layout implies: MHA (kv heads = heads), head_dim = hidden / heads."""
    if arch["num_kv_heads"] is None:
        arch["num_kv_heads"] = arch["num_heads"]
    if arch["head_dim"] is None and arch["hidden_size"] and arch["num_heads"]:
        arch["head_dim"] = arch["hidden_size"] // arch["num_heads"]
    return arch


def _gguf_value(field):
    """A GGUF metadata field as Python: a str, a number, or a list; read through ``parts``/``data``,
    which every gguf-py version has (``ReaderField.contents`` is newer)."""
    import gguf

    types = list(field.types)
    if types and types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types and types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def _gguf_architecture(path: Path) -> dict:
    try:
        import gguf
    except ImportError:
        raise ValueError(f"models: reading {path} needs the gguf package: {_GGUF_HINT}") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - gguf raises ValueError, struct.error, OSError... on a bad file
        raise ValueError(f"models: {path} is not a readable GGUF file: {_one_line(err)}") from None

    def read(key):
        field = reader.fields.get(key)
        if field is None:
            return None
        value = _gguf_value(field)
        # per-layer arrays (e.g. head_count_kv of hybrid models): one number when they agree
        if isinstance(value, list) and value and len(set(value)) == 1:
            return value[0]
        return value

    arch_name = read("general.architecture")
    if not isinstance(arch_name, str):
        raise ValueError(  # noqa: TRY004 - bad data, not a bad argument
            f"models: {path} is not a model: its GGUF metadata has no general.architecture")
    return _defaults({
        "model_type": arch_name,
        "num_layers": read(f"{arch_name}.block_count"),
        "hidden_size": read(f"{arch_name}.embedding_length"),
        "num_heads": read(f"{arch_name}.attention.head_count"),
        "num_kv_heads": read(f"{arch_name}.attention.head_count_kv"),
        "head_dim": read(f"{arch_name}.attention.key_length"),
        "d_ff": read(f"{arch_name}.feed_forward_length"),
    })


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def architecture(source: ModelSource) -> dict:
    """The shape of ``source``'s model, read without loading weights: ``{model_type, num_layers,
    hidden_size, num_heads, num_kv_heads, head_dim, d_ff}`` (None where unknown), from
    ``config.json`` (Llama-style names, GPT-2's ``n_layer``/``n_embd``/``n_head``/``n_inner``, OPT's
    ``ffn_dim``; ``text_config`` of multimodal configs) or the GGUF metadata (``<arch>.block_count``,
    ``embedding_length``, ``attention.head_count[_kv]``, ``attention.key_length``,
    ``feed_forward_length``). ``num_kv_heads`` defaults to ``num_heads``, ``head_dim`` to
    ``hidden_size // num_heads``. GGUF needs the ``gguf`` package."""
    if source.kind == "gguf":
        return _gguf_architecture(source.path)
    if source.kind == "hf":
        return _hf_architecture(source.path)
    raise ValueError(f"source: expected kind 'hf' or 'gguf', got {source.kind!r}")


def check_series(sources: Iterable[ModelSource]) -> None:
    """Raise ValueError if two checkpoints of one series (same ``series``, same checkpoint folder)
    differ in any :func:`architecture` field, naming both and the first field that differs.
    Separate models (different series) may differ."""
    groups: dict[tuple[str, Path], list[ModelSource]] = {}
    for source in sources:
        parent = Path(os.path.abspath(source.path)).parent
        groups.setdefault((source.series, parent), []).append(source)
    for (_, parent), members in groups.items():
        if len(members) < 2:
            continue
        first, first_arch = members[0], architecture(members[0])
        for other in members[1:]:
            other_arch = architecture(other)
            for field in _FIELDS:
                if first_arch[field] != other_arch[field]:
                    raise ValueError(
                        f"models: {first.label} and {other.label} in {first.path.parent} differ in {field} "
                        f"({first_arch[field]} vs {other_arch[field]}); a series must share one architecture")
