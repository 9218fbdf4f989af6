"""The server's static settings: fixed when it starts, because most of them are static shapes of the engine's
compiled programs (rows, cache slots, logprob and logit-bias slots) and changing one would recompile."""

from __future__ import annotations

import dataclasses

from jspec import validate as V

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt of the whole context in JSON is far below it


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """model: the name clients send (``/v1/models`` lists it). rows: requests decoded at once (the engine's
    batch). max_len: cache slots per row, the prompt plus every generated token but the last (vLLM's
    max_model_len). max_queue: requests that may wait for a row; one more is answered 429. max_logprobs: the
    alternatives a request may ask for (the engine computes that many for every row each round), None for no
    log-probabilities at all (the cheapest rounds). max_logit_bias / max_stop_ids: entries a request may give
    (slots the engine keeps per row). penalties: whether requests may set repetition / presence / frequency
    penalties (the engine then keeps [rows, vocab] token counts). rounds_per_sync: decode rounds per host sync.
    bucket: prompt widths are padded to a multiple of it (one prefill program per width). warmup: compile every
    prompt width and the round before taking requests, so no request pays a compilation. drain_s: on
    shutdown, how long running requests may go on before they are cancelled. max_body_bytes: a larger request
    body is refused unread."""

    model: str
    rows: int = 8
    max_len: int = 1024
    max_queue: int = 64
    max_logprobs: int | None = 20
    max_logit_bias: int = 64
    max_stop_ids: int = 4
    penalties: bool = True
    rounds_per_sync: int = 1
    bucket: int = 64
    seed: int = 0
    warmup: bool = True
    drain_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model (the name clients send) must be a non-empty string, got {self.model!r}")
        for name in ("rows", "max_len", "rounds_per_sync", "bucket", "max_body_bytes"):
            V.check_count(name, getattr(self, name))
        for name in ("max_queue", "max_logit_bias", "max_stop_ids"):
            V.check_count(name, getattr(self, name), least=0)
        if self.max_logprobs is not None:
            n, top = self.max_logprobs, V.MAX_TOP_LOGPROBS
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= top:
                raise ValueError(f"max_logprobs must be an int in [0, {top}] or None (none at all), got {n!r}")
        V.check_flag("penalties", self.penalties)
        V.check_flag("warmup", self.warmup)
        V.check_seed(self.seed)
        if not self.drain_s >= 0:
            raise ValueError(f"drain_s must be >= 0 seconds, got {self.drain_s}")
