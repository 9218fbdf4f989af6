"""The transformers peer: plain ``generate``, prompt lookup and assisted generation on the same GGUF file.

transformers' own GGUF converter loads the file, dequantised to f32 (``load_transformers``), on the device jspec
runs on where torch sees it; assisted generation drafts with the target's first layers (``truncated_assistant``),
the same truncated draft a jspec ``ModelDrafter`` can use, at a fixed K. ``run_transformers`` serves the jobs
one request at a time (``peers._serve_sequentially``), timestamping each push of its streamer: one per target
forward, so its tokens per verify round are observable (``tokens_per_round``). Nothing after the first end token
is kept, as in jspec.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from jspec.bench import peers
from jspec.bench.metrics import RequestRecord

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
) -> list[peers.PeerRun]:
    """transformers' plain / prompt-lookup / assisted generation on the same GGUF, one request at a time.

    device: torch device; None = "cuda" when JAX runs on a GPU that torch also sees, else "cpu". f32 matmuls
    stay f32 on the GPU (torch's TF32 switch is off by default, and left so). model: the model
    ``load_transformers`` returned for this file and device, reused instead of loading it again (a benchmark
    that runs the peer once per pass loads it once)."""
    lib = "transformers"
    missing = peers._missing(["torch", "transformers"])
    if missing:
        reason = f"not installed: {', '.join(missing)} (pip install -e '.[peers]')"
        return [peers.PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
    try:
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        device = _torch_device(device)
        model = model if model is not None else _load_transformers(gguf_path, device)
    except Exception as e:
        reason = f"failed to load {gguf_path}: {type(e).__name__}: {e}"[:300]
        return [peers.PeerRun(lib, t, f"{lib} {t}", False, reason) for t in techniques]
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
        info["file"] = peers.gguf_weights(gguf_path)
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
            k_info["lookup_policy"] = peers.LOOKUP_POLICY["transformers"]
        elif tech == "assisted":
            if not assistant_layers:
                out.append(
                    peers.PeerRun(lib, tech, f"{lib} assisted", False, "no assistant (assistant_layers not set)")
                )
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
            out.append(peers.PeerRun(lib, tech, f"{lib} {tech}", False, f"unknown technique {tech!r}"))
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
            rec.stop_reason = peers._stop(rec.tokens, eos_ids)

        run = peers.PeerRun(lib, tech, label, True, None, info=dict(info, generate_kwargs=_jsonable(kw), **k_info))
        try:  # warm-up outside the timed loop (first calls allocate and pick kernels)
            warm = next((j for j in jobs if j.prompt is not None), None)
            if warm is not None:
                generate_one(warm.prompt[:32], RequestRecord("warm", "warmup", 0, 0.0), time.perf_counter())
        except Exception as e:
            out.append(
                peers.PeerRun(lib, tech, label, False, f"warm-up failed: {type(e).__name__}: {e}"[:300], info=info)
            )
            continue
        records, wall = peers._serve_sequentially(jobs, generate_one, max_wall_s, run, freeze_gc)
        peers._finalize(run, records, wall, jobs, decode_text, scorer)
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


def _jsonable(kw: dict) -> dict:
    return {k: (v if isinstance(v, int | float | str | bool | type(None)) else type(v).__name__) for k, v in kw.items()}
