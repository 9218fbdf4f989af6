"""What jspec needs from a model: a pure call and a cache. jspec never imports ``models``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax


class ApplyFn(Protocol):
    def __call__(
        self,
        params: Any,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32 (RoPE positions; for trees they follow depth, not slot)
        cache: Any,  # a cache pytree with ``lengths`` [B] and ``commit(n, path=None)``
        tree_mask: jax.Array | None = None,  # [B, T, T] bool ancestor mask among the T new tokens; None = causal
    ) -> tuple[jax.Array, Any]:  # logits [B, T, V] (float32), cache with the T entries written, not committed
        ...


@dataclasses.dataclass(frozen=True)
class Model:
    """A target or draft model as the decoder sees it.

    apply: see ``ApplyFn``. The call writes its T tokens' state at slots ``cache.lengths[b] + t`` and leaves
      ``lengths`` unchanged; the decoder commits what it accepts.
    init_cache: ``(batch, slots) -> cache`` with ``lengths`` zero. ``serve.Engine`` also needs the cache's
      ``insert(row, one_row_cache)`` (put a prefilled single-row cache into a row), as ``jspec.cache.KVCache`` has.
    vocab_size: V of the logits.
    name: for error messages and statistics.
    apply_at: optional ``(params, tokens [B, T], positions [B, T], cache, index [B]) -> (logits [B, V], cache)``,
      ``apply`` with the logits of token ``index[b]`` of each row only. The prefill samples from one position
      per row, and the LM head over every prompt token can be a large share of it (~20% for SmolLM2-135M,
      whose head is a fifth of its weights); without ``apply_at`` the prefill takes that row of ``apply``'s
      logits.
    argmax: optional ``logits [..., V] -> ids [...]`` int32 with ``jspec.sampling.argmax``'s contract (the
      lowest index of each row's maximum; V - 1 for a row holding a NaN), e.g. a kernel for the model's
      platform. The greedy paths of a round (plain steps, chain and tree verification) take it for the
      target's logits: on SmolLM2's CPU layout XLA's reductions over a 9-token call's logits were ~0.3 ms of a
      round. Without it, ``jspec.sampling.argmax``.
    max_positions: optional context length: ``prepare`` and ``serve.Engine`` refuse requests that would feed a
      position at or past it (RoPE positions beyond training are accepted by the maths and silently degrade).

    Build one ``Model`` per model and reuse it: it is a static argument of the jitted decoder, compared by
    the identity of its functions.
    """

    apply: Callable[..., tuple[jax.Array, Any]]
    init_cache: Callable[[int, int], Any]
    vocab_size: int
    name: str = "model"
    apply_at: Callable[..., tuple[jax.Array, Any]] | None = None
    argmax: Callable[[jax.Array], jax.Array] | None = None
    max_positions: int | None = None
