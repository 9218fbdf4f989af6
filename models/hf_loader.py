"""Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded) into config + params.

Pure steps: read the config (``config_from_hf``) -> index the safetensors headers (``index_safetensors``) ->
check every name and shape -> nest (``checkpoint.params_from_hf_layout``). HF weights are already in the
rotate-half RoPE layout, so nothing is permuted.

safetensors files are read with a small header parser + ``numpy.memmap`` rather than ``safetensors.numpy``,
because numpy has no native bfloat16 and bf16 checkpoints are the common case (``ml_dtypes`` supplies it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from models.checkpoint import (
    CheckpointError,
    check_tensors,
    hf_expected_shapes,
    hf_id_list,
    params_from_hf_layout,
    read_json,
)
from models.config import LlamaConfig, RopeScaling, canonical_dtype
from models.llama import Params

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
# What transformers' config class of each model type (configuration_<type>.py) takes for a key config.json
# lacks, where that is not "none": a Mistral config without sliding_window slides a 4096-token window, Mistral
# and Qwen2 configs without num_key_value_heads have 8 and 32 KV heads (an explicit null is "none": one KV head
# per attention head, as for Llama); Qwen3 and Gemma fix head_dim instead of deriving it from the hidden width.
_GEMMA_DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}
_ABSENT_DEFAULTS = {
    "llama": {},
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"sliding_window": 4096, "num_key_value_heads": 32},
    "qwen3": {"sliding_window": 4096, "num_key_value_heads": 32, "head_dim": 128},
    "gemma2": _GEMMA_DEFAULTS | {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": _GEMMA_DEFAULTS,
}
# Gemma's RMSNorm scales by (1 + w): the loader stores w + 1, so one RMSNorm (and the CPU kernels' fused one) runs
# every family. (llama.cpp's converter adds the 1 itself: GGUF norms need nothing.)
_NORM_OFFSET = {"gemma2": 1.0, "gemma3_text": 1.0}
# Model types that name another family's text model, refused with what to load instead.
_OTHER_MODEL_TYPES = {
    "gemma3": "the multimodal Gemma 3 (its text model, model_type gemma3_text, is supported)",
    "gemma": "Gemma 1 (Gemma 2 and the Gemma 3 text model are supported)",
}
# transformers' activation names (ACT2FN) -> models.config.ACTIVATIONS; others are refused by name.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# The keys each RoPE type reads (modeling_rope_utils); any other key is a setting this model would not apply.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype, shape, byte range inside the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def load(self) -> np.ndarray:
        count = (self.end - self.start) // _ST_DTYPES[self.dtype].itemsize
        arr = np.memmap(self.file, dtype=_ST_DTYPES[self.dtype], mode="r", offset=self.start, shape=(count,))
        return np.asarray(arr).reshape(self.shape)


def _read_safetensors_header(path: str) -> dict[str, TensorRef]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    base = 8 + n
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(x) is int for x in offsets)
            and isinstance(shape, list)
            and all(type(x) is int and x >= 0 for x in shape)
        ):
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor '{name}' needs a shape and data_offsets [start, end]"
            )
        start, end = offsets
        if base + end > size:
            raise CheckpointError(f"{path}: truncated safetensors file: tensor '{name}' ends past the end of the file")
        if not 0 <= start <= end:
            # Offsets count from the end of the header: a negative start would read header bytes as weights.
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor '{name}' has data_offsets {offsets}")
        dtype, shape = info.get("dtype"), tuple(shape)
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype}, not supported ({sorted(_ST_DTYPES)})")
        if end - start != int(np.prod(shape)) * _ST_DTYPES[dtype].itemsize:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor '{name}' of shape {shape} and dtype {dtype} spans "
                f"{end - start} bytes"
            )
        refs[name] = TensorRef(path, dtype, shape, base + start, base + end)
    # Tensors must not share bytes (the safetensors format lays them out back to back): an overlap is a corrupt
    # header, whose tensors would read each other's weights.
    spans = sorted((r.start, r.end, name) for name, r in refs.items() if r.end > r.start)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensors '{a}' and '{b}' overlap")
    return refs


def index_safetensors(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Read step: tensor name -> location, from model.safetensors or else a sharded index (transformers'
    ``from_pretrained`` order: a directory holding both loads model.safetensors and ignores the index)."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return _read_safetensors_header(single)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: no weight_map (tensor name -> shard file) in the index")
        shards: dict[str, dict[str, TensorRef]] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{path}: shard '{shard}' listed in the index is missing")
            shards[shard] = _read_safetensors_header(shard_path)
        # Each tensor from the shard the index names (a copy in another shard must not win by file order),
        # and every tensor of every shard listed in the index (an unlisted one is still checked as unexpected).
        refs: dict[str, TensorRef] = {}
        for shard, found in shards.items():
            for name, ref in found.items():
                if weight_map.get(name, shard) == shard:
                    refs[name] = ref
        missing = sorted(n for n, shard in weight_map.items() if n not in shards[shard])
        if missing:
            raise CheckpointError(f"{path}: tensor '{missing[0]}' listed in the index is not in its shard")
        return refs
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def config_from_hf(path: str | os.PathLike, dtype="float32", name: str | None = None) -> LlamaConfig:
    """Config step: config.json -> LlamaConfig, rejecting features this model does not implement."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    c = read_json(cfg_path)
    if c is None:
        raise CheckpointError(f"{path}: no config.json")
    mtype = c.get("model_type")
    if mtype in _OTHER_MODEL_TYPES:
        raise CheckpointError(f"{cfg_path}: unsupported model_type '{mtype}': {_OTHER_MODEL_TYPES[mtype]}")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{cfg_path}: unsupported model_type '{mtype}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    absent = {k: v for k, v in _ABSENT_DEFAULTS[mtype].items() if k not in c}
    c = c | absent
    rope_theta, rope_scaling, local_theta = _rope(c, cfg_path, mtype)
    act_key = "hidden_activation" if mtype in GEMMA else "hidden_act"  # Gemma's models read hidden_activation
    act = c.get(act_key, "silu")
    unsupported = {
        "attention_bias": mtype != "qwen2" and c.get("attention_bias", False),
        "mlp_bias": c.get("mlp_bias", False),
        f"{act_key}={act}": act not in _ACTIVATIONS,
        # Gemma 2/3 embedding models attend both ways; a causal decoder cannot run them.
        "use_bidirectional_attention": c.get("use_bidirectional_attention") or False,
        # Gemma 3's attention never applies this cap in transformers (the argument is not passed on): a config
        # that sets it asks for something its reference does not do, so neither reading is safe.
        f"attn_logit_softcapping={c.get('attn_logit_softcapping')} (transformers' Gemma 3 does not apply it)": (
            mtype == "gemma3_text" and c.get("attn_logit_softcapping") is not None
        ),
    }
    partial = c.get("partial_rotary_factor")  # null is unset, as transformers reads it
    unsupported[f"partial_rotary_factor={partial}"] = partial not in (None, 1)
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"{cfg_path}: unsupported setting {bad[0]}")
    sliding = _sliding_layers(c, cfg_path, mtype)
    # Several end tokens (Llama-3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>): the first is the canonical one;
    # generate() stops at those of generation_config.json as well.
    eos = hf_id_list(c, "eos_token_id", cfg_path) + hf_id_list(
        read_json(gen := os.path.join(path, "generation_config.json")), "eos_token_id", gen
    )
    bos = hf_id_list(c, "bos_token_id", cfg_path)  # -1 is "none", as for every id of config.json
    dtype = canonical_dtype(dtype)  # outside the try: a bad argument is not a bad config.json
    gemma = mtype in GEMMA
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return LlamaConfig(
            vocab_size=int(c["vocab_size"]),
            hidden=hidden,
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            ffn=int(c["intermediate_size"]),
            rope_theta=rope_theta,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=mtype == "qwen2",
            bos_id=bos[0] if bos else None,
            eos_id=eos[0] if eos else None,
            eos_ids=tuple(eos),
            dtype=dtype,
            name=name or os.path.basename(os.path.normpath(path)),
            max_positions=int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
            rope_scaling=rope_scaling,
            local_rope_theta=local_theta if sliding else None,
            sliding_window=int(c["sliding_window"]) if sliding else None,
            sliding_layers=tuple(sliding),
            qk_norm=mtype in ("qwen3", "gemma3_text"),
            post_norms=gemma,
            activation=_ACTIVATIONS[act],
            embed_scale=hidden**0.5 if gemma else 1.0,
            attn_scale=float(c["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            attn_softcap=_cap(c, "attn_logit_softcapping", cfg_path) if mtype == "gemma2" else None,
            final_softcap=_cap(c, "final_logit_softcapping", cfg_path) if gemma else None,
        )
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: missing key {e}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:  # e.g. "num_attention_heads": null, or 0
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _cap(c: dict, key: str, cfg_path: str) -> float | None:
    """A soft cap of config.json (null: off)."""
    cap = c.get(key)
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise CheckpointError(f"{cfg_path}: {key} must be a positive number or null, got {cap!r}")
    return float(cap)


def _rope(c: dict, cfg_path: str, mtype: str) -> tuple[float, RopeScaling | None, float | None]:
    """(base, scaling) of the full-attention layers' RoPE and the sliding layers' base (Gemma 3's local RoPE;
    None: the full layers' RoPE), read as transformers 5 reads them."""
    if mtype != "gemma3_text":
        theta, scaling = _rope_theta(c, cfg_path)
        return theta, scaling, None
    # Gemma3TextConfig.convert_rope_params_to_dict: rope_parameters keyed by layer type, else the legacy keys
    # (rope_theta 1e6 and rope_scaling for the full layers, rope_local_base_freq 1e4 for the sliding ones).
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"}:
        raise CheckpointError(
            f"{cfg_path}: Gemma 3's rope_parameters must be keyed by layer type (full_attention, sliding_attention), "
            f"got {params!r}"
        )
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    if c.get("rope_scaling"):
        full.update(c["rope_scaling"])
    full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    theta, scaling = _rope_theta({"rope_parameters": full}, cfg_path)
    local_theta, local_scaling = _rope_theta({"rope_parameters": local}, cfg_path)
    if local_scaling is not None:
        raise CheckpointError(
            f"{cfg_path}: RoPE scaling '{local_scaling.kind}' of the sliding layers is not supported (only their "
            "base, rope_theta)"
        )
    return theta, scaling, local_theta


def _rope_theta(c: dict, cfg_path: str) -> tuple[float, RopeScaling | None]:
    """config.json's RoPE base and scaling, read as transformers 5 reads them, refusing kinds and keys this model
    does not implement.

    transformers (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``) takes its RoPE dict from
    ``rope_scaling`` when that is non-empty, else from ``rope_parameters``, and the base from that dict's
    ``rope_theta``, else the top-level ``rope_theta``, else 10000. A config giving both dicts, different, is
    refused: transformers would ignore ``rope_parameters`` (the current name) without a word.
    """
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    # Both places may name a type; a scaling entry that names none (only a factor) still scales positions.
    for where, d in (("rope_scaling", scaling), ("rope_parameters", rope)):
        if not isinstance(d, dict):
            raise CheckpointError(f"{cfg_path}: {where} must be an object, got {d!r}")
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type is not None and rope_type not in _ROPE_KEYS:
            raise CheckpointError(
                f"{cfg_path}: RoPE scaling '{rope_type}' is not supported (supported: {', '.join(_ROPE_KEYS)})"
            )
        other = sorted(set(d) - {"rope_type", "type", "rope_theta"})
        if rope_type is None and other:
            raise CheckpointError(
                f"{cfg_path}: {where} has {other} but no type: RoPE scaling of an unknown kind is not supported"
            )
    if rope and scaling and rope != scaling:
        raise CheckpointError(
            f"{cfg_path}: rope_scaling {scaling} and rope_parameters {rope} differ: transformers would read only "
            "rope_scaling; give one of them"
        )
    d = scaling or rope
    theta = d["rope_theta"] if "rope_theta" in d else c.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(f"{cfg_path}: rope_theta must be a positive number, got {theta!r}")
    kind = d.get("rope_type", d.get("type")) or "default"
    keys = _ROPE_KEYS[kind]
    extra = sorted(set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *keys})
    if extra:
        raise CheckpointError(f"{cfg_path}: RoPE scaling '{kind}' with {extra}: settings this model does not apply")
    if d.get("partial_rotary_factor") not in (None, 1):
        raise CheckpointError(f"{cfg_path}: unsupported setting partial_rotary_factor={d['partial_rotary_factor']}")
    if kind == "default":
        return float(theta), None
    missing = [k for k in keys if k not in d]
    if missing:
        raise CheckpointError(f"{cfg_path}: RoPE scaling '{kind}' needs {missing}")
    values = {k: d[k] for k in keys}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values.values()):
        raise CheckpointError(f"{cfg_path}: RoPE scaling '{kind}' settings must be numbers, got {values}")
    try:
        return float(theta), RopeScaling(
            kind,
            float(values["factor"]),
            **(
                {
                    "low_freq_factor": float(values["low_freq_factor"]),
                    "high_freq_factor": float(values["high_freq_factor"]),
                    "original_max_positions": int(values["original_max_position_embeddings"]),
                }
                if kind == "llama3"
                else {}
            ),
        )
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _sliding_layers(c: dict, cfg_path: str, mtype: str) -> list[int]:
    """The layers that attend within ``sliding_window``, as transformers decides for each model type: Mistral
    all of them when the window is set; Qwen2/Qwen3 ``_qwen2_sliding_layers``; Gemma its ``layer_types``, else
    every other layer from the first (Gemma 2) or all but every sliding_window_pattern-th (Gemma 3, 6)."""
    try:
        layers = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return []  # refused by name where the config is read
    if mtype == "mistral":
        return list(range(layers)) if c.get("sliding_window") is not None else []
    if mtype in ("qwen2", "qwen3"):
        return _qwen2_sliding_layers(c, cfg_path)
    if mtype == "llama":
        return []
    types = c.get("layer_types")
    if types is None:
        every = 2 if mtype == "gemma2" else c.get("sliding_window_pattern", 6)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(f"{cfg_path}: sliding_window_pattern must be a layer count, got {every!r}")
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    sliding = _typed_sliding_layers(types, layers, cfg_path)
    if sliding and c.get("sliding_window") is None:
        raise CheckpointError(
            f"{cfg_path}: layer_types makes layers {sliding} sliding_attention but sliding_window is null: sliding "
            "layers without a window, which transformers cannot run either"
        )
    return sliding


def _typed_sliding_layers(types, layers: int, cfg_path: str) -> list[int]:
    """The sliding layers a ``layer_types`` list names, refusing other attention kinds by name."""
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"{cfg_path}: layer_types must list one type per layer ({layers}), got {types!r}")
    # "attention" is the legacy name transformers reads as "full_attention" (remap_legacy_layer_types).
    other = [t for t in types if t not in ("full_attention", "attention", "sliding_attention")]
    if other:
        raise CheckpointError(f"{cfg_path}: unsupported layer type {other[0]!r} in layer_types")
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _qwen2_sliding_layers(c: dict, cfg_path: str) -> list[int]:
    """The layers a Qwen2 config gives sliding-window attention, as transformers' Qwen2Config decides: its
    ``layer_types`` when given, else layer i slides when ``use_sliding_window`` is on, ``sliding_window`` is not
    null and i >= ``max_window_layers`` (defaults 4096 and 28). So ``max_window_layers >= num_hidden_layers``
    means no layer slides."""
    try:
        layers = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return []  # refused by name where the config is read
    types = c.get("layer_types")
    if types is not None:
        sliding = _typed_sliding_layers(types, layers, cfg_path)
        if not sliding or (c.get("use_sliding_window", False) and c.get("sliding_window") is not None):
            return sliding
        # Qwen2Config then sets sliding_window to None and keeps layer_types; transformers' model cannot run that
        # (its cache and its sliding-window mask both need the window), so it is no full-attention model either.
        off = "sliding_window is null" if c.get("use_sliding_window", False) else "use_sliding_window is false"
        raise CheckpointError(
            f"{cfg_path}: layer_types makes layers {sliding} sliding_attention but {off}: sliding layers without a "
            "window, which transformers cannot run either"
        )
    if not c.get("use_sliding_window", False) or c.get("sliding_window", 4096) is None:
        return []
    first = c.get("max_window_layers", 28)
    if isinstance(first, bool) or not isinstance(first, int):
        raise CheckpointError(f"{cfg_path}: max_window_layers must be a layer count, got {first!r}")
    return list(range(max(first, 0), layers))


def params_from_hf(path: str | os.PathLike, cfg: LlamaConfig) -> Params:
    """Check and nest every tensor of the directory into params in ``cfg.dtype``."""
    refs = index_safetensors(path)
    expected = hf_expected_shapes(cfg)
    # Tied checkpoints sometimes still store the (duplicate) head; rotary caches are derived, not weights.
    check_tensors(
        os.fspath(path),
        expected,
        {n: r.shape for n, r in refs.items()},
        ignore=lambda n: (cfg.tie_embeddings and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"),
    )
    offset = _NORM_OFFSET.get((read_json(os.path.join(os.fspath(path), "config.json")) or {}).get("model_type"), 0.0)

    def get(name: str) -> np.ndarray:
        w = refs[name].load()
        if offset and name.endswith("norm.weight"):  # in f32, as transformers adds it, before the cast to cfg.dtype
            return w.astype(np.float32) + np.float32(offset)
        return w

    return params_from_hf_layout(cfg, get)


def load_hf(path: str | os.PathLike, dtype="float32") -> tuple[LlamaConfig, Params]:
    cfg = config_from_hf(path, dtype)
    return cfg, params_from_hf(path, cfg)
