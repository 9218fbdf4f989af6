"""Self-speculation (LayerSkip) against plain decoding on SmolLM2-135M, f32, batch 1, greedy, open chat prompts.

    python examples/bench_selfspec.py                      # E=4 with K=1 and K=2, adapter if it is cached
    python examples/bench_selfspec.py --settings 4:2,8:2 --adapter both --train --repeats 5

Everything is measured in ONE process, interleaved (JAX CPU timings jump between two levels from process to
process, so only ratios within a run are meaningful): each repeat (a pass) decodes every prompt once per setting,
the settings in an order rotated from repeat to repeat, with ``PreparedDecode.run_timed`` (compilation excluded,
and done once per call). Printed per setting: tokens/s (total tokens / total time of a repeat, median over
repeats), speedup over plain (median of the per-repeat ratios, with their min-max), acceptance per draft position,
and the cost model (``jspec.cost_model.predict``) fed with the measured conditional acceptance and separately
measured costs: one draft step (a jitted K-step ``propose`` / K) and one verification (a jitted ``verify`` of K+1
tokens, reuse included), state cost 0, for rounds of K draft steps (a position never proposed counts as never
accepted). The pieces take the KV cache donated, as the fused round updates it in place (fresh copies made outside
the timing). The costs are timed after the decode runs, and these VMs' speed drifts by 10-40% within minutes, so
they enter the model as multiples of a plain 1-token step timed interleaved with them, at the plain decode's ms per
token (the raw ms are printed too). The gap between the prediction and the measurement is then the per-round
overhead the model leaves out (acceptance, commit, loop control, and the prompt's prefill, which the measured
seconds include, spread over the rounds), also printed per round.

The exit adapter comes from ``examples/train_early_exit.py``'s cache (``--train`` trains it when missing). Every
run has the cache slots of the longest prompt + --max-new-tokens (``cache_slots``), checked against the model's
context, and --settings against its layers, before any adapter is trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import phase_costs
from jspec.bench.checks import predict_k_rounds
from jspec.bench.phase_costs import fresh
from jspec.cost_model import conditional_rates_from_stats, survival_from_stats
from jspec.decode import prepare
from jspec.drafters import DraftContext
from jspec.loaders import wants_unstacked
from jspec.validate import default_slots, sampling_params
from models.layerskip import LayerSkipDrafter, default_cache_dir, exit_cache_path, restore_exit_params
from models.registry import load

CHATS = [
    "Can you tell me a bit about the history of tea?",
    "Write a short story about a dragon who is afraid of the dark.",
    "What are some easy ways to reduce stress during a busy week?",
    "Explain how the internet works to someone who has never used a computer.",
    "I want to start running. How should I begin?",
    "What makes a good friend?",
]


def exit_params_for(args, cfg, exit_layer: int, train: bool):
    """(adapter exit params or None, token ids [N]) for this E, training the adapter first if asked."""
    path = exit_cache_path(args.model, exit_layer, args.width, args.head_tokens)
    if not os.path.exists(os.path.join(path, "meta.json")) and train:
        from train_early_exit import main as train_main

        train_main(
            ["--model", args.model, "--exit-layer", str(exit_layer), "--width", str(args.width)]
            + ["--head-tokens", str(args.head_tokens), "--no-eval"]
        )
    if os.path.exists(os.path.join(path, "meta.json")):
        ex = restore_exit_params(path, cfg)
        return ex, ex.get("token_ids")
    # No trained head rows: BPE ids follow merge order, which roughly follows frequency.
    return None, (jnp.arange(args.head_tokens, dtype=jnp.int32) if args.head_tokens else None)


def time_ms(fn, args, n: int = 10) -> float:
    """Median ms of ``fn(*args())``, the arguments made before each call's clock starts."""
    return phase_costs.median_ms(fn, repeats=n, args=args)


def component_parts(cfg, params, model, drafter, dparams, k: int, prompt: list[int], slots: int) -> dict:
    """name -> (jitted piece, maker of its arguments) after a prefill of ``prompt`` (a realistic cache length):
    one plain 1-token step, one K-step draft rollout and one K+1-token reusing verification. Each takes the
    target's KV cache (and the drafter's state) donated, as the fused round updates them in place: returned
    undonated, every call would copy the whole cache into its output, which the decode loop never does. The
    maker hands each call fresh copies, to be made outside the timed region."""
    p = len(prompt)
    cache = model.init_cache(1, slots)
    toks = jnp.asarray([prompt], jnp.int32)
    _, cache = jax.jit(model.apply)(params, toks, jnp.arange(p)[None], cache)
    cache = cache.with_lengths(jnp.asarray([p - 1], jnp.int32))  # the last prompt token is pending
    seq = jnp.zeros((1, slots + 1), jnp.int32).at[:, :p].set(toks)
    ctx = DraftContext(seq, jnp.asarray([p]), jnp.asarray([k]), sampling_params(1))
    state = drafter.init(dparams, toks, jnp.asarray([p]), slots)
    key = jax.random.key(0)

    def draft(dp, state, target_cache, ctx, key):  # the cache a separate argument: donated alone
        return drafter.propose(dp, state, dataclasses.replace(ctx, target_cache=target_cache), key, k)

    propose = jax.jit(draft, donate_argnums=(1, 2))
    prop = propose(dparams, fresh(state), fresh(cache), ctx, key)
    tokens = jnp.concatenate([toks[:, -1:], prop.tokens], axis=1)
    positions = (p - 1) + jnp.arange(k + 1)[None]
    verify = jax.jit(drafter.verify, static_argnums=0, donate_argnums=6)
    step = jax.jit(lambda prm, c: model.apply(prm, toks[:, -1:], jnp.asarray([[p - 1]]), c), donate_argnums=1)
    return {
        "plain_step": (step, lambda: (params, fresh(cache))),
        "draft": (propose, lambda: (dparams, fresh(state), fresh(cache), ctx, key)),
        "verify": (verify, lambda: (model, params, dparams, prop.state, tokens, positions, fresh(prop.target_cache))),
    }


def component_costs(cfg, params, model, drafter, dparams, k: int, prompt: list[int], slots: int) -> dict:
    """Median ms of each of ``component_parts``' pieces, three interleaved medians of 10 calls each."""
    parts = component_parts(cfg, params, model, drafter, dparams, k, prompt, slots)
    out = {name: [] for name in parts}
    for _ in range(3):  # interleaved, medians
        for name, (fn, args) in parts.items():
            out[name].append(time_ms(fn, args))
    return {name: statistics.median(v) for name, v in out.items()}


def add_run(total: dict, stats: dict) -> None:
    """Add one decode's statistics to a repeat's totals: tokens (all new tokens, for tokens/s), seconds,
    loop_rounds (for ms per round), and emitted / rounds: the tokens the rounds emitted (each row's new tokens
    but the first, which the prefill samples) and the rounds, ``jspec.decode``'s tokens_per_round."""
    total["tokens"] = total.get("tokens", 0) + sum(stats["new_tokens"])
    total["seconds"] = total.get("seconds", 0.0) + stats["seconds"]
    total["loop_rounds"] = total.get("loop_rounds", 0) + stats["loop_rounds"]
    total["emitted"] = total.get("emitted", 0) + sum(max(n - 1, 0) for n in stats["new_tokens"])
    total["rounds"] = total.get("rounds", 0) + sum(stats["rounds"])


def tokens_per_round(total: dict) -> float:
    return total["emitted"] / total["rounds"] if total.get("rounds") else 0.0


def parse_settings(text: str) -> list[tuple[int, int]]:
    """--settings: comma-separated E:K pairs (exit layer E >= 1, K >= 1 draft tokens), each once, checked whole
    before the model loads (ValueError naming the flag); E's upper bound needs the model (``main``)."""
    from jspec.bench.args import list_flag

    def pair(item: str) -> tuple[int, int]:
        e, sep, k = item.partition(":")
        e, k = int(e), int(k)  # ValueError: not a number
        if not sep or e < 1 or k < 1:
            raise ValueError(item)
        return e, k

    return list_flag("--settings", text, pair, "E:K pairs of integers >= 1")


def cache_slots(prompts, max_new_tokens: int, max_positions: int | None) -> int:
    """Cache slots per row for every run (and the cost pieces): the longest prompt + ``max_new_tokens`` - 1 (the
    last token takes no slot), rounded up to a multiple of 128 as ``jspec.decode.prepare`` sizes its own, within
    the model's context. ValueError naming --max-new-tokens where even that does not fit the context."""
    need = max(len(p) for p in prompts) + max_new_tokens - 1
    if max_positions is not None and need > max_positions:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the longest prompt ({need - max_new_tokens + 1} tokens) + "
            f"{max_new_tokens} new tokens run past the model's context ({max_positions} positions)"
        )
    return default_slots(need, max_positions)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--settings", default="4:1,4:2", help="comma-separated E:K pairs")
    ap.add_argument("--adapter", choices=("auto", "on", "off", "both"), default="auto")
    ap.add_argument("--train", action="store_true", help="train a missing adapter first")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--head-tokens", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes (after one untimed warm-up repeat)")
    ap.add_argument("--out", default=None, help="the result file (default results/selfspec-<UTC time>.json)")
    ap.add_argument("--prompts", type=int, default=len(CHATS))
    ap.add_argument(
        "--layers",
        default="auto",
        choices=("auto", "stacked", "unstacked"),
        help="target layer layout, see models.llama.unstack_layers (auto: unstacked on CPU and GPU)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(CHATS):
        ap.error(f"--prompts must be in [1, {len(CHATS)}] (the built-in prompts), got {args.prompts}")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected 1 or more (repeat 0 only warms up; the rates are medians)")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    from jspec.bench import record

    try:
        settings = parse_settings(args.settings)
        rec = record.start("selfspec", "python examples/bench_selfspec.py", argv, dict(vars(args)), args.out)
    except (ValueError, OSError) as e:
        ap.error(str(e))

    cfg, params, model, tok = load(args.model, dtype="float32", unstacked=wants_unstacked(args.layers))
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS[: args.prompts]]
    # Checked before any --train step below: the bounds that need the model.
    beyond = [e for e, _ in settings if e >= cfg.num_layers]
    if beyond:
        ap.error(
            f"--settings {args.settings}: exit layer E={beyond[0]} must be below the model's {cfg.num_layers} layers"
        )
    try:
        max_len = cache_slots(prompts, args.max_new_tokens, cfg.max_positions)
    except ValueError as e:
        ap.error(str(e))
    kw = dict(max_new_tokens=args.max_new_tokens, eos_ids=cfg.eos_ids, max_len=max_len)

    runs = {"plain": (None, None, 0)}  # name -> (drafter, draft params, K)
    for e, k in settings:
        ex, ids = exit_params_for(args, cfg, e, args.train and args.adapter != "off")
        choices = {"auto": [ex is not None], "on": [True], "off": [False], "both": [False, True]}[args.adapter]
        for use in choices:
            if use and ex is None:
                raise SystemExit(f"no trained adapter for E={e} in {default_cache_dir()}: run with --train")
            d = LayerSkipDrafter(cfg, e, adapter=use, head_tokens=args.head_tokens, max_draft=k)
            head = {"token_ids": ids} if args.head_tokens else {}
            dp = d.draft_params(params, dict(head, adapter=ex["adapter"]) if use else head)
            runs[f"E={e} K={k} {'adapter' if use else 'no adapter'}"] = (d, dp, k)

    prepared = {
        (name, i): prepare(model, params, [p], drafter=d, draft_params=dp, gamma=max(k, 1) if d else 0, **kw)
        for name, (d, dp, k) in runs.items()
        for i, p in enumerate(prompts)
    }
    for p in prepared.values():
        # run_timed compiles before timing (excluded from the time); compile each call once, not every repeat.
        p.compile = functools.cache(p.compile)
    per_repeat = {name: [] for name in runs}  # per repeat: totals over the prompts (``add_run``)
    stats = {name: None for name in runs}
    reference = {}
    for r in range(args.repeats + 1):  # repeat 0 compiles, warms up and checks the outputs
        print(f"repeat {r}/{args.repeats}{' (warm-up)' if r == 0 else ''}", flush=True)
        for i in range(len(prompts)):
            for name in record.rotation(list(runs), r):  # rotated from repeat to repeat
                out = prepared[(name, i)].run_timed()
                if r == 0:  # greedy: every setting must reproduce plain decoding token for token
                    reference.setdefault(i, out.tokens)
                    assert out.tokens == reference[i], f"{name}: output differs from plain decoding"
                    continue
                s = out.stats
                tok_s = per_repeat[name]
                if len(tok_s) < r:
                    tok_s.append({})
                add_run(tok_s[r - 1], s)
                if r == 1:
                    acc = stats[name]
                    stats[name] = (
                        (np.asarray(s["accepted_at"]), np.asarray(s["proposed_at"]))
                        if acc is None
                        else (acc[0] + s["accepted_at"], acc[1] + s["proposed_at"])
                    )

    write_record(rec, runs, per_repeat, len(prompts), args.max_new_tokens)
    plain_tps = [x["tokens"] / x["seconds"] for x in per_repeat["plain"]]
    base_ms = 1e3 / statistics.median(plain_tps)
    print(
        f"\n{cfg.name}: f32, batch 1, greedy, {len(prompts)} chat prompts, <= {args.max_new_tokens} new tokens, "
        f"{max_len} cache slots"
    )
    print(f"plain: {statistics.median(plain_tps):.1f} tok/s ({base_ms:.1f} ms/token), repeats {plain_tps}")
    for name, (d, dp, k) in runs.items():
        if d is None:
            continue
        tps = [x["tokens"] / x["seconds"] for x in per_repeat[name]]
        ratios = [a / b for a, b in zip(tps, plain_tps)]
        measured = statistics.median(ratios)
        acc, prop = stats[name]
        surv = survival_from_stats(acc, prop)
        rates = conditional_rates_from_stats(acc, prop)
        costs = component_costs(cfg, params, model, d, dp, k, prompts[0], max_len)
        # In plain steps timed beside them, then at the decode runs' speed (one plain token = base_ms).
        speed = base_ms / costs["plain_step"]
        draft_ms, verify_ms = speed * costs["draft"] / k, speed * costs["verify"]
        # Rounds of K draft steps, as the pieces were timed (a position never proposed: rate 0, not a shorter K).
        pred = predict_k_rounds(base_ms, draft_ms, verify_ms, rates, k)
        sec, rounds = (statistics.median(x[f] for x in per_repeat[name]) for f in ("seconds", "loop_rounds"))
        round_ms = 1e3 * sec / rounds
        per_round = statistics.median(tokens_per_round(x) for x in per_repeat[name])
        overhead = round_ms - k * draft_ms - verify_ms
        print(
            f"\n{name}: {statistics.median(tps):.1f} tok/s, speedup {measured:.3f}x ({min(ratios):.3f}-"
            f"{max(ratios):.3f}; per repeat {ratios})"
        )
        print(f"  acceptance per position P(first i accepted) {np.round(surv, 3).tolist()}, ")
        print(f"  conditional rates {np.round(rates, 3).tolist()}, tokens/round {per_round:.2f}")
        print(
            f"  costs timed apart: plain step {costs['plain_step']:.1f} ms, draft step {costs['draft'] / k:.1f} ms "
            f"({draft_ms / base_ms:.2f} of a plain step), verify {costs['verify']:.1f} ms "
            f"({verify_ms / base_ms:.2f}); at the decode's speed ({base_ms:.1f} ms per plain token): draft step "
            f"{draft_ms:.1f} ms, verify {verify_ms:.1f} ms; measured round {round_ms:.1f} ms, draft share "
            f"{k * draft_ms / round_ms:.0%}, unmodelled {overhead:.1f} ms/round (prefill included)"
        )
        print(f"  cost model: {pred.summary()}; predicted/measured {pred.ratio_to(measured):.2f}")
        rec.extra.setdefault("cost_model", {})[name] = {"predicted_speedup": pred.speedup, "measured": measured}
    rec.finish()
    print(f"\nwrote {rec.write()}")


def write_record(rec, runs: dict, per_repeat: dict, n_prompts: int, max_new_tokens: int) -> None:
    """Each timed repeat as a pass of the result file (``jspec.bench.record``): per setting its totals over the
    prompts, at its position in that repeat's rotated order (repeat r: the settings rotated by r)."""
    from jspec.bench import record

    cell = "chat b=1"
    rec.cell(cell, workload="chat", batch=1, prompts=n_prompts, max_new_tokens=max_new_tokens)
    names = list(runs)
    for name, (d, _, k) in runs.items():
        rec.config(cell, name, kind="plain" if d is None else "jspec", gamma=k)
    for r in range(len(per_repeat["plain"])):
        order = record.rotation(names, r + 1)  # timed repeats are 1.. (repeat 0 warms up)
        rec.add_pass(cell, r, [record.run_entry(n, order.index(n), per_repeat[n][r]["tokens"],
                                                per_repeat[n][r]["seconds"], per_repeat[n][r]["rounds"],
                                                tokens_per_round(per_repeat[n][r])) for n in names])  # fmt: skip
    for name in names[1:]:
        rec.ratio(cell, name, ["plain"], f"{name} vs plain")
    rec.write()


if __name__ == "__main__":
    main()
