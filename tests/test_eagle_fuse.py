"""EAGLE-3 feature fusion (``EagleConfig.fuse``): the target returns the outputs of chosen layers next to its
final feature, the head reads them through ``fuse_features``. Checked here: the layer outputs equal a
truncated target's (an independent forward), greedy speculative == greedy plain with a fused head (chain and
tree, ragged batch), the features the fused head consumes equal a fresh target pass fused, the checkpoint round
trip keeps the fusion, bad layer sets are refused, and train_eagle lays the raw features out the way the
loss and ``fuse_features`` read them (the fused layers first, f last)."""

import dataclasses
import json
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle import PROMPTS, TINY, TINY_MODEL, TINY_PARAMS, _right_pad, random_head, stepped_rounds

from jspec.decode import decode
from jspec.drafters import DraftContext
from jspec.tree import TreeSpec
from models import llama
from models.eagle import (
    EagleConfig,
    EagleDrafter,
    fuse_features,
    head_features,
    init_head,
    init_head_cache,
    restore_head,
    save_head,
    subset_logits,
    target_features,
)
from models.training import eagle as train_eagle
from models.training import eagle_data

FUSE = (0, 2)  # TINY has 4 layers: layer 3's output is f itself


def fused_drafter(k=3, seed=7, scale=0.1):
    ecfg = EagleConfig(TINY, head_tokens=40, name="tiny-eagle3", fuse=FUSE)
    ids = np.sort(np.random.default_rng(seed).permutation(TINY.vocab_size)[:40])
    hp = random_head(ecfg, TINY_PARAMS, seed, scale, ids)
    drafter = EagleDrafter(ecfg, max_draft=k)
    return drafter, drafter.draft_params(TINY_PARAMS, hp), hp


def test_hidden_layers_equal_a_truncated_target():
    """Layer l's output, put through the final norm, is the final feature of the same model cut after layer l
    (a separate forward over the first l + 1 layers); the last E columns, logits and cache are the plain
    forward's."""
    toks = jnp.asarray([[1, 5, 9, 3, 7, 2], [4, 8, 15, 16, 23, 42]], jnp.int32)
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = llama.init_cache(TINY, b, 8)
    logits, raw, c1 = llama.forward(TINY, TINY_PARAMS, toks, pos, cache, return_hidden=True, hidden_layers=FUSE)
    ref_logits, hn, c0 = llama.forward(TINY, TINY_PARAMS, toks, pos, cache, return_hidden=True)
    e = TINY.hidden
    assert raw.shape == (b, t, 3 * e)
    np.testing.assert_array_equal(np.asarray(raw[..., 2 * e :]), np.asarray(hn))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    np.testing.assert_array_equal(np.asarray(c1.k), np.asarray(c0.k))
    for i, layer in enumerate(FUSE):
        cut = TINY.replace(num_layers=layer + 1)
        params = {**TINY_PARAMS, "layers": jax.tree.map(lambda w, n=layer + 1: w[:n], TINY_PARAMS["layers"])}
        _, want, _ = llama.forward(cut, params, toks, pos, llama.init_cache(cut, b, 8), return_hidden=True)
        got = llama.final_norm(TINY, TINY_PARAMS, raw[..., i * e : (i + 1) * e])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for bad in ((3,), (2, 0), (1, 1), (-1,)):
        with pytest.raises(ValueError, match="hidden_layers"):
            llama.forward(TINY, TINY_PARAMS, toks, pos, cache, return_hidden=True, hidden_layers=bad)


def test_fused_head_refuses_bad_layers():
    for bad in ((3,), (2, 1), (0, 0), (-1, 2)):
        with pytest.raises(ValueError, match=r"fuse=.* must be distinct ascending target layers in \[0, 3\)"):
            EagleConfig(TINY, head_tokens=40, fuse=bad)


def test_fresh_fused_head_reads_f_alone():
    """The fusion kernel starts as [0 | 0 | I]: an untrained fused head computes exactly what the unfused head
    with the same weights does (training starts from EAGLE's input and learns what the lower layers add)."""
    ecfg = EagleConfig(TINY, head_tokens=40, fuse=FUSE)
    hp = init_head(ecfg, TINY_PARAMS, jax.random.key(1))
    raw = jax.random.normal(jax.random.key(2), (2, 5, 3 * TINY.hidden)) * 10.0
    np.testing.assert_array_equal(np.asarray(fuse_features(ecfg, hp, raw)), np.asarray(raw[..., 2 * TINY.hidden :]))


def test_fused_greedy_identical_to_plain_tiny():
    mnew = [24, 30, 17]
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=mnew)
    drafter, dparams, _ = fused_drafter(k=3)
    chain = decode(
        TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, gamma=3, max_new_tokens=mnew
    )
    tree = decode(
        TINY_MODEL,
        TINY_PARAMS,
        PROMPTS,
        drafter=drafter.as_tree(TreeSpec((2, 1))),
        draft_params=dparams,
        max_new_tokens=mnew,
    )
    for out in (chain, tree):
        assert out.tokens == plain.tokens
        assert out.stop_reason == plain.stop_reason
    assert 0 < chain.stats["accepted"] < chain.stats["proposed"], chain.stats


def test_fused_head_consumes_fresh_target_features():
    """After rounds with rejections, the stored feature block is ``fuse_features`` of a fresh target pass over
    the committed tokens (layer outputs and f), and the head cache the catch-up leaves equals a fresh head pass
    over those fused features."""
    k = 3
    drafter, dparams, hp = fused_drafter(k=k, seed=5)
    st, committed, toks, pos = stepped_rounds(drafter, dparams, k)
    seq = np.asarray(st.seq)
    b, w = toks.shape
    _, raw, _ = target_features(drafter.ecfg, TINY_PARAMS, toks, pos, llama.init_cache(TINY, b, w))
    fresh = fuse_features(drafter.ecfg, hp, raw)
    # Fusion moves the features: an unfused reading of the same pass would not match.
    assert float(jnp.max(jnp.abs(fresh - raw[..., -TINY.hidden :]))) > 0.1
    ds = st.draft_state
    start = np.asarray(ds.start)
    for r in range(b):
        n = committed[r] - start[r]
        assert 1 <= n <= k + 1
        np.testing.assert_allclose(ds.feats[r, :n], fresh[r, start[r] : committed[r]], atol=1e-4, rtol=0)
    ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), k, jnp.int32), st.sampling)
    observed = jax.jit(drafter.observe)(dparams, ds, ctx)
    ref_toks = jnp.asarray(_right_pad([seq[r, 1 : committed[r] + 1].tolist() for r in range(b)]))
    _, ref_cache = head_features(
        drafter.ecfg, hp, TINY_PARAMS, fresh, ref_toks, pos, init_head_cache(drafter.ecfg, b, w)
    )
    for r in range(b):
        c = committed[r]
        np.testing.assert_allclose(
            np.asarray(observed.cache.k)[:, r, :, :c], np.asarray(ref_cache.k)[:, r, :, :c], atol=1e-4, rtol=0
        )


def test_fused_checkpoint_round_trip(tmp_path):
    drafter, dparams, hp = fused_drafter(seed=4)
    save_head(tmp_path / "head", drafter.ecfg, dparams[1])
    ecfg2, hp2 = restore_head(tmp_path / "head", TINY)
    assert ecfg2.fuse == FUSE
    assert jax.tree.structure(hp2) == jax.tree.structure(hp)
    for a, b in zip(jax.tree.leaves(hp2), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    raw = jax.random.normal(jax.random.key(9), (2, 5, 3 * TINY.hidden))
    toks = jnp.asarray([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def logits(e, h):
        f, _ = head_features(e, h, TINY_PARAMS, fuse_features(e, h, raw), toks, pos, init_head_cache(e, 2, 8))
        return np.asarray(subset_logits(f, EagleDrafter(e).draft_params(TINY_PARAMS, h)[1]["rows"]))

    np.testing.assert_array_equal(logits(ecfg2, hp2), logits(drafter.ecfg, hp))


def test_trainer_lays_out_fused_features(tmp_path):
    """train_eagle's layer files hold the fused layers' outputs of each data file's tokens, and ``load_windows``
    puts them before f: the order ``fuse_features`` splits and the loss's f_{i+1} target (the last E) assume."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, TINY.vocab_size, (2, 40)).astype(np.int32)
    lengths = np.array([40, 23], np.int32)
    tokens[1, 23:] = 0
    b, w = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(w), (b, w))
    _, raw, _ = llama.forward(
        TINY,
        TINY_PARAMS,
        jnp.asarray(tokens),
        pos,
        llama.init_cache(TINY, b, w),
        return_hidden=True,
        hidden_layers=FUSE,
    )
    raw = np.asarray(raw).astype(np.float16)
    e = TINY.hidden
    path = str(tmp_path / "batch_0000.npz")
    np.savez(path, tokens=tokens, lengths=lengths, prompt_lengths=np.array([5, 4], np.int32), feats=raw[..., 2 * e :])
    args = SimpleNamespace(fuse=FUSE, feature_batch=1)
    layers = eagle_data.layer_files(args, SimpleNamespace(config=TINY, params=TINY_PARAMS), [path])
    assert layers == [str(tmp_path / "batch_0000.layers0-2.npz")]
    stored = np.load(layers[0])["layer_feats"]
    np.testing.assert_allclose(stored[0].astype(np.float32), raw[0, :, : 2 * e].astype(np.float32), atol=2e-2)
    data, _ = eagle_data.load_windows([path], 16, True, layers)
    assert data["feats"].shape[2] == 3 * e
    np.testing.assert_array_equal(data["feats"][0], np.concatenate([stored[0, :17], raw[0, :17, 2 * e :]], axis=-1))
    with pytest.raises(SystemExit):  # a malformed --fuse names the flag
        train_eagle.parse_args(["--fuse", "2;15"])
    assert train_eagle.parse_args(["--fuse", "2,15"]).name == "smollm2-8k-f2-15"


def test_trainer_fine_tunes_only_a_head_of_the_same_shape(tmp_path):
    """``--init-from`` starts from a trained head's weights and token map; an unfused head asked to fuse gets a
    fusion grafted on that starts as the identity on f (it drafts exactly as before: the same decode); any
    other change of shape (a fused head asked for other layers or none, another draft vocabulary) is refused
    naming the flag."""
    drafter, dparams, hp = fused_drafter(seed=6)
    save_head(tmp_path / "fused", drafter.ecfg, hp)
    plain = EagleConfig(TINY, head_tokens=40)
    plain_hp = random_head(plain, TINY_PARAMS, 5, 0.1, np.asarray(hp["token_ids"]))  # one that accepts some
    save_head(tmp_path / "plain", plain, plain_hp)
    args = SimpleNamespace(init_from=str(tmp_path / "fused"), head_tokens=40, ffn=0, fuse=FUSE)
    src, got = train_eagle.init_source(args, TINY)
    assert src.fuse == FUSE
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    src, grafted = train_eagle.init_source(
        SimpleNamespace(**{**vars(args), "init_from": str(tmp_path / "plain")}), TINY
    )
    assert src.fuse == FUSE and set(grafted) == set(plain_hp) | {"fuse"}
    for a, b in zip(jax.tree.leaves({k: grafted[k] for k in plain_hp}), jax.tree.leaves(plain_hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    e = TINY.hidden
    want = np.concatenate([np.zeros((2 * e, e)), np.eye(e)])
    np.testing.assert_array_equal(np.asarray(grafted["fuse"]["kernel"]), want)
    for temperature in (0.0, 1.0):  # sampled: equal tokens need equal q at every draft step
        runs = []
        for ecfg, params in ((plain, plain_hp), (src, grafted)):
            d = EagleDrafter(ecfg, max_draft=3)
            dp = d.draft_params(TINY_PARAMS, params)
            runs.append(
                decode(
                    TINY_MODEL,
                    TINY_PARAMS,
                    PROMPTS,
                    drafter=d,
                    draft_params=dp,
                    gamma=3,
                    max_new_tokens=20,
                    temperature=temperature,
                    seed=11,
                )
            )
        assert runs[0].tokens == runs[1].tokens
        assert runs[0].stats["accepted_at"] == runs[1].stats["accepted_at"]
        assert runs[0].stats["accepted"] > 0

    with pytest.raises(SystemExit, match=r"--init-from .*fused: that head has .* \(40, 128, \(0, 2\)\), this run asks"):
        train_eagle.init_source(SimpleNamespace(**{**vars(args), "fuse": ()}), TINY)
    with pytest.raises(SystemExit, match=r"this run asks for \(40, 128, \(0, 1\)\)"):
        train_eagle.init_source(SimpleNamespace(**{**vars(args), "fuse": (0, 1)}), TINY)
    with pytest.raises(SystemExit, match=r"--init-from .*\(40, 128, \(0, 2\)\), this run asks for \(20, "):
        train_eagle.init_source(SimpleNamespace(**{**vars(args), "head_tokens": 20}), TINY)


def test_trainer_remaps_a_fine_tuned_head_only_when_asked():
    """A fine-tuned head keeps its own token map unless ``--remap``, which takes the N most frequent tokens of
    this run's answers (EOS always in, ties to the lower id); ``--remap`` without ``--init-from`` is refused."""
    answers = [np.array([5, 5, 5, 9, 9, 7]), np.array([9, 3])]  # counts: 9 x3, 5 x3, 7 x1, 3 x1
    args = SimpleNamespace(init_from="some-head", remap=False, head_tokens=3)
    assert train_eagle.draft_vocabulary(args, answers, 12, eos_ids=[0]) is None
    args.remap = True
    np.testing.assert_array_equal(train_eagle.draft_vocabulary(args, answers, 12, eos_ids=[0]), [0, 5, 9])
    args.head_tokens = 4  # 3 and 7 tie at one occurrence: the lower id
    np.testing.assert_array_equal(train_eagle.draft_vocabulary(args, answers, 12, eos_ids=[0]), [0, 3, 5, 9])
    args.init_from, args.remap = "", False  # a fresh head always gets its map
    np.testing.assert_array_equal(train_eagle.draft_vocabulary(args, answers, 12, eos_ids=[0]), [0, 3, 5, 9])
    with pytest.raises(SystemExit, match="--remap .* needs --init-from"):
        train_eagle.main(["--remap"])


def test_trainer_loss_weighs_the_feature_regression_by_reg_weight():
    """``--reg-weight 0`` trains on tokens alone (EAGLE-3): the loss is then ce_weight x the KL term; with
    weight 1 the smooth-L1 distance of f^ from f counts too, each pass weighted pass_decay^u."""
    from models import eagle as EG
    from models.eagle import split_trainable

    ecfg = EagleConfig(TINY, head_tokens=40)
    rng = np.random.default_rng(1)
    hp = random_head(ecfg, TINY_PARAMS, 3, 0.1, np.sort(rng.choice(TINY.vocab_size, 40, replace=False)))
    trainable, ids = split_trainable(hp)
    rows = EagleDrafter(ecfg).draft_params(TINY_PARAMS, hp)[1]["rows"]
    feats = jnp.asarray(rng.normal(size=(2, 9, TINY.hidden)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 9)), jnp.int32)
    mask = np.ones((2, 8), bool)
    mask[0, 5:] = mask[1, :2] = False  # holes: the means are over the masked positions only

    # The expected terms from the test's inputs in NumPy (float64). Only the head's rollout f^ [U, B, w, E] comes
    # from the library (``head_unrolled``, checked against drafting in tests/test_eagle.py), fed as its
    # docstring says: true f_i = feats[:, :-1], tokens x_{i+1} = tokens[:, 1:]. Per pass u: reg = masked mean
    # over positions of mean_E smooth-L1(f^ - f_{i+1}) (Huber, delta 1: 0.5 d^2 where |d| <= 1, |d| - 0.5
    # beyond); kl = masked mean of KL(p || q) over the head's N tokens, p = softmax(f_{i+1} . rows^T) (the
    # target on the subset), q = softmax(f^ . rows^T); agree = argmax q == argmax p; loss = sum_u decay_u
    # (reg_weight reg_u + ce_weight kl_u) / sum_u decay_u, decay_u = pass_decay^u.
    f_hat = EG.head_unrolled(ecfg, hp, {"embed": TINY_PARAMS["embed"]}, feats[:, :-1], tokens[:, 1:], 2)
    f_hat = np.asarray(f_hat, np.float64)
    target = np.asarray(feats, np.float64)[:, 1:]
    d = np.abs(f_hat - target[None])
    reg = np.mean(np.where(d <= 1.0, 0.5 * d * d, d - 0.5), axis=-1)  # [U, B, w]
    w_rows = np.asarray(rows, np.float64)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    logp = log_softmax(target @ w_rows.T)[None]  # [1, B, w, N]
    logq = log_softmax(f_hat @ w_rows.T)  # [U, B, w, N]
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)  # [U, B, w]
    agree = (np.argmax(logq, -1) == np.argmax(logp, -1)).astype(np.float64)
    per_pass = lambda x: (x * mask).sum(axis=(1, 2)) / mask.sum()  # noqa: E731
    assert np.all(per_pass(reg) > 0.05) and np.all(per_pass(kl) > 0.05)  # both terms far from 0: they count
    decay = np.array([1.0, 0.5])
    out = {}
    for rw in (0.0, 1.0):
        args = SimpleNamespace(pass_decay=0.5, unroll=2, noise=0.0, ce_weight=0.3, reg_weight=rw)
        fn = train_eagle.make_loss(ecfg, args)
        hm = jnp.asarray(mask)
        loss, m = fn(trainable, ids, {"embed": TINY_PARAMS["embed"]}, rows, feats, tokens, hm, hm, None)
        # float32 sums of ~16 positions x 64 features against float64: rtol 1e-5 (reg), 1e-4 (kl's log-softmax).
        np.testing.assert_allclose(np.asarray(m["reg"]), per_pass(reg), rtol=1e-5, atol=0)
        np.testing.assert_allclose(np.asarray(m["kl"]), per_pass(kl), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(m["agree"]), per_pass(agree), rtol=0, atol=1e-6)
        want = np.sum(decay * (rw * per_pass(reg) + 0.3 * per_pass(kl))) / decay.sum()
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=0)
        out[rw] = float(loss)
    assert out[1.0] > out[0.0]


def test_trainer_refuses_a_cached_head_or_checkpoint_made_with_other_settings(tmp_path, monkeypatch):
    """A finished head under --name was printed and exported as this run's result whatever the settings, and a
    checkpoint was resumed on another schedule; now the first run records its training settings and a later
    one with other values is refused, naming them (settings that only change the evaluation do not count).
    Every end token is in a fresh head's map, and --force cannot delete the head --init-from names."""
    out, ev = str(tmp_path / "run"), str(tmp_path / "run" / "eval.json")
    first = train_eagle.parse_args(["--lr", "3e-4"])
    train_eagle.check_same_run(train_eagle.parse_args(["--lr", "5e-4"]), out, ev)  # stopped before a checkpoint
    train_eagle.check_same_run(first, out, ev)  # nothing saved yet: this run's settings replace those
    # The checkpoint manager makes ckpt/ when it starts, before any step is saved: an empty one holds nothing,
    # so a run with other settings is accepted and its settings recorded (it was refused as a saved run).
    os.makedirs(os.path.join(out, "ckpt"))
    train_eagle.check_same_run(train_eagle.parse_args(["--lr", "5e-4"]), out, ev)
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["lr"] == 5e-4
    train_eagle.check_same_run(first, out, ev)  # and replaced again
    os.makedirs(os.path.join(out, "ckpt", "50"))  # its first checkpoint (step 50)
    train_eagle.check_same_run(first, out, ev)  # the same run again (a resume): accepted
    train_eagle.check_same_run(train_eagle.parse_args(["--lr", "3e-4", "--ckpt-every", "10"]), out, ev)
    train_eagle.check_same_run(train_eagle.parse_args(["--lr", "3e-4", "--gamma", "5", "--no-eval"]), out, ev)
    with pytest.raises(SystemExit, match=r"other settings \(epochs: .* there, 6 here, lr: 0.0003 there, 0.001 here\)"):
        train_eagle.check_same_run(train_eagle.parse_args(["--lr", "1e-3", "--epochs", "6"]), out, ev)

    answers = [np.array([5, 5, 9])]
    args = SimpleNamespace(init_from="", remap=False, head_tokens=3)
    np.testing.assert_array_equal(train_eagle.draft_vocabulary(args, answers, 12, eos_ids=[0, 11]), [0, 5, 11])

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    head_dir = tmp_path / "cache" / "eagle" / "mine" / "head"
    head_dir.mkdir(parents=True)
    (head_dir / "meta.json").write_text("{}")
    with pytest.raises(SystemExit, match="--force would delete .* which holds the head --init-from mine names"):
        train_eagle.main(["--name", "mine", "--init-from", "mine", "--force"])
    assert (head_dir / "meta.json").exists()


def test_cached_self_written_batches_are_checked_against_the_held_out_prompts(tmp_path):
    """The held-out check ran only when a batch was written: a prompt added to the evaluation set later could
    be restated by a cached batch and still be trained on."""
    held = ["Write a haiku about frost on the window glass"]
    ok, bad = tmp_path / "self_0000.npz", tmp_path / "self_0001.npz"
    np.savez(ok, prompts=np.asarray(["How do I bake bread at home?"]))
    np.savez(bad, prompts=np.asarray(["Tell me a story", "write a haiku about the frost on window glass"]))
    eagle_data.check_cached_prompts([str(ok)], held)
    with pytest.raises(SystemExit, match=r"self_0001.npz: its request 'write a haiku .* too close to a held-out"):
        eagle_data.check_cached_prompts([str(ok), str(bad)], held)


def test_cached_docstring_files_must_hold_what_this_run_would_write(tmp_path, monkeypatch, smollm2):
    """The docstring cache is keyed on width and seed only, but --feature-batch sets the passages per file:
    a rerun with another value reused the old files and wrote duplicate passages after them. Features are
    stand-ins here (zeros): only which passages land in which file is checked."""
    from types import SimpleNamespace

    monkeypatch.setattr(eagle_data, "feature_fn", lambda cfg: lambda p, t: np.zeros((*t.shape, cfg.hidden)))
    target = SimpleNamespace(tokenizer=smollm2.tokenizer, config=smollm2.config, params=None)
    args = train_eagle.parse_args(["--doc-tokens", "2000", "--doc-width", "64", "--feature-batch", "2"])
    files = eagle_data.generate_doc_data(args, target, str(tmp_path))
    assert eagle_data.generate_doc_data(args, target, str(tmp_path)) == files  # the same run: reused
    args = dataclasses.replace(args, feature_batch=4)
    with pytest.raises(SystemExit, match=r"docs_0000.npz holds other passages .* from --feature-batch 4"):
        eagle_data.generate_doc_data(args, target, str(tmp_path))
