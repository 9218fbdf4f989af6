"""Trained draft vs plain decoding on --model (SmolLM2-135M by default; f32, batch 1, greedy), measured in one run.

For every configuration (plain, then each draft at each K) and every open chat prompt below, one
``jspec.decode.prepare(...).run_timed()`` (compile and the program's first execution excluded: every
prepared decode is compiled once and run once untimed before the repeats); repeats are interleaved (JAX CPU timings jump
between two levels from process to process and drift with the machine's load) and the speedup is the
median over repeats of (plain time / speculative time) measured back to back. Greedy speculative output is
checked to be token-for-token the plain output.

Also printed: acceptance per draft position (accepted / proposed, and the conditional rates derived from
them), measured tokens per round, and the cost model (``jspec.cost_model.predict``) fed with the measured
conditional rates and measured costs: a draft step (one draft token: draft forward + sampling) and a
verification call over K + 1 positions, for rounds of K draft steps (a position never proposed counts as
never accepted), the plain per-token time as the baseline, state cost 0. The costs
are timed after the decode runs, and these VMs' speed drifts by 10-40% within minutes, so they enter the
model as multiples of a plain 1-token target step timed beside them, at the plain decode's ms per token (the
raw ms are printed too); the round time the model leaves out (acceptance, commit, loop control) is printed
per configuration. measured / predicted says how much of the predicted gain the real loop keeps.

A draft missing from the cache is trained first (``examples/train_draft.py`` defaults; minutes).

    python examples/bench_draft.py [--drafts smollm2-2L-8k,smollm2-2L-full] [--gammas 2,3,4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jspec import cost_model
from jspec import decode as dec
from jspec.bench import metrics, phase_costs
from jspec.bench.checks import predict_k_rounds
from jspec.loaders import wants_unstacked
from jspec.sampling import distribution, sample
from jspec.validate import sampling_params
from models import draft as D
from models import registry

PROMPTS = [
    "What are three fun things to do on a rainy day?",
    "Can you explain what a budget is and why it is useful?",
    "Write a short note thanking a friend for their help with moving house.",
    "What is the best way to learn to cook?",
    "Tell me about the benefits of walking every day.",
    "How do I make my small apartment feel more cozy?",
]


def get_draft(name: str, target, model: str, unstacked: bool = False):
    try:
        return D.load_draft(name, target_config=target.config, tokenizer=target.tokenizer, unstacked=unstacked)
    except FileNotFoundError:
        pass
    from models.training import draft as train_draft

    argv = ["--name", name, "--model", model]
    m = re.fullmatch(r".*-(\d+)L-(\d+k|\d+|full)", name)
    if m:  # names like smollm2-2L-8k / smollm2-4L-full carry the draft's shape
        head = m.group(2)
        head = 0 if head == "full" else int(head[:-1]) * 1024 if head.endswith("k") else int(head)
        argv += ["--layers", m.group(1), "--head-size", str(head)]
    print(f"draft '{name}' is not cached: training it ({' '.join(argv)})", flush=True)
    train_draft.main(argv)
    return D.load_draft(name, target_config=target.config, tokenizer=target.tokenizer, unstacked=unstacked)


def _median_ms(fn, *args, n: int = 15) -> float:
    return phase_costs.median_ms(lambda: fn(*args), repeats=n)


def measure_costs(target, drafts, gammas, slots: int, ctx: int) -> dict:
    """Milliseconds of: one target step (1 token), one verification (K + 1 tokens) per K, one draft step per
    draft (16 chained draft tokens in one jitted scan, divided by 16), all with ``ctx`` cached tokens."""
    greedy = sampling_params(1)
    key = jax.random.key(0)

    def target_call(t):
        @jax.jit
        def f(params, cache):
            tokens = jnp.ones((1, t), jnp.int32)
            pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
            logits, _ = target.model.apply(params, tokens, pos, cache)
            return distribution(logits, greedy)

        return f

    cache = target.model.init_cache(1, slots).with_lengths(jnp.array([ctx], jnp.int32))
    out = {"target_step_ms": _median_ms(target_call(1), target.params, cache)}
    out["verify_ms"] = {k: _median_ms(target_call(k + 1), target.params, cache) for k in gammas}
    out["draft_ms"] = {}
    for name, loaded in drafts.items():
        model = loaded.model

        @jax.jit
        def chain(params, cache, model=model):
            def body(carry, _):
                cache, x = carry
                logits, cache = model.apply(params, x[:, None], cache.lengths[:, None], cache)
                cache = cache.commit(jnp.ones((1,), jnp.int32))
                return (cache, sample(key, distribution(logits[:, 0], greedy))), None

            (_, x), _ = jax.lax.scan(body, (cache, jnp.ones((1,), jnp.int32)), None, length=16)
            return x

        dcache = model.init_cache(1, slots).with_lengths(jnp.array([ctx], jnp.int32))
        out["draft_ms"][name] = _median_ms(chain, loaded.params, dcache) / 16
    return out


def warm_up(groups) -> int:
    """Compile every prepared decode once and run it once, untimed. ``run_timed`` compiles on every call
    (excluded from its time) unless ``compile`` is cached, so each timed run executed a freshly compiled
    program for the first time, one-time costs included; now every timed run reuses a program that ran
    before. Returns the number of warm-up runs."""
    n = 0
    for preps in groups:
        for p in preps:
            p.compile = functools.cache(p.compile)
            p.run(p.compile())
            n += 1
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafts", default="smollm2-2L-8k", help="comma-separated cached draft names")
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=5, help="passes, each running every configuration (rotated order)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=None, help="the result file (default results/draft-<UTC time>.json)")
    ap.add_argument(
        "--layers",
        default="auto",
        choices=("auto", "stacked", "unstacked"),
        help="target (and draft) layer layout, see models.llama.unstack_layers (auto: unstacked on CPU and GPU)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected 1 or more (the speedups are medians over the repeats)")
    gammas = [int(g) for g in args.gammas.split(",")]
    from jspec.bench import record

    try:
        rec = record.start("draft", "python examples/bench_draft.py", argv, dict(vars(args)), args.out)
    except OSError as e:
        ap.error(str(e))

    unstacked = wants_unstacked(args.layers)
    target = registry.load(args.model, dtype="float32", unstacked=unstacked)
    tok = target.tokenizer
    drafts = {name: get_draft(name, target, args.model, unstacked) for name in args.drafts.split(",")}
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    common = dict(max_new_tokens=args.max_new, eos_ids=tok.eos_ids, temperature=0.0)

    configs = [("plain", None, 0)] + [(n, d, k) for n, d in drafts.items() for k in gammas]
    prepared = {}
    for name, loaded, k in configs:
        kw = {} if loaded is None else dict(drafter=loaded.drafter(), draft_params=loaded.params, gamma=k)
        prepared[(name, k)] = [dec.prepare(target.model, target.params, [p], **common, **kw) for p in prompts]

    print(f"compiling {len(configs)} configurations x {len(prompts)} prompts, each run once untimed ...", flush=True)
    warm_up(prepared.values())

    runs = {key: [] for key in prepared}  # per repeat: (seconds, tokens, outputs)
    order = list(prepared)
    label = {key: "plain" if key[1] == 0 else f"{key[0]} K={key[1]}" for key in order}
    rec.cell("chat b=1", workload="chat", batch=1, prompts=len(prompts), max_new_tokens=args.max_new)
    for key in order:
        rec.config("chat b=1", label[key], kind="plain" if key[1] == 0 else "jspec", draft=key[0], gamma=key[1])
    for r in range(args.repeats):
        for key in record.rotation(order, r):  # rotated: no config always runs first
            outs = [p.run_timed() for p in prepared[key]]
            runs[key].append((sum(o.stats["seconds"] for o in outs), sum(sum(o.lengths) for o in outs), outs))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    plain_outs = runs[("plain", 0)][0][2]
    for r in range(args.repeats):
        rotated = record.rotation(order, r)
        rec.add_pass("chat b=1", r, [pass_entry(label[k], rotated.index(k), runs[k][r][2], plain_outs) for k in order])
    for key in order[1:]:
        rec.ratio("chat b=1", label[key], ["plain"], f"{label[key]} vs plain")

    plain = runs[("plain", 0)]
    plain_ms = 1000 * statistics.median(s / n for s, n, _ in plain)
    rows = measured_rows(configs, runs)
    rec.extra.update(plain_ms_per_token=plain_ms, costs=None, rows=rows, prompts=PROMPTS)
    rec.write()  # the measured runs first: the cost timing below may fail or be stopped
    print(f"measured runs written to {rec.path} (the cost model's fields follow after the cost timing)")

    slots = prepared[("plain", 0)][0].config.slots
    ctx = int(np.mean([len(p) for p in prompts])) + args.max_new // 2
    costs = measure_costs(target, drafts, gammas, slots, ctx)
    # Costs in plain steps timed beside them, then at the decode runs' speed (one plain token = plain_ms).
    speed = plain_ms / costs["target_step_ms"]
    verify_ms = {k: speed * v for k, v in costs["verify_ms"].items()}
    draft_ms = {n: speed * v for n, v in costs["draft_ms"].items()}

    print()
    print(
        f"{target.config.name} f32, batch 1, greedy, {len(prompts)} chat prompts x <= {args.max_new} tokens, "
        f"{args.repeats} interleaved repeats (medians)"
    )
    print(
        f"plain: {1000 / plain_ms:.1f} tok/s ({plain_ms:.2f} ms/token); costs: target step "
        f"{costs['target_step_ms']:.2f} ms, verify "
        + ", ".join(f"K={k}: {v:.2f} ms" for k, v in costs["verify_ms"].items())
        + ", draft step "
        + ", ".join(f"{n}: {v:.2f} ms" for n, v in costs["draft_ms"].items())
        + " (timed apart); at the decode's speed, in plain steps: verify "
        + ", ".join(f"K={k}: {v / plain_ms:.2f}" for k, v in verify_ms.items())
        + ", draft step "
        + ", ".join(f"{n}: {v / plain_ms:.2f}" for n, v in draft_ms.items())
    )
    header = (
        f"{'draft':22s} {'K':>2s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'tok/round':>9s} "
        f"{'predicted':>9s} {'meas/pred':>9s} {'unmodelled':>10s}  accepted/proposed per position | "
        "conditional rates"
    )
    print(header)
    print("(unmodelled: ms per round the cost model leaves out; the measured seconds include each prompt's prefill)")
    for row in rows:
        name, k, sp = row["draft"], row["gamma"], row["speedup"]
        rates = np.asarray(row["conditional_rates"])
        # Rounds of K draft steps and a K+1-position verification, as the costs were timed: a position never
        # proposed counts as never accepted, not as a shorter draft (``predict_k_rounds``).
        pred = predict_k_rounds(plain_ms, draft_ms[name], verify_ms[k], rates, k)
        unmodelled = row["round_ms"] - k * draft_ms[name] - verify_ms[k]
        surv = " ".join(f"{a / p:.2f}" if p else "-" for a, p in zip(row["accepted_at"], row["proposed_at"]))
        cond = " ".join(f"{x:.2f}" for x in rates)
        print(
            f"{name:22s} {k:2d} {row['tokens_per_s']:7.1f} {sp:7.2f}x {row['acceptance_rate']:7.3f} "
            f"{row['tokens_per_round']:9.2f} {pred.speedup:8.2f}x {sp / pred.speedup:9.2f} "
            f"{unmodelled:7.1f} ms  [{surv}] | [{cond}]"
            + ("" if row["identical_to_plain"] else "  OUTPUT DIFFERS FROM PLAIN")
        )
        row.update(
            predicted_speedup=pred.speedup,
            predicted_expected_tokens=pred.expected_tokens,
            measured_over_predicted=sp / pred.speedup,
            unmodelled_ms_per_round=unmodelled,
        )
    rec.extra.update(costs=costs, costs_at_decode_speed=dict(verify_ms=verify_ms, draft_ms=draft_ms), rows=rows)
    rec.finish()
    print(f"wrote {rec.write()}")
    return rows


def pass_entry(name: str, position: int, outs, plain_outs) -> dict:
    """One configuration's run over the prompts in one pass, as a result-file entry (``jspec.bench.record``)."""
    from jspec.bench import record

    rounds = sum(sum(o.stats["rounds"]) for o in outs)
    tokens = sum(sum(o.lengths) for o in outs)
    return record.run_entry(
        name, position, tokens, sum(o.stats["seconds"] for o in outs), rounds,
        metrics.tokens_per_round([n for o in outs for n in o.stats["new_tokens"]], [rounds]),
        same_as_plain=all(o.tokens == p.tokens for o, p in zip(outs, plain_outs)),
    )  # fmt: skip


def measured_rows(configs, runs: dict) -> list[dict]:
    """Per speculative configuration, what the decode runs measured (the cost model's fields come later): the
    median speedup over the repeats (plain time / its time, back to back), tokens/s, acceptance per position and
    conditional rates, tokens per round, ms per round, and whether its greedy output is plain's."""
    plain = runs[("plain", 0)]
    plain_tokens = [o.tokens for o in plain[0][2]]
    rows = []
    for name, _, k in configs[1:]:
        rs = runs[(name, k)]
        speedups = [ps / s for (ps, _, _), (s, _, _) in zip(plain, rs)]
        ms_tok = 1000 * statistics.median(s / n for s, n, _ in rs)
        acc = np.sum([o.stats["accepted_at"] for o in rs[0][2]], axis=0)
        prop = np.sum([o.stats["proposed_at"] for o in rs[0][2]], axis=0)
        accepted = int(acc.sum())
        proposed = int(prop.sum())
        rounds = sum(sum(o.stats["rounds"]) for o in rs[0][2])
        emitted = sum(sum(o.stats["new_tokens"]) - 1 for o in rs[0][2])  # the first token comes from prefill
        rates = cost_model.conditional_rates_from_stats(acc, prop)
        round_ms = 1000 * statistics.median(
            sum(o.stats["seconds"] for o in outs) / max(sum(sum(o.stats["rounds"]) for o in outs), 1)
            for _, _, outs in rs
        )
        rows.append(
            dict(
                draft=name,
                gamma=k,
                tokens_per_s=1000 / ms_tok,
                speedup=statistics.median(speedups),
                speedups=speedups,
                acceptance_rate=accepted / max(proposed, 1),
                accepted_at=acc.tolist(),
                proposed_at=prop.tolist(),
                conditional_rates=np.asarray(rates).tolist(),
                tokens_per_round=emitted / max(rounds, 1),
                round_ms=round_ms,
                identical_to_plain=all(o.tokens == t for o, t in zip(rs[0][2], plain_tokens)),
            )
        )
    return rows


if __name__ == "__main__":
    main()
