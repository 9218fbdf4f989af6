"""Goodput-driven draft length: each round the whole batch drafts the K, from a small static set, that maximises
the tokens it expects to commit per unit of time.

A round's cost is paid per batch, not per row: a K+1-token verification costs the same whether one row or every
row proposes, and at large batches (or on small CPUs) it is compute-bound, so one row proposing makes the whole
batch pay for it. So K is chosen for the batch, from the measured cost of a round at each K on this device, model,
layout and batch size (``jspec.costs``, relative to a plain step), and each running row's acceptance estimate:

    K* = argmax_K  sum over running rows of E[N_row(K)]  /  cost(K),    E[N(K)] = 1 + a + ... + a^K

(Leviathan et al.'s expected tokens per round, the seed's cost model with measured costs): the throughput of a
serving engine, whose rows are refilled as they end. A fixed batch (``decode``) ends with its last row, and a row
that ends early only waits: there the objective is the expected time until the last running row ends,
max over rows of remaining_row / E[N_row(K)] rounds at cost(K) each ("makespan"). K = 0 is a plain step:
nothing is drafted, and a stateful drafter only keeps up with the committed tokens (``Drafter.observe``). The set
is static (one compiled round per K, chosen on device each round with ``jspec.rounds.switch_in_place``); the costs
are static numbers of the compiled batch. Whatever is chosen, verification is the same lossless rule, so only the
speed changes.

The per-row estimate is two pairs of accepted / tested moving sums (``jspec.adaptive``'s estimate): a short one
(``beta``) that the choice reads, and a long one (``beta_long``), the row's acceptance over many rounds. While a row
does not propose (the batch is at K = 0) its short estimate drifts towards its long one (``drift`` a round), and the
long one, much more slowly, towards ``prior`` (``drift_long``). So a batch that stopped speculating tries again
soon where its rows accepted in the past (a copy that paused), and only now and then where they did not: with one
constant drift to the prior, the estimate came back over the threshold a few rounds after each failed probe, and
at batch 8 on chat a third of the rounds were K = 1 probes that mostly failed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jspec import adaptive as adapt

OBJECTIVES = ("throughput", "makespan")


@dataclasses.dataclass(frozen=True)
class GoodputK:
    """Static policy: the K set and the measured round cost at each K (``costs[i]`` for ``ks[i]``, relative to
    a plain step at the same batch, cache size and context; ``jspec.costs.CostTable.policy`` builds it). beta,
    beta_long, prior, drift, drift_long: the rows' acceptance estimates (``update``)."""

    ks: tuple[int, ...]
    costs: tuple[float, ...]
    # "throughput": the batch's tokens per unit of time (a serving engine, whose rows are refilled as they end);
    # "makespan": the time until the last row ends (a fixed batch, ``decode``: rows that end early just wait).
    objective: str = "throughput"
    beta: float = 0.7
    prior: float = 0.6
    drift: float = 0.05
    beta_long: float = 0.95
    drift_long: float = 0.005
    # A round at K > 0 is chosen only where it beats a plain step with its cost raised by this fraction: the
    # tables are medians of a few timed rounds, and a choice at the break-even point gains nothing when right and
    # loses the cost's error when wrong.
    margin: float = 0.1

    def __post_init__(self):
        ks, costs = tuple(self.ks), tuple(self.costs)
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ks):
            raise ValueError(f"GoodputK.ks must be ints >= 0, got {self.ks!r}")
        if list(ks) != sorted(set(ks)):
            raise ValueError(f"GoodputK.ks must be increasing without repeats, got {self.ks!r}")
        if len(costs) != len(ks):
            raise ValueError(f"GoodputK has {len(ks)} draft lengths but {len(costs)} costs")
        if any(isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0 for c in costs):
            raise ValueError(f"GoodputK.costs must be finite numbers > 0 (a round's time / a plain step's): {costs!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"GoodputK.objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, hi_open in (
            ("beta", True),
            ("beta_long", True),
            ("prior", False),
            ("drift", False),
            ("drift_long", False),
            ("margin", False),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (0 <= v and (v < 1 if hi_open else v <= 1)):
                raise ValueError(f"GoodputK.{name} must be a number in [0, 1{')' if hi_open else ']'}, got {v!r}")
        object.__setattr__(self, "ks", ks)
        object.__setattr__(self, "costs", tuple(float(c) for c in costs))

    @property
    def k_max(self) -> int:
        return self.ks[-1]


def init(policy: GoodputK, batch: int) -> jax.Array:
    """[B, 4]: the short and the long (accepted, tested) moving sums, both at the prior (one tested token accepted
    with probability ``prior``)."""
    return jnp.tile(jnp.asarray([[policy.prior, 1.0, policy.prior, 1.0]], jnp.float32), (batch, 1))


def update(policy: GoodputK, ema: jax.Array, n_accepted: jax.Array, tried: jax.Array, active: jax.Array) -> jax.Array:
    """Fold a round into ``ema`` [B, 4] (see ``init``). Rows that tried (``tried`` [B] > 0 candidates; a prompt
    lookup that missed counts as one failed test) move both pairs of sums by what they tested: a chain tests until
    its first rejection, so n_accepted of min(n_accepted + 1, tried). Running rows that did not try drift: the short
    estimate towards the long one, the long one towards the prior, each keeping its weight. Stopped rows keep
    theirs."""
    short, long = ema[:, :2], ema[:, 2:]
    tested = jnp.minimum(n_accepted + 1, tried)
    now = jnp.stack([n_accepted, tested], axis=1).astype(jnp.float32)
    a_short, a_long = adapt.estimate(short), adapt.estimate(long)

    def drifted(sums, a, towards, rate):
        return jnp.stack([(a + rate * (towards - a)) * sums[:, 1], sums[:, 1]], axis=1)

    did, running = (active & (tried > 0))[:, None], active[:, None]
    short = jnp.where(
        did,
        policy.beta * short + (1.0 - policy.beta) * now,
        jnp.where(running, drifted(short, a_short, a_long, policy.drift), short),
    )
    long = jnp.where(
        did,
        policy.beta_long * long + (1.0 - policy.beta_long) * now,
        jnp.where(running, drifted(long, a_long, policy.prior, policy.drift_long), long),
    )
    return jnp.concatenate([short, long], axis=1)


def expected_tokens(a: jax.Array, ks: tuple[int, ...]) -> jax.Array:
    """a [B] acceptance estimates in [0, 1) -> [B, J] expected tokens per round at each K: 1 + a + ... + a^K."""
    k = jnp.asarray(ks, jnp.float32)[None, :]
    a = a[:, None]
    return (1.0 - a ** (k + 1.0)) / (1.0 - a)


def choose(policy: GoodputK, ema: jax.Array, active: jax.Array, remaining: jax.Array | None = None) -> jax.Array:
    """[] int32: the index into ``policy.ks`` of the K that serves the policy's objective best, from the rows'
    (accepted, tested) moving sums ``ema`` [B, 2] (or ``init``'s [B, 4], whose short pair is read), which rows
    run (``active`` [B]) and, for "makespan", the tokens each may still generate (``remaining`` [B]).
    throughput: the most expected tokens of the running rows per unit of cost. makespan: the least expected time
    until the last running row ends, max over rows of remaining / E[N_row(K)] rounds times cost(K). Every cost at
    K > 0 is raised by ``policy.margin``. The first (smallest K) wins a tie; with no running row that is ks[0]."""
    a = jnp.clip(adapt.estimate(ema), 0.0, 0.999)
    expected = expected_tokens(a, policy.ks)  # [B, J]
    costs = jnp.asarray([c * (1.0 + policy.margin * (k > 0)) for k, c in zip(policy.ks, policy.costs)], jnp.float32)
    if policy.objective == "makespan":
        need = jnp.maximum(remaining, 1).astype(jnp.float32)[:, None] / expected  # [B, J] rounds left
        rounds = jnp.max(jnp.where(active[:, None], need, 0.0), axis=0)  # the last row's
        return jnp.argmin(rounds * costs).astype(jnp.int32)
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), axis=0)  # [J]
    return jnp.argmax(tokens / costs).astype(jnp.int32)
