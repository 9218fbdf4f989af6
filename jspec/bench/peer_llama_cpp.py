"""The llama-cpp-python peer: plain and prompt-lookup decoding of the same GGUF file, run natively.

llama.cpp keeps the file's own weight types and its own KV cache type (f16 by default), recorded by
``llama_cpp_info`` so that ``peers.like_for_like_problems`` can tell when a ratio with jspec would compare other
arithmetic. ``run_llama_cpp`` serves the jobs one request at a time (``peers._serve_sequentially``) with one
thread count for generation and prompts; its generator yields one token at a time, so its verify rounds are not
observable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from jspec.bench import peers
from jspec.bench.metrics import RequestRecord


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
) -> list[peers.PeerRun]:
    """llama-cpp-python plain and prompt-lookup decoding of the same GGUF, one request at a time."""
    lib = "llama-cpp-python"
    techniques = [t for t in techniques if t != "assisted"]  # its draft-model API is not compared here
    if peers._missing(["llama_cpp"]):
        reason = "not installed: llama_cpp (pip install llama-cpp-python; it compiles llama.cpp)"
        return [peers.PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
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
            out.append(peers.PeerRun(lib, tech, label, False, f"failed to load: {type(e).__name__}: {e}"[:300]))
            continue
        offload = bool(getattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)())
        info = llama_cpp_info(gguf_path, llm, gpu_layers and offload)
        info["llama_cpp"] = getattr(llama_cpp, "__version__", None)
        info["threads"] = getattr(llm, "n_threads", n_threads)
        info["threads_batch"] = getattr(llm, "n_threads_batch", n_threads)
        info["threads_how"] = f"n_threads = n_threads_batch = {n_threads}" + ("" if threads else " (os.cpu_count())")
        if tech != "plain":
            info["gamma"] = gamma
            info["lookup_policy"] = peers.LOOKUP_POLICY["llama-cpp-python"]
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
            rec.stop_reason = peers._stop(rec.tokens, eos_ids)

        run = peers.PeerRun(lib, tech, label, True, None, info=info)
        try:
            warm = next((j for j in jobs if j.prompt is not None), None)
            if warm is not None:
                generate_one(warm.prompt[:32], RequestRecord("warm", "warmup", 0, 0.0), time.perf_counter())
        except Exception as e:
            out.append(peers.PeerRun(lib, tech, label, False, f"warm-up failed: {type(e).__name__}: {e}"[:300]))
            continue
        records, wall = peers._serve_sequentially(jobs, generate_one, max_wall_s, run, freeze_gc)
        peers._finalize(run, records, wall, jobs, decode_text, scorer)
        out.append(run)
    return out


def llama_cpp_info(gguf_path: str, llm, on_gpu: bool) -> dict[str, Any]:
    """What a llama.cpp run computes with: the file's own weight types (it does not dequantise), its KV cache
    type (read from the context it made: llama.cpp's default is f16) and its device."""
    info: dict[str, Any] = {"weights": "native GGUF types (not dequantised)", "device": "gpu" if on_gpu else "cpu"}
    try:
        info["file"] = peers.gguf_weights(gguf_path)
        info["weights_dtype"] = info["file"]["dtype"]
    except Exception as e:
        info["file"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        info["weights_dtype"] = None
    from gguf import GGMLQuantizationType

    params = getattr(llm, "context_params", None)
    try:  # llama.cpp's ggml_type numbers are the GGUF tensor type numbers
        k, v = (peers.ggml_type_dtype(GGMLQuantizationType(int(getattr(params, f))).name) for f in ("type_k", "type_v"))
        info["kv_cache_dtype"] = k if k == v else f"{k} keys, {v} values"
    except (AttributeError, TypeError, ValueError):  # not readable from this version: recorded as unknown
        info["kv_cache_dtype"] = None
    return info
