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
from jspec.ngram import NgramDrafter
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


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["n-gram", "draft model", "tree"])
def test_greedy_equals_the_naive_loop(example, kind):
    (target, tparams), (draft, dparams), naive = example
    drafter = ex.drafters(draft)[kind]
    out = decode(target, tparams, ex.PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=BUDGETS)
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
