"""The static description of a decoder of the Llama family: ``LlamaConfig`` and ``RopeScaling``.

One config covers Llama 2/3, SmolLM2, Mistral-style GQA, Qwen2/Qwen3, Gemma 2 and Gemma 3 (text): the families
differ by flags here (q/k norms, post norms, the activation, soft caps, the embedding scale, the query scale,
sliding-window layers, RoPE scaling), not by code paths of their own. Frozen and hashable: a config keys the jit
cache, so every field is a scalar, a tuple or another frozen dataclass.

What the checkpoint loaders fold into the weights instead of a flag: Gemma's RMSNorm scales by (1 + w), so its
loader stores w + 1 and every model runs one RMSNorm (the CPU kernels fuse that one into their matmuls).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# The MLP's gate activation: SwiGLU's silu, or GeGLU's tanh-approximated gelu (transformers' gelu_pytorch_tanh).
ACTIVATIONS = ("silu", "gelu_tanh")

# RoPE frequency scalings that run exactly as transformers computes them (modeling_rope_utils): "linear" divides
# every frequency by ``factor``; "llama3" divides the low frequencies by it and interpolates the middle band.
# "factors" divides frequency i by ``factors[i]``: llama.cpp's per-frequency form (a GGUF file's rope_freqs tensor,
# which is how its converter stores llama3's scaling), carried as the file gives it rather than re-derived.
ROPE_SCALINGS = ("linear", "llama3", "factors")


def canonical_dtype(dtype: Any) -> str:
    """'float32' / 'bfloat16' from a string or a numpy/jax dtype."""
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    name = {"f32": "float32", "bf16": "bfloat16", "fp32": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported parameter dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return name


def end_token_ids(ids) -> tuple[int, ...]:
    """End-of-generation ids in order, first occurrence kept, None (unset) left out: the canonical EOS first."""
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How the RoPE frequencies of a layer are scaled. kind: one of ``ROPE_SCALINGS``; factor: the divisor;
    low_freq_factor / high_freq_factor / original_max_positions: llama3's band edges (wavelengths longer than
    original_max_positions / low_freq_factor are divided by factor, shorter than original_max_positions /
    high_freq_factor kept, those between interpolated). factors: kind "factors" only, one divisor per rotation
    frequency ([head_dim / 2], a tuple so the config stays hashable); ``factor`` is unused there (1.0)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling '{self.kind}' is not supported (supported: {', '.join(ROPE_SCALINGS)})")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        # A list read back from JSON (dataclasses.asdict) becomes a tuple again: the config keys the jit cache.
        object.__setattr__(self, "factors", tuple(float(f) for f in self.factors))
        if (self.kind == "factors") != bool(self.factors):
            raise ValueError(
                f"RoPE scaling '{self.kind}' with {len(self.factors)} factors: kind 'factors' needs them, others "
                "take none"
            )
        bad = [f for f in self.factors if not (math.isfinite(f) and f > 0)]
        if bad:
            raise ValueError(f"RoPE frequency factors must be finite and > 0, got {bad[0]}")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(
                f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor} "
                f"and {self.high_freq_factor}"
            )
        if self.kind == "llama3" and self.original_max_positions < 1:
            raise ValueError(
                f"llama3 RoPE scaling needs original_max_positions >= 1, got {self.original_max_positions}"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static shape and numerics of a Llama-family model (hashable: it keys the jit cache). max_positions: the
    context length it was trained for (GGUF ``context_length``, HF ``max_position_embeddings``; None when
    unknown): ``jspec.decode`` refuses a request that would feed a position at or past it. eos_ids: every id
    that ends generation (``eos_id``, the canonical one, first; Llama-3 lists ``<|eot_id|>`` too).

    Family features (defaults: Llama's):
    rope_scaling: the frequency scaling of the full-attention layers' RoPE (Llama 3.1's llama3, Gemma 3's linear).
    sliding_layers / sliding_window: layers whose tokens see only keys fewer than ``sliding_window`` positions
    back (an index mask on the same cache: no copies); local_rope_theta: their RoPE base when it differs from
    the full layers' (Gemma 3; such layers are never scaled). qk_norm: RMSNorm over each head of q and k before
    RoPE (Qwen3, Gemma 3). post_norms: RMSNorm on the attention and MLP outputs before the residual add (Gemma).
    activation: ``ACTIVATIONS``. embed_scale: multiplies the token embeddings (Gemma: sqrt(hidden)). attn_scale:
    the query scale (None: 1/sqrt(head_dim); Gemma: query_pre_attn_scalar^-0.5). attn_softcap / final_softcap:
    cap * tanh(x / cap) on the attention scores / the logits (Gemma 2).
    """

    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    dtype: str = "float32"
    name: str = "llama"
    max_positions: int | None = None
    eos_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        ends = end_token_ids([self.eos_id, *self.eos_ids])
        object.__setattr__(self, "eos_ids", ends)
        object.__setattr__(self, "eos_id", ends[0] if ends else None)
        if isinstance(self.rope_scaling, Mapping):  # a config read back from JSON (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        if self.max_positions is not None and int(self.max_positions) < 1:
            raise ValueError(f"max_positions={self.max_positions} must be >= 1 (or None: unknown)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        factors = self.rope_scaling.factors if self.rope_scaling is not None else ()
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"{len(factors)} RoPE frequency factors for head_dim={self.head_dim}: one per rotation frequency "
                f"({self.head_dim // 2})"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not supported (supported: {', '.join(ACTIVATIONS)})")
        layers = self.sliding_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"sliding_layers={layers} must be distinct ascending layers in [0, {self.num_layers})")
        if bool(layers) != (self.sliding_window is not None):
            raise ValueError(
                f"sliding_layers={layers} and sliding_window={self.sliding_window}: give both (layers that slide "
                "and their window) or neither"
            )
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        for name in ("attn_softcap", "final_softcap", "attn_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value} must be a positive number (or None: off)")

    @property
    def jdtype(self):
        return DTYPES[self.dtype]

    @property
    def query_scale(self) -> float:
        """What attention multiplies q.k by."""
        return 1.0 / math.sqrt(self.head_dim) if self.attn_scale is None else float(self.attn_scale)

    @property
    def layer_slides(self) -> tuple[bool, ...]:
        """Per layer: whether it is a sliding-window layer."""
        return tuple(i in self.sliding_layers for i in range(self.num_layers))

    def rope_of(self, sliding: bool) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of the RoPE that full-attention (sliding=False) or sliding layers use."""
        if sliding and self.local_rope_theta is not None:
            return float(self.local_rope_theta), None
        return float(self.rope_theta), self.rope_scaling

    def layers_of(self, source: tuple[int, ...], **changes) -> LlamaConfig:
        """A config of ``len(source)`` layers that are the layers ``source`` of this one, each keeping its
        attention kind (a LayerSkip exit's first E layers, a draft copying some target layers)."""
        sliding = tuple(i for i, src in enumerate(source) if src in self.sliding_layers)
        window = self.sliding_window if sliding else None
        return self.replace(num_layers=len(source), sliding_layers=sliding, sliding_window=window, **changes)

    def features(self) -> tuple[str, ...]:
        """The flags this config sets beyond a Llama 2-style decoder (names of fields off their defaults), for
        model code that implements only that decoder to refuse by name."""
        plain = LlamaConfig(1, 2, 1, 1, 1, 2, 1)
        names = ("rope_scaling", "local_rope_theta", "sliding_window", "qk_norm", "post_norms", "activation")
        names += ("embed_scale", "attn_scale", "attn_softcap", "final_softcap")
        return tuple(n for n in names if getattr(self, n) != getattr(plain, n))

    def replace(self, **changes) -> LlamaConfig:
        if "eos_id" in changes and "eos_ids" not in changes:  # a new EOS replaces the old end tokens
            changes["eos_ids"] = ()
        if "num_layers" in changes and self.sliding_layers and "sliding_layers" not in changes:
            # Which of the new layers slide is the caller's to say (a prefix keeps its layers' kinds; other
            # layer choices do not): guessing would run some layer with the wrong attention.
            raise ValueError(
                f"{self.name} has sliding-window layers {self.sliding_layers}: a config with num_layers="
                f"{changes['num_layers']} must give its own sliding_layers"
            )
        return dataclasses.replace(self, **changes)
