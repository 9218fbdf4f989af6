"""Per-request seeds: with one key per row, a row's tokens depend on its own prompt, sampling settings and seed
only, not on its row, on the other rows or on the batch size, and the sampled distribution is still the
target's."""

import dataclasses

import jax
import numpy as np
import pytest
from test_decode_core import (
    DIST_SLOTS,
    DRAFT_PARAMS,
    DRAFTER,
    GROUPS,
    N_PER_GROUP,
    PROMPT,
    TARGET,
    TARGET_PARAMS,
    TARGET_TABLE,
)
from test_serve import BUDGETS, REQUESTS
from test_tree import DRAFTERS as TREE_DRAFTERS
from toy_models import chi2_critical, chi_square, exact_sequence_distribution, grouped_rows

from jspec import decode as dec
from jspec.serve import Engine

ROWS = [[2, 0, 1], [1, 1], [0, 2, 2, 1, 0]]
SEEDS = [11, 12, 13]
ROW_SAMPLING = dict(temperature=[1.0, 1.3, 0.8], top_k=[0, 2, 0], top_p=[1.0, 1.0, 0.9], max_new_tokens=[9, 7, 8])
SPEC_DRAFTERS = {
    "plain": None,
    "chain": DRAFTER,
    "tree-iid": TREE_DRAFTERS["static-iid"],
    "tree-without-replacement": TREE_DRAFTERS["static-without-replacement"],
}


def _decode(drafter, rows, seeds, order=None):
    order = list(range(len(ROWS))) if order is None else order
    kw = {k: [v[i] for i in order] for k, v in ROW_SAMPLING.items()}
    if drafter is not None:
        # A fixed K: goodput's K, chosen for the batch, would make a row's draws depend on its neighbours.
        kw.update(
            drafter=drafter, draft_params=DRAFT_PARAMS if getattr(drafter, "vocab_size", 3) else None, goodput=False
        )
    return dec.decode(TARGET, TARGET_PARAMS, [rows[i] for i in order], seed=[seeds[i] for i in order], max_len=32, **kw)


# tree-iid: in test_a_tree_row_does_not_depend_on_the_cache_the_other_rows_size (the suite's time); the n-gram
# drafter draws nothing, and its rounds verify with the chain's keys (the "chain" case).
@pytest.mark.parametrize("name", [n for n in SPEC_DRAFTERS if n != "tree-iid"])
def test_a_row_follows_its_own_seed(name):
    """Each row decoded alone (batch 1), and the batch in another row order, give the same tokens per request."""
    drafter = SPEC_DRAFTERS[name]
    together = _decode(drafter, ROWS, SEEDS)
    for i in range(len(ROWS)):
        assert _decode(drafter, ROWS, SEEDS, order=[i]).tokens == [together.tokens[i]], (name, i)
    permuted = _decode(drafter, ROWS, SEEDS, order=[2, 0, 1])
    assert permuted.tokens == [together.tokens[i] for i in (2, 0, 1)], name
    # Not vacuous: other seeds sample other tokens, and the drafters' proposals were accepted.
    assert _decode(drafter, ROWS, [21, 22, 23]).tokens != together.tokens
    if drafter is not None:
        assert together.stats["accepted"] > 0


def test_one_seed_for_the_batch_is_not_per_row():
    """The contrast that makes the test above meaningful: with one key for the whole batch, a row's draws come
    from its position in the batch's draws, so the same request alone samples differently."""
    kw = dict(temperature=1.0, max_new_tokens=8, max_len=32, drafter=DRAFTER, draft_params=DRAFT_PARAMS, goodput=False)
    together = dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=5, **kw).tokens
    alone = [dec.decode(TARGET, TARGET_PARAMS, [r], seed=5, **kw).tokens[0] for r in ROWS]
    assert together != alone


@pytest.mark.parametrize("name", ["chain", "tree-without-replacement"])  # uniforms; Gumbel noise for the tree
def test_per_row_keys_keep_the_target_distribution(name):
    """>= 100k sampled sequences, each row with its own key (a [B] key array), against the exact sequence
    distribution of the target table; chi-square at a 1e-5 false-alarm level, as the one-key tests in
    test_decode_core / test_tree (which run every sampling setting; the keys are what this test is about, so one
    setting each: T 0.7 with top-k for the chain, T 1.3 with top-p for the tree)."""
    groups, n, n_new = [GROUPS[0] if name == "chain" else GROUPS[3]], N_PER_GROUP, 5
    prompts, cols = grouped_rows(PROMPT, groups, n)
    drafter = DRAFTER if name == "chain" else TREE_DRAFTERS[name.replace("tree", "static")]
    keys = jax.random.split(jax.random.key(2024), len(prompts))
    kw = dict(gamma=3) if name == "chain" else {}
    out = dec.decode(
        TARGET, TARGET_PARAMS, prompts, drafter=drafter, goodput=False, draft_params=DRAFT_PARAMS, max_new_tokens=n_new,
        max_len=DIST_SLOTS, key=keys, **kw, **cols,
    )  # fmt: skip
    tokens = np.asarray(out.tokens)
    if name == "chain":
        assert 0.3 < out.stats["acceptance_rate"] < 0.95  # both branches of the acceptance rule ran
    else:
        assert out.stats["tokens_per_round"] > 1.1  # paths of the trees were accepted
    for i, g in enumerate(groups):
        exact = exact_sequence_distribution(TARGET_TABLE, PROMPT, n_new, **g)
        stat, df = chi_square(tokens[i * n : (i + 1) * n], exact)
        assert stat < chi2_critical(df), (name, g, stat, df)


# Request i samples with SETTINGS[i % 3] (top-k, top-p and min-p each reach the engine's own add()).
SETTINGS = [dict(temperature=1.0, top_k=2), dict(temperature=1.3, top_p=0.8), dict(temperature=1.3, min_p=0.3)]


def _serve(engine, order, seeds):
    """Requests in ``order``, admitted as rows free up; request i samples with SETTINGS[i % 3] and seeds[i]."""
    out, queue, owner = {}, list(order), {}
    while queue or owner:
        for row in engine.free_rows():
            owner.pop(row, None)
            while queue:
                i = queue.pop(0)
                owner[row] = i
                out[i] = [engine.add(row, REQUESTS[i], BUDGETS[i], seed=seeds[i], **SETTINGS[i % 3])]
                if engine.stop_reason(row) == dec.StopReason.RUNNING:
                    break
        owner = {r: i for r, i in owner.items() if engine.stop_reason(r) == dec.StopReason.RUNNING}
        if not owner:
            continue
        for row, toks in engine.step().items():
            out[owner[row]] += toks
    return [out[i] for i in range(len(REQUESTS))]


def test_engine_requests_follow_their_seed():
    """Served in a batch-2 engine in two admission orders (other rows, other start rounds), every sampled
    request gives the tokens ``decode`` gives it alone with the same seed and sampling settings; also with
    block verification."""
    seeds = [100 + i for i in range(len(REQUESTS))]
    for block in (False, True):
        kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3, block_verify=block)
        alone = [
            dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m, seed=[s], **SETTINGS[i % 3], **kw).tokens[0]
            for i, (r, m, s) in enumerate(zip(REQUESTS, BUDGETS, seeds))
        ]
        engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, **kw)
        assert _serve(engine, range(len(REQUESTS)), seeds) == alone
        if not block:
            assert _serve(engine, reversed(range(len(REQUESTS))), seeds) == alone
    with pytest.raises(ValueError, match="seed must be in"):
        engine.add(0, [1, 2], 3, temperature=1.0, seed=-1)
    assert 0 in engine.free_rows()  # the refused request left its row free


def test_seed_lists_and_key_arrays_are_checked():
    kw = dict(max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match=r"seed must be one int or a list of 3 \(one per row\)"):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=[1, 2], **kw)
    with pytest.raises(ValueError, match=r"seed must be one int or a list of 3"):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=[[1, 2, 3]], **kw)
    with pytest.raises(ValueError, match="seed must be an int"):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=[1, 2.5, 3], **kw)
    with pytest.raises(ValueError, match=r"seed must be in \[0, "):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=[1, -2, 3], **kw)
    with pytest.raises(ValueError, match=r"one per row \(shape \(3,\)\), got \(2,\)"):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, key=jax.random.split(jax.random.key(0), 2), **kw)
    with pytest.raises(ValueError, match=r"raw uint32 key data \[2\] / \[B, 2\] with B = 3"):
        dec.decode(TARGET, TARGET_PARAMS, ROWS, key=np.zeros((2, 2), np.uint32), **kw)
    # Seeds, typed per-row keys and their raw data name the same streams.
    keys = jax.numpy.stack([jax.random.key(s) for s in SEEDS])
    by_seed = dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=SEEDS, **kw).tokens
    assert dec.decode(TARGET, TARGET_PARAMS, ROWS, key=keys, **kw).tokens == by_seed
    assert dec.decode(TARGET, TARGET_PARAMS, ROWS, key=jax.random.key_data(keys), **kw).tokens == by_seed
    assert dec.decode(TARGET, TARGET_PARAMS, ROWS, seed=np.asarray(SEEDS), **kw).tokens == by_seed


@pytest.mark.parametrize("tree", [False])  # the chain draws per step; a dynamic tree's children are its top-k
def test_eagle_rows_follow_their_own_seed(tree):
    """The EAGLE head draws through the same per-row keys: each request alone gives the tokens it gets in the
    batch. A 4-layer random Llama target, so the rows meet in real batched matmuls."""
    from test_eagle import PROMPTS, TINY_MODEL, TINY_PARAMS, _rollout_head

    from models.eagle import EagleDrafter

    ecfg, hp = _rollout_head()
    chain = EagleDrafter(ecfg, max_draft=3)
    drafter = chain.as_dynamic_tree(top_k=2, depth=3, budget=6) if tree else chain
    kw = dict(drafter=drafter, draft_params=chain.draft_params(TINY_PARAMS, hp), max_len=48, temperature=1.0)
    if not tree:
        kw["gamma"] = 3
    seeds, budgets = [3, 4, 5], [12, 9, 10]
    together = dec.decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=budgets, seed=seeds, **kw)
    for i, p in enumerate(PROMPTS):
        alone = dec.decode(TINY_MODEL, TINY_PARAMS, [p], max_new_tokens=budgets[i], seed=[seeds[i]], **kw)
        assert alone.tokens == [together.tokens[i]], i
    assert together.stats["accepted"] > 0


@pytest.mark.parametrize("name", ["tree-iid"])  # without replacement: test_a_row_follows_its_own_seed
def test_a_tree_row_does_not_depend_on_the_cache_the_other_rows_size(name):
    """A 100-token prompt with 28 new tokens alone gets a 256-slot cache (P + N - 1 and the tree's 10 scratch
    slots, rounded up to 128; it was 128 before the reservation); next to a row that needs 360 slots, 384. A
    tree's last rounds must verify the same nodes either way (the nodes that fit the row's own slots), or the
    sampled tokens follow the batch."""
    drafter = SPEC_DRAFTERS[name]
    rng = np.random.default_rng(7)
    long_row = rng.integers(0, 3, 100).tolist()
    other = rng.integers(0, 3, 300).tolist()
    kw = dict(drafter=drafter, draft_params=DRAFT_PARAMS, temperature=1.0, goodput=False)
    # The default cache reserves the tree's scratch past P + N - 1: 127 + 10 slots -> 256 (a chain: 128).
    assert dec.prepare(TARGET, TARGET_PARAMS, [long_row], max_new_tokens=28, **kw).config.slots == 256
    chain = dict(kw, drafter=DRAFTER)
    assert dec.prepare(TARGET, TARGET_PARAMS, [long_row], max_new_tokens=28, **chain).config.slots == 128
    for seed in range(6):
        alone = dec.decode(TARGET, TARGET_PARAMS, [long_row], max_new_tokens=28, seed=[seed], **kw)
        both = dec.decode(TARGET, TARGET_PARAMS, [long_row, other], max_new_tokens=[28, 51], seed=[seed, 99], **kw)
        assert alone.tokens[0] == both.tokens[0], seed


def test_engine_and_decode_cap_a_trees_scratch_at_the_context_length():
    """The engine keeps a tree's scratch past max_len, as decode's default does (without it, a request filling
    the cache verified fewer nodes in its last rounds than alone, and gave other tokens for the same seed).
    Next to the model's context length no scratch slot may hold a node (its position would run past it):
    decode's default and the engine both cap the cache there, so a sampled tree request that ends at the last
    position still follows its seed alike (the engine used to keep max_len + its scratch, decode 64). A NumPy
    budget of a dynamic tree is a tree's node count like an int."""
    drafter = TREE_DRAFTERS["static-without-replacement"]
    short = dataclasses.replace(TARGET, max_positions=64)
    prompt = np.random.default_rng(4).integers(0, 3, 40).tolist()
    kw = dict(drafter=drafter, draft_params=DRAFT_PARAMS, temperature=1.0, goodput=False)
    assert dec.prepare(short, TARGET_PARAMS, [prompt], max_new_tokens=25, **kw).config.slots == 64
    engine = Engine(
        short, TARGET_PARAMS, batch=1, max_len=64, drafter=drafter, goodput=False, draft_params=DRAFT_PARAMS
    )
    assert engine.config.slots == 64
    reserve = drafter.nodes - 1  # the scratch an engine without a context length keeps
    unbounded = Engine(
        TARGET, TARGET_PARAMS, batch=1, max_len=64, drafter=drafter, goodput=False, draft_params=DRAFT_PARAMS
    )
    assert unbounded.config.slots == 64 + reserve
    for seed in range(2):  # seed 1 differed when the engine kept the scratch
        alone = dec.decode(short, TARGET_PARAMS, [prompt], max_new_tokens=25, seed=[seed], **kw).tokens[0]
        got = [engine.add(0, prompt, 25, temperature=1.0, seed=seed)]
        while engine.stop_reason(0) == dec.StopReason.RUNNING:
            got += engine.step().get(0, [])
        assert got == alone, seed
    dyn = TREE_DRAFTERS["dynamic"]
    assert dataclasses.replace(dyn, budget=np.int64(dyn.budget)).nodes == dyn.nodes > 1
