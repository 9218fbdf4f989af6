"""Bring your own Flax model: a ``jspec.model.Model`` from a model whose attention calls a swappable function.

Dimension letters: B batch, T tokens in a call, V vocab, S cache slots, L layers (attention calls per forward),
H query heads, Hkv key/value heads, D head dim.

What jspec's call needs and a researcher's model lacks is all inside the core of attention: each row's new K/V
written at its own ``cache.lengths[b]`` (rows are ragged), queries restricted to committed slots plus the call's own
tokens under a causal or tree mask, and, after verification, the accepted path moved into place. So the user hands
over exactly that core: their attention calls ``attention_fn(q, k, v)`` as ``nnx.MultiHeadAttention`` and
``jax.nn.dot_product_attention`` already do, and for jspec's calls the adapter swaps in ``_Layers.attend``, which
writes into a ``jspec.cache.KVCache`` (whose ``commit`` moves a tree's accepted path) and attends with
``jspec.cache.attention_mask``. Embedding, RoPE, norms, MLP and head stay the user's code and get jspec's positions.

A per-layer cache dict with an end index (the gemma sampler's) is not the interface: its usual write is one
``dynamic_update_slice`` at ``end_index[0]`` for the whole batch, which is wrong for ragged rows and clamps near the
end of the cache, and it has no way to say which of a tree's nodes see which. See docs/own_model.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.cache import KVCache, attention_mask, scratch_slots
from jspec.model import Model

_MASKED = -1e30  # finite: a row whose every slot were masked would give NaN with -inf (none is: a token sees itself)
# Options of jax.nn.dot_product_attention that change the maths and the adapter does not implement (the others,
# mask and is_causal included, are jspec's business or do not apply to inference).
_UNSUPPORTED = ("bias", "local_window_size", "query_seq_lengths", "key_value_seq_lengths")
_PROBE_B, _PROBE_T = 2, 5  # distinct sizes, so a [B, H, T, D] layout or a batch-major mistake shows in the probe


class AttentionFn(Protocol):
    """What the user's attention calls: ``jax.nn.dot_product_attention``'s layout and keywords.

    q [B, T, H, D]; k, v [B, T, Hkv, D]: the call's new tokens only, after RoPE; H a multiple of Hkv.
    Returns [B, T, H, D]. ``mask`` and ``is_causal`` are replaced by jspec's mask; ``scale`` is honoured.
    """

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, bias=None, mask=None, **options) -> jax.Array: ...


# (params, tokens [B, T] int32, positions [B, T] int32, attention) -> logits [B, T, V]
Forward = Callable[[Any, jax.Array, jax.Array, AttentionFn], jax.Array]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What the probe read off the user's model: the cache is [L, B, Hkv, S, D] of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: Any
    vocab_size: int


class _Hook:
    """Base of the probe and the real hook. ``__call__`` gives layers in call order (``wrap``'s forward);
    ``at(i)`` a hook bound to layer i (``from_nnx``: one per attention module, whatever order they run in)."""

    def __init__(self, name: str, b: int, t: int):
        self.name, self.b, self.t = name, b, t
        self.calls: list[int] = []

    def __call__(self, q, k, v, bias=None, mask=None, **options):
        return self.attend(len(self.calls), q, k, v, bias, mask, **options)

    def at(self, layer: int) -> AttentionFn:
        return functools.partial(self.attend, layer)

    def attend(self, layer, q, k, v, bias=None, mask=None, *, scale=None, **options):
        self._check(layer, q, k, v, bias, options)
        self.calls.append(layer)
        return self._attend(layer, q, k, v, scale)

    def _attend(self, layer, q, k, v, scale):
        raise NotImplementedError

    def _check(self, layer, q, k, v, bias, options):
        where = f"{self.name}: layer {layer}'s attention"
        if layer in self.calls:
            raise ValueError(f"{where} ran twice in one call: the adapter keeps one cache layer per attention call")
        given = [n for n in _UNSUPPORTED if {"bias": bias, **options}.get(n) is not None]
        if given:
            raise ValueError(f"{where} got {given}: the adapter's attention has no bias, window or padding lengths")
        if options.get("dropout_rate", 0.0) > 0 and not options.get("deterministic", True):
            raise ValueError(f"{where} asks for dropout: call model.eval() (deterministic) before wrapping it")
        for n, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 4 or x.shape[:2] != (self.b, self.t):
                raise ValueError(
                    f"{where} got {n} of shape {tuple(x.shape)} for {self.b} rows of {self.t} tokens: expected "
                    f"[B, T, heads, D] = [{self.b}, {self.t}, ., .] (jax.nn.dot_product_attention's layout, not "
                    "[B, heads, T, D]), with k and v the call's new tokens only (jspec keeps the cache)"
                )
        if k.shape != v.shape or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
            raise ValueError(
                f"{where} got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have one "
                "shape, the head dim of q, and a number of heads that divides q's"
            )


class _Probe(_Hook):
    """Records each layer's K shape and dtype under ``jax.eval_shape`` (nothing is computed)."""

    def __init__(self, name: str):
        super().__init__(name, _PROBE_B, _PROBE_T)
        self.kv: dict[int, tuple] = {}

    def _attend(self, layer, q, k, v, scale):
        self.kv[layer] = (k.shape[2], k.shape[3], jnp.dtype(k.dtype))
        return jnp.zeros(q.shape, q.dtype)


class _Layers(_Hook):
    """One jspec call's attention: each layer writes its T new K/V at ``lengths[b] + t``, then attends to the
    committed slots and its own block under ``mask``."""

    def __init__(self, name: str, layout: CacheLayout, cache: KVCache, mask: jax.Array):
        super().__init__(name, *mask.shape[:2])
        self.layout, self.k, self.v = layout, cache.k, cache.v  # [L, B, Hkv, S, D]
        slots = scratch_slots(cache.lengths, jnp.arange(self.t, dtype=jnp.int32)[None, :], cache.num_slots)
        self.rows = jnp.broadcast_to(jnp.arange(self.b, dtype=jnp.int32)[:, None], slots.shape)  # [B, T]
        self.slots, self.mask = slots, mask  # [B, T] (S where a write falls off the cache: dropped), [B, T, S]

    def _attend(self, layer, q, k, v, scale):
        lay = self.layout
        if not 0 <= layer < lay.layers or k.shape[2:] != (lay.kv_heads, lay.head_dim):
            raise ValueError(
                f"{self.name}: attention call {layer} got k {tuple(k.shape)}, but the cache was laid out for "
                f"{lay.layers} layers of [B, T, {lay.kv_heads}, {lay.head_dim}] when the model was wrapped: "
                "wrap the model again after changing it"
            )
        # One scatter with explicit (row, slot) indices into the whole [L, B, ...] array, then the read: in this
        # order XLA updates the cache in place (models/attention.py measured the forms that copy it).
        self.k = self.k.at[layer, self.rows, :, self.slots, :].set(k.astype(lay.dtype), mode="drop")
        self.v = self.v.at[layer, self.rows, :, self.slots, :].set(v.astype(lay.dtype), mode="drop")
        return masked_attention(q, self.k[layer], self.v[layer], self.mask, scale)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float | None = None):
    """q [B, T, H, D] against one layer's cache k, v [B, Hkv, S, D] where mask [B, T, S] -> [B, T, H, D]."""
    b, t, h, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, h // hkv, d)  # query heads grouped by the KV head they share
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * (d**-0.5 if scale is None else scale), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, v).reshape(b, t, h, d).astype(q.dtype)


def _check_logits(name: str, logits, b: int, t: int, vocab: int | None = None) -> jax.Array:
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 3 or shape[:2] != (b, t) or (vocab is not None and shape[2] != vocab):
        want = f"[{b}, {t}, {'V' if vocab is None else vocab}]"
        got = tuple(shape) if shape is not None else type(logits).__name__
        raise ValueError(f"{name}: the forward returned {got}, expected logits {want} (one row per token)")
    return logits


def _check_layers(hook: _Hook, layers: int) -> None:
    if sorted(hook.calls) != list(range(layers)):
        missing = sorted(set(range(layers)) - set(hook.calls))
        raise ValueError(
            f"{hook.name}: {layers} attention layers expected, these ran: {sorted(hook.calls)}"
            + (f" (never called: {missing})" if missing else "")
            + ". Every layer must call its attention_fn exactly once per forward, from Python (a layer loop inside "
            "jax.lax.scan / nnx.scan cannot hand its K/V to the cache)"
        )


def probe(forward: Forward, params, name: str = "model", layers: int | None = None) -> CacheLayout:
    """The cache layout of ``forward`` read off one abstract call (``jax.eval_shape``: no FLOPs, no memory);
    ``layers``: how many attention calls it must make, where the caller knows (else as many as it made)."""
    hook = _Probe(name)
    tokens = jnp.zeros((_PROBE_B, _PROBE_T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(_PROBE_T, dtype=jnp.int32), tokens.shape)
    out = jax.eval_shape(lambda p: forward(p, tokens, positions, hook), params)
    logits = _check_logits(name, out, _PROBE_B, _PROBE_T)
    if not hook.calls:
        raise ValueError(f"{name}: the forward never called the attention it was given (no layer to cache)")
    _check_layers(hook, layers or max(hook.calls) + 1)
    shapes = set(hook.kv.values())
    if len(shapes) != 1:
        raise ValueError(f"{name}: layers differ in (kv heads, head dim, dtype): {hook.kv}; the cache needs one")
    ((hkv, d, dtype),) = shapes
    return CacheLayout(len(hook.calls), hkv, d, dtype, logits.shape[2])


def wrap(forward: Forward, params, *, name: str = "model", max_positions: int | None = None) -> Model:
    """A jspec ``Model`` from ``forward(params, tokens, positions, attention) -> logits [B, T, V]``, which must
    call ``attention(q, k, v)`` once per layer, in the same order every call, and use ``positions`` (RoPE or
    position embeddings) rather than counting tokens itself. ``params`` (arrays or ``jax.ShapeDtypeStruct``s)
    only serve the probe that lays out the cache. Build it once and reuse it: jspec compiles per ``Model``."""
    layout = probe(forward, params, name)
    return _model(forward, layout, name, max_positions)


def _model(forward: Forward, layout: CacheLayout, name: str, max_positions: int | None) -> Model:
    def apply(params, tokens, positions, cache: KVCache, tree_mask=None):
        b, t = tokens.shape
        kv = cache.k.shape  # [L, B, Hkv, S, D]
        if (kv[0], kv[2], kv[4]) != (layout.layers, layout.kv_heads, layout.head_dim):
            raise ValueError(f"{name}: a cache of shape {kv} (L, B, Hkv, S, D) is not this model's {layout}")
        hook = _Layers(name, layout, cache, attention_mask(cache.lengths, t, cache.num_slots, tree_mask))
        logits = _check_logits(name, forward(params, tokens, positions, hook), b, t, layout.vocab_size)
        _check_layers(hook, layout.layers)
        return logits.astype(jnp.float32), dataclasses.replace(cache, k=hook.k, v=hook.v)

    def init_cache(batch: int, slots: int) -> KVCache:
        return KVCache.init(layout.layers, batch, layout.kv_heads, slots, layout.head_dim, layout.dtype)

    return Model(apply, init_cache, layout.vocab_size, name=name, max_positions=max_positions)


def _attention_modules(module: nnx.Module, attr: str) -> list[tuple[tuple, nnx.Module]]:
    return [
        (path, node) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Module) and attr in vars(node)
    ]


def from_nnx(
    model: nnx.Module,
    *,
    attr: str = "attention_fn",
    call: Callable[[nnx.Module, jax.Array, jax.Array], jax.Array] | None = None,
    name: str | None = None,
    max_positions: int | None = None,
) -> tuple[Model, nnx.State]:
    """(jspec ``Model``, params) of a Flax NNX model, unchanged: every submodule holding an ``attr`` attribute
    (``nnx.MultiHeadAttention``'s ``attention_fn``, or your own attention's) gets the adapter's attention for
    jspec's calls, on a copy merged from the params, so ``model`` itself keeps its own.

    call: ``(module, tokens [B, T], positions [B, T]) -> logits [B, T, V]``; by default ``module(tokens,
    positions)``. Use it for a model whose call takes other arguments or returns more than logits. The params are
    ``nnx.split(model)``'s state: pass them to ``jspec.decode.decode`` (or as ``draft_params``)."""
    name = name or type(model).__name__
    paths = [p for p, _ in _attention_modules(model, attr)]
    if not paths:
        raise ValueError(
            f"{name}: no submodule has an attribute {attr!r}. Give your attention module one (as "
            f"nnx.MultiHeadAttention has), call it as self.{attr}(q, k, v), or pass attr= its name"
        )
    if call is None:
        try:
            inspect.signature(model).bind(None, None)
        except TypeError:
            raise ValueError(
                f"{name}: model(tokens, positions) does not fit its __call__{inspect.signature(model)}; pass "
                "call=lambda module, tokens, positions: logits (jspec's positions must reach RoPE or the position "
                "embedding: a tree's nodes sit at their depth, not their index)"
            ) from None
    graphdef, state = nnx.split(model)
    run = call or (lambda module, tokens, positions: module(tokens, positions))

    def forward(params, tokens, positions, hook: _Hook):
        module = nnx.merge(graphdef, params)
        found = _attention_modules(module, attr)
        if [p for p, _ in found] != paths:
            raise ValueError(f"{name}: params do not build the wrapped model's attention modules {paths}")
        for layer, (_, node) in enumerate(found):
            setattr(node, attr, hook.at(layer))
        return run(module, tokens, positions)

    return _model(forward, probe(forward, state, name, len(paths)), name, max_positions), state
