"""OpenAI's response objects: completions and chat completions, whole or as server-sent-event chunks, with usage
and log-probabilities in each API's format (and vLLM's ``stop_reason`` and ``token_ids``)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from jspec.server.schema import GenerationRequest
from jspec.server.worker import Delta, Done

DONE_LINE = b"data: [DONE]\n\n"
_FLOOR = -9999.0  # OpenAI's log-probability for "impossible": JSON has no -inf


def _lp(x: float) -> float:
    return x if x > _FLOOR else _FLOOR


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}  # fmt: skip


@dataclasses.dataclass
class Reply:
    """One request's answer as it is built: its id, and (not streamed) everything its deltas brought."""

    request: GenerationRequest
    model: str
    token_text: Callable[[int], str]  # one token's text, for log-probabilities
    id: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    offset: int = 0  # characters before the next token (completions' text_offset)

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.request.chat else "cmpl-") + uuid.uuid4().hex

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.tokens += d.tokens
        self.logprobs += d.logprobs or []
        self.top += d.top or []

    # --- whole --------------------------------------------------------------------------------------

    def final(self, done: Done) -> dict[str, Any]:
        lp = self._logprobs(self.tokens, self.logprobs, self.top) if self.request.logprobs is not None else None
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice.update(logprobs=lp, finish_reason=done.finish_reason, stop_reason=done.stop_reason)
        if self.request.return_token_ids:
            choice["token_ids"] = self.tokens
        obj = "chat.completion" if self.request.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(done)}  # fmt: skip

    # --- streamed -----------------------------------------------------------------------------------

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.request.chat else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.request.include_usage:
            out["usage"] = None
        return out

    def opening(self) -> bytes:
        """A chat stream's first chunk names the role (OpenAI's); a completion stream has none."""
        if not self.request.chat:
            return b""
        return sse(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}))  # fmt: skip

    def delta(self, d: Delta) -> bytes:
        lp = None
        if self.request.logprobs is not None and d.logprobs is not None:
            lp = self._logprobs(d.tokens, d.logprobs, d.top or [])
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["delta"] = {"content": d.text}
        else:
            choice["text"] = d.text
        choice.update(logprobs=lp, finish_reason=None)
        if self.request.return_token_ids:
            choice["token_ids"] = d.tokens
        return sse(self._chunk(choice))

    def closing(self, done: Done) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice.update(logprobs=None, finish_reason=done.finish_reason, stop_reason=done.stop_reason)
        out = sse(self._chunk(choice))
        if self.request.include_usage:  # OpenAI's: one more chunk, with no choices and the usage
            chunk = self._chunk({})
            chunk.update(choices=[], usage=usage(done))
            out += sse(chunk)
        return out + DONE_LINE

    # --- log-probabilities ----------------------------------------------------------------------------

    def _logprobs(self, tokens: list[int], lps: list[float], top: list[list[tuple[int, float]]]) -> dict[str, Any]:
        n = self.request.logprobs or 0
        tops = [alts[:n] for alts in top] if n else [[] for _ in tokens]
        texts = [self.token_text(t) for t in tokens]
        if self.request.chat:

            def entry(text: str, lp: float) -> dict[str, Any]:
                return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

            content = [
                {**entry(s, lp), "top_logprobs": [entry(self.token_text(i), a) for i, a in alts]}
                for s, lp, alts in zip(texts, lps, tops)
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for s in texts:
            offsets.append(self.offset)
            self.offset += len(s)
        return {
            "tokens": texts,
            "token_logprobs": [_lp(x) for x in lps],
            "top_logprobs": [{self.token_text(i): _lp(a) for i, a in alts} for alts in tops],
            "text_offset": offsets,
        }
