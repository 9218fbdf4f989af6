"""Candidate trees: several continuations share prefixes and ONE target call verifies all of them.

Nodes are stored in topological order (every parent before its children); node 0 is the root, the pending
token. A tree is described per row by ``parent`` [B, N] (-1 for the root), ``depth`` [B, N] and ``valid``
[B, N] (a node that was not proposed is never accepted), so static trees (one shape for every row) and
dynamic trees (EAGLE-2 style, a different shape per row) go through the same code.

The target sees node i at slot ``committed + i`` and position ``committed + depth[i]``, and attends to the
committed context and to i's ancestors only (``ancestor_mask``): never to a sibling. Verification walks
from the root: at each node its children are tried in turn with the rule that matches how they were
drawn, the first accepted child becomes the next node, and when every child is rejected the token comes
from the final residual. Exactly one root-to-node path is committed; its cache entries are moved from
their scratch slots into consecutive committed slots (``KVCache.commit(n, path)``).

Rules (``TreeRule``):
- DETERMINISTIC: children chosen without randomness (top-c of the draft, n-gram continuations). Each child
  is a one-hot proposal: accept x with probability p'(x); on rejection p' <- norm(p' with x removed).
- IID: children drawn independently from the node's draft distribution q (SpecInfer's multi-round
  rejection sampling): accept x with min(1, p'(x)/q(x)); on rejection p' <- norm(max(0, p' - q)), q kept.
- WITHOUT_REPLACEMENT: children drawn from q without replacement (Gumbel top-c): accept with
  min(1, p'(x)/q'(x)); on rejection p' <- norm(max(0, p' - q')) and q' <- norm(q' with x removed).
Under greedy decoding p is one-hot and every rule accepts the longest path that matches the target's argmax.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from jspec.sampling import distribution, sample_from


class TreeRule(enum.IntEnum):
    DETERMINISTIC = 0
    IID = 1
    WITHOUT_REPLACEMENT = 2


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A static tree shape: ``branching[d]`` children per node at depth d (depth 0 = root).

    ``TreeSpec((3, 2, 1, 1))`` is 1 root, 3 children, 6 grandchildren, then two single-child levels:
    1 + 3 + 6 + 6 + 6 = 22 nodes. ``budget`` keeps only the first N nodes in breadth-first order (the most
    likely ones when children are ranked), so trees can be compared at an equal verification budget.
    """

    branching: tuple[int, ...]
    budget: int | None = None

    def __post_init__(self):
        if not self.branching or any(int(c) < 1 for c in self.branching):
            raise ValueError(f"branching must be a non-empty tuple of counts >= 1, got {self.branching}")
        if self.budget is not None and self.budget < 2:
            raise ValueError(f"a tree budget counts the root: it must be >= 2, got {self.budget}")

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parent [N], depth [N], child_rank [N]) in breadth-first order."""
        parent, depth, rank = [-1], [0], [0]
        frontier = [0]
        for d, c in enumerate(self.branching):
            nxt = []
            for node in frontier:
                for r in range(c):
                    parent.append(node)
                    depth.append(d + 1)
                    rank.append(r)
                    nxt.append(len(parent) - 1)
            frontier = nxt
        n = len(parent) if self.budget is None else min(self.budget, len(parent))
        return np.array(parent[:n]), np.array(depth[:n]), np.array(rank[:n])

    @property
    def num_nodes(self) -> int:
        return len(self.arrays[0])

    @property
    def max_depth(self) -> int:
        return int(self.arrays[1].max())

    @property
    def max_children(self) -> int:
        return max(self.branching)

    @classmethod
    def chain(cls, k: int) -> TreeSpec:
        return cls((1,) * k)


def ancestor_mask(parent: jax.Array) -> jax.Array:
    """parent [B, N] (-1 = root) in topological order -> [B, N, N] bool, node i sees node j iff j is i or an
    ancestor of i."""
    b, n = parent.shape
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    rows = jnp.arange(b)[:, None]

    def step(mask, i):
        par = parent[:, i]  # [B]
        inherited = mask[rows[:, 0], jnp.maximum(par, 0)] & (par >= 0)[:, None]  # [B, N]
        return mask.at[:, i].set(mask[:, i] | inherited), None

    mask, _ = jax.lax.scan(step, eye, jnp.arange(n))
    return mask


def children_table(parent: jax.Array, valid: jax.Array, max_children: int) -> jax.Array:
    """[B, N] parents -> [B, N, C] child indices of each node in index order, -1 padded. Invalid nodes are
    not listed (a node is listed only if it and its whole path are valid: validity is ancestor-closed)."""
    b, n = parent.shape
    is_child = (parent[:, None, :] == jnp.arange(n)[None, :, None]) & valid[:, None, :]  # [B, node, m]
    rank = jnp.cumsum(is_child, axis=2) - 1
    slots = jnp.arange(max_children)[None, None, :, None]
    hit = is_child[:, :, None, :] & (rank[:, :, None, :] == slots)  # [B, node, C, m]
    idx = jnp.sum(jnp.where(hit, jnp.arange(n)[None, None, None, :], 0), axis=3)
    return jnp.where(jnp.any(hit, axis=3), idx, -1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeResult:
    """path: [B, D+1] node indices of the accepted path (path[:, 0] = root; entries past n_accepted = 0).
    n_accepted: [B] accepted nodes below the root. next_token: [B] correction or bonus token.
    accepted_depth: [B, D] bool, a node was accepted at depth d+1."""

    path: jax.Array
    n_accepted: jax.Array
    next_token: jax.Array
    accepted_depth: jax.Array


def _remove(dist: jax.Array, x: jax.Array) -> jax.Array:
    """Zero token x of dist [B, V] and renormalise (left unnormalised-zero if nothing remains)."""
    out = dist * (1.0 - jax.nn.one_hot(x, dist.shape[-1], dtype=dist.dtype))
    mass = jnp.sum(out, axis=-1, keepdims=True)
    return jnp.where(mass > 0, out / jnp.where(mass > 0, mass, 1.0), out)


def _norm_pos(x: jax.Array) -> jax.Array:
    r = jnp.maximum(x, 0.0)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), r)


def verify_tree(
    p: jax.Array,  # [B, N, V] target distribution at each node (for that node's children)
    q: jax.Array,  # [B, N, V] draft distribution each node's children were drawn from (unused: DETERMINISTIC)
    tokens: jax.Array,  # [B, N] node tokens (tokens[:, 0] = pending root)
    parent: jax.Array,  # [B, N]
    valid: jax.Array,  # [B, N] bool, ancestor-closed
    rule: TreeRule,
    max_depth: int,
    max_children: int,
    u_accept: jax.Array,  # [B, D, C] uniforms
    u_final: jax.Array,  # [B]
) -> TreeResult:
    b, n, v = p.shape
    rows = jnp.arange(b)
    children = children_table(parent, valid, max_children)
    cur = jnp.zeros((b,), jnp.int32)
    p_res = p[:, 0]
    q_res = q[:, 0]
    done = jnp.zeros((b,), bool)
    path = [cur]
    acc_depth = []
    for d in range(max_depth):
        ch = children[rows, cur]  # [B, C]
        nxt = jnp.full((b,), -1, jnp.int32)
        for c in range(max_children):
            node = ch[:, c]
            live = (node >= 0) & ~done & (nxt < 0)
            x = tokens[rows, jnp.maximum(node, 0)]
            px = jnp.take_along_axis(p_res, x[:, None], axis=1)[:, 0]
            u = u_accept[:, d, c]
            if rule == TreeRule.DETERMINISTIC:
                ok = u < px
                rejected = _remove(p_res, x)
            else:
                qx = jnp.take_along_axis(q_res, x[:, None], axis=1)[:, 0]
                ok = u * qx < px
                rejected = _norm_pos(p_res - q_res)
            acc = live & ok
            nxt = jnp.where(acc, node, nxt)
            rej = live & ~ok
            p_res = jnp.where(rej[:, None], rejected, p_res)
            if rule == TreeRule.WITHOUT_REPLACEMENT:
                q_res = jnp.where(rej[:, None], _remove(q_res, x), q_res)
        moved = nxt >= 0
        cur = jnp.where(moved, nxt, cur)
        p_res = jnp.where(moved[:, None], p[rows, cur], p_res)
        q_res = jnp.where(moved[:, None], q[rows, cur], q_res)
        done = done | ~moved
        path.append(jnp.where(moved, cur, 0))
        acc_depth.append(moved)
    n_acc = jnp.sum(jnp.stack(acc_depth, axis=1), axis=1).astype(jnp.int32)
    # p_res is the final residual after a rejection, or p at the last node reached (a bonus draw).
    mass = jnp.sum(p_res, axis=-1, keepdims=True)
    final = jnp.where(mass > 0, p_res, p[rows, cur])
    nxt_tok = sample_from(final, u_final)
    return TreeResult(jnp.stack(path, axis=1), n_acc, nxt_tok, jnp.stack(acc_depth, axis=1))


def verify_tree_key(key, p, q, tokens, parent, valid, rule, max_depth, max_children) -> TreeResult:
    k_acc, k_fin = jax.random.split(key)
    b = p.shape[0]
    u = jax.random.uniform(k_acc, (b, max_depth, max_children))
    return verify_tree(p, q, tokens, parent, valid, rule, max_depth, max_children, u, jax.random.uniform(k_fin, (b,)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeProposal:
    """tokens, parent, depth: [B, N] (node 0 is the root; its token is replaced by the pending token);
    q: [B, N, V] the draft distribution node i's children were drawn from; valid: [B, N] bool; state."""

    tokens: jax.Array
    q: jax.Array
    parent: jax.Array
    depth: jax.Array
    valid: jax.Array
    state: object


def _gumbel_top(key, logq: jax.Array, c: int) -> jax.Array:
    """[..., V] log-probabilities -> [..., c] tokens drawn without replacement, in draw order."""
    g = jax.random.gumbel(key, logq.shape)
    return jax.lax.top_k(logq + g, c)[1].astype(jnp.int32)


def choose_children(key, logits: jax.Array, q: jax.Array, c: int, rule: TreeRule):
    """Children for nodes with draft logits / distributions [B, M, V]: -> (tokens [B, M, c], ok [B, M, c])."""
    if rule == TreeRule.DETERMINISTIC:
        # Ranked by the raw draft logits: under greedy q is one-hot, but the runner-up guesses still help.
        return jax.lax.top_k(logits, c)[1].astype(jnp.int32), jnp.ones(logits.shape[:-1] + (c,), bool)
    if rule == TreeRule.IID:
        u = jax.random.uniform(key, q.shape[:-1] + (c,))
        cdf = jnp.cumsum(q, axis=-1)
        idx = jnp.sum(cdf[..., None, :] <= u[..., None] * cdf[..., -1:, None], axis=-1)
        idx = jnp.minimum(idx, q.shape[-1] - 1).astype(jnp.int32)
        return idx, jnp.take_along_axis(q, idx, axis=-1) > 0
    tok = _gumbel_top(key, jnp.log(q), c)
    # Without replacement, a draw exists only while q has mass left outside the earlier children.
    return tok, jnp.take_along_axis(q, tok, axis=-1) > 0


@dataclasses.dataclass(frozen=True)
class TreeModelDrafter:
    """A draft model that expands a static tree (``TreeSpec``) level by level.

    Its cache holds the committed sequence up to ``lengths``; each round first catches up on the tokens
    committed since (the accepted path and the new pending token, at most depth + 1 of them, fed as one
    block), then runs the whole tree (every non-root node, ancestor-masked) once per level. Scratch entries
    of rejected branches stay beyond ``lengths`` and are overwritten next round.
    """

    model: object  # jspec.model.Model
    spec: TreeSpec
    rule: TreeRule = TreeRule.DETERMINISTIC
    is_tree: bool = dataclasses.field(default=True, init=False)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_depth(self) -> int:
        return self.spec.max_depth

    @property
    def max_children(self) -> int:
        return self.spec.max_children

    def init(self, params, prompt, prompt_len, slots):
        b, p = prompt.shape
        cache = self.model.init_cache(b, slots)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = self.model.apply(params, prompt, positions, cache)
        return cache.with_lengths(prompt_len)

    def _catch_up(self, params, cache, seq, seq_len):
        """Feed every token from ``cache.lengths`` to the pending token; return its logits [B, V]."""
        b, w_seq = seq.shape
        rows = jnp.arange(b)
        width = self.spec.max_depth + 2
        start = cache.lengths
        idx = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        toks = seq[rows[:, None], jnp.minimum(idx, w_seq - 1)]
        logits, cache = self.model.apply(params, toks, idx, cache)
        pend = seq_len - 1
        return logits[rows, pend - start], cache.with_lengths(seq_len)

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
        keys = jax.random.split(key, self.spec.max_depth)
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
