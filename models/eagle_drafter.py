"""The EAGLE head as a jspec drafter: chains, static trees and EAGLE-2 dynamic trees.

Why a module of its own: this is the part the decoder sees, the drafter protocol (``jspec.drafters``) with
``verify_updates_state``: the head's state between rounds, catching up on the committed tokens, proposing, and
replacing the decoder's target call so the target's features come back with its logits. The head's maths is
``models.eagle_head``; the tree forms subclass the chain drafter (same draft params, same catch-up), so the
three live together, and ``EagleDrafter.as_tree`` / ``as_dynamic_tree`` build them without an import circle.

Dimension vocabulary: B batch, K draft length, V vocab, N tokens of the draft head's vocabulary, E hidden
width.

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
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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
from models.eagle_head import (
    EagleConfig,
    check_token_ids,
    expand_to_vocab,
    fuse_features,
    head_features,
    init_head_cache,
    subset_logits,
    target_features,
)
from models.layerskip import head_rows
from models.llama import Params


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
            check_token_ids(self.ecfg, np.asarray(ids))
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
