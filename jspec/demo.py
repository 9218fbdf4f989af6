"""``python -m jspec demo`` (``make run``): what jspec does, on the default model, in one command.

The workload is one a user meets: add type hints to a function that ships with Python (``textwrap.dedent`` by
default). The answer repeats most of the prompt's code, so prompt lookup (the n-gram drafter) proposes long runs
the target accepts. The same prompt is decoded greedily twice in this process, speculative and plain, each timed
after it is compiled; the report gives both speeds, their ratio, the tokens per round and whether the outputs
are identical (greedy speculation must reproduce plain decoding token for token). Speculation chooses its draft
length each round from round costs it measures the first time (``jspec.costs``; ``--gamma K``: a fixed K).

Compilation is paid once: programs go to JAX's persistent cache (``--compile-cache``), so a second run reads
them back and starts decoding in seconds; the compile times are reported apart from the decoding times.
"""

from __future__ import annotations

import argparse
import sys
import time

from jspec import validate as V
from jspec.bench.workloads import EDIT_INSTRUCTION, edit_prompt
from jspec.decode import prepare
from jspec.loaders import COMPILE_CACHE_DEFAULT, compile_cache_flag, end_ids, load_model, model_loader, wants_unstacked
from jspec.ngram import NgramDrafter

DEFAULT_FUNCTION = "textwrap:dedent"


def _timed(prepared):
    """(output, compile seconds, decode seconds): compiled (or read from the persistent cache) first, then run."""
    t0 = time.perf_counter()
    compiled = prepared.compile()
    t1 = time.perf_counter()
    out = prepared.run(compiled)
    return out, t1 - t0, time.perf_counter() - t1


def run(args) -> int:
    if args.gamma is not None:
        V.check_count("--gamma", args.gamma)
    V.check_count("--max-new-tokens", args.max_new_tokens)
    request = edit_prompt(args.function)  # before the model loads: a bad --function is named at once
    cache = compile_cache_flag(args.compile_cache)
    t0 = time.perf_counter()
    loaded = load_model(model_loader(), args.model, "float32", unstacked=wants_unstacked("auto"))
    _, params, target, tok = loaded
    load_s = time.perf_counter() - t0
    prompt = tok.encode_chat([{"role": "user", "content": request}])
    drafter = NgramDrafter(vocab_size=target.vocab_size)
    kw = dict(max_new_tokens=args.max_new_tokens, eos_ids=end_ids(tok))
    t0 = time.perf_counter()
    spec = prepare(target, params, [prompt], drafter=drafter, gamma=args.gamma, **kw)
    setup_s = time.perf_counter() - t0  # with the default goodput: the cost table, measured once per situation
    plain = prepare(target, params, [prompt], max_len=spec.config.slots, **kw)  # the same cache: same attention
    print(f"[{args.model}: loaded in {load_s:.1f} s; prompt {len(prompt)} tokens: {EDIT_INSTRUCTION!r} + the source "
          f"of {args.function}]", file=sys.stderr)  # fmt: skip
    spec_out, spec_c, spec_s = _timed(spec)
    print(tok.decode(spec_out.tokens[0], skip_special_tokens=True))
    plain_out, plain_c, plain_s = _timed(plain)
    n, n_plain = len(spec_out.tokens[0]), len(plain_out.tokens[0])
    st = spec_out.stats
    where = f"persistent cache {cache}" if cache else "no persistent cache"
    if spec.config.goodput is not None:
        print(f"[cost table: {setup_s:.1f} s (measured once for this model, batch and cache size on this machine, "
              "then read from disk)]", file=sys.stderr)  # fmt: skip
    policy = spec.config.goodput
    ks = (
        f"K={spec.config.gamma}"
        if policy is None
        else "K chosen each round (" + ", ".join(f"{k}: {r}" for k, r in zip(policy.ks, st["k_rounds"])) + " rounds)"
    )
    print(
        f"[compile: speculative {spec_c:.1f} s, plain {plain_c:.1f} s ({where}: a second run reads them back)]\n"
        f"[n-gram {ks}: {n} tokens in {st['rounds'][0]} rounds ({st['tokens_per_round']:.2f} "
        f"tokens/round, acceptance {st['acceptance_rate']:.2f}), {spec_s:.2f} s, {n / spec_s:.1f} tok/s]\n"
        f"[plain: {n_plain} tokens, {plain_s:.2f} s, {n_plain / plain_s:.1f} tok/s]",
        file=sys.stderr,
    )
    same = spec_out.tokens == plain_out.tokens
    print(
        f"[speedup {(n / spec_s) / (n_plain / plain_s):.2f}x over plain decoding, measured in this run; output "
        f"{'identical' if same else 'DIFFERENT (a float near-tie between two tokens, or a bug)'}]",
        file=sys.stderr,
    )
    return 0 if same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jspec demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    ap.add_argument(
        "--function", default=DEFAULT_FUNCTION, help="the standard-library function to annotate, as module:name"
    )
    ap.add_argument(
        "--gamma",
        type=int,
        default=None,
        help=f"K, candidates every round (default: up to {V.DEFAULT_GAMMA}, chosen each round from measured costs)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument(
        "--compile-cache", default=None, help=f"JAX's persistent compilation cache (default {COMPILE_CACHE_DEFAULT})"
    )
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:  # bad input: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
