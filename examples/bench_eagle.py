"""Benchmark the EAGLE head against plain decoding and n-gram prompt lookup, in ONE process, on SmolLM2-135M.

f32, batch 1, open chat prompts, greedy and T = 1. For every repetition, prompt and temperature the configs
run back to back (interleaved, so the two timing levels JAX:CPU jumps between from process to process
affect them alike); tokens/s come from ``PreparedDecode.run_timed()`` (compilation excluded) and the report
quotes medians over prompts x repetitions of each config's tokens/s and of its ratio to plain decoding's
tokens/s measured right before it. For the head it also reports:
- acceptance per draft position (accepted/proposed, the survival probability, and the conditional rate);
- the draft's share of a round: a jitted ``propose`` (catch-up + K head steps + q) and a jitted ``verify``
  (the target's K+1-token pass with features) timed separately on a live decode state, against the round
  time measured in the decode itself (seconds / rounds);
- ``jspec.cost_model.predict`` from those measured values (draft ms per step = propose / K, verify ms, the
  rest of the round as state ms, plain ms per token, measured conditional acceptance), next to the measured
  speedup, with the ratio predicted / measured. Propose and verify are timed after the decode runs, and these
  VMs' speed drifts by 20-40% within minutes, so they enter the model as multiples of a plain target step
  timed interleaved with them, scaled by the plain decode's ms per token: every input then comes from the
  same moment as the decode it predicts (the raw ms are printed too).

The default head is the one bundled in models/heads/ (``models.eagle.DEFAULT_HEAD``); examples/train_eagle.py
trains others into the cache, named by ``--name``.

    python examples/bench_eagle.py [--head smollm2-8k-chat-mp5] [--ks 2,3,4] [--trees '2,1;2,2,1']
        [--dynamic-trees '4,3,9'] [--reps 2] [--max-new 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec import decode as dec  # noqa: E402
from jspec.bench import metrics  # noqa: E402
from jspec.cli import wants_unstacked  # noqa: E402
from jspec.cost_model import conditional_rates_from_stats, predict  # noqa: E402
from jspec.drafters import DraftContext  # noqa: E402
from jspec.ngram import NgramDrafter  # noqa: E402
from jspec.tree import TreeRule, TreeSpec  # noqa: E402
from models import eagle as EG  # noqa: E402
from models import llama, registry  # noqa: E402

PROMPTS = [
    "What are some fun things to do on a rainy afternoon?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about a city waking up in the morning.",
    "What advice would you give to someone starting their first job?",
    "Why is the sky blue? Explain it simply.",
    "Tell me a short story about a fox who wants to fly.",
]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def tokens_per_round(rs) -> float:
    """Tokens per round over the runs of one config, as ``jspec.decode`` defines it: the tokens the rounds
    emitted (each run's new tokens but the first, which the prefill samples) / the rounds."""
    return metrics.tokens_per_round([r["tokens"] for r in rs], [r["rounds"] for r in rs])


def time_round_parts(target, drafter, dparams, tparams, prompt_ids, k: int, eos: tuple, reps: int = 15) -> dict:
    """Median ms of a jitted propose (catch-up + K head steps) and a jitted verify (K+1 target positions with
    features) on a live state after a few rounds, and of a plain 1-token target step, interleaved."""
    prepared = dec.prepare(
        target, tparams, [prompt_ids], drafter=drafter, draft_params=dparams, gamma=k, max_new_tokens=64, eos_ids=eos
    )
    pre, step = dec._stream_fns(target, drafter, prepared.config)
    st = pre(*prepared.args)
    for _ in range(3):
        st, _, _ = step(tparams, dparams, st)
    b = 1
    ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), k, jnp.int32), st.sampling)
    propose = jax.jit(drafter.propose, static_argnums=4)
    verify = jax.jit(drafter.verify, static_argnums=0)
    plain = jax.jit(target.apply)
    key = jax.random.key(0)
    prop = jax.block_until_ready(propose(dparams, st.draft_state, ctx, key, k))
    committed = st.seq_len - 1
    pending = jnp.take_along_axis(st.seq, committed[:, None], axis=1)
    tokens = jnp.concatenate([pending, prop.tokens], axis=1)
    positions = committed[:, None] + jnp.arange(k + 1)[None, :]
    jax.block_until_ready(verify(target, tparams, dparams, prop.state, tokens, positions, st.cache))
    jax.block_until_ready(plain(tparams, pending, committed[:, None], st.cache))
    t_p, t_v, t_1 = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(propose(dparams, st.draft_state, ctx, key, k))
        t1 = time.perf_counter()
        jax.block_until_ready(verify(target, tparams, dparams, prop.state, tokens, positions, st.cache))
        t2 = time.perf_counter()
        jax.block_until_ready(plain(tparams, pending, committed[:, None], st.cache))
        t3 = time.perf_counter()
        t_p.append(t1 - t0)
        t_v.append(t2 - t1)
        t_1.append(t3 - t2)
    return {"propose_ms": 1e3 * median(t_p), "verify_ms": 1e3 * median(t_v), "plain_step_ms": 1e3 * median(t_1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--head",
        default=EG.DEFAULT_HEAD,
        help="trained head: cache name, bundled head's name or directory; several, comma-separated",
    )
    ap.add_argument("--ks", default="2,3,4", help="draft lengths K for the head")
    ap.add_argument(
        "--trees",
        default="",
        help="static trees for the head, ';'-separated branchings (e.g. '2,1;2,2,1'), each optionally cut to its "
        "first N nodes breadth-first with '/N' ('4,1,1/11': tree (4,1) and a third level under its first two "
        "lines); children are the head's top-c at T = 0 (deterministic rule) and drawn without replacement "
        "at T > 0",
    )
    ap.add_argument(
        "--dynamic-trees",
        default="",
        help="EAGLE-2 dynamic trees for the head, ';'-separated TOP_K,DEPTH,BUDGET (e.g. '4,3,9'): BUDGET nodes "
        "(root included) chosen by the head's cumulative log-probability; children are its top candidates at "
        "any temperature",
    )
    ap.add_argument(
        "--packed-dtypes",
        default="bfloat16",
        help="dtype of the head's packed weights on the CPU kernel (EagleDrafter.draft_params); several, "
        "comma-separated, are compared in the same run",
    )
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the full results as JSON here")
    ap.add_argument(
        "--layers",
        default="auto",
        choices=("auto", "stacked", "unstacked"),
        help="target layer layout, see models.llama.unstack_layers (auto: unstacked on CPU and GPU)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}] (the built-in prompts), got {args.prompts}")
    ks = [int(x) for x in args.ks.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]

    target = registry.load(args.model, dtype="float32", unstacked=wants_unstacked(args.layers))
    cfg, tparams, model, tok = target
    eos = tok.eos_ids
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    configs = {
        "plain": (None, None, 0),
        f"ngram K={args.ngram_k}": (NgramDrafter(3, 1, vocab_size=cfg.vocab_size), None, args.ngram_k),
    }
    heads = args.head.split(",")
    dtypes = args.packed_dtypes.split(",")
    if len(dtypes) > 1 and not llama.is_packed(tparams):
        raise SystemExit("--packed-dtypes: only a packed target (the CPU kernel layout) uses them; give one")
    for head, pdt in [(h, d) for h in heads for d in dtypes]:
        # Several heads or dtypes: compared in the same run, each config tagged with what differs.
        diff = [x for x, many in ((head, len(heads) > 1), (pdt, len(dtypes) > 1)) if many]
        tag = f"eagle[{','.join(diff)}]" if diff else "eagle"
        for k in ks:
            drafter, dparams = EG.load_eagle(head, cfg, tparams, max_draft=k, packed_dtype=pdt)
            configs[f"{tag} K={k}"] = (drafter, dparams, k)
        for branching in filter(None, args.trees.split(";")):
            shape, _, budget = branching.partition("/")
            spec = TreeSpec(tuple(int(c) for c in shape.split(",")), int(budget) if budget else None)
            chain, dparams = EG.load_eagle(head, cfg, tparams, max_draft=spec.max_depth, packed_dtype=pdt)
            trees = (chain.as_tree(spec, TreeRule.DETERMINISTIC), chain.as_tree(spec, TreeRule.WITHOUT_REPLACEMENT))
            configs[f"{tag} tree {branching}"] = (trees, dparams, spec.max_depth)
            drafter = chain
        for dyn in filter(None, args.dynamic_trees.split(";")):
            top_k, depth, budget = (int(c) for c in dyn.split(","))
            chain, dparams = EG.load_eagle(head, cfg, tparams, max_draft=depth, packed_dtype=pdt)
            configs[f"{tag} dyn {dyn}"] = (chain.as_dynamic_tree(top_k, depth, budget), dparams, depth)
            drafter = chain
        meta = EG.read_meta(head)
        print(
            f"head '{head}': N={drafter.ecfg.n} tokens, {EG.param_count(dparams[1]) / 1e6:.2f}M params read per "
            f"draft step (rows included), trained on {meta.get('generated_tokens', '?')} generated tokens"
        )

    runs: dict = {(name, t): [] for name in configs for t in temps}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for i, ids in enumerate(prompts):
            for t in temps:
                plain_tps = None
                for name, (drafter, dparams, k) in configs.items():
                    if isinstance(drafter, tuple):  # a tree: (greedy rule, sampling rule)
                        drafter = drafter[1] if t > 0 else drafter[0]
                    out = dec.prepare(
                        model,
                        tparams,
                        [ids],
                        drafter=drafter,
                        draft_params=dparams,
                        gamma=k,
                        max_new_tokens=args.max_new,
                        temperature=t,
                        eos_ids=eos,
                        seed=1000 * rep + i,
                    ).run_timed()
                    s = out.stats
                    if drafter is None:
                        plain_tps = s["tokens_per_s"]
                    runs[(name, t)].append(
                        {
                            "prompt": i,
                            "rep": rep,
                            "tokens": s["new_tokens"][0],
                            "seconds": s["seconds"],
                            "tokens_per_s": s["tokens_per_s"],
                            "vs_plain": s["tokens_per_s"] / plain_tps,
                            "rounds": s["rounds"][0],
                            "accepted_at": s["accepted_at"],
                            "proposed_at": s["proposed_at"],
                            "compile_s": s["compile_seconds"],
                        }
                    )
                print(
                    f"rep {rep} prompt {i} T={t:g}: "
                    + ", ".join(f"{n} {runs[(n, t)][-1]['tokens_per_s']:.1f}" for n in configs)
                    + " tok/s",
                    flush=True,
                )
    print(f"decode runs took {time.perf_counter() - t_start:.0f} s")

    parts = {}
    for name, (drafter, dparams, k) in configs.items():
        if name.startswith("eagle") and " K=" in name:
            parts[name] = time_round_parts(model, drafter, dparams, tparams, prompts[0], k, eos)

    report = {"args": vars(args), "results": {}}
    ng = f"ngram K={args.ngram_k}"
    width = max(map(len, configs)) + 1
    for t in temps:
        print(f"\n== T={t:g}, batch 1, {len(prompts)} prompts x {args.reps} reps, medians ==")
        plain_tps = median([r["tokens_per_s"] for r in runs[("plain", t)]])
        for name in configs:
            rs = runs[(name, t)]
            tps = median([r["tokens_per_s"] for r in rs])
            ratio = median([r["vs_plain"] for r in rs])
            # Paired like vs_plain: each run against the n-gram run of the same prompt, repetition and T.
            vs_ng = median([r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(rs, runs[(ng, t)])])
            is_tree = isinstance(configs[name][0], tuple) or getattr(configs[name][0], "is_tree", False)
            acc = np.sum([r["accepted_at"] for r in rs], axis=0)
            prop = np.sum([r["proposed_at"] for r in rs], axis=0)
            row = {
                "tokens_per_s": tps,
                "speedup_vs_plain": ratio,
                "vs_ngram": vs_ng,
                "tokens_per_round": tokens_per_round(rs),
            }
            line = f"{name:{width}s} {tps:7.1f} tok/s  x{ratio:.2f} plain  x{vs_ng:.2f} n-gram"
            if name != "plain" and is_tree:  # candidates per depth, at most one kept: not a chain's survival
                row.update(accepted_at=acc.tolist(), proposed_at=prop.tolist())
                line += f"  {row['tokens_per_round']:.2f} tok/round  accepted/candidate nodes per depth " + " ".join(
                    f"{x:.2f}" for x in acc / np.maximum(prop, 1)
                )
            elif name != "plain":
                surv = acc / np.maximum(prop, 1)
                cond = conditional_rates_from_stats(acc.tolist(), prop.tolist())
                row.update(
                    accepted_at=acc.tolist(),
                    proposed_at=prop.tolist(),
                    survival=surv.tolist(),
                    conditional=cond.tolist(),
                )
                line += f"  {row['tokens_per_round']:.2f} tok/round  accepted/proposed per position " + " ".join(
                    f"{x:.2f}" for x in surv
                )
            if name in parts:
                k = configs[name][2]
                p = parts[name]
                round_ms = 1e3 * median([r["seconds"] / max(r["rounds"], 1) for r in rs])
                plain_ms = 1e3 / plain_tps
                # In units of the plain step timed next to them, then at the decode runs' speed. The model's
                # cycle is propose + verify only: the rest of the round (acceptance, commit, loop control) is
                # what it leaves out, printed beside it (taking it from the measured round would make the
                # prediction agree with the measurement by construction).
                propose_ms = p["propose_ms"] / p["plain_step_ms"] * plain_ms
                verify_ms = p["verify_ms"] / p["plain_step_ms"] * plain_ms
                rest_ms = round_ms - propose_ms - verify_ms
                pred = predict(
                    baseline_ms_per_token=plain_ms,
                    draft_ms=propose_ms / k,
                    verify_ms=verify_ms,
                    state_ms=0.0,
                    accept_at=list(cond)[:k] + [0.0] * (k - len(cond)),
                )
                row.update(
                    parts=p,
                    round_ms=round_ms,
                    propose_ms_at_decode_speed=propose_ms,
                    verify_ms_at_decode_speed=verify_ms,
                    unmodelled_ms=rest_ms,
                    draft_share=propose_ms / round_ms,
                    predicted_speedup=pred.speedup,
                    predicted_over_measured=pred.ratio_to(ratio),
                )
                line += (
                    f"\n{'':{width}s} round {round_ms:.1f} ms: propose {propose_ms:.1f} ms "
                    f"({100 * propose_ms / round_ms:.0f}% of the round), verify {verify_ms:.1f} ms, rest "
                    f"{rest_ms:.1f} ms, not modelled (propose {p['propose_ms'] / p['plain_step_ms']:.2f} and verify "
                    f"{p['verify_ms'] / p['plain_step_ms']:.2f} plain steps, timed apart at T=0: "
                    f"{p['propose_ms']:.1f}, {p['verify_ms']:.1f} and {p['plain_step_ms']:.1f} ms); cost model "
                    f"x{pred.speedup:.2f} predicted vs x{ratio:.2f} measured (ratio {pred.ratio_to(ratio):.2f})"
                )
            print(line)
            report["results"][f"{name} T={t:g}"] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**report, "runs": {f"{n} T={t:g}": v for (n, t), v in runs.items()}}, f, indent=1)
    return report


if __name__ == "__main__":
    main()
