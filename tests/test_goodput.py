"""Goodput-driven draft length (``jspec.goodput``) and its measured costs (``jspec.costs``): the choice is the seed's
expected tokens per unit of measured cost, every K of the set (and switching between them mid-sequence) keeps the
target's distribution, greedy output is plain decoding's, and a cost table is used only where it was measured."""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_core import (
    DIST_SLOTS,
    DRAFT,
    DRAFT_PARAMS,
    DRAFTER,
    GROUPS,
    N_PER_GROUP,
    PROMPT,
    PROMPTS,
    TARGET,
    TARGET_PARAMS,
    TARGET_TABLE,
    VOCAB,
)
from toy_models import chi2_critical, chi_square, exact_sequence_distribution, grouped_rows

from jspec import decode as dec
from jspec import goodput
from jspec.costs import CostKey, CostTable, context_of, cost_table
from jspec.drafters import TreeModelDrafter
from jspec.goodput import GoodputK
from jspec.loop import decode_round, prefill
from jspec.ngram import NgramDrafter
from jspec.state import StopReason, to_output
from jspec.tree import TreeRule, TreeSpec


def _ema(rates, weight=10.0):
    """(accepted, tested) moving sums whose estimate is each row's rate."""
    return jnp.asarray([[a * weight, weight] for a in rates], jnp.float32)


@pytest.mark.fast
def test_the_choice_maximises_expected_tokens_per_unit_of_cost():
    """Worked by hand: two running rows at a = 0.5 expect 1, 1.5, 1.75 and 1.9375 tokens at K = 0, 1, 2, 4; at
    costs 1, 1.1, 1.3, 2 the batch's tokens per unit of cost are 2, 2.727, 2.692, 1.9375: K = 1. A stopped row
    counts for nothing, whatever its estimate; with no running row the plain step (the first K) is chosen."""
    policy = GoodputK((0, 1, 2, 4), (1.0, 1.1, 1.3, 2.0), margin=0.0)
    both = np.ones(2, bool)
    assert int(goodput.choose(policy, _ema([0.5, 0.5]), both)) == 1
    # A row at 0.95 alone: 1, 1.95, 2.8525, 4.524 per 1, 1.1, 1.3, 2 -> 2.26 at K = 4 beats 2.19 at K = 2.
    assert int(goodput.choose(policy, _ema([0.95, 0.0]), np.array([True, False]))) == 3
    assert int(goodput.choose(policy, _ema([0.0, 0.95]), np.array([True, False]))) == 0
    assert int(goodput.choose(policy, _ema([0.9, 0.9]), np.zeros(2, bool))) == 0
    # Expensive verification (a large batch on a small CPU): nothing pays over a plain step.
    assert int(goodput.choose(GoodputK((0, 1, 2, 4), (1.0, 2.0, 3.0, 5.0)), _ema([0.6, 0.6]), both)) == 0


@pytest.mark.fast
def test_a_wide_round_must_beat_a_plain_step_by_the_margin():
    """Worked by hand, costs 1 and 1.1 at K = 0 and 1, two rows: at a = 0.15 the batch expects 2 tokens at K = 0
    and 2.3 at K = 1, 2.09 per unit of cost, so K = 1 without a margin; with the default margin 0.1 the round at
    K = 1 costs 1.21 (1.90 per unit) and K = 0 wins. At a = 0.25, 2.5 / 1.21 = 2.07 > 2: K = 1 still pays. The
    makespan objective is raised alike: a row with 10 tokens to go at a = 0.15 needs 10 / 1.15 = 8.70 rounds at
    K = 1, 9.57 units at cost 1.1 (K = 1) and 10.52 at 1.21 (K = 0: 10)."""
    both = np.ones(2, bool)
    assert GoodputK((0, 1), (1.0, 1.1)).margin == 0.1
    for objective in ("throughput", "makespan"):
        remaining = jnp.asarray([10, 10], jnp.int32)
        plain = GoodputK((0, 1), (1.0, 1.1), objective=objective, margin=0.0)
        assert int(goodput.choose(plain, _ema([0.15, 0.15]), both, remaining)) == 1
        margin = GoodputK((0, 1), (1.0, 1.1), objective=objective)
        assert int(goodput.choose(margin, _ema([0.15, 0.15]), both, remaining)) == 0
        assert int(goodput.choose(margin, _ema([0.25, 0.25]), both, remaining)) == 1
    with pytest.raises(ValueError, match=r"GoodputK.margin must be a number in \[0, 1\]"):
        GoodputK((0, 1), (1.0, 1.1), margin=-0.1)


@pytest.mark.fast
def test_an_idle_rows_estimate_drifts_to_its_own_past_and_that_to_the_prior():
    """By hand, one round of four rows (beta 0.7, beta_long 0.95, drift 0.05, drift_long 0.005, prior 0.6): a row
    that tested 2 accepted of 3 moves both pairs of sums; a lookup that missed (1 tried, 0 accepted) is a failed
    test; an idle running row's short estimate 0.1 moves 0.05 of the way to its long one 0.3 (0.11, weight 2 kept)
    and the long one 0.005 of the way to the prior (0.3015, weight 10 kept); a stopped row keeps its sums."""
    policy = GoodputK((0, 1), (1.0, 1.1))
    ema = jnp.asarray([[0.2, 2.0, 3.0, 10.0]] * 4, jnp.float32)
    got = goodput.update(
        policy, ema, jnp.asarray([2, 0, 0, 0]), jnp.asarray([4, 1, 0, 4]), jnp.asarray([True, True, True, False])
    )
    want = [
        [0.7 * 0.2 + 0.3 * 2, 0.7 * 2 + 0.3 * 3, 0.95 * 3 + 0.05 * 2, 0.95 * 10 + 0.05 * 3],
        [0.7 * 0.2, 0.7 * 2 + 0.3 * 1, 0.95 * 3, 0.95 * 10 + 0.05 * 1],
        [0.11 * 2, 2.0, 0.3015 * 10, 10.0],
        [0.2, 2.0, 3.0, 10.0],
    ]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    # A batch that stopped speculating: a row whose tests all failed stays under the 0.12 that a K = 1 round at
    # 1.12 plain steps needs for as long as its long estimate takes to climb from 0 to 0.12 at 0.005 a round
    # (ln 0.8 / ln 0.995 = 44.5 rounds; the short one lags behind it), while a row that accepted 0.5 of its tests
    # is back over it in six rounds (0.025, 0.049, 0.071, 0.093, 0.113, 0.133): it probes again soon, the first
    # only now and then.
    failed, accepted = [0.0, 1.0, 0.0, 10.0], [0.0, 1.0, 5.0, 10.0]  # its short estimate at 0 after one miss
    ema = jnp.asarray([failed, accepted], jnp.float32)
    idle = jnp.zeros(2, jnp.int32)
    crossed = []
    for _ in range(44):
        ema = goodput.update(policy, ema, idle, idle, jnp.ones(2, bool))
        crossed.append(np.asarray(ema[:, 0] / ema[:, 1]) >= 0.12)
    crossed = np.asarray(crossed)
    assert not crossed[:, 0].any() and crossed[:, 1].argmax() == 5


@pytest.mark.fast
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(ks=(0, 2, 1), costs=(1, 1, 1)), "increasing without repeats"),
        (dict(ks=(0, 1), costs=(1.0,)), "2 draft lengths but 1 costs"),
        (dict(ks=(0, 1), costs=(1.0, float("nan"))), "costs must be finite numbers > 0"),
        (dict(ks=(0, 1), costs=(1.0, 0.0)), "costs must be finite numbers > 0"),
        (dict(ks=(-1, 1), costs=(1.0, 1.0)), "ks must be ints >= 0"),
        (dict(ks=(0, 1), costs=(1.0, 1.0), beta=1.0), "beta must be a number in"),
        (dict(ks=(0, 1), costs=(1.0, 1.0), beta_long=1.0), "beta_long must be a number in"),
        (dict(ks=(0, 1), costs=(1.0, 1.0), drift_long=-0.1), "drift_long must be a number in"),
    ],
)
def test_bad_policies_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        GoodputK(**kw)


@pytest.mark.fast
def test_a_policy_must_fit_its_drafter_and_excludes_a_fixed_k():
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, max_new_tokens=4)
    cases = [
        (dict(gamma=4, goodput=True), "which a fixed gamma"),
        (dict(adaptive=True, goodput=True), "which an adaptive policy"),
        (dict(gamma=2, goodput=GoodputK((0, 2), (1.0, 1.2))), "excludes a fixed gamma and an adaptive policy"),
        (dict(goodput="yes"), "goodput must be None, True, False, a CostTable or a GoodputK"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, **kw, **extra)
    with pytest.raises(ValueError, match="needs a drafter"):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=4, goodput=True)
    # A policy's largest K is the loop's K.
    assert dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, **kw, goodput=GoodputK((0, 2), (1.0, 1.2))).config.gamma == 2
    tree = TreeModelDrafter(DRAFT, TreeSpec((2, 1)))
    with pytest.raises(ValueError, match=r"goodput set is \(0, 2\)"):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, **dict(kw, drafter=tree), goodput=GoodputK((0, 1, 2), (1, 1, 1)))


@pytest.mark.fast
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_every_k_of_the_set_and_switching_mid_sequence_keep_the_targets_distribution(tree):
    """The rounds are forced through the set in turn (a chain: K = 3, 0, 1, 3, 0, ...; a sampled tree: the tree,
    a plain step, the tree, ...: every K, a switch every round), on >= 100k sampled sequences per sampling group;
    the whole-sequence distribution must be the target's (chi-square at a 1e-5 false-alarm level, as
    test_decode_core's fixed-K test)."""
    n, n_new, groups = N_PER_GROUP, 6, [GROUPS[0], GROUPS[3]]
    if tree:
        drafter, policy, schedule = (
            TreeModelDrafter(DRAFT, TreeSpec((2, 1)), TreeRule.IID),
            GoodputK((0, 2), (1, 1)),
            (1, 0),
        )
    else:
        drafter, policy, schedule = DRAFTER, GoodputK((0, 1, 3), (1.0, 1.0, 1.0)), (2, 0, 1)
    prompts, cols = grouped_rows(PROMPT, groups, n)
    prepared = dec.prepare(
        TARGET, TARGET_PARAMS, prompts, drafter=drafter, draft_params=DRAFT_PARAMS, goodput=policy,
        max_new_tokens=n_new, max_len=DIST_SLOTS, seed=211, **cols,
    )  # fmt: skip
    pre = jax.jit(functools.partial(prefill, TARGET, drafter, prepared.config))
    rnd = jax.jit(functools.partial(decode_round, TARGET, drafter, prepared.config))
    st, r = pre(*prepared.args), 0
    while np.any(np.asarray(st.stop) == StopReason.RUNNING):
        st = rnd(TARGET_PARAMS, DRAFT_PARAMS, st, jnp.int32(schedule[r % len(schedule)]))[0]
        r += 1
    out = to_output(st)
    assert all(c > 0 for c in out.stats["k_rounds"]) and r >= len(schedule)  # every K ran
    assert 0.3 < out.stats["acceptance_rate"] < 0.95  # both accepted and rejected drafts
    tokens = np.asarray(out.tokens)
    for i, g in enumerate(groups):
        exact = exact_sequence_distribution(TARGET_TABLE, PROMPT, n_new, **g)
        stat, df = chi_square(tokens[i * n : (i + 1) * n], exact)
        assert stat < chi2_critical(df), (g, stat, df)


@pytest.mark.fast
@pytest.mark.measures_costs
def test_greedy_goodput_decoding_is_plain_decoding(tmp_path, monkeypatch):
    """The default (goodput=None) on a chain, a prompt lookup and a tree: the costs are measured (and cached), the
    loop chooses K round by round, and the tokens are plain greedy decoding's. goodput=True reads the same table."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    plain = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=20)
    for drafter in (DRAFTER, NgramDrafter(vocab_size=VOCAB), TreeModelDrafter(DRAFT, TreeSpec((2, 1)))):
        kw = dict(drafter=drafter, draft_params=DRAFT_PARAMS, max_new_tokens=20)
        prepared = dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, **kw)
        assert prepared.config.goodput.ks == ((0, 2) if drafter.is_tree else (0, 1, 2, 4))
        assert dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, **kw, goodput=True).config == prepared.config
        out = prepared.run()
        assert out.tokens == plain.tokens, drafter
        assert sum(out.stats["k_rounds"]) == max(out.stats["rounds"]), drafter
    tables = [json.loads(f.read_text()) for f in (tmp_path / "costs").glob("*.json")]
    assert len(tables) == 3  # one table per situation, kept
    # Measured at the rows' mean context over the decode (prompt + half the budget), in steps of 128 tokens.
    want = context_of(np.mean([len(p) + 20 / 2 for p in PROMPTS]), prepared.config.slots)
    assert want == min(128, prepared.config.slots) and all(t["key"]["context"] == want for t in tables)


@pytest.mark.fast
def test_the_default_is_a_fixed_k_wherever_something_fixes_k_or_the_costs_cannot_be_measured(monkeypatch):
    """goodput=None measures a policy only for a drafter that can change K, with no gamma or adaptive policy, on
    concrete parameters in a single process (``measurable``); everywhere else it is the fixed K, as False is."""
    from jspec.costs import measurable

    kw = dict(draft_params=DRAFT_PARAMS, max_new_tokens=4)
    for extra in (dict(gamma=4), dict(adaptive=True), dict(goodput=False)):
        config = dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, drafter=DRAFTER, **kw, **extra).config
        assert config.goodput is None and config.gamma == 4, extra
    assert dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=4).config.goodput is None  # no drafter
    base = dict(gamma=4, gamma_given=False, adaptive=None, slots=128)
    assert measurable(DRAFTER, TARGET_PARAMS, DRAFT_PARAMS, **base)
    # The profile's prompts (>= 8 tokens) and 4 calls of 4 rounds at K = 4 need 8 + 64 + 2 = 74 slots.
    assert measurable(DRAFTER, TARGET_PARAMS, DRAFT_PARAMS, **dict(base, slots=74))
    assert not measurable(DRAFTER, TARGET_PARAMS, DRAFT_PARAMS, **dict(base, slots=73))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), TARGET_PARAMS)
    assert not measurable(DRAFTER, abstract, DRAFT_PARAMS, **base)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not measurable(DRAFTER, TARGET_PARAMS, DRAFT_PARAMS, **base)


def test_the_context_of_a_table_is_the_nearest_step_within_the_cache():
    assert [context_of(t, 1024) for t in (0, 10, 191, 192, 700, 2000)] == [128, 128, 128, 256, 640, 1024]
    assert context_of(300, 200) == 200


def test_a_cost_table_is_used_only_where_it_was_measured(tmp_path):
    """Another device, model, layout or shape set is refused by name; the same situation is accepted."""
    b, slots, ks = len(PROMPTS), 128, (0, 1, 2, 4)
    context = context_of(np.mean([len(p) + 20 / 2 for p in PROMPTS]), slots)  # as decode's, below
    key = CostKey.of(TARGET, TARGET_PARAMS, DRAFTER, DRAFT_PARAMS, b, slots, ks, context)
    table = CostTable(key, (1.0, 1.05, 1.1, 1.3), 8, plain_ms=1.0)
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, max_new_tokens=20, max_len=slots)
    # decode's batch ends with its last row: the table's costs under the makespan objective.
    got = dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, goodput=table, **kw).config.goodput
    assert got == table.policy(objective="makespan")
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), TARGET_PARAMS)
    for change, field in (
        (dict(device="tpu:TPU v5 lite x8"), "device"),
        (dict(model="other"), "model"),
        (dict(params=CostKey.of(TARGET, bf16, DRAFTER, DRAFT_PARAMS, b, slots, ks, context).params), "params"),
        (dict(batch=8), "batch"),
        (dict(slots=256), "slots"),
        (dict(context=context + 128), "context"),
    ):
        other = CostTable(dataclasses.replace(key, **change), table.round_ms, 8, plain_ms=1.0)
        with pytest.raises(ValueError, match=f"measured for another {field}"):
            dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, goodput=other, **kw)


@pytest.mark.measures_costs
def test_the_disk_cache_is_read_back_and_a_corrupt_file_is_measured_again(tmp_path):
    kw = dict(batch=2, slots=64, ks=(0, 1, 2), context=64, directory=str(tmp_path))
    first = cost_table(TARGET, TARGET_PARAMS, DRAFTER, DRAFT_PARAMS, **kw)
    # Each cost is a round's time over plain decoding's step, timed beside them.
    assert all(ms > 0 for ms in first.round_ms) and first.plain_ms > 0
    assert first.relative == tuple(ms / first.plain_ms for ms in first.round_ms)
    (path,) = tmp_path.glob("*.json")
    assert cost_table(TARGET, TARGET_PARAMS, DRAFTER, DRAFT_PARAMS, **kw) == first  # read, not measured
    path.write_text("{ not json")
    with pytest.warns(UserWarning, match="unusable"):
        again = cost_table(TARGET, TARGET_PARAMS, DRAFTER, DRAFT_PARAMS, **kw)
    assert again.key == first.key and json.loads(path.read_text())["round_ms"] == list(again.round_ms)
    report = again.report()
    assert all(f"K={k} " in report for k in (0, 1, 2)) and "batch 2, 64 slots, context 64" in report
    assert f"plain {again.plain_ms:8.2f} ms" in report


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_serving_engine_chooses_k_each_round_and_keeps_greedy_output(tree):
    """An engine with a goodput policy (a chain's K, or a plain step or the tree) serves every request with plain
    greedy decoding's tokens, and counts each round at the K it chose."""
    from test_serve import BUDGETS, REQUESTS, _serve

    from jspec.serve import Engine

    alone = [dec.decode(TARGET, TARGET_PARAMS, [r], max_new_tokens=m).tokens[0] for r, m in zip(REQUESTS, BUDGETS)]
    drafter = TreeModelDrafter(DRAFT, TreeSpec((2, 1))) if tree else DRAFTER
    # Costs under which the rows' acceptance makes the choice switch between K = 0 and K > 0.
    policy = GoodputK((0, 2), (1.0, 1.75)) if tree else GoodputK((0, 1, 2, 4), (1.0, 1.3, 1.6, 2.2))
    engine = Engine(TARGET, TARGET_PARAMS, batch=2, max_len=64, drafter=drafter, draft_params=DRAFT_PARAMS,
                    goodput=policy)  # fmt: skip
    assert engine.config.goodput == policy
    assert _serve(engine) == alone
    k_rounds = np.asarray(engine.state.stats.k_rounds)
    assert int(np.sum(k_rounds)) == int(engine.state.stats.loop_rounds) > 0
    assert k_rounds[0] > 0 and k_rounds[1:].sum() > 0  # plain steps and wider rounds both ran


@pytest.mark.fast
def test_a_fixed_batch_is_as_fast_as_its_last_row():
    """makespan: the batch ends with its last row. Worked by hand with costs 1, 1.1, 1.3, 2 at K = 0, 1, 2, 4: a
    row that never accepts (a = 0) with 100 tokens to go needs 100 rounds at any K, so K = 0 (100 units) beats
    every K > 0, however well another row accepts; at a = 0.5 it needs 100, 66.7, 57.1 and 51.6 rounds, 100, 73.3,
    74.3 and 103.2 units: K = 1. Throughput counts the good row's tokens: 2, 2.99, 3.97 and 5.90 for both rows,
    per unit of cost 2, 2.72, 3.05 and 2.95: K = 2."""
    costs = (1.0, 1.1, 1.3, 2.0)
    fixed = GoodputK((0, 1, 2, 4), costs, objective="makespan", margin=0.0)
    both, remaining = np.ones(2, bool), jnp.asarray([10, 100], jnp.int32)
    assert int(goodput.choose(fixed, _ema([0.99, 0.0]), both, remaining)) == 0
    assert int(goodput.choose(fixed, _ema([0.99, 0.5]), both, remaining)) == 1
    assert int(goodput.choose(GoodputK((0, 1, 2, 4), costs, margin=0.0), _ema([0.99, 0.0]), both)) == 2
    with pytest.raises(ValueError, match="objective must be one of throughput, makespan"):
        GoodputK((0, 1), (1.0, 1.1), objective="latency")


def _unconditional_ops(hlo: str) -> set[str]:
    """The op kinds a compiled module runs whatever its branches do: those of the entry computation and of every
    computation it calls (fusions, reductions), not of the while loops' bodies and conditions."""
    from sharding.hlo import parse

    entry, comps = parse(hlo)
    ops, todo, seen = set(), [entry], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            if "=" not in line:
                continue
            rhs = line.split("=", 1)[1].strip()
            if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
                depths = np.cumsum([{"(": 1, ")": -1}.get(ch, 0) for ch in rhs])
                rest = rhs[int(np.argmax(depths == 0)) + 1 :].strip()
            elif " " in rhs:
                rest = rhs.split(" ", 1)[1]
            else:
                continue
            op = rest.split("(", 1)[0]
            ops.add(op)
            if op != "while":
                todo += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line)
    return ops


@pytest.mark.fast
def test_no_branch_of_a_round_runs_untaken():
    """XLA moves loop-invariant work out of while loops, and a round's branches are loops of 0 or 1 trips
    (``jspec.rounds.switch_in_place``): without the operands' barrier, the K = 2 step's prompt lookup (a cond) ran
    every round, K = 0 chosen or not, and on SmolLM2 with the CPU kernels also its embedding and first projection
    (4-6 ms of a 45 ms round at batch 8). In the compiled goodput round of a tiny transformer, no cond and no
    matrix product may run outside the loops."""
    from models.llama import LlamaConfig, init_random_params, make_model

    cfg = LlamaConfig(vocab_size=64, hidden=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12, ffn=96)
    model, params = make_model(cfg), init_random_params(cfg, jax.random.key(0))
    policy = GoodputK((0, 2), (1.0, 1.0))
    drafter = NgramDrafter(vocab_size=cfg.vocab_size)
    prepared = dec.prepare(model, params, [[1, 2, 3, 1, 2]] * 2, drafter=drafter, goodput=policy, max_new_tokens=8)
    st = jax.jit(functools.partial(prefill, model, drafter, prepared.config))(*prepared.args)
    rnd = jax.jit(functools.partial(decode_round, model, drafter, prepared.config))
    hlo = rnd.lower(params, None, st, jnp.int32(0)).compile().as_text()
    ops = _unconditional_ops(hlo)
    assert "while" in ops and "add" in ops, sorted(ops)  # the parse found the entry's work
    assert not {"conditional", "dot", "convolution", "custom-call"} & ops, sorted(ops)
