"""jspec's GGUF tokenizers against llama.cpp's own test vectors, on real published vocabularies.

llama.cpp ships vocabulary-only GGUF files of published tokenizers (``models/ggml-vocab-<name>.gguf``) with test
texts (``.gguf.inp``) and the token ids its own tokenizer gives each of them (``.gguf.out``); its
tests/test-tokenizer-0.cpp checks them. ``make setup`` extracts them from the pinned llama-cpp-python sdist into
``<venv>/share/llamacpp-vocab`` (the Makefile's ``LLAMACPP_VOCABS``). Each vocabulary jspec reads must give
exactly llama.cpp's ids for every text, and each it does not read must be refused by name.

The files are read as test-tokenizer-0.cpp reads them: texts separated by the line ``__ggml_vocab_test__`` (a
separator ends the file), one line of space-separated ids per text, kept in a map keyed by the text; it tokenizes
with ``add_special = false`` (no BOS, no EOS) and ``parse_special = false`` (the text of a control token is plain
text), and prints the detokenized ids beside each text without checking them.
"""

from __future__ import annotations

import functools
import os
import struct
import sys

import pytest

from models.checkpoint import CheckpointError
from models.gguf_loader import open_gguf, read_gguf_metadata
from models.tokenizer import Tokenizer

VOCAB_DIR = os.path.join(sys.prefix, "share", "llamacpp-vocab")
# The vocabularies jspec reads (tokenizer.ggml.model "llama" = SentencePiece: Llama 2, Phi-3; "gpt2" with a
# pre-tokenizer jspec knows: GPT-2, Llama 3, Qwen2, StarCoder).
SUPPORTED = ("llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2", "starcoder")
# The others llama.cpp checks, and what jspec's refusal must name: the tokenizer model or the pre-tokenizer.
REFUSED = {
    "bert-bge": "tokenizer model 'bert'",
    "gemma-4": "tokenizer model 'gemma4'",
    "command-r": "unknown pre-tokenizer 'command-r'",
    "deepseek-coder": "unknown pre-tokenizer 'deepseek-coder'",
    "deepseek-llm": "unknown pre-tokenizer 'deepseek-llm'",
    "falcon": "unknown pre-tokenizer 'falcon'",
    "mpt": "unknown pre-tokenizer 'mpt'",
    "qwen35": "unknown pre-tokenizer 'qwen35'",
    "refact": "unknown pre-tokenizer 'refact'",
}
_SEP = "\n__ggml_vocab_test__\n"  # test-tokenizer-0.cpp's separator
# The vocabularies whose ids llama.cpp's detokenizer "cleans" (src/llama-vocab.cpp: clean_spaces, true for BPE
# pre-tokenizers unless theirs sets it false, as qwen2's and smollm's do; false for SentencePiece). jspec's decode
# does not: a named difference (test_decode_keeps_the_spaces_llamacpp_cleans).
CLEAN_SPACES = ("gpt-2", "llama-bpe", "starcoder")

needs_vectors = pytest.mark.skipif(
    not os.path.isdir(VOCAB_DIR),
    reason=f"llama.cpp's tokenizer test vectors are not installed in {VOCAB_DIR}: `make setup` puts them there "
    "(for a venv set up before they joined the set-up: `rm .venv/.jspec-installed && make setup`)",
)


def _path(name: str) -> str:
    return os.path.join(VOCAB_DIR, f"ggml-vocab-{name}.gguf")


def read_vectors(name: str) -> dict[str, list[int]]:
    """text -> llama.cpp's ids, as test-tokenizer-0.cpp's read_tests builds them (bytes read as they are)."""
    with open(_path(name) + ".inp", encoding="utf-8", newline="") as f:
        raw = f.read()
    with open(_path(name) + ".out", encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":  # std::getline yields no line after the final newline
        lines.pop()
    texts, pos = [], 0
    while pos < len(raw):  # a separator at the very end starts no further text
        nxt = raw.find(_SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(_SEP)
    assert len(texts) == len(lines), f"{name}: {len(texts)} texts and {len(lines)} lines of ids"
    return {text: [int(t) for t in line.split()] for text, line in zip(texts, lines)}


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_metadata(_path(name)))


@needs_vectors
def test_every_installed_vocabulary_is_checked():
    """The Makefile's list and this file's agree: each installed vocabulary is read or refused here."""
    installed = {f.removeprefix("ggml-vocab-").removesuffix(".gguf") for f in os.listdir(VOCAB_DIR) if
                 f.endswith(".gguf")}  # fmt: skip
    assert installed == set(SUPPORTED) | set(REFUSED)
    for name in installed:
        assert read_vectors(name), f"{name}: no test texts"


@needs_vectors
@pytest.mark.parametrize("name", SUPPORTED)
def test_encodes_as_llamacpp(name):
    """Every test text gives exactly llama.cpp's ids (no BOS or EOS, as its test asks for none)."""
    tok = _tokenizer(name)
    vectors = read_vectors(name)
    # llama.cpp's test does not parse special-token text; jspec's encode does, so no text may contain any.
    specials = [t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special]
    assert not [(s, t) for t in vectors for s in specials if s in t]
    wrong = {}
    for text, expected in vectors.items():
        got = tok.encode(text, add_bos=False, add_eos=False)
        if got != expected:
            wrong[text] = (expected, got)
    assert not wrong, f"{name}: {len(wrong)} of {len(vectors)} texts differ (text: (llama.cpp, jspec)): {wrong}"


@needs_vectors
@pytest.mark.parametrize("name", SUPPORTED)
def test_decodes_llamacpp_ids_back(name):
    """llama.cpp's ids decode to the text: byte-level BPE loses nothing, and SentencePiece's decoder drops the one
    space prefix the encoder added (llama.cpp's detokenizer strips it from the first piece too)."""
    tok = _tokenizer(name)
    wrong = {t: tok.decode(ids) for t, ids in read_vectors(name).items() if tok.decode(ids) != t}
    assert not wrong, f"{name}: text -> decoded: {wrong}"


def llamacpp_clean_spaces(text: str) -> str:
    """llama.cpp's detokenizer clean-up (llama_vocab::impl::detokenize, ``if (clean_spaces)``), restated pass for
    pass on the characters in place (its patterns are ASCII, so characters and UTF-8 bytes give the same result):
    drop the space before ``? ! . ,``, turn `` ' `` into ``'``, and drop the space before ``'s 'm 're 've``."""
    t, n = list(text), len(text)
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x in "?!.,":
            total -= 1
        t[total], total = x, total + 1
    n, total, i = total, 1 if total else 0, 1
    while i < n:
        x = t[i]
        if x == "'" and i + 1 < n and t[i - 1] == " " and t[i + 1] == " ":
            total -= 1
            i += 1
            t[i] = "\0"
        t[total], total, i = x, total + 1, i + 1
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < n:
            x1, x2 = t[i + 1], t[i + 2] if i + 2 < n else None
            if x1 in "sm" or (x1 + (x2 or "")) in ("re", "ve"):
                total -= 1
        t[total], total = x, total + 1
    return "".join(t[:total])


def test_llamacpp_clean_spaces_restated():
    assert llamacpp_clean_spaces("Hi , you ! 'D he 's I 've it 't a ' b ?") == "Hi, you! 'D he's I've it 't a'b?"
    assert llamacpp_clean_spaces("") == "" and llamacpp_clean_spaces(" ?") == "?"


@needs_vectors
@pytest.mark.parametrize("name", CLEAN_SPACES)
def test_decode_keeps_the_spaces_llamacpp_cleans(name):
    """A named difference: for these vocabularies llama.cpp's detokenizer (common_detokenize, what its test prints)
    drops the space of " ?", " 's" and the like, as transformers' clean_up_tokenization_spaces does; jspec's decode
    gives the text back as it was encoded (a decoded prefix never loses a character when the next token
    arrives). The test texts where the two differ decode to the text, not to llama.cpp's cleaned text."""
    tok = _tokenizer(name)
    vectors = read_vectors(name)
    cleaned = {t: llamacpp_clean_spaces(t) for t in vectors if llamacpp_clean_spaces(t) != t}
    assert cleaned, f"{name}: no test text shows the difference"
    assert {t: tok.decode(vectors[t]) for t in cleaned} == {t: t for t in cleaned}


@needs_vectors
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_vocabulary_is_refused_by_name(name):
    with pytest.raises(CheckpointError, match=REFUSED[name]):
        Tokenizer.from_gguf(read_gguf_metadata(_path(name)))


@needs_vectors
def test_metadata_reader_matches_gguf_reader():
    """read_gguf_metadata gives what the gguf package's reader (open_gguf) gives, key for key, in file order."""
    path = _path("llama-spm")
    fields = open_gguf(path).reader.fields
    expected = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    got = read_gguf_metadata(path).values
    assert list(got) == list(expected)
    assert got == expected
    assert isinstance(got["tokenizer.ggml.add_bos_token"], bool)


def _kv(key: str, vtype: int, payload: bytes, order: str = "<") -> bytes:
    return struct.pack(f"{order}Q", len(key)) + key.encode() + struct.pack(f"{order}I", vtype) + payload


def _header(kv_count: int, version: int = 3, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(f"{order}IQQ", version, 0, kv_count)


def test_metadata_reader_values_and_byte_order(tmp_path):
    for order in "<>":
        floats = struct.pack(f"{order}IQ3f", 6, 3, 0.5, -1.25, 3.0)
        strings = struct.pack(f"{order}IQ", 8, 2) + b"".join(struct.pack(f"{order}Q", len(s)) + s for s in
                                                             (b"a", "\u2581\u00e9".encode()))  # fmt: skip
        blob = _header(4, order=order) + b"".join(
            (
                _kv("n", 4, struct.pack(f"{order}I", 7), order),
                _kv("flag", 7, b"\x01", order),
                _kv("scores", 9, floats, order),
                _kv("tokens", 9, strings, order),
            )
        )
        path = tmp_path / f"m{order == '>'}.gguf"
        path.write_bytes(blob)
        got = read_gguf_metadata(path)
        assert got.values == {"n": 7, "flag": True, "scores": [0.5, -1.25, 3.0], "tokens": ["a", "\u2581\u00e9"]}
        assert got.get("missing", 3) == 3


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"GGML" + bytes(20), "not a GGUF file"),
        (_header(0, version=1), "GGUF version 1 is not supported"),
        (_header(1) + _kv("a", 99, b""), "'a' has unknown GGUF value type 99"),
        (_header(1) + _kv("a", 8, struct.pack("<Q", 50) + b"short"), "truncated or corrupt"),
        (_header(1) + _kv("a", 9, struct.pack("<IQ", 4, 10**9)), "truncated or corrupt"),
        (_header(1) + _kv("a", 8, struct.pack("<Q", 1) + b"\xff"), "'a' is not UTF-8"),
        (_header(2) + _kv("a", 4, bytes(4)) + _kv("a", 4, bytes(4)), "'a' appears twice"),
        (b"GGUF", "truncated"),
    ],
)
def test_metadata_reader_refuses_bad_files(tmp_path, blob, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=message):
        read_gguf_metadata(path)
    with pytest.raises(CheckpointError, match="not found"):
        read_gguf_metadata(tmp_path / "absent.gguf")
