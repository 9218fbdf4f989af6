"""Llama-family decoder in Flax + ``lax.scan``: Llama 2/3, SmolLM2, Mistral-style GQA, Qwen2 (q/k/v biases), Qwen3
(q/k norms), Gemma 2/3 (GeGLU, post norms, soft caps, sliding-window layers), one code path switched by the flags
of ``models.config.LlamaConfig``.

Dimension vocabulary: B batch, T tokens in a call, V vocab, S cache slots, L layers, E hidden,
H query heads, Hkv key/value heads, D head dim, F feed-forward width.

Parameters are a plain nested dict of arrays. Per-layer weights are stacked along a leading [L] axis so the
layer loop is one ``lax.scan``: it compiles once per shape instead of once per layer. The whole KV cache
[L, B, Hkv, S, D] rides in the scan carry; each layer first writes its new K/V into the carry and only then
reads its own layer slice for attention. How the write is expressed decides whether XLA:CPU keeps the carry
in place: a vmapped scatter straight into [L, B, ...] copied the whole cache every layer (4x slower step),
while slice -> ``jspec.cache.write_layer`` -> dynamic_update_slice back compiles with no cache copy at all
(checked in the optimised HLO for B in {1, 8}, T in {1, 5, 64}, S = 1024).

The forward is split into ``embed`` -> ``run_layers`` -> ``head`` so that a LayerSkip draft can run layers
[0, E) plus the head, and an EAGLE head can take the final hidden states (``forward(..., return_hidden=True)``).

RoPE (``models.rope``) uses the rotate-half (GPT-NeoX / Hugging Face) layout; the GGUF loader undoes llama.cpp's
row permutation so that both checkpoint formats share this one code path. The attention over the cache lives in
``models.attention``; a sliding-window layer differs from a full one only by its mask and RoPE table, chosen per
layer (``layer_inputs``), so both kinds run in the same scan over stacked layers. The two weight layouts (stacked
and per-layer) and their conversions live in ``models.layouts``; this module re-exports their names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import KVCache, attention_mask, take_rows
from jspec.model import Model
from models import cpu_kernels
from models.attention import attend, sliding_mask, write_index
from models.config import DTYPES, LlamaConfig, RopeScaling, canonical_dtype, end_token_ids  # noqa: F401 (re-exported)
from models.cpu_kernels import PackedMatrix
from models.layouts import (  # noqa: F401 (re-exported: models.llama stays the one import for a model's pieces)
    embedding_rows,
    is_fused,
    is_fused_layer,
    is_packed,
    is_unstacked,
    lm_head_rows,
    stack_layers,
    unstack_layer_stack,
    unstack_layers,
)
from models.rope import apply_rope, rope_tables  # noqa: F401 (re-exported)

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------
# Flax building blocks. Each parameter is declared with its logical axis names; ``param_logical_axes``
# reads them back (plus the stacked "layers" axis), so the sharding table never drifts from the model.


def _normal(std: float):
    return nn.initializers.normal(std)


class RMSNorm(nn.Module):
    eps: float
    axis: str = "embed"  # the logical name of the normalised axis: "head_dim" for q/k norms

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., E] -> [..., E]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)), (x.shape[-1],))
        # Statistics in f32 even for bf16 activations (as the reference implementations do).
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * scale.astype(x.dtype)


class Attention(nn.Module):
    cfg: LlamaConfig
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x, cos, sin, k_all, v_all, layer, lengths, mask):
        """x [B, T, E]; cos/sin [B, T, D/2]; k_all/v_all [L, B, Hkv, S, D]; layer scalar; lengths [B];
        mask [B, T, S] bool. Returns (out [B, T, E], k_all, v_all) with this call's K/V written."""
        cfg = self.cfg
        e, h, hkv, d = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = _normal(self.init_std)

        def param(name, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape)

        wq = param("wq", (e, h, d), ("embed", "heads", "head_dim"))
        wk = param("wk", (e, hkv, d), ("embed", "kv_heads", "head_dim"))
        wv = param("wv", (e, hkv, d), ("embed", "kv_heads", "head_dim"))
        wo = param("wo", (h, d, e), ("heads", "head_dim", "embed"))
        dt = x.dtype
        b, t = x.shape[:2]

        # Matmuls on the free (contiguous) 2-D views of the weights: contracting over (h, d) as two axes made
        # XLA:CPU transpose wo in every layer.
        def project(w, n):  # x [B, T, E] @ w [E, n, D] -> [B, T, n, D]
            return (x @ w.reshape(e, n * d).astype(dt)).reshape(b, t, n, d)

        q, k, v = project(wq, h), project(wk, hkv), project(wv, hkv)
        if cfg.qkv_bias:
            q = q + param("bq", (h, d), ("heads", "head_dim")).astype(dt)
            k = k + param("bk", (hkv, d), ("kv_heads", "head_dim")).astype(dt)
            v = v + param("bv", (hkv, d), ("kv_heads", "head_dim")).astype(dt)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_eps, "head_dim", name="q_norm")(q)
            k = RMSNorm(cfg.rms_eps, "head_dim", name="k_norm")(k)
        out, k_all, v_all = attend(cfg, q, k, v, cos, sin, k_all, v_all, layer, lengths, mask)
        return out @ wo.reshape(h * d, e).astype(dt), k_all, v_all


def activation(cfg: LlamaConfig):
    """The MLP's gate activation (``models.config.ACTIVATIONS``)."""
    if cfg.activation == "gelu_tanh":
        return functools.partial(jax.nn.gelu, approximate=True)
    return jax.nn.silu


class MLP(nn.Module):
    cfg: LlamaConfig
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, E] -> [B, T, E]
        e, f = self.cfg.hidden, self.cfg.ffn
        init = _normal(self.init_std)
        w_gate = self.param("w_gate", nn.with_logical_partitioning(init, ("embed", "mlp")), (e, f))
        w_up = self.param("w_up", nn.with_logical_partitioning(init, ("embed", "mlp")), (e, f))
        w_down = self.param("w_down", nn.with_logical_partitioning(init, ("mlp", "embed")), (f, e))
        dt = x.dtype
        gate = jnp.einsum("bte,ef->btf", x, w_gate.astype(dt))
        up = jnp.einsum("bte,ef->btf", x, w_up.astype(dt))
        return jnp.einsum("btf,fe->bte", activation(self.cfg)(gate) * up, w_down.astype(dt))


class Block(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with post norms (Gemma) each
    branch's output is normed again before the add. cos/sin/mask are this layer's (``layer_inputs``)."""

    cfg: LlamaConfig
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x, cos, sin, k_all, v_all, layer, lengths, mask):
        cfg = self.cfg
        a, k_all, v_all = Attention(cfg, self.init_std, name="attn")(
            RMSNorm(cfg.rms_eps, name="attn_norm")(x), cos, sin, k_all, v_all, layer, lengths, mask
        )
        if cfg.post_norms:
            a = RMSNorm(cfg.rms_eps, name="post_attn_norm")(a)
        x = x + a
        m = MLP(cfg, self.init_std, name="mlp")(RMSNorm(cfg.rms_eps, name="mlp_norm")(x))
        if cfg.post_norms:
            m = RMSNorm(cfg.rms_eps, name="post_mlp_norm")(m)
        return x + m, k_all, v_all


class Embed(nn.Module):
    vocab: int
    hidden: int
    init_std: float = 0.02

    def setup(self):
        init = nn.with_logical_partitioning(_normal(self.init_std), ("vocab", "embed"))
        self.embedding = self.param("embedding", init, (self.vocab, self.hidden))

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, E]
        return jnp.take(self.embedding, tokens, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:  # tied LM head: [B, T, E] -> [B, T, V] float32
        return jnp.einsum("bte,ve->btv", h, self.embedding.astype(h.dtype), preferred_element_type=jnp.float32)


class LMHead(nn.Module):
    vocab: int
    init_std: float = 0.02

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:  # [B, T, E] -> [B, T, V] float32
        init = nn.with_logical_partitioning(_normal(self.init_std), ("embed", "vocab"))
        kernel = self.param("kernel", init, (h.shape[-1], self.vocab))
        return jnp.einsum("bte,ev->btv", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------------------------------------
# Parameter tree: init, shapes, logical axes.


def _boxed_init(cfg: LlamaConfig, key: jax.Array, std: float) -> Params:
    """The full parameter tree with ``LogicallyPartitioned`` leaves (layer leaves stacked to [L, ...])."""
    k_embed, k_layers, k_norm, k_head = jax.random.split(key, 4)
    b, t, s = 1, 1, 1
    x = jnp.zeros((b, t, cfg.hidden), jnp.float32)
    cos = jnp.zeros((b, t, cfg.head_dim // 2), jnp.float32)
    kv = jnp.zeros((1, b, cfg.num_kv_heads, s, cfg.head_dim), jnp.float32)
    lengths = jnp.zeros((b,), jnp.int32)
    mask = jnp.ones((b, t, s), bool)
    block = Block(cfg, std)

    def init_layer(k):
        return block.init(k, x, cos, cos, kv, kv, jnp.int32(0), lengths, mask)["params"]

    layers = jax.vmap(init_layer)(jax.random.split(k_layers, cfg.num_layers))
    # vmap stacked the values but not the names: prepend the "layers" axis to every leaf's names.
    layers = jax.tree.map(lambda p: p.replace(names=("layers",) + tuple(p.names)), layers, is_leaf=_is_box)
    params = {
        "embed": Embed(cfg.vocab_size, cfg.hidden, std).init(k_embed, jnp.zeros((b, t), jnp.int32))["params"],
        "layers": layers,
        "final_norm": RMSNorm(cfg.rms_eps).init(k_norm, x)["params"],
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = LMHead(cfg.vocab_size, std).init(k_head, x)["params"]
    return params


def _is_box(p) -> bool:
    return isinstance(p, nn.LogicallyPartitioned)


def init_random_params(cfg: LlamaConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters for tiny test models (weights ~ N(0, std), norm scales ~ 1 + N(0, std)).

    The Flax modules define the tree (traced abstractly); values are drawn with numpy from a seed derived from
    ``key``: compiling the equivalent jax.random program took ~2 s even for a tiny model.
    """
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg, std=std), key)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())

    def draw(path, p):
        x = rng.standard_normal(p.value.shape).astype(np.float32) * std
        if jax.tree_util.keystr(path).endswith("['scale']"):
            x += 1.0
        return jnp.asarray(x, cfg.jdtype)

    return jax.tree_util.tree_map_with_path(draw, boxed, is_leaf=_is_box)


def param_logical_axes(cfg: LlamaConfig) -> Params:
    """Same structure as the params; leaves are tuples of logical axis names (e.g. ("layers", "embed", "mlp"))."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg, std=0.02), jax.random.key(0))
    return jax.tree.map(lambda p: tuple(p.names), boxed, is_leaf=_is_box)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) or n is None for n in x)


def logical_axes(cfg: LlamaConfig, params: Params) -> Params:
    """``param_logical_axes`` in the layout of ``params``: stacked, or the unfused per-layer layout
    (``unstack_layers(fused=False)``: each layer's names without "layers"). The fused per-layer layout has no
    sharding names: it is the single-device layout."""
    axes = param_logical_axes(cfg)
    if not is_unstacked(params):
        return axes
    if is_fused(params):
        raise ValueError(
            "fused per-layer params (unstack_layers(fused=True), the single-device layout) have no logical axes: "
            "shard unstack_layers(params, fused=False) or the stacked params"
        )
    one = jax.tree.map(lambda a: a[1:], axes["layers"], is_leaf=_is_axes)
    return {**axes, "layers": tuple(one for _ in params["layers"])}


def param_shapes(cfg: LlamaConfig) -> Params:
    """Same structure as the params; leaves are shape tuples."""
    return jax.tree.map(lambda s: tuple(s.shape), abstract_params(cfg))


def abstract_params(cfg: LlamaConfig) -> Params:
    """Same structure as the params; leaves are ``jax.ShapeDtypeStruct`` (for sharding plans, compile-ahead)."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg, std=0.02), jax.random.key(0))
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.value.shape, cfg.jdtype), boxed, is_leaf=_is_box)


def _fused_block(cfg: LlamaConfig, lp: Params, x, cos, sin, k_all, v_all, layer, lengths, mask, index):
    """``Block`` on one layer of the unstacked layout (fused q/k/v and gate/up); same arguments and results,
    plus the cache-write index shared by all layers."""
    b, t, e = x.shape
    h, hkv, d, f, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn, x.dtype
    a, m = lp["attn"], lp["mlp"]
    qkv = norm_dense(cfg, x, lp["attn_norm"], a["wqkv"]).reshape(b, t, h + 2 * hkv, d)
    if cfg.qkv_bias:
        qkv = qkv + a["bqkv"].astype(dt)
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
    if cfg.qk_norm:
        q, k = _rms(cfg, a["q_norm"], q), _rms(cfg, a["k_norm"], k)
    out, k_all, v_all = attend(cfg, q, k, v, cos, sin, k_all, v_all, layer, lengths, mask, index)
    out = dense(out, a["wo"])
    x = x + (_rms(cfg, lp["post_attn_norm"], out) if cfg.post_norms else out)
    gu = norm_dense(cfg, x, lp["mlp_norm"], m["w_gate_up"])  # [B, T, 2F]
    out = dense(activation(cfg)(gu[..., :f]) * gu[..., f:], m["w_down"])
    return x + (_rms(cfg, lp["post_mlp_norm"], out) if cfg.post_norms else out), k_all, v_all


def _rms(cfg: LlamaConfig, norm: Params, x: jax.Array) -> jax.Array:
    return RMSNorm(cfg.rms_eps).apply({"params": norm}, x)


def norm_dense(cfg: LlamaConfig, x: jax.Array, norm: Params, w) -> jax.Array:
    """``dense(RMSNorm(x), w)``; with packed weights and f32 activations one kernel call that normalises the
    rows itself (``cpu_kernels.norm_matmul``). Every call of a model takes the same path, so a row's result
    still does not depend on the call it is in."""
    if isinstance(w, PackedMatrix) and x.dtype == jnp.float32:
        return cpu_kernels.norm_matmul(x, norm["scale"], cfg.rms_eps, w)
    return dense(_rms(cfg, norm, x), w)


def dense(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w (an array whose leading axes multiply to K, or a PackedMatrix) -> [..., N] in x's dtype."""
    if isinstance(w, PackedMatrix):
        return cpu_kernels.matmul(x, w).astype(x.dtype)
    return x @ w.reshape(x.shape[-1], -1).astype(x.dtype)


# --------------------------------------------------------------------------------------------------------
# Forward pieces. ``cfg`` is static everywhere; all functions are pure and jit-friendly.


def embed(cfg: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int32 -> hidden [B, T, E] in cfg.dtype (times ``cfg.embed_scale``, rounded to that dtype as
    transformers rounds Gemma's sqrt(E))."""
    if "embedding_t" in params["embed"]:  # unstacked layout: [E, V]
        et = params["embed"]["embedding_t"]
        if isinstance(et, PackedMatrix):
            h = et.rows(tokens).astype(cfg.jdtype)
        else:
            h = jnp.moveaxis(jnp.take(et, tokens, axis=1), 0, -1).astype(cfg.jdtype)
    else:
        h = Embed(cfg.vocab_size, cfg.hidden).apply({"params": params["embed"]}, tokens).astype(cfg.jdtype)
    return h if cfg.embed_scale == 1.0 else h * jnp.asarray(cfg.embed_scale, cfg.jdtype)


def _materialized_rope_tables(cfg: LlamaConfig, positions: jax.Array, sliding: bool) -> tuple[jax.Array, jax.Array]:
    """``rope_tables`` of full (sliding=False) or sliding layers, computed once per call on CPU. XLA:CPU fuses
    the cos/sin into every layer's RoPE and evaluates them per element of q and k (55 us a layer at 9 tokens,
    more than that layer's attention). An optimization barrier does not stop it (XLA:CPU removes barriers before
    fusion); the output of a conditional cannot be fused into its users, and both branches are the same
    function. Only on CPU: a GPU conditional may read its predicate on the host, a sync per call."""
    theta, scaling = cfg.rope_of(sliding)
    tables = functools.partial(rope_tables, head_dim=cfg.head_dim, theta=theta, scaling=scaling)
    if positions.size == 0:
        return tables(positions)

    def once(positions):
        return jax.lax.cond(positions[0, 0] >= 0, tables, tables, positions)

    return jax.lax.platform_dependent(positions, cpu=once, default=tables)


LayerInputs = tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def layer_inputs(
    cfg: LlamaConfig, positions: jax.Array, lengths: jax.Array, slots: int, tree_mask: jax.Array | None = None
) -> LayerInputs:
    """What a call's layers read besides their weights and the cache, built once per call: ((cos, sin, mask) of
    full-attention layers, the same of sliding layers). cos/sin [B, T, D/2]; mask [B, T, S] bool (the cache's
    index mask under ``tree_mask``, narrowed to the window for sliding layers). positions [B, T]; lengths [B].
    A model without sliding layers gets the full triple twice (the same arrays)."""
    t = positions.shape[1]
    mask = attention_mask(lengths, t, slots, tree_mask)  # [B, T, S]
    full = (*_materialized_rope_tables(cfg, positions, False), mask)
    if not cfg.sliding_layers:
        return full, full
    tables = full[:2] if cfg.rope_of(True) == cfg.rope_of(False) else _materialized_rope_tables(cfg, positions, True)
    return full, (*tables, sliding_mask(mask, lengths, positions, cfg.sliding_window))


def inputs_of_layer(cfg: LlamaConfig, inputs: LayerInputs, layer) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cos, sin, mask) of layer ``layer``: a static int picks one of ``inputs``; a traced index (inside a scan
    over stacked layers) selects with ``where`` on the model's per-layer kinds, so both kinds share one scan."""
    full, sliding = inputs
    if full is sliding:
        return full
    if isinstance(layer, int):
        return sliding if cfg.layer_slides[layer] else full
    slides = jnp.asarray(cfg.layer_slides)[layer]
    return tuple(jnp.where(slides, s, f) for f, s in zip(full, sliding))


def run_layers(
    cfg: LlamaConfig,
    params: Params,
    h: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    start: int = 0,
    stop: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run decoder layers [start, stop) (static ints) on hidden states.

    Stacked layer weights run as one ``lax.scan``, unstacked ones (``unstack_layers``) as a Python loop.
    h [B, T, E]; positions [B, T] int32; cache k/v [L, B, Hkv, S, D] (layers outside [start, stop) are left
    untouched); tree_mask [B, T, T] bool or None (causal). Returns (h [B, T, E], cache with this call's
    entries written into layers [start, stop), lengths unchanged).
    """
    h, cache, _ = _run_layers(cfg, params, h, positions, cache, tree_mask, start, stop)
    return h, cache


def _run_layers(cfg, params, h, positions, cache, tree_mask, start, stop, taps: tuple[int, ...] = ()):
    """``run_layers`` plus the outputs of layers ``taps`` (static, ascending, inside [start, stop)): the
    masks, RoPE tables and write index are built once for every segment between them."""
    stop = cfg.num_layers if stop is None else stop
    if not 0 <= start < stop <= cfg.num_layers:
        raise ValueError(f"layer range [{start}, {stop}) outside [0, {cfg.num_layers})")
    layers = params["layers"]
    t, s = h.shape[1], cache.k.shape[3]
    inputs = layer_inputs(cfg, positions, cache.lengths, s, tree_mask)
    if is_unstacked(params):  # see ``unstack_layers``: one code copy per layer
        if len(layers) != cfg.num_layers:
            raise ValueError(f"params have {len(layers)} unstacked layers, the config {cfg.num_layers}")
        k_all, v_all = cache.k, cache.v
        # One write index for every layer: built inside each layer's scatter, it cost ~0.7 ms of a 9-token
        # SmolLM2 call on the 2-core CPU (23.9 -> 23.2 ms, alternated in one process).
        index = write_index(cache.lengths, h.shape[0], t, s)
        taken = []
        fused = is_fused_layer(layers[0])
        for i in range(start, stop):
            cos, sin, mask = inputs_of_layer(cfg, inputs, i)
            if fused:
                h, k_all, v_all = _fused_block(cfg, layers[i], h, cos, sin, k_all, v_all, i, cache.lengths, mask, index)
            else:  # the sharded layout: the layer index as an array keeps the CPU kernels (no sharding rule) out
                h, k_all, v_all = Block(cfg).apply(
                    {"params": layers[i]}, h, cos, sin, k_all, v_all, jnp.int32(i), cache.lengths, mask
                )
            if i in taps:
                taken.append(h)
        return h, dataclasses.replace(cache, k=k_all, v=v_all), taken
    block = Block(cfg)

    def body(carry, xs):
        x, k_all, v_all = carry
        layer_params, layer = xs
        cos, sin, mask = inputs_of_layer(cfg, inputs, layer)
        x, k_all, v_all = block.apply({"params": layer_params}, x, cos, sin, k_all, v_all, layer, cache.lengths, mask)
        return (x, k_all, v_all), None

    # One scan per segment ending at a tap or at stop (a scan's per-layer outputs would keep every layer's h).
    k, v, taken, lo = cache.k, cache.v, [], start
    for hi in sorted({i + 1 for i in taps} | {stop}):
        seg = layers if (lo, hi) == (0, cfg.num_layers) else jax.tree.map(lambda w, a=lo, b=hi: w[a:b], layers)
        (h, k, v), _ = jax.lax.scan(body, (h, k, v), (seg, jnp.arange(lo, hi, dtype=jnp.int32)))
        if hi - 1 in taps:
            taken.append(h)
        lo = hi
    return h, dataclasses.replace(cache, k=k, v=v), taken


def final_norm(cfg: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """[B, T, E] -> [B, T, E]: the final RMSNorm (its output is what the LM head reads)."""
    return _rms(cfg, params["final_norm"], h)


def lm_head(cfg: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """Normed hidden [B, T, E] -> logits [B, T, V] float32 (tied: the embedding matrix), soft-capped where the
    model caps its logits."""
    return _cap_logits(cfg, _lm_head(cfg, params, h))


def _lm_head(cfg: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    if cfg.tie_embeddings and "embedding_t" in params["embed"]:  # unstacked layout: [E, V]
        w = params["embed"]["embedding_t"]
        if isinstance(w, PackedMatrix):
            return cpu_kernels.matmul(h, w)
        return jnp.einsum("bte,ev->btv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if not cfg.tie_embeddings and isinstance(params["lm_head"]["kernel"], PackedMatrix):
        return cpu_kernels.matmul(h, params["lm_head"]["kernel"])
    if cfg.tie_embeddings:
        return Embed(cfg.vocab_size, cfg.hidden).apply({"params": params["embed"]}, h, method=Embed.attend)
    return LMHead(cfg.vocab_size).apply({"params": params["lm_head"]}, h)


def _cap_logits(cfg: LlamaConfig, logits: jax.Array) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma 2's final soft cap; monotonic, so greedy choices do not move)."""
    if cfg.final_softcap is None:
        return logits
    return jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap


def head(cfg: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """Final norm + LM head: hidden [B, T, E] -> logits [B, T, V] float32. ``forward``'s logits come from
    here: on a packed head the norm runs inside the LM-head kernel (``norm_dense``), whose last bits can
    differ from ``lm_head(final_norm(h))``'s."""
    w = None
    if cfg.tie_embeddings and "embedding_t" in params["embed"]:
        w = params["embed"]["embedding_t"]
    elif not cfg.tie_embeddings:
        w = params["lm_head"]["kernel"]
    if isinstance(w, PackedMatrix) and h.dtype == jnp.float32:
        return _cap_logits(cfg, norm_dense(cfg, h, params["final_norm"], w))
    return lm_head(cfg, params, final_norm(cfg, params, h))


def forward(
    cfg: LlamaConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    return_hidden: bool = False,
    logits_at: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
):
    """The ``jspec.model.ApplyFn`` contract, plus optionally the final (normed) hidden states.

    tokens, positions [B, T] int32; cache k/v [L, B, Hkv, S, D]; tree_mask [B, T, T] bool or None.
    Returns (logits [B, T, V] float32, cache) or, with return_hidden, (logits, hidden [B, T, E], cache).
    logits_at [B] int32: the LM head runs on token ``logits_at[b]`` of each row only, logits [B, 1, V] (the
    ``Model.apply_at`` of a prefill, where the head over every prompt token was ~20% of the work).
    hidden_layers (static, ascending, each < L - 1): with return_hidden, the hidden is [B, T, (n + 1) E], the
    outputs of these layers (un-normed, the residual stream) then the final normed hidden (EAGLE-3's fused
    low / mid / high features), taken on the way through the layers (no other layer's output is kept).
    The T new entries are written at slots ``cache.lengths[b] + t``; ``cache.lengths`` is unchanged.
    """
    bounds = tuple(hidden_layers)
    if bounds and (list(bounds) != sorted(set(bounds)) or bounds[0] < 0 or bounds[-1] >= cfg.num_layers - 1):
        raise ValueError(f"hidden_layers={bounds} must be distinct ascending layers in [0, {cfg.num_layers - 1})")
    h = embed(cfg, params, tokens)
    h, cache, taken = _run_layers(cfg, params, h, positions, cache, tree_mask, 0, None, bounds)
    logits = head(cfg, params, h if logits_at is None else take_rows(h, logits_at)[:, None])
    if not return_hidden:
        return logits, cache
    hn = final_norm(cfg, params, h)
    return logits, (jnp.concatenate(taken + [hn], axis=-1) if taken else hn), cache


def init_cache(cfg: LlamaConfig, batch: int, slots: int) -> KVCache:
    """Empty cache: k/v [L, B, Hkv, S, D] in cfg.dtype, lengths [B] zeros."""
    return KVCache.init(cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, cfg.jdtype)


@functools.cache
def make_model(cfg: LlamaConfig, kernel_argmax: bool = False) -> Model:
    """The ``jspec.model.Model`` for a config, built once per config so its functions keep one identity
    (the decoder takes it as a static jit argument).

    kernel_argmax: the model's ``argmax`` is the CPU row-argmax kernel (``cpu_kernels.row_argmax``), for the
    packed single-device CPU layout (``registry.load`` sets it there). Not for sharded runs: an FFI call has no
    sharding rule, so XLA would gather the logits of a data-parallel batch to every device."""

    def apply(params, tokens, positions, cache, tree_mask=None):
        return forward(cfg, params, tokens, positions, cache, tree_mask)

    def apply_at(params, tokens, positions, cache, index):
        logits, cache = forward(cfg, params, tokens, positions, cache, logits_at=index)
        return logits[:, 0], cache

    def make_cache(batch: int, slots: int) -> KVCache:
        return init_cache(cfg, batch, slots)

    model = Model(
        apply=apply,
        init_cache=make_cache,
        vocab_size=cfg.vocab_size,
        name=cfg.name,
        apply_at=apply_at,
        argmax=cpu_kernels.row_argmax if kernel_argmax else None,
        max_positions=cfg.max_positions,
    )
    _CONFIG_OF[id(model)] = cfg  # make_model is cached: the model lives as long as the process
    return model


_CONFIG_OF: dict[int, LlamaConfig] = {}  # id(make_model(cfg)) -> cfg, for ``check_model_of``
# make_model is functools.cache'd (never cleared here): its models, and so these ids, live as long as the process.
_NOT_MATHS = ("name", "max_positions", "bos_id", "eos_id", "eos_ids")  # fields that do not change the forward pass


def check_model_of(target: Model, cfg: LlamaConfig, who: str) -> None:
    """A drafter that runs this config's forward pass itself (EAGLE's verification reads the hidden features;
    LayerSkip writes the first layers of the target's cache) serves only a target ``make_model`` built from a
    config with the same maths (the name and context length aside): another model (the compressed stand-in)
    or config (dtype, RoPE, ...) would be verified with the wrong maths."""
    tcfg = _CONFIG_OF.get(id(target))
    if tcfg is None:
        raise ValueError(
            f"{who} runs {cfg.name}'s forward pass itself, so the target must be a models.llama.make_model model; "
            f"got {target.name!r} (another model would be verified with the wrong maths)"
        )
    for f in dataclasses.fields(LlamaConfig):
        if f.name not in _NOT_MATHS and getattr(tcfg, f.name) != getattr(cfg, f.name):
            raise ValueError(
                f"{who} runs its own copy of the target's forward pass, built for {f.name}="
                f"{getattr(cfg, f.name)!r}, but the target {target.name!r} has {f.name}={getattr(tcfg, f.name)!r}"
            )


def check_same_params(target_params: Params, own: Params, who: str) -> None:
    """``own`` must be ``target_params`` (the same arrays, or equal ones): a self-speculative drafter writes the
    target's committed cache with them."""
    a, b = jax.tree.flatten(target_params), jax.tree.flatten(own)
    if a[1] != b[1] or not all(_same_array(x, y) for x, y in zip(a[0], b[0])):
        raise ValueError(
            f"{who}'s draft_params must hold the target's own params (drafter.draft_params(target_params, ...)): "
            "it writes the target's cache with them, so other weights would change the output"
        )


def _same_array(x, y) -> bool:
    """Equal arrays, compared on the host without a collective (this runs in per-process validation, where a
    device collective entered by some processes only would hang): whole arrays when this process holds them,
    else this process's shards when both are laid out alike."""
    if x is y:
        return True
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if getattr(x, "is_fully_addressable", True) and getattr(y, "is_fully_addressable", True):
        return bool(np.array_equal(np.asarray(x), np.asarray(y)))
    if x.sharding != y.sharding:
        return False  # not comparable shard by shard: place the draft's copy as the target's, or pass the same
    pairs = zip(x.addressable_shards, y.addressable_shards)
    return all(np.array_equal(np.asarray(u.data), np.asarray(v.data)) for u, v in pairs)
