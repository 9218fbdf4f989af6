"""The n-gram (prompt-lookup) drafter: lookups against a plain-Python reference written from the definition,
greedy decoding identical to plain decoding, and the sampled sequence distribution equal to the target's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_models import chi2_critical, chi_square, exact_sequence_distribution, make_table_model, random_table

from jspec.decode import decode
from jspec.drafters import DraftContext, Drafter, Proposal
from jspec.ngram import NgramDrafter, NgramTreeDrafter, ngram_lookup
from jspec.validate import sampling_params


def ref_lookup(hist: list[int], k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """Longest suffix n-gram first; its most recent occurrence that starts strictly before the suffix; the
    tokens that followed it inside the history, repeated in turn until there are k (fewer than k follow only
    when the occurrence overlaps the suffix: the history ends in a repetition of that period). Returns
    (continuation, n) or ([], 0)."""
    length = len(hist)
    for n in range(max_n, min_n - 1, -1):
        suffix = hist[length - n :] if n <= length else None
        if suffix is None:
            continue
        for i in range(length - n - 1, -1, -1):  # starts before the suffix's own start, latest first
            if hist[i : i + n] == suffix:
                follow = hist[i + n :]
                return [follow[j % len(follow)] for j in range(k)], n
    return [], 0


def make_ctx(histories: list[list[int]], width: int, max_draft) -> DraftContext:
    b = len(histories)
    seq = np.zeros((b, width), np.int32)
    for i, h in enumerate(histories):
        seq[i, : len(h)] = h
    seq_len = np.array([len(h) for h in histories], np.int32)
    return DraftContext(
        jnp.asarray(seq),
        jnp.asarray(seq_len),
        jnp.asarray(np.broadcast_to(np.asarray(max_draft, np.int32), (b,))),
        sampling_params(b),
    )


@functools.cache
def jitted_propose(drafter: NgramDrafter, k: int):
    return jax.jit(lambda ctx: drafter.propose(None, None, ctx, jax.random.key(0), k))


def propose(drafter: NgramDrafter, histories, k, max_draft=None, width=None) -> Proposal:
    width = width or max(len(h) for h in histories) + 3
    ctx = make_ctx(histories, width, k if max_draft is None else max_draft)
    return jax.device_get(jitted_propose(drafter, k)(ctx))


# ---- unit: hand-built histories (expected values worked out by hand) ----

HAND = [
    # (history, max_n, min_n, k, expected continuation, expected n)
    ([1, 2, 3, 1, 2], 3, 1, 4, [3, 1, 2, 3], 2),  # "1 2" at 0; "3 1 2" follow, then their period again
    ([5, 6, 7, 8], 3, 1, 4, [], 0),  # no token repeats
    ([1, 2, 1, 2, 1, 2], 3, 1, 4, [1, 2, 1, 2], 3),  # "2 1 2" latest earlier start is 1: "1 2" follow, repeated
    ([4, 4, 4, 4], 3, 1, 4, [4, 4, 4, 4], 3),  # the occurrence overlaps the suffix: one token follows, a loop
    ([7, 1, 9, 7, 1, 8, 7, 1], 2, 1, 3, [8, 7, 1], 2),  # "7 1" at 0 and 3: the most recent (3) wins
    ([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3, 1, 3, [9, 2, 3], 3),  # the longer n wins over a more recent "2 3"
    ([3], 3, 1, 4, [], 0),  # a single pending token has nothing before it
    ([5, 1, 5], 2, 2, 4, [], 0),  # only "5" repeats, but 1-grams are not allowed
    ([5, 1, 5], 2, 1, 4, [1, 5, 1, 5], 1),
    ([2, 0, 1, 2, 0], 1, 1, 2, [1, 2], 1),  # "0" at 1 (the last 0 is the suffix itself)
    ([0, 0], 3, 1, 5, [0, 0, 0, 0, 0], 1),  # token id 0 (also the padding value) matches like any other
]
HAND_WIDTH = 12


@pytest.mark.parametrize("hist,max_n,min_n,k,want,want_n", HAND)
def test_hand_built_histories(hist, max_n, min_n, k, want, want_n):
    assert ref_lookup(hist, k, max_n, min_n) == (want, want_n)  # the reference agrees with the hand values
    lookup = jax.jit(ngram_lookup, static_argnums=(2, 3, 4))
    seq = jnp.asarray([hist + [0] * (HAND_WIDTH - len(hist))])
    tokens, n_found, n_used = jax.device_get(lookup(seq, jnp.asarray([len(hist)]), k, max_n, min_n))
    assert int(n_found[0]) == len(want)
    assert tokens[0, : len(want)].tolist() == want
    assert int(n_used[0]) == want_n
    prop = propose(NgramDrafter(max_n, min_n, vocab_size=10), [hist], k, width=HAND_WIDTH)
    assert int(prop.n_draft[0]) == len(want)
    assert prop.tokens[0, : len(want)].tolist() == want


# ---- unit: many random histories against the reference, all rows of one batch ----


def random_histories(rng, b, width, vocab_max):
    hists = []
    for _ in range(b):
        v = int(rng.integers(1, vocab_max + 1))  # small per-row vocabularies make matches frequent
        length = int(rng.integers(1, width + 1))  # rows of very different lengths, up to a full buffer
        hists.append(rng.integers(0, v, size=length).tolist())
    return hists


def check_against_reference(drafter, hists, k, max_draft, prop):
    assert prop.tokens.shape == (len(hists), k)
    assert prop.q.shape == (len(hists), k, drafter.vocab_size)
    assert np.all(np.isfinite(prop.q))
    np.testing.assert_allclose(prop.q.sum(-1), 1.0)
    for i, h in enumerate(hists):
        want, _ = ref_lookup(h, k, drafter.max_ngram, drafter.min_ngram)
        want = want[: int(max_draft[i])]
        n = int(prop.n_draft[i])
        assert n == len(want), (i, h, want, prop.tokens[i], n)
        assert prop.tokens[i, :n].tolist() == want, (i, h)
        # q is the distribution the token was drawn from: a point mass on it.
        np.testing.assert_array_equal(prop.q[i, np.arange(n), prop.tokens[i, :n]], 1.0)


@pytest.mark.parametrize("max_n,min_n,k", [(3, 1, 4), (2, 2, 3), (4, 2, 5), (1, 1, 2), (5, 3, 1)])
def test_random_histories_match_reference(max_n, min_n, k):
    rng = np.random.default_rng(100 * max_n + 10 * min_n + k)
    b, width = 3000, 24
    hists = random_histories(rng, b, width, vocab_max=4)
    max_draft = rng.integers(0, k + 1, size=b)
    max_draft[: b // 2] = k  # half the rows uncapped, so caps do not hide the lookup itself
    drafter = NgramDrafter(max_n, min_n, vocab_size=4)
    prop = propose(drafter, hists, k, max_draft=max_draft, width=width)
    check_against_reference(drafter, hists, k, max_draft, prop)
    n = prop.n_draft
    # The sample really covers every case: no match, a full k read from the history, a repetition whose period
    # is shorter than k (extended), and rows capped by max_draft below what the lookup found.
    found = np.array([len(ref_lookup(h, k, max_n, min_n)[0]) for h in hists])
    assert np.any(found == 0) and np.any(found == k)
    if k > 1:
        periods = [_period(h, max_n, min_n) for h in hists]
        assert any(0 < p < k for p in periods) and any(p >= k for p in periods)
    assert np.any(n < found)


def _period(hist, max_n, min_n) -> int:
    """How many tokens follow the reference's occurrence in the history (0: no match)."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(hist):
            continue
        for i in range(len(hist) - n - 1, -1, -1):
            if hist[i : i + n] == hist[len(hist) - n :]:
                return len(hist) - i - n
    return 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=16), min_size=1, max_size=6),
    st.integers(0, 3),
)
def test_hypothesis_histories_match_reference(hists, cap):
    drafter = NgramDrafter(3, 1, vocab_size=3)
    b = 6
    padded = hists + [[0]] * (b - len(hists))  # fixed [6, 16] shapes: one compilation for all examples
    max_draft = np.full((b,), cap)
    prop = propose(drafter, padded, 3, max_draft=max_draft, width=16)
    check_against_reference(drafter, padded, 3, max_draft, prop)


def test_ragged_batch_each_row_its_own_count():
    """One batch, rows that draft 0, 2 and 4 tokens (a match drafts K unless capped), checked against hand values
    and the reference."""
    hists = [
        [1, 2, 3, 4, 1, 2],  # "1 2" at 0 -> 3 4 1 2 -> 4 tokens
        [1, 2, 3, 4, 5, 6],  # nothing repeats -> 0
        [9, 8, 7, 9, 8],  # "9 8" at 0 -> 7 9 8 follow, then the period again -> 7 9 8 7
        [5, 5],  # "5" at 0 -> 5 follows: a loop of period 1 -> 5 5 5 5
        [1, 2, 3, 1, 2, 3, 4, 5, 6, 7],  # "7" never seen before -> 0
        [6, 1, 2, 6, 1, 2],  # "6 1 2" at 0 -> 6 1 2 -> 3, capped to 2
        [3, 1, 3, 1, 3, 1, 3, 1],  # "1 3 1" latest earlier start 3 -> 3 1 follow -> 3 1 3 1
    ]
    max_draft = np.array([4, 4, 4, 4, 4, 2, 4])
    drafter = NgramDrafter(3, 1, vocab_size=10)
    prop = propose(drafter, hists, 4, max_draft=max_draft, width=12)
    assert prop.n_draft.tolist() == [4, 0, 4, 4, 0, 2, 4]
    assert prop.tokens[0].tolist() == [3, 4, 1, 2]
    assert prop.tokens[2].tolist() == [7, 9, 8, 7]
    assert prop.tokens[3].tolist() == [5, 5, 5, 5]
    assert prop.tokens[5, :2].tolist() == [6, 1]
    assert prop.tokens[6].tolist() == [3, 1, 3, 1]
    check_against_reference(drafter, hists, 4, max_draft, prop)


def test_drafter_is_static_and_validated():
    a, b = NgramDrafter(3, 1, vocab_size=7), NgramDrafter(3, 1, vocab_size=7)
    assert a == b and hash(a) == hash(b)  # equal configs share one compilation of the decoder
    assert NgramDrafter(vocab_size=7).max_ngram == 3
    with pytest.raises(ValueError):
        NgramDrafter(2, 3, vocab_size=7)
    with pytest.raises(ValueError):
        NgramDrafter(2, 0, vocab_size=7)
    # The tree form checks the same n-gram range and its own shape (a min above the max never proposes).
    for args, message in (((3, 2, 1, 2), "min_ngram <= max_ngram"), ((0, 2), "branches >= 1"), ((2, 0), "depth >= 1")):
        with pytest.raises(ValueError, match=message):
            NgramTreeDrafter(*args, vocab_size=7)
    # Counts are integers: True was read as 1, and 2.5 failed at trace time in range().
    for make, message in (
        (lambda: NgramDrafter(True, vocab_size=7), "max_ngram must be an integer, got True"),
        (lambda: NgramDrafter(2.5, vocab_size=7), "max_ngram must be an integer, got 2.5"),
        (lambda: NgramDrafter(vocab_size=7.0), "vocab_size must be an integer"),
        (lambda: NgramTreeDrafter(2, 2.5, vocab_size=7), "depth must be an integer, got 2.5"),
        (lambda: NgramTreeDrafter(np.bool_(True), vocab_size=7), "branches must be an integer"),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    assert NgramDrafter(np.int64(3), vocab_size=np.int32(7)) == a  # NumPy ints are ints


# ---- greedy: speculative output == plain output ----


@pytest.mark.fast
def test_greedy_identical_to_plain_decoding():
    # Period 1: the greedy next token is a function of the last two tokens, so the output falls into a cycle
    # that the lookups find, and also leaves it where the prompt misleads them (rejections).
    table = random_table(seed=3, vocab=5, period=1)
    target, params = make_table_model(table, "toy-greedy")
    prompts = [[0, 1, 2, 0, 1, 2, 0, 1], [3, 4], [2, 2, 1, 4, 2, 2, 1, 4, 2, 2, 1], [4, 3, 2, 1, 0, 4, 3]]
    plain = decode(target, params, prompts, drafter=None, max_new_tokens=[40, 33, 27, 40])
    for k in (1, 4):
        drafter = NgramDrafter(3, 1, vocab_size=5)
        spec = decode(target, params, prompts, drafter=drafter, gamma=k, max_new_tokens=[40, 33, 27, 40])
        assert spec.tokens == plain.tokens
        assert spec.stop_reason == plain.stop_reason
        assert spec.stats["accepted"] > 0
        assert spec.stats["loop_rounds"] < plain.stats["loop_rounds"]
        assert spec.stats["acceptance_rate"] < 1.0  # some proposals were wrong: the rejection path ran too


def test_vocab_mismatch_is_refused():
    target, params = make_table_model(random_table(0, 4, 1))
    with pytest.raises(ValueError, match="vocab"):
        decode(target, params, [[1, 2]], drafter=NgramDrafter(vocab_size=5), gamma=2, max_new_tokens=3)


# ---- sampling: the whole-sequence distribution is the target's ----


@dataclasses.dataclass(frozen=True)
class MisreportedNgram(Drafter):
    """A deliberately WRONG scheme for the power check: the same deterministic proposals, but q is reported
    as ``w`` on the proposed token and the rest spread over the others. w -> 0 makes verification accept
    every proposal the target allows (p(x) >= q(x)); w = 0.9 is a subtler 10% misreport."""

    inner: NgramDrafter
    w: float

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def init(self, *args):
        return self.inner.init(*args)

    def propose(self, params, state, ctx, key, k):
        prop = self.inner.propose(params, state, ctx, key, k)
        q = prop.q * self.w + (1 - prop.q) * (1 - self.w) / (self.vocab_size - 1)
        return dataclasses.replace(prop, q=q)


N_ROWS = 100_000
N_NEW = 5
PROMPT = [0, 1, 2, 0, 1, 2, 0, 1]  # every suffix n-gram of it and of most continuations has occurred before
SAMPLING_CASES = [dict(temperature=0.7, top_k=2), dict(temperature=1.3, top_p=0.8), dict(temperature=1.0)]


@functools.cache
def dist_target():
    """One table and one Model object for every sampling case: the decoder compiles once per drafter."""
    table = random_table(seed=11, vocab=3, period=2, scale=1.2)
    return table, *make_table_model(table, "toy-dist")


def sample_rows(drafter, sampling, seed):
    _, target, params = dist_target()
    prompts = np.tile(np.asarray(PROMPT, np.int32), (N_ROWS, 1))
    out = decode(
        target, params, prompts, drafter=drafter, gamma=3, max_new_tokens=N_NEW, max_len=16, seed=seed, **sampling
    )
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (N_ROWS, N_NEW)
    return tokens, out.stats


def test_sampled_sequences_follow_the_target_distribution():
    table = dist_target()[0]
    drafter = NgramDrafter(3, 1, vocab_size=3)
    for i, sampling in enumerate(SAMPLING_CASES):
        exact = exact_sequence_distribution(table, PROMPT, N_NEW, **sampling)
        tokens, stats = sample_rows(drafter, sampling, seed=i)
        # Not vacuous: most rows draft every round, and both acceptances and rejections happen often.
        assert stats["proposed"] > 2 * N_ROWS
        assert 0.2 < stats["acceptance_rate"] < 0.9
        stat, df = chi_square(tokens, exact)
        assert stat < chi2_critical(df), (sampling, stat, df, chi2_critical(df))


@pytest.mark.parametrize("case,w", [(0, 1e-6), (1, 0.9)])
def test_distribution_check_has_power(case, w):
    """The same statistic, with the same seeds, on a scheme that misreports q must exceed the critical value:
    the test above would catch a lossy drafter, even one whose q is only 10% off."""
    table = dist_target()[0]
    sampling = SAMPLING_CASES[case]
    exact = exact_sequence_distribution(table, PROMPT, N_NEW, **sampling)
    tokens, _ = sample_rows(MisreportedNgram(NgramDrafter(3, 1, vocab_size=3), w), sampling, seed=case)
    stat, df = chi_square(tokens, exact)
    assert stat > chi2_critical(df), (sampling, stat, df, chi2_critical(df))
