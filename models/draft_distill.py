"""Distilling a draft model to its target: the split of its parameters, the teacher and the loss.

Kept apart from the model (``models.draft_model``) because decoding never needs it (nor optax); the training
loop that calls these pieces is ``models.training.draft``.

Dimension vocabulary: B batch, T tokens in a call, V vocab, N subset size (frequent-token head), L layers,
k teacher entries kept per position.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.draft_model import DraftConfig, hidden, subset_logits
from models.llama import LlamaConfig, Params, init_cache
from models.llama import forward as llama_forward


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
