"""Adaptive draft length: each row picks its K from its own measured acceptance, on device.

The row estimates its per-token acceptance a as a ratio of exponential moving sums, accepted / tested: a chain
tests its proposals up to the first rejection, so a round with n accepted of k proposed tested min(n + 1, k).
This is the geometric maximum-likelihood estimate; accepted / proposed would count the untested proposals after
a rejection as failures (a = 0.5 at K = 4 read as ~0.23), and an average of per-round ratios is biased too
(~0.32). Each round the row picks the k in [min_k, K] that maximises the seed's cost model: expected tokens per
round E[N] = 1 + a + ... + a^k divided by the round's cost relative to one plain step. The cost is what the loop
really runs: a round that proposes anything drafts all K steps and verifies K + 1 positions (the shapes are
static), 1 + K * (draft_cost + verify_cost), whatever k a row keeps; only a round in which no row proposes is a
plain 1-token step (for a drafter that always verifies wide, EAGLE, a K + 1-wide one without the draft). So a
smaller k saves nothing and only cuts accepted tokens: the choice is K, or 0 when K does not pay (the row stops
proposing; its estimate then drifts back towards ``prior`` so the row probes again later instead of staying off
for good). Changing K never changes what is sampled (verification is lossless for any proposal count), only how
fast."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """Static policy. Costs are relative to one plain target step (decode is memory-bound, so a step costs
    about the bytes it reads): draft_cost per proposed token (~0 for n-gram lookup, ~0.1-0.4 for a draft
    model, see shared notes), verify_cost per extra verified position (a 5-token verify measured ~1.3x a
    1-token step on CPU: 0.075 per token)."""

    beta: float = 0.7  # EMA weight of the past
    draft_cost: float = 0.0
    verify_cost: float = 0.075
    prior: float = 0.6  # starting estimate, and where an idle row's estimate drifts back to
    min_k: int = 0  # 0 lets a row stop speculating; 1 keeps it always proposing
    drift: float = 0.05  # per idle round, towards the prior

    def __post_init__(self):
        # Out of these ranges the estimate stops learning (beta = 1) or diverges (beta > 1 or < 0), and a
        # negative cost can make a round cost nothing or less. (A min_k above K is refused by prepare.)
        for name, lo, hi, hi_open in (
            ("beta", 0.0, 1.0, True),
            ("prior", 0.0, 1.0, False),
            ("drift", 0.0, 1.0, False),
            ("draft_cost", 0.0, float("inf"), True),
            ("verify_cost", 0.0, float("inf"), True),
        ):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (lo <= v and (v < hi if hi_open else v <= hi))
            ):
                raise ValueError(
                    f"AdaptiveK.{name} must be a number in [{lo}, {hi}{')' if hi_open else ']'}, got {v!r}"
                )
        if isinstance(self.min_k, bool) or not isinstance(self.min_k, int) or self.min_k < 0:
            raise ValueError(f"AdaptiveK.min_k must be an int >= 0, got {self.min_k!r}")


def init(policy: AdaptiveK | None, batch: int):
    """[B, 2] (accepted, tested) moving sums at the prior: one tested token accepted with probability prior."""
    prior = policy.prior if policy is not None else 1.0
    return jnp.tile(jnp.asarray([[prior, 1.0]], jnp.float32), (batch, 1))


def estimate(ema):
    """[B, 2] moving sums -> [B] per-token acceptance estimates."""
    return ema[:, 0] / jnp.maximum(ema[:, 1], 1e-6)


def choose_k(policy: AdaptiveK, ema, k_max: int, always_wide: bool = False):
    """ema [B, 2] (accepted, tested) moving sums -> [B] int32 draft lengths: K, or 0 where K does not pay (never
    below ``policy.min_k``). ``always_wide``: the drafter verifies K + 1 positions even in a round without
    proposals (EAGLE reads the verification's features), so a round at 0 costs 1 + K * verify_cost, not 1."""
    on = _k_pays(policy, jnp.clip(estimate(ema), 0.0, 0.999), k_max, always_wide) | (policy.min_k > 0)
    return jnp.where(on, k_max, 0).astype(jnp.int32)


def _k_pays(policy: AdaptiveK, a, k_max: int, always_wide: bool):
    """Estimates ``a`` in [0, 0.999] (an array on device, or a float on the host) -> does K beat proposing
    nothing: tokens per unit of round cost, E[N] / cost(K) against 1 / cost(0)."""
    expected = (1.0 - a ** (k_max + 1.0)) / (1.0 - a)  # 1 + a + ... + a^K
    # Any k >= 1 runs the whole K-step draft and the K+1-wide verification (see the module doc).
    cost_k = 1.0 + k_max * (policy.draft_cost + policy.verify_cost)
    cost_0 = 1.0 + k_max * policy.verify_cost if always_wide else 1.0
    return expected / cost_k > 1.0 / cost_0


def pays(policy: AdaptiveK, a: float, k_max: int, always_wide: bool = False) -> bool:
    """Host-side ``choose_k`` for one estimate ``a``: does K beat proposing nothing?"""
    return bool(_k_pays(policy, min(max(float(a), 0.0), 0.999), k_max, always_wide))


def update(policy: AdaptiveK, ema, n_accepted, n_proposed, active):
    """Fold this round's outcome into the estimate of rows that proposed; idle rows drift to the prior. A chain
    tests proposals until the first rejection, so n_accepted of min(n_accepted + 1, n_proposed) were tested."""
    tested = jnp.minimum(n_accepted + 1, n_proposed)
    now = jnp.stack([n_accepted, tested], axis=1).astype(jnp.float32)
    moved = policy.beta * ema + (1.0 - policy.beta) * now
    a = estimate(ema)
    drifted = a + policy.drift * (policy.prior - a)  # the estimate moves, the weight (tested) stays
    idle = jnp.stack([drifted * ema[:, 1], ema[:, 1]], axis=1)
    proposed = (active & (n_proposed > 0))[:, None]
    return jnp.where(proposed, moved, jnp.where(active[:, None], idle, ema))
