"""The decode loop with tiny random Flax transformers (models.llama) as target and draft."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_models import Forwarding, ref_transform

from jspec import decode as dec
from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter
from jspec.ngram import NgramDrafter
from jspec.tree import TreeSpec
from models.llama import LlamaConfig, init_random_params, make_model

CFG = LlamaConfig(vocab_size=64, hidden=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12, ffn=96)
DCFG = CFG.replace(num_layers=1, name="draft")
# Large init scale: peaked distributions, so greedy decisions are robust and the draft agrees often enough.
PARAMS = init_random_params(CFG, jax.random.key(0), std=0.6)
DPARAMS = {**init_random_params(DCFG, jax.random.key(1), std=0.6), "embed": PARAMS["embed"]}
TARGET, DRAFT = make_model(CFG), make_model(DCFG)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 64, size=n).tolist() for n in (3, 11, 1, 7)]


@pytest.mark.fast
@pytest.mark.parametrize(
    "drafter",
    [
        ModelDrafter(DRAFT),
        NgramDrafter(vocab_size=64),
        TreeModelDrafter(DRAFT, TreeSpec((2, 2, 1))),
        DynamicTreeDrafter(DRAFT, top_k=3, depth=3, budget=8),
    ],
    ids=["chain", "ngram", "static-tree", "dynamic-tree"],
)
def test_greedy_speculative_equals_plain_batch4_ragged(drafter):
    plain = dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=24)
    k = None if getattr(drafter, "is_tree", False) else 4  # a tree drafts to its depth (3)
    spec = dec.decode(
        TARGET, PARAMS, PROMPTS, drafter=drafter, draft_params=DPARAMS, gamma=k, goodput=False, max_new_tokens=24
    )
    assert spec.tokens == plain.tokens
    # Not vacuous: candidates were accepted (the multi-token commit ran) and rejected.
    assert 0 < spec.stats["accepted"] < spec.stats["proposed"], spec.stats


def test_plain_greedy_matches_a_step_by_step_reference():
    """Independent reference: recompute the whole sequence from scratch (no cache) for every token."""
    out = dec.decode(TARGET, PARAMS, PROMPTS, max_new_tokens=8)
    fwd = jax.jit(lambda toks: TARGET.apply(PARAMS, toks, jnp.arange(toks.shape[1])[None], TARGET.init_cache(1, 64))[0])
    for prompt, got in zip(PROMPTS, out.tokens):
        seq = list(prompt)
        for _ in range(8):
            seq.append(int(jnp.argmax(fwd(jnp.asarray([seq]))[0, -1])))
        assert got == seq[len(prompt) :]


def test_batch_64_ragged_with_sampling_and_greedy_rows():
    prompts = [RNG.integers(0, 64, size=int(n)).tolist() for n in RNG.integers(1, 20, size=64)]
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(64)]
    kw = dict(max_new_tokens=12, temperature=temps, top_p=0.9)
    plain = dec.decode(TARGET, PARAMS, prompts, **kw)
    spec = dec.decode(TARGET, PARAMS, prompts, drafter=ModelDrafter(DRAFT), draft_params=DPARAMS, gamma=3, **kw)
    # Greedy rows are token-for-token equal; sampled rows only share the distribution (other draws).
    assert [t for t, g in zip(spec.tokens, temps) if g == 0] == [t for t, g in zip(plain.tokens, temps) if g == 0]
    assert all(len(t) == 12 for t in spec.tokens)
    assert 0 < spec.stats["accepted"] < spec.stats["proposed"], spec.stats
    # Every sampled token lies in the top-p 0.9 nucleus of the target's T=1 distribution at its position,
    # recomputed by one cache-free pass per row (causal: the zero padding after a row cannot change it).
    fwd = jax.jit(lambda toks: TARGET.apply(PARAMS, toks, jnp.arange(32)[None], TARGET.init_cache(1, 32))[0])
    for prompt, got, temp in zip(prompts, spec.tokens, temps):
        if temp == 0:
            continue
        seq = np.zeros((1, 32), np.int32)
        seq[0, : len(prompt) + 12] = prompt + got
        logits = np.asarray(fwd(jnp.asarray(seq)))[0]
        for i, tok in enumerate(got):
            assert ref_transform(logits[len(prompt) + i - 1], temperature=1.0, top_p=0.9)[tok] > 0, (prompt, i)


def test_transformer_cache_equals_fresh_prefill_after_speculation():
    prepared = dec.prepare(
        TARGET,
        PARAMS,
        PROMPTS,
        drafter=ModelDrafter(DRAFT),
        draft_params=DPARAMS,
        gamma=4,
        max_new_tokens=20,
        temperature=1.0,
        seed=3,
    )
    st = prepared.fn(*prepared.args)
    seq, lengths = np.asarray(st.seq), np.asarray(st.cache.lengths)
    assert 0 < int(st.stats.accepted.sum()) < int(st.stats.proposed.sum())
    for b in range(len(PROMPTS)):
        n = int(lengths[b])
        fresh = TARGET.init_cache(1, prepared.config.slots)
        _, fresh = TARGET.apply(PARAMS, jnp.asarray(seq[b : b + 1, :n]), jnp.arange(n)[None], fresh)
        for name in ("k", "v"):
            np.testing.assert_allclose(
                np.asarray(getattr(st.cache, name))[:, b, :, :n],
                np.asarray(getattr(fresh, name))[:, 0, :, :n],
                atol=1e-4,
                rtol=1e-4,
            )


@dataclasses.dataclass(frozen=True)
class SpyDrafter(Forwarding):
    """The n-gram drafter, recording every round's per-row ``max_draft`` (what each row may propose)."""

    inner: NgramDrafter
    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def propose(self, params, state, ctx, key, k):
        jax.debug.callback(lambda m: self.seen.append(np.asarray(m).tolist()), ctx.max_draft, ordered=True)
        return self.inner.propose(params, state, ctx, key, k)


def test_a_stopped_row_proposes_nothing():
    """A row that ended (here at EOS straight after prefill) gets max_draft 0, so it neither drafts nor makes
    the batch's verification K+1 wide while the other rows run on."""
    first = dec.decode(TARGET, PARAMS, [[5, 9, 5, 9, 5, 9]], max_new_tokens=1).tokens[0][0]
    rest = [p for p in (RNG.integers(0, 64, size=6).tolist() for _ in range(20))]
    runner = next(p for p in rest if first not in dec.decode(TARGET, PARAMS, [p], max_new_tokens=12).tokens[0])
    spy = SpyDrafter(NgramDrafter(vocab_size=64))
    out = dec.decode(
        TARGET, PARAMS, [[5, 9, 5, 9, 5, 9], runner], drafter=spy, gamma=3, max_new_tokens=12, eos_ids=[first]
    )
    assert out.tokens[0] == [first] and len(out.tokens[1]) == 12
    assert spy.seen and all(m[0] == 0 for m in spy.seen), spy.seen
    assert any(m[1] > 0 for m in spy.seen), spy.seen
