"""Whether a draft can draft for a target: the same vocabulary, token strings and special ids.

Speculative decoding is lossless for any draft, but a draft with another tokenizer proposes ids that mean other
strings, so nothing it proposes is accepted: a silent waste, refused here by name instead. Every way in checks
it (``as_drafter``, ``models.draft_checkpoint.load_draft``, the registry's ``--drafter model``), so it is one
module of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


class DraftMismatchError(ValueError):
    """A draft that cannot draft for this target (vocabulary or tokenizer differ); the message names what."""


def tokenizer_tokens(tokenizer) -> list[str]:
    """Every token string of a ``models.tokenizer.Tokenizer`` (or a bare ``tokenizers.Tokenizer``) by id."""
    backend = getattr(tokenizer, "backend", tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    return [backend.id_to_token(i) or "" for i in range(n)]


def tokens_fingerprint(tokens: Sequence[str]) -> str:
    return hashlib.sha256("\x00".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()


def check_compatible(
    target_vocab: int,
    draft_vocab: int,
    target_tokens: Sequence[str] | None = None,
    draft_tokens: Sequence[str] | None = None,
    *,
    target_name: str = "target",
    draft_name: str = "draft",
    target_special: dict[str, int | None] | None = None,
    draft_special: dict[str, int | None] | None = None,
) -> None:
    """Raise ``DraftMismatchError`` unless the draft can propose for the target: equal vocabulary sizes and,
    when both token lists are known, the same string for every id (same size is not enough: a different
    tokenizer with as many tokens would make every proposal mean another string), and the same special
    ids (EOS ends rows for both)."""
    if target_vocab != draft_vocab:
        raise DraftMismatchError(
            f"vocabulary mismatch: draft '{draft_name}' has {draft_vocab} tokens, target '{target_name}' has "
            f"{target_vocab}; a draft must share the target's tokenizer"
        )
    if target_tokens is not None and draft_tokens is not None:
        if len(target_tokens) != len(draft_tokens):
            raise DraftMismatchError(
                f"tokenizer mismatch: draft '{draft_name}' tokenizer has {len(draft_tokens)} tokens, target "
                f"'{target_name}' has {len(target_tokens)}"
            )
        for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)):
            if a != b:
                raise DraftMismatchError(
                    f"tokenizer mismatch: token id {i} is {b!r} for draft '{draft_name}' but {a!r} for target "
                    f"'{target_name}'; a draft must share the target's tokenizer (same vocabulary size is not "
                    "enough)"
                )
    for key in sorted(set(target_special or {}) & set(draft_special or {})):
        a, b = target_special[key], draft_special[key]
        if a is not None and b is not None and a != b:
            raise DraftMismatchError(
                f"tokenizer mismatch: {key} is id {b} for draft '{draft_name}' but {a} for target '{target_name}'"
            )


def special_ids(tokenizer) -> dict[str, int | None]:
    """The tokenizer's EOS and BOS ids (None where it has none), as drafts record and compare them."""
    return {"eos_id": getattr(tokenizer, "eos_id", None), "bos_id": getattr(tokenizer, "bos_id", None)}


def _config_special(loaded) -> dict[str, int | None]:
    # A checkpoint without a tokenizer still states its special ids in its config (GGUF metadata, config.json).
    return {"eos_id": loaded.config.eos_id, "bos_id": loaded.config.bos_id}


def check_models_compatible(target, draft) -> None:
    """Two ``models.registry.LoadedModel``-like objects (``config``, ``tokenizer``; the tokenizer may be None:
    then its config's special ids are compared, with the vocabulary size)."""
    tt, dt = target.tokenizer, draft.tokenizer
    check_compatible(
        target.config.vocab_size,
        draft.config.vocab_size,
        tokenizer_tokens(tt) if tt is not None else None,
        tokenizer_tokens(dt) if dt is not None else None,
        target_name=target.config.name,
        draft_name=draft.config.name,
        # Like with like: tokenizers' ids when both have one, else both configs' (a tokenizer's EOS may be the
        # chat turn's end while its config keeps the base model's).
        target_special=special_ids(tt) if tt is not None and dt is not None else _config_special(target),
        draft_special=special_ids(dt) if tt is not None and dt is not None else _config_special(draft),
    )


def as_drafter(target, draft):
    """A loaded model (any checkpoint the loaders read) as a draft for a loaded target, after the
    compatibility check: returns (``ModelDrafter``, draft params) for ``jspec.decode``."""
    from jspec.drafters import ModelDrafter

    check_models_compatible(target, draft)
    return ModelDrafter(draft.model), draft.params
