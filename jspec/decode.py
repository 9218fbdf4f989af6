"""Speculative decoding as one jit-compiled loop: prefill, then ``lax.while_loop`` over rounds of
draft rollout -> one target call over K+1 positions -> acceptance -> commit, per row, with no host sync.

Plain autoregressive decoding is the same loop with no drafter (K = 0): baselines share every line but the
speculation.

Statistics (``DecodeStats``), per row:
- rounds: verification rounds the row took part in (the first token, sampled at prefill, is not a round).
- emitted: tokens the rounds appended (accepted proposals + one correction/bonus token each, after EOS /
  length truncation); ``tokens_per_round = emitted / rounds``.
- proposed: candidate tokens proposed to the target; accepted: how many of them the target accepted.
- acceptance rate = accepted / proposed: the fraction of proposed candidates that were kept. It is not
  the useful output per round (that is tokens_per_round, which also counts the correction/bonus token).
- accepted_at[i] / proposed_at[i] (summed over rows): candidates accepted / proposed at draft position i.
  For a tree, position i is depth i + 1 and proposed_at counts its candidate nodes, of which at most one is
  accepted: the rate is a fraction of nodes (at most 1 / the branching), not a chain's conditional
  acceptance, so ``jspec.cost_model``'s expected-token formulas do not apply to tree statistics.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jspec import adaptive as adapt
from jspec.adaptive import AdaptiveK
from jspec.cache import set_rows, take_rows
from jspec.drafters import DraftContext, Proposal
from jspec.model import Model
from jspec.sampling import (
    SamplingParams,
    argmax,
    distribution,
    int_array,
    is_stop,
    penalized_logits,
    processed_logits,
    sample,
    split_keys,
    top_k,
)
from jspec.stop import StopStrings, check_stop_strings
from jspec.tree import TreeProposal, TreeRule, ancestor_mask, verify_tree_greedy, verify_tree_key
from jspec.verify import verify_chain_greedy, verify_chain_key


class StopReason(enum.IntEnum):
    RUNNING = 0
    EOS = 1  # an end token: one of eos_ids or of the row's stop_token_ids
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3
    IDLE = 4  # no request in this row (the serving engine's free rows)
    STOP_STRING = 5  # one of the request's stop strings (host-side: ``jspec.stop``, the engine and the CLI)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static loop configuration: changing any field recompiles. Everything per call is an array.

    gamma: K, the (maximum) number of candidates per round; 0 = plain autoregressive decoding.
    slots: S, cache slots per row: the prompt and every generated token but the last (never fed back) must fit,
      P + N <= S + 1.
    eos_ids: token ids that end a row (the EOS token is emitted, nothing after it).
    debug_checks: check invariants on device (a proposal with q(x) == 0 raises).
    adaptive: per-row draft length policy (``jspec.adaptive.AdaptiveK``); None = always K.
    block_verify: verify chains jointly (``jspec.verify.verify_block``) instead of token by token.
    logprobs: keep the target's log-probability of every generated token (``DecodeOutput.logprobs``).
    top_logprobs: N, also keep the N most likely tokens and their log-probabilities at every generated position
      (``DecodeOutput.top_logprobs``; OpenAI's ``top_logprobs``, vLLM's ``logprobs=N``); needs ``logprobs``.
    penalties: keep per-row token counts ([B, V]) so that the rows' repetition / presence / frequency penalties
      apply; without it they are not applied (``prepare`` sets it when a row asks for one, ``Engine.add`` refuses
      a penalty without it).
    constrain: optional ``DecodeState -> DecodeState`` applied after prefill and after every round, e.g. to pin
      shardings of the loop state with ``jax.lax.with_sharding_constraint`` (see ``sharding``).
    """

    gamma: int
    slots: int
    eos_ids: tuple[int, ...] = ()
    debug_checks: bool = False
    adaptive: AdaptiveK | None = None
    block_verify: bool = False
    constrain: Any = None
    logprobs: bool = False
    top_logprobs: int = 0
    penalties: bool = False

    def __post_init__(self):
        if self.top_logprobs and not self.logprobs:  # the alternatives are read from the logprobs' logits
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
    rounds: jax.Array  # [B]
    emitted: jax.Array  # [B]
    proposed: jax.Array  # [B]
    accepted: jax.Array  # [B]
    accepted_at: jax.Array  # [K]
    proposed_at: jax.Array  # [K]
    loop_rounds: jax.Array  # [] while-loop iterations (max over rows of rounds)
    wide_rounds: jax.Array  # [] iterations that verified wide (K+1 positions, or a tree's N nodes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes during decoding. ``seq`` holds prompt + generated tokens per row; its last
    valid entry (``seq_len - 1``) is the pending token, emitted but not yet in the target cache."""

    seq: jax.Array  # [B, S+1]
    seq_len: jax.Array  # [B]
    prompt_len: jax.Array  # [B]
    max_new: jax.Array  # [B]
    cache: Any  # target cache; committed lengths = seq_len - 1
    draft_state: Any
    sampling: SamplingParams
    key: jax.Array
    stop: jax.Array  # [B] StopReason
    stats: DecodeStats
    bad_proposal: jax.Array  # [] bool, some row proposed a token its drafter gave q(x) == 0
    accept_ema: jax.Array  # [B, 2] float32, the adaptive draft length's (accepted, tested) moving sums
    # [B, S+1] float32: the target's log-probability of the token at each slot of ``seq`` (generated slots only;
    # [B, 0] unless ``DecodeConfig.logprobs``)
    logprob: jax.Array
    # [B, S+1, N] int32 / float32: the N most likely tokens at each generated slot of ``seq`` and their
    # log-probabilities, most likely first ([B, 0, 0] unless ``DecodeConfig.top_logprobs``)
    top_ids: jax.Array
    top_logprob: jax.Array
    # [B, V] int32: how often each token occurs among the generated tokens (the pending one included); [B, V] bool:
    # the token occurs in the prompt ([B, 0] both unless ``DecodeConfig.penalties``)
    out_counts: jax.Array
    prompt_seen: jax.Array


def top_token_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V] -> (ids [B, T, N] int32, log-probabilities [B, T, N] float32) of the N most likely tokens
    under the raw logits at temperature 1, most likely first (the lower id first among equal values)."""
    logits = logits.astype(jnp.float32)
    vals, ids = top_k(logits, n)
    return ids, vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits [B, T, V], tokens [B, T] -> [B, T] float32 log-probabilities of the tokens under the model's own
    distribution (the raw logits at temperature 1, before any sampling transform, as vLLM reports by default)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _scatter_rows(buf: jax.Array, start: jax.Array, vals: jax.Array, n: jax.Array) -> jax.Array:
    """buf [B, W, ...]; write vals[b, :n[b]] ([B, T, ...]) at buf[b, start[b]:]; anything else (or past W) is
    dropped."""
    w = buf.shape[1]
    j = jnp.arange(vals.shape[1], dtype=jnp.int32)[None, :]
    idx = jnp.where(j < n[:, None], start[:, None] + j, w)
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(buf, idx, vals)


def prefill(
    target: Model,
    drafter,
    config: DecodeConfig,
    target_params,
    draft_params,
    prompt: jax.Array,  # [B, P] right-padded
    prompt_len: jax.Array,  # [B]
    max_new: jax.Array,  # [B]
    sampling: SamplingParams,
    key: jax.Array,
) -> DecodeState:
    """Run the prompt through the target (and drafter), sample the first token, build the loop state."""
    b, p = prompt.shape
    s = config.slots
    cache = target.init_cache(b, s)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    draft_state = None
    if hasattr(drafter, "prefill"):
        # A drafter that needs the target's own prefill (EAGLE: the prompt's features) runs that one pass.
        last, cache, draft_state = drafter.prefill(
            target, target_params, draft_params, prompt, positions, cache, prompt_len, s
        )
    elif target.apply_at is not None:
        last, cache = target.apply_at(target_params, prompt, positions, cache, prompt_len - 1)
    else:
        logits, cache = target.apply(target_params, prompt, positions, cache)
        last = take_rows(logits, prompt_len - 1)
    if drafter is not None and draft_state is None:
        draft_state = drafter.init(draft_params, prompt, prompt_len, s)
    cache = cache.commit(prompt_len)  # a commit, not a length change: caches with more state must keep it
    key, k0 = split_keys(key, 2)
    first_logits = processed_logits(last[:, None], sampling, jnp.zeros((b, 1), jnp.int32), config.eos_ids)
    v = last.shape[-1]
    out_counts = jnp.zeros((b, v if config.penalties else 0), jnp.int32)
    prompt_seen = jnp.zeros((b, v if config.penalties else 0), bool)
    if config.penalties:
        in_prompt = jnp.arange(p)[None, :] < prompt_len[:, None]
        ids = jnp.where(in_prompt, prompt, v)  # padding: dropped
        prompt_seen = jax.vmap(lambda row, i: row.at[i].set(True, mode="drop"))(prompt_seen, ids)
        first_logits = penalized_logits(first_logits, sampling, jnp.zeros_like(first_logits), prompt_seen[:, None])
    first = sample(k0, distribution(first_logits[:, 0], sampling))
    if config.penalties:
        out_counts = out_counts.at[jnp.arange(b), first].add(1)
    seq = jnp.zeros((b, s + 1), jnp.int32).at[:, :p].set(prompt)
    seq = set_rows(seq, prompt_len, first)
    logprob = jnp.zeros((b, s + 1 if config.logprobs else 0), jnp.float32)
    if config.logprobs:
        logprob = set_rows(logprob, prompt_len, token_logprobs(last[:, None], first[:, None])[:, 0])
    n_top = config.top_logprobs
    top_ids = jnp.zeros((b, s + 1 if n_top else 0, n_top), jnp.int32)
    top_lp = jnp.zeros(top_ids.shape, jnp.float32)
    if n_top:
        ids, lps = top_token_logprobs(last[:, None], n_top)
        top_ids, top_lp = set_rows(top_ids, prompt_len, ids[:, 0]), set_rows(top_lp, prompt_len, lps[:, 0])
    k = config.gamma
    stats = DecodeStats(
        rounds=jnp.zeros((b,), jnp.int32),
        emitted=jnp.zeros((b,), jnp.int32),
        proposed=jnp.zeros((b,), jnp.int32),
        accepted=jnp.zeros((b,), jnp.int32),
        accepted_at=jnp.zeros((k,), jnp.int32),
        proposed_at=jnp.zeros((k,), jnp.int32),
        loop_rounds=jnp.zeros((), jnp.int32),
        wide_rounds=jnp.zeros((), jnp.int32),
    )
    stop = _stop_reason(
        config,
        sampling.stop_ids,
        first[:, None],
        jnp.ones((b,), jnp.int32),
        jnp.ones((b,), jnp.int32),
        max_new,
        prompt_len,
        jnp.zeros((b,), jnp.int32),
    )
    return DecodeState(
        seq,
        prompt_len + 1,
        prompt_len,
        max_new,
        cache,
        draft_state,
        sampling,
        key,
        stop,
        stats,
        jnp.zeros((), bool),
        adapt.init(config.adaptive, b),
        logprob,
        top_ids,
        top_lp,
        out_counts,
        prompt_seen,
    )


def _ends(config, stop_ids, emitted):
    """emitted [B, T] -> [B, T] bool: an end token, one of the loop's EOS ids or of the row's stop ids."""
    ends = is_stop(emitted, stop_ids)
    if config.eos_ids:
        ends = ends | jnp.isin(emitted, jnp.asarray(config.eos_ids, jnp.int32))
    return ends


def _stop_reason(config, stop_ids, emitted, n_emit, n_gen, max_new, committed, old_stop):
    """Per-row stop after a step: an end token (EOS or the row's stop ids) among the emitted tokens, the token
    budget, or no cache slot left for the next pending token. An already stopped row keeps its reason."""
    j = jnp.arange(emitted.shape[1])[None, :]
    hit_eos = jnp.any(_ends(config, stop_ids, emitted) & (j < n_emit[:, None]), axis=1)
    reason = jnp.where(
        hit_eos,
        StopReason.EOS,
        jnp.where(
            n_gen >= max_new,
            StopReason.MAX_NEW_TOKENS,
            jnp.where(committed >= config.slots, StopReason.CACHE_FULL, StopReason.RUNNING),
        ),
    )
    return jnp.where(old_stop != StopReason.RUNNING, old_stop, reason).astype(jnp.int32)


def _chain_step(
    target, drafter, config, target_params, draft_params, st, pending, committed, max_draft, k_draft, k_verify
):
    """Draft a chain, verify its K+1 positions in one target call, accept. See ``decode_round``."""
    k = config.gamma
    b = pending.shape[0]
    proc = _processor(config, st)
    if k == 0:
        logits, cache = target.apply(target_params, pending[:, None], committed[:, None], st.cache)
        n_draft = jnp.zeros((b,), jnp.int32)
        draft_tokens = jnp.zeros((b, 0), jnp.int32)
        q = jnp.zeros((b, 0, 1), jnp.float32)
        draft_state = st.draft_state
        best = _greedy_ids(target, logits, st.sampling, proc)
    else:
        shares = getattr(drafter, "shares_target_cache", False)
        ctx = DraftContext(st.seq, st.seq_len, max_draft, st.sampling, st.cache if shares else None)
        v = target.vocab_size

        def propose(c):
            prop: Proposal = drafter.propose(draft_params, c[3], ctx, k_draft, k)
            tcache = prop.target_cache if shares else c[4]
            return prop.tokens, prop.q, jnp.minimum(prop.n_draft, max_draft), prop.state, tcache

        def skip_draft(c):
            # No row may propose (adaptive K at 0, or the budget is nearly spent): the drafter only keeps its
            # state in step with the committed sequence instead of rolling out K steps.
            state = c[3]
            if hasattr(drafter, "observe"):
                state = drafter.observe(draft_params, state, ctx)
            return c[0], c[1], c[2], state, c[4]

        def uniform():  # q of no proposal: finite, never read as a candidate
            return jnp.ones((b, k, v), jnp.float32) / v

        if shares or jax.tree.leaves(st.draft_state):
            # Branches that pass a KV cache (the target's, or the drafter's own in its state) through: in place.
            none = (jnp.zeros((b, k), jnp.int32), uniform(), jnp.zeros((b,), jnp.int32), st.draft_state, st.cache)
            draft_tokens, q, n_draft, draft_state, tcache = _cond_in_place(
                jnp.any(max_draft > 0), propose, skip_draft, none
            )
        else:
            # A stateless drafter (the n-gram lookup) and no cache through the branches: a plain cond, so the
            # [B, K, V] q of "no proposal" is only built in the round that takes that branch, not as every
            # round's loop-carry initialiser.
            def propose_stateless(_):
                return propose((None, None, None, st.draft_state, None))[:4]

            def skip_stateless(_):
                return jnp.zeros((b, k), jnp.int32), uniform(), jnp.zeros((b,), jnp.int32), st.draft_state

            draft_tokens, q, n_draft, draft_state = jax.lax.cond(
                jnp.any(max_draft > 0), propose_stateless, skip_stateless, None
            )
            tcache = st.cache

        # The verification branches return the target's logits and, when every row is greedy, their argmax:
        # the distributions are built after the branch, and only for a batch that samples.
        def verify_wide(cache):
            tokens = jnp.concatenate([pending[:, None], draft_tokens], axis=1)  # [B, K+1]
            positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
            state = draft_state
            if updates_state:
                logits, cache, state = drafter.verify(
                    target, target_params, draft_params, draft_state, tokens, positions, cache
                )
            elif hasattr(drafter, "verify"):
                logits, cache = drafter.verify(
                    target, target_params, draft_params, draft_state, tokens, positions, cache
                )
            else:
                logits, cache = target.apply(target_params, tokens, positions, cache)
            return logits.astype(jnp.float32), _greedy_ids(target, logits, st.sampling, proc_wide), cache, state

        def verify_narrow(c):
            # Nothing was proposed anywhere (e.g. every n-gram lookup missed): a plain 1-token step, so a miss
            # costs what plain decoding costs instead of a K+1-wide verification. Positions 1..K keep their
            # initial zeros: with nothing proposed, only position 0 is read.
            logits, cache = target.apply(target_params, pending[:, None], committed[:, None], c[2])
            wide = c[0].at[:, :1].set(logits.astype(jnp.float32))
            return wide, c[1].at[:, :1].set(_greedy_ids(target, logits, st.sampling, proc)), cache, c[3]

        # Position j follows the pending token and drafts 1..j (what the penalties count besides the output).
        block = (
            jnp.concatenate([pending[:, None], draft_tokens], axis=1),
            jnp.broadcast_to(jnp.tril(jnp.ones((k + 1, k + 1), bool)), (b, k + 1, k + 1)),
        )
        proc_wide = functools.partial(proc, block=block)
        # A drafter that reads the verification's by-products (e.g. the target features an EAGLE head needs)
        # sets ``verify_updates_state``; its verify returns the new drafter state and always runs.
        updates_state = getattr(drafter, "verify_updates_state", False)
        if _always_wide(drafter):
            logits, best, cache, draft_state = verify_wide(tcache)
        else:
            init = (jnp.zeros((b, k + 1, v), jnp.float32), jnp.zeros((b, k + 1), jnp.int32), tcache, draft_state)
            logits, best, cache, draft_state = _cond_in_place(
                jnp.any(n_draft > 0), lambda c: verify_wide(c[2]), verify_narrow, init
            )

    def greedy(_):  # p is one-hot on the argmax: see ``verify_chain_greedy`` (block verification agrees)
        q_x = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0] if k else jnp.zeros((b, 0))
        return verify_chain_greedy(best, draft_tokens, n_draft, q_x)

    def sampled(_):
        p = distribution(proc_wide(logits) if k else proc(logits), st.sampling)
        return verify_chain_key(k_verify, p, q, draft_tokens, n_draft, block=config.block_verify)

    res = jax.lax.cond(jnp.all(st.sampling.temperature == 0), greedy, sampled, None)
    proposed_at = (jnp.arange(k)[None, :] < n_draft[:, None]).astype(jnp.int32)
    emitted_logits = logits if config.logprobs else None  # position j predicts the j-th emitted token
    return (
        draft_tokens,
        res.n_accepted,
        res.next_token,
        None,
        cache,
        draft_state,
        proposed_at,
        res.bad_proposal,
        emitted_logits,
    )


def _processor(config: DecodeConfig, st: DecodeState):
    """logits [B, T, V] of T positions from the pending token's on (a chain's; a tree's take ``depth``) ->
    ``processed_logits`` then ``penalized_logits``: the rows' logit bias, min_tokens and penalties, which act on
    what is sampled and on greedy argmaxes, never on the raw logits that logprobs report.

    block: (tokens [B, T], history [B, T, T] bool) of a verification block whose position t follows tokens[t]
    (tokens[0] is the pending token): history[b, t, s], token s precedes position t's prediction (a chain's
    s <= t, a tree node's ancestors and itself). The penalties count the block tokens 1.. of a position's history
    besides the committed output; without a block every position sees the committed output only."""
    n_gen = st.seq_len - st.prompt_len  # generated so far, the pending token included: position 0 predicts #n_gen

    def proc(logits, depth=None, block=None):
        t = logits.shape[1]
        if depth is None:
            depth = jnp.arange(t, dtype=jnp.int32)[None, :]
        out = processed_logits(logits, st.sampling, n_gen[:, None] + depth, config.eos_ids)
        if not config.penalties:
            return out
        b, _, v = out.shape
        counts = jnp.broadcast_to(st.out_counts[:, None, :], out.shape)
        if block is not None:  # [B, T, T] sparse additions, not a [B, T, V] one-hot product
            tokens, history = block
            history = history & (jnp.arange(t) > 0)[None, None, :]  # the pending token is counted already
            ids = jnp.where(history, tokens[:, None, :], v)  # [B, T, T]; past V: dropped
            rows, cols = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
            counts = counts.at[rows, cols, ids].add(1, mode="drop")
        seen = st.prompt_seen[:, None, :] | (counts > 0)
        return penalized_logits(out, st.sampling, counts, seen)

    return proc


def _always_wide(drafter) -> bool:
    """Whether every round verifies wide, proposals or not: a tree verifies its N nodes, and a drafter that reads
    the verification's by-products (EAGLE) always runs its own verify; other chains fall back to a 1-token step
    when no row proposed."""
    return bool(getattr(drafter, "is_tree", False) or getattr(drafter, "verify_updates_state", False))


def _target_argmax(target: Model):
    """The target's own row argmax (``Model.argmax``, e.g. a CPU kernel) or ``jspec.sampling.argmax``."""
    return target.argmax or argmax


def _greedy_ids(target: Model, logits: jax.Array, sampling: SamplingParams, proc) -> jax.Array:
    """[B, T, V] -> [B, T] int32: the argmax of the processed logits (``proc``, see ``_processor``) when every
    row is greedy (all greedy verification reads), zeros otherwise (a sampling batch builds its distributions
    instead)."""
    zeros = jnp.zeros(logits.shape[:2], jnp.int32)
    am = _target_argmax(target)
    greedy = jnp.all(sampling.temperature == 0)
    return jax.lax.cond(greedy, lambda x: am(proc(x)), lambda _: zeros, logits).astype(jnp.int32)


AT_MOST_ONCE = "at_most_once"


def _cond_in_place(pred: jax.Array, true_fn, false_fn, carry):
    """``lax.cond(pred, true_fn, false_fn, carry)`` for branches that rewrite a large buffer of ``carry`` (the KV
    cache): run as two while loops of 0 or 1 trips. XLA updates while-loop carries in place, whereas a cond
    copied k and v into or out of the taken branch and again after it (SmolLM2, n-gram K=4: 4 whole-cache
    copies per round in the optimised HLO; 48.1 -> 46.4 ms per round without them). Both functions map
    ``carry`` to a value of its structure."""

    def once(fn, go):
        def body(c):
            return c[0] + 1, fn(c[1])

        return lambda c: jax.lax.while_loop(lambda c: c[0] < go, body, (jnp.int32(0), c))[1]

    # The scope name marks these loops in the compiled HLO, so analyses (``sharding.hlo``) can count them as
    # branches taken at most once rather than as data-dependent loops.
    with jax.named_scope(AT_MOST_ONCE):
        carry = once(false_fn, jnp.where(pred, 0, 1))(carry)
        return once(true_fn, jnp.where(pred, 1, 0))(carry)


def _tree_step(
    target, drafter, config, target_params, draft_params, st, pending, committed, max_draft, k_draft, k_verify
):
    """Draft a candidate tree, verify every node in one target call under the ancestor mask, accept one path."""
    b = pending.shape[0]
    ctx = DraftContext(st.seq, st.seq_len, max_draft, st.sampling)
    prop: TreeProposal = drafter.propose_tree(draft_params, st.draft_state, ctx, k_draft)
    n = prop.tokens.shape[1]
    tokens = prop.tokens.at[:, 0].set(pending)
    # A node is usable if it is proposed, not deeper than this row may go, its scratch slot exists, and so
    # does every ancestor's (the parent comes first in topological order, so one pass suffices). Which nodes
    # are verified decides which acceptance draws a sampled row uses: so that it does not depend on a cache sized
    # by the other rows, decode's default max_len and the serving engine give every row n - 1 scratch slots past
    # its P + N - 1 (``tree_nodes``), and then this bound never cuts a node the row may use.
    fits = committed[:, None] + jnp.arange(n)[None, :] < config.slots
    own_ok = prop.valid & (prop.depth <= max_draft[:, None]) & fits
    valid = own_ok
    for i in range(1, n):
        par_ok = take_rows(valid, jnp.maximum(prop.parent[:, i], 0))
        valid = valid.at[:, i].set(own_ok[:, i] & par_ok)
    valid = valid.at[:, 0].set(True)
    positions = committed[:, None] + prop.depth
    mask = ancestor_mask(prop.parent)
    # A drafter that reads the verification's by-products (an EAGLE head's target features) runs the call
    # itself and, once a path is accepted, keeps what belongs to that path only (``follow_path``).
    updates_state = getattr(drafter, "verify_updates_state", False)
    if updates_state:
        logits, cache, verified = drafter.verify(
            target, target_params, draft_params, prop.state, tokens, positions, st.cache, mask
        )
    else:
        logits, cache = target.apply(target_params, tokens, positions, st.cache, mask)

    proc = _processor(config, st)

    def sampled(logits):
        p = distribution(proc(logits, prop.depth, (tokens, mask)), st.sampling)
        d, c = drafter.max_depth, drafter.max_children
        return verify_tree_key(k_verify, p, prop.q, tokens, prop.parent, valid, drafter.rule, d, c)

    def greedy(logits):  # the same result without the [B, N, V] distributions (1-1.5 ms of a SmolLM2 round)
        ids = _target_argmax(target)(proc(logits, prop.depth, (tokens, mask)))
        return verify_tree_greedy(ids, tokens, prop.parent, valid, drafter.max_depth, drafter.max_children)

    res = jax.lax.cond(jnp.all(st.sampling.temperature == 0), greedy, sampled, logits)
    state = drafter.follow_path(prop.state, verified, res.path) if updates_state else prop.state
    path_tokens = take_rows(tokens, res.path[:, 1:])  # [B, D]
    depth_hot = jax.nn.one_hot(prop.depth - 1, drafter.max_depth, dtype=jnp.int32)  # [B, N, D]; root -> none
    proposed_at = jnp.einsum("bnd,bn->bd", depth_hot, valid.astype(jnp.int32))  # candidate nodes per depth
    bad = jnp.zeros((b,), bool)
    if config.debug_checks and drafter.rule != TreeRule.DETERMINISTIC:
        # Sampled children (IID, without replacement) are verified against the q they were drawn from: a usable
        # node whose parent's q gives its token probability 0 breaks losslessness (deterministic trees are
        # verified without q).
        q_x = prop.q[jnp.arange(b)[:, None], jnp.maximum(prop.parent, 0), tokens]  # [B, N] q_parent(token)
        bad = jnp.any(valid[:, 1:] & (q_x[:, 1:] <= 0), axis=1)
    # The path's node j predicts the j-th emitted token (its accepted child, or the correction / bonus token).
    emitted_logits = jnp.take_along_axis(logits, res.path[..., None], axis=1) if config.logprobs else None
    return path_tokens, res.n_accepted, res.next_token, res.path, cache, state, proposed_at, bad, emitted_logits


def decode_round(
    target: Model, drafter, config: DecodeConfig, target_params, draft_params, st: DecodeState
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One round for every row: draft -> verify K+1 positions in one target call -> accept -> commit.
    Returns the new state, the tokens emitted this round [B, K+1] and how many per row [B]."""
    k = config.gamma
    s = config.slots
    b = st.seq.shape[0]
    active = st.stop == StopReason.RUNNING
    committed = st.seq_len - 1  # = target cache lengths; the pending token sits at this slot
    n_gen = st.seq_len - st.prompt_len
    # Never propose past the cache (the verify block must fit) or past the tokens still wanted.
    max_draft = jnp.clip(jnp.minimum(s - 1 - committed, st.max_new - n_gen - 1), 0, k)
    if st.key.ndim == 0:  # one stream for the batch: this round's keys come from the loop's round count
        key, k_draft, k_verify = jax.random.split(jax.random.fold_in(st.key, st.stats.loop_rounds), 3)
    else:  # per-row keys: row b's round keys come from its own key and its own round count, never its neighbours'
        key = st.key
        k_draft, k_verify = split_keys(jax.vmap(jax.random.fold_in)(st.key, st.stats.rounds), 2)

    if config.adaptive is not None:
        wide = _always_wide(drafter)
        max_draft = jnp.minimum(max_draft, adapt.choose_k(config.adaptive, st.accept_ema, k, wide))
    # A row that has ended proposes nothing: otherwise it alone could make the batch draft and verify K+1
    # wide while the running rows asked for no candidates (and the stats, counting running rows, hide it).
    max_draft = jnp.where(active, max_draft, 0)
    # Nor is it sampled: its outputs are discarded, and its temperature would put every greedy row of the
    # batch on the sampled path (distributions over [B, K+1, V]) until the row is refilled. The state keeps
    # the row's own parameters.
    temperature = jnp.where(active, st.sampling.temperature, 0.0)
    rst = dataclasses.replace(st, sampling=dataclasses.replace(st.sampling, temperature=temperature))

    pending = take_rows(st.seq, committed)
    step_fn = _tree_step if getattr(drafter, "is_tree", False) else _chain_step
    step = step_fn(
        target, drafter, config, target_params, draft_params, rst, pending, committed, max_draft, k_draft, k_verify
    )
    path_tokens, n_acc, next_token, path, cache, draft_state, proposed_at, bad_rows, emitted_logits = step

    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j < n_acc[:, None], padded, next_token[:, None])  # [B, K+1]
    n_emit = n_acc + 1
    is_end = _ends(config, st.sampling.stop_ids, emitted) & (j < n_emit[:, None])
    n_emit = jnp.where(jnp.any(is_end, axis=1), jnp.argmax(is_end, axis=1) + 1, n_emit)
    n_emit = jnp.where(active, jnp.minimum(n_emit, st.max_new - n_gen), 0)

    seq = _scatter_rows(st.seq, st.seq_len, emitted, n_emit)
    logprob = st.logprob
    if config.logprobs:
        logprob = _scatter_rows(logprob, st.seq_len, token_logprobs(emitted_logits, emitted), n_emit)
    out_counts = st.out_counts
    if config.penalties:  # the emitted tokens join the output the penalties count
        ids = jnp.where(j < n_emit[:, None], emitted, out_counts.shape[1])  # past V: dropped
        out_counts = jax.vmap(lambda c, i: c.at[i].add(1, mode="drop"))(out_counts, ids)
    top_ids, top_lp = st.top_ids, st.top_logprob
    if config.top_logprobs:
        ids, lps = top_token_logprobs(emitted_logits, config.top_logprobs)
        top_ids = _scatter_rows(top_ids, st.seq_len, ids, n_emit)
        top_lp = _scatter_rows(top_lp, st.seq_len, lps, n_emit)
    # The pending token and the accepted proposals now have their state in the cache; the correction/bonus
    # token becomes the new pending token, computed next round (never reused from a rejected candidate).
    # For a tree, the accepted path's entries move from their scratch slots to consecutive committed slots.
    cache = cache.commit(jnp.where(active, n_acc + 1, 0), path)
    seq_len = st.seq_len + n_emit
    stop = _stop_reason(
        config, st.sampling.stop_ids, emitted, n_emit, seq_len - st.prompt_len, st.max_new, seq_len - 1, st.stop
    )

    act = active.astype(jnp.int32)
    proposed_at = proposed_at * act[:, None]  # [B, K] candidates proposed at each draft position (tree: depth)
    n_draft = jnp.sum(proposed_at, axis=1, dtype=jnp.int32)
    accepted_mask = (jnp.arange(k)[None, :] < n_acc[:, None]) & active[:, None]
    stats = DecodeStats(
        rounds=st.stats.rounds + act,
        emitted=st.stats.emitted + n_emit,
        proposed=st.stats.proposed + n_draft * act,
        accepted=st.stats.accepted + n_acc * act,
        accepted_at=st.stats.accepted_at + jnp.sum(accepted_mask, axis=0, dtype=jnp.int32),
        proposed_at=st.stats.proposed_at + jnp.sum(proposed_at, axis=0, dtype=jnp.int32),
        loop_rounds=st.stats.loop_rounds + 1,
        wide_rounds=st.stats.wide_rounds + (jnp.any(n_draft > 0) | _always_wide(drafter)).astype(jnp.int32),
    )
    bad = st.bad_proposal | jnp.any(bad_rows & active)
    ema = st.accept_ema
    if config.adaptive is not None:
        ema = adapt.update(config.adaptive, ema, n_acc, n_draft, active)
    new = dataclasses.replace(
        st,
        accept_ema=ema,
        seq=seq,
        seq_len=seq_len,
        logprob=logprob,
        top_ids=top_ids,
        top_logprob=top_lp,
        out_counts=out_counts,
        cache=cache,
        draft_state=draft_state,
        key=key,
        stop=stop,
        stats=stats,
        bad_proposal=bad,
    )
    if config.debug_checks:
        checkify.check(~bad, "a drafter proposed a token to which its own q gives probability 0 (drafter bug)")
    if config.constrain is not None:
        new = config.constrain(new)
    return new, emitted, n_emit


def run_loop(target: Model, drafter, config: DecodeConfig, target_params, draft_params, st: DecodeState) -> DecodeState:
    """Rounds until every row has stopped, all on device."""

    def cond(st):
        return jnp.any(st.stop == StopReason.RUNNING)

    def body(st):
        return decode_round(target, drafter, config, target_params, draft_params, st)[0]

    return jax.lax.while_loop(cond, body, st)


def generate_arrays(
    target, drafter, config, target_params, draft_params, prompt, prompt_len, max_new, sampling, key
) -> DecodeState:
    """The pure, jittable whole decode: prefill + loop. Shardings and donation are applied by the caller."""
    st = prefill(target, drafter, config, target_params, draft_params, prompt, prompt_len, max_new, sampling, key)
    if config.constrain is not None:
        st = config.constrain(st)
    return run_loop(target, drafter, config, target_params, draft_params, st)


@functools.lru_cache(maxsize=64)
def _compiled(target, drafter, config):
    fn = functools.partial(generate_arrays, target, drafter, config)
    if config.debug_checks:
        return _Checked(jax.jit(checkify.checkify(fn)))
    return jax.jit(fn)


def _throw(err_out):
    err, out = err_out
    err.throw()
    return out


class _Checked:
    """A checkified jitted function that raises its error on the host; ``lower(...).compile()`` as jax.jit's,
    so ``PreparedDecode.run_timed`` compiles before it times under ``debug_checks`` too."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, *args):
        return _throw(self.jitted(*args))

    def lower(self, *args):
        return _CheckedLowered(self.jitted.lower(*args))


class _CheckedLowered:
    """``_Checked``'s lowering: its ``compile()`` raises the check's error on the host after each call."""

    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self):
        compiled = self.lowered.compile()
        return lambda *args: _throw(compiled(*args))


@dataclasses.dataclass
class DecodeOutput:
    """Host-side result. ``tokens[b]`` are row b's generated ids (the prompt excluded), EOS included."""

    tokens: list[list[int]]
    stop_reason: list[StopReason]
    stats: dict[str, Any]
    # logprobs[b][i]: the target's log-probability of tokens[b][i] (raw logits, temperature 1); with logprobs=True
    logprobs: list[list[float]] | None = None
    # top_logprobs[b][i]: the N most likely (token id, log-probability) pairs where tokens[b][i] was generated,
    # most likely first (the same raw distribution); with top_logprobs=N
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]


def check_eos(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """``eos_ids`` (a sequence of token ids) -> the static tuple of DecodeConfig; an id that is not a whole
    number or outside [0, V) could never end a row, so it is an error rather than cast or kept."""
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, int | np.integer):
        raise ValueError(f"eos_ids must be a sequence of token ids, got the single value {eos_ids!r}: use [{eos_ids}]")
    ids = int_array(list(eos_ids), "eos_ids")
    if ids.ndim != 1:
        raise ValueError(f"eos_ids must be a flat sequence of token ids, got shape {ids.shape}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"eos_ids must be token ids in [0, {vocab_size}), got {bad.tolist()}")
    return tuple(sorted({int(e) for e in ids}))  # a set: [2, 3], [3, 2] and [2, 2, 3] share one compilation


DEFAULT_GAMMA = 4  # a chain drafter's K when none is given


def adaptive_policy(adaptive) -> AdaptiveK | None:
    """``adaptive`` as prepare and serve.Engine take it: True = the default ``AdaptiveK``, False/None = fixed K,
    or an ``AdaptiveK``."""
    if adaptive is None or isinstance(adaptive, AdaptiveK):
        return adaptive
    if isinstance(adaptive, bool | np.bool_):  # numpy's True too: it is not `True`, and not a policy
        return AdaptiveK() if adaptive else None
    raise ValueError(f"adaptive must be True, False, None or an AdaptiveK policy, got {adaptive!r}")


def check_drafter(
    target: Model,
    drafter,
    gamma: int | None,
    adaptive=None,
    block_verify: bool = False,
    draft_params=None,
    target_params=None,
) -> int:
    """The draft settings ``prepare`` and ``serve.Engine`` share, checked on the host. Returns the K the loop
    runs. ``gamma=None`` takes the drafter's own: 0 without a drafter, a tree's depth for a tree drafter,
    ``DEFAULT_GAMMA`` for a chain. A given gamma must be what runs (0 without a drafter, >= 1 with a chain
    drafter, the depth with a tree drafter): a value the loop would replace is refused, not ignored. A drafter
    with a ``check_target`` hook is asked whether it can serve this target with these params."""
    if gamma is not None:
        if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer):
            raise ValueError(f"gamma (draft length K) must be an int, got {gamma!r}")
        if gamma < 0:
            raise ValueError(f"gamma (draft length K) must be >= 0, got {gamma}")
    policy = adaptive_policy(adaptive)
    if drafter is None:
        if policy is not None or block_verify:
            raise ValueError("adaptive draft length and block verification need a drafter")
        if gamma:
            raise ValueError(f"gamma={gamma} needs a drafter: without one the decode is plain (K = 0)")
        return 0
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the drafter's vocab size is {drafter.vocab_size} but the target's "
            f"({target.name}) is {target.vocab_size}; a drafter must share the target's tokenizer"
        )
    name = type(drafter).__name__
    if getattr(drafter, "is_tree", False):
        if policy is not None or block_verify:
            raise ValueError("adaptive draft length and block verification apply to chains, not trees")
        if gamma is not None and gamma != drafter.max_depth:
            raise ValueError(
                f"gamma={gamma}, but a tree drafter drafts to its depth, {drafter.max_depth}: leave gamma unset "
                f"(or pass {drafter.max_depth}) and set the depth in the tree's shape"
            )
        k = drafter.max_depth  # a tree's accepted path is at most its depth
    else:
        k = _chain_k(drafter, gamma, policy)
    # A drafter that reads params says so (``needs_params``): without them it would fail deep inside its model
    # at trace time. (Params given to a drafter that reads none, or with no drafter, are unused: harmless.)
    if getattr(drafter, "needs_params", False) and draft_params is None:
        raise ValueError(f"{name} needs draft_params (its model's or head's parameters), got None")
    check = getattr(drafter, "check_target", None)
    if check is not None:
        check(target, target_params, draft_params)
    return k


def _chain_k(drafter, gamma: int | None, policy: AdaptiveK | None) -> int:
    """A chain's K: ``gamma`` or ``DEFAULT_GAMMA``, >= 1, within the drafter's ``max_draft`` (when it states
    one) and no less than the adaptive policy's ``min_k``."""
    name = type(drafter).__name__
    k = DEFAULT_GAMMA if gamma is None else int(gamma)
    if k == 0:
        raise ValueError("gamma=0 with a drafter drafts nothing: pass drafter=None for plain decoding, or gamma >= 1")
    limit = getattr(drafter, "max_draft", None)
    if isinstance(limit, int | np.integer) and k > limit:
        raise ValueError(f"gamma={k} is more than {name}'s max_draft={int(limit)}")
    if policy is not None and policy.min_k > k:
        raise ValueError(f"the adaptive policy's min_k={policy.min_k} is more than gamma={k}")
    if policy is not None:
        adapt.check_prior(policy, k, _always_wide(drafter))
    return k


def tree_nodes(drafter) -> int | None:
    """The nodes a tree drafter verifies per round (root included), or None for a chain drafter."""
    if not getattr(drafter, "is_tree", False):
        return None
    budget = getattr(drafter, "budget", None)  # a dynamic tree
    if isinstance(budget, int | np.integer) and not isinstance(budget, bool):
        return int(budget)
    spec = getattr(drafter, "spec", None)
    return spec.num_nodes if spec is not None else None


def tree_scratch(drafter) -> int:
    """Cache slots a round writes past the pending token's: a tree's nodes but the root (0 for a chain). A
    dynamic tree's drafter also runs every frontier slot of its ``depth`` levels (``top_k`` each) through its
    own cache, which can be more than ``budget - 1``: reserved too, so that no frontier entry falls off the end
    of the cache, where its logits (and so which nodes a row keeps) would depend on the cache's size."""
    n = (tree_nodes(drafter) or 1) - 1
    shape = [getattr(drafter, f, None) for f in ("budget", "top_k", "depth")]  # a dynamic tree's
    if n and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in shape):
        n = max(n, int(shape[1]) * int(shape[2]))
    return n


def default_slots(need: int, ctx: int | None) -> int:
    """The default max_len for ``need`` slots: rounded up to a multiple of 128 so nearby request sizes share one
    compilation, capped at the model's context ``ctx``."""
    slots = -(-need // 128) * 128
    return slots if ctx is None else min(slots, ctx)


def _prepare(target: Model, prompts, max_new_tokens, max_len, reserve: int = 0):
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1):
        raise ValueError(f"max_len (cache slots per row) must be an int >= 1, got {max_len!r}")  # as Engine's
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 2:
        dense = int_array(prompts, "prompts")  # B equal-length prompts: validated without a Python loop
        if dense.shape[0] == 0 or dense.shape[1] == 0:
            raise ValueError(f"prompts array of shape {dense.shape} is empty: at least one token is needed")
        bad = np.nonzero((dense < 0).any(1) | (dense >= target.vocab_size).any(1))[0]
        if bad.size:
            raise ValueError(f"prompt {int(bad[0])} has token ids outside [0, {target.vocab_size})")
        rows = dense.astype(np.int32)
        plen = np.full((dense.shape[0],), dense.shape[1], np.int32)
    else:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        rows = []
        for i, pr in enumerate(prompts):
            arr = int_array(pr, f"prompt {i}")
            if arr.ndim != 1:
                raise ValueError(
                    f"prompt {i} must be a 1-D sequence of token ids, got shape {arr.shape}: prompts is a list of "
                    "prompts ([ids] for one prompt) or a [B, P] array"
                )
            if arr.size == 0:
                raise ValueError(f"prompt {i} is empty: at least one token is needed to start decoding")
            if arr.min() < 0 or arr.max() >= target.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {target.vocab_size})")
            rows.append(arr.astype(np.int32))
        plen = np.array([len(r) for r in rows], np.int32)
    b = len(rows)
    mnew = int_array(max_new_tokens if max_new_tokens is not None else 0, "max_new_tokens")
    mnew = np.full((b,), mnew) if mnew.ndim == 0 else mnew
    if mnew.shape != (b,):
        raise ValueError(f"max_new_tokens must be an int or have one entry per prompt ({b}), got {mnew.shape}")
    if max_new_tokens is not None and np.any(mnew < 1):
        raise ValueError(f"max_new_tokens must be >= 1, got {mnew.tolist()}")
    # Positions fed to the model: 0 .. P + N - 2 (the last token is never fed back); none may reach its context.
    ctx = target.max_positions
    if ctx is not None and max_new_tokens is not None:
        far = np.nonzero(plen + mnew - 1 > ctx)[0]
        if far.size:
            i = int(far[0])
            raise ValueError(
                f"prompt {i} ({plen[i]} tokens) + max_new_tokens ({int(mnew[i])}) runs past {target.name}'s "
                f"context length ({ctx} positions)"
            )
    if max_len is None:
        if max_new_tokens is None:
            raise ValueError("max_new_tokens=None (generate until EOS or a full cache) needs max_len")
        # The last token takes no slot (P + N <= S + 1, below); ``reserve``: a tree's scratch past it, so that the
        # last rounds verify whole trees in every row.
        max_len = default_slots(int((plen + mnew - 1).max()) + reserve, ctx)  # still >= every P + N - 1
    elif ctx is not None and max_new_tokens is None and max_len > ctx:
        raise ValueError(
            f"max_len={max_len} with max_new_tokens=None decodes up to position {max_len - 1}, past "
            f"{target.name}'s context length ({ctx} positions): pass max_len <= {ctx}"
        )
    if max_new_tokens is None:
        mnew = np.full((b,), max_len + 1, np.int64)  # the cache, not the budget, ends these rows
    # The last generated token is never fed back, so it takes no slot: P + N <= S + 1 (what max_new_tokens=None
    # generates into a full cache).
    over = np.nonzero(np.where(max_new_tokens is None, plen + 1, plen + mnew - 1) > max_len)[0]
    if over.size:
        i = int(over[0])
        if max_new_tokens is None:
            raise ValueError(f"prompt {i} ({plen[i]} tokens) leaves no cache slot to generate in (max_len={max_len})")
        raise ValueError(
            f"prompt {i} ({plen[i]} tokens) + max_new_tokens ({int(mnew[i])}) exceeds the cache "
            f"(max_len={max_len} slots hold the prompt and every generated token but the last)"
        )
    pw = min(-(-int(plen.max()) // 16) * 16, max_len)  # padding never past the cache (max_len < 16, say)
    prompt = np.zeros((b, pw), np.int32)
    if isinstance(rows, np.ndarray):
        prompt[:, : rows.shape[1]] = rows
    else:
        for i, r in enumerate(rows):
            prompt[i, : len(r)] = r
    return prompt, plen, mnew.astype(np.int32), int(max_len)


def to_output(st: DecodeState) -> DecodeOutput:
    """Host-side tokens, stop reasons and statistics from a final ``DecodeState`` (blocks until ready)."""
    seq, seq_len, plen, stop, lp = jax.device_get((st.seq, st.seq_len, st.prompt_len, st.stop, st.logprob))
    top = jax.device_get((st.top_ids, st.top_logprob)) if st.top_ids.shape[1] else None
    stats = jax.device_get(st.stats)
    tokens = [seq[i, plen[i] : seq_len[i]].tolist() for i in range(seq.shape[0])]
    logprobs = [lp[i, plen[i] : seq_len[i]].tolist() for i in range(seq.shape[0])] if lp.shape[1] else None
    proposed = int(stats.proposed.sum())
    accepted = int(stats.accepted.sum())
    rounds = int(stats.rounds.sum())
    emitted = int(stats.emitted.sum())
    out_stats = {
        "new_tokens": [len(t) for t in tokens],
        "rounds": stats.rounds.tolist(),
        "loop_rounds": int(stats.loop_rounds),
        "tokens_per_round": emitted / rounds if rounds else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "accepted_at": stats.accepted_at.tolist(),
        "proposed_at": stats.proposed_at.tolist(),
    }
    tops = None
    if top is not None:
        tops = [top_pairs(top[0][i, plen[i] : seq_len[i]], top[1][i, plen[i] : seq_len[i]]) for i in range(len(tokens))]
    return DecodeOutput(tokens, [StopReason(int(r)) for r in stop], out_stats, logprobs, tops)


@functools.partial(jax.jit, static_argnums=2)
def tail_rows(x: jax.Array, end: jax.Array, width: int) -> jax.Array:
    """x [B, W, ...], end [B] -> [B, width, ...]: row b's entries end[b] - width .. end[b] - 1 (clamped at 0), on
    device, so that a step's few new log-probabilities travel to the host instead of every row's whole history."""
    idx = jnp.maximum(end[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :], 0)
    return jax.vmap(lambda row, i: row[i])(x, idx)


def top_pairs(ids: np.ndarray, lps: np.ndarray) -> list[list[tuple[int, float]]]:
    """[T, N] ids and log-probabilities -> T lists of N (id, log-probability) pairs."""
    return [list(zip(i.tolist(), p.tolist())) for i, p in zip(ids, lps)]


@dataclasses.dataclass
class PreparedDecode:
    """A validated decode call, split so that compilation and execution can be timed apart."""

    fn: Any  # the jitted whole decode
    args: tuple
    config: DecodeConfig
    stream_fns: Any = None  # () -> the (prefill, round) pair a stream steps with

    @property
    def sampling(self) -> SamplingParams:
        """The rows' validated sampling parameters (after the params, the draft params, the prompts, their lengths
        and budgets in ``args``)."""
        return self.args[5]

    def stream(self, fns=None) -> DecodeStream:
        """The round-by-round ``DecodeStream`` of this call (see ``decode_stream``); ``fns``: the pair
        ``compile_stream`` returns, else they compile at the first steps."""
        pre, step = fns or self.stream_fns()
        return DecodeStream(pre, step, self.args, self.config.logprobs, top=bool(self.config.top_logprobs))

    def compile_stream(self):
        """Compile the stream's (prefill, round) ahead of time (no execution), so that a timed stream runs
        without compiling; returns the pair for ``stream``. With debug_checks the pair stays jitted."""
        pre, step = self.stream_fns()
        if not hasattr(step, "lower"):
            return pre, step
        state = jax.eval_shape(pre, *self.args)
        return pre.lower(*self.args).compile(), step.lower(*self.args[:2], state).compile()

    def compile(self):
        """Compile ahead of time (no execution); returns the compiled executable."""
        return self.fn.lower(*self.args).compile() if hasattr(self.fn, "lower") else self.fn

    def run(self, compiled=None) -> DecodeOutput:
        st = (compiled or self.fn)(*self.args)
        return to_output(st)

    def run_timed(self) -> DecodeOutput:
        """Compile, then run and time the execution alone; adds ``compile_seconds``, ``seconds`` (excluding
        compilation, including the transfer of the result to the host) and ``tokens_per_s`` to the stats."""
        t0 = time.perf_counter()
        compiled = self.compile()
        jax.block_until_ready(self.args)
        t1 = time.perf_counter()
        st = jax.block_until_ready(compiled(*self.args))
        out = to_output(st)
        t2 = time.perf_counter()
        total = sum(out.stats["new_tokens"])
        out.stats.update(compile_seconds=t1 - t0, seconds=t2 - t1, tokens_per_s=total / (t2 - t1))
        return out


def prepare(
    target: Model,
    target_params,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    drafter=None,
    draft_params=None,
    gamma: int | None = None,
    max_new_tokens: int | Sequence[int] | None = 64,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    eos_ids: Sequence[int] = (),
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    min_tokens: int | Sequence[int] = 0,
    logit_bias: dict | Sequence[dict | None] | None = None,
    repetition_penalty: float | Sequence[float] = 1.0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    seed: int | Sequence[int] | None = None,
    key: jax.Array | None = None,
    max_len: int | None = None,
    debug_checks: bool = False,
    adaptive: AdaptiveK | bool | None = None,
    block_verify: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    penalties: bool | None = None,
    stop_strings: Sequence[bool] | None = None,
) -> PreparedDecode:
    """Validate the inputs of ``decode`` (raising a ValueError that names the problem) and build the call.
    penalties: None (the default) keeps token counts when some row has a penalty; True keeps them anyway (a
    sharded decode whose other processes' rows have penalties compiles the same program); False with a row that
    has a penalty is refused (the penalty would be ignored). stop_strings: per row, whether the caller looks for
    stop strings in it (``decode(stop=...)``), which min_tokens then holds back too."""
    logprobs = check_flag("logprobs", logprobs)
    top_logprobs = check_top_logprobs(top_logprobs, logprobs, target.vocab_size)
    block_verify = check_flag("block_verify", block_verify)
    debug_checks = check_flag("debug_checks", debug_checks)
    gamma = check_drafter(target, drafter, gamma, adaptive, block_verify, draft_params, target_params)
    prompt, plen, mnew, slots = _prepare(target, prompts, max_new_tokens, max_len, tree_scratch(drafter))
    check_draft_context(drafter, plen + mnew - 1 if max_new_tokens is not None else np.full_like(plen, slots))
    sampling = SamplingParams.make(
        len(plen),
        temperature,
        top_k,
        top_p,
        min_p,
        stop_token_ids,
        vocab_size=target.vocab_size,
        min_tokens=min_tokens,
        logit_bias=logit_bias,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    key = _decode_key(seed, key, len(plen))
    eos = check_eos(eos_ids, target.vocab_size)
    # Without a budget a row runs until its cache is full: P + N <= S + 1.
    check_min_tokens(
        sampling, mnew if max_new_tokens is not None else slots + 1 - plen, eos, target.vocab_size, stop_strings
    )
    counts = sampling.has_penalties()  # their [B, V] counts only where a row asks for a penalty (or the caller)
    if penalties is not None:
        asked = check_flag("penalties", penalties)
        if not asked and counts:
            raise ValueError(
                "penalties=False, but a row has a repetition / presence / frequency penalty, which needs the "
                "token counts: pass penalties=None (the default) or True"
            )
        counts = asked
    config = DecodeConfig(
        gamma,
        slots,
        eos,
        debug_checks,
        adaptive_policy(adaptive),
        block_verify,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        penalties=counts,
    )
    arrays = (jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(mnew), sampling, key)
    return PreparedDecode(
        _compiled(target, drafter, config),
        (target_params, draft_params, *arrays),
        config,
        functools.partial(_stream_fns, target, drafter, config),
    )


MAX_TOP_LOGPROBS = 20  # OpenAI's limit; each one is a max/min pass over V per generated position


def check_top_logprobs(n, logprobs: bool, vocab_size: int) -> int:
    """top_logprobs as the static N of ``DecodeConfig``: an int in [0, 20] (and at most V), with logprobs=True
    (as OpenAI's API asks; the chosen token's own log-probability comes with its alternatives)."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
    if n > vocab_size:
        raise ValueError(f"top_logprobs={n} is more than the vocabulary ({vocab_size} tokens)")
    if n and not logprobs:
        raise ValueError(f"top_logprobs={n} needs logprobs=True (the chosen tokens' log-probabilities come with them)")
    return int(n)


def check_min_tokens(
    sampling: SamplingParams,
    max_new: np.ndarray,
    eos_ids,
    vocab_size: int,
    stop_strings: bool | Sequence[bool] | None = None,
) -> None:
    """min_tokens above the tokens a row may generate (``max_new``: its budget, or what its cache holds) is
    refused (vLLM's rule: no end token could ever come, which is surely not what was meant); so is min_tokens on
    a row with nothing to hold back, which would be ignored: no EOS ids, no stop ids of its own and no stop
    strings (``stop_strings``: whether the row has any, one bool or one per row, where the caller takes them;
    None where there are none to take); and so is a row whose banned tokens (logit_bias -inf) and end
    tokens, masked while min_tokens holds, leave nothing to sample."""
    n_min, ids, bias, stops = jax.device_get((sampling.min_tokens, sampling.bias_ids, sampling.bias, sampling.stop_ids))
    if np.any(n_min > max_new):
        i = int(np.argmax(n_min > max_new))
        raise ValueError(
            f"row {i}: min_tokens ({int(n_min[i])}) is more than the {int(max_new[i])} tokens it may generate "
            "(max_new_tokens, or what the cache holds)"
        )
    has_strings = np.asarray(False if stop_strings is None else stop_strings, bool)
    if has_strings.ndim and has_strings.shape != n_min.shape:
        raise ValueError(f"stop_strings has {has_strings.size} entries for {n_min.size} rows")
    has_strings = np.broadcast_to(has_strings, n_min.shape)
    for i in np.nonzero(n_min > 0)[0]:
        ends = set(eos_ids) | set(stops[i][stops[i] >= 0].tolist())
        if not ends and not has_strings[i]:
            raise ValueError(
                f"row {i}: min_tokens ({int(n_min[i])}) holds back nothing: the row has no end token (EOS ids, "
                "stop_token_ids)" + (" or stop string" if stop_strings is not None else "") + " to keep back"
            )
        if len(set(ids[i][bias[i] == -np.inf].tolist()) | ends) >= vocab_size:
            raise ValueError(
                f"row {i}: min_tokens masks the end tokens and logit_bias bans every other token: nothing is left "
                "to sample"
            )


def check_draft_context(drafter, last: np.ndarray) -> None:
    """A draft model fed past its own context length drafts garbage (lossless, but nothing is accepted):
    refused like the target's. ``last``: [B] the slots each row fills."""
    dm = getattr(drafter, "model", None)
    ctx = getattr(dm, "max_positions", None) if isinstance(dm, Model) else None
    if ctx is not None and np.any(last > ctx):
        i = int(np.argmax(last > ctx))
        raise ValueError(
            f"row {i} runs to position {int(last[i]) - 1}, past the draft model {dm.name}'s context length "
            f"({ctx} positions): lower max_new_tokens / max_len or use a draft with a longer context"
        )


def _decode_key(seed, key, b: int) -> jax.Array:
    """The loop's PRNG key: ``key``, or one made from ``seed`` (default 0); both given is refused (one would be
    ignored). One seed / key drives the whole batch; B seeds (a sequence) or a [B] key array give each row its
    own stream (per-request seeds). A raw uint32[2] (or [B, 2]) key is wrapped, so it and the typed key it stands
    for share one compilation."""
    if key is not None:
        if seed is not None:
            raise ValueError("give seed or key, not both (the seed would be ignored)")
        key = key if isinstance(key, jax.Array) else jnp.asarray(key)
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            w = jax.random.key_data(jax.random.key(0)).shape[-1]  # words per key of the default PRNG (2: threefry)
            if key.dtype != jnp.uint32 or key.shape not in ((w,), (b, w)):
                raise ValueError(
                    f"key must be a jax.random.key (or [B] of them) or raw uint32 key data [{w}] / [B, {w}] with "
                    f"B = {b}, got {key.dtype}{list(key.shape)}"
                )
            key = jax.random.wrap_key_data(key)
        if key.shape not in ((), (b,)):
            raise ValueError(f"key must be one PRNG key (shape ()) or one per row (shape ({b},)), got {key.shape}")
        return key
    if seed is None:
        return jax.random.key(0)
    if isinstance(seed, list | tuple | np.ndarray):
        seeds = [check_seed(x) for x in np.asarray(seed, dtype=object).reshape(-1)] if np.ndim(seed) == 1 else None
        if seeds is None or len(seeds) != b:
            raise ValueError(f"seed must be one int or a list of {b} (one per row), got {seed!r:.80}")
        return jnp.stack([jax.random.key(x) for x in seeds])
    return jax.random.key(check_seed(seed))


def check_flag(name: str, value) -> bool:
    """A boolean option as a bool: a truthy "no" or "off" would switch the feature on, so only bools are taken."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_seed(seed) -> int:
    """A seed ``jax.random.key`` keeps whole: without 64-bit mode it keeps the low 32 bits (2**32 gives seed 0's
    stream, -1 gives 2**32 - 1's), so a seed outside [0, 2**32) is refused rather than folded onto another."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an int, got {seed!r}")
    top = 2**63 if jax.config.jax_enable_x64 else 2**32
    if not 0 <= int(seed) < top:
        raise ValueError(f"seed must be in [0, {top}) (other values alias seeds in that range), got {seed}")
    return int(seed)


def stop_string_rows(stop, batch: int) -> list[tuple[str, ...]]:
    """``decode``'s ``stop`` -> one tuple of stop strings per row: a string, or a list of strings, for every row;
    or one entry per row (a list of B lists, each None, a string or a list of strings)."""
    per_row = isinstance(stop, Sequence) and not isinstance(stop, str)
    if per_row and any(x is None or isinstance(x, list | tuple) for x in stop):
        if len(stop) != batch:
            raise ValueError(f"stop has {len(stop)} per-row entries for {batch} rows")
        return [() if x is None else check_stop_strings(x) for x in stop]
    return [check_stop_strings(stop)] * batch


def run_with_stop_strings(stream: DecodeStream, stops, detokenize, min_tokens) -> DecodeOutput:
    """Step ``stream`` (every row) and look for each row's stop strings in its text (``jspec.stop.StopStrings``,
    ``stops[b]`` with ``min_tokens[b]``): a row whose string appears keeps the tokens up to the one completing it
    (its log-probabilities alike) and ends with STOP_STRING. The steps end once every row has met a string or
    stopped on the device; a row that met one earlier runs on with the batch (its rounds cost nothing more: the
    batch's do), and ``stats`` count every token decoded."""
    checkers = [StopStrings(s, detokenize, int(m)) for s, m in zip(stops, min_tokens, strict=True)]
    for chunk in stream:
        for c, toks in zip(checkers, chunk, strict=True):
            if c.matched is None and toks:
                c.feed(toks)
        if all(c.matched is not None or r != StopReason.RUNNING for c, r in zip(checkers, stream.stop_reasons)):
            break
    out = stream.output()
    for b, c in enumerate(checkers):
        if c.matched is not None:
            n = len(c.tokens)
            out.tokens[b], out.stop_reason[b] = list(c.tokens), StopReason.STOP_STRING
            if out.logprobs is not None:
                out.logprobs[b] = out.logprobs[b][:n]
            if out.top_logprobs is not None:
                out.top_logprobs[b] = out.top_logprobs[b][:n]
    return out


def decode(target: Model, target_params, prompts, *, stop=None, detokenize=None, **kwargs) -> DecodeOutput:
    """Generate up to ``max_new_tokens`` per prompt with speculative decoding (plain when drafter is None).

    prompts: B token-id lists of any (non-zero) lengths, or a [B, P] array of B prompts of exactly P tokens (no
    padding: there is no attention mask, so pad ids would be read as prompt tokens; pass ragged prompts as
    lists). Keyword arguments (see
    ``prepare``): drafter, draft_params, gamma (K candidates per round; unset: 4 for a chain drafter, the depth of a
    tree drafter, 0 without a drafter; a given value must be the one that runs, see ``check_drafter``),
    max_new_tokens (int, per-row list, or None = until EOS or a full cache), temperature / top_k / top_p / min_p
    (scalars or per-row lists; temperature 0 is greedy), eos_ids (the model's end tokens, every row),
    stop_token_ids (vLLM's: ids that end a row as EOS does, emitted; one list for every row or one list per row;
    stop reason EOS), min_tokens (vLLM's: end tokens, EOS and stop ids, are masked until a row has generated that
    many; per row or one for all), logit_bias (a ``{token_id: bias}`` dict, or one per row: added to the target's
    logits before temperature and the filters, -inf bans a token; both change what rows sample and greedy rows'
    argmax, not the raw log-probabilities that ``logprobs`` reports), repetition_penalty / presence_penalty /
    frequency_penalty (vLLM's, per row or one for all, applied after the bias: see ``SamplingParams``; any of them
    set compiles a loop that keeps [B, V] token counts), seed or key (not both; seed 0 by default, in
    [0, 2**32) without 64-bit mode; one for the batch, or B seeds / [B] keys for a stream per row), max_len (cache
    slots S; default the largest P + N - 1 (the slots the rows need; plus a tree's nodes but the root, its
    scratch) rounded up to a multiple of 128, capped at the model's context length), adaptive, block_verify,
    debug_checks, logprobs (``DecodeOutput.logprobs``: the target's log-probability of each generated token),
    top_logprobs (N <= 20, with logprobs=True: ``DecodeOutput.top_logprobs``, the N most likely (id,
    log-probability) pairs at each generated position, most likely first).
    Returns generated tokens per row, the stop reason per row and statistics (defined in the module doc). Sampling
    parameters, stop token ids, min_tokens, logit biases, the seed or key and the budgets are arrays: new values
    reuse the compiled loop as long as the batch, the padded prompt width (a multiple of 16), max_len, the longest
    row's stop-id count and logit_bias size (each rounded up to a multiple of 4) and the kind of seed (one, or one
    per row) stay the same (a default max_len follows the budget); drafter, gamma, eos_ids, adaptive,
    block_verify, debug_checks, logprobs, top_logprobs and whether any row has a penalty are static and compile a
    loop of their own.

    stop (vLLM's stop strings: a string or a list of them for every row, or one entry per row) with
    ``detokenize`` (token ids -> text, e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``): text only
    exists on the host, so the decode then steps round by round (``run_with_stop_strings``: a host sync per round,
    the same tokens) and a row whose text holds one of its strings ends with the token completing it, stop reason
    STOP_STRING; with min_tokens, only a string that a token after the row's first min_tokens completes counts.
    """
    if "stop_strings" in kwargs:
        raise ValueError("decode sets stop_strings from stop= (prepare's serves callers that step a stream)")
    if stop is None:
        if detokenize is not None:
            raise ValueError("detokenize is only used to find stop strings: pass stop=[...] with it, or leave it out")
        return prepare(target, target_params, prompts, **kwargs).run()
    if detokenize is None or not callable(detokenize):
        raise ValueError(
            "stop strings need detokenize (token ids -> text), "
            "e.g. lambda ids: tok.decode(ids, skip_special_tokens=True)"
        )
    try:
        batch = len(prompts)
    except TypeError:  # not prompts at all: prepare says what is wrong with them
        return prepare(target, target_params, prompts, **kwargs).run()
    rows = stop_string_rows(stop, batch)
    prepared = prepare(target, target_params, prompts, stop_strings=[bool(r) for r in rows], **kwargs)
    if not any(rows):  # no row has a string to look for: the fused loop, no host sync per round
        return prepared.run()
    n_min = jax.device_get(prepared.sampling.min_tokens)
    return run_with_stop_strings(prepared.stream(), rows, detokenize, n_min)


def decode_stream(target: Model, target_params, prompts, **kwargs) -> DecodeStream:
    """Like ``decode`` (same arguments), but steps round by round from Python: the returned ``DecodeStream``
    yields, after prefill and after every round, the tokens each row emitted in that step (an empty list for rows
    that emitted nothing), and says between steps why each row stopped (``stop_reasons``), the log-probabilities
    of the step's tokens (``logprobs``, with ``logprobs=True``) and the whole ``DecodeOutput`` so far
    (``output()``). The rounds run the same ``decode_round`` as the fused loop, so the tokens are identical.
    Arguments are checked when it is called, not at the first ``next()``."""
    if "stop" in kwargs or "detokenize" in kwargs:
        raise ValueError(
            "decode_stream yields every token: look for stop strings over its steps with jspec.stop.StopStrings, "
            "or let decode(stop=..., detokenize=...) do it"
        )
    return prepare(target, target_params, prompts, **kwargs).stream()


class DecodeStream(Iterator[list[list[int]]]):
    """The iterator ``decode_stream`` returns (and ``sharding``'s streams): ``next()`` runs one step (prefill
    first, then one round) and returns the tokens each row emitted in it; it stops after the step in which the
    last running row stopped.

    After a step: ``stop_reasons[b]`` is row b's ``StopReason`` (RUNNING while it decodes; the finish reason a
    server reports when a row's last tokens arrive), ``logprobs[b]`` the target's log-probabilities of the tokens
    the step gave row b (with ``logprobs=True``, else None), ``top_logprobs[b]`` their alternatives (with
    ``top_logprobs=N``, else None), and ``output()`` the ``DecodeOutput`` of the state so far, equal to ``decode``'s
    once the stream is exhausted.

    ``to_host`` fetches (small per-row) device arrays to numpy and ``gather`` turns a state into a
    ``DecodeOutput``: multi-process callers pass collectives, so every process must step the stream alike."""

    def __init__(self, pre, step, args, logprobs: bool, to_host=jax.device_get, gather=None, top: bool = False):
        self._pre, self._step, self._args = pre, step, args
        self._to_host, self._gather = to_host, gather or to_output
        self._want_logprobs = bool(logprobs)
        self._want_top = bool(top)
        self.top_logprobs: list[list[list[tuple[int, float]]]] | None = None
        self._st = None  # the latest state; the round donates it, so only the newest one is ever read
        self._done = False
        self._failed = False
        self.stop_reasons: list[StopReason] | None = None
        self.logprobs: list[list[float]] | None = None

    def __iter__(self) -> DecodeStream:
        return self

    def __next__(self) -> list[list[int]]:
        if self._done:
            raise StopIteration
        if self._failed:
            raise ValueError("a step of this stream failed (the error was raised then): it cannot go on")
        target_params, draft_params, *arrays = self._args
        self._failed = True  # until the step returns: the round donates the state it is given
        if self._st is None:
            st = self._pre(target_params, draft_params, *arrays)
            emitted, n_emit = st.seq, None  # the first token: at seq_len - 1
        else:
            st, emitted, n_emit = self._step(target_params, draft_params, self._st)
        # Only the step's window of log-probabilities travels (its tokens end at seq_len), not every row's history.
        w = 1 if n_emit is None else emitted.shape[1]
        lp = tail_rows(st.logprob, st.seq_len, w) if self._want_logprobs else None
        top = (
            (tail_rows(st.top_ids, st.seq_len, w), tail_rows(st.top_logprob, st.seq_len, w)) if self._want_top else None
        )
        # One transfer per step (a collective across processes): tokens, lengths, stops and logprobs together.
        emitted, n_emit, seq_len, stop, lp, top = self._to_host((emitted, n_emit, st.seq_len, st.stop, lp, top))
        if n_emit is None:
            chunk = [[int(emitted[i, seq_len[i] - 1])] for i in range(seq_len.shape[0])]
            n_emit = np.ones_like(seq_len)
        else:
            chunk = [emitted[i, : n_emit[i]].tolist() for i in range(seq_len.shape[0])]
        self._st, self._failed = st, False
        self.stop_reasons = [StopReason(int(r)) for r in stop]
        if lp is not None:  # the step's tokens are the window's last n_emit
            self.logprobs = [lp[i, w - n_emit[i] :].tolist() for i in range(lp.shape[0])]
        if top is not None:
            self.top_logprobs = [
                top_pairs(top[0][i, w - n_emit[i] :], top[1][i, w - n_emit[i] :]) for i in range(len(top[0]))
            ]
        self._done = not np.any(np.asarray(stop) == StopReason.RUNNING)
        return chunk

    def output(self) -> DecodeOutput:
        """Tokens, stop reasons, statistics (and logprobs) of every step so far."""
        if self._failed:
            raise ValueError("a step of this stream failed: its state was given to that step and is gone")
        if self._st is None:
            raise ValueError("the stream has not run a step yet: call next() first")
        return self._gather(self._st)


@functools.lru_cache(maxsize=64)
def _stream_fns(target, drafter, config):
    """(prefill, round) for stepping from Python. The round's state argument is donated: without it XLA
    copies the whole KV cache into the new state every round (SmolLM2, 1024 slots: streaming ran at 34.7
    plain / 41.5 n-gram tokens/s against 42.0 / 49.8 donated). The caller must use only the returned state."""
    pre = jax.jit(functools.partial(prefill, target, drafter, config))
    rnd = functools.partial(decode_round, target, drafter, config)
    if config.debug_checks:  # the round's check must be functionalised; it raises on the host after the round
        checked = jax.jit(checkify.checkify(rnd), donate_argnums=(2,))
        return pre, lambda *args: _throw(checked(*args))
    return pre, jax.jit(rnd, donate_argnums=(2,))
