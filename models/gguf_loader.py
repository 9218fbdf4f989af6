"""Load a Llama-family GGUF file (llama.cpp's format) into ``LlamaConfig`` + params.

Pure steps: read (``open_gguf``) -> config from metadata (``config_from_gguf``) -> check every tensor name,
type and shape -> dequantise -> rename to the Hugging Face layout, undoing llama.cpp's Q/K row permutation
-> nest (``checkpoint.params_from_hf_layout``).

llama.cpp's converter permutes the rows of Q and K (per head, from rotate-half order to interleaved pairs)
because its "llama" RoPE rotates adjacent pairs. We invert that permutation here so the model keeps a single
rotate-half RoPE for both checkpoint formats. Qwen2/Qwen3 files are not permuted (llama.cpp uses NeoX RoPE there).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from models.checkpoint import (
    CheckpointError,
    check_tensors,
    gguf_end_ids,
    gguf_special_id,
    hf_expected_shapes,
    params_from_hf_layout,
)
from models.llama import LlamaConfig, Params, canonical_dtype

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose GGUF metadata does not say how to run them exactly, refused with the reason.
_REFUSED_ARCHITECTURES = {
    arch: "the file does not carry the query scale (query_pre_attn_scalar; llama.cpp guesses it from the model "
    "size) nor, in older files, which layers slide: load the Hugging Face directory instead"
    for arch in ("gemma2", "gemma3")
}

SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
)

_GGUF_MAGIC = b"GGUF"

# Hugging Face name (inside a layer) -> llama.cpp name (inside ``blk.N.``).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP_NAMES["lm_head.weight"] = "output.weight"


def gguf_name(hf_name: str) -> str:
    """Hugging Face tensor name -> llama.cpp tensor name."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its path (for messages) and the ``gguf`` reader (tensor data memory-mapped)."""

    path: str
    reader: GGUFReader


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read step: parse the header, metadata and tensor index (data stays memory-mapped)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package reports a short file as a reshape/view error
        raise CheckpointError(f"{path}: GGUF file is truncated or corrupt ({size} bytes; reader said: {e})") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(f"{path}: GGUF file is truncated: tensor data ends at byte {end}, file has {size}")
    return GGUFFile(path, reader)


def _field(gf: GGUFFile, key: str, default=None, required: bool = True):
    field = gf.reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise CheckpointError(f"{gf.path}: missing metadata key '{key}'")
        return default
    return field.contents()


def config_from_gguf(gf: GGUFFile, dtype="float32", name: str | None = None) -> LlamaConfig:
    """Config step: read the architecture hyper-parameters from GGUF metadata."""
    arch = _field(gf, "general.architecture")
    if arch in _REFUSED_ARCHITECTURES:
        raise CheckpointError(
            f"{gf.path}: architecture '{arch}' is not supported from GGUF: {_REFUSED_ARCHITECTURES[arch]}"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gf.path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    scaling = _field(gf, f"{arch}.rope.scaling.type", required=False)
    if scaling not in (None, "none"):
        raise CheckpointError(f"{gf.path}: RoPE scaling '{scaling}' is not supported")
    # llama.cpp scales positions linearly by these factors even without a scaling type: refused, not ignored.
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        factor = _field(gf, key, required=False)
        if factor not in (None, 0, 0.0, 1, 1.0):
            raise CheckpointError(f"{gf.path}: RoPE scaling factor {key}={factor} is not supported")
    # Llama-3.1/3.2 files carry their frequency scaling as a tensor, not as metadata.
    if any(t.name == "rope_freqs.weight" for t in gf.reader.tensors):
        raise CheckpointError(
            f"{gf.path}: RoPE frequency scaling (tensor rope_freqs.weight, Llama-3.1) is not supported"
        )
    hidden = int(_field(gf, f"{arch}.embedding_length"))
    num_layers = int(_field(gf, f"{arch}.block_count"))
    heads = _per_layer(gf, f"{arch}.attention.head_count", num_layers)
    kv_heads = _per_layer(gf, f"{arch}.attention.head_count_kv", num_layers, heads)
    for key, count in (("head_count", heads), ("head_count_kv", kv_heads)):
        if count <= 0:
            raise CheckpointError(f"{gf.path}: {arch}.attention.{key} is {count}: a model needs at least one head")
    head_dim = int(_field(gf, f"{arch}.attention.key_length", hidden // heads))
    rot = int(_field(gf, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(f"{gf.path}: partial RoPE ({rot} of {head_dim} dims) is not supported")
    embd = next((t for t in gf.reader.tensors if t.name == "token_embd.weight"), None)

    def meta(key):
        return _field(gf, key, required=False)

    vocab = _field(gf, f"{arch}.vocab_size", required=False)
    if vocab is None:
        tokens = gf.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        raise CheckpointError(f"{gf.path}: cannot tell the vocabulary size (no {arch}.vocab_size, no tokens)")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=_per_layer(gf, f"{arch}.feed_forward_length", num_layers),
        rope_theta=float(_field(gf, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(gf, f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_embeddings=not any(t.name == "output.weight" for t in gf.reader.tensors),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        # Ids outside the vocabulary are None, as llama.cpp ignores them (checkpoint.gguf_special_id).
        bos_id=gguf_special_id(meta, "bos"),
        eos_id=gguf_special_id(meta, "eos"),
        eos_ids=gguf_end_ids(meta),  # as llama.cpp: by id and by text
        dtype=canonical_dtype(dtype),
        name=name or _field(gf, "general.name", "", required=False) or arch,
        max_positions=_optional_int(_field(gf, f"{arch}.context_length", required=False)),
    )


def _per_layer(gf: GGUFFile, key: str, num_layers: int, default=None) -> int:
    """A hyper-parameter llama.cpp reads as one value or one per layer (``get_key_or_arr``: head counts, FFN
    width). The model here has the same shape in every layer: an array must have one value per layer, all
    equal, and that value is used; one that varies between layers is refused by name."""
    value = _field(gf, key, default)
    if not isinstance(value, (list, tuple)):
        return int(value)
    if len(value) != num_layers:
        raise CheckpointError(f"{gf.path}: {key} has {len(value)} per-layer values for {num_layers} layers")
    if len(set(value)) != 1:
        raise CheckpointError(
            f"{gf.path}: {key} varies between layers ({list(value)}): layers of different shapes are not supported"
        )
    return int(value[0])


def _optional_int(x) -> int | None:
    return None if x is None else int(x)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row permutation: interleaved pairs -> rotate-half order.

    w: (n_heads * D, ...) rows as llama.cpp stores them. Within each head, llama.cpp row 2i is HF row i and
    row 2i+1 is HF row D/2 + i.
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def params_from_gguf(gf: GGUFFile, cfg: LlamaConfig) -> Params:
    """Check, dequantise, rename and nest every tensor of the file into params in ``cfg.dtype``."""
    arch = _field(gf, "general.architecture")
    by_name = {t.name: t for t in gf.reader.tensors}
    hf_shapes = hf_expected_shapes(cfg)
    expected = {gguf_name(n): s for n, s in hf_shapes.items()}
    # GGUF lists dims fastest-first; reversed they are numpy's (out, in).
    got = {n: tuple(int(x) for x in reversed(t.shape.tolist())) for n, t in by_name.items()}
    check_tensors(str(gf.path), expected, got)
    for n in expected:
        ttype = GGMLQuantizationType(int(by_name[n].tensor_type))
        if ttype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise CheckpointError(f"{gf.path}: tensor '{n}' has type {ttype.name}; supported: {supported}")

    def get(hf_name: str) -> np.ndarray:
        name = gguf_name(hf_name)
        t = by_name[name]
        w = dequantize(t.data, GGMLQuantizationType(int(t.tensor_type))).reshape(expected[name])
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    return params_from_hf_layout(cfg, get)


def load_gguf(path: str | os.PathLike, dtype="float32") -> tuple[LlamaConfig, Params, GGUFFile]:
    """path -> (config, params, parsed file); the file also feeds ``models.tokenizer.Tokenizer.from_gguf``."""
    gf = open_gguf(path)
    cfg = config_from_gguf(gf, dtype)
    return cfg, params_from_gguf(gf, cfg), gf
