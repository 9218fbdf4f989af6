"""A Llama variant whose cache also holds a state compressed along the sequence.

A small stand-in for DeepSeek-V4's compressed sequence attention: every completed block of ``m`` tokens is
pooled (mean of its keys and values, per layer and KV head) into ONE extra key/value that every later token
attends to, in addition to the ordinary per-token cache. The pooled entry of a block depends on which
tokens form it, so two branches of a candidate tree that complete the same block produce different
compressed states: a tree mask alone cannot isolate them.

So the cache keeps three stores: the per-token K/V (index-masked, as ``jspec.cache.KVCache``), the committed
block summaries ``ck/cv`` (block j at index j), and a scratch pad ``sk/sv`` holding, at each written slot,
the summary of the block that token completes along ITS OWN path (its ancestors only). Committing a path
moves the path's per-token entries into consecutive committed slots and copies the scratch summaries of the
path tokens that complete a block into the committed block store; summaries of rejected branches are never
copied and are overwritten by the next call.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jspec.cache import attention_mask, commit_path, insert_row, scratch_slots, write_layer
from jspec.model import Model
from models.llama import MLP, Embed, LlamaConfig, RMSNorm, apply_rope, rope_tables

_MASK_VALUE = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedCache:
    """k, v: [L, B, Hkv, S, D] per-token entries; ck, cv: [L, B, Hkv, C, D] committed block summaries
    (C = S // m); sk, sv: [L, B, Hkv, S, D] scratch summaries by slot; lengths: [B] committed tokens."""

    k: jax.Array
    v: jax.Array
    ck: jax.Array
    cv: jax.Array
    sk: jax.Array
    sv: jax.Array
    lengths: jax.Array
    block: int = dataclasses.field(metadata=dict(static=True), default=4)

    def with_lengths(self, lengths: jax.Array) -> CompressedCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def insert(self, row: jax.Array, one: CompressedCache) -> CompressedCache:
        return insert_row(self, row, one)

    def commit(self, n: jax.Array, path: jax.Array | None = None) -> CompressedCache:
        """Keep n[b] of the last call's entries (``path`` offsets for a tree, else the first n): per-token
        entries move like ``KVCache.commit``; each kept token that completes a block contributes its scratch
        summary to the committed block store."""
        b = self.lengths.shape[0]
        s = self.k.shape[3]
        c = self.ck.shape[3]
        p = path if path is not None else jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
        width = p.shape[1]
        j = jnp.arange(width, dtype=jnp.int32)[None, :]
        src = scratch_slots(self.lengths, p, s)  # slots holding the kept tokens' scratch summaries
        pos = self.lengths[:, None] + j  # committed position each kept token lands on
        completes = (j < n[:, None]) & ((pos + 1) % self.block == 0) & (src < s)
        blk = jnp.where(completes, (pos + 1) // self.block - 1, c)  # out of range -> dropped

        def move(store, scratch):  # [L, B, Hkv, C, D], [L, B, Hkv, S, D]
            def one_row(st_row, sc_row, src_row, blk_row):  # [L, Hkv, C, D], [L, Hkv, S, D], [P], [P]
                vals = jnp.take(sc_row, jnp.minimum(src_row, s - 1), axis=2)
                return st_row.at[:, :, blk_row, :].set(vals, mode="drop")

            return jax.vmap(one_row, in_axes=(1, 1, 0, 0), out_axes=1)(store, scratch, src, blk)

        moved = commit_path(self, path, n) if path is not None else self.with_lengths(self.lengths + n)
        return dataclasses.replace(moved, ck=move(self.ck, self.sk), cv=move(self.cv, self.sv))


def init_cache(cfg: LlamaConfig, block: int, batch: int, slots: int) -> CompressedCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim)
    cshape = (cfg.num_layers, batch, cfg.num_kv_heads, slots // block + 1, cfg.head_dim)
    z, zc = jnp.zeros(shape, cfg.jdtype), jnp.zeros(cshape, cfg.jdtype)
    return CompressedCache(z, z, zc, zc, z, z, jnp.zeros((batch,), jnp.int32), block)


def _slot_positions(lengths, positions, slots):
    """[B, S] position of the token held in each slot for this call: slot s < lengths holds position s;
    slot lengths + t holds ``positions[:, t]``; anything else -1."""
    s_idx = jnp.arange(slots, dtype=jnp.int32)[None, :]
    rel = s_idx - lengths[:, None]
    t = positions.shape[1]
    new_pos = jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1)
    return jnp.where(rel < 0, s_idx, jnp.where(rel < t, new_pos, -1))


def forward(cfg: LlamaConfig, block: int, params, tokens, positions, cache: CompressedCache, tree_mask=None):
    """The ``jspec.model.ApplyFn`` contract. tokens, positions [B, T]; tree_mask [B, T, T] or None."""
    b, t = tokens.shape
    s = cache.k.shape[3]
    c = cache.ck.shape[3]
    h_, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = h_ // hkv
    mask = attention_mask(cache.lengths, t, s, tree_mask)  # [B, T, S]
    own_mask = tree_mask if tree_mask is not None else jnp.tril(jnp.ones((t, t), bool))[None]
    own_mask = jnp.broadcast_to(own_mask, (b, t, t))
    slot_pos = _slot_positions(cache.lengths, positions, s)  # [B, S]
    # Members of the block each new token completes, along its own path: visible slots in its block range.
    start = positions - block + 1
    members = mask & (slot_pos[:, None, :] >= start[:, :, None]) & (slot_pos[:, None, :] <= positions[:, :, None])
    completes = (positions + 1) % block == 0  # [B, T]
    # Compressed entries a token attends to: committed blocks, and blocks completed by its strict ancestors.
    n_committed_blocks = cache.lengths // block
    sees_committed = jnp.arange(c)[None, None, :] < n_committed_blocks[:, None, None]  # [B, 1, C]
    anc = own_mask & ~jnp.eye(t, dtype=bool)[None] & completes[:, None, :]  # [B, T, T]
    cos, sin = rope_tables(positions, d, cfg.rope_theta)
    h = Embed(cfg.vocab_size, cfg.hidden).apply({"params": params["embed"]}, tokens).astype(cfg.jdtype)
    ks, vs, sks, svs = [], [], [], []
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda w, i=layer: w[i], params["layers"])
        x = RMSNorm(cfg.rms_eps).apply({"params": lp["attn_norm"]}, h)
        a = lp["attn"]
        q = jnp.einsum("bte,ehd->bthd", x, a["wq"])
        k = jnp.einsum("bte,ehd->bthd", x, a["wk"])
        v = jnp.einsum("bte,ehd->bthd", x, a["wv"])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_l = write_layer(cache.k[layer], k.transpose(0, 2, 1, 3), cache.lengths)  # [B, Hkv, S, D]
        v_l = write_layer(cache.v[layer], v.transpose(0, 2, 1, 3), cache.lengths)
        # Pooled summaries of the blocks completed by this call's tokens (their own paths).
        wts = members.astype(k_l.dtype) / block  # [B, T, S]
        sk_new = jnp.einsum("bts,bksd->bktd", wts, k_l)  # [B, Hkv, T, D]
        sv_new = jnp.einsum("bts,bksd->bktd", wts, v_l)
        sk_l = write_layer(cache.sk[layer], sk_new, cache.lengths)
        sv_l = write_layer(cache.sv[layer], sv_new, cache.lengths)
        keys = jnp.concatenate([k_l, cache.ck[layer], sk_new], axis=2)  # [B, Hkv, S + C + T, D]
        vals = jnp.concatenate([v_l, cache.cv[layer], sv_new], axis=2)
        full_mask = jnp.concatenate([mask, jnp.broadcast_to(sees_committed, (b, t, c)), anc], axis=2)
        qg = q.reshape(b, t, hkv, g, d)
        scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys) / math.sqrt(d)
        scores = jnp.where(full_mask[:, None, None], scores, _MASK_VALUE)
        out = jnp.einsum("bkgts,bksd->btkgd", jax.nn.softmax(scores, axis=-1), vals).reshape(b, t, h_ * d)
        h = h + out @ a["wo"].reshape(h_ * d, cfg.hidden)
        h = h + MLP(cfg).apply({"params": lp["mlp"]}, RMSNorm(cfg.rms_eps).apply({"params": lp["mlp_norm"]}, h))
        ks.append(k_l)
        vs.append(v_l)
        sks.append(sk_l)
        svs.append(sv_l)
    h = RMSNorm(cfg.rms_eps).apply({"params": params["final_norm"]}, h)
    logits = Embed(cfg.vocab_size, cfg.hidden).apply({"params": params["embed"]}, h, method=Embed.attend)
    new = dataclasses.replace(cache, k=jnp.stack(ks), v=jnp.stack(vs), sk=jnp.stack(sks), sv=jnp.stack(svs))
    return logits, new


@functools.cache
def make_compressed_model(cfg: LlamaConfig, block: int = 4) -> Model:
    """A ``jspec.model.Model`` over a (tied-embedding) Llama parameter tree with block-compressed state."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block (tokens per summary) must be an int >= 1, got {block!r}")
    if not cfg.tie_embeddings:
        raise ValueError("the compressed-state stand-in uses tied embeddings")
    if cfg.qkv_bias:  # its projections have no bias terms: a Qwen2 model's logits would silently differ
        raise ValueError("the compressed-state stand-in does not implement q/k/v biases (qkv_bias=True)")
    if cfg.features():  # Gemma / Qwen3 / Llama 3.1 maths it does not run either
        raise ValueError(f"the compressed-state stand-in runs a Llama 2-style decoder; the config has {cfg.features()}")

    def apply(params, tokens, positions, cache, tree_mask=None):
        return forward(cfg, block, params, tokens, positions, cache, tree_mask)

    return Model(
        apply=apply,
        init_cache=lambda batch, slots: init_cache(cfg, block, batch, slots),
        vocab_size=cfg.vocab_size,
        name=f"{cfg.name}-compressed{block}",
        max_positions=cfg.max_positions,
    )
