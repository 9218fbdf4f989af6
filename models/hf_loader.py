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
from models.llama import LlamaConfig, Params, canonical_dtype

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# What transformers' config class of each model type (configuration_<type>.py) takes for a key config.json
# lacks, where that is not "none": a Mistral config without sliding_window slides a 4096-token window, Mistral
# and Qwen2 configs without num_key_value_heads have 8 and 32 KV heads (an explicit null is "none": one KV head
# per attention head, as for Llama).
_ABSENT_DEFAULTS = {
    "llama": {},
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"sliding_window": 4096, "num_key_value_heads": 32},
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
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{cfg_path}: unsupported model_type '{mtype}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    absent = {k: v for k, v in _ABSENT_DEFAULTS[mtype].items() if k not in c}
    c = c | absent
    rope_theta = _rope_theta(c, cfg_path)
    window = f"sliding_window={c.get('sliding_window')}"
    if "sliding_window" in absent:
        window += " (transformers' default for a config.json without one)"
    unsupported = {
        "attention_bias": mtype != "qwen2" and c.get("attention_bias", False),
        "mlp_bias": c.get("mlp_bias", False),
        # Qwen2 names the layers that slide (_qwen2_sliding_layers); the others have no per-layer switch.
        "use_sliding_window": mtype != "qwen2" and c.get("use_sliding_window", False),
        window: mtype == "mistral" and c.get("sliding_window") is not None,
        f"hidden_act={c.get('hidden_act')}": c.get("hidden_act", "silu") != "silu",
    }
    partial = c.get("partial_rotary_factor")  # null is unset, as transformers reads it
    unsupported[f"partial_rotary_factor={partial}"] = partial not in (None, 1)
    if mtype == "qwen2":
        sliding = _qwen2_sliding_layers(c, cfg_path)
        unsupported[f"sliding-window attention in layers {sliding}"] = bool(sliding)
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"{cfg_path}: unsupported setting {bad[0]}")
    # Several end tokens (Llama-3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>): the first is the canonical one;
    # generate() stops at those of generation_config.json as well.
    eos = hf_id_list(c, "eos_token_id", cfg_path) + hf_id_list(
        read_json(gen := os.path.join(path, "generation_config.json")), "eos_token_id", gen
    )
    bos = hf_id_list(c, "bos_token_id", cfg_path)  # -1 is "none", as for every id of config.json
    dtype = canonical_dtype(dtype)  # outside the try: a bad argument is not a bad config.json
    try:
        heads = int(c["num_attention_heads"])
        return LlamaConfig(
            vocab_size=int(c["vocab_size"]),
            hidden=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
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
        )
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: missing key {e}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:  # e.g. "num_attention_heads": null, or 0
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _rope_theta(c: dict, cfg_path: str) -> float:
    """config.json's RoPE base, read as transformers 5 reads it, refusing scaling this model does not implement.

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
        if rope_type not in (None, "default"):
            raise CheckpointError(f"{cfg_path}: RoPE scaling '{rope_type}' is not supported")
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
    return float(theta)


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
        if not isinstance(types, list) or len(types) != layers:
            raise CheckpointError(f"{cfg_path}: layer_types must list one type per layer ({layers}), got {types!r}")
        # "attention" is the legacy name transformers reads as "full_attention" (remap_legacy_layer_types).
        other = [t for t in types if t not in ("full_attention", "attention", "sliding_attention")]
        if other:
            raise CheckpointError(f"{cfg_path}: unsupported layer type {other[0]!r} in layer_types")
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
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
    return params_from_hf_layout(cfg, lambda n: refs[n].load())


def load_hf(path: str | os.PathLike, dtype="float32") -> tuple[LlamaConfig, Params]:
    cfg = config_from_hf(path, dtype)
    return cfg, params_from_hf(path, cfg)
