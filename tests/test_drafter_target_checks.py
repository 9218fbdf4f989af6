"""Drafters that run part of the target's computation themselves refuse a target they would not reproduce:
LayerSkip writes the target's committed cache with its own copy of the first layers, EAGLE verifies with its
own copy of the forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from test_layerskip import PROMPTS, TINY, TINY_MODEL, TINY_PARAMS

from jspec.decode import decode
from jspec.serve import Engine
from models import llama
from models.compressed import make_compressed_model
from models.eagle import EagleConfig, EagleDrafter, init_head
from models.layerskip import LayerSkipDrafter


def test_layerskip_refuses_params_other_than_the_targets():
    ls = LayerSkipDrafter(TINY, exit_layer=2)
    other = jax.tree.map(lambda w: w * 1.01, TINY_PARAMS)  # e.g. a cheaper (quantised) copy for the draft
    kw = dict(drafter=ls, draft_params=ls.draft_params(other), gamma=2, max_new_tokens=6)
    with pytest.raises(ValueError, match="must hold the target's own params"):
        decode(TINY_MODEL, TINY_PARAMS, PROMPTS, **kw)
    with pytest.raises(ValueError, match="must hold the target's own params"):
        Engine(TINY_MODEL, TINY_PARAMS, batch=2, max_len=32, **{k: v for k, v in kw.items() if k != "max_new_tokens"})
    # The same values in other arrays are the target's params: accepted, and greedy output is the target's.
    copy = jax.tree.map(jnp.array, TINY_PARAMS)
    got = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, **dict(kw, draft_params=ls.draft_params(copy)))
    assert got.tokens == decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=6).tokens


def test_self_computing_drafters_refuse_another_target_model():
    """The compressed-state stand-in over the same weights, and a target of another config (RoPE theta):
    plain decoding would run them, the drafters' own forward passes would not."""
    ls = LayerSkipDrafter(TINY, exit_layer=2)
    ecfg = EagleConfig(TINY, head_tokens=0, name="tiny-eagle")
    eagle = EagleDrafter(ecfg, max_draft=2)
    hp = init_head(ecfg, TINY_PARAMS, jax.random.key(1))
    other_cfg = dataclasses.replace(TINY, rope_theta=TINY.rope_theta * 2)
    for target in (make_compressed_model(TINY), llama.make_model(other_cfg)):
        for drafter, dparams in ((ls, ls.draft_params(TINY_PARAMS)), (eagle, eagle.draft_params(TINY_PARAMS, hp))):
            with pytest.raises(ValueError, match="must be a models.llama.make_model model|has rope_theta=20000"):
                decode(target, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, gamma=2, max_new_tokens=4)
    # The model make_model builds for the config (either argmax) is accepted.
    ok = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=eagle, draft_params=eagle.draft_params(TINY_PARAMS, hp),
                gamma=2, max_new_tokens=4)  # fmt: skip
    assert ok.tokens == decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=4).tokens


def test_wide_rounds_count_the_verifications_that_ran_wide():
    """With a budget of 2 tokens the one round may propose nothing: a chain drafter then takes a 1-token step,
    but EAGLE's verify (which returns the head's features) always runs K+1 wide, except in a goodput round at
    K = 0 (its verify over the pending token alone); the statistic the cost model reads must say so."""
    from jspec.decode import prepare
    from jspec.drafters import ModelDrafter
    from jspec.goodput import GoodputK

    ecfg = EagleConfig(TINY, head_tokens=0, name="tiny-eagle")
    eagle = EagleDrafter(ecfg, max_draft=2)
    hp = init_head(ecfg, TINY_PARAMS, jax.random.key(1))
    plain_step = GoodputK((0, 2), (1.0, 100.0))  # a K = 2 round would cost 100 plain steps: never chosen
    runs = {
        "eagle": (eagle, eagle.draft_params(TINY_PARAMS, hp), 1, dict(gamma=2)),
        "eagle at K = 0": (eagle, eagle.draft_params(TINY_PARAMS, hp), 0, dict(goodput=plain_step)),
        "chain": (ModelDrafter(TINY_MODEL), TINY_PARAMS, 0, dict(gamma=2)),
    }
    for name, (drafter, dparams, wide, kw) in runs.items():
        p = prepare(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=2, **kw)
        st = p.fn(*p.args)
        assert int(st.stats.loop_rounds) == 1 and int(st.stats.proposed.sum()) == 0, name
        assert int(st.stats.wide_rounds) == wide, name
