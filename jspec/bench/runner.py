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
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jspec.bench import metrics
from jspec.bench.metrics import RequestRecord
from jspec.bench.runspec import Job, Load, RunResult, Sampling, Spec
from jspec.serve import Engine
from jspec.state import StopReason
from jspec.validate import sampling_params


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """[n] arrival times (s from the start) of a Poisson process of ``rate`` per second: cumulative sums of
    exponential gaps drawn from ``numpy.random.default_rng(seed)``, so the same seed gives the same times."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps)


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
        gamma=spec.engine_gamma,
        eos_ids=tuple(eos_ids),
        block_verify=spec.block_verify,
        adaptive=spec.adaptive,
        bucket=bucket,
        seed=seed,
        rounds_per_sync=rounds_per_sync,
        goodput=spec.goodput or None,
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
    sampling: Sampling = Sampling(),  # noqa: B008 (frozen: an immutable default)
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
        # The K a round could choose and the engine rounds run at each (goodput: several; else one).
        "draft_lengths": list(engine.config.draft_lengths),
        "k_rounds": (np.asarray(st.k_rounds) - np.asarray(stats0.k_rounds)).tolist(),
        "rounds_per_sync": rounds_per_sync,
        "step_ms": metrics.dist_summary(step_times, 1e3),
        "prefill_insert_ms": metrics.dist_summary(add_times, 1e3),
        "gc": gc_stats,
    }
    return RunResult(spec, load, sampling, max_new_tokens, records, summary, decode_stats, memory, engine_info)
