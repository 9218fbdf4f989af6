"""Request validation, on the host, before anything is traced: the one place ``jspec.decode``, the serving
engine and the CLI check what they are given. Every check raises a ValueError naming the problem (and the row or
flag); nothing is silently truncated, clamped, cast or ignored. A check returns the value in the form the loop
keeps (a tuple of ids, a bool, a PRNG key, ``SamplingParams`` arrays), so callers never parse again what was
validated.

By subject: ``values`` (numbers, flags, seeds, ids, keys), ``options`` (sampling parameters and request options),
``requests`` (prompts, budgets, the cache), ``drafter`` (the drafter protocol, K, the adaptive policy).
"""

from jspec.validate.drafter import (
    DEFAULT_GAMMA,
    GOODPUT_KS,
    adaptive_policy,
    check_drafter,
    check_goodput,
    check_prior,
    check_protocol,
    goodput_ks,
    tree_scratch,
)
from jspec.validate.options import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    check_greedy_filters,
    check_min_tokens,
    check_stop_strings,
    check_top_logprobs,
    logit_bias_rows,
    sampling_params,
    stop_id_rows,
    stop_string_rows,
)
from jspec.validate.requests import (
    check_draft_context,
    check_engine_options,
    check_engine_request,
    check_prompts,
    default_slots,
)
from jspec.validate.values import as_flags, check_count, check_eos, check_flag, check_seed, decode_key, int_array

__all__ = [
    "DEFAULT_GAMMA",
    "GOODPUT_KS",
    "MAX_ABS_LOGIT_BIAS",
    "MAX_ABS_PENALTY",
    "MAX_TOP_LOGPROBS",
    "REPETITION_PENALTY_RANGE",
    "adaptive_policy",
    "as_flags",
    "check_count",
    "check_draft_context",
    "check_drafter",
    "check_engine_options",
    "check_engine_request",
    "check_eos",
    "check_flag",
    "check_goodput",
    "check_greedy_filters",
    "check_min_tokens",
    "check_prior",
    "check_prompts",
    "check_protocol",
    "check_seed",
    "check_stop_strings",
    "check_top_logprobs",
    "decode_key",
    "default_slots",
    "goodput_ks",
    "int_array",
    "logit_bias_rows",
    "sampling_params",
    "stop_id_rows",
    "stop_string_rows",
    "tree_scratch",
]
