"""EAGLE-2 dynamic trees from the EAGLE head (models.eagle.EagleDynamicTreeDrafter): the proposed trees equal a
NumPy EAGLE-2 growth over the training computation, greedy output equals plain, bad shapes are refused. Its
children are chosen deterministically (q is never read), so its sampled verification is test_tree.py's
``[dynamic]`` distribution case. A file of its own so ``pytest -n 2 --dist loadfile``
can run it beside tests/test_eagle.py, whose helpers it uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle import (
    PROMPTS,
    TINY_MODEL,
    TINY_PARAMS,
    _path_tokens,
    _reference_features,
    _rollout_head,
    random_head,
)

from jspec import decode as dec
from jspec.decode import decode, prepare
from jspec.drafters import DraftContext
from jspec.state import to_output
from jspec.tree import TreeRule
from models.eagle import EagleDrafter, EagleDynamicTreeDrafter, head_unrolled, subset_logits


def _reference_dynamic_tree(logq_at, top_k: int, depth: int, budget: int) -> set[tuple[int, ...]]:
    """EAGLE-2's growth written out on paths (NumPy): ``logq_at(paths) -> [M, N]`` log-probabilities over the
    head's N tokens of the children of the node reached by each path (a tuple of indices into those N tokens,
    () = the root). Each level expands the top_k
    children of each of the top_k frontier paths by cumulative log-probability (stable: the earlier one first
    on ties), the pool keeps every expanded child, and the tree is the budget - 1 best-scored candidates whose
    parent was expanded. Returns the selected paths."""
    pool = {}  # path -> score, insertion-ordered (parents before children)
    frontier = [((), 0.0)]
    expanded = {()}
    for d in range(depth):
        lq = logq_at([p for p, _ in frontier])
        kids = []
        for (path, score), row in zip(frontier, lq):
            for tok in np.argsort(-row, kind="stable")[:top_k]:
                kids.append((path + (int(tok),), score + float(row[tok])))
        for path, score in kids:
            pool[path] = score
        if d == 0:
            frontier = kids
        else:
            order = np.argsort([-sc for _, sc in kids], kind="stable")[:top_k]
            frontier = [kids[i] for i in order]
        expanded |= {p for p, _ in frontier}
    usable = [(p, sc) for p, sc in pool.items() if p[:-1] in expanded]
    order = np.argsort([-sc for _, sc in usable], kind="stable")[: budget - 1]
    return {usable[i][0] for i in order}


@pytest.mark.parametrize("top_k,depth,budget,head", [(2, 3, 6, "near-identity"), (3, 3, 9, "random")])
def test_dynamic_tree_is_eagle2_growth_on_the_training_computation(top_k, depth, budget, head):
    """Greedy dynamic-tree rounds stepped from Python, and before each, ``propose_tree`` on the round's own
    state. The reference grows the tree in NumPy (``_reference_dynamic_tree``) from ``head_unrolled`` on the
    committed prefix plus each candidate's own path (pass d at pair pend - 1 + d, features past the committed
    ones noise): a node seeing a sibling, a wrong feature or position, or scratch from an earlier round changes
    the scores and so the selected set. Both must select the same paths in every row and round; the rounds'
    accepted drafts must be a path of the proposed tree, the shapes must differ between rows, and the rounds,
    stepped on to the end, must give plain greedy decoding's output. The near-identity head is accepted often
    (paths of 2+ drafts are checked); the random one makes the selection sensitive to any error in a node's
    inputs."""
    ecfg, hp = _rollout_head()
    if head == "random":
        hp = random_head(ecfg, TINY_PARAMS, 9, 0.3, np.asarray(hp["token_ids"]))
    drafter = EagleDynamicTreeDrafter(ecfg, top_k=top_k, depth=depth, budget=budget)
    assert drafter.max_draft == depth and drafter.max_children == budget - 1
    dparams = drafter.draft_params(TINY_PARAMS, hp)
    b = len(PROMPTS)
    prepared = prepare(TINY_MODEL, TINY_PARAMS, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=40)
    pre, step = dec._stream_fns(TINY_MODEL, drafter, prepared.config)
    propose = jax.jit(drafter.propose_tree)
    st = pre(*prepared.args)
    recs, accepted, shapes = [], [], set()
    for r in range(6):
        assert np.all(np.asarray(st.stop) == dec.StopReason.RUNNING)
        ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), depth, jnp.int32), st.sampling)
        prop = propose(dparams, st.draft_state, ctx, jax.random.key(r))
        pend = np.asarray(st.seq_len) - 1
        st, emitted, n_emit = step(TINY_PARAMS, dparams, st)
        toks, par, valid = np.asarray(prop.tokens), np.asarray(prop.parent), np.asarray(prop.valid)
        n_acc = np.asarray(n_emit) - 1
        trees = []
        for row in range(b):
            assert valid[row].all()
            paths = {tuple(_path_tokens(toks[row], par[row], i)) for i in range(1, budget)}
            assert len(paths) == budget - 1  # distinct nodes
            assert n_acc[row] == 0 or tuple(np.asarray(emitted)[row, : n_acc[row]].tolist()) in paths
            trees.append(paths)
            shapes.add(tuple(par[row].tolist()))
        accepted.append(n_acc)
        recs.append((pend, trees))
    assert len(shapes) > 1, shapes  # the tree's shape follows the head, row by row
    accepted = np.stack(accepted)
    assert head == "random" or (accepted >= 2).any(), accepted

    seq, w, fresh, noise = _reference_features(st, recs, depth)
    run = jax.jit(head_unrolled, static_argnums=(0, 5))
    ids = np.asarray(hp["token_ids"])
    for pend, trees in recs:
        for row in range(b):
            p = pend[row]

            def logq_at(paths, p=p, row=row):
                xs = [
                    np.concatenate([seq[row, : p + 1], ids[list(path)], np.zeros(w, np.int32)])[1 : w + 1]
                    for path in paths
                ]
                f = np.where(np.arange(w)[:, None] < p, fresh[row, :w], noise[:w])
                passes = run(
                    ecfg, hp, TINY_PARAMS, jnp.asarray(np.stack([f] * len(paths))), jnp.asarray(np.stack(xs)), depth
                )
                d = len(paths[0])
                logits = subset_logits(jnp.asarray(passes)[d, :, p - 1 + d][:, None], dparams[1]["rows"])[:, 0]
                return np.asarray(jax.nn.log_softmax(logits, axis=-1))

            ref = _reference_dynamic_tree(logq_at, top_k, depth, budget)
            assert {tuple(ids.searchsorted(t) for t in path) for path in trees[row]} == ref, (row, p)
    # The rest of the decode on the same compiled round (the fused loop is a while_loop over this round; it runs
    # this drafter on SmolLM2 in tests/test_real_model_decode.py's CLI test).
    while np.any(np.asarray(st.stop) == dec.StopReason.RUNNING):
        st, _, _ = step(TINY_PARAMS, dparams, st)
    out = to_output(st)
    plain = decode(TINY_MODEL, TINY_PARAMS, PROMPTS, max_new_tokens=40)
    assert out.tokens == plain.tokens and out.stats["accepted"] < out.stats["proposed"]
    assert head == "random" or out.stats["accepted"] > 0


def test_dynamic_tree_refuses_what_it_cannot_build():
    ecfg, _ = _rollout_head()
    with pytest.raises(ValueError, match=r"budget must be in \[2, 7\] for top_k=2, depth=2, got 8"):
        EagleDynamicTreeDrafter(ecfg, top_k=2, depth=2, budget=8)
    with pytest.raises(ValueError, match="top_k >= 1 and depth >= 1"):
        EagleDrafter(ecfg).as_dynamic_tree(0, 2, 2)
    with pytest.raises(ValueError, match="deterministically"):
        EagleDynamicTreeDrafter(ecfg, rule=TreeRule.IID)
    with pytest.raises(TypeError, match="max_draft"):  # depth sets it
        EagleDynamicTreeDrafter(ecfg, max_draft=6, top_k=2, depth=2, budget=4)
    assert EagleDynamicTreeDrafter(ecfg, top_k=2, depth=3, budget=5).max_draft == 3
