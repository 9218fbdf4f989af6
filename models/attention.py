"""Attention over the index-masked KV cache, shared by both layer layouts of ``models.llama``: the cache writes, the
sliding-window mask and the attention itself (XLA, or the CPU kernel of ``models.cpu_kernels``).

Dimension vocabulary: B batch, T tokens in a call, S cache slots, L layers, H query heads, Hkv key/value heads,
G = H / Hkv query heads per KV head, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.cache import scratch_slots, write_layer
from models import cpu_kernels
from models.config import LlamaConfig
from models.rope import apply_rope

# Large but finite: a row with no visible slot (only possible for garbage rows) then gives a uniform
# distribution instead of NaNs that would poison a whole batch through later reductions.
MASK_VALUE = -1e30


def sliding_mask(mask: jax.Array, lengths: jax.Array, positions: jax.Array, window: int) -> jax.Array:
    """``mask`` [B, T, S] narrowed to keys fewer than ``window`` positions before each query (transformers'
    ``kv > q - window``): one more index condition on the same cache, nothing copied or evicted.

    A committed slot s holds position s (every decode path commits a row's tokens at the slots of their
    positions: prefill from 0, a chain in order, a tree's accepted path moved to consecutive slots); this call's
    own entry j, at slot ``lengths[b] + j``, holds ``positions[b, j]`` (a tree node's depth, not its slot).
    lengths [B]; positions [B, T] int32.
    """
    b, t, s = mask.shape
    if t == 0:
        return mask
    slot = jnp.arange(s, dtype=jnp.int32)[None, :]
    rel = slot - lengths[:, None]  # [B, S]
    own = jnp.take_along_axis(positions.astype(jnp.int32), jnp.clip(rel, 0, t - 1), axis=1)
    key_pos = jnp.where(rel < 0, slot, own)  # [B, S]
    return mask & (key_pos[:, None, :] > positions[:, :, None] - window)


def write_layer_kv(
    all_kv: jax.Array, layer: jax.Array, new: jax.Array, lengths: jax.Array, index: tuple | None = None
) -> jax.Array:
    """Write a call's T new entries into layer ``layer`` of the full cache, at slots ``lengths[b] + t``.

    all_kv [L, B, Hkv, S, D]; new [B, T, Hkv, D]; lengths [B]; index: ``write_index(lengths, B, T, S)``,
    computed once per call by the unstacked layout. Slots past the end are dropped (never clamped onto
    committed entries). The row scatter is ``jspec.cache.write_layer`` (vmapped over rows, so
    a batch-sharded cache scatters locally) applied to the layer slice, which then goes back with a
    dynamic_update_slice at the layer index (always in range, so its clamping is harmless). This form stays
    in place in the scan carry; see ``models.llama``'s module docstring.
    """
    if isinstance(layer, int):
        # Unstacked layers (straight-line code, no scan carry): the slice -> write -> update form copied the
        # whole cache at every layer there, and a scatter vmapped over the batch axis made XLA pick a
        # batch-major cache layout and convert to and from it. One scatter with explicit (row, slot) indices
        # into the full array stays in place.
        b, t = new.shape[:2]
        rows, slots = write_index(lengths, b, t, all_kv.shape[3]) if index is None else index
        # numpy indexing: the advanced indices (layer, rows, slots) are split by a slice, so the indexed
        # window is [B, T, Hkv, D], the layout ``new`` already has.
        return all_kv.at[layer, rows, :, slots, :].set(new.astype(all_kv.dtype), mode="drop")
    layer_kv = jax.lax.dynamic_index_in_dim(all_kv, layer, 0, keepdims=False)  # [B, Hkv, S, D]
    layer_kv = write_layer(layer_kv, new.transpose(0, 2, 1, 3), lengths)
    return jax.lax.dynamic_update_index_in_dim(all_kv, layer_kv, layer, 0)


def write_index(lengths: jax.Array, b: int, t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """(rows, slots) [B, T] int32 of a call's cache writes (see ``write_layer_kv``)."""
    slots = scratch_slots(lengths, jnp.arange(t, dtype=jnp.int32)[None, :], s)
    return jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)), slots


def attend(cfg: LlamaConfig, q, k, v, cos, sin, k_all, v_all, layer, lengths, mask, index=None):
    """Attention after the projections (and q/k norms), shared by both layer layouts.

    q [B, T, H, D]; k, v [B, T, Hkv, D] (before RoPE); k_all/v_all [L, B, Hkv, S, D]; mask [B, T, S] (the
    layer's own: sliding layers get the narrowed one); index: the cache-write index (``write_layer_kv``) when the
    caller computed it once for all layers. Returns (out [B, T, H*D] before the output projection, k_all, v_all
    with this call's K/V written).
    """
    b, t, h, d = q.shape
    dt = q.dtype
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    # Write first, then read the layer slice: see models.llama's module docstring for why the order matters.
    k_all = write_layer_kv(k_all, layer, k, lengths, index)
    v_all = write_layer_kv(v_all, layer, v, lengths, index)
    # The kernel has no soft cap: a capped model takes XLA's attention in every call (one path per model).
    if cfg.attn_softcap is None and cpu_kernels.cache_attention_applies(q, k_all, layer):
        # The CPU kernel reads the layer's K/V in place (no slice copies) in one call; see models.cpu_kernels.
        xla = lambda: xla_attention(cfg, q, k_all, v_all, layer, mask).reshape(b, t, h, d)  # noqa: E731
        out = cpu_kernels.cache_attention(q, k_all, v_all, mask, layer, cfg.query_scale, xla)
        return out.reshape(b, t, h * d).astype(dt), k_all, v_all
    return xla_attention(cfg, q, k_all, v_all, layer, mask), k_all, v_all


def xla_attention(cfg: LlamaConfig, q, k_all, v_all, layer, mask):
    """q [B, T, H, D] (after RoPE) against layer ``layer`` of k_all/v_all [L, B, Hkv, S, D] under mask
    [B, T, S] -> [B, T, H*D]."""
    b, t, h, d = q.shape
    hkv, dt = cfg.num_kv_heads, q.dtype
    k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False)  # [B, Hkv, S, D]
    v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False)

    # Scores are slot-major, [B, Hkv, S, G*T] = K [S, D] x q^T: both cache reads then take K and V in their
    # stored [S, D] layout. Query-major scores (q x K^T) made XLA:CPU copy every layer's K into [D, S] before
    # the dot; this form was 4-6% faster per SmolLM2 decode step (21.96 vs 23.41 ms, alternated in one process).
    g = h // hkv  # query heads sharing one KV head
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # [B, Hkv, G*T, D]
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(
        k_layer.astype(dt), qg, (((3,), (3,)), batch), preferred_element_type=jnp.float32
    )  # [B, Hkv, S, G*T]
    scores = scores.reshape(b, hkv, -1, g, t) * cfg.query_scale
    if cfg.attn_softcap is not None:  # before the mask, as transformers caps (masked scores stay masked)
        scores = jnp.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
    scores = jnp.where(mask.transpose(0, 2, 1)[:, None, :, None, :], scores, MASK_VALUE)  # mask [B, S, T]
    probs = jax.nn.softmax(scores, axis=2).astype(dt).reshape(b, hkv, -1, g * t)  # over slots
    out = jax.lax.dot_general(probs, v_layer.astype(dt), (((2,), (2,)), batch))  # [B, Hkv, G*T, D]
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)
