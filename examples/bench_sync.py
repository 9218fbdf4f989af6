"""Host syncs per round: the fused on-device loop (``jspec.decode``) against the serving engine stepped from
Python with 1 or more rounds per host sync (``Engine(rounds_per_sync=R)``), plain and n-gram, batch 1, greedy,
in ONE process, every program compiled and run once before timing, then each prompt x repetition is a pass running
the fused loop and every engine back to back, in an order rotated from pass to pass. A request's time runs from
its prefill to its last token on the host. Outputs are checked identical to the fused loop's. Both sides pad
each prompt to the same width (a multiple of ``PROMPT_PAD``, as ``jspec.decode.prepare`` does), so both
prefill the same number of positions.

    python examples/bench_sync.py [--rounds 1,4,16] [--prompts 3] [--max-new 96] [--reps 2]
"""

from __future__ import annotations

import argparse
import time

from jspec.bench import record
from jspec.bench.metrics import timed_region_gc
from jspec.decode import prepare
from jspec.loaders import LAYER_LAYOUTS, wants_unstacked
from jspec.ngram import NgramDrafter
from jspec.serve import Engine
from models import registry

# jspec.decode.prepare pads a prompt to a multiple of 16 positions (capped at max_len); the engine pads to a
# multiple of its ``bucket`` (default 64), so it is given 16: with 64, a 40-token prompt prefilled 64 positions
# through the engine and 48 through the fused loop, and the ratio charged the engine for the difference.
PROMPT_PAD = 16

PROMPTS = [
    "Rewrite this sentence in plain words: The committee postponed the decision until further data arrives.",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about a city waking up in the morning.",
]


def make_engine(model, params, drafter, k: int, eos, max_len: int, rounds_per_sync: int) -> Engine:
    """A batch-1 engine that pads prompts as the fused loop's ``prepare`` does (``PROMPT_PAD``)."""
    return Engine(
        model,
        params,
        batch=1,
        max_len=max_len,
        drafter=drafter,
        gamma=k,
        eos_ids=eos,
        rounds_per_sync=rounds_per_sync,
        bucket=PROMPT_PAD,
    )


def engine_run(engine: Engine, ids, max_new: int) -> tuple[list[int], float]:
    # The heap frozen as a warm server's would be: the Python loop allocates, the fused loop does not.
    with timed_region_gc():
        t0 = time.perf_counter()
        toks = [engine.add(0, ids, max_new)]
        while engine.stop_reason(0) == 0:  # RUNNING
            toks += engine.step().get(0, [])
        return toks, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", default="1,4,16", help="rounds per host sync for the engine")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="repetitions: each prompt x repetition is a pass")
    ap.add_argument("--out", default=None, help="the result file (default results/sync-<UTC time>.json)")
    ap.add_argument("--layers", default="auto", choices=LAYER_LAYOUTS)
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}] (the built-in prompts), got {args.prompts}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: expected 1 or more (the rates are medians over the repetitions)")

    try:
        rec = record.start("sync", "python examples/bench_sync.py", argv, dict(vars(args)), args.out)
    except OSError as e:
        ap.error(str(e))
    cfg, params, model, tok = registry.load(args.model, unstacked=wants_unstacked(args.layers))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    eos = cfg.eos_ids
    drafters = {
        "plain": (None, 0),
        f"ngram K={args.gamma}": (NgramDrafter(3, 1, vocab_size=cfg.vocab_size), args.gamma),
    }
    rounds = [int(r) for r in args.rounds.split(",")]
    for dname, (drafter, k) in drafters.items():
        engines = {f"engine R={r}": make_engine(model, params, drafter, k, eos, args.max_len, r) for r in rounds}
        fused, refs = [], []
        for ids in prompts:  # warm-up: compile and run every program once
            for e in engines.values():
                engine_run(e, ids, args.max_new)
            p = prepare(
                model,
                params,
                [ids],
                drafter=drafter,
                gamma=k,
                max_new_tokens=args.max_new,
                eos_ids=eos,
                max_len=args.max_len,
            )
            compiled = p.compile()
            refs.append(p.run(compiled).tokens[0])
            fused.append((p, compiled))
        cell, names = f"{dname} b=1", ["fused loop", *engines]
        rec.cell(cell, drafter=dname, batch=1, prompts=len(prompts), max_new_tokens=args.max_new)
        for name in names:
            rec.config(cell, name, kind="reference" if name == "fused loop" else "engine")
        for rep in range(args.reps):
            for i, ids in enumerate(prompts):
                entries = []
                for pos, name in enumerate(record.rotation(names, rep * len(prompts) + i)):
                    if name == "fused loop":
                        p, compiled = fused[i]
                        t0 = time.perf_counter()
                        toks = p.run(compiled).tokens[0]  # blocks: the tokens come back to the host
                        sec = time.perf_counter() - t0
                    else:
                        toks, sec = engine_run(engines[name], ids, args.max_new)
                    if toks != refs[i]:
                        raise SystemExit(f"{dname}, {name}, prompt {i}: output differs from the fused loop's")
                    entries.append(record.run_entry(name, pos, len(toks), sec, prompt=i, rep=rep))
                rec.add_pass(cell, rep * len(prompts) + i, entries)
        for name in names[1:]:
            rec.ratio(cell, name, ["fused loop"], f"{name} vs fused loop")
        rec.write()
    print(
        f"batch 1, greedy, {len(prompts)} prompts x {args.reps} reps, {args.max_new} new tokens, max_len {args.max_len}"
    )
    summary = record.summarize(rec.data)
    for dname in drafters:  # medians over the passes; each ratio's median of the per-pass ratios, (min-max)
        cell = summary[f"{dname} b=1"]
        for how, c in cell["configs"].items():
            r = cell["ratios"].get(f"{how} vs fused loop")
            of = f"  x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) of the fused loop" if r else ""
            print(f"{dname:10s} {how:12s} {c['tokens_per_s']['median']:8.1f} tok/s{of}")
    print("outputs identical to the fused loop: yes")
    rec.finish()
    print(f"wrote {rec.write()}")


if __name__ == "__main__":
    main()
