"""The cost of each phase of a decode round, timed piece by piece on the serving shapes.

The fused loop cannot be timed per phase from inside, so each phase is a separately jitted piece on the same
shapes as the serving run (same batch, cache slots, context length): a draft-only rollout, a verify-only target
call (K + 1 positions, or the tree's N nodes under its ancestor mask), a plain 1-token target step, the accept +
commit step, and the whole fused round (``decode_round``, with every candidate proposed; for chain drafters also
a round where nothing is proposed, the 1-token fallback a lookup miss takes); each is timed with
``block_until_ready`` and reported as the median of repeats, the configurations of one load sampled in turn. The
round minus the three phases is reported as "other": what the pieces leave out (branching and buffer copies
inside the fused round; fusion can also make it negative).

``PhaseTimer`` compiles and feeds one configuration's pieces once and takes one sample at a time, so the
configurations of one load are sampled in turn (``measure_phases_interleaved``) and share the machine's state;
``measure_phases`` times one configuration. The cost-model check (``checks.cost_model_check``) reads the result.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import DraftContext
from jspec.loop import decode_round, prefill, scatter_rows
from jspec.sampling import argmax, distribution
from jspec.state import DecodeConfig
from jspec.tree import ancestor_mask, verify_tree_greedy, verify_tree_key
from jspec.validate import sampling_params
from jspec.verify import verify_chain_greedy, verify_chain_key


def median_ms(fn: Callable[..., Any], repeats: int = 7, args: Callable[[], tuple] | None = None) -> float:
    """Median wall time of ``fn()`` in ms after one warm-up call (which also compiles).

    args: makes ``fn``'s arguments for each call, outside the timed region (``fn(*args())``): fresh copies of
    what a piece that donates its inputs (a KV cache) consumes, as ``PhaseTimer`` feeds its pieces."""
    make = args or tuple
    jax.block_until_ready(fn(*make()))
    times = []
    for _ in range(repeats):
        a = make()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _phase_fns(target, drafter, config: DecodeConfig, greedy: bool):
    """Jitted pieces of one round, each taking the loop state as an argument (never closed over, so the
    arrays are inputs, not constants folded into the program). The pieces that return a KV cache take it
    donated, as the serving engine's step does: otherwise XLA copies the whole cache into every output
    (~1.6 ms for SmolLM2 at 640 slots, on the plain step and the round alike). ``PhaseTimer`` hands each
    call fresh copies, made outside the timed region. They take the paths the round takes: a drafter that
    shares the target's cache drafts from it, a drafter with its own ``verify`` (EAGLE: the target call that
    also returns its features) verifies, and a greedy batch works on the argmax ids (``greedy``), not on
    [B, T, V] distributions."""
    k = config.gamma
    is_tree = drafter is not None and drafter.is_tree
    shares = drafter is not None and drafter.shares_target_cache
    pre = jax.jit(functools.partial(prefill, target, drafter, config))
    best = target.argmax or argmax

    def _pending(st):
        rows = jnp.arange(st.seq.shape[0])
        committed = st.seq_len - 1
        return st.seq[rows, committed], committed

    def scores(logits, sampling):
        return best(logits).astype(jnp.int32) if greedy else distribution(logits.astype(jnp.float32), sampling)

    def plain(tp, cache, st):  # one plain decoding step: [B, 1] through the target
        st = dataclasses.replace(st, cache=cache)
        pending, committed = _pending(st)
        logits, cache = target.apply(tp, pending[:, None], committed[:, None], st.cache)
        return scores(logits, st.sampling), cache

    def ctx(st):
        max_draft = jnp.full(st.seq_len.shape, k, jnp.int32)
        return DraftContext(st.seq, st.seq_len, max_draft, st.sampling, st.cache if shares else None)

    def draft(dp, st, key):
        if is_tree:
            return drafter.propose_tree(dp, st.draft_state, ctx(st), key)
        return drafter.propose(dp, st.draft_state, ctx(st), key, k)

    def verify(tp, dp, cache, st, prop):
        st = dataclasses.replace(st, cache=cache)
        pending, committed = _pending(st)
        mask = None
        if is_tree:
            tokens = prop.tokens.at[:, 0].set(pending)
            positions = committed[:, None] + prop.depth
            mask = ancestor_mask(prop.parent)
        else:
            tokens = jnp.concatenate([pending[:, None], prop.tokens], axis=1)  # [B, K+1]
            positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        if drafter.verify_updates_state or drafter.shares_target_cache:
            extra = () if mask is None else (mask,)
            out = drafter.verify(target, tp, dp, prop.state, tokens, positions, st.cache, *extra)
            logits, cache = out[0], out[1]
        else:
            logits, cache = target.apply(tp, tokens, positions, st.cache, mask)
        return scores(logits, st.sampling), cache

    def update(st, prop, p, cache, key):
        """Acceptance + commit: the verification rule, the emitted tokens, the sequence and cache commit."""
        b = st.seq.shape[0]
        if is_tree:
            pending, _ = _pending(st)
            tokens = prop.tokens.at[:, 0].set(pending)
            d, c = drafter.max_depth, drafter.max_children
            if greedy:
                res = verify_tree_greedy(p, tokens, prop.parent, prop.valid, d, c)
            else:
                res = verify_tree_key(key, p, prop.q, tokens, prop.parent, prop.valid, drafter.rule, d, c)
            path_tokens = tokens[jnp.arange(b)[:, None], res.path[:, 1:]]
            cache = cache.commit(res.n_accepted + 1, res.path)
        else:
            if greedy:
                q_x = jnp.take_along_axis(prop.q, prop.tokens[..., None], axis=-1)[..., 0]
                res = verify_chain_greedy(p, prop.tokens, prop.n_draft, q_x)
            else:
                res = verify_chain_key(key, p, prop.q, prop.tokens, prop.n_draft, block=config.block_verify)
            path_tokens = prop.tokens
            cache = cache.commit(res.n_accepted + 1)
        j = jnp.arange(path_tokens.shape[1] + 1)[None, :]
        padded = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = jnp.where(j < res.n_accepted[:, None], padded, res.next_token[:, None])
        seq = scatter_rows(st.seq, st.seq_len, emitted, res.n_accepted + 1)
        return seq, cache

    def round_(tp, dp, st):
        return decode_round(target, drafter, config, tp, dp, st)[0]

    return (
        pre,
        jax.jit(plain, donate_argnums=1),
        jax.jit(draft, donate_argnums=1),  # the round updates the drafter's cache in place: so must this piece
        jax.jit(verify, donate_argnums=2),
        jax.jit(update, donate_argnums=3),
        jax.jit(round_, donate_argnums=2),
    )


def fresh(tree):
    """A copy of every array of ``tree``, ready: the argument a donating piece may consume."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


class PhaseTimer:
    """The jitted pieces of one configuration's round, compiled and fed once, timed one sample at a time.

    Several timers sampled in turn (``measure_phases_interleaved``) see the same machine state, so their
    ratios are not biased by load that drifts over minutes (the noise these shared CPUs have)."""

    def __init__(self, target, target_params, drafter, draft_params, config: DecodeConfig, batch: int,
                 context_len: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int = 0):  # fmt: skip
        b, s = batch, config.slots
        n = self.context_len = int(min(max(context_len, 2), s - config.gamma - 3))
        rng = np.random.default_rng(seed)
        # A prompt that repeats a random block: every suffix n-gram occurs earlier, so a lookup drafter
        # proposes its full K and the round takes its wide (K+1-position) path, as a model drafter always does.
        block = rng.integers(0, target.vocab_size, size=(b, min(32, max(n // 2, 1))))
        prompt = jnp.asarray(np.tile(block, (1, -(-n // block.shape[1])))[:, :n], jnp.int32)
        plen = jnp.full((b,), n, jnp.int32)
        max_new = jnp.full((b,), s, jnp.int32)
        # The run's own filters: with none set the sampling path skips its threshold searches, so timing
        # without them would price another configuration than the one measured.
        sampling = sampling_params(b, temperature, top_k, top_p, min_p)
        key = jax.random.split(jax.random.key(seed), b)  # per-row keys, as the serving engine runs them
        pre, plain, draft, verify, update, round_ = _phase_fns(target, drafter, config, bool(temperature == 0))
        st = jax.block_until_ready(pre(target_params, draft_params, prompt, plen, max_new, sampling, key))
        tp, dp = target_params, draft_params
        # name -> (arguments, made before the clock starts: fresh copies of what the piece consumes; the piece)
        self.pieces: dict[str, tuple[Callable[[], tuple], Callable[..., Any]]] = {
            "plain_step_ms": (lambda: (tp, fresh(st.cache), st), plain)
        }
        self.info: dict[str, Any] = {"batch": b, "context_len": self.context_len, "slots": s, "gamma": config.gamma}
        if drafter is not None:
            prop = draft(dp, fresh(st), key)
            p, cache = verify(tp, dp, fresh(st.cache), st, prop)
            self.pieces["draft_ms"] = (lambda: (dp, fresh(st), key), draft)
            self.pieces["verify_ms"] = (lambda: (tp, dp, fresh(st.cache), st, prop), verify)
            self.pieces["state_ms"] = (lambda: (st, prop, p, fresh(cache), key), update)
            self.info["verify_positions"] = int(prop.tokens.shape[1] + (0 if drafter.is_tree else 1))
        self.pieces["round_ms"] = (lambda: (tp, dp, fresh(st)), round_)
        if drafter is not None and not drafter.is_tree and target.vocab_size >= n:
            # Distinct tokens: no suffix occurs earlier, so a lookup drafter proposes nothing and the round
            # takes its narrow path (a 1-token verification). For a model drafter it equals round_ms.
            distinct = np.stack([rng.permutation(target.vocab_size)[:n] for _ in range(b)])
            st_miss = pre(tp, dp, jnp.asarray(distinct, jnp.int32), plen, max_new, sampling, key)
            self.pieces["round_narrow_ms"] = (lambda: (tp, dp, fresh(st_miss)), round_)
        for args, fn in self.pieces.values():  # compile and warm every piece before any sample is taken
            jax.block_until_ready(fn(*args()))
        self.samples: dict[str, list[float]] = {k: [] for k in self.pieces}
        try:
            mem = round_.lower(tp, dp, st).compile().memory_analysis()
            self.info["round_scratch_bytes"] = int(mem.temp_size_in_bytes)
        except Exception as e:  # memory_analysis is backend-dependent; record why it is missing
            self.info["round_scratch_bytes"] = None
            self.info["round_scratch_error"] = f"{type(e).__name__}: {e}"[:200]

    def sample(self) -> None:
        for name, (args, fn) in self.pieces.items():
            a = args()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            self.samples[name].append((time.perf_counter() - t0) * 1e3)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.info)
        out["repeats"] = len(self.samples["round_ms"])
        out["how"] = "separately jitted pieces on the serving shapes, block_until_ready, median of repeats"
        for name, xs in self.samples.items():
            out[name] = float(statistics.median(xs))
        if "draft_ms" not in out:  # plain decoding: its verification is the 1-token step
            out.update(draft_ms=0.0, verify_ms=out["plain_step_ms"], state_ms=None)
        out["other_ms"] = out["round_ms"] - sum(out[k] or 0.0 for k in ("draft_ms", "verify_ms", "state_ms"))
        return out


def measure_phases_interleaved(timers: Sequence[PhaseTimer], repeats: int = 7) -> list[dict[str, Any]]:
    """``repeats`` rounds of one sample from every timer in turn; medians per timer."""
    for _ in range(repeats):
        for t in timers:
            t.sample()
    for t in timers:
        t.info["interleaved_with"] = len(timers)
    return [t.result() for t in timers]


def measure_phases(
    target,
    target_params,
    drafter,
    draft_params,
    config: DecodeConfig,
    batch: int,
    context_len: int,
    *,
    temperature: float = 0.0,
    repeats: int = 7,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-phase costs in ms (medians of ``repeats``) at batch ``batch`` with ``context_len`` committed tokens
    per row in a cache of ``config.slots`` slots. The prompt repeats a random block of token ids, so a
    lookup drafter proposes its full K and the round takes its wide path, as a model drafter's always does
    (``PhaseTimer``); round_narrow_ms times the same round on distinct tokens, where a lookup finds nothing.

    Returns plain_step_ms, draft_ms (the whole rollout for K, or the tree), verify_ms, state_ms (accept +
    commit), round_ms (the fused round as the loop runs it), other_ms = round - draft - verify - state, and
    the round's scratch bytes."""
    timer = PhaseTimer(target, target_params, drafter, draft_params, config, batch, context_len,
                       temperature=temperature, seed=seed)  # fmt: skip
    return measure_phases_interleaved([timer], repeats)[0]
