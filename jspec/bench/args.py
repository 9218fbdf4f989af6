"""Command-line helpers shared by the benchmark commands (``python -m jspec bench``, ``examples/bench_*.py``):
the common flags of the request-serving suite, the checks that refuse bad settings before a model loads, and
parsers for comma-separated list flags."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jspec.bench import suite_peers, workloads
from jspec.loaders import COMPILE_CACHE_DEFAULT

if TYPE_CHECKING:
    from jspec.bench.suite_runs import SuiteConfig


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--workloads", default=",".join(workloads.WORKLOADS), help="comma-separated subset")
    ap.add_argument("--n", type=int, default=4, help="requests per workload")
    ap.add_argument("--seed", type=int, default=0, help="prompt-set and arrival seed")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=640, help="cache slots per row")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact match with plain is checked)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=None, help="per-request deadline from arrival")
    ap.add_argument("--max-wall-s", type=float, default=None, help="stop admitting requests after this long")
    ap.add_argument(
        "--rounds-per-sync",
        type=int,
        default=1,
        help="decode rounds the engine runs on the device per host sync (tokens stream up to R rounds at a time)",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=5,
        help="run every configuration N times, the order reversed every other pass (A B, B A, ...): the "
        "headline gives each pass's ratio, their median and their min-max",
    )
    ap.add_argument(
        "--bucket",
        type=int,
        default=64,
        help="prompt widths are padded up to a multiple of this (one prefill compile per width): a smaller "
        "bucket wastes less prefill compute on padding and compiles more widths",
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the Python heap unfrozen in timed runs (by default it is frozen after each warm-up, as "
        "vLLM and SGLang do; collections that still run are reported either way)",
    )
    ap.add_argument("--phase-repeats", type=int, default=5)
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase timing (and the cost model)")
    ap.add_argument("--out", default="results/bench", help="output directory (JSON, Markdown, PNG)")
    ap.add_argument(
        "--record",
        default=None,
        help="the run's result file (jspec.bench.record: command, commit, machine, every pass); default "
        "results/<name>-<UTC time>.json",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="persistent XLA compilation cache directory ('none' to disable): reruns skip recompiling; default "
        f"$JAX_COMPILATION_CACHE_DIR when set, else {COMPILE_CACHE_DEFAULT} ($JSPEC_COMPILE_CACHE); given, it wins",
    )
    ap.add_argument(
        "--layers",
        default="auto",
        choices=("auto", "stacked", "unstacked"),
        help="target layer weights (as python -m jspec generate --layers; auto = unstacked on CPU and GPU)",
    )


# The integer settings of add_common_args that must be >= 1, and what each counts.
_COUNTS = {
    "n": "requests per workload",
    "max_new_tokens": "new tokens per request",
    "max_len": "cache slots per row",
    "bucket": "the prompt-width padding multiple",
    "rounds_per_sync": "decode rounds per host sync",
    "passes": "runs of every configuration",
    "phase_repeats": "timings of each phase, whose median is kept",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args, **counts: int | None) -> None:
    """Refuse, before any model is loaded, settings of ``add_common_args`` that would fail after the runs
    (--phase-repeats 0, --bucket 0: a traceback once every run is done), fail every request (--max-new-tokens
    past --max-len: each refused by the engine, and "0.00x plain"), or be silently ignored (a sampling filter
    at temperature 0). ``counts``: a script's own integer flags that must be >= 1 (e.g. ``gamma=args.gamma``,
    ``concurrency=args.concurrency``), named as their flags."""
    from jspec.validate import check_greedy_filters, check_seed, sampling_params

    for name, value in [*((n, getattr(args, n)) for n in _COUNTS), *counts.items()]:
        if value is not None and value < 1:
            what = f" ({_COUNTS[name]})" if name in _COUNTS else ""
            raise ValueError(f"{_flag(name)} {value}: must be >= 1{what}")
    if args.max_new_tokens > args.max_len:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} > --max-len {args.max_len}: no request fits the engine's cache "
            "(its slots hold the prompt and every generated token but the last)"
        )
    for name in ("timeout_s", "max_wall_s"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{_flag(name)} {value}: must be a number of seconds > 0")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names:
        raise ValueError(f"--workloads {args.workloads!r}: name at least one of {', '.join(workloads.WORKLOADS)}")
    unknown = [w for w in names if w not in workloads.WORKLOADS]
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(workloads.WORKLOADS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--workloads {args.workloads!r} names a workload twice (its requests would repeat)")
    try:
        check_seed(args.seed)
        sampling_params(1, args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:  # "seed must be in ...", "top_p must be in (0, 1] ...": named as their flags
        name, _, rest = str(e).partition(" ")
        if name not in ("seed", "temperature", "top_k", "top_p", "min_p"):
            raise
        raise ValueError(f"{_flag(name)} {rest}") from None
    check_greedy_filters(args.temperature, args.top_k, args.top_p, args.min_p)


def list_flag(flag: str, text: str, parse: Callable[[str], Any], what: str, empty_ok: bool = False) -> list:
    """A script's comma-separated flag, each entry parsed by ``parse`` (which raises ValueError on a bad one),
    checked whole before the model loads. An empty entry (a stray comma), one that does not parse, or one given
    twice (the same runs would repeat) is refused (ValueError naming ``flag``); so is an empty list unless
    ``empty_ok``. ``what``: what an entry must be, for the message."""
    if not text.strip():
        if empty_ok:
            return []
        raise ValueError(f"{flag} {text!r}: give at least one value ({what})")
    entries, values = [e.strip() for e in text.split(",")], []
    for e in entries:
        if not e:
            raise ValueError(f"{flag} {text!r}: an empty entry (a stray comma?); expected {what}")
        try:
            values.append(parse(e))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: cannot read {e!r}; expected {what}") from None
    twice = [e for i, e in enumerate(entries) if values[i] in values[:i]]
    if twice:
        raise ValueError(f"{flag} {text!r} gives {twice[0]} twice (the same runs would repeat)")
    return values


def int_list(flag: str, text: str, least: int = 1, empty_ok: bool = False, why: str = "") -> list[int]:
    """A script's comma-separated integer flag (--ks, --batches, --budgets, ...), every entry >= ``least``
    (``why``: the reason, for the message), as ``list_flag``: refused whole before the model loads, not at the
    entry that fails mid-run, after the runs before it."""
    values = list_flag(flag, text, int, f"integers >= {least}", empty_ok)
    low = [v for v in values if v < least]
    if low:
        raise ValueError(f"{flag} {text!r}: {low[0]} is below {least}; every entry must be >= {least}{why}")
    return values


def rate_list(flag: str, text: str, empty_ok: bool = False) -> list[float]:
    """A comma-separated list of rates (requests/s), each a finite number > 0, as ``int_list``."""
    values = list_flag(flag, text, float, "numbers > 0", empty_ok)
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ValueError(f"{flag} {text!r}: {bad[0]} is not a rate; every entry must be a finite number > 0")
    return values


def make_out_dir(path: str) -> str:
    """--out, created before the model loads, so that an unusable one (a file there, no permission) fails now
    and not when the results are written after the runs."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"--out {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"--out {path}: not writable")
    return path


def peer_names(text: str) -> list[str]:
    """--peers: comma-separated names of ``suite_peers.PEER_NAMES``, or '' / 'none' for none."""
    if text in ("", "none"):
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in suite_peers.PEER_NAMES]
    if unknown:
        raise ValueError(
            f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(suite_peers.PEER_NAMES)} or none"
        )
    return names


def config_from_args(args, **counts: int | None) -> SuiteConfig:
    """The suite's configuration from ``add_common_args``' flags, checked first (``check_args``, which takes a
    script's own ``counts``), then the compilation cache switched on."""
    import jax

    from jspec.bench.runspec import Sampling
    from jspec.bench.suite_runs import SuiteConfig
    from jspec.loaders import compile_cache_flag

    check_args(args, **counts)
    compile_cache_flag(args.compile_cache)
    if jax.default_backend() == "gpu" and args.dtype == "float32" and jax.config.jax_default_matmul_precision is None:
        # f32 means f32 on both sides of a peer ratio: JAX's GPU default runs f32 matmuls in TF32, torch's does not.
        jax.config.update("jax_default_matmul_precision", "highest")
    return SuiteConfig(
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        n_per_workload=args.n,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        max_len=args.max_len,
        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.min_p),
        chat_template=not args.no_chat_template,
        timeout_s=args.timeout_s,
        phase_repeats=args.phase_repeats,
        measure_phases=not args.no_phases,
        max_wall_s=args.max_wall_s,
        rounds_per_sync=args.rounds_per_sync,
        passes=args.passes,
        bucket=args.bucket,
        freeze_gc=not args.no_gc_freeze,
        peer_threads=getattr(args, "peer_threads", None),
    )


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """--peers and --peer-threads, for the scripts that run peers."""
    ap.add_argument("--peers", default="transformers,llama_cpp", help="comma-separated; 'none' to skip")
    ap.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="threads for both peers (torch.set_num_threads; llama.cpp n_threads and n_threads_batch); default: "
        "jspec's (XLA's CPU pool: one per CPU the process may use). jspec's own count is not set by this flag: "
        "another count is reported as not like for like",
    )
