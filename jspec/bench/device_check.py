"""The pieces of the device check (``examples/device_check.py``): what to run whenever a GPU or TPU is at hand.

- ``greedy_equal``: greedy speculative tokens against plain tokens, per drafter and batch, on this device;
- ``forward_costs``: the target's call at T tokens per row against B rows, after ``context`` cached tokens, timed
  in passes with the widths in rotated order: the cost curve of a plain step (T = 1) and a K + 1 verification;
- ``ControlledDrafter`` and ``controlled_speed``: decode speed with proposals that are right with a set
  probability whatever the weights (random weights make any real drafter's acceptance meaningless), against
  the cost model's prediction from the measured curve.

Nothing here builds a model: the caller passes ``jspec.model.Model``s and params (random weights of real shapes).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.record import rotation
from jspec.decode import prepare
from jspec.drafters import DraftContext, Drafter, Proposal
from jspec.model import Model


@dataclasses.dataclass(frozen=True)
class ControlledDrafter(Drafter):
    """Proposes the target's own greedy continuation, each token right with probability ``accuracy`` and
    otherwise replaced by another token: under greedy verification a proposal is accepted exactly when it is
    right and every one before it was, so a round's expected tokens are 1 + a + ... + a^K with a = accuracy,
    the cost model's assumption, whatever the weights. Draft params: ``reference`` [B, W], each row's greedy
    sequence (prompt, then the plain decode's tokens; ``reference_rows``). Deterministic proposals (one-hot q)."""

    accuracy: float
    _: dataclasses.KW_ONLY
    vocab_size: int

    needs_params: ClassVar[bool] = True

    def __post_init__(self):
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {self.accuracy!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (a wrong token must exist), got {self.vocab_size}")

    def propose(self, params, state, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        ref = params  # [B, W]
        b, w = ref.shape
        pos = jnp.minimum(ctx.seq_len[:, None] + jnp.arange(k)[None, :], w - 1)  # the positions proposed for
        right = jnp.take_along_axis(ref, pos, axis=1)
        k_miss, k_shift = jax.random.split(key)
        miss = jax.random.uniform(k_miss, (b, k)) >= self.accuracy
        shift = jax.random.randint(k_shift, (b, k), 1, self.vocab_size)  # never 0: a wrong token is another one
        tokens = jnp.where(miss, (right + shift) % self.vocab_size, right).astype(jnp.int32)
        n_draft = jnp.minimum(jnp.int32(k), ctx.max_draft).astype(jnp.int32)
        return Proposal(tokens, jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), n_draft, state)


def reference_rows(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[B, width] int32: each row's prompt then its continuation (zeros after): ``ControlledDrafter``'s params."""
    out = np.zeros((len(prompts), width), np.int32)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        row = list(p) + list(c)
        if len(row) > width:
            raise ValueError(f"row {i}: {len(row)} tokens do not fit a reference of width {width}")
        out[i, : len(row)] = row
    return out


def expected_tokens(accuracy: float, k: int) -> float:
    """1 + a + ... + a^K: a chain round's expected tokens when each proposal is right with probability a."""
    return float(sum(accuracy**i for i in range(k + 1)))


def greedy_equal(
    target: Model,
    params,
    drafters: dict[str, tuple[Drafter, Any, dict]],
    prompts: Sequence[Sequence[int]],
    max_new: int,
) -> dict[str, dict[str, Any]]:
    """Per drafter name: whether its greedy tokens equal plain greedy decoding's, row by row, and its tokens per
    round. drafters: name -> (drafter, draft params, extra ``prepare`` keyword arguments). Each drafter runs its
    fixed K unless ``extra`` says otherwise: the check is of its verification path, which the goodput default
    might not take in any round."""
    plain = prepare(target, params, prompts, max_new_tokens=max_new).run()
    out = {}
    for name, (drafter, dparams, extra) in drafters.items():
        kw = {"goodput": False, **extra}
        got = prepare(target, params, prompts, drafter=drafter, draft_params=dparams, max_new_tokens=max_new, **kw)
        res = got.run()
        rows = [i for i, (a, b) in enumerate(zip(res.tokens, plain.tokens)) if a != b]
        out[name] = {
            "equal": not rows,
            "rows_differing": rows,
            "tokens_per_round": res.stats["tokens_per_round"],
            "accepted": res.stats["accepted"],
        }
    return out


def _median_ms(samples: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples)}


def forward_costs(
    target: Model,
    params,
    batches: Sequence[int],
    widths: Sequence[int],
    context: int,
    passes: int = 5,
    calls: int = 3,
) -> dict[int, dict[int, dict[str, float]]]:
    """ms per target call with T tokens per row (``widths``, 1 first: a plain step) on B rows after ``context``
    cached tokens: {B: {T: {median_ms, min_ms, max_ms, relative}}}, relative = median / the T = 1 median. Each
    pass times every width ``calls`` times back to back (their mean is one sample) in an order rotated from pass
    to pass; the call's cache writes are never committed, so every call sees the same cache."""
    widths = sorted(set(int(t) for t in widths))
    if widths[0] != 1:
        raise ValueError(f"widths must include 1 (a plain step, the unit of the costs), got {widths}")
    out: dict[int, dict[int, dict[str, float]]] = {}
    for b in batches:
        slots = context + max(widths) + 1
        cache = target.init_cache(b, slots)
        rng = np.random.default_rng(b)
        prompt = jnp.asarray(rng.integers(0, target.vocab_size, (b, context)), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (b, context))
        _, cache = jax.jit(target.apply)(params, prompt, pos, cache)
        cache = jax.block_until_ready(cache.commit(jnp.full((b,), context, jnp.int32)))
        call = jax.jit(lambda p, t, x, c: target.apply(p, t, x, c)[0])
        inputs = {}
        for t in widths:
            toks = jnp.asarray(rng.integers(0, target.vocab_size, (b, t)), jnp.int32)
            x = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (b, t))
            jax.block_until_ready(call(params, toks, x, cache))  # compile and warm up
            inputs[t] = (toks, x)
        samples: dict[int, list[float]] = {t: [] for t in widths}
        for i in range(passes):
            for t in rotation(widths, i):
                t0 = time.perf_counter()
                for _ in range(calls):
                    y = call(params, *inputs[t], cache)
                jax.block_until_ready(y)
                samples[t].append((time.perf_counter() - t0) * 1e3 / calls)
        base = statistics.median(samples[1])
        out[b] = {t: {**_median_ms(s), "relative": statistics.median(s) / base} for t, s in samples.items()}
    return out


def controlled_speed(
    target: Model,
    params,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    accuracy: float,
    k: int,
    passes: int,
    add_pass: Callable[[int, list[dict[str, Any]]], None],
    run_entry: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """Plain greedy decoding against ``ControlledDrafter(accuracy)`` at K = ``k`` on ``prompts``, ``passes`` times
    in alternating order (each pass's runs go to ``add_pass``, built with ``run_entry``); returns the measured
    tokens per round and acceptance, and whether the speculative tokens were the plain ones."""
    plain = prepare(target, params, prompts, max_new_tokens=max_new)
    ref_out = plain.run()  # also compiles; the reference the drafter proposes from
    width = plain.config.slots + 1
    drafter = ControlledDrafter(accuracy, vocab_size=target.vocab_size)
    ref = jnp.asarray(reference_rows(prompts, ref_out.tokens, width))
    spec = prepare(target, params, prompts, drafter=drafter, draft_params=ref, gamma=k, max_new_tokens=max_new)
    compiled = {"plain": plain.compile(), "spec": spec.compile()}
    prepared = {"plain": plain, "spec": spec}
    last = {}
    for i in range(passes):
        runs = []
        for pos, name in enumerate(rotation(["plain", "spec"], i)):
            t0 = time.perf_counter()
            out = prepared[name].run(compiled[name])
            seconds = time.perf_counter() - t0
            last[name] = out
            n = sum(out.stats["new_tokens"])
            runs.append(run_entry(name, pos, n, seconds, out.stats["loop_rounds"], out.stats["tokens_per_round"]))
        add_pass(i, runs)
    s = last["spec"].stats
    return {
        "identical": last["spec"].tokens == ref_out.tokens,
        "tokens_per_round": s["tokens_per_round"],
        "acceptance": s["acceptance_rate"],
        "expected_tokens_per_round": expected_tokens(accuracy, k),
    }
