"""Continuous batching: a fixed set of B rows decodes round by round; when a row finishes, the next waiting
request is prefilled alone and dropped into that row while the other rows keep their state.

Each round is the same jitted ``decode_round`` as the fused loop (so outputs are those of ``decode``); the
host only sees the round's emitted tokens, which is what a server streams anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jspec import validate as V
from jspec.adaptive import AdaptiveK
from jspec.costs import context_of, goodput_policy
from jspec.loop import decode_round, prefill
from jspec.model import Model
from jspec.state import DecodeConfig, DecodeState, StopReason, top_pairs
from jspec.stop import StopStrings
from jspec.stream import tail_rows


def _insert_state(big: DecodeState, row: jax.Array, one: DecodeState) -> DecodeState:
    """Put the single-row state ``one`` into row ``row`` of ``big``; global counters are kept."""

    def put(a, b):
        return a.at[row].set(b[0])

    draft = big.draft_state
    if draft is not None:
        if hasattr(draft, "insert"):
            draft = draft.insert(row, one.draft_state)
        else:
            # Without insert(), a drafter state must be per-row arrays with a leading [B] axis (LayerSkip's
            # layer-E hidden states); anything else cannot be split by row.
            b = big.seq.shape[0]
            if not all(getattr(a, "ndim", 0) >= 1 and a.shape[0] == b for a in jax.tree.leaves(draft)):
                raise TypeError(
                    f"the drafter state {type(draft).__name__} has no insert() and is not per-row [B, ...] "
                    "arrays: no continuous batching"
                )
            draft = jax.tree.map(put, draft, one.draft_state)
    stats = dataclasses.replace(
        big.stats,
        rounds=put(big.stats.rounds, one.stats.rounds),
        emitted=put(big.stats.emitted, one.stats.emitted),
        proposed=put(big.stats.proposed, one.stats.proposed),
        accepted=put(big.stats.accepted, one.stats.accepted),
    )
    seq = big.seq.at[row].set(one.seq[0])
    return dataclasses.replace(
        big,
        seq=seq,
        seq_len=put(big.seq_len, one.seq_len),
        prompt_len=put(big.prompt_len, one.prompt_len),
        max_new=put(big.max_new, one.max_new),
        cache=big.cache.insert(row, one.cache),
        draft_state=draft,
        sampling=jax.tree.map(put, big.sampling, one.sampling),
        stop=put(big.stop, one.stop),
        stats=stats,
        accept_ema=put(big.accept_ema, one.accept_ema),
        key=big.key.at[row].set(one.key[0]),
        logprob=big.logprob.at[row].set(one.logprob[0]),
        top_ids=big.top_ids.at[row].set(one.top_ids[0]),
        top_logprob=big.top_logprob.at[row].set(one.top_logprob[0]),
        out_counts=big.out_counts.at[row].set(one.out_counts[0]),
        prompt_seen=big.prompt_seen.at[row].set(one.prompt_seen[0]),
    )


def engine_slots(target: Model, drafter, max_len: int) -> int:
    """The cache slots S of an ``Engine`` with ``max_len``: a tree's scratch past each request's P + N - 1 slots,
    as decode's default max_len reserves it, so that which nodes a row verifies (and so its sampled tokens) does
    not depend on the engine's size; both are capped at the model's context length, where no node may sit."""
    s = max_len + V.tree_scratch(drafter)
    return s if target.max_positions is None else min(s, target.max_positions)


def freeze_gc_heap() -> int:
    """Collect garbage once, then move every object alive into CPython's permanent generation
    (``gc.freeze``); returns how many objects are frozen now. Call it once the engine is warm (its programs compiled).

    JAX keeps its traced and compiled programs as long-lived Python objects (~600k in a benchmark process), and every
    oldest-generation collection walks all of them: in a benchmark process these pauses grew from ~90 to
    ~530 ms, each landing in whichever request was being served (vLLM and SGLang freeze their heaps after
    warm-up for the same reason). Frozen objects are never collected, so programs dropped afterwards
    (``jax.clear_caches``) stay in memory until ``gc.unfreeze()``.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclasses.dataclass
class Engine:
    """B rows of decoding with per-row requests.

    ``add(row, prompt, max_new_tokens, ...)`` puts a request into a free row (prefill + insert, one jitted
    call per prompt-width bucket); ``step()`` runs rounds for every row and returns {row: tokens emitted by them}
    (with no row running it runs nothing and returns {}); ``cancel(row)`` aborts a running request and frees its
    row; ``stop_reason(row)`` says why a row's request ended and ``free_rows()`` lists the rows ready for a new one.

    logprobs: with True, ``last_logprobs[row]`` holds the target's log-probabilities of the tokens last returned
    for ``row`` (as ``decode(logprobs=True)`` reports them): ``step()`` replaces the dict with its rows',
    ``add()`` sets its own row's (its first token) and keeps the others'. top_logprobs=N (with logprobs=True):
    ``last_top_logprobs[row]`` holds those tokens' N most likely (id, log-probability) pairs, kept alike.
    rounds_per_sync: rounds one ``step()`` runs on the device before returning to the host (multi-step
    scheduling). Each return is a host sync; on a GPU at small batch it costs about as much as a round. A
    step still returns right after the round in which some running row stops on the device (EOS, a stop id,
    its budget), so its row is refilled as soon as with one round per step. Tokens then reach the caller up to
    R rounds at a time. Stop strings are found on the host after the step: a row that ends at one may have
    run up to R - 1 more rounds, whose tokens are dropped (they stay in ``state.stats``).
    eos_ids end every request; ``add(..., stop_token_ids=[...])`` gives one request its own (vLLM's
    stop_token_ids), at most ``max_stop_ids`` of them (the state holds that many per row, so adding them never
    recompiles). ``add(..., min_tokens=n)`` masks a request's end tokens until it has n tokens, and
    ``add(..., logit_bias={id: bias})`` biases its target logits, with up to ``max_logit_bias`` entries (as
    ``decode``'s; 0, the default, holds none). ``add(..., repetition_penalty=, presence_penalty=,
    frequency_penalty=)`` need ``Engine(penalties=True)``, whose state keeps [B, V] token counts.
    detokenize: token ids -> text; with it, ``add(..., stop=[...])`` takes stop strings and ``text(row)`` gives
    a request's text as a stream may show it (never a part of a stop string).
    """

    target: Model
    target_params: object
    batch: int
    max_len: int
    drafter: object = None
    draft_params: object = None
    gamma: int | None = None
    eos_ids: Sequence[int] = ()
    block_verify: bool = False
    adaptive: AdaptiveK | None = None
    bucket: int = 64
    seed: int = 0
    rounds_per_sync: int = 1
    logprobs: bool = False
    max_stop_ids: int = 4
    max_logit_bias: int = 0
    top_logprobs: int = 0
    penalties: bool = False
    detokenize: Callable[[list[int]], str] | None = None
    # None (the default): the batch's K chosen each round from measured costs where it can be (decode's goodput);
    # False: the fixed K; True, a CostTable or a GoodputK: as decode's.
    goodput: object = None

    def __post_init__(self):
        self.logprobs = V.check_flag("logprobs", self.logprobs)
        self.top_logprobs = V.check_top_logprobs(self.top_logprobs, self.logprobs, self.target.vocab_size)
        self.block_verify = V.check_flag("block_verify", self.block_verify)
        self.penalties = V.check_flag("penalties", self.penalties)
        V.check_count("batch", self.batch)
        V.check_count("max_len", self.max_len)
        V.check_count("bucket (the prompt-width padding multiple)", self.bucket)
        V.check_count("rounds_per_sync", self.rounds_per_sync)
        V.check_count("max_stop_ids", self.max_stop_ids, least=0)  # 0: no per-request ids / biases
        V.check_count("max_logit_bias", self.max_logit_bias, least=0)
        self.adaptive = V.adaptive_policy(self.adaptive)
        gamma_given = self.gamma is not None
        gamma = V.check_drafter(
            self.target,
            self.drafter,
            self.gamma,
            self.adaptive,
            self.block_verify,
            self.draft_params,
            self.target_params,
        )
        slots = engine_slots(self.target, self.drafter, self.max_len)
        chooser = goodput_policy(
            self.goodput, self.target, self.target_params, self.drafter, self.draft_params, gamma=gamma,
            gamma_given=gamma_given, adaptive=self.adaptive, batch=self.batch, slots=slots,
            context=context_of(self.max_len / 2, slots),  # requests come and go: the middle of a row's room
        )  # fmt: skip
        if chooser is not None:  # the loop's K is the policy's largest, which the drafter must serve
            gamma = V.check_drafter(
                self.target, self.drafter, chooser.k_max, None, self.block_verify, self.draft_params, self.target_params
            )
        self.config = DecodeConfig(
            gamma,
            slots,
            V.check_eos(self.eos_ids, self.target.vocab_size),
            False,
            self.adaptive,
            self.block_verify,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            penalties=self.penalties,
            goodput=chooser,
        )
        self._prefill, self._insert, self._step = _engine_fns(
            self.target, self.drafter, self.config, self.rounds_per_sync
        )
        self.last_rounds = 0  # rounds the last step() ran
        self.last_logprobs: dict[int, list[float]] = {}
        self.last_top_logprobs: dict[int, list[list[tuple[int, float]]]] = {}
        # Every row starts idle: a 1-token dummy prefill gives the state its shapes. On abstract params
        # (``jax.ShapeDtypeStruct``s) only the shapes exist: such an engine serves ``export`` alone.
        b = self.batch
        dummy = jnp.zeros((b, 1), jnp.int32)
        leaves = jax.tree.leaves((self.target_params, self.draft_params))
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        st = (jax.eval_shape if self.abstract else lambda f, *a: f(*a))(
            self._prefill,
            self.target_params,
            self.draft_params,
            dummy,
            jnp.ones((b,), jnp.int32),
            jnp.ones((b,), jnp.int32),
            V.sampling_params(b, stop_width=self.max_stop_ids, bias_width=self.max_logit_bias),
            jax.random.split(jax.random.key(V.check_seed(self.seed)), b),  # per-row keys; replaced by each add()
        )
        if not hasattr(st.cache, "insert"):
            raise TypeError(
                f"{self.target.name}'s cache ({type(st.cache).__name__}) has no insert(row, one_row_cache): the "
                "engine puts each request's prefilled cache row into the batch with it (jspec.cache.KVCache has one)"
            )
        # From a NumPy array: jnp.full of a Python int is weakly typed, and the first add() or step() on a fresh
        # engine would compile each program once more than on one whose state a step already returned.
        self.state = dataclasses.replace(st, stop=jnp.asarray(np.full((b,), int(StopReason.IDLE), np.int32)))
        self._stop = np.full((b,), int(StopReason.IDLE))
        self._n_added = 0
        # Each row's last request's text and stop strings (every request's, with detokenize).
        self._stops: dict[int, StopStrings] = {}

    def export(self, platforms: Sequence[str]) -> jax_export.Exported:
        """The engine's step (``rounds_per_sync`` rounds for every row) lowered for ``platforms`` (e.g.
        ``("tpu",)``) with ``jax.export``, on any host; the engine may be built on abstract params."""
        return jax_export.export(self._step, platforms=tuple(platforms))(
            self.target_params, self.draft_params, self.state
        )

    def free_rows(self) -> list[int]:
        return [int(i) for i in np.nonzero(self._stop != StopReason.RUNNING)[0]]

    def _check_row(self, row) -> None:
        if self.abstract:
            raise ValueError("this engine was built on abstract params (ShapeDtypeStructs): it can only be exported")
        if isinstance(row, bool) or not isinstance(row, int | np.integer) or not 0 <= row < self.batch:
            raise ValueError(f"row must be an int in [0, {self.batch}), got {row!r}")  # -1 is not the last row

    def cancel(self, row: int) -> None:
        """Abort the request running in ``row`` (vLLM's abort): the row stops now, as a row whose request ended
        does, and is free for the next ``add()``; the other rows' requests go on unchanged. Its stop reason
        becomes IDLE (no request), as before any request; its counters stay in ``state.stats`` until the next
        request in the row resets them. A row with no running request is refused."""
        self._check_row(row)
        if self._stop[row] != StopReason.RUNNING:
            reason = StopReason(int(self._stop[row])).name
            raise ValueError(f"row {row} has no running request to cancel (its stop reason is {reason})")
        self._end(row, StopReason.IDLE)
        self.last_logprobs.pop(int(row), None)
        self.last_top_logprobs.pop(int(row), None)

    def _end(self, row: int, reason: StopReason) -> None:
        """Stop ``row`` on the device with ``reason`` (cancel, a stop string)."""
        self._stop[row] = int(reason)
        # The host's copy (every row's stop reason as of the last add/step) put back whole: a transfer, where an
        # eager scatter would compile a program the first time a request is cancelled (inside a timed run).
        stop = self.state.stop
        self.state = dataclasses.replace(self.state, stop=jax.device_put(self._stop.astype(stop.dtype), stop.sharding))

    def matched_stop(self, row: int) -> str | None:
        """The stop string that ended ``row``'s last request (stop reason STOP_STRING), else None."""
        self._check_row(row)
        checker = self._stops.get(int(row))
        return None if checker is None else checker.matched

    def text(self, row: int) -> str:
        """The text of ``row``'s last request so far (an engine built with ``detokenize``), as a stream may show
        it (``jspec.stop.StopStrings.visible``): cut before its stop string once one ended it; whole once it
        ended otherwise (EOS, a stop id, its budget, ``cancel``); while it runs, without its last characters
        that could begin one of its stop strings (vLLM's streams hold them back alike). "" before any request."""
        self._check_row(row)
        if self.detokenize is None:
            raise ValueError("text(row) needs the engine's detokenize (token ids -> text): Engine(..., detokenize=)")
        checker = self._stops.get(int(row))
        return "" if checker is None else checker.visible(final=self._stop[row] != StopReason.RUNNING)

    def add(
        self,
        row: int,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        logit_bias: dict | None = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop: str | Sequence[str] = (),
    ) -> int:
        """Prefill ``prompt`` and start it in ``row`` (which must be free). Returns its first token.

        Every request samples from its own key: ``seed`` (as ``decode(seed=[...])`` gives a row), or without
        one the engine's ``seed`` folded with the request's admission number. With a seed, a request's tokens
        do not depend on its row, on when it was admitted or on the other requests (up to the float
        reassociation of batched matmuls, as in any server). stop_token_ids: this request's own end tokens (up
        to ``max_stop_ids``), besides the engine's eos_ids; stop reason EOS. min_tokens, logit_bias: as ``decode``'s
        for one row (a dict of up to ``max_logit_bias`` entries). repetition_penalty, presence_penalty,
        frequency_penalty: as ``decode``'s (an engine built with ``penalties=True``). stop: a string or strings
        that end the request when its text holds one (an engine built with ``detokenize``; see ``jspec.stop``):
        the tokens up to the one completing it are returned, the stop reason is STOP_STRING, ``matched_stop(row)``
        names it and ``text(row)`` ends before it; with min_tokens, only a string that a token after the first
        min_tokens completes counts (vLLM's rule). min_tokens with no end token or stop string to hold back is
        refused."""
        self._check_row(row)
        if self._stop[row] == StopReason.RUNNING:
            raise ValueError(f"row {row} is still decoding a request")
        prompt, max_new_tokens = V.check_engine_request(self.target, self.drafter, prompt, max_new_tokens, self.max_len)
        width = min(-(-prompt.size // self.bucket) * self.bucket, self.config.slots)  # slots: capped at the context
        padded = np.zeros((1, width), np.int32)
        padded[0, : prompt.size] = prompt
        V.check_engine_options(stop_token_ids, logit_bias, self.max_logit_bias)
        sampling = V.sampling_params(
            1,
            temperature,
            top_k,
            top_p,
            min_p,
            stop_token_ids,
            self.target.vocab_size,
            self.max_stop_ids,
            min_tokens=min_tokens,
            logit_bias=logit_bias,
            bias_width=self.max_logit_bias,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )
        stops = V.check_stop_strings(stop)
        if stops and self.detokenize is None:
            raise ValueError("stop strings need the engine's detokenize (token ids -> text): Engine(..., detokenize=)")
        if not self.penalties and sampling.has_penalties():
            raise ValueError("penalties need an engine that counts tokens: build it with Engine(..., penalties=True)")
        V.check_min_tokens(
            sampling, np.asarray([max_new_tokens]), self.config.eos_ids, self.target.vocab_size, bool(stops)
        )
        if seed is None:
            key = jax.random.fold_in(jax.random.key(self.seed), self._n_added)
        else:
            key = jax.random.key(V.check_seed(seed))
        self._n_added += 1
        self.state, first, first_lp, first_top, stop = self._insert(
            self.target_params,
            self.draft_params,
            self.state,
            jnp.int32(row),
            jnp.asarray(padded),
            jnp.asarray([prompt.size], jnp.int32),
            jnp.asarray([max_new_tokens], jnp.int32),
            sampling,
            key[None],
        )
        first, first_lp, first_top, stop = jax.device_get((first, first_lp, first_top, stop))
        self._stop[row] = int(stop)
        self._stops.pop(int(row), None)
        if self.detokenize is not None:  # fed even when the row stopped at once (EOS, a budget of 1)
            n_min = int(jax.device_get(sampling.min_tokens)[0])
            self._stops[int(row)] = checker = StopStrings(stops, self.detokenize, n_min)
            if checker.feed([int(first)]) is not None:
                self._end(row, StopReason.STOP_STRING)
        if self.logprobs:  # the other rows keep the tokens they were last given (a step's, before the refill)
            self.last_logprobs[int(row)] = [float(first_lp)]
        if self.top_logprobs:
            self.last_top_logprobs[int(row)] = top_pairs(first_top[0][None], first_top[1][None])
        return int(first)

    def step(self) -> dict[int, list[int]]:
        """Up to ``rounds_per_sync`` rounds for all rows; returns the tokens each running row emitted. With no
        row running (the host knows each row's state) nothing runs: {} and ``last_rounds`` 0. A request whose
        stop string appears gets the tokens up to the one completing it (the rest of its step's tokens are
        dropped) and ends with STOP_STRING."""
        running = self._stop == StopReason.RUNNING
        if not running.any():
            self.last_rounds = 0
            self.last_logprobs = {}
            self.last_top_logprobs = {}
            return {}
        self.state, emitted, n_emit, n_rounds = self._step(self.target_params, self.draft_params, self.state)
        # Fetched with the tokens: the window of the step's tokens (R rounds of up to K+1 each end at seq_len).
        st, w = self.state, emitted.shape[0] * emitted.shape[2]
        lp = tail_rows(st.logprob, st.seq_len, w) if self.logprobs else None
        top = (
            (tail_rows(st.top_ids, st.seq_len, w), tail_rows(st.top_logprob, st.seq_len, w))
            if self.top_logprobs
            else None
        )
        emitted, n_emit, n_rounds, stop, lp, top = jax.device_get((emitted, n_emit, n_rounds, st.stop, lp, top))
        self._stop = np.asarray(stop).copy()
        self.last_rounds = int(n_rounds)
        out = {
            int(r): [t for i in range(self.last_rounds) for t in emitted[i, r, : n_emit[i, r]].tolist()]
            for r in np.nonzero(running)[0]
        }
        self.last_logprobs = {}
        self.last_top_logprobs = {}
        if lp is not None:  # a row's tokens of this step are the last ones of its window
            self.last_logprobs = {r: lp[r, w - len(t) :].tolist() for r, t in out.items()}
        if top is not None:
            self.last_top_logprobs = {
                r: top_pairs(top[0][r, w - len(t) :], top[1][r, w - len(t) :]) for r, t in out.items()
            }
        for r, toks in out.items():  # stop strings: the text only exists here
            checker = self._stops.get(r)
            keep = None if checker is None or checker.matched is not None else checker.feed(toks)
            if keep is not None:
                out[r] = toks[:keep]
                for d in (self.last_logprobs, self.last_top_logprobs):
                    if r in d:
                        d[r] = d[r][:keep]
                self._end(r, StopReason.STOP_STRING)
        return out

    def stop_reason(self, row: int) -> StopReason:
        self._check_row(row)
        return StopReason(int(self._stop[row]))


def _step_rounds(target, drafter, config, rounds: int, target_params, draft_params, state):
    """Up to ``rounds`` decode rounds on the device: -> (state, emitted [R, B, K+1], n_emit [R, B], rounds
    run). Stops early after a round in which a row that was running stopped (its row can be refilled) and
    when no row runs."""
    if rounds == 1:  # no loop around a single round
        st, e, n = decode_round(target, drafter, config, target_params, draft_params, state)
        return st, e[None], n[None], jnp.int32(1)
    b = state.seq.shape[0]
    running0 = state.stop == StopReason.RUNNING
    emitted = jnp.zeros((rounds, b, config.gamma + 1), jnp.int32)
    n_emit = jnp.zeros((rounds, b), jnp.int32)

    def cond(c):
        i, st, _, _ = c
        running = st.stop == StopReason.RUNNING
        return (i < rounds) & jnp.all(running | ~running0) & jnp.any(running)

    def body(c):
        i, st, em, ne = c
        st, e, n = decode_round(target, drafter, config, target_params, draft_params, st)
        return i + 1, st, em.at[i].set(e), ne.at[i].set(n)

    i, st, emitted, n_emit = jax.lax.while_loop(cond, body, (jnp.int32(0), state, emitted, n_emit))
    return st, emitted, n_emit, i


@functools.lru_cache(maxsize=32)
def _engine_fns(target, drafter, config, rounds: int):
    pre = jax.jit(functools.partial(prefill, target, drafter, config))

    def insert(target_params, draft_params, state, row, prompt, plen, max_new, sampling, key):
        one = prefill(target, drafter, config, target_params, draft_params, prompt, plen, max_new, sampling, key)
        first = one.seq[0, plen[0]]
        first_lp = one.logprob[0, plen[0]] if config.logprobs else jnp.float32(0)
        first_top = (one.top_ids[0, plen[0]], one.top_logprob[0, plen[0]]) if config.top_logprobs else None
        return _insert_state(state, row, one), first, first_lp, first_top, one.stop[0]

    step = functools.partial(_step_rounds, target, drafter, config, rounds)
    return pre, jax.jit(insert, donate_argnums=(2,)), jax.jit(step, donate_argnums=(2,))
