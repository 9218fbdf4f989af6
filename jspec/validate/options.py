"""A request's sampling parameters and options: ranges, ids, stop strings, min_tokens and what it can hold back."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.sampling import SamplingParams
from jspec.validate.values import _has_bool, int_array

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; each one is a max/min pass over V per generated position
# OpenAI's range for a logit bias (-inf, a ban, is jspec's addition); the repetition penalty's keeps a penalised
# logit far from float32's overflow (logit / 1e-38 is +inf, and then the softmax is NaN).
MAX_ABS_LOGIT_BIAS = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_ABS_PENALTY = 2.0  # presence and frequency (OpenAI's and vLLM's range)


def sampling_params(
    batch: int,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    stop_token_ids=None,
    vocab_size: int | None = None,
    stop_width: int | None = None,
    *,
    min_tokens=0,
    logit_bias=None,
    bias_width: int | None = None,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
) -> SamplingParams:
    """``SamplingParams`` of [B] arrays from scalars or per-row sequences, validated on the host.

    stop_token_ids: None or one flat sequence of token ids for every row, or B sequences (one per row, of
    any lengths); each id must lie in [0, vocab_size) when ``vocab_size`` is given. stop_width: E, the
    fixed number of id slots per row (a serving engine's state keeps one shape; more ids are refused);
    unset, the longest row's count rounded up to a multiple of 4, so a few more or fewer ids reuse the
    compiled loop.
    min_tokens: a scalar or [B] ints >= 0. logit_bias: None, one ``{token_id: bias}`` dict for every row, or B
    of them (None for a row without); biases in [-100, 100] (OpenAI's range) or -inf (a ban). bias_width: M,
    slots per row (as stop_width; unset, the largest dict's size rounded up to a multiple of 4).
    repetition_penalty: in [0.01, 100]; presence_penalty, frequency_penalty: in [-2, 2] (vLLM's and OpenAI's
    range)."""

    def col(x, dtype, name):
        if dtype == np.int32:
            a = int_array(x, name)
            if a.size and (a.min() < -np.iinfo(np.int32).max or a.max() > np.iinfo(np.int32).max):
                raise ValueError(f"{name} is out of range: {a.tolist()!r:.80}")
        else:
            try:
                a = np.asarray(x)
            except ValueError as e:  # ragged nesting
                raise ValueError(f"{name} must be numbers, got {x!r:.80}: {e}") from None
            if a.dtype.kind not in "iufV" or _has_bool(x):  # True is not 1.0, nor "0.7" a temperature (V: bf16)
                raise ValueError(f"{name} must be numbers, got {x!r:.80}")
        a = a.astype(dtype)
        if a.ndim == 0:
            a = np.full((batch,), a, dtype=dtype)
        if a.shape != (batch,):
            raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {a.shape}")
        return a

    t = col(temperature, np.float32, "temperature")
    k = col(top_k, np.int32, "top_k")
    p = col(top_p, np.float32, "top_p")
    m = col(min_p, np.float32, "min_p")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t.tolist()}")
    # Below float32's smallest normal number a temperature is 0 after the cast or a subnormal that XLA
    # flushes to 0: either way greedy, which was not asked for.
    asked = np.broadcast_to(np.asarray(temperature, np.float64), t.shape)
    tiny = (asked > 0) & (asked < np.finfo(np.float32).tiny)
    if np.any(tiny):
        raise ValueError(
            f"temperature {float(asked[tiny][0])!r} is below float32's smallest normal value "
            f"({float(np.finfo(np.float32).tiny):.3g}): pass 0 for greedy"
        )
    if np.any(k < 0):
        raise ValueError(f"top_k must be >= 0 (0 = disabled), got {k.tolist()}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {p.tolist()}")
    if not np.all(np.isfinite(m)) or np.any(m < 0) or np.any(m > 1):
        raise ValueError(f"min_p must be in [0, 1] (0 = disabled), got {m.tolist()}")
    stops = stop_id_rows(stop_token_ids, batch, vocab_size, stop_width)
    n_min = col(min_tokens, np.int32, "min_tokens")
    if np.any(n_min < 0):
        raise ValueError(f"min_tokens must be >= 0 (0 = disabled), got {n_min.tolist()}")
    ids, vals = logit_bias_rows(logit_bias, batch, vocab_size, bias_width)
    rep = col(repetition_penalty, np.float32, "repetition_penalty")
    lo, hi = REPETITION_PENALTY_RANGE
    if not np.all(np.isfinite(rep)) or np.any(rep < lo) or np.any(rep > hi):
        raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = disabled), got {rep.tolist()}")
    pres = col(presence_penalty, np.float32, "presence_penalty")
    freq = col(frequency_penalty, np.float32, "frequency_penalty")
    for name, a in (("presence_penalty", pres), ("frequency_penalty", freq)):
        if not np.all(np.isfinite(a)) or np.any(np.abs(a) > MAX_ABS_PENALTY):
            raise ValueError(
                f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] (0 = disabled), got {a.tolist()}"
            )
    return SamplingParams(*(jnp.asarray(x) for x in (t, k, p, m, stops, n_min, ids, vals, rep, pres, freq)))


def stop_id_rows(stop_token_ids, batch: int, vocab_size: int | None = None, width: int | None = None) -> np.ndarray:
    """``sampling_params``' stop_token_ids -> [B, E] int32, -1 padded (see there)."""
    ids = [] if stop_token_ids is None else stop_token_ids
    if hasattr(ids, "shape") and hasattr(ids, "dtype"):  # a NumPy or JAX array: [E] for every row, or [B, E]
        ids = np.asarray(ids)
        ids = ids.tolist() if ids.ndim else ids.item()
    if not isinstance(ids, list | tuple):
        hint = f": use [{ids!r}]" if isinstance(ids, int | float | np.number) else ""
        raise ValueError(f"stop_token_ids must be a sequence of token ids, got {ids!r:.80}{hint}")
    nested = [isinstance(x, list | tuple) or getattr(x, "ndim", 0) > 0 for x in ids]
    if any(nested) and not all(nested):
        raise ValueError(f"stop_token_ids must be token ids or one sequence of them per row, not a mix: {ids!r:.80}")
    if any(nested):
        if len(ids) != batch:
            raise ValueError(f"stop_token_ids has {len(ids)} per-row sequences for {batch} rows")
        rows = [int_array(r.tolist() if hasattr(r, "tolist") else r, f"stop_token_ids[{i}]") for i, r in enumerate(ids)]
    else:
        rows = [int_array(ids, "stop_token_ids")] * batch
    for i, r in enumerate(rows):
        if r.ndim != 1:
            raise ValueError(f"stop_token_ids[{i}] must be a flat sequence of token ids, got shape {r.shape}")
        top = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
        if r.size and (r.min() < 0 or r.max() >= top):
            bad = r[(r < 0) | (r >= top)].tolist()
            raise ValueError(f"stop_token_ids must be token ids in [0, {top}), got {bad}")
    width = _slot_width(max((r.size for r in rows), default=0), width, "stop token ids")
    out = np.full((batch, width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : r.size] = r
    return out


def _slot_width(longest: int, width: int | None, what: str) -> int:
    """Slots per row for a per-row list of at most ``longest`` entries: ``width`` when given (more entries than
    that are refused, never cut), else ``longest`` rounded up to a multiple of 4 so a few more or fewer entries
    share one compiled loop."""
    if width is None:
        return -(-longest // 4) * 4
    if longest > width:
        raise ValueError(f"{longest} {what} for one row, more than the {width} this state holds")
    return width


def logit_bias_rows(
    logit_bias, batch: int, vocab_size: int | None = None, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``sampling_params``' logit_bias -> (ids [B, M] int32, -1 padded; biases [B, M] float32), see there."""
    if logit_bias is None:
        rows = [{}] * batch
    elif isinstance(logit_bias, dict):
        rows = [logit_bias] * batch
    elif isinstance(logit_bias, list | tuple) and all(r is None or isinstance(r, dict) for r in logit_bias):
        if len(logit_bias) != batch:
            raise ValueError(f"logit_bias has {len(logit_bias)} per-row dicts for {batch} rows")
        rows = [r or {} for r in logit_bias]
    else:
        raise ValueError(
            f"logit_bias must be a {{token_id: bias}} dict, or one such dict (or None) per row, got {logit_bias!r:.80}"
        )
    top = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    checked = []
    for i, r in enumerate(rows):
        where = "logit_bias" if isinstance(logit_bias, dict) else f"logit_bias[{i}]"
        ids = int_array(list(r.keys()), f"{where}'s token ids")
        if ids.size and (ids.min() < 0 or ids.max() >= top):
            raise ValueError(f"{where} must have token ids in [0, {top}), got {ids[(ids < 0) | (ids >= top)].tolist()}")
        vals = list(r.values())
        number = (int, float, np.integer, np.floating)
        if any(isinstance(v, bool | np.bool_) or not isinstance(v, number) for v in vals):
            raise ValueError(f"{where}'s biases must be numbers, got {vals!r:.80}")
        try:
            vals = np.asarray([float(v) for v in vals], np.float64)
        except OverflowError:  # an int past float64
            raise ValueError(f"{where}'s biases must be finite (or -inf, a ban), got {vals!r:.80}") from None
        bad = np.isnan(vals) | (vals == np.inf)
        if np.any(bad):
            raise ValueError(f"{where}'s biases must be finite (or -inf, a ban), got {vals[bad].tolist()}")
        bad = np.isfinite(vals) & (np.abs(vals) > MAX_ABS_LOGIT_BIAS)
        if np.any(bad):
            raise ValueError(
                f"{where}'s biases must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] (or -inf, a ban), "
                f"got {vals[bad].tolist()}"
            )
        if vocab_size is not None and np.sum(vals == -np.inf) >= vocab_size:
            raise ValueError(f"{where} bans every token of the vocabulary: nothing could be sampled")
        checked.append((ids, vals))
    width = _slot_width(max((ids.size for ids, _ in checked), default=0), width, "logit_bias entries")
    out_ids = np.full((batch, width), -1, np.int32)
    out_vals = np.zeros((batch, width), np.float32)
    for i, (ids, vals) in enumerate(checked):
        out_ids[i, : ids.size] = ids
        out_vals[i, : ids.size] = vals
    return out_ids, out_vals


def check_greedy_filters(temperature, top_k, top_p, min_p) -> None:
    """A sampling filter (--top-k, --top-p, --min-p) at --temperature 0 would be ignored (greedy): refused."""
    if temperature == 0:
        for flag, value, off in (("--top-k", top_k, 0), ("--top-p", top_p, 1.0), ("--min-p", min_p, 0.0)):
            if value != off:
                raise ValueError(f"{flag} {value} has no effect at --temperature 0 (greedy): set a temperature > 0")


def check_top_logprobs(n, logprobs: bool, vocab_size: int | None = None) -> int:
    """top_logprobs as the static N of ``DecodeConfig``: an int in [0, 20] (and at most V), with logprobs=True
    (as OpenAI's API asks; the chosen token's own log-probability comes with its alternatives)."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
    if vocab_size is not None and n > vocab_size:
        raise ValueError(f"top_logprobs={n} is more than the vocabulary ({vocab_size} tokens)")
    if n and not logprobs:
        raise ValueError(f"top_logprobs={n} needs logprobs=True (the chosen tokens' log-probabilities come with them)")
    return int(n)


def check_min_tokens(
    sampling: SamplingParams,
    max_new: np.ndarray,
    eos_ids,
    vocab_size: int,
    stop_strings: bool | Sequence[bool] | None = None,
) -> None:
    """min_tokens above the tokens a row may generate (``max_new``: its budget, or what its cache holds) is
    refused (vLLM's rule: no end token could ever come, which is surely not what was meant); so is min_tokens on
    a row with nothing to hold back, which would be ignored: no EOS ids, no stop ids of its own and no stop
    strings (``stop_strings``: whether the row has any, one bool or one per row, where the caller takes them;
    None where there are none to take); and so is a row whose banned tokens (logit_bias -inf) and end
    tokens, masked while min_tokens holds, leave nothing to sample."""
    n_min, ids, bias, stops = jax.device_get((sampling.min_tokens, sampling.bias_ids, sampling.bias, sampling.stop_ids))
    if np.any(n_min > max_new):
        i = int(np.argmax(n_min > max_new))
        raise ValueError(
            f"row {i}: min_tokens ({int(n_min[i])}) is more than the {int(max_new[i])} tokens it may generate "
            "(max_new_tokens, or what the cache holds)"
        )
    has_strings = np.asarray(False if stop_strings is None else stop_strings, bool)
    if has_strings.ndim and has_strings.shape != n_min.shape:
        raise ValueError(f"stop_strings has {has_strings.size} entries for {n_min.size} rows")
    has_strings = np.broadcast_to(has_strings, n_min.shape)
    for i in np.nonzero(n_min > 0)[0]:
        ends = set(eos_ids) | set(stops[i][stops[i] >= 0].tolist())
        if not ends and not has_strings[i]:
            raise ValueError(
                f"row {i}: min_tokens ({int(n_min[i])}) holds back nothing: the row has no end token (EOS ids, "
                "stop_token_ids)" + (" or stop string" if stop_strings is not None else "") + " to keep back"
            )
        if len(set(ids[i][bias[i] == -np.inf].tolist()) | ends) >= vocab_size:
            raise ValueError(
                f"row {i}: min_tokens masks the end tokens and logit_bias bans every other token: nothing is left "
                "to sample"
            )


def check_stop_strings(stops) -> tuple[str, ...]:
    """``stops`` as a tuple of non-empty strings; one string is one stop string (as OpenAI's and vLLM's ``stop``
    take it: "\\n\\n" is the blank line, not two newlines)."""
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, Sequence):
        raise ValueError(f"stop strings must be a string or a list of strings, got {stops!r:.80}")
    bad = [s for s in stops if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop strings must be non-empty strings, got {bad!r:.80}")
    return tuple(stops)


def stop_string_rows(stop, batch: int) -> list[tuple[str, ...]]:
    """``decode``'s ``stop`` -> one tuple of stop strings per row: a string, or a list of strings, for every row;
    or one entry per row (a list of B lists, each None, a string or a list of strings)."""
    per_row = isinstance(stop, Sequence) and not isinstance(stop, str)
    if per_row and any(x is None or isinstance(x, list | tuple) for x in stop):
        if len(stop) != batch:
            raise ValueError(f"stop has {len(stop)} per-row entries for {batch} rows")
        return [() if x is None else check_stop_strings(x) for x in stop]
    return [check_stop_strings(stop)] * batch
