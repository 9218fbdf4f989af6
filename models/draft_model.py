"""Draft models: a small Llama that shares the target's tokenizer, built from the target.

The model itself: its config, its parameters copied from the target, and its forward pass as a
``jspec.model.Model``. Distillation (``models.draft_distill``), the tokenizer checks (``models.draft_compat``)
and saving (``models.draft_checkpoint``) build on it; ``models.draft`` gathers them under one name.

Dimension vocabulary: B batch, T tokens in a call, V vocab, N subset size (frequent-token head), L layers,
E hidden, k teacher entries kept per position.

A draft is the target's embedding plus a few of its layers (copying them trains much faster than a random
start) and, optionally, a *frequent-token head*: the LM head reads only the N rows of the N most frequent
tokens instead of all V (on SmolLM2-135M the full tied head is 28M of the 35M parameters a 2-layer draft
reads per token, so the head decides whether a draft pays; see shared/notes/drafter-arithmetic.md). The
draft's ``apply`` still returns full-vocabulary logits [B, T, V] with -inf outside the subset, so q is
exactly what the draft samples (zero outside the subset) and speculative decoding stays lossless with the
decoder unchanged: the residual max(0, p - q) covers every token the draft can never propose.

Parameters are the Llama tree of ``models.llama`` (``embed``, ``layers`` stacked [L, ...], ``final_norm``,
``lm_head`` when untied) plus, with a frequent-token head, ``head = {weight [N, E], ids [N], index [V]}``:
``ids`` are the subset's token ids, ``index[v]`` the position of token v in the subset or N when absent.
The integer leaves are frozen (``split_trainable``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model import Model
from models import cpu_kernels
from models.llama import (
    LlamaConfig,
    Params,
    embed,
    embedding_rows,
    final_norm,
    init_cache,
    lm_head,
    param_logical_axes,
    run_layers,
    stack_layers,
)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Static description of a draft (hashable: it keys the jit cache through ``make_draft_model``).

    llama: the draft's own Llama config (its ``num_layers`` is the draft's depth, ``vocab_size`` the target's).
    head_size: N tokens in the frequent-token head; 0 = the full LM head over all V tokens.
    source_layers: which target layers the draft's layers were copied from (metadata, for reports).
    """

    llama: LlamaConfig
    head_size: int = 0
    source_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not 0 <= self.head_size <= self.llama.vocab_size:
            raise ValueError(f"head_size={self.head_size} must be in [0, vocab_size={self.llama.vocab_size}]")
        object.__setattr__(self, "source_layers", tuple(int(i) for i in self.source_layers))

    @property
    def vocab_size(self) -> int:
        return self.llama.vocab_size

    @property
    def name(self) -> str:
        return self.llama.name


def draft_config(
    target: LlamaConfig,
    num_layers: int = 2,
    head_size: int = 0,
    layers: Sequence[int] | None = None,
    name: str | None = None,
) -> DraftConfig:
    """A draft config sharing the target's widths, vocabulary and special ids, with ``num_layers`` layers.

    layers: the target layers to copy (default: the first ``num_layers``; on SmolLM2 the first layers give a
      far better start than evenly spaced ones, whose residual streams the final norm was not trained on).
    """
    layers = tuple(range(num_layers)) if layers is None else tuple(int(i) for i in layers)
    if not layers or len(layers) != num_layers:
        raise ValueError(f"need {num_layers} source layers, got {layers}")
    if min(layers) < 0 or max(layers) >= target.num_layers:
        raise ValueError(f"source layers {layers} outside the target's [0, {target.num_layers})")
    head = f"{head_size // 1024}k" if head_size and head_size % 1024 == 0 else str(head_size or "full")
    name = name or f"{target.name}-draft-{num_layers}L-{head}"
    return DraftConfig(target.layers_of(layers, name=name), int(head_size), layers)


# --------------------------------------------------------------------------------------------------------
# Initialisation from the target.


def _head_leaves(ids: np.ndarray, weight: jax.Array, vocab_size: int, dtype) -> dict[str, jax.Array]:
    ids = np.asarray(ids, np.int32)
    index = np.full(vocab_size, ids.shape[0], np.int32)
    index[ids] = np.arange(ids.shape[0], dtype=np.int32)
    return {"weight": jnp.asarray(weight, dtype), "ids": jnp.asarray(ids), "index": jnp.asarray(index)}


def init_from_target(dcfg: DraftConfig, target_params: Params, token_map: np.ndarray | None = None) -> Params:
    """Draft parameters copied from the target: embedding, final norm, the ``source_layers`` layers, and
    the LM head (restricted to ``token_map`` [N] for a frequent-token head, default: the N lowest ids).
    The target may be in any layout (stacked, unstacked, packed for the CPU kernel): it is read stacked."""
    cfg = dcfg.llama
    layers = dcfg.source_layers or tuple(range(cfg.num_layers))
    idx = np.asarray(layers)
    dt = cfg.jdtype
    target_params = stack_layers(target_params)  # plain [L, ...] arrays, embedding [V, E], lm_head [E, V]
    params: Params = {
        "embed": {"embedding": jnp.asarray(embedding_rows(target_params), dt)},
        "layers": jax.tree.map(lambda w: jnp.asarray(w[idx], dt), target_params["layers"]),
        "final_norm": {"scale": jnp.asarray(target_params["final_norm"]["scale"], dt)},
    }
    untied = "lm_head" in target_params
    if dcfg.head_size == 0:
        if untied:
            params["lm_head"] = {"kernel": jnp.asarray(target_params["lm_head"]["kernel"], dt)}
        return params
    ids = np.arange(dcfg.head_size, dtype=np.int32) if token_map is None else np.asarray(token_map, np.int32)
    if ids.shape != (dcfg.head_size,) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token_map must be {dcfg.head_size} ids in [0, {cfg.vocab_size}), got shape {ids.shape}")
    if np.unique(ids).size != ids.size:
        raise ValueError("token_map has repeated ids")
    rows = target_params["lm_head"]["kernel"].T if untied else embedding_rows(target_params)  # [V, E]
    params["head"] = _head_leaves(ids, jnp.take(jnp.asarray(rows), jnp.asarray(ids), axis=0), cfg.vocab_size, dt)
    return params


def draft_logical_axes(dcfg: DraftConfig) -> Params:
    """Logical axis names per leaf (same structure as the params), for sharding rules."""
    axes = param_logical_axes(dcfg.llama.replace(tie_embeddings=dcfg.llama.tie_embeddings or dcfg.head_size > 0))
    if dcfg.head_size:
        axes["head"] = {"weight": ("vocab", "embed"), "ids": ("vocab",), "index": ("vocab",)}
    return axes


# --------------------------------------------------------------------------------------------------------
# Forward.


def hidden(
    dcfg: DraftConfig, params: Params, tokens: jax.Array, positions: jax.Array, cache, tree_mask=None
) -> tuple[jax.Array, Any]:
    """tokens, positions [B, T] -> (final-normed hidden [B, T, E], cache with the T entries written)."""
    cfg = dcfg.llama
    h = embed(cfg, params, tokens)
    h, cache = run_layers(cfg, params, h, positions, cache, tree_mask)
    return final_norm(cfg, params, h), cache


def subset_logits(dcfg: DraftConfig, params: Params, hn: jax.Array) -> jax.Array:
    """Normed hidden [B, T, E] -> logits over the head's tokens [B, T, N] (N = V for a full head)."""
    if dcfg.head_size == 0:
        return lm_head(dcfg.llama, params, hn)
    w = params["head"]["weight"]
    if isinstance(w, cpu_kernels.PackedMatrix):  # packed at load next to a packed target: weight^T [E, N]
        return cpu_kernels.matmul(hn, w)
    # Only these N rows are read: the whole point of the frequent-token head.
    return jnp.einsum("bte,ne->btn", hn, w.astype(hn.dtype), preferred_element_type=jnp.float32)


def expand_logits(dcfg: DraftConfig, params: Params, sub: jax.Array) -> jax.Array:
    """[B, T, N] subset logits -> [B, T, V] with -inf outside the subset (q = 0 there after softmax)."""
    if dcfg.head_size == 0:
        return sub
    pad = jnp.full(sub.shape[:-1] + (1,), -jnp.inf, sub.dtype)
    # A gather by a fixed [V] index (N = "absent" -> the -inf pad) rather than a scatter into V: one pass.
    return jnp.take(jnp.concatenate([sub, pad], axis=-1), params["head"]["index"], axis=-1)


def forward(
    dcfg: DraftConfig, params: Params, tokens: jax.Array, positions: jax.Array, cache, tree_mask=None
) -> tuple[jax.Array, Any]:
    """The ``jspec.model.ApplyFn`` contract: tokens, positions [B, T] -> (logits [B, T, V] float32, cache)."""
    hn, cache = hidden(dcfg, params, tokens, positions, cache, tree_mask)
    return expand_logits(dcfg, params, subset_logits(dcfg, params, hn)), cache


@functools.cache
def make_draft_model(dcfg: DraftConfig) -> Model:
    """The ``jspec.model.Model`` of a draft (one per config: the decoder keys its jit cache on it), usable
    as ``jspec.drafters.ModelDrafter(make_draft_model(dcfg))``."""

    def apply(params, tokens, positions, cache, tree_mask=None):
        return forward(dcfg, params, tokens, positions, cache, tree_mask)

    def make_cache(batch: int, slots: int):
        return init_cache(dcfg.llama, batch, slots)

    # max_positions: decode refuses rows past the draft's context, where it would draft garbage.
    return Model(
        apply=apply,
        init_cache=make_cache,
        vocab_size=dcfg.vocab_size,
        name=dcfg.name,
        max_positions=dcfg.llama.max_positions,
    )
