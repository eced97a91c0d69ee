"""The text ``fastspec analyze`` feeds every model: read from disk, packed into a fixed token budget.

:func:`read_documents` reads documents from a text file (one document: any UTF-8 file, whatever
its name: ``COPYING``, ``notes.md``), a ``.jsonl`` file (one document per line, from one string
field), a folder of ``.txt``/``.jsonl`` files (recursively, sorted by path; a folder holds other
things too, so only those two are read) or, by default, the built-in corpus: the running
interpreter's standard library source, the demo's text (``fastspec/demo/data.py``), so that an
analysis runs without any download. ``text_format`` forces one reading of every file read.

A file with a NUL byte is binary and refused in one line. A ``.txt``/``.jsonl`` file is text by
its name: bytes that are not UTF-8 are replaced (U+FFFD), so one stray byte does not stop a run.
Any other file is text only if it decodes as UTF-8 (the one evidence that it is text at all);
otherwise it is refused in one line.

:func:`pack` turns documents into the evaluation batch, ``int64 [n_seq, seq_len]``, with one
model's tokenizer. Design, after the eval protocol (docs/protocols.md: fixed batch, fixed seed,
identical across conditions):

* documents are tokenized in order and joined into one stream, the tokenizer's EOS between
  them, as in pretraining; no padding, so every position is a real token the probe may count;
* the stream stops growing once it holds 4x the tokens needed: enough windows to draw from
  without tokenizing gigabytes, and still a function of the text and the tokenizer alone;
* the stream is cut into non-overlapping ``seq_len`` windows and ``ceil(tokens / seq_len)`` of
  them are drawn with a seeded ``torch.randperm`` (spread over the whole text, not its first
  files), returned in text order. Checkpoints that share a tokenizer (a training run) thus get
  exactly the same batch.

torch and transformers are imported only inside :func:`pack`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path

from .. import _args

__all__ = ["BUILTIN", "TEXT_FORMATS", "pack", "read_documents"]

BUILTIN = "builtin"
HEADROOM = 4  # the stream stops at HEADROOM x the tokens needed
_CHUNK_CHARS = 100_000  # a long document is tokenized in pieces of about this many characters
_SUFFIXES = (".txt", ".jsonl")  # what a folder's files are read from, and names that say "text"
TEXT_FORMATS = ("auto", "plain", "jsonl")  # auto: .jsonl files are JSON lines, every other file plain


def _size(n_bytes: int) -> str:
    """``12.3 MB``, ``4.5 kB``, ``17 B``."""
    if n_bytes >= 1_000_000:
        return f"{n_bytes / 1e6:.1f} MB"
    if n_bytes >= 1_000:
        return f"{n_bytes / 1e3:.1f} kB"
    return f"{n_bytes} B"


def _builtin() -> tuple[list[str], str]:
    # the demo's corpus (fastspec/demo/data.py): the stdlib's top-level *.py files, sorted
    root = Path(os.path.dirname(os.__file__))
    documents = []
    for path in sorted(root.glob("*.py")):
        try:
            documents.append(path.read_bytes().decode("utf-8", errors="replace"))
        except OSError:
            continue
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"text: the built-in corpus is empty: no Python source found under {root}; "
                         f"give --text")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return documents, f"built-in corpus: Python {version} standard library source"


def _binary(path: Path, where: str = "") -> ValueError:
    return ValueError(f"text: {where}{path} is a binary file (it holds NUL bytes), not text; expected a UTF-8 text file")


def _not_utf8(path: Path, err: UnicodeDecodeError, where: str = "") -> ValueError:
    byte = err.object[err.start]
    return ValueError(f"text: {where}{path} is not UTF-8 text (byte 0x{byte:02x} at offset {err.start}"
                      f"{' of the line' if where else ''}); expected a UTF-8 text file")


def _decode(data: bytes, path: Path, strict: bool, where: str = "") -> str:
    """``data`` as text; ``strict``: a byte that is not UTF-8 is an error, else it is replaced."""
    if b"\0" in data:
        raise _binary(path, where)
    try:
        return data.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err, where) from None


def _jsonl(path: Path, field: str, strict: bool) -> list[str]:
    """One document per non-empty line of ``path``: the string ``field`` of the line's JSON object."""
    documents = []
    with open(path, "rb") as f:  # line by line: a large file is never held whole as well
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, strict, where=f"line {number} of ")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"text: line {number} of {path} is not JSON ({err.msg})") from None
            if not isinstance(record, dict):  # bad data, not a bad argument: a ValueError
                raise ValueError(  # noqa: TRY004
                    f"text: line {number} of {path} is not a JSON object but a {type(record).__name__}")
            if field not in record:
                has = ", ".join(sorted(map(str, record))) or "no fields"
                raise ValueError(f"--text-field: line {number} of {path} has no field {field!r} (it has: {has})")
            value = record[field]
            if not isinstance(value, str):
                raise ValueError(  # noqa: TRY004
                    f"--text-field: line {number} of {path} has field {field!r} of type "
                    f"{type(value).__name__}, not a string")
            documents.append(value)
    return documents


def _read_file(path: Path, field: str, text_format: str) -> list[str]:
    """The documents of one file: JSON lines (a ``.jsonl`` name, or ``text_format="jsonl"``) or
    one plain document. Only a ``.txt``/``.jsonl`` name lets bytes that are not UTF-8 through."""
    suffix = path.suffix.lower()
    strict = suffix not in _SUFFIXES
    try:
        if text_format == "jsonl" or (text_format == "auto" and suffix == ".jsonl"):
            return _jsonl(path, field, strict)
        return [_decode(path.read_bytes(), path, strict)]
    except OSError as err:
        raise ValueError(f"text: cannot read {path} ({err.strerror or err})") from None


def read_documents(text=None, text_field: str = "text", text_format: str = "auto") -> tuple[list[str], str]:
    """``(documents, description)``: the documents of ``text`` in order, and one line saying what
    they are (``"3 files in /x (12.3 MB)"``, ``"built-in corpus: Python 3.11 standard library source"``).

    ``text``: None or ``"builtin"`` (the built-in corpus, one document per stdlib file), a file
    (a ``.jsonl`` file: one document per non-empty line, its string field ``text_field``; any
    other file: one plain-text document), or a folder (every ``.txt``/``.jsonl`` under it,
    recursively, sorted by path). ``text_format``: ``"auto"`` (by the name, as just said),
    ``"plain"`` or ``"jsonl"`` (every file read so, whatever its name). Blank documents are left
    out. Raises ValueError (``"text: ..."``, or ``"--text-field: ..."`` for a missing field) for a
    missing path, a folder without such files, a binary file, a file not named ``.txt``/``.jsonl``
    that is not UTF-8, a line that is not a JSON object, or text that is empty."""
    text_field = _args.text("--text-field", text_field)
    text_format = _args.choice("--text-format", text_format, TEXT_FORMATS)
    if text is None or (isinstance(text, str) and text == BUILTIN):
        if text_format != "auto":  # most likely --text was forgotten
            raise ValueError(f"--text-format: {text_format!r} is for the files of --text; the built-in corpus "
                             f"has one reading (give --text, or leave --text-format auto)")
        return _builtin()
    if not isinstance(text, (str, os.PathLike)):
        raise _args.ArgumentTypeError(f"text: expected a path, {BUILTIN!r} or None, got {text!r}")
    path = Path(text)
    if not path.exists():
        raise ValueError(f"text: {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"text: {path} has no .txt or .jsonl files (a folder's other files are not read: "
                             f"give such a file itself)")
    else:
        files = [path]
    documents = [doc for file in files for doc in _read_file(file, text_field, text_format) if doc.strip()]
    n_bytes = sum(file.stat().st_size for file in files)
    if not documents:
        what = "it is empty" if len(files) == 1 else f"its {len(files)} files are all empty"
        raise ValueError(f"text: {path} holds no text ({what})")
    if path.is_dir():
        plural = "file" if len(files) == 1 else "files"
        return documents, f"{len(files)} {plural} in {path} ({_size(n_bytes)})"
    if len(documents) > 1:
        return documents, f"{path} ({len(documents)} documents, {_size(n_bytes)})"
    return documents, f"{path} ({_size(n_bytes)})"


def _pieces(document: str):
    """``document`` in pieces of at most :data:`_CHUNK_CHARS` characters, cut after a newline
    where there is one in the second half of the piece (so words stay whole), so that a long
    document is tokenized only as far as it is needed."""
    start = 0
    while start < len(document):
        end = start + _CHUNK_CHARS
        if end < len(document):
            newline = document.rfind("\n", start + _CHUNK_CHARS // 2, end)
            if newline != -1:
                end = newline + 1
        yield document[start:end]
        start = end


@contextlib.contextmanager
def _quiet_length_warning():
    """Silence "Token indices sequence length is longer than the specified maximum sequence
    length": documents are longer than the model's context on purpose, the windows are not."""
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def pack(tokenizer, documents: list[str], *, tokens: int, seq_len: int, seed: int = 0):
    """The evaluation batch: ``ceil(tokens / seq_len)`` windows of ``seq_len`` tokens, int64
    ``[n_seq, seq_len]``, drawn from ``documents`` as tokenized by ``tokenizer``.

    ``tokenizer``: a Hugging Face tokenizer, called as ``tokenizer(doc, add_special_tokens=False)
    ["input_ids"]``; its ``eos_token_id`` (if not None) goes between documents. The documents are
    read in order until the stream holds :data:`HEADROOM` x the tokens needed, cut into
    non-overlapping windows, and ``n_seq`` of them picked by ``torch.randperm`` seeded with
    ``seed``, in text order. Same tokenizer, documents and arguments: the same tensor. Raises
    ValueError (``"text: ..."``) when the text has fewer windows than ``n_seq``."""
    import torch

    tokens = _args.integer("tokens", tokens, minimum=1)
    seq_len = _args.integer("seq_len", seq_len, minimum=1)
    seed = _args.integer("seed", seed, minimum=0)
    if isinstance(documents, str):
        raise _args.ArgumentTypeError("documents: expected a list of strings, got one str")
    n_seq = math.ceil(tokens / seq_len)
    needed = n_seq * seq_len
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = eos if isinstance(eos, int) and not isinstance(eos, bool) else None

    stream: list[int] = []
    with _quiet_length_warning():
        for i, document in enumerate(documents):
            if len(stream) >= HEADROOM * needed:
                break
            if i > 0 and eos is not None:
                stream.append(eos)
            for piece in _pieces(document):
                stream.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
                if len(stream) >= HEADROOM * needed:
                    break

    n_windows = len(stream) // seq_len
    if n_windows < n_seq:
        raise ValueError(
            f"text: {len(stream)} tokens with this model's tokenizer ({n_windows} windows of {seq_len}), "
            f"fewer than --tokens {tokens} needs ({n_seq} sequences of {seq_len}); "
            f"give more text or lower --tokens")
    generator = torch.Generator().manual_seed(seed)
    picked = torch.randperm(n_windows, generator=generator)[:n_seq].sort().values
    windows = torch.tensor(stream[:n_windows * seq_len], dtype=torch.int64).view(n_windows, seq_len)
    return windows[picked].contiguous()
