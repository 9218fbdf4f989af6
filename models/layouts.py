"""The two layouts of a Llama-family model's weights, and conversions between them (no model maths here:
``models.llama`` runs both).

Dimension vocabulary: L layers, E hidden, V vocab, H query heads, Hkv key/value heads, D head dim, F feed-forward
width.

Two layouts of the weights. Stacked ([L, ...] leaves, the canonical layout: loaders, checkpoints, sharding
rules, drafts built from the target) runs as one ``lax.scan``. XLA:CPU copies each layer's weights out of
the stack before its matmuls (a dynamic-slice fusion per weight, per layer, per step): for SmolLM2 that copy
took more time than the matmuls themselves. Unstacked is the decode layout for CPU: a tuple of L per-layer
dicts run as a Python loop over separate arrays, so the matmuls read the weights in place (1.2-1.3x faster
per step, at 2-3x the compile time per shape). Within it, q/k/v are one [E, H + 2 Hkv, D] matrix and
gate/up one [E, 2F] matrix, and a tied embedding is stored transposed ([E, V]) for the LM head: at one token
per call XLA:CPU's matrix-vector product streams a few large matrices faster than many small ones, and the
head faster from [E, V] than from [V, E] (``examples/bench_forward.py`` on SmolLM2, separate runs: 29.4 ms
per step unstacked before the fusion, 23.0 ms after; stacked 33.7 ms). With the CPU kernels
(``models.cpu_kernels``, ``unstack_layers(packed=True)``, the default where they build) those matrices are
packed into panels, and a 2-12 token call costs about what a 1-token call does instead of up to 2x.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from models import cpu_kernels
from models.config import LlamaConfig
from models.cpu_kernels import PackedMatrix

Params = dict[str, Any]


def is_unstacked(params: Params) -> bool:
    """Whether ``params["layers"]`` holds per-layer dicts (``unstack_layers``) rather than [L, ...] leaves."""
    return isinstance(params["layers"], (tuple, list))


_HEAD_NORMS = ("q_norm", "k_norm")  # per-head norms inside "attn" (qk_norm), kept apart in every layout


def _fuse_layer(lp: Params) -> Params:
    """One layer of the stacked layout (leading [L] axis already indexed away) -> the unstacked layout."""
    a, m = lp["attn"], lp["mlp"]
    attn = {"wqkv": jnp.concatenate([a["wq"], a["wk"], a["wv"]], axis=1), "wo": a["wo"]}  # [E, H + 2 Hkv, D]
    if "bq" in a:
        attn["bqkv"] = jnp.concatenate([a["bq"], a["bk"], a["bv"]], axis=0)  # [H + 2 Hkv, D]
    attn |= {n: a[n] for n in _HEAD_NORMS if n in a}
    mlp = {"w_gate_up": jnp.concatenate([m["w_gate"], m["w_up"]], axis=1), "w_down": m["w_down"]}  # [E, 2F]
    return {**lp, "attn": attn, "mlp": mlp}  # the norms as they are


def _split_layer(lp: Params) -> Params:
    """Inverse of ``_fuse_layer`` (head counts read off wo [H, D, E] and the fused width); a layer of the
    unfused per-layer layout passes through."""
    lp = jax.tree.map(_unpack, lp, is_leaf=lambda w: isinstance(w, PackedMatrix))
    if not is_fused_layer(lp):
        return lp
    a, m = lp["attn"], lp["mlp"]
    h = a["wo"].shape[0]
    hkv = (a["wqkv"].shape[1] - h) // 2
    attn = {"wq": a["wqkv"][:, :h], "wk": a["wqkv"][:, h : h + hkv], "wv": a["wqkv"][:, h + hkv :], "wo": a["wo"]}
    if "bqkv" in a:
        attn |= {"bq": a["bqkv"][:h], "bk": a["bqkv"][h : h + hkv], "bv": a["bqkv"][h + hkv :]}
    attn |= {n: a[n] for n in _HEAD_NORMS if n in a}
    f = m["w_gate_up"].shape[1] // 2
    mlp = {"w_gate": m["w_gate_up"][:, :f], "w_up": m["w_gate_up"][:, f:], "w_down": m["w_down"]}
    return {**lp, "attn": attn, "mlp": mlp}


def _unpack(w):
    return w.unpack() if isinstance(w, PackedMatrix) else w


# The weights the CPU kernel takes, with how many leading axes each contracts (wo [H, D, E]: two).
_PACKED = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


def _pack_layer(lp: Params) -> Params:
    a, m = lp["attn"], lp["mlp"]

    def pack(w, name):
        return cpu_kernels.pack(w, math.prod(w.shape[: _PACKED[name]]))

    attn = {**a, "wqkv": pack(a["wqkv"], "wqkv"), "wo": pack(a["wo"], "wo")}
    mlp = {"w_gate_up": pack(m["w_gate_up"], "w_gate_up"), "w_down": pack(m["w_down"], "w_down")}
    return {**lp, "attn": attn, "mlp": mlp}


def _unstack(layers: Params, packed: bool) -> tuple[Params, ...]:
    n = jax.tree.leaves(layers)[0].shape[0]
    split = tuple(_fuse_layer(jax.tree.map(lambda w, i=i: w[i], layers)) for i in range(n))
    return tuple(_pack_layer(lp) for lp in split) if packed else split


def unstack_layer_stack(layers: Params, packed: bool) -> tuple[Params, ...]:
    """Just the layers of ``unstack_layers``: a stacked [L, ...] layer tree -> the tuple of L per-layer dicts
    (for a head or draft of its own, e.g. an EAGLE layer, that runs next to an unstacked target)."""
    return jax.jit(_unstack, static_argnums=1)(layers, packed)


def is_fused_layer(lp: Params) -> bool:
    return "wqkv" in lp["attn"]


def is_fused(params: Params) -> bool:
    """Whether the params are unstacked with fused q/k/v and gate/up matrices (the single-device layout)."""
    return is_unstacked(params) and is_fused_layer(params["layers"][0])


def is_packed(params: Params) -> bool:
    """Whether the params are unstacked with the CPU kernel's packed matrices (``unstack_layers(packed=True)``)."""
    return is_unstacked(params) and isinstance(params["layers"][0]["mlp"]["w_down"], PackedMatrix)


def unstack_layers(params: Params, packed: bool | None = None, fused: bool = True) -> Params:
    """Stacked -> unstacked (the CPU decode layout above): ``params["layers"]`` becomes a tuple of L per-layer
    dicts with fused q/k/v and gate/up weights, and a tied embedding (no ``lm_head``) becomes
    ``embed["embedding_t"]`` [E, V]. All arrays are fresh, so the stacked ones can be freed. Unstacked params
    pass through. Read the embedding through ``embed`` / ``lm_head`` / ``embedding_rows`` (both layouts).

    packed: store those matrices (and an untied ``lm_head``) as ``cpu_kernels.PackedMatrix`` panels for the
    CPU matmul kernel (``models.cpu_kernels``: a 2-12 token verification pass then costs about what a 1-token
    step does, instead of ~2x). None: when the kernel is available, the default backend is the CPU and the
    weights are float32.

    fused=False: the sharded per-layer layout. Each layer keeps the stacked layout's matrices (separate q, k, v,
    gate, up; the embedding [V, E]), so the logical axes of ``logical_axes`` lay every one out by heads or MLP
    width: a fused [E, H + 2 Hkv, D] matrix split over heads would cut across q, k and v. Per-layer weights are
    what makes a verification cheap on GPUs (``jspec.loaders.wants_unstacked``); nothing is packed."""
    if is_unstacked(params):
        return params
    if not fused:
        if packed:
            raise ValueError("packed panels are the fused layout's (the CPU kernel's): pass fused=True")
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        split = jax.jit(lambda ls: tuple(jax.tree.map(lambda w, i=i: w[i], ls) for i in range(n)))
        return {**params, "layers": split(params["layers"])}
    if packed is None:
        f32 = all(w.dtype == jnp.float32 for w in jax.tree.leaves(params["layers"]))
        packed = f32 and jax.default_backend() == "cpu" and cpu_kernels.available()

    tied = "lm_head" not in params

    def convert(layers, emb, head):
        split = _unstack(layers, packed)
        emb = {"embedding_t": emb["embedding"].T} if tied else emb
        if packed:
            if tied:
                emb = {"embedding_t": cpu_kernels.pack(emb["embedding_t"])}
            else:
                head = {"kernel": cpu_kernels.pack(head["kernel"])}
        return split, emb, head

    layers, emb, head = jax.jit(convert)(params["layers"], params["embed"], params.get("lm_head"))
    return {**params, "layers": layers, "embed": emb} | ({} if tied else {"lm_head": head})


def stack_layers(params: Params) -> Params:
    """Unstacked -> stacked ([L, ...] leaves, separate q/k/v and gate/up, embedding [V, E]); stacked params
    pass through."""
    if not is_unstacked(params):
        return params
    layers = [_split_layer(lp) for lp in params["layers"]]
    emb = params["embed"]
    if "embedding_t" in emb:
        emb = {"embedding": _unpack(emb["embedding_t"]).T}
    out = {**params, "layers": jax.tree.map(lambda *ws: jnp.stack(ws), *layers), "embed": emb}
    if "lm_head" in params:
        out["lm_head"] = {"kernel": _unpack(params["lm_head"]["kernel"])}
    return out


def embedding_rows(params: Params, token_ids: jax.Array | None = None) -> jax.Array:
    """The token embedding matrix [V, E] (or its rows for ``token_ids`` [N] -> [N, E]) in either layout."""
    emb = params["embed"]
    if "embedding_t" in emb:
        et = emb["embedding_t"]
        if isinstance(et, PackedMatrix):
            return et.unpack().T if token_ids is None else et.rows(token_ids)
        return et.T if token_ids is None else jnp.take(et, token_ids, axis=1).T
    return emb["embedding"] if token_ids is None else jnp.take(emb["embedding"], token_ids, axis=0)


def lm_head_rows(cfg: LlamaConfig, params: Params, token_ids: jax.Array) -> jax.Array:
    """The LM head's rows for ``token_ids`` [N] -> [N, E] in either layout (tied: the embedding's rows; untied:
    columns of the [E, V] kernel, packed for the CPU kernel or not)."""
    if cfg.tie_embeddings:
        return embedding_rows(params, token_ids)
    w = params["lm_head"]["kernel"]
    if isinstance(w, PackedMatrix):
        return w.rows(token_ids)
    return jnp.take(w, token_ids, axis=1).T
