"""Lossless chain verification (Leviathan et al. 2023, sec. 2.3 and app. A.1).

A proposed token x ~ q is accepted with probability min(1, p(x)/q(x)); on the first rejection the
replacement comes from the residual norm(max(0, p - q)); when every proposal is accepted a bonus token is
drawn from the target's next distribution. Whatever q is, the emitted tokens are distributed as p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.cache import take_rows
from jspec.sampling import sample_from, split_keys, uniform


def accepted_mass(p: jax.Array, q: jax.Array) -> jax.Array:
    """[..., V] -> [..., V]: probability that token x is both proposed and accepted, min(p, q).
    Summed over V it is the acceptance rate for this prefix."""
    return jnp.minimum(p, q)


def acceptance_prob(p: jax.Array, q: jax.Array) -> jax.Array:
    """min(1, p/q) elementwise, defined as 1 where q == 0 (such a token is never proposed); never 0/0."""
    safe_q = jnp.where(q > 0, q, 1.0)
    return jnp.where(q > 0, jnp.minimum(1.0, p / safe_q), 1.0)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """[..., V] -> [..., V]: norm(max(0, p - q)), the distribution of a correction token after a rejection.

    When p == q the residual has no mass; a rejection is then impossible (every proposal is accepted), so
    the value returned there (p itself) is never sampled from. It only avoids producing NaNs.
    """
    r = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def accept(p_x: jax.Array, q_x: jax.Array, u: jax.Array) -> jax.Array:
    """Accept a proposal iff u < p(x)/q(x), written u * q(x) < p(x) so p == q always accepts (u < 1) and
    nothing is divided."""
    return u * q_x < p_x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChainResult:
    """Outcome of verifying one chain per row.

    n_accepted: [B] leading proposals accepted (0..n_draft).
    next_token: [B] the correction (after a rejection) or bonus (all accepted) token.
    accepted: [B, K] bool, proposal i accepted (only the leading run counts; later ones are discarded).
    bad_proposal: [B] bool, some proposed token had q(x) == 0 (a drafter bug; checked under debug mode).
    """

    n_accepted: jax.Array
    next_token: jax.Array
    accepted: jax.Array
    bad_proposal: jax.Array


def _proposal_count(n_draft: jax.Array, k: int) -> jax.Array:
    """A row holds K proposals at most: a count past K (a traced value, which cannot be refused here) would draw
    the bonus token from residual(p[K], q[K-1]), positions that do not match, instead of p[K]. Read as all K."""
    return jnp.clip(n_draft, 0, k).astype(jnp.int32)


def verify_chain(
    p: jax.Array,  # [B, K+1, V] target distributions at the K proposals and the bonus position
    q: jax.Array,  # [B, K, V] distributions the proposals were really drawn from
    draft: jax.Array,  # [B, K] proposed token ids
    n_draft: jax.Array,  # [B] proposals actually made per row (<= K); later positions are ignored
    u_accept: jax.Array,  # [B, K] uniforms in [0, 1) for the accept tests
    u_final: jax.Array,  # [B] uniform in [0, 1) for the correction/bonus draw
) -> ChainResult:
    b, k1, v = p.shape
    k = k1 - 1
    n_draft = _proposal_count(n_draft, k)
    if k == 0:
        nxt = sample_from(p[:, 0], u_final)
        return ChainResult(jnp.zeros((b,), jnp.int32), nxt, jnp.zeros((b, 0), bool), jnp.zeros((b,), bool))
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    proposed = jnp.arange(k)[None, :] < n_draft[:, None]
    ok = accept(p_x, q_x, u_accept) & proposed
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    all_accepted = n_acc >= n_draft
    p_n = take_rows(p, n_acc)  # [B, V]
    q_n = take_rows(q, jnp.minimum(n_acc, k - 1))
    final = jnp.where(all_accepted[:, None], p_n, residual(p_n, q_n))
    nxt = sample_from(final, u_final)
    bad = jnp.any(proposed & (q_x <= 0), axis=1)
    return ChainResult(n_acc, nxt, ok, bad)


def verify_chain_key(key: jax.Array, p, q, draft, n_draft, block: bool = False) -> ChainResult:
    """``verify_chain`` (or ``verify_block``) with the uniforms drawn from a PRNG key."""
    k_acc, k_fin = split_keys(key, 2)
    b, k = draft.shape
    fn = verify_block if block else verify_chain
    return fn(p, q, draft, n_draft, uniform(k_acc, (b, k)), uniform(k_fin, (b,)))


def verify_chain_greedy(
    best: jax.Array,  # [B, K+1] the target's argmax at the K proposals and the bonus position
    draft: jax.Array,  # [B, K]
    n_draft: jax.Array,  # [B]
    q_x: jax.Array,  # [B, K] q of each proposed token (only to flag q(x) == 0 proposals)
) -> ChainResult:
    """``verify_chain`` (and ``verify_block``) when every row is greedy, i.e. p one-hot on ``best``, for any q:
    u q(x) < p(x) holds iff x is the argmax (p(x) is 1 or 0, u q(x) < 1), and after a rejected x != argmax the
    residual max(0, p - q) keeps all its mass on the argmax, so the next token is the argmax where the chain
    stopped. Works on [B, K+1] ids: no one-hot p, residual or inverse-CDF draw over V."""
    b, k = draft.shape
    n_draft = _proposal_count(n_draft, k)
    proposed = jnp.arange(k)[None, :] < n_draft[:, None]
    ok = (draft == best[:, :k]) & proposed
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    bad = jnp.any(proposed & (q_x <= 0), axis=1)
    return ChainResult(n_acc, take_rows(best, n_acc), ok, bad)


def verify_block(
    p: jax.Array,  # [B, K+1, V]
    q: jax.Array,  # [B, K, V]
    draft: jax.Array,  # [B, K]
    n_draft: jax.Array,  # [B]
    u_accept: jax.Array,  # [B, K]
    u_final: jax.Array,  # [B]
) -> ChainResult:
    """Block verification (Sun et al., ICLR 2025): the whole chain is judged jointly. Lossless, and in
    expectation it never accepts fewer tokens than ``verify_chain``.

    A running weight w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) (w_0 = 1) carries how much of the target's
    mass the first i proposals still hold. Stopping after i accepted tokens is allowed with probability
    h_i = m_i / (m_i + 1 - w_i), where m_i is the mass of the weighted residual max(0, w_i p_{i+1} - q_{i+1}),
    and h_n = w_n at the end of the row's block; the accepted length is the LARGEST i whose test passes
    (scanning from the end), and the correction comes from that weighted residual (or the bonus from p at
    the end). With a single proposal this is exactly token-wise verification.
    """
    b, k1, v = p.shape
    k = k1 - 1
    if k == 0:
        return verify_chain(p, q, draft, n_draft, u_accept, u_final)
    n_draft = _proposal_count(n_draft, k)
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    ratio = jnp.where(q_x > 0, p_x / jnp.where(q_x > 0, q_x, 1.0), 0.0)
    weights = [jnp.ones((b,), p.dtype)]
    for i in range(k):
        weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, i]))
    w = jnp.stack(weights, axis=1)  # [B, K+1], w[:, i] after i proposals
    resid = jnp.maximum(w[:, :k, None] * p[:, :k] - q, 0.0)  # [B, K, V] weighted residual after i accepted
    mass = jnp.sum(resid, axis=-1)  # [B, K]
    denom = mass + 1.0 - w[:, :k]
    h = jnp.where(denom > 0, mass / jnp.where(denom > 0, denom, 1.0), 0.0)  # [B, K]; h[:, 0] is unused (h_0 = 1)
    idx = jnp.arange(k + 1)[None, :]
    # h_i for i = 1..K; at the row's block end h = w; past it, never.
    h_full = jnp.concatenate([jnp.ones((b, 1)), h[:, 1:], jnp.zeros((b, 1))], axis=1)  # [B, K+1]
    h_full = jnp.where(idx == n_draft[:, None], w, h_full)
    h_full = jnp.where(idx > n_draft[:, None], 0.0, h_full)
    u = jnp.concatenate([jnp.zeros((b, 1)), u_accept], axis=1)  # u for i = 0 is irrelevant (h_0 = 1)
    passed = (u < h_full) | (idx == 0)
    tau = (k - jnp.argmax(jnp.flip(passed, axis=1), axis=1)).astype(jnp.int32)  # largest passing i
    at_end = tau >= n_draft
    res_tau = take_rows(resid, jnp.minimum(tau, k - 1))
    m_tau = jnp.sum(res_tau, axis=-1, keepdims=True)
    # A stop at tau < end needs m_tau > 0 (h is 0 otherwise); the guard only keeps NaNs out of dead branches.
    p_tau = take_rows(p, tau)
    res_tau = jnp.where(m_tau > 0, res_tau / jnp.where(m_tau > 0, m_tau, 1.0), p_tau)
    final = jnp.where(at_end[:, None], p_tau, res_tau)
    nxt = sample_from(final, u_final)
    proposed = jnp.arange(k)[None, :] < n_draft[:, None]
    accepted = jnp.arange(k)[None, :] < tau[:, None]
    bad = jnp.any(proposed & (q_x <= 0), axis=1)
    return ChainResult(tau, nxt, accepted, bad)
