"""The distribution that is really sampled: logits -> temperature, top-k, top-p, min-p -> probabilities.

Target and drafter both go through ``distribution``, so the p and q that verification compares are exactly
what each side samples from; that is what makes speculative sampling lossless for any transform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters, all arrays with a leading [B] axis, so changing them never recompiles.

    temperature: 0 means greedy (a one-hot distribution on the argmax, lowest index on ties).
    top_k: keep the k most likely tokens (ties at the k-th value are kept); 0 disables.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 disables.
    min_p: keep tokens whose probability is at least min_p times the largest; 0 disables.
    Applied in that order (temperature, top-k, top-p, min-p), each on the renormalised result of the last.
    stop_ids: [B, E] the row's own stop token ids (vLLM's ``stop_token_ids``), -1 where unused: the first of
      them a row emits ends it, emitted, as an EOS does. Not part of the distribution (speculation may propose
      a stop token; what the row keeps is cut after it, as for EOS).
    min_tokens: [B] the row's end tokens (the loop's EOS ids and its own stop ids) get probability 0 while it has
      generated fewer tokens than this (vLLM's ``min_tokens``; transformers' ``min_new_tokens``); 0 disables.
    bias_ids, bias: [B, M] the row's logit bias (OpenAI's and vLLM's ``logit_bias``): ``bias[b, j]`` is added to
      the logit of token ``bias_ids[b, j]`` (-1: unused slot); -inf bans the token.
    repetition_penalty: [B] (vLLM's and transformers'; 1 disables): the logit of every token already in the prompt
      or the output is divided by it when positive, multiplied by it when not.
    presence_penalty, frequency_penalty: [B] (OpenAI's and vLLM's; 0 disables): subtracted from the logit of every
      token the output already holds, once / once per occurrence.
    The bias and min_tokens, then the penalties, act on the target's raw logits before the transforms above (as
    vLLM's logits processors and penalties do), so they change the distribution sampled and the argmax of greedy
    rows (see ``processed_logits``, ``penalized_logits``); drafters propose from their own unprocessed q, which
    stays lossless.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    stop_ids: jax.Array
    min_tokens: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array

    def has_penalties(self) -> bool:
        """Whether any row asks for a penalty (host-side: reads the arrays)."""
        rep, pres, freq = (
            np.asarray(x) for x in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )
        return bool(np.any(rep != 1) or np.any(pres != 0) or np.any(freq != 0))

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]


def processed_logits(
    logits: jax.Array, params: SamplingParams, index: jax.Array, eos_ids: tuple[int, ...] = ()
) -> jax.Array:
    """The target's logits as its rows sample from them: logits [B, T, V]; index [B, T], which generated token
    (0: the first) each position predicts; eos_ids: the loop's end tokens. Adds each row's logit bias and, where
    ``index < min_tokens``, sets the end tokens (eos_ids and the row's stop ids) to -inf. -> [B, T, V] float32.

    Sparse writes of [B, T, M] and [B, T, E] entries (not a [B, T, V] mask), the latter whenever there are end
    tokens, even with every min_tokens 0 (a scatter of dropped entries, ~0.02 ms for SmolLM2's logits); nothing
    at all when the state holds no bias slots and there are no end tokens (static shapes)."""
    m, e = params.bias_ids.shape[1], params.stop_ids.shape[1] + len(eos_ids)
    if m == 0 and e == 0:
        return logits
    logits = logits.astype(jnp.float32)
    b, t, v = logits.shape
    rows = jnp.arange(b)[:, None, None]
    cols = jnp.arange(t)[None, :, None]
    if m:
        ids = jnp.where(params.bias_ids >= 0, params.bias_ids, v)[:, None, :]  # past V: dropped
        logits = logits.at[rows, cols, ids].add(jnp.broadcast_to(params.bias[:, None, :], (b, t, m)), mode="drop")
    if e:
        ends = params.stop_ids
        if eos_ids:
            ends = jnp.concatenate([ends, jnp.broadcast_to(jnp.asarray(eos_ids, jnp.int32), (b, len(eos_ids)))], 1)
        early = (index < params.min_tokens[:, None])[:, :, None]  # [B, T, 1]
        ids = jnp.where(early & (ends >= 0)[:, None, :], ends[:, None, :], v)
        logits = logits.at[rows, cols, ids].set(-jnp.inf, mode="drop")
    return logits


def penalized_logits(logits: jax.Array, params: SamplingParams, counts: jax.Array, seen: jax.Array) -> jax.Array:
    """logits [B, T, V]; counts [B, T, V]: how often each token occurs in the output before the token each
    position predicts; seen [B, T, V] bool: the token occurs in the prompt or there. -> [B, T, V] float32 with
    the rows' repetition, presence and frequency penalties applied (vLLM's formulas)."""
    logits = logits.astype(jnp.float32)
    rep = _expand(params.repetition_penalty, 3)
    hit = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, hit, logits)
    counts = counts.astype(jnp.float32)
    return logits - _expand(params.frequency_penalty, 3) * counts - _expand(params.presence_penalty, 3) * (counts > 0)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B, T], stop_ids [B, E] (-1 unused) -> [B, T] bool: the token is one of its row's stop ids."""
    return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)


def _expand(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] to broadcast against [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _bits(p: jax.Array) -> jax.Array:
    """Non-negative float32 -> int32 with the same order (IEEE-754: the bit pattern of a non-negative float
    grows with its value), so value thresholds can be found by bisection on integers, exactly."""
    return jax.lax.bitcast_convert_type(p.astype(jnp.float32), jnp.int32)


def _kth_largest(probs: jax.Array, k: jax.Array) -> jax.Array:
    """probs [..., V] >= 0, k [..., 1] in [1, V] -> [..., 1] the k-th largest value, counted with
    multiplicity: the largest t with #{p >= t} >= k. 32 bisection steps over the bit patterns, each one
    counting pass over V."""
    bits = _bits(probs)
    k = jnp.broadcast_to(k, probs.shape[:-1] + (1,))
    lo = jnp.zeros(k.shape, jnp.int32)  # #{p >= +0.0} = V >= k
    hi = jnp.max(bits, axis=-1, keepdims=True) + 1  # #{p >= above the max} = 0 < k

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(bits >= mid, axis=-1, keepdims=True, dtype=jnp.int32) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _top_p_threshold(kept: jax.Array, top_p: jax.Array) -> jax.Array:
    """kept [..., V] >= 0 (0 = filtered out), top_p [..., 1] in (0, 1) -> [..., 1] the smallest kept value x
    whose strictly larger values hold less than top_p of the kept mass: the last value the descending
    cumulative sum reaches before top_p, so keeping p >= x keeps the smallest prefix reaching top_p (with
    its whole tie group). 32 bisection steps, each one masked sum over V."""
    bits = _bits(kept)
    target = top_p * jnp.sum(kept, axis=-1, keepdims=True)
    lo = jnp.full(target.shape, -1, jnp.int32)  # mass above -1 (all of it) >= target: not ok
    hi = jnp.max(bits, axis=-1, keepdims=True)  # mass above the max is 0 < target: ok

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(bits > mid, kept, 0.0), axis=-1, keepdims=True) < target
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def _filtered(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled probabilities with top-k/top-p/min-p applied (renormalised). [B, ..., V].

    Thresholds are values, so ties are kept whole. They are found by bisection over the probabilities' bit
    patterns, not by sorting: XLA:CPU sorts a 49152-entry row in ~10 ms, which made a top-p round at batch 16
    with K=4 cost ~0.8 s; the 64 passes over a row cost ~0.5-1 ms (``examples/bench_sampler.py``)."""
    nd = logits.ndim
    temp = _expand(params.temperature, nd)
    # Shifted by the row max first: at a tiny positive temperature logits / T overflows to +-inf, and softmax's
    # own shift then computes inf - inf = NaN; shifted, the max is 0 and the rest go to -inf (one-hot on the max).
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    scaled = shifted / jnp.where(temp > 0, temp, 1.0)
    # The row max is already 0: softmax's own max-subtraction would be a second reduction over V for nothing.
    e = jnp.exp(scaled)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)

    def with_filters(probs):
        v = probs.shape[-1]
        k = _expand(params.top_k, nd)
        kth = jnp.where((k > 0) & (k < v), _kth_largest(probs, jnp.clip(k, 1, v)), 0.0)
        kept = jnp.where(probs >= kth, probs, 0.0)
        # top-p on the top-k result (the threshold is relative to the kept mass, so no renormalising first).
        top_p = _expand(params.top_p, nd)
        pth = jnp.where(top_p < 1.0, _top_p_threshold(kept, jnp.clip(top_p, 1e-30, 1.0)), 0.0)
        kept = jnp.where(kept >= pth, kept, 0.0)
        kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
        # min-p is relative to the largest remaining probability, which the earlier filters never remove.
        min_p = _expand(params.min_p, nd)
        kept = jnp.where(kept >= min_p * jnp.max(kept, axis=-1, keepdims=True), kept, 0.0)
        kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
        # A row without filters keeps its probabilities bit for bit: renormalised again it moved by an ulp or
        # so, enough to change a sampled token with the batch's other rows (batch 1 vs batch 8, same seed).
        own = ((k > 0) & (k < v)) | (top_p < 1.0) | (min_p > 0)
        return jnp.where(own, kept, probs)

    # Rows without filters (the usual case) skip the threshold searches entirely.
    needs_filter = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1.0) | jnp.any(params.min_p > 0)
    return jax.lax.cond(needs_filter, with_filters, lambda x: x, probs)


def distribution(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[B, ..., V] logits -> [B, ..., V] float32 probabilities that sum to 1 over V.

    Rows with temperature 0 get a one-hot on the argmax, so greedy decoding runs through the same
    acceptance rule as sampling and stays token-for-token equal to plain greedy decoding.
    """
    logits = logits.astype(jnp.float32)
    greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    is_greedy = _expand(params.temperature, logits.ndim) == 0
    # An all-greedy batch (the usual benchmark case) skips the softmax over [B, ..., V] entirely.
    return jax.lax.cond(
        jnp.all(params.temperature == 0),
        lambda x: greedy,
        lambda x: jnp.where(is_greedy, greedy, _filtered(x, params)),
        logits,
    )


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (lowest index on ties) as two plain reductions: XLA:CPU's fused
    (value, index) reduction took ~2 ms for [9, 49152] logits, a noticeable share of a verification round.
    A row holding NaN maps to the last index (``jnp.argmax`` would return the first NaN's index)."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first, v - 1)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis: (values [..., k] descending, indices [..., k] int32), the
    lower index first among equal values. For k <= 16 it runs as k max/min passes: XLA:CPU lowers
    ``lax.top_k`` to a full sort of every row, which took 45 ms of a 166 ms tree round for [4, 2, 49152]
    draft logits."""
    if k > 16:
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    v = x.shape[-1]
    if not 0 <= k <= v:
        raise ValueError(f"top_k: k={k} outside [0, {v}]")
    iota = jnp.arange(v, dtype=jnp.int32)
    taken = jnp.zeros(x.shape, bool)
    vals, idxs = [], []
    for _ in range(k):
        rest = jnp.where(taken, -jnp.inf, x)
        top = jnp.max(rest, axis=-1, keepdims=True)
        # Among untaken entries equal to the max (all -inf ones too, once only those are left), the lowest.
        i = jnp.min(jnp.where((rest == top) & ~taken, iota, v), axis=-1)
        vals.append(top[..., 0])
        idxs.append(i)
        taken = taken | (iota == i[..., None])
    return jnp.stack(vals, axis=-1).astype(x.dtype), jnp.stack(idxs, axis=-1).astype(jnp.int32)


def sample_from(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw: probs [..., V] (need not be normalised), u [...] uniforms in [0, 1) -> ids [...].

    Taking explicit uniforms (rather than a key) lets a caller replay a draw exactly. A token of zero
    probability is never returned while the row has some mass (an all-zero row gives V - 1).
    """
    cdf = jnp.cumsum(probs, axis=-1)
    return inverse_cdf(probs, cdf, u[..., None] * cdf[..., -1:])


def inverse_cdf(probs: jax.Array, cdf: jax.Array, target: jax.Array) -> jax.Array:
    """The first token with mass whose cdf passes ``target`` (probs, cdf [..., V]; target [..., 1], broadcast).

    Not the count of cdf entries <= target, which is the same index only while cdf never decreases: cumsum runs
    as a parallel scan whose entries are rounded independently, so across a run of zero-mass tokens (what top-k
    / top-p / min-p leave) cdf can dip by an ulp, and the count would land on a token of probability 0 (an
    emitted filtered token; a draft token with q = 0, accepted outright). Past the last cdf (a few ulps of
    rounding), the last token with mass."""
    # Plain min / max reductions over an iota (as ``argmax`` does): XLA:CPU's fused argmax is far slower.
    v = probs.shape[-1]
    iota = jnp.arange(v, dtype=jnp.int32)
    first = jnp.min(jnp.where((probs > 0) & (cdf > target), iota, v), axis=-1)
    last_positive = jnp.max(jnp.where(probs > 0, iota, -1), axis=-1)
    last_positive = jnp.where(last_positive < 0, v - 1, last_positive)  # no mass at all: the last token
    return jnp.where(first < v, first, last_positive).astype(jnp.int32)


# Keys. Everything random in a round takes either one key for the whole batch or a [B] array of per-row keys
# (per-request seeds). With per-row keys, row b's draws come from key b alone, so a request's tokens do not
# depend on which row it sits in, on the other rows or on B. Every draw goes through these three helpers.


def split_keys(key: jax.Array, n: int) -> jax.Array:
    """``n`` keys: [n] from one key, [n, B] from [B] per-row keys (so ``keys[i]`` is always one draw's key)."""
    if key.ndim == 0:
        return jax.random.split(key, n)
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)


def _per_row(draw, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if key.ndim == 0:
        return draw(key, shape)
    if key.ndim != 1 or not shape or shape[0] != key.shape[0]:
        raise ValueError(f"per-row keys {key.shape} need a draw shaped [B, ...] with B = {key.shape[0]}, got {shape}")
    return jax.vmap(lambda k: draw(k, shape[1:]))(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms in [0, 1) of ``shape``; with [B] per-row keys the leading axis is B and row b uses key b."""
    return _per_row(jax.random.uniform, key, tuple(shape))


def gumbel(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard Gumbel noise of ``shape``, per row as ``uniform``."""
    return _per_row(jax.random.gumbel, key, tuple(shape))


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per leading index from probs [..., V] with a PRNG key (or [B] per-row keys)."""
    return sample_from(probs, uniform(key, probs.shape[:-1]))
