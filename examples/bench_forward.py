"""Plain greedy decode speed of SmolLM2-135M-Instruct (f32, batch 1): our fused loop vs transformers, on one device.

Our side: prefill the prompt, then ``new`` 1-token steps inside ONE jitted ``lax.scan`` (no Python per token),
for each layout of the layer weights (stacked: a scan over layers; unstacked: a Python loop with XLA's
matmuls; packed: the same loop with the CPU matmul kernel, see ``models.llama.unstack_layers`` and
``models.cpu_kernels``), then ``jspec.decode``'s plain loop on the fastest one. Then the cost of one forward
call of T = 1, 2, 5, 9 tokens after the prompt (what a verification pass of K = T - 1 drafts costs) per layout.
transformers: ``generate(do_sample=False)`` on the same GGUF (dequantised to f32). Prints tokens/s as medians
over ``--repeats`` runs measured in this same process (JAX timings on these VMs jump between two levels from
process to process, so compare ratios within one run and repeat the whole script a few times).
transformers runs on the device kind JAX runs on: the CPU, or, where JAX runs on a GPU, the GPU torch sees
(with f32 matmuls in full f32 on both sides); where torch cannot use JAX's device the script refuses before
measuring anything (run it with JAX_PLATFORMS=cpu, or --no-torch), since a ratio across devices would be
no comparison of the implementations.

    python examples/bench_forward.py [--ctx 256] [--new 64] [--repeats 5] [--verify-tokens 1,2,5,9] [--no-torch]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import prepare
from jspec.state import to_output
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--verify-tokens", default="1,2,5,9", help="token counts T of the one-call cost table ('' to skip it)"
    )
    ap.add_argument("--no-torch", action="store_true")
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

    m = registry.load(args.model, dtype="float32")
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(100, m.config.vocab_size, size=args.ctx).tolist()
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    slots = args.ctx + args.new + 8
    cache = m.model.init_cache(1, slots)
    layouts = {"stacked": m.params, "unstacked": unstack_layers(m.params, packed=False)}
    if cpu_kernels.available():
        layouts["packed"] = unstack_layers(m.params, packed=True)

    # Decode rate = (time for new + 1 tokens - time for 1 token) / new: prefill and dispatch cancel out.
    def per_token(run):
        ts = []
        for _ in range(args.repeats):
            t1, tn = run(1), run(args.new + 1)
            ts.append((tn - t1) / args.new)
        return statistics.median(ts) * 1e3

    fused, tokens = {}, {}
    for name, params in layouts.items():

        def run(new, params=params):
            t0 = time.perf_counter()
            greedy(m.config, params, prompt, cache, new).block_until_ready()
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        run(1), run(args.new + 1)
        compile_s = time.perf_counter() - t0
        fused[name] = per_token(run)
        tokens[name] = np.asarray(greedy(m.config, params, prompt, cache, args.new))[0].tolist()
        print(
            f"jax fused greedy, {name:9s} layers, ctx={args.ctx} new={args.new}: {fused[name]:.1f} ms/token, "
            f"{1e3 / fused[name]:.1f} tok/s (median of {args.repeats}; 2 compiles + first runs {compile_s:.1f} s)"
        )
    for name in layouts:
        if name != "stacked":
            print(
                f"{name} / stacked speed: {fused['stacked'] / fused[name]:.2f}x; "
                f"same greedy tokens: {tokens['stacked'] == tokens[name]}"
            )
    best = min(fused, key=fused.get)
    ms, jax_tokens = fused[best], tokens[best]

    # The library's own plain loop (jspec.decode with no drafter: the speculative loop with K = 0, per-row
    # stops and statistics), timed the same way, on the faster layout.
    def run_lib(new):
        prep = prepare(m.model, layouts[best], [prompt_ids], max_new_tokens=new, max_len=slots)
        compiled = prep.compile()
        t0 = time.perf_counter()
        st = jax.block_until_ready(compiled(*prep.args))
        run_lib.state = st
        return time.perf_counter() - t0

    run_lib(1), run_lib(args.new + 1)
    lms = per_token(run_lib)
    lib_tokens = to_output(run_lib.state).tokens[0][: args.new]
    print(
        f"jspec.decode plain, {best} layers: {lms:.1f} ms/token, {1e3 / lms:.1f} tok/s; "
        f"loop overhead vs the bare fused scan: {lms / ms:.2f}x; same greedy tokens: {lib_tokens == jax_tokens}"
    )

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
        + f"; {gb:.3f} GB at {gb / fms * 1e3:.1f} GB/s ({fname}); fastest decode step / floor = {ms / fms:.2f}"
    )

    # One forward call of T tokens after the prompt, per layout: what a verification pass costs.
    ts = [int(t) for t in args.verify_tokens.split(",") if t]
    if ts:
        apply = jax.jit(lambda p, t, pos, c: forward(m.config, p, t, pos, c)[0])
        filled = cache.with_lengths(jnp.full((1,), args.ctx, jnp.int32))
        for name, params in layouts.items():
            cost = {}
            for t in ts:
                toks = jnp.asarray([prompt_ids[:t]], jnp.int32)
                pos = args.ctx + jnp.arange(t, dtype=jnp.int32)[None]
                apply(params, toks, pos, filled).block_until_ready()
                runs = []
                for _ in range(args.repeats * 3):
                    t0 = time.perf_counter()
                    apply(params, toks, pos, filled).block_until_ready()
                    runs.append(time.perf_counter() - t0)
                cost[t] = statistics.median(runs) * 1e3
            base = cost.get(1, cost[ts[0]])
            print(
                f"one call, {name:9s} layers: "
                + ", ".join(f"T={t} {c:.1f} ms ({c / base:.2f}x)" for t, c in cost.items())
            )

    if args.no_torch:
        return
    import torch

    from models.hf_reference import transformers_from_gguf

    tm = transformers_from_gguf(registry.resolve(args.model)).to(torch_device)
    ids = torch.tensor([prompt_ids], device=torch_device)
    gen = functools.partial(tm.generate, ids, do_sample=False, pad_token_id=0, eos_token_id=None)

    def sync():
        if torch_device != "cpu":
            torch.cuda.synchronize()

    with torch.no_grad():
        gen(max_new_tokens=2)
        theirs = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            gen(max_new_tokens=1)
            sync()
            t1 = time.perf_counter()
            out = gen(max_new_tokens=args.new + 1)
            sync()
            theirs.append(((time.perf_counter() - t1) - (t1 - t0)) / args.new)
    tms = statistics.median(theirs) * 1e3
    print(
        f"transformers greedy ctx={args.ctx} new={args.new} on {torch_device} (JAX on {jax.default_backend()}): "
        f"{tms:.1f} ms/token, {1e3 / tms:.1f} tok/s"
    )
    same = out[0, args.ctx : args.ctx + args.new].cpu().tolist() == jax_tokens
    for name in layouts:
        print(f"speed ratio jax ({name} layers)/transformers: {tms / fused[name]:.2f}x")
    print(f"same greedy tokens as transformers: {same}")


if __name__ == "__main__":
    main()
