"""Peer implementations measured in the same run, on the same checkpoint file and the same prompt ids.

This module holds what the peers share: their result (``PeerRun``), the closed loop that serves a peer one
request at a time (``_serve_sequentially``), the GGUF file's weight types (``gguf_weights``) and what makes a
peer run another computation than jspec's (``like_for_like_problems``). The runners are ``peer_transformers``
and ``peer_llama_cpp``; ``suite_peers.run_peers`` runs them by name.

- transformers (torch CPU): plain ``generate``, prompt lookup (``prompt_lookup_num_tokens``) and assisted
  generation (``assistant_model``: here the target's first layers, the same truncated draft a jspec
  ``ModelDrafter`` can use), loaded by transformers' own GGUF converter from the same .gguf file (f32).
- llama-cpp-python: plain and prompt lookup (``LlamaPromptLookupDecoding``), running the GGUF natively (its
  quantised weights, not jspec's f32 dequantisation, and llama.cpp's f16 KV cache: a different numerical
  target and a different amount of arithmetic, so exact match with jspec is not expected and no ratio is
  given unless the file's weights and the cache are in jspec's dtype; see ``like_for_like_problems``).

Every run records what it computed with in its ``info``: ``weights_dtype`` and ``kv_cache_dtype`` ("float32",
or the GGUF types a runner kept, e.g. "Q4_1+F32+Q8_0"), ``device``, ``threads`` (torch's intra-op threads,
llama.cpp's ``n_threads`` and ``n_threads_batch``) and, for speculative techniques, ``gamma`` (K).
``suite_peers.run_peer_set`` gives both peers one thread count (jspec's XLA pool size unless told another),
compares what they recorded with jspec's run and records the differences as ``not_like_for_like`` (a greedy run
whose outputs are not jspec plain's too); ``ratios.ratio_blockers`` adds the K check, and the headline and the
peers table print no ratio where either finds one.

Prompt lookup is not the same policy on both sides (``LOOKUP_POLICY``; jspec's: ``ratios.LOOKUP_POLICY_JSPEC``):
jspec's n-gram drafter takes the most recent earlier match and repeats its continuation up to K, transformers and
llama-cpp-python take the first (leftmost) match and stop at the history's end. The ratio is labelled "different
lookup policy", next to each side's tokens per verify round where the peer's is observable
(``peer_transformers.tokens_per_round``: transformers' streamer gets one push per verify round; llama-cpp-python
yields one token at a time). Each run's timed part records its wall-clock start and end (``info["wall_clock"]``,
Unix seconds): peers run after all of jspec's runs, not interleaved with them.

Everything is imported lazily; a peer that is not installed (or fails to load) is skipped with the reason
recorded in the result. Peers decode one request at a time (batch 1, the only batch their speculative paths
support), so they are compared with jspec's concurrency-1 runs. Per-token timestamps come from a streamer
(transformers) or the token iterator (llama.cpp), so TTFT and inter-token intervals are measured the same
way as jspec's: the prompt's arrival is the call, bursts keep their zero gaps.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import time
from collections.abc import Callable, Sequence
from typing import Any

from jspec.bench import metrics
from jspec.bench.metrics import RequestRecord

TECHNIQUES = ("plain", "prompt_lookup", "assisted")


@dataclasses.dataclass
class PeerRun:
    """One peer configuration's results (or why it was skipped)."""

    library: str
    technique: str
    label: str
    available: bool
    reason: str | None = None
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    quality: dict[str, Any] | None = None

    def tokens_by_id(self) -> dict[str, list[int]]:
        return {r.id: r.tokens for r in self.records if r.ok}

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        out = {
            "library": self.library,
            "technique": self.technique,
            "label": self.label,
            "available": self.available,
            "reason": self.reason,
            "summary": self.summary,
            "info": self.info,
            "quality": self.quality,
        }
        if with_requests:
            out["requests"] = [r.to_json() for r in self.records]
            out["itl_ms_all"] = [round(x * 1e3, 3) for r in self.records if r.ok for x in r.itl()]
        return out


def _missing(mods: Sequence[str]) -> list[str]:
    return [m for m in mods if importlib.util.find_spec(m) is None]


_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def ggml_type_dtype(name: str) -> str:
    """A GGML tensor type name -> a dtype name where it is one ("F32" -> "float32"), else the type ("Q4_1")."""
    return _FLOAT_TYPES.get(name, name)


def gguf_weights(path: str) -> dict[str, Any]:
    """How a GGUF file stores its weights (read from its header, as ``models.gguf_loader`` reads it): the
    ``file_type`` (general.file_type, e.g. "MOSTLY_Q4_1"), ``tensor_types`` (type -> tensor count) and
    ``dtype``: "float32" (or float16, bfloat16) when every tensor has that type, else the types, most frequent
    first ("Q4_1+F32+Q8_0"): what a runner that keeps the file's types (llama.cpp) computes with."""
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    counts = collections.Counter(GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors)
    field = reader.fields.get("general.file_type")
    file_type = None
    if field is not None:
        value = int(field.contents())
        try:
            file_type = LlamaFileType(value).name
        except ValueError:
            file_type = str(value)
    ordered = sorted(counts, key=lambda n: (-counts[n], n))
    dtype = ggml_type_dtype(ordered[0]) if len(ordered) == 1 else "+".join(ordered)
    return {"file_type": file_type, "tensor_types": dict(counts), "dtype": dtype}


def device_kind(device: str | None) -> str | None:
    """A torch / llama.cpp / JAX device or backend name -> "cpu", "gpu", "tpu", ... ("cuda:0" -> "gpu")."""
    if device is None:
        return None
    d = str(device).split(":")[0].lower()
    return "gpu" if d in ("cuda", "rocm", "hip", "gpu") else d


def like_for_like_problems(info: dict[str, Any], *, dtype: str, backend: str, threads: int | None = None) -> list[str]:
    """What makes a peer run (its ``info``) another computation than jspec's run in ``dtype`` on JAX's
    ``backend``: weights or KV cache in another precision (llama.cpp keeps the GGUF's quantised weights and an
    f16 cache), another device (transformers falls back to the CPU when torch sees no GPU), or, both on the CPU,
    another number of threads than jspec's ``threads`` (``metrics.jspec_threads``; None: not compared). Empty
    when the two are like for like; what was not recorded counts as different."""
    out = []
    weights, kv = info.get("weights_dtype"), info.get("kv_cache_dtype")
    if weights != dtype:
        out.append(f"native {weights} weights" if weights else "weights' precision not recorded")
    if kv != dtype:
        out.append(f"{kv} KV cache" if kv else "KV cache's precision not recorded")
    peer_dev, ours = device_kind(info.get("device")), device_kind(backend)
    if peer_dev != ours:
        out.append(f"peer on {peer_dev or 'an unrecorded device'}, jspec on {ours}")
    elif threads is not None and ours == "cpu":
        # llama.cpp has a second count for prompts (n_threads_batch); transformers one for both.
        counts = (info.get("threads"), info.get("threads_batch", info.get("threads")))
        if None in counts:
            out.append(f"the peer's thread count not recorded, jspec on {threads} threads")
        elif counts != (threads, threads):
            many = str(counts[0]) if counts[0] == counts[1] else f"{counts[0]} ({counts[1]} for prompts)"
            out.append(f"peer on {many} threads, jspec on {threads}")
    if out:
        out.append(f"jspec runs {dtype}")
    return out


def _serve_sequentially(
    jobs,
    generate_one: Callable[[Sequence[int], RequestRecord], None],
    max_wall_s: float | None,
    run: PeerRun,
    freeze_gc: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Closed loop at concurrency 1: each request arrives when the previous one ends. ``generate_one`` fills
    the record's emissions and tokens (times relative to the run start via ``rec.arrival``). The Python heap
    is frozen for the timed part as for jspec's runs (``metrics.timed_region_gc``; stats in
    ``run.info["gc"]``); the timed part's wall-clock start and end (Unix seconds) go to ``run.info["wall_clock"]``
    (how long after jspec's runs the peer ran: ``ratios.peer_gap_s``)."""
    start = time.time()
    with metrics.timed_region_gc(freeze_gc) as gc_stats:
        out = _serve_jobs(jobs, generate_one, max_wall_s)
    run.info["gc"] = gc_stats
    run.info["wall_clock"] = [start, time.time()]
    return out


def _serve_jobs(jobs, generate_one, max_wall_s) -> tuple[list[RequestRecord], float]:
    records = []
    t0 = time.perf_counter()
    for job in jobs:
        t = time.perf_counter() - t0
        rec = RequestRecord(job.id, job.workload, len(job.prompt or ()), t)
        records.append(rec)
        if max_wall_s is not None and t > max_wall_s:
            rec.stop_reason = "not_run"
            continue
        if job.prompt is None:
            rec.error, rec.stop_reason, rec.finished = job.error, "error", t
            continue
        rec.admitted = t
        try:
            generate_one(job.prompt, rec, t0)
        except Exception as e:  # recorded, the run goes on
            rec.error, rec.stop_reason = f"{type(e).__name__}: {e}"[:300], "error"
            rec.finished = time.perf_counter() - t0
    return records, time.perf_counter() - t0


def _finalize(run: PeerRun, records, wall, jobs, decode_text, scorer):
    for job, rec in zip(jobs, records):
        if rec.tokens and decode_text is not None:
            rec.text = decode_text(rec.tokens)
        if scorer is not None and rec.ok and job.request is not None:
            try:
                rec.quality = scorer(job.request, rec.text or "")
            except Exception as e:
                rec.quality = {"check_error": f"{type(e).__name__}: {e}"}
    run.records = records
    run.summary = metrics.summarize_requests(records, wall)


# Prompt lookup as each peer implements it; jspec's n-gram drafter is ``ratios.LOOKUP_POLICY_JSPEC`` (the most
# recent match, its continuation repeated up to K). ``ratios.peer_caveats`` labels a ratio between the two.
LOOKUP_POLICY = {
    "transformers": "first (leftmost) match, up to K tokens, stopping at the history's end",
    "llama-cpp-python": "first (leftmost) match, up to K tokens, stopping at the history's end",
}


def _stop(tokens: list[int], eos_ids: Sequence[int]) -> str:
    return "eos" if tokens and tokens[-1] in eos_ids else "max_new_tokens"
