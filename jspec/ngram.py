"""Prompt-lookup (n-gram) drafting, entirely on device.

Each row looks up the last n tokens of its own history (prompt + generated, the pending token included) at
an earlier place in that history, for n from ``max_ngram`` down to ``min_ngram``, and proposes the tokens
that followed the most recent such occurrence. Nothing is learnt and nothing is sampled: the proposal is a
deterministic function of the committed history, so q is a one-hot on the proposed token. Chain
verification then accepts x with probability p(x) and, on rejection, draws from p with x removed, which
keeps the output distributed exactly as the target's.

Cost per round: O(B * W * max_ngram) comparisons and reductions over the history width W, no sort, no
O(W^2) table, no host sync. A row with no match proposes nothing, so a miss costs (almost) nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters import DraftContext, Proposal

# Stands for "before the start of the row"; outside any vocabulary, so it never matches a real token. Both
# sides can use it: an occurrence ends before the suffix, so its side runs off the row first, while the
# suffix side still holds a real token there, and the match has already failed.
_PAD = -1


def ngram_lookup(
    seq: jax.Array,  # [B, W] int history, right-padded
    seq_len: jax.Array,  # [B] valid tokens per row (>= 1)
    k: int,  # K, static
    max_ngram: int,
    min_ngram: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Find, per row, the most recent earlier occurrence of the longest suffix n-gram (n in
    [min_ngram, max_ngram]) and read the tokens that followed it.

    Returns tokens [B, K] (0 past the available ones), n_found [B] (how many of the K are real: the
    continuation stops at the end of the history; 0 when nothing matches) and ngram [B] (the n that matched,
    0 when none).
    """
    b, w = seq.shape
    seq = seq.astype(jnp.int32)
    seq_len = seq_len.astype(jnp.int32)
    m = max_ngram
    rows = jnp.arange(b)
    # Occurrences are indexed by their END position e; the suffix ends at L-1. Token j back from the end:
    # history side seq[e - j] (left padding stands in for e - j < 0), suffix side seq[L-1-j].
    padded = jnp.concatenate([jnp.full((b, m), _PAD, jnp.int32), seq], axis=1)  # [B, m + W]
    sfx_idx = seq_len[:, None] - 1 - jnp.arange(m)[None, :]  # [B, m]
    sfx = jnp.where(sfx_idx >= 0, seq[rows[:, None], jnp.maximum(sfx_idx, 0)], _PAD)
    ends = jnp.arange(w, dtype=jnp.int32)[None, :]
    # An occurrence must end before the suffix does (strictly earlier), which also guarantees at least one
    # following token inside the history.
    earlier = ends <= (seq_len[:, None] - 2)  # [B, W]

    best_end = jnp.full((b,), -1, jnp.int32)
    best_n = jnp.zeros((b,), jnp.int32)
    match = earlier
    # Growing n only adds one comparison to the (n-1)-gram match, so all lengths together cost O(B W m).
    # Ascending n, a found longer n overwrites a shorter one: the longest matching n wins.
    for n in range(1, m + 1):
        match = match & (padded[:, m - (n - 1) : m - (n - 1) + w] == sfx[:, n - 1 : n])
        if n < min_ngram:
            continue
        last = jnp.max(jnp.where(match, ends, -1), axis=1)  # most recent occurrence of this n-gram
        found = last >= 0
        best_end = jnp.where(found, last, best_end)
        best_n = jnp.where(found, n, best_n)

    start = best_end + 1
    n_found = jnp.where(best_n > 0, jnp.minimum(seq_len - start, k), 0)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = jnp.clip(start[:, None] + j, 0, w - 1)
    tokens = jnp.where(j < n_found[:, None], jnp.take_along_axis(seq, idx, axis=1), 0)
    return tokens, n_found, best_n


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafter (see the module docstring). Hashable: a static argument of the jitted decoder.

    max_ngram / min_ngram: suffix lengths tried, longest first. vocab_size: V of the one-hot q (the
    target's). The drafter keeps no state and needs no params (pass ``draft_params=None``).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    _: dataclasses.KW_ONLY
    vocab_size: int

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min={self.min_ngram}, max={self.max_ngram}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int) -> None:
        # The history the lookup needs is the decoder's own ``ctx.seq``: nothing to keep between rounds.
        return None

    def propose(self, params, state, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        """tokens [B, K], q [B, K, V] one-hot (padding positions: one-hot on token 0, never NaN), n_draft [B]."""
        tokens, n_found, _ = ngram_lookup(ctx.seq, ctx.seq_len, k, self.max_ngram, self.min_ngram)
        n_draft = jnp.minimum(n_found, ctx.max_draft).astype(jnp.int32)
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return Proposal(tokens, q, n_draft, state)
