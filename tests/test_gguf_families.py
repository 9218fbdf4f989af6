"""GGUF files of Llama 3.1/3.2, Gemma 2 and Gemma 3 (text), written here the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them from a tiny random Hugging Face checkpoint saved beside them: both load with
jspec's loaders and give the same logits over a 64-token prompt (past the sliding windows and the llama3 original
context). What the converter does, restated here from its published behaviour rather than from the loader:

- Llama: Q/K rows permuted per head to interleaved pairs; HF's llama3 RoPE scaling becomes a tensor
  ``rope_freqs.weight`` of head_dim/2 divisors (1 for wavelengths under original/high_freq_factor, ``factor`` over
  original/low_freq_factor, 1 / ((1 - s) / factor + s) between, s = (original / wavelength - low) / (high - low)).
- Gemma: every ``*norm.weight`` stored as 1 + w; Q/K not permuted (NeoX RoPE); Gemma 2 drops lm_head and writes
  its soft caps and window, Gemma 3 its linear factor, both RoPE bases and its window. Neither writes the query
  scale: llama.cpp picks it by layer count, which the loader follows only where that matches the published models.
"""

from __future__ import annotations

import math
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_torch

from models.checkpoint import CheckpointError
from models.gguf_loader import config_from_gguf, load_gguf, open_gguf
from models.hf_loader import load_hf
from models.llama import make_model
from models.rope import inv_freq

VOCAB = 128
_RNG = np.random.default_rng(0)
PROMPT = _RNG.integers(3, VOCAB, 64).astype(np.int32)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _hf_config(family: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6
    )
    common |= dict(initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "llama3":  # a small original context: the scaled and the interpolated bands both hold frequencies
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, **LLAMA3}
        return transformers.LlamaConfig(
            **common, hidden_size=64, head_dim=32, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=False
        )
    if family == "gemma2":
        # 46 layers: llama.cpp's Gemma 2 27B, whose query scale is (hidden / heads)^-1/2 = 32^-1/2, not head_dim's
        # 16^-1/2 (so a scale taken from the wrong rule moves the logits). Caps low enough to bend these scores.
        kw = dict(
            query_pre_attn_scalar=32, attn_logit_softcapping=4.0, final_logit_softcapping=6.0, initializer_range=0.1
        )
        return transformers.Gemma2Config(
            **(common | kw), hidden_size=128, head_dim=16, num_hidden_layers=46, sliding_window=8
        )
    # Gemma 3: head_dim = hidden / heads, where both of llama.cpp's rules agree; 7 layers: 5 sliding, 1 global, 1
    # sliding (llama.cpp's fixed period of 6). Global layers: their own base and a linear factor; local: 1e4.
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    return transformers.Gemma3TextConfig(
        **common, hidden_size=128, head_dim=32, num_hidden_layers=7, sliding_window=8, layer_types=types,
        rope_parameters=rope, query_pre_attn_scalar=32,
    )  # fmt: skip


def llama3_rope_factors(head_dim: int, theta: float, factor, low, high, original) -> np.ndarray:
    """[head_dim / 2] divisors from llama.cpp's published llama3 formula (its converter reads ``original`` from
    config.json's top-level original_max_position_embeddings, default 8192: the value inside rope_scaling for the
    published Llama 3.1/3.2 configs; a converted tiny config would need that key at the top level too)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            s = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "ffn_post_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


def _converted_name(hf: str, gemma: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    if hf in top:
        return top[hf] + ".weight"
    layer, rest = hf.split(".")[2], hf.split(".", 3)[3]
    # HF's post_attention_layernorm: Gemma's norm on the attention output, Llama's MLP input norm.
    name = ("attn_post_norm" if gemma else "ffn_norm") if rest == "post_attention_layernorm.weight" else _NAMES[rest]
    return f"blk.{layer}.{name}.weight"


def _interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Llama Q/K permutation: per head, row i of each half goes to rows 2i and 2i + 1."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_converted(path, family: str, conf, state: dict[str, np.ndarray]) -> None:
    """``state`` (an HF checkpoint's f32 tensors) as llama.cpp's converter writes it: names, permutation or norm
    shift, the metadata keys of its model class, rope_freqs for llama3."""
    arch = {"llama3": "llama"}.get(family, family)
    gemma = family.startswith("gemma")
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(conf.num_hidden_layers)
    w.add_context_length(conf.max_position_embeddings)
    w.add_embedding_length(conf.hidden_size)
    w.add_feed_forward_length(conf.intermediate_size)
    w.add_head_count(conf.num_attention_heads)
    w.add_head_count_kv(conf.num_key_value_heads)
    w.add_layer_norm_rms_eps(conf.rms_norm_eps)
    w.add_key_length(conf.head_dim)
    w.add_value_length(conf.head_dim)
    rope = conf.rope_parameters
    if family == "llama3":
        w.add_vocab_size(conf.vocab_size)
        w.add_rope_dimension_count(conf.head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        factors = llama3_rope_factors(conf.head_dim, rope["rope_theta"], *LLAMA3.values())
        w.add_tensor("rope_freqs.weight", factors)
    elif family == "gemma2":  # no RoPE base: llama.cpp's default 10000 is Gemma 2's
        w.add_attn_logit_softcapping(conf.attn_logit_softcapping)
        w.add_final_logit_softcapping(conf.final_logit_softcapping)
        w.add_sliding_window(conf.sliding_window)
    else:
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_sliding_window(conf.sliding_window)
    for hf, arr in state.items():
        if family == "gemma2" and hf == "lm_head.weight":
            continue
        if gemma and hf.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        elif not gemma and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = conf.num_attention_heads if "q_proj" in hf else conf.num_key_value_heads
            arr = _interleave_rows(arr, heads)
        w.add_tensor(_converted_name(hf, gemma), np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama3", "gemma2", "gemma3"])
def converted(request, tmp_path_factory):
    """(family, HF directory, GGUF file converted from it) of one tiny random checkpoint."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    conf = _hf_config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(conf)
    with torch.no_grad():  # random norms: an unshifted or swapped norm moves the logits
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    state = {k: v.astype(np.float32) for k, v in load_file(path / "model.safetensors").items()}
    write_converted(path / "model.gguf", request.param, model.config, state)
    return request.param, path, path / "model.gguf"


def _logits(cfg, params) -> np.ndarray:
    m = make_model(cfg)
    pos = jnp.arange(len(PROMPT), dtype=jnp.int32)[None]
    logits, _ = jax.jit(m.apply)(params, jnp.asarray(PROMPT[None]), pos, m.init_cache(1, len(PROMPT)))
    return np.asarray(logits[0])


@requires_torch
def test_converted_gguf_logits_equal_the_hf_directorys(converted):
    """The GGUF file and the directory it was converted from: the same model, logits within 1e-5 of the largest
    over 64 tokens (Gemma's are the same to the bit; llama3's one interpolated frequency computed as freq / factor
    rounds a few ulp from transformers' (1 - s) freq / factor + s freq, which moves logits of ~7 by ~1e-5); the
    feature the file carries differently (llama3's factors, the query scale, Gemma 3's RoPE) moves them when taken
    away, so the comparison can fail."""
    family, path, file = converted
    cfg_h, params_h = load_hf(path)
    cfg_g, params_g, _ = load_gguf(file)
    for field in ("sliding_window", "sliding_layers", "local_rope_theta", "post_norms", "qk_norm", "activation"):
        assert getattr(cfg_g, field) == getattr(cfg_h, field), field
    for field in ("attn_scale", "attn_softcap", "final_softcap", "embed_scale", "tie_embeddings", "rope_theta"):
        assert getattr(cfg_g, field) == getattr(cfg_h, field), field
    want = _logits(cfg_h, params_h)
    diff = np.abs(_logits(cfg_g, params_g) - want).max()
    assert diff <= 1e-5 * max(1.0, np.abs(want).max()), (family, diff, np.abs(want).max())
    if family == "llama3":
        theirs, ours = (np.asarray(inv_freq(32, c.rope_theta, c.rope_scaling)) for c in (cfg_h, cfg_g))
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
        factors = np.asarray(cfg_g.rope_scaling.factors)
        assert cfg_g.rope_scaling.kind == "factors" and factors.shape == (16,)
        # Every band is present: kept (1), slowed by the factor (8), interpolated between.
        assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
        wrong = cfg_g.replace(rope_scaling=None)
    elif family == "gemma2":
        assert cfg_g.attn_scale == 32**-0.5 and cfg_g.sliding_layers == tuple(range(0, 46, 2))
        wrong = cfg_g.replace(attn_scale=16**-0.5)  # head_dim's rule, which llama.cpp takes for other sizes
    else:
        assert cfg_g.rope_scaling.kind == "linear" and cfg_g.sliding_layers == (0, 1, 2, 3, 4, 6)
        wrong = cfg_g.replace(local_rope_theta=None)  # sliding layers at the global base and scaling
    assert np.abs(_logits(wrong, params_g) - want).max() > 1e-3, family


# --------------------------------------------------------------------------------------------------------
# Metadata alone: llama.cpp's query-scale rule by layer count, and what is refused by name.


def _gemma_metadata(path, arch="gemma2", layers=26, hidden=128, heads=4, head_dim=16, extra=None):
    """A tensor-less Gemma GGUF (config_from_gguf reads metadata only); ``extra``: more keys, typed by value."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(96)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(VOCAB)
    w.add_sliding_window(8)
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return open_gguf(path)


@pytest.mark.parametrize(
    "arch, layers, dim",
    [("gemma2", 26, 16), ("gemma2", 42, 16), ("gemma2", 46, 32), ("gemma3", 26, 16), ("gemma3", 62, 32)],
)
def test_query_scale_follows_llama_cpps_rule_for_published_sizes(tmp_path, arch, layers, dim):
    """head_dim 16, hidden / heads 32: the 27B layer counts (Gemma 2's 46, Gemma 3's 62) scale by 32^-1/2, the
    other published sizes by head_dim's 16^-1/2, as llama.cpp does and as the published configs say."""
    cfg = config_from_gguf(_gemma_metadata(tmp_path / "m.gguf", arch, layers))
    assert cfg.attn_scale == dim**-0.5 and cfg.embed_scale == 128**0.5 and cfg.post_norms


def test_gemma_files_are_refused_where_llama_cpps_rules_do_not_settle_them(tmp_path):
    cases = [
        # A size llama.cpp does not know, whose two rules disagree: the file cannot say which one trained it.
        (
            dict(layers=3),
            r"query scale of a 3-layer gemma2 model: .*= 32\^-1/2 at 27B's 46 layers and head_dim\^-1/2 = 16\^-1/2",
        ),
        (dict(extra={"gemma2.attention.scale": 0.5}), r"gemma2.attention.scale=0.5, but llama.cpp scales .* 16\^-1/2"),
        (dict(extra={"gemma2.attention.sliding_window_pattern": 3}), r"sliding_window_pattern=3 makes other layers"),
        (dict(extra={"gemma2.rope.freq_base_swa": 500.0}), r"gemma2.rope.freq_base_swa=500.0 differs from freq_base"),
        (dict(extra={"gemma2.attn_logit_softcapping": 0.0}), r"attn_softcap=0.0 must be a positive number"),
        (dict(extra={"gemma2.rope.scaling.factor": 2.0}), r"RoPE scaling factor gemma2.rope.scaling.factor=2.0 is not"),
        (dict(arch="gemma3", extra={"gemma3.rope.freq_base_swa": 500.0}), r"freq_base_swa=500.0: llama.cpp runs"),
        (dict(arch="gemma3", extra={"gemma3.final_logit_softcapping": 30.0}), r"final_logit_softcapping=30.0 \(a cap"),
    ]
    for i, (kw, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            config_from_gguf(_gemma_metadata(tmp_path / f"{i}.gguf", **kw))
    # The same period written out is llama.cpp's own rule, not a disagreement.
    flags = [i % 2 == 0 for i in range(26)]
    cfg = config_from_gguf(
        _gemma_metadata(tmp_path / "p.gguf", extra={"gemma2.attention.sliding_window_pattern": flags})
    )
    assert cfg.sliding_layers == tuple(range(0, 26, 2)) and (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)


def test_gemma3_without_a_window_is_refused(tmp_path):
    w = gguf.GGUFWriter(os.fspath(tmp_path / "g.gguf"), "gemma3")
    for add, v in ((w.add_block_count, 26), (w.add_embedding_length, 128), (w.add_feed_forward_length, 96)):
        add(v)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="a Gemma 3 file without gemma3.attention.sliding_window"):
        config_from_gguf(open_gguf(tmp_path / "g.gguf"))
