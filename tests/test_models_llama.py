"""The Flax Llama forward on a tiny random model: cache semantics, ragged rows, tree masks, layer slicing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.cache import KV_AXES
from models import cpu_kernels, llama
from models.llama import LlamaConfig, init_random_params, make_model, param_logical_axes

# GQA (4 query heads on 2 KV heads), biases and an untied head, so every code path runs.
CFG = LlamaConfig(
    vocab_size=97,
    hidden=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn=48,
    rope_theta=500.0,
    qkv_bias=True,
    tie_embeddings=False,
)
SLOTS = 24
# A larger init than the 0.02 default: attention is far from uniform, so a wrongly visible slot moves logits.
STD = 0.3


@pytest.fixture(scope="module", params=["stacked", "unstacked"])
def params(request):
    """Every cache/mask test runs on both layer layouts: one ``lax.scan`` over stacked weights, and the
    Python loop over per-layer arrays with its own in-place cache write (with the CPU kernel's packed
    matrices where it is available, as ``unstack_layers`` picks by default)."""
    p = init_random_params(CFG, jax.random.key(0), std=STD)
    return p if request.param == "stacked" else llama.unstack_layers(p)


@pytest.mark.parametrize("packed", [False, True], ids=["xla", "packed"])
@pytest.mark.parametrize("cfg", [CFG, CFG.replace(qkv_bias=False, tie_embeddings=True)], ids=["untied-bias", "tied"])
def test_unstack_and_stack_are_inverse(cfg, packed):
    if packed and not cpu_kernels.available():
        pytest.skip("the CPU matmul kernel is not available here (no C++ compiler?)")
    p = init_random_params(cfg, jax.random.key(0), std=STD)
    u = llama.unstack_layers(p, packed=packed)
    assert isinstance(u["layers"], tuple) and len(u["layers"]) == cfg.num_layers
    # Packed matrices are panels; unpacked, they are the matrices below. The toy widths (qkv 64, 2F 96,
    # vocab 97) include one that is not a multiple of the 32-column panel.
    assert isinstance(u["layers"][0]["mlp"]["w_down"], cpu_kernels.PackedMatrix) == packed
    unpack = lambda w: np.asarray(w.unpack() if packed else w)  # noqa: E731
    # The fused matrices hold the separate ones side by side: [E, H + 2 Hkv, D] and [E, 2F].
    a2, a = u["layers"][2]["attn"], p["layers"]["attn"]
    want_qkv = np.concatenate([np.asarray(a[n][2]) for n in ("wq", "wk", "wv")], axis=1)
    np.testing.assert_array_equal(unpack(a2["wqkv"]), want_qkv)
    np.testing.assert_array_equal(unpack(a2["wo"]), np.asarray(a["wo"][2]))
    f = cfg.ffn
    np.testing.assert_array_equal(
        unpack(u["layers"][2]["mlp"]["w_gate_up"])[:, f:], np.asarray(p["layers"]["mlp"]["w_up"][2])
    )
    emb = np.asarray(p["embed"]["embedding"])
    if cfg.tie_embeddings:  # stored [E, V] for the LM head; the readers give back [V, E]
        np.testing.assert_array_equal(unpack(u["embed"]["embedding_t"]), emb.T)
    else:
        np.testing.assert_array_equal(unpack(u["lm_head"]["kernel"]), np.asarray(p["lm_head"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(llama.embedding_rows(u)), emb)
    np.testing.assert_array_equal(np.asarray(llama.embedding_rows(u, jnp.asarray([5, 1]))), emb[[5, 1]])
    back = llama.stack_layers(u)
    assert jax.tree.structure(back) == jax.tree.structure(p)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(p), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert llama.unstack_layers(u) is u and llama.stack_layers(p) is p
    # Both layouts compute the same thing: a ragged batch of 3-token calls under a tree mask.
    m = make_model(cfg)
    cache = m.init_cache(2, SLOTS).with_lengths(jnp.array([2, 6], jnp.int32))
    toks = jnp.asarray(np.stack([_tokens(50, 3), _tokens(51, 3)]))
    pos = jnp.asarray([[2, 3, 3], [6, 7, 7]], jnp.int32)
    tree = jnp.asarray(np.broadcast_to(np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (2, 3, 3)))
    apply = jax.jit(m.apply)
    (ls, cs), (lu, cu) = apply(p, toks, pos, cache, tree), apply(u, toks, pos, cache, tree)
    # f32 rounding only (the fused matmuls, and the packed layout's norms inside the matmul kernel, sum in
    # another order: 1.1e-5 seen at a logit of -2.16); a wrong slot or head would be off by O(1).
    np.testing.assert_allclose(np.asarray(lu), np.asarray(ls), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cu.k), np.asarray(cs.k), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cu.v), np.asarray(cs.v), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="2 unstacked layers"):
        m.apply({**u, "layers": u["layers"][:2]}, jnp.zeros((1, 1), jnp.int32), _pos(0, 1), m.init_cache(1, SLOTS))


@pytest.fixture(scope="module")
def model():
    return make_model(CFG)


@pytest.fixture(scope="module")
def apply(model):
    return jax.jit(model.apply)


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=n).astype(np.int32)


def _pos(start, n, batch=1):
    return jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (batch, n))


def test_make_model_is_built_once_per_config(model):
    assert make_model(CFG) is model
    assert make_model(CFG.replace()) is model  # equal configs share the Model (static jit argument)
    assert model.vocab_size == CFG.vocab_size


def test_apply_writes_at_lengths_and_leaves_lengths(params, model, apply):
    cache = model.init_cache(2, SLOTS).with_lengths(jnp.array([3, 5], jnp.int32))
    toks = jnp.asarray(np.stack([_tokens(1, 4), _tokens(2, 4)]))
    pos = jnp.asarray([[3, 4, 5, 6], [5, 6, 7, 8]], jnp.int32)
    logits, new = apply(params, toks, pos, cache)
    assert logits.shape == (2, 4, CFG.vocab_size) and logits.dtype == jnp.float32
    assert new.k.shape == (CFG.num_layers, 2, CFG.num_kv_heads, SLOTS, CFG.head_dim)
    np.testing.assert_array_equal(new.lengths, [3, 5])
    written = np.asarray(jnp.abs(new.k).sum(axis=(0, 2, 4)) > 0)  # [B, S]
    expect = np.zeros((2, SLOTS), bool)
    expect[0, 3:7] = True
    expect[1, 5:9] = True
    np.testing.assert_array_equal(written, expect)


def test_writes_past_the_end_are_dropped_not_clamped(params, model, apply):
    # 4 new tokens at length S-2: two fit, two must vanish; a clamping write would overwrite slots S-4, S-3.
    cache = model.init_cache(1, SLOTS)
    marker = jnp.full_like(cache.k, 7.0)
    cache = cache.__class__(marker, marker, jnp.array([SLOTS - 2], jnp.int32))
    _, new = apply(params, jnp.asarray(_tokens(3, 4))[None], _pos(SLOTS - 2, 4), cache)
    np.testing.assert_array_equal(np.asarray(new.k[:, :, :, : SLOTS - 2]), 7.0)
    assert not np.any(np.asarray(new.k[:, :, :, SLOTS - 2 :]) == 7.0)


def test_prefill_equals_token_by_token(params, model, apply):
    toks = _tokens(4, 9)
    full, _ = apply(params, jnp.asarray(toks)[None], _pos(0, 9), model.init_cache(1, SLOTS))
    cache = model.init_cache(1, SLOTS)
    steps = []
    for t in range(9):
        lg, cache = apply(params, jnp.asarray(toks[t : t + 1])[None], _pos(t, 1), cache)
        cache = cache.commit(jnp.ones((1,), jnp.int32))
        steps.append(np.asarray(lg[0, 0]))
    np.testing.assert_allclose(np.stack(steps), np.asarray(full[0]), atol=1e-4, rtol=0)
    # Chunked: 4 tokens, then 5 on top of the committed 4.
    cache = model.init_cache(1, SLOTS)
    a, cache = apply(params, jnp.asarray(toks[:4])[None], _pos(0, 4), cache)
    cache = cache.commit(jnp.full((1,), 4, jnp.int32))
    b, _ = apply(params, jnp.asarray(toks[4:])[None], _pos(4, 5), cache)
    np.testing.assert_allclose(np.concatenate([a[0], b[0]]), np.asarray(full[0]), atol=1e-4, rtol=0)


def test_uncommitted_scratch_is_invisible(params, model, apply):
    # A rejected draft leaves entries beyond `lengths`; the next call must not see them.
    toks = _tokens(5, 6)
    cache = model.init_cache(1, SLOTS)
    _, cache = apply(params, jnp.asarray(toks[:4])[None], _pos(0, 4), cache)
    cache = cache.commit(jnp.full((1,), 2, jnp.int32))  # keep 2 of the 4 written
    lg, _ = apply(params, jnp.asarray(toks[4:])[None], _pos(2, 2), cache)
    ref, _ = apply(params, jnp.asarray(np.r_[toks[:2], toks[4:]])[None], _pos(0, 4), model.init_cache(1, SLOTS))
    np.testing.assert_allclose(np.asarray(lg[0]), np.asarray(ref[0, 2:]), atol=1e-4, rtol=0)


def test_ragged_batch_matches_single_rows(params, model, apply):
    lens = [5, 9]
    prompts = [_tokens(10, lens[0]), _tokens(11, lens[1])]
    t = max(lens)
    padded = np.zeros((2, t), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    nxt = jnp.asarray([[_tokens(12, 1)[0]], [_tokens(13, 1)[0]]])
    logits, cache = apply(params, jnp.asarray(padded), _pos(0, t, 2), model.init_cache(2, SLOTS))
    cache = cache.commit(jnp.asarray(lens, jnp.int32))
    step, _ = apply(params, nxt, cache.lengths[:, None], cache)
    for b, p in enumerate(prompts):
        ref, c1 = apply(params, jnp.asarray(p)[None], _pos(0, len(p)), model.init_cache(1, SLOTS))
        np.testing.assert_allclose(np.asarray(logits[b, : len(p)]), np.asarray(ref[0]), atol=1e-4, rtol=0)
        c1 = c1.commit(jnp.full((1,), len(p), jnp.int32))
        ref_step, _ = apply(params, nxt[b : b + 1], _pos(len(p), 1), c1)
        np.testing.assert_allclose(np.asarray(step[b]), np.asarray(ref_step[0]), atol=1e-4, rtol=0)


def test_apply_at_is_apply_at_those_rows(params, model, apply):
    # Ragged rows: the logits of token index[b] (the last prompt token) and the same cache as the full call.
    lens = [5, 9]
    padded = np.zeros((2, max(lens)), np.int32)
    for b, n in enumerate(lens):
        padded[b, :n] = _tokens(20 + b, n)
    toks, pos, index = jnp.asarray(padded), _pos(0, max(lens), 2), jnp.asarray(lens, jnp.int32) - 1
    full, c_full = apply(params, toks, pos, model.init_cache(2, SLOTS))
    last, c_at = jax.jit(model.apply_at)(params, toks, pos, model.init_cache(2, SLOTS), index)
    assert last.shape == (2, CFG.vocab_size)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(last[b]), np.asarray(full[b, n - 1]), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(c_at.k), np.asarray(c_full.k))
    np.testing.assert_array_equal(np.asarray(c_at.v), np.asarray(c_full.v))


def test_decode_prefill_takes_apply_at(model):
    # The decoder's prefill calls apply_at when the model has one, and its tokens equal those of the fallback
    # (apply's full logits, the row taken afterwards). One layout: apply_at is layout-independent code (the
    # test above holds it to apply on both).
    from jspec import decode as dec

    params = init_random_params(CFG, jax.random.key(0), std=STD)

    calls = []

    def counted(*args):
        calls.append(1)
        return model.apply_at(*args)

    with_at = dataclasses.replace(model, apply_at=counted)
    without = dataclasses.replace(model, apply_at=None)
    prompts = [list(_tokens(30, 5)), list(_tokens(31, 8))]
    outs = [dec.decode(m, params, prompts, max_new_tokens=6, max_len=SLOTS).tokens for m in (with_at, without)]
    assert calls, "prefill did not call apply_at"
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])


# Tree over 4 new tokens: 0 is the root, 1 and 2 are its children, 3 is the child of 1.
PARENT = [-1, 0, 0, 1]
DEPTH = [0, 1, 1, 2]


def _ancestor_mask():
    m = np.zeros((4, 4), bool)
    for i in range(4):
        j = i
        while j >= 0:
            m[i, j] = True
            j = PARENT[j]
    return m


def test_tree_mask_siblings_do_not_leak(params, model, apply):
    prefix = _tokens(20, 5)
    cache = model.init_cache(1, SLOTS)
    _, cache = apply(params, jnp.asarray(prefix)[None], _pos(0, 5), cache)
    cache = cache.commit(jnp.full((1,), 5, jnp.int32))
    mask = jnp.asarray(_ancestor_mask())[None]
    pos = jnp.asarray([[5 + d for d in DEPTH]], jnp.int32)
    nodes = np.array([3, 14, 15, 92], np.int32)
    base, _ = apply(params, jnp.asarray(nodes)[None], pos, cache, mask)
    changed_nodes = nodes.copy()
    changed_nodes[2] = 65  # node 2 is a sibling of 1 and not an ancestor of 3
    other, _ = apply(params, jnp.asarray(changed_nodes)[None], pos, cache, mask)
    for i in (0, 1, 3):
        np.testing.assert_allclose(np.asarray(other[0, i]), np.asarray(base[0, i]), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(other[0, 2] - base[0, 2])).max() > 1e-2  # node 2 itself did change
    # The path 0 -> 1 -> 3 scores exactly like a plain causal chain of those tokens.
    chain, _ = apply(params, jnp.asarray(nodes[[0, 1, 3]])[None], _pos(5, 3), cache)
    np.testing.assert_allclose(np.asarray(base[0, [0, 1, 3]]), np.asarray(chain[0]), atol=1e-4, rtol=0)
    # A mask letting node 3 see its uncle 2 must change node 3 (the test can fail).
    leaky = np.array(_ancestor_mask())
    leaky[3, 2] = True
    leak, _ = apply(params, jnp.asarray(nodes)[None], pos, cache, jnp.asarray(leaky)[None])
    assert np.abs(np.asarray(leak[0, 3] - base[0, 3])).max() > 1e-2


def test_layer_range_composes_and_returns_hidden(params, model):
    toks = jnp.asarray(_tokens(30, 6))[None]
    pos = _pos(0, 6)
    cache = model.init_cache(1, SLOTS)
    logits, hidden, full_cache = jax.jit(llama.forward, static_argnums=(0,), static_argnames="return_hidden")(
        CFG, params, toks, pos, cache, return_hidden=True
    )
    assert hidden.shape == (1, 6, CFG.hidden)

    @jax.jit
    def split(params, toks, pos, cache):
        h = llama.embed(CFG, params, toks)
        h, c1 = llama.run_layers(CFG, params, h, pos, cache, start=0, stop=1)  # a LayerSkip-style draft prefix
        draft_logits = llama.head(CFG, params, h)
        h, c2 = llama.run_layers(CFG, params, h, pos, c1, start=1, stop=CFG.num_layers)
        return draft_logits, c1, llama.head(CFG, params, h), c2

    draft_logits, c1, logits2, c2 = split(params, toks, pos, cache)
    # f32 reordering only (1.9e-6 seen on an H200; 1.03e-5 on a Zen 4 CPU, at a logit of -2.11, which an
    # absolute 1e-5 alone refused); a wrong layer or slot would be off by O(1).
    np.testing.assert_allclose(np.asarray(logits2), np.asarray(logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(c2.k), np.asarray(full_cache.k), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(c1.k[1:]))  # the 1-layer prefix wrote only its own layer
    assert np.any(np.asarray(c1.k[0]))
    assert np.abs(np.asarray(draft_logits - logits)).max() > 1e-2


def test_logical_axes_cover_every_param(params):
    params = llama.stack_layers(params)  # the axes describe the canonical (stacked) layout
    axes = param_logical_axes(CFG)
    vocab = {"batch", "layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "cache_seq"}
    assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_a = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, p), a in zip(flat_p, flat_a, strict=True):
        assert len(a) == p.ndim, (path, a, p.shape)
        assert set(a) <= vocab
        assert (a[0] == "layers") == ("layers" in jax.tree_util.keystr(path))
    assert axes["layers"]["attn"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["attn"]["wk"] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes["layers"]["mlp"]["w_down"] == ("layers", "mlp", "embed")
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    assert set(KV_AXES) <= vocab


def test_bfloat16_model_runs_close_to_float32(params):
    cfg16 = CFG.replace(dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    m16 = make_model(cfg16)
    toks = jnp.asarray(_tokens(40, 6))[None]
    lg16, c16 = jax.jit(m16.apply)(p16, toks, _pos(0, 6), m16.init_cache(1, SLOTS))
    assert lg16.dtype == jnp.float32 and c16.k.dtype == jnp.bfloat16
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)
    lg32, _ = jax.jit(make_model(CFG).apply)(p32, toks, _pos(0, 6), make_model(CFG).init_cache(1, SLOTS))
    scale = float(jnp.abs(lg32).max())
    assert float(jnp.abs(lg16 - lg32).max()) < 0.05 * scale
