"""The seed's worked example and cost model (DIGEST sections 2 and 3), checked against exact maths.

Expected values are derived here from the definitions (``fractions.Fraction``), never read off the code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from fractions import Fraction
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jspec import cost_model as cm
from jspec.verify import acceptance_prob, accepted_mass, residual, verify_chain

pytestmark = pytest.mark.fast  # the fast tier: make test-fast

ROOT = Path(__file__).resolve().parents[1]

# The seed's example, as exact fractions.
P = (Fraction(1, 2), Fraction(3, 10), Fraction(1, 5))
Q = (Fraction(3, 5), Fraction(1, 10), Fraction(3, 10))


def _run_example(*args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


# ---------------------------------------------------------------- examples, run as a user would


def test_cost_model_example_prints_seed_table():
    lines = _run_example("examples/cost_model.py")
    row08 = next(line for line in lines if line.startswith("alpha=0.8"))
    row09 = next(line for line in lines if line.startswith("alpha=0.9"))
    for needle in ("d=1 ms", "E[N]=3.3616", "cycle 18 ms", "5.355 ms/token", "speedup 1.868x"):
        assert needle in row08, (needle, row08)
    for needle in ("d=3 ms", "E[N]=4.0951", "cycle 26 ms", "6.349 ms/token", "speedup 1.575x"):
        assert needle in row09, (needle, row09)


def test_cost_model_example_measured_inputs():
    lines = _run_example(
        "examples/cost_model.py", "--accept-at", "0.9,0.8,0.7,0.6", "--draft-ms", "1", "--measured-speedup", "1.5"
    )
    text = "\n".join(lines)
    # 1 + .9 + .72 + .504 + .3024 = 3.4264; 18 / 3.4264 = 5.2533; 10 / 5.2533 = 1.9036; / 1.5 = 1.2691
    assert "E[N]=3.4264" in text and "5.253 ms/token" in text and "speedup 1.904x" in text, text
    assert "predicted / measured 1.269" in text, text
    lines = _run_example("examples/cost_model.py", "--alpha", "0.5", "--gamma", "2", "--draft-ms", "0")
    # 1 + .5 + .25 = 1.75; cycle 0 + 12 + 2 = 14; 14 / 1.75 = 8; 10 / 8 = 1.25
    assert any("E[N]=1.7500" in x and "cycle 14 ms" in x and "8.000 ms/token" in x and "1.250x" in x for x in lines)


def test_seed_example_prints_the_worked_example():
    lines = _run_example("examples/seed_example.py")
    for expected in (
        "accepted mass [0.5, 0.1, 0.2]",
        "acceptance 0.8",
        "residual [0.0, 1.0, 0.0]",
        "reconstructed [0.5, 0.3, 0.2]",
        "A accepted (0.7 < 0.833)",
        "C rejected (0.9 >= 0.667)",
        "discard ['C', 'B']",
        "correction drawn from the residual = B",
        "emit ['A', 'B']",
    ):
        assert expected in lines, (expected, lines)
    probs = next(line for line in lines if line.startswith("acceptance probabilities"))
    assert probs.endswith("[0.833, 1.0, 0.667] = 5/6, 1, 2/3"), probs
    # The replay stops at the first rejection: no verdict is printed for the third proposal.
    assert not any(line.startswith("B accepted") or line.startswith("B rejected") for line in lines)


# ---------------------------------------------------------------- the A/B/C example, exactly


def test_abc_example_exact_fractions_in_float64():
    exp_accept = [min(Fraction(1), p / q) for p, q in zip(P, Q)]
    exp_mass = [min(p, q) for p, q in zip(P, Q)]
    exp_total = sum(exp_mass)
    pos = [max(Fraction(0), p - q) for p, q in zip(P, Q)]
    exp_resid = [x / sum(pos) for x in pos]
    # Independent sanity of the hand derivation itself (the seed's numbers).
    assert exp_accept == [Fraction(5, 6), 1, Fraction(2, 3)]
    assert exp_mass == [Fraction(1, 2), Fraction(1, 10), Fraction(1, 5)] and exp_total == Fraction(4, 5)
    assert exp_resid == [0, 1, 0]

    with jax.enable_x64(True):
        p = jnp.asarray([float(x) for x in P], jnp.float64)
        q = jnp.asarray([float(x) for x in Q], jnp.float64)
        got_accept, got_mass, got_resid = acceptance_prob(p, q), accepted_mass(p, q), residual(p, q)
        got_total = jnp.sum(got_mass)
        assert got_accept.dtype == got_mass.dtype == got_resid.dtype == jnp.float64
        got = {
            "accept": np.asarray(got_accept).tolist(),
            "mass": np.asarray(got_mass).tolist(),
            "total": [float(got_total)],
            "resid": np.asarray(got_resid).tolist(),
        }
    for name, exp in (("accept", exp_accept), ("mass", exp_mass), ("total", [exp_total]), ("resid", exp_resid)):
        assert len(got[name]) == len(exp)
        for g, e in zip(got[name], exp):
            assert abs(g - float(e)) < 1e-12, (name, g, e)
            assert Fraction(g).limit_denominator(100) == e, (name, g, e)
    # Reconstruction p = accepted mass + (1 - acceptance) * residual, exactly in fractions and in float64.
    assert [m + (1 - exp_total) * r for m, r in zip(exp_mass, exp_resid)] == list(P)
    recon = np.asarray(got["mass"]) + (1 - got["total"][0]) * np.asarray(got["resid"])
    np.testing.assert_allclose(recon, [float(x) for x in P], rtol=0, atol=1e-12)


def test_abc_replay_through_verify_chain():
    """The seed's replay: draft A, C, B; uniforms 0.7, 0.9, 0.2; final draw 0.2 -> emit A, B."""
    a, b, c = 0, 1, 2
    p = jnp.broadcast_to(jnp.asarray([float(x) for x in P], jnp.float32), (1, 4, 3))
    q = jnp.broadcast_to(jnp.asarray([float(x) for x in Q], jnp.float32), (1, 3, 3))
    res = jax.jit(verify_chain)(
        p,
        q,
        jnp.asarray([[a, c, b]], jnp.int32),
        jnp.asarray([3], jnp.int32),
        jnp.asarray([[0.7, 0.9, 0.2]], jnp.float32),
        jnp.asarray([0.2], jnp.float32),
    )
    assert int(res.n_accepted[0]) == 1
    assert int(res.next_token[0]) == b  # residual (0, 1, 0): any final draw gives B
    # 0.2 < 1 = a(B) would accept B, but it follows the rejected C: it must not count.
    assert np.asarray(res.accepted[0]).tolist()[:2] == [True, False]
    assert not bool(res.bad_proposal[0])


def test_a_proposal_count_past_k_reads_as_all_k():
    """K = 2, both proposals accepted (p puts all its mass on them): the bonus token comes from p at position 2,
    [0.5, 0, 0.5], where the final uniform 0.9 lands on token 2. A count of 5 proposals made the rows look
    unfinished, and the bonus came from residual(p[2], q[1]) = [0.5, 0, 0] (token 0) instead."""
    from jspec.verify import verify_block

    p = jnp.asarray([[[1.0, 0, 0], [0, 1.0, 0], [0.5, 0, 0.5]]])
    q = jnp.asarray([[[1.0, 0, 0], [0, 0.5, 0.5]]])
    draft, u, uf = jnp.asarray([[0, 1]]), jnp.asarray([[0.5, 0.5]]), jnp.asarray([0.9])
    for fn in (verify_chain, verify_block):
        for n in (2, 5):
            res = fn(p, q, draft, jnp.asarray([n]), u, uf)
            assert (int(res.n_accepted[0]), int(res.next_token[0])) == (2, 2), (fn.__name__, n)


# ---------------------------------------------------------------- properties on the simplex


@st.composite
def _pq(draw):
    v = draw(st.integers(2, 50))
    kind = draw(st.sampled_from(["random", "equal", "onehot_q", "onehot_both", "disjoint"]))

    def simplex(allow_zeros=True):
        w = np.asarray(draw(st.lists(st.floats(0.0, 1.0), min_size=v, max_size=v)), np.float64)
        if allow_zeros:
            zeros = np.asarray(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
            w = np.where(zeros, 0.0, w)
        if w.sum() <= 1e-6:
            w[draw(st.integers(0, v - 1))] = 1.0
        return w / w.sum()

    def onehot():
        return np.eye(v)[draw(st.integers(0, v - 1))]

    p = simplex()
    if kind == "random":
        q = simplex()
    elif kind == "equal":
        q = p.copy()
    elif kind == "onehot_q":
        q = onehot()
    elif kind == "onehot_both":
        p = onehot()
        q = onehot()
    else:  # disjoint supports: nothing is ever accepted
        i = draw(st.integers(0, v - 1))
        p, q = np.eye(v)[i], np.eye(v)[(i + 1) % v]
    return p.astype(np.float32), q.astype(np.float32), kind


@jax.jit
def _rule(p, q):
    # One compilation per V instead of one per eager op and V: keeps 200 examples fast.
    return acceptance_prob(p, q), accepted_mass(p, q), residual(p, q)


@settings(max_examples=200, deadline=None)
@given(_pq())
def test_acceptance_rule_properties(pq):
    p_np, q_np, kind = pq
    a, mass, r = (np.asarray(x) for x in _rule(jnp.asarray(p_np), jnp.asarray(q_np)))
    total = float(mass.sum())
    for arr in (a, mass, r):
        assert np.all(np.isfinite(arr)), (p_np, q_np, arr)
    assert np.all((a >= 0) & (a <= 1)) and np.all(r >= 0)
    # Lossless: accept-then-correct reproduces p.
    np.testing.assert_allclose(mass + (1.0 - total) * r, p_np, rtol=0, atol=1e-5)
    # a(x) * q(x) is the chance x is proposed AND accepted.
    np.testing.assert_allclose(a * q_np, mass, rtol=0, atol=1e-6)
    if total < 1.0 - 1e-6:
        assert abs(float(r.sum()) - 1.0) < 1e-5
        assert np.all(r[p_np <= q_np] == 0)  # corrections only where the proposer under-samples
    if kind == "equal" or (kind == "onehot_both" and np.array_equal(p_np, q_np)):
        assert np.all(a == 1.0)  # p == q: never 0/0, never a rejection
    if kind == "disjoint":
        assert total == 0.0 and np.array_equal(r, p_np)


# ---------------------------------------------------------------- Monte Carlo of verify_chain


N_DRAWS = 1 << 18  # 262,144


@jax.jit
def _first_tokens(key):
    """One proposal per row (K = 1) drawn from q, verified against p: [N] first emitted token, [N] accepted,
    and the token a WRONG rule would emit (resample from p, not the residual, after a rejection)."""
    p1 = jnp.asarray([float(x) for x in P], jnp.float32)
    q1 = jnp.asarray([float(x) for x in Q], jnp.float32)
    k_draft, k_acc, k_fin = jax.random.split(key, 3)
    # Drafting with jax.random directly, not jspec's sampler: the proposals must really follow q.
    draft = jax.random.categorical(k_draft, jnp.log(q1), shape=(N_DRAWS,)).astype(jnp.int32)
    u_acc = jax.random.uniform(k_acc, (N_DRAWS, 1))
    u_fin = jax.random.uniform(k_fin, (N_DRAWS,))
    p = jnp.broadcast_to(p1, (N_DRAWS, 2, 3))
    q = jnp.broadcast_to(q1, (N_DRAWS, 1, 3))
    res = verify_chain(p, q, draft[:, None], jnp.ones((N_DRAWS,), jnp.int32), u_acc, u_fin)
    ok = res.n_accepted == 1
    first = jnp.where(ok, draft, res.next_token)
    naive = jnp.where(ok, draft, jax.random.categorical(k_fin, jnp.log(p1), shape=(N_DRAWS,)))
    return first, ok, naive


def _within_4_se(tokens: np.ndarray, expected: np.ndarray) -> bool:
    freq = np.bincount(tokens, minlength=3) / tokens.size
    se = np.sqrt(expected * (1 - expected) / tokens.size)
    return bool(np.all(np.abs(freq - expected) < 4 * se))


def test_verify_chain_first_token_follows_p():
    first, ok, naive = jax.device_get(_first_tokens(jax.random.key(0)))
    expected = np.asarray([float(x) for x in P])
    freq = np.bincount(first, minlength=3) / N_DRAWS
    assert _within_4_se(first, expected), freq
    # The acceptance rate is sum_x min(p, q) = 4/5.
    assert abs(ok.mean() - 0.8) < 4 * np.sqrt(0.8 * 0.2 / N_DRAWS), ok.mean()
    # The same check must reject the naive rule (its A-frequency is 1/2 + 1/5 * 1/2 = 0.6): the test has teeth.
    assert not _within_4_se(naive, expected)


# ---------------------------------------------------------------- cost model


def _exact_row(alpha: Fraction, gamma: int, d: Fraction, verify=Fraction(12), state=Fraction(2), base=Fraction(10)):
    e_n = sum(alpha**i for i in range(gamma + 1))
    cycle = gamma * d + verify + state
    return e_n, cycle, cycle / e_n, base / (cycle / e_n)


@pytest.mark.parametrize(
    "alpha, d, printed",
    [
        (Fraction(4, 5), Fraction(1), ("3.3616", 18, "5.355", "1.868")),
        (Fraction(9, 10), Fraction(3), ("4.0951", 26, "6.349", "1.575")),
    ],
)
def test_seed_table(alpha, d, printed):
    e_n, cycle, ms_tok, sp = _exact_row(alpha, 4, d)
    # The seed's printed (rounded) values agree with the exact maths...
    assert (f"{float(e_n):.4f}", cycle, f"{float(ms_tok):.3f}", f"{float(sp):.3f}") == printed
    # ...and the library matches the exact maths.
    r = cm.predict(baseline_ms_per_token=10, draft_ms=float(d), verify_ms=12, state_ms=2, gamma=4, alpha=float(alpha))
    for got, exp in ((r.expected_tokens, e_n), (r.cycle_ms, cycle), (r.ms_per_token, ms_tok), (r.speedup, sp)):
        assert abs(got - float(exp)) < 1e-12, (got, exp)
    assert abs(cm.expected_tokens_per_round(float(alpha), 4) - float(e_n)) < 1e-12
    assert cm.cycle_time(4, float(d), 12, 2) == float(cycle)
    assert abs(cm.time_per_token(float(cycle), float(e_n)) - float(ms_tok)) < 1e-12
    assert abs(cm.speedup(10, float(ms_tok)) - float(sp)) < 1e-12
    assert r.gamma == 4 and r.accept_at == (float(alpha),) * 4
    assert abs(r.ratio_to(float(sp) / 2) - 2.0) < 1e-12


@pytest.mark.parametrize("gamma", [0, 1, 3, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
def test_per_position_equal_rates_match_iid(alpha, gamma):
    exact = float(sum(Fraction(alpha) ** i for i in range(gamma + 1)))
    assert abs(cm.expected_tokens_per_round(alpha, gamma) - exact) < 1e-12
    assert abs(cm.expected_tokens_from_positions([alpha] * gamma) - exact) < 1e-12
    iid = cm.predict(baseline_ms_per_token=10, draft_ms=1, verify_ms=12, state_ms=2, gamma=gamma, alpha=alpha)
    pos = cm.predict(baseline_ms_per_token=10, draft_ms=1, verify_ms=12, state_ms=2, accept_at=[alpha] * gamma)
    assert iid == pos


def test_per_position_rates_hand_computed():
    # 1 + .9 + .9*.5 + .9*.5*.2 = 2.44
    assert abs(cm.expected_tokens_from_positions([0.9, 0.5, 0.2]) - 2.44) < 1e-12
    # Tuning gamma on the same measurements: the first two positions only -> 1 + .9 + .45 = 2.35.
    r = cm.predict(baseline_ms_per_token=10, draft_ms=1, verify_ms=12, state_ms=2, gamma=2, accept_at=[0.9, 0.5, 0.2])
    assert r.gamma == 2 and abs(r.expected_tokens - 2.35) < 1e-12 and r.cycle_ms == 16
    with pytest.raises(ValueError, match="gamma=4"):
        cm.predict(baseline_ms_per_token=10, draft_ms=1, verify_ms=12, gamma=4, accept_at=[0.9, 0.5, 0.2])
    with pytest.raises(ValueError, match="exactly one"):
        cm.predict(baseline_ms_per_token=10, draft_ms=1, verify_ms=12, gamma=2, alpha=0.5, accept_at=[0.5, 0.5])
    with pytest.raises(ValueError):
        cm.expected_tokens_from_positions([0.5, 1.5])
    with pytest.raises(ValueError):
        cm.expected_tokens_per_round(float("nan"), 3)


def test_rates_from_hand_built_decode_stats():
    # K = 3. Ten rounds draft all 3: n_accepted = 0 (x2), 1 (x3), 2 (x1), 3 (x4).
    # jspec.decode counts every drafted position as proposed and the accepted prefix as accepted:
    #   accepted_at = [#(n>=1), #(n>=2), #(n>=3)] = [8, 5, 4], proposed_at = [10, 10, 10].
    # E[N] = 1 + mean(n_accepted) = 1 + (0*2 + 1*3 + 2*1 + 3*4) / 10 = 2.7; rates 8/10, 5/8, 4/5.
    full = {"accepted_at": [8, 5, 4], "proposed_at": [10, 10, 10], "tokens_per_round": 99.0}
    np.testing.assert_allclose(
        cm.conditional_rates_from_stats(full["accepted_at"], full["proposed_at"]), [0.8, 0.625, 0.8]
    )
    assert abs(cm.expected_tokens_from_stats(full) - 2.7) < 1e-12
    # Five more rounds could draft only 1 (token budget): 4 accepted, 1 rejected. Same underlying rates, so
    # the estimate must not move: accepted_at = [12, 5, 4], proposed_at = [15, 10, 10].
    mixed = {"accepted_at": [12, 5, 4], "proposed_at": [15, 10, 10]}
    np.testing.assert_allclose(cm.survival_from_stats(mixed["accepted_at"], mixed["proposed_at"]), [0.8, 0.5, 0.4])
    np.testing.assert_allclose(cm.conditional_rates_from_stats(**mixed), [0.8, 0.625, 0.8])
    assert abs(cm.expected_tokens_from_stats(mixed) - 2.7) < 1e-12
    # The same rounds counted where a position is proposed only once the earlier ones were accepted.
    reached = types.SimpleNamespace(accepted_at=np.array([12, 5, 4]), proposed_at=np.array([15, 8, 5]))
    np.testing.assert_allclose(
        cm.conditional_rates_from_stats([12, 5, 4], [15, 8, 5], proposed="reached"), [0.8, 0.625, 0.8]
    )
    assert abs(cm.expected_tokens_from_stats(reached, proposed="reached") - 2.7) < 1e-12
    # Positions never drafted are not extrapolated; a position nobody survived to adds 0, without 0/0.
    assert cm.conditional_rates_from_stats([3, 0, 0], [4, 0, 0]).tolist() == [0.75]
    assert abs(cm.expected_tokens_from_stats({"accepted_at": [3, 0, 0], "proposed_at": [4, 0, 0]}) - 1.75) < 1e-12
    assert cm.conditional_rates_from_stats([0, 0], [5, 5]).tolist() == [0.0, 0.0]
    assert cm.expected_tokens_from_stats({"accepted_at": [0, 0], "proposed_at": [5, 5]}) == 1.0
    with pytest.raises(ValueError):
        cm.conditional_rates_from_stats([6, 0], [5, 5])  # more accepted than proposed


def test_rates_from_stats_match_a_real_decode():
    """Ties the helper to what jspec.decode really records: when every round drafts all K (rows end by EOS,
    far from the token budget and the cache), 1 + accepted / rounds is E[N] exactly."""
    from toy_models import make_table_model, random_table

    from jspec.decode import decode
    from jspec.drafters import ModelDrafter

    k, eos, budget = 3, 3, 300
    table = random_table(1, 4, 3)
    table[..., eos] -= 2.0  # rows run ~tens of tokens, then stop at EOS
    draft_table = 0.5 * table + 0.5 * random_table(2, 4, 3)  # a drafter that agrees only partly
    target, tparams = make_table_model(table, "target")
    draft_model, dparams = make_table_model(draft_table, "draft")
    out = decode(
        target,
        tparams,
        [[1, 2]] * 32,
        drafter=ModelDrafter(draft_model),
        draft_params=dparams,
        gamma=k,
        max_new_tokens=budget,
        temperature=1.0,
        eos_ids=(eos,),
        seed=0,
    )
    assert all(r.name == "EOS" for r in out.stop_reason) and max(out.lengths) < budget - k - 1
    rounds = sum(out.stats["rounds"])
    assert out.stats["proposed_at"] == [rounds] * k  # every round drafted all K
    measured = 1 + out.stats["accepted"] / rounds
    assert 0.1 < out.stats["acceptance_rate"] < 0.95  # neither trivial case
    assert abs(cm.expected_tokens_from_stats(out.stats) - measured) < 1e-12
    # Reading these counts as already-conditional rates would be wrong here, and measurably so.
    assert abs(cm.expected_tokens_from_stats(out.stats, proposed="reached") - measured) > 0.05
