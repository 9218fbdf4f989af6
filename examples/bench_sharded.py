"""Sharded decode throughput next to one device, and the collectives of one round from the compiled HLO.

    python examples/bench_sharded.py                          # 8 fake CPU devices, mesh 2x4, draft model
    python examples/bench_sharded.py --mesh 8x1 --drafter ngram
    python examples/bench_sharded.py --devices 0 --mesh data=1,model=-1 --size medium    # real GPUs / TPUs
    python -m sharding.launch -n 2 --cpu-devices 4 -- python examples/bench_sharded.py --distributed

Models are random Llama-shaped weights (``--size``); the draft model is the target's first layer with the
shared embedding and head (an early exit), so some proposals are accepted. Timings exclude compilation;
the 1-device and sharded runs alternate (each of ``--repeats`` passes runs both, in an order rotated from pass to
pass) and medians with their min-max are reported (timings on shared VMs are noisy), also in one result file
(``jspec.bench.record``; process 0 writes it).

Collectives per round: from the partitioned HLO of the whole decode, one iteration of the decode loop (the
worst-case branch of each conditional: drafting + the (K+1)-token verification, layer scans multiplied
out). "model" is what the model calls of a round cost by themselves: the pinned target / draft forward is
compiled alone with the same shardings and its collectives counted, times the calls per round. The rest are
classified by element type: pred = the loop's "any row still running / proposing" predicates, s32 = index
gathers of per-row values, f32 = other per-row float gathers. Collectives that move KV-cache data are
listed separately and must be none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import jax
import numpy as np

SIZES = {
    "tiny": dict(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, ffn=128),
    "small": dict(vocab_size=2048, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, ffn=1024),
    "medium": dict(vocab_size=32000, hidden=1024, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64, ffn=4096),
}


def build(size: str, dtype: str, seed: int = 0):
    from models.llama import LlamaConfig, init_random_params

    cfg = LlamaConfig(**SIZES[size], dtype=dtype, name=f"{size}-target")
    dcfg = cfg.replace(num_layers=1, name=f"{size}-draft")
    tp = init_random_params(cfg, jax.random.key(seed), std=0.1)
    dp = {"embed": tp["embed"], "final_norm": tp["final_norm"], "layers": jax.tree.map(lambda w: w[:1], tp["layers"])}
    return cfg, tp, dcfg, dp


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Ragged prompts (length/2 .. length); odd rows repeat a motif so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(batch):
        n = int(rng.integers(max(1, length // 2), length + 1))
        if i % 2:
            out.append(np.resize(rng.integers(0, vocab, size=4), n).tolist())
        else:
            out.append(rng.integers(0, vocab, size=n).tolist())
    return out


def forward_collectives(model, params, plan, rules, batch: int, t: int, slots: int) -> int:
    """Collectives of one pinned model call over T tokens with the decode's shardings (per execution)."""
    import jax.numpy as jnp

    from sharding import hlo
    from sharding.placement import cache_shardings
    from sharding.sharded_decode import pinned_model

    pm = pinned_model(model, plan, rules)
    cache = jax.eval_shape(lambda: model.init_cache(batch, slots))
    tok = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    fn = jax.jit(
        lambda p, x, pos, c: pm.apply(p, x, pos, c),
        in_shardings=(
            jax.tree.map(lambda x: x.sharding, params),
            plan.rows((batch, t), batch),
            plan.rows((batch, t), batch),
            cache_shardings(cache, plan.mesh, rules, batch),
        ),
    )
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    a = hlo.analyze(fn.lower(shapes, tok, tok, cache).compile().as_text())
    return sum(n for *_, n in a.outside_loop)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices; 0 = the platform's real devices")
    ap.add_argument("--mesh", default="2x4", help="data x model, e.g. 2x4 or data=2,model=-1")
    ap.add_argument("--preset", default="data_tensor", help="target preset (replicated/data/tensor/data_tensor)")
    ap.add_argument("--draft-preset", default=None, help="draft preset (default: the target's)")
    ap.add_argument("--drafter", choices=["plain", "model", "ngram"], default="model")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--layers",
        choices=["auto", "stacked", "unstacked"],
        default="auto",
        help="weight layout: stacked [L, ...] or per layer (unstack_layers(fused=False)); auto: per layer on "
        "CPU and GPU, stacked elsewhere (jspec.loaders.wants_unstacked)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=None, help="K (default 4); not with --drafter plain")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=5, help="passes, each running both sides (rotated order)")
    ap.add_argument("--out", default=None, help="the result file (default results/sharded-<UTC time>.json)")
    ap.add_argument("--distributed", action="store_true", help="multi-process run (sharding.launch or a pod)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected 1 or more (the rates are medians over the repeats)")
    if args.drafter == "plain" and args.gamma is not None:
        ap.error(f"--gamma {args.gamma} does not apply to --drafter plain (no draft: nothing to propose)")
    if args.gamma is not None and args.gamma < 1:
        ap.error(f"--gamma {args.gamma}: must be >= 1 (--drafter plain for no speculation)")
    from jspec.bench import record

    started = record.utc_now()
    try:  # the record itself is made after the devices are set up (it reads JAX's backend)
        out_path = record.check_out_path(args.out or record.default_path("sharded"))
    except OSError as e:
        ap.error(str(e))

    if args.distributed:
        from sharding.distributed import initialize

        initialize(auto=True)
    elif args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before any backend use

    from jspec.decode import prepare
    from jspec.drafters import ModelDrafter
    from jspec.loaders import wants_unstacked
    from jspec.ngram import NgramDrafter
    from models.llama import logical_axes, make_model, unstack_layers
    from sharding import hlo
    from sharding.distributed import rows_for_process
    from sharding.mesh import make_mesh, parse_shape
    from sharding.placement import shard_params
    from sharding.sharded_decode import gather_output, make_plan, prepare_sharded

    cfg, tp, dcfg, dp = build(args.size, args.dtype)
    if wants_unstacked(args.layers):
        tp, dp = unstack_layers(tp, fused=False), unstack_layers(dp, fused=False)
    t_axes, d_axes = logical_axes(cfg, tp), logical_axes(dcfg, dp)
    model = make_model(cfg)
    drafter = {"plain": None, "model": ModelDrafter(make_model(dcfg)), "ngram": NgramDrafter(vocab_size=cfg.vocab_size)}
    drafter = drafter[args.drafter]
    gamma = 0 if drafter is None else args.gamma or 4
    mesh = make_mesh(parse_shape(args.mesh))
    plan = make_plan(
        mesh,
        args.preset,
        args.draft_preset,
        target_axes=t_axes,
        target_shapes=tp,
        draft_axes=d_axes,
        draft_shapes=dp,
    )
    stp = shard_params(tp, t_axes, mesh, plan.target)
    sdp = shard_params(dp, d_axes, mesh, plan.draft_rules) if args.drafter == "model" else None
    prompts = make_prompts(args.batch, args.prompt_len, cfg.vocab_size)
    slots = -(-(args.prompt_len + args.new_tokens + gamma + 1) // 16) * 16
    kw = dict(gamma=gamma, max_new_tokens=args.new_tokens, max_len=slots, temperature=args.temperature, seed=1)
    rows = rows_for_process(plan, args.batch).tolist()
    sd = prepare_sharded(
        model,
        stp,
        [prompts[i] for i in rows] if args.distributed else prompts,
        plan=plan,
        drafter=drafter,
        draft_params=sdp,
        process_local=args.distributed,
        **kw,
    )
    t0 = time.perf_counter()
    compiled = sd.compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()

    single = None
    if not args.distributed:
        pd = prepare(model, tp, prompts, drafter=drafter, draft_params=dp if args.drafter == "model" else None, **kw)
        single = pd.compile()

    def timed_sharded():
        a = jax.block_until_ready(sd.args())
        t = time.perf_counter()
        st = jax.block_until_ready(compiled(*a))
        return time.perf_counter() - t, gather_output(st)

    def timed_single():
        t = time.perf_counter()
        st = jax.block_until_ready(single(*pd.args))
        return time.perf_counter() - t, jax.device_get(st.seq)

    timed_sharded()  # first executions, untimed
    if single is not None:
        timed_single()
    names = ["sharded"] + (["one device"] if single is not None else [])
    times: dict = {n: [] for n in names}
    orders, out = [], None
    for i in range(args.repeats):  # alternating: both sides see the same machine noise
        orders.append(record.rotation(names, i))
        for name in orders[-1]:
            if name == "sharded":
                dt, out = timed_sharded()
            else:
                dt, _ = timed_single()
            times[name].append(dt)
    sh_times, one_times = times["sharded"], times.get("one device", [])
    new_tokens = sum(out.stats["new_tokens"])
    res = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": dict(mesh.shape),
        "preset": args.preset,
        "draft_preset": args.draft_preset or args.preset,
        "drafter": args.drafter,
        "size": args.size,
        "batch": args.batch,
        "gamma": gamma,
        "new_tokens": new_tokens,
        "tokens_per_round": out.stats["tokens_per_round"],
        "compile_s": compile_s,
        "sharded_tok_s": new_tokens / statistics.median(sh_times),
    }
    if single is not None:
        ref = prepare(model, tp, prompts, drafter=drafter, draft_params=dp if args.drafter == "model" else None, **kw)
        res["one_device_tok_s"] = new_tokens / statistics.median(one_times)
        res["tokens_identical"] = out.tokens == ref.run(single).tokens

    a = hlo.analyze(text)
    b, k = args.batch, gamma
    target_calls = {k + 1: 1} if gamma else {1: 1}
    draft_calls = {2: 1, 1: k - 1} if args.drafter == "model" else {}
    own = sum(n * forward_collectives(model, stp, plan, plan.target, b, t, slots) for t, n in target_calls.items())
    own += sum(
        n * forward_collectives(make_model(dcfg), sdp, plan, plan.draft_rules, b, t, slots)
        for t, n in draft_calls.items()
        if n
    )
    total = sum(n for *_, n in a.per_round)
    rest = Counter()
    for _op, shape, n in a.per_round:
        rest[shape.lstrip("(").split("[")[0]] += n
    # The model's own collectives are all f32 here; what is left over beyond them is the loop's bookkeeping.
    rest["f32"] -= own
    res["collectives_per_round"] = {
        "total": total,
        "by_op": a.summary()["per_round"],
        "model_calls": own,
        "beyond_model_by_dtype": {k_: v for k_, v in rest.items() if v},
        "outside_loop": sum(n for *_, n in a.outside_loop),
        "cache_collectives": [f"{c.op} {c.shape}" for c in hlo.cache_collectives(text, slots, cfg.head_dim)],
    }
    if jax.process_index() == 0:
        rec = record.Record("sharded", record.command_line("python examples/bench_sharded.py", argv),
                            dict(vars(args)), out_path)  # fmt: skip
        rec.data["started"] = started
        rec.cell("decode", batch=args.batch, devices=jax.device_count(), mesh=dict(mesh.shape), drafter=args.drafter)
        for name in names:
            rec.config("decode", name, kind="jspec")
        for i, order in enumerate(orders):  # every run decodes the same tokens (greedy; a seeded sample otherwise)
            rec.add_pass("decode", i, [record.run_entry(n, order.index(n), new_tokens, times[n][i]) for n in names])
        if single is not None:
            rec.ratio("decode", "sharded", ["one device"], "sharded vs one device")
            r = record.summarize(rec.data)["decode"]["ratios"]["sharded vs one device"]
            res["ratio_sharded_vs_one"] = r["median"]
            res["ratio_sharded_vs_one_min_max"] = [r["min"], r["max"]]
        rec.extra.update(res)
        rec.finish()
        path = rec.write()
        if args.json:
            print(json.dumps(res))
        else:
            for key, v in res.items():
                print(f"{key:>24}: {v:.1f}" if isinstance(v, float) else f"{key:>24}: {v}")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
