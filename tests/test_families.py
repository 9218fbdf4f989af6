"""Model families beyond Llama 2 (Gemma 2, Gemma 3 text, Qwen3, Llama 3.1/3.2 RoPE scaling), each against transformers'
own implementation on a tiny random configuration built and saved here (no download): logits over a 64-token
prompt, 32 greedy tokens, speculative decodes with an n-gram chain and an n-gram tree, both layer layouts, the chat
template; the sliding window on its own; refusals by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_torch

from jspec import decode as dec
from jspec.ngram import NgramDrafter, NgramTreeDrafter
from jspec.tree import TreeSpec, ancestor_mask
from models import llama
from models.checkpoint import CheckpointError
from models.hf_loader import config_from_hf, load_hf
from models.registry import load

pytestmark = requires_torch

VOCAB = 128
# A prompt with repeats, so the n-gram drafters find continuations; 64 tokens pass every sliding window below.
_RNG = np.random.default_rng(0)
PROMPT = np.concatenate([_RNG.integers(3, VOCAB, 24), _RNG.integers(3, VOCAB, 8)] * 2).astype(np.int32)
assert PROMPT.shape == (64,)
NEW = 32
WINDOW = 8
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]
TEMPLATES = {
    # Gemma's shape: the assistant is "model", turns end with <end_of_turn>, BOS written by the template.
    "gemma": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    # ChatML (Qwen3), with its empty think block on an assistant turn.
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n\n' + m['content'] }}"
        "{{ '<end_of_turn>' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>assistant\n\n' }}"
        "{% endif %}"
    ),
}
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads (16), and a width the CPU attention kernel takes (unstacked layout)
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # large enough that a mapping error moves logits well past the tolerance
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small: the scaled and interpolated bands both hold frequencies
    "rope_theta": 5000.0,
}


def _family_config(family: str):
    import transformers

    if family == "gemma2":  # soft caps low enough to bend the scores and logits these weights give
        kw = dict(query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
        return transformers.Gemma2Config(**COMMON, num_hidden_layers=3, sliding_window=WINDOW, **kw), "gemma"
    if family == "gemma3":  # untied; global layers with linear RoPE scaling at their own base, local ones at 1e4
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        }
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        cfg = transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, sliding_window=WINDOW, layer_types=types, rope_parameters=rope,
            query_pre_attn_scalar=32, tie_word_embeddings=False,
        )  # fmt: skip
        return cfg, "gemma"
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False), "chatml"
    tied = family == "llama3.2"  # 3.2 ties its head to the embedding, 3.1 does not
    cfg = transformers.LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=tied)
    return cfg, "llama3"


def _save_tokenizer(path, template: str) -> None:
    """A byte-free BPE tokenizer.json (single letters plus the specials) and a tokenizer_config.json with the
    family's chat template: what transformers' AutoTokenizer and the registry both read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as tk_models

    vocab = {t: i for i, t in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate("abcdefgh \n")}
    backend = HFTokenizer(tk_models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.add_special_tokens(SPECIALS)
    backend.save(str(path / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATES[template]}
    tcfg |= {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))


FAMILIES = ["gemma2", "gemma3", "qwen3", "llama3.1", "llama3.2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, saved directory, transformers model in f32) of one tiny random family member."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg, template = _family_config(request.param)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norm weights start at 0 (Gemma) or 1: random ones catch a swapped or unshifted norm
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    _save_tokenizer(path, template)
    return request.param, path, model.float().eval()


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens[None]).long()).logits[0].numpy()


def _our_logits(loaded, tokens: np.ndarray) -> np.ndarray:
    m = loaded.model
    t = len(tokens)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    logits, _ = jax.jit(m.apply)(loaded.params, jnp.asarray(tokens[None]), pos, m.init_cache(1, t + 8))
    return np.asarray(logits[0])


@pytest.mark.fast
def test_logits_match_transformers(family):
    """f32 logits over a 64-token prompt within 1e-4 of transformers', in the stacked and the unstacked layout."""
    name, path, model = family
    want = _torch_logits(model, PROMPT)
    for unstacked in (False, True):
        loaded = load(str(path), unstacked=unstacked)
        assert llama.is_unstacked(loaded.params) == unstacked
        diff = np.abs(_our_logits(loaded, PROMPT) - want).max()
        assert diff <= 1e-4, (name, unstacked, diff)


def test_greedy_and_speculative_decodes_match_transformers(family):
    """32 greedy tokens equal transformers' generate; an n-gram chain (unstacked layout) and an n-gram tree
    (stacked) give the plain tokens. The context (64 + 32) passes every sliding window."""
    import torch

    name, path, model = family
    if name == "llama3.2":
        pytest.skip("Llama 3.1 decodes the same maths; 3.2's tied head is checked by its logits in both layouts")
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(PROMPT[None]).long(), max_new_tokens=NEW, do_sample=False, eos_token_id=None
        )
    want = out[0, len(PROMPT) :].tolist()
    assert len(want) == NEW
    stacked, unstacked = load(str(path)), load(str(path), unstacked=True)
    prompt = [PROMPT.tolist()]
    plain = dec.decode(stacked.model, stacked.params, prompt, max_new_tokens=NEW)
    assert plain.tokens[0] == want, name
    chain = NgramDrafter(vocab_size=VOCAB)
    ngram = dec.decode(unstacked.model, unstacked.params, prompt, drafter=chain, goodput=False, max_new_tokens=NEW)
    tree = NgramTreeDrafter(2, 3, vocab_size=VOCAB)
    treed = dec.decode(stacked.model, stacked.params, prompt, drafter=tree, goodput=False, max_new_tokens=NEW)
    assert ngram.tokens[0] == want and treed.tokens[0] == want, name
    assert ngram.stats["accepted"] > 0 and treed.stats["accepted"] > 0, (ngram.stats, treed.stats)


def test_chat_template_is_the_tokenizers(family):
    """The registry's tokenizer renders the family's chat template (tokenizer_config.json) as transformers does."""
    import transformers

    name, path, _ = family
    tok = load(str(path)).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "abc "}, {"role": "assistant", "content": "dea"}]
    chat.append({"role": "user", "content": "h"})
    text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(chat) == text
    ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.encode_chat(chat) == ids
    assert ("<start_of_turn>" in text) == (name != "qwen3")


def test_loaded_config_flags(family):
    """What each family switches on, read from its config.json."""
    name, path, _ = family
    cfg = config_from_hf(path)
    gemma = name.startswith("gemma")
    assert cfg.post_norms == gemma and cfg.activation == ("gelu_tanh" if gemma else "silu")
    assert cfg.qk_norm == (name in ("qwen3", "gemma3"))
    assert cfg.embed_scale == (64**0.5 if gemma else 1.0)
    assert cfg.tie_embeddings == (name in ("gemma2", "llama3.2"))
    assert cfg.sliding_layers == {"gemma2": (0, 2), "gemma3": (0, 2)}.get(name, ())
    assert (cfg.rope_scaling.kind if cfg.rope_scaling else None) == {"gemma3": "linear"}.get(
        name, "llama3" if name.startswith("llama") else None
    )
    assert (cfg.attn_softcap, cfg.final_softcap) == ((4.0, 6.0) if name == "gemma2" else (None, None))
    assert cfg.local_rope_theta == (500.0 if name == "gemma3" else None)


def test_layer_ranges_keep_each_layers_kind(family):
    """LayerSkip runs the target's layer ranges with its own scan, and its exit (and a draft copying target
    layers) is a config of fewer layers: each layer keeps its sliding or full attention and RoPE. Checked on
    Gemma 3 (sliding, full, sliding; local and scaled RoPE) against ``llama.run_layers``."""
    from models.layerskip import run_layer_range

    name, path, _ = family
    if name != "gemma3":
        pytest.skip("Gemma 3 mixes the layer kinds")
    cfg, params = load_hf(path)
    assert cfg.layers_of((1, 2)).sliding_layers == (1,) and cfg.layers_of((1,)).sliding_window is None
    with pytest.raises(ValueError, match=r"sliding-window layers \(0, 2\): a config with num_layers=2 must give"):
        cfg.replace(num_layers=2)
    m = load(str(path)).model
    cache = m.init_cache(1, 64)
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    _, cache = jax.jit(m.apply)(params, jnp.asarray(PROMPT[None, :40]), pos, cache)
    cache = cache.with_lengths(jnp.asarray([40], jnp.int32))
    h = llama.embed(cfg, params, jnp.asarray(PROMPT[None, 40:43]))
    pos = 40 + jnp.arange(3, dtype=jnp.int32)[None]

    @jax.jit
    def both(h, pos, cache):
        return [
            (
                run_layer_range(cfg, params, h, pos, cache, a, b)[0],
                llama.run_layers(cfg, params, h, pos, cache, None, a, b)[0],
            )
            for a, b in [(0, 3), (1, 3), (0, 2)]
        ]

    for mine, lib in jax.device_get(both(h, pos, cache)):
        np.testing.assert_allclose(mine, lib, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------------
# Sliding window on its own: every layer slides (Gemma 2, layer_types all sliding_attention).


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Gemma2Config(
        **COMMON, num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention"] * 2,
        query_pre_attn_scalar=16, attn_logit_softcapping=None, final_logit_softcapping=None,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path_factory.mktemp("sliding")
    model.save_pretrained(path)
    return path, model.eval()


@pytest.mark.fast
def test_tokens_beyond_the_window_are_not_visible(sliding):
    """Two layers of window 4: the last token's logits read tokens at most 2 * 3 positions back. Changing every
    token before that leaves them as they were (to the last bit); changing one inside moves them. Checked against
    transformers' logits too."""
    path, model = sliding
    loaded = load(str(path))
    base = PROMPT[:40].copy()
    far = base.copy()
    far[: 40 - 7] = (far[: 40 - 7] + 1) % VOCAB  # everything but the last 7 tokens
    near = base.copy()
    near[40 - 7] = (near[40 - 7] + 1) % VOCAB  # the farthest token the receptive field reaches
    a, b, c = (_our_logits(loaded, x)[-1] for x in (base, far, near))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    assert np.abs(_our_logits(loaded, far) - _torch_logits(model, far)).max() <= 1e-4


@pytest.mark.parametrize("unstacked", [False, True], ids=["stacked", "unstacked"])
def test_tree_under_the_window_equals_its_paths(sliding, unstacked):
    """A tree call past the window: each node's logits equal a plain chain call of the prefix plus its
    root-to-node path. A node at depth d sits at slot lengths + j with j > d, so the window must be measured
    in positions, not slots, and siblings stay invisible (the tree mask still applies)."""
    path, _ = sliding
    loaded = load(str(path), unstacked=unstacked)
    m, params = loaded.model, loaded.params
    prefix = PROMPT[:30]
    spec = TreeSpec((2, 2, 1))
    parent, depth, _ = spec.arrays
    n = spec.num_nodes
    nodes = _RNG.integers(3, VOCAB, n).astype(np.int32)
    cache = m.init_cache(1, 64)
    pos = jnp.arange(len(prefix), dtype=jnp.int32)[None]
    _, cache = jax.jit(m.apply)(params, jnp.asarray(prefix[None]), pos, cache)
    cache = cache.with_lengths(jnp.asarray([len(prefix)], jnp.int32))
    mask = ancestor_mask(jnp.asarray(parent)[None])
    tree_pos = (len(prefix) + jnp.asarray(depth, jnp.int32))[None]
    tree_logits, _ = jax.jit(m.apply)(params, jnp.asarray(nodes[None]), tree_pos, cache, mask)
    # Every node's root-to-node path after the prefix, right-padded into one batch (padding follows the last
    # real token, so a causal call leaves its logits alone): one compiled chain call for all of them.
    paths = []
    for j in range(n):
        chain, i = [], j
        while i >= 0:
            chain.append(int(nodes[i]))
            i = int(parent[i])
        paths.append(chain[::-1])
    width = len(prefix) + max(map(len, paths))
    seqs = np.zeros((n, width), np.int32)
    for j, p in enumerate(paths):
        seqs[j, : len(prefix) + len(p)] = np.concatenate([prefix, p])
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (n, width))
    chain_logits, _ = jax.jit(m.apply)(params, jnp.asarray(seqs), pos, m.init_cache(n, 64))
    last = np.asarray([len(prefix) + len(p) - 1 for p in paths])
    want = np.asarray(chain_logits)[np.arange(n), last]
    np.testing.assert_allclose(np.asarray(tree_logits[0]), want, atol=2e-5)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_qwen2_and_mistral_sliding_layers_match_transformers(kind, tmp_path):
    """The same window serves the families that used to be refused: Qwen2's layers from max_window_layers on, all
    of Mistral's; logits over the 64-token prompt against transformers'."""
    import torch
    import transformers

    torch.manual_seed(2)
    kw = {**COMMON, "num_hidden_layers": 2, "sliding_window": WINDOW}
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**kw, use_sliding_window=True, max_window_layers=1)
    else:
        cfg = transformers.MistralConfig(**kw)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    assert loaded.config.sliding_layers == ((1,) if kind == "qwen2" else (0, 1))
    assert np.abs(_our_logits(loaded, PROMPT) - _torch_logits(model.float().eval(), PROMPT)).max() <= 1e-4


# Every family flag at once, in shapes a 2x4 mesh splits (8 query heads, 4 KV heads): abstract params only.
ALL_FEATURES = llama.LlamaConfig(
    vocab_size=512, hidden=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, ffn=256, tie_embeddings=False,
    rope_scaling=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 64), local_rope_theta=1000.0, sliding_window=16,
    sliding_layers=(0, 1, 3), qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=128**0.5,
    attn_scale=0.2, attn_softcap=50.0, final_softcap=30.0, name="all-features",
)  # fmt: skip


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("path", ["plain", "static-tree", "layerskip"])
def test_every_feature_lowers_sharded(path, platform):
    """The rules table lays out every new parameter (q/k norms over head_dim, post norms over embed: no new
    logical axis), and the sharded decode lowers on a 2x4 mesh in the layout each platform gets (stacked on TPU,
    the unfused per-layer layout on CUDA), the cache split by the table."""
    from test_lowering_sharded import check_sharded

    from sharding.rules import TABLE

    names = {
        n
        for axes in jax.tree.leaves(llama.param_logical_axes(ALL_FEATURES), is_leaf=lambda x: isinstance(x, tuple))
        for n in axes
    }
    assert names <= set(TABLE)
    check_sharded(ALL_FEATURES, "8-data-tensor", path, platform)


# --------------------------------------------------------------------------------------------------------
# Refusals: unsupported features by name at load time; tensors by name with expected and found shapes.


def _rewrite(path, dst, **changes):
    """A copy of the checkpoint at ``dst`` whose config.json has ``changes`` (None: an explicit null)."""
    import shutil

    shutil.copytree(path, dst)
    conf = json.loads((dst / "config.json").read_text())
    conf |= changes
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


@pytest.mark.fast
def test_unsupported_features_are_refused_by_name(sliding, tmp_path):
    path, _ = sliding
    cases = [
        (dict(model_type="gemma3"), r"unsupported model_type 'gemma3': the multimodal Gemma 3"),
        (dict(model_type="gemma"), r"unsupported model_type 'gemma': Gemma 1"),
        (dict(model_type="phi3"), r"unsupported model_type 'phi3' \(supported: llama, .*gemma3_text\)"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"RoPE scaling 'yarn' is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), r"RoPE scaling 'dynamic' is not supported"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), r"'llama3' needs \['low_freq_factor', 'high_"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta": 1}), r"'linear' with \['beta'\]"),
        (dict(use_bidirectional_attention=True), "unsupported setting use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "unsupported setting hidden_activation=gelu"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "unsupported layer type 'chunked_attention'"),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=None), "sliding_attention but sliding_window is"),
        (dict(final_logit_softcapping="30"), "final_logit_softcapping must be a positive number or null"),
    ]
    for i, (changes, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(_rewrite(path, tmp_path / str(i), **changes))
    g3 = dict(model_type="gemma3_text", attn_logit_softcapping=50.0, rope_parameters=None)  # legacy RoPE keys
    with pytest.raises(CheckpointError, match=r"attn_logit_softcapping=50.0 \(transformers' Gemma 3 does not apply"):
        config_from_hf(_rewrite(path, tmp_path / "g3", **g3))
    local = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(CheckpointError, match="RoPE scaling 'linear' of the sliding layers is not supported"):
        config_from_hf(_rewrite(path, tmp_path / "g3l", model_type="gemma3_text", rope_parameters=local))


def test_missing_and_mismatched_tensors_are_named_with_shapes(family, tmp_path):
    """A family's own tensors (q/k norms, the post norms) missing or of the wrong shape: named, with the
    expected and the found shape."""
    from safetensors.numpy import load_file, save_file

    name, path, _ = family
    if name not in ("gemma3", "qwen3"):
        pytest.skip("one Gemma and one Qwen checkpoint cover the family tensors")
    import shutil

    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    gone = "model.layers.1.self_attn.k_norm.weight"
    d = COMMON["head_dim"]
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"missing tensor '{gone}' \(expected shape \({d},\)\)"):
        load_hf(tmp_path / "m")
    bad = "post_feedforward_layernorm" if name == "gemma3" else "self_attn.q_norm"
    bad = f"model.layers.0.{bad}.weight"
    wrong = {**tensors, bad: np.ones(7, np.float32)}
    save_file(wrong, tmp_path / "m" / "model.safetensors")
    want = COMMON["hidden_size"] if name == "gemma3" else d
    with pytest.raises(CheckpointError, match=rf"tensor '{bad}' has shape \(7,\), expected \({want},\)"):
        load_hf(tmp_path / "m")


# --------------------------------------------------------------------------------------------------------
# GGUF: Qwen3 files load (q/k norms, NeoX RoPE: nothing permuted). Gemma and Llama 3: tests/test_gguf_families.py.


def test_qwen3_gguf_matches_transformers(tmp_path):
    import torch
    import transformers
    from test_models_gguf import KV, TOKENS, E, F, H, L, V, hf_state, our_logits, write_gguf

    from models.gguf_loader import load_gguf

    state = hf_state(seed=5, untied=True)
    rng = np.random.default_rng(5)
    norms = {
        f"model.layers.{i}.self_attn.{n}_norm.weight": (1 + 0.3 * rng.standard_normal(E // H)).astype(np.float32)
        for i in range(L)
        for n in ("q", "k")
    }
    extra = {f"blk.{k.split('.')[2]}.attn_{k.split('.')[4][0]}_norm.weight": v for k, v in norms.items()}
    write_gguf(tmp_path / "qwen3.gguf", state, arch="qwen3", extra_tensors=extra)
    cfg, params, _ = load_gguf(tmp_path / "qwen3.gguf")
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.tie_embeddings
    conf = transformers.Qwen3Config(
        vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=KV, head_dim=E // H, rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=False,
    )  # fmt: skip
    ref = transformers.Qwen3ForCausalLM(conf).eval()
    missing, unexpected = ref.load_state_dict(
        {k: torch.from_numpy(v) for k, v in (state | norms).items()}, strict=False
    )
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(TOKENS).long()).logits[0].numpy()
    assert np.abs(our_logits(cfg, params) - theirs).max() <= 1e-4
