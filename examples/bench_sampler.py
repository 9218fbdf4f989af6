"""The sampler's filters (top-k / top-p / min-p) on vocabulary-sized rows: jspec's bisection thresholds
against a sort-based filter with the same semantics, timed in the same run, outputs checked equal.

A verification round samples from [B, K+1, V] target probabilities and the draft from [B, V] per step, so
this cost is paid every round whenever a filter is on. XLA:CPU sorts a 49152-entry row in milliseconds.

    python examples/bench_sampler.py [--vocab 49152] [--shapes 1x1,1x5,4x5,16x5] [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.metrics import median_ms
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
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    settings = {
        "top-p 0.9": dict(top_p=0.9),
        "top-k 50": dict(top_k=50),
        "top-k 50 + top-p 0.9 + min-p 0.02": dict(top_k=50, top_p=0.9, min_p=0.02),
    }
    rng = np.random.default_rng(0)
    ours, ref = jax.jit(distribution), jax.jit(sorted_filter)
    print(f"{'B x T':>7} {'filter':<34} {'jspec ms':>9} {'sort ms':>9} {'speed-up':>9}")
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        logits = jnp.asarray(rng.normal(size=(b, t, args.vocab)).astype(np.float32) * 3.0)
        for name, kw in settings.items():
            params = sampling_params(b, temperature=0.8, **kw)
            a, r = ours(logits, params), ref(logits, params)
            if not np.array_equal(np.asarray(a) > 0, np.asarray(r) > 0):
                raise SystemExit(f"{shape} {name}: the two filters keep different tokens")
            ms_ours = median_ms(functools.partial(ours, logits, params), repeats=args.repeats)
            ms_ref = median_ms(functools.partial(ref, logits, params), repeats=args.repeats)
            print(f"{shape:>7} {name:<34} {ms_ours:9.2f} {ms_ref:9.2f} {ms_ref / ms_ours:8.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
