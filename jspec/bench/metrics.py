"""What a benchmark run records: latency distributions, throughput, memory, environment.

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

Memory on CPU: ``device_bytes`` adds the bytes of the target params, the draft params, the KV cache (and the
drafter's state) of the serving batch, plus the round's scratch (XLA's temp allocation of the compiled round,
``memory_analysis().temp_size_in_bytes``, read by ``phase_costs.PhaseTimer``); ``max_rss_bytes`` is the
process's peak resident set size (``getrusage``), which also counts Python, the tokenizer and anything else
loaded. On an accelerator whose backend reports ``memory_stats()`` the process's peak device bytes so far are
recorded too (JAX cannot reset that peak, so it is not one run's own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import hashlib
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jspec.serve import freeze_gc_heap


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
