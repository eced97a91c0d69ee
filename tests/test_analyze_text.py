"""fastspec.checkpoints.text: reading the documents, packing them into the fixed evaluation batch."""
from __future__ import annotations

import json
import logging
import random
import string
import sys

import _checkpoints as ck
import pytest
import torch

from fastspec.checkpoints.text import BUILTIN, pack, read_documents

transformers = pytest.importorskip("transformers")


def _one_line_error(excinfo, start: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(start), message
    return message


# --- read_documents -------------------------------------------------------------------------------

def test_builtin_corpus():
    docs, description = read_documents()
    assert read_documents(BUILTIN) == (docs, description)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert description == f"built-in corpus: Python {version} standard library source"
    assert len(docs) > 50 and all(isinstance(d, str) and d.strip() for d in docs)
    assert any("def " in d for d in docs)


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\nsecond line\n")
    docs, description = read_documents(path)
    assert docs == ["first line\nsecond line\n"]
    assert description == f"{path} (23 B)"
    # bytes that are not UTF-8 are replaced, not fatal
    path.write_bytes(b"caf\xe9 ok")
    assert read_documents(str(path))[0] == ["caf\ufffd ok"]


def test_jsonl_file_one_document_per_line(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [{"text": "alpha", "id": 1}, {"text": "beta", "id": 2}, {"text": "   ", "id": 3}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    docs, description = read_documents(path)
    assert docs == ["alpha", "beta"]  # blank documents are left out, blank lines skipped
    assert description.startswith(f"{path} (2 documents, ")
    body = tmp_path / "b.jsonl"
    body.write_text(json.dumps({"body": "gamma"}) + "\n")
    assert read_documents(body, text_field="body")[0] == ["gamma"]


def test_folder_recursively_sorted_by_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "A1"}) + "\n" + json.dumps({"text": "A2"}) + "\n")
    (tmp_path / "sub" / "c.txt").write_text("C")
    (tmp_path / "skip.md").write_text("not read")
    docs, description = read_documents(tmp_path)
    assert docs == ["A1", "A2", "B", "C"]
    assert description.startswith(f"3 files in {tmp_path} (") and description.endswith(" B)")


def test_bad_jsonl_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n\n" + json.dumps({"body": "x", "id": 3}) + "\n")
    with pytest.raises(ValueError) as e:
        read_documents(path)
    assert _one_line_error(e, "--text-field: ") == \
        f"--text-field: line 3 of {path} has no field 'text' (it has: body, id)"
    path.write_text(json.dumps({"text": "ok"}) + "\nnot json\n")
    with pytest.raises(ValueError) as e:
        read_documents(path)
    _one_line_error(e, f"text: line 2 of {path} is not JSON")
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError) as e:
        read_documents(path)
    _one_line_error(e, f"text: line 1 of {path} is not a JSON object")
    path.write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(ValueError) as e:
        read_documents(path)
    _one_line_error(e, f"--text-field: line 1 of {path} has field 'text' of type int")


def test_bad_text_paths(tmp_path):
    with pytest.raises(ValueError) as e:
        read_documents(tmp_path / "nope")
    assert _one_line_error(e, "text: ") == f"text: {tmp_path / 'nope'} does not exist"
    empty = tmp_path / "empty"
    (empty / "deeper").mkdir(parents=True)
    (empty / "notes.md").write_text("x")
    with pytest.raises(ValueError) as e:
        read_documents(empty)
    assert _one_line_error(e, "text: ") == (f"text: {empty} has no .txt or .jsonl files (a folder's other files "
                                            f"are not read: give such a file itself)")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n")
    with pytest.raises(ValueError) as e:
        read_documents(blank)
    _one_line_error(e, f"text: {blank} holds no text")
    # a file of any other name is text when it is UTF-8 (test_any_utf8_file_is_plain_text)
    other = tmp_path / "data.csv"
    other.write_text("a,b")
    assert read_documents(other)[0] == ["a,b"]


# the start of the GPL (COPYING): a plain file with no extension
GPL = ("                    GNU GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007\n\n"
       " Copyright (C) 2007 Free Software Foundation, Inc. <https://fsf.org/>\n Everyone is permitted to "
       "copy and distribute verbatim copies\n of this license document, but changing it is not allowed.\n"
       "\n                            Preamble \u2014 caf\u00e9\n") * 8


def test_any_utf8_file_is_plain_text(tmp_path):
    """`--text COPYING` reads the file as one document, the same tokens as the same text in a .txt."""
    txt, copying = tmp_path / "a.txt", tmp_path / "COPYING"
    txt.write_text(GPL, encoding="utf-8")
    copying.write_text(GPL, encoding="utf-8")
    docs, description = read_documents(copying)
    assert docs == read_documents(txt)[0] == [GPL]
    assert description == f"{copying} ({len(GPL.encode()) / 1e3:.1f} kB)"
    tok = ck.tokenizer()
    assert torch.equal(pack(tok, docs, tokens=64, seq_len=16), pack(tok, [GPL], tokens=64, seq_len=16))
    for name in ("notes.md", "guide.rst", "data.json"):  # a .json file is one document too: not JSON lines
        (tmp_path / name).write_text(GPL)
        assert read_documents(tmp_path / name)[0] == [GPL]
    # a folder still reads its .txt/.jsonl files only: COPYING, notes.md, ... beside a.txt are left out
    docs, description = read_documents(tmp_path)
    assert docs == [GPL] and description.startswith(f"1 file in {tmp_path} (")


def test_binary_or_undecodable_files_are_one_line_errors(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"PK\x03\x04\x00\x00\x08\x00" + bytes(range(256)))
    with pytest.raises(ValueError) as e:
        read_documents(binary)
    assert _one_line_error(e, "text: ") == \
        f"text: {binary} is a binary file (it holds NUL bytes), not text; expected a UTF-8 text file"
    latin1 = tmp_path / "README"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        read_documents(latin1)
    assert _one_line_error(e, "text: ") == \
        f"text: {latin1} is not UTF-8 text (byte 0xe9 at offset 3); expected a UTF-8 text file"
    # a .txt or .jsonl name says "text": stray bytes are replaced (test_txt_file_is_one_document),
    # but NUL bytes (UTF-16, a binary renamed) are refused there too
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("hello", encoding="utf-16")
    with pytest.raises(ValueError) as e:
        read_documents(utf16)
    _one_line_error(e, f"text: {utf16} is a binary file")
    for name in ("a.jsonl", "lines"):  # a line of JSON lines too, named by its number
        path = tmp_path / name
        path.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "\x00"}\n')
        with pytest.raises(ValueError) as e:
            read_documents(path, text_format="jsonl")
        _one_line_error(e, f"text: line 2 of {path} is a binary file")
    lines = tmp_path / "lines"
    lines.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError) as e:
        read_documents(lines, text_format="jsonl")
    assert _one_line_error(e, "text: ") == \
        f"text: line 2 of {lines} is not UTF-8 text (byte 0xe9 at offset 13 of the line); expected a UTF-8 text file"
    named = tmp_path / "b.jsonl"
    named.write_bytes(lines.read_bytes())
    assert read_documents(named)[0] == ["ok", "caf\ufffd"]


def test_text_format_forces_one_reading(tmp_path):
    body = json.dumps({"text": "alpha"}) + "\n" + json.dumps({"text": "beta"}) + "\n"
    for name in ("corpus", "corpus.json", "corpus.txt"):
        path = tmp_path / name
        path.write_text(body)
        assert read_documents(path)[0] == [body]  # auto: by the name, plain text
        assert read_documents(path, text_format="jsonl")[0] == ["alpha", "beta"]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text(body)
    assert read_documents(jsonl)[0] == read_documents(jsonl, text_format="jsonl")[0] == ["alpha", "beta"]
    assert read_documents(jsonl, text_format="plain")[0] == [body]
    # a folder: every file read so
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(body)
    (folder / "b.txt").write_text("gamma")
    assert read_documents(folder)[0] == ["alpha", "beta", "gamma"]
    assert read_documents(folder, text_format="plain")[0] == [body, "gamma"]
    with pytest.raises(ValueError) as e:
        read_documents(folder, text_format="jsonl")
    _one_line_error(e, f"text: line 1 of {folder / 'b.txt'} is not JSON")


@pytest.mark.parametrize("text, fmt, start", [
    ("x", "xml", "--text-format: expected one of ('auto', 'plain', 'jsonl'), got 'xml'"),
    (None, "jsonl", "--text-format: 'jsonl' is for the files of --text"),
    (BUILTIN, "plain", "--text-format: 'plain' is for the files of --text"),
])
def test_bad_text_format(text, fmt, start):
    with pytest.raises(ValueError) as e:
        read_documents(text, text_format=fmt)
    _one_line_error(e, start)


# --- pack -----------------------------------------------------------------------------------------

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(40)]


def test_pack_shape_and_determinism():
    tok = ck.tokenizer()
    ids = pack(tok, DOCS, tokens=512, seq_len=64, seed=0)
    assert ids.shape == (8, 64) and ids.dtype == torch.int64
    assert ids.min() >= 0 and ids.max() < len(tok)
    assert torch.equal(ids, pack(tok, DOCS, tokens=512, seq_len=64, seed=0))
    assert not torch.equal(ids, pack(tok, DOCS, tokens=512, seq_len=64, seed=1))
    # a token budget that is not a multiple of seq_len rounds up to whole sequences
    assert pack(tok, DOCS, tokens=100, seq_len=32).shape == (4, 32)
    assert pack(tok, DOCS, tokens=1, seq_len=7).shape == (1, 7)


def test_pack_windows_are_the_stream_cut_in_order():
    tok = ck.tokenizer()
    docs = ["ab", "cde", "f"]
    stream = [*tok("ab")["input_ids"], 0, *tok("cde")["input_ids"], 0, *tok("f")["input_ids"]]
    assert len(stream) == 8
    # documents joined with EOS (id 0) between them, not after the last; all 4 windows of 2, in order
    assert pack(tok, docs, tokens=8, seq_len=2).tolist() == [stream[0:2], stream[2:4], stream[4:6], stream[6:8]]
    # the picked windows come back sorted and non-overlapping
    rng = random.Random(0)  # text without repeats, so that each window is found at one place
    docs = ["".join(rng.choice(string.ascii_letters) for _ in range(50)) for _ in range(20)]
    picked = pack(tok, docs, tokens=96, seq_len=16, seed=3)
    full = torch.tensor(_stream(tok, docs, limit=4 * 96))
    starts = [_find(full, row) for row in picked]
    assert starts == sorted(starts) and all(s % 16 == 0 for s in starts)


def _stream(tok, docs, limit):
    out = []
    for i, doc in enumerate(docs):
        if len(out) >= limit:
            break
        if i:
            out.append(tok.eos_token_id)
        out.extend(tok(doc, add_special_tokens=False)["input_ids"])
    return out


def _find(stream: torch.Tensor, row: torch.Tensor) -> int:
    for start in range(len(stream) - len(row) + 1):
        if torch.equal(stream[start:start + len(row)], row):
            return start
    raise AssertionError("window not in the stream")


def test_pack_stops_reading_at_four_times_the_budget():
    calls = []

    class Counting:
        eos_token_id = None

        def __call__(self, text, add_special_tokens=True):
            calls.append(text)
            return {"input_ids": [ord(c) % 50 for c in text]}

    docs = ["x" * 100] * 50  # 5000 tokens
    ids = pack(Counting(), docs, tokens=50, seq_len=10)
    assert ids.shape == (5, 10)
    assert len(calls) == 2  # 200 = 4 x 50 tokens needed: two documents, not fifty


def test_pack_same_batch_for_checkpoints_sharing_a_tokenizer(tmp_path):
    docs, _ = read_documents()
    run = ck.write_series(tmp_path / "run", "llama", steps=(1, 2))
    a, b = (transformers.AutoTokenizer.from_pretrained(run / f"checkpoint-{s}") for s in (1, 2))
    batch = pack(a, docs, tokens=1024, seq_len=128)
    assert torch.equal(batch, pack(b, docs, tokens=1024, seq_len=128))
    assert torch.equal(batch, pack(ck.tokenizer(), docs, tokens=1024, seq_len=128))


def test_pack_long_documents_without_warnings(caplog):
    tok = ck.tokenizer.__wrapped__()  # model_max_length 128; a new one (not the cached): it warns once
    long = "word " * 60_000  # 300k characters: tokenized in pieces
    # transformers' loggers do not propagate to the root logger, where caplog listens
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(caplog.handler)
    try:
        ids = pack(tok, [long], tokens=1000, seq_len=100)
        assert ids.shape == (10, 100)
        assert not [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]
        # a new tokenizer does warn outside pack: the check above can fail
        ck.tokenizer.__wrapped__()(long[:10_000])
        assert [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]
    finally:
        logger.removeHandler(caplog.handler)
    # the pieces are cut after newlines, so a text of lines tokenizes as it would in one go
    lines = "".join(f"line {i} of a long file\n" for i in range(6000))  # ~150k characters
    stream = tok(lines, add_special_tokens=False)["input_ids"]
    tokens = (len(stream) // 50 // 4 + 1) * 50  # 4x this is more than the text: all of it is read
    assert torch.equal(pack(tok, [lines], tokens=tokens, seq_len=50, seed=0), _expected(stream, tokens, 50, 0))


def _expected(stream, tokens, seq_len, seed):
    """pack's batch from a stream tokenized in one go, all of it used."""
    n_seq = -(-tokens // seq_len)
    n_windows = len(stream) // seq_len
    windows = torch.tensor(stream[:n_windows * seq_len]).view(n_windows, seq_len)
    picked = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))[:n_seq].sort().values
    return windows[picked]


def test_pack_too_little_text():
    tok = ck.tokenizer()
    with pytest.raises(ValueError) as e:
        pack(tok, ["too short"], tokens=64, seq_len=16)
    message = _one_line_error(e, "text: ")
    assert message == ("text: 9 tokens with this model's tokenizer (0 windows of 16), fewer than --tokens 64 "
                       "needs (4 sequences of 16); give more text or lower --tokens")


@pytest.mark.parametrize("kw, start", [
    ({"tokens": 0, "seq_len": 8}, "tokens: "), ({"tokens": 8, "seq_len": 0}, "seq_len: "),
    ({"tokens": 8.0, "seq_len": 8}, "tokens: "), ({"tokens": True, "seq_len": 8}, "tokens: "),
    ({"tokens": 8, "seq_len": 8, "seed": -1}, "seed: "),
])
def test_pack_checks_its_numbers(kw, start):
    with pytest.raises(ValueError) as e:
        pack(ck.tokenizer(), DOCS, **kw)
    _one_line_error(e, start)
