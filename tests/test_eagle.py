"""EAGLE draft head (models/eagle.py): greedy speculative == greedy plain (tiny random Llama, ragged batch, with
and without adaptive K; the real SmolLM2 at batch 2 with the bundled head), the features the head consumes ==
a fresh target pass over the committed tokens, the whole-sequence distribution at T > 0 with top-k / top-p and
a reduced draft vocabulary against an exact enumeration, the orbax checkpoint round trip and its bf16 export.
The same for the head drafting candidate trees (``EagleTreeDrafter``): every node's draft distribution equals
the training-time computation on its own root-to-node path, the accepted path's features (not a sibling's)
feed the next round."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_models import MisreportedQ, chi2_critical, chi_square, exact_causal_distribution, grouped_rows

from jspec import decode as dec
from jspec.adaptive import AdaptiveK
from jspec.decode import decode, prepare
from jspec.drafters import DraftContext
from jspec.goodput import GoodputK
from jspec.loop import decode_round, prefill
from jspec.state import StopReason, to_output
from jspec.tree import TreeRule, TreeSpec
from jspec.validate import sampling_params
from models import llama
from models.cpu_kernels import PackedMatrix
from models.eagle import (
    BUNDLED_DIR,
    DEFAULT_HEAD,
    EagleConfig,
    EagleDrafter,
    EagleDynamicTreeDrafter,
    EagleTreeDrafter,
    bundled_heads,
    frequent_tokens,
    graft_fusion,
    head_features,
    head_unrolled,
    init_head,
    init_head_cache,
    restore_head,
    save_head,
    subset_logits,
)
from models.llama import is_packed, unstack_layers

TINY = llama.LlamaConfig(
    vocab_size=48, hidden=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128, name="tiny"
)
TINY_PARAMS = llama.init_random_params(TINY, jax.random.key(0), std=0.1)
TINY_MODEL = llama.make_model(TINY)
PROMPTS = [[1, 5, 9, 3, 7], [2, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def random_head(ecfg: EagleConfig, target_params, seed: int, scale: float = 0.1, token_ids=None):
    """Head params with every trainable leaf random (an untrained head is close to the identity map)."""
    hp = init_head(ecfg, target_params, jax.random.key(seed), token_ids)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        if x.dtype == jnp.int32:
            return x
        noise = rng.standard_normal(x.shape).astype(np.float32) * scale
        return jnp.asarray(np.asarray(x) + noise) if "scale" in jax.tree_util.keystr(path) else jnp.asarray(noise)

    return jax.tree_util.tree_map_with_path(draw, hp)


def tiny_drafter(head_tokens=40, k=3, seed=3, scale=0.1):
    ecfg = EagleConfig(TINY, head_tokens=head_tokens, name="tiny-eagle")
    ids = np.sort(np.random.default_rng(seed).permutation(TINY.vocab_size)[:head_tokens]) if head_tokens else None
    hp = random_head(ecfg, TINY_PARAMS, seed, scale, ids)
    drafter = EagleDrafter(ecfg, max_draft=k)
    return drafter, drafter.draft_params(TINY_PARAMS, hp), hp


def test_heads_and_rules_that_do_not_match_their_config_are_refused():
    """A fused head under an unfused config drafted from unfused features silently (and the reverse, or another
    layer count, failed at trace time); a tree rule of True or 1.0 was read as IID."""
    drafter, _, hp = tiny_drafter()
    fused = EagleConfig(TINY, head_tokens=40, name="tiny-eagle", fuse=(0,))
    with pytest.raises(ValueError, match=r"the head has no fusion weights but its config says fuse=\(0,\)"):
        EagleDrafter(fused).draft_params(TINY_PARAMS, hp)
    with pytest.raises(ValueError, match=r"the head has fusion weights but its config says fuse=\(\)"):
        drafter.draft_params(TINY_PARAMS, graft_fusion(fused, hp))
    deeper = EagleConfig(TINY, head_tokens=40, name="tiny-eagle", layers=2)
    with pytest.raises(ValueError, match=r"the head's layers stack \[1\] layers, its config says 2"):
        EagleDrafter(deeper).draft_params(TINY_PARAMS, hp)
    for rule in (True, 1.0):
        with pytest.raises(ValueError, match="rule must be a jspec.tree.TreeRule"):
            EagleTreeDrafter(drafter.ecfg, spec=TreeSpec((2, 1)), rule=rule)


def test_frequent_tokens():
    counts = np.array([0, 5, 1, 5, 0, 9])
    assert frequent_tokens(counts, 3).tolist() == [1, 3, 5]
    assert frequent_tokens(counts, 3, always=[4]).tolist() == [1, 4, 5]  # ties (1, 3) -> lower id
    assert frequent_tokens(counts, 4).tolist() == [1, 2, 3, 5]
    with pytest.raises(ValueError):
        frequent_tokens(counts, 0)


@pytest.mark.fast
def test_greedy_identical_to_plain_tiny():
    mnew = [24, 30, 17]
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=mnew)
    drafter, dparams, _ = tiny_drafter(k=4)
    spec = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, gamma=4, max_new_tokens=mnew)
    assert spec.tokens == plain.tokens
    assert spec.stop_reason == plain.stop_reason
    assert 0 < spec.stats["accepted"] < spec.stats["proposed"], spec.stats
    # gamma < max_draft (narrower catch-up and feature block) and adaptive K (the observe path: rounds with
    # no proposals must still feed the committed tokens to the head).
    short = decode(
        TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, gamma=2, max_new_tokens=mnew
    )
    assert short.tokens == plain.tokens
    adaptive = decode(
        TINY_MODEL,
        TINY_PARAMS,
        PROMPTS,
        drafter=drafter,
        draft_params=dparams,
        gamma=4,
        max_new_tokens=mnew,
        adaptive=AdaptiveK(draft_cost=0.2),  # a round costs 2.1 steps: on while acceptance is above ~0.55
    )
    assert adaptive.tokens == plain.tokens
    assert 0 < adaptive.stats["proposed"] < spec.stats["proposed"], (adaptive.stats, spec.stats)
    # A goodput policy: each round's K among 0 (a plain step through the head's own verify: the features of the
    # pending token), 1, 2 and 4; costs under which both plain steps and drafting rounds are chosen.
    policy = GoodputK((0, 1, 2, 4), (1.0, 1.3, 1.5, 1.9))
    chosen = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, goodput=policy,
                    max_new_tokens=mnew)  # fmt: skip
    assert chosen.tokens == plain.tokens
    k_rounds = chosen.stats["k_rounds"]
    assert sum(k_rounds) == max(chosen.stats["rounds"]) and k_rounds[0] > 0 and sum(k_rounds[1:]) > 0, chosen.stats


def _right_pad(rows: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def stepped_rounds(drafter, dparams, k: int, rounds: int = 6):
    """Six sampled rounds of ``drafter`` on PROMPTS, stepped from Python, with rejections. Returns (state,
    committed [B] (tokens before each row's pending one), those tokens right-padded [B, W], positions [B, W])."""
    prepared = prepare(
        TINY_MODEL,
        TINY_PARAMS,
        PROMPTS,
        drafter=drafter,
        draft_params=dparams,
        gamma=k,
        max_new_tokens=40,
        temperature=1.0,  # a random head is accepted often enough only when sampling
        seed=2,
    )
    pre, step = dec._stream_fns(TINY_MODEL, drafter, prepared.config)
    st = pre(*prepared.args)
    for _ in range(rounds):
        st, _, _ = step(TINY_PARAMS, dparams, st)
    assert np.all(np.asarray(st.stop) == dec.StopReason.RUNNING)
    stats = jax.device_get(st.stats)
    assert 0 < stats.accepted.sum() < stats.proposed.sum()
    seq, seq_len = np.asarray(st.seq), np.asarray(st.seq_len)
    committed = seq_len - 1
    toks = jnp.asarray(_right_pad([seq[r, : committed[r]].tolist() for r in range(len(PROMPTS))]))
    b, w = toks.shape
    return st, committed, toks, jnp.broadcast_to(jnp.arange(w), (b, w))


def test_head_consumes_fresh_target_features():
    """After rounds with rejections: the stored feature block equals a fresh target pass over the committed
    tokens, and the head cache the rollout reads (every committed pair, fed round by round from verification
    by-products) equals a fresh head pass over (fresh features, next tokens)."""
    k = 3
    drafter, dparams, hp = tiny_drafter(k=k, seed=5)
    st, committed, toks, pos = stepped_rounds(drafter, dparams, k)
    seq = np.asarray(st.seq)
    b, w = toks.shape
    _, fresh, _ = llama.forward(TINY, TINY_PARAMS, toks, pos, llama.init_cache(TINY, b, w), return_hidden=True)
    ds = st.draft_state
    start = np.asarray(ds.start)
    for r in range(b):
        n = committed[r] - start[r]  # accepted drafts + the pending token of the last verified block
        assert 1 <= n <= k + 1
        np.testing.assert_allclose(ds.feats[r, :n], fresh[r, start[r] : committed[r]], atol=1e-4, rtol=0)

    # The head cache after next round's catch-up vs a fresh head pass over every committed pair.
    ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), k, jnp.int32), st.sampling)
    observed = jax.jit(drafter.observe)(dparams, ds, ctx)
    assert np.array_equal(np.asarray(observed.cache.lengths), committed)
    ref_toks = jnp.asarray(_right_pad([seq[r, 1 : committed[r] + 1].tolist() for r in range(b)]))
    _, ref_cache = head_features(
        drafter.ecfg, hp, TINY_PARAMS, fresh, ref_toks, pos, init_head_cache(drafter.ecfg, b, w)
    )
    for r in range(b):
        c = committed[r]
        for name in ("k", "v"):
            got = np.asarray(getattr(observed.cache, name))[:, r, :, :c]
            want = np.asarray(getattr(ref_cache, name))[:, r, :, :c]
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


class _EagleWithoutInit(EagleDrafter):
    def init(self, *args):
        raise AssertionError("the decoder's prefill should use the drafter's prefill hook, not init")


def test_prefill_hook_equals_init_and_runs_the_target_once(monkeypatch):
    """``EagleDrafter.prefill`` (one target pass for the logits and the features) gives the logits of each
    row's last prompt token, the target cache and the head state that ``init`` builds from a second pass; the
    decoder takes it instead of ``init`` (a drafter whose init raises still prefills)."""
    drafter, dparams, _ = tiny_drafter(k=3, seed=6)
    b, p = len(PROMPTS), max(map(len, PROMPTS))
    prompt = jnp.asarray(_right_pad(PROMPTS))
    plen = jnp.asarray([len(x) for x in PROMPTS], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    slots = 32
    last, cache, state = jax.jit(drafter.prefill, static_argnums=(0, 7))(
        TINY_MODEL, TINY_PARAMS, dparams, prompt, pos, TINY_MODEL.init_cache(b, slots), plen, slots
    )
    logits, ref_cache = TINY_MODEL.apply(TINY_PARAMS, prompt, pos, TINY_MODEL.init_cache(b, slots))
    ref_state = drafter.init(dparams, prompt, plen, slots)
    for r in range(b):
        np.testing.assert_allclose(last[r], logits[r, plen[r] - 1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache.k, ref_cache.k, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(state.start, ref_state.start)
    np.testing.assert_allclose(state.feats, ref_state.feats, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(state.cache.lengths, ref_state.cache.lengths)
    for r in range(b):
        c = int(plen[r]) - 1
        np.testing.assert_allclose(state.cache.k[:, r, :, :c], ref_state.cache.k[:, r, :, :c], atol=1e-5, rtol=0)

    # Traced, not compiled (the decoded tokens are held to plain's by the greedy tests, which take this path),
    # counting the target passes: every one goes through llama.forward with the target's config.
    no_init = _EagleWithoutInit(drafter.ecfg, max_draft=3)
    prepared = prepare(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=no_init, draft_params=dparams, gamma=3)
    passes, forward = [], llama.forward
    monkeypatch.setattr(llama, "forward", lambda cfg, *a, **k: passes.append(cfg == TINY) or forward(cfg, *a, **k))
    st = jax.eval_shape(functools.partial(prefill, TINY_MODEL, no_init, prepared.config), *prepared.args)
    assert st.draft_state.feats.shape == (b, 4, TINY.hidden)
    assert passes.count(True) == 1, passes


def test_training_time_test_matches_rollout():
    """Pass u of ``head_unrolled`` at position i is what draft step u computes at inference: the committed
    pairs < i - u + 1 from true features in the head cache, then u rollout steps on predicted features."""
    drafter, dparams, hp = tiny_drafter(seed=6, scale=0.2)
    ecfg = drafter.ecfg
    t, unroll = 9, 3
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(2, t, TINY.hidden)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, t)), jnp.int32)
    passes = np.asarray(jax.jit(head_unrolled, static_argnums=(0, 5))(ecfg, hp, TINY_PARAMS, feats, toks, unroll))
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    for i in range(unroll - 1, t):
        c = i - unroll + 1  # pairs [0, c] use true features (the catch-up), then the rollout continues
        f, cache = head_features(
            ecfg, hp, TINY_PARAMS, feats[:, : c + 1], toks[:, : c + 1], pos[:, : c + 1], init_head_cache(ecfg, 2, t)
        )
        cache = cache.with_lengths(jnp.full((2,), c + 1, jnp.int32))
        np.testing.assert_allclose(passes[0, :, c], np.asarray(f[:, c]), atol=1e-5)
        f_prev = f[:, c]
        for u in range(1, unroll):
            j = c + u
            f_new, cache = head_features(
                ecfg, hp, TINY_PARAMS, f_prev[:, None], toks[:, j : j + 1], pos[:, j : j + 1], cache
            )
            cache = cache.with_lengths(cache.lengths + 1)
            np.testing.assert_allclose(passes[u, :, j], np.asarray(f_new[:, 0]), atol=1e-5)
            f_prev = f_new[:, 0]


# ---- the rollout inside jspec.decode == the training-time computation ----


def near_identity_head(ecfg: EagleConfig, target_params, seed: int, scale: float, token_ids=None):
    """``init_head`` (f^_{i+1} ~ f_i: "the pending token again", which a repetitive greedy target often
    accepts) with every float leaf perturbed: greedy decoding then accepts 0..K drafts, ragged over rows."""
    hp = init_head(ecfg, target_params, jax.random.key(seed), token_ids)
    rng = np.random.default_rng(seed)

    def draw(x):
        if x.dtype == jnp.int32:
            return x
        return jnp.asarray(np.asarray(x) + rng.standard_normal(x.shape).astype(np.float32) * scale)

    return jax.tree.map(draw, hp)


class ShiftedPairingDrafter(EagleDrafter):
    """A deliberately wrong drafter for the check below: its catch-up pairs f_i with x_i instead of x_{i+1}."""

    def _catch_up(self, params, state, ctx, width):
        seq = jnp.concatenate([ctx.seq[:, :1], ctx.seq[:, :-1]], axis=1)  # seq[i + 1] now reads x_i
        return super()._catch_up(params, state, dataclasses.replace(ctx, seq=seq), width)


def _reference_features(st, recs, k: int):
    """(final sequence [B, S+1], reference width w = the last round's pending position + k, a fresh target
    pass's features over seq[:, :w+1], noise of their shape): the noise stands in for the features at pairs a
    correct rollout never reads. recs: per round, first item the pending positions [B]."""
    seq = np.asarray(st.seq)
    b = seq.shape[0]
    w = int(max(rec[0].max() for rec in recs)) + k
    pos = jnp.broadcast_to(jnp.arange(w + 1), (b, w + 1))
    _, fresh, _ = llama.forward(
        TINY, TINY_PARAMS, jnp.asarray(seq[:, : w + 1]), pos, llama.init_cache(TINY, b, w + 1), return_hidden=True
    )
    fresh = np.asarray(fresh)
    return seq, w, fresh, np.random.default_rng(0).normal(size=fresh.shape[1:]).astype(np.float32) * 3


def rollout_vs_training(drafter, hp, k: int, rounds: int, max_new: int = 40, **decode_kw):
    """Greedy ``jspec.decode`` rounds (``decode_round``, stepped from Python) on the tiny target. Before every
    round the drafter's ``propose`` is called on the round's own state, exactly as the loop calls it (the
    loop's key: its greedy drafts must be the ones the round accepted), and once more at T = 1, whose q over
    the head's tokens is softmax(draft logits). The reference is the training-time computation on the
    committed prefix: ``head_unrolled`` over pairs (f_i, x_{i+1}) with f_i from one fresh target pass over the
    final sequence, tokens the committed ones up to the pending token, then the drafts; draft position u + 1
    is pass u at pair pend - 1 + u (pass 0 = the true features). Features at pairs >= pend are noise: a
    correct rollout never reads them. Returns (max |q - q_ref|, greedy drafts == argmax of the reference,
    accepted counts [rounds, B], rounds in which no row proposed)."""
    b = len(PROMPTS)
    ecfg = drafter.ecfg
    dparams = drafter.draft_params(TINY_PARAMS, hp)
    prepared = prepare(
        TINY_MODEL,
        TINY_PARAMS,
        PROMPTS,
        drafter=drafter,
        draft_params=dparams,
        gamma=k,
        max_new_tokens=max_new,
        temperature=0.0,
        **decode_kw,
    )
    pre, step = dec._stream_fns(TINY_MODEL, drafter, prepared.config)
    propose = jax.jit(drafter.propose, static_argnums=4)
    soft = sampling_params(b, 1.0)
    st = pre(*prepared.args)
    recs, accepted, idle = [], [], 0
    for r in range(rounds):
        assert np.all(np.asarray(st.stop) == dec.StopReason.RUNNING)
        _, k_draft, _ = jax.random.split(jax.random.fold_in(st.key, st.stats.loop_rounds), 3)
        ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), k, jnp.int32), st.sampling)
        greedy = propose(dparams, st.draft_state, ctx, k_draft, k)
        sampled = propose(dparams, st.draft_state, dataclasses.replace(ctx, sampling=soft), jax.random.key(r), k)
        pend = np.asarray(st.seq_len) - 1
        proposed = int(np.asarray(st.stats.proposed).sum())
        st, emitted, n_emit = step(TINY_PARAMS, dparams, st)
        idle += int(np.asarray(st.stats.proposed).sum()) == proposed  # only ``observe`` ran
        n_acc = np.asarray(n_emit) - 1
        g_tok = np.asarray(greedy.tokens)
        for row in range(b):  # these greedy drafts are the ones the round verified
            np.testing.assert_array_equal(np.asarray(emitted)[row, : n_acc[row]], g_tok[row, : n_acc[row]])
        accepted.append(n_acc)
        recs.append((pend, g_tok, np.asarray(sampled.tokens), np.asarray(sampled.q)))

    # Reference: every (round, row, greedy|sampled drafts) in one head_unrolled call of fixed width.
    seq, w, fresh, noise = _reference_features(st, recs, k)
    feats, toks, where = [], [], []
    for pend, g_tok, s_tok, _ in recs:
        for row in range(b):
            p = pend[row]
            for drafts in (g_tok[row], s_tok[row]):
                x = np.concatenate([seq[row, : p + 1], drafts[: k - 1], np.zeros(w, np.int32)])[1 : w + 1]
                f = np.where(np.arange(w)[:, None] < p, fresh[row, :w], noise[:w])
                feats.append(f)
                toks.append(x)
                where.append(p)
    passes = jax.jit(head_unrolled, static_argnums=(0, 5))(
        ecfg, hp, TINY_PARAMS, jnp.asarray(np.stack(feats)), jnp.asarray(np.stack(toks), jnp.int32), k
    )  # [K, M, w, E]
    m = len(where)
    f_ref = np.asarray(passes)[:, np.arange(m)[:, None], np.asarray(where)[:, None] - 1 + np.arange(k)[None, :]]
    f_ref = np.diagonal(f_ref, axis1=0, axis2=2).transpose(0, 2, 1)  # [M, K, E]: pass u at pend - 1 + u
    logits = np.asarray(subset_logits(jnp.asarray(f_ref), dparams[1]["rows"]))  # [M, K, N]
    ids = np.asarray(hp["token_ids"])
    err, greedy_ok, i = 0.0, True, 0
    for _, g_tok, _, q in recs:
        for row in range(b):
            greedy_ok &= bool(np.array_equal(ids[logits[i].argmax(-1)], g_tok[row]))
            q_ref = np.asarray(jax.nn.softmax(logits[i + 1], axis=-1))
            err = max(err, float(np.abs(q[row][:, ids] - q_ref).max()))
            i += 2
    return err, greedy_ok, np.stack(accepted), idle


def _rollout_head():
    ecfg = EagleConfig(TINY, head_tokens=40, name="tiny-eagle")
    ids = np.sort(np.random.default_rng(6).permutation(TINY.vocab_size)[:40])
    return ecfg, near_identity_head(ecfg, TINY_PARAMS, 6, 0.02, ids)


@pytest.mark.parametrize("gamma,adaptive", [(3, None), (2, None), (3, AdaptiveK(draft_cost=0.6, prior=0.9))])
def test_rollout_equals_training_time_test(gamma, adaptive):
    """Every draft position's logits that ``propose`` produces inside the decode loop (greedy, ragged
    acceptance; K < max_draft; adaptive K, with rounds in which no row proposes and the head only
    ``observe``s) equal ``head_unrolled`` on the committed prefix: no off-by-one in the (f_i, x_{i+1})
    pairing, no rejected candidate's feature in the head cache, the right positions after ragged acceptance,
    the correction token's pair included."""
    ecfg, hp = _rollout_head()
    rounds = 10 if adaptive else 6
    err, greedy_ok, acc, idle = rollout_vs_training(
        EagleDrafter(ecfg, max_draft=3), hp, gamma, rounds, adaptive=adaptive
    )
    assert err < 2e-5, err
    assert greedy_ok
    # The rounds mixed rejections and acceptances of several drafts, ragged across rows.
    assert (acc == 0).any() and (acc >= 2).any(), acc
    assert any(len(set(a.tolist())) > 1 for a in acc), acc
    assert idle > 0 if adaptive else idle == 0


def test_rollout_check_detects_shifted_pairing():
    """The check above fails for a drafter whose catch-up pairs f_i with x_i (an off-by-one)."""
    ecfg, hp = _rollout_head()
    err, _, _, _ = rollout_vs_training(ShiftedPairingDrafter(ecfg, max_draft=3), hp, 3, 3)
    assert err > 1e-3, err


# ---- candidate trees ----


@pytest.mark.fast
@pytest.mark.parametrize(
    "spec,rules",
    [
        (TreeSpec((2, 2, 1)), (TreeRule.DETERMINISTIC, TreeRule.WITHOUT_REPLACEMENT)),
        (TreeSpec.chain(3), (TreeRule.DETERMINISTIC,)),
    ],
    ids=["2x2x1", "chain3"],
)
def test_tree_greedy_identical_to_plain_tiny(spec, rules):
    mnew = [24, 30, 17]
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=mnew)
    ecfg, hp = _rollout_head()
    chain = EagleDrafter(ecfg, max_draft=spec.max_depth)
    for rule in rules:
        drafter = chain.as_tree(spec, rule)
        out = decode(
            TINY_MODEL,
            TINY_PARAMS,
            PROMPTS,
            drafter=drafter,
            draft_params=chain.draft_params(TINY_PARAMS, hp),
            max_new_tokens=mnew,
        )
        assert out.tokens == plain.tokens, rule
        assert out.stop_reason == plain.stop_reason
        assert 0 < out.stats["accepted"] < out.stats["proposed"], (rule, out.stats)
    if spec.max_children == 1:  # a one-child-per-node tree is the chain: the same drafts, the same acceptance
        ref = decode(
            TINY_MODEL,
            TINY_PARAMS,
            PROMPTS,
            drafter=chain,
            draft_params=chain.draft_params(TINY_PARAMS, hp),
            gamma=spec.max_depth,
            max_new_tokens=mnew,
        )
        assert out.stats["accepted_at"] == ref.stats["accepted_at"] and out.stats["rounds"] == ref.stats["rounds"]


def test_request_options_through_eagle_verification():
    """EAGLE's own verify (the target's logits come back with the features the head needs) and its trees under
    per-row logit_bias, min_tokens, stop ids and penalties: greedy output equals an argmax loop over uncached
    target forwards whose logits a NumPy reference processes (test_logit_processors.ref_logits, written from the
    definitions), and the options changed every row."""
    from test_logit_processors import ref_logits

    n_new, width = 20, 32
    bare = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=n_new)
    eos = bare.tokens[0][3]  # row 0 would end at its 4th token; min_tokens holds that back
    stops = [[], [bare.tokens[1][2]], [bare.tokens[2][1]]]
    n_min = [6, 0, 4]
    bias = [{5: 0.5, 7: -np.inf}, None, {int(bare.tokens[2][0]): -1.5, 30: 1.0}]
    pen = [(1.0, 0.8, 0.0), (1.3, 0.0, 0.0), (1.1, 0.0, 0.5)]
    rep, pres, freq = (list(x) for x in zip(*pen))

    def reference(i):
        full, out = list(PROMPTS[i]), []
        ends = {eos, *stops[i]}
        while len(out) < n_new and not (out and out[-1] in ends):
            row = np.zeros((1, width), np.int32)
            row[0, : len(full)] = full  # causal: the padding after it changes nothing before it
            logits = np.asarray(all_logits(TINY, TINY_PARAMS, jnp.asarray(row)))[0, len(full) - 1]
            x = ref_logits(logits, bias[i] or {}, len(out), n_min[i], ends, (PROMPTS[i], out), pen[i])
            out.append(int(np.argmax(x)))
            full.append(out[-1])
        return out

    want = [reference(i) for i in range(len(PROMPTS))]
    ecfg, hp = _rollout_head()
    chain = EagleDrafter(ecfg, max_draft=3)
    kw = dict(eos_ids=[eos], stop_token_ids=stops, min_tokens=n_min, logit_bias=bias, repetition_penalty=rep,
              presence_penalty=pres, frequency_penalty=freq, max_new_tokens=n_new)  # fmt: skip
    # Not vacuous: each kind of option, left out, changes the output of every row that has it.
    no_penalty = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    for left_out, rows in ((dict(logit_bias=None), (0, 2)), (dict(min_tokens=0), (0, 2)), (no_penalty, (0, 1, 2))):
        other = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, **{**kw, **left_out}).tokens
        assert all(other[i] != want[i] for i in rows), left_out
    dp = chain.draft_params(TINY_PARAMS, hp)
    for drafter, gamma in ((chain, 3), (chain.as_tree(TreeSpec((2, 2, 1))), None)):
        out = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dp, gamma=gamma, **kw)
        assert out.tokens == want, type(drafter).__name__
        assert 0 < out.stats["accepted"] < out.stats["proposed"], out.stats


def _path_tokens(tokens: np.ndarray, parent: np.ndarray, i: int) -> list[int]:
    out = []
    while i > 0:
        out.append(int(tokens[i]))
        i = int(parent[i])
    return out[::-1]


def test_tree_rollout_equals_training_time_test():
    """Greedy tree rounds stepped from Python. Before each round, ``propose_tree`` on the round's own state at
    T = 1 (children are the head's top-c, so the tree is the one the round verifies; q is softmax of the
    node's draft logits). Every node with children, siblings included, must have the q that
    ``head_unrolled`` gives on the committed prefix followed by that node's own root-to-node path (pass d at
    pair pend - 1 + d): a node seeing a sibling, a wrong position, or a previous round's rejected branch (or
    a sibling of the accepted node) in the features or the head cache changes it. The rounds must accept
    through a non-first child at least once, so the accepted path is not simply the leftmost one."""
    spec = TreeSpec((2, 2, 1))
    ecfg, hp = _rollout_head()
    drafter = EagleTreeDrafter(ecfg, spec=spec)
    assert drafter.max_draft == spec.max_depth == 3  # the feature block holds the accepted path
    with pytest.raises(TypeError, match="max_draft"):  # the tree's depth sets it: not an argument to ignore
        EagleTreeDrafter(ecfg, max_draft=5, spec=spec)
    dparams = drafter.draft_params(TINY_PARAMS, hp)
    b, dmax = len(PROMPTS), spec.max_depth
    prepared = prepare(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=40)
    pre, step = dec._stream_fns(TINY_MODEL, drafter, prepared.config)
    propose = jax.jit(drafter.propose_tree)
    soft = sampling_params(b, 1.0)
    parent_np, depth_np, _ = spec.arrays
    st = pre(*prepared.args)
    recs, accepted, sibling_taken = [], [], 0
    for r in range(8):
        assert np.all(np.asarray(st.stop) == dec.StopReason.RUNNING)
        ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), dmax, jnp.int32), soft)
        prop = propose(dparams, st.draft_state, ctx, jax.random.key(r))
        pend = np.asarray(st.seq_len) - 1
        st, emitted, n_emit = step(TINY_PARAMS, dparams, st)
        toks, emitted, n_acc = np.asarray(prop.tokens), np.asarray(emitted), np.asarray(n_emit) - 1
        for row in range(b):  # the accepted drafts form a root-to-node path of this tree
            paths = [_path_tokens(toks[row], parent_np, i) for i in range(len(parent_np))]
            assert emitted[row, : n_acc[row]].tolist() in paths
            leftmost = _path_tokens(toks[row], parent_np, int(np.nonzero(depth_np == dmax)[0][0]))
            sibling_taken += emitted[row, : n_acc[row]].tolist() != leftmost[: n_acc[row]]
        accepted.append(n_acc)
        recs.append((pend, toks, np.asarray(prop.q)))
    accepted = np.stack(accepted)
    assert (accepted == 0).any() and (accepted >= 2).any(), accepted
    assert sibling_taken > 0, accepted

    seq, w, fresh, noise = _reference_features(st, recs, dmax)
    inner = [i for i in range(len(parent_np)) if (parent_np == i).any()]  # nodes with children: q is read
    feats, xs, where, got = [], [], [], []
    for pend, toks, q in recs:
        for row in range(b):
            p = pend[row]
            for i in inner:
                path = _path_tokens(toks[row], parent_np, i)
                x = np.concatenate([seq[row, : p + 1], path, np.zeros(w, np.int32)])[1 : w + 1]
                feats.append(np.where(np.arange(w)[:, None] < p, fresh[row, :w], noise[:w]))
                xs.append(x)
                where.append(p - 1 + depth_np[i])
                got.append((depth_np[i], q[row, i]))
    passes = np.asarray(
        jax.jit(head_unrolled, static_argnums=(0, 5))(
            ecfg, hp, TINY_PARAMS, jnp.asarray(np.stack(feats)), jnp.asarray(np.stack(xs), jnp.int32), dmax
        )
    )  # [D, M, w, E]
    ids = np.asarray(hp["token_ids"])
    err = 0.0
    for m, (d, q) in enumerate(got):
        logits = np.asarray(subset_logits(jnp.asarray(passes[d, m, where[m]][None, None]), dparams[1]["rows"]))[0, 0]
        err = max(err, float(np.abs(q[ids] - np.asarray(jax.nn.softmax(logits))).max()))
        assert np.all(np.delete(q, ids) == 0)  # nothing outside the head's tokens
    assert err < 2e-5, err


def test_tree_from_the_command_line_flags(tmp_path):
    """``--drafter eagle --tree 2,1 --tree-rule ...`` builds the tree form of a saved head (jspec.cli's own
    builder, through the installed drafter loader), ``--dynamic-tree 2,2,4`` its EAGLE-2 form. Built, not
    decoded: greedy trees of both forms decode in test_tree_greedy_identical_to_plain_tiny and
    tests/test_eagle_dynamic.py, and the dynamic form through the CLI on SmolLM2 in
    tests/test_real_model_decode.py."""
    import argparse

    from jspec import cli
    from models.registry import LoadedModel

    ecfg, hp = _rollout_head()
    save_head(tmp_path / "head", ecfg, hp)
    args = argparse.Namespace(
        drafter="eagle",
        draft_model=str(tmp_path / "head"),
        gamma=3,
        tree="2,1",
        tree_budget=None,
        tree_rule="without-replacement",
        dynamic_tree=None,
    )
    loaded = LoadedModel(TINY, TINY_PARAMS, TINY_MODEL, None)
    drafter, dparams = cli.build_drafter(args, TINY_MODEL, loaded)
    assert isinstance(drafter, EagleTreeDrafter) and drafter.rule == TreeRule.WITHOUT_REPLACEMENT
    assert drafter.spec.branching == (2, 1) and drafter.max_draft == 2
    np.testing.assert_array_equal(dparams[1]["fc"]["kernel"], hp["fc"]["kernel"])  # the saved head's weights
    dyn, dyn_params = cli.build_drafter(
        argparse.Namespace(**{**vars(args), "tree": None, "dynamic_tree": "2,2,4"}), TINY_MODEL, loaded
    )
    assert isinstance(dyn, EagleDynamicTreeDrafter) and (dyn.top_k, dyn.depth, dyn.budget) == (2, 2, 4)
    assert dyn.ecfg == drafter.ecfg
    np.testing.assert_array_equal(dyn_params[1]["fc"]["kernel"], hp["fc"]["kernel"])


def test_continuous_batching_matches_single_requests():
    """The head in the serving engine: requests dropped into free rows of a batch-2 engine (the head's state
    inserted by row) decode exactly as each does alone. A tree, so the per-node features and the accepted
    path's selection run there too; the chain's state is the same ``EagleState``."""
    from test_serve import BUDGETS, REQUESTS, _serve

    from jspec.serve import Engine

    ecfg, hp = _rollout_head()
    chain = EagleDrafter(ecfg, max_draft=3)
    dparams = chain.draft_params(TINY_PARAMS, hp)
    for drafter in (chain.as_tree(TreeSpec((2, 1))),):
        kw = dict(drafter=drafter, draft_params=dparams)  # K: the tree's depth
        alone = [
            decode(TINY_MODEL, TINY_PARAMS, [r], max_new_tokens=m, **kw).tokens[0] for r, m in zip(REQUESTS, BUDGETS)
        ]
        assert _serve(Engine(TINY_MODEL, TINY_PARAMS, batch=2, max_len=64, **kw)) == alone, drafter


# ---- the sampled distribution at T > 0 (top-k / top-p) with a reduced draft vocabulary ----

# Vocabulary 6, the head covers 4 tokens: 3 and 5 are never proposed (q = 0) while the target often wants
# them, so the residual must supply them.
DIST = llama.LlamaConfig(
    vocab_size=6, hidden=16, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=4, ffn=32, name="dist"
)
DIST_PARAMS = llama.init_random_params(DIST, jax.random.key(1), std=0.3)
DIST_MODEL = llama.make_model(DIST)
DIST_GROUPS = [dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)]
DIST_PROMPT = [2, 0]
DIST_SUBSET = [0, 1, 2, 4]


@functools.partial(jax.jit, static_argnums=0)
def all_logits(cfg, params, rows):  # [M, T] -> [M, T, V]: one uncached forward
    m, t = rows.shape
    return llama.forward(cfg, params, rows, jnp.broadcast_to(jnp.arange(t), (m, t)), llama.init_cache(cfg, m, t))[0]


def exact_target_distribution(prompt, n_new, **sampling) -> dict:
    """P(generated sequence) for every sequence of n_new tokens from the target's own logits (one cache-free
    forward) and the NumPy reference transform."""
    fn = functools.partial(all_logits, DIST, DIST_PARAMS)
    return exact_causal_distribution(fn, DIST.vocab_size, prompt, n_new, **sampling)


def _dist_head():
    ecfg = EagleConfig(DIST, head_tokens=len(DIST_SUBSET), name="dist-eagle")
    return ecfg, random_head(ecfg, DIST_PARAMS, 7, scale=0.5, token_ids=DIST_SUBSET)


def test_draft_params_refuse_token_ids_that_would_break_q():
    """expand_to_vocab scatters the head's q over its token ids: a repeated id (later entries overwrite
    earlier ones) or an id outside the vocabulary would make the verified q differ from the sampled one, so
    draft_params refuses them, and an unsorted table, as init_head does (the ids are ascending by contract)."""
    ecfg, hp = _dist_head()
    EagleDrafter(ecfg).draft_params(DIST_PARAMS, hp)  # the valid table passes
    for ids in ([0, 1, 1, 4], [0, 2, 1, 4], [0, 1, 2, DIST.vocab_size]):
        with pytest.raises(ValueError, match="distinct ascending ids"):
            EagleDrafter(ecfg).draft_params(DIST_PARAMS, {**hp, "token_ids": jnp.asarray(ids, jnp.int32)})


def _sample_and_check(drafter, hp, seed: int, group: dict, params=DIST_PARAMS, n=100_000, lossy=False, **decode_kw):
    """n (100k) sequences at one sampling setting against the exact distribution; chi-square at a 1e-5
    false-alarm level; 5 new tokens (the first from prefill). The chain runs one of DIST_GROUPS and the tree the
    other, so top-k and top-p both meet the reduced vocabulary (q comes from ``jspec.sampling.distribution``
    for every drafter: the filters' own code is the same for both). ``lossy``: the statistic must REJECT."""
    n_new = 5
    prompts, cols = grouped_rows(DIST_PROMPT, [group], n)
    out = decode(
        DIST_MODEL,
        params,
        prompts,
        drafter=drafter,
        draft_params=drafter.draft_params(params, hp),
        max_new_tokens=n_new,
        seed=seed,
        max_len=16,
        **decode_kw,
        **cols,
    )
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (n, n_new)
    assert all(c > 0 for c in out.stats["accepted_at"]), out.stats  # every draft position is accepted sometimes
    outside = np.isin(tokens, [3, 5])
    assert outside.mean() > 0.05  # tokens the head cannot propose still come out (through the residual)
    stat, df = chi_square(tokens, exact_target_distribution(DIST_PROMPT, n_new, **group))
    assert (stat > chi2_critical(df)) if lossy else (stat < chi2_critical(df)), (group, stat, df)
    return out


def test_whole_sequence_distribution_equals_target():
    """The chain, K=3, on the CPU decode layout: with the CPU kernel the target is packed and the head's
    weights are packed in bf16 (``draft_params``' default), so q comes from the bf16 kernel; the tree test
    below runs the stacked layout and the head's XLA path."""
    ecfg, hp = _dist_head()
    params = unstack_layers(DIST_PARAMS)
    if is_packed(params):
        assert EagleDrafter(ecfg).draft_params(params, hp)[1]["rows"].dtype == jnp.bfloat16
    out = _sample_and_check(EagleDrafter(ecfg, max_draft=3), hp, 5, DIST_GROUPS[1], params=params, gamma=3)
    assert 0.2 < out.stats["acceptance_rate"] < 0.95, out.stats  # both branches of the acceptance rule


def test_goodput_k_switching_keeps_the_distribution():
    """The chain under a goodput policy, its rounds forced to K = 3, 0, 1, 3, 0, 1, ... (every K, a switch every
    round: the head's catch-up after a plain step or a narrow round feeds the next one): the target's
    distribution, as above."""
    ecfg, hp = _dist_head()
    drafter, group, n, n_new = EagleDrafter(ecfg, max_draft=3), DIST_GROUPS[1], 100_000, 5
    prompts, cols = grouped_rows(DIST_PROMPT, [group], n)
    dparams = drafter.draft_params(DIST_PARAMS, hp)
    prepared = prepare(DIST_MODEL, DIST_PARAMS, prompts, drafter=drafter, draft_params=dparams, max_new_tokens=n_new,
                       seed=7, max_len=16, goodput=GoodputK((0, 1, 3), (1.0, 1.0, 1.0)), **cols)  # fmt: skip
    rnd = jax.jit(functools.partial(decode_round, DIST_MODEL, drafter, prepared.config))
    st = jax.jit(functools.partial(prefill, DIST_MODEL, drafter, prepared.config))(*prepared.args)
    r = 0
    while np.any(np.asarray(st.stop) == StopReason.RUNNING):
        st = rnd(DIST_PARAMS, dparams, st, jnp.int32((2, 0, 1)[r % 3]))[0]
        r += 1
    out = to_output(st)
    assert all(c > 0 for c in out.stats["k_rounds"]) and 0.2 < out.stats["acceptance_rate"] < 0.95, out.stats
    tokens = np.asarray(out.tokens)
    stat, df = chi_square(tokens, exact_target_distribution(DIST_PROMPT, n_new, **group))
    assert stat < chi2_critical(df), (stat, df)


def test_distribution_check_has_power():
    """The same statistic rejects the head's chain reporting a q 10% off what it samples (mixed with the
    uniform: ``toy_models.MisreportedQ``) at a quarter of the samples, so passing above means something."""
    ecfg, hp = _dist_head()
    bad = MisreportedQ(EagleDrafter(ecfg, max_draft=3), 0.9)
    _sample_and_check(bad, hp, 5, DIST_GROUPS[1], n=25_000, lossy=True, gamma=3)


def test_tree_whole_sequence_distribution_equals_target():
    """A (2, 1) tree whose children are drawn from the head's reduced vocabulary without replacement (the rule
    whose q changes after each rejection; tests/test_tree.py checks every rule's sampled distribution on toy
    drafters, and that the same statistic rejects a q misreported by 10%). EAGLE-2's dynamic trees choose
    children deterministically, so their q is never read: their sampled verification, per-row shapes included,
    is test_tree.py's ``[dynamic]`` case."""
    ecfg, hp = _dist_head()
    tree = EagleTreeDrafter(ecfg, spec=TreeSpec((2, 1)), rule=TreeRule.WITHOUT_REPLACEMENT)
    _sample_and_check(tree, hp, 6, DIST_GROUPS[0])


# ---- the real model ----


@pytest.mark.slow
def test_smollm2_greedy_identical_to_plain(smollm2):
    """On the CPU decode layout (the CLI's default on CPU), where with the CPU kernel the head's layer, fc and
    rows are packed by ``draft_params`` as the target's weights are. The stacked head path runs in the tiny
    tests above."""
    cfg, params, model, tok = smollm2
    params = unstack_layers(params)
    # As ``registry.load`` builds it for this layout: greedy paths read the CPU row-argmax kernel.
    kmodel = llama.make_model(cfg, kernel_argmax=is_packed(params))
    assert (kmodel.argmax is not None) == is_packed(params) and model.argmax is None
    chats = [
        "What are three good habits for staying focused while studying?",
        "Write a short poem about the sea at night.",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in chats]
    kw = dict(max_new_tokens=40, eos_ids=[cfg.eos_id], max_len=128)
    plain = decode(kmodel, params, prompts, **kw)
    assert plain.tokens == decode(model, params, prompts, **kw).tokens  # the kernel keeps the argmax contract
    # The bundled, trained head (models/heads/, bf16 on disk): its accepted runs exercise the multi-token
    # commits an untrained head rarely reaches (the CLI test decodes an untrained one).
    path = Path(BUNDLED_DIR) / DEFAULT_HEAD  # what is committed (a trained head of that name would shadow it)
    assert DEFAULT_HEAD in bundled_heads()
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 20e6  # the repository's limit
    ecfg, hp = restore_head(path, cfg)
    assert ecfg.head_tokens == 8192 and hp["fc"]["kernel"].dtype == jnp.float32  # restored in the target's dtype
    drafter = EagleDrafter(ecfg, max_draft=4)
    dparams = drafter.draft_params(params, hp)
    if is_packed(params):  # the head's weights packed in bf16 (the default), half the bytes per draft step
        assert isinstance(dparams[1]["rows"], PackedMatrix) and isinstance(dparams[1]["layers"], tuple)
        assert dparams[1]["rows"].dtype == jnp.bfloat16 and dparams[1]["fc"]["kernel"].dtype == jnp.bfloat16
    # K=2, the K this head is benchmarked with on AVX2 (README, "Choosing K"): its 3-token verification runs
    # the CPU kernel's 3-row tile; 5-token verifications on this layout run in the CLI main job's test
    # (n-gram, K=4). gamma below max_draft (4), as the CLI runs it (max_draft 8).
    spec = decode(kmodel, params, prompts, drafter=drafter, draft_params=dparams, gamma=2, **kw)
    assert spec.tokens == plain.tokens
    assert min(plain.lengths) >= 20
    assert spec.stats["proposed"] > 0 and spec.stats["accepted_at"][1] > 0  # runs of two drafts accepted
    # Trees of this head on the real model: test_real_model_decode's CLI test decodes an EAGLE-2 dynamic tree
    # (the static tree's verification and path following) against plain; tiny ragged batches above.


# ---- checkpoints ----


def head_logits(ecfg, hp, seed):
    """The head's subset logits on random features for two 5-token rows: what a restored head must reproduce."""
    feats = jax.random.normal(jax.random.key(seed), (2, 5, TINY.hidden))
    toks = jnp.asarray([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    f, _ = head_features(ecfg, hp, TINY_PARAMS, feats, toks, pos, init_head_cache(ecfg, 2, 8))
    return np.asarray(subset_logits(f, EagleDrafter(ecfg).draft_params(TINY_PARAMS, hp)[1]["rows"]))


def test_checkpoint_round_trip(tmp_path):
    drafter, dparams, hp = tiny_drafter(head_tokens=20, seed=4)
    ecfg = drafter.ecfg
    save_head(tmp_path / "head", ecfg, dparams[1], {"steps": 3})  # runtime rows are dropped on save
    ecfg2, hp2 = restore_head(tmp_path / "head", TINY)
    assert ecfg2.head_tokens == ecfg.head_tokens and ecfg2.target == TINY
    assert jax.tree.structure(hp2) == jax.tree.structure(hp)
    for a, b in zip(jax.tree.leaves(hp2), jax.tree.leaves(hp)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(head_logits(ecfg2, hp2, seed=9), head_logits(ecfg, hp, seed=9))
    with pytest.raises(ValueError, match="trained for"):
        restore_head(tmp_path / "head", TINY.replace(hidden=32))
    # Another model of the same widths (deeper, another norm epsilon) loaded silently and drafted nothing useful.
    for other in (dict(num_layers=TINY.num_layers + 2), dict(rms_eps=1e-6), dict(ffn=TINY.ffn * 2)):
        (field,) = other
        with pytest.raises(ValueError, match=f"trained for {field}="):
            restore_head(tmp_path / "head", TINY.replace(**other))


def test_restore_head_refuses_a_target_with_other_attention_biases(tmp_path):
    """A head trained on a Llama target (no q/k/v biases) restored for a Qwen2-style target of the same widths
    (qkv_bias=True) was not compared on that field: its layer tree then wanted bias leaves the file lacks, and
    orbax failed on the tree instead of naming the difference."""
    drafter, dparams, _ = tiny_drafter(head_tokens=20, seed=4)
    assert not TINY.qkv_bias
    save_head(tmp_path / "head", drafter.ecfg, dparams[1])
    with pytest.raises(ValueError, match="trained for qkv_bias=False, target has True"):
        restore_head(tmp_path / "head", TINY.replace(qkv_bias=True))


def test_export_head_stores_bf16_and_restores_the_rounded_head(tmp_path, monkeypatch):
    """``export_head`` (how models/heads/ is written): float leaves stored in bf16 (half the bytes on disk),
    restored as f32 equal to the bf16 rounding of the original, the token map exact, the logits those of the
    rounded head; bundled heads resolve by name, a trained head of the same name shadows them, and a missing
    name lists what is bundled."""
    import orbax.checkpoint as ocp

    from models import eagle as E
    from models import eagle_checkpoint

    drafter, dparams, hp = tiny_drafter(head_tokens=20, seed=6)
    ecfg = drafter.ecfg
    save_head(tmp_path / "f32", ecfg, hp, {"name": "tiny-eagle", "steps": 3})
    bundle = tmp_path / "bundle"
    monkeypatch.setattr(eagle_checkpoint, "BUNDLED_DIR", str(bundle))  # where resolve_head reads it
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    E.export_head(tmp_path / "f32", bundle / "tiny-b")
    stored = ocp.StandardCheckpointer().metadata(str(bundle / "tiny-b" / "params"))
    stored = getattr(getattr(stored, "item_metadata", stored), "tree", stored)
    assert stored["fc"]["kernel"].dtype == jnp.bfloat16 and stored["token_ids"].dtype == jnp.int32

    def size(d):
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    assert size(bundle / "tiny-b") < 0.75 * size(tmp_path / "f32")
    assert E.bundled_heads() == ["tiny-b"]
    assert E.resolve_head("tiny-b") == str(bundle / "tiny-b")
    meta = E.read_meta("tiny-b")
    assert meta["stored_dtype"] == "bfloat16" and meta["steps"] == 3 and meta["exported_from"] == "tiny-eagle"

    ecfg2, hp2 = restore_head(E.resolve_head("tiny-b"), TINY)
    assert ecfg2.head_tokens == ecfg.head_tokens
    rounded = {
        k: v if k == "token_ids" else jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), v)
        for k, v in hp.items()
    }
    assert jax.tree.structure(hp2) == jax.tree.structure(rounded)
    for a, b in zip(jax.tree.leaves(hp2), jax.tree.leaves(rounded)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = np.asarray(hp["fc"]["kernel"]) != np.asarray(rounded["fc"]["kernel"])
    assert changed.mean() > 0.9  # random f32 values: the rounding really happened (and was really stored)

    np.testing.assert_array_equal(head_logits(ecfg2, hp2, seed=2), head_logits(ecfg, rounded, seed=2))

    save_head(tmp_path / "cache" / "eagle" / "tiny-b" / "head", ecfg, hp)  # trained under the same name
    assert E.resolve_head("tiny-b") == str(tmp_path / "cache" / "eagle" / "tiny-b" / "head")
    with pytest.raises(FileNotFoundError, match=r"nor a bundled head \(tiny-b\)"):
        E.resolve_head("no-such-head")
    with pytest.raises(ValueError, match="float type"):
        E.export_head(tmp_path / "f32", tmp_path / "int", dtype="int8")


def test_trainer_batch_ranges(tmp_path):
    """--gen-batches takes N or ranges: '0-2,5,7-8' is batches 0 1 2 5 7 8 (batch i answers prompts
    [32 i, 32 i + 32)); a malformed or reversed range is refused with the flag named, as is a range that runs past
    the training prompts, before any model call."""
    import os
    from types import SimpleNamespace

    from models.training import eagle_data

    assert eagle_data.batch_ids(3) == [0, 1, 2] and eagle_data.batch_ids("3") == [0, 1, 2]
    assert eagle_data.batch_ids("0-2,5, 7-8,1") == [0, 1, 2, 5, 7, 8]
    assert eagle_data.batch_ids("none") == []  # only self-written prompts (--self-batches)
    none = SimpleNamespace(seed=0, gen_batch=32, max_prompt=192, max_new=128, gen_batches="none")
    assert eagle_data.generate_data(none, SimpleNamespace(tokenizer=None, config=None), str(tmp_path / "d")) == []
    for bad in ("0", "5-3", "a-b", "1,,2", "-3"):
        with pytest.raises(SystemExit, match="--gen-batches"):
            eagle_data.batch_ids(bad)
    n = len(eagle_data.training_prompts(0))
    last = n // 32  # batch `last` would need prompts up to 32 * last + 32 > n
    args = SimpleNamespace(seed=0, gen_batch=32, max_prompt=192, max_new=128, gen_batches=f"0-1,{last}")
    with pytest.raises(SystemExit, match=f"--gen-batches 0-1,{last} x --gen-batch 32 .* {n} training prompts"):
        eagle_data.generate_data(args, SimpleNamespace(tokenizer=None, config=None), str(tmp_path))
    assert not os.listdir(tmp_path)


def test_trainer_self_prompts(monkeypatch):
    """--self-batches: the target writes its own requests from the user-turn prefix at T = 1 (Magpie). Kept are
    the finished ones (EOS within the limit) of four words or more, not repeated, and not too close to a
    held-out prompt (word-set Jaccard >= 0.5); too few usable after eight tries is an error naming the count."""
    from types import SimpleNamespace

    from example_scripts import load_example

    from models.training import eagle_data
    from models.training import prompts as P

    bench_eagle = load_example("bench_eagle")
    held = ["Why do leaves change colour in autumn?"]
    texts = {
        1: "Why do the leaves change colour in autumn?",  # 7 shared words of 8: dropped
        2: "Plan a picnic for six friends please.",
        3: "Hi there",  # two words: dropped
        4: "plan a picnic for SIX friends, please",  # the same words as 2: dropped
        5: "How do I fix a squeaky door hinge?",
        6: "An unfinished request that ran past the limit",
    }

    class Tok:
        eos_id = 0
        eos_ids = (0,)

        def decode(self, ids):
            return " ".join(texts[i] for i in ids)

        def apply_chat_template(self, messages, add_generation_prompt):
            return "<sys>hello</sys><user>" + messages[0]["content"] + "</user>"

        def encode(self, text, add_bos=False, add_eos=False):
            return [ord(c) for c in text]

    calls = []

    def fake_decode(model, params, prompts, **kw):
        calls.append((prompts, kw))
        return SimpleNamespace(tokens=[[1, 0], [2, 0], [3, 0], [4, 0], [5, 0], [6]])  # row 6 never ended

    monkeypatch.setattr(eagle_data.dec, "decode", fake_decode)
    target = SimpleNamespace(tokenizer=Tok(), model=None, params=None)
    assert eagle_data.self_prompts(target, 2, 7, held) == [texts[2], texts[5]]
    prefix = [ord(c) for c in "<sys>hello</sys><user>"]
    assert calls[0][0] == [prefix] * 4 and calls[0][1]["temperature"] == 1.0 and calls[0][1]["seed"] == 700
    with pytest.raises(SystemExit, match="only 2 of 3 usable after 8 tries"):
        eagle_data.self_prompts(target, 3, 7, held)
    assert [c[1]["seed"] for c in calls[1:]] == list(range(700, 708))

    assert not P.too_close("alpha beta", ["alpha gamma"])  # 1 shared word of 3
    assert P.too_close("alpha beta gamma delta", ["Alpha, beta; gamma epsilon zeta"])  # 3 of 6: 0.5
    held_out = P.held_out_prompts()
    assert set(P.EAGLE_EVAL_PROMPTS) <= set(held_out) and set(bench_eagle.PROMPTS) <= set(held_out)


def test_user_turn_prefix_matches_transformers(smollm2, hf_smollm2_tokenizer):
    """The self-written prompts start from the chat template cut where a user's message begins: transformers'
    own chat template of a conversation starts with exactly these tokens, then the message."""

    from models.training import eagle_data

    prefix = eagle_data.user_turn_prefix(smollm2.tokenizer)
    msg = [{"role": "user", "content": "How do I fix a squeaky door hinge?"}]
    text = hf_smollm2_tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=False)
    theirs = hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert theirs[: len(prefix)] == prefix
    assert hf_smollm2_tokenizer.decode(theirs[len(prefix) :]).startswith(msg[0]["content"])
    assert hf_smollm2_tokenizer.decode(prefix).endswith("<|im_start|>user\n")


def test_trainer_refuses_more_batches_than_prompts(tmp_path):
    """train_eagle.py's default budget fits the training prompts and its batches are the prompts before the
    EXTRA_TOPICS ones (a larger budget keeps the default's cached batches); asking for more batches than the
    prompts fill is an error that names both flags, raised before any model call (it used to fail somewhere
    inside generation)."""
    import os
    from types import SimpleNamespace

    from models.training import eagle as train_eagle
    from models.training import eagle_data
    from models.training import prompts as P

    n = len(eagle_data.training_prompts(0))
    args = SimpleNamespace(seed=0, gen_batch=32, max_prompt=192, max_new=128)
    defaults = train_eagle.parse_args([])
    n_default = len(eagle_data.batch_ids(defaults.gen_batches))
    assert n_default * defaults.gen_batch <= n
    prompts = eagle_data.training_prompts(0)
    n_extra = len(P.EXTRA_TOPICS) * len(P.TEMPLATES)
    n_styled = (len(P.TOPICS) + len(P.EXTRA_TOPICS)) * len(P.STYLES)
    templated = prompts[: n - n_styled]  # the STYLES requests come last, after every templated one
    styled = {s.format(t=t) for t in P.TOPICS + P.EXTRA_TOPICS for s in P.STYLES}
    assert set(prompts[n - n_styled :]) == styled and not styled & set(templated)
    extra = [p for p in templated if any(t in p for t in P.EXTRA_TOPICS)]
    assert extra == templated[-n_extra:] and n_default * defaults.gen_batch <= len(templated) - n_extra
    target = SimpleNamespace(tokenizer=None, config=None)
    with pytest.raises(SystemExit, match=f"--gen-batches {n // 32 + 1} x --gen-batch 32 .* {n} training prompts"):
        eagle_data.generate_data(SimpleNamespace(gen_batches=n // 32 + 1, **vars(args)), target, str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing generated
    doc_args = SimpleNamespace(doc_tokens=10**7, doc_width=256, feature_batch=8, seed=0)
    with pytest.raises(SystemExit, match=r"--doc-tokens 10000000 needs 1221 files of 32 passages .* than the \d+ "):
        eagle_data.generate_doc_data(doc_args, target, str(tmp_path))
    assert not os.listdir(tmp_path)
    assert len(eagle_data.topic_answers()) > 100  # the reference manual's topics extend the docstrings


def test_full_head_q_lands_on_its_ids_and_restore_checks_the_ids(tmp_path):
    """expand_to_vocab scatters q over the head's ids even when N == V (a permutation taken as arange(V) put
    q on other tokens than those drawn), and restore_head refuses ids expand_to_vocab could not scatter over."""
    from models.eagle import expand_to_vocab, restore_head, save_head

    q = np.asarray([[0.1, 0.2, 0.3, 0.4]], np.float32)
    perm = np.asarray([2, 0, 3, 1])
    out = np.asarray(expand_to_vocab(jnp.asarray(q), jnp.asarray(perm), 4))
    np.testing.assert_array_equal(out[0, perm], q[0])
    ecfg, hp = _rollout_head()
    repeated = np.asarray(hp["token_ids"]).copy()
    repeated[1] = repeated[0]  # one token twice: its q would be overwritten
    save_head(tmp_path / "head", ecfg, dict(hp, token_ids=jnp.asarray(repeated)))
    with pytest.raises(ValueError, match="distinct ascending ids"):
        restore_head(tmp_path / "head")
