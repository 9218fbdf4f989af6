"""Draft models: a small Llama that shares the target's tokenizer, built from the target and distilled to it.

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

On disk a draft is a directory: ``params/`` (an orbax checkpoint) and ``draft.json`` (config, the shape and
dtype of every leaf, the tokenizer's tokens), so it restores onto any device layout without the target.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.model import Model
from models import cpu_kernels
from models.llama import (
    LlamaConfig,
    Params,
    abstract_params,
    embed,
    embedding_rows,
    final_norm,
    init_cache,
    is_packed,
    lm_head,
    param_logical_axes,
    run_layers,
    stack_layers,
    unstack_layers,
)
from models.llama import forward as llama_forward

FORMAT_VERSION = 1
META_FILE = "draft.json"
PARAMS_DIR = "params"


class DraftMismatchError(ValueError):
    """A draft that cannot draft for this target (vocabulary or tokenizer differ); the message names what."""


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
# Frequent-token map and initialisation from the target.


def token_counts(token_lists: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Occurrences [V] of every token id in some token lists (e.g. target-generated continuations)."""
    counts = np.zeros(vocab_size, np.int64)
    for toks in token_lists:
        arr = np.asarray(toks, np.int64).reshape(-1)
        if arr.size:
            # An id outside the vocabulary is not one of its tokens: cut off, it would vanish from the counts.
            bad = arr[(arr < 0) | (arr >= vocab_size)]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
            counts += np.bincount(arr, minlength=vocab_size)
    return counts


def frequent_token_map(counts: np.ndarray, n: int, always: Sequence[int] = ()) -> np.ndarray:
    """The N token ids [N] int32 (ascending) the frequent-token head keeps.

    counts [V]: occurrences in target-generated text. Ties (and tokens never seen, which is most of them
    with a few thousand sampled tokens) are broken by the lower id first: a BPE vocabulary numbers its
    merges in training order, so a low id is a token that was frequent in the tokenizer's corpus.
    always: ids kept whatever their counts (EOS: a draft that cannot propose the end of an answer wastes
      its last round of every reply).
    """
    counts = np.asarray(counts, np.float64)
    v = counts.shape[0]
    if not 0 < n <= v:
        raise ValueError(f"head size N={n} must be in [1, V={v}]")
    always = np.asarray(always, np.int64).reshape(-1)
    bad = always[(always < 0) | (always >= v)]
    if bad.size:  # a negative id would index from the end: another token kept in its place
        raise ValueError(f"always: token id {int(bad[0])} is outside the vocabulary [0, {v})")
    score = counts.copy()
    score[always] = np.inf
    order = np.lexsort((np.arange(v), -score))  # count descending, then id ascending
    return np.sort(order[:n]).astype(np.int32)


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


# --------------------------------------------------------------------------------------------------------
# Distillation pieces (the training loop itself is examples/train_draft.py).


def split_trainable(params: Params) -> tuple[Params, Params]:
    """(trainable, frozen): the input embedding (the target's, only B*T rows of it are ever read) and the
    head's integer maps stay frozen; everything else trains. ``merge_params`` undoes the split."""
    frozen = {"embed": params["embed"]}
    trainable = {k: v for k, v in params.items() if k not in ("embed", "head")}
    if "head" in params:
        frozen["head"] = {k: params["head"][k] for k in ("ids", "index")}
        trainable["head"] = {"weight": params["head"]["weight"]}
    return trainable, frozen


def merge_params(trainable: Params, frozen: Params) -> Params:
    out = {**trainable, **{k: v for k, v in frozen.items() if k != "head"}}
    if "head" in frozen:
        out["head"] = {**frozen["head"], **trainable["head"]}
    return out


def teacher_topk(cfg: LlamaConfig, target_params: Params, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The target's next-token log-probabilities on tokens [B, T], keeping the k most likely per position:
    (logp [B, T, k] float32, descending; ids [B, T, k] int32). A full [T, V] row costs 200 KB per token at
    V = 49152; the top k hold almost all of the mass that matters for the draft (the rest is reported as
    ``teacher_mass``)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = llama_forward(cfg, target_params, tokens, positions, init_cache(cfg, b, t))
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return logp, ids.astype(jnp.int32)


def distill_loss(
    dcfg: DraftConfig,
    params: Params,
    tokens: jax.Array,  # [B, T] int32
    mask: jax.Array,  # [B, T] bool: positions whose next token the draft must predict
    t_logp: jax.Array,  # [B, T, k] teacher log-probs (top k)
    t_ids: jax.Array,  # [B, T, k] their token ids
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean KL(p~ || q) over masked positions, where p~ is the target's distribution restricted to its top k
    AND the draft's support (the frequent-token subset) and renormalised: the closest distribution the draft
    can represent. Returns (loss [], metrics: kl, agree (draft argmax == target argmax, the greedy
    acceptance of one position), support (target mass inside the draft's support))."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hn, _ = hidden(dcfg, params, tokens, positions, init_cache(dcfg.llama, b, t))
    sub = subset_logits(dcfg, params, hn)  # [B, T, N]
    logq_all = jax.nn.log_softmax(sub, axis=-1)
    n = sub.shape[-1]
    col = params["head"]["index"][t_ids] if dcfg.head_size else t_ids  # [B, T, k], N = outside the subset
    inside = col < n
    logq = jnp.take_along_axis(logq_all, jnp.minimum(col, n - 1), axis=-1)
    # Finite stand-in for -inf: a position with no teacher entry inside the subset must give 0, not NaN
    # gradients (0 * inf); such positions are also dropped from the mask.
    lp = jnp.where(inside, t_logp.astype(jnp.float32), -1e30)
    norm = jax.nn.logsumexp(lp, axis=-1, keepdims=True)
    p = jnp.where(inside, jnp.exp(lp - norm), 0.0)
    kl = jnp.sum(p * (lp - norm - logq), axis=-1)  # [B, T]
    m = (mask & jnp.any(inside, axis=-1)).astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(m), 1.0)
    draft_top = jnp.argmax(sub, axis=-1)
    draft_top = params["head"]["ids"][draft_top] if dcfg.head_size else draft_top
    agree = (draft_top == t_ids[..., 0]).astype(jnp.float32)
    support = jnp.sum(jnp.where(inside, jnp.exp(t_logp.astype(jnp.float32)), 0.0), axis=-1)
    m_all = mask.astype(jnp.float32)
    denom_all = jnp.maximum(jnp.sum(m_all), 1.0)
    loss = jnp.sum(kl * m) / denom
    metrics = {
        "kl": loss,
        "agree": jnp.sum(agree * m_all) / denom_all,
        "support": jnp.sum(support * m_all) / denom_all,
    }
    return loss, metrics


def make_train_step(dcfg: DraftConfig, optimizer, frozen_layers: int = 0) -> Callable:
    """A jitted AdamW (or any optax) step: (trainable, frozen, opt_state, tokens, mask, t_logp, t_ids) ->
    (trainable, opt_state, metrics).

    frozen_layers: the first F draft layers keep the target's weights (their updates are zeroed after the
    optimizer, weight decay included; they live in one stacked leaf, so they are masked rather than split off)."""

    def loss_fn(trainable, frozen, *batch):
        return distill_loss(dcfg, merge_params(trainable, frozen), *batch)

    keep = (np.arange(dcfg.llama.num_layers) >= frozen_layers).astype(np.float32)

    @jax.jit
    def step(trainable, frozen, opt_state, tokens, mask, t_logp, t_ids):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, tokens, mask, t_logp, t_ids)
        scale = lambda g: g * keep.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)  # noqa: E731
        if frozen_layers:
            grads = {**grads, "layers": jax.tree.map(scale, grads["layers"])}
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        if frozen_layers:
            # AdamW's decay term (-lr * wd * w) does not need a gradient: masked here, or "frozen" layers shrink.
            updates = {**updates, "layers": jax.tree.map(scale, updates["layers"])}
        return optax.apply_updates(trainable, updates), opt_state, metrics

    return step


# --------------------------------------------------------------------------------------------------------
# Compatibility with a target.


def tokenizer_tokens(tokenizer) -> list[str]:
    """Every token string of a ``models.tokenizer.Tokenizer`` (or a bare ``tokenizers.Tokenizer``) by id."""
    backend = getattr(tokenizer, "backend", tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    return [backend.id_to_token(i) or "" for i in range(n)]


def tokens_fingerprint(tokens: Sequence[str]) -> str:
    return hashlib.sha256("\x00".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()


def check_compatible(
    target_vocab: int,
    draft_vocab: int,
    target_tokens: Sequence[str] | None = None,
    draft_tokens: Sequence[str] | None = None,
    *,
    target_name: str = "target",
    draft_name: str = "draft",
    target_special: dict[str, int | None] | None = None,
    draft_special: dict[str, int | None] | None = None,
) -> None:
    """Raise ``DraftMismatchError`` unless the draft can propose for the target: equal vocabulary sizes and,
    when both token lists are known, the same string for every id (same size is not enough: a different
    tokenizer with as many tokens would make every proposal mean another string), and the same special
    ids (EOS ends rows for both)."""
    if target_vocab != draft_vocab:
        raise DraftMismatchError(
            f"vocabulary mismatch: draft '{draft_name}' has {draft_vocab} tokens, target '{target_name}' has "
            f"{target_vocab}; a draft must share the target's tokenizer"
        )
    if target_tokens is not None and draft_tokens is not None:
        if len(target_tokens) != len(draft_tokens):
            raise DraftMismatchError(
                f"tokenizer mismatch: draft '{draft_name}' tokenizer has {len(draft_tokens)} tokens, target "
                f"'{target_name}' has {len(target_tokens)}"
            )
        for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)):
            if a != b:
                raise DraftMismatchError(
                    f"tokenizer mismatch: token id {i} is {b!r} for draft '{draft_name}' but {a!r} for target "
                    f"'{target_name}'; a draft must share the target's tokenizer (same vocabulary size is not "
                    "enough)"
                )
    for key in sorted(set(target_special or {}) & set(draft_special or {})):
        a, b = target_special[key], draft_special[key]
        if a is not None and b is not None and a != b:
            raise DraftMismatchError(
                f"tokenizer mismatch: {key} is id {b} for draft '{draft_name}' but {a} for target '{target_name}'"
            )


def _special(tokenizer) -> dict[str, int | None]:
    return {"eos_id": getattr(tokenizer, "eos_id", None), "bos_id": getattr(tokenizer, "bos_id", None)}


def _config_special(loaded) -> dict[str, int | None]:
    # A checkpoint without a tokenizer still states its special ids in its config (GGUF metadata, config.json).
    return {"eos_id": loaded.config.eos_id, "bos_id": loaded.config.bos_id}


def check_models_compatible(target, draft) -> None:
    """Two ``models.registry.LoadedModel``-like objects (``config``, ``tokenizer``; the tokenizer may be None:
    then its config's special ids are compared, with the vocabulary size)."""
    tt, dt = target.tokenizer, draft.tokenizer
    check_compatible(
        target.config.vocab_size,
        draft.config.vocab_size,
        tokenizer_tokens(tt) if tt is not None else None,
        tokenizer_tokens(dt) if dt is not None else None,
        target_name=target.config.name,
        draft_name=draft.config.name,
        # Like with like: tokenizers' ids when both have one, else both configs' (a tokenizer's EOS may be the
        # chat turn's end while its config keeps the base model's).
        target_special=_special(tt) if tt is not None and dt is not None else _config_special(target),
        draft_special=_special(dt) if tt is not None and dt is not None else _config_special(draft),
    )


def as_drafter(target, draft):
    """A loaded model (any checkpoint the loaders read) as a draft for a loaded target, after the
    compatibility check: returns (``ModelDrafter``, draft params) for ``jspec.decode``."""
    from jspec.drafters import ModelDrafter

    check_models_compatible(target, draft)
    return ModelDrafter(draft.model), draft.params


# --------------------------------------------------------------------------------------------------------
# Save / restore (orbax) and the cache directory.


def cache_root() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/draft``: where trained drafts live (never in the repository)."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "draft")


def _leaf_specs(params: Params) -> dict[str, list]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(p): [list(x.shape), jnp.dtype(x.dtype).name] for p, x in flat}


def _config_leaf_specs(dcfg: DraftConfig) -> dict[str, list]:
    """``_leaf_specs`` of the params a draft of ``dcfg`` has: the stacked Llama tree in its dtype, with a
    frequent-token head in place of an untied ``lm_head``."""
    tree = abstract_params(dcfg.llama)
    if dcfg.head_size:
        tree.pop("lm_head", None)
        n = dcfg.head_size
        tree["head"] = {
            "weight": jax.ShapeDtypeStruct((n, dcfg.llama.hidden), dcfg.llama.jdtype),
            "ids": jax.ShapeDtypeStruct((n,), jnp.int32),
            "index": jax.ShapeDtypeStruct((dcfg.vocab_size,), jnp.int32),
        }
    return _leaf_specs(tree)


def _check_leaf_specs(holder: str, leaves: dict[str, list], dcfg: DraftConfig) -> None:
    """Refuse leaves (``_leaf_specs``) other than those ``dcfg`` implies, naming the first that differs: restored
    as recorded, they would load another depth or dtype than the config says, or fail far from the cause."""

    def spec(s) -> str:
        return f"{tuple(s[0])} {s[1]}"

    want = _config_leaf_specs(dcfg)
    for key, w in want.items():
        if key not in leaves:
            raise ValueError(f"{holder} has no leaf {key}; the draft's config implies {spec(w)}")
        got = [list(leaves[key][0]), str(leaves[key][1])]
        if got != w:
            raise ValueError(f"{holder} has leaf {key} of {spec(got)}; the draft's config implies {spec(w)}")
    extra = sorted(leaves.keys() - want.keys())
    if extra:
        raise ValueError(f"{holder} has leaf {extra[0]} of {spec(leaves[extra[0]])}; the draft's config has none")


def _check_head_maps(holder: str, head: Params, vocab_size: int) -> None:
    """The frequent-token head's integer maps must be each other's inverse: ``ids`` N distinct ids in [0, V),
    ``index[ids] = arange(N)`` and N everywhere else (else ``expand_logits`` puts q on the wrong tokens)."""
    ids = np.asarray(jax.device_get(head["ids"]))
    index = np.asarray(jax.device_get(head["index"]))
    n = ids.shape[0]
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{holder}: head id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != n:
        raise ValueError(f"{holder}: head id {int(uniq[counts > 1][0])} appears more than once")
    want = np.full(vocab_size, n, np.int64)
    want[ids] = np.arange(n)
    wrong = np.flatnonzero(index != want)
    if wrong.size:
        v = int(wrong[0])
        raise ValueError(f"{holder}: head index[{v}] is {int(index[v])}, the head ids imply {int(want[v])}")


def save_draft(
    path: str | os.PathLike,
    dcfg: DraftConfig,
    params: Params,
    tokenizer=None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write a draft directory (``params/`` orbax checkpoint + ``draft.json``); overwrites. Returns the path.

    tokenizer: the target's, recorded so ``load_draft`` can refuse a target with another tokenizer.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    # restore_draft refuses leaves other than the config implies: such params are refused before anything is written.
    _check_leaf_specs(f"save_draft '{path}': the params", _leaf_specs(params), dcfg)
    if dcfg.head_size:
        _check_head_maps(f"save_draft '{path}'", params["head"], dcfg.vocab_size)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, META_FILE)):  # an overwrite: the old json must not vouch for new params
        os.remove(os.path.join(path, META_FILE))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(path, PARAMS_DIR), params, force=True)
    ckpt.wait_until_finished()
    tokens = tokenizer_tokens(tokenizer) if tokenizer is not None else None
    meta = {
        "format": FORMAT_VERSION,
        "llama": dataclasses.asdict(dcfg.llama),
        "head_size": dcfg.head_size,
        "source_layers": list(dcfg.source_layers),
        "leaves": _leaf_specs(params),
        "tokenizer": None
        if tokens is None
        else {"sha256": tokens_fingerprint(tokens), "tokens": tokens, **_special(tokenizer)},
        "extra": extra or {},
    }
    tmp = os.path.join(path, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(path, META_FILE))  # the json appears last: its presence marks a complete save
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    meta_path = os.path.join(os.fspath(path), META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no draft at '{path}' ({META_FILE} missing: not a draft directory, or unfinished)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"'{path}': draft format {meta.get('format')!r}, this code reads {FORMAT_VERSION}")
    return meta


def config_from_meta(meta: dict[str, Any]) -> DraftConfig:
    return DraftConfig(LlamaConfig(**meta["llama"]), int(meta["head_size"]), tuple(meta["source_layers"]))


ShardingSpec = jax.sharding.Sharding | Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | None


def restore_draft(
    path: str | os.PathLike, sharding: ShardingSpec = None, dtype: Any = None
) -> tuple[DraftConfig, Params]:
    """Restore a saved draft onto any device layout.

    sharding: one ``jax.sharding.Sharding`` for every leaf, or ``fn(leaf path, shape) -> Sharding`` (e.g. to
      shard the head rows over a mesh axis), or None for the default device. Restoring through
      ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` targets is what lets a checkpoint written on one
      topology load onto another.
    dtype: cast floating leaves (e.g. "bfloat16") while restoring; integer maps keep their dtype.
    """
    import orbax.checkpoint as ocp

    meta = read_meta(path)
    dcfg = config_from_meta(meta)
    _check_leaf_specs(f"'{path}': {META_FILE}", meta["leaves"], dcfg)
    if dtype is not None:
        dcfg = dataclasses.replace(dcfg, llama=dcfg.llama.replace(dtype=dtype))
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(key: str, spec) -> jax.ShapeDtypeStruct:
        shape, dt = tuple(spec[0]), jnp.dtype(spec[1])
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = dcfg.llama.jdtype
        if sharding is None:
            shd = default
        elif isinstance(sharding, jax.sharding.Sharding):
            shd = sharding
        else:
            shd = sharding(key, shape)
        return jax.ShapeDtypeStruct(shape, dt, sharding=shd)

    leaves = meta["leaves"]
    # Rebuild the tree structure from the recorded key paths ("['layers']['attn']['wq']" -> nested dicts).
    abstract: dict[str, Any] = {}
    for key, spec in leaves.items():
        parts = [p.strip("'\"") for p in key.strip("[]").split("][")]
        node = abstract
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = target(key, spec)
    params = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(os.fspath(path)), PARAMS_DIR), abstract)
    if dcfg.head_size:
        _check_head_maps(f"'{path}'", params["head"], dcfg.vocab_size)
    return dcfg, params


class LoadedDraft(NamedTuple):
    config: DraftConfig
    params: Params
    model: Model
    path: str
    meta: dict[str, Any]

    def drafter(self):
        from jspec.drafters import ModelDrafter

        return ModelDrafter(self.model)


def resolve_draft(path_or_name: str | os.PathLike) -> str:
    """A draft directory, or a name in the cache (``cache_root()/<name>``, where train_draft.py writes)."""
    s = os.fspath(path_or_name)
    if os.path.isfile(os.path.join(s, META_FILE)):
        return s
    cached = os.path.join(cache_root(), s)
    for cand in (cached, os.path.join(cached, "draft")):
        if os.path.isfile(os.path.join(cand, META_FILE)):
            return cand
    raise FileNotFoundError(
        f"no draft '{s}': neither a draft directory nor a trained draft under {cache_root()} "
        "(train one with: python examples/train_draft.py)"
    )


def load_draft(
    path_or_name: str | os.PathLike,
    *,
    target_config: LlamaConfig | None = None,
    tokenizer=None,
    sharding: ShardingSpec = None,
    dtype: Any = None,
    unstacked: bool = False,
) -> LoadedDraft:
    """Load a saved draft (directory or cache name) and check it against the target.

    target_config / tokenizer: the target's; a vocabulary size, tokenizer or special-id mismatch raises
    ``DraftMismatchError`` naming it (a draft saved without a tokenizer is checked on size only).
    unstacked: return the params in the CPU decode layout (``models.llama.unstack_layers``), as for the target.
    """
    path = resolve_draft(path_or_name)
    meta = read_meta(path)
    if target_config is not None or tokenizer is not None:
        vocab = meta["llama"]["vocab_size"]
        tok_meta = meta.get("tokenizer")
        target_vocab = target_config.vocab_size if target_config is not None else tokenizer.vocab_size
        target_tokens = draft_tokens = None
        if tokenizer is not None and tok_meta is not None:
            target_tokens = tokenizer_tokens(tokenizer)
            if tokens_fingerprint(target_tokens) != tok_meta["sha256"]:
                draft_tokens = tok_meta["tokens"]
            else:
                draft_tokens = target_tokens  # identical: skip the 49k-string comparison
        check_compatible(
            target_vocab,
            vocab,
            target_tokens,
            draft_tokens,
            target_name=target_config.name if target_config is not None else "target",
            draft_name=meta["llama"]["name"],
            target_special=_special(tokenizer) if tokenizer is not None else None,
            draft_special={k: tok_meta.get(k) for k in ("eos_id", "bos_id")} if tok_meta else None,
        )
    dcfg, params = restore_draft(path, sharding, dtype)
    if unstacked:
        params = unstack_layers(params)
        if is_packed(params) and dcfg.head_size:  # the frequent-token head on the CPU kernel too
            head = params["head"]
            params = {**params, "head": {**head, "weight": cpu_kernels.pack(jnp.asarray(head["weight"]).T)}}
    return LoadedDraft(dcfg, params, make_draft_model(dcfg), path, meta)
