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

from jspec.drafters import DraftContext, Drafter, Proposal, StaticTreeShape
from jspec.tree import TreeProposal, TreeRule, TreeSpec, _count

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
    [min_ngram, max_ngram]) and read the tokens that followed it, repeated with their period when fewer than K
    follow (the history then ends in a repetition).

    Returns tokens [B, K] (zeros when nothing matches), n_found [B] (K when something matches, 0 when nothing
    does) and ngram [B] (the n that matched, 0 when none).
    """
    b, w = seq.shape
    seq = seq.astype(jnp.int32)
    seq_len = seq_len.astype(jnp.int32)
    m = max_ngram
    padded, sfx, earlier = _suffix_setup(seq, seq_len, m)
    ends = jnp.arange(w, dtype=jnp.int32)[None, :]
    best_match, best_n = _longest_suffix_matches(padded, sfx, earlier, m, min_ngram)
    best_end = jnp.max(jnp.where(best_match, ends, -1), axis=1)  # the most recent occurrence
    start = best_end + 1
    # The p = seq_len - start tokens that followed the occurrence, repeated: the history's end then reads as a
    # repetition of period p (a greedy loop, say, when the occurrence overlaps the suffix), continued. Any
    # proposal is lossless, and a K-wide verification costs the same whatever it holds.
    period = jnp.maximum(seq_len - start, 1)
    n_found = jnp.where(best_n > 0, k, 0)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = jnp.clip(start[:, None] + j % period[:, None], 0, w - 1)
    tokens = jnp.where(j < n_found[:, None], jnp.take_along_axis(seq, idx, axis=1), 0)
    return tokens, n_found, best_n


def _counts(drafter, *names: str) -> None:
    """Integer fields as ints: True read as 1, and 2.5 failed at trace time in range()."""
    for name in names:
        object.__setattr__(drafter, name, _count(name, getattr(drafter, name)))


def _longest_suffix_matches(padded, sfx, earlier, m: int, min_ngram: int):
    """-> (match [B, W]: occurrence ends of the longest matching suffix n-gram, best_n [B], 0 = none)."""
    b, w = earlier.shape
    best_match = jnp.zeros((b, w), bool)
    best_n = jnp.zeros((b,), jnp.int32)
    match = earlier
    # Growing n only adds one comparison to the (n-1)-gram match, so all lengths together cost O(B W m).
    # Ascending n, a found longer n overwrites a shorter one: the longest matching n wins.
    for n in range(1, m + 1):
        match = match & (padded[:, m - (n - 1) : m - (n - 1) + w] == sfx[:, n - 1 : n])
        if n < min_ngram:
            continue
        found = jnp.any(match, axis=1)
        best_match = jnp.where(found[:, None], match, best_match)
        best_n = jnp.where(found, n, best_n)
    return best_match, best_n


def _suffix_setup(seq, seq_len, m):
    b, w = seq.shape
    rows = jnp.arange(b)
    padded = jnp.concatenate([jnp.full((b, m), _PAD, jnp.int32), seq], axis=1)  # [B, m + W]
    sfx_idx = seq_len[:, None] - 1 - jnp.arange(m)[None, :]  # [B, m]
    sfx = jnp.where(sfx_idx >= 0, seq[rows[:, None], jnp.maximum(sfx_idx, 0)], _PAD)
    earlier = jnp.arange(w, dtype=jnp.int32)[None, :] <= (seq_len[:, None] - 2)
    return padded, sfx, earlier


def ngram_continuations(
    seq: jax.Array,  # [B, W]
    seq_len: jax.Array,  # [B]
    branches: int,  # C, static
    k: int,  # K, static
    max_ngram: int,
    min_ngram: int,
) -> tuple[jax.Array, jax.Array]:
    """Up to C continuations per row for a candidate tree: the most recent occurrences of the longest suffix
    n-gram whose next tokens are all different (so the continuations branch at their first token).

    Returns tokens [B, C, K] and n_found [B, C] (K per continuation found, repeated with its period as
    ``ngram_lookup`` does; 0 = no such continuation).
    """
    b, w = seq.shape
    seq = seq.astype(jnp.int32)
    seq_len = seq_len.astype(jnp.int32)
    padded, sfx, earlier = _suffix_setup(seq, seq_len, max_ngram)
    match, best_n = _longest_suffix_matches(padded, sfx, earlier, max_ngram, min_ngram)
    ends = jnp.arange(w, dtype=jnp.int32)[None, :]
    nxt = jnp.concatenate([seq[:, 1:], jnp.full((b, 1), _PAD, jnp.int32)], axis=1)  # token after each end
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    toks, counts = [], []
    for _ in range(branches):
        end = jnp.max(jnp.where(match, ends, -1), axis=1)
        start = end + 1
        # As ``ngram_lookup``: the tokens that followed, repeated with their period up to K.
        period = jnp.maximum(seq_len - start, 1)
        n_found = jnp.where((best_n > 0) & (end >= 0), k, 0)
        idx = jnp.clip(start[:, None] + j % period[:, None], 0, w - 1)
        toks.append(jnp.where(j < n_found[:, None], jnp.take_along_axis(seq, idx, axis=1), 0))
        counts.append(n_found)
        # Later branches must start with a different token.
        first = jnp.take_along_axis(nxt, jnp.maximum(end, 0)[:, None], axis=1)
        match = match & (nxt != first)
    return jnp.stack(toks, axis=1), jnp.stack(counts, axis=1)


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    """Prompt-lookup drafter (see the module docstring). Hashable: a static argument of the jitted decoder.

    max_ngram / min_ngram: suffix lengths tried, longest first. vocab_size: V of the one-hot q (the
    target's). The drafter keeps no state and needs no params (pass ``draft_params=None``).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    _: dataclasses.KW_ONLY
    vocab_size: int

    def __post_init__(self):
        _counts(self, "max_ngram", "min_ngram", "vocab_size")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min={self.min_ngram}, max={self.max_ngram}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    def propose(self, params, state, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        """tokens [B, K], q [B, K, V] one-hot (padding positions: one-hot on token 0, never NaN), n_draft [B]."""
        tokens, n_found, _ = ngram_lookup(ctx.seq, ctx.seq_len, k, self.max_ngram, self.min_ngram)
        n_draft = jnp.minimum(n_found, ctx.max_draft).astype(jnp.int32)
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return Proposal(tokens, q, n_draft, state)


@dataclasses.dataclass(frozen=True)
class NgramTreeDrafter(StaticTreeShape, Drafter):
    """Prompt lookup with several continuations: a candidate tree whose root has up to ``branches`` children
    (the different tokens that followed the most recent occurrences of the suffix n-gram), each continued as
    a chain of up to ``depth`` tokens. Deterministic proposals: verified with ``TreeRule.DETERMINISTIC``."""

    branches: int = 3
    depth: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    _: dataclasses.KW_ONLY
    vocab_size: int

    def __post_init__(self):
        _counts(self, "branches", "depth", "max_ngram", "min_ngram", "vocab_size")
        if self.branches < 1 or self.depth < 1:
            raise ValueError(f"need branches >= 1 and depth >= 1, got branches={self.branches}, depth={self.depth}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min={self.min_ngram}, max={self.max_ngram}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def rule(self):
        return TreeRule.DETERMINISTIC

    @property
    def spec(self):
        return TreeSpec((self.branches,) + (1,) * (self.depth - 1))

    def propose_tree(self, params, state, ctx: DraftContext, key) -> TreeProposal:
        c, k = self.branches, self.depth
        toks, n_found = ngram_continuations(ctx.seq, ctx.seq_len, c, k, self.max_ngram, self.min_ngram)
        b = toks.shape[0]
        parent_np, depth_np, _ = self.spec.arrays  # breadth-first: level d holds branch i at 1 + d*c + i
        # Node 1 + d*c + i is token d of continuation i.
        node_tok = jnp.transpose(toks, (0, 2, 1)).reshape(b, k * c)
        node_ok = (jnp.arange(k)[None, None, :] < n_found[:, :, None]).transpose(0, 2, 1).reshape(b, k * c)
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), node_tok], axis=1)
        valid = jnp.concatenate([jnp.ones((b, 1), bool), node_ok], axis=1)
        parent = jnp.broadcast_to(jnp.asarray(parent_np, jnp.int32), tokens.shape)
        depth = jnp.broadcast_to(jnp.asarray(depth_np, jnp.int32), tokens.shape)
        q = jnp.zeros((b, tokens.shape[1], 1), jnp.float32)  # unused by the DETERMINISTIC rule
        return TreeProposal(tokens, q, parent, depth, valid, state)
