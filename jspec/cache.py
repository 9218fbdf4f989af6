"""Index-masked KV cache.

Dimension vocabulary used throughout jspec: B batch, T tokens in a call, K draft length, V vocab,
S cache slots, L layers, H query heads, Hkv key/value heads, D head dim.

The cache is an immutable pytree. A row's committed prefix is slots ``[0, lengths[b])``; everything at or
beyond ``lengths[b]`` is scratch: a model call writes its T new tokens at slots ``lengths[b] + t`` without
committing them, and the decoder commits a per-row number of them afterwards. Rollback is therefore free
(nothing is zeroed): rejected entries stay in the array, invisible because validity comes from the index
mask, and are overwritten by the next call.

Writes are scatters with ``mode="drop"`` rather than ``dynamic_update_slice``: the latter clamps its start
index so the window fits, which would silently overwrite committed slots near the end of the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Logical axis names of the cache arrays, read by the sharding rules table.
KV_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values plus per-row committed lengths.

    k, v: [L, B, Hkv, S, D]  (batch and KV heads lead so the cache shards over them, never over S)
    lengths: [B] int32, committed slots per row.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    @classmethod
    def init(cls, num_layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, dtype=jnp.float32):
        shape = (num_layers, batch, kv_heads, slots, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def commit(self, n: jax.Array, path: jax.Array | None = None) -> KVCache:
        """Commit, per row, ``n[b]`` of the entries written by the last call.

        n: [B] number of entries to keep; the rest of the row's scratch stays invisible.
        path: None for a chain (the first n written entries are already in place, only lengths move), or
          [B, P] int32 offsets (relative to ``lengths``) of the entries to keep, in order: for a tree, the
          accepted root-to-leaf path, whose entries move from scratch slots into consecutive committed slots.
        """
        if path is None:
            return dataclasses.replace(self, lengths=self.lengths + n.astype(jnp.int32))
        return commit_path(self, path, n)

    def insert(self, row: jax.Array, one: KVCache) -> KVCache:
        """Replace batch row ``row`` with the single-row cache ``one`` (continuous batching: a new request
        is prefilled alone, then dropped into a free row while the other rows keep their state)."""
        return insert_row(self, row, one)


def scratch_slots(lengths: jax.Array, offsets: jax.Array, slots: int) -> jax.Array:
    """[B], [B, T] -> [B, T] absolute slots ``lengths + offsets``, with anything >= ``slots`` mapped to
    ``slots`` so a ``mode="drop"`` scatter discards it instead of clamping onto committed entries."""
    idx = lengths[:, None] + offsets
    return jnp.where((idx >= 0) & (idx < slots), idx, slots)


def write_layer(layer_cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write a call's T new entries into one layer's cache at ``lengths[b] + t``.

    layer_cache: [B, Hkv, S, D]; new: [B, Hkv, T, D]; lengths: [B]. Returns [B, Hkv, S, D].
    Vmapped over rows so a batch-sharded cache takes a local scatter (no all-gather).
    """
    slots = layer_cache.shape[2]
    t = new.shape[2]
    idx = scratch_slots(lengths, jnp.arange(t, dtype=jnp.int32)[None, :], slots)

    def one_row(row, upd, i):  # row [Hkv, S, D], upd [Hkv, T, D], i [T]
        return row.at[:, i, :].set(upd.astype(row.dtype), mode="drop")

    return jax.vmap(one_row)(layer_cache, new, idx)


def attention_mask(lengths: jax.Array, num_new: int, slots: int, tree_mask: jax.Array | None = None) -> jax.Array:
    """[B, T, S] bool: which cache slots each of a call's T new tokens may attend to.

    A new token sees every committed slot (``s < lengths[b]``) and, among the call's own entries (slots
    ``lengths[b] + j``), those allowed by ``tree_mask`` [B, T, T] (``tree_mask[b, i, j]``: token i sees new
    token j). The default is causal (a chain). For a candidate tree pass the ancestor mask (each node sees
    itself and its ancestors, never siblings). Scratch left over from earlier calls is never visible.
    """
    s = jnp.arange(slots, dtype=jnp.int32)[None, None, :]
    rel = s - lengths[:, None, None]  # offset of slot s inside this call's block
    committed = rel < 0
    if tree_mask is None:
        own = (rel >= 0) & (rel <= jnp.arange(num_new, dtype=jnp.int32)[None, :, None])
    else:
        in_block = (rel >= 0) & (rel < num_new)
        relc = jnp.clip(rel, 0, num_new - 1)  # [B, 1, S]
        b = tree_mask.shape[0]
        gathered = jnp.take_along_axis(tree_mask, jnp.broadcast_to(relc, (b, num_new, slots)).astype(jnp.int32), axis=2)
        own = in_block & gathered
    return committed | own


def commit_path(cache, path: jax.Array, n: jax.Array):
    """Generic commit for any cache pytree with ``k``/``v`` of layout [L, B, Hkv, S, D] and ``lengths``.

    Entries at ``lengths + path[b, j]`` (j < n[b]) move to ``lengths + j``; then ``lengths += n``.
    Sources are gathered before any write, so overlapping source and destination slots are safe.
    """
    slots = cache.k.shape[3]
    src = scratch_slots(cache.lengths, path, slots)  # [B, P]
    p = path.shape[1]
    dst_off = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], path.shape)
    dst_off = jnp.where(dst_off < n[:, None], dst_off, slots)  # entries beyond n are not moved
    dst = scratch_slots(cache.lengths, dst_off, slots)

    rows = jnp.broadcast_to(jnp.arange(path.shape[0], dtype=jnp.int32)[:, None], path.shape)  # [B, P]

    def move(arr):  # [L, B, Hkv, S, D]
        # One gather and one scatter with explicit (row, slot) indices. The advanced indices are split by a
        # slice, so the moved window is [B, P, L, Hkv, D] on both sides. A scatter vmapped over the batch axis
        # made XLA:CPU convert the whole cache to a batch-major layout and back every round.
        vals = arr[:, rows, :, jnp.minimum(src, slots - 1), :]
        return arr.at[:, rows, :, dst, :].set(vals, mode="drop")

    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v), lengths=cache.lengths + n.astype(jnp.int32))


def insert_row(cache, row: jax.Array, one):
    """Generic ``insert`` for cache dataclasses whose array fields have batch at axis 1 ([L, B, ...]) except
    ``lengths`` ([B])."""
    updates = {}
    for f in dataclasses.fields(cache):
        big, small = getattr(cache, f.name), getattr(one, f.name)
        if not isinstance(big, jax.Array):
            continue
        if f.name == "lengths":
            updates[f.name] = big.at[row].set(small[0])
        else:
            updates[f.name] = big.at[:, row].set(small[:, 0])
    return dataclasses.replace(cache, **updates)


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row gather along axis 1: x [B, N, ...], idx [B] -> x[b, idx[b]] [B, ...]; idx [B, M] -> [B, M, ...].

    Written as ``take_along_axis`` rather than ``x[arange(B), idx]``: under batch sharding the latter lowers
    to a cross-device gather (all-reduces every round), this one stays local to each row's device.
    """
    squeeze = idx.ndim == 1
    i = idx[:, None] if squeeze else idx
    i = i.reshape(i.shape + (1,) * (x.ndim - 2)).astype(jnp.int32)
    out = jnp.take_along_axis(x, i, axis=1)
    return out[:, 0] if squeeze else out


def set_rows(x: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
    """Per-row scatter along axis 1: x [B, N, ...], idx [B], vals [B, ...] -> x with x[b, idx[b]] = vals[b]
    (out-of-range indices dropped); row-local under batch sharding."""
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode="drop"))(x, idx, vals)
