"""The engine's thread: the only code that touches the device.

HTTP handlers ``submit`` a ``Ticket`` and receive its ``Delta`` / ``Done`` / ``Failed`` events through the
ticket's ``emit`` callback (called on this thread; the handler hands them to its event loop). The thread loops:
cancel what clients abandoned, admit waiting requests into free rows (one prefill each, as
``jspec.serve.Engine.add`` does), then run one engine step for every running row and hand each request its
tokens, its text so far (held back while it could begin a stop string) and its log-probabilities. Waiting
requests are bounded: past ``max_queue`` (with every row busy) ``submit`` raises ``QueueFull`` (429).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from jspec.serve import Engine
from jspec.server.config import ServerConfig
from jspec.server.metrics import ServerMetrics
from jspec.server.schema import GenerationRequest
from jspec.state import StopReason

FINISH_REASON = {StopReason.EOS: "stop", StopReason.STOP_STRING: "stop", StopReason.MAX_NEW_TOKENS: "length",
                 StopReason.CACHE_FULL: "length"}  # fmt: skip


class QueueFull(Exception):
    """Every row is busy and ``max_queue`` requests already wait."""


class ShuttingDown(Exception):
    """The server is stopping: no new request is taken."""


@dataclasses.dataclass(frozen=True)
class Delta:
    """Tokens a step gave one request, with the text they add and, when asked for, their log-probabilities
    (``top``: per token, its (id, log-probability) alternatives, most likely first)."""

    tokens: list[int]
    text: str
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(frozen=True)
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str | int | None = None  # vLLM's: the stop string that ended it, or the end token


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclasses.dataclass(eq=False)
class Ticket:
    """One request between its handler and the engine. ``emit`` is called on the engine's thread."""

    request: GenerationRequest
    emit: Callable[[Event], None]
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    row: int | None = None
    generated: int = 0
    shown: str = ""  # the text already sent
    last_emit: float | None = None


class EngineWorker:
    """Owns ``engine`` on a thread of its own (``start``); ``submit`` / ``cancel`` from any thread."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self._cv = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._owner: dict[int, Ticket] = {}  # row -> its running request
        self._cancels: list[Ticket] = []
        self._stopping = False
        self._abort = False
        self._thread = threading.Thread(target=self._loop, name="jspec-engine", daemon=True)
        self.error: BaseException | None = None  # what ended the thread, if it crashed
        metrics.bind(self)

    # --- from any thread -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread.ident is None:  # a thread starts once; a stopped worker stays stopped
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def load(self) -> tuple[int, int, int]:
        """(waiting, running, cache slots in use): a snapshot for the metrics."""
        with self._cv:
            owners = list(self._owner.values())
            return len(self._waiting), len(owners), sum(len(t.request.prompt) + t.generated for t in owners)

    def submit(self, ticket: Ticket) -> None:
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise ShuttingDown("the server is shutting down")
            free = self.config.rows - len(self._owner)
            if len(self._waiting) >= max(free, 0) + self.config.max_queue:
                raise QueueFull(
                    f"the server is at capacity: {self.config.rows} rows busy and {len(self._waiting)} requests "
                    f"waiting (--max-queue {self.config.max_queue}); retry later"
                )
            self._waiting.append(ticket)
            self._cv.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client left: the request stops and its row is freed at the next step boundary."""
        with self._cv:
            if not ticket.cancelled:
                ticket.cancelled = True
                self._cancels.append(ticket)
                self._cv.notify()

    def shutdown(self, drain_s: float | None = None) -> None:
        """Stop taking requests; let running and waiting ones finish for up to ``drain_s`` (the config's by
        default), then cancel the rest (their clients get a Failed event) and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(self.config.drain_s if drain_s is None else drain_s)
        with self._cv:
            self._abort = True
            self._cv.notify()
        self._thread.join()

    # --- the engine's thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._waiting or self._owner or self._cancels or self._stopping):
                        self._cv.wait()
                    if self._abort or self._stopping and not (self._waiting or self._owner):
                        break
                    cancels, self._cancels = self._cancels, []
                for t in cancels:
                    self._drop(t)
                self._admit()
                if self._owner:
                    self._step()
        except BaseException as e:  # the device failed: every client is told, and /health reports it
            self.error = e
            raise
        finally:
            self._fail_all("the server stopped before this request finished" if self.error is None
                           else f"the engine failed: {type(self.error).__name__}: {self.error}")  # fmt: skip

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            tickets = list(self._waiting) + list(self._owner.values())
            self._waiting.clear()
            self._owner.clear()
        for t in tickets:
            self.metrics.finished(t, "cancelled" if t.cancelled else "error")
            t.emit(Failed(message))

    def _drop(self, t: Ticket) -> None:
        with self._cv:
            if t in self._waiting:
                self._waiting.remove(t)
            elif t.row is not None and self._owner.get(t.row) is t:
                if len(self._owner) == 1:  # the last running request: as in _step, read the counters first
                    self.metrics.snapshot()
                del self._owner[t.row]
                if self.engine.stop_reason(t.row) == StopReason.RUNNING:
                    self.engine.cancel(t.row)
            else:
                return  # it ended before its cancellation arrived
        self.metrics.finished(t, "cancelled")

    def _admit(self) -> None:
        free = [r for r in self.engine.free_rows() if r not in self._owner]
        while free:
            with self._cv:
                if not self._waiting:
                    return
                t = self._waiting.popleft()
            row = free[0]
            started = time.perf_counter()
            try:
                first = self.engine.add(row, t.request.prompt, **t.request.engine_kwargs())
            except ValueError as e:  # the parser checks what add() checks: a slip there, still this request's
                self.metrics.finished(t, "error")
                t.emit(Failed(f"ValueError: {e}"))
                continue
            self.metrics.prefill(started, time.perf_counter(), t.arrived)
            t.row = row
            with self._cv:
                self._owner[row] = t
            free.pop(0)
            self._deliver(t, [first], self.engine.last_logprobs.get(row), self.engine.last_top_logprobs.get(row))

    def _step(self) -> None:
        started = time.perf_counter()
        out = self.engine.step()
        self.metrics.step(time.perf_counter() - started, self.engine.last_rounds, out)
        if all(self.engine.stop_reason(r) != StopReason.RUNNING for r in self._owner):
            # The server goes idle: its counters are read before any client hears of its end (whole when scraped).
            self.metrics.snapshot()
        for row, toks in out.items():
            t = self._owner.get(row)
            if t is not None:
                self._deliver(t, toks, self.engine.last_logprobs.get(row), self.engine.last_top_logprobs.get(row))

    def _deliver(self, t: Ticket, toks: list[int], logprobs, top) -> None:
        """Send a request its new tokens (and its end, when the engine stopped its row)."""
        row, eng = t.row, self.engine
        reason = eng.stop_reason(row)
        t.generated += len(toks)
        text = eng.text(row)
        # A tokenizer may rewrite earlier characters as text grows: only an extension of what was sent is sent.
        delta = text[len(t.shown) :] if text.startswith(t.shown) else ""
        t.shown += delta
        now = time.perf_counter()
        self.metrics.emitted(t, now, len(toks))
        t.last_emit = now
        if toks or delta:
            t.emit(Delta(toks, delta, logprobs if t.request.logprobs is not None else None,
                         top if t.request.logprobs else None))  # fmt: skip
        if reason == StopReason.RUNNING:
            return
        with self._cv:
            self._owner.pop(row, None)
        stop: str | int | None = None
        if reason == StopReason.STOP_STRING:
            stop = eng.matched_stop(row)
        elif reason == StopReason.EOS and toks:
            stop = int(toks[-1])
        finish = FINISH_REASON.get(reason, "stop")
        self.metrics.finished(t, finish)
        t.emit(Done(finish, len(t.request.prompt), t.generated, stop))

    def warm(self) -> float:
        """Compile every program requests can reach before any arrives: one prefill per prompt width (a
        multiple of ``bucket`` up to the cache) and the step. Runs on the caller's thread, before ``start``."""
        if self._thread.is_alive():
            raise RuntimeError("warm() runs before start(): the engine belongs to its thread once started")
        t0 = time.perf_counter()
        eng, cfg = self.engine, self.config
        widths = range(cfg.bucket, eng.config.slots + cfg.bucket, cfg.bucket)
        for w in sorted({min(w, cfg.max_len, eng.config.slots) for w in widths}):
            eng.add(0, np.zeros(max(1, w - 1), np.int64), 2)  # w - 1 tokens: in w's bucket, with room for 2 new
            eng.step()
            if eng.stop_reason(0) == StopReason.RUNNING:
                eng.cancel(0)
        self.metrics.reset_engine_baseline()
        return time.perf_counter() - t0
