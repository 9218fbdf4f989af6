"""The request runner over HTTP: the same jobs and arrival processes as ``runner.run`` (Poisson arrivals at a
rate, or a closed loop of c clients), sent to a running ``python -m jspec serve`` on loopback and timed by the
client, as vLLM's and SGLang's serving benchmarks drive their servers.

Each job is one streamed ``/v1/completions`` request whose prompt is the job's token ids (the exact prompt the
in-process runner prefills), with ``return_token_ids`` (vLLM's field) so that every server-sent event says
how many tokens it carries: an event is an emission, timed when the client reads it. A request's arrival is
its scheduled time (the client's own lag counts against the server, as a user would see it); TTFT, the
inter-token intervals and the totals are then ``metrics.RequestRecord``'s, as in-process. A request refused
(400, 429), cut off or past its deadline (``Load.timeout_s``: the client closes the stream, which cancels it on
the server) is recorded as an error or a timeout and the run goes on. Decode statistics (rounds, tokens per
round, acceptance per position) are the differences of the server's ``/metrics`` counters over the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from jspec.bench import metrics
from jspec.bench.metrics import RequestRecord
from jspec.bench.runner import poisson_arrivals
from jspec.bench.runspec import Job, Load, RunResult, Sampling, Spec

# The in-process runner's stop-reason names for the API's finish reasons.
_STOP = {"length": "max_new_tokens", "stop": "eos"}


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus counters and gauges as {"name{labels}": value} (histograms as _sum/_count)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def decode_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The run's share of the server's counters: rounds, tokens per round, acceptance per draft position."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    positions = sorted({int(k.split('"')[1]) for k in after if k.startswith("jspec_draft_proposed_total{")})
    acc = [delta(f'jspec_draft_accepted_total{{position="{i}"}}') for i in positions]
    prop = [delta(f'jspec_draft_proposed_total{{position="{i}"}}') for i in positions]
    ks = sorted({int(k.split('"')[1]) for k in after if k.startswith("jspec_draft_length_rounds_total{")})
    row_rounds, tokens = delta("jspec_row_rounds_total"), delta("jspec_decode_tokens_total")
    steps = delta("jspec_engine_step_seconds_count")
    return {
        "definition": "differences of the server's /metrics counters over the run (jspec.server.metrics): "
        "tokens_per_round = decode tokens (the prefill's first token excluded) / rounds summed over rows",
        "engine_rounds": delta("jspec_engine_rounds_total"),
        "row_rounds": row_rounds,
        "decode_tokens": tokens,
        "tokens_per_round": tokens / row_rounds if row_rounds else 0.0,
        "accepted_at": acc,
        "proposed_at": prop,
        "acceptance_by_position": [a / p if p else None for a, p in zip(acc, prop)],
        "acceptance_rate": sum(acc) / sum(prop) if sum(prop) else 0.0,
        "draft_lengths": ks,  # the K a round could run (goodput: several) and the engine rounds at each
        "k_rounds": [delta(f'jspec_draft_length_rounds_total{{k="{k}"}}') for k in ks],
        "engine_steps": steps,
        "step_ms_mean": delta("jspec_engine_step_seconds_sum") / steps * 1e3 if steps else None,
    }


def run(url: str, model: str, spec: Spec, load: Load, jobs: Sequence[Job], *, max_new_tokens: int,
        sampling: Sampling = Sampling(), max_wall_s: float | None = None, decode_text=None) -> RunResult:  # noqa: B008  # fmt: skip
    """Serve ``jobs`` under ``load`` through the server at ``url`` (serving ``model``) and record them as
    ``runner.run`` does; ``spec`` names what the server runs (the runner cannot see it)."""
    before = scrape(url)
    records, wall = asyncio.run(_drive(url, model, load, jobs, max_new_tokens, sampling, max_wall_s))
    after = scrape(url)
    if decode_text is not None:
        for rec in records:
            if rec.tokens:
                rec.text = decode_text(rec.tokens)
    stats = decode_stats(before, after)
    k = len(stats["proposed_at"])
    stats["wide_verify_fraction"] = None  # the server does not export it
    engine = {"transport": "http", "url": url, "gamma": k, "step_ms_mean": stats["step_ms_mean"]}
    summary = metrics.summarize_requests(records, wall)
    return RunResult(spec, load, sampling, max_new_tokens, records, summary, stats, {}, engine,
                     extra={"transport": "http"})  # fmt: skip


async def _drive(url, model, load: Load, jobs, max_new_tokens, sampling: Sampling, max_wall_s):
    import httpx

    n = len(jobs)
    records: list[RequestRecord | None] = [None] * n
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        async def one(i: int, arrival: float) -> None:
            job = jobs[i]
            rec = records[i] = RequestRecord(job.id, job.workload, len(job.prompt or ()), arrival)
            if max_wall_s is not None and now() > max_wall_s:
                rec.stop_reason = "not_run"
                return
            if job.prompt is None:
                rec.stop_reason, rec.error = "error", job.error
                return
            body = {"model": model, "prompt": list(job.prompt), "max_tokens": max_new_tokens, "stream": True,
                    "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                    "min_p": sampling.min_p, "return_token_ids": True}  # fmt: skip
            try:
                await asyncio.wait_for(_stream(client, body, rec, now), load.timeout_s)
            except TimeoutError:
                rec.stop_reason, rec.timed_out = "timeout", True
            except (httpx.HTTPError, OSError, ValueError) as e:  # refused, cut off, unreadable: this request's
                rec.stop_reason, rec.error = "error", f"{type(e).__name__}: {e}"[:500]

        if load.mode == "open":
            arrivals = poisson_arrivals(load.rate, n, load.seed)
            tasks = []
            for i, a in enumerate(arrivals):
                await asyncio.sleep(max(0.0, a - now()))
                tasks.append(asyncio.create_task(one(i, float(a))))
            await asyncio.gather(*tasks)
        else:
            next_job = iter(range(n))

            async def client_loop() -> None:
                for i in next_job:
                    await one(i, now())

            await asyncio.gather(*(client_loop() for _ in range(load.concurrency)))
        return records, now()


async def _stream(client, body: dict[str, Any], rec: RequestRecord, now) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            err = json.loads(await resp.aread()).get("error", {})
            raise ValueError(f"HTTP {resp.status_code}: {err.get('message')}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            t, event = now(), json.loads(line[6:])
            if "error" in event:
                raise ValueError(f"server error mid-stream: {event['error'].get('message')}")
            for choice in event.get("choices", ()):
                toks = choice.get("token_ids") or []
                if toks:  # (rec.admitted stays None: a client cannot see when its prefill starts)
                    rec.emissions.append((t, len(toks)))
                    rec.tokens.extend(toks)
                if choice.get("finish_reason"):
                    reason = choice["finish_reason"]
                    rec.stop_reason = "stop_string" if isinstance(choice.get("stop_reason"), str) else _STOP[reason]
    if rec.stop_reason is None:
        raise ValueError("the stream ended without a finish reason")
    rec.finished = rec.emissions[-1][0] if rec.emissions else now()


class ServerProcess:
    """``python -m jspec serve ARGS`` on a loopback port, for the duration of a ``with`` block: started, waited
    for until ``/health`` answers (its warm-up compiles first), stopped with SIGINT (it drains, then exits).
    Its output goes to ``log_path``."""

    def __init__(self, args: Sequence[str], port: int, log_path: str, start_timeout_s: float = 900.0):
        self.args, self.port, self.log_path, self.timeout = list(args), port, log_path, start_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        self.returncode: int | None = None  # after the block: 0 for a clean stop, else what went wrong

    def __enter__(self) -> ServerProcess:
        import httpx

        cmd = [sys.executable, "-m", "jspec", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before serving; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            if time.perf_counter() - t0 > self.timeout:
                self.__exit__()
                raise RuntimeError(f"the server did not answer /health in {self.timeout:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.returncode = self.proc.returncode
        self._log.close()
