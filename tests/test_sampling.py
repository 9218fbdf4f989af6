"""Sampling transforms against an independent float64 reference written from the definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_models import ref_transform

from jspec.sampling import distribution, sample, sample_from
from jspec.validate import sampling_params

pytestmark = pytest.mark.fast  # the fast tier: make test-fast

CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.7, top_k=1),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, top_p=0.5),
    dict(temperature=0.9, top_k=10, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.2, top_k=20, top_p=0.95, min_p=0.05),
    dict(temperature=0.0),
    dict(temperature=0.0, top_k=3, top_p=0.5),
]


def test_distribution_matches_reference_per_row():
    """All cases as rows of ONE batch: per-row parameters really are per row."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(CASES), 3, 50)) * 2.5  # [B, T, V]
    cols = {k: [c.get(k, d) for c in CASES] for k, d in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0))}
    cols["min_p"] = [c.get("min_p", 0.0) for c in CASES]
    params = sampling_params(len(CASES), **cols)
    got = np.asarray(distribution(jnp.asarray(logits, jnp.float32), params))
    for b, case in enumerate(CASES):
        for t in range(3):
            want = ref_transform(logits[b, t], **case)
            np.testing.assert_allclose(got[b, t], want, atol=2e-6, err_msg=str(case))
            assert abs(got[b, t].sum() - 1) < 1e-5


def test_greedy_is_one_hot_on_argmax():
    logits = jnp.asarray([[0.1, 3.0, 3.0, -1.0]])
    probs = distribution(logits, sampling_params(1, temperature=0.0))
    assert np.asarray(probs).tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first maximal index on ties


def test_changing_parameters_does_not_recompile():
    traces = []

    @jax.jit
    def f(logits, params):
        traces.append(1)
        return distribution(logits, params)

    logits = jnp.ones((2, 8))
    for t, k, p, m in [(0.0, 0, 1.0, 0.0), (0.7, 3, 0.9, 0.0), (1.3, 0, 0.5, 0.2), (1.0, 7, 1.0, 0.0)]:
        f(logits, sampling_params(2, t, k, p, m)).block_until_ready()
    assert len(traces) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=[0.5, 0.5, 0.5]), "shape"),
        # Nothing cast silently: the int32 cast would wrap 2**32 + 3 to 3; True is not 1.0, "0.7" not 0.7.
        (dict(top_k=2**32 + 3), "top_k is out of range"),
        (dict(temperature=True), "temperature must be numbers"),
        (dict(temperature="0.7"), "temperature must be numbers"),
        (dict(top_p=[0.9, None]), "top_p must be numbers"),
        # A bool inside a list: numpy would promote [True, 40] to [1, 40] and [0.7, True] to [0.7, 1.0].
        (dict(top_k=[True, 40]), "top_k must be integers"),
        (dict(temperature=[0.7, True]), "temperature must be numbers"),
        (dict(top_k=[np.array(True), 40]), "top_k must be integers"),
        # Past int64: the cast would wrap 2**63 to -2**63, whose abs is still negative.
        (dict(top_k=2**63), "top_k is out of range"),
        (dict(top_k=float(2**63)), "top_k is out of range"),
        (dict(top_k=-(2**63)), "top_k is out of range"),
        # Positive, but 0 in float32: the row would run greedy.
        (dict(temperature=[0.7, 1e-50]), "temperature 1e-50 is below float32's smallest normal value"),
        (dict(temperature=1e-40), "temperature 1e-40 is below float32's smallest normal value"),  # subnormal
    ],
)
def test_bad_sampling_parameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampling_params(2, **kwargs)


def test_tiny_positive_temperature_is_the_greedy_limit_not_nan():
    """At T -> 0+ the distribution tends to one-hot on the argmax (uniform over a tie): logits / T alone
    overflowed to +-inf there, and the softmax's inf - inf made the whole row NaN (then token 0 forever)."""
    # At T = 2e-38 logits / T is +inf in row 0 and -inf everywhere in row 1; 25 - 2**-18 is ~4e3 temperatures
    # below the max at T = 1e-9 (e**-4e3 is 0 in float32).
    logits = jnp.asarray([[-3.0, 25.0, 24.9, -1e4, 25.0 - 2.0**-18], [-20.0, -27.0, -20.0, -50.0, -23.0]])
    for t in (2e-38, 1e-37, 1e-9):
        probs = np.asarray(distribution(logits, sampling_params(2, t)))
        np.testing.assert_array_equal(probs, [[0, 1, 0, 0, 0], [0.5, 0, 0.5, 0, 0]])


def test_inverse_cdf_draw():
    probs = jnp.asarray([[0.0, 0.5, 0.0, 0.5]] * 4)
    u = jnp.asarray([0.0, 0.49, 0.5, 0.999999])
    assert np.asarray(sample_from(probs, u)).tolist() == [1, 1, 3, 3]
    # A zero-probability token is never returned, even at the top of the range.
    assert int(sample_from(jnp.asarray([0.3, 0.7, 0.0]), jnp.asarray(0.9999999))) == 1


def test_sample_frequencies():
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    n = 200_000
    draws = np.asarray(sample(jax.random.key(3), jnp.broadcast_to(p, (n, 4))))
    freq = np.bincount(draws, minlength=4) / n
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) < 4 * se), (freq, p)


def test_argmax_matches_numpy_including_ties():
    from jspec.sampling import argmax

    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(6, 5, 50)).astype(np.float32)  # few distinct values: many ties
    x[0, 0] = 7.0  # a row that is all one value
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
    y = rng.standard_normal((3, 49152)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(y))), np.argmax(y, axis=-1))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_matches_a_stable_sort_including_ties_and_neg_inf(k):
    """Reference: numpy's stable argsort of -x (descending values, lower index first among equals)."""
    from jspec.sampling import top_k

    rng = np.random.default_rng(4)
    x = rng.integers(0, 3, size=(4, 3, 20)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf  # a row with nothing finite: the k lowest indices
    x[1, 1, 5:] = -np.inf  # fewer finite entries than k = 8
    vals, idx = top_k(jnp.asarray(x), k)
    want = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.asarray(idx), want)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want, axis=-1))
    y = rng.standard_normal((2, 49152)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(top_k(jnp.asarray(y), k)[1]), np.argsort(-y, axis=-1)[..., :k])


def test_filters_keep_tie_groups_whole_and_match_the_reference_on_vocab_rows():
    """The threshold searches (bisection, no sort) against the float64 reference: logits with few distinct
    values, where top-k and top-p cut through tie groups (the whole group is kept), a row whose filtered set
    is every token, and SmolLM2-sized rows (V = 49152) with top-k 50 / top-p 0.9 / min-p."""
    rng = np.random.default_rng(5)
    ties = rng.integers(0, 5, size=(4, 2, 40)).astype(np.float64)
    ties[3, 1] = 1.0  # one value everywhere: every filter keeps all 40
    cases = [dict(temperature=1.0, top_k=7), dict(temperature=0.8, top_p=0.6),
             dict(temperature=1.0, top_k=12, top_p=0.7), dict(temperature=1.0, top_k=3, top_p=0.3)]  # fmt: skip
    big = rng.normal(size=(2, 1, 49152)) * 3.0
    big_cases = [dict(temperature=1.0, top_k=50, top_p=0.9), dict(temperature=0.7, top_p=0.95, min_p=0.02)]
    for logits, cs in ((ties, cases), (big, big_cases)):
        cols = {k: [c.get(k, d) for c in cs] for k, d in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
        params = sampling_params(len(cs), [c["temperature"] for c in cs], **cols)
        got = np.asarray(distribution(jnp.asarray(logits, jnp.float32), params))
        for b, case in enumerate(cs):
            for t in range(logits.shape[1]):
                want = ref_transform(logits[b, t], **case)
                np.testing.assert_array_equal(got[b, t] > 0, want > 0, err_msg=str(case))
                np.testing.assert_allclose(got[b, t], want, atol=2e-6, err_msg=str(case))
    assert 1 < np.count_nonzero(got[0, 0]) < 50  # top-p 0.9 cut inside the top 50 of a broad row


def test_bench_sampler_agrees_with_its_sort_based_reference(capsys, tmp_path):
    """examples/bench_sampler.py checks that both filters keep the same tokens before it times them."""
    import re

    from example_scripts import load_example

    bench_sampler = load_example("bench_sampler")
    argv = ["--vocab", "300", "--shapes", "2x3,1x1", "--repeats", "1", "--out", str(tmp_path / "sampler.json")]
    assert bench_sampler.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.search(r"\d+x \(\d", line)]
    assert len(rows) == 6  # 2 shapes x 3 filter settings, each with its speed-up (min-max)
    assert (tmp_path / "sampler.json").exists()


def test_a_row_without_filters_is_the_same_whatever_its_batch_filters():
    """Whether the filters ran was decided for the whole batch, and an unfiltered row that went through them
    was renormalised a second time: its probabilities moved by an ulp or so with the other rows' settings, so
    a fixed seed could sample another token at batch 8 than at batch 1. Compared bit for bit."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 4, 49152)) * 2.0, jnp.float32)
    for t in (0.6, 1.3):
        alone = np.asarray(distribution(logits[:1], sampling_params(1, temperature=t)))
        for other in (dict(top_k=[0, 7]), dict(top_p=[1.0, 0.8]), dict(min_p=[0.0, 0.1])):
            mixed = np.asarray(distribution(logits, sampling_params(2, temperature=t, **other)))
            np.testing.assert_array_equal(mixed[0], alone[0], err_msg=str(other))
            if "top_p" not in other:  # the filtered row is still filtered (the reference's top-p is slow at V)
                one = {k: v[1] for k, v in other.items()}
                want = ref_transform(np.asarray(logits[1, 0], np.float64), temperature=t, **one)
                np.testing.assert_allclose(mixed[1, 0], want, atol=2e-6)
            else:
                assert np.count_nonzero(mixed[1, 0]) < np.count_nonzero(alone[0, 0])


def test_a_draw_never_lands_on_a_zero_mass_token_where_the_cdf_dips():
    """jnp.cumsum runs as a parallel scan (reduce_window): across runs of zero-mass tokens its entries can dip by
    an ulp (thousands of dips on these rows). Uniforms placed inside such dips (found by hand from the cdf the
    draw itself computes) made the old rule (count the cdf entries <= target) return a token of probability 0
    every time; the draw must always return a token with mass, and the one an exact cdf picks."""
    rng = np.random.default_rng(0)
    probs = rng.random((16, 49152)).astype(np.float32)
    probs[rng.random(probs.shape) < 0.95] = 0  # what a top-p / min-p filter leaves
    cdf = np.asarray(jnp.cumsum(jnp.asarray(probs), axis=-1))
    rows, us = [], []
    for r in range(len(probs)):
        for i in np.nonzero(np.diff(cdf[r]) < 0)[0][:20]:
            lo, hi = cdf[r, i + 1], cdf[r, i]
            u = np.float32((np.float64(lo) + np.float64(hi)) / 2 / np.float64(cdf[r, -1]))
            if lo <= np.float32(u * cdf[r, -1]) < hi:  # the draw's own target falls inside the dip
                rows.append(r)
                us.append(u)
    assert len(rows) > 50
    got = np.asarray(sample_from(jnp.asarray(probs[rows]), jnp.asarray(np.asarray(us, np.float32))))
    assert np.all(probs[rows, got] > 0)
    # Exact reference: the first token whose float64 cdf passes the target, up to the float32 cdf's rounding
    # (these targets sit inside an ulp-sized dip by construction, so either side of it is a correct draw).
    exact = np.cumsum(probs[rows].astype(np.float64), axis=-1)
    target = np.asarray(us, np.float64) * cdf[rows, -1]
    eps = 1e-5 * cdf[rows, -1]
    lo = np.argmax(exact > (target - eps)[:, None], axis=-1)
    hi = np.argmax(exact > (target + eps)[:, None], axis=-1)
    assert np.all((lo <= got) & (got <= hi))
