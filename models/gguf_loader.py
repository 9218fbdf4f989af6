"""Load a GGUF file (llama.cpp's format) of the Llama, Qwen2/Qwen3 or Gemma 2/Gemma 3 (text) architectures into
``LlamaConfig`` + params.

Pure steps: read (``open_gguf``) -> config from metadata (``config_from_gguf``) -> check every tensor name,
type and shape -> dequantise -> rename to the Hugging Face layout, undoing llama.cpp's Q/K row permutation
-> nest (``checkpoint.params_from_hf_layout``).

llama.cpp's converter permutes the rows of Q and K (per head, from rotate-half order to interleaved pairs)
because its "llama" RoPE rotates adjacent pairs. We invert that permutation here so the model keeps a single
rotate-half RoPE for both checkpoint formats. Qwen2/Qwen3 and Gemma files are not permuted (llama.cpp uses NeoX
RoPE there). Llama 3.1/3.2's RoPE scaling is a tensor, rope_freqs.weight (one divisor per rotation frequency), read
into the config. Gemma's metadata leaves some quantities to llama.cpp's fixed rules (``_gemma_fields``): they are
followed where they match the published models, and a file they do not settle is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

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
from models.config import RopeScaling
from models.llama import LlamaConfig, Params, canonical_dtype

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")

# What llama.cpp (src/llama-model.cpp, load_hparams) fixes for Gemma files rather than reading it from them:
# which layers slide (every ``period``-th layer from the ``period``-th is global: layer i slides when
# i % period < period - 1), and the query scale, chosen by the layer count. Its 27B sizes scale by
# (hidden / heads)^-1/2, every other size by head_dim^-1/2; the published configs' query_pre_attn_scalar is exactly
# that (27B: 144 = 4608 / 32 and 168 = 5376 / 32; the others 256 = head_dim). Layer counts of published sizes
# (Gemma 3 270M's 18 gets the head_dim rule whether or not llama.cpp names that size; its config matches it).
_GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_SIZES = {
    "gemma2": {26: "2B", 42: "9B", 46: "27B"},
    "gemma3": {18: "270M", 26: "1B", 34: "4B", 48: "12B", 62: "27B"},
}
# Gemma 2's soft caps when the file names none (llama-hparams.h; transformers' Gemma2Config has the same).
_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA2_WINDOW = 4096  # llama.cpp's Gemma 2 window when the file names none (transformers' default too)
_GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's RoPE base of Gemma 3's sliding layers, whatever the file says

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
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "ffn_post_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP_NAMES["lm_head.weight"] = "output.weight"


def gguf_name(hf_name: str, post_norms: bool = False) -> str:
    """Hugging Face tensor name -> llama.cpp tensor name. post_norms (Gemma): HF's post_attention_layernorm is the
    norm on the attention output there (llama.cpp's attn_post_norm), and pre_feedforward_layernorm the MLP's
    input norm (ffn_norm, Llama's post_attention_layernorm)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.rest
    if post_norms and rest == "post_attention_layernorm.weight":
        return f"blk.{layer}.attn_post_norm.weight"
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its path (for messages) and the ``gguf`` reader (tensor data memory-mapped)."""

    path: str
    reader: GGUFReader

    def get(self, key: str, default=None):
        """Metadata value ``key`` (arrays as lists), or ``default`` when the file has no such key."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's metadata alone (``read_gguf_metadata``): its path (for messages) and key -> value."""

    path: str
    values: dict[str, Any]

    def get(self, key: str, default=None):
        """Metadata value ``key`` (arrays as lists), or ``default`` when the file has no such key."""
        return self.values.get(key, default)


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


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one little-endian value; 8 is a string, 9 an
# array (item type, count, items).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> GGUFMetadata:
    """The header and metadata of a GGUF file, without its tensor index: what ``Tokenizer.from_gguf`` reads.

    Values are what ``GGUFReader``'s ``field.contents()`` gives (Python scalars, strings, lists), read in one pass:
    ``GGUFReader`` makes a numpy view of every array element, which takes seconds for a real vocabulary (8 s for
    Llama 3's 128k tokens and 280k merges), where this takes a fraction of one. A short file, another magic, a
    GGUF version other than 2 or 3, an unknown value type or a string that is not UTF-8 is a ``CheckpointError``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (expected magic {_GGUF_MAGIC!r})")
        if os.path.getsize(path) < 24:
            raise CheckpointError(f"{path}: GGUF file is truncated: {os.path.getsize(path)} bytes, no header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return GGUFMetadata(path, _MetadataParser(path, buf).values())


class _MetadataParser:
    """One pass over a GGUF header and its key/value section (the layout of gguf's GGUFReader and llama.cpp's
    gguf.cpp: little- or big-endian, told apart by the version word as GGUFReader does)."""

    def __init__(self, path: str, buf):
        self.path, self.buf, self.pos = path, buf, 4
        version = int.from_bytes(buf[4:8], "little")
        self.order = "<"
        if version & 0xFFFF == 0:  # a file written on a big-endian machine
            self.order, version = ">", int.from_bytes(buf[4:8], "big")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        self.pos = 8

    def _take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise CheckpointError(
                f"{self.path}: GGUF file is truncated or corrupt: {what} needs {n} bytes at byte {start}, "
                f"file has {len(self.buf)}"
            )
        self.pos = start + n
        return start

    def _scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(self.order + fmt, self.buf, self._take(size, what))[0]

    def _string(self, what: str) -> str:
        n = self._scalar("Q", what)
        start = self._take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8 ({e})") from e

    def _value(self, vtype: int, what: str):
        if vtype in _GGUF_SCALARS:
            return self._scalar(_GGUF_SCALARS[vtype], what)
        if vtype == _GGUF_STRING:
            return self._string(what)
        if vtype == _GGUF_ARRAY:
            itype, count = self._scalar("I", what), self._scalar("Q", what)
            if itype in _GGUF_SCALARS:  # numbers in one read, as Python values (float32 -> its exact float)
                fmt = _GGUF_SCALARS[itype]
                start = self._take(count * struct.calcsize(fmt), what)
                return list(struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, start))
            return [self._value(itype, what) for _ in range(count)]
        raise CheckpointError(f"{self.path}: {what} has unknown GGUF value type {vtype}")

    def values(self) -> dict[str, Any]:
        self._scalar("Q", "the tensor count")
        kv_count = self._scalar("Q", "the metadata count")
        values = {}
        for i in range(kv_count):
            key = self._string(f"metadata key {i}")
            if key in values:  # GGUFReader refuses these too
                raise CheckpointError(f"{self.path}: metadata key '{key}' appears twice")
            values[key] = self._value(self._scalar("I", f"the type of '{key}'"), f"metadata '{key}'")
        return values


def _field(gf: GGUFFile, key: str, default=None, required: bool = True):
    field = gf.reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise CheckpointError(f"{gf.path}: missing metadata key '{key}'")
        return default
    return field.contents()


def config_from_gguf(gf: GGUFFile, dtype="float32", name: str | None = None) -> LlamaConfig:
    """Config step: read the architecture hyper-parameters from GGUF metadata (and Llama 3's rope_freqs tensor)."""
    arch = _field(gf, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gf.path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
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
    value_dim = int(_field(gf, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise CheckpointError(f"{gf.path}: value heads of {value_dim} dims for key heads of {head_dim}: not supported")
    embd = next((t for t in gf.reader.tensors if t.name == "token_embd.weight"), None)

    def meta(key):
        return _field(gf, key, required=False)

    vocab = _field(gf, f"{arch}.vocab_size", required=False)
    if vocab is None:
        tokens = gf.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        raise CheckpointError(f"{gf.path}: cannot tell the vocabulary size (no {arch}.vocab_size, no tokens)")
    rope_theta = float(_field(gf, f"{arch}.rope.freq_base", 10000.0))
    family = _gemma_fields(gf, arch, num_layers, hidden, heads, head_dim, rope_theta) if arch in GEMMA else {}
    try:
        return LlamaConfig(
            vocab_size=int(vocab),
            hidden=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn=_per_layer(gf, f"{arch}.feed_forward_length", num_layers),
            rope_theta=rope_theta,
            rms_eps=float(_field(gf, f"{arch}.attention.layer_norm_rms_epsilon")),
            # llama.cpp's Gemma 2 always multiplies by the embedding; an output.weight is then an unexpected tensor.
            tie_embeddings=arch == "gemma2" or not any(t.name == "output.weight" for t in gf.reader.tensors),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            # Ids outside the vocabulary are None, as llama.cpp ignores them (checkpoint.gguf_special_id).
            bos_id=gguf_special_id(meta, "bos"),
            eos_id=gguf_special_id(meta, "eos"),
            eos_ids=gguf_end_ids(meta),  # as llama.cpp: by id and by text
            dtype=canonical_dtype(dtype),
            name=name or _field(gf, "general.name", "", required=False) or arch,
            max_positions=_optional_int(_field(gf, f"{arch}.context_length", required=False)),
            rope_scaling=_rope_scaling(gf, arch, head_dim),
            **family,
        )
    except CheckpointError:
        raise
    except ValueError as e:  # a value the config refuses (a soft cap of 0, a window of 0, ...), named
        raise CheckpointError(f"{gf.path}: {e}") from e


def _rope_scaling(gf: GGUFFile, arch: str, head_dim: int) -> RopeScaling | None:
    """The full-attention layers' RoPE scaling as llama.cpp applies it: a linear factor (Gemma 3's global layers;
    llama.cpp divides positions by rope.scaling.factor, else the older rope.scale_linear, whatever the scaling
    type), or Llama 3's per-frequency factors (the rope_freqs tensor). Anything else is refused by name."""
    kind = _field(gf, f"{arch}.rope.scaling.type", required=False)
    linear_ok = arch == "gemma3"
    if kind not in (None, "none") and not (linear_ok and kind == "linear"):
        raise CheckpointError(f"{gf.path}: RoPE scaling '{kind}' is not supported")
    factors = {}
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        factor = _field(gf, key, required=False)
        if factor not in (None, 0, 0.0, 1, 1.0):
            factors[key] = factor
    if factors and not linear_ok:  # llama.cpp scales positions by these even without a type: refused, not ignored
        key, factor = next(iter(factors.items()))
        raise CheckpointError(f"{gf.path}: RoPE scaling factor {key}={factor} is not supported")
    if len(set(factors.values())) > 1:  # llama.cpp reads the first; a file that disagrees with itself is refused
        raise CheckpointError(f"{gf.path}: RoPE scaling factors disagree: {factors}")
    freqs = next((t for t in gf.reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and arch != "llama":  # llama.cpp reads rope_freqs only for the Llama architecture here
        raise CheckpointError(f"{gf.path}: tensor rope_freqs.weight in a '{arch}' file, whose RoPE does not read it")
    if factors:
        factor = float(next(iter(factors.values())))
        if not (math.isfinite(factor) and factor > 0):
            raise CheckpointError(f"{gf.path}: RoPE scaling factor must be a positive number, got {factor}")
        return RopeScaling("linear", factor)
    if freqs is None:
        return None
    # Llama 3.1/3.2: llama.cpp's converter turns HF's llama3 scaling into one divisor per rotation frequency (1 for
    # short wavelengths, the factor for long ones, interpolated between), and llama.cpp's RoPE divides frequency i
    # by factor i. Read as stored, so the model runs the file's frequencies, not a re-derivation of them.
    shape = tuple(int(x) for x in reversed(freqs.shape.tolist()))
    if shape != (head_dim // 2,):
        raise CheckpointError(
            f"{gf.path}: tensor 'rope_freqs.weight' has shape {shape}, expected ({head_dim // 2},): one RoPE "
            f"frequency factor per rotation frequency (head_dim {head_dim} / 2)"
        )
    values = _dequantized(gf, freqs, shape)
    bad = values[~(np.isfinite(values) & (values > 0))]
    if bad.size:
        raise CheckpointError(f"{gf.path}: tensor 'rope_freqs.weight' has factor {bad[0]}: they must be finite and > 0")
    return RopeScaling("factors", 1.0, factors=tuple(float(v) for v in values))


def _gemma_fields(gf: GGUFFile, arch: str, num_layers: int, hidden: int, heads: int, head_dim: int, theta: float):
    """The LlamaConfig fields of a Gemma 2 / Gemma 3 file, as llama.cpp runs it (its converter has already stored
    the RMSNorm weights as 1 + w and left Q/K unpermuted: NeoX RoPE). What the file leaves to llama.cpp's fixed
    rules (the query scale, which layers slide, Gemma 3's local RoPE base) is taken from those rules where they
    match the published models, and a file whose metadata says otherwise is refused: llama.cpp versions differ on
    reading those keys."""

    def meta(key, default=None):
        return _field(gf, f"{arch}.{key}", default, required=False)

    per_head = hidden // heads  # llama.cpp: n_embd / n_head, in integers
    size = _GEMMA_SIZES[arch].get(num_layers)
    if size == "27B":
        dim = per_head
    elif size is not None or per_head * heads == hidden == head_dim * heads:
        dim = head_dim  # a published size's rule, or a shape where both of llama.cpp's rules give the same scale
    else:
        sizes = _GEMMA_SIZES[arch]
        big = next(n for n, s in sizes.items() if s == "27B")
        raise CheckpointError(
            f"{gf.path}: cannot tell the query scale of a {num_layers}-layer {arch} model: the file does not carry "
            f"query_pre_attn_scalar; llama.cpp takes (hidden / heads)^-1/2 = {per_head}^-1/2 at 27B's {big} layers "
            f"and head_dim^-1/2 = {head_dim}^-1/2 at any other count, which the published configs match only at "
            f"their sizes ({', '.join(map(str, sizes))} layers), and for this shape the two differ: load the "
            "Hugging Face directory instead"
        )
    scale = float(dim) ** -0.5
    stated = meta("attention.scale")  # llama.cpp's Gemma does not read it: it must not say otherwise
    if stated is not None and not math.isclose(float(stated), scale, rel_tol=1e-6):
        raise CheckpointError(
            f"{gf.path}: {arch}.attention.scale={stated}, but llama.cpp scales this model's queries by {dim}^-1/2 "
            f"= {scale:.6g} (and ignores the key)"
        )
    for key in ("attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"):
        if meta(key) not in (None, head_dim):
            raise CheckpointError(f"{gf.path}: {arch}.{key}={meta(key)}: sliding layers of another head width")
    if arch == "gemma2":
        caps = {k: float(meta(k, v)) for k, v in _GEMMA2_CAPS.items()}
        window = int(meta("attention.sliding_window", _GEMMA2_WINDOW))
        local = meta("rope.freq_base_swa")
        if local is not None and float(local) != theta:  # older llama.cpp runs every Gemma 2 layer at freq_base
            raise CheckpointError(f"{gf.path}: gemma2.rope.freq_base_swa={local} differs from freq_base={theta}")
        local_theta = None
    else:
        for key in _GEMMA2_CAPS:  # transformers' and llama.cpp's sliding Gemma 3 apply neither
            if meta(key) is not None:
                raise CheckpointError(f"{gf.path}: gemma3.{key}={meta(key)} (a cap Gemma 3 does not apply)")
        caps = {k: None for k in _GEMMA2_CAPS}
        window = int(meta("attention.sliding_window", 0))
        if window <= 0:  # llama.cpp versions differ on such a file (required key; or full attention everywhere)
            raise CheckpointError(f"{gf.path}: a Gemma 3 file without gemma3.attention.sliding_window is not supported")
        local = meta("rope.freq_base_swa")
        if local is not None and float(local) != _GEMMA3_LOCAL_THETA:
            raise CheckpointError(
                f"{gf.path}: gemma3.rope.freq_base_swa={local}: llama.cpp runs Gemma 3's sliding layers at RoPE base "
                f"{_GEMMA3_LOCAL_THETA:g} whatever the file says"
            )
        local_theta = _GEMMA3_LOCAL_THETA
    period = _GEMMA_SLIDING_PERIOD[arch]
    sliding = tuple(i for i in range(num_layers) if i % period < period - 1)
    pattern = meta("attention.sliding_window_pattern")
    if pattern is not None and _pattern_layers(pattern, num_layers) != sliding:
        raise CheckpointError(
            f"{gf.path}: {arch}.attention.sliding_window_pattern={pattern} makes other layers slide than llama.cpp's "
            f"fixed {arch} rule (layers {sliding}), and llama.cpp versions differ on reading it"
        )
    return dict(
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=local_theta,
        post_norms=True,
        activation="gelu_tanh",
        embed_scale=hidden**0.5,
        attn_scale=scale,
        attn_softcap=caps["attn_logit_softcapping"],
        final_softcap=caps["final_logit_softcapping"],
    )


def _pattern_layers(pattern, num_layers: int) -> tuple[int, ...] | None:
    """The sliding layers a sliding_window_pattern names: a period (llama.cpp's set_swa_pattern: 0 is every layer)
    or one flag per layer; None for anything else."""
    if isinstance(pattern, (list, tuple)):
        return tuple(i for i, s in enumerate(pattern) if s) if len(pattern) == num_layers else None
    p = int(pattern)
    return tuple(i for i in range(num_layers) if p == 0 or i % p < p - 1)


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
    expected = {gguf_name(n, cfg.post_norms): s for n, s in hf_shapes.items()}
    # GGUF lists dims fastest-first; reversed they are numpy's (out, in). rope_freqs is in the config already.
    got = {n: tuple(int(x) for x in reversed(t.shape.tolist())) for n, t in by_name.items()}
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "factors":
        got.pop("rope_freqs.weight", None)
    check_tensors(str(gf.path), expected, got)
    for n in expected:
        ttype = GGMLQuantizationType(int(by_name[n].tensor_type))
        if ttype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise CheckpointError(f"{gf.path}: tensor '{n}' has type {ttype.name}; supported: {supported}")

    def get(hf_name: str) -> np.ndarray:
        name = gguf_name(hf_name, cfg.post_norms)
        w = _dequantized(gf, by_name[name], expected[name])
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    return params_from_hf_layout(cfg, get)


def _dequantized(gf: GGUFFile, t, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's values as float32 numpy in ``shape`` (numpy order), refusing a type this loader does not read."""
    ttype = GGMLQuantizationType(int(t.tensor_type))
    if ttype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise CheckpointError(f"{gf.path}: tensor '{t.name}' has type {ttype.name}; supported: {supported}")
    return dequantize(t.data, ttype).reshape(shape)


def load_gguf(path: str | os.PathLike, dtype="float32") -> tuple[LlamaConfig, Params, GGUFFile]:
    """path -> (config, params, parsed file); the file also feeds ``models.tokenizer.Tokenizer.from_gguf``."""
    gf = open_gguf(path)
    cfg = config_from_gguf(gf, dtype)
    return cfg, params_from_gguf(gf, cfg), gf
