"""Rotary position embeddings in the rotate-half (GPT-NeoX / Hugging Face) layout, with the frequency scalings of
``models.config.ROPE_SCALINGS`` computed as transformers computes them (``modeling_rope_utils``), in float32 (and
llama.cpp's per-frequency factors as a GGUF file stores them).

The GGUF loader undoes llama.cpp's row permutation so that both checkpoint formats share this one layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.config import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """[D/2] float32 rotation frequencies."""
    freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind == "factors":  # llama.cpp's rope_freqs: each frequency divided by its own factor
        return freq / jnp.asarray(scaling.factors, jnp.float32)
    # llama3: long wavelengths (past the original context / low_freq_factor) are slowed by ``factor``, short ones
    # (under the original context / high_freq_factor) kept, and the band between interpolated smoothly.
    old = scaling.original_max_positions
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > old / scaling.low_freq_factor, freq / scaling.factor, freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old / scaling.high_freq_factor) & ~(wavelen > old / scaling.low_freq_factor)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """[B, T] int positions -> cos, sin [B, T, D/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq(head_dim, theta, scaling)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, T, N, D]; cos, sin [B, T, D/2]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
