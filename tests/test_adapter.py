"""models.adapter: a researcher's own Flax model decoded by jspec.

References are the user's model run without jspec: examples/bring_your_own_model.py's naive generate loop (the
whole sequence recomputed per token, argmax) for greedy equality, and its plain forward over every continuation
for the exact whole-sequence distribution (toy_models.exact_causal_distribution)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from example_scripts import load_example
from flax import nnx
from toy_models import chi2_critical, chi_square, exact_causal_distribution, grouped_rows

from jspec.decode import decode
from jspec.drafters import ModelDrafter, TreeModelDrafter
from jspec.tree import TreeRule, TreeSpec
from models.adapter import from_nnx, wrap

ex = load_example("bring_your_own_model")
BUDGETS = [ex.NEW_TOKENS, 17, 9]  # ragged budgets beside the ragged prompts


@pytest.fixture(scope="module")
def example():
    """The example's target and draft, wrapped, and the naive loop's greedy continuation of each prompt."""
    target, draft = ex.build()
    width = max(map(len, ex.PROMPTS)) + ex.NEW_TOKENS
    naive = [ex.naive_generate(target, p, ex.NEW_TOKENS, width) for p in ex.PROMPTS]
    return from_nnx(target, name="target"), from_nnx(draft, name="draft"), naive


@pytest.mark.parametrize("kind", [pytest.param("n-gram", marks=pytest.mark.fast), "draft model", "tree"])
def test_greedy_equals_the_naive_loop(example, kind):
    (target, tparams), (draft, dparams), naive = example
    drafter = ex.drafters(draft)[kind]
    out = decode(
        target, tparams, ex.PROMPTS, drafter=drafter, goodput=False, draft_params=dparams, max_new_tokens=BUDGETS
    )
    assert out.tokens == [n[:b] for n, b in zip(naive, BUDGETS)]
    assert out.stats["tokens_per_round"] > 1.0  # candidates were accepted: the checked path is the speculative one


# ---- the whole-sequence distribution at T > 0 (the example's classes at a 5-token vocabulary) ----

DIST_CFG = ex.Config(vocab=5, dim=16, layers=2, heads=2, kv_heads=1, ffn=32, init_scale=2.0)
DIST_GROUPS = [  # (sampling, prompt): two prompt lengths in one call, so rows are ragged
    (dict(temperature=0.8, top_k=3), [1, 3, 0]),
    (dict(temperature=1.2, top_p=0.85), [2, 0, 4, 1, 3]),
]
DIST_NEW = 4
DIST_ROWS = 30_000  # per group


@pytest.fixture(scope="module")
def dist_models():
    target, draft = ex.build(DIST_CFG, seed=3)
    return target, from_nnx(target, name="dist-target"), from_nnx(draft, name="dist-draft")


def _sample_and_check(dist_models, drafter_of, seed: int):
    user_model, (target, tparams), (draft, dparams) = dist_models
    n = DIST_ROWS
    _, cols = grouped_rows([0], [g for g, _ in DIST_GROUPS], n)
    prompts = [p for _, p in DIST_GROUPS for _ in range(n)]
    out = decode(
        target, tparams, prompts, drafter=drafter_of(draft), draft_params=dparams, max_new_tokens=DIST_NEW,
        max_len=16, seed=seed, **cols,
    )  # fmt: skip
    assert 0.2 < out.stats["acceptance_rate"] < 0.95, out.stats  # both branches of the acceptance rule

    def logits_fn(rows):  # the user's model as they run it, no jspec: [M, T] -> [M, T, V]
        return ex.forward(user_model, rows, jnp.broadcast_to(jnp.arange(rows.shape[1]), rows.shape))

    tokens = np.asarray(out.tokens)
    for g, (sampling, prompt) in enumerate(DIST_GROUPS):
        exact = exact_causal_distribution(logits_fn, DIST_CFG.vocab, prompt, DIST_NEW, **sampling)
        stat, df = chi_square(tokens[g * n : (g + 1) * n], exact)
        assert stat < chi2_critical(df), (g, sampling, stat, df)


def test_distribution_with_a_draft_model(dist_models):
    """60k sampled sequences (two groups, 1e-5 false-alarm chi-square) against the exact distribution of the
    user's own model: the adapter's cache writes, masks and commits change nothing the target samples."""
    _sample_and_check(dist_models, lambda draft: ModelDrafter(draft), seed=1)


def test_distribution_with_a_tree(dist_models):
    """The same with a (2, 1) tree drawn without replacement: its nodes see only their ancestors (the adapter's
    tree mask) and the accepted path is moved into place (KVCache.commit)."""
    _sample_and_check(dist_models, lambda d: TreeModelDrafter(d, TreeSpec((2, 1)), TreeRule.WITHOUT_REPLACEMENT), 2)


# ---- other ways to write a model: nnx.MultiHeadAttention unchanged, and linen through ``wrap`` ----

V_SMALL, DIM, MAX_LEN = 11, 8, 32


class MHADecoder(nnx.Module):
    """A GPT-style decoder from nnx.MultiHeadAttention as it ships (its ``attention_fn`` is the hook) with
    learned position embeddings, so the positions jspec passes are what it reads."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed, self.pos = nnx.Embed(V_SMALL, DIM, rngs=rngs), nnx.Embed(MAX_LEN, DIM, rngs=rngs)
        mha = lambda: nnx.MultiHeadAttention(2, DIM, num_kv_heads=1, decode=False, rngs=rngs)
        self.attn = nnx.List([mha(), mha()])
        self.head = nnx.Linear(DIM, V_SMALL, rngs=rngs)

    def __call__(self, tokens, positions):
        x = self.embed(tokens) + self.pos(positions)
        for a in self.attn:
            x = x + a(x, mask=nnx.make_causal_mask(tokens))
        return self.head(x)


class LinenDecoder(nn.Module):
    """A linen decoder whose layers take the attention as a call argument (linen modules cannot be patched
    after construction, so ``wrap`` hands it over in the call)."""

    @nn.compact
    def __call__(self, tokens, positions, attention=ex.causal_attention):
        x = nn.Embed(V_SMALL, DIM)(tokens) + nn.Embed(MAX_LEN, DIM)(positions)
        for _ in range(2):
            q, k, v = (nn.DenseGeneral((h, 4))(x) for h in (2, 1, 1))
            x = x + nn.DenseGeneral(DIM, axis=(-2, -1))(attention(q, k, v))
        return nn.Dense(V_SMALL)(x)


def _check_ragged_calls(model, params, full):
    """jspec's calls (a prefill, a ragged commit that rejects row 1's last token, a second call from each row's own
    length) give the logits of ``full`` (the user's forward over the whole sequence, causal) at the same tokens."""
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, V_SMALL)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    want = np.asarray(full(tokens, pos))
    apply = jax.jit(model.apply)
    got, cache = apply(params, tokens[:, :3], pos[:, :3], model.init_cache(2, 16))
    np.testing.assert_allclose(got, want[:, :3], atol=1e-5)
    cache = cache.commit(jnp.asarray([3, 2]))
    idx = jnp.asarray([[3, 4], [2, 3]])
    got, _ = apply(params, jnp.take_along_axis(tokens, idx, 1), idx, cache)
    np.testing.assert_allclose(got, np.take_along_axis(want, np.asarray(idx)[..., None], 1), atol=1e-5)


@pytest.mark.fast
def test_nnx_multi_head_attention_unchanged():
    user = MHADecoder(nnx.Rngs(0))
    model, params = from_nnx(user, max_positions=MAX_LEN)
    assert model.max_positions == MAX_LEN and model.vocab_size == V_SMALL
    assert model.init_cache(1, 4).k.shape == (2, 1, 1, 4, 4)  # [L, B, Hkv, S, D] read off the model
    _check_ragged_calls(model, params, user)
    assert user.attn[0].attention_fn is nnx.dot_product_attention  # the user's model keeps its own


@pytest.mark.fast
def test_linen_through_wrap():
    module = LinenDecoder()
    tokens = jnp.zeros((1, 4), jnp.int32)
    variables = module.init(jax.random.key(0), tokens, jnp.arange(4)[None])
    model = wrap(lambda p, t, pos, attention: module.apply(p, t, pos, attention), variables, name="linen")
    _check_ragged_calls(model, variables, lambda t, pos: module.apply(variables, t, pos))


# ---- bad input: errors that name the problem ----


def _toy(kv_heads=(2, 2), transpose=False, calls=1, bias=False, logits_at_last=False):
    """``wrap``'s forward for a toy model: each entry of kv_heads a layer, q [B, T, 2, 4]; the arguments break it
    one way each."""

    def forward(params, tokens, positions, attention):
        b, t = tokens.shape
        x = params[tokens]  # [B, T, 8]
        for hkv in kv_heads:
            q = x.reshape(b, t, 2, 4)
            kv = jnp.tile(q[:, :, :1], (1, 1, hkv, 1))
            qkv = [q, kv, kv]
            if transpose:  # [B, heads, T, D], the torch layout
                qkv = [a.transpose(0, 2, 1, 3) for a in qkv]
            out = q
            for _ in range(calls):
                out = attention(*qkv, bias=jnp.zeros(()) if bias else None)
            x = x + out.reshape(x.shape)
        return x[:, -1] if logits_at_last else x

    return forward


PARAMS = jnp.ones((V_SMALL, 8))


@pytest.mark.fast
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(transpose=True), r"expected \[B, T, heads, D\]"),
        (dict(kv_heads=(2, 1)), "layers differ"),
        (dict(kv_heads=(3,)), "number of heads that divides"),
        (dict(calls=0), "never called the attention"),
        (dict(bias=True), "bias"),
        (dict(logits_at_last=True), r"expected logits \[2, 5, V\]"),
    ],
)
def test_bad_forward_is_refused_when_wrapped(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wrap(_toy(**kwargs), PARAMS, name="toy")


@pytest.mark.fast
def test_bad_models_and_caches_are_refused():
    class NoHook(nnx.Module):  # attention inlined: nothing to swap
        def __init__(self):
            self.w = nnx.Param(jnp.ones((V_SMALL, 8)))

        def __call__(self, tokens, positions):
            return self.w[tokens]

    with pytest.raises(ValueError, match="no submodule has an attribute 'attention_fn'"):
        from_nnx(NoHook())

    class Twice(MHADecoder):  # one module, two calls: which cache layer would the second one be?
        def __call__(self, tokens, positions):
            x = self.embed(tokens)
            return self.head(x + self.attn[0](self.attn[0](x, mask=nnx.make_causal_mask(tokens))))

    with pytest.raises(ValueError, match="layer 0's attention ran twice"):
        from_nnx(Twice(nnx.Rngs(0)))

    class NoPositions(MHADecoder):  # counts positions itself: a tree's nodes would sit at the wrong ones
        def __call__(self, tokens):
            return super().__call__(tokens, jnp.arange(tokens.shape[1])[None])

    with pytest.raises(ValueError, match=r"model\(tokens, positions\) does not fit"):
        from_nnx(NoPositions(nnx.Rngs(0)))

    small, big = wrap(_toy(), PARAMS), wrap(_toy(kv_heads=(2, 2, 2)), PARAMS)
    with pytest.raises(ValueError, match="is not this model's"):
        small.apply(PARAMS, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), big.init_cache(1, 8))
