"""Decoding round by round from Python: ``DecodeStream`` (what ``jspec.decode.decode_stream`` returns) and the
stop strings that need the text between rounds (``run_with_stop_strings``). Each step runs the same
``jspec.loop.decode_round`` as the fused loop, so the tokens are identical; the host sees them after every round
(time-to-first-token, inter-token latency, text-level stops) at the price of a host sync per round.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jspec.state import DecodeOutput, StopReason, to_output, top_pairs
from jspec.stop import StopStrings


@functools.partial(jax.jit, static_argnums=2)
def tail_rows(x: jax.Array, end: jax.Array, width: int) -> jax.Array:
    """x [B, W, ...], end [B] -> [B, width, ...]: row b's entries end[b] - width .. end[b] - 1 (clamped at 0), on
    device, so that a step's few new log-probabilities travel to the host instead of every row's whole history."""
    idx = jnp.maximum(end[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :], 0)
    return jax.vmap(lambda row, i: row[i])(x, idx)


class DecodeStream(Iterator[list[list[int]]]):
    """The iterator ``decode_stream`` returns (and ``sharding``'s streams): ``next()`` runs one step (prefill
    first, then one round) and returns the tokens each row emitted in it; it stops after the step in which the
    last running row stopped.

    After a step: ``stop_reasons[b]`` is row b's ``StopReason`` (RUNNING while it decodes; the finish reason a
    server reports when a row's last tokens arrive), ``logprobs[b]`` the target's log-probabilities of the tokens
    the step gave row b (with ``logprobs=True``, else None), ``top_logprobs[b]`` their alternatives (with
    ``top_logprobs=N``, else None), and ``output()`` the ``DecodeOutput`` of the state so far, equal to ``decode``'s
    once the stream is exhausted.

    ``to_host`` fetches (small per-row) device arrays to numpy and ``gather`` turns a state into a
    ``DecodeOutput``: multi-process callers pass collectives, so every process must step the stream alike."""

    def __init__(self, pre, step, args, logprobs: bool, to_host=jax.device_get, gather=None, top: bool = False):
        self._pre, self._step, self._args = pre, step, args
        self._to_host, self._gather = to_host, gather or to_output
        self._want_logprobs = bool(logprobs)
        self._want_top = bool(top)
        self.top_logprobs: list[list[list[tuple[int, float]]]] | None = None
        self._st = None  # the latest state; the round donates it, so only the newest one is ever read
        self._done = False
        self._failed = False
        self.stop_reasons: list[StopReason] | None = None
        self.logprobs: list[list[float]] | None = None

    def __iter__(self) -> DecodeStream:
        return self

    def __next__(self) -> list[list[int]]:
        if self._done:
            raise StopIteration
        if self._failed:
            raise ValueError("a step of this stream failed (the error was raised then): it cannot go on")
        target_params, draft_params, *arrays = self._args
        self._failed = True  # until the step returns: the round donates the state it is given
        if self._st is None:
            st = self._pre(target_params, draft_params, *arrays)
            emitted, n_emit = st.seq, None  # the first token: at seq_len - 1
        else:
            st, emitted, n_emit = self._step(target_params, draft_params, self._st)
        # Only the step's window of log-probabilities travels (its tokens end at seq_len), not every row's history.
        w = 1 if n_emit is None else emitted.shape[1]
        lp = tail_rows(st.logprob, st.seq_len, w) if self._want_logprobs else None
        top = (
            (tail_rows(st.top_ids, st.seq_len, w), tail_rows(st.top_logprob, st.seq_len, w)) if self._want_top else None
        )
        # One transfer per step (a collective across processes): tokens, lengths, stops and logprobs together.
        emitted, n_emit, seq_len, stop, lp, top = self._to_host((emitted, n_emit, st.seq_len, st.stop, lp, top))
        if n_emit is None:
            chunk = [[int(emitted[i, seq_len[i] - 1])] for i in range(seq_len.shape[0])]
            n_emit = np.ones_like(seq_len)
        else:
            chunk = [emitted[i, : n_emit[i]].tolist() for i in range(seq_len.shape[0])]
        self._st, self._failed = st, False
        self.stop_reasons = [StopReason(int(r)) for r in stop]
        if lp is not None:  # the step's tokens are the window's last n_emit
            self.logprobs = [lp[i, w - n_emit[i] :].tolist() for i in range(lp.shape[0])]
        if top is not None:
            self.top_logprobs = [
                top_pairs(top[0][i, w - n_emit[i] :], top[1][i, w - n_emit[i] :]) for i in range(len(top[0]))
            ]
        self._done = not np.any(np.asarray(stop) == StopReason.RUNNING)
        return chunk

    def output(self) -> DecodeOutput:
        """Tokens, stop reasons, statistics (and logprobs) of every step so far."""
        if self._failed:
            raise ValueError("a step of this stream failed: its state was given to that step and is gone")
        if self._st is None:
            raise ValueError("the stream has not run a step yet: call next() first")
        return self._gather(self._st)


def run_with_stop_strings(stream: DecodeStream, stops, detokenize, min_tokens) -> DecodeOutput:
    """Step ``stream`` (every row) and look for each row's stop strings in its text (``jspec.stop.StopStrings``,
    ``stops[b]`` with ``min_tokens[b]``): a row whose string appears keeps the tokens up to the one completing it
    (its log-probabilities alike) and ends with STOP_STRING. The steps end once every row has met a string or
    stopped on the device; a row that met one earlier runs on with the batch (its rounds cost nothing more: the
    batch's do), and ``stats`` count every token decoded."""
    checkers = [StopStrings(s, detokenize, int(m)) for s, m in zip(stops, min_tokens, strict=True)]
    for chunk in stream:
        for c, toks in zip(checkers, chunk, strict=True):
            if c.matched is None and toks:
                c.feed(toks)
        if all(c.matched is not None or r != StopReason.RUNNING for c, r in zip(checkers, stream.stop_reasons)):
            break
    out = stream.output()
    for b, c in enumerate(checkers):
        if c.matched is not None:
            out.cut(b, len(c.tokens), StopReason.STOP_STRING)
    return out
