"""EAGLE heads of more than one decoder layer (``EagleConfig.layers``, ``graft_layers``): a layer grafted onto a
trained head starts as the identity (the deeper head drafts exactly as the source did: same tokens, same
acceptance, greedy and sampled); once it is not the identity, the rollout inside ``jspec.decode`` still equals
the training-time computation (``head_unrolled``) on the committed prefix, greedy speculative == greedy plain
on a ragged batch, and the checkpoint keeps the depth (a head saved without one reads as one layer);
train_eagle grafts layers with ``--head-layers`` and refuses to drop any."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle import PROMPTS, TINY, TINY_MODEL, TINY_PARAMS, near_identity_head, random_head, rollout_vs_training

from jspec.decode import decode
from models.eagle import (
    EagleConfig,
    EagleDrafter,
    graft_layers,
    head_features,
    head_unrolled,
    init_head_cache,
    restore_head,
    save_head,
)
from models.training import eagle as train_eagle

IDS = np.sort(np.random.default_rng(6).permutation(TINY.vocab_size)[:40])


def _decode(ecfg, hp, temperature, gamma=3, max_new=20):
    d = EagleDrafter(ecfg, max_draft=gamma)
    return decode(
        TINY_MODEL,
        TINY_PARAMS,
        PROMPTS,
        drafter=d,
        draft_params=d.draft_params(TINY_PARAMS, hp),
        gamma=gamma,
        max_new_tokens=max_new,
        temperature=temperature,
        seed=11,
    )


def test_config_refuses_bad_depths_and_reads_old_heads_as_one_layer():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="layers=.* must be an int >= 1"):
            EagleConfig(TINY, head_tokens=40, layers=bad)
    two = EagleConfig(TINY, head_tokens=40, layers=2)
    assert two.layer_cfg.num_layers == 2 and init_head_cache(two, 2, 8).k.shape[0] == 2
    old = {k: v for k, v in two.to_json().items() if k != "layers"}  # meta.json as written before depth existed
    assert EagleConfig.from_json(old).layers == 1 and EagleConfig.from_json(two.to_json()).layers == 2


def test_grafted_layer_starts_as_the_identity():
    """Graft a second layer onto a one-layer head: its output projections are zero, every other leaf is the
    source's, the head's features are bit-equal, and decoding with it is the same decode (at T = 1 too, where
    equal tokens need equal q at every draft step)."""
    one = EagleConfig(TINY, head_tokens=40)
    hp = random_head(one, TINY_PARAMS, 5, 0.1, IDS)
    two = EagleConfig(TINY, head_tokens=40, layers=2)
    g = graft_layers(two, hp, jax.random.key(1))
    assert jax.tree.leaves(g["layers"])[0].shape[0] == 2
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda w: w[:1], g["layers"])), jax.tree.leaves(hp["layers"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new = jax.tree.map(lambda w: np.asarray(w[1]), g["layers"])
    assert not np.any(new["attn"]["wo"]) and not np.any(new["mlp"]["w_down"])
    assert np.any(new["attn"]["wq"])  # drawn, not zero: gradients reach them
    feats = jax.random.normal(jax.random.key(3), (2, 5, TINY.hidden))
    toks = jnp.asarray([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    f1, _ = head_features(one, hp, TINY_PARAMS, feats, toks, pos, init_head_cache(one, 2, 8))
    f2, _ = head_features(two, g, TINY_PARAMS, feats, toks, pos, init_head_cache(two, 2, 8))
    np.testing.assert_array_equal(np.asarray(f1), np.asarray(f2))
    for temperature in (0.0, 1.0):
        a, b = _decode(one, hp, temperature), _decode(two, g, temperature)
        assert a.tokens == b.tokens and a.stats["accepted_at"] == b.stats["accepted_at"]
        assert a.stats["accepted"] > 0
    with pytest.raises(ValueError, match="has 2 layers, the config asks for 2"):
        graft_layers(two, g, jax.random.key(1))


def _two_layer_head(seed=6, scale=0.02):
    ecfg = EagleConfig(TINY, head_tokens=40, name="tiny-eagle-2l", layers=2)
    return ecfg, near_identity_head(ecfg, TINY_PARAMS, seed, scale, IDS)


def test_two_layer_rollout_equals_training_time_test():
    """Both layers active (no zero projections): every draft position's q inside the decode loop equals
    ``head_unrolled`` (which runs the layers itself) on the committed prefix, and greedy drafts are its argmax."""
    ecfg, hp = _two_layer_head()
    assert np.abs(np.asarray(hp["layers"]["mlp"]["w_down"][1])).max() > 1e-3
    err, greedy_ok, acc, _ = rollout_vs_training(EagleDrafter(ecfg, max_draft=3), hp, 3, 6)
    assert err < 2e-5, err
    assert greedy_ok
    assert (acc == 0).any() and (acc >= 2).any(), acc


def test_two_layer_unrolled_pass_zero_is_the_head_on_true_features():
    """Pass 0 of ``head_unrolled`` is ``head_features`` over the same pairs (a causal pass of both layers)."""
    ecfg, hp = _two_layer_head(scale=0.2)
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(2, 7, TINY.hidden)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 7)), jnp.int32)
    passes = head_unrolled(ecfg, hp, TINY_PARAMS, feats, toks, 2)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    f, _ = head_features(ecfg, hp, TINY_PARAMS, feats, toks, pos, init_head_cache(ecfg, 2, 7))
    np.testing.assert_allclose(np.asarray(passes[0]), np.asarray(f), atol=1e-5)


def test_two_layer_greedy_identical_to_plain_and_checkpoint_round_trip(tmp_path):
    ecfg, hp = _two_layer_head(scale=0.05)
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=24)
    spec = _decode(ecfg, hp, 0.0, max_new=24)
    assert spec.tokens == plain.tokens
    assert spec.stats["accepted"] > 0
    save_head(tmp_path / "h", ecfg, hp)
    with open(tmp_path / "h" / "meta.json") as f:
        assert json.load(f)["config"]["layers"] == 2
    ecfg2, hp2 = restore_head(tmp_path / "h", TINY)
    assert ecfg2.layers == 2
    for a, b in zip(jax.tree.leaves(hp2), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _decode(ecfg2, hp2, 0.0, max_new=24).tokens == plain.tokens


def test_trainer_grafts_layers_and_refuses_to_drop_them(tmp_path, capsys):
    one = EagleConfig(TINY, head_tokens=40)
    hp = random_head(one, TINY_PARAMS, 5, 0.1, IDS)
    save_head(tmp_path / "one", one, hp)
    args = SimpleNamespace(init_from=str(tmp_path / "one"), head_tokens=40, ffn=0, fuse=(), head_layers=0, seed=0)
    src, same = train_eagle.init_source(args, TINY)
    assert src.layers == 1 and jax.tree.leaves(same["layers"])[0].shape[0] == 1
    src, deeper = train_eagle.init_source(SimpleNamespace(**{**vars(args), "head_layers": 3}), TINY)
    assert src.layers == 3 and jax.tree.leaves(deeper["layers"])[0].shape[0] == 3
    assert not np.any(np.asarray(deeper["layers"]["attn"]["wo"][1:]))
    save_head(tmp_path / "three", src, deeper)
    with pytest.raises(SystemExit, match=r"--head-layers 2: --init-from .*three has 3 layers"):
        train_eagle.init_source(
            SimpleNamespace(**{**vars(args), "init_from": str(tmp_path / "three"), "head_layers": 2}), TINY
        )
    assert train_eagle.parse_args(["--head-layers", "2"]).head_layers == 2
    with pytest.raises(SystemExit):
        train_eagle.parse_args(["--head-layers", "-1"])
    assert "--head-layers -1: expected 0" in capsys.readouterr().err
