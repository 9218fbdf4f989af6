"""The drafter protocol: what proposes candidates, as the decode loop sees it.

A drafter is a frozen (hashable) object, a static argument of the jitted decoder, that derives from
``Drafter``. Its class DECLARES what it can do in the capability fields below; the loop reads those fields and
never probes for methods, and ``jspec.validate.check_drafter`` checks once, before anything is traced, that a
drafter has the methods its declared capabilities need (the ``typing.Protocol`` classes below).

Capabilities (class fields, read as they are):
- ``is_tree``: proposes a candidate tree each round (``TreeDrafter``), else a chain (``ChainDrafter``).
- ``shares_target_cache``: is part of the target (self-speculation): finds the target's cache in
  ``DraftContext.target_cache``, may write its own entries there (``Proposal.target_cache``), and replaces the
  verification's target call with its own ``verify`` that reuses what it computed (``CacheSharingDrafter``).
- ``verify_updates_state``: reads by-products of the verification (an EAGLE head reads the target's hidden
  features): runs the verification itself and keeps its new state, and runs the prompt's pass too, so that
  the target sees the prompt once (``VerifyReadingDrafter``).
- ``needs_params``: reads ``draft_params`` (a draft model's or head's weights): ``prepare`` refuses None.

Every drafter has ``vocab_size`` (V of q, which must equal the target's; None for drafters that emit token
ids only), ``init`` (state after the prompt is known; ``Drafter``'s keeps none), ``observe`` (called instead of
proposing in rounds where no row may propose, e.g. adaptive K at 0, so a stateful drafter keeps up with the
committed sequence cheaply; ``Drafter``'s keeps the state as it is) and ``check_target`` (raises a ValueError
naming the problem when it cannot serve this target with these params; ``target_params`` may be None where a
caller does not have them). Drafters that run part of the target's computation themselves use it to refuse a
target they would not reproduce.

Randomness: ``key`` is one key for the batch or [B] per-row keys (per-request seeds); draw through
``jspec.sampling``'s ``split_keys`` / ``uniform`` / ``gumbel`` / ``sample``, which take both, so a row's draws
come from its own key. q must be ``jspec.sampling.distribution(draft_logits, ctx.sampling)`` of what is really
sampled: that is what keeps verification lossless.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import take_rows
from jspec.model import Model
from jspec.sampling import SamplingParams, distribution, sample, split_keys
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter may read at the start of a round.

    seq: [B, W] every token of the row so far (prompt, then generated), right-padded.
    seq_len: [B] tokens in ``seq``; the last one (``seq[b, seq_len-1]``) is the pending token, emitted but
      not yet run through the target.
    max_draft: [B] proposals allowed this round (<= K): limited by the cache room and the tokens still wanted.
    sampling: the rows' sampling parameters; q must be ``distribution(draft_logits, sampling)``.
    target_cache: the target's cache, for drafters with ``shares_target_cache`` (None otherwise).
    """

    seq: jax.Array
    seq_len: jax.Array
    max_draft: jax.Array
    sampling: SamplingParams
    target_cache: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """tokens: [B, K]; q: [B, K, V] (the distribution each token was drawn from); n_draft: [B] how many of
    the K are real proposals (the rest are padding and are never accepted); state: the drafter's new state;
    target_cache: the target's cache with the drafter's writes (only for ``shares_target_cache`` drafters)."""

    tokens: jax.Array
    q: jax.Array
    n_draft: jax.Array
    state: Any
    target_cache: Any = None


class Drafter:
    """Base of every drafter: the declared capabilities (see the module docstring) and the defaults of the
    optional methods. Subclasses are frozen dataclasses; they override the fields that apply to them."""

    is_tree: ClassVar[bool] = False
    shares_target_cache: ClassVar[bool] = False
    verify_updates_state: ClassVar[bool] = False
    needs_params: ClassVar[bool] = False
    # The largest K a chain drafter can be asked for (its state has a fixed width), None for no limit.
    max_draft: int | None = None

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int) -> Any:
        """prompt [B, P] right-padded, prompt_len [B] -> the drafter's state (None: it keeps none)."""
        return None

    def observe(self, params, state, ctx: DraftContext) -> Any:
        """The state after a round in which no row proposed."""
        return state

    def check_target(self, target: Model, target_params, draft_params) -> None:
        """Raise a ValueError naming the problem when this drafter cannot serve ``target``."""
        return None

    @property
    def draft_model(self) -> Model | None:
        """The separate model it drafts with, if any (its context length bounds the rows it can serve)."""
        return None


def always_wide(drafter: Drafter | None) -> bool:
    """Whether every round verifies wide, proposals or not: a tree verifies its N nodes, and a drafter that reads
    the verification's by-products (EAGLE) always runs its own verify; other chains fall back to a 1-token step
    when no row proposed."""
    return drafter is not None and (drafter.is_tree or drafter.verify_updates_state)


class ChainDrafter(Protocol):
    """A drafter proposing up to K candidates in a row (``is_tree`` False)."""

    vocab_size: int | None

    def propose(self, params, state, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        """Up to ``k`` (static) candidates per row and the distributions q they were really drawn from."""
        ...


class TreeDrafter(Protocol):
    """A drafter proposing a candidate tree (``is_tree`` True), verified by one target call over its nodes.

    max_depth: the deepest node (the longest path a round can accept); max_children: the most children of
    one node; rule: how children are drawn (``jspec.tree.TreeRule``); nodes: nodes verified per round, the
    root included; scratch: cache slots a round writes past the pending token's (at least nodes - 1)."""

    vocab_size: int | None
    max_depth: int
    max_children: int
    rule: TreeRule
    nodes: int
    scratch: int

    def propose_tree(self, params, state, ctx: DraftContext, key: jax.Array) -> TreeProposal: ...


class CacheSharingDrafter(Protocol):
    """``shares_target_cache``: its ``verify`` replaces the target call of the verification."""

    def verify(self, target: Model, target_params, draft_params, state, tokens, positions, cache):
        """tokens, positions [B, T] -> (logits [B, T, V], cache with the T entries written)."""
        ...


class VerifyReadingDrafter(Protocol):
    """``verify_updates_state``: runs the prompt's pass and the verification itself, keeping their by-products.

    prefill -> (logits of each row's last prompt token [B, V], cache, state): replaces both the decoder's
    prefill call and ``init``. verify -> (logits, cache, new state) for a chain; a tree drafter's returns what
    ``follow_path(state, verified, path)`` keeps of the accepted path once verification has chosen it."""

    def prefill(self, target: Model, target_params, draft_params, prompt, positions, cache, prompt_len, slots): ...

    def verify(self, target: Model, target_params, draft_params, state, tokens, positions, cache, tree_mask=None): ...


@runtime_checkable
class TreeForms(Protocol):
    """A chain drafter with tree forms of its own (an EAGLE head needs the target's features per node)."""

    def as_tree(self, spec, rule) -> Drafter: ...

    def as_dynamic_tree(self, top_k: int, depth: int, budget: int) -> Drafter: ...


@runtime_checkable
class ModelForm(Protocol):
    """A drafter that can also run as a stand-alone draft model (LayerSkip's exit), so any model drafter's tree
    can be built from it."""

    def as_model(self, draft_params) -> tuple[Model, Any]: ...


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
    """A separate (smaller) model sharing the target's tokenizer drafts K tokens autoregressively.

    Its cache follows the committed sequence by index masking alone: each round rewinds the cache to one
    slot before the pending token and re-feeds [previous token, pending token] (rewriting an identical entry
    when it already exists), so whether the last round's final proposal was accepted needs no bookkeeping.
    """

    model: Model

    needs_params: ClassVar[bool] = True  # its model's params: prepare refuses None

    @property
    def draft_model(self) -> Model:
        return self.model

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int):
        b, p = prompt.shape
        cache = self.model.init_cache(b, slots)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = self.model.apply(params, prompt, positions, cache)
        # A commit, not a length change: a cache with more state (a compressed model's block summaries) keeps
        # what the prompt's tokens wrote only when they are committed.
        return cache.commit(prompt_len)

    def _catch_up(self, params, cache, ctx: DraftContext):
        """Rewind to one slot before the pending token and feed [previous, pending]: afterwards the cache
        holds the whole committed sequence plus the pending token. Returns (logits [B, 2, V], cache)."""
        b = ctx.seq.shape[0]
        pend = ctx.seq_len - 1  # slot/position of the pending token
        first = take_rows(ctx.seq, jnp.stack([jnp.maximum(pend - 1, 0), pend], axis=1))
        cache = cache.with_lengths(pend - 1)
        logits, cache = self.model.apply(params, first, jnp.stack([pend - 1, pend], axis=1), cache)
        return logits, cache.commit(jnp.full((b,), 2, jnp.int32))

    def observe(self, params, cache, ctx: DraftContext):
        return self._catch_up(params, cache, ctx)[1]

    def propose(self, params, cache, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        b = ctx.seq.shape[0]
        pend = ctx.seq_len - 1
        logits, cache = self._catch_up(params, cache, ctx)
        keys = split_keys(key, k)
        q0 = distribution(logits[:, -1], ctx.sampling)
        x0 = sample(keys[0], q0)

        def step(carry, k_i):
            cache, x, pos = carry
            logits, cache = self.model.apply(params, x[:, None], pos[:, None], cache)
            cache = cache.commit(jnp.ones((b,), jnp.int32))
            q = distribution(logits[:, 0], ctx.sampling)
            nx = sample(k_i, q)
            return (cache, nx, pos + 1), (nx, q)

        (cache, _, _), (xs, qs) = jax.lax.scan(step, (cache, x0, pend + 1), keys[1:])
        tokens = jnp.concatenate([x0[:, None], xs.T], axis=1)
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        return Proposal(tokens, q, ctx.max_draft, cache)


class StaticTreeShape:
    """A tree drafter's verification bounds from its ``spec`` (``TreeSpec``): the same tree every row and round."""

    is_tree: ClassVar[bool] = True

    @property
    def max_depth(self) -> int:
        return self.spec.max_depth

    @property
    def max_children(self) -> int:
        return self.spec.max_children

    @property
    def nodes(self) -> int:
        return self.spec.num_nodes

    @property
    def scratch(self) -> int:
        return self.spec.num_nodes - 1


@dataclasses.dataclass(frozen=True)
class TreeModelDrafter(StaticTreeShape, Drafter):
    """A draft model that expands a static tree (``TreeSpec``) level by level.

    Its cache holds the committed sequence up to ``lengths``; each round first catches up on the tokens
    committed since (the accepted path and the new pending token, at most depth + 1 of them, fed as one
    block), then runs the whole tree (every non-root node, ancestor-masked) once per level. Scratch entries
    of rejected branches stay beyond ``lengths`` and are overwritten next round.
    """

    model: object  # jspec.model.Model
    spec: TreeSpec
    rule: TreeRule = TreeRule.DETERMINISTIC

    needs_params: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.spec, TreeSpec):
            raise TypeError(f"TreeModelDrafter needs spec=jspec.tree.TreeSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "rule", check_rule(self.rule))

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def draft_model(self):
        return self.model

    def init(self, params, prompt, prompt_len, slots):
        b, p = prompt.shape
        cache = self.model.init_cache(b, slots)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = self.model.apply(params, prompt, positions, cache)
        return cache.commit(prompt_len)  # a commit: see ``ModelDrafter.init``

    def _catch_up(self, params, cache, seq, seq_len):
        """Feed every token from ``cache.lengths`` to the pending token; return its logits [B, V]."""
        b, w_seq = seq.shape
        width = self.max_depth + 2
        start = cache.lengths
        idx = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        toks = take_rows(seq, jnp.minimum(idx, w_seq - 1))
        logits, cache = self.model.apply(params, toks, idx, cache)
        pend = seq_len - 1
        return take_rows(logits, pend - start), cache.commit(seq_len - start)  # through the pending token

    def observe(self, params, cache, ctx: DraftContext):
        # A round without a tree (a plain step): the cache catches up with the committed tokens every round, so
        # the gap to the pending token never outgrows one catch-up block.
        return self._catch_up(params, cache, ctx.seq, ctx.seq_len)[1]

    def propose_tree(self, params, cache, ctx, key) -> TreeProposal:
        parent_np, depth_np, _ = self.spec.arrays
        n = len(parent_np)
        b = ctx.seq.shape[0]
        v = self.vocab_size
        root_logits, cache = self._catch_up(params, cache, ctx.seq, ctx.seq_len)
        pend = ctx.seq_len - 1
        parent = jnp.broadcast_to(jnp.asarray(parent_np, jnp.int32), (b, n))
        depth = jnp.broadcast_to(jnp.asarray(depth_np, jnp.int32), (b, n))
        # Non-root nodes see the root as committed context; among themselves, their ancestors only.
        sub_mask = ancestor_mask(parent)[:, 1:, 1:]
        tokens = jnp.zeros((b, n), jnp.int32)
        valid = jnp.ones((b, n), bool)
        q_all = jnp.zeros((b, n, v), jnp.float32)
        level_logits = root_logits[:, None]  # [B, 1, V] logits of the nodes at the current depth
        keys = split_keys(key, self.spec.max_depth)
        for d in range(self.spec.max_depth):
            level = np.nonzero(depth_np == d)[0]
            q_level = distribution(level_logits, ctx.sampling)  # [B, M, V]
            q_all = q_all.at[:, level].set(q_level)
            kids_per_node = [np.nonzero(parent_np == i)[0] for i in level]
            c = max(len(k_) for k_ in kids_per_node)
            if c == 0:
                break
            toks, ok = choose_children(keys[d], level_logits, q_level, c, self.rule)
            for m, kids in enumerate(kids_per_node):
                if len(kids):
                    tokens = tokens.at[:, kids].set(toks[:, m, : len(kids)])
                    valid = valid.at[:, kids].set(ok[:, m, : len(kids)])
            nxt = np.nonzero(depth_np == d + 1)[0]
            if d + 1 < self.spec.max_depth and np.any(depth_np == d + 2):
                logits, _ = self.model.apply(params, tokens[:, 1:], pend[:, None] + depth[:, 1:], cache, sub_mask)
                level_logits = logits[:, nxt - 1]
        return TreeProposal(tokens, q_all, parent, depth, valid, cache)


class DynamicTreeShape:
    """The verification bounds of a dynamic tree with fields ``top_k``, ``depth`` and ``budget`` (a mixin)."""

    is_tree: ClassVar[bool] = True

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_children(self) -> int:
        return self.budget - 1  # the root may keep every selected candidate as a child

    @property
    def nodes(self) -> int:
        return self.budget

    @property
    def scratch(self) -> int:
        # Every frontier slot of the ``depth`` levels (``top_k`` each) also runs through the drafter's cache,
        # which can be more than the budget's: reserved too, so that no frontier entry falls off the end of the
        # cache, where its logits (and so which nodes a row keeps) would depend on the cache's size.
        return max(self.budget - 1, self.top_k * self.depth)


@dataclasses.dataclass(frozen=True)
class DynamicTreeDrafter(DynamicTreeShape, TreeModelDrafter):
    """EAGLE-2 style dynamic tree from a draft model (``grow_dynamic_tree`` with width ``top_k``): the shape
    differs per row; children are chosen deterministically (DETERMINISTIC rule)."""

    # Not constructor arguments: the tree is built per row and its children are always the most likely, so
    # ``DynamicTreeDrafter(model, top_k, depth, budget)`` reads as it is written.
    spec: TreeSpec = dataclasses.field(default=None, init=False)
    rule: TreeRule = dataclasses.field(default=TreeRule.DETERMINISTIC, init=False)
    top_k: int = 4
    depth: int = 4
    budget: int = 16

    def __post_init__(self):
        check_dynamic_tree(self.rule, self.top_k, self.depth, self.budget)

    def propose_tree(self, params, cache, ctx, key) -> TreeProposal:
        root_logits, cache = self._catch_up(params, cache, ctx.seq, ctx.seq_len)
        pend = ctx.seq_len - 1

        def expand(d, f_tok, f_par, f_dep, carry):
            # Every frontier slot in one call (later levels are placeholders that see only the root and
            # themselves, so they cannot disturb earlier ones); the level-d slots' logits are read.
            logits, _ = self.model.apply(params, f_tok, pend[:, None] + f_dep, cache, frontier_mask(f_par))
            k = self.top_k
            return logits[:, (d - 1) * k : d * k], carry

        tokens, parent, depth, valid = grow_dynamic_tree(root_logits, expand, None, self.top_k, self.depth, self.budget)
        q = jnp.zeros(tokens.shape + (1,), jnp.float32)  # unused by the DETERMINISTIC rule
        return TreeProposal(tokens, q, parent, depth, valid, cache)
