"""The decode loop on table-driven toy models: losslessness, greedy equivalence, stops, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_models import (
    MisreportedQ,
    chi2_critical,
    chi_square,
    exact_sequence_distribution,
    grouped_rows,
    make_table_model,
    random_table,
)

from jspec import decode as dec
from jspec import rounds as round_steps
from jspec.drafters import Drafter, ModelDrafter, Proposal
from jspec.state import DecodeConfig
from jspec.validate import DEFAULT_GAMMA, check_eos
from jspec.verify import verify_chain_key

VOCAB, PERIOD = 3, 4
TARGET_TABLE = random_table(0, VOCAB, PERIOD)
# The draft is a perturbed target: close enough that many proposals are accepted, different enough that
# many are rejected, so both branches of the acceptance rule are exercised.
DRAFT_TABLE = TARGET_TABLE + random_table(1, VOCAB, PERIOD) * 0.8
TARGET, TARGET_PARAMS = make_table_model(TARGET_TABLE, "target")
DRAFT, DRAFT_PARAMS = make_table_model(DRAFT_TABLE, "draft")
DRAFTER = ModelDrafter(DRAFT)

# Row groups decoded together in one call: per-row sampling parameters, both temperatures, top-k, top-p and
# min-p (0.2 drops a token in 24 of the table's 36 contexts at T 1.3; plain temperature is the n-gram and
# draft-model tests' T 1.0 group).
GROUPS = [
    dict(temperature=0.7, top_k=2),
    dict(temperature=1.3, top_k=2),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.3, min_p=0.2),
]
N_PER_GROUP = 100_000
PROMPT = [2, 0, 1]
# Cache slots for the distribution tests: the prompt, 7 new tokens and a full verification block fit (no
# draft is ever cut short by the cache end), and every [B, S] mask and the table models' parent lookup cost a
# 16th of what the default 128 slots cost at 100k+ rows.
DIST_SLOTS = 16


@pytest.mark.fast
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_whole_sequence_distribution_equals_target(gamma):
    """>= 100k sampled sequences per sampling setting, all settings in ONE jitted call, vs the exact
    sequence distribution enumerated from the target table. Chi-square at a 1e-5 false-alarm level.
    K=3 runs all five settings; K=1 and K=5 run one top-k and one top-p setting (the filters do not depend on
    K, and 500k rows of 7 tokens at K=5 took ~1 min of the suite on 2 cores)."""
    n = N_PER_GROUP
    n_new = gamma + 2  # the first token comes from prefill; then a round can use all K positions
    groups = GROUPS if gamma == 3 else [GROUPS[0], GROUPS[3]]
    prompts, cols = grouped_rows(PROMPT, groups, n)
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        prompts,
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=gamma,
        max_new_tokens=n_new,
        max_len=DIST_SLOTS,
        seed=100 + gamma,
        **cols,
    )
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (n * len(groups), n_new)
    # Not vacuous: proposals were made at every position and both accepted and rejected.
    assert 0.3 < out.stats["acceptance_rate"] < 0.95
    assert all(c > 0 for c in out.stats["proposed_at"])
    for i, g in enumerate(groups):
        exact = exact_sequence_distribution(TARGET_TABLE, PROMPT, n_new, **g)
        stat, df = chi_square(tokens[i * n : (i + 1) * n], exact)
        assert stat < chi2_critical(df), (g, stat, df)


def test_distribution_test_has_power():
    """The K=3 test's statistic and seed, with a quarter of its rows per group, reject a chain whose q is
    misreported by 10% (mixed with the uniform distribution) in a top-k and a top-p group: a subtly lossy
    verifier would be caught by the test above."""
    groups, n = [GROUPS[0], GROUPS[3]], N_PER_GROUP // 4
    prompts, cols = grouped_rows(PROMPT, groups, n)
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        prompts,
        drafter=MisreportedQ(DRAFTER, 0.9),
        draft_params=DRAFT_PARAMS,
        gamma=3,
        max_new_tokens=5,
        max_len=DIST_SLOTS,
        seed=103,
        **cols,
    )
    for i, g in enumerate(groups):
        exact = exact_sequence_distribution(TARGET_TABLE, PROMPT, 5, **g)
        stat, df = chi_square(np.asarray(out.tokens)[i * n : (i + 1) * n], exact)
        assert stat > chi2_critical(df), (g, stat, df, chi2_critical(df))


PROMPTS = [[0, 1, 2, 0, 1], [2], [1, 1, 0, 2, 2, 1, 0, 0, 1], [0, 2]]


@pytest.mark.fast
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_greedy_plain(gamma):
    plain = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=20)
    spec = dec.decode(
        TARGET, TARGET_PARAMS, PROMPTS, drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=gamma, max_new_tokens=20
    )
    assert spec.tokens == plain.tokens
    assert spec.stats["accepted"] > 0 and spec.stats["accepted"] < spec.stats["proposed"]
    # Independent reference: greedy argmax chain straight from the table.
    for prompt, got in zip(PROMPTS, plain.tokens):
        seq = list(prompt)
        for _ in range(20):
            parent = seq[-2] if len(seq) >= 2 else 0
            seq.append(int(np.argmax(TARGET_TABLE[parent, seq[-1], (len(seq) - 1) % PERIOD])))
        assert got == seq[len(prompt) :]


def test_greedy_paths_take_the_targets_own_argmax():
    """``Model.argmax`` (a kernel in models) is what the greedy paths read: plain steps, chain verification
    (wide and narrow branches) and tree verification. A deliberately different rule (argmin) shows it is
    used everywhere after the prefill (whose first token goes through ``jspec.sampling``)."""
    from jspec.drafters import TreeModelDrafter
    from jspec.ngram import NgramDrafter
    from jspec.tree import TreeRule, TreeSpec

    target = dataclasses.replace(TARGET, argmax=lambda x: jnp.argmin(x, axis=-1).astype(jnp.int32))
    want = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for i in range(12):
            parent = seq[-2] if len(seq) >= 2 else 0
            row = TARGET_TABLE[parent, seq[-1], (len(seq) - 1) % PERIOD]
            seq.append(int(np.argmax(row) if i == 0 else np.argmin(row)))
        want.append(seq[len(prompt) :])
    runs = {
        "plain": {},
        "chain": dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3),
        "ngram": dict(drafter=NgramDrafter(vocab_size=VOCAB), gamma=3),
        "tree": dict(
            drafter=TreeModelDrafter(DRAFT, TreeSpec((2, 1)), TreeRule.DETERMINISTIC),
            draft_params=DRAFT_PARAMS,
            goodput=False,
        ),
    }
    for name, kw in runs.items():
        assert dec.decode(target, TARGET_PARAMS, PROMPTS, max_new_tokens=12, **kw).tokens == want, name
    assert want != dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=12).tokens


def test_max_new_tokens_per_row_exact():
    budgets = [1, 7, 3, 12]
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=3,
        max_new_tokens=budgets,
        temperature=1.0,
        seed=1,
    )
    assert out.lengths == budgets
    assert all(r == dec.StopReason.MAX_NEW_TOKENS for r in out.stop_reason)


@pytest.mark.parametrize("gamma", [0, 3])
def test_eos_stops_row_and_nothing_follows(gamma):
    eos = 2
    ref = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=30)  # no EOS: the full greedy stream
    drafter = DRAFTER if gamma else None
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=drafter,
        draft_params=DRAFT_PARAMS,
        gamma=gamma,
        max_new_tokens=30,
        eos_ids=[eos],
    )
    for full, got, reason in zip(ref.tokens, out.tokens, out.stop_reason):
        if eos in full:
            cut = full.index(eos) + 1
            assert got == full[:cut] and reason == dec.StopReason.EOS
        else:
            assert got == full and reason == dec.StopReason.MAX_NEW_TOKENS
    assert any(r == dec.StopReason.EOS for r in out.stop_reason)


def test_an_end_token_inside_an_accepted_burst_cuts_the_burst():
    """A draft equal to the target is always accepted at greedy: every round emits K + 1 = 4 tokens, so an end
    token (EOS or a row's stop id) mostly lands inside a burst, and what follows it in the burst must go."""
    ref = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=30)
    twin = ModelDrafter(TARGET)
    kw = dict(drafter=twin, draft_params=TARGET_PARAMS, gamma=3, max_new_tokens=30)
    for stops in (dict(eos_ids=[2]), dict(stop_token_ids=[[0], [2], [0], [0]])):
        out = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, **kw, **stops)
        ends = stops.get("stop_token_ids") or [[2]] * len(PROMPTS)
        cut_inside = 0
        for full, got, end, rounds in zip(ref.tokens, out.tokens, ends, out.stats["rounds"]):
            n = next(i for i, t in enumerate(full) if t in end) + 1  # each row meets its end token in 30
            assert got == full[:n]
            cut_inside += (n - 1) % 4 != 0 and rounds == -(-(n - 1) // 4)  # a burst of 4 cut short
        assert cut_inside >= 1 and out.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("gamma", [0, 3])
def test_per_row_stop_token_ids_cut_each_row_after_its_own(gamma):
    """vLLM's stop_token_ids, per row: each row is the unstopped greedy stream cut after the first of ITS ids
    (the prefill's token included), beside an engine-wide EOS id; a row without ids runs to its budget."""
    eos = 2
    ref = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=30)
    stops = [[0], [1, 0], [], [1]]
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTER if gamma else None,
        draft_params=DRAFT_PARAMS,
        gamma=gamma,
        max_new_tokens=30,
        eos_ids=[eos] if gamma else [],
        stop_token_ids=stops,
    )
    for full, got, reason, own in zip(ref.tokens, out.tokens, out.stop_reason, stops):
        ends = set(own) | ({eos} if gamma else set())
        hits = [i for i, t in enumerate(full) if t in ends]
        if hits:
            assert got == full[: hits[0] + 1] and reason == dec.StopReason.EOS
        else:
            assert got == full and reason == dec.StopReason.MAX_NEW_TOKENS
    assert sum(r == dec.StopReason.EOS for r in out.stop_reason) >= 2
    if gamma:  # the row with no ids of its own still ends at the EOS id
        assert out.stop_reason[2] == dec.StopReason.EOS


@pytest.mark.parametrize(
    "stops, msg",
    [
        (3, r"must be a sequence of token ids, got 3: use \[3\]"),
        (np.array(2.0), "must be a sequence of token ids, got 2.0"),
        ({0, 1}, "must be a sequence of token ids"),
        ([3], r"stop_token_ids must be token ids in \[0, 3\), got \[3\]"),
        ([-1], r"in \[0, 3\), got \[-1\]"),
        ([[0], [1]], "has 2 per-row sequences for 4 rows"),
        ([0, [1]], "not a mix"),
        ([True], "stop_token_ids must be integers"),
        ([[0], [1], [2], [0.5]], r"stop_token_ids\[3\] must be integers"),
    ],
)
def test_bad_stop_token_ids_are_refused(stops, msg):
    with pytest.raises(ValueError, match=msg):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=4, stop_token_ids=stops)


def test_stop_token_ids_as_arrays_flat_or_per_row():
    def ids(stops):
        return np.asarray(dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, stop_token_ids=stops).args[5].stop_ids).tolist()

    pad = [-1, -1, -1]
    assert ids(jnp.asarray([[0], [1], [2], [0]])) == [[0, *pad], [1, *pad], [2, *pad], [0, *pad]]
    assert ids(np.asarray([2, 1])) == [[2, 1, -1, -1]] * 4
    assert ids([np.asarray([1]), (2, 0), [], jnp.asarray([0, 1, 2, 0, 1])]) == [
        [1, *pad, -1, -1, -1, -1],
        [2, 0, *pad[:2], -1, -1, -1, -1],
        [-1] * 8,
        [0, 1, 2, 0, 1, -1, -1, -1],
    ]  # five ids in the longest row: 8 slots


@pytest.mark.parametrize("gamma", [0, 3])
def test_cache_full_stops_with_reason(gamma):
    slots = 24
    drafter = DRAFTER if gamma else None
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=drafter,
        draft_params=DRAFT_PARAMS,
        gamma=gamma,
        max_new_tokens=None,
        max_len=slots,
        temperature=1.0,
        seed=3,
    )
    assert all(r == dec.StopReason.CACHE_FULL for r in out.stop_reason)
    # Every slot is used: the last token emitted is the one that no longer has a slot.
    assert out.lengths == [slots + 1 - len(p) for p in PROMPTS]


@pytest.mark.parametrize("gamma", [0, 3])
def test_cache_narrower_than_the_prompt_padding(gamma):
    """Prompts are padded to a multiple of 16 for compilation; a cache that holds the prompt and its budget
    but not that padding (an explicit max_len of 30 for 20 + 5 tokens, of 10 for 9 + the rest) still decodes
    as a roomy cache does."""
    kw = dict(drafter=DRAFTER if gamma else None, draft_params=DRAFT_PARAMS, gamma=gamma)
    prompt = [[2, 0, 1, 1] * 5]
    roomy = dec.decode(TARGET, TARGET_PARAMS, prompt, max_new_tokens=5, **kw)
    assert dec.decode(TARGET, TARGET_PARAMS, prompt, max_new_tokens=5, max_len=30, **kw).tokens == roomy.tokens
    tight = dec.decode(TARGET, TARGET_PARAMS, [[1, 2, 0] * 3], max_new_tokens=None, max_len=10, **kw)
    assert tight.lengths == [2] and tight.stop_reason == [dec.StopReason.CACHE_FULL]
    assert tight.tokens == dec.decode(TARGET, TARGET_PARAMS, [[1, 2, 0] * 3], max_new_tokens=2, **kw).tokens
    # The same budget asked for explicitly fits the same cache (P + N <= S + 1: the last token takes no slot).
    exact = dec.decode(TARGET, TARGET_PARAMS, [[1, 2, 0] * 3], max_new_tokens=2, max_len=10, **kw)
    assert exact.tokens == tight.tokens and exact.stop_reason == [dec.StopReason.MAX_NEW_TOKENS]
    with pytest.raises(ValueError, match=r"prompt 0 \(9 tokens\) \+ max_new_tokens \(3\) exceeds the cache"):
        dec.decode(TARGET, TARGET_PARAMS, [[1, 2, 0] * 3], max_new_tokens=3, max_len=10, **kw)


def test_a_stopped_sampled_row_leaves_the_batch_on_the_greedy_path(monkeypatch):
    """Row 0 samples (T=1) and ends at its first token (a budget of 1); row 1 is greedy. The sampled
    verification (its [B, K+1, V] distributions) must never run: a spy in it, which only fires when its
    branch is taken, stays silent, and row 1 decodes as plain greedy decoding does."""
    calls = []

    def spy(*args, **kw):
        jax.debug.callback(lambda: calls.append(1))
        return verify_chain_key(*args, **kw)

    monkeypatch.setattr(round_steps, "verify_chain_key", spy)
    prompts = [[2, 0, 1], [1, 1, 0, 2]]
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=2, max_len=40)  # max_len: a fresh trace
    out = dec.decode(TARGET, TARGET_PARAMS, prompts, max_new_tokens=[1, 12], temperature=[1.0, 0.0], **kw)
    assert out.lengths == [1, 12] and out.stats["proposed"] > 0
    assert out.tokens[1] == dec.decode(TARGET, TARGET_PARAMS, prompts[1:], max_new_tokens=12).tokens[0]
    assert calls == []
    # Not vacuous: with row 0 still running, the same spy fires.
    dec.decode(TARGET, TARGET_PARAMS, prompts, max_new_tokens=[12, 12], temperature=[1.0, 0.0], **kw)
    assert calls


@pytest.mark.fast
def test_target_cache_equals_fresh_prefill():
    """After generation the committed cache holds exactly what a fresh prefill of the final sequence
    computes: no rejected candidate leaked into a committed slot."""
    prepared = dec.prepare(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=3,
        max_new_tokens=15,
        temperature=1.3,
        seed=5,
    )
    slots = prepared.config.slots
    st = prepared.fn(*prepared.args)  # the raw final DecodeState
    seq, seq_len, lengths = np.asarray(st.seq), np.asarray(st.seq_len), np.asarray(st.cache.lengths)
    assert np.all(lengths == seq_len - 1)
    assert int(st.stats.accepted.sum()) < int(st.stats.proposed.sum())  # rejections happened
    for b in range(len(PROMPTS)):
        n = int(lengths[b])
        fresh = TARGET.init_cache(1, slots)
        _, fresh = TARGET.apply(TARGET_PARAMS, jnp.asarray(seq[b : b + 1, :n]), jnp.arange(n)[None], fresh)
        np.testing.assert_array_equal(np.asarray(st.cache.k)[:, b, :, :n], np.asarray(fresh.k)[:, 0, :, :n])


def test_streaming_yields_the_fused_tokens():
    kw = dict(
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=3,
        max_new_tokens=[9, 4, 12, 6],
        temperature=1.3,
        top_p=0.9,
        seed=11,
        eos_ids=[2],
    )
    fused = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, **kw)
    chunks = list(dec.decode_stream(TARGET, TARGET_PARAMS, PROMPTS, **kw))
    streamed = [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))]
    assert streamed == fused.tokens
    assert max(len(row) for c in chunks[1:] for row in c) > 1  # rounds really emitted bursts


def test_per_call_arrays_do_not_recompile():
    before = dec._compiled.cache_info().currsize
    # Stop ids are arrays too: any counts up to the same multiple of 4 share the program.
    for (t, budget), stops in zip([(0.0, 5), (0.9, 9), (1.3, 3)], [[2], [[0], [1, 2], [], [0]], [0, 1, 2]]):
        dec.decode(
            TARGET,
            TARGET_PARAMS,
            PROMPTS,
            drafter=DRAFTER,
            draft_params=DRAFT_PARAMS,
            gamma=2,
            max_new_tokens=budget,
            temperature=t,
            top_k=2,
            seed=int(t * 10),
            stop_token_ids=stops,
        )
    fn = dec._compiled(TARGET, DRAFTER, DecodeConfig(2, 128))
    assert dec._compiled.cache_info().currsize == before + 1
    assert fn._cache_size() == 1


@dataclasses.dataclass(frozen=True)
class _BrokenDrafter(Drafter):
    """Proposes token 0 while claiming q puts all its mass on token 1."""

    vocab_size: int = VOCAB

    def init(self, params, prompt, prompt_len, slots):
        return None

    def propose(self, params, state, ctx, key, k):
        b = ctx.seq.shape[0]
        q = jax.nn.one_hot(jnp.ones((b, k), jnp.int32), VOCAB)
        return Proposal(jnp.zeros((b, k), jnp.int32), q, ctx.max_draft, state)


def test_debug_checks_catch_zero_q_proposals():
    with pytest.raises(Exception, match="probability 0"):
        dec.decode(
            TARGET, TARGET_PARAMS, PROMPTS, drafter=_BrokenDrafter(), gamma=2, max_new_tokens=5, debug_checks=True
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=-1, drafter=DRAFTER), "gamma"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(prompts=[[0, 1], []]), "prompt 1 is empty"),
        (dict(prompts=[[0, 7]]), "outside"),
        (dict(max_new_tokens=100, max_len=64), "exceeds the cache"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(drafter=ModelDrafter(make_table_model(random_table(2, 5, 2))[0]), gamma=2), "vocabulary mismatch"),
        # Nothing is truncated or flattened silently: numpy's int casts would turn these into other requests.
        (dict(prompts=[0, 1, 2]), "prompt 0 must be a 1-D sequence"),  # one prompt, not wrapped in a list
        (dict(prompts=[[[0, 1], [1, 2]]]), "prompt 0 must be a 1-D sequence"),
        (dict(prompts=[[0, 1.5]]), "prompt 0 must be integers"),
        (dict(prompts=np.array([[0.0, 1.0], [1.0, 0.5]])), "prompts must be integers"),
        (dict(top_k=2.5), "top_k must be integers"),
        (dict(top_k=-0.5), "top_k must be integers"),
        (dict(max_new_tokens=4.5), "max_new_tokens must be integers"),
        (dict(drafter=DRAFTER, gamma=2.0), "gamma .* must be an int"),
        (dict(adaptive=True), "need a drafter"),
        (dict(block_verify=True), "need a drafter"),
        (dict(max_new_tokens=None, max_len=9), "prompt 2 \\(9 tokens\\) leaves no cache slot"),
        (dict(max_len=100.5), "max_len .* must be an int >= 1, got 100.5"),  # int() would make it 100
        (dict(max_len=True), "max_len .* must be an int >= 1"),
        # An EOS id that could never match, or would be cast into another token, is refused.
        (dict(eos_ids=[1.5]), "eos_ids must be integers"),
        (dict(eos_ids=[3]), "eos_ids must be token ids in \\[0, 3\\), got \\[3\\]"),
        (dict(eos_ids=2), "eos_ids must be a sequence of token ids, got the single value 2"),
        # jax.random.key keeps a seed's low 32 bits: 2**32 was seed 0's stream, -1 was 2**32 - 1's.
        (dict(seed=2**32), r"seed must be in \[0, 4294967296\)"),
        (dict(seed=-1), r"seed must be in \[0, 4294967296\)"),
        (
            dict(key=jax.random.split(jax.random.key(0), 3)),
            r"one PRNG key \(shape \(\)\) or one per row \(shape \(4,\)\)",
        ),
        (dict(key=np.zeros(3, np.uint32)), r"raw uint32 key data \[2\] / \[B, 2\] with B = 4, got uint32\[3\]"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, message):
    kwargs = {"prompts": PROMPTS, **kwargs}
    prompts = kwargs.pop("prompts")
    with pytest.raises(ValueError, match=message):
        dec.decode(TARGET, TARGET_PARAMS, prompts, **kwargs)


def test_whole_number_floats_are_accepted_as_ints():
    """int_array refuses only what a cast would change: 3.0 is the int 3 (as in a JSON request)."""
    a = dec.decode(TARGET, TARGET_PARAMS, [[0.0, 1.0, 2.0]], max_new_tokens=3.0, top_k=2.0, temperature=1.0)
    b = dec.decode(TARGET, TARGET_PARAMS, [[0, 1, 2]], max_new_tokens=3, top_k=2, temperature=1.0)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 3


def test_adaptive_k_keeps_greedy_output_and_adapts():
    from jspec.adaptive import AdaptiveK

    plain = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=24)
    bad_draft, bad_params = make_table_model(random_table(9, VOCAB, PERIOD), "unrelated")
    kw = dict(drafter=ModelDrafter(bad_draft), draft_params=bad_params, gamma=4, max_new_tokens=24)
    fixed = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, **kw)
    # An expensive drafter with poor acceptance: it starts on (at the prior 0.9, 4.1 tokens a round against its
    # cost of 2.9 steps) and backs off once the rows measure their acceptance.
    costly = AdaptiveK(draft_cost=0.4, prior=0.9)
    adaptive = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, adaptive=costly, **kw)
    assert fixed.tokens == plain.tokens
    assert adaptive.tokens == plain.tokens
    assert 0 < adaptive.stats["proposed"] < fixed.stats["proposed"] / 2
    good = dec.decode(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=4,
        max_new_tokens=24,
        adaptive=True,
    )
    assert good.tokens == plain.tokens and good.stats["proposed"] > 0


def test_adaptive_prior_at_which_k_never_pays_is_refused():
    """A row starts at the prior and drifts back to it while idle: where K does not pay at the prior (the
    default 0.6 with draft cost 0.4 at K = 4), no row ever proposed or measured anything and decoding was
    silently plain. Refused, naming the break-even acceptance: the root of 1 + a + ... + a^4 = 1 + 4 * 0.475."""
    from jspec.adaptive import AdaptiveK

    roots = np.roots([1, 1, 1, 1, 1 - (1 + 4 * (0.4 + 0.075))])
    even = float(next(r.real for r in roots if abs(r.imag) < 1e-9 and 0 < r.real < 1))
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=4, max_new_tokens=4)
    with pytest.raises(ValueError, match=f"chooses K=0 at its own prior for gamma=4.*above {even:.3f}"):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, adaptive=AdaptiveK(draft_cost=0.4), **kw)
    with pytest.raises(ValueError, match="at its own prior"):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, adaptive=AdaptiveK(prior=0.0), **kw)
    with pytest.raises(ValueError, match="does not pay at any acceptance"):
        dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, adaptive=AdaptiveK(draft_cost=2.0, prior=0.99), **kw)
    for ok in (AdaptiveK(draft_cost=0.4, prior=even + 0.01), AdaptiveK(draft_cost=0.4, min_k=1)):
        assert dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, adaptive=ok, **kw).config.adaptive == ok


def test_adaptive_k_distribution():
    """Per-row draft lengths that change from round to round must not change what is sampled.

    The policy (draft cost 0.25 + verify 0.075 a position, EMA weight 0.3 on the past) makes K change: at the
    prior 0.6, 1 + ... + 0.6^k over 1 + 0.325 k peaks at K = 1 (1.21 against 1.19 for K = 2), so every row's
    first round drafts 1; an accepted draft moves the estimate to 0.88, where K = 3 wins (1.69 against 1.61),
    a rejected one to 0.18, where K = 0 does. 7 new tokens leave room for the 3-candidate rounds."""
    from jspec.adaptive import AdaptiveK

    groups = [GROUPS[0], GROUPS[3]]
    n, n_new = N_PER_GROUP, 7
    prompts, cols = grouped_rows(PROMPT, groups, n)
    out = dec.decode(
        TARGET,
        TARGET_PARAMS,
        prompts,
        drafter=DRAFTER,
        draft_params=DRAFT_PARAMS,
        gamma=3,
        max_new_tokens=n_new,
        max_len=DIST_SLOTS,
        seed=77,
        adaptive=AdaptiveK(draft_cost=0.25, beta=0.3),
        **cols,
    )
    tokens = np.asarray(out.tokens)
    at = out.stats["proposed_at"]
    assert at[2] > 0 and at[0] > at[1], at  # rounds of 3 candidates after first rounds of 1: K changed
    for i, g in enumerate(groups):
        stat, df = chi_square(
            tokens[i * n : (i + 1) * n], exact_sequence_distribution(TARGET_TABLE, PROMPT, n_new, **g)
        )
        assert stat < chi2_critical(df), (g, stat, df)


# ---- the draft length: what is given is what runs ----


def test_gamma_unset_is_the_drafters_own_and_a_given_one_is_what_runs():
    """gamma=None: 0 without a drafter, 4 (DEFAULT_GAMMA) for a chain, a tree's depth for a tree. A given gamma
    the loop would have replaced (a tree drafted to its depth whatever gamma said; gamma=0 with a drafter ran
    plain; gamma without a drafter ran plain) is refused naming both values."""
    from jspec.ngram import NgramTreeDrafter

    tree = NgramTreeDrafter(2, 3, vocab_size=VOCAB)

    def k(**kw):
        return dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, max_new_tokens=4, goodput=False, **kw).config.gamma

    assert k() == 0 and k(gamma=0) == 0
    assert k(drafter=DRAFTER, draft_params=DRAFT_PARAMS) == DEFAULT_GAMMA == 4
    assert k(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=2) == 2
    assert k(drafter=tree) == 3 and k(drafter=tree, gamma=3) == 3
    for kw, message in (
        (dict(drafter=tree, gamma=2), "gamma=2, but a tree drafter drafts to its depth, 3"),
        (dict(drafter=tree, gamma=4), "gamma=4, but a tree drafter drafts to its depth, 3"),
        (dict(gamma=3), "gamma=3 needs a drafter"),
        (dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=0), "gamma=0 with a drafter drafts nothing"),
        (dict(drafter=DRAFTER), "ModelDrafter needs draft_params"),
    ):
        with pytest.raises(ValueError, match=message):
            k(**kw)
    with pytest.raises(ValueError, match="gamma=4 is more than _Capped's max_draft=3"):
        k(drafter=_Capped(), gamma=4)
    assert k(drafter=_Capped()) == 3  # unset: DEFAULT_GAMMA, capped at the drafter's max_draft


@dataclasses.dataclass(frozen=True)
class _Capped(Drafter):
    """A chain drafter that states the largest K it serves (its state is sized for it): refused on the host."""

    vocab_size: int = VOCAB
    max_draft: int = 3

    def propose(self, params, state, ctx, key, k):
        raise AssertionError("refused before it is traced")


def test_adaptive_policies_are_checked():
    from jspec.adaptive import AdaptiveK

    base = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, max_new_tokens=4)
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ValueError, match="adaptive must be True, False, None or an AdaptiveK"):
            dec.decode(TARGET, TARGET_PARAMS, PROMPTS, adaptive=bad, **base)
    with pytest.raises(ValueError, match="min_k=3 is more than gamma=2"):  # no k would be allowed
        dec.decode(TARGET, TARGET_PARAMS, PROMPTS, gamma=2, adaptive=AdaptiveK(min_k=3), **base)
    for field, value in (("beta", 1.0), ("beta", -0.1), ("prior", 1.5), ("drift", -0.01), ("verify_cost", -0.1)):
        with pytest.raises(ValueError, match=f"AdaptiveK.{field} must be a number in"):
            AdaptiveK(**{field: value})
    for value in (-1, 1.0, True):
        with pytest.raises(ValueError, match="AdaptiveK.min_k must be an int >= 0"):
            AdaptiveK(min_k=value)
    AdaptiveK(beta=0.0, prior=1.0, drift=1.0, draft_cost=0.0, verify_cost=0.0, min_k=2)  # the range ends are valid


# ---- debug checks on every path ----


def test_debug_checks_in_the_streaming_path():
    """decode_stream with debug_checks raises the drafter bug on the host (it used to fail to trace), and a
    sound drafter streams the fused loop's tokens."""
    broken = dec.decode_stream(
        TARGET, TARGET_PARAMS, PROMPTS, drafter=_BrokenDrafter(), gamma=2, max_new_tokens=5, debug_checks=True
    )
    with pytest.raises(Exception, match="probability 0"):
        list(broken)
    # The failed round was given (donated) the stream's state: the stream says so instead of reading it.
    with pytest.raises(ValueError, match="a step of this stream failed"):
        next(broken)
    with pytest.raises(ValueError, match="a step of this stream failed"):
        broken.output()
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=2, max_new_tokens=6, temperature=1.0, seed=3)
    chunks = list(dec.decode_stream(TARGET, TARGET_PARAMS, PROMPTS, debug_checks=True, **kw))
    streamed = [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))]
    assert streamed == dec.decode(TARGET, TARGET_PARAMS, PROMPTS, **kw).tokens


def _zero_q_tree(rule):
    """A tree drafter whose reported q gives each proposed child probability 0 (every row of q moved onto the
    next token id), the tree analogue of ``_BrokenDrafter``."""
    from jspec.drafters import TreeModelDrafter
    from jspec.tree import TreeSpec

    class ZeroQTree(TreeModelDrafter):
        def propose_tree(self, params, state, ctx, key):
            prop = super().propose_tree(params, state, ctx, key)
            # q rows are per parent node: put each parent's mass on a token none of its children has.
            kids = (
                jnp.zeros(prop.q.shape, bool)
                .at[jnp.arange(prop.q.shape[0])[:, None], jnp.maximum(prop.parent, 0), prop.tokens]
                .set(prop.valid.at[:, 0].set(False))  # the root is nobody's child
            )
            free = jnp.argmin(kids, axis=-1)  # a token no child of that node carries (V=3 > 2 children)
            return dataclasses.replace(prop, q=jax.nn.one_hot(free, VOCAB))

    return ZeroQTree(DRAFT, TreeSpec((2, 1)), rule)


def test_debug_checks_catch_zero_q_tree_nodes():
    """Sampled trees verify against q: a node that its parent's q gives probability 0 is a drafter bug that
    debug_checks reports (one check for both rules that read q, IID and without replacement: IID runs here);
    deterministic trees do not read q, so the same tree passes."""
    from jspec.tree import TreeRule

    kw = dict(draft_params=DRAFT_PARAMS, max_new_tokens=6, temperature=1.0, debug_checks=True)
    with pytest.raises(Exception, match="probability 0"):
        dec.decode(TARGET, TARGET_PARAMS, PROMPTS, drafter=_zero_q_tree(TreeRule.IID), goodput=False, **kw)
    out = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, drafter=_zero_q_tree(TreeRule.DETERMINISTIC), goodput=False, **kw)
    assert out.stats["proposed"] > 0


def test_seed_or_key_not_both():
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=2, max_new_tokens=6, temperature=1.0)
    by_seed = dec.decode(TARGET, TARGET_PARAMS, PROMPTS, seed=5, **kw).tokens
    assert dec.decode(TARGET, TARGET_PARAMS, PROMPTS, key=jax.random.key(5), **kw).tokens == by_seed
    assert (
        dec.decode(TARGET, TARGET_PARAMS, PROMPTS, **kw).tokens
        == dec.decode(TARGET, TARGET_PARAMS, PROMPTS, seed=0, **kw).tokens
    )  # the default seed is 0
    with pytest.raises(ValueError, match="give seed or key, not both"):
        dec.decode(TARGET, TARGET_PARAMS, PROMPTS, seed=5, key=jax.random.key(5), **kw)
    for bad in (1.5, True, "3"):
        with pytest.raises(ValueError, match="seed must be an int"):
            dec.decode(TARGET, TARGET_PARAMS, PROMPTS, seed=bad, **kw)


def test_debug_checks_compile_ahead_like_the_plain_loop():
    """``prepare(..., debug_checks=True).compile()`` compiles (run_timed then times execution alone, as without
    the checks) and the compiled call still raises a drafter bug."""
    broken = dec.prepare(
        TARGET, TARGET_PARAMS, PROMPTS, drafter=_BrokenDrafter(), gamma=2, max_new_tokens=5, debug_checks=True
    )
    compiled = broken.compile()
    assert compiled is not broken.fn
    with pytest.raises(Exception, match="probability 0"):
        broken.run(compiled)
    sound = dec.prepare(
        TARGET,
        TARGET_PARAMS,
        PROMPTS,
        drafter=DRAFTER,
        goodput=False,
        draft_params=DRAFT_PARAMS,
        max_new_tokens=5,
        debug_checks=True,
    )
    out = sound.run_timed()
    assert (
        out.tokens
        == dec.decode(
            TARGET, TARGET_PARAMS, PROMPTS, drafter=DRAFTER, goodput=False, draft_params=DRAFT_PARAMS, max_new_tokens=5
        ).tokens
    )


def test_requests_past_the_models_context_are_refused():
    """A model that states its context length (``Model.max_positions``; SmolLM2's GGUF says 8192) is never fed a
    position at or past it: a budget that would is refused by name (decode and Engine), a default cache is
    capped at the context, and max_new_tokens=None needs a cache that fits it."""
    from jspec.serve import Engine

    short = dataclasses.replace(TARGET, max_positions=12)
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3)
    prompt = [[2, 0, 1, 1, 0]]  # positions 0-4; 8 new tokens feed positions up to 11
    fits = dec.prepare(short, TARGET_PARAMS, prompt, max_new_tokens=8, **kw)
    assert fits.config.slots == 12  # the default 128 slots, capped
    assert fits.run().tokens == dec.decode(TARGET, TARGET_PARAMS, prompt, max_new_tokens=8, **kw).tokens
    with pytest.raises(ValueError, match=r"prompt 0 \(5 tokens\) \+ max_new_tokens \(9\) runs past target's context"):
        dec.decode(short, TARGET_PARAMS, prompt, max_new_tokens=9, **kw)
    with pytest.raises(ValueError, match=r"max_len=13 with max_new_tokens=None decodes up to position 12, past"):
        dec.decode(short, TARGET_PARAMS, prompt, max_new_tokens=None, max_len=13)
    assert dec.decode(short, TARGET_PARAMS, prompt, max_new_tokens=None, max_len=12).lengths == [8]
    engine = Engine(short, TARGET_PARAMS, batch=1, max_len=32)
    with pytest.raises(ValueError, match=r"runs past target's context length \(12 positions\)"):
        engine.add(0, prompt[0], 9)
    engine.add(0, prompt[0], 8)


def test_adaptive_estimate_is_the_per_token_acceptance():
    """The adaptive K's estimate was an average of accepted / proposed per round: a chain stops testing at its
    first rejection, so at a = 0.5, K = 4 it read ~0.23 and chose K = 1 where K = 3 pays. It is now a ratio of
    moving sums, accepted / tested (the geometric maximum-likelihood estimate). Exact update first, then
    2000 simulated rounds of per-token acceptance 0.5 (fixed seed; tolerance 0.05)."""
    from jspec import adaptive as adapt

    policy = adapt.AdaptiveK(beta=0.7, prior=0.6)
    ema = adapt.init(policy, 1)
    one = lambda x: jnp.asarray([x], jnp.int32)  # noqa: E731
    moved = adapt.update(policy, ema, one(2), one(4), jnp.asarray([True]))  # 2 accepted of 3 tested
    np.testing.assert_allclose(np.asarray(moved), [[0.7 * 0.6 + 0.3 * 2, 0.7 * 1 + 0.3 * 3]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adapt.estimate(moved)), [1.02 / 1.6], rtol=1e-6)
    # By hand, three rows in one call: all 4 accepted tests 4 (not 5); a row that proposed nothing drifts its
    # estimate 0.25 by 0.05 towards the prior 0.6 (0.2675) keeping its weight 2; an inactive row stays.
    ema3 = jnp.asarray([[1.2, 2.0], [0.5, 2.0], [0.3, 1.0]])
    got = adapt.update(policy, ema3, jnp.asarray([4, 0, 2]), jnp.asarray([4, 0, 4]), jnp.asarray([True, True, False]))
    want = [[0.7 * 1.2 + 0.3 * 4, 0.7 * 2 + 0.3 * 4], [0.2675 * 2, 2.0], [0.3, 1.0]]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)

    slow = adapt.AdaptiveK(beta=0.99)
    rng = np.random.default_rng(0)
    ema = adapt.init(slow, 1)
    ref = np.asarray([[slow.prior, 1.0]])  # the same rounds through the formula in float64
    for _ in range(2000):
        n_acc = 0
        while n_acc < 4 and rng.random() < 0.5:
            n_acc += 1
        ema = adapt.update(slow, ema, one(n_acc), one(4), jnp.asarray([True]))
        ref = 0.99 * ref + 0.01 * np.asarray([[n_acc, min(n_acc + 1, 4)]])
    np.testing.assert_allclose(np.asarray(ema), ref, rtol=1e-4)
    assert abs(float(adapt.estimate(ema)[0]) - 0.5) < 0.05
    # A round that proposes drafts all K steps and verifies K + 1 positions whatever k a row keeps, so the cost of
    # any k >= 1 is 1 + K * (draft_cost + verify_cost) and the choice is K or 0. By hand, K = 4:
    # - defaults (draft 0, verify 0.075), a = 0.5: E[N] = 1.9375 over 1.3 = 1.49 > 1 -> 4 (it chose 3 while it
    #   priced k < K as cheaper);
    # - draft 0.3, a = 0.6: E[N] = 2.3056 over 2.5 = 0.92 < 1 -> 0 (it chose 1, believing 1.16x; really 0.64x);
    #   with min_k = 1 the best allowed is K.
    default = adapt.AdaptiveK()
    assert int(adapt.choose_k(default, jnp.asarray([[0.5, 1.0]]), 4)[0]) == 4
    costly = adapt.AdaptiveK(draft_cost=0.3)
    assert int(adapt.choose_k(costly, jnp.asarray([[0.6, 1.0]]), 4)[0]) == 0
    assert int(adapt.choose_k(adapt.AdaptiveK(draft_cost=0.3, min_k=1), jnp.asarray([[0.6, 1.0]]), 4)[0]) == 4
    # A drafter that verifies K + 1 wide even without proposals (EAGLE): a round at 0 costs 1 + 4 * 0.075 = 1.3,
    # not 1. Draft 0.2, a = 0.5: E[N] / cost = 1.9375 / 2.1 = 0.92, below plain's 1 but above 1 / 1.3 = 0.77.
    eagle_like = adapt.AdaptiveK(draft_cost=0.2)
    assert int(adapt.choose_k(eagle_like, jnp.asarray([[0.5, 1.0]]), 4)[0]) == 0
    assert int(adapt.choose_k(eagle_like, jnp.asarray([[0.5, 1.0]]), 4, always_wide=True)[0]) == 4


def test_defaults_and_keys_that_compiled_too_much():
    """A default cache sized P + N (not P + N - 1) doubled at a bucket edge; EOS ids in another order or
    repeated, and a raw key next to the typed key it stands for, compiled loops of their own; decode_stream
    checked its arguments only at the first next()."""
    prompt = [[0, 1, 2] * 9 + [0, 1]]  # 29 tokens + 100 new = 128 slots needed
    assert dec.prepare(TARGET, TARGET_PARAMS, prompt, max_new_tokens=100).config.slots == 128
    assert check_eos([2, 1, 2], VOCAB) == check_eos([1, 2], VOCAB) == (1, 2)
    raw = dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, key=jax.random.key_data(jax.random.key(7)))
    typed = dec.prepare(TARGET, TARGET_PARAMS, PROMPTS, key=jax.random.key(7))
    assert raw.args[-1].dtype == typed.args[-1].dtype and raw.run().tokens == typed.run().tokens
    with pytest.raises(ValueError, match="temperature"):
        dec.decode_stream(TARGET, TARGET_PARAMS, PROMPTS, temperature=-1.0)  # no next() needed


def test_a_draft_model_fed_past_its_context_is_refused():
    """The target's context was checked, the draft model's not: fed past it, it drafts garbage."""
    short = dataclasses.replace(DRAFT, max_positions=8)
    message = r"row 0 runs to position 8, past the draft model draft's context length \(8 positions"
    with pytest.raises(ValueError, match=message):
        dec.decode(TARGET, TARGET_PARAMS, PROMPTS, drafter=ModelDrafter(short), goodput=False,
                   draft_params=DRAFT_PARAMS, max_new_tokens=5)  # fmt: skip
    out = dec.decode(TARGET, TARGET_PARAMS, [[0, 1]], drafter=ModelDrafter(short), goodput=False,
                     draft_params=DRAFT_PARAMS, max_new_tokens=5)  # fmt: skip
    assert len(out.tokens[0]) == 5
    from jspec.serve import Engine  # the serving engine checks the same at add()

    engine = Engine(
        TARGET,
        TARGET_PARAMS,
        batch=1,
        max_len=32,
        drafter=ModelDrafter(short),
        goodput=False,
        draft_params=DRAFT_PARAMS,
    )
    with pytest.raises(ValueError, match="past the draft model draft's context length"):
        engine.add(0, PROMPTS[0], max_new_tokens=5)
