"""The HTTP routes (Starlette, served by uvicorn): ``/v1/completions`` and ``/v1/chat/completions`` (whole or
streamed as server-sent events), ``/v1/models``, ``/health`` and ``/metrics``.

Every error is answered in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: a bad request 400
naming its field, a full queue 429, a server that is stopping 503, anything unexpected 500 (logged; the
server and the other requests go on). An error after a stream began arrives as a last ``data: {"error": ...}``
event before ``data: [DONE]`` (vLLM's convention): the status line is already sent. A client that disconnects
has its request cancelled, which frees its row at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jspec.server.config import ServerConfig
from jspec.server.metrics import CONTENT_TYPE, ServerMetrics
from jspec.server.responses import DONE_LINE, Reply, sse
from jspec.server.schema import APIError, RequestParser, bad
from jspec.server.worker import Delta, Done, EngineWorker, Failed, QueueFull, ShuttingDown, Ticket

log = logging.getLogger("jspec.server")


def create_app(worker: EngineWorker, parser: RequestParser, metrics: ServerMetrics, token_text) -> Starlette:
    """The application over a worker (started with the app, stopped when it shuts down: running requests
    drain for up to ``config.drain_s``, then are cancelled). token_text: one token id -> its text."""
    cfg: ServerConfig = worker.config

    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        try:
            body = await _read_json(request, cfg.max_body_bytes)
            req = parser.chat(body) if chat else parser.completion(body)
        except APIError:
            metrics.refused("invalid")
            raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(ev) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
                loop.call_soon_threadsafe(events.put_nowait, ev)

        ticket = Ticket(req, emit, arrived=time.perf_counter())
        try:
            worker.submit(ticket)
        except QueueFull as e:
            metrics.refused("rejected")
            raise APIError(429, str(e), None, "rate_limit_exceeded", "queue_full") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), None, "server_error", "shutting_down") from None
        reply = Reply(req, cfg.model, token_text)
        if req.stream:
            return StreamingResponse(_stream(ticket, events, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await _whole(request, ticket, events, reply)

    async def _whole(request: Request, ticket: Ticket, events: asyncio.Queue, reply: Reply) -> Response:
        async def collect() -> Done | Failed:
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    reply.add(ev)
                else:
                    return ev

        result = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():  # the client left (or this handler was cancelled): free the row
                worker.cancel(ticket)
                result.cancel()
            gone.cancel()
        if result.cancelled():
            return Response(status_code=499)  # nobody reads it
        ev = result.result()
        if isinstance(ev, Failed):
            raise APIError(500, ev.message, None, "server_error")
        return JSONResponse(reply.final(ev))

    async def _stream(ticket: Ticket, events: asyncio.Queue, reply: Reply) -> AsyncIterator[bytes]:
        ended = False
        try:
            yield reply.opening()
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    yield reply.delta(ev)
                    continue
                ended = True
                if isinstance(ev, Done):
                    yield reply.closing(ev)
                else:
                    yield sse(APIError(500, ev.message, None, "server_error").body()) + DONE_LINE
                return
        finally:
            if not ended:  # the client left mid-stream (the generator is cancelled or closed)
                worker.cancel(ticket)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "created": int(started), "owned_by": "jspec",
             "max_model_len": parser.capacity},
        ]})  # fmt: skip

    async def health(request: Request) -> Response:
        if worker.error is not None:
            return _error(APIError(503, f"the engine failed: {worker.error}", None, "server_error"))
        if not worker.alive:
            return _error(APIError(503, "the server is stopping", None, "server_error", "shutting_down"))
        return JSONResponse({"status": "ok"})

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        worker.start()
        try:
            yield
        finally:  # uvicorn has already waited (up to its graceful timeout) for open responses to finish
            await asyncio.get_running_loop().run_in_executor(None, worker.shutdown, 0.0)

    started = time.time()
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {APIError: _api_error, HTTPException: _http_error, Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused unread past ``limit`` bytes (by its Content-Length, or as it arrives)."""
    length = request.headers.get("content-length", "")
    too_big = f"the request body is larger than this server's limit ({limit} bytes, --max-body-bytes)"
    if length.isdigit() and int(length) > limit:
        raise bad(too_big, None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise bad(too_big, None, "request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was already read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _api_error(request: Request, e: APIError) -> Response:
    return _error(e)


async def _http_error(request: Request, e: HTTPException) -> Response:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return _error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None, kind, code))


async def _unexpected(request: Request, e: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", None, "server_error"))
