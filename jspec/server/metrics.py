"""What ``/metrics`` exposes, in Prometheus' text format (``prometheus_client``, one registry per server so that
two servers in one process, as in the tests, count apart).

Latencies are the benchmark's definitions (``jspec.bench.metrics``), measured on the server: TTFT from a
request's arrival to its first token; an emission of n tokens (one engine step) gives one inter-token interval
(the time since the request's previous emission) and n - 1 zeros, so speculation's bursts and the pauses
between them both show. Acceptance per draft position comes from the engine's own counters, read on the
engine's thread at most once a second (a read is a device transfer; the state is donated to each step, so
no other thread may touch it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from jspec.server.worker import EngineWorker, Ticket

disable_created_metrics()  # each counter's creation time, a second series that nobody graphs
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
_SNAPSHOT_EVERY_S = 1.0


class ServerMetrics:
    def __init__(self, max_tokens_per_round: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("jspec_requests", "Requests by outcome: stop, length (finished), cancelled (the "
                                "client left), error, rejected (429: queue full), invalid (400)", ["outcome"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("jspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("jspec_generation_tokens", "Tokens generated for requests", registry=r)
        self.rounds = Counter("jspec_engine_rounds", "Decode rounds the engine ran (all rows at once)", registry=r)
        self.row_rounds = Counter("jspec_row_rounds", "Decode rounds summed over the rows that ran them", registry=r)
        self.decode_tokens = Counter("jspec_decode_tokens", "Tokens emitted by decode rounds (a request's first "
                                     "token comes from its prefill); / jspec_row_rounds = tokens per round",
                                     registry=r)  # fmt: skip
        self.ttft = Histogram("jspec_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram("jspec_inter_token_latency_seconds", "Per token: the pause before its step's emission "
                             "for the first token of a burst, 0 for the rest", registry=r,
                             buckets=(0.0, *_LATENCY_BUCKETS))  # fmt: skip
        self.latency = Histogram("jspec_request_latency_seconds", "Arrival to the request's end", registry=r,
                                 buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.queue_time = Histogram("jspec_queue_time_seconds", "Arrival to the start of its prefill", registry=r,
                                    buckets=(0.0, *_LATENCY_BUCKETS))  # fmt: skip
        self.prefill_time = Histogram("jspec_prefill_seconds", "One request's prefill and insertion into its row",
                                      registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.step_time = Histogram("jspec_engine_step_seconds", "One engine step (its rounds for every row)",
                                   registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.tokens_per_round = Histogram(
            "jspec_tokens_per_round", "Per running row and step: tokens emitted per round (1 = plain decoding)",
            registry=r, buckets=tuple(float(i) for i in range(1, max_tokens_per_round + 1)),
        )  # fmt: skip
        self._worker: EngineWorker | None = None
        # accepted_at, proposed_at, k_rounds (``bind`` reads them)
        self._base = self._snap = (np.zeros(0), np.zeros(0), np.zeros(0))
        self._snap_t = 0.0
        r.register(_EngineCollector(self))

    def bind(self, worker: EngineWorker) -> None:
        """Before the worker's thread starts (the engine's state is read here)."""
        self._worker = worker
        self.reset_engine_baseline()

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # --- called on the engine's thread -----------------------------------------------------------------

    def _engine_counters(self) -> tuple[np.ndarray, ...]:
        st = self._worker.engine.state.stats
        return tuple(np.asarray(x, np.int64) for x in jax.device_get((st.accepted_at, st.proposed_at, st.k_rounds)))

    def reset_engine_baseline(self) -> None:
        """After the warm-up: its dummy requests' rounds are not the server's."""
        self._base = self._snap = self._engine_counters()

    def prefill(self, started: float, ended: float, arrived: float) -> None:
        self.queue_time.observe(started - arrived)
        self.prefill_time.observe(ended - started)

    def step(self, seconds: float, rounds: int, out: dict[int, list[int]]) -> None:
        self.step_time.observe(seconds)
        self.rounds.inc(rounds)
        self.row_rounds.inc(rounds * len(out))
        for toks in out.values():
            self.decode_tokens.inc(len(toks))
            if rounds and toks:
                self.tokens_per_round.observe(len(toks) / rounds)
        now = time.perf_counter()
        if now - self._snap_t >= _SNAPSHOT_EVERY_S:
            self.snapshot(now)

    def snapshot(self, now: float | None = None) -> None:
        """Read the engine's counters now (``step`` does at most once a second; the worker when its last running
        row ends, so that an idle server's counters are whole)."""
        self._snap, self._snap_t = self._engine_counters(), time.perf_counter() if now is None else now

    def emitted(self, t: Ticket, now: float, n: int) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if t.last_emit is None:
            self.ttft.observe(now - t.arrived)
            self.prompt_tokens.inc(len(t.request.prompt))
            n -= 1
            if n == 0:
                return
            self.itl.observe(0.0)
        else:
            self.itl.observe(now - t.last_emit)
        for _ in range(n - 1):
            self.itl.observe(0.0)

    def finished(self, t: Ticket, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.latency.observe(time.perf_counter() - t.arrived)

    # --- called by the HTTP handlers ------------------------------------------------------------------

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()


class _EngineCollector:
    """The engine's state at scrape time: queue, rows, cache slots, and acceptance per draft position."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        w = self.m._worker
        if w is None:
            return
        waiting, running, used = w.load()
        slots = w.config.rows * w.engine.config.slots
        yield GaugeMetricFamily("jspec_queue_waiting", "Requests waiting for a row", value=waiting)
        yield GaugeMetricFamily("jspec_rows_running", "Rows decoding a request", value=running)
        yield GaugeMetricFamily("jspec_rows", "Rows of the engine (requests decoded at once)", value=w.config.rows)
        yield GaugeMetricFamily("jspec_cache_slots_used", "KV-cache slots held by running requests", value=used)
        yield GaugeMetricFamily("jspec_cache_slots", "KV-cache slots of the engine (rows x slots per row)", value=slots)
        yield GaugeMetricFamily("jspec_cache_usage", "Fraction of the KV cache held by running requests",
                                value=used / slots if slots else 0.0)  # fmt: skip
        acc, prop, k_rounds = (np.asarray(a) - np.asarray(b) for a, b in zip(self.m._snap, self.m._base))
        fams = (
            CounterMetricFamily("jspec_draft_accepted", "Draft candidates accepted at each position (tree: depth "
                                "- 1), as of the last snapshot (<= 1 s old)", labels=["position"]),
            CounterMetricFamily("jspec_draft_proposed", "Draft candidates proposed at each position",
                                labels=["position"]),
            GaugeMetricFamily("jspec_draft_acceptance", "Accepted / proposed at each draft position",
                              labels=["position"]),
        )  # fmt: skip
        for i, (a, p) in enumerate(zip(acc.tolist(), prop.tolist())):
            fams[0].add_metric([str(i)], a)
            fams[1].add_metric([str(i)], p)
            fams[2].add_metric([str(i)], a / p if p else 0.0)
        yield from fams
        ks = CounterMetricFamily("jspec_draft_length_rounds", "Engine rounds run at each draft length K the engine "
                                 "may choose (goodput, the default: several; a fixed K: one), as of the last snapshot",
                                 labels=["k"])  # fmt: skip
        for k, n in zip(w.engine.config.draft_lengths, k_rounds.tolist()):
            ks.add_metric([str(k)], n)
        yield ks
