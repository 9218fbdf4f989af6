"""The seed's cost model for linear-chain speculation (Leviathan et al. 2023, sec. 3.1), in plain Python.

One round drafts gamma candidates (gamma draft steps of ``draft_ms`` each), runs ONE target call over the
gamma + 1 positions (``verify_ms``) and updates the state (``state_ms``: commit/rollback of caches, host
bookkeeping). It emits the accepted prefix plus one correction/bonus token, N tokens in all, so

    cycle        = gamma * draft_ms + verify_ms + state_ms
    ms per token = cycle / E[N]
    speedup      = baseline ms per token (plain decoding) / ms per token.

With i.i.d. acceptance alpha (the paper's assumption, no early stop) E[N] = 1 + alpha + ... + alpha^gamma.
Acceptance really varies with the draft position and the task, so the model also takes MEASURED
per-position conditional rates a_1..a_K (E[N] = 1 + a_1 + a_1 a_2 + ... + a_1...a_K), and
``conditional_rates_from_stats`` derives them from jspec's decode statistics. Predictions are for rounds
that draft all gamma candidates and are not cut short by EOS or the token budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CostModelResult",
    "conditional_rates_from_stats",
    "cycle_time",
    "expected_tokens_from_positions",
    "expected_tokens_from_stats",
    "expected_tokens_per_round",
    "predict",
    "speedup",
    "survival_from_stats",
    "time_per_token",
]


def _check_rate(x: float, name: str) -> float:
    x = float(x)
    if not (0.0 <= x <= 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be a probability in [0, 1], got {x}")
    return x


def _check_ms(x: float, name: str) -> float:
    x = float(x)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{name} must be a finite time >= 0 ms, got {x}")
    return x


def _check_gamma(gamma: int) -> int:
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 0:
        raise ValueError(f"gamma (draft length K) must be an integer >= 0, got {gamma!r}")
    return int(gamma)


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[N] = 1 + alpha + ... + alpha^gamma: tokens emitted per round (correction/bonus included) when each
    of the gamma candidates is accepted independently with probability alpha."""
    alpha = _check_rate(alpha, "alpha")
    gamma = _check_gamma(gamma)
    # The direct sum, not (1 - alpha^(gamma+1)) / (1 - alpha): exact at alpha == 1 (gamma + 1 tokens).
    return float(sum(alpha**i for i in range(gamma + 1)))


def expected_tokens_from_positions(accept_at: Sequence[float]) -> float:
    """E[N] from per-position conditional acceptance: accept_at [K], where accept_at[i] is the probability
    that candidate i is accepted given that candidates 0..i-1 were. E[N] = 1 + a_1 + a_1 a_2 + ... .

    Equal rates alpha reproduce ``expected_tokens_per_round(alpha, K)``."""
    total, survive = 1.0, 1.0
    for i, a in enumerate(accept_at):
        survive *= _check_rate(a, f"accept_at[{i}]")
        total += survive  # P(the first i+1 candidates are all accepted) = E[1{candidate i is emitted}]
    return total


def _counts(accepted_at, proposed_at) -> tuple[np.ndarray, np.ndarray]:
    acc = np.asarray(accepted_at, dtype=np.float64).reshape(-1)
    prop = np.asarray(proposed_at, dtype=np.float64).reshape(-1)
    if acc.shape != prop.shape:
        raise ValueError(f"accepted_at {acc.shape} and proposed_at {prop.shape} must have the same length K")
    if not (np.all(np.isfinite(acc)) and np.all(np.isfinite(prop))) or np.any(acc < 0) or np.any(acc > prop):
        raise ValueError(
            f"need finite counts with 0 <= accepted_at <= proposed_at, got {acc.tolist()} / {prop.tolist()}"
        )
    # A round that drafts position i also drafts every earlier position, so only a leading run of positions
    # has measurements; past it there is nothing to estimate from (and no 0/0 to compute).
    measured = int(np.argmin(prop > 0)) if np.any(prop <= 0) else prop.size
    return acc[:measured], prop[:measured]


def survival_from_stats(accepted_at: Sequence[int], proposed_at: Sequence[int]) -> np.ndarray:
    """[K] counts -> [K'] s_i = accepted_at[i] / proposed_at[i], K' = leading positions with proposals.

    In ``jspec.decode`` every DRAFTED position counts as proposed, also those after a rejection in the same
    round (the chain is verified in one call), while a position counts as accepted only inside the accepted
    prefix. So s_i = P(candidates 0..i all accepted | the round drafted position i), the survival
    probability, not a conditional rate; E[N] = 1 + sum_i s_i.
    """
    acc, prop = _counts(accepted_at, proposed_at)
    return acc / prop


def conditional_rates_from_stats(
    accepted_at: Sequence[int], proposed_at: Sequence[int], *, proposed: str = "drafted"
) -> np.ndarray:
    """Per-position decode counts [K] -> conditional acceptance rates [K'] for ``expected_tokens_from_positions``.

    proposed="drafted" (what ``jspec.decode`` records, see ``survival_from_stats``): a_i = s_i / s_{i-1}.
      Rows that drafted fewer than K (cache room, token budget, a drafter with nothing to propose) are out of
      both counts at the missing positions, so s_i only averages over rounds that drafted position i. This
      assumes acceptance does not depend on how many candidates a round drafted (true when the budget cuts
      the draft; only an estimate for drafters whose draft length follows their confidence).
    proposed="reached": counts where a position is proposed only after all earlier ones were accepted;
      then accepted_at[i] / proposed_at[i] is already the conditional rate.

    K' < K when the last positions were never proposed: nothing measures them, so nothing is extrapolated.
    A position that no round survived to gets rate 0 (it can only contribute 0 to E[N]).
    """
    acc, prop = _counts(accepted_at, proposed_at)
    if proposed == "reached":
        return acc / prop
    if proposed != "drafted":
        raise ValueError(f"proposed must be 'drafted' or 'reached', got {proposed!r}")
    surv = acc / prop
    before = np.concatenate([[1.0], surv[:-1]])
    rates = np.divide(surv, before, out=np.zeros_like(surv), where=before > 0)
    # Averaging over different sets of rounds per position can push a ratio a hair above 1.
    return np.clip(rates, 0.0, 1.0)


def _stat(stats: Any, name: str):
    if isinstance(stats, Mapping):
        return stats[name]
    return getattr(stats, name)


def expected_tokens_from_stats(stats: Mapping[str, Any] | Any, *, proposed: str = "drafted") -> float:
    """E[N] per full round from a ``DecodeOutput.stats`` dict or a ``DecodeStats`` (anything with
    ``accepted_at`` and ``proposed_at`` [K]) of a chain drafter (a tree's count candidate nodes per depth: use
    its measured tokens per round instead)."""
    rates = conditional_rates_from_stats(_stat(stats, "accepted_at"), _stat(stats, "proposed_at"), proposed=proposed)
    return expected_tokens_from_positions(rates)


def cycle_time(gamma: int, draft_ms: float, verify_ms: float, state_ms: float) -> float:
    """Milliseconds per round: gamma sequential draft steps + one verification call + the state update."""
    gamma = _check_gamma(gamma)
    return gamma * _check_ms(draft_ms, "draft_ms") + _check_ms(verify_ms, "verify_ms") + _check_ms(state_ms, "state_ms")


def time_per_token(cycle_ms: float, expected_tokens: float) -> float:
    """Milliseconds per emitted token: cycle / E[N] (E[N] >= 1: every round emits at least one token)."""
    if not expected_tokens >= 1.0:
        raise ValueError(f"expected tokens per round must be >= 1, got {expected_tokens}")
    return _check_ms(cycle_ms, "cycle_ms") / expected_tokens


def speedup(baseline_ms_per_token: float, ms_per_token: float) -> float:
    """Plain decoding's ms/token over speculative decoding's ms/token (> 1: speculation pays)."""
    base = _check_ms(baseline_ms_per_token, "baseline_ms_per_token")
    if not (math.isfinite(ms_per_token) and ms_per_token > 0):
        raise ValueError(f"ms_per_token must be finite and > 0, got {ms_per_token}")
    return base / ms_per_token


@dataclasses.dataclass(frozen=True)
class CostModelResult:
    """One prediction. accept_at [gamma] are the conditional rates used (all alpha in the i.i.d. form)."""

    gamma: int
    accept_at: tuple[float, ...]
    expected_tokens: float  # E[N] per round
    cycle_ms: float
    ms_per_token: float
    baseline_ms_per_token: float
    speedup: float

    def ratio_to(self, measured_speedup: float) -> float:
        """predicted / measured speedup: 1 means the model explains the measurement; > 1 means overheads
        the model leaves out (or mis-measured costs) eat part of the predicted gain."""
        if not (math.isfinite(measured_speedup) and measured_speedup > 0):
            raise ValueError(f"measured_speedup must be finite and > 0, got {measured_speedup}")
        return self.speedup / measured_speedup

    def summary(self) -> str:
        return (
            f"gamma={self.gamma} E[N]={self.expected_tokens:.4f} cycle {self.cycle_ms:g} ms "
            f"{self.ms_per_token:.3f} ms/token speedup {self.speedup:.3f}x"
        )


def predict(
    *,
    baseline_ms_per_token: float,
    draft_ms: float,
    verify_ms: float,
    state_ms: float = 0.0,
    gamma: int | None = None,
    alpha: float | None = None,
    accept_at: Sequence[float] | None = None,
) -> CostModelResult:
    """Predicted speedup of chain speculation over plain decoding.

    Give either ``alpha`` and ``gamma`` (i.i.d. acceptance) or ``accept_at`` [K], measured conditional
    rates per draft position (e.g. ``conditional_rates_from_stats``). With ``accept_at``, gamma defaults to
    K; a smaller gamma predicts a shorter draft from the same measurements (tuning gamma), a larger one is
    refused (those positions were never measured). Times are measured milliseconds: per draft step, per
    verification call (gamma + 1 positions), per state update, and per token of plain decoding.
    """
    if (alpha is None) == (accept_at is None):
        raise ValueError("give exactly one of alpha (i.i.d. acceptance) and accept_at (per-position rates)")
    if alpha is not None:
        if gamma is None:
            raise ValueError("the i.i.d. form needs gamma")
        gamma = _check_gamma(gamma)
        rates = (_check_rate(alpha, "alpha"),) * gamma
    else:
        rates = tuple(_check_rate(a, f"accept_at[{i}]") for i, a in enumerate(accept_at))
        gamma = len(rates) if gamma is None else _check_gamma(gamma)
        if gamma > len(rates):
            raise ValueError(f"gamma={gamma} needs acceptance rates for {gamma} positions, got {len(rates)}")
        rates = rates[:gamma]
    e_n = expected_tokens_from_positions(rates)
    cycle = cycle_time(gamma, draft_ms, verify_ms, state_ms)
    ms_tok = time_per_token(cycle, e_n)
    base = _check_ms(baseline_ms_per_token, "baseline_ms_per_token")
    return CostModelResult(gamma, rates, e_n, cycle, ms_tok, base, speedup(base, ms_tok))
