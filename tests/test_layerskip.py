"""LayerSkip self-speculation (models/layerskip.py): the verify hook against a full target pass (logits and
every cache entry, the reused early layers included), greedy decoding identical to plain decoding (tiny random
Llama and the real SmolLM2), adaptive K, the sampled sequence distribution against an exact enumeration of
the target's own probabilities, and the exit adapter's orbax round trip."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS
from toy_models import MisreportedQ, chi2_critical, chi_square, exact_causal_distribution, grouped_rows, ref_transform

from jspec.adaptive import AdaptiveK
from jspec.decode import decode
from jspec.drafters import DraftContext, DynamicTreeDrafter
from jspec.sampling import distribution
from jspec.serve import Engine
from jspec.validate import sampling_params
from models import llama
from models.layerskip import (
    LayerSkipDrafter,
    abstract_exit_params,
    exit_logits,
    head_rows,
    init_adapter,
    restore_exit_params,
    run_layer_range,
    save_exit_params,
)

# std 0.1: the layers change the residual stream enough that an early exit is often wrong (acceptance ~0.5 at
# E=3 of 4) but not always; with the default 0.02 the embedding dominates and every exit agrees.
TINY = llama.LlamaConfig(
    vocab_size=48, hidden=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128, name="tiny"
)
TINY_PARAMS = llama.init_random_params(TINY, jax.random.key(0), std=0.1)
TINY_MODEL = llama.make_model(TINY)
PROMPTS = [[1, 5, 9, 3, 7], [2, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def random_exit(cfg, drafter: LayerSkipDrafter, seed: int, scale: float = 0.3):
    """Exit params with an adapter that really changes the exit (its trained-from-zero W_down set at random)."""
    ex = {}
    if drafter.adapter:
        ad = init_adapter(cfg, jax.random.key(seed), 32)
        w = np.random.default_rng(seed).normal(size=ad["w_down"].shape) * scale
        ex["adapter"] = dict(ad, w_down=jnp.asarray(w, jnp.float32))
    if drafter.head_tokens:
        ids = np.random.default_rng(seed + 1).permutation(cfg.vocab_size)[: drafter.head_tokens]
        ex["token_ids"] = jnp.asarray(np.sort(ids), jnp.int32)
    return ex


def prefilled(cfg, params, prompts, slots):
    """Target cache after the prompts (right-padded, per-row lengths) and the row buffers of a DraftContext."""
    b, p = len(prompts), max(len(x) for x in prompts)
    toks = np.zeros((b, p), np.int32)
    for i, x in enumerate(prompts):
        toks[i, : len(x)] = x
    cache = llama.init_cache(cfg, b, slots)
    _, cache = llama.forward(cfg, params, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(p), (b, p)), cache)
    plen = jnp.asarray([len(x) for x in prompts], jnp.int32)
    return cache.with_lengths(plen - 1), toks, plen


@functools.partial(jax.jit, static_argnums=0)
def early_exit_hidden(exit_layer, rows):
    """Independent draft reference, first half: layers [0, E) of ``llama.run_layers`` over whole rows [B, T]
    from an empty cache (no reuse of the target's cache): layer E's hidden states [B, T, Dm]."""
    b, t = rows.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    h, _ = llama.run_layers(
        TINY,
        TINY_PARAMS,
        llama.embed(TINY, TINY_PARAMS, rows),
        pos,
        llama.init_cache(TINY, b, t),
        start=0,
        stop=exit_layer,
    )
    return h


def _np_rms(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def np_exit_logits(cfg, params, ex, h):
    """The exit head written from its definition (models/layerskip.py), NumPy float64, tied head only:
    h [..., Dm] -> logits [..., V]. With an adapter, h <- h + W_down(silu(W_gate n) * (W_up n)), n = RMSNorm(h)
    with the adapter's norm_scale; then the target's final RMSNorm (the model's eps, both norms) and
    hn @ embedding^T read from the target's embedding (not the drafter's gathered ``ex["head"]``); a restricted
    head keeps only the ``token_ids`` columns and is -inf elsewhere."""
    h = np.asarray(h, np.float64)
    ex = ex or {}
    if "adapter" in ex:
        a = {name: np.asarray(w, np.float64) for name, w in ex["adapter"].items()}
        n = _np_rms(h, a["norm_scale"], cfg.rms_eps)
        gate = n @ a["w_gate"]
        h = h + (gate / (1.0 + np.exp(-gate)) * (n @ a["w_up"])) @ a["w_down"]
    hn = _np_rms(h, params["final_norm"]["scale"], cfg.rms_eps)
    logits = hn @ np.asarray(params["embed"]["embedding"], np.float64).T
    if "token_ids" in ex:
        keep = np.zeros(cfg.vocab_size, bool)
        keep[np.asarray(ex["token_ids"])] = True
        logits = np.where(keep, logits, -np.inf)
    return logits


def np_exit_q(ex, h, temperature):
    """q of the NumPy exit head under the NumPy reference sampling transform: [..., V] float64."""
    logits = np_exit_logits(TINY, TINY_PARAMS, ex, h)
    return np.apply_along_axis(lambda row: ref_transform(row, temperature), -1, logits)


def assert_exit_logits_match(cfg, params, ex, h):
    """The library's ``exit_logits`` against ``np_exit_logits`` on the same hidden states: inside the head
    within 1e-4 (float32 against float64 over Dm = 64 terms of size ~1), outside it a logit softmax maps to 0."""
    got = np.asarray(exit_logits(cfg, params, ex, jnp.asarray(h)), np.float64)
    want = np_exit_logits(cfg, params, ex, h)
    inside = np.isfinite(want)
    np.testing.assert_allclose(got[inside], want[inside], atol=1e-4, rtol=0)
    assert np.all(got[~inside] <= -1e29), got[~inside].max(initial=-np.inf)


def test_layer_range_equals_llama_run_layers():
    cache, toks, plen = prefilled(TINY, TINY_PARAMS, PROMPTS, 16)
    h = llama.embed(TINY, TINY_PARAMS, jnp.asarray([[3, 4]] * 3))
    pos = cache.lengths[:, None] + jnp.arange(2)[None]

    @jax.jit
    def both(h, pos, cache):
        out = []
        for start, stop in [(0, 1), (1, 4), (0, 4), (2, 3)]:
            a, ca = run_layer_range(TINY, TINY_PARAMS, h, pos, cache, start, stop)
            b, cb = llama.run_layers(TINY, TINY_PARAMS, h, pos, cache, start=start, stop=stop)
            out.append(((a, ca.k, ca.v), (b, cb.k, cb.v)))
        return out

    for mine, lib in jax.device_get(both(h, pos, cache)):
        for x, y in zip(mine, lib):
            np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)


def test_exit_logits_equal_a_numpy_head():
    """``exit_logits`` against the NumPy exit head (``np_exit_logits``): plain, adapter, restricted head, both.
    rms_eps 0.05 and hidden states of RMS ~0.2 make the eps of both norms visible (a norm with another eps, or
    the adapter's norm skipped, moves the logits by far more than the 1e-4 tolerance)."""
    cfg = TINY.replace(rms_eps=0.05)
    h = np.random.default_rng(2).normal(size=(2, 3, cfg.hidden)) * 0.2
    for adapter, head_tokens in [(False, 0), (True, 0), (False, 20), (True, 20)]:
        drafter = LayerSkipDrafter(cfg, 2, adapter=adapter, head_tokens=head_tokens)
        ex = drafter.draft_params(TINY_PARAMS, random_exit(cfg, drafter, 4))[1]
        assert_exit_logits_match(cfg, TINY_PARAMS, ex, h)
        other_eps, want = np_exit_logits(TINY, TINY_PARAMS, ex, h), np_exit_logits(cfg, TINY_PARAMS, ex, h)
        inside = np.isfinite(want)
        assert np.abs(other_eps[inside] - want[inside]).max() > 1e-2  # the eps matters at this scale


@pytest.mark.parametrize(
    "exit_layer,adapter,head_tokens,temperature",
    [(1, False, 0, 0.0), (3, True, 0, 1.0), (2, True, 20, 0.8)],
)
def test_verify_hook_equals_full_target_pass(exit_layer, adapter, head_tokens, temperature):
    """One round by hand, rows of different lengths: the hook's logits and cache equal one target call over
    the same K+1 tokens, the draft's early-layer entries equal the full pass's, and q is what an independent
    early-exit forward over the whole sequence gives."""
    k, slots = 4, 24
    drafter = LayerSkipDrafter(TINY, exit_layer, adapter=adapter, head_tokens=head_tokens, max_draft=6)
    dparams = drafter.draft_params(TINY_PARAMS, random_exit(TINY, drafter, 7))
    # The last prompt token plays the pending token: committed = len - 1.
    cache, toks, plen = prefilled(TINY, TINY_PARAMS, PROMPTS, slots)
    b = len(PROMPTS)
    seq = jnp.zeros((b, slots + 1), jnp.int32).at[:, : toks.shape[1]].set(toks)
    sampling = sampling_params(b, temperature)
    ctx = DraftContext(seq, plen, jnp.full((b,), k, jnp.int32), sampling, cache)
    state0 = drafter.init(dparams, jnp.asarray(toks), plen, slots)
    prop = jax.jit(drafter.propose, static_argnums=4)(dparams, state0, ctx, jax.random.key(3), k)
    committed = plen - 1
    rows = jnp.arange(b)
    tokens = jnp.concatenate([seq[rows, committed][:, None], prop.tokens], axis=1)  # [B, K+1]
    positions = committed[:, None] + jnp.arange(k + 1)[None]
    assert np.array_equal(prop.target_cache.lengths, committed)

    logits, vcache = jax.jit(drafter.verify, static_argnums=0)(
        TINY_MODEL, TINY_PARAMS, dparams, prop.state, tokens, positions, prop.target_cache
    )
    ref_logits, ref_cache = TINY_MODEL.apply(TINY_PARAMS, tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-4, rtol=0)
    assert np.array_equal(vcache.lengths, committed)
    for r in range(b):
        c = int(committed[r])
        new = slice(c, c + k + 1)
        for name in ("k", "v"):
            got, want = getattr(vcache, name)[:, r], getattr(ref_cache, name)[:, r]
            np.testing.assert_allclose(got[:, :, new], want[:, :, new], atol=1e-5, rtol=0)
            np.testing.assert_array_equal(got[:, :, :c], getattr(cache, name)[:, r, :, :c])  # committed: untouched
            # What the draft wrote for the pending token and the first K-1 drafts (layers < E) is what the
            # full pass computes: the reuse is exact, not an approximation.
            drafted = getattr(prop.target_cache, name)[:exit_layer, r, :, c : c + k]
            np.testing.assert_allclose(drafted, want[:exit_layer, :, c : c + k], atol=1e-5, rtol=0)
            # ... and the draft never touched layers >= E.
            np.testing.assert_array_equal(
                getattr(prop.target_cache, name)[exit_layer:, r], getattr(cache, name)[exit_layer:, r]
            )

    # q: an early-exit forward over each whole row (prompt, pending token, drafts) from an empty cache, no
    # reuse; rows right-padded into one batch (causal attention never sees the padding after a row).
    ex = dparams[1]
    rows_np = np.zeros((b, toks.shape[1] + k + 1), np.int32)
    for r in range(b):
        c = int(committed[r])
        rows_np[r, : c + k + 1] = np.concatenate([toks[r, :c], np.asarray(tokens[r])])
    # The exit head and the sampling transform are NumPy references written from their definitions; only the
    # layers [0, E) come from the library (llama.run_layers, whole rows, no cache reuse).
    all_h = np.asarray(early_exit_hidden(exit_layer, jnp.asarray(rows_np)))
    assert_exit_logits_match(TINY, TINY_PARAMS, ex, all_h)
    for r in range(b):
        c = int(committed[r])
        want_q = np_exit_q(ex, all_h[r, c : c + k], temperature)
        np.testing.assert_allclose(np.asarray(prop.q[r]), want_q, atol=1e-5, rtol=0)
    if head_tokens:  # a restricted head never proposes, and gives no mass to, tokens outside its rows
        outside = np.setdiff1d(np.arange(TINY.vocab_size), np.asarray(ex["token_ids"]))
        assert np.all(np.asarray(prop.q)[:, :, outside] == 0)
        assert not np.isin(np.asarray(prop.tokens), outside).any()


@pytest.mark.fast
def test_greedy_identical_to_plain_decoding():
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=[24, 30, 17])
    for exit_layer, k, adapter, head_tokens in [(3, 4, False, 0), (1, 2, True, 40)]:
        drafter = LayerSkipDrafter(TINY, exit_layer, adapter=adapter, head_tokens=head_tokens, max_draft=5)
        dparams = drafter.draft_params(TINY_PARAMS, random_exit(TINY, drafter, 11, scale=0.05))
        spec = decode(
            TINY_MODEL,
            TINY_PARAMS,
            PROMPTS,
            drafter=drafter,
            draft_params=dparams,
            gamma=k,
            max_new_tokens=[24, 30, 17],
        )
        assert spec.tokens == plain.tokens, (exit_layer, k)
        assert spec.stop_reason == plain.stop_reason
        assert 0 < spec.stats["accepted"] < spec.stats["proposed"], spec.stats  # both branches taken
        if exit_layer == 1:
            # A costly drafter with poor acceptance backs off to K = 0 for whole rounds (the observe path and
            # the decoder's 1-token verify), then probes again: none of it may change the output.
            policy = AdaptiveK(draft_cost=0.3)  # K=2: a proposing round costs 1.75 steps; on while a > ~0.5
            adaptive = decode(
                TINY_MODEL,
                TINY_PARAMS,
                PROMPTS,
                drafter=drafter,
                draft_params=dparams,
                gamma=k,
                max_new_tokens=[24, 30, 17],
                adaptive=policy,
            )
            assert adaptive.tokens == plain.tokens
            assert 0 < adaptive.stats["proposed"] < spec.stats["proposed"]


def test_exit_model_matches_the_exit_and_builds_greedy_trees():
    """``as_model``: the exit as a stand-alone draft model with its own E-layer cache. Its distribution for a
    prefix fed in pieces (sibling nodes under a tree mask included) equals the independent whole-row early
    exit, and a dynamic tree drafted with it decodes exactly as plain greedy decoding (a static one does in the
    real-model CLI test, ``--drafter layerskip --tree 2,1``)."""
    drafter = LayerSkipDrafter(TINY, 2, adapter=True, head_tokens=40, max_draft=4)
    dparams = drafter.draft_params(TINY_PARAMS, random_exit(TINY, drafter, 11, scale=0.05))
    model, mparams = drafter.as_model(dparams)
    assert model is drafter.as_model(dparams)[0]  # one static identity per (config, E): no recompiles
    rows = jnp.asarray([[1, 5, 9, 3, 7, 2], [2, 4, 6, 8, 10, 12]], jnp.int32)
    cache = model.init_cache(2, 8)
    assert cache.k.shape[0] == 2  # E layers, not L
    _, cache = model.apply(mparams, rows[:, :4], jnp.broadcast_to(jnp.arange(4), (2, 4)), cache)
    # Tokens 4 and 5 as two siblings at position 4: each sees the prefix and itself, not the other.
    siblings = jnp.broadcast_to(jnp.eye(2, dtype=bool), (2, 2, 2))
    logits, _ = model.apply(mparams, rows[:, 4:], jnp.full((2, 2), 4), cache.with_lengths(jnp.full((2,), 4)), siblings)
    sampling = sampling_params(2, 1.0)
    got = distribution(logits, sampling)
    # Reference: layers [0, 2) over each sibling's own whole row, then the NumPy exit head and transform.
    h0 = np.asarray(early_exit_hidden(2, rows[:, :5]))[:, -1]
    h1 = np.asarray(early_exit_hidden(2, jnp.concatenate([rows[:, :4], rows[:, 5:]], 1)))[:, -1]
    np.testing.assert_allclose(got[:, 0], np_exit_q(dparams[1], h0, 1.0), atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[:, 1], np_exit_q(dparams[1], h1, 1.0), atol=1e-5, rtol=0)

    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=[24, 30, 17])
    tree = DynamicTreeDrafter(model, top_k=2, depth=3, budget=6)
    out = decode(
        TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=tree, goodput=False, draft_params=mparams, max_new_tokens=[24, 30, 17]
    )
    assert out.tokens == plain.tokens
    assert out.stats["tokens_per_round"] > 1.1, out.stats


def test_continuous_batching_matches_single_requests():
    """LayerSkip in the serving engine (its state: per-row hidden states, inserted by row): requests dropped
    into free rows of a batch-2 engine decode exactly as each does alone."""
    from test_serve import BUDGETS, REQUESTS, _serve

    drafter = LayerSkipDrafter(TINY, 2, adapter=True, max_draft=3)
    dparams = drafter.draft_params(TINY_PARAMS, random_exit(TINY, drafter, 5, scale=0.05))
    kw = dict(drafter=drafter, draft_params=dparams, gamma=3)
    alone = [decode(TINY_MODEL, TINY_PARAMS, [r], max_new_tokens=m, **kw).tokens[0] for r, m in zip(REQUESTS, BUDGETS)]
    assert _serve(Engine(TINY_MODEL, TINY_PARAMS, batch=2, max_len=64, **kw)) == alone


# ---- the sampled distribution at T > 0 (top-k / top-p) equals the target's, exactly enumerated ----

# Vocabulary 5 so whole sequences can be enumerated; std 0.3 gives spread-out, position-dependent distributions
# and an early exit (E=1 of 2, through a random adapter and a head without token 3) that is accepted about half
# the time. Token 3 is never proposed (q = 0) while the target often wants it: the residual must supply it.
DIST = llama.LlamaConfig(
    vocab_size=5, hidden=16, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=4, ffn=32, name="dist"
)
DIST_PARAMS = llama.init_random_params(DIST, jax.random.key(1), std=0.3)
DIST_MODEL = llama.make_model(DIST)
DIST_GROUPS = [dict(temperature=1.3, top_p=0.8)]
DIST_PROMPT = [2, 0]


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(cfg, params, rows):  # [M, T] -> [M, T, V] full-depth logits, one uncached forward
    m, t = rows.shape
    return llama.forward(cfg, params, rows, jnp.broadcast_to(jnp.arange(t), (m, t)), llama.init_cache(cfg, m, t))[0]


def exact_llama_distribution(cfg, params, prompt, n_new, **sampling) -> dict:
    """P(generated sequence) for every sequence of n_new tokens: the target's own full-depth logits (one
    cache-free forward over every continuation), the NumPy reference transform, products."""
    fn = functools.partial(_all_logits, cfg, params)
    return exact_causal_distribution(fn, cfg.vocab_size, prompt, n_new, **sampling)


def test_whole_sequence_distribution_equals_target():
    """100k sampled sequences at T 1.3 with top-p against the exact distribution; chi-square at a 1e-5
    false-alarm level. K=3 and 5 new tokens: the first comes from prefill, then rounds use every draft position.
    One setting: q comes from ``jspec.sampling.distribution`` for every drafter, and the other filters run
    through the same verification in tests/test_decode_core.py and tests/test_eagle.py. The exit as a tree
    draft (``as_model``) is the exit's own computation (test_exit_model_matches_the_exit_and_builds_greedy_trees);
    sampled trees without replacement are checked on toy drafters in tests/test_tree.py."""
    k, n, n_new = 3, 100_000, 5
    groups = DIST_GROUPS
    drafter = LayerSkipDrafter(DIST, 1, adapter=True, head_tokens=4, max_draft=k)
    adapter = random_exit(DIST, drafter, 2, scale=0.1)["adapter"]
    ex = {"adapter": adapter, "token_ids": jnp.asarray([0, 1, 2, 4], jnp.int32)}
    prompts, cols = grouped_rows(DIST_PROMPT, groups, n)
    out = decode(
        DIST_MODEL,
        DIST_PARAMS,
        prompts,
        drafter=drafter,
        draft_params=drafter.draft_params(DIST_PARAMS, ex),
        gamma=k,
        max_new_tokens=n_new,
        seed=5,
        max_len=16,
        **cols,
    )
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (n * len(groups), n_new)
    assert 0.3 < out.stats["acceptance_rate"] < 0.95, out.stats  # both branches of the acceptance rule
    assert all(c > 0 for c in out.stats["proposed_at"])
    assert np.mean(tokens == 3) > 0.02  # the token the draft head cannot propose is still produced
    for i, g in enumerate(groups):
        exact = exact_llama_distribution(DIST, DIST_PARAMS, DIST_PROMPT, n_new, **g)
        stat, df = chi_square(tokens[i * n : (i + 1) * n], exact)
        assert stat < chi2_critical(df), (g, stat, df)
        # Power: had the decoder emitted the draft's own distribution (an early exit of the target), the
        # statistic's expectation would be n * chi2-divergence, far above the critical value.
        if i == 0:
            draft = exact_exit_distribution(drafter, ex, n_new, **g)
            div = sum((draft.get(s, 0.0) - p) ** 2 / p for s, p in exact.items())
            assert n * div > 10 * chi2_critical(df), n * div


def test_distribution_check_has_power_against_a_misreported_q():
    """Empirically too: the exit's chain reporting a q 10% off what it samples (``toy_models.MisreportedQ``) is
    rejected by the same statistic at a quarter of the samples, at the first group's setting."""
    k, n, n_new, g = 3, 25_000, 5, DIST_GROUPS[0]
    inner = LayerSkipDrafter(DIST, 1, adapter=True, head_tokens=4, max_draft=k)
    ex = {"adapter": random_exit(DIST, inner, 2, scale=0.1)["adapter"], "token_ids": jnp.asarray([0, 1, 2, 4])}
    prompts, cols = grouped_rows(DIST_PROMPT, [g], n)
    bad = MisreportedQ(inner, 0.9)
    kw = dict(gamma=k, max_new_tokens=n_new, seed=5, max_len=16, **cols)
    out = decode(DIST_MODEL, DIST_PARAMS, prompts, drafter=bad, draft_params=inner.draft_params(DIST_PARAMS, ex), **kw)
    stat, df = chi_square(np.asarray(out.tokens), exact_llama_distribution(DIST, DIST_PARAMS, DIST_PROMPT, n_new, **g))
    assert stat > chi2_critical(df), (stat, df)


def test_exit_params_the_drafter_would_not_read_are_refused():
    """A misspelt key, or token_ids for a drafter with the full head, were ignored silently."""
    full = LayerSkipDrafter(TINY, 1, adapter=False, head_tokens=0)
    with pytest.raises(ValueError, match="exit params hold 'adaptor': only 'adapter' and 'token_ids' are read"):
        full.draft_params(TINY_PARAMS, {"adaptor": {}})
    with pytest.raises(ValueError, match="give token_ids but the drafter has head_tokens=0"):
        full.draft_params(TINY_PARAMS, {"token_ids": jnp.arange(4)})
    assert full.draft_params(TINY_PARAMS, None)[1] is None


def exact_exit_distribution(drafter, ex, n_new, **sampling) -> dict:
    """Like ``exact_llama_distribution`` for the early exit itself (what a broken verifier would emit); the
    tokens outside the exit's head (logit -inf) get -1e9 so the reference transform gives them 0."""
    dp = drafter.draft_params(DIST_PARAMS, ex)

    @jax.jit
    def exit_all(rows):
        n, t = rows.shape
        pos = jnp.broadcast_to(jnp.arange(t), (n, t))
        h, _ = run_layer_range(
            DIST, DIST_PARAMS, llama.embed(DIST, DIST_PARAMS, rows), pos, llama.init_cache(DIST, n, t), 0, 1
        )
        return jnp.maximum(exit_logits(DIST, DIST_PARAMS, dp[1], h), -1e9)

    return exact_causal_distribution(exit_all, DIST.vocab_size, DIST_PROMPT, n_new, **sampling)


# ---- the real model ----


@pytest.mark.slow
def test_smollm2_greedy_identical_to_plain(smollm2):
    cfg, params, model, tok = smollm2
    chats = [
        "What are three good habits for staying focused while studying?",
        "Write a short poem about the sea at night.",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in chats]
    kw = dict(max_new_tokens=40, eos_ids=[cfg.eos_id], max_len=128)
    plain = decode(model, params, prompts, **kw)
    drafter = LayerSkipDrafter(cfg, 8, head_tokens=8192, max_draft=4)
    ids = jnp.arange(8192, dtype=jnp.int32)  # BPE ids follow merge order, roughly frequency: a fine subset
    spec = decode(
        model,
        params,
        prompts,
        drafter=drafter,
        draft_params=drafter.draft_params(params, {"token_ids": ids}),
        gamma=4,
        **kw,
    )
    assert spec.tokens == plain.tokens
    assert min(plain.lengths) >= 20
    assert 0 < spec.stats["accepted"] < spec.stats["proposed"]


# ---- exit adapter checkpoints ----


def test_exit_params_checkpoint_round_trip(tmp_path):
    drafter = LayerSkipDrafter(TINY, 2, adapter=True, head_tokens=20)
    ex = random_exit(TINY, drafter, 4)
    save_exit_params(tmp_path / "exit", ex, {"exit_layer": 2, "model": TINY.name})
    h = jax.random.normal(jax.random.key(9), (2, 3, TINY.hidden))
    want = np.asarray(exit_logits(TINY, TINY_PARAMS, drafter.draft_params(TINY_PARAMS, ex)[1], h))
    abstract = abstract_exit_params(TINY, 32, 20)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), ex)
    for restored in (
        restore_exit_params(tmp_path / "exit", TINY),  # targets rebuilt from meta.json
        restore_exit_params(tmp_path / "exit", target=abstract),  # explicit ShapeDtypeStruct targets
    ):
        assert jax.tree.structure(restored) == jax.tree.structure(ex)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(ex)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        got = np.asarray(exit_logits(TINY, TINY_PARAMS, drafter.draft_params(TINY_PARAMS, restored)[1], h))
        np.testing.assert_array_equal(got, want)
    # A target of the wrong shape is refused rather than silently reshaped.
    with pytest.raises(ValueError, match="not compatible"):
        restore_exit_params(tmp_path / "exit", target=abstract_exit_params(TINY, 16, 20))


def test_exit_params_refuse_another_target_by_name(tmp_path):
    """meta.json named the model but nothing compared it: an adapter of another width surfaced as an orbax
    shape error, one trained for another model of the same width loaded silently. The target's config is now
    recorded (``save_exit_params(target_cfg=)``) and compared on restore, through the registry's loader too."""
    import json

    from models.registry import LoadedModel, load_layerskip_drafter

    drafter = LayerSkipDrafter(TINY, 2, adapter=True, head_tokens=20)
    ex = random_exit(TINY, drafter, 4)
    save_exit_params(tmp_path / "exit", ex, {"exit_layer": 2, "model": TINY.name}, target_cfg=TINY)
    with open(tmp_path / "exit" / "meta.json") as f:
        rec = json.load(f)["target"]
    assert rec["hidden"] == 64 and rec["num_layers"] == 4 and rec["qkv_bias"] is False and rec["name"] == "tiny"
    restored = restore_exit_params(tmp_path / "exit", TINY.replace(name="tiny from another file"))  # same model
    np.testing.assert_array_equal(np.asarray(restored["token_ids"]), np.asarray(ex["token_ids"]))
    others = {
        "num_layers": (TINY.replace(num_layers=6), "trained for num_layers=4, target has 6"),
        "rms_eps": (TINY.replace(rms_eps=1e-6), "trained for rms_eps=1e-05, target has 1e-06"),
        "qkv_bias": (TINY.replace(qkv_bias=True), "trained for qkv_bias=False, target has True"),
        "hidden": (TINY.replace(hidden=32), "trained for hidden=64, target has 32"),
    }
    for cfg, msg in others.values():
        with pytest.raises(ValueError, match=msg):
            restore_exit_params(tmp_path / "exit", cfg)
    other = others["num_layers"][0]
    target = LoadedModel(other, llama.init_random_params(other, jax.random.key(1)), llama.make_model(other), None)
    with pytest.raises(ValueError, match="exit adapter .* trained for num_layers=4, target has 6"):
        load_layerskip_drafter(str(tmp_path / "exit"), target, 3)
    # A file written before the record existed: only what its shapes tell is compared, and named.
    save_exit_params(tmp_path / "old", ex, {"exit_layer": 2, "model": TINY.name})
    with open(tmp_path / "old" / "meta.json") as f:
        assert "target" not in json.load(f)
    restore_exit_params(tmp_path / "old", TINY.replace(num_layers=6))  # nothing recorded to refuse it by
    with pytest.raises(ValueError, match="exit adapter .* trained for hidden=64, target has 32"):
        restore_exit_params(tmp_path / "old", TINY.replace(hidden=32))


_SAVE_ON_LAST_DEVICE = """
import sys, jax, numpy as np
from models.layerskip import save_exit_params
arrays = dict(np.load(sys.argv[2]))
dev = jax.devices()[-1]  # a device the restoring process does not have
tree = {"adapter": {k[2:]: jax.device_put(v, dev) for k, v in arrays.items() if k.startswith("a.")},
        "token_ids": jax.device_put(arrays["token_ids"], dev)}
save_exit_params(sys.argv[1], tree, {"exit_layer": 2})
print("saved on", dev)
"""


def test_exit_params_saved_on_another_device_restore_here(tmp_path):
    """A checkpoint written on a device this process lacks (cpu:3 of 4 fake CPU devices, as a file trained
    on one host's CPU is for a GPU host) restores onto the default device, whichever target is given. orbax
    alone would look for the saving device ("Device cpu:3 was not found")."""
    import os
    import subprocess
    import sys

    ex = random_exit(TINY, LayerSkipDrafter(TINY, 2, adapter=True, head_tokens=20), 4)
    flat = {f"a.{k}": np.asarray(v) for k, v in ex["adapter"].items()} | {"token_ids": np.asarray(ex["token_ids"])}
    np.savez(tmp_path / "ex.npz", **flat)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_ON_LAST_DEVICE, str(tmp_path / "exit"), str(tmp_path / "ex.npz")],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "saved on cpu:3" in proc.stdout, proc.stdout + proc.stderr
    assert len(jax.devices()) < 4  # else the saving device would exist here and the test would prove nothing
    for restored in (
        restore_exit_params(tmp_path / "exit", TINY),
        restore_exit_params(tmp_path / "exit", target=abstract_exit_params(TINY, 32, 20)),
        restore_exit_params(tmp_path / "exit"),  # targets from the checkpoint's own metadata
    ):
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(ex)):
            assert a.devices() == {jax.devices()[0]}
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_head_rows_of_an_untied_head_in_every_layout():
    """An untied LM head packed for the CPU kernel (a PackedMatrix) was read with jnp.take, which fails on it:
    EAGLE and LayerSkip heads of an untied target (Qwen2) could not be built in the CPU decode layout."""
    from models import cpu_kernels

    cfg = TINY.replace(tie_embeddings=False, name="tiny-untied")
    params = llama.init_random_params(cfg, jax.random.key(4), std=0.1)
    ids = jnp.asarray([3, 0, 17, 41], jnp.int32)
    want = np.asarray(params["lm_head"]["kernel"])[:, [3, 0, 17, 41]].T  # [N, E] from the [E, V] kernel
    layouts = [params, llama.unstack_layers(params, packed=False)]
    if cpu_kernels.available():
        layouts.append(llama.unstack_layers(params, packed=True))
        assert isinstance(layouts[-1]["lm_head"]["kernel"], cpu_kernels.PackedMatrix)
    for p in layouts:
        np.testing.assert_allclose(np.asarray(head_rows(cfg, p, ids)), want, rtol=0, atol=0)


def test_exit_token_ids_must_be_distinct_vocabulary_ids():
    """Only the shape of the head's token_ids was checked: an id past the vocabulary read another row (and was
    dropped on write), a negative one wrapped to V - 1, a repeat split q's mass between two rows."""
    drafter = LayerSkipDrafter(TINY, 2, adapter=False, head_tokens=4, max_draft=3)
    for bad in ([0, 1, 2, TINY.vocab_size], [0, 1, 2, -1], [0, 1, 2, 2]):
        with pytest.raises(ValueError, match=r"token_ids must be 4 distinct ids in \[0, "):
            drafter.draft_params(TINY_PARAMS, {"token_ids": np.asarray(bad, np.int32)})
    drafter.draft_params(TINY_PARAMS, {"token_ids": np.asarray([0, 1, 2, 3], np.int32)})
