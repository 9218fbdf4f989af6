"""One round's draft and verification, for a chain and for a tree: what ``jspec.loop.decode_round`` calls.

Each step drafts (``Drafter.propose`` / ``propose_tree``), runs ONE target call over the candidates (K+1
positions of a chain, the N nodes of a tree under their ancestor mask) and decides per row how many candidates
are kept (``jspec.verify`` / ``jspec.tree``). It returns a ``RoundStep``; committing it is the loop's.

The request options (logit bias, min_tokens, penalties) act on the target's logits before acceptance
(``request_logits``): speculation stays lossless with respect to the processed distribution.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec.cache import take_rows
from jspec.drafters import DraftContext, Drafter, Proposal, always_wide
from jspec.model import Model
from jspec.sampling import SamplingParams, argmax, distribution, penalized_logits, processed_logits
from jspec.state import DecodeConfig, DecodeState
from jspec.tree import TreeProposal, TreeRule, ancestor_mask, verify_tree_greedy, verify_tree_key
from jspec.verify import verify_chain_greedy, verify_chain_key


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStep:
    """What a round's draft and verification decided, per row, before anything is committed.

    path_tokens [B, K]: the candidates along the kept path (the first n_accepted are accepted); n_accepted [B];
    next_token [B]: the correction or bonus token; path [B, K+1]: a tree's accepted node indices (None for a
    chain, whose path is its positions); cache: the target's, with the round's entries written but not
    committed; draft_state; proposed_at [B, K]: candidates proposed per position (a tree: per depth);
    bad [B]: a proposal its drafter's q gave probability 0 (``debug_checks``); emitted_logits [B, K+1, V]:
    the target's logits predicting each emitted token (only with ``logprobs``)."""

    path_tokens: jax.Array
    n_accepted: jax.Array
    next_token: jax.Array
    path: jax.Array | None
    cache: Any
    draft_state: Any
    proposed_at: jax.Array
    bad: jax.Array
    emitted_logits: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Verified:
    """A chain verification's outputs: logits [B, K+1, V] (float32), their argmax [B, K+1] when every row is
    greedy (zeros otherwise), the target cache with the round written, and the drafter's state."""

    logits: jax.Array
    best: jax.Array
    cache: Any
    state: Any


def request_logits(config: DecodeConfig, st: DecodeState):
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


def target_argmax(target: Model):
    """The target's own row argmax (``Model.argmax``, e.g. a CPU kernel) or ``jspec.sampling.argmax``."""
    return target.argmax or argmax


def greedy_ids(target: Model, logits: jax.Array, sampling: SamplingParams, proc) -> jax.Array:
    """[B, T, V] -> [B, T] int32: the argmax of the processed logits (``proc``, see ``request_logits``) when every
    row is greedy (all greedy verification reads), zeros otherwise (a sampling batch builds its distributions
    instead)."""
    zeros = jnp.zeros(logits.shape[:2], jnp.int32)
    am = target_argmax(target)
    greedy = jnp.all(sampling.temperature == 0)
    return jax.lax.cond(greedy, lambda x: am(proc(x)), lambda _: zeros, logits).astype(jnp.int32)


AT_MOST_ONCE = "at_most_once"


def switch_in_place(index: jax.Array, fns, carry, operands=None):
    """``lax.switch(index, fns, carry)`` for branches that rewrite a large buffer of ``carry`` (the KV cache): one
    while loop of 0 or 1 trips per branch. XLA updates while-loop carries in place, whereas a cond copied k and v
    into or out of the taken branch and again after it (SmolLM2, n-gram K=4: 4 whole-cache copies per round in the
    optimised HLO; 48.1 -> 46.4 ms per round without them). Every function maps ``carry`` to a value of its
    structure; exactly the one at ``index`` runs.

    ``operands``: what the branches read besides ``carry`` (a pytree; each function is then called as
    ``fn(carry, operands)``). XLA moves loop-invariant work out of a while loop, so a branch's work on values it
    only closes over (a prompt lookup on the sequence, the embedding and first layer of a K+1-token verification)
    would run before the loop, taken or not: at batch 8 a goodput round at K = 0 ran 4-6 ms (~10%) over a plain
    step for the K = 4 branch's hoisted work. Passed here, they go through an optimisation barrier with the loop's
    trip counter, which makes them loop-variant: nothing of a branch runs unless it is taken."""

    def once(fn, go):
        def body(c):
            if operands is None:
                return c[0] + 1, fn(c[1])
            n, ops = jax.lax.optimization_barrier((c[0] + 1, operands))
            return n, fn(c[1], ops)

        return lambda c: jax.lax.while_loop(lambda c: c[0] < go, body, (jnp.int32(0), c))[1]

    # The scope name marks these loops in the compiled HLO, so analyses (``sharding.hlo``) can count them as
    # branches taken at most once rather than as data-dependent loops.
    with jax.named_scope(AT_MOST_ONCE):
        for i, fn in enumerate(fns):
            carry = once(fn, jnp.where(index == i, 1, 0))(carry)
    return carry


def cond_in_place(pred: jax.Array, true_fn, false_fn, carry, operands=None):
    """``lax.cond(pred, true_fn, false_fn, carry)`` for branches that rewrite the KV cache (``switch_in_place``,
    ``operands`` as there)."""
    return switch_in_place(jnp.where(pred, 1, 0), (false_fn, true_fn), carry, operands)


def _draft_chain(drafter: Drafter, k: int, draft_params, st: DecodeState, max_draft, key, v: int) -> Proposal:
    """The round's chain of ``k`` proposals, n_draft capped at ``max_draft`` (q over the target's V tokens). When
    no row may propose (adaptive K at 0, or the budget nearly spent) the drafter only keeps its state in step
    (``observe``) instead of rolling out K steps. The returned ``target_cache`` is the target's cache, with the
    drafter's writes if it shares it."""
    b = st.seq.shape[0]
    shares = drafter.shares_target_cache
    ctx = DraftContext(st.seq, st.seq_len, max_draft, st.sampling, st.cache if shares else None)

    def propose(p: Proposal) -> Proposal:
        prop = drafter.propose(draft_params, p.state, ctx, key, k)
        tcache = prop.target_cache if shares else p.target_cache
        return Proposal(prop.tokens, prop.q, jnp.minimum(prop.n_draft, max_draft), prop.state, tcache)

    def skip(p: Proposal) -> Proposal:
        return dataclasses.replace(p, state=drafter.observe(draft_params, p.state, ctx))

    def nothing(state, tcache) -> Proposal:  # q of no proposal: finite, never read as a candidate
        q = jnp.ones((b, k, v), jnp.float32) / v
        return Proposal(jnp.zeros((b, k), jnp.int32), q, jnp.zeros((b,), jnp.int32), state, tcache)

    any_row = jnp.any(max_draft > 0)
    if shares or jax.tree.leaves(st.draft_state):
        # Branches that pass a KV cache (the target's, or the drafter's own in its state) through: in place.
        return cond_in_place(any_row, propose, skip, nothing(st.draft_state, st.cache))
    # A stateless drafter (the n-gram lookup) and no cache through the branches: a plain cond, so the [B, K, V] q
    # of "no proposal" is only built in the round that takes that branch, not as every round's loop-carry
    # initialiser.
    empty = Proposal(None, None, None, st.draft_state, None)
    prop = jax.lax.cond(any_row, lambda _: propose(empty), lambda _: nothing(st.draft_state, None), None)
    return dataclasses.replace(prop, target_cache=st.cache)


def chain_step(
    target: Model,
    drafter,
    config: DecodeConfig,
    target_params,
    draft_params,
    st,
    pending,
    committed,
    max_draft,
    keys,
    k: int | None = None,
) -> RoundStep:
    """Draft a chain of ``k`` (static; default ``config.gamma``), verify its K+1 positions in one target call,
    accept. ``keys``: (draft key, verify key). The step's arrays are ``config.gamma`` wide whatever its k (a round
    that chooses among several K, ``jspec.goodput``, switches between steps of one shape)."""
    k_draft, k_verify = keys
    k = config.gamma if k is None else k
    b = pending.shape[0]
    proc = request_logits(config, st)
    if k == 0:  # one plain target step; a drafter's state keeps up with the committed tokens
        none = jnp.zeros((b, 0), jnp.int32)
        state = st.draft_state
        if drafter is not None:
            ctx = DraftContext(st.seq, st.seq_len, jnp.zeros_like(max_draft), st.sampling)
            state = drafter.observe(draft_params, state, ctx)
        if drafter is not None and drafter.verify_updates_state:
            # The drafter's own call over the pending token alone (an EAGLE head keeps its features, which the
            # next round's catch-up feeds it): the same one-position target pass, with its by-products.
            logits, cache, state = drafter.verify(
                target, target_params, draft_params, state, pending[:, None], committed[:, None], st.cache
            )
        else:
            logits, cache = target.apply(target_params, pending[:, None], committed[:, None], st.cache)
        prop = Proposal(none, jnp.zeros((b, 0, 1), jnp.float32), jnp.zeros((b,), jnp.int32), state)
        ver = _Verified(logits, greedy_ids(target, logits, st.sampling, proc), cache, state)
        proc_wide = proc
    else:
        prop = _draft_chain(drafter, k, draft_params, st, max_draft, k_draft, target.vocab_size)
        tokens = jnp.concatenate([pending[:, None], prop.tokens], axis=1)  # [B, K+1]
        # Position j follows the pending token and drafts 1..j (what the penalties count besides the output).
        history = jnp.broadcast_to(jnp.tril(jnp.ones((k + 1, k + 1), bool)), (b, k + 1, k + 1))
        proc_wide = functools.partial(proc, block=(tokens, history))

        # The verification branches return the target's logits and, when every row is greedy, their argmax:
        # the distributions are built after the branch, and only for a batch that samples.
        def verify_wide(cache, ops) -> _Verified:
            tokens, _, committed = ops
            positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
            state, args = prop.state, (target, target_params, draft_params, prop.state, tokens, positions, cache)
            if drafter.verify_updates_state:  # it reads the verification's by-products (an EAGLE head's features)
                logits, cache, state = drafter.verify(*args)
            elif drafter.shares_target_cache:  # it reuses what it computed of the target's pass
                logits, cache = drafter.verify(*args)
            else:
                logits, cache = target.apply(target_params, tokens, positions, cache)
            best = greedy_ids(target, logits, st.sampling, proc_wide)
            return _Verified(logits.astype(jnp.float32), best, cache, state)

        def verify_narrow(v: _Verified, ops) -> _Verified:
            # Nothing was proposed anywhere (e.g. every n-gram lookup missed): a plain 1-token step, so a miss
            # costs what plain decoding costs instead of a K+1-wide verification. Positions 1..K keep their
            # initial zeros: with nothing proposed, only position 0 is read.
            _, pending, committed = ops
            logits, cache = target.apply(target_params, pending[:, None], committed[:, None], v.cache)
            best = v.best.at[:, :1].set(greedy_ids(target, logits, st.sampling, proc))
            return _Verified(v.logits.at[:, :1].set(logits.astype(jnp.float32)), best, cache, v.state)

        if always_wide(drafter):
            ver = verify_wide(prop.target_cache, (tokens, pending, committed))
        else:
            v = target.vocab_size
            init = _Verified(
                jnp.zeros((b, k + 1, v), jnp.float32), jnp.zeros((b, k + 1), jnp.int32), prop.target_cache, prop.state
            )
            ops = (tokens, pending, committed)  # through the branches' barrier: neither runs untaken
            any_proposed = jnp.any(prop.n_draft > 0)
            ver = cond_in_place(any_proposed, lambda x, o: verify_wide(x.cache, o), verify_narrow, init, ops)

    def greedy(_):  # p is one-hot on the argmax: see ``verify_chain_greedy`` (block verification agrees)
        q_x = jnp.take_along_axis(prop.q, prop.tokens[..., None], axis=-1)[..., 0] if k else jnp.zeros((b, 0))
        return verify_chain_greedy(ver.best, prop.tokens, prop.n_draft, q_x)

    def sampled(_):
        p = distribution(proc_wide(ver.logits), st.sampling)
        return verify_chain_key(k_verify, p, prop.q, prop.tokens, prop.n_draft, block=config.block_verify)

    res = jax.lax.cond(jnp.all(st.sampling.temperature == 0), greedy, sampled, None)
    proposed_at = (jnp.arange(k)[None, :] < prop.n_draft[:, None]).astype(jnp.int32)
    # Every step is config.gamma wide: positions past this step's k hold nothing (never accepted, never emitted).
    wide = config.gamma - k
    return RoundStep(
        path_tokens=jnp.pad(prop.tokens, ((0, 0), (0, wide))),
        n_accepted=res.n_accepted,
        next_token=res.next_token,
        path=None,
        cache=ver.cache,
        draft_state=ver.state,
        proposed_at=jnp.pad(proposed_at, ((0, 0), (0, wide))),
        bad=res.bad_proposal,
        # Position j predicts the j-th emitted token.
        emitted_logits=jnp.pad(ver.logits, ((0, 0), (0, wide), (0, 0))) if config.logprobs else None,
    )


def tree_step(
    target: Model, drafter, config: DecodeConfig, target_params, draft_params, st, pending, committed, max_draft, keys
) -> RoundStep:
    """Draft a candidate tree, verify every node in one target call under the ancestor mask, accept one path."""
    k_draft, k_verify = keys
    b = pending.shape[0]
    ctx = DraftContext(st.seq, st.seq_len, max_draft, st.sampling)
    prop: TreeProposal = drafter.propose_tree(draft_params, st.draft_state, ctx, k_draft)
    n = prop.tokens.shape[1]
    tokens = prop.tokens.at[:, 0].set(pending)
    # A node is usable if it is proposed, not deeper than this row may go, its scratch slot exists, and so
    # does every ancestor's (the parent comes first in topological order, so one pass suffices). Which nodes
    # are verified decides which acceptance draws a sampled row uses: so that it does not depend on a cache sized
    # by the other rows, decode's default max_len and the serving engine give every row the drafter's scratch
    # slots past its P + N - 1, and then this bound never cuts a node the row may use.
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
    if drafter.verify_updates_state:
        logits, cache, verified = drafter.verify(
            target, target_params, draft_params, prop.state, tokens, positions, st.cache, mask
        )
    else:
        logits, cache = target.apply(target_params, tokens, positions, st.cache, mask)

    proc = request_logits(config, st)

    def sampled(logits):
        p = distribution(proc(logits, prop.depth, (tokens, mask)), st.sampling)
        d, c = drafter.max_depth, drafter.max_children
        return verify_tree_key(k_verify, p, prop.q, tokens, prop.parent, valid, drafter.rule, d, c)

    def greedy(logits):  # the same result without the [B, N, V] distributions (1-1.5 ms of a SmolLM2 round)
        ids = target_argmax(target)(proc(logits, prop.depth, (tokens, mask)))
        return verify_tree_greedy(ids, tokens, prop.parent, valid, drafter.max_depth, drafter.max_children)

    res = jax.lax.cond(jnp.all(st.sampling.temperature == 0), greedy, sampled, logits)
    state = drafter.follow_path(prop.state, verified, res.path) if drafter.verify_updates_state else prop.state
    depth_hot = jax.nn.one_hot(prop.depth - 1, drafter.max_depth, dtype=jnp.int32)  # [B, N, D]; root -> none
    bad = jnp.zeros((b,), bool)
    if config.debug_checks and drafter.rule != TreeRule.DETERMINISTIC:
        # Sampled children (IID, without replacement) are verified against the q they were drawn from: a usable
        # node whose parent's q gives its token probability 0 breaks losslessness (deterministic trees are
        # verified without q).
        q_x = prop.q[jnp.arange(b)[:, None], jnp.maximum(prop.parent, 0), tokens]  # [B, N] q_parent(token)
        bad = jnp.any(valid[:, 1:] & (q_x[:, 1:] <= 0), axis=1)
    return RoundStep(
        path_tokens=take_rows(tokens, res.path[:, 1:]),  # [B, D]
        n_accepted=res.n_accepted,
        next_token=res.next_token,
        path=res.path,
        cache=cache,
        draft_state=state,
        proposed_at=jnp.einsum("bnd,bn->bd", depth_hot, valid.astype(jnp.int32)),  # candidate nodes per depth
        bad=bad,
        # The path's node j predicts the j-th emitted token (its accepted child, or the correction / bonus token).
        emitted_logits=jnp.take_along_axis(logits, res.path[..., None], axis=1) if config.logprobs else None,
    )
