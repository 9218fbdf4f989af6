"""The compressed-state model: branches compute different compressed states; only the chosen path's are
committed, so tree decoding stays equal to plain decoding and the cache equals a fresh prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import decode as dec
from jspec.drafters import ModelDrafter
from jspec.tree import DynamicTreeDrafter, TreeModelDrafter, TreeSpec, ancestor_mask
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
        TARGET, PARAMS, PROMPTS, drafter=DRAFTERS[name], draft_params=PARAMS, max_new_tokens=17, temperature=1.0, seed=4
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
    chain = dec.decode(TARGET, PARAMS, PROMPTS, drafter=ModelDrafter(TARGET), draft_params=PARAMS, max_new_tokens=24)
    assert chain.stats["accepted_at"] == chain.stats["proposed_at"] and chain.stats["proposed"] > 20, chain.stats
    tree = TreeModelDrafter(TARGET, TreeSpec((2, 1)))  # 2 nodes at each depth: 2 proposed per round per depth
    out = dec.decode(TARGET, PARAMS, PROMPTS, drafter=tree, draft_params=PARAMS, max_new_tokens=24)
    assert out.tokens == dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=24).tokens
    rounds_at = [n // 2 for n in out.stats["proposed_at"]]
    assert out.stats["accepted_at"] == rounds_at and rounds_at[1] > 15, out.stats


def test_configs_it_does_not_implement_are_refused():
    """Its projections have no bias terms: a Qwen2-style config (q/k/v biases) gave other logits silently."""
    with pytest.raises(ValueError, match=r"does not implement q/k/v biases \(qkv_bias=True\)"):
        make_compressed_model(CFG.replace(qkv_bias=True))
    with pytest.raises(ValueError, match="uses tied embeddings"):
        make_compressed_model(CFG.replace(tie_embeddings=False))
