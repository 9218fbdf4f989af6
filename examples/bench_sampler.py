"""The sampler's filters (top-k / top-p / min-p) on vocabulary-sized rows: jspec's bisection thresholds
against a sort-based filter with the same semantics, timed in the same run, outputs checked equal. Each of
``--repeats`` passes times both once, in an order rotated from pass to pass; the speed-up is the median of the
per-pass ratios with their min-max, written to one result file (``jspec.bench.record``).

A verification round samples from [B, K+1, V] target probabilities and the draft from [B, V] per step, so
this cost is paid every round whenever a filter is on. XLA:CPU sorts a 49152-entry row in milliseconds.

    python examples/bench_sampler.py [--vocab 49152] [--shapes 1x1,1x5,4x5,16x5] [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench import record
from jspec.sampling import SamplingParams, distribution
from jspec.validate import sampling_params


def sorted_filter(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Reference: temperature, then top-k / top-p / min-p thresholds read off one descending sort."""
    nd = logits.ndim

    def col(x):
        return x.reshape(x.shape + (1,) * (nd - 1))

    probs = jax.nn.softmax(logits / col(params.temperature), axis=-1)
    v = probs.shape[-1]
    sorted_p = -jnp.sort(-probs, axis=-1)
    k = col(params.top_k)
    k = jnp.where((k > 0) & (k < v), k, v)
    keep = probs >= jnp.take_along_axis(sorted_p, k - 1, axis=-1)
    kept = jnp.where(jnp.arange(v) < k, sorted_p, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    before = jnp.cumsum(kept, axis=-1) - kept
    n_keep = jnp.maximum(jnp.sum((before < col(params.top_p)) & (kept > 0), axis=-1, keepdims=True), 1)
    keep &= probs >= jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
    out = jnp.where(keep, probs, 0.0)
    out = out / jnp.sum(out, axis=-1, keepdims=True)
    out = jnp.where(out >= col(params.min_p) * jnp.max(out, axis=-1, keepdims=True), out, 0.0)
    return out / jnp.sum(out, axis=-1, keepdims=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--shapes", default="1x1,1x5,4x5,16x5", help="BxT rows of logits")
    ap.add_argument("--repeats", type=int, default=10, help="passes (at least 5 for a ratio)")
    ap.add_argument("--out", default=None, help="the result file (default results/sampler-<UTC time>.json)")
    args = ap.parse_args(argv)
    try:
        rec = record.start("sampler", "python examples/bench_sampler.py", argv, dict(vars(args)), args.out)
    except OSError as e:
        ap.error(str(e))
    settings = {
        "top-p 0.9": dict(top_p=0.9),
        "top-k 50": dict(top_k=50),
        "top-k 50 + top-p 0.9 + min-p 0.02": dict(top_k=50, top_p=0.9, min_p=0.02),
    }
    rng = np.random.default_rng(0)
    ours, ref = jax.jit(distribution), jax.jit(sorted_filter)
    print(f"{'B x T':>7} {'filter':<34} {'jspec ms':>9} {'sort ms':>9} {'speed-up (min-max)':>20}")
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        logits = jnp.asarray(rng.normal(size=(b, t, args.vocab)).astype(np.float32) * 3.0)
        for name, kw in settings.items():
            params = sampling_params(b, temperature=0.8, **kw)
            a, r = ours(logits, params), ref(logits, params)
            if not np.array_equal(np.asarray(a) > 0, np.asarray(r) > 0):
                raise SystemExit(f"{shape} {name}: the two filters keep different tokens")
            fns = {"jspec": functools.partial(ours, logits, params), "sort": functools.partial(ref, logits, params)}
            cell = f"{shape} {name}"
            rec.cell(cell, batch=b, positions=t, vocab=args.vocab, filter=name)
            for c in fns:
                rec.config(cell, c, kind="jspec" if c == "jspec" else "reference")
            for i in range(args.repeats):  # a row of logits is a "token": rows per second
                entries = []
                for pos, c in enumerate(record.rotation(list(fns), i)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fns[c]())
                    entries.append(record.run_entry(c, pos, b * t, time.perf_counter() - t0))
                rec.add_pass(cell, i, entries)
            rec.ratio(cell, "jspec", ["sort"], "jspec vs sort")
            sm = record.summarize(rec.data)[cell]
            ms = {c: 1e3 * b * t / sm["configs"][c]["tokens_per_s"]["median"] for c in fns}
            r = sm["ratios"]["jspec vs sort"]
            print(f"{shape:>7} {name:<34} {ms['jspec']:9.2f} {ms['sort']:9.2f} {r['median']:8.1f}x "
                  f"({r['min']:.1f}-{r['max']:.1f})", flush=True)  # fmt: skip
    rec.finish()
    print(f"wrote {rec.write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
