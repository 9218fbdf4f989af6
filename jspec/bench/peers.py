"""Peer implementations measured in the same run, on the same checkpoint file and the same prompt ids.

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
``suite_peers.run_peer_set`` gives both peers one thread count (jspec's XLA pool size unless told another), compares
what they recorded with jspec's run and records the differences as ``not_like_for_like`` (a greedy run whose
outputs are not jspec plain's too); ``ratios.ratio_blockers`` adds the K check, and the headline and the peers
table print no ratio where either finds one.

Prompt lookup is not the same policy on both sides (``LOOKUP_POLICY``; jspec's: ``ratios.LOOKUP_POLICY_JSPEC``):
jspec's n-gram drafter takes the most recent earlier match and repeats its continuation up to K, transformers and
llama-cpp-python take the first (leftmost) match and stop at the history's end. The ratio is labelled "different
lookup policy", next to each side's tokens per verify round where the peer's is observable (``tokens_per_round``:
transformers' streamer gets one push per verify round; llama-cpp-python yields one token at a time). Each run's
timed part records its wall-clock start and end (``info["wall_clock"]``, Unix seconds): peers run after all of
jspec's runs, not interleaved with them.

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
import os
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

TOKENS_PER_ROUND_HOW = (
    "tokens after each request's first streamer push / the pushes after it: transformers pushes once per target "
    "forward (one verify round) in its assisted and prompt-lookup loops; the first forward (the prefill, which "
    "verifies a first draft too) is left out, as jspec's tokens/round leaves out its prefill"
)


def tokens_per_round(records: Sequence[RequestRecord]) -> float | None:
    """Tokens per verify round of a peer whose every emission is one round (transformers' streamer pushes): over
    the finished requests, the tokens after each one's first emission / its emissions after the first (as
    ``TOKENS_PER_ROUND_HOW``). None when no request had a round after its first."""
    rounds = sum(len(r.emissions) - 1 for r in records if r.ok and r.emissions)
    tokens = sum(r.decode_tokens for r in records if r.ok and r.emissions)
    return tokens / rounds if rounds > 0 else None


# --------------------------------------------------------------------------------------------------------
# transformers


class _TimingStreamer:
    """A ``generate`` streamer that timestamps every push (the first push is the prompt itself)."""

    def __init__(self, rec: RequestRecord, t0: float):
        self.rec, self.t0, self.seen_prompt = rec, t0, False

    def put(self, value):
        t = time.perf_counter() - self.t0
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        toks = [int(x) for x in value.reshape(-1).tolist()]
        if toks:
            self.rec.emissions.append((t, len(toks)))
            self.rec.tokens.extend(toks)

    def end(self):
        pass


def _torch_device(device: str | None) -> str:
    """The peer runs where jspec runs: on the GPU when JAX's backend is one and torch sees it, else CPU (then
    on another device than jspec: ``like_for_like_problems`` says so, and no ratio is printed)."""
    if device:
        return device
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def load_transformers(gguf_path: str, device: str | None = None):
    """transformers' model of the GGUF file, f32, on ``device`` (None: where JAX runs, as ``run_transformers``),
    for ``run_transformers(model=...)``."""
    return _load_transformers(gguf_path, _torch_device(device))


def _load_transformers(gguf_path: str, device: str = "cpu"):
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    # transformers refuses GGUF files unless ``accelerate`` is importable, although its GGUF path does not
    # use it on CPU: lift that one gate instead of requiring the package.
    if not modeling_utils.is_accelerate_available():
        modeling_utils.is_accelerate_available = lambda: True
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path) or ".", gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return model.to(device).eval()


def truncated_assistant(model, layers: int):
    """The target's first ``layers`` decoder layers + its final norm and head, as a separate transformers
    model: the same draft as ``examples/``' truncated jspec ``ModelDrafter``. A new module with copied
    weights: a shallow copy would share the target's submodule registry, and truncating it would truncate
    the target too."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    assistant = type(model)(cfg).to(device=model.device, dtype=model.dtype).eval()
    keep = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
            continue
        keep[name] = t
    missing, unexpected = assistant.load_state_dict(keep, strict=False)
    if unexpected or any(not m.startswith("lm_head") for m in missing):
        raise ValueError(f"truncated assistant: missing {missing}, unexpected {unexpected}")
    assistant.tie_weights()
    assistant.generation_config = copy.deepcopy(model.generation_config)
    return assistant


def run_transformers(
    gguf_path: str,
    jobs,
    *,
    techniques: Sequence[str] = ("plain", "prompt_lookup"),
    gamma: int = 4,
    max_ngram: int = 3,
    assistant_layers: int | None = None,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    threads: int | None = None,
    decode_text=None,
    scorer=None,
    max_wall_s: float | None = None,
    freeze_gc: bool = True,
    device: str | None = None,
    model=None,
) -> list[PeerRun]:
    """transformers' plain / prompt-lookup / assisted generation on the same GGUF, one request at a time.

    device: torch device; None = "cuda" when JAX runs on a GPU that torch also sees, else "cpu". f32 matmuls
    stay f32 on the GPU (torch's TF32 switch is off by default, and left so). model: the model
    ``load_transformers`` returned for this file and device, reused instead of loading it again (a benchmark
    that runs the peer once per pass loads it once)."""
    lib = "transformers"
    missing = _missing(["torch", "transformers"])
    if missing:
        reason = f"not installed: {', '.join(missing)} (pip install -e '.[peers]')"
        return [PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
    try:
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        device = _torch_device(device)
        model = model if model is not None else _load_transformers(gguf_path, device)
    except Exception as e:
        reason = f"failed to load {gguf_path}: {type(e).__name__}: {e}"[:300]
        return [PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
    info = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "threads_how": f"torch.set_num_threads({threads})" if threads else "torch's default (not set)",
        "device": device,
        "dtype": "float32",
        "weights": "transformers' GGUF converter, dequantised to f32 (same file as jspec)",
        "weights_dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(model.dtype).removeprefix("torch."),  # its dynamic cache holds the model's dtype
    }
    try:
        info["file"] = gguf_weights(gguf_path)
    except Exception as e:  # informative only: the run does not depend on it
        info["file"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    assistant = None
    out = []
    for tech in techniques:
        label = {"plain": f"{lib} plain", "prompt_lookup": f"{lib} prompt-lookup K={gamma}"}.get(tech, "")
        kw: dict[str, Any] = {}
        k_info = {} if tech == "plain" else {"gamma": gamma}
        if tech == "prompt_lookup":
            kw = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": max_ngram}
            k_info["lookup_policy"] = LOOKUP_POLICY["transformers"]
        elif tech == "assisted":
            if not assistant_layers:
                out.append(PeerRun(lib, tech, f"{lib} assisted", False, "no assistant (assistant_layers not set)"))
                continue
            if assistant is None:
                assistant = truncated_assistant(model, assistant_layers)
            # jspec drafts a fixed K; transformers' default schedule adapts it, which would compare policies.
            assistant.generation_config.num_assistant_tokens = gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kw = {"assistant_model": assistant}
            label = f"{lib} assisted {assistant_layers}L K={gamma}"
        elif tech != "plain":
            out.append(PeerRun(lib, tech, f"{lib} {tech}", False, f"unknown technique {tech!r}"))
            continue
        sample = (
            dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p or None)
            if temperature > 0
            else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        )

        def generate_one(prompt, rec, t0, kw=kw, sample=sample):
            ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
            with torch.inference_mode():
                model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=list(eos_ids) or None,
                    pad_token_id=eos_ids[0] if eos_ids else None,
                    streamer=_TimingStreamer(rec, t0),
                    **sample,
                    **kw,
                )
            rec.finished = time.perf_counter() - t0
            ends = [i for i, t in enumerate(rec.tokens) if t in eos_ids]
            if ends:  # nothing after the first end token, as in jspec
                rec.tokens = rec.tokens[: ends[0] + 1]
                _trim_emissions(rec, len(rec.tokens))
            rec.stop_reason = _stop(rec.tokens, eos_ids)

        run = PeerRun(lib, tech, label, True, None, info=dict(info, generate_kwargs=_jsonable(kw), **k_info))
        try:  # warm-up outside the timed loop (first calls allocate and pick kernels)
            warm = next((j for j in jobs if j.prompt is not None), None)
            if warm is not None:
                generate_one(warm.prompt[:32], RequestRecord("warm", "warmup", 0, 0.0), time.perf_counter())
        except Exception as e:
            out.append(PeerRun(lib, tech, label, False, f"warm-up failed: {type(e).__name__}: {e}"[:300], info=info))
            continue
        records, wall = _serve_sequentially(jobs, generate_one, max_wall_s, run, freeze_gc)
        _finalize(run, records, wall, jobs, decode_text, scorer)
        run.info.update(tokens_per_round=tokens_per_round(run.records), tokens_per_round_how=TOKENS_PER_ROUND_HOW)
        out.append(run)
    return out


def _trim_emissions(rec, n: int) -> None:
    """Keep the emission bursts of the first ``n`` tokens only: bursts of tokens dropped after EOS would add
    zero gaps to the inter-token intervals, which jspec's records (nothing after EOS) never have."""
    kept, total = [], 0
    for t, k in rec.emissions:
        if total >= n:
            break
        kept.append((t, min(k, n - total)))
        total += kept[-1][1]
    rec.emissions = kept


def _stop(tokens: list[int], eos_ids: Sequence[int]) -> str:
    return "eos" if tokens and tokens[-1] in eos_ids else "max_new_tokens"


def _jsonable(kw: dict) -> dict:
    return {k: (v if isinstance(v, int | float | str | bool | type(None)) else type(v).__name__) for k, v in kw.items()}


# --------------------------------------------------------------------------------------------------------
# llama-cpp-python


def run_llama_cpp(
    gguf_path: str,
    jobs,
    *,
    techniques: Sequence[str] = ("plain", "prompt_lookup"),
    gamma: int = 4,
    max_ngram: int = 3,
    max_new_tokens: int,
    max_len: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    threads: int | None = None,
    decode_text=None,
    scorer=None,
    max_wall_s: float | None = None,
    freeze_gc: bool = True,
) -> list[PeerRun]:
    """llama-cpp-python plain and prompt-lookup decoding of the same GGUF, one request at a time."""
    lib = "llama-cpp-python"
    techniques = [t for t in techniques if t != "assisted"]  # its draft-model API is not compared here
    if _missing(["llama_cpp"]):
        reason = "not installed: llama_cpp (pip install llama-cpp-python; it compiles llama.cpp)"
        return [PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
    out = []
    for tech in techniques:
        label = f"{lib} plain" if tech == "plain" else f"{lib} prompt-lookup K={gamma}"
        try:
            import llama_cpp
            from llama_cpp import Llama

            draft = None
            if tech == "prompt_lookup":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                # Its default n-gram length changed between releases (2, then 3): set, as jspec's n-gram drafter is.
                draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=gamma)
            import jax

            # On the GPU where jspec runs (a CPU-only llama.cpp build ignores the setting and says so below).
            gpu_layers = -1 if jax.default_backend() == "gpu" else 0
            # One count for generation and prompts: left unset, n_threads_batch takes every CPU.
            n_threads = threads or os.cpu_count()
            llm = Llama(
                model_path=gguf_path,
                n_ctx=max_len,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                n_gpu_layers=gpu_layers,
                draft_model=draft,
                verbose=False,
            )
        except Exception as e:
            out.append(PeerRun(lib, tech, label, False, f"failed to load: {type(e).__name__}: {e}"[:300]))
            continue
        offload = bool(getattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)())
        info = llama_cpp_info(gguf_path, llm, gpu_layers and offload)
        info["llama_cpp"] = getattr(llama_cpp, "__version__", None)
        info["threads"] = getattr(llm, "n_threads", n_threads)
        info["threads_batch"] = getattr(llm, "n_threads_batch", n_threads)
        info["threads_how"] = f"n_threads = n_threads_batch = {n_threads}" + ("" if threads else " (os.cpu_count())")
        if tech != "plain":
            info["gamma"] = gamma
            info["lookup_policy"] = LOOKUP_POLICY["llama-cpp-python"]
        # Its generate yields one token at a time, speculative or not: no verify round is observable.
        info["tokens_per_round"] = None
        info["tokens_per_round_how"] = "not observable: llama-cpp-python yields one token at a time"

        def generate_one(prompt, rec, t0, llm=llm):
            llm.reset()  # no prefix reuse between requests: every request pays its prefill, as in jspec
            # min_p explicitly: llama-cpp-python's own default (0.05) would filter tokens jspec's run keeps.
            gen = llm.generate(
                list(prompt),
                temp=temperature,
                top_k=top_k if temperature > 0 else 1,
                top_p=top_p,
                min_p=min_p,
                reset=True,
            )
            for tok in gen:
                t = time.perf_counter() - t0
                rec.emissions.append((t, 1))
                rec.tokens.append(int(tok))
                if tok in eos_ids or len(rec.tokens) >= max_new_tokens:
                    break
            rec.finished = time.perf_counter() - t0
            rec.stop_reason = _stop(rec.tokens, eos_ids)

        run = PeerRun(lib, tech, label, True, None, info=info)
        try:
            warm = next((j for j in jobs if j.prompt is not None), None)
            if warm is not None:
                generate_one(warm.prompt[:32], RequestRecord("warm", "warmup", 0, 0.0), time.perf_counter())
        except Exception as e:
            out.append(PeerRun(lib, tech, label, False, f"warm-up failed: {type(e).__name__}: {e}"[:300]))
            continue
        records, wall = _serve_sequentially(jobs, generate_one, max_wall_s, run, freeze_gc)
        _finalize(run, records, wall, jobs, decode_text, scorer)
        out.append(run)
    return out


def llama_cpp_info(gguf_path: str, llm, on_gpu: bool) -> dict[str, Any]:
    """What a llama.cpp run computes with: the file's own weight types (it does not dequantise), its KV cache
    type (read from the context it made: llama.cpp's default is f16) and its device."""
    info: dict[str, Any] = {"weights": "native GGUF types (not dequantised)", "device": "gpu" if on_gpu else "cpu"}
    try:
        info["file"] = gguf_weights(gguf_path)
        info["weights_dtype"] = info["file"]["dtype"]
    except Exception as e:
        info["file"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        info["weights_dtype"] = None
    from gguf import GGMLQuantizationType

    params = getattr(llm, "context_params", None)
    try:  # llama.cpp's ggml_type numbers are the GGUF tensor type numbers
        k, v = (ggml_type_dtype(GGMLQuantizationType(int(getattr(params, f))).name) for f in ("type_k", "type_v"))
        info["kv_cache_dtype"] = k if k == v else f"{k} keys, {v} values"
    except (AttributeError, TypeError, ValueError):  # not readable from this version: recorded as unknown
        info["kv_cache_dtype"] = None
    return info


PEER_NAMES = ("transformers", "llama_cpp", "llama-cpp-python")  # what ``run_peers`` knows


def run_peers(
    names: Sequence[str], gguf_path: str | None, jobs, *, assistant_layers: int | None = None, **kw
) -> list[PeerRun]:
    """Run the named peer libraries ("transformers", "llama_cpp"); unknown names and a missing checkpoint
    path are recorded as skipped."""
    max_len = kw.pop("max_len", 2048)  # llama.cpp's context size; transformers sizes its cache itself
    out: list[PeerRun] = []
    for name in names:
        if gguf_path is None or not str(gguf_path).endswith(".gguf"):
            out.append(PeerRun(name, "plain", f"{name}", False, f"needs the GGUF checkpoint path, got {gguf_path}"))
            continue
        if name == "transformers":
            techniques = ["plain", "prompt_lookup"] + (["assisted"] if assistant_layers else [])
            out += run_transformers(gguf_path, jobs, techniques=techniques, assistant_layers=assistant_layers, **kw)
        elif name in ("llama_cpp", "llama-cpp-python"):
            out += run_llama_cpp(gguf_path, jobs, max_len=max_len, **kw)
        else:
            out.append(PeerRun(name, "plain", name, False, f"unknown peer {name!r} (transformers, llama_cpp)"))
    return out
