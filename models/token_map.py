"""The frequent-token map: which N tokens a restricted LM head keeps, and the counts it is chosen from.

A head over N of the V tokens reads N rows instead of V per draft step (the reason distilled drafts and EAGLE
heads have one), and q is 0 outside them, so the rule that picks them decides which tokens can ever be
proposed. It is one rule for every restricted head, the distilled draft's (``models.draft_model``) and the
EAGLE head's (``models.eagle_head``), so it lives apart from both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def token_counts(token_lists: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Occurrences [V] of every token id in some token lists (e.g. target-generated continuations)."""
    counts = np.zeros(vocab_size, np.int64)
    for toks in token_lists:
        arr = np.asarray(toks, np.int64).reshape(-1)
        if arr.size:
            # An id outside the vocabulary is not one of its tokens: cut off, it would vanish from the counts.
            bad = arr[(arr < 0) | (arr >= vocab_size)]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
            counts += np.bincount(arr, minlength=vocab_size)
    return counts


def frequent_token_map(counts: np.ndarray, n: int, always: Sequence[int] = ()) -> np.ndarray:
    """The N token ids [N] int32 (ascending) the frequent-token head keeps.

    counts [V]: occurrences in target-generated text. Ties (and tokens never seen, which is most of them
    with a few thousand sampled tokens) are broken by the lower id first: a BPE vocabulary numbers its
    merges in training order, so a low id is a token that was frequent in the tokenizer's corpus.
    always: ids kept whatever their counts (EOS: a draft that cannot propose the end of an answer wastes
      its last round of every reply).
    """
    counts = np.asarray(counts, np.float64)
    v = counts.shape[0]
    if not 0 < n <= v:
        raise ValueError(f"head size N={n} must be in [1, V={v}]")
    always = np.asarray(always, np.int64).reshape(-1)
    bad = always[(always < 0) | (always >= v)]
    if bad.size:  # a negative id would index from the end: another token kept in its place
        raise ValueError(f"always: token id {int(bad[0])} is outside the vocabulary [0, {v})")
    score = counts.copy()
    score[always] = np.inf
    order = np.lexsort((np.arange(v), -score))  # count descending, then id ascending
    return np.sort(order[:n]).astype(np.int32)
