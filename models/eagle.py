"""EAGLE-style draft head: one small transformer layer that drafts from the target's own hidden features.

Dimension vocabulary: B batch, T tokens in a call, K draft length, V vocab, N tokens of the draft head's
vocabulary (the frequent-token subset; N = V for a full head), E hidden width, S cache slots.

Features. f_t is the target's final normed hidden state at position t, the vector its LM head turns into
p(x_{t+1}) (``models.llama.forward(..., return_hidden=True)``).

Fusion (EAGLE-3, optional: ``EagleConfig.fuse``). The target also returns the outputs of a few lower layers
(``llama.forward(..., hidden_layers=fuse)``); ``fuse_features`` norms each, concatenates them with f_i and
projects back to E, and that g_i replaces f_i wherever a target feature enters the head (prefill,
verification). The rollout's later steps read the head's own f^, as without fusion.

Head step. Pair i is (f_i, x_{i+1}): RMSNorm(emb(x_{i+1})) and RMSNorm(f_i) are concatenated, projected
2E -> E, run through one Llama decoder layer (its own 1-layer KV cache, RoPE position i) and a final RMSNorm,
giving f^_{i+1}, the head's guess of the target's next feature; its logits over the N frequent tokens are
f^_{i+1} . rows, where rows [N, E] are the target's own LM-head rows of those tokens. Every other token gets
q = 0: it is never proposed, and the verifier's residual max(0, p - q) supplies it, so decoding stays
lossless (q is exactly what the head samples).

Round (``EagleDrafter``). The drafter state holds the features of the last verified block [B, K+1, E] and the
position where that block starts. ``propose`` first catches up: the pairs of the newly committed tokens
(accepted drafts and the new pending token, n_accepted + 1 <= K + 1 of them, their features all in the
stored block) go through the head as one block at the head cache's committed end, which is rewound by index
masking alone (``KVCache.lengths``); the catch-up's last output gives the first draft, and K - 1 more head
steps on its own predicted features run in a ``lax.scan``. ``verify`` replaces the decoder's target call: one
target pass over [pending, drafts] that also returns the features, which become the new state, so no target
work is repeated. The prompt's features come from ``prefill``, the decoder's optional hook: its one target
pass over the prompt also returns them (``init``, which would run the target again, is only the drafter
protocol's fallback).

Parameters. Trainable head params (``init_head``): emb_norm, feat_norm, fc, layers (one stacked Llama
block), out_norm, with ``fuse`` the fusion's per-layer norms and projection, plus the frozen ``token_ids`` [N]
(ascending). ``EagleDrafter.draft_params`` builds the runtime params once per target: (target params, head
params + the gathered ``rows`` [N, E]).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import KVCache, take_rows
from jspec.drafters import DraftContext, Drafter, DynamicTreeShape, Proposal, StaticTreeShape
from jspec.model import Model
from jspec.sampling import distribution, sample, split_keys
from jspec.tree import (
    TreeProposal,
    TreeRule,
    TreeSpec,
    ancestor_mask,
    check_dynamic_tree,
    check_rule,
    choose_children,
    frontier_mask,
    grow_dynamic_tree,
)
from models import cpu_kernels, llama
from models import draft as _draft
from models.layerskip import check_trained_for, head_rows, load_exit_meta, restore_exit_params, save_exit_params
from models.llama import LlamaConfig, Params

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static description of a head (hashable: part of the drafter, a static jit argument).

    target: the target's config (widths, vocabulary, RoPE, dtype). head_tokens: N, the size of the draft
    vocabulary (0 or V: the full LM head). ffn: the head layer's feed-forward width (0: the target's).
    fuse: target layers (ascending, each < L - 1) whose outputs join the final feature f_i as the head's
    input (EAGLE-3's low / mid / high fusion, ``fuse_features``); () = f_i alone (EAGLE-1/2). layers: the
    head's decoder layers (EAGLE uses one; ``graft_layers`` deepens a trained head).
    """

    target: LlamaConfig
    head_tokens: int = 8192
    ffn: int = 0
    name: str = "eagle"
    fuse: tuple[int, ...] = ()
    layers: int = 1

    def __post_init__(self):
        if not 0 <= self.head_tokens <= self.target.vocab_size:
            raise ValueError(f"head_tokens={self.head_tokens} must be in [0, {self.target.vocab_size}]")
        if isinstance(self.layers, bool) or not isinstance(self.layers, (int, np.integer)) or self.layers < 1:
            raise ValueError(f"layers={self.layers!r} must be an int >= 1")
        object.__setattr__(self, "layers", int(self.layers))
        f = tuple(self.fuse)
        if f and (list(f) != sorted(set(f)) or f[0] < 0 or f[-1] >= self.target.num_layers - 1):
            raise ValueError(
                f"fuse={f} must be distinct ascending target layers in [0, {self.target.num_layers - 1}) "
                "(the last layer's output is f itself)"
            )
        object.__setattr__(self, "fuse", f)

    @property
    def n(self) -> int:
        return self.head_tokens or self.target.vocab_size

    @property
    def layer_cfg(self) -> LlamaConfig:
        """The head's decoder layers: the target's attention shape, ``layers`` layers, their own FFN width."""
        # Full attention over the head's own cache whatever the target's layers do (a draft's choice: it changes
        # what the head proposes, never what is accepted).
        return self.target.replace(
            num_layers=self.layers, ffn=self.ffn or self.target.ffn, name=f"{self.name}-layer", sliding_layers=(),
            sliding_window=None,
        )  # fmt: skip

    @property
    def raw_width(self) -> int:
        """Width of the target features the head reads: (len(fuse) + 1) E."""
        return (len(self.fuse) + 1) * self.target.hidden

    def to_json(self) -> dict:
        d = {"target": dataclasses.asdict(self.target), "head_tokens": self.head_tokens, "ffn": self.ffn}
        return {**d, "fuse": list(self.fuse), "layers": self.layers}

    @classmethod
    def from_json(cls, d: dict, name: str = "eagle") -> EagleConfig:
        fuse = tuple(int(i) for i in d.get("fuse", ()))  # heads saved before fusion existed have none
        layers = int(d.get("layers", 1))  # nor did they say their depth: one layer
        return cls(LlamaConfig(**d["target"]), int(d["head_tokens"]), int(d["ffn"]), name, fuse, layers)


# --------------------------------------------------------------------------------------------------------
# Frequent-token map.


# One rule for every restricted head (see ``models.draft.frequent_token_map``): counts descending, ties to the
# lower id, EOS always kept.
token_counts = _draft.token_counts
frequent_tokens = _draft.frequent_token_map


# --------------------------------------------------------------------------------------------------------
# Head parameters and forward.


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def init_head(ecfg: EagleConfig, target_params: Params, key: jax.Array, token_ids: np.ndarray | None = None) -> Params:
    """Fresh head params (float32 numpy-drawn like ``llama.init_random_params``).

    The layer's attention/MLP output projections start small so the untrained layer is close to the identity
    on the fc output; fc starts as [0 | I]: f^_{i+1} = f_i plus a learned correction, a start that already
    lives in the target's feature space. out_norm starts at the target's final-norm scale (the features are
    that norm's output). token_ids default to the N lowest ids.
    """
    cfg = ecfg.target
    e = cfg.hidden
    layer = llama.init_random_params(ecfg.layer_cfg, key, std=0.02)["layers"]
    layer = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), layer)
    ids = np.arange(ecfg.n, dtype=np.int32) if token_ids is None else np.asarray(token_ids, np.int32)
    _check_token_ids(ecfg, ids)
    fc = np.concatenate([np.zeros((e, e), np.float32), np.eye(e, dtype=np.float32)], axis=0)
    hp = {
        "emb_norm": {"scale": jnp.ones((e,), jnp.float32)},
        "feat_norm": {"scale": jnp.ones((e,), jnp.float32)},
        "fc": {"kernel": jnp.asarray(fc)},
        "layers": layer,
        "out_norm": {"scale": jnp.asarray(target_params["final_norm"]["scale"], jnp.float32)},
        "token_ids": jnp.asarray(ids),
    }
    return graft_fusion(ecfg, hp) if ecfg.fuse else hp


def graft_fusion(ecfg: EagleConfig, hp: Params) -> Params:
    """``hp`` (an unfused head's params) with a fresh fusion for ``ecfg.fuse``: kernel [0 | ... | 0 | I], so
    g_i = f_i and the grafted head drafts exactly as ``hp`` did until training teaches it what the lower layers
    add (the steps past the first read the head's own f^, which lives in f's space). ``init_head`` starts every
    fused head this way; examples/train_eagle.py grafts onto a trained unfused head (``--init-from`` with
    ``--fuse``)."""
    if not ecfg.fuse:
        raise ValueError("graft_fusion: the config has no fuse layers")
    if "fuse" in hp:
        raise ValueError("graft_fusion: the head already has a fusion")
    e, n = ecfg.target.hidden, len(ecfg.fuse)
    kernel = np.concatenate([np.zeros((n * e, e), np.float32), np.eye(e, dtype=np.float32)], axis=0)
    return {**hp, "fuse": {"norm": jnp.ones((n, e), jnp.float32), "kernel": jnp.asarray(kernel)}}


def graft_layers(ecfg: EagleConfig, hp: Params, key: jax.Array) -> Params:
    """``hp`` (a trained head's params, fewer layers than ``ecfg.layers``) with fresh layers appended on top,
    each starting as the identity: its attention and MLP output projections are zero, so the deeper head drafts
    exactly as ``hp`` did until training gives the new layers a share of the work (the other weights are drawn
    as ``init_head`` draws them, so their gradients are not zero once the projections move)."""
    have = jax.tree.leaves(hp["layers"])[0].shape[0]
    if have >= ecfg.layers:
        raise ValueError(f"graft_layers: the head has {have} layers, the config asks for {ecfg.layers}")
    extra = ecfg.layer_cfg.replace(num_layers=ecfg.layers - have)
    new = llama.init_random_params(extra, key, std=0.02)["layers"]
    new = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), new)
    new["attn"]["wo"] = jnp.zeros_like(new["attn"]["wo"])
    new["mlp"]["w_down"] = jnp.zeros_like(new["mlp"]["w_down"])
    old = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), hp["layers"])
    return {**hp, "layers": jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), old, new)}


def abstract_head(ecfg: EagleConfig) -> Params:
    """ShapeDtypeStruct tree of the head params (what ``save_head`` writes), for a shape-checked restore."""
    cfg = ecfg.target
    shapes = llama.abstract_params(ecfg.layer_cfg)["layers"]
    e = cfg.hidden

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    tree = {
        "emb_norm": {"scale": f32(e)},
        "feat_norm": {"scale": f32(e)},
        "fc": {"kernel": f32(2 * e, e)},
        "layers": jax.tree.map(lambda s: f32(*s.shape), shapes),
        "out_norm": {"scale": f32(e)},
        "token_ids": jax.ShapeDtypeStruct((ecfg.n,), jnp.int32),
    }
    if ecfg.fuse:
        tree["fuse"] = {"norm": f32(len(ecfg.fuse), e), "kernel": f32(ecfg.raw_width, e)}
    return tree


def split_trainable(hp: Params) -> tuple[Params, jax.Array]:
    """(trainable params, frozen token_ids [N])."""
    return {k: v for k, v in hp.items() if k != "token_ids"}, hp["token_ids"]


def fuse_features(ecfg: EagleConfig, hp: Params, raw: jax.Array) -> jax.Array:
    """The target features [B, T, (len(fuse) + 1) E] (``llama.forward(..., hidden_layers=ecfg.fuse)``) ->
    the head's input g_i [B, T, E]: each fused layer's output RMS-normed (their scales differ by orders of
    magnitude along the residual stream), concatenated with f_i and projected (EAGLE-3). Identity without
    ``fuse``. Applied once where the target's features arrive (prefill, verification), so the drafter state,
    the catch-up and the rollout only ever see E-wide features."""
    if not ecfg.fuse:
        return raw
    cfg = ecfg.target
    dt = cfg.jdtype
    e, n = cfg.hidden, len(ecfg.fuse)
    raw = raw.astype(dt)
    parts = [_rms(raw[..., i * e : (i + 1) * e], hp["fuse"]["norm"][i].astype(dt), cfg.rms_eps) for i in range(n)]
    return llama.dense(jnp.concatenate(parts + [raw[..., n * e :]], axis=-1), hp["fuse"]["kernel"])


def target_features(
    ecfg: EagleConfig, target_params: Params, tokens, positions, cache, tree_mask=None, logits_at=None
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One target pass -> (logits, raw features [B, T, raw_width], cache): what every head call site reads."""
    return llama.forward(
        ecfg.target, target_params, tokens, positions, cache, tree_mask, True, logits_at, hidden_layers=ecfg.fuse
    )


def head_features(
    ecfg: EagleConfig,
    hp: Params,
    target_params: Params,
    feats: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """The head on T pairs: feats [B, T, E] (f_i), tokens [B, T] (x_{i+1}), positions [B, T] (i) ->
    (f^ [B, T, E] predicted next features, cache with the T entries written at ``lengths + t``, uncommitted).
    tree_mask [B, T, T] bool: which of the T pairs each pair sees (default causal), for candidate trees."""
    cfg, lcfg = ecfg.target, ecfg.layer_cfg
    dt = cfg.jdtype
    emb = llama.embed(cfg, target_params, tokens)
    x = jnp.concatenate(
        [
            _rms(emb, hp["emb_norm"]["scale"].astype(dt), cfg.rms_eps),
            _rms(feats.astype(dt), hp["feat_norm"]["scale"].astype(dt), cfg.rms_eps),
        ],
        axis=-1,
    )
    x = llama.dense(x, hp["fc"]["kernel"])
    x, cache = llama.run_layers(lcfg, {"layers": hp["layers"]}, x, positions, cache, tree_mask)
    return _rms(x, hp["out_norm"]["scale"].astype(dt), cfg.rms_eps), cache


def unroll_mask(t: int, u: int) -> np.ndarray:
    """[T, (u+1)T] bool: what pass u (0 = true features) of training-time test sees at position i, i.e.
    what draft step u of a rollout sees at inference: the committed pairs j <= i - u (computed from true
    features: slots j of pass 0), then the rollout's own entries, one per pass v in 1..u at j = i - (u - v)."""
    i = np.arange(t)[:, None]
    j = np.arange(t)[None, :]
    blocks = [j <= i - u] + [j == i - (u - v) for v in range(1, u + 1)]
    return np.concatenate(blocks, axis=1)


def head_unrolled(
    ecfg: EagleConfig, hp: Params, target_params: Params, feats: jax.Array, tokens: jax.Array, unroll: int
) -> jax.Array:
    """Training-time test (EAGLE-3): the head on every pair of whole sequences for ``unroll`` passes, pass u
    feeding on pass u-1's predicted features and attending exactly as draft step u does in ``propose``.

    feats [B, T, E] (true f_i), tokens [B, T] (x_{i+1}) -> f^ [U, B, T, E]; pass u at i predicts f_{i+1}.
    """
    cfg, lcfg = ecfg.target, ecfg.layer_cfg
    dt = cfg.jdtype
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = llama.rope_tables(pos, lcfg.head_dim, *lcfg.rope_of(False))  # as run_layers rotates the head
    emb = _rms(llama.embed(cfg, target_params, tokens), hp["emb_norm"]["scale"].astype(dt), cfg.rms_eps)
    cache = init_head_cache(ecfg, b, unroll * t)
    k_all, v_all = cache.k, cache.v
    block = llama.Block(lcfg)
    f_in, outs = feats.astype(dt), []
    for u in range(unroll):
        x = jnp.concatenate([emb, _rms(f_in, hp["feat_norm"]["scale"].astype(dt), cfg.rms_eps)], axis=-1)
        x = x @ hp["fc"]["kernel"].astype(dt)
        mask = np.zeros((t, unroll * t), bool)
        mask[:, : (u + 1) * t] = unroll_mask(t, u)
        lengths = jnp.full((b,), u * t, jnp.int32)
        for li in range(ecfg.layers):
            x, k_all, v_all = block.apply(
                {"params": jax.tree.map(lambda w, li=li: w[li], hp["layers"])},
                x,
                cos,
                sin,
                k_all,
                v_all,
                jnp.int32(li),
                lengths,
                jnp.broadcast_to(mask, (b, t, t * unroll)),
            )
        f_hat = _rms(x, hp["out_norm"]["scale"].astype(dt), cfg.rms_eps)
        outs.append(f_hat)
        # Position i of the next pass reads the prediction of f_i (made at i - 1); position 0 keeps f_0.
        f_in = jnp.concatenate([feats[:, :1].astype(dt), f_hat[:, :-1]], axis=1)
    return jnp.stack(outs)


def subset_logits(f_hat: jax.Array, rows: jax.Array) -> jax.Array:
    """f^ [B, T, E] . rows [N, E] -> logits over the head's tokens [B, T, N] float32. Only these N rows are
    read: on SmolLM2-135M the full tied head (49152 rows) would cost 6x more than the 8k-row one. ``rows`` may
    be a ``cpu_kernels.PackedMatrix`` of rows^T [E, N] (``EagleDrafter.draft_params`` next to a packed target)."""
    if isinstance(rows, cpu_kernels.PackedMatrix):
        return cpu_kernels.matmul(f_hat, rows)
    return jnp.einsum("bte,ne->btn", f_hat, rows.astype(f_hat.dtype), preferred_element_type=jnp.float32)


def expand_to_vocab(q_sub: jax.Array, token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """[..., N] probabilities over the subset -> [..., V] with exactly 0 outside it. Scattered even when N == V:
    a full head's ids are arange(V) when checked (``_check_token_ids``), but ids traced under a caller's jit are
    not, and a permutation taken as arange would report q of other tokens than those drawn."""
    full = jnp.zeros(q_sub.shape[:-1] + (vocab_size,), q_sub.dtype)
    return full.at[..., token_ids].set(q_sub)


def _check_token_ids(ecfg: EagleConfig, ids: np.ndarray) -> None:
    """The head's vocabulary: N distinct ascending ids in [0, V). ``expand_to_vocab`` scatters q over them: a
    repeated id would overwrite q, so the q verified would not be the q sampled."""
    v = ecfg.target.vocab_size
    if ids.shape != (ecfg.n,) or ids.min() < 0 or ids.max() >= v or np.any(np.diff(ids) <= 0):
        raise ValueError(f"token_ids must be {ecfg.n} distinct ascending ids in [0, {v}), got {ids[:8]}...")


def init_head_cache(ecfg: EagleConfig, batch: int, slots: int) -> KVCache:
    """The head's own cache: k/v [layers, B, Hkv, S, D]."""
    return llama.init_cache(ecfg.layer_cfg, batch, slots)


# --------------------------------------------------------------------------------------------------------
# The drafter.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    """feats: [B, K+1, E] target features of the last verified block (position ``start + j`` at j);
    start: [B] that block's first position (the pending token of the round that verified it);
    cache: the head's KV cache, committed through pair ``start - 1`` (lengths = start) between rounds."""

    feats: jax.Array
    start: jax.Array
    cache: KVCache

    def insert(self, row: jax.Array, one: EagleState) -> EagleState:
        """Put the single-row state ``one`` into row ``row`` (the serving engine's continuous batching)."""
        return EagleState(
            self.feats.at[row].set(one.feats[0]),
            self.start.at[row].set(one.start[0]),
            self.cache.insert(row, one.cache),
        )


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
    """EAGLE draft head (jspec drafter protocol with ``verify_updates_state``).

    ecfg: the head's config (its ``target`` must be the target's config). max_draft: the largest K this
    drafter is asked for (the state's feature block has a fixed width, K+1, before K is known).
    draft params: ``draft_params(target_params, head_params)``.
    """

    ecfg: EagleConfig
    max_draft: int = 8

    verify_updates_state: ClassVar[bool] = True
    needs_params: ClassVar[bool] = True

    def __post_init__(self):
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")

    @property
    def vocab_size(self) -> int:
        return self.ecfg.target.vocab_size

    def check_target(self, target: Model, target_params, draft_params) -> None:
        # The verification is this head's own copy of the target's forward pass (it returns the features too).
        llama.check_model_of(target, self.ecfg.target, f"the EAGLE head {self.ecfg.name!r}")

    def draft_params(
        self, target_params: Params, head_params: Params, packed_dtype: str = "bfloat16"
    ) -> tuple[Params, Params]:
        """(target params, head params + ``rows`` [N, E]): the subset's LM-head rows gathered here, once per
        target, not per draft step. JAX does not copy the target params passed twice.

        packed_dtype: next to a packed target (the CPU kernel), the head's packed matrices are stored in this
        dtype. "bfloat16" (default) halves the bytes a draft step reads; the kernel widens them to f32 and
        multiplies in f32. Lossless either way: q is what the head samples, whatever its weights' rounding."""
        # A head of another shape than the config drafted from unfused features (a fused head under fuse=())
        # or failed at trace time (a missing fusion, another layer count).
        if ("fuse" in head_params) != bool(self.ecfg.fuse):
            has = "has" if "fuse" in head_params else "has no"
            raise ValueError(f"the head {has} fusion weights but its config says fuse={self.ecfg.fuse}")
        depth = {int(np.shape(x)[0]) for x in jax.tree.leaves(head_params["layers"])}
        if depth != {self.ecfg.layers}:
            raise ValueError(f"the head's layers stack {sorted(depth)} layers, its config says {self.ecfg.layers}")
        ids = jnp.asarray(head_params["token_ids"], jnp.int32)
        if ids.shape != (self.ecfg.n,):
            raise ValueError(f"head has {ids.shape[0]} token ids, config says N={self.ecfg.n}")
        try:  # checked on the host when the ids are concrete (not under a trace)
            _check_token_ids(self.ecfg, np.asarray(ids))
        except jax.errors.TracerArrayConversionError:
            pass
        rows = head_rows(self.ecfg.target, target_params, ids).astype(self.ecfg.target.jdtype)
        hp = {**head_params, "rows": rows}
        dt = llama.DTYPES[llama.canonical_dtype(packed_dtype)]  # checked whatever the layout
        if llama.is_packed(target_params):
            # Next to a target on the CPU kernel, the head's own matmuls (its layer, fc and the N rows) use it
            # too: a draft step reads ~36 MB of head weights, and XLA's matmuls read them at a lower rate.
            hp["layers"] = cpu_kernels.cast_panels(llama.unstack_layer_stack(head_params["layers"], packed=True), dt)
            hp["fc"] = {"kernel": cpu_kernels.pack(jnp.asarray(head_params["fc"]["kernel"], jnp.float32), dtype=dt)}
            hp["rows"] = cpu_kernels.pack(rows.T, dtype=dt)
        return target_params, hp

    def as_tree(self, spec: TreeSpec, rule: TreeRule = TreeRule.DETERMINISTIC) -> EagleTreeDrafter:
        """The same head drafting candidate trees of shape ``spec``; it takes the same draft params."""
        return EagleTreeDrafter(self.ecfg, spec=spec, rule=rule)

    def as_dynamic_tree(self, top_k: int, depth: int, budget: int) -> EagleDynamicTreeDrafter:
        """The same head growing EAGLE-2 dynamic trees (``EagleDynamicTreeDrafter``); same draft params."""
        return EagleDynamicTreeDrafter(self.ecfg, top_k=top_k, depth=depth, budget=budget)

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int) -> EagleState:
        """Runs the target over the prompt [B, P] once more to get its features, then the head over the
        prompt's pairs. The decoder calls ``prefill`` instead, which takes the features from its own pass."""
        tparams, _ = params
        cfg = self.ecfg.target
        b, p = prompt.shape
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, raw, _ = target_features(self.ecfg, tparams, prompt, pos, llama.init_cache(cfg, b, p))
        return self._state_from_prompt(params, prompt, prompt_len, raw, slots)

    def prefill(
        self, target: Model, target_params, params, prompt: jax.Array, positions: jax.Array, cache, prompt_len, slots
    ) -> tuple[jax.Array, KVCache, EagleState]:
        """The decoder's prefill (the drafter protocol's optional hook): one target pass over the prompt [B, P]
        gives the logits of each row's last token [B, V], the target cache and the prompt's features, from
        which the head state is built. ``init`` would run the target over the prompt a second time."""
        cfg = self.ecfg.target
        if target.vocab_size != cfg.vocab_size:
            raise ValueError(f"target vocab {target.vocab_size} != head's target config {cfg.vocab_size}")
        logits, raw, cache = target_features(
            self.ecfg, target_params, prompt, positions, cache, logits_at=prompt_len - 1
        )
        return logits[:, 0], cache, self._state_from_prompt(params, prompt, prompt_len, raw, slots)

    def _state_from_prompt(self, params, prompt, prompt_len, raw, slots: int) -> EagleState:
        """The head over the prompt's pairs (g_i, x_{i+1}), i < prompt_len - 1; raw [B, P, raw_width]."""
        tparams, hp = params
        cfg = self.ecfg.target
        b, p = prompt.shape
        feats = fuse_features(self.ecfg, hp, raw)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        cache = init_head_cache(self.ecfg, b, slots + self._scratch_slots())
        if p > 1:
            _, cache = head_features(self.ecfg, hp, tparams, feats[:, :-1], prompt[:, 1:], pos[:, :-1], cache)
        last = take_rows(feats, prompt_len - 1)  # [B, E] f of the last prompt token
        block = jnp.zeros((b, self.max_draft + 1, cfg.hidden), cfg.jdtype).at[:, 0].set(last)
        return EagleState(block, prompt_len - 1, cache.with_lengths(prompt_len - 1))

    def _scratch_slots(self) -> int:
        # Room past the last committed slot for the catch-up block (K+1) and the rollout.
        return self.max_draft + 2

    def _catch_up(self, params, state: EagleState, ctx: DraftContext, width: int) -> tuple[jax.Array, KVCache]:
        """Feed pairs start .. pending-1 (the stored features with the tokens that followed them) as one block
        of ``width`` at the head cache's end, rewound to ``start``. Returns (f^ of the pending position [B, E],
        the head cache committed through the pending token's pair)."""
        tparams, hp = params
        pend = ctx.seq_len - 1
        start = state.start
        j = jnp.arange(width, dtype=jnp.int32)[None, :]
        pos = start[:, None] + j  # [B, width] pair index i
        toks = take_rows(ctx.seq, jnp.minimum(pos + 1, ctx.seq.shape[1] - 1))  # x_{i+1}
        f_hat, cache = head_features(
            self.ecfg, hp, tparams, state.feats[:, :width], toks, pos, state.cache.with_lengths(start)
        )
        # A stopped row has pend == start (nothing new): its output is garbage that no one reads.
        last = take_rows(f_hat, jnp.clip(pend - start - 1, 0, width - 1))
        return last, cache.with_lengths(pend)

    def observe(self, params, state: EagleState, ctx: DraftContext) -> EagleState:
        # No proposals this round, but the committed tokens must still enter the head cache: the verify
        # that follows moves ``start`` on and the pairs before it would otherwise be lost.
        _, cache = self._catch_up(params, state, ctx, self.max_draft + 1)
        return dataclasses.replace(state, cache=cache)

    def propose(self, params, state: EagleState, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        """K drafts [B, K] with q [B, K, V] (zero outside the head's N tokens)."""
        if k > self.max_draft:
            raise ValueError(f"EagleDrafter(max_draft={self.max_draft}) asked for k={k} candidates")
        tparams, hp = params
        v = self.vocab_size
        ids, rows = hp["token_ids"], hp["rows"]
        pend = ctx.seq_len - 1
        f0, cache = self._catch_up(params, state, ctx, k + 1)
        keys = split_keys(key, k)

        def draw(f, key_i):  # f [B, E] -> token [B], q over the subset [B, N]
            q = distribution(subset_logits(f[:, None], rows)[:, 0], ctx.sampling)
            return jnp.take(ids, sample(key_i, q)), q

        x0, q0 = draw(f0, keys[0])

        def step(carry, key_i):
            cache, f, x, pos = carry
            f_next, cache = head_features(
                self.ecfg, hp, tparams, f[:, None], x[:, None], pos[:, None], cache.with_lengths(pos)
            )
            nx, q = draw(f_next[:, 0], key_i)
            return (cache, f_next[:, 0], nx, pos + 1), (nx, q)

        (cache, _, _, _), (xs, qs) = jax.lax.scan(step, (cache, f0, x0, pend), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)
        q_sub = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        new_state = dataclasses.replace(state, cache=cache.with_lengths(pend))
        return Proposal(tokens, expand_to_vocab(q_sub, ids, v), ctx.max_draft, new_state)

    def verify(
        self,
        target: Model,
        target_params: Params,
        draft_params,
        state: EagleState,
        tokens: jax.Array,  # [B, K+1] pending token, then the K drafts
        positions: jax.Array,  # [B, K+1]
        cache: KVCache,
    ) -> tuple[jax.Array, KVCache, EagleState]:
        """The target's logits [B, K+1, V] and cache (one pass, exactly the decoder's own call) plus the
        features of the block as the next state."""
        cfg = self.ecfg.target
        if target.vocab_size != cfg.vocab_size:
            raise ValueError(f"target vocab {target.vocab_size} != head's target config {cfg.vocab_size}")
        logits, raw, cache = target_features(self.ecfg, target_params, tokens, positions, cache)
        feats = fuse_features(self.ecfg, draft_params[1], raw)
        block = jnp.zeros_like(state.feats)
        block = jax.lax.dynamic_update_slice_in_dim(block, feats.astype(block.dtype), 0, axis=1)
        return logits, cache, EagleState(block, positions[:, 0], state.cache)


@dataclasses.dataclass(frozen=True)
class EagleTreeDrafter(StaticTreeShape, EagleDrafter):
    """The EAGLE head expanding a static candidate tree (``jspec.tree.TreeSpec``), level by level.

    A node's children come from the head's predicted feature at that node: f^ of the root is the catch-up's
    output at the pending position; f^ of node i is the head on the pair (f^ of i's parent, x_i) at position
    ``pending + depth_i - 1``, attending to the committed pairs and to i's ancestors only (never a sibling).
    The target verifies every node in one call under the ancestor mask and returns each node's features;
    after acceptance, ``follow_path`` keeps those of the accepted path (root first), so the next catch-up
    feeds the head exactly the pairs a chain over that path would have given it. Scratch entries of the
    tree stay past the head cache's committed length and are overwritten.

    rule: how children are chosen (``TreeRule``); with the frequent-token head, children are drawn from
    the N tokens it covers and q is 0 elsewhere, so every rule stays lossless.
    """

    spec: TreeSpec | None = None
    rule: TreeRule | None = None  # None = DETERMINISTIC
    # Set from the tree's depth in __post_init__: not an argument, so a max_draft passed in is not ignored.
    max_draft: int = dataclasses.field(default=0, init=False)

    def __post_init__(self):
        if not isinstance(self.spec, TreeSpec):
            raise TypeError(f"EagleTreeDrafter needs spec=jspec.tree.TreeSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "rule", TreeRule.DETERMINISTIC if self.rule is None else check_rule(self.rule))
        # The feature block holds the accepted path: the root and at most max_depth accepted nodes.
        object.__setattr__(self, "max_draft", self.spec.max_depth)
        super().__post_init__()

    def _scratch_slots(self) -> int:
        return max(self.max_draft + 2, self.spec.num_nodes + 1)

    def propose(self, *args, **kwargs):
        raise TypeError("EagleTreeDrafter proposes trees (propose_tree); use EagleDrafter for chains")

    def propose_tree(self, params, state: EagleState, ctx: DraftContext, key: jax.Array):
        """-> ``jspec.tree.TreeProposal``: tokens/parent/depth/valid [B, N], q [B, N, V] (node i's children's
        distribution, 0 outside the head's tokens), state (the head cache committed through the pending pair)."""
        tparams, hp = params
        ids, rows = hp["token_ids"], hp["rows"]
        parent_np, depth_np, _ = self.spec.arrays
        n, dmax = len(parent_np), self.spec.max_depth
        b, v = ctx.seq.shape[0], self.vocab_size
        pend = ctx.seq_len - 1
        f0, cache = self._catch_up(params, state, ctx, dmax + 1)
        parent = jnp.broadcast_to(jnp.asarray(parent_np, jnp.int32), (b, n))
        depth = jnp.broadcast_to(jnp.asarray(depth_np, jnp.int32), (b, n))
        sub_mask = ancestor_mask(parent)[:, 1:, 1:]  # non-root nodes: their non-root ancestors and themselves
        pair_pos = pend[:, None] + depth[:, 1:] - 1  # the pair (f^ parent, x_i) sits at the parent's position
        tokens = jnp.zeros((b, n), jnp.int32)
        valid = jnp.ones((b, n), bool)
        q_all = jnp.zeros((b, n, v), jnp.float32)
        node_f = jnp.zeros((b, n) + f0.shape[1:], f0.dtype).at[:, 0].set(f0)
        keys = split_keys(key, dmax)
        for d in range(dmax):
            level = np.nonzero(depth_np == d)[0]
            kids_per_node = [np.nonzero(parent_np == i)[0] for i in level]
            c = max(len(k_) for k_ in kids_per_node)
            if c == 0:
                break
            logits = subset_logits(node_f[:, level], rows)  # [B, M, N_head]
            q_sub = distribution(logits, ctx.sampling)
            q_all = q_all.at[:, level].set(expand_to_vocab(q_sub, ids, v))
            idx, ok = choose_children(keys[d], logits, q_sub, c, self.rule)
            toks = jnp.take(ids, idx)
            for m, kids in enumerate(kids_per_node):
                if len(kids):
                    tokens = tokens.at[:, kids].set(toks[:, m, : len(kids)])
                    valid = valid.at[:, kids].set(ok[:, m, : len(kids)])
            if np.any(depth_np == d + 2):
                # Every non-root node in one head call; only those at depth d+1 have their inputs yet (their
                # parents' f^ came from the previous level), and the mask keeps the others from them.
                in_f = jnp.take_along_axis(node_f, parent[:, 1:, None], axis=1)
                f_hat, _ = head_features(self.ecfg, hp, tparams, in_f, tokens[:, 1:], pair_pos, cache, sub_mask)
                nxt = np.nonzero(depth_np == d + 1)[0]
                node_f = node_f.at[:, nxt].set(f_hat[:, nxt - 1])
        return TreeProposal(tokens, q_all, parent, depth, valid, dataclasses.replace(state, cache=cache))

    def verify(
        self,
        target: Model,
        target_params: Params,
        draft_params,
        state: EagleState,
        tokens: jax.Array,  # [B, N] the pending token at the root, then the tree's candidates
        positions: jax.Array,  # [B, N] committed + depth
        cache: KVCache,
        tree_mask: jax.Array | None = None,  # [B, N, N] ancestor mask
    ) -> tuple[jax.Array, KVCache, tuple[jax.Array, jax.Array]]:
        """The target's logits [B, N, V] and cache (exactly the decoder's own tree call) plus what
        ``follow_path`` needs: every node's features [B, N, E] and the root's position [B]."""
        cfg = self.ecfg.target
        if target.vocab_size != cfg.vocab_size:
            raise ValueError(f"target vocab {target.vocab_size} != head's target config {cfg.vocab_size}")
        logits, raw, cache = target_features(self.ecfg, target_params, tokens, positions, cache, tree_mask)
        return logits, cache, (fuse_features(self.ecfg, draft_params[1], raw), positions[:, 0])

    def follow_path(self, state: EagleState, verified: tuple[jax.Array, jax.Array], path: jax.Array) -> EagleState:
        """The accepted path's features (path [B, D+1] node indices, root first) as the next feature block."""
        feats, start = verified
        block = jnp.take_along_axis(feats, path[:, :, None], axis=1).astype(state.feats.dtype)
        return EagleState(block, start, state.cache)


@dataclasses.dataclass(frozen=True)
class EagleDynamicTreeDrafter(DynamicTreeShape, EagleTreeDrafter):
    """The EAGLE head growing EAGLE-2 dynamic trees (``jspec.tree.grow_dynamic_tree``): ``budget`` nodes
    (root included) per row, shaped by the head's own cumulative log-probabilities, up to ``depth`` deep,
    expanding the ``top_k`` best nodes of each level. Where the head is confident the tree runs deep, where it
    is not it spreads over alternatives, at the verification cost of a fixed ``budget`` tokens.

    Frontier node j's feature is the head on (f^ of j's parent, x_j) at position ``pending + depth_j - 1``
    under the ancestor mask among the frontier (the root's f^ is the catch-up's output), exactly as in a
    static tree; every level runs the head once over all frontier slots. Children are the head's top
    candidates (DETERMINISTIC rule: each a one-hot proposal, lossless at any temperature); verification and
    ``follow_path`` are the static tree's.
    """

    top_k: int = 4
    depth: int = 3
    budget: int = 9

    def __post_init__(self):
        object.__setattr__(self, "rule", TreeRule.DETERMINISTIC if self.rule is None else check_rule(self.rule))
        check_dynamic_tree(self.rule, self.top_k, self.depth, self.budget)
        object.__setattr__(self, "max_draft", self.depth)
        EagleDrafter.__post_init__(self)

    def _scratch_slots(self) -> int:
        # The catch-up block (depth + 1) and every frontier slot (depth * top_k) past the committed end.
        return max(self.depth + 2, self.depth * self.top_k + 1)

    def propose_tree(self, params, state: EagleState, ctx: DraftContext, key: jax.Array):
        """-> ``jspec.tree.TreeProposal`` (tokens/parent/depth/valid [B, budget]; q unused by the rule)."""
        tparams, hp = params
        ids, rows = hp["token_ids"], hp["rows"]
        k = self.top_k
        pend = ctx.seq_len - 1
        f0, cache = self._catch_up(params, state, ctx, self.depth + 1)
        root_logits = subset_logits(f0[:, None], rows)[:, 0]  # [B, N]

        def expand(d, f_idx, f_par, f_dep, node_f):
            # node_f [B, M, E]: f^ of every frontier slot computed so far; a slot's input is its parent's.
            of_parent = jnp.take_along_axis(node_f, jnp.maximum(f_par, 0)[..., None], axis=1)
            in_f = jnp.where((f_par >= 0)[..., None], of_parent, f0[:, None])
            pos = pend[:, None] + f_dep - 1
            toks = jnp.take(ids, f_idx)
            node_f, _ = head_features(self.ecfg, hp, tparams, in_f, toks, pos, cache, frontier_mask(f_par))
            return subset_logits(node_f[:, (d - 1) * k : d * k], rows), node_f

        node_f = jnp.zeros((f0.shape[0], self.depth * k) + f0.shape[1:], f0.dtype)
        idx, parent, depth, valid = grow_dynamic_tree(root_logits, expand, node_f, k, self.depth, self.budget)
        tokens = jnp.take(ids, idx).at[:, 0].set(0)
        q = jnp.zeros(tokens.shape + (1,), jnp.float32)  # unused by the DETERMINISTIC rule
        return TreeProposal(tokens, q, parent, depth, valid, dataclasses.replace(state, cache=cache))


# --------------------------------------------------------------------------------------------------------
# Checkpoints (orbax, through models.layerskip's helpers) and the cache directory.


def save_head(path: str | os.PathLike, ecfg: EagleConfig, hp: Params, meta: dict | None = None) -> str:
    """Write ``path/params`` (orbax) and ``path/meta.json`` (config, frequent-token map size, metrics).
    ``hp`` may carry runtime ``rows``; they are not saved (rebuilt from the target). Overwrites."""
    hp = {k: v for k, v in hp.items() if k != "rows"}
    meta = {**(meta or {}), "format": FORMAT_VERSION, "kind": "eagle", "config": ecfg.to_json()}
    save_exit_params(path, hp, meta)
    return os.fspath(path)


def restore_head(path: str | os.PathLike, target_cfg: LlamaConfig | None = None) -> tuple[EagleConfig, Params]:
    """Read what ``save_head`` wrote: (config, head params). With ``target_cfg`` the head must match it
    (same widths, depth, norm epsilon, embedding tying, attention biases and vocabulary: a head trained for
    another model of the same width would load and draft nothing useful). The params come back float32 (a bf16
    export widened); the drafter casts them to the target's dtype where it uses them."""
    meta = load_exit_meta(path)
    if meta.get("kind") != "eagle" or meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"'{path}' is not an EAGLE head of format {FORMAT_VERSION}")
    ecfg = EagleConfig.from_json(meta["config"], name=os.path.basename(os.path.normpath(os.fspath(path))))
    if target_cfg is not None:
        # Every field of models.layerskip.TARGET_FIELDS (qkv_bias included: a Llama head on a Qwen2 target of
        # the same widths); a head saved before qkv_bias was recorded was trained for a model without biases.
        check_trained_for(f"head '{path}'", dataclasses.asdict(ecfg.target), target_cfg)
        ecfg = dataclasses.replace(ecfg, target=target_cfg)
    # Stored arrays that disagree with meta.json's config (another depth, fusion, head size) are refused by leaf.
    params = restore_exit_params(path, target=abstract_head(ecfg), holder=f"EAGLE head '{path}'")
    _check_token_ids(ecfg, np.asarray(params["token_ids"]))  # what expand_to_vocab scatters q over
    return ecfg, params


def cache_root() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/eagle``: where examples/train_eagle.py writes its heads and data."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "eagle")


# Heads shipped in the repository (``export_head``, bf16: ~6.6 MB each), so a chat drafter works without the
# hours of CPU its data and training cost. DEFAULT_HEAD is what ``--drafter eagle`` and bench_eagle.py use
# when no head is named.
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")
DEFAULT_HEAD = "smollm2-8k-chat-mp5"


def bundled_heads() -> list[str]:
    """Names of the heads under ``BUNDLED_DIR``."""
    if not os.path.isdir(BUNDLED_DIR):
        return []
    return sorted(n for n in os.listdir(BUNDLED_DIR) if os.path.isfile(os.path.join(BUNDLED_DIR, n, "meta.json")))


def resolve_head(path_or_name: str | os.PathLike) -> str:
    """A head directory, a name under ``cache_root()`` (where examples/train_eagle.py writes), or a bundled
    head's name; a trained head shadows a bundled one of the same name."""
    s = os.fspath(path_or_name)
    for cand in (s, os.path.join(cache_root(), s, "head"), os.path.join(BUNDLED_DIR, s)):
        if os.path.isfile(os.path.join(cand, "meta.json")):
            return cand
    raise FileNotFoundError(
        f"no EAGLE head '{s}': neither a head directory, a trained head under {cache_root()} nor a bundled head "
        f"({', '.join(bundled_heads()) or 'none'}) (train one with: python examples/train_eagle.py)"
    )


def export_head(
    src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "bfloat16", extra_meta: dict | None = None
) -> str:
    """Write the head at ``src`` (directory or name) to ``dst`` with its float parameters stored in ``dtype``
    (bf16 halves the files: how ``BUNDLED_DIR`` keeps under the repository's 20 MB limit). ``restore_head``
    widens them back to float32, so what loads is the ``dtype``-rounded head (on a packed CPU target
    its matrices are packed in bf16 anyway); the frequent-token map and meta.json's metrics are kept,
    ``extra_meta`` (e.g. the held-out evaluation) joins them."""
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"export dtype must be a float type, got {dtype!r}")
    path = resolve_head(src)
    ecfg, hp = restore_head(path)
    hp = {k: v if k == "token_ids" else jax.tree.map(lambda x: x.astype(dt), v) for k, v in hp.items()}
    meta = {k: v for k, v in read_meta(path).items() if k not in ("format", "kind", "config")}
    meta.update(extra_meta or {})
    meta.update(stored_dtype=dt.name, exported_from=meta.get("name") or os.path.basename(os.path.normpath(path)))
    return save_head(dst, ecfg, hp, meta)


def load_eagle(
    path_or_name: str | os.PathLike,
    target_cfg: LlamaConfig,
    target_params: Params,
    max_draft: int = 8,
    packed_dtype: str = "bfloat16",
) -> tuple[EagleDrafter, tuple[Params, Params]]:
    """(drafter, draft params) for ``jspec.decode`` from a saved head (directory or cache name);
    ``packed_dtype``: see ``EagleDrafter.draft_params``."""
    ecfg, hp = restore_head(resolve_head(path_or_name), target_cfg)
    drafter = EagleDrafter(ecfg, max_draft)
    return drafter, drafter.draft_params(target_params, hp, packed_dtype)


def read_meta(path_or_name: str | os.PathLike) -> dict[str, Any]:
    with open(os.path.join(resolve_head(path_or_name), "meta.json")) as f:
        return json.load(f)


def param_count(hp: Params) -> int:
    """Trainable parameters read per draft step (the rows included when present)."""
    leaves = [x for k, sub in hp.items() if k != "token_ids" for x in jax.tree.leaves(sub)]
    return int(sum(math.prod(x.shape) for x in leaves))
