"""Draft models (models/draft.py): distillation, checkpoints across device layouts, compatibility checks,
losslessness with a frequent-token head (greedy on the real model, exact distribution on tiny Llamas)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TEST_XLA_FLAGS
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tk_models
from toy_models import MisreportedQ, chi2_critical, chi_square, exact_causal_distribution

from jspec import decode as dec
from jspec.drafters import ModelDrafter
from models import cpu_kernels
from models import draft as D
from models.llama import LlamaConfig, forward, init_cache, init_random_params, make_model, unstack_layers
from models.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET_CFG = LlamaConfig(
    vocab_size=48, hidden=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64, name="tiny-target"
)


@pytest.fixture(scope="module")
def tiny_target():
    # std 0.3: peaked, position-dependent distributions (the 0.02 default is nearly uniform).
    return make_model(TARGET_CFG), init_random_params(TARGET_CFG, jax.random.key(0), std=0.3)


@pytest.fixture(scope="module")
def distilled(tiny_target):
    """On-policy data from the tiny target, its cached top-k log-probs, and a 1-layer, 40-token-head draft
    before and after 30 AdamW steps: (dcfg, params0, params, batch, loss0, loss1)."""
    model, tparams = tiny_target
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 48, size=int(n)).tolist() for n in rng.integers(2, 7, size=16)]
    out = dec.decode(model, tparams, prompts, max_new_tokens=24, temperature=1.0, seed=3)
    width = 32
    tokens = np.zeros((16, width), np.int32)
    mask = np.zeros((16, width), bool)
    for r, (p, t) in enumerate(zip(prompts, out.tokens)):
        tokens[r, : len(p) + len(t)] = p + t
        mask[r, len(p) - 1 : len(p) + len(t) - 1] = True
    t_logp, t_ids = jax.jit(D.teacher_topk, static_argnums=(0, 3))(TARGET_CFG, tparams, jnp.asarray(tokens), 16)
    batch = (jnp.asarray(tokens), jnp.asarray(mask), t_logp, t_ids)
    dcfg = D.draft_config(TARGET_CFG, 1, head_size=40)
    token_map = D.frequent_token_map(D.token_counts(out.tokens, 48), 40)
    params0 = D.init_from_target(dcfg, tparams, token_map)
    trainable, frozen = D.split_trainable(params0)
    opt = optax.adamw(3e-3)
    opt_state = opt.init(trainable)
    step = D.make_train_step(dcfg, opt)
    loss = jax.jit(D.distill_loss, static_argnums=0)
    loss0 = loss(dcfg, params0, *batch)
    for _ in range(30):
        trainable, opt_state, _ = step(trainable, frozen, opt_state, *batch)
    params = D.merge_params(trainable, frozen)
    return dcfg, params0, params, batch, loss0, loss(dcfg, params, *batch)


def np_distill_loss(draft_logits, mask, t_logp, t_ids, renormalise=True):
    """``distill_loss`` from its docstring, NumPy float64. draft_logits [B, T, V] (-inf outside the draft's
    tokens), mask [B, T], teacher top-k t_logp / t_ids [B, T, k]. p~ = the teacher's top-k probabilities kept
    where the draft has the token, renormalised; kl = sum p~ (log p~ - log q), q = softmax(draft_logits),
    averaged over masked positions with at least one kept token. agree (draft argmax == teacher top-1) and
    support (teacher mass on kept tokens) are averaged over all masked positions. renormalise=False: p~ is the
    kept top-k probabilities as they are (only to show that the renormalisation matters)."""
    logits = np.asarray(draft_logits, np.float64)
    finite = np.isfinite(logits)
    z = np.where(finite, logits, -np.inf)
    logq = z - z.max(-1, keepdims=True)
    logq = logq - np.log(np.exp(logq).sum(-1, keepdims=True))
    t_logp, t_ids, mask = np.asarray(t_logp, np.float64), np.asarray(t_ids), np.asarray(mask, bool)
    kept = np.take_along_axis(finite, t_ids, -1)  # [B, T, k]
    p = np.where(kept, np.exp(t_logp), 0.0)
    support = p.sum(-1)
    norm = np.log(np.maximum(support, 1e-300))[..., None] if renormalise else 0.0
    log_pt = np.where(kept, t_logp - norm, 0.0)  # log p~
    logq_t = np.where(kept, np.take_along_axis(logq, t_ids, -1), 0.0)
    kl = np.sum(np.where(kept, np.exp(log_pt) * (log_pt - logq_t), 0.0), -1)
    m = mask & kept.any(-1)
    agree = np.argmax(logits, -1) == t_ids[..., 0]
    return {"kl": kl[m].mean(), "agree": agree[mask].mean(), "support": support[mask].mean()}


def test_distillation_steps_reduce_kl(distilled):
    dcfg, params0, params, batch, (kl0, m0), (kl1, m1) = distilled
    assert np.isfinite(float(kl0)) and float(kl1) < 0.6 * float(kl0), (float(kl0), float(kl1))
    assert float(m1["agree"]) > float(m0["agree"])
    # The loss and metrics before and after training against the NumPy formula over the draft model's own
    # full-vocabulary logits (its forward, -inf outside the 40 tokens): KL(p~ || q), not KL(q || p~), and p~
    # renormalised over the teacher's top-16 tokens the draft has. 8 of 48 tokens are outside the head, so
    # the renormalisation changes the value (checked below: by far more than the tolerance, rtol 1e-4 for
    # float32 against float64).
    tokens, mask, t_logp, t_ids = batch
    for p, loss, m in ((params0, kl0, m0), (params, kl1, m1)):
        ref = np_distill_loss(_logits(dcfg, p, tokens), mask, t_logp, t_ids)
        np.testing.assert_allclose(float(loss), ref["kl"], rtol=1e-4, atol=0)
        for name in ("kl", "agree", "support"):
            np.testing.assert_allclose(float(m[name]), ref[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert ref["support"] < 0.99  # teacher mass outside the head: p~ is a restriction, not the top-k as is
    unnormalised = np_distill_loss(_logits(dcfg, params, tokens), mask, t_logp, t_ids, renormalise=False)["kl"]
    assert abs(unnormalised - ref["kl"]) > 1e-2 * ref["kl"], (unnormalised, ref["kl"])
    # Only float leaves train; the embedding and the head's integer maps are frozen.
    np.testing.assert_array_equal(params["embed"]["embedding"], params0["embed"]["embedding"])
    np.testing.assert_array_equal(params["head"]["ids"], params0["head"]["ids"])
    assert not np.array_equal(params["head"]["weight"], params0["head"]["weight"])


def _logits(dcfg, params, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return jax.jit(D.make_draft_model(dcfg).apply)(params, tokens, pos, init_cache(dcfg.llama, b, t))[0]


def test_frequent_token_head_is_minus_inf_outside_the_subset(distilled):
    dcfg, _, params, (tokens, *_), _, _ = distilled
    logits = np.asarray(_logits(dcfg, params, tokens))
    assert logits.shape == (16, 32, 48)
    outside = np.setdiff1d(np.arange(48), np.asarray(params["head"]["ids"]))
    assert outside.size == 8 and np.all(logits[..., outside] == -np.inf)
    assert np.all(np.isfinite(np.delete(logits, outside, axis=-1)))


def test_frequent_token_map_counts_then_low_ids_and_always():
    counts = np.zeros(10)
    counts[[7, 3, 9]] = [5, 5, 1]
    np.testing.assert_array_equal(D.frequent_token_map(counts, 4), [0, 3, 7, 9])
    np.testing.assert_array_equal(D.frequent_token_map(counts, 4, always=[8]), [3, 7, 8, 9])


def test_checkpoint_round_trip_identical_logits(distilled, tmp_path):
    dcfg, _, params, (tokens, *_), _, _ = distilled
    D.save_draft(tmp_path / "d", dcfg, params)
    want = np.asarray(_logits(dcfg, params, tokens))
    loaded = D.load_draft(tmp_path / "d", target_config=TARGET_CFG)
    assert loaded.config == dcfg and loaded.model is D.make_draft_model(dcfg)
    # The draft's context travels with it: decode refuses rows past it (it drafted garbage there).
    assert loaded.model.max_positions == dcfg.llama.max_positions
    np.testing.assert_array_equal(np.asarray(_logits(loaded.config, loaded.params, tokens)), want)
    # Onto an explicit device sharding (how a checkpoint moves between layouts).
    dev = jax.devices()[-1]
    _, placed = D.restore_draft(tmp_path / "d", sharding=jax.sharding.SingleDeviceSharding(dev))
    assert all(leaf.sharding.device_set == {dev} for leaf in jax.tree.leaves(placed))
    np.testing.assert_array_equal(np.asarray(_logits(dcfg, placed, tokens)), want)
    # In the CPU decode layout (per-layer fused weights), as an unstacked target loads its draft.
    flat = D.load_draft(tmp_path / "d", target_config=TARGET_CFG, unstacked=True).params
    assert isinstance(flat["layers"], tuple) and "w_gate_up" in flat["layers"][0]["mlp"]
    # With the CPU kernel, the frequent-token head is packed too (subset_logits then runs on it).
    assert isinstance(flat["head"]["weight"], cpu_kernels.PackedMatrix) == cpu_kernels.available()
    # Other kernels, other summation orders: f32 rounding (1.7e-5 on a logit of 0.55 under the suite's XLA flags).
    np.testing.assert_allclose(np.asarray(_logits(dcfg, flat, tokens)), want, atol=3e-5, rtol=1e-5)
    # In bfloat16: float leaves cast, integer maps untouched.
    bcfg, bf = D.restore_draft(tmp_path / "d", dtype="bfloat16")
    assert bf["layers"]["attn"]["wq"].dtype == jnp.bfloat16 and bf["head"]["ids"].dtype == jnp.int32
    assert bcfg.llama.dtype == "bfloat16"


_TWO_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from models import draft as D
    from models.llama import init_cache
    assert len(jax.devices()) == 2, jax.devices()
    path, tokens_file, want_file = sys.argv[1:]
    mesh = Mesh(np.array(jax.devices()), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    def layout(key, shape):  # head rows and MLP columns split over the two devices, the rest replicated
        if key == "['head']['weight']":
            return NamedSharding(mesh, P("x", None))
        if key.endswith("['w_gate']") or key.endswith("['w_up']"):
            return NamedSharding(mesh, P(None, None, "x"))
        return NamedSharding(mesh, P())
    loaded = D.load_draft(path, sharding=layout)
    w = loaded.params["head"]["weight"]
    assert len(w.addressable_shards) == 2 and w.addressable_shards[0].data.shape[0] == w.shape[0] // 2
    tokens = jnp.asarray(np.load(tokens_file))
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    got = jax.jit(loaded.model.apply)(loaded.params, tokens, pos, init_cache(loaded.config.llama, b, t))[0]
    want = np.load(want_file)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got)[fin], want[fin], atol=1e-5, rtol=1e-5)
    print("OK two-device restore")
    """
)


def test_restore_onto_two_device_layout(distilled, tmp_path):
    """A draft saved on one device restores onto a 2-device mesh (head rows and MLP columns sharded) with
    the same logits; fake CPU devices need a fresh process."""
    dcfg, _, params, (tokens, *_), _, _ = distilled
    D.save_draft(tmp_path / "d", dcfg, params)
    np.save(tmp_path / "tokens.npy", np.asarray(tokens))
    np.save(tmp_path / "want.npy", np.asarray(_logits(dcfg, params, tokens)))
    flags = f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICE_SCRIPT, str(tmp_path / "d"), str(tmp_path / "tokens.npy")]
        + [str(tmp_path / "want.npy")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0 and "OK two-device restore" in proc.stdout, proc.stdout + proc.stderr


# ---- compatibility ----------------------------------------------------------------------------------------


def _tokenizer(tokens: list[str]) -> Tokenizer:
    backend = HFTokenizer(tk_models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    return Tokenizer(backend, bos_id=None, eos_id=1)


def test_vocab_size_mismatch_refused(distilled, tiny_target, tmp_path):
    dcfg, _, params, _, _, _ = distilled
    with pytest.raises(D.DraftMismatchError, match=r"vocabulary mismatch: draft 'd' has 40 tokens, target 't' has 48"):
        D.check_compatible(48, 40, target_name="t", draft_name="d")
    D.save_draft(tmp_path / "d", dcfg, params)
    with pytest.raises(D.DraftMismatchError, match="has 48 tokens, target 'big' has 64"):
        D.load_draft(tmp_path / "d", target_config=TARGET_CFG.replace(vocab_size=64, name="big"))
    # The decoder refuses it too (its own check, before anything compiles).
    small = D.draft_config(TARGET_CFG.replace(vocab_size=40), 1)
    model, tparams = tiny_target
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        dec.decode(model, tparams, [[1, 2]], drafter=ModelDrafter(D.make_draft_model(small)), draft_params={})


def test_same_size_different_tokenizer_refused(distilled, tmp_path):
    dcfg, _, params, _, _, _ = distilled
    words = [f"w{i}" for i in range(48)]
    other = list(words)
    other[5], other[6] = other[6], other[5]  # same size, same set, different ids
    tok, tok_other = _tokenizer(words), _tokenizer(other)
    with pytest.raises(D.DraftMismatchError, match=r"token id 5 is 'w6' for draft .* but 'w5' for target"):
        D.check_compatible(48, 48, D.tokenizer_tokens(tok), D.tokenizer_tokens(tok_other))
    D.save_draft(tmp_path / "d", dcfg, params, tokenizer=tok)
    D.load_draft(tmp_path / "d", target_config=TARGET_CFG, tokenizer=tok)  # the same tokenizer passes
    with pytest.raises(D.DraftMismatchError, match=r"token id 5 is 'w5' for draft .* but 'w6' for target"):
        D.load_draft(tmp_path / "d", target_config=TARGET_CFG, tokenizer=tok_other)
    # Loaded models (what the loaders return) are checked the same way, special ids included.
    tgt = type("M", (), {"config": TARGET_CFG, "tokenizer": tok})
    drf = type("M", (), {"config": dcfg.llama, "tokenizer": Tokenizer(tok.backend, bos_id=None, eos_id=2)})
    with pytest.raises(D.DraftMismatchError, match="eos_id is id 2 for draft"):
        D.check_models_compatible(tgt, drf)
    # A checkpoint without a tokenizer (an HF directory without tokenizer.json) was checked on size alone; the
    # two configs' special ids are compared now (config with config: a tokenizer's EOS may be a chat turn's end
    # while the config keeps the base model's).
    tgt = type("M", (), {"config": TARGET_CFG.replace(eos_id=1), "tokenizer": tok})
    bare = type("M", (), {"config": dcfg.llama.replace(eos_id=2, bos_id=None), "tokenizer": None})
    with pytest.raises(D.DraftMismatchError, match="eos_id is id 2 for draft"):
        D.check_models_compatible(tgt, bare)
    D.check_models_compatible(tgt, type("M", (), {"config": dcfg.llama.replace(eos_id=1), "tokenizer": None}))
    chat = type("M", (), {"config": TARGET_CFG.replace(eos_id=5), "tokenizer": tok})  # tokenizer EOS 1, config 5
    D.check_models_compatible(chat, type("M", (), {"config": dcfg.llama.replace(eos_id=5), "tokenizer": None}))


# ---- losslessness ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_speculative_equals_plain_real_model(smollm2):
    """SmolLM2-135M target, a 2-layer draft copied from its first layers with a 4096-token head (untrained:
    mostly rejected, which is the harder path), batch 2 with different prompt lengths."""
    tok = smollm2.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode_chat([{"role": "user", "content": "List three colours of the rainbow and explain why it forms."}]),
    ]
    assert len(prompts[0]) != len(prompts[1])
    dcfg = D.draft_config(smollm2.config, 2, head_size=4096)
    params = D.init_from_target(dcfg, smollm2.params, D.frequent_token_map(np.zeros(49152), 4096, [tok.eos_id]))
    kw = dict(max_new_tokens=24, eos_ids=[tok.eos_id])
    plain = dec.decode(smollm2.model, smollm2.params, prompts, **kw)
    spec = dec.decode(
        smollm2.model,
        smollm2.params,
        prompts,
        drafter=ModelDrafter(D.make_draft_model(dcfg)),
        draft_params=params,
        gamma=3,
        **kw,
    )
    assert spec.tokens == plain.tokens
    assert spec.stats["proposed"] > 0 and spec.stats["accepted"] < spec.stats["proposed"]


# Tiny Llamas over 5 tokens: the draft keeps the target's first layer and a 4-token head, so token 4 has q = 0
# everywhere (never proposed) and only the residual max(0, p - q) can emit it.
V = 5
TINY_T = LlamaConfig(
    vocab_size=V, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, ffn=32, name="tiny5"
)
GROUPS = [  # (sampling, prompt, max_new_tokens): with K = 3, budgets 5/3/4 let rows draft 3/1/2 in round one
    (dict(temperature=0.8, top_k=3), [1, 3, 0], 5),
    (dict(temperature=1.2, top_p=0.85), [2, 0, 4, 1, 3, 3], 5),
    (dict(temperature=1.0), [1, 3, 0], 3),
    (dict(temperature=1.0, top_k=4, top_p=0.9), [2, 0, 4, 1, 3, 3], 4),
]
ROWS_PER_GROUP = 30_000


def _tiny_pair():
    tparams = init_random_params(TINY_T, jax.random.key(11), std=0.6)
    dcfg = D.draft_config(TINY_T, 1, head_size=4)
    dparams = D.init_from_target(dcfg, tparams, np.arange(4))
    dparams["head"]["weight"] = dparams["head"]["weight"] * 1.3  # a sharper, different draft
    return make_model(TINY_T), tparams, dcfg, dparams


def _exact(tparams, prompt, n_new, sampling) -> dict:
    """P(sequence) for every n_new-token continuation (toy_models.exact_causal_distribution)."""

    def logits_fn(rows):
        b, t = rows.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return forward(TINY_T, tparams, rows, pos, init_cache(TINY_T, b, t))[0]

    return exact_causal_distribution(logits_fn, V, prompt, n_new, **sampling)


def _grouped_decode(drafter):
    """Every group's rows in ONE decode call (4 groups x ROWS_PER_GROUP) -> (output, target params)."""
    model, tparams, dcfg, dparams = _tiny_pair()
    n = ROWS_PER_GROUP
    prompts, budgets, cols = [], [], {"temperature": [], "top_k": [], "top_p": []}
    for sampling, prompt, budget in GROUPS:
        prompts += [prompt] * n
        budgets += [budget] * n
        for key, default in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
            cols[key] += [sampling.get(key, default)] * n
    out = dec.decode(
        model,
        tparams,
        prompts,
        drafter=drafter(D.make_draft_model(dcfg)),
        draft_params=dparams,
        gamma=3,
        max_new_tokens=budgets,
        max_len=16,  # the default rounds the cache up to 128 slots: 8x the memory traffic at 120k rows
        seed=5,
        **cols,
    )
    assert out.lengths == budgets
    return out, tparams


def _group_statistics(out, tparams):
    """(statistic, critical value) of each group's whole sequences against the exact target distribution."""
    n = ROWS_PER_GROUP
    stats = []
    for g, (sampling, prompt, budget) in enumerate(GROUPS):
        toks = np.asarray(out.tokens[g * n : (g + 1) * n])
        exact = _exact(tparams, prompt, budget, sampling)
        assert any(4 in s for s in exact)  # the token the draft never proposes must still appear
        stat, df = chi_square(toks, exact)
        stats.append((stat, chi2_critical(df)))
    return stats


def test_distribution_tiny_llama_draft_with_subset_head_ragged():
    """120k rows in ONE call (4 groups: temperature, top-k, top-p, two prompt lengths, budgets 5/3/4 so
    rows draft 3, 1 or 2 candidates in the same round), each group's whole sequences vs the exact target
    distribution: chi-square at a 1e-5 false-alarm level (statistics 57-122 against critical values 108-230
    when this was written)."""
    out, tparams = _grouped_decode(ModelDrafter)
    assert 0.3 < out.stats["acceptance_rate"] < 0.95, out.stats["acceptance_rate"]
    assert all(c > 0 for c in out.stats["proposed_at"])
    for g, (stat, critical) in enumerate(_group_statistics(out, tparams)):
        assert stat < critical, (g, GROUPS[g], stat, critical)


def test_distribution_check_has_power_at_these_sample_sizes():
    """The same rows per group, seed and statistic reject every group when q is misreported by 10% (mixed
    with the uniform distribution): the test above would catch a verifier that is only slightly lossy
    (statistics 322-1299 against critical values 108-230 when this was written)."""
    out, tparams = _grouped_decode(lambda model: MisreportedQ(ModelDrafter(model), 0.9))
    for g, (stat, critical) in enumerate(_group_statistics(out, tparams)):
        assert stat > critical, (g, GROUPS[g], stat, critical)


def test_ragged_rows_draft_different_lengths_greedy():
    """Per-row budgets and prompt lengths: each row drafts what it may (max_draft differs per row) and
    greedy speculative output equals greedy plain output row by row."""
    model, tparams, dcfg, dparams = _tiny_pair()
    prompts = [[1], [2, 0, 4], [3, 3, 1, 0, 2, 2, 1], [0, 1], [4, 4, 4, 4], [2, 1, 0]]
    budgets = [1, 2, 3, 5, 8, 13]
    plain = dec.decode(model, tparams, prompts, max_new_tokens=budgets)
    prep = dec.prepare(
        model,
        tparams,
        prompts,
        drafter=ModelDrafter(D.make_draft_model(dcfg)),
        draft_params=dparams,
        gamma=3,
        max_new_tokens=budgets,
    )
    st = prep.fn(*prep.args)  # the raw loop state keeps per-row statistics
    proposed = np.asarray(st.stats.proposed)
    spec = prep.run()
    assert spec.tokens == plain.tokens and spec.lengths == budgets
    assert proposed[0] == 0 and proposed[1] == 0  # budgets 1 and 2 leave no room for any candidate
    assert proposed[2] == 1 and len(set(proposed.tolist())) >= 4
    assert spec.stats["accepted"] > 0 and spec.stats["accepted"] < spec.stats["proposed"]


@pytest.mark.parametrize("packed", [False, True])
def test_init_from_untied_target_in_the_unstacked_layouts(packed):
    """An untied target in the CPU decode layout (fused per-layer weights; with ``packed`` its matrices and
    lm_head are PackedMatrix panels) gives the draft the target's own weights: the source layers, the whole
    [E, V] head, or for a frequent-token head the head's columns for those ids as rows [N, E]."""
    if packed and not cpu_kernels.available():
        pytest.skip("the CPU matmul kernel is not built here")
    cfg = TARGET_CFG.replace(tie_embeddings=False, name="tiny-untied")
    stacked = init_random_params(cfg, jax.random.key(5), std=0.3)
    flat = unstack_layers(stacked, packed=packed)
    assert isinstance(flat["lm_head"]["kernel"], cpu_kernels.PackedMatrix) == packed
    kernel = np.asarray(stacked["lm_head"]["kernel"])  # [E, V]
    full = D.init_from_target(D.draft_config(cfg, 2, layers=[0, 2]), flat)
    np.testing.assert_array_equal(np.asarray(full["lm_head"]["kernel"]), kernel)
    np.testing.assert_array_equal(np.asarray(full["embed"]["embedding"]), np.asarray(stacked["embed"]["embedding"]))
    for w, src in zip(jax.tree.leaves(full["layers"]), jax.tree.leaves(stacked["layers"])):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(src)[[0, 2]])
    ids = np.array([1, 5, 7, 40], np.int32)
    sub = D.init_from_target(D.draft_config(cfg, 1, head_size=4), flat, ids)
    np.testing.assert_array_equal(np.asarray(sub["head"]["weight"]), kernel[:, ids].T)
    assert "lm_head" not in sub


def test_frozen_layers_stay_the_targets_under_weight_decay(tiny_target, distilled):
    """--frozen-layers zeroed the first layers' gradients, but AdamW's decay (-lr * wd * w) needs none: the
    "frozen" layers shrank every step. A 2-layer draft, layer 0 frozen, 3 AdamW steps with weight decay."""
    _, tparams = tiny_target
    _, _, _, batch, _, _ = distilled
    dcfg = D.draft_config(TARGET_CFG, 2, head_size=0)
    params0 = D.init_from_target(dcfg, tparams)
    trainable, frozen = D.split_trainable(params0)
    opt = optax.adamw(1e-2, weight_decay=0.5)
    opt_state = opt.init(trainable)
    step = D.make_train_step(dcfg, opt, frozen_layers=1)
    for _ in range(3):
        trainable, opt_state, _ = step(trainable, frozen, opt_state, *batch)
    for name, w0 in jax.tree_util.tree_leaves_with_path(params0["layers"]):
        w = dict(jax.tree_util.tree_leaves_with_path(trainable["layers"]))[name]
        np.testing.assert_array_equal(np.asarray(w)[0], np.asarray(w0)[0], err_msg=str(name))  # frozen layer 0
        assert not np.array_equal(np.asarray(w)[1], np.asarray(w0)[1]), name  # layer 1 trains
