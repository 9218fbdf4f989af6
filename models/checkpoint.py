"""Steps shared by the checkpoint loaders: name/shape checking and the Hugging Face layout -> params nesting.

Both loaders bring their tensors into the Hugging Face layout first (names like
``model.layers.3.self_attn.q_proj.weight``, matrices as (out, in), RoPE rows in rotate-half order), then
``params_from_hf_layout`` reshapes and stacks them into the model's parameter tree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, Params, end_token_ids


class CheckpointError(ValueError):
    """A checkpoint that does not match what the loader expects; the message names the first problem."""


def hf_expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape (out, in) for every tensor a model with this config must have."""
    e, v = cfg.hidden, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, e)}
    for i in range(cfg.num_layers):
        shapes |= {f"model.layers.{i}.{suffix}": shape for suffix, (shape, _, _) in _layer_leaves(cfg).items()}
    shapes["model.norm.weight"] = (e,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def check_tensors(
    source: str,
    expected: Mapping[str, tuple[int, ...]],
    got: Mapping[str, tuple[int, ...]],
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Raise ``CheckpointError`` for the first missing tensor, wrong shape, or unexpected tensor."""
    for name, shape in expected.items():
        if name not in got:
            raise CheckpointError(f"{source}: missing tensor '{name}' (expected shape {tuple(shape)})")
        if tuple(got[name]) != tuple(shape):
            raise CheckpointError(
                f"{source}: tensor '{name}' has shape {tuple(got[name])}, expected {tuple(shape)} from the config"
            )
    extra = sorted(n for n in got if n not in expected and not ignore(n))
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor '{extra[0]}' ({len(extra)} unexpected in all); "
            "the checkpoint does not match the model this config describes"
        )


def _layer_leaves(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], Callable]]:
    """HF name suffix inside a layer -> (its HF shape, our leaf's path inside the layer, function from the HF
    (out, in) array to our layout). Post norms (Gemma) rename: HF's post_attention_layernorm is the norm on the
    attention output there, and pre_feedforward_layernorm the MLP's input norm (Llama's post_attention_layernorm)."""
    e, h, hkv, d, f = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn
    same = lambda w: w  # noqa: E731
    leaves = {
        "input_layernorm.weight": ((e,), ("attn_norm", "scale"), same),
        "self_attn.q_proj.weight": ((h * d, e), ("attn", "wq"), lambda w: w.T.reshape(e, h, d)),
        "self_attn.k_proj.weight": ((hkv * d, e), ("attn", "wk"), lambda w: w.T.reshape(e, hkv, d)),
        "self_attn.v_proj.weight": ((hkv * d, e), ("attn", "wv"), lambda w: w.T.reshape(e, hkv, d)),
        "self_attn.o_proj.weight": ((e, h * d), ("attn", "wo"), lambda w: w.T.reshape(h, d, e)),
        "mlp.gate_proj.weight": ((f, e), ("mlp", "w_gate"), lambda w: w.T),
        "mlp.up_proj.weight": ((f, e), ("mlp", "w_up"), lambda w: w.T),
        "mlp.down_proj.weight": ((e, f), ("mlp", "w_down"), lambda w: w.T),
    }
    if cfg.post_norms:
        leaves |= {
            "post_attention_layernorm.weight": ((e,), ("post_attn_norm", "scale"), same),
            "pre_feedforward_layernorm.weight": ((e,), ("mlp_norm", "scale"), same),
            "post_feedforward_layernorm.weight": ((e,), ("post_mlp_norm", "scale"), same),
        }
    else:
        leaves["post_attention_layernorm.weight"] = ((e,), ("mlp_norm", "scale"), same)
    if cfg.qkv_bias:
        leaves |= {
            "self_attn.q_proj.bias": ((h * d,), ("attn", "bq"), lambda w: w.reshape(h, d)),
            "self_attn.k_proj.bias": ((hkv * d,), ("attn", "bk"), lambda w: w.reshape(hkv, d)),
            "self_attn.v_proj.bias": ((hkv * d,), ("attn", "bv"), lambda w: w.reshape(hkv, d)),
        }
    if cfg.qk_norm:
        leaves |= {
            "self_attn.q_norm.weight": ((d,), ("attn", "q_norm", "scale"), same),
            "self_attn.k_norm.weight": ((d,), ("attn", "k_norm", "scale"), same),
        }
    return leaves


def params_from_hf_layout(cfg: LlamaConfig, get: Callable[[str], np.ndarray]) -> Params:
    """Nest HF-layout tensors into the parameter tree in ``cfg.dtype``; layer tensors stacked to [L, ...].

    ``get(name)`` returns one HF-layout array; names must already have passed ``check_tensors``.
    """
    dtype = cfg.jdtype

    def to_jax(a: np.ndarray):
        return jnp.asarray(a, dtype=dtype)

    layers: dict[str, Any] = {}
    for suffix, (_, path, fn) in _layer_leaves(cfg).items():
        stacked = np.stack([fn(np.asarray(get(f"model.layers.{i}.{suffix}"))) for i in range(cfg.num_layers)])
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = to_jax(stacked)
    params: Params = {
        "embed": {"embedding": to_jax(get("model.embed_tokens.weight"))},
        "layers": layers,
        "final_norm": {"scale": to_jax(get("model.norm.weight"))},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": to_jax(np.asarray(get("lm_head.weight")).T)}
    return params


# GGUF keys of tokens that end generation besides ``tokenizer.ggml.eos_token_id``.
GGUF_END_KEYS = ("eot", "eom")

# Token texts llama.cpp ends generation at whatever the metadata says: llama-vocab.cpp, ``llama_vocab::impl::load``
# ("maintain a list of tokens that cause end-of-generation", ggml-org/llama.cpp issue 9606), which also makes each
# of them a CONTROL token. Its current list also has texts of model families jspec does not load (PaddleOCR's
# "</s>", Kimi-K2's "[EOT]", SmolDocling's "<end_of_utterance>", Gemma-4's), left out here.
GGUF_END_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's <｜end▁of▁sentence｜>
        "<|return|>",  # gpt-oss (o200k_harmony)
        "<|call|>",
        "<|calls|>",  # Solar-Open
        "<|flush|>",
    }
)
# The same load ends generation at the fill-in-the-middle pad / repository / file-separator tokens too: the id
# tokenizer.ggml.fim_{pad,rep,sep}_token_id names, else a token with one of these texts (llama.cpp takes the one
# its hash map meets first when several match; the lowest id here). SmolLM2's <reponame> (id 4) is such a token.
GGUF_FIM_END_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def gguf_end_ids(get: Callable[[str], Any]) -> tuple[int, ...]:
    """Every id llama.cpp ends generation at, from GGUF metadata read by ``get(key)`` (None when absent).

    The metadata's EOS (the canonical one, first), EOT and EOM ids, then in id order every token whose text is in
    ``GGUF_END_TEXTS`` and the FIM tokens of ``GGUF_FIM_END_TEXTS``; no id twice. As llama.cpp does, ``<|end|>``
    is left out when the set also holds ``<|return|>`` and ``<|call|>`` (gpt-oss) or ``<|calls|>`` and
    ``<|flush|>`` (Solar-Open): there it ends a message, not the turn.
    """
    tokens = get("tokenizer.ggml.tokens") or []
    by_text = {i for i, t in enumerate(tokens) if t in GGUF_END_TEXTS}
    for role, texts in GGUF_FIM_END_TEXTS.items():
        named = gguf_special_id(get, role)  # None when outside the vocabulary: then found by its text
        found = [i for i, t in enumerate(tokens) if t in texts] if named is None else [named]
        by_text.update(found[:1])
    named = [gguf_special_id(get, k) for k in ("eos", *GGUF_END_KEYS)]
    ids = end_token_ids([*named, *sorted(by_text)])
    texts = {tokens[i]: i for i in ids if 0 <= i < len(tokens)}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        ids = tuple(i for i in ids if i != texts["<|end|>"])
    return ids


def gguf_special_id(get: Callable[[str], Any], name: str) -> int | None:
    """``tokenizer.ggml.{name}_token_id`` from GGUF metadata read by ``get(key)`` (None when absent), or None when
    it lies outside the vocabulary ``tokenizer.ggml.tokens`` (not checked for a file without one). llama.cpp
    (``llama_vocab::impl::load``) warns "bad special token" for such an id and keeps its default, as for an absent
    key: no token for most names, but id 11 for a gpt2-style vocabulary's BOS and EOS, an arbitrary token of
    another vocabulary that jspec does not copy (such a file has no BOS / EOS here)."""
    tokens = get("tokenizer.ggml.tokens")
    found = get(f"tokenizer.ggml.{name}_token_id")
    if found is None or (tokens and not 0 <= found < len(tokens)):
        return None
    return found


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when there is no such file; malformed JSON or a value other than an
    object is a ``CheckpointError`` naming the file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def hf_id_list(config: dict | None, key: str, path) -> list[int]:
    """``config[key]`` (an id, a list of ids or absent) as a list; a negative id is the convention for "none"
    (older conversions write ``"pad_token_id": -1``) and is left out; anything else is refused by name."""
    ids = (config or {}).get(key)
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: {key} must be a token id or a list of token ids, got {config[key]!r}")
    return [i for i in ids if i >= 0]
