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
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import take_rows
from jspec.sampling import gumbel, inverse_cdf, sample_from, split_keys, top_k, uniform


class TreeRule(enum.IntEnum):
    DETERMINISTIC = 0
    IID = 1
    WITHOUT_REPLACEMENT = 2


def check_rule(rule) -> TreeRule:
    """A tree drafter's rule as a TreeRule. The drafter and the verifier branch on the rule differently (an
    unknown value would draw children without replacement and verify them as iid draws: lossy), so only
    TreeRule's values are taken, and only as TreeRules or ints: True is not IID, nor 1.0."""
    if isinstance(rule, bool | np.bool_) or not isinstance(rule, int | np.integer):
        raise ValueError(f"rule must be a jspec.tree.TreeRule, got {rule!r}")
    try:
        return TreeRule(rule)
    except ValueError:
        raise ValueError(f"rule must be a jspec.tree.TreeRule, got {rule!r}") from None


def _count(name: str, value) -> int:
    """An integer count given as an int (NumPy's included, bool not): a float or a list would pass the range checks
    here and fail far away, at trace time or in the compile cache's hashing."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


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
        branching = self.branching
        if isinstance(branching, np.ndarray) and branching.ndim == 1:  # np.array([3, 1]): its entries, as ints
            branching = branching.tolist()
        if isinstance(branching, str) or not isinstance(branching, Sequence):
            raise ValueError(f"branching must be a non-empty tuple of counts >= 1, got {self.branching!r}")
        object.__setattr__(self, "branching", tuple(_count("a branching count", c) for c in branching))
        if self.budget is not None:
            object.__setattr__(self, "budget", _count("a tree budget", self.budget))
        if not self.branching or any(c < 1 for c in self.branching):
            raise ValueError(f"branching must be a non-empty tuple of counts >= 1, got {self.branching}")
        if self.budget is not None and self.budget < 2:
            raise ValueError(f"a tree budget counts the root: it must be >= 2, got {self.budget}")
        full, level = 1, 1
        for c in self.branching:  # Python ints: NumPy's int64 product wraps for wide trees
            level *= c
            full += level
        if self.budget is not None and self.budget > full:
            raise ValueError(f"budget {self.budget} is larger than the tree: {self.branching} has {full} nodes")

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parent [N], depth [N], child_rank [N]) in breadth-first order; built once, and only up to the budget
        (a budget of 64 on a 10**9-node shape builds 64 nodes)."""
        parent, depth, rank = [-1], [0], [0]
        frontier = [0]
        stop = self.budget
        for d, c in enumerate(self.branching):
            nxt = []
            for node in frontier:
                for r in range(c if stop is None else min(c, stop - len(parent))):
                    parent.append(node)
                    depth.append(d + 1)
                    rank.append(r)
                    nxt.append(len(parent) - 1)
            frontier = nxt
        out = np.array(parent), np.array(depth), np.array(rank)
        for a in out:
            a.flags.writeable = False  # shared by every caller
        return out

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
    children = children_table(parent, valid, max_children)
    cur = jnp.zeros((b,), jnp.int32)
    p_res = p[:, 0]
    q_res = q[:, 0]
    done = jnp.zeros((b,), bool)
    path = [cur]
    acc_depth = []
    for d in range(max_depth):
        ch = take_rows(children, cur)  # [B, C]
        nxt = jnp.full((b,), -1, jnp.int32)
        for c in range(max_children):
            node = ch[:, c]
            live = (node >= 0) & ~done & (nxt < 0)
            x = take_rows(tokens, jnp.maximum(node, 0))
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
        p_res = jnp.where(moved[:, None], take_rows(p, cur), p_res)
        q_res = jnp.where(moved[:, None], take_rows(q, cur), q_res)
        done = done | ~moved
        path.append(jnp.where(moved, cur, 0))
        acc_depth.append(moved)
    n_acc = jnp.sum(jnp.stack(acc_depth, axis=1), axis=1).astype(jnp.int32)
    # p_res is the final residual after a rejection, or p at the last node reached (a bonus draw).
    mass = jnp.sum(p_res, axis=-1, keepdims=True)
    final = jnp.where(mass > 0, p_res, take_rows(p, cur))
    nxt_tok = sample_from(final, u_final)
    return TreeResult(jnp.stack(path, axis=1), n_acc, nxt_tok, jnp.stack(acc_depth, axis=1))


def verify_tree_greedy(
    best: jax.Array,  # [B, N] the target's argmax at each node (for that node's children)
    tokens: jax.Array,  # [B, N]
    parent: jax.Array,  # [B, N]
    valid: jax.Array,  # [B, N] bool, ancestor-closed
    max_depth: int,
    max_children: int,
) -> TreeResult:
    """``verify_tree`` when every row is greedy (p one-hot on ``best``), for any rule: a child is accepted iff
    its token is its parent's argmax (p(x) is 1 or 0, so every rule's test u q(x) < p(x) or u < p(x) says
    exactly that), the first such child in order wins, and every residual stays one-hot on the argmax (a
    rejected x != argmax takes no mass from it), so the next token is the argmax at the last node reached.
    Works on [B, N] token ids instead of the [B, N, V] distributions: a round's acceptance no longer passes
    over V for every tried child."""
    b = tokens.shape[0]
    children = children_table(parent, valid, max_children)
    cur = jnp.zeros((b,), jnp.int32)
    done = jnp.zeros((b,), bool)
    path, acc_depth = [cur], []
    for _ in range(max_depth):
        ch = take_rows(children, cur)  # [B, C]
        want = take_rows(best, cur)  # [B]
        nxt = jnp.full((b,), -1, jnp.int32)
        for c in range(max_children):
            node = ch[:, c]
            hit = (node >= 0) & ~done & (nxt < 0) & (take_rows(tokens, jnp.maximum(node, 0)) == want)
            nxt = jnp.where(hit, node, nxt)
        moved = nxt >= 0
        cur = jnp.where(moved, nxt, cur)
        done = done | ~moved
        path.append(jnp.where(moved, cur, 0))
        acc_depth.append(moved)
    acc = jnp.stack(acc_depth, axis=1)
    n_acc = jnp.sum(acc, axis=1).astype(jnp.int32)
    return TreeResult(jnp.stack(path, axis=1), n_acc, take_rows(best, cur).astype(jnp.int32), acc)


def verify_tree_key(key, p, q, tokens, parent, valid, rule, max_depth, max_children) -> TreeResult:
    k_acc, k_fin = split_keys(key, 2)
    b = p.shape[0]
    u = uniform(k_acc, (b, max_depth, max_children))
    return verify_tree(p, q, tokens, parent, valid, rule, max_depth, max_children, u, uniform(k_fin, (b,)))


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
    g = gumbel(key, logq.shape)
    return top_k(logq + g, c)[1]


def choose_children(key, logits: jax.Array, q: jax.Array, c: int, rule: TreeRule):
    """Children for nodes with draft logits / distributions [B, M, V]: -> (tokens [B, M, c], ok [B, M, c])."""
    if rule == TreeRule.DETERMINISTIC:
        # Ranked by the raw draft logits: under greedy q is one-hot, but the runner-up guesses still help.
        return top_k(logits, c)[1], jnp.ones(logits.shape[:-1] + (c,), bool)
    if rule == TreeRule.IID:
        u = uniform(key, q.shape[:-1] + (c,))
        cdf = jnp.cumsum(q, axis=-1)
        # As ``sample_from``: never a q = 0 token (it would drop the child, and which children survive would
        # depend on the rounding of the cdf).
        idx = inverse_cdf(q[..., None, :], cdf[..., None, :], u[..., None] * cdf[..., -1:, None])
        return idx, jnp.take_along_axis(q, idx, axis=-1) > 0
    tok = _gumbel_top(key, jnp.log(q), c)
    # Without replacement, a draw exists only while q has mass left outside the earlier children.
    return tok, jnp.take_along_axis(q, tok, axis=-1) > 0


def frontier_mask(f_par: jax.Array) -> jax.Array:
    """[B, M] frontier parents (frontier indices, -1 = the root) -> [B, M, M] ancestor mask among the frontier
    slots (the root is committed context, not a slot)."""
    b = f_par.shape[0]
    full = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), jnp.where(f_par >= 0, f_par + 1, 0)], axis=1)
    return ancestor_mask(full)[:, 1:, 1:]


def check_dynamic_tree(rule, top_k: int, depth: int, budget: int) -> None:
    """Refuse a dynamic tree that ``grow_dynamic_tree`` cannot build, naming the bad value."""
    top_k, depth, budget = _count("top_k", top_k), _count("depth", depth), _count("budget", budget)
    if rule != TreeRule.DETERMINISTIC:
        raise ValueError("a dynamic tree chooses children deterministically: use TreeRule.DETERMINISTIC")
    if top_k < 1 or depth < 1:
        raise ValueError(f"a dynamic tree needs top_k >= 1 and depth >= 1, got top_k={top_k}, depth={depth}")
    pool = top_k + (depth - 1) * top_k * top_k
    if not 2 <= budget <= pool + 1:
        raise ValueError(f"budget must be in [2, {pool + 1}] for top_k={top_k}, depth={depth}, got {budget}")


def grow_dynamic_tree(root_logits, expand, carry, width: int, depth: int, budget: int):
    """EAGLE-2's tree growth, shared by every dynamic-tree drafter: each level expands the ``width`` best children
    of the ``width`` frontier nodes with the highest cumulative draft log-probability and keeps the best
    ``width`` as the next frontier; after ``depth`` levels the ``budget - 1`` best candidates overall (plus the root)
    form the tree.

    root_logits [B, N]: the draft's logits for the root's children over its N tokens. ``expand(d, f_tok, f_par,
    f_dep, carry) -> (logits [B, width, N], carry)``: the children's logits of the level-d frontier (slots
    [(d-1) k, d k), k = width, of f_tok / f_par / f_dep [B, depth * k]; f_par holds frontier indices, -1 = the root;
    later levels' slots are placeholders), for d = 1 .. depth - 1. Candidate ids index the N logits; the
    caller maps them to tokens. A candidate's score never exceeds its parent's, and parents enter the pool
    first (winning ties), so the selected set is closed under ancestors.

    Returns tokens (as indices into N; the root's is 0), parent, depth [B, budget] int32 and valid [B, budget].
    """
    k, dd, n = width, depth, budget
    b = root_logits.shape[0]
    rows = jnp.arange(b)[:, None]
    f_tok = jnp.zeros((b, dd * k), jnp.int32)
    f_par = jnp.full((b, dd * k), -1, jnp.int32)
    f_dep = jnp.broadcast_to(jnp.repeat(jnp.arange(1, dd + 1, dtype=jnp.int32), k), (b, dd * k))
    f_pool = jnp.zeros((b, dd * k), jnp.int32)  # pool index of each frontier node
    # Candidate pool: tokens, parent pool index (-1 = root), score (cumulative log-prob), depth.
    score, tok = top_k(jax.nn.log_softmax(root_logits.astype(jnp.float32), axis=-1), k)
    p_tok, p_par, p_score = [tok], [jnp.full((b, k), -1, jnp.int32)], [score]
    p_dep = [jnp.ones((b, k), jnp.int32)]
    f_tok = f_tok.at[:, :k].set(tok)
    f_pool = f_pool.at[:, :k].set(jnp.arange(k)[None, :])
    f_score = score
    pool_size = k
    for d in range(1, dd):
        lvl, carry = expand(d, f_tok, f_par, f_dep, carry)
        c_score, c_tok = top_k(jax.nn.log_softmax(lvl.astype(jnp.float32), axis=-1), k)  # [B, k, k]
        c_score = (f_score[:, :, None] + c_score).reshape(b, k * k)
        c_tok = c_tok.reshape(b, k * k)
        c_par_f = jnp.repeat(jnp.arange((d - 1) * k, d * k), k)[None, :]  # frontier index of the parent
        p_tok.append(c_tok)
        p_par.append(f_pool[rows, c_par_f])
        p_score.append(c_score)
        p_dep.append(jnp.full((b, k * k), d + 1, jnp.int32))
        best_score, best = jax.lax.top_k(c_score, k)  # next frontier
        f_tok = f_tok.at[:, d * k : (d + 1) * k].set(c_tok[rows, best])
        f_par = f_par.at[:, d * k : (d + 1) * k].set(jnp.broadcast_to(c_par_f, (b, k * k))[rows, best])
        f_pool = f_pool.at[:, d * k : (d + 1) * k].set(pool_size + best)
        f_score = best_score
        pool_size += k * k
    pool_tok = jnp.concatenate(p_tok, 1)
    pool_par = jnp.concatenate(p_par, 1)
    pool_score = jnp.concatenate(p_score, 1)
    pool_dep = jnp.concatenate(p_dep, 1)
    # Only candidates whose parent was expanded (a frontier node) can be in the tree.
    expanded = jnp.zeros((b, pool_size), bool).at[rows, f_pool].set(True)
    usable = (pool_par < 0) | expanded[rows, jnp.maximum(pool_par, 0)]
    _, sel = jax.lax.top_k(jnp.where(usable, pool_score, -jnp.inf), n - 1)
    sel = jnp.sort(sel, axis=1)  # pool order is topological
    inv = jnp.zeros((b, pool_size), jnp.int32).at[rows, sel].set(jnp.arange(1, n)[None, :])
    par_pool = pool_par[rows, sel]
    parent = jnp.concatenate(
        [jnp.full((b, 1), -1, jnp.int32), jnp.where(par_pool < 0, 0, inv[rows, jnp.maximum(par_pool, 0)])], 1
    )
    tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), pool_tok[rows, sel]], 1)
    depth_out = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), pool_dep[rows, sel]], 1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), jnp.isfinite(pool_score[rows, sel])], 1)
    return tokens, parent, depth_out, valid
