"""min_tokens, logit_bias and the repetition / presence / frequency penalties (vLLM's and OpenAI's request
options) on toy table models: the processed logits against NumPy, greedy decoding (plain, chain, tree, the
serving engine) against an argmax loop written from the definitions, whole-sequence distributions at T > 0
against exact enumeration, and the refusals.

References apply the options as vLLM's logits processors and transformers' ``SequenceBiasLogitsProcessor`` /
``MinNewTokensLengthLogitsProcessor`` do: the bias is added to the raw logits, and while fewer than min_tokens
tokens have been generated the end tokens get -inf; then (vLLM's order) the penalties: a logit of a token in the
prompt or the output divided by repetition_penalty when positive, multiplied when not, and presence_penalty /
frequency_penalty times the token's occurrence / count in the output subtracted; all before temperature and the
top-k/top-p filters. The real-model check against transformers' generate is in test_real_model_decode.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from toy_models import chi2_critical, chi_square, make_table_model, random_table, ref_transform

from jspec import decode as dec
from jspec.drafters import ModelDrafter, TreeModelDrafter
from jspec.ngram import NgramDrafter
from jspec.sampling import processed_logits
from jspec.serve import Engine
from jspec.state import DecodeConfig
from jspec.tree import TreeRule, TreeSpec
from jspec.validate import sampling_params

VOCAB, PERIOD, EOS = 4, 3, 3
TABLE = random_table(7, VOCAB, PERIOD)
# EOS likely early, so that min_tokens has something to hold back: its logit raised in every context.
TABLE[..., EOS] += 1.0
DRAFT_TABLE = TABLE + random_table(8, VOCAB, PERIOD) * 0.8
TARGET, TPARAMS = make_table_model(TABLE, "target")
DRAFT, DPARAMS = make_table_model(DRAFT_TABLE, "draft")
CHAIN = ModelDrafter(DRAFT)
TREE = TreeModelDrafter(DRAFT, TreeSpec((2, 2, 1)), TreeRule.WITHOUT_REPLACEMENT)
GREEDY_TREE = TreeModelDrafter(DRAFT, TreeSpec((2, 2, 1)))


def ref_logits(logits, bias: dict, index: int, min_tokens: int, ends, history=None, pen=(1.0, 0.0, 0.0)):
    """One position's logits as the row samples from them (float64). history: (prompt, output so far) for the
    penalties pen = (repetition, presence, frequency)."""
    x = np.array(logits, np.float64)
    for tok, b in bias.items():
        x[tok] += b
    if index < min_tokens:
        x[sorted(ends)] = -np.inf
    if history is not None:
        prompt, out = history
        rep, pres, freq = pen
        for tok in set(prompt) | set(out):
            x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
        for tok in set(out):
            x[tok] -= freq * out.count(tok) + pres
    return x


def context_logits(full: list[int]) -> np.ndarray:
    parent = full[-2] if len(full) >= 2 else 0
    return TABLE[parent, full[-1], (len(full) - 1) % PERIOD]


def ref_greedy(prompt, n_new, bias, min_tokens, ends, pen=(1.0, 0.0, 0.0)) -> list[int]:
    full, out = list(prompt), []
    while len(out) < n_new and not (out and out[-1] in ends):
        x = ref_logits(context_logits(full), bias, len(out), min_tokens, ends, (prompt, out), pen)
        tok = int(np.argmax(x))
        full.append(tok)
        out.append(tok)
    return out


def exact_ended(prompt, n_new, bias, min_tokens, ends, pen=(1.0, 0.0, 0.0), masked=None, **sampling) -> dict:
    """P(output) for every output (ending at its first end token or after n_new tokens), padded with -1 to
    n_new, by enumeration with the NumPy reference transform. masked: the end tokens min_tokens holds back
    (all of ``ends`` unless given: a wrong rule for the power checks)."""
    out = {}
    masked = ends if masked is None else masked

    def walk(full, gen, prob):
        if len(gen) == n_new or (gen and gen[-1] in ends):
            out[tuple(gen) + (-1,) * (n_new - len(gen))] = prob
            return
        x = ref_logits(context_logits(full), bias, len(gen), min_tokens, masked, (prompt, gen), pen)
        dist = ref_transform(x, **sampling)
        for tok in np.flatnonzero(dist > 0):
            walk(full + [int(tok)], gen + [int(tok)], prob * dist[tok])

    walk(list(prompt), [], 1.0)
    return out


def padded(tokens: list[list[int]], n: int) -> np.ndarray:
    return np.array([t + [-1] * (n - len(t)) for t in tokens])


def test_processed_logits_match_numpy():
    rng = np.random.default_rng(0)
    b, t, v = 3, 4, 11
    logits = rng.normal(size=(b, t, v)).astype(np.float32)
    biases = [{2: 1.5, 7: -np.inf}, None, {0: -3.0, 10: 0.25, 4: 2.0}]
    stops = [[5], [], [1, 9]]
    sp = sampling_params(b, stop_token_ids=stops, min_tokens=[2, 0, 9], logit_bias=biases, vocab_size=v)
    assert sp.bias_ids.shape == (b, 4) and sp.stop_ids.shape == (b, 4)  # widths rounded up to 4
    index = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 7, 8]], np.int32)
    got = np.asarray(processed_logits(jnp.asarray(logits), sp, jnp.asarray(index), (3,)))
    for i in range(b):
        ends = {3, *stops[i]}
        for j in range(t):
            want = ref_logits(logits[i, j], biases[i] or {}, index[i, j], [2, 0, 9][i], ends)
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6)
    # Nothing to do (no bias slots, no end tokens): the logits come back as they are.
    sp0 = sampling_params(b)
    np.testing.assert_array_equal(np.asarray(processed_logits(jnp.asarray(logits), sp0, jnp.asarray(index))), logits)


PROMPTS = [[0, 1, 2, 0, 1], [2], [1, 1, 0, 2, 2, 1, 0, 0, 1], [0, 2]]
BIASES = [{0: 1.0}, None, {1: -np.inf, 2: 0.7}, {0: -0.5, 1: 0.5, 2: 0.3}]
MIN_TOKENS = [4, 0, 6, 2]
STOPS = [[], [1], [0], []]


@pytest.mark.parametrize("drafter", [None, CHAIN, GREEDY_TREE], ids=["plain", "chain", "tree"])
def test_greedy_follows_the_processed_argmax(drafter):
    kw = dict(drafter=drafter, draft_params=DPARAMS, goodput=False) if drafter is not None else {}
    if drafter is CHAIN:
        kw["gamma"] = 3
    out = dec.decode(
        TARGET,
        TPARAMS,
        PROMPTS,
        max_new_tokens=14,
        eos_ids=[EOS],
        stop_token_ids=STOPS,
        min_tokens=MIN_TOKENS,
        logit_bias=BIASES,
        logprobs=True,
        **kw,
    )
    for i, prompt in enumerate(PROMPTS):
        want = ref_greedy(prompt, 14, BIASES[i] or {}, MIN_TOKENS[i], {EOS, *STOPS[i]})
        assert out.tokens[i] == want, i
        # logprobs stay the raw model's (vLLM's default), not the biased distribution's.
        full = list(prompt)
        for tok, lp in zip(out.tokens[i], out.logprobs[i]):
            raw = context_logits(full)
            assert lp == pytest.approx(raw[tok] - np.log(np.exp(raw).sum()), abs=1e-5)
            full.append(tok)
    # Not vacuous: without the options the same prompts end earlier (an end token inside min_tokens) and
    # take other tokens.
    bare = dec.decode(TARGET, TPARAMS, PROMPTS, max_new_tokens=14, eos_ids=[EOS], stop_token_ids=STOPS, **kw)
    assert any(len(t) < m for t, m in zip(bare.tokens, MIN_TOKENS))
    assert bare.tokens != out.tokens
    if drafter is not None:
        assert 0 < out.stats["accepted"] < out.stats["proposed"]


# Per row (repetition, presence, frequency): every penalty alone and together, negative ones included.
# Row 1's prompt [2] is padded with id 0: its repetition penalty must not see the padding.
PENALTIES = [(1.5, 0.0, 0.3), (1.3, 0.5, 0.0), (2.0, -0.4, 0.7), (1.2, 1.0, -0.5)]
NGRAM = NgramDrafter(2, 1, vocab_size=VOCAB)  # proposes only on a match: rounds with no proposal run narrow


@pytest.mark.parametrize(
    "drafter, extra",
    [(None, {}), (CHAIN, dict(gamma=3)), (CHAIN, dict(gamma=3, block_verify=True)), (GREEDY_TREE, dict(goodput=False)),
     (NGRAM, dict(gamma=3))],
    ids=["plain", "chain", "block", "tree", "ngram"],
)  # fmt: skip
def test_greedy_penalties_follow_the_reference(drafter, extra):
    """Penalties with the other options: a candidate's penalty counts the drafts before it in its block (a
    chain's earlier positions, a tree node's ancestors), not the rejected ones."""
    kw = dict(drafter=drafter, draft_params=DPARAMS if drafter is not NGRAM else None, **extra) if drafter else {}
    rep, pres, freq = (list(x) for x in zip(*PENALTIES))
    # No end tokens here, so that every row runs its 14 tokens (the penalties with min_tokens and end tokens are
    # in the distribution test).
    opts = dict(logit_bias=BIASES, **kw)
    out = dec.decode(TARGET, TPARAMS, PROMPTS, max_new_tokens=14, repetition_penalty=rep, presence_penalty=pres,
                     frequency_penalty=freq, **opts)  # fmt: skip
    for i, prompt in enumerate(PROMPTS):
        assert out.tokens[i] == ref_greedy(prompt, 14, BIASES[i] or {}, 0, set(), PENALTIES[i])
    bare = dec.decode(TARGET, TPARAMS, PROMPTS, max_new_tokens=14, **opts)
    assert all(a != b for a, b in zip(out.tokens, bare.tokens))  # every row's penalties changed its output
    if drafter is not None:
        assert 0 < out.stats["accepted"] < out.stats["proposed"]


def test_engine_requests_take_their_own_options():
    eng = Engine(TARGET, TPARAMS, batch=2, max_len=32, drafter=CHAIN, draft_params=DPARAMS, gamma=2, eos_ids=[EOS],
                 max_logit_bias=3)  # fmt: skip
    got = {}
    for i, prompt in enumerate(PROMPTS[:2]):
        first = eng.add(i, prompt, 14, stop_token_ids=STOPS[i], min_tokens=MIN_TOKENS[i], logit_bias=BIASES[i])
        got[i] = [first]
    while eng.free_rows() != [0, 1]:
        for r, toks in eng.step().items():
            got[r] += toks
    for i in range(2):
        assert got[i] == ref_greedy(PROMPTS[i], 14, BIASES[i] or {}, MIN_TOKENS[i], {EOS, *STOPS[i]})
    # A refilled row starts from the new request's options, not the old one's.
    first = eng.add(0, PROMPTS[3], 14, min_tokens=MIN_TOKENS[3], logit_bias=BIASES[3])
    toks = [first]
    while 0 not in eng.free_rows():
        toks += eng.step().get(0, [])
    assert toks == ref_greedy(PROMPTS[3], 14, BIASES[3], MIN_TOKENS[3], {EOS})
    with pytest.raises(ValueError, match=r"4 logit_bias entries, more than .* Engine\(\.\.\., max_logit_bias=4\)"):
        eng.add(1, [0], 4, logit_bias={i: 1.0 for i in range(4)})
    with pytest.raises(ValueError, match="logit_bias must be one"):
        eng.add(1, [0], 4, logit_bias=[{0: 1.0}])
    with pytest.raises(ValueError, match=r"min_tokens \(5\) is more than the 4 tokens it may generate"):
        eng.add(1, [0], 4, min_tokens=5)
    with pytest.raises(ValueError, match=r"build it with Engine\(\.\.\., penalties=True\)"):
        eng.add(1, [0], 4, repetition_penalty=1.2)


def test_engine_with_penalties_and_a_tree():
    """Engine(penalties=True) with a tree drafter: each request's counts start from its own prompt, also in a
    refilled row."""
    eng = Engine(TARGET, TPARAMS, batch=2, max_len=40, drafter=GREEDY_TREE, goodput=False, draft_params=DPARAMS,
                 eos_ids=[EOS], max_logit_bias=4, penalties=True)  # fmt: skip
    accepted = []
    for first_row in (0, 3):  # rows 0 and 1, then rows 3 and 2 refill them
        got = {}
        for r, i in enumerate((first_row, 1 if first_row == 0 else 2)):
            rep, pres, freq = PENALTIES[i]
            got[r] = (i, [eng.add(r, PROMPTS[i], 14, stop_token_ids=STOPS[i], min_tokens=MIN_TOKENS[i],
                                  logit_bias=BIASES[i], repetition_penalty=rep, presence_penalty=pres,
                                  frequency_penalty=freq)])  # fmt: skip
        while eng.free_rows() != [0, 1]:
            for r, toks in eng.step().items():
                got[r][1].extend(toks)
        for i, toks in got.values():
            assert toks == ref_greedy(PROMPTS[i], 14, BIASES[i] or {}, MIN_TOKENS[i], {EOS, *STOPS[i]}, PENALTIES[i])
        st = eng.state.stats
        accepted.append((int(st.accepted.sum()), int(st.proposed.sum())))
    assert all(0 < a < p for a, p in accepted), accepted  # the tree's drafts were verified, some accepted


GROUPS = [
    dict(temperature=1.0, bias={0: 1.0, 2: -0.5}, min_tokens=3, stops=[]),
    dict(temperature=0.8, top_k=2, bias={1: -np.inf}, min_tokens=2, stops=[]),
    dict(temperature=1.2, top_p=0.9, bias={}, min_tokens=4, stops=[0]),
    dict(temperature=0.7, bias={2: 0.5}, min_tokens=1, stops=[], pen=(1.6, 0.4, 0.6)),
]
N_PER_GROUP = 60_000
PROMPT = [2, 2, 0]  # tokens 1 and EOS unseen: a repetition penalty hits them only once drafted or emitted
N_NEW = 5


def _sample(drafter, seed, gamma=None):
    n = N_PER_GROUP
    defaults = (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_tokens", 0))
    col = {k: np.repeat([g.get(k, d) for g in GROUPS], n) for k, d in defaults}
    for i, name in enumerate(("repetition_penalty", "presence_penalty", "frequency_penalty")):
        col[name] = np.repeat([g.get("pen", (1.0, 0.0, 0.0))[i] for g in GROUPS], n)
    out = dec.decode(
        TARGET,
        TPARAMS,
        np.tile(np.asarray(PROMPT, np.int32), (n * len(GROUPS), 1)),
        drafter=drafter,
        draft_params=DPARAMS,
        gamma=gamma,
        max_new_tokens=N_NEW,
        max_len=16,
        eos_ids=[EOS],
        stop_token_ids=[g["stops"] for g in GROUPS for _ in range(n)],
        logit_bias=[g["bias"] for g in GROUPS for _ in range(n)],
        seed=seed,
        **col,
    )
    return padded(out.tokens, N_NEW), out.stats


def _exact(g, **override):
    g = {**g, **override}
    filters = {k: g[k] for k in ("temperature", "top_k", "top_p") if k in g}
    pen = g.get("pen", (1.0, 0.0, 0.0))
    masked = {EOS} if g.get("eos_only") else None
    return exact_ended(PROMPT, N_NEW, g["bias"], g["min_tokens"], {EOS, *g["stops"]}, pen, masked, **filters)


# Block verification reads the same processed p as a chain (its greedy case is above; its acceptance rule has its
# own distribution tests in test_block_verify): not repeated here, for the suite's time.
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_distribution_follows_the_processed_target(kind):
    """60k whole outputs per group, four groups in ONE call (per-row biases, min_tokens, stop ids, filters,
    penalties), chi-square against the exact distribution at a 1e-5 false-alarm level. The same samples reject
    the exact distribution without the bias, with min_tokens one off, and without the penalties: the test sees
    every option."""
    tokens, stats = _sample(TREE, 12) if kind == "tree" else _sample(CHAIN, 11, 3)
    assert 0 < stats["accepted"] < stats["proposed"]
    n = N_PER_GROUP
    for i, g in enumerate(GROUPS):
        rows = tokens[i * n : (i + 1) * n]
        stat, df = chi_square(rows, _exact(g))
        assert stat < chi2_critical(df), (i, stat, df)
        # min_tokens one lower or higher, or none: each rejected by the same samples (an off-by-one would show).
        for other in (0, g["min_tokens"] - 1, g["min_tokens"] + 1):
            wrong, df1 = chi_square(rows, _exact(g, min_tokens=other))
            assert wrong > chi2_critical(df1), (i, other)
        if g["bias"]:
            unbiased, df0 = chi_square(rows, _exact(g, bias={}))
            assert unbiased > chi2_critical(df0), i
        if g["stops"]:  # min_tokens holding back EOS but not the row's stop ids
            wrong, df3 = chi_square(rows, _exact(g, eos_only=True))
            assert wrong > chi2_critical(df3), i
        if "pen" in g:  # each penalty alone left out
            for j in range(3):
                pen = list(g["pen"])
                pen[j] = (1.0, 0.0, 0.0)[j]
                wrong, df2 = chi_square(rows, _exact(g, pen=tuple(pen)))
                assert wrong > chi2_critical(df2), (i, j)
            # Presence and frequency after the temperature (x / T - p, not (x - p) / T): the same as before
            # it with p * T (the repetition penalty's scaling commutes with the temperature's).
            t = g["temperature"]
            late = (g["pen"][0], g["pen"][1] * t, g["pen"][2] * t)
            wrong, df4 = chi_square(rows, _exact(g, pen=late))
            assert wrong > chi2_critical(df4), (i, "penalties after temperature")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(logit_bias={4: 1.0}), r"logit_bias must have token ids in \[0, 4\), got \[4\]"),
        (dict(logit_bias={-1: 1.0}), r"token ids in \[0, 4\)"),
        (dict(logit_bias={0: float("nan")}), "biases must be finite"),
        (dict(logit_bias={0: np.inf}), "biases must be finite"),
        (dict(logit_bias={0: 1e39}), r"biases must be in \[-100, 100\] \(or -inf, a ban\), got \[1e\+39\]"),
        (dict(logit_bias={0: -100.5}), r"biases must be in \[-100, 100\]"),
        (dict(logit_bias={0: True}), "biases must be numbers"),
        (dict(logit_bias={0: "1"}), "biases must be numbers"),
        (dict(logit_bias={1.5: 1.0}), "token ids must be integers"),
        (dict(logit_bias={i: -np.inf for i in range(4)}), "bans every token"),
        (dict(logit_bias=[{0: 1.0}]), "1 per-row dicts for 2 rows"),
        (dict(logit_bias=[(0, 1.0), (1, 1.0)]), "must be a {token_id: bias} dict"),
        (dict(logit_bias={0: -np.inf, 1: -np.inf, 2: -np.inf}, min_tokens=1, eos_ids=[3]), "nothing is left"),
        (dict(min_tokens=-1), "min_tokens must be >= 0"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \[0.01, 100\] \(1 = disabled\)"),
        (dict(repetition_penalty=[1.0, float("nan")]), r"repetition_penalty must be in \[0.01, 100\]"),
        (dict(repetition_penalty=1e-40), r"repetition_penalty must be in \[0.01, 100\]"),  # flushed to 0 by XLA
        (dict(repetition_penalty=101.0), r"repetition_penalty must be in \[0.01, 100\]"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=[0.0, -3.0]), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty="0.5"), "frequency_penalty must be numbers"),
        (dict(min_tokens=1.5), "min_tokens must be integers"),
        (dict(min_tokens=[0, 9]), r"row 1: min_tokens \(9\) is more than the 8 tokens it may generate"),
        (dict(min_tokens=12, max_new_tokens=None, max_len=10), r"row 0: min_tokens \(12\) is more than the 10 tokens"),
        (dict(logit_bias={0: 10**400}), "biases must be finite"),
        (
            dict(min_tokens=[0, 2]),
            r"row 1: min_tokens \(2\) holds back nothing: the row has no end token \(EOS ids, "
            r"stop_token_ids\) to keep back",
        ),
        (dict(repetition_penalty=1.2, penalties=False), r"penalties=False, but a row has a repetition / presence"),
        (dict(stop_strings=[True]), "stop_strings has 1 entries for 2 rows"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dec.prepare(TARGET, TPARAMS, [[0], [1]], **{"max_new_tokens": 8, **kwargs})


def test_new_values_reuse_the_compiled_loop():
    """Biases and min_tokens are arrays: other values (with as many bias slots) run the same program."""
    kw = dict(max_new_tokens=6, eos_ids=[EOS], max_len=24)
    outs = [
        dec.decode(TARGET, TPARAMS, PROMPTS, min_tokens=1, logit_bias={0: 1.0}, **kw),
        dec.decode(TARGET, TPARAMS, PROMPTS, min_tokens=[0, 2, 3, 1], logit_bias=BIASES, **kw),
        dec.decode(TARGET, TPARAMS, PROMPTS, min_tokens=[5, 0, 0, 0], logit_bias=[{0: -np.inf}, {}, {}, {}], **kw),
    ]
    assert outs[0].tokens != outs[1].tokens
    assert dec._compiled(TARGET, None, DecodeConfig(0, 24, (EOS,)))._cache_size() == 1
