"""What a benchmark run records: latency distributions, throughput, per-phase costs, memory, environment.

Latency (per request, from the engine's round timestamps):
- TTFT = time from the request's arrival to its first token (queueing + prefill, which samples that token).
- inter-token intervals: after the first token, a round that emits n tokens gives ONE interval (the time since
  the previous emission) followed by n - 1 zero gaps: speculation emits in bursts, and the zeros are kept so
  the distribution shows the bursts and the pauses between them instead of averaging them away.
- total latency = arrival to last token; time per output token (TPOT) = (last token - first emission) /
  (tokens after the first emission), and decode tokens/s = the same over all requests: the decode phase
  alone, which is what speculation changes, while output tokens/s over the run's wall time also pays for
  prefills and queueing. The first emission is jspec's prefill token, but a peer's first burst can carry
  several tokens (transformers' assisted and prompt-lookup generation verify a draft in the same call as the
  prefill): those tokens came before the decode phase's clock starts, so they are not decode tokens.

Phase costs (``measure_phases``): the fused loop cannot be timed per phase from inside, so each phase is a
separately jitted piece on the same shapes as the serving run (same batch, cache slots, context length):
a draft-only rollout, a verify-only target call (K + 1 positions, or the tree's N nodes under its ancestor
mask), a plain 1-token target step, the accept + commit step, and the whole fused round (``decode_round``,
with every candidate proposed; for chain drafters also a round where nothing is proposed, the 1-token
fallback a lookup miss takes); each is timed with ``block_until_ready`` and reported as the median of
repeats, the configurations of one load sampled in turn. The round minus the three phases is reported as
"other": what the pieces leave out (branching and buffer copies inside the fused round; fusion can also
make it negative).

Memory on CPU: ``device_bytes`` adds the bytes of the target params, the draft params, the KV cache (and the
drafter's state) of the serving batch, plus the round's scratch (XLA's temp allocation of the compiled round,
``memory_analysis().temp_size_in_bytes``); ``max_rss_bytes`` is the process's peak resident set size
(``getrusage``), which also counts Python, the tokenizer and anything else loaded. On an accelerator whose
backend reports ``memory_stats()`` the process's peak device bytes so far are recorded too (JAX cannot reset that
peak, so it is not one run's own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import hashlib
import os
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import DraftContext
from jspec.loop import decode_round, prefill, scatter_rows
from jspec.sampling import argmax, distribution
from jspec.serve import freeze_gc_heap
from jspec.state import DecodeConfig
from jspec.tree import ancestor_mask, verify_tree_greedy, verify_tree_key
from jspec.validate import sampling_params
from jspec.verify import verify_chain_greedy, verify_chain_key


def dist_summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """n, median, p95, p99, mean, max of ``values * scale`` (None entries when there are none)."""
    a = np.asarray([v for v in values if v is not None], np.float64) * scale
    if a.size == 0:
        return {"n": 0, "median": None, "p95": None, "p99": None, "mean": None, "max": None}
    return {
        "n": int(a.size),
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "max": float(a.max()),
    }


def inter_token_intervals(emissions: Sequence[tuple[float, int]]) -> list[float]:
    """emissions: [(time, n_tokens)] in order, the first being the first token. Returns the intervals after
    the first token: one real gap per later emission, then n - 1 zeros for the rest of its burst."""
    out: list[float] = []
    for (t_prev, _), (t, n) in zip(emissions, emissions[1:]):
        if n <= 0:
            continue
        out.append(t - t_prev)
        out.extend([0.0] * (n - 1))
    return out


@dataclasses.dataclass
class RequestRecord:
    """Everything recorded about one request (times in seconds from the run's start)."""

    id: str
    workload: str
    prompt_len: int
    arrival: float
    admitted: float | None = None  # prefill started
    emissions: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    finished: float | None = None
    stop_reason: str | None = None  # eos / max_new_tokens / cache_full / error / timeout / not_run
    error: str | None = None
    timed_out: bool = False
    stats: dict[str, int] = dataclasses.field(default_factory=dict)  # rounds / emitted / proposed / accepted
    text: str | None = None
    quality: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Finished normally (not an error, not a timeout)."""
        return self.error is None and not self.timed_out and self.finished is not None

    @property
    def outcome(self) -> str:
        """finished / timeout / not_run / error / unfinished: what became of the request."""
        if self.ok:
            return "finished"
        if self.timed_out:
            return "timeout"
        if self.stop_reason == "not_run":
            return "not_run"
        return "error" if self.error is not None else "unfinished"

    @property
    def ttft(self) -> float | None:
        return self.emissions[0][0] - self.arrival if self.emissions else None

    @property
    def latency(self) -> float | None:
        return self.finished - self.arrival if self.finished is not None else None

    @property
    def decode_time(self) -> float | None:
        """First token to last: the decode phase alone (prefill and queueing excluded)."""
        return self.finished - self.emissions[0][0] if self.emissions and self.finished is not None else None

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first emission (a burst when a peer's first call emits several): the tokens
        ``decode_time`` produced."""
        return len(self.tokens) - self.emissions[0][1] if self.emissions else 0

    def itl(self) -> list[float]:
        return inter_token_intervals(self.emissions)

    def to_json(self) -> dict[str, Any]:
        itl = self.itl()
        return {
            "id": self.id,
            "workload": self.workload,
            "prompt_len": self.prompt_len,
            "output_len": len(self.tokens),
            "arrival_s": self.arrival,
            "admitted_s": self.admitted,
            "finished_s": self.finished,
            "ttft_s": self.ttft,
            "latency_s": self.latency,
            "itl_median_s": float(np.median(itl)) if itl else None,
            "itl_max_s": float(np.max(itl)) if itl else None,
            "bursts": len(self.emissions),
            "stop_reason": self.stop_reason,
            "error": self.error,
            "timed_out": self.timed_out,
            "stats": self.stats,
            "quality": self.quality,
            "text": self.text,
            "tokens": self.tokens,
        }


@contextlib.contextmanager
def timed_region_gc(freeze: bool = True):
    """Around a timed run: with ``freeze``, ``jspec.serve.freeze_gc_heap()`` on entry and ``gc.unfreeze()`` on
    exit (so what the run dropped can be collected before the next one; not when the heap was already frozen
    on entry, which is the caller's to undo); either way every collection inside is timed. Yields a dict
    filled in on exit: frozen, frozen_objects, collections, pause_ms_total, pause_ms_max (the pauses a run
    did pay are reported, not hidden)."""
    stats: dict[str, Any] = {"frozen": bool(freeze), "frozen_objects": 0, "collections": 0}
    pauses: list[float] = []
    started: list[float] = []

    def watch(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    # A caller that froze the heap itself keeps it frozen (gc.unfreeze cannot undo only our part).
    unfreeze = freeze and gc.get_freeze_count() == 0
    if freeze:
        stats["frozen_objects"] = freeze_gc_heap()
    gc.callbacks.append(watch)
    try:
        yield stats
    finally:
        gc.callbacks.remove(watch)
        if unfreeze:
            gc.unfreeze()
        stats["collections"] = len(pauses)
        stats["pause_ms_total"] = round(sum(pauses) * 1e3, 3)
        stats["pause_ms_max"] = round(max(pauses, default=0.0) * 1e3, 3)


def request_set(records: Sequence[RequestRecord]) -> str:
    """A digest of which requests a run served and how each ended (id and ``outcome``): two runs with the
    same digest finished, timed out and left unrun the same requests, so their throughputs are over the same
    work (``ratios.requests_differ``); a wall limit (--max-wall-s) or deadlines (--timeout-s) can cut two
    runs of the same jobs differently."""
    lines = sorted(f"{r.id}\t{r.outcome}" for r in records)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def summarize_requests(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Run-level latency / throughput / counts. Throughput counts only tokens delivered to requests, i.e.
    emitted tokens (accepted candidates + correction/bonus tokens); rejected candidates never appear."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if r.error is not None]
    timeouts = [r for r in records if r.timed_out]
    out_tokens = sum(len(r.tokens) for r in records)
    ok_tokens = sum(len(r.tokens) for r in ok)
    itl = [x for r in ok for x in r.itl()]
    dec = [r for r in ok if r.decode_tokens > 0 and r.decode_time]
    dec_tokens = sum(r.decode_tokens for r in dec)
    dec_time = sum(r.decode_time for r in dec)
    stops: dict[str, int] = {}
    for r in records:
        stops[r.stop_reason or "unfinished"] = stops.get(r.stop_reason or "unfinished", 0) + 1
    return {
        "submitted": len(records),
        "finished": len(ok),
        "errors": len(errors),
        "timeouts": len(timeouts),
        "not_run": sum(r.stop_reason == "not_run" for r in records),  # cut by the run's wall limit
        "request_set": request_set(records),
        "error_messages": sorted({r.error for r in errors if r.error}),
        "stop_reasons": stops,
        "completion_rate": (stops.get("eos", 0) / len(ok)) if ok else 0.0,
        "output_tokens": out_tokens,
        "finished_output_tokens": ok_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "finished_requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        # Decode phase only (tokens after the first emission / time after it), what speculation changes;
        # output_tokens_per_s above also pays for prefills and queueing.
        "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 else 0.0,
        "tpot_ms": dist_summary([r.decode_time / r.decode_tokens for r in dec], 1e3),
        "ttft_ms": dist_summary([r.ttft for r in ok], 1e3),
        "itl_ms": dist_summary(itl, 1e3),
        "itl_nonzero_ms": dist_summary([x for x in itl if x > 0], 1e3),
        "latency_ms": dist_summary([r.latency for r in ok], 1e3),
        "queue_ms": dist_summary([(r.admitted - r.arrival) for r in ok if r.admitted is not None], 1e3),
        "input_len": dist_summary([r.prompt_len for r in records]),
        "output_len": dist_summary([len(r.tokens) for r in ok]),
    }


def tokens_per_round(new_tokens: Sequence[int], rounds: Sequence[int]) -> float:
    """``jspec.decode``'s tokens_per_round from per-request counts: the tokens the rounds emitted (each
    request's new tokens but its first, which the prefill samples and no round does) over the rounds."""
    total = sum(int(r) for r in rounds)
    return sum(max(int(n) - 1, 0) for n in new_tokens) / total if total else 0.0


# --------------------------------------------------------------------------------------------------------
# Environment, checkpoint identity, memory


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(mod)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Hardware and versions, written into every result."""
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "numpy": np.__version__,
        "jspec": _version("jspec"),
        "backend": jax.default_backend(),
        # On GPUs JAX's default lets f32 matmuls run in TF32; the peers' torch does not: recorded with every result.
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "device_count": jax.device_count(),
        "threads": jspec_threads(),  # jspec's side of the peers' thread-count check (``peers.like_for_like_problems``)
    }


def jspec_threads() -> dict[str, Any]:
    """The host threads jspec's runs compute with, as far as knowable from outside XLA: {"threads", "how"}.
    jspec sets no thread count. On the CPU, XLA's intra-op pool takes one thread per CPU this process may run on
    (its affinity mask, which ``os.cpu_count()`` ignores), unless XLA_FLAGS turns the multi-threaded Eigen
    kernels off; on an accelerator the device computes and no host thread count is compared (None)."""
    backend = jax.default_backend()
    if backend != "cpu":
        return {"threads": None, "how": f"backend {backend}: the device computes (no host thread count compared)"}
    flags = os.environ.get("XLA_FLAGS", "")
    if re.search(r"--xla_cpu_multi_thread_eigen=(false|0)\b", flags):
        how = "XLA_FLAGS --xla_cpu_multi_thread_eigen=false: matmuls on one thread (other loops may use XLA's pool)"
        return {"threads": 1, "how": how}
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "threads": n,
        "how": "XLA:CPU's default intra-op pool, one thread per CPU this process may run on (not set by jspec; "
        "read from the affinity mask, as XLA sizes it)",
    }


def file_fingerprint(path: str | os.PathLike | None) -> dict[str, Any]:
    """Path, size and sha256 of the first MiB (enough to tell checkpoints apart without reading 100 MB)."""
    if path is None or not os.path.isfile(path):
        return {"path": None if path is None else os.fspath(path), "sha256_first_mib": None}
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    return {
        "path": os.fspath(path),
        "bytes": os.path.getsize(path),
        "sha256_first_mib": hashlib.sha256(head).hexdigest(),
    }


def tree_bytes(tree: Any, shared_with: Any = None) -> int:
    """Bytes of every array leaf of a pytree (params, caches, states). Leaves that are the very same array
    objects as leaves of ``shared_with`` are not counted (a draft that reuses the target's embedding holds
    no second copy of it)."""
    shared = {id(x) for x in jax.tree.leaves(shared_with)} if shared_with is not None else set()
    seen: set[int] = set()
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "dtype") or id(x) in shared or id(x) in seen:
            continue
        seen.add(id(x))
        total += x.size * x.dtype.itemsize
    return int(total)


def max_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_device_peak_bytes() -> int | None:
    """The first device's peak bytes in use since the PROCESS started (``memory_stats()``, where the backend
    reports it): JAX offers no reset of that peak, so it is the largest of every run so far (and of warm-ups,
    phase timers and peers on the same device), not one run's own peak."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


# --------------------------------------------------------------------------------------------------------
# Per-phase costs


def median_ms(fn: Callable[..., Any], repeats: int = 7, args: Callable[[], tuple] | None = None) -> float:
    """Median wall time of ``fn()`` in ms after one warm-up call (which also compiles).

    args: makes ``fn``'s arguments for each call, outside the timed region (``fn(*args())``): fresh copies of
    what a piece that donates its inputs (a KV cache) consumes, as ``PhaseTimer`` feeds its pieces."""
    make = args or tuple
    jax.block_until_ready(fn(*make()))
    times = []
    for _ in range(repeats):
        a = make()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _phase_fns(target, drafter, config: DecodeConfig, greedy: bool):
    """Jitted pieces of one round, each taking the loop state as an argument (never closed over, so the
    arrays are inputs, not constants folded into the program). The pieces that return a KV cache take it
    donated, as the serving engine's step does: otherwise XLA copies the whole cache into every output
    (~1.6 ms for SmolLM2 at 640 slots, on the plain step and the round alike). ``PhaseTimer`` hands each
    call fresh copies, made outside the timed region. They take the paths the round takes: a drafter that
    shares the target's cache drafts from it, a drafter with its own ``verify`` (EAGLE: the target call that
    also returns its features) verifies, and a greedy batch works on the argmax ids (``greedy``), not on
    [B, T, V] distributions."""
    k = config.gamma
    is_tree = drafter is not None and drafter.is_tree
    shares = drafter is not None and drafter.shares_target_cache
    pre = jax.jit(functools.partial(prefill, target, drafter, config))
    best = target.argmax or argmax

    def _pending(st):
        rows = jnp.arange(st.seq.shape[0])
        committed = st.seq_len - 1
        return st.seq[rows, committed], committed

    def scores(logits, sampling):
        return best(logits).astype(jnp.int32) if greedy else distribution(logits.astype(jnp.float32), sampling)

    def plain(tp, cache, st):  # one plain decoding step: [B, 1] through the target
        st = dataclasses.replace(st, cache=cache)
        pending, committed = _pending(st)
        logits, cache = target.apply(tp, pending[:, None], committed[:, None], st.cache)
        return scores(logits, st.sampling), cache

    def ctx(st):
        max_draft = jnp.full(st.seq_len.shape, k, jnp.int32)
        return DraftContext(st.seq, st.seq_len, max_draft, st.sampling, st.cache if shares else None)

    def draft(dp, st, key):
        if is_tree:
            return drafter.propose_tree(dp, st.draft_state, ctx(st), key)
        return drafter.propose(dp, st.draft_state, ctx(st), key, k)

    def verify(tp, dp, cache, st, prop):
        st = dataclasses.replace(st, cache=cache)
        pending, committed = _pending(st)
        mask = None
        if is_tree:
            tokens = prop.tokens.at[:, 0].set(pending)
            positions = committed[:, None] + prop.depth
            mask = ancestor_mask(prop.parent)
        else:
            tokens = jnp.concatenate([pending[:, None], prop.tokens], axis=1)  # [B, K+1]
            positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        if drafter.verify_updates_state or drafter.shares_target_cache:
            extra = () if mask is None else (mask,)
            out = drafter.verify(target, tp, dp, prop.state, tokens, positions, st.cache, *extra)
            logits, cache = out[0], out[1]
        else:
            logits, cache = target.apply(tp, tokens, positions, st.cache, mask)
        return scores(logits, st.sampling), cache

    def update(st, prop, p, cache, key):
        """Acceptance + commit: the verification rule, the emitted tokens, the sequence and cache commit."""
        b = st.seq.shape[0]
        if is_tree:
            pending, _ = _pending(st)
            tokens = prop.tokens.at[:, 0].set(pending)
            d, c = drafter.max_depth, drafter.max_children
            if greedy:
                res = verify_tree_greedy(p, tokens, prop.parent, prop.valid, d, c)
            else:
                res = verify_tree_key(key, p, prop.q, tokens, prop.parent, prop.valid, drafter.rule, d, c)
            path_tokens = tokens[jnp.arange(b)[:, None], res.path[:, 1:]]
            cache = cache.commit(res.n_accepted + 1, res.path)
        else:
            if greedy:
                q_x = jnp.take_along_axis(prop.q, prop.tokens[..., None], axis=-1)[..., 0]
                res = verify_chain_greedy(p, prop.tokens, prop.n_draft, q_x)
            else:
                res = verify_chain_key(key, p, prop.q, prop.tokens, prop.n_draft, block=config.block_verify)
            path_tokens = prop.tokens
            cache = cache.commit(res.n_accepted + 1)
        j = jnp.arange(path_tokens.shape[1] + 1)[None, :]
        padded = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = jnp.where(j < res.n_accepted[:, None], padded, res.next_token[:, None])
        seq = scatter_rows(st.seq, st.seq_len, emitted, res.n_accepted + 1)
        return seq, cache

    def round_(tp, dp, st):
        return decode_round(target, drafter, config, tp, dp, st)[0]

    return (
        pre,
        jax.jit(plain, donate_argnums=1),
        jax.jit(draft, donate_argnums=1),  # the round updates the drafter's cache in place: so must this piece
        jax.jit(verify, donate_argnums=2),
        jax.jit(update, donate_argnums=3),
        jax.jit(round_, donate_argnums=2),
    )


def fresh(tree):
    """A copy of every array of ``tree``, ready: the argument a donating piece may consume."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


class PhaseTimer:
    """The jitted pieces of one configuration's round, compiled and fed once, timed one sample at a time.

    Several timers sampled in turn (``measure_phases_interleaved``) see the same machine state, so their
    ratios are not biased by load that drifts over minutes (the noise these shared CPUs have)."""

    def __init__(self, target, target_params, drafter, draft_params, config: DecodeConfig, batch: int,
                 context_len: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int = 0):  # fmt: skip
        b, s = batch, config.slots
        n = self.context_len = int(min(max(context_len, 2), s - config.gamma - 3))
        rng = np.random.default_rng(seed)
        # A prompt that repeats a random block: every suffix n-gram occurs earlier, so a lookup drafter
        # proposes its full K and the round takes its wide (K+1-position) path, as a model drafter always does.
        block = rng.integers(0, target.vocab_size, size=(b, min(32, max(n // 2, 1))))
        prompt = jnp.asarray(np.tile(block, (1, -(-n // block.shape[1])))[:, :n], jnp.int32)
        plen = jnp.full((b,), n, jnp.int32)
        max_new = jnp.full((b,), s, jnp.int32)
        # The run's own filters: with none set the sampling path skips its threshold searches, so timing
        # without them would price another configuration than the one measured.
        sampling = sampling_params(b, temperature, top_k, top_p, min_p)
        key = jax.random.split(jax.random.key(seed), b)  # per-row keys, as the serving engine runs them
        pre, plain, draft, verify, update, round_ = _phase_fns(target, drafter, config, bool(temperature == 0))
        st = jax.block_until_ready(pre(target_params, draft_params, prompt, plen, max_new, sampling, key))
        tp, dp = target_params, draft_params
        # name -> (arguments, made before the clock starts: fresh copies of what the piece consumes; the piece)
        self.pieces: dict[str, tuple[Callable[[], tuple], Callable[..., Any]]] = {
            "plain_step_ms": (lambda: (tp, fresh(st.cache), st), plain)
        }
        self.info: dict[str, Any] = {"batch": b, "context_len": self.context_len, "slots": s, "gamma": config.gamma}
        if drafter is not None:
            prop = draft(dp, fresh(st), key)
            p, cache = verify(tp, dp, fresh(st.cache), st, prop)
            self.pieces["draft_ms"] = (lambda: (dp, fresh(st), key), draft)
            self.pieces["verify_ms"] = (lambda: (tp, dp, fresh(st.cache), st, prop), verify)
            self.pieces["state_ms"] = (lambda: (st, prop, p, fresh(cache), key), update)
            self.info["verify_positions"] = int(prop.tokens.shape[1] + (0 if drafter.is_tree else 1))
        self.pieces["round_ms"] = (lambda: (tp, dp, fresh(st)), round_)
        if drafter is not None and not drafter.is_tree and target.vocab_size >= n:
            # Distinct tokens: no suffix occurs earlier, so a lookup drafter proposes nothing and the round
            # takes its narrow path (a 1-token verification). For a model drafter it equals round_ms.
            distinct = np.stack([rng.permutation(target.vocab_size)[:n] for _ in range(b)])
            st_miss = pre(tp, dp, jnp.asarray(distinct, jnp.int32), plen, max_new, sampling, key)
            self.pieces["round_narrow_ms"] = (lambda: (tp, dp, fresh(st_miss)), round_)
        for args, fn in self.pieces.values():  # compile and warm every piece before any sample is taken
            jax.block_until_ready(fn(*args()))
        self.samples: dict[str, list[float]] = {k: [] for k in self.pieces}
        try:
            mem = round_.lower(tp, dp, st).compile().memory_analysis()
            self.info["round_scratch_bytes"] = int(mem.temp_size_in_bytes)
        except Exception as e:  # memory_analysis is backend-dependent; record why it is missing
            self.info["round_scratch_bytes"] = None
            self.info["round_scratch_error"] = f"{type(e).__name__}: {e}"[:200]

    def sample(self) -> None:
        for name, (args, fn) in self.pieces.items():
            a = args()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            self.samples[name].append((time.perf_counter() - t0) * 1e3)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.info)
        out["repeats"] = len(self.samples["round_ms"])
        out["how"] = "separately jitted pieces on the serving shapes, block_until_ready, median of repeats"
        for name, xs in self.samples.items():
            out[name] = float(statistics.median(xs))
        if "draft_ms" not in out:  # plain decoding: its verification is the 1-token step
            out.update(draft_ms=0.0, verify_ms=out["plain_step_ms"], state_ms=None)
        out["other_ms"] = out["round_ms"] - sum(out[k] or 0.0 for k in ("draft_ms", "verify_ms", "state_ms"))
        return out


def measure_phases_interleaved(timers: Sequence[PhaseTimer], repeats: int = 7) -> list[dict[str, Any]]:
    """``repeats`` rounds of one sample from every timer in turn; medians per timer."""
    for _ in range(repeats):
        for t in timers:
            t.sample()
    for t in timers:
        t.info["interleaved_with"] = len(timers)
    return [t.result() for t in timers]


def measure_phases(
    target,
    target_params,
    drafter,
    draft_params,
    config: DecodeConfig,
    batch: int,
    context_len: int,
    *,
    temperature: float = 0.0,
    repeats: int = 7,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-phase costs in ms (medians of ``repeats``) at batch ``batch`` with ``context_len`` committed tokens
    per row in a cache of ``config.slots`` slots. The prompt repeats a random block of token ids, so a
    lookup drafter proposes its full K and the round takes its wide path, as a model drafter's always does
    (``PhaseTimer``); round_narrow_ms times the same round on distinct tokens, where a lookup finds nothing.

    Returns plain_step_ms, draft_ms (the whole rollout for K, or the tree), verify_ms, state_ms (accept +
    commit), round_ms (the fused round as the loop runs it), other_ms = round - draft - verify - state, and
    the round's scratch bytes."""
    timer = PhaseTimer(target, target_params, drafter, draft_params, config, batch, context_len,
                       temperature=temperature, seed=seed)  # fmt: skip
    return measure_phases_interleaved([timer], repeats)[0]
