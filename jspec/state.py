"""The decode loop's types: its static configuration, its state on device, and the result on the host.

Statistics (``DecodeStats``), per row:
- rounds: verification rounds the row took part in (the first token, sampled at prefill, is not a round).
- emitted: tokens the rounds appended (accepted proposals + one correction/bonus token each, after EOS /
  length truncation); ``tokens_per_round = emitted / rounds``.
- proposed: candidate tokens proposed to the target; accepted: how many of them the target accepted.
- acceptance rate = accepted / proposed: the fraction of proposed candidates that were kept. It is not
  the useful output per round (that is tokens_per_round, which also counts the correction/bonus token).
- accepted_at[i] / proposed_at[i] (summed over rows): candidates accepted / proposed at draft position i.
  For a tree, position i is depth i + 1 and proposed_at counts its candidate nodes, of which at most one is
  accepted: the rate is a fraction of nodes (at most 1 / the branching), not a chain's conditional
  acceptance, so ``jspec.cost_model``'s expected-token formulas do not apply to tree statistics.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from jspec.adaptive import AdaptiveK
from jspec.goodput import GoodputK
from jspec.sampling import SamplingParams


class StopReason(enum.IntEnum):
    RUNNING = 0
    EOS = 1  # an end token: one of eos_ids or of the row's stop_token_ids
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3
    IDLE = 4  # no request in this row (the serving engine's free rows)
    STOP_STRING = 5  # one of the request's stop strings (host-side: ``jspec.stop``, the engine and the CLI)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static loop configuration: changing any field recompiles. Everything per call is an array.

    gamma: K, the (maximum) number of candidates per round; 0 = plain autoregressive decoding.
    slots: S, cache slots per row: the prompt and every generated token but the last (never fed back) must fit,
      P + N <= S + 1.
    eos_ids: token ids that end a row (the EOS token is emitted, nothing after it).
    debug_checks: check invariants on device (a proposal with q(x) == 0 raises).
    adaptive: per-row draft length policy (``jspec.adaptive.AdaptiveK``); None = always K.
    goodput: the batch's draft length chosen each round from a static set by measured costs
      (``jspec.goodput.GoodputK``; gamma is its largest K); None = always K.
    block_verify: verify chains jointly (``jspec.verify.verify_block``) instead of token by token.
    logprobs: keep the target's log-probability of every generated token (``DecodeOutput.logprobs``).
    top_logprobs: N, also keep the N most likely tokens and their log-probabilities at every generated position
      (``DecodeOutput.top_logprobs``; OpenAI's ``top_logprobs``, vLLM's ``logprobs=N``); needs ``logprobs``.
    penalties: keep per-row token counts ([B, V]) so that the rows' repetition / presence / frequency penalties
      apply; without it they are not applied (``prepare`` sets it when a row asks for one, ``Engine.add`` refuses
      a penalty without it).
    constrain: optional ``DecodeState -> DecodeState`` applied after prefill and after every round, e.g. to pin
      shardings of the loop state with ``jax.lax.with_sharding_constraint`` (see ``sharding``).
    """

    gamma: int
    slots: int
    eos_ids: tuple[int, ...] = ()
    debug_checks: bool = False
    adaptive: AdaptiveK | None = None
    block_verify: bool = False
    constrain: Any = None
    logprobs: bool = False
    top_logprobs: int = 0
    penalties: bool = False
    goodput: GoodputK | None = None

    def __post_init__(self):
        if self.top_logprobs and not self.logprobs:  # the alternatives are read from the logprobs' logits
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        if self.goodput is not None and (self.goodput.k_max != self.gamma or self.adaptive is not None):
            raise ValueError("a goodput policy's largest K is the loop's gamma, and it replaces the adaptive policy")

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The K a round may run: the goodput policy's set, else gamma alone."""
        return self.goodput.ks if self.goodput is not None else (self.gamma,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """A validated call's per-call arrays (``jspec.validate`` builds them): new values never recompile."""

    prompt: jax.Array  # [B, P] right-padded to a multiple of 16
    prompt_len: jax.Array  # [B]
    max_new: jax.Array  # [B]
    sampling: SamplingParams
    key: jax.Array  # one PRNG key, or [B] (a stream per row)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStats:
    rounds: jax.Array  # [B]
    emitted: jax.Array  # [B]
    proposed: jax.Array  # [B]
    accepted: jax.Array  # [B]
    accepted_at: jax.Array  # [K]
    proposed_at: jax.Array  # [K]
    loop_rounds: jax.Array  # [] while-loop iterations (max over rows of rounds)
    wide_rounds: jax.Array  # [] iterations that verified wide (K+1 positions, or a tree's N nodes)
    k_rounds: jax.Array  # [J] iterations run at each draft length of ``DecodeConfig.draft_lengths``


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes during decoding. ``seq`` holds prompt + generated tokens per row; its last
    valid entry (``seq_len - 1``) is the pending token, emitted but not yet in the target cache."""

    seq: jax.Array  # [B, S+1]
    seq_len: jax.Array  # [B]
    prompt_len: jax.Array  # [B]
    max_new: jax.Array  # [B]
    cache: Any  # target cache; committed lengths = seq_len - 1
    draft_state: Any
    sampling: SamplingParams
    key: jax.Array
    stop: jax.Array  # [B] StopReason
    stats: DecodeStats
    bad_proposal: jax.Array  # [] bool, some row proposed a token its drafter gave q(x) == 0
    # [B, 2] float32, the adaptive draft length's (accepted, tested) moving sums; [B, 4] with a goodput policy: its
    # short and long pairs of sums (``jspec.goodput.update``)
    accept_ema: jax.Array
    # [B, S+1] float32: the target's log-probability of the token at each slot of ``seq`` (generated slots only;
    # [B, 0] unless ``DecodeConfig.logprobs``)
    logprob: jax.Array
    # [B, S+1, N] int32 / float32: the N most likely tokens at each generated slot of ``seq`` and their
    # log-probabilities, most likely first ([B, 0, 0] unless ``DecodeConfig.top_logprobs``)
    top_ids: jax.Array
    top_logprob: jax.Array
    # [B, V] int32: how often each token occurs among the generated tokens (the pending one included); [B, V] bool:
    # the token occurs in the prompt ([B, 0] both unless ``DecodeConfig.penalties``)
    out_counts: jax.Array
    prompt_seen: jax.Array


@dataclasses.dataclass
class DecodeOutput:
    """Host-side result. ``tokens[b]`` are row b's generated ids (the prompt excluded), EOS included."""

    tokens: list[list[int]]
    stop_reason: list[StopReason]
    stats: dict[str, Any]
    # logprobs[b][i]: the target's log-probability of tokens[b][i] (raw logits, temperature 1); with logprobs=True
    logprobs: list[list[float]] | None = None
    # top_logprobs[b][i]: the N most likely (token id, log-probability) pairs where tokens[b][i] was generated,
    # most likely first (the same raw distribution); with top_logprobs=N
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def cut(self, row: int, n: int, reason: StopReason) -> None:
        """Keep row ``row``'s first ``n`` tokens (and their log-probabilities) and end it with ``reason``: a
        stop string found on the host after the device ran the round to its end."""
        self.tokens[row], self.stop_reason[row] = self.tokens[row][:n], reason
        if self.logprobs is not None:
            self.logprobs[row] = self.logprobs[row][:n]
        if self.top_logprobs is not None:
            self.top_logprobs[row] = self.top_logprobs[row][:n]


def top_pairs(ids: np.ndarray, lps: np.ndarray) -> list[list[tuple[int, float]]]:
    """[T, N] ids and log-probabilities -> T lists of N (id, log-probability) pairs."""
    return [list(zip(i.tolist(), p.tolist())) for i, p in zip(ids, lps)]


def to_output(st: DecodeState) -> DecodeOutput:
    """Host-side tokens, stop reasons and statistics from a final ``DecodeState`` (blocks until ready)."""
    seq, seq_len, plen, stop, lp = jax.device_get((st.seq, st.seq_len, st.prompt_len, st.stop, st.logprob))
    top = jax.device_get((st.top_ids, st.top_logprob)) if st.top_ids.shape[1] else None
    stats = jax.device_get(st.stats)
    tokens = [seq[i, plen[i] : seq_len[i]].tolist() for i in range(seq.shape[0])]
    logprobs = [lp[i, plen[i] : seq_len[i]].tolist() for i in range(seq.shape[0])] if lp.shape[1] else None
    proposed = int(stats.proposed.sum())
    accepted = int(stats.accepted.sum())
    rounds = int(stats.rounds.sum())
    emitted = int(stats.emitted.sum())
    out_stats = {
        "new_tokens": [len(t) for t in tokens],
        "rounds": stats.rounds.tolist(),
        "loop_rounds": int(stats.loop_rounds),
        "tokens_per_round": emitted / rounds if rounds else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "accepted_at": stats.accepted_at.tolist(),
        "proposed_at": stats.proposed_at.tolist(),
        "k_rounds": stats.k_rounds.tolist(),  # loop rounds at each draft length the loop may choose
    }
    tops = None
    if top is not None:
        tops = [top_pairs(top[0][i, plen[i] : seq_len[i]], top[1][i, plen[i] : seq_len[i]]) for i in range(len(tokens))]
    return DecodeOutput(tokens, [StopReason(int(r)) for r in stop], out_stats, logprobs, tops)
