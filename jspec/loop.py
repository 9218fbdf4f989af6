"""The device loop: prefill, then ``lax.while_loop`` over rounds of draft -> verify -> accept -> commit, per row,
with no host sync. Plain autoregressive decoding is the same loop with no drafter (K = 0): baselines share every
line but the speculation.

Read top to bottom: ``prefill`` builds the ``DecodeState`` from the prompt; ``decode_round`` runs one round for
every row (the drafting and verification are ``jspec.rounds``'; here the accepted tokens are emitted, cut at an
end token or the budget, and committed to the cache and the statistics); ``run_loop`` repeats it until every
row has stopped; ``generate_arrays`` is the whole pure decode that ``jspec.decode`` jits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jspec import adaptive as adapt
from jspec import goodput
from jspec.cache import set_rows, take_rows
from jspec.drafters import always_wide
from jspec.model import Model
from jspec.rounds import RoundStep, chain_step, switch_in_place, tree_step
from jspec.sampling import (
    SamplingParams,
    distribution,
    is_stop,
    penalized_logits,
    processed_logits,
    sample,
    split_keys,
    top_k,
)
from jspec.state import DecodeConfig, DecodeState, DecodeStats, StopReason


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


def scatter_rows(buf: jax.Array, start: jax.Array, vals: jax.Array, n: jax.Array) -> jax.Array:
    """buf [B, W, ...]; write vals[b, :n[b]] ([B, T, ...]) at buf[b, start[b]:]; anything else (or past W) is
    dropped."""
    w = buf.shape[1]
    j = jnp.arange(vals.shape[1], dtype=jnp.int32)[None, :]
    idx = jnp.where(j < n[:, None], start[:, None] + j, w)
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(buf, idx, vals)


def ends(config: DecodeConfig, stop_ids: jax.Array, emitted: jax.Array) -> jax.Array:
    """emitted [B, T] -> [B, T] bool: an end token, one of the loop's EOS ids or of the row's stop ids."""
    out = is_stop(emitted, stop_ids)
    if config.eos_ids:
        out = out | jnp.isin(emitted, jnp.asarray(config.eos_ids, jnp.int32))
    return out


def stop_reason(config, stop_ids, emitted, n_emit, n_gen, max_new, committed, old_stop) -> jax.Array:
    """Per-row stop after a step: an end token (EOS or the row's stop ids) among the emitted tokens, the token
    budget, or no cache slot left for the next pending token. An already stopped row keeps its reason."""
    j = jnp.arange(emitted.shape[1])[None, :]
    hit_eos = jnp.any(ends(config, stop_ids, emitted) & (j < n_emit[:, None]), axis=1)
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
    if drafter is not None and drafter.verify_updates_state:
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
    zeros = jnp.zeros((b,), jnp.int32)
    stats = DecodeStats(  # each its own buffer: a stream's round donates the state
        rounds=jnp.zeros((b,), jnp.int32),
        emitted=jnp.zeros((b,), jnp.int32),
        proposed=jnp.zeros((b,), jnp.int32),
        accepted=jnp.zeros((b,), jnp.int32),
        accepted_at=jnp.zeros((k,), jnp.int32),
        proposed_at=jnp.zeros((k,), jnp.int32),
        loop_rounds=jnp.zeros((), jnp.int32),
        wide_rounds=jnp.zeros((), jnp.int32),
        k_rounds=jnp.zeros((len(config.draft_lengths),), jnp.int32),
    )
    one = jnp.ones((b,), jnp.int32)
    stop = stop_reason(config, sampling.stop_ids, first[:, None], one, one, max_new, prompt_len, zeros)
    return DecodeState(
        seq=seq,
        seq_len=prompt_len + 1,
        prompt_len=prompt_len,
        max_new=max_new,
        cache=cache,
        draft_state=draft_state,
        sampling=sampling,
        key=key,
        stop=stop,
        stats=stats,
        bad_proposal=jnp.zeros((), bool),
        accept_ema=adapt.init(config.adaptive, b) if config.goodput is None else goodput.init(config.goodput, b),
        logprob=logprob,
        top_ids=top_ids,
        top_logprob=top_lp,
        out_counts=out_counts,
        prompt_seen=prompt_seen,
    )


def _step_at(target, drafter, config, target_params, draft_params, st, pending, committed, max_draft, keys, k_index):
    """The round's draft and verification at the goodput policy's ``ks[k_index]``: one step per K in the set, the
    chosen one run (``switch_in_place``: the caches stay in place). Every step has the same shapes (config.gamma
    wide); a tree drafter's set is a plain step (K = 0) and its tree."""
    policy = config.goodput
    tree = drafter.is_tree
    b, k, v = pending.shape[0], config.gamma, target.vocab_size

    def branch(k_i):
        step_fn = tree_step if tree and k_i > 0 else functools.partial(chain_step, k=k_i)

        def run(c: RoundStep, ops) -> RoundStep:
            sub, pending, committed, max_draft, keys = ops
            sub = dataclasses.replace(sub, cache=c.cache, draft_state=c.draft_state)
            out = step_fn(
                target, drafter, config, target_params, draft_params, sub, pending, committed, max_draft, keys
            )
            return (
                out
                if out.path is not None or not tree
                else dataclasses.replace(out, path=jnp.zeros((b, k + 1), jnp.int32))
            )

        return run

    zeros = jnp.zeros((b,), jnp.int32)
    init = RoundStep(
        path_tokens=jnp.zeros((b, k), jnp.int32),
        n_accepted=zeros,
        next_token=zeros,
        path=jnp.zeros((b, k + 1), jnp.int32) if tree else None,
        cache=st.cache,
        draft_state=st.draft_state,
        proposed_at=jnp.zeros((b, k), jnp.int32),
        bad=jnp.zeros((b,), bool),
        emitted_logits=jnp.zeros((b, k + 1, v), jnp.float32) if config.logprobs else None,
    )
    # What the steps read besides the caches goes in as operands, so that no step's work runs untaken.
    ops = (dataclasses.replace(st, cache=None, draft_state=None), pending, committed, max_draft, keys)
    return switch_in_place(k_index, [branch(k_i) for k_i in policy.ks], init, ops)


def decode_round(
    target: Model,
    drafter,
    config: DecodeConfig,
    target_params,
    draft_params,
    st: DecodeState,
    k_index: jax.Array | None = None,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One round for every row: draft -> verify K+1 positions in one target call -> accept -> commit.
    Returns the new state, the tokens emitted this round [B, K+1] and how many per row [B]. With a goodput policy
    the round's K is the policy's choice, or ``ks[k_index]`` when given (the cost profiler times each K so)."""
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
        max_draft = jnp.minimum(max_draft, adapt.choose_k(config.adaptive, st.accept_ema, k, always_wide(drafter)))
    policy = config.goodput
    if policy is not None:
        if k_index is None:
            k_index = goodput.choose(policy, st.accept_ema, active, st.max_new - n_gen)
        round_k = jnp.asarray(policy.ks, jnp.int32)[k_index]
        max_draft = jnp.minimum(max_draft, round_k)
    else:
        k_index, round_k = jnp.zeros((), jnp.int32), jnp.int32(k)
    # A row that has ended proposes nothing: otherwise it alone could make the batch draft and verify K+1
    # wide while the running rows asked for no candidates (and the stats, counting running rows, hide it).
    max_draft = jnp.where(active, max_draft, 0)
    # Nor is it sampled: its outputs are discarded, and its temperature would put every greedy row of the
    # batch on the sampled path (distributions over [B, K+1, V]) until the row is refilled. The state keeps
    # the row's own parameters.
    temperature = jnp.where(active, st.sampling.temperature, 0.0)
    rst = dataclasses.replace(st, sampling=dataclasses.replace(st.sampling, temperature=temperature))

    pending = take_rows(st.seq, committed)
    args = (
        target,
        drafter,
        config,
        target_params,
        draft_params,
        rst,
        pending,
        committed,
        max_draft,
        (k_draft, k_verify),
    )
    if policy is not None:
        step = _step_at(*args, k_index)
    elif drafter is not None and drafter.is_tree:
        step = tree_step(*args)
    else:
        step = chain_step(*args)
    n_acc = step.n_accepted

    # Emit the accepted candidates and the correction/bonus token, up to the first end token and the budget.
    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([step.path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j < n_acc[:, None], padded, step.next_token[:, None])  # [B, K+1]
    n_emit = n_acc + 1
    is_end = ends(config, st.sampling.stop_ids, emitted) & (j < n_emit[:, None])
    n_emit = jnp.where(jnp.any(is_end, axis=1), jnp.argmax(is_end, axis=1) + 1, n_emit)
    n_emit = jnp.where(active, jnp.minimum(n_emit, st.max_new - n_gen), 0)

    seq = scatter_rows(st.seq, st.seq_len, emitted, n_emit)
    logprob = st.logprob
    if config.logprobs:
        logprob = scatter_rows(logprob, st.seq_len, token_logprobs(step.emitted_logits, emitted), n_emit)
    out_counts = st.out_counts
    if config.penalties:  # the emitted tokens join the output the penalties count
        ids = jnp.where(j < n_emit[:, None], emitted, out_counts.shape[1])  # past V: dropped
        out_counts = jax.vmap(lambda c, i: c.at[i].add(1, mode="drop"))(out_counts, ids)
    top_ids, top_lp = st.top_ids, st.top_logprob
    if config.top_logprobs:
        ids, lps = top_token_logprobs(step.emitted_logits, config.top_logprobs)
        top_ids = scatter_rows(top_ids, st.seq_len, ids, n_emit)
        top_lp = scatter_rows(top_lp, st.seq_len, lps, n_emit)
    # Commit: the pending token and the accepted proposals now have their state in the cache; the correction/bonus
    # token becomes the new pending token, computed next round (never reused from a rejected candidate).
    # For a tree, the accepted path's entries move from their scratch slots to consecutive committed slots.
    cache = step.cache.commit(jnp.where(active, n_acc + 1, 0), step.path)
    seq_len = st.seq_len + n_emit
    stop = stop_reason(
        config, st.sampling.stop_ids, emitted, n_emit, seq_len - st.prompt_len, st.max_new, seq_len - 1, st.stop
    )

    act = active.astype(jnp.int32)
    proposed_at = step.proposed_at * act[:, None]  # [B, K] candidates proposed at each draft position (tree: depth)
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
        # A drafter that reads the verification verifies K + 1 positions even where nothing was proposed, but not
        # in a goodput round at K = 0 (a plain step).
        wide_rounds=st.stats.wide_rounds
        + (jnp.any(n_draft > 0) | (always_wide(drafter) & (round_k > 0))).astype(jnp.int32),
        k_rounds=st.stats.k_rounds.at[k_index].add(1),
    )
    bad = st.bad_proposal | jnp.any(step.bad & active)
    ema = st.accept_ema
    if config.adaptive is not None:
        ema = adapt.update(config.adaptive, ema, n_acc, n_draft, active)
    if policy is not None:
        # A row that could propose and found nothing (a prompt lookup that missed) kept one token of the K + 1 the
        # round cost: a failed test, not an idle round that would drift back to the prior.
        tried = jnp.where(max_draft > 0, jnp.maximum(n_draft, 1), n_draft)
        ema = goodput.update(policy, ema, n_acc, tried, active)
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
        draft_state=step.draft_state,
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
