"""Candidate trees: lossless verification under each rule, greedy equivalence, masks and commits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_core import (
    DIST_SLOTS,
    DRAFT,
    DRAFT_PARAMS,
    GROUPS,
    N_PER_GROUP,
    PROMPT,
    PROMPTS,
    TARGET,
    TARGET_PARAMS,
    TARGET_TABLE,
)
from toy_models import MisreportedQ, chi2_critical, chi_square, exact_sequence_distribution, grouped_rows

from jspec import decode as dec
from jspec.drafters import DraftContext, DynamicTreeDrafter, TreeModelDrafter
from jspec.ngram import NgramTreeDrafter
from jspec.serve import engine_slots
from jspec.tree import TreeRule, TreeSpec, ancestor_mask, children_table, verify_tree, verify_tree_greedy
from jspec.validate import tree_scratch

SPEC = TreeSpec((2, 2, 1))  # 1 + 2 + 4 + 4 = 11 nodes, depth 3


def test_tree_spec_shapes():
    parent, depth, _ = SPEC.arrays
    assert parent.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert TreeSpec((3, 2, 2), budget=6).num_nodes == 6
    with pytest.raises(ValueError, match="branching"):
        TreeSpec((2, 0))
    assert TreeSpec((2, 1), budget=5).num_nodes == 5  # 1 + 2 + 2: the whole tree
    with pytest.raises(ValueError, match=r"budget 6 is larger than the tree: \(2, 1\) has 5 nodes"):
        TreeSpec((2, 1), budget=6)  # a budget is never clamped silently


def test_tree_settings_that_would_fail_far_away_or_lose_losslessness_are_refused():
    # An unknown rule drew children without replacement but verified them as iid draws (lossy); now refused.
    for rule in ("without_replacement", 3, True, 1.0):
        with pytest.raises(ValueError, match="rule must be a jspec.tree.TreeRule"):
            TreeModelDrafter(DRAFT, SPEC, rule)
    assert TreeModelDrafter(DRAFT, SPEC, 2).rule is TreeRule.WITHOUT_REPLACEMENT
    with pytest.raises(TypeError, match="TreeSpec"):
        TreeModelDrafter(DRAFT, (2, 1))
    # Counts must be integers: a float passed the range checks and failed at trace time, a list in hashing.
    with pytest.raises(ValueError, match=r"a branching count must be an integer, got 2.5"):
        TreeSpec((2.5,))
    with pytest.raises(ValueError, match="a tree budget must be an integer"):
        TreeSpec((2, 1), budget=4.0)
    with pytest.raises(ValueError, match="branching must be a non-empty tuple"):
        TreeSpec(3)
    assert TreeSpec([2, np.int64(1)]) == TreeSpec((2, 1))  # stored as a tuple of ints: hashable
    assert TreeSpec(np.asarray([2, 1])) == TreeSpec((2, 1))
    with pytest.raises(ValueError, match="a branching count must be an integer, got 2.5"):
        TreeSpec(np.asarray([2.5, 1]))
    with pytest.raises(ValueError, match="branching must be a non-empty tuple"):
        TreeSpec(np.asarray([[2, 1]]))
    hash(TreeSpec([2, 1]))
    with pytest.raises(ValueError, match="top_k must be an integer"):
        DynamicTreeDrafter(DRAFT, 2.0, 2, 4)
    for flag in ("block_verify", "debug_checks"):  # a truthy "no" switched the feature on
        with pytest.raises(ValueError, match=f"{flag} must be True or False"):
            dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, drafter=DRAFT, draft_params=DRAFT_PARAMS, **{flag: "no"})


def test_ancestor_mask_and_children():
    parent = jnp.asarray(SPEC.arrays[0])[None]
    mask = np.asarray(ancestor_mask(parent))[0]
    # Independent: walk parents in Python.
    par = SPEC.arrays[0]
    for i in range(len(par)):
        anc, j = {i}, i
        while par[j] >= 0:
            j = par[j]
            anc.add(j)
        assert set(np.nonzero(mask[i])[0].tolist()) == anc
    kids = np.asarray(children_table(parent, jnp.ones_like(parent, bool), 2))[0]
    assert kids[0].tolist() == [1, 2] and kids[3].tolist() == [7, -1] and kids[10].tolist() == [-1, -1]


@pytest.mark.fast
@pytest.mark.parametrize("rule", list(TreeRule))
def test_greedy_tree_verification_fast_path(rule):
    """``verify_tree_greedy`` (token ids only) equals ``verify_tree`` on one-hot p under every rule, and a plain
    Python walk: accept the first valid child whose token is the parent's argmax, emit the argmax where the
    walk stops. 256 random rows on SPEC; a 4-token vocabulary makes matches, duplicate siblings and invalid
    subtrees common."""
    rng = np.random.default_rng(int(rule))
    b, v = 256, 4
    parent_np, _, _ = SPEC.arrays
    n = len(parent_np)
    tokens = rng.integers(0, v, (b, n))
    best = rng.integers(0, v, (b, n))
    own = rng.random((b, n)) < 0.85
    valid = np.ones((b, n), bool)
    for i in range(1, n):
        valid[:, i] = own[:, i] & valid[:, parent_np[i]]
    q = rng.random((b, n, v)) + 0.05
    q /= q.sum(-1, keepdims=True)
    parent = np.broadcast_to(parent_np, (b, n))
    args = (jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(valid))
    fast = verify_tree_greedy(jnp.asarray(best), *args, SPEC.max_depth, SPEC.max_children)
    p = jnp.asarray(np.eye(v, dtype=np.float32)[best])
    u = jnp.asarray(rng.random((b, SPEC.max_depth, SPEC.max_children)), jnp.float32)
    ref = verify_tree(p, jnp.asarray(q, jnp.float32), *args, rule, SPEC.max_depth, SPEC.max_children, u,
                      jnp.asarray(rng.random(b), jnp.float32))  # fmt: skip
    for name in ("path", "n_accepted", "next_token", "accepted_depth"):
        np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(ref, name)), err_msg=name)
    for r in range(b):
        cur, walked = 0, [0]
        while True:
            kids = [i for i in range(n) if parent_np[i] == cur and valid[r, i] and tokens[r, i] == best[r, cur]]
            if not kids:
                break
            cur = kids[0]
            walked.append(cur)
        assert int(fast.n_accepted[r]) == len(walked) - 1
        assert np.asarray(fast.path[r, : len(walked)]).tolist() == walked
        assert int(fast.next_token[r]) == best[r, cur]
    assert 0 < int(jnp.sum(fast.n_accepted > 0)) < b  # both outcomes occur


# Greedy rounds verify with verify_tree_greedy whatever the rule (test_greedy_tree_verification_fast_path shows
# it equals verify_tree under each rule, duplicate and invalid siblings included), so one rule decodes here.
@pytest.mark.fast
@pytest.mark.parametrize("rule", [TreeRule.DETERMINISTIC])
def test_greedy_tree_equals_greedy_plain(rule):
    plain = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=20)
    tree = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=TreeModelDrafter(DRAFT, SPEC, rule),
        goodput=False,
        draft_params=DRAFT_PARAMS,
        max_new_tokens=20,
    )
    assert tree.tokens == plain.tokens
    assert tree.stats["tokens_per_round"] > 1.0


DRAFTERS = {
    "static-deterministic": TreeModelDrafter(DRAFT, SPEC, TreeRule.DETERMINISTIC),
    "static-iid": TreeModelDrafter(DRAFT, SPEC, TreeRule.IID),
    "static-without-replacement": TreeModelDrafter(DRAFT, SPEC, TreeRule.WITHOUT_REPLACEMENT),
    "dynamic": DynamicTreeDrafter(DRAFT, top_k=2, depth=3, budget=6),
    "ngram-branches": NgramTreeDrafter(2, 3, vocab_size=3),
}


def test_dynamic_tree_greedy_equals_plain_and_shapes_differ_per_row():
    plain = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=20)
    tree = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTERS["dynamic"],
        goodput=False,
        draft_params=DRAFT_PARAMS,
        max_new_tokens=20,
    )
    assert tree.tokens == plain.tokens and tree.stats["tokens_per_round"] > 1.5
    # The proposals of a few rounds, stepped as the loop does: each row's tree follows the draft's own
    # cumulative probabilities, so the parent arrays (the shapes) differ between rows.
    drafter = DRAFTERS["dynamic"]
    prepared = dec.prepare(
        TARGET, TARGET_PARAMS, PROMPTS, drafter=drafter, goodput=False, draft_params=DRAFT_PARAMS, max_new_tokens=20
    )
    pre, step = dec._stream_fns(TARGET, drafter, prepared.config)
    st, shapes = pre(*prepared.args), set()
    for r in range(3):
        ctx = DraftContext(st.seq, st.seq_len, jnp.full((len(PROMPTS),), drafter.max_depth), st.sampling)
        prop = drafter.propose_tree(DRAFT_PARAMS, st.draft_state, ctx, jax.random.key(r))
        shapes |= {tuple(p) for p in np.asarray(prop.parent).tolist()}
        st = step(TARGET_PARAMS, DRAFT_PARAMS, st)[0]
    assert len(shapes) > 1, shapes
    with pytest.raises(ValueError, match="budget"):
        DynamicTreeDrafter(DRAFT, top_k=2, depth=2, budget=8)
    # Positional arguments are top_k, depth, budget as the README writes them (spec and rule are not arguments).
    assert DynamicTreeDrafter(DRAFT, 2, 3, 6) == DRAFTERS["dynamic"]


def test_dynamic_tree_frontier_fits_the_reserved_cache():
    """A dynamic tree runs all depth * top_k frontier slots (here 3 * 2 = 6) through the draft's cache, one more
    than its budget - 1 = 5 verified nodes: with only 5 reserved, a row at the end of a 128-slot cache lost its
    last frontier entry (a dropped write), so which nodes it kept depended on the cache size (on the other rows,
    through the default max_len). The reserve now covers the frontier; a static tree's stays its nodes."""
    d = DRAFTERS["dynamic"]
    assert tree_scratch(d) == 3 * 2 and tree_scratch(DRAFTERS["static-iid"]) == SPEC.num_nodes - 1
    assert tree_scratch(DynamicTreeDrafter(DRAFT, top_k=2, depth=2, budget=6)) == 5  # budget - 1 > 2 * 2
    p, n = len(PROMPT), 128 - len(PROMPT) - 6 + 1  # P + N - 1 + 6 = 128: no slack at all
    slots = dec.prepare(
        TARGET, TARGET_PARAMS, [PROMPT], drafter=d, goodput=False, draft_params=DRAFT_PARAMS, max_new_tokens=n
    )
    assert slots.config.slots == 128 and p + n - 1 + 6 <= slots.config.slots
    bigger = dec.prepare(
        TARGET, TARGET_PARAMS, [PROMPT], drafter=d, goodput=False, draft_params=DRAFT_PARAMS, max_new_tokens=n + 1
    )
    assert bigger.config.slots == 256  # one more token and the reserve no longer fits 128
    assert engine_slots(TARGET, d, 64) == 64 + 6  # the serving engine reserves the same


TREE_GROUPS = [GROUPS[0], GROUPS[3]]  # T 0.7 with top-k, T 1.3 with top-p
TREE_NEW = 5


def _tree_statistics(name, drafter, n=N_PER_GROUP):
    """n sampled sequences per group in one decode -> (stats, [(statistic, critical value)])."""
    prompts, cols = grouped_rows(PROMPT, TREE_GROUPS, n)
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        prompts,
        drafter=drafter,
        goodput=False,
        draft_params=DRAFT_PARAMS,
        max_new_tokens=TREE_NEW,
        max_len=DIST_SLOTS,
        seed=31 + len(name),
        **cols,
    )
    tokens = np.asarray(out.tokens)
    checks = []
    for i, g in enumerate(TREE_GROUPS):
        exact = exact_sequence_distribution(TARGET_TABLE, PROMPT, TREE_NEW, **g)
        stat, df = chi_square(tokens[i * n : (i + 1) * n], exact)
        checks.append((stat, chi2_critical(df)))
    return out.stats, checks


# The static DETERMINISTIC tree is left out: its rule never reads q, and the dynamic and n-gram trees sample
# that rule's verification (with per-row shapes, which a static tree does not have).
@pytest.mark.parametrize("name", [n for n in DRAFTERS if n != "static-deterministic"])
def test_tree_whole_sequence_distribution(name):
    """Static trees under the rules that read q, and dynamic trees: >= 100k sampled sequences per setting,
    chi-square."""
    stats, checks = _tree_statistics(name, DRAFTERS[name])
    assert stats["tokens_per_round"] > 1.1  # trees really accepted paths (stats are per round)
    for g, (stat, critical) in zip(TREE_GROUPS, checks):
        assert stat < critical, (name, g, stat, critical)


@pytest.mark.parametrize("name", ["static-iid", "static-without-replacement"])
def test_tree_distribution_check_has_power(name):
    """The rules that read q (IID: accept with min(1, p / q), then the residual; without replacement: q
    renormalised after each rejected sibling), with q misreported by 10%, seed and statistic as above but a
    quarter of the rows: every group is still rejected, so the test above (4x the rows) would catch a rule
    whose q bookkeeping is that far off."""
    _, checks = _tree_statistics(name, MisreportedQ(DRAFTERS[name], 0.9), n=N_PER_GROUP // 4)
    for g, (stat, critical) in zip(TREE_GROUPS, checks):
        assert stat > critical, (name, g, stat, critical)


@pytest.mark.fast
def test_tree_target_cache_equals_fresh_prefill():
    """Accepted paths are moved from scratch slots into committed slots; nothing of a rejected branch stays."""
    prepared = dec.prepare(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=TreeModelDrafter(DRAFT, SPEC, TreeRule.IID),
        goodput=False,
        draft_params=DRAFT_PARAMS,
        max_new_tokens=15,
        temperature=1.3,
        seed=2,
    )
    st = prepared.fn(*prepared.args)
    seq, lengths = np.asarray(st.seq), np.asarray(st.cache.lengths)
    assert int(st.stats.accepted.sum()) > 0
    for b in range(len(PROMPTS)):
        n = int(lengths[b])
        fresh = TARGET.init_cache(1, prepared.config.slots)
        _, fresh = TARGET.apply(TARGET_PARAMS, jnp.asarray(seq[b : b + 1, :n]), jnp.arange(n)[None], fresh)
        np.testing.assert_array_equal(np.asarray(st.cache.k)[:, b, :, :n], np.asarray(fresh.k)[:, 0, :, :n])


def test_ngram_tree_continuations_and_decoding():
    from jspec.ngram import ngram_continuations

    # History "1 2 3 | 1 2 4 | 1 2 3 5 | 1 2": suffix [1, 2] was followed by 3 (most recent), then 4.
    seq = jnp.asarray([[1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2, 0, 0]])
    toks, n = ngram_continuations(seq, jnp.asarray([12]), 3, 3, 2, 1)
    assert np.asarray(n).tolist() == [[3, 3, 0]]
    assert np.asarray(toks)[0, :2].tolist() == [[3, 5, 1], [4, 1, 2]]
    # Greedy tree decoding with n-gram branches equals plain decoding; sampled decoding is checked by the
    # distribution tests of the tree verifier (the same DETERMINISTIC rule).
    prompts = [[0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 2, 2, 1, 2], [1, 0, 1, 0, 1]]
    plain = dec.decode(TARGET, TARGET_PARAMS, prompts, max_new_tokens=16)
    tree = dec.decode(
        TARGET, TARGET_PARAMS, prompts, drafter=NgramTreeDrafter(3, 4, vocab_size=3), goodput=False, max_new_tokens=16
    )
    assert tree.tokens == plain.tokens
