"""Request-level runner: requests served by ``jspec.serve.Engine`` (continuous batching) under a fixed load.

- closed loop (``Load.closed(c)``): c clients; each sends its next request as soon as its previous one ends,
  so c requests are always in flight (the engine has c rows). Concurrency 1 measures low-load latency;
  a high concurrency measures saturation throughput. They are separate runs.
- open loop (``Load.open(rate, rows)``): requests arrive at Poisson times (rate per second, arrival times
  a pure function of ``seed``) whether or not the engine keeps up; they wait in a FIFO queue for one of the
  engine's rows. When a row finishes, the next waiting request is prefilled alone and dropped into that row
  while the other rows keep decoding (that is what ``Engine.add`` does).

Time is the host's wall clock (``time.perf_counter``) from the run's start. A request records its arrival,
admission (prefill start), every emission (the prefill's first token, then each round's burst) and finish.
A request that raises (e.g. too long for the cache) is recorded with its error and the run goes on; a
request past its deadline (``timeout_s`` from arrival) is recorded as a timeout: dropped if still queued,
and if running, cancelled (``Engine.cancel``) after the step in which it ran late: its row is freed at once for
the next request, and the tokens it got up to that step are kept.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jspec import cost_model
from jspec.bench import metrics, ratios
from jspec.bench.metrics import RequestRecord
from jspec.serve import Engine
from jspec.state import StopReason
from jspec.validate import DEFAULT_GAMMA, adaptive_policy, sampling_params


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling of every request in a run (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Spec:
    """One decoding configuration: the drafter (None = plain decoding) and its static options.

    ``drafter`` must be hashable (it is a static argument of the jitted loop); ``draft_params`` is its pytree
    (excluded from equality and hashing). ``kind`` is "plain", "chain" or "tree"; ``label`` names the row in
    tables ("ngram K=4"); ``peer`` maps to the peer technique measured against it ("plain", "prompt_lookup",
    "assisted")."""

    label: str
    drafter: Any = None
    gamma: int | None = None
    draft_params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    adaptive: Any = None
    block_verify: bool = False
    peer: str | None = None

    def __post_init__(self):  # adaptive as decode and Engine take it: True = the default AdaptiveK, False = none
        object.__setattr__(self, "adaptive", adaptive_policy(self.adaptive))
        if self.gamma is None:  # the K decode takes when none is given: 0 plain, a tree's depth, else 4
            d = self.drafter
            k = 0 if d is None else d.max_depth if d.is_tree else DEFAULT_GAMMA
            object.__setattr__(self, "gamma", k)

    @property
    def kind(self) -> str:
        if self.drafter is None:
            return "plain"
        return "tree" if self.drafter.is_tree else "chain"

    def describe(self) -> dict[str, Any]:
        d = self.drafter
        return {
            "label": self.label,
            "kind": self.kind,
            "drafter": None if d is None else type(d).__name__,
            "drafter_repr": None if d is None else _short_repr(d),
            "gamma": self.gamma if d is not None else 0,
            "adaptive": None if self.adaptive is None else dataclasses.asdict(self.adaptive),
            "block_verify": self.block_verify,
            "peer": self.peer,
        }


def _short_repr(obj) -> str:
    if dataclasses.is_dataclass(obj):
        parts = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            parts.append(f"{f.name}={getattr(v, 'name', None) or v!r}" if f.name == "model" else f"{f.name}={v!r}")
        return f"{type(obj).__name__}({', '.join(parts)})"[:300]
    return repr(obj)[:300]


@dataclasses.dataclass(frozen=True)
class Load:
    """The offered load. mode "closed": ``concurrency`` clients; mode "open": Poisson arrivals at ``rate``
    requests/s served by ``concurrency`` engine rows. ``timeout_s``: per-request deadline from arrival."""

    mode: str
    concurrency: int
    rate: float | None = None
    seed: int = 0
    timeout_s: float | None = None

    @classmethod
    def closed(cls, concurrency: int, timeout_s: float | None = None) -> Load:
        return cls("closed", concurrency, None, 0, timeout_s)

    @classmethod
    def open(cls, rate: float, rows: int, seed: int = 0, timeout_s: float | None = None) -> Load:
        return cls("open", rows, rate, seed, timeout_s)

    def __post_init__(self):
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency (engine rows) must be >= 1, got {self.concurrency}")
        if self.mode == "open" and not (self.rate and self.rate > 0):
            raise ValueError(f"an open loop needs a rate > 0 requests/s, got {self.rate}")
        if self.timeout_s is not None and not self.timeout_s >= 0:  # 0: every request times out (a test of that)
            raise ValueError(f"timeout_s (the per-request deadline) must be >= 0 seconds or None, got {self.timeout_s}")

    @property
    def name(self) -> str:
        if self.mode == "closed":
            return f"closed c={self.concurrency}"
        return f"open {self.rate:g}/s rows={self.concurrency}"


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """[n] arrival times (s from the start) of a Poisson process of ``rate`` per second: cumulative sums of
    exponential gaps drawn from ``numpy.random.default_rng(seed)``, so the same seed gives the same times."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps)


@dataclasses.dataclass(frozen=True)
class Job:
    """A tokenised request: ``prompt`` ids (None if building it failed, with ``error``)."""

    id: str
    workload: str
    prompt: tuple[int, ...] | None
    error: str | None = None
    request: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


def make_jobs(requests: Sequence, tokenizer, chat_template: bool = True) -> list[Job]:
    """Tokenise ``workloads.Request`` objects with the target's chat template (or raw text). A request whose
    tokenisation raises becomes a job carrying that error, recorded as a failed request by the run."""
    jobs = []
    for r in requests:
        try:
            ids = tokenizer.encode_chat(list(r.messages)) if chat_template else tokenizer.encode(r.prompt_text())
            jobs.append(Job(r.id, r.workload, tuple(int(i) for i in ids), None, r))
        except Exception as e:
            jobs.append(Job(r.id, r.workload, None, f"{type(e).__name__}: {e}", r))
    return jobs


@dataclasses.dataclass
class RunResult:
    """One run: configuration, per-request records, run summary, decode statistics, memory."""

    spec: Spec
    load: Load
    sampling: Sampling
    max_new_tokens: int
    records: list[RequestRecord]
    summary: dict[str, Any]
    decode_stats: dict[str, Any]
    memory: dict[str, Any]
    engine: dict[str, Any]
    phases: dict[str, Any] | None = None
    cost_model: dict[str, Any] | None = None
    quality: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.spec.label

    def tokens_by_id(self) -> dict[str, list[int]]:
        return {r.id: r.tokens for r in self.records if r.ok}

    def itl_ms(self) -> list[float]:
        return [x * 1e3 for r in self.records if r.ok for x in r.itl()]

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        out = {
            "spec": self.spec.describe(),
            "load": dataclasses.asdict(self.load),
            "load_name": self.load.name,
            "sampling": dataclasses.asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "summary": self.summary,
            "decode_stats": self.decode_stats,
            "memory": self.memory,
            "engine": self.engine,
            "phases": self.phases,
            "cost_model": self.cost_model,
            "quality": self.quality,
            **self.extra,
        }
        if with_requests:
            out["requests"] = [r.to_json() for r in self.records]
            # Pooled inter-token intervals (ms) for the latency-distribution plots.
            out["itl_ms_all"] = [round(x, 3) for x in self.itl_ms()]
        return out


def _engine(
    target, params, spec: Spec, rows: int, max_len: int, eos_ids, seed: int, bucket: int, rounds_per_sync: int = 1
) -> Engine:
    eng = Engine(
        target,
        params,
        batch=rows,
        max_len=max_len,
        drafter=spec.drafter,
        draft_params=spec.draft_params,
        gamma=spec.gamma,
        eos_ids=tuple(eos_ids),
        block_verify=spec.block_verify,
        adaptive=spec.adaptive,
        bucket=bucket,
        seed=seed,
        rounds_per_sync=rounds_per_sync,
    )
    # A fresh Engine's state has a weak-typed leaf (its ``stop`` row flags) that the first insert or step
    # makes strong, so each engine function would compile twice; strengthening it up front compiles once.
    eng.state = jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype) if _weak(x) else x, eng.state)
    return eng


def _weak(x) -> bool:
    return bool(getattr(x, "weak_type", False))


def _warm(target, params, spec, load, max_len, eos_ids, bucket, prompt_lens, max_new, sampling, rounds_per_sync=1):
    """Compile everything the timed run will call, by serving a few short dummy requests the same way: one
    prompt per width bucket, more requests than rows (so requests enter both a fresh engine and rows freed
    while others decode: the state's weak types differ between the two, and each variant compiles once).
    prompt_lens: the run's prompt lengths, each fitting max_len next to max_new new tokens."""
    # One real prompt length per width bucket: a dummy of the bucket's full width may not fit next to its new
    # tokens, and a shorter stand-in can fall in the bucket below when max_len clamps the last one.
    longest: dict[int, int] = {}
    for p in prompt_lens:
        if p > 0:
            w = min(-(-p // bucket) * bucket, max_len)
            longest[w] = max(longest.get(w, 0), p)
    if not longest:
        return
    lens = [longest[w] for w in sorted(longest)]
    lens += [min(p for p in prompt_lens if p > 0)] * (load.concurrency + 1)  # fits, as every real prompt does
    new = max(1, min(3, max_new))
    jobs = [Job(f"warm{i}", "warmup", (0,) * n) for i, n in enumerate(lens)]
    # The real EOS ids: they are part of the static decode config, so warming with others compiled programs the
    # timed run never calls, and its first step then compiled inside the timed region.
    run(
        target,
        params,
        spec,
        Load.closed(load.concurrency),
        jobs,
        max_new_tokens=new,
        max_len=max_len,
        sampling=sampling,
        eos_ids=tuple(eos_ids),
        seed=0,
        bucket=bucket,
        warmup=False,
        rounds_per_sync=rounds_per_sync,
        freeze_gc=False,  # the timed run freezes once, after its warm-up
    )
    # A warm request that ends at its first token (EOS) is never stepped: run the step program once explicitly
    # (a stopped row steps as a no-op through it). Not through Engine.step(), which runs nothing when no row runs.
    eng = _engine(target, params, spec, load.concurrency, max_len, eos_ids, 0, bucket, rounds_per_sync)
    eng.add(0, (0,) * lens[-1], new, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    jax.block_until_ready(eng._step(eng.target_params, eng.draft_params, eng.state))


def run(
    target,
    params,
    spec: Spec,
    load: Load,
    jobs: Sequence[Job],
    *,
    max_new_tokens: int,
    max_len: int,
    sampling: Sampling = Sampling(),
    eos_ids: Sequence[int] = (),
    seed: int = 0,
    bucket: int = 64,
    warmup: bool = True,
    decode_text: Callable[[list[int]], str] | None = None,
    scorer: Callable[[Any, str], dict[str, Any]] | None = None,
    max_wall_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    rounds_per_sync: int = 1,
    freeze_gc: bool = True,
) -> RunResult:
    """Serve ``jobs`` under ``load`` and record everything (see the module docstring).

    max_len: the engine's cache slots per row; a job whose prompt + max_new_tokens does not fit raises in
    ``Engine.add`` and is recorded as an error. decode_text / scorer: turn tokens into text and score it
    (``workloads.score``) after the run, outside the timed part. max_wall_s: stop admitting new requests
    after this long; running ones finish, and those never started are recorded with stop reason "not_run"
    (neither errors nor timeouts).
    rounds_per_sync: decode rounds per engine step (``jspec.serve.Engine``); tokens are timestamped when
    their step returns. freeze_gc: freeze the Python heap for the timed part, as a server does once warm
    (``metrics.timed_region_gc``); the collections that still run there are timed into ``engine["gc"]``.
    """
    # The run's own settings are checked here: in the loop below a request that Engine.add refuses is
    # recorded as that request's error, so a bad setting would turn every request into one and still "finish".
    for name, value in (("max_new_tokens", max_new_tokens), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    # Engine.add takes a request when prompt + max_new_tokens - 1 <= max_len (and the model's context): even a
    # 1-token prompt needs max_new_tokens <= both, or every request fails and the run "finishes" with none.
    ctx = getattr(target, "max_positions", None)
    limit, what = (max_len, "max_len") if ctx is None or max_len <= ctx else (ctx, f"{target.name}'s context length")
    if max_new_tokens > limit:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens}) must be <= {what} ({limit}): no request could fit the engine's cache"
        )
    if max_wall_s is not None and not max_wall_s >= 0:  # 0: nothing is admitted (every request "not_run")
        raise ValueError(f"max_wall_s must be >= 0 seconds or None, got {max_wall_s}")
    sampling_params(1, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)  # names a bad one
    rows = load.concurrency
    if warmup:
        # Every prompt the engine takes (P + N - 1 <= max_len: the last token needs no slot) is warmed.
        lens = [len(j.prompt) for j in jobs if j.prompt is not None and len(j.prompt) + max_new_tokens - 1 <= max_len]
        _warm(target, params, spec, load, max_len, eos_ids, bucket, lens, max_new_tokens, sampling, rounds_per_sync)
    engine = _engine(target, params, spec, rows, max_len, eos_ids, seed, bucket, rounds_per_sync)
    k = engine.config.gamma
    stats0 = jax.device_get(engine.state.stats)

    n = len(jobs)
    if load.mode == "open":
        arrivals = list(poisson_arrivals(load.rate, n, load.seed))
    else:
        arrivals = [0.0] * min(rows, n)  # the first c requests at once; each later one when a client frees
    records: list[RequestRecord | None] = [None] * n
    next_job = 0  # next job to arrive
    queue: collections.deque[int] = collections.deque()
    owner: dict[int, int] = {}  # row -> job index of its running request
    step_times: list[float] = []
    add_times: list[float] = []

    with metrics.timed_region_gc(freeze_gc) as gc_stats:
        t0 = clock()

        def now() -> float:
            return clock() - t0

        def arrive(upto: float):
            nonlocal next_job
            while next_job < n and next_job < len(arrivals) and arrivals[next_job] <= upto:
                j = jobs[next_job]
                plen = len(j.prompt) if j.prompt is not None else 0
                records[next_job] = RequestRecord(j.id, j.workload, plen, float(arrivals[next_job]))
                queue.append(next_job)
                next_job += 1

        def client_done(t: float):
            # Closed loop: the client whose request just ended sends its next one now.
            if load.mode == "closed" and len(arrivals) < n:
                arrivals.append(t)

        def finish(i: int, t: float, reason: str, error: str | None = None, timed_out: bool = False):
            rec = records[i]
            rec.finished = t if not (timed_out or reason == "not_run") else None
            rec.stop_reason = reason
            rec.error = error
            rec.timed_out = timed_out
            client_done(t)

        stopped_admitting = False
        while True:
            t = now()
            arrive(t)
            if max_wall_s is not None and t > max_wall_s and not stopped_admitting:
                stopped_admitting = True
            # Deadlines of queued requests.
            # Past the wall limit the queue is drained to the end: in a closed loop each request marked
            # not_run sends its client's next one, which must not be admitted either.
            while load.timeout_s is not None or stopped_admitting:
                for i in list(queue):
                    late = load.timeout_s is not None and t - records[i].arrival > load.timeout_s
                    if late:
                        queue.remove(i)
                        finish(i, t, "timeout", timed_out=True)
                    elif stopped_admitting:  # never started: neither an error nor a timeout of the system
                        queue.remove(i)
                        finish(i, t, "not_run")
                arrive(t)
                if not (stopped_admitting and queue):
                    break
            # Fill free rows.
            busy = set(owner)
            for row in engine.free_rows():
                if row in busy:
                    continue
                while queue:
                    i = queue.popleft()
                    rec, job = records[i], jobs[i]
                    if job.prompt is None:
                        finish(i, now(), "error", job.error)
                        continue
                    rec.admitted = now()
                    try:
                        first = engine.add(
                            row,
                            job.prompt,
                            max_new_tokens,
                            sampling.temperature,
                            sampling.top_k,
                            sampling.top_p,
                            sampling.min_p,
                        )
                    except (ValueError, TypeError) as e:  # a request refused by its checks; the run goes on
                        finish(i, now(), "error", f"{type(e).__name__}: {e}")
                        continue
                    ta = now()
                    add_times.append(ta - rec.admitted)
                    rec.emissions.append((ta, 1))
                    rec.tokens.append(first)
                    reason = engine.stop_reason(row)
                    if reason != StopReason.RUNNING:  # ended at its first token (EOS or a budget of 1)
                        rec.stats = {"rounds": 0, "emitted": 0, "proposed": 0, "accepted": 0}
                        finish(i, ta, reason.name.lower())
                        continue
                    owner[row] = i
                    break
            running = [r for r in owner if engine.stop_reason(r) == StopReason.RUNNING]
            if not running:
                owner.clear()
                if stopped_admitting:  # drained: later arrivals are recorded as not run, not waited for
                    break
                if next_job >= n and not queue:
                    if load.mode == "closed" and len(arrivals) < n:
                        continue
                    break
                if not queue and next_job < len(arrivals):  # idle until the next arrival or the wall limit
                    wait = min(arrivals[next_job], math.inf if max_wall_s is None else max_wall_s) - now()
                    if wait > 0:
                        time.sleep(wait)
                continue
            ts = now()
            emitted = engine.step()
            te = now()
            step_times.append(te - ts)
            done_rows = []
            for row, toks in emitted.items():
                i = owner.get(row)
                if i is None:
                    continue
                rec = records[i]
                if toks:
                    rec.emissions.append((te, len(toks)))
                    rec.tokens.extend(toks)
                if engine.stop_reason(row) != StopReason.RUNNING:
                    done_rows.append(row)
            # Deadlines of running requests: cancelled, their rows freed for the next requests.
            late = []
            if load.timeout_s is not None:
                late = [r for r, i in owner.items() if r not in done_rows and te - records[i].arrival > load.timeout_s]
            if done_rows or late:
                st = jax.device_get(engine.state.stats)
                for row in done_rows + late:
                    i = owner.pop(row)
                    # Per-request counters (reset when a request is inserted, so read before the row is refilled).
                    records[i].stats = {
                        f: int(getattr(st, f)[row]) for f in ("rounds", "emitted", "proposed", "accepted")
                    }
                    if row in late:
                        finish(i, te, "timeout", timed_out=True)
                        engine.cancel(row)
                    else:
                        finish(i, te, engine.stop_reason(row).name.lower())

        wall = now()
    for i, rec in enumerate(records):
        if rec is None:  # never arrived (run wall limit): recorded, not silently dropped
            records[i] = RequestRecord(jobs[i].id, jobs[i].workload, len(jobs[i].prompt or ()), wall)
            records[i].stop_reason = "not_run"
    st = jax.device_get(engine.state.stats)

    if decode_text is not None:
        for i, rec in enumerate(records):
            if rec.tokens:
                rec.text = decode_text(rec.tokens)
            if scorer is not None and rec.ok and jobs[i].request is not None:
                try:
                    rec.quality = scorer(jobs[i].request, rec.text or "")
                except Exception as e:  # a broken check must not lose the run
                    rec.quality = {"check_error": f"{type(e).__name__}: {e}"}

    summary = metrics.summarize_requests(records, wall)
    rounds = sum(r.stats.get("rounds", 0) for r in records)
    emitted_n = sum(r.stats.get("emitted", 0) for r in records)
    proposed = sum(r.stats.get("proposed", 0) for r in records)
    accepted = sum(r.stats.get("accepted", 0) for r in records)
    loop_rounds = int(st.loop_rounds) - int(stats0.loop_rounds)
    wide_rounds = int(st.wide_rounds) - int(stats0.wide_rounds)
    acc_at = (np.asarray(st.accepted_at) - np.asarray(stats0.accepted_at)).tolist()
    prop_at = (np.asarray(st.proposed_at) - np.asarray(stats0.proposed_at)).tolist()
    decode_stats = {
        "definition": (
            "per finished or timed-out request: rounds = verification rounds, emitted = tokens those rounds "
            "appended (accepted candidates + one correction/bonus each; the prefill's first token is not a "
            "round), proposed / accepted = candidates; tokens_per_round = emitted / rounds; acceptance_rate "
            "= accepted / proposed (a property of the proposals, not useful output); accepted_at[i] / "
            "proposed_at[i] = candidates at draft position i (tree: depth i+1) over the whole run"
        ),
        "rounds": rounds,
        "emitted": emitted_n,
        "proposed": proposed,
        "accepted": accepted,
        "rejected": proposed - accepted,
        "tokens_per_round": emitted_n / rounds if rounds else 0.0,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "accepted_at": acc_at,
        "proposed_at": prop_at,
        "acceptance_by_position": [a / p if p else None for a, p in zip(acc_at, prop_at)],
        "engine_steps": len(step_times),
        "engine_rounds": loop_rounds,
        # Rounds that verified wide (K+1 positions or a tree's nodes, not a 1-token step): some row proposed, or
        # the drafter always verifies wide (EAGLE, trees).
        "wide_verify_fraction": wide_rounds / loop_rounds if (k and loop_rounds) else (0.0 if k else None),
    }
    cache_b = metrics.tree_bytes(engine.state.cache)
    draft_state_b = metrics.tree_bytes(engine.state.draft_state)
    draft_b = metrics.tree_bytes(spec.draft_params, shared_with=params)  # its own weights, not the shared ones
    memory = {
        "how": (
            "device_bytes = params + draft params (not counting arrays shared with the target) + KV cache + "
            "drafter state of the serving batch (+ the round's scratch when phases were measured); "
            "max_rss_bytes = process peak RSS so far (getrusage); process_device_peak_bytes = the device's peak "
            "bytes in use since the process started (memory_stats; JAX cannot reset it, so neither is this "
            "run's own peak)"
        ),
        "params_bytes": metrics.tree_bytes(params),
        "draft_params_bytes": draft_b,
        "draft_params_shared_with_target_bytes": metrics.tree_bytes(spec.draft_params) - draft_b,
        "cache_bytes": cache_b,
        "draft_state_bytes": draft_state_b,
        "device_bytes": metrics.tree_bytes(params) + draft_b + cache_b + draft_state_b,
        "max_rss_bytes": metrics.max_rss_bytes(),
        "process_device_peak_bytes": metrics.process_device_peak_bytes(),
    }
    engine_info = {
        "rows": rows,
        "max_len": max_len,
        "bucket": bucket,
        "gamma": k,
        "rounds_per_sync": rounds_per_sync,
        "step_ms": metrics.dist_summary(step_times, 1e3),
        "prefill_insert_ms": metrics.dist_summary(add_times, 1e3),
        "gc": gc_stats,
    }
    return RunResult(spec, load, sampling, max_new_tokens, records, summary, decode_stats, memory, engine_info)


# --------------------------------------------------------------------------------------------------------
# Quality across runs, and the cost-model check


def quality_summary(result: RunResult, reference: RunResult | None = None) -> dict[str, Any]:
    """Task quality of a run; with ``reference`` (plain greedy on the same jobs) also the exact-match rate
    (``exact_match_vs_plain`` over the ``exact_match_n`` requests both finished, ``differ_from_plain_n`` of them
    with other tokens).

    math: answer accuracy; code: ``ast.parse`` validity, defines the function, property check; grounded:
    exact copy/edit rate, mean similarity to the expected text, grounding; all: completion rate (EOS)."""
    by_w: dict[str, list[RequestRecord]] = {}
    for r in result.records:
        if r.ok:
            by_w.setdefault(r.workload, []).append(r)
    out: dict[str, Any] = {}
    for w, recs in sorted(by_w.items()):
        q = [r.quality for r in recs]
        d: dict[str, Any] = {"n": len(recs), "completion_rate": sum(r.stop_reason == "eos" for r in recs) / len(recs)}
        if w == "math":
            d["accuracy"] = _mean([x.get("correct") for x in q])
        elif w == "code":
            d["parses"] = _mean([x.get("parses") for x in q])
            d["defines_function"] = _mean([x.get("defines_function") for x in q])
            d["property_check"] = _mean([x.get("correct") for x in q])
        elif w == "grounded":
            d["exact"] = _mean([x.get("correct") for x in q if "correct" in x])
            d["similarity"] = _mean([x.get("similarity") for x in q if "similarity" in x])
            d["grounding"] = _mean([x.get("grounding") for x in q])
        else:
            d["nonempty"] = _mean([x.get("nonempty") for x in q])
        out[w] = d
    if reference is not None and result.sampling.greedy and reference.sampling.greedy:
        ref = reference.tokens_by_id()
        mine = result.tokens_by_id()
        both = [i for i in mine if i in ref]
        same = sum(mine[i] == ref[i] for i in both)
        out["exact_match_vs_plain"] = same / len(both) if both else None
        out["exact_match_n"] = len(both)
        out["differ_from_plain_n"] = len(both) - same  # ``ratios.outputs_differ`` flags the ratios of such a run
    return out


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def predict_k_rounds(
    baseline_ms: float, draft_step_ms: float, verify_ms: float, rates, k: int, state_ms: float = 0.0
) -> cost_model.CostModelResult:
    """``cost_model.predict`` for rounds that draft K candidates and verify K + 1 positions, as the costs were
    timed: gamma = K, whatever positions the decode measured. ``rates`` (``conditional_rates_from_stats``)
    stop at the last position any round proposed; the positions past it were drafted and never accepted
    (rate 0), so they must not shorten the cycle (``predict`` would take gamma = len(rates) < K, pricing
    fewer draft steps than the rounds ran)."""
    rates = [float(x) for x in rates][:k]
    return cost_model.predict(
        baseline_ms_per_token=baseline_ms,
        draft_ms=draft_step_ms,
        verify_ms=verify_ms,
        state_ms=state_ms,
        gamma=k,
        accept_at=rates + [0.0] * (k - len(rates)),
    )


def cost_model_check(spec_run: RunResult, plain_run: RunResult, phases: dict, plain_phases: dict) -> dict[str, Any]:
    """The seed's cost model next to the measured decode speedup (same load, same jobs).

    baseline = the plain round (ms per token per row); measured costs from ``measure_phases``.
    - "seed": speedup = baseline * E[N] / (K d + verify + state), E[N] from the measured per-position
      acceptance (chains only; ``cost_model.predict``).
    - "measured_en": E[N] = the measured tokens per round, and a cycle that mixes wide rounds (draft + verify
      + state) with rounds where no row proposed (draft + plain step + state), weighted by their measured
      share.
    - "measured_rounds": the same E[N] and share, with the whole fused round timed (wide and narrow) instead
      of the sum of its pieces: what the loop really runs, branching and buffer copies included.
    ratio = predicted / measured (1: the model explains the measurement; > 1: overheads it leaves out).

    The two runs must have served the same requests, and some (``ratios.no_ratio``): otherwise nothing measured
    is compared (measured speedups None, ``different_requests`` says why); the predictions are still given. An
    open loop's end-to-end ratio is not recorded (its wall time follows the arrivals: ``output_speedup_note``)."""
    # The model describes the decode loop, so it is checked against the decode-phase rate (prefill and
    # queueing excluded); the end-to-end output rate ratio is recorded next to it.
    measured = spec_run.summary["decode_tokens_per_s"] / max(plain_run.summary["decode_tokens_per_s"], 1e-12)
    end_to_end = spec_run.summary["output_tokens_per_s"] / max(plain_run.summary["output_tokens_per_s"], 1e-12)
    ds = spec_run.decode_stats
    base = plain_phases["round_ms"]
    out: dict[str, Any] = {"baseline_ms": base}
    differ = ratios.no_ratio(spec_run.summary, plain_run.summary)
    if differ:
        measured = end_to_end = None
        out["different_requests"] = differ
    elif getattr(getattr(spec_run, "load", None), "mode", "closed") == "open":
        end_to_end = None
        out["output_speedup_note"] = ratios.open_loop_note()
    out.update(measured_speedup=measured, measured_output_speedup=end_to_end)
    d, v, s = phases.get("draft_ms") or 0.0, phases.get("verify_ms") or 0.0, phases.get("state_ms") or 0.0
    k = phases.get("gamma") or spec_run.spec.gamma
    if spec_run.spec.kind == "chain" and k:
        try:
            # The pieces were timed drafting K and verifying K + 1 positions, as every wide round does: the cycle
            # is K draft steps (d / K each), whatever positions were measured (``predict_k_rounds``).
            rates = cost_model.conditional_rates_from_stats(ds["accepted_at"], ds["proposed_at"])
            pred = predict_k_rounds(base, d / k, v, rates, k, s)
            out["seed"] = {
                "expected_tokens": pred.expected_tokens,
                "cycle_ms": pred.cycle_ms,
                "speedup": pred.speedup,
                "ratio_to_measured": pred.ratio_to(measured) if measured else None,
                "accept_at": list(pred.accept_at),
                # The seed formula assumes every round drafts K and verifies K + 1: with rounds that proposed
                # nothing (an n-gram miss) it predicts another configuration than the one measured.
                "all_rounds_wide": ds.get("wide_verify_fraction") is None or ds["wide_verify_fraction"] >= 1.0,
            }
        except ValueError as e:  # e.g. no position was ever proposed
            out["seed"] = {"error": str(e)}
    en = ds["tokens_per_round"]
    f = ds.get("wide_verify_fraction")
    # A tree round always verifies its N nodes (no 1-token fallback), so its cycle is always the wide one.
    f = 1.0 if f is None or spec_run.spec.kind == "tree" else f
    if en >= 1:
        # Pieces: the seed's cycle, with rounds where nothing was proposed costing a 1-token step instead.
        cycle = f * (d + v + s) + (1 - f) * (d + plain_phases["plain_step_ms"] + s)
        # Whole rounds: the fused round as the loop runs it, wide and narrow, so branching and copies count.
        narrow = phases.get("round_narrow_ms") or phases["round_ms"]
        cycle_round = f * phases["round_ms"] + (1 - f) * narrow
        for name, cyc in (("measured_en", cycle), ("measured_rounds", cycle_round)):
            if cyc > 0:
                sp = base * en / cyc
                out[name] = {
                    "expected_tokens": en,
                    "wide_fraction": f,
                    "cycle_ms": cyc,
                    "speedup": sp,
                    "ratio_to_measured": sp / measured if measured else None,
                }
    return out
