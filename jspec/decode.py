"""jspec's public API: ``decode`` (the whole decode in one jit-compiled call), ``decode_stream`` (round by round
from Python) and ``prepare`` (a validated call whose compilation and execution can be timed apart).

    import jspec.decode as jd
    out = jd.decode(target, params, [prompt_ids], drafter=NgramDrafter(vocab_size=target.vocab_size))

The call is validated on the host (``jspec.validate``), then runs ``jspec.loop.generate_arrays`` under
``jax.jit``: prefill, then one ``lax.while_loop`` over rounds of draft -> verify -> accept -> commit, per row,
with no host sync. The drafter, K and the ``DecodeConfig`` are static (each combination compiles once); prompts,
budgets, sampling parameters and keys are arrays (new values reuse the compiled loop).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export
from jax.experimental import checkify

from jspec import validate as V
from jspec.adaptive import AdaptiveK
from jspec.costs import CostTable, context_of, goodput_policy
from jspec.drafters import Drafter
from jspec.goodput import GoodputK
from jspec.loop import decode_round, generate_arrays, prefill
from jspec.model import Model
from jspec.sampling import SamplingParams
from jspec.state import DecodeConfig, DecodeInputs, DecodeOutput, StopReason, to_output
from jspec.stream import DecodeStream, run_with_stop_strings

__all__ = ["DecodeOutput", "DecodeStream", "PreparedDecode", "StopReason", "decode", "decode_stream", "prepare"]


@functools.lru_cache(maxsize=64)
def _compiled(target, drafter, config):
    fn = functools.partial(generate_arrays, target, drafter, config)
    if config.debug_checks:
        return _Checked(jax.jit(checkify.checkify(fn)))
    return jax.jit(fn)


def _throw(err_out):
    err, out = err_out
    err.throw()
    return out


class _Checked:
    """A checkified jitted function that raises its error on the host; ``lower(...).compile()`` as jax.jit's,
    so ``PreparedDecode.run_timed`` compiles before it times under ``debug_checks`` too."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, *args):
        return _throw(self.jitted(*args))

    def lower(self, *args):
        return _CheckedLowered(self.jitted.lower(*args))


class _CheckedLowered:
    """``_Checked``'s lowering: its ``compile()`` raises the check's error on the host after each call."""

    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self):
        compiled = self.lowered.compile()
        return lambda *args: _throw(compiled(*args))


@dataclasses.dataclass
class PreparedDecode:
    """A validated decode call, split so that compilation and execution can be timed apart."""

    fn: Any  # the jitted whole decode
    target_params: Any
    draft_params: Any
    inputs: DecodeInputs
    config: DecodeConfig
    stream_fns: Any = None  # () -> the (prefill, round) pair a stream steps with

    @property
    def args(self) -> tuple:
        """The positional arguments of ``fn`` (and of ``jspec.loop.prefill`` after its static ones)."""
        i = self.inputs
        return self.target_params, self.draft_params, i.prompt, i.prompt_len, i.max_new, i.sampling, i.key

    @property
    def sampling(self) -> SamplingParams:
        """The rows' validated sampling parameters."""
        return self.inputs.sampling

    def stream(self, fns=None) -> DecodeStream:
        """The round-by-round ``DecodeStream`` of this call (see ``decode_stream``); ``fns``: the pair
        ``compile_stream`` returns, else they compile at the first steps."""
        pre, step = fns or self.stream_fns()
        return DecodeStream(pre, step, self.args, self.config.logprobs, top=bool(self.config.top_logprobs))

    def compile_stream(self):
        """Compile the stream's (prefill, round) ahead of time (no execution), so that a timed stream runs
        without compiling; returns the pair for ``stream``. With debug_checks the pair stays jitted."""
        pre, step = self.stream_fns()
        if self.config.debug_checks:  # the checked round raises on the host: it is a function, not a jitted one
            return pre, step
        state = jax.eval_shape(pre, *self.args)
        return pre.lower(*self.args).compile(), step.lower(*self.args[:2], state).compile()

    def compile(self):
        """Compile ahead of time (no execution); returns the compiled executable."""
        return self.fn.lower(*self.args).compile()

    def export(self, platforms: Sequence[str]) -> jax_export.Exported:
        """The whole decode lowered for ``platforms`` (e.g. ``("tpu",)`` or ``("cuda",)``) with ``jax.export``,
        on any host: params may be ``jax.ShapeDtypeStruct``s (``models.llama.abstract_params``)."""
        return jax_export.export(self.fn, platforms=tuple(platforms))(*self.args)

    def run(self, compiled=None) -> DecodeOutput:
        st = (compiled or self.fn)(*self.args)
        return to_output(st)

    def run_timed(self) -> DecodeOutput:
        """Compile, then run and time the execution alone; adds ``compile_seconds``, ``seconds`` (excluding
        compilation, including the transfer of the result to the host) and ``tokens_per_s`` to the stats."""
        t0 = time.perf_counter()
        compiled = self.compile()
        jax.block_until_ready(self.args)
        t1 = time.perf_counter()
        st = jax.block_until_ready(compiled(*self.args))
        out = to_output(st)
        t2 = time.perf_counter()
        total = sum(out.stats["new_tokens"])
        out.stats.update(compile_seconds=t1 - t0, seconds=t2 - t1, tokens_per_s=total / (t2 - t1))
        return out


def prepare(
    target: Model,
    target_params,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    drafter: Drafter | None = None,
    draft_params=None,
    gamma: int | None = None,
    max_new_tokens: int | Sequence[int] | None = 64,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    eos_ids: Sequence[int] = (),
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    min_tokens: int | Sequence[int] = 0,
    logit_bias: dict | Sequence[dict | None] | None = None,
    repetition_penalty: float | Sequence[float] = 1.0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    seed: int | Sequence[int] | None = None,
    key: jax.Array | None = None,
    max_len: int | None = None,
    debug_checks: bool = False,
    adaptive: AdaptiveK | bool | None = None,
    block_verify: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    penalties: bool | None = None,
    stop_strings: Sequence[bool] | None = None,
    goodput: GoodputK | CostTable | bool | None = None,
) -> PreparedDecode:
    """Validate the inputs of ``decode`` (raising a ValueError that names the problem) and build the call.
    penalties: None (the default) keeps token counts when some row has a penalty; True keeps them anyway (a
    sharded decode whose other processes' rows have penalties compiles the same program); False with a row that
    has a penalty is refused (the penalty would be ignored). stop_strings: per row, whether the caller looks for
    stop strings in it (``decode(stop=...)``), which min_tokens then holds back too. goodput: True, a
    ``jspec.costs.CostTable`` or a ``jspec.goodput.GoodputK`` chooses the batch's draft length each round from
    measured costs (``jspec.costs.goodput_policy``); False: a fixed K; None (the default): True wherever the
    costs can be measured and the drafter can change its K from round to round, with no gamma or adaptive policy
    given (``jspec.costs.measurable``), else a fixed K. The first decode of a situation (device, model, drafter,
    batch, cache size, context) measures its cost table, seconds to tens of seconds, then reads it from disk."""
    logprobs = V.check_flag("logprobs", logprobs)
    top_logprobs = V.check_top_logprobs(top_logprobs, logprobs, target.vocab_size)
    block_verify = V.check_flag("block_verify", block_verify)
    debug_checks = V.check_flag("debug_checks", debug_checks)
    gamma_given = gamma is not None
    gamma = V.check_drafter(target, drafter, gamma, adaptive, block_verify, draft_params, target_params)
    prompt, plen, mnew, slots = V.check_prompts(target, prompts, max_new_tokens, max_len, V.tree_scratch(drafter))
    V.check_draft_context(drafter, plen + mnew - 1 if max_new_tokens is not None else np.full_like(plen, slots))
    sampling = V.sampling_params(
        len(plen),
        temperature,
        top_k,
        top_p,
        min_p,
        stop_token_ids,
        vocab_size=target.vocab_size,
        min_tokens=min_tokens,
        logit_bias=logit_bias,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    key = V.decode_key(seed, key, len(plen))
    eos = V.check_eos(eos_ids, target.vocab_size)
    # Without a budget a row runs until its cache is full: P + N <= S + 1.
    V.check_min_tokens(
        sampling, mnew if max_new_tokens is not None else slots + 1 - plen, eos, target.vocab_size, stop_strings
    )
    counts = sampling.has_penalties()  # their [B, V] counts only where a row asks for a penalty (or the caller)
    if penalties is not None:
        asked = V.check_flag("penalties", penalties)
        if not asked and counts:
            raise ValueError(
                "penalties=False, but a row has a repetition / presence / frequency penalty, which needs the "
                "token counts: pass penalties=None (the default) or True"
            )
        counts = asked
    policy = V.adaptive_policy(adaptive)
    # The rows' mean context over the decode: each prompt and half of what may follow it.
    budget = mnew if max_new_tokens is not None else slots + 1 - plen
    context = context_of(float(np.mean(plen + budget / 2)), slots)
    chooser = goodput_policy(
        goodput, target, target_params, drafter, draft_params, gamma=gamma, gamma_given=gamma_given,
        adaptive=policy, batch=len(plen), slots=slots, context=context, objective="makespan",
    )  # fmt: skip
    if chooser is not None:  # the loop's K is the policy's largest, which the drafter must serve
        gamma = V.check_drafter(target, drafter, chooser.k_max, None, block_verify, draft_params, target_params)
    config = DecodeConfig(
        gamma,
        slots,
        eos,
        debug_checks,
        policy,
        block_verify,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        penalties=counts,
        goodput=chooser,
    )
    inputs = DecodeInputs(jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(mnew), sampling, key)
    return PreparedDecode(
        _compiled(target, drafter, config),
        target_params,
        draft_params,
        inputs,
        config,
        functools.partial(_stream_fns, target, drafter, config),
    )


def decode(target: Model, target_params, prompts, *, stop=None, detokenize=None, **kwargs) -> DecodeOutput:
    """Generate up to ``max_new_tokens`` per prompt with speculative decoding (plain when drafter is None).

    prompts: B token-id lists of any (non-zero) lengths, or a [B, P] array of B prompts of exactly P tokens (no
    padding: there is no attention mask, so pad ids would be read as prompt tokens; pass ragged prompts as
    lists). Keyword arguments (see
    ``prepare``): drafter, draft_params, gamma (K candidates per round, every round; unset: 4 for a chain drafter,
    the depth of a tree drafter, 0 without a drafter, and each round's K is chosen up to it from measured costs,
    ``goodput``; a given value must be the one that runs, see ``jspec.validate.check_drafter``), goodput,
    max_new_tokens (int, per-row list, or None = until EOS or a full cache), temperature / top_k / top_p / min_p
    (scalars or per-row lists; temperature 0 is greedy), eos_ids (the model's end tokens, every row),
    stop_token_ids (vLLM's: ids that end a row as EOS does, emitted; one list for every row or one list per row;
    stop reason EOS), min_tokens (vLLM's: end tokens, EOS and stop ids, are masked until a row has generated that
    many; per row or one for all), logit_bias (a ``{token_id: bias}`` dict, or one per row: added to the target's
    logits before temperature and the filters, -inf bans a token; both change what rows sample and greedy rows'
    argmax, not the raw log-probabilities that ``logprobs`` reports), repetition_penalty / presence_penalty /
    frequency_penalty (vLLM's, per row or one for all, applied after the bias: see ``SamplingParams``; any of them
    set compiles a loop that keeps [B, V] token counts), seed or key (not both; seed 0 by default, in
    [0, 2**32) without 64-bit mode; one for the batch, or B seeds / [B] keys for a stream per row), max_len (cache
    slots S; default the largest P + N - 1 (the slots the rows need; plus a tree's nodes but the root, its
    scratch) rounded up to a multiple of 128, capped at the model's context length), adaptive, block_verify,
    debug_checks, logprobs (``DecodeOutput.logprobs``: the target's log-probability of each generated token),
    top_logprobs (N <= 20, with logprobs=True: ``DecodeOutput.top_logprobs``, the N most likely (id,
    log-probability) pairs at each generated position, most likely first).
    Returns generated tokens per row, the stop reason per row and statistics (defined in ``jspec.state``). Sampling
    parameters, stop token ids, min_tokens, logit biases, the seed or key and the budgets are arrays: new values
    reuse the compiled loop as long as the batch, the padded prompt width (a multiple of 16), max_len, the longest
    row's stop-id count and logit_bias size (each rounded up to a multiple of 4) and the kind of seed (one, or one
    per row) stay the same (a default max_len follows the budget); drafter, gamma, eos_ids, adaptive,
    block_verify, debug_checks, logprobs, top_logprobs and whether any row has a penalty are static and compile a
    loop of their own.

    stop (vLLM's stop strings: a string or a list of them for every row, or one entry per row) with
    ``detokenize`` (token ids -> text, e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``): text only
    exists on the host, so the decode then steps round by round (``run_with_stop_strings``: a host sync per round,
    the same tokens) and a row whose text holds one of its strings ends with the token completing it, stop reason
    STOP_STRING; with min_tokens, only a string that a token after the row's first min_tokens completes counts.
    """
    if "stop_strings" in kwargs:
        raise ValueError("decode sets stop_strings from stop= (prepare's serves callers that step a stream)")
    if stop is None:
        if detokenize is not None:
            raise ValueError("detokenize is only used to find stop strings: pass stop=[...] with it, or leave it out")
        return prepare(target, target_params, prompts, **kwargs).run()
    if detokenize is None or not callable(detokenize):
        raise ValueError(
            "stop strings need detokenize (token ids -> text), "
            "e.g. lambda ids: tok.decode(ids, skip_special_tokens=True)"
        )
    try:
        batch = len(prompts)
    except TypeError:  # not prompts at all: prepare says what is wrong with them
        return prepare(target, target_params, prompts, **kwargs).run()
    rows = V.stop_string_rows(stop, batch)
    prepared = prepare(target, target_params, prompts, stop_strings=[bool(r) for r in rows], **kwargs)
    if not any(rows):  # no row has a string to look for: the fused loop, no host sync per round
        return prepared.run()
    n_min = jax.device_get(prepared.sampling.min_tokens)
    return run_with_stop_strings(prepared.stream(), rows, detokenize, n_min)


def decode_stream(target: Model, target_params, prompts, **kwargs) -> DecodeStream:
    """Like ``decode`` (same arguments), but steps round by round from Python: the returned ``DecodeStream``
    yields, after prefill and after every round, the tokens each row emitted in that step (an empty list for rows
    that emitted nothing), and says between steps why each row stopped (``stop_reasons``), the log-probabilities
    of the step's tokens (``logprobs``, with ``logprobs=True``) and the whole ``DecodeOutput`` so far
    (``output()``). The rounds run the same ``decode_round`` as the fused loop, so the tokens are identical.
    Arguments are checked when it is called, not at the first ``next()``."""
    if "stop" in kwargs or "detokenize" in kwargs:
        raise ValueError(
            "decode_stream yields every token: look for stop strings over its steps with jspec.stop.StopStrings, "
            "or let decode(stop=..., detokenize=...) do it"
        )
    return prepare(target, target_params, prompts, **kwargs).stream()


@functools.lru_cache(maxsize=64)
def _stream_fns(target, drafter, config):
    """(prefill, round) for stepping from Python. The round's state argument is donated: without it XLA
    copies the whole KV cache into the new state every round (SmolLM2, 1024 slots: streaming ran at 34.7
    plain / 41.5 n-gram tokens/s against 42.0 / 49.8 donated). The caller must use only the returned state."""
    pre = jax.jit(functools.partial(prefill, target, drafter, config))
    rnd = functools.partial(decode_round, target, drafter, config)
    if config.debug_checks:  # the round's check must be functionalised; it raises on the host after the round
        checked = jax.jit(checkify.checkify(rnd), donate_argnums=(2,))
        return pre, lambda *args: _throw(checked(*args))
    return pre, jax.jit(rnd, donate_argnums=(2,))
