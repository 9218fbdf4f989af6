"""Prompts, token budgets and the cache they must fit: ``decode``'s batch and one serving-engine request."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jspec.drafters import Drafter
from jspec.model import Model
from jspec.validate.values import int_array


def default_slots(need: int, ctx: int | None) -> int:
    """The default max_len for ``need`` slots: rounded up to a multiple of 128 so nearby request sizes share one
    compilation, capped at the model's context ``ctx``."""
    slots = -(-need // 128) * 128
    return slots if ctx is None else min(slots, ctx)


def check_prompts(target: Model, prompts, max_new_tokens, max_len, reserve: int = 0):
    """``decode``'s prompts, budgets and cache size -> (prompt [B, P] right-padded to a multiple of 16, prompt
    lengths [B], budgets [B], cache slots S). ``reserve``: slots past each row's P + N - 1 that a default max_len
    also holds (a tree drafter's scratch)."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1):
        raise ValueError(f"max_len (cache slots per row) must be an int >= 1, got {max_len!r}")  # as Engine's
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 2:
        dense = int_array(prompts, "prompts")  # B equal-length prompts: validated without a Python loop
        if dense.shape[0] == 0 or dense.shape[1] == 0:
            raise ValueError(f"prompts array of shape {dense.shape} is empty: at least one token is needed")
        bad = np.nonzero((dense < 0).any(1) | (dense >= target.vocab_size).any(1))[0]
        if bad.size:
            raise ValueError(f"prompt {int(bad[0])} has token ids outside [0, {target.vocab_size})")
        rows = dense.astype(np.int32)
        plen = np.full((dense.shape[0],), dense.shape[1], np.int32)
    else:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        rows = []
        for i, pr in enumerate(prompts):
            arr = int_array(pr, f"prompt {i}")
            if arr.ndim != 1:
                raise ValueError(
                    f"prompt {i} must be a 1-D sequence of token ids, got shape {arr.shape}: prompts is a list of "
                    "prompts ([ids] for one prompt) or a [B, P] array"
                )
            if arr.size == 0:
                raise ValueError(f"prompt {i} is empty: at least one token is needed to start decoding")
            if arr.min() < 0 or arr.max() >= target.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {target.vocab_size})")
            rows.append(arr.astype(np.int32))
        plen = np.array([len(r) for r in rows], np.int32)
    b = len(rows)
    mnew = int_array(max_new_tokens if max_new_tokens is not None else 0, "max_new_tokens")
    mnew = np.full((b,), mnew) if mnew.ndim == 0 else mnew
    if mnew.shape != (b,):
        raise ValueError(f"max_new_tokens must be an int or have one entry per prompt ({b}), got {mnew.shape}")
    if max_new_tokens is not None and np.any(mnew < 1):
        raise ValueError(f"max_new_tokens must be >= 1, got {mnew.tolist()}")
    # Positions fed to the model: 0 .. P + N - 2 (the last token is never fed back); none may reach its context.
    ctx = target.max_positions
    if ctx is not None and max_new_tokens is not None:
        far = np.nonzero(plen + mnew - 1 > ctx)[0]
        if far.size:
            i = int(far[0])
            raise ValueError(
                f"prompt {i} ({plen[i]} tokens) + max_new_tokens ({int(mnew[i])}) runs past {target.name}'s "
                f"context length ({ctx} positions)"
            )
    if max_len is None:
        if max_new_tokens is None:
            raise ValueError("max_new_tokens=None (generate until EOS or a full cache) needs max_len")
        # The last token takes no slot (P + N <= S + 1, below); ``reserve``: a tree's scratch past it, so that the
        # last rounds verify whole trees in every row.
        max_len = default_slots(int((plen + mnew - 1).max()) + reserve, ctx)  # still >= every P + N - 1
    elif ctx is not None and max_new_tokens is None and max_len > ctx:
        raise ValueError(
            f"max_len={max_len} with max_new_tokens=None decodes up to position {max_len - 1}, past "
            f"{target.name}'s context length ({ctx} positions): pass max_len <= {ctx}"
        )
    if max_new_tokens is None:
        mnew = np.full((b,), max_len + 1, np.int64)  # the cache, not the budget, ends these rows
    # The last generated token is never fed back, so it takes no slot: P + N <= S + 1 (what max_new_tokens=None
    # generates into a full cache).
    over = np.nonzero(np.where(max_new_tokens is None, plen + 1, plen + mnew - 1) > max_len)[0]
    if over.size:
        i = int(over[0])
        if max_new_tokens is None:
            raise ValueError(f"prompt {i} ({plen[i]} tokens) leaves no cache slot to generate in (max_len={max_len})")
        raise ValueError(
            f"prompt {i} ({plen[i]} tokens) + max_new_tokens ({int(mnew[i])}) exceeds the cache "
            f"(max_len={max_len} slots hold the prompt and every generated token but the last)"
        )
    pw = min(-(-int(plen.max()) // 16) * 16, max_len)  # padding never past the cache (max_len < 16, say)
    prompt = np.zeros((b, pw), np.int32)
    if isinstance(rows, np.ndarray):
        prompt[:, : rows.shape[1]] = rows
    else:
        for i, r in enumerate(rows):
            prompt[i, : len(r)] = r
    return prompt, plen, mnew.astype(np.int32), int(max_len)


def check_engine_request(target: Model, drafter: Drafter | None, prompt, max_new_tokens, max_len: int):
    """One request for a serving engine of ``max_len`` slots per row -> (prompt [P] int64, max_new_tokens)."""
    prompt = int_array(prompt, "prompt")
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be a 1-D sequence of token ids, got shape {prompt.shape}")
    budget = int_array(max_new_tokens, "max_new_tokens")
    if budget.ndim != 0:
        raise ValueError(f"max_new_tokens must be one int, got shape {budget.shape}")
    max_new_tokens = int(budget)
    if prompt.size == 0:
        raise ValueError("empty prompt: at least one token is needed")
    if prompt.min() < 0 or prompt.max() >= target.vocab_size:
        raise ValueError(f"prompt has token ids outside [0, {target.vocab_size})")
    if max_new_tokens < 1 or prompt.size + max_new_tokens - 1 > max_len:
        raise ValueError(
            f"prompt ({prompt.size} tokens) + max_new_tokens ({max_new_tokens}) must fit the engine's cache "
            f"({max_len} slots hold the prompt and every generated token but the last) and "
            "max_new_tokens must be >= 1"
        )
    ctx = target.max_positions
    if ctx is not None and prompt.size + max_new_tokens - 1 > ctx:
        raise ValueError(
            f"prompt ({prompt.size} tokens) + max_new_tokens ({max_new_tokens}) runs past "
            f"{target.name}'s context length ({ctx} positions)"
        )
    check_draft_context(drafter, np.asarray([prompt.size + max_new_tokens - 1]))
    return prompt, max_new_tokens


def check_engine_options(stop_token_ids, logit_bias, max_logit_bias: int) -> None:
    """The per-request option containers a serving engine takes for one row: a flat id list, one bias dict
    that fits the ``max_logit_bias`` slots its state holds (their values: ``sampling_params``)."""
    if isinstance(stop_token_ids, Sequence) and any(isinstance(x, Sequence) for x in stop_token_ids):
        raise ValueError(f"stop_token_ids must be one flat sequence of token ids, got {stop_token_ids!r:.80}")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be one {{token_id: bias}} dict, got {logit_bias!r:.80}")
    if logit_bias and len(logit_bias) > max_logit_bias:
        raise ValueError(
            f"{len(logit_bias)} logit_bias entries, more than this engine holds per request: build it with "
            f"Engine(..., max_logit_bias={len(logit_bias)}) or more (now {max_logit_bias})"
        )


def check_draft_context(drafter: Drafter | None, last: np.ndarray) -> None:
    """A draft model fed past its own context length drafts garbage (lossless, but nothing is accepted):
    refused like the target's. ``last``: [B] the slots each row fills."""
    dm = drafter.draft_model if drafter is not None else None
    ctx = dm.max_positions if dm is not None else None
    if ctx is not None and np.any(last > ctx):
        i = int(np.argmax(last > ctx))
        raise ValueError(
            f"row {i} runs to position {int(last[i]) - 1}, past the draft model {dm.name}'s context length "
            f"({ctx} positions): lower max_new_tokens / max_len or use a draft with a longer context"
        )
