"""Plain greedy decode speed of SmolLM2-135M-Instruct (f32, batch 1): our fused loop vs transformers, on one device.

Our side: prefill the prompt, then ``new`` 1-token steps inside ONE jitted ``lax.scan`` (no Python per token), for
each layout of the layer weights (stacked: a scan over layers; unstacked: a Python loop with XLA's matmuls; packed:
the same loop with the CPU matmul kernel, see ``models.llama.unstack_layers`` and ``models.cpu_kernels``), and
``jspec.decode``'s plain loop on the packed layout (unstacked without the kernel). Then the cost of one forward
call of T = 1, 2, 5, 9 tokens after the prompt (what a verification pass of K = T - 1 drafts costs) per layout.
transformers: ``generate(do_sample=False)`` on the same GGUF (dequantised to f32). Prints tokens/s as medians over
``--repeats`` passes measured in this same process (JAX timings on these VMs jump between two levels from process
to process, so compare ratios within one run and repeat the whole script a few times). transformers runs on the
device kind JAX runs on: the CPU, or, where JAX runs on a GPU, the GPU torch sees (with f32 matmuls in full f32 on
both sides); where torch cannot use JAX's device the script refuses before measuring anything (run it with
JAX_PLATFORMS=cpu, or --no-torch), since a ratio across devices would be no comparison of the implementations.

    python examples/bench_forward.py [--ctx 256] [--new 64] [--repeats 5] [--verify-tokens 1,2,5,9] [--no-torch]

Every rate and cost is timed in passes: each pass times every configuration once, in an order rotated from pass to
pass; ratios are medians of the per-pass ratios with their min-max, written to one result file
(``jspec.bench.record``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import record
from jspec.decode import prepare
from models import cpu_kernels, registry
from models.llama import forward, unstack_layers


@functools.partial(jax.jit, static_argnames=("cfg", "new"))
def greedy(cfg, params, prompt, cache, new: int):
    """prompt [1, P] -> [1, new] greedy tokens; the whole decode is one XLA program."""
    p = prompt.shape[1]
    logits, cache = forward(cfg, params, prompt, jnp.arange(p, dtype=jnp.int32)[None], cache)
    cache = cache.commit(jnp.full((1,), p, jnp.int32))
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)  # [1]

    def step(carry, _):
        tok, cache = carry
        logits, cache = forward(cfg, params, tok[:, None], cache.lengths[:, None], cache)
        cache = cache.commit(jnp.ones((1,), jnp.int32))
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (nxt, cache), tok

    (_, _), toks = jax.lax.scan(step, (first, cache), None, length=new)
    return toks.T


def torch_device_for(backend: str, cuda_available: bool) -> str:
    """The torch device on the device kind JAX's ``backend`` is, or SystemExit saying why there is none."""
    from jspec.bench.peers import device_kind

    kind = device_kind(backend)
    if kind == "cpu":
        return "cpu"
    if kind == "gpu" and cuda_available:
        return "cuda"
    raise SystemExit(
        f"JAX runs on {kind} here and torch cannot (torch.cuda.is_available() is {cuda_available}): transformers "
        "would run on the CPU and the ratio would compare devices, not implementations. Run with "
        "JAX_PLATFORMS=cpu to compare both on the CPU, or pass --no-torch."
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ctx", type=int, default=256, help="prompt length (context the decode attends to)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="passes, each timing every configuration (rotated order)")
    ap.add_argument(
        "--verify-tokens", default="1,2,5,9", help="token counts T of the one-call cost table ('' to skip it)"
    )
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=None, help="the result file (default results/forward-<UTC time>.json)")
    args = ap.parse_args(argv)
    for flag in ("ctx", "new", "repeats"):  # rates per token over --new tokens, medians over --repeats
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: expected 1 or more")
    torch_device = None
    if not args.no_torch:  # checked before any measurement: both sides on one device kind, or nothing
        import torch

        torch_device = torch_device_for(jax.default_backend(), torch.cuda.is_available())
        if torch_device != "cpu" and jax.config.jax_default_matmul_precision is None:
            # f32 on both sides: JAX's GPU default runs f32 matmuls in TF32, torch's does not.
            jax.config.update("jax_default_matmul_precision", "highest")
    try:
        rec = record.start("forward", "python examples/bench_forward.py", argv, dict(vars(args)), args.out)
    except OSError as e:
        ap.error(str(e))

    m = registry.load(args.model, dtype="float32")
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(100, m.config.vocab_size, size=args.ctx).tolist()
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    slots = args.ctx + args.new + 8
    cache = m.model.init_cache(1, slots)
    layouts = {"stacked": m.params, "unstacked": unstack_layers(m.params, packed=False)}
    if cpu_kernels.available():
        layouts["packed"] = unstack_layers(m.params, packed=True)
    lib_layout = "packed" if "packed" in layouts else "unstacked"  # the layout jspec decodes with on the CPU

    # Each configuration: run(new) -> seconds for a prefill and ``new`` tokens; its decode rate is ``--new``
    # tokens over run(new + 1) - run(1): prefill and dispatch cancel out.
    configs, tokens = {}, {}
    for name, params in layouts.items():

        def run(new, params=params):
            t0 = time.perf_counter()
            greedy(m.config, params, prompt, cache, new).block_until_ready()
            return time.perf_counter() - t0

        configs[f"fused scan, {name}"] = run
        tokens[name] = np.asarray(greedy(m.config, params, prompt, cache, args.new))[0].tolist()

    # The library's own plain loop (jspec.decode with no drafter: the speculative loop with K = 0, per-row
    # stops and statistics), timed the same way.
    lib = {new: prepare(m.model, layouts[lib_layout], [prompt_ids], max_new_tokens=new, max_len=slots)
           for new in (1, args.new + 1)}  # fmt: skip
    lib_compiled = {new: p.compile() for new, p in lib.items()}

    def run_lib(new):
        t0 = time.perf_counter()
        run_lib.out = lib[new].run(lib_compiled[new])
        return time.perf_counter() - t0

    configs[f"jspec.decode plain, {lib_layout}"] = run_lib
    if torch_device is not None:
        import torch

        from models.hf_reference import transformers_from_gguf

        tm = transformers_from_gguf(registry.resolve(args.model)).to(torch_device)
        ids = torch.tensor([prompt_ids], device=torch_device)
        gen = functools.partial(tm.generate, ids, do_sample=False, pad_token_id=0, eos_token_id=None)

        def run_torch(new):
            with torch.no_grad():
                if torch_device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run_torch.out = gen(max_new_tokens=new)
                if torch_device != "cpu":
                    torch.cuda.synchronize()
                return time.perf_counter() - t0

        configs["transformers"] = run_torch

    names = list(configs)
    for name in names:  # compiles and first runs, untimed
        configs[name](1), configs[name](args.new + 1)
    cell = f"decode ctx={args.ctx}"
    rec.cell(cell, batch=1, ctx=args.ctx, new=args.new, torch_device=torch_device)
    for name in names:
        rec.config(cell, name, kind="peer" if name == "transformers" else "jspec")
    for i in range(args.repeats):
        entries = []
        for pos, name in enumerate(record.rotation(names, i)):
            t1, tn = configs[name](1), configs[name](args.new + 1)
            if tn <= t1:
                raise SystemExit(f"{name}: {args.new + 1} tokens timed no longer than 1 ({tn:.4f} s): raise --new")
            entries.append(record.run_entry(name, pos, args.new, tn - t1))
        rec.add_pass(cell, i, entries)
    for name in names:
        if name != "fused scan, stacked" and name.startswith("fused scan"):
            rec.ratio(cell, name, ["fused scan, stacked"], f"{name} vs stacked")
    rec.ratio(cell, names[len(layouts)], [f"fused scan, {lib_layout}"], "jspec.decode plain vs its bare fused scan")
    if torch_device is not None:
        for name in names[:-1]:
            rec.ratio(cell, name, ["transformers"], f"{name} vs transformers")
    summary = record.summarize(rec.data)[cell]
    for name, c in summary["configs"].items():
        print(f"{name:32s} {c['tokens_per_s']['median']:7.1f} tok/s (median of {args.repeats} passes, ctx={args.ctx})")
    for name, r in summary["ratios"].items():
        print(f"{name}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})")
    lib_tokens = run_lib.out.tokens[0][: args.new]
    same = {name: tokens[name] == tokens["stacked"] for name in layouts}
    same["jspec.decode"] = lib_tokens == tokens[lib_layout]
    if torch_device is not None:
        same["transformers"] = run_torch.out[0, args.ctx : args.ctx + args.new].cpu().tolist() == tokens["stacked"]
    print(f"same greedy tokens as the stacked scan: {same}")
    rec.extra["same_greedy_tokens"] = same
    rec.write()
    fastest = min(summary["configs"]["fused scan, " + n]["tokens_per_s"]["median"] ** -1 for n in layouts) * 1e3

    # Memory floor under the same conditions: one pass reading every weight (a decode step must do at least
    # this). On a loaded or noisy VM the ratio to it is more telling than the absolute time. Two readers, the
    # faster one counts: XLA summing every array, and (where available) the CPU kernel multiplying one row by
    # every packed matrix, which streams the panels at a higher rate than XLA's reduction does.
    readers = {"xla sum": (jax.jit(lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p))), m.params)}
    if "packed" in layouts:
        mats = [
            w for w in jax.tree.leaves(layouts["packed"], is_leaf=lambda w: isinstance(w, cpu_kernels.PackedMatrix))
        ]
        mats = [w for w in mats if isinstance(w, cpu_kernels.PackedMatrix)]
        readers["kernel 1-row product"] = (
            jax.jit(lambda ws: sum(cpu_kernels.matmul(jnp.ones((1, w.k)), w)[0, 0] for w in ws)),
            mats,
        )
    floors = {}
    for name, (read_all, arg) in readers.items():
        read_all(arg).block_until_ready()
        runs = []
        for _ in range(args.repeats * 3):
            t0 = time.perf_counter()
            read_all(arg).block_until_ready()
            runs.append(time.perf_counter() - t0)
        floors[name] = statistics.median(runs) * 1e3
    gb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(m.params)) / 1e9
    fname = min(floors, key=floors.get)
    fms = floors[fname]
    print(
        "memory floor (read all weights once): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in floors.items())
        + f"; {gb:.3f} GB at {gb / fms * 1e3:.1f} GB/s ({fname}); fastest decode step / floor = {fastest / fms:.2f}"
    )
    rec.extra["memory_floor_ms"] = floors

    # One forward call of T tokens after the prompt, per layout: what a verification pass costs. Every T of a
    # layout in each pass, rotated; a ratio "T=t / T=1" is the median of the per-pass cost ratios.
    ts = [int(t) for t in args.verify_tokens.split(",") if t]
    if ts:
        apply = jax.jit(lambda p, t, pos, c: forward(m.config, p, t, pos, c)[0])
        filled = cache.with_lengths(jnp.full((1,), args.ctx, jnp.int32))
        for name, params in layouts.items():
            calls = {}
            for t in ts:
                toks = jnp.asarray([prompt_ids[:t]], jnp.int32)
                pos = args.ctx + jnp.arange(t, dtype=jnp.int32)[None]
                calls[f"T={t}"] = functools.partial(apply, params, toks, pos, filled)
                calls[f"T={t}"]().block_until_ready()
            cell = f"one call, {name}"
            rec.cell(cell, layout=name, ctx=args.ctx)
            for c in calls:
                rec.config(cell, c, kind="jspec")
            for i in range(args.repeats):  # a call's tokens/s counts calls: 1 "token" per call
                entries = []
                for pos_, c in enumerate(record.rotation(list(calls), i)):
                    t0 = time.perf_counter()
                    calls[c]().block_until_ready()
                    entries.append(record.run_entry(c, pos_, 1, time.perf_counter() - t0))
                rec.add_pass(cell, i, entries)
            base = list(calls)[0]
            for c in list(calls)[1:]:
                rec.ratio(cell, base, [c], f"{c} / {base} (time per call)")
            s = record.summarize(rec.data)[cell]
            print(
                f"one call, {name:9s} layers: "
                + ", ".join(f"{c} {1e3 / s['configs'][c]['tokens_per_s']['median']:.1f} ms" for c in calls)
                + "; "
                + ", ".join(f"{r} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for r, v in s["ratios"].items())
            )
    rec.finish()
    print(f"wrote {rec.write()}")


if __name__ == "__main__":
    main()
