"""A GGUF SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``: Llama 2, Mistral v0.1, Gemma) as a
``tokenizers`` pipeline that tokenizes as llama.cpp does.

llama.cpp's SPM tokenizer joins adjacent pieces, the pair whose joined text is the vocabulary entry of the
highest score first, and spells a character outside the vocabulary as its UTF-8 bytes ``<0xNN>``. A ``tokenizers``
BPE model does the same given merges ranked by the joined token's score and ``byte_fallback``; the merges are
derived here from the vocabulary (every split of a NORMAL token into two NORMAL tokens), as transformers and
``tokenizers``' own SentencePiece extractor derive them. Spaces become ``▁``; where the file asks for a space
prefix (``tokenizer.ggml.add_space_prefix``, true when absent), every stretch of text between two special tokens
gets one, as llama.cpp prefixes each text fragment that follows a special token or starts the text. The
metadata's scores are the merge order; ties go to the lower id.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers

# GGUF token types (llama.cpp's llama_token_type; SentencePiece's piece types as the converter writes them).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges ranked as llama.cpp's SPM tokenizer applies them: a pair joins when the joined text is a NORMAL
    token, the best-scoring joined token first (ties: the lower id), for every split of that token into two NORMAL
    tokens (ties: the shorter left part). A type of 0 (a file without token types) counts as NORMAL."""
    normal = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (0, NORMAL):
            normal.setdefault(t, i)  # a duplicate spelling keeps its first id, as the BPE vocabulary does
    ranked = []
    for t, i in normal.items():
        for k in range(1, len(t)):
            if t[:k] in normal and t[k:] in normal:
                ranked.append((-float(scores[i]), i, k, t[:k], t[k:]))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_backend(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    unk_id: int | None,
    add_space_prefix: bool,
) -> Tokenizer:
    """The ``tokenizers`` pipeline of a SentencePiece vocabulary (no special tokens registered yet: the caller adds
    the CONTROL, UNKNOWN and USER_DEFINED ones). Decoding turns ``▁`` back into spaces, byte tokens back into UTF-8
    and, with a space prefix, drops the first leading space (transformers' decoder for these vocabularies)."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, scores, types),
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    escape = normalizers.Replace(" ", SPACE)
    # A normalizer runs on each stretch of text between added tokens, which is where llama.cpp prefixes a space.
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend
