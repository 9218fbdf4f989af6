"""SentencePiece GGUF tokenizers (``tokenizer.ggml.model = "llama"``: Gemma, Llama 2, Mistral v0.1).

A tiny SentencePiece BPE model is trained here (byte fallback, control and user-defined pieces, no downloads) and
written into a GGUF the way llama.cpp's converter writes one (``_create_vocab_for_sentencepiece``: every piece with
its score and type, user-defined pieces from tokenizer_config.json with ``▁`` written as a space, the special ids,
``add_bos_token``, Gemma's ``add_space_prefix`` false, the chat template). jspec's tokenizer is checked against
sentencepiece's own encoding and against transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``). Where those two differ, jspec follows llama.cpp, whose rules are restated in the tests.
"""

from __future__ import annotations

import io
import os

import gguf
import pytest
from conftest import need_torch, requires_torch

from models.checkpoint import CheckpointError
from models.gguf_loader import open_gguf
from models.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Numbers 12345 and 67890.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "def f(x):\n    return x * 2\n",
    "Les élèves étudient à l'école, naïve café.",
    "Values: 3.14159, 2.71828, 1000000; tabs\tand  double  spaces.",
]
CONTROL = ["<start_of_turn>", "<end_of_turn>"]
GEMMA_USER = ["\u2581\u2581", "\u2581\u2581\u2581", "<think>"]  # Gemma's whitespace runs, and a tag
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Plain text: unicode inside and outside the vocabulary (byte fallback: ☃, 𝔘, 中文, an emoji), digits, runs of
# spaces, tabs and newlines, leading and trailing whitespace.
PLAIN = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "élève naïve café à l'école",
    "snow ☃ and 𝔘 and 中文 and 🦊!",
    "12345 + 67890 = 80235",
    "double  spaces   and    more",
    " leading space",
    "   three leading",
    "trailing space ",
    "tabs\tand\t\tnewlines\n\n  indented",
    "def f(x):\n    return x * 2\n",
    "\n",
    " ",
    "",
]
# With special-token text: control tokens are one id each, the unknown token too (llama.cpp and transformers both
# match it), a user-defined tag is one id; a near miss is ordinary text.
SPECIAL = [
    "<start_of_turn>user\nHello<end_of_turn>\n",
    "a<end_of_turn>b",
    "<end_of_turn><end_of_turn>",
    "<unk> unknown",
    "<start_of_turn",
]
GEMMA_SPECIAL = ["<think>why</think>", "  <think>  "]


def _train(prefix: bool, user: list[str]):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=buf,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # Llama 2 and Gemma: no NFKC
        remove_extra_whitespaces=False,
        add_dummy_prefix=prefix,
        split_digits=True,
        control_symbols=CONTROL,
        user_defined_symbols=user,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _vocab(sp):
    """(tokens, scores, types) as llama.cpp's converter writes them from a SentencePiece model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece, kind = sp.id_to_piece(i), 1  # NORMAL
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        elif piece in GEMMA_USER:  # tokenizer_config.json's non-special added tokens: USER_DEFINED, ▁ as a space
            kind, piece = 4, piece.replace("\u2581", " ")
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(kind)
    return tokens, scores, types


def _write(path, arch, tokens, scores=None, types=None, *, model="llama", meta=None, template=TEMPLATE):
    """A GGUF holding a (metadata-only) model of architecture ``arch`` and the tokenizer; ``meta``: more keys (a
    bool, or None to leave out one of the default keys add_bos_token / bos / eos / unk / pad)."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_vocab_size(len(tokens))
    if arch.startswith("gemma"):
        w.add_sliding_window(8)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    keys = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    keys |= {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 3}
    keys |= {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False}
    for key, value in (keys | (meta or {})).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif value is not None:
            w.add_uint32(key, value)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma's layout: no space prefix (``add_space_prefix`` false), whitespace runs (2 and 3 spaces here, up to 31
    in Gemma) as user-defined tokens."""
    sp = _train(prefix=False, user=GEMMA_USER)
    meta = {"tokenizer.ggml.add_space_prefix": False}
    path = _write(tmp_path_factory.mktemp("gemma") / "gemma.gguf", "gemma2", *_vocab(sp), meta=meta)
    return sp, path, Tokenizer.from_gguf(open_gguf(path))


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    """Llama 2's layout: a space prefix (``add_space_prefix`` absent, llama.cpp's default true), no user tokens."""
    sp = _train(prefix=True, user=[])
    path = _write(tmp_path_factory.mktemp("llama") / "llama.gguf", "llama", *_vocab(sp))
    return sp, path, Tokenizer.from_gguf(open_gguf(path))


_REFERENCES = {}


def _transformers(path):
    """transformers' tokenizer of the GGUF file ``path`` (built once per file)."""
    need_torch()
    from models.hf_reference import transformers_tokenizer_from_gguf

    if path not in _REFERENCES:
        _REFERENCES[path] = transformers_tokenizer_from_gguf(path)
    return _REFERENCES[path]


# --------------------------------------------------------------------------------------------------------
# Gemma: transformers, sentencepiece and jspec agree.


@requires_torch
def test_gemma_ids_equal_transformers_and_sentencepiece(gemma):
    sp, path, tok = gemma
    ref = _transformers(path)
    assert not tok.add_eos and tok.add_bos and tok.bos_id == 1
    for text in PLAIN:
        ids = tok.encode(text, add_bos=False)
        assert ids == sp.encode(text), text
        assert tok.encode(text) == [1, *ids], text  # BOS, as add_bos_token says
        if " " * 4 in text:
            # A run of spaces longer than the longest user-defined one: sentencepiece and llama.cpp take the
            # longest user-defined run first ("▁▁▁" "▁"); transformers respells the runs as vocabulary entries and
            # merges them ("▁▁" "▁▁").
            assert ref.encode(text, add_special_tokens=False) != ids, text
            continue
        assert tok.encode(text) == ref.encode(text), text
    for text in SPECIAL + GEMMA_SPECIAL:
        assert tok.encode(text) == ref.encode(text), text
    # The cases the strings are there for do happen: byte fallback, whitespace runs as one token, control tokens.
    assert tok.encode("☃", add_bos=False) == [sp.piece_to_id(f"<0x{b:02X}>") for b in "☃".encode()]
    assert tok.encode("a   b", add_bos=False) == [
        sp.piece_to_id("a"),
        sp.piece_to_id("\u2581" * 3),
        sp.piece_to_id("b"),
    ]
    eot = sp.piece_to_id("<end_of_turn>")
    assert tok.encode("a<end_of_turn>b", add_bos=False) == [sp.piece_to_id("a"), eot, sp.piece_to_id("b")]
    assert eot in tok.eos_ids  # llama.cpp ends generation at it, by its text


@requires_torch
def test_gemma_decode_round_trips_and_equals_transformers(gemma):
    _, path, tok = gemma
    ref = _transformers(path)
    for text in PLAIN + SPECIAL + GEMMA_SPECIAL:
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
        if text in PLAIN:
            assert tok.decode(ids, skip_special_tokens=True) == text
    # A byte token alone is not text; decoding the whole run is.
    assert tok.decode(tok.encode("🦊", add_bos=False)) == "🦊"


@requires_torch
def test_gemma_chat_template_renders_as_transformers(gemma):
    _, path, tok = gemma
    ref = _transformers(path)
    chat = [
        {"role": "user", "content": "Hi there  ☃"},
        {"role": "assistant", "content": "Hello! 123"},
        {"role": "user", "content": " Again?"},
    ]
    for gen in (True, False):
        text = tok.apply_chat_template(chat, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        want = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert tok.encode_chat(chat, add_generation_prompt=gen) == list(want)
    assert text.startswith("<s><start_of_turn>") and tok.encode_chat(chat).count(tok.bos_id) == 1
    assert tok.special_tokens_map == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }


# --------------------------------------------------------------------------------------------------------
# Llama 2 (a space prefix): sentencepiece on plain text, llama.cpp's prefix rule around special tokens.


def test_llama2_ids_equal_sentencepiece(llama2):
    sp, _, tok = llama2
    for text in PLAIN:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text
        if text:
            assert tok.decode(tok.encode(text), skip_special_tokens=True) == text, text
    assert tok.encode("Hello", add_bos=False)[0] == sp.piece_to_id("\u2581He")  # the prefix


def test_llama2_prefixes_text_after_a_special_token_as_llama_cpp(llama2):
    """llama.cpp (llama_vocab::tokenize, SPM) gives a space prefix to every stretch of text that starts the input
    or follows a special token; each stretch is tokenized alone."""
    sp, _, tok = llama2
    eot, start = sp.piece_to_id("<end_of_turn>"), sp.piece_to_id("<start_of_turn>")
    assert tok.encode("a<end_of_turn>b", add_bos=False) == [*sp.encode("a"), eot, *sp.encode("b")]
    assert tok.encode("<start_of_turn>user\nHi", add_bos=False) == [start, *sp.encode("user\nHi")]
    assert tok.encode("<end_of_turn><end_of_turn>", add_bos=False) == [eot, eot]


@requires_torch
def test_llama2_ids_equal_transformers_where_it_follows_sentencepiece(llama2):
    """transformers' GGUF Llama tokenizer prefixes only the start of the text (Metaspace "first"), and not one
    that starts with a space: it matches sentencepiece on text that starts with neither a space nor a special
    token and holds no special token, which is where jspec is compared with it."""
    sp, path, tok = llama2
    ref = _transformers(path)
    for text in PLAIN:
        if text.startswith(" "):
            assert ref.encode(text, add_special_tokens=False) != sp.encode(text), text  # the difference is real
            continue
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text)), text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert tok.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------------------------------------------
# A hand-made vocabulary: the scores order the merges, BOS follows add_bos_token.

HAND = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "a", "b", "c", "ab", "bc"]
HAND_TYPES = [2, 3, 3, *([6] * 256), 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("ab, bc, want", [(-1.0, -2.0, ["ab", "c"]), (-2.0, -1.0, ["a", "bc"])])
def test_the_higher_scored_merge_wins(tmp_path, ab, bc, want):
    scores = [0.0] * (len(HAND) - 2) + [ab, bc]
    meta = {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.padding_token_id": None}
    tok = Tokenizer.from_gguf(open_gguf(_write(tmp_path / "t.gguf", "llama", HAND, scores, HAND_TYPES, meta=meta)))
    assert tok.encode("abc", add_bos=False) == [HAND.index(t) for t in want]
    assert tok.encode("d", add_bos=False) == [HAND.index("<0x64>")]  # byte fallback
    assert tok.decode(tok.encode("abcd☃")) == "<s>abcd☃"


@pytest.mark.parametrize("flag, bos", [(True, True), (False, False), (None, True)])
def test_bos_follows_add_bos_token(tmp_path, flag, bos):
    """add_bos_token as the file says; absent, llama.cpp's default for a SentencePiece vocabulary: BOS."""
    scores = [0.0] * len(HAND)
    meta = {"tokenizer.ggml.add_bos_token": flag}
    tok = Tokenizer.from_gguf(open_gguf(_write(tmp_path / "t.gguf", "llama", HAND, scores, HAND_TYPES, meta=meta)))
    assert tok.add_bos is bos
    assert tok.encode("a") == [1] * bos + [HAND.index("\u2581"), HAND.index("a")]  # and the space prefix


# --------------------------------------------------------------------------------------------------------
# Bad input is refused by name.


def test_unknown_tokenizer_model_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "t.gguf", "llama", HAND, [0.0] * len(HAND), HAND_TYPES, model="t5")
    with pytest.raises(
        CheckpointError, match=r"tokenizer model 't5' \(tokenizer.ggml.model\) is not supported.*'llama'"
    ):
        Tokenizer.from_gguf(open_gguf(path))


def test_missing_or_short_fields_are_named(tmp_path):
    path = _write(tmp_path / "noscores.gguf", "llama", HAND, None, HAND_TYPES)
    with pytest.raises(CheckpointError, match=r"without tokenizer\.ggml\.scores"):
        Tokenizer.from_gguf(open_gguf(path))
    path = _write(tmp_path / "short.gguf", "llama", HAND, [0.0] * 3, HAND_TYPES)
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.scores has 3 entries for 265 tokens"):
        Tokenizer.from_gguf(open_gguf(path))
    path = _write(tmp_path / "types.gguf", "llama", HAND, [0.0] * len(HAND), [1] * 5)
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.token_type has 5 entries for 265 tokens"):
        Tokenizer.from_gguf(open_gguf(path))
