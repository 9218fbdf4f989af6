"""Benchmark the EAGLE head against plain decoding and n-gram prompt lookup, in ONE process, on SmolLM2-135M.

f32, batch 1, open chat prompts, greedy and T = 1. For every repetition, prompt and temperature the configs run
back to back (interleaved, so the two timing levels JAX:CPU jumps between from process to process affect them
alike), their order rotated by one from each prompt to the next (so that no config always runs first, or always
right after plain decoding, as the machine drifts); tokens/s come from ``PreparedDecode.run_timed()`` on a
program compiled and already run once (compilation and each program's first execution excluded: the first time a
config meets a prompt width, one untimed run comes before the timed one). The report quotes medians over prompts
x repetitions of each config's tokens/s and of its ratio to plain decoding's tokens/s on the same prompt and
repetition, twice: end to end (prefill included) and decode only (the tokens after the prefill's first one, over
the run's time minus its prefill, timed alone right after the run). At T = 1 the two sides emit different
numbers of tokens, so the end-to-end rates spread one prefill over different lengths; the decode-only ratio is
the like-for-like one there, and the one the cost model is checked against.

At T = 0 every speculative config's tokens are compared with plain decoding's, token for token (greedy
speculation is lossless): a difference prints a MISMATCH line, marks that config's ratios and makes the
script exit with status 1.

For the head it also reports:
- acceptance per draft position (accepted/proposed, the survival probability, and the conditional rate);
- the draft's share of a round: a jitted ``propose`` (catch-up + K head steps + q) and a jitted ``verify``
  (the target's K+1-token pass with features) timed separately on a live decode state, against the round
  time measured in the decode itself (decode-only seconds / rounds). Like the fused round, they update the
  KV caches (and the head's state) in place: those arguments are donated, fresh copies made untimed;
- ``jspec.cost_model.predict`` from those measured values (draft ms per step = propose / K, verify ms, state
  ms 0: the rest of the round (acceptance, commit, loop control) is not modelled and is printed beside it
  as "rest"), plain decode-only ms per token, the measured conditional acceptance), next to the measured
  decode-only speedup, with the ratio predicted / measured. Propose and verify are timed after the decode
  runs, and these VMs' speed drifts by 20-40% within minutes, so they enter the model as multiples of a
  whole plain decode round (``decode_round`` without a drafter: the target step, sampling, the cache write and
  the loop's bookkeeping) timed interleaved with them, scaled by the plain decode's ms per token (one plain round
  per token): both sides of every ratio are in the same unit and from the same moment as the decode it predicts
  (``cost_at_decode_speed``; the raw ms, and the bare target step for reference, are printed too). "round" is the
  head config's measured decode round, "propose" / "verify" its pieces at the decode's speed, "rest" = round -
  propose - verify, "% of the round" = propose / round, and the prediction is plain round x E[N] / (propose +
  verify): the seed formula with a whole plain round as its baseline.

The default head is the one bundled in models/heads/ (``models.eagle.DEFAULT_HEAD``); examples/train_eagle.py
trains others into the cache, named by ``--name``.

    python examples/bench_eagle.py [--head smollm2-8k-chat-mp5] [--ks 2,3,4] [--trees '2,1;2,2,1']
        [--dynamic-trees '4,3,9'] [--reps 2] [--max-new 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import decode as dec
from jspec.bench import metrics
from jspec.bench.checks import predict_k_rounds
from jspec.bench.phase_costs import fresh
from jspec.cost_model import conditional_rates_from_stats
from jspec.drafters import DraftContext
from jspec.loaders import wants_unstacked
from jspec.ngram import NgramDrafter
from jspec.tree import TreeRule, TreeSpec
from models import eagle as EG
from models import llama, registry
from models.training.prompts import BENCH_EAGLE_PROMPTS as PROMPTS  # held out from the EAGLE trainer's data


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def tokens_per_round(rs) -> float:
    """Tokens per round over the runs of one config, as ``jspec.decode`` defines it: the tokens the rounds
    emitted (each run's new tokens but the first, which the prefill samples) / the rounds."""
    return metrics.tokens_per_round([r["tokens"] for r in rs], [r["rounds"] for r in rs])


def round_parts(target, drafter, dparams, tparams, prompt_ids, k: int, eos: tuple) -> dict:
    """name -> (jitted piece, maker of its arguments) on a live state after a few rounds: a propose (catch-up +
    K head steps), a verify (K+1 target positions with features), a bare 1-token target step (``target.apply``)
    and a whole plain decode round (``decode_round`` without a drafter, on a plain decode's state after as many
    rounds: the step plus sampling, the cache write and the loop's bookkeeping; the unit ``cost_at_decode_speed``
    converts with). Each piece takes what the fused round updates in place donated (the target's KV cache;
    propose and verify the head's state too; the plain round its whole state): returned undonated, every call
    would copy the whole cache into its output, a cost the decode loop never pays. The maker hands each call
    fresh copies, to be made outside the timed region."""
    prepared = dec.prepare(
        target, tparams, [prompt_ids], drafter=drafter, draft_params=dparams, gamma=k, max_new_tokens=64, eos_ids=eos
    )
    pre, step = dec._stream_fns(target, drafter, prepared.config)
    st = pre(*prepared.args)
    for _ in range(3):
        st, _, _ = step(tparams, dparams, st)
    b = 1
    ctx = DraftContext(st.seq, st.seq_len, jnp.full((b,), k, jnp.int32), st.sampling)
    propose = jax.jit(drafter.propose, static_argnums=4, donate_argnums=1)
    verify = jax.jit(drafter.verify, static_argnums=0, donate_argnums=(3, 6))
    plain = jax.jit(target.apply, donate_argnums=3)
    key = jax.random.key(0)
    prop = jax.block_until_ready(propose(dparams, fresh(st.draft_state), ctx, key, k))
    committed = st.seq_len - 1
    pending = jnp.take_along_axis(st.seq, committed[:, None], axis=1)
    tokens = jnp.concatenate([pending, prop.tokens], axis=1)
    positions = committed[:, None] + jnp.arange(k + 1)[None, :]
    plain_prep = dec.prepare(target, tparams, [prompt_ids], max_new_tokens=64, eos_ids=eos)
    plain_pre, plain_round = dec._stream_fns(target, None, plain_prep.config)
    plain_st = plain_pre(*plain_prep.args)
    for _ in range(3):
        plain_st, _, _ = plain_round(tparams, None, plain_st)
    return {
        "propose_ms": (propose, lambda: (dparams, fresh(st.draft_state), ctx, key, k)),
        "verify_ms": (
            verify,
            lambda: (target, tparams, dparams, fresh(prop.state), tokens, positions, fresh(st.cache)),
        ),
        "plain_step_ms": (plain, lambda: (tparams, pending, committed[:, None], fresh(st.cache))),
        "plain_round_ms": (plain_round, lambda: (tparams, None, fresh(plain_st))),
    }


def time_round_parts(target, drafter, dparams, tparams, prompt_ids, k: int, eos: tuple, reps: int = 15) -> dict:
    """Median ms of each of ``round_parts``' pieces, interleaved; each piece compiled and run once first."""
    parts = round_parts(target, drafter, dparams, tparams, prompt_ids, k, eos)
    for fn, args in parts.values():
        jax.block_until_ready(fn(*args()))
    times: dict = {name: [] for name in parts}
    for _ in range(reps):
        for name, (fn, args) in parts.items():
            a = args()  # fresh copies of what the piece consumes, before the clock starts
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * median(t) for name, t in times.items()}


def cost_at_decode_speed(p: dict, k: int, round_ms: float, plain_ms: float, cond, measured: float) -> dict:
    """One head config's cost model in the decode runs' units. ``p``: ``time_round_parts``' medians (propose,
    verify, the bare target step and the whole plain round, timed together after the decode runs); ``round_ms``:
    the config's measured decode round (decode-only seconds / rounds); ``plain_ms``: plain decoding's decode-only
    ms per token, i.e. per plain round; ``cond``: the measured conditional acceptance; ``measured``: the measured
    decode-only speedup.

    Propose and verify enter as multiples of the whole plain round timed with them, times ``plain_ms``: one unit
    on both sides. (As multiples of the bare target step, times a whole round, they took on the plain round's own
    overhead, sampling, the cache write and loop control, in proportion: "rest" came out too small and the draft's
    share of the round too large.) The prediction is the seed formula with the plain round as baseline:
    plain_ms x E[N] / (propose + verify); the rest of the round is not modelled (``unmodelled_ms``)."""
    scale = plain_ms / p["plain_round_ms"]
    propose_ms, verify_ms = p["propose_ms"] * scale, p["verify_ms"] * scale
    pred = predict_k_rounds(plain_ms, propose_ms / k, verify_ms, cond, k)
    return {
        "round_ms": round_ms,
        "plain_round_ms_at_decode_speed": plain_ms,
        "propose_in_plain_rounds": p["propose_ms"] / p["plain_round_ms"],
        "verify_in_plain_rounds": p["verify_ms"] / p["plain_round_ms"],
        "plain_round_in_bare_steps": p["plain_round_ms"] / p["plain_step_ms"],
        "propose_ms_at_decode_speed": propose_ms,
        "verify_ms_at_decode_speed": verify_ms,
        "unmodelled_ms": round_ms - propose_ms - verify_ms,
        "draft_share": propose_ms / round_ms,
        "predicted_speedup": pred.speedup,
        "predicted_over_measured": pred.ratio_to(measured),
    }


def program_key(p) -> tuple:
    """What one compiled program serves: the jitted decode (drafter and static config) and every argument's
    shape, dtype and weak type but the target params' (the same in every run)."""
    avals = tuple(
        (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))) for x in jax.tree.leaves(p.args[1:])
    )
    return id(p.fn), avals


def timed_run(p, programs: dict):
    """``p.run_timed()`` with the compile and the program's first execution outside the timing: the first time
    ``program_key(p)`` comes up the decode and its prefill are compiled and run once, untimed (``programs``
    keeps them). Then the prefill alone is timed right after the run (``prefill_seconds``), for decode-only
    rates. ``compile_seconds``: that first compile (0 for a program met before)."""
    key = program_key(p)
    entry = programs.get(key)
    compile_s = 0.0
    if entry is None:
        t0 = time.perf_counter()
        run, pre = p.compile(), p.stream_fns()[0].lower(*p.args).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(run(*p.args))  # untimed first executions
        jax.block_until_ready(pre(*p.args))
        # "fn" keeps the jitted decode alive, so that its id in the key is not reused by another.
        entry = programs[key] = {"fn": p.fn, "run": run, "prefill": pre}
    p.compile = lambda: entry["run"]
    out = p.run_timed()
    t0 = time.perf_counter()
    jax.block_until_ready(entry["prefill"](*p.args))
    out.stats.update(prefill_seconds=time.perf_counter() - t0, compile_seconds=compile_s)
    return out


def decode_rate(new_tokens: int, seconds: float, prefill_seconds: float) -> float | None:
    """Tokens after the prefill's first one / the run's time without its prefill (None: no decode phase, or a
    prefill timed longer than the run)."""
    t = seconds - prefill_seconds
    return (new_tokens - 1) / t if new_tokens > 1 and t > 0 else None


def first_difference(a, b) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length if one is a prefix of the
    other), None when equal."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def paired(rs, base, field: str) -> list[float]:
    """rs[j][field] / base[j][field] for the runs where both are measured (same prompt, repetition and T)."""
    return [r[field] / b[field] for r, b in zip(rs, base) if r[field] and b[field]]


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
    ap.add_argument("--reps", type=int, default=2, help="repetitions: every prompt x repetition is one pass")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument(
        "--out",
        default=None,
        help="the result file (jspec.bench.record; default results/eagle-<UTC time>.json): written once the decode "
        "runs are measured, then again with the summary and the cost model",
    )
    ap.add_argument(
        "--layers",
        default="auto",
        choices=("auto", "stacked", "unstacked"),
        help="target layer layout, see models.llama.unstack_layers (auto: unstacked on CPU and GPU)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}] (the built-in prompts), got {args.prompts}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: expected 1 or more (every statistic is a median over the repetitions)")
    dtypes = args.packed_dtypes.split(",")
    for d in dtypes:
        try:
            llama.canonical_dtype(d)
        except ValueError as e:
            ap.error(f"--packed-dtypes {args.packed_dtypes!r}: {e}")
    ks = [int(x) for x in args.ks.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    from jspec.bench import record

    try:
        rec = record.start("eagle", "python examples/bench_eagle.py", argv, dict(vars(args)), args.out)
    except OSError as e:
        ap.error(str(e))

    target = registry.load(args.model, dtype="float32", unstacked=wants_unstacked(args.layers))
    cfg, tparams, model, tok = target
    eos = tok.eos_ids
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    configs = {
        "plain": (None, None, 0),
        f"ngram K={args.ngram_k}": (NgramDrafter(3, 1, vocab_size=cfg.vocab_size), None, args.ngram_k),
    }
    heads = args.head.split(",")
    default_dtype = ap.get_default("packed_dtypes")
    if not llama.is_packed(tparams) and (len(dtypes) > 1 or llama.canonical_dtype(dtypes[0]) != default_dtype):
        # An unpacked target's head keeps its own weights' dtype: the flag would be ignored, silently.
        raise SystemExit(
            f"--packed-dtypes {args.packed_dtypes}: only a packed target (the CPU kernel layout) uses them, and this "
            f"one is not packed: leave the flag out (it would be ignored)"
        )
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
    for t in temps:  # a cell per temperature; a pass per prompt x repetition, the configs in a rotated order
        rec.cell(f"T={t:g}", temperature=t, batch=1, prompts=len(prompts), reps=args.reps, max_new_tokens=args.max_new)
        for name in configs:
            rec.config(f"T={t:g}", name, kind="plain" if name == "plain" else "jspec", gamma=configs[name][2])
    programs: dict = {}  # compiled decodes (and prefills) already run once: see ``timed_run``
    mismatches = []
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for i, ids in enumerate(prompts):
            for t in temps:
                names = list(configs)
                shift = (rep * len(prompts) + i) % len(names)
                done, order = {}, names[shift:] + names[:shift]
                for name in order:
                    drafter, dparams, k = configs[name]
                    if isinstance(drafter, tuple):  # a tree: (greedy rule, sampling rule)
                        drafter = drafter[1] if t > 0 else drafter[0]
                    prepared = dec.prepare(
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
                    )
                    out = timed_run(prepared, programs)
                    s = out.stats
                    n_new = s["new_tokens"][0]
                    run = {
                        "prompt": i,
                        "rep": rep,
                        "tokens": n_new,
                        "seconds": s["seconds"],
                        "prefill_seconds": s["prefill_seconds"],
                        "decode_seconds": s["seconds"] - s["prefill_seconds"],
                        "tokens_per_s": s["tokens_per_s"],
                        "decode_tokens_per_s": decode_rate(n_new, s["seconds"], s["prefill_seconds"]),
                        "rounds": s["rounds"][0],
                        "accepted_at": s["accepted_at"],
                        "proposed_at": s["proposed_at"],
                        "compile_s": s["compile_seconds"],
                        "output": out.tokens[0],
                    }
                    done[name] = run
                plain_run = done["plain"]
                for name in names:  # the report's order
                    run = done[name]
                    run["vs_plain"] = run["tokens_per_s"] / plain_run["tokens_per_s"]
                    pd, rd = plain_run["decode_tokens_per_s"], run["decode_tokens_per_s"]
                    run["vs_plain_decode"] = rd / pd if rd and pd else None
                    if t == 0 and name != "plain":  # greedy speculation must reproduce plain decoding
                        j = first_difference(run["output"], plain_run["output"])
                        run["same_as_plain"] = j is None
                        if j is not None:
                            mismatches.append(f"{name} rep {rep} prompt {i}")
                            print(
                                f"MISMATCH: {name} at T=0 (rep {rep}, prompt {i}) differs from plain greedy decoding "
                                f"from new token {j} on ({len(run['output'])} vs {len(plain_run['output'])} tokens)",
                                flush=True,
                            )
                    runs[(name, t)].append(run)
                rec.add_pass(f"T={t:g}", rep * len(prompts) + i, [record_entry(name, order.index(name), done[name])
                                                                 for name in names])  # fmt: skip
                print(
                    f"rep {rep} prompt {i} T={t:g}: "
                    + ", ".join(f"{n} {runs[(n, t)][-1]['tokens_per_s']:.1f}" for n in configs)
                    + " tok/s",
                    flush=True,
                )
    print(f"decode runs took {time.perf_counter() - t_start:.0f} s ({len(programs)} programs warmed up untimed)")
    ng = f"ngram K={args.ngram_k}"
    for t in temps:
        for name in list(configs)[1:]:
            rec.ratio(f"T={t:g}", name, ["plain"], f"{name} vs plain")
            if name != ng:
                rec.ratio(f"T={t:g}", name, [ng], f"{name} vs {ng}")
    rec.extra.update(mismatches=mismatches, results=None)
    rec.write()  # the measured runs first: the cost timing below may fail or be stopped
    print(f"decode runs written to {rec.path} (the results follow after the cost timing)", flush=True)

    parts = {}
    for name, (drafter, dparams, k) in configs.items():
        if name.startswith("eagle") and " K=" in name:
            parts[name] = time_round_parts(model, drafter, dparams, tparams, prompts[0], k, eos)

    report = {"args": vars(args), "results": {}, "mismatches": mismatches}
    width = max(map(len, configs)) + 1
    for t in temps:
        print(f"\n== T={t:g}, batch 1, {len(prompts)} prompts x {args.reps} reps, medians ==")
        print(
            f"{'':{width}s} end to end (prefill included) | decode only (after the prefill's token)"
            + ("" if t == 0 else ": the like-for-like rate at T > 0, where the configs emit different lengths")
        )
        plain_dec = median([r["decode_tokens_per_s"] for r in runs[("plain", t)] if r["decode_tokens_per_s"]])
        for name in configs:
            rs = runs[(name, t)]
            tps = median([r["tokens_per_s"] for r in rs])
            dtps = median([r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"]])
            ratio = median([r["vs_plain"] for r in rs])
            dratio = median([r["vs_plain_decode"] for r in rs if r["vs_plain_decode"]])
            # Paired like vs_plain: each run against the n-gram run of the same prompt, repetition and T.
            vs_ng = median(paired(rs, runs[(ng, t)], "tokens_per_s"))
            vs_ng_dec = median(paired(rs, runs[(ng, t)], "decode_tokens_per_s"))
            is_tree = isinstance(configs[name][0], tuple) or getattr(configs[name][0], "is_tree", False)
            acc = np.sum([r["accepted_at"] for r in rs], axis=0)
            prop = np.sum([r["proposed_at"] for r in rs], axis=0)
            row = {
                "tokens_per_s": tps,
                "speedup_vs_plain": ratio,
                "decode_tokens_per_s": dtps,
                "decode_speedup_vs_plain": dratio,
                "vs_ngram": vs_ng,
                "vs_ngram_decode": vs_ng_dec,
                "tokens_per_round": tokens_per_round(rs),
            }
            differ = sum(not r.get("same_as_plain", True) for r in rs)
            mark = f" (OUTPUT DIFFERS FROM PLAIN in {differ}/{len(rs)} runs: these ratios compare other outputs)"
            mark = mark if differ else ""
            if t == 0 and name != "plain":
                row["identical_to_plain"] = not differ
            line = (
                f"{name:{width}s} {tps:7.1f} tok/s x{ratio:.2f} plain | {dtps:7.1f} tok/s x{dratio:.2f} plain, "
                f"x{vs_ng_dec:.2f} n-gram{mark}"
            )
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
                p = parts[name]
                # Decode only on both sides: the model describes the rounds, not the prefill. The model's cycle
                # is propose + verify only: the rest of the round (acceptance, commit, loop control) is what it
                # leaves out, printed beside it (taking it from the measured round would make the prediction
                # agree with the measurement by construction).
                round_ms = 1e3 * median([r["decode_seconds"] / r["rounds"] for r in rs if r["rounds"]])
                c = cost_at_decode_speed(p, configs[name][2], round_ms, 1e3 / plain_dec, cond, dratio)
                row.update(parts=p, **c)
                line += (
                    f"\n{'':{width}s} round {round_ms:.1f} ms (decode only): propose "
                    f"{c['propose_ms_at_decode_speed']:.1f} ms ({100 * c['draft_share']:.0f}% of the round), verify "
                    f"{c['verify_ms_at_decode_speed']:.1f} ms, rest {c['unmodelled_ms']:.1f} ms, not modelled "
                    f"(propose {c['propose_in_plain_rounds']:.2f} and verify {c['verify_in_plain_rounds']:.2f} whole "
                    f"plain rounds, timed apart at T=0: {p['propose_ms']:.1f}, {p['verify_ms']:.1f} and "
                    f"{p['plain_round_ms']:.1f} ms; the bare target step {p['plain_step_ms']:.1f} ms); cost model "
                    f"x{c['predicted_speedup']:.2f} predicted (plain round x E[N] / (propose + verify)) vs "
                    f"x{dratio:.2f} measured decode only (ratio {c['predicted_over_measured']:.2f})"
                )
            print(line)
            report["results"][f"{name} T={t:g}"] = row
    if mismatches:
        print(
            f"\nMISMATCH: {len(mismatches)} greedy speculative run(s) differ from plain decoding "
            f"({', '.join(mismatches)}): their ratios compare different outputs"
        )
    rec.extra.update(results=report["results"])
    rec.finish()
    print(f"wrote {rec.write()}")
    return report


def record_entry(name: str, position: int, run: dict) -> dict:
    """One measured run as a pass entry of the result file (``jspec.bench.record``)."""
    from jspec.bench import record

    return record.run_entry(
        name, position, run["tokens"], run["seconds"], run["rounds"], tokens_per_round([run]),
        decode_tokens_per_s=run["decode_tokens_per_s"], prefill_seconds=run["prefill_seconds"],
        same_as_plain=run.get("same_as_plain"), prompt=run["prompt"], rep=run["rep"],
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(1 if main()["mismatches"] else 0)
