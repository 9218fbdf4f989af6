"""OpenAI request bodies -> one checked ``GenerationRequest``, or an ``APIError`` naming the field.

Field names and ranges are OpenAI's and vLLM's (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``return_token_ids`` are vLLM's). The values go through the same checks as ``jspec.decode``
and the engine (``jspec.validate``), so a bad value is refused with the message decode gives, under the API's
name for the field. Nothing is clamped or dropped: an out-of-range value, a field this server does not
implement (``n`` > 1, ``echo``, tools, ...) or one it does not know is a 400 that names it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from jspec import validate as V
from jspec.server.config import ServerConfig

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "min_tokens", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "stream",
    "stream_options", "user", "return_token_ids",
}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
_ROLES = ("system", "developer", "user", "assistant")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

# The names jspec.validate's messages start with, as this API calls them.
_RENAME = {"max_new_tokens": "max_tokens", "stop strings": "stop", "empty prompt": "prompt"}
_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "stop_token_ids", "min_tokens", "logit_bias", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "prompt", "max_new_tokens", "stop strings", "empty prompt",
)  # fmt: skip
_FIELD_AT_START = re.compile(r"^(?:row 0: )?(" + "|".join(re.escape(f) for f in _FIELDS) + r")\b")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One checked request. logprobs: None when not asked for, else how many alternatives per token (0: the
    chosen token's alone). max_tokens: what the request may generate (a default already resolved)."""

    chat: bool
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = dataclasses.field(default=None, hash=False)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """``Engine.add``'s keywords after (row, prompt)."""
        return dict(
            max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
            logit_bias=self.logit_bias, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, stop=self.stop,
        )  # fmt: skip


@contextlib.contextmanager
def _as_fields(prompt_field: str) -> Iterator[None]:
    """A ValueError of ``jspec.validate`` becomes a 400 naming the API's field (``max_new_tokens`` is
    ``max_tokens``, a prompt is ``messages`` in a chat)."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        m = _FIELD_AT_START.match(msg)
        field = None if m is None else _RENAME.get(m.group(1), m.group(1))
        if m is not None:
            msg = msg[m.start(1) :]  # "row 0: " means nothing to a client sending one request
        field = prompt_field if field == "prompt" else field
        raise bad(msg.replace("max_new_tokens", "max_tokens"), field) from None


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    """``body[name]`` of a JSON type in ``kinds`` (null: the default). A JSON true is no number here."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"{name} must be {what}, got {value!r:.80}", name)
    return value


_NUMBER, _INT = (int, float), (int,)


class RequestParser:
    """Checks bodies for one server: its model name, tokenizer, target (vocabulary, context), drafter (a draft
    model's context) and static limits (``ServerConfig``)."""

    def __init__(self, config: ServerConfig, target, drafter, tokenizer, eos_ids):
        self.config, self.target, self.drafter, self.tok = config, target, drafter, tokenizer
        self.eos_ids = tuple(eos_ids)
        ctx = target.max_positions
        # P + N - 1 slots per request: the engine's rows and the model's positions both bound it.
        self.capacity = config.max_len if ctx is None else min(config.max_len, ctx)

    def completion(self, body: Any) -> GenerationRequest:
        body = self._object(body, _COMPLETION)
        if "prompt" not in body or body["prompt"] is None:
            raise bad("prompt is required", "prompt")
        prompt = self._prompt(body["prompt"])
        if _get(body, "echo", (bool,), False, "a boolean"):
            raise bad("echo is not supported by this server (the prompt is not returned)", "echo")
        if _get(body, "best_of", _INT, 1, "an integer") != 1:
            raise bad("best_of must be 1: this server returns one sample per request", "best_of")
        if body.get("suffix") is not None:
            raise bad("suffix is not supported by this server (no fill-in-the-middle)", "suffix")
        n_top = _get(body, "logprobs", _INT, None, "an integer")
        if n_top is not None:
            self._check_logprobs(n_top, "logprobs")
        default = min(COMPLETION_DEFAULT_MAX_TOKENS, max(1, self.capacity - len(prompt) + 1))
        return self._request(body, False, prompt, "prompt", default, n_top)

    def chat(self, body: Any) -> GenerationRequest:
        body = self._object(body, _CHAT)
        prompt = self._messages(body.get("messages"))
        n_top = None
        if _get(body, "logprobs", (bool,), False, "a boolean"):
            n_top = _get(body, "top_logprobs", _INT, 0, "an integer")
            self._check_logprobs(n_top, "top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        # vLLM's default for a chat: whatever the context leaves.
        return self._request(body, True, prompt, "messages", max(1, self.capacity - len(prompt) + 1), n_top)

    # ---------------------------------------------------------------------------------------------------

    def _object(self, body: Any, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad(f"unsupported field {unknown[0]!r} (this server takes: {', '.join(sorted(allowed))})", unknown[0])
        model = body.get("model")
        if model != self.config.model:
            raise bad(f"the model {model!r} does not exist: this server serves {self.config.model!r}", "model",
                      "model_not_found")  # fmt: skip
        if _get(body, "n", _INT, 1, "an integer") != 1:
            raise bad("n must be 1: this server returns one choice per request", "n")
        return body

    def _prompt(self, prompt: Any) -> tuple[int, ...]:
        """A string, token ids, or a list holding one of them (a batch of one)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad("prompt is empty: at least one token is needed", "prompt")
            return tuple(self.tok.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return tuple(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, str | list) for x in prompt):
            raise bad(f"prompt holds {len(prompt)} prompts: this server takes one per request", "prompt")
        raise bad(f"prompt must be a string or a list of token ids, got {prompt!r:.80}", "prompt")

    def _messages(self, messages: Any) -> tuple[int, ...]:
        if not isinstance(messages, list) or not messages:
            raise bad("messages must be a non-empty list of {role, content} objects", "messages")
        chat = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise bad(f"{where} must be an object with a role and a content", where)
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r:.40}", f"{where}.role")
            if isinstance(content, list):  # OpenAI's content parts: only text ones here
                parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
                if any(not isinstance(p, str) for p in parts):
                    raise bad(f"{where}.content: only text parts are supported", f"{where}.content")
                content = "".join(parts)
            if not isinstance(content, str):
                raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
            chat.append({"role": role, "content": content})
        try:
            return tuple(self.tok.encode_chat(chat))
        except ValueError as e:
            raise bad(f"messages: {e}", "messages") from None

    def _check_logprobs(self, n: int, field: str) -> None:
        top = self.config.max_logprobs
        if top is None:
            raise bad("this server was started without log-probabilities (--no-logprobs)", field)
        if not 0 <= n <= top:
            raise bad(f"{field} must be in [0, {top}] (this server's --max-logprobs), got {n}", field)

    def _request(self, body: dict[str, Any], chat: bool, prompt: tuple[int, ...], prompt_field: str, default: int,
                 n_top: int | None) -> GenerationRequest:  # fmt: skip
        cap, p = self.capacity, len(prompt)
        max_tokens = _get(body, "max_tokens", _INT, default, "an integer")
        if max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if p > cap:
            raise bad(f"the prompt has {p} tokens, more than this server's context ({cap} tokens: prompt + "
                      "max_tokens - 1 must fit)", prompt_field, "context_length_exceeded")  # fmt: skip
        if p + max_tokens - 1 > cap:
            raise bad(f"max_tokens ({max_tokens}) + the prompt ({p} tokens) - 1 is past this server's context "
                      f"({cap} tokens): max_tokens may be at most {cap - p + 1}", "max_tokens",
                      "context_length_exceeded")  # fmt: skip
        stream = _get(body, "stream", (bool,), False, "a boolean")
        options = _get(body, "stream_options", (dict,), None, "an object")
        if options is not None and not stream:
            raise bad("stream_options needs stream: true", "stream_options")
        include_usage = _get(options or {}, "include_usage", (bool,), False, "a boolean")
        stop = body.get("stop")
        stop = () if stop is None else stop
        bias = self._logit_bias(body.get("logit_bias"))
        kw = dict(
            temperature=_get(body, "temperature", _NUMBER, 1.0, "a number"),
            top_p=_get(body, "top_p", _NUMBER, 1.0, "a number"),
            top_k=_get(body, "top_k", _INT, 0, "an integer"),
            min_p=_get(body, "min_p", _NUMBER, 0.0, "a number"),
            min_tokens=_get(body, "min_tokens", _INT, 0, "an integer"),
            repetition_penalty=_get(body, "repetition_penalty", _NUMBER, 1.0, "a number"),
            presence_penalty=_get(body, "presence_penalty", _NUMBER, 0.0, "a number"),
            frequency_penalty=_get(body, "frequency_penalty", _NUMBER, 0.0, "a number"),
        )
        if kw["top_k"] == -1:  # vLLM's spelling of "no top-k" (jspec's is 0)
            kw["top_k"] = 0
        if not self.config.penalties:
            for name, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
                if kw[name] != off:
                    raise bad(f"{name}: this server was started without penalties (--no-penalties)", name)
        stop_ids = _get(body, "stop_token_ids", (list,), [], "a list of token ids")
        if len(stop_ids) > self.config.max_stop_ids:
            raise bad(f"stop_token_ids has {len(stop_ids)} ids, more than this server takes per request "
                      f"({self.config.max_stop_ids})", "stop_token_ids")  # fmt: skip
        seed = _get(body, "seed", _INT, None, "an integer")
        with _as_fields(prompt_field):
            stops = V.check_stop_strings(stop)
            sampling = V.sampling_params(
                1, kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"], stop_ids, self.target.vocab_size,
                self.config.max_stop_ids, min_tokens=kw["min_tokens"], logit_bias=bias,
                bias_width=self.config.max_logit_bias, repetition_penalty=kw["repetition_penalty"],
                presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
            )  # fmt: skip
            if seed is not None:
                V.check_seed(seed)
            V.check_engine_request(self.target, self.drafter, prompt, max_tokens, self.config.max_len)
            V.check_min_tokens(sampling, np.asarray([max_tokens]), self.eos_ids, self.target.vocab_size, bool(stops))
        return GenerationRequest(
            chat, prompt, max_tokens, **kw, seed=seed, stop=stops, stop_token_ids=tuple(stop_ids),
            logit_bias=bias, logprobs=n_top, stream=stream, include_usage=include_usage,
            return_token_ids=_get(body, "return_token_ids", (bool,), False, "a boolean"),
        )  # fmt: skip

    def _logit_bias(self, bias: Any) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} (JSON keys are strings) as {id: bias}; the values' range is checked with
        the rest."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise bad(f"logit_bias must be an object mapping token ids to biases, got {bias!r:.80}", "logit_bias")
        out = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise bad(f"logit_bias keys must be token ids (decimal strings), got {key!r:.40}", "logit_bias")
            out[int(key)] = value
        if len(out) > self.config.max_logit_bias:
            raise bad(f"logit_bias has {len(out)} entries, more than this server's --max-logit-bias "
                      f"({self.config.max_logit_bias})", "logit_bias")  # fmt: skip
        return out or None
