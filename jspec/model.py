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
    init_cache: ``(batch, slots) -> cache`` with ``lengths`` zero.
    vocab_size: V of the logits.
    name: for error messages and statistics.
    apply_at: optional ``(params, tokens [B, T], positions [B, T], cache, index [B]) -> (logits [B, V], cache)``,
      ``apply`` with the logits of token ``index[b]`` of each row only. The prefill samples from one position
      per row, and the LM head over every prompt token can be a large share of it (~20% for SmolLM2-135M,
      whose head is a fifth of its weights); without ``apply_at`` the prefill takes that row of ``apply``'s
      logits.

    Build one ``Model`` per model and reuse it: it is a static argument of the jitted decoder, compared by
    the identity of its functions.
    """

    apply: Callable[..., tuple[jax.Array, Any]]
    init_cache: Callable[[int, int], Any]
    vocab_size: int
    name: str = "model"
    apply_at: Callable[..., tuple[jax.Array, Any]] | None = None
