"""Speculative vs plain decoding of SmolLM2-135M-Instruct over batch sizes x workloads x drafters, in one process
(``jspec.bench.grid``): every ratio is the median over --passes passes run in a rotating order, with its min-max
spread, written to one result file (``jspec.bench.record``). Exits 1 when a speculative output differs from plain
decoding's (greedy speculation is lossless).

    python examples/bench_grid.py                                     # the real settings (README's results)
    python examples/bench_grid.py --batches 1,4,8,16,32 --drafters ngram,ngram:8,eagle:3,eagle-tree:4x2
    python examples/bench_grid.py --batches 1 --workloads edit --drafters ngram --max-new 16 --prompts 1 \\
        --peers none                                                  # a smoke run (its file says so)
"""

from __future__ import annotations

import argparse
import sys

from jspec.bench import grid, record
from jspec.bench.args import int_list, list_flag


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=",".join(map(str, grid.DEFAULT_BATCHES)), help="comma-separated batch sizes")
    ap.add_argument("--workloads", default=",".join(grid.DEFAULT_WORKLOADS), help=f"of {', '.join(grid.REQUESTS)}")
    ap.add_argument(
        "--drafters",
        default=",".join(grid.DEFAULT_DRAFTERS),
        help="comma-separated: ngram[:K] (K=4), eagle[:K] (the bundled head, K=2), eagle-tree[:B1xB2..] (4x1)",
    )
    ap.add_argument("--passes", type=int, default=grid.DEFAULT_PASSES, help="timed passes per cell (rotating order)")
    ap.add_argument(
        "--prompts",
        type=int,
        default=grid.DEFAULT_PROMPTS,
        help="prompts per cell (a batch-B cell decodes at least B, in whole batches)",
    )
    ap.add_argument(
        "--max-new",
        type=int,
        default=None,
        help="new tokens per prompt for every workload (default: "
        + ", ".join(f"{w} {n}" for w, n in grid.MAX_NEW_TOKENS.items())
        + "); fewer marks the file as a smoke run",
    )
    ap.add_argument("--peers", default="transformers", choices=grid.PEERS, help="transformers at batch 1, or none")
    ap.add_argument("--seed", type=int, default=0, help="prompt-set seed")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name or .gguf file")
    ap.add_argument("--out", default=None, help="the result file (default results/grid-<UTC time>.json)")
    ap.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache directory ('none': off)")
    return ap


def settings_from_args(args) -> grid.GridSettings:
    """The grid's settings from the flags, every list checked whole (ValueError naming the flag)."""
    workloads = list_flag("--workloads", args.workloads, str, f"workload names ({', '.join(grid.REQUESTS)})")
    unknown = [w for w in workloads if w not in grid.REQUESTS]
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(grid.REQUESTS)}")
    drafters = list_flag("--drafters", args.drafters, str, "ngram[:K], eagle[:K], eagle-tree[:B1xB2..]")
    try:
        drafters = [grid.parse_drafter(d) for d in drafters]
    except ValueError as e:
        raise ValueError(f"--drafters {args.drafters!r}: {e}") from None
    if args.max_new is not None and args.max_new < 1:
        raise ValueError(f"--max-new {args.max_new}: must be >= 1")
    max_new = {w: args.max_new or grid.MAX_NEW_TOKENS[w] for w in workloads}
    return grid.GridSettings(
        batches=tuple(int_list("--batches", args.batches)),
        workloads=tuple(workloads),
        drafters=tuple(drafters),
        passes=args.passes,
        prompts=args.prompts,
        max_new_tokens=max_new,
        peers=args.peers,
        seed=args.seed,
        model=args.model,
    )


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        settings = settings_from_args(args)
        out = record.check_out_path(args.out or record.default_path("grid"))
        from jspec.loaders import compile_cache_flag

        compile_cache_flag(args.compile_cache)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    command = record.command_line("python examples/bench_grid.py", argv)
    path, mismatches = grid.run(settings, command, out)
    print(f"wrote {path}")
    for m in mismatches:
        print(f"MISMATCH: {m['config']} in {m['cell']}, pass {m['pass'] + 1}: output differs from plain decoding")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
