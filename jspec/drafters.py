"""Drafters: what proposes candidates. The decoder only sees this small protocol.

A drafter is a frozen (hashable) object, a static argument of the jitted decoder, with three pure methods:
- ``init(params, prompt, prompt_len, slots) -> state``: set-up after the prompt is known (e.g. a draft
  model's prefill). ``prompt`` [B, P] right-padded, ``prompt_len`` [B].
- ``propose(params, state, ctx, key, k) -> Proposal``: up to ``k`` (static) candidates per row, and the
  distributions q they were really drawn from. ``key`` is one key for the batch or [B] per-row keys (per-request
  seeds); draw through ``jspec.sampling``'s ``split_keys`` / ``uniform`` / ``gumbel`` / ``sample``, which take
  both, so a row's draws come from its own key.
- ``vocab_size``: V of q (must equal the target's), or None for drafters that emit token ids only.
- optionally ``observe(params, state, ctx) -> state``: called instead of ``propose`` in rounds where no row
  may propose (adaptive K at 0), so a stateful drafter keeps up with the committed sequence cheaply.
- optionally ``check_target(target, target_params, draft_params)``: raises a ValueError naming the problem when
  the drafter cannot serve this target with these params (``decode`` and ``serve.Engine`` call it on the host;
  ``target_params`` may be None where a caller does not have them). Drafters that run part of the target's
  computation themselves (self-speculation, EAGLE's verification) use it to refuse a target they would not
  reproduce.

Drafters that are part of the target (self-speculation) also set ``shares_target_cache = True``: they then
find the target's cache in ``ctx.target_cache``, may write their own entries into it (returned in
``Proposal.target_cache``), and provide ``verify(target, target_params, draft_params, state, tokens,
positions, cache) -> (logits, cache)`` to replace the target call of the verification, reusing what they
computed. A drafter that needs by-products of the verification (an EAGLE head reads the target's hidden
features) sets ``verify_updates_state = True``; its ``verify`` (which need not share the cache) then returns
``(logits, cache, new_state)`` and the decoder keeps that state for the next round. Such a drafter usually
needs the prompt's by-products too; it may provide ``prefill(target, target_params, draft_params, prompt,
positions, cache, prompt_len, slots) -> (logits of each row's last prompt token [B, V], cache, state)``,
which then replaces both the decoder's prefill call and ``init``, so the target runs over the prompt once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jspec.cache import take_rows
from jspec.model import Model
from jspec.sampling import SamplingParams, distribution, sample, split_keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter may read at the start of a round.

    seq: [B, W] every token of the row so far (prompt, then generated), right-padded.
    seq_len: [B] tokens in ``seq``; the last one (``seq[b, seq_len-1]``) is the pending token, emitted but
      not yet run through the target.
    max_draft: [B] proposals allowed this round (<= K): limited by the cache room and the tokens still wanted.
    sampling: the rows' sampling parameters; q must be ``distribution(draft_logits, sampling)``.
    target_cache: the target's cache, for drafters with ``shares_target_cache`` (None otherwise).
    """

    seq: jax.Array
    seq_len: jax.Array
    max_draft: jax.Array
    sampling: SamplingParams
    target_cache: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """tokens: [B, K]; q: [B, K, V] (the distribution each token was drawn from); n_draft: [B] how many of
    the K are real proposals (the rest are padding and are never accepted); state: the drafter's new state;
    target_cache: the target's cache with the drafter's writes (only for ``shares_target_cache`` drafters)."""

    tokens: jax.Array
    q: jax.Array
    n_draft: jax.Array
    state: Any
    target_cache: Any = None


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A separate (smaller) model sharing the target's tokenizer drafts K tokens autoregressively.

    Its cache follows the committed sequence by index masking alone: each round rewinds the cache to one
    slot before the pending token and re-feeds [previous token, pending token] (rewriting an identical entry
    when it already exists), so whether the last round's final proposal was accepted needs no bookkeeping.
    """

    model: Model

    needs_params: ClassVar[bool] = True  # its model's params: prepare refuses None

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int):
        b, p = prompt.shape
        cache = self.model.init_cache(b, slots)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = self.model.apply(params, prompt, positions, cache)
        # A commit, not a length change: a cache with more state (a compressed model's block summaries) keeps
        # what the prompt's tokens wrote only when they are committed.
        return cache.commit(prompt_len)

    def _catch_up(self, params, cache, ctx: DraftContext):
        """Rewind to one slot before the pending token and feed [previous, pending]: afterwards the cache
        holds the whole committed sequence plus the pending token. Returns (logits [B, 2, V], cache)."""
        b = ctx.seq.shape[0]
        pend = ctx.seq_len - 1  # slot/position of the pending token
        first = take_rows(ctx.seq, jnp.stack([jnp.maximum(pend - 1, 0), pend], axis=1))
        cache = cache.with_lengths(pend - 1)
        logits, cache = self.model.apply(params, first, jnp.stack([pend - 1, pend], axis=1), cache)
        return logits, cache.commit(jnp.full((b,), 2, jnp.int32))

    def observe(self, params, cache, ctx: DraftContext):
        return self._catch_up(params, cache, ctx)[1]

    def propose(self, params, cache, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        b = ctx.seq.shape[0]
        pend = ctx.seq_len - 1
        logits, cache = self._catch_up(params, cache, ctx)
        keys = split_keys(key, k)
        q0 = distribution(logits[:, -1], ctx.sampling)
        x0 = sample(keys[0], q0)

        def step(carry, k_i):
            cache, x, pos = carry
            logits, cache = self.model.apply(params, x[:, None], pos[:, None], cache)
            cache = cache.commit(jnp.ones((b,), jnp.int32))
            q = distribution(logits[:, 0], ctx.sampling)
            nx = sample(k_i, q)
            return (cache, nx, pos + 1), (nx, q)

        (cache, _, _), (xs, qs) = jax.lax.scan(step, (cache, x0, pend + 1), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        return Proposal(tokens, q, ctx.max_draft, cache)
