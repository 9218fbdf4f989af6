"""The compressed-state model: branches compute different compressed states; only the chosen path's are
committed, so tree decoding stays equal to plain decoding and the cache equals a fresh prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import decode as dec
from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter
from jspec.tree import TreeSpec, ancestor_mask
from models.compressed import make_compressed_model
from models.llama import LlamaConfig, init_random_params, make_model

CFG = LlamaConfig(vocab_size=24, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)
PARAMS = init_random_params(CFG, jax.random.key(0), std=0.5)
BLOCK = 3
TARGET = make_compressed_model(CFG, BLOCK)
# The draft is the same weights without the compressed entries: close to the target, yet different exactly
# where the compressed state matters.
DRAFT = make_model(CFG)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 3, 9, 9, 9, 1, 2]]
DRAFTERS = {
    "chain": ModelDrafter(DRAFT),
    "static-tree": TreeModelDrafter(DRAFT, TreeSpec((3, 2, 1))),
    "dynamic-tree": DynamicTreeDrafter(DRAFT, top_k=3, depth=3, budget=8),
}


def np_compressed_logits(tokens, block):
    """Uncached NumPy (float64) reference of the compressed model over one causal sequence, written from the
    definition in models/compressed.py: a pre-norm tied-embedding Llama (RMSNorm, rotate-half RoPE, GQA,
    SwiGLU) whose attention at position i sees the per-token keys/values of positions 0..i AND, for every
    block j of ``block`` tokens completed strictly before i ((j + 1) * block - 1 < i), one extra key/value: the
    mean of that block's post-RoPE keys and of its values (per layer and KV head). block=None: no summaries
    (plain Llama). tokens [T] -> logits [T, V]."""
    prm = jax.tree.map(lambda w: np.asarray(w, np.float64), PARAMS)
    t, hq, hkv, d = len(tokens), CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    emb = prm["embed"]["embedding"]

    def rms(z, scale):
        return z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + CFG.rms_eps) * scale

    angles = np.arange(t)[:, None] * (1.0 / CFG.rope_theta ** (np.arange(0, d, 2) / d))[None]  # [T, D/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(z):  # [T, N, D]
        z1, z2 = z[..., : d // 2], z[..., d // 2 :]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], axis=-1)

    x = emb[np.asarray(tokens)]
    for layer in range(CFG.num_layers):
        lp = jax.tree.map(lambda w, i=layer: w[i], prm["layers"])
        a, m = lp["attn"], lp["mlp"]
        n = rms(x, lp["attn_norm"]["scale"])
        q = rope(np.einsum("te,ehd->thd", n, a["wq"]))
        k = rope(np.einsum("te,ehd->thd", n, a["wk"]))
        v = np.einsum("te,ehd->thd", n, a["wv"])
        out = np.zeros((t, hq, d))
        for i in range(t):
            done = 0 if block is None else i // block  # blocks whose last position is < i
            for head in range(hq):
                kv = head // (hq // hkv)
                keys = [k[: i + 1, kv]] + [k[j * block : (j + 1) * block, kv].mean(0)[None] for j in range(done)]
                vals = [v[: i + 1, kv]] + [v[j * block : (j + 1) * block, kv].mean(0)[None] for j in range(done)]
                scores = np.concatenate(keys) @ q[i, head] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[i, head] = (w / w.sum()) @ np.concatenate(vals)
        x = x + out.reshape(t, hq * d) @ a["wo"].reshape(hq * d, CFG.hidden)
        n = rms(x, lp["mlp_norm"]["scale"])
        gate = n @ m["w_gate"]
        x = x + (gate / (1.0 + np.exp(-gate)) * (n @ m["w_up"])) @ m["w_down"]
    return rms(x, prm["final_norm"]["scale"]) @ emb.T


# Logits here are of size up to ~11 (std 0.5 weights); float32 against float64 through 2 layers agrees to
# ~3e-5 (measured), so 2e-4 leaves a margin of ~6x.
TOL = dict(atol=2e-4, rtol=0)


def test_logits_equal_an_uncached_numpy_reference():
    """The model's logits against ``np_compressed_logits``: one uncached call, the same rows fed in cached
    pieces of ragged lengths (committed block summaries, summaries completed inside a call), and the nodes of
    a tree (each node against the reference over its own path: a sibling's summary must not leak)."""
    seqs = [[5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11], [3, 3, 3, 9, 9, 9, 1, 2, 17, 20, 0]]
    refs = [np_compressed_logits(x, BLOCK) for x in seqs]
    # The reference itself: without summaries it is the plain Llama of models/llama.py (an implementation
    # sharing no code with it); with them it differs by far more than the tolerance, so the comparisons below
    # see the summaries.
    plain, _ = jax.jit(DRAFT.apply)(PARAMS, jnp.asarray(seqs), jnp.arange(11)[None], DRAFT.init_cache(2, 11))
    plain = np.asarray(plain)
    for r, x in enumerate(seqs):
        np.testing.assert_allclose(plain[r], np_compressed_logits(x, None), **TOL)
        diff = np.abs(refs[r] - np_compressed_logits(x, None)).max(axis=-1)  # [T]
        assert np.all(diff[:BLOCK] == 0), diff  # nothing to pool before the first block completes
        assert diff.max() > 0.2 and np.mean(diff[BLOCK:] > 10 * TOL["atol"]) >= 0.5, diff

    # Whole rows, one call from an empty cache.
    apply, commit = jax.jit(TARGET.apply), jax.jit(lambda cache, n: cache.commit(n))
    logits, _ = apply(PARAMS, jnp.asarray(seqs), jnp.arange(11)[None], TARGET.init_cache(2, 16))
    for r in range(2):
        np.testing.assert_allclose(np.asarray(logits[r]), refs[r], **TOL)

    # Cached pieces: row 0 commits 4 then 3 then 3 tokens, row 1 commits 3 then 4 then 3 (right-padded calls of
    # width 4; the padding is never committed). Blocks complete at positions 2, 5 and 8: inside calls (row 0)
    # and as a call's last committed token (row 1).
    cache = TARGET.init_cache(2, 16)
    lengths = np.zeros(2, np.int64)
    for counts in ([4, 3], [3, 4], [3, 3]):
        toks = np.zeros((2, 4), np.int32)
        for r in range(2):
            toks[r, : counts[r]] = seqs[r][lengths[r] : lengths[r] + counts[r]]
        pos = jnp.asarray(lengths[:, None] + np.arange(4)[None], jnp.int32)
        logits, cache = apply(PARAMS, jnp.asarray(toks), pos, cache)
        for r in range(2):
            got = np.asarray(logits[r, : counts[r]])
            np.testing.assert_allclose(got, refs[r][lengths[r] : lengths[r] + counts[r]], **TOL)
        cache = commit(cache, jnp.asarray(counts, jnp.int32))
        lengths += counts
    assert np.array_equal(np.asarray(cache.lengths), [10, 10])

    # Then a tree on those 10 committed tokens: root at position 10, two siblings at 11 (each completes block
    # [9, 11] with itself, so their summaries differ), one child each at 12, which must attend to its own
    # path's summary only. Each node against the reference over the committed row plus its path.
    parent = np.asarray([-1, 0, 0, 1, 2])
    depth = np.asarray([0, 1, 1, 2, 2])
    nodes = [[11, 1, 2, 3, 4], [0, 1, 11, 3, 13]]
    mask = jax.jit(ancestor_mask)(jnp.asarray(np.stack([parent, parent])))
    logits, _ = apply(PARAMS, jnp.asarray(nodes), jnp.asarray(10 + np.stack([depth, depth])), cache, mask)
    for r in range(2):
        for i in range(5):
            path, j = [], i
            while j >= 0:
                path.insert(0, nodes[r][j])
                j = int(parent[j])
            want = np_compressed_logits(seqs[r][:10] + path, BLOCK)[-1]
            np.testing.assert_allclose(np.asarray(logits[r, i]), want, **TOL, err_msg=f"row {r} node {i}")


def test_compressed_state_changes_the_model():
    plain = dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=20)
    uncompressed = dec.decode(DRAFT, PARAMS, PROMPTS, max_new_tokens=20)
    assert plain.tokens != uncompressed.tokens


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculative_equals_plain_with_compressed_state(name):
    plain = dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=24)
    out = dec.decode(TARGET, PARAMS, PROMPTS, drafter=DRAFTERS[name], draft_params=PARAMS, gamma=3, max_new_tokens=24)
    assert out.tokens == plain.tokens
    assert out.stats["tokens_per_round"] > 1.2


@pytest.mark.parametrize("name", ["static-tree", "dynamic-tree"])
def test_committed_compressed_state_equals_fresh_prefill(name):
    prepared = dec.prepare(
        TARGET,
        PARAMS,
        PROMPTS,
        drafter=DRAFTERS[name],
        goodput=False,
        draft_params=PARAMS,
        max_new_tokens=17,
        temperature=1.0,
        seed=4,
    )
    st = prepared.fn(*prepared.args)
    seq, lengths = np.asarray(st.seq), np.asarray(st.cache.lengths)
    assert int(st.stats.accepted.sum()) > 0
    for b in range(len(PROMPTS)):
        n = int(lengths[b])
        fresh = TARGET.init_cache(1, prepared.config.slots)
        _, fresh = TARGET.apply(PARAMS, jnp.asarray(seq[b : b + 1, :n]), jnp.arange(n)[None], fresh)
        fresh = fresh.commit(jnp.asarray([n]))
        np.testing.assert_allclose(
            np.asarray(st.cache.k)[:, b, :, :n], np.asarray(fresh.k)[:, 0, :, :n], atol=1e-4, rtol=1e-4
        )
        blocks = n // BLOCK
        np.testing.assert_allclose(
            np.asarray(st.cache.ck)[:, b, :, :blocks], np.asarray(fresh.ck)[:, 0, :, :blocks], atol=1e-4, rtol=1e-4
        )


def test_siblings_get_different_compressed_states_and_do_not_see_each_other():
    """Two branches completing the same block pool different tokens; a node's logits ignore its siblings."""
    prompt = jnp.asarray([[5, 6, 7, 8, 9]])  # 5 committed tokens: the next token completes block 1 (pos 5)
    cache = TARGET.init_cache(1, 32)
    _, cache = TARGET.apply(PARAMS, prompt, jnp.arange(5)[None], cache)
    cache = cache.commit(jnp.asarray([5]))
    parent = jnp.asarray([[-1, 0, 0, 1, 2]])  # root, two siblings, one child each
    depth = jnp.asarray([[0, 1, 1, 2, 2]])
    mask = ancestor_mask(parent)

    def run(tokens):
        return TARGET.apply(PARAMS, jnp.asarray([tokens]), 5 + depth, cache, mask)

    logits_a, c_a = run([9, 1, 2, 3, 4])
    logits_b, _ = run([9, 1, 11, 3, 13])  # only the second branch changes
    # Node 1 (pos 5) completes block [3, 5] along its path; node 2 completes it with another token.
    sk = np.asarray(c_a.sk)[:, 0, :, 5:10]
    assert not np.allclose(sk[:, :, 1], sk[:, :, 2])
    np.testing.assert_allclose(
        np.asarray(logits_a)[0, [0, 1, 3]], np.asarray(logits_b)[0, [0, 1, 3]], atol=1e-4, rtol=1e-4
    )
    assert not np.allclose(np.asarray(logits_a)[0, 2], np.asarray(logits_b)[0, 2])


def test_a_compressed_model_drafting_for_itself_is_always_accepted():
    """The compressed model as its own draft (greedy): every proposal on the greedy path is accepted only if the
    draft's own cache commits its block summaries, the prompt's included (``init`` and a tree's catch-up once
    moved only the lengths, so the draft attended to empty summaries: 2 of 15 and 2 of 23 rejected here)."""
    chain = dec.decode(
        TARGET, PARAMS, PROMPTS, drafter=ModelDrafter(TARGET), goodput=False, draft_params=PARAMS, max_new_tokens=24
    )
    assert chain.stats["accepted_at"] == chain.stats["proposed_at"] and chain.stats["proposed"] > 20, chain.stats
    tree = TreeModelDrafter(TARGET, TreeSpec((2, 1)))  # 2 nodes at each depth: 2 proposed per round per depth
    out = dec.decode(TARGET, PARAMS, PROMPTS, drafter=tree, goodput=False, draft_params=PARAMS, max_new_tokens=24)
    assert out.tokens == dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=24).tokens
    rounds_at = [n // 2 for n in out.stats["proposed_at"]]
    assert out.stats["accepted_at"] == rounds_at and rounds_at[1] > 15, out.stats


def test_configs_it_does_not_implement_are_refused():
    """Its projections have no bias terms: a Qwen2-style config (q/k/v biases) gave other logits silently."""
    with pytest.raises(ValueError, match=r"does not implement q/k/v biases \(qkv_bias=True\)"):
        make_compressed_model(CFG.replace(qkv_bias=True))
    with pytest.raises(ValueError, match="uses tied embeddings"):
        make_compressed_model(CFG.replace(tie_embeddings=False))
    for block in (0, 2.0, True):  # 0 divided by zero deep in init_cache
        with pytest.raises(ValueError, match="block \\(tokens per summary\\) must be an int >= 1"):
            make_compressed_model(CFG, block)
    # Its context is the config's: decode refuses rows past it, as for the uncompressed model.
    assert make_compressed_model(CFG.replace(max_positions=16), BLOCK).max_positions == 16
