"""Measured round costs: how long a round at each draft length K takes, relative to a plain step, for the shapes
the loop runs (its batch B and cache slots S), on this device, for this model, layout and drafter.

A verification's price depends on B, T = K + 1, the context, the device and the model: at batch 1 a decode step is
bound by reading the weights and K + 1 tokens cost little more than one; at larger batches (and on small CPUs) it is
bound by arithmetic and grows with B x (K + 1); and each of the K + 1 positions attends to the whole context, which
at a few hundred tokens is a large part of a small model's step. ``profile`` measures it: it compiles ONE program
of a few rounds of the goodput loop (``jspec.loop.decode_round``, whose K is an argument there) and one of plain
decoding's, prefills a batch of B prompts of the decode's context length that prompt lookup always continues (so a
round at K verifies K + 1 positions, as the policy assumes), and times those rounds at each K and plain decoding's
steps, alternating, taking medians; a cost is a round's time over a plain step's.
The ``CostTable`` is cached on disk under ``${JSPEC_CACHE:-~/.cache/jspec}/costs/``, keyed by everything that
changes the costs (``CostKey``: device, model, parameter layout and dtype, drafter, B, S, the context in steps of
``CONTEXT_STEP`` tokens, the K set, JAX version),
so it is measured once per situation and read back by any later process; ``refresh=True`` measures again. A table
from another device, model, layout or shape set is refused by name (``check``); a file that cannot be read is
measured again, with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import validate as V
from jspec.drafters import Drafter
from jspec.goodput import GoodputK
from jspec.loop import decode_round, prefill
from jspec.model import Model
from jspec.state import DecodeConfig

SCHEMA = 4  # 2: rounds timed inside one compiled loop, every round at K > 0 wide; 3: at the decode's context;
# 4: relative to plain decoding's step, timed beside them (a goodput round at K = 0 is not quite one)
# A table per CONTEXT_STEP tokens of context: at most S / 128 of them per batch and cache size, each within 64 tokens
# of the context it serves.
CONTEXT_STEP = 128


def cache_dir() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/costs``."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "costs")


def _describe(x: Any) -> Any:
    """A process-independent description of a drafter (or anything in it): dataclasses by their fields, models
    by name and vocabulary, never the addresses of their functions."""
    if isinstance(x, Model):
        return f"Model({x.name}, V={x.vocab_size}, max_positions={x.max_positions})"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _describe(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"type": type(x).__qualname__, **fields}
    if isinstance(x, tuple | list):
        return [_describe(v) for v in x]
    return repr(x)


def params_fingerprint(params: Any) -> str:
    """The parameters' tree structure, shapes and dtypes (their layout: stacked, per-layer, packed for the CPU
    kernels; and their precision), hashed; not their values."""
    leaves, treedef = jax.tree.flatten(params)
    desc = [str(treedef)] + [f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}" for x in leaves]
    return hashlib.sha256("\n".join(desc).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CostKey:
    """What a cost table was measured for; a table is used only where every field is the same."""

    device: str
    model: str
    params: str  # params_fingerprint of the target's params (layout and dtype)
    drafter: str  # a description of the drafter and the fingerprint of its params
    batch: int
    slots: int
    context: int  # tokens per row before the timed rounds (``context_of``)
    ks: tuple[int, ...]
    jax: str

    @classmethod
    def of(
        cls, target: Model, target_params, drafter: Drafter, draft_params, batch: int, slots: int, ks, context: int
    ) -> CostKey:
        dev = jax.devices()[0]
        drafter_desc = json.dumps([_describe(drafter), params_fingerprint(draft_params)], sort_keys=True)
        return cls(
            device=f"{dev.platform}:{getattr(dev, 'device_kind', '')} x{jax.device_count()}",
            model=target.name,
            params=params_fingerprint(target_params),
            drafter=drafter_desc,
            batch=int(batch),
            slots=int(slots),
            context=int(context),
            ks=tuple(int(k) for k in ks),
            jax=jax.__version__,
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:20]


@dataclasses.dataclass(frozen=True)
class CostTable:
    """round_ms[i]: the median time of a round at ``key.ks[i]`` (ms); plain_ms: plain decoding's step (no
    drafter) timed beside them; ``relative`` divides by it. So the policy's K = 0 round, which still carries the
    goodput loop (the choice, the estimates, the drafter keeping up), shows its cost over a plain step, and a
    prediction from the table is one against plain decoding."""

    key: CostKey
    round_ms: tuple[float, ...]
    rounds: int  # rounds timed per K
    plain_ms: float

    @property
    def relative(self) -> tuple[float, ...]:
        return tuple(ms / self.plain_ms for ms in self.round_ms)

    def policy(self, **kw) -> GoodputK:
        """The goodput policy of these costs (``kw``: GoodputK's objective and estimate parameters)."""
        return GoodputK(self.key.ks, self.relative, **kw)

    def check(self, key: CostKey) -> None:
        """Refuse, naming the fields, a table measured for another situation than ``key``."""
        differ = [f.name for f in dataclasses.fields(CostKey) if getattr(self.key, f.name) != getattr(key, f.name)]
        if differ:
            what = "; ".join(f"{n}: table {getattr(self.key, n)!r:.60}, here {getattr(key, n)!r:.60}" for n in differ)
            raise ValueError(f"the cost table was measured for another {', '.join(differ)} ({what}): profile this one")

    def report(self) -> str:
        """The table as text: one row per K, its time and its cost relative to a plain step."""
        k = self.key
        head = f"round cost at batch {k.batch}, {k.slots} slots, context {k.context} ({k.model}, {k.device})"
        rows = zip(self.key.ks, self.round_ms, self.relative)
        plain = f"  plain {self.plain_ms:8.2f} ms    1.00x"
        return "\n".join([head, plain, *(f"  K={k:<3d} {ms:8.2f} ms   {rel:5.2f}x" for k, ms, rel in rows)])

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "key": dataclasses.asdict(self.key),
            "round_ms": list(self.round_ms),
            "rounds": self.rounds,
            "plain_ms": self.plain_ms,
        }

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"cost table schema {data.get('schema')!r}, expected {SCHEMA}")
        key = CostKey(**{**data["key"], "ks": tuple(data["key"]["ks"])})
        round_ms = tuple(float(x) for x in data["round_ms"])
        if len(round_ms) != len(key.ks) or not all(np.isfinite(x) and x > 0 for x in round_ms):
            raise ValueError(f"cost table round_ms {round_ms} does not match ks {key.ks}")
        plain_ms = float(data["plain_ms"])
        if not (np.isfinite(plain_ms) and plain_ms > 0):
            raise ValueError(f"cost table plain_ms {plain_ms} is not a time")
        return cls(key, round_ms, int(data["rounds"]), plain_ms)


def context_of(tokens: float, slots: int) -> int:
    """The context a table is measured at for rows of ``tokens`` context on average: the nearest multiple of
    ``CONTEXT_STEP`` (the first step for less), within the cache."""
    step = CONTEXT_STEP * max(1, round(float(tokens) / CONTEXT_STEP))
    return int(min(step, slots))


PROFILE_ROUNDS = 4  # rounds timed per call


PROFILE_REPEATS = 3  # timed calls per K, after one that compiles and warms up


def fits_profile(slots: int, k_max: int, rounds: int = PROFILE_ROUNDS, repeats: int = PROFILE_REPEATS) -> bool:
    """Whether a cache of ``slots`` holds the profile's prompts (at least 8 tokens) and every call's ``rounds``
    rounds at K = ``k_max``."""
    return slots - k_max * rounds * (repeats + 1) - 2 >= 8


def _lookup_prompts(batch: int, length: int, vocab: int) -> np.ndarray:
    """[B, length] prompts of a repeating period, so a prompt lookup always finds a continuation (every round of a
    chain drafter verifies wide, as the costs assume)."""
    period = np.arange(1, min(vocab, 17))
    row = np.resize(period, length)
    return np.stack([np.roll(row, i) for i in range(batch)]).astype(np.int32)


def profile(
    target: Model,
    target_params,
    drafter: Drafter,
    draft_params,
    *,
    batch: int,
    slots: int,
    ks,
    context: int,
    rounds: int = PROFILE_ROUNDS,
    repeats: int = PROFILE_REPEATS,
) -> CostTable:
    """Time a round at each K of ``ks`` on ``batch`` rows and ``slots`` cache slots, starting at ``context`` tokens
    per row (at most what the timed rounds leave room for; see the module docstring).

    The rows decode ``_lookup_prompts``, which prompt lookup always continues, so that every round at K > 0
    verifies K + 1 positions: the cost the policy pays when it chooses K (how often a row has nothing to propose
    is its acceptance estimate's business, not the cost's). The rounds run as the decode runs them, inside one
    compiled loop (``rounds`` rounds per call, no dispatch between them); the calls of the K and plain decoding's
    alternate, and each one's time is the median over ``repeats`` calls, after one that compiles and warms up."""
    ks = tuple(int(k) for k in ks)
    if not fits_profile(slots, ks[-1], rounds, repeats):
        raise ValueError(f"{slots} cache slots cannot hold the profile's prompts and its rounds at K = {ks[-1]}")
    p = min(context, slots - ks[-1] * rounds * (repeats + 1) - 2)  # the prompts leave room for every timed round
    ids = _lookup_prompts(batch, p, target.vocab_size)
    # The costs do not matter here: every round's K is given.
    config = DecodeConfig(ks[-1], slots, goodput=GoodputK(ks, (1.0,) * len(ks)))
    plain_config = DecodeConfig(0, slots)  # plain decoding's program: no drafter, no policy
    args = (
        jnp.asarray(ids),
        jnp.full((batch,), p, jnp.int32),
        jnp.full((batch,), slots, jnp.int32),
        V.sampling_params(batch),
        jax.random.key(0),
    )

    def rounds_of(drafter, config):
        """``rounds`` rounds in one jitted call (at ``ks[k_index]``: one program for every K) and a prefilled state."""

        def run(target_params, draft_params, st, k_index):
            step = functools.partial(decode_round, target, drafter, config, target_params, draft_params)
            return jax.lax.fori_loop(0, rounds, lambda _, s: step(s, k_index)[0], st)

        pre = jax.jit(functools.partial(prefill, target, drafter, config))
        return jax.jit(run, donate_argnums=(2,)), lambda: pre(target_params, draft_params, *args)

    many, fresh = rounds_of(drafter, config)
    plain_many, plain_fresh = rounds_of(None, plain_config)
    # One running state per K, then plain decoding's (its k_index unread); the calls alternate between them. Each
    # call goes on from where the last left off: restarting every call from the prefilled prompts made the first
    # rounds' lookups miss (the model's first token does not continue the period), so the rounds verified narrow
    # and every K cost a plain step (batch 32: 0.99x at K = 4 against 3.9x).
    calls = [(many, jnp.int32(i)) for i in range(len(ks))] + [(plain_many, None)]
    states = [fresh() for _ in ks] + [plain_fresh()]
    times: list[list[float]] = [[] for _ in calls]
    for r in range(repeats + 1):  # call 0 compiles and warms up
        for i, (fn, k_index) in enumerate(calls):
            t0 = time.perf_counter()
            states[i] = jax.block_until_ready(fn(target_params, draft_params, states[i], k_index))
            if r:
                times[i].append((time.perf_counter() - t0) * 1e3 / rounds)
    key = CostKey.of(target, target_params, drafter, draft_params, batch, slots, ks, context)
    medians = [float(statistics.median(t)) for t in times]
    return CostTable(key, tuple(medians[:-1]), rounds * repeats, medians[-1])


def cost_table(
    target: Model,
    target_params,
    drafter: Drafter,
    draft_params,
    *,
    batch: int,
    slots: int,
    ks,
    context: int,
    refresh: bool = False,
    directory: str | None = None,
) -> CostTable:
    """The cost table of this situation: read from the disk cache, or measured (``profile``) and saved there."""
    key = CostKey.of(target, target_params, drafter, draft_params, batch, slots, ks, context)
    path = os.path.join(directory or cache_dir(), f"{key.digest()}.json")
    if not refresh and os.path.exists(path):
        try:
            with open(path) as f:
                table = CostTable.from_json(json.load(f))
            table.check(key)
            return table
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"cost table {path} is unusable ({e}); measuring it again", stacklevel=2)
    table = profile(target, target_params, drafter, draft_params, batch=batch, slots=slots, ks=ks, context=context)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table.to_json(), f, indent=1)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return table


def measurable(
    drafter: Drafter | None, target_params, draft_params, *, gamma: int, gamma_given: bool, adaptive, slots: int
) -> bool:
    """Whether the default (``goodput=None``) measures a policy: where a drafter can change its K from round to
    round (``goodput_ks``) and nothing fixes K (no ``gamma``, no adaptive policy). Not where the costs cannot be
    measured alike: on abstract parameters (a program lowered for another machine, ``jax.ShapeDtypeStruct``s),
    or in a multi-process run, where each process would time its own rounds and compile a program with other
    costs than its peers' (pass one ``CostTable`` or ``GoodputK`` to every process instead); nor in a cache too
    small for the profile's rounds (``fits_profile``: 74 slots at K = 4, a decode of a few dozen tokens). There the
    default is the fixed K."""
    if drafter is None or gamma_given or adaptive is not None or V.goodput_ks(drafter, gamma) is None:
        return False
    if jax.process_count() > 1 or not fits_profile(slots, gamma):
        return False
    return not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((target_params, draft_params)))


def goodput_policy(
    goodput,
    target: Model,
    target_params,
    drafter: Drafter | None,
    draft_params,
    *,
    gamma: int,
    gamma_given: bool,
    adaptive,
    batch: int,
    slots: int,
    context: int,
    objective: str = "throughput",
) -> GoodputK | None:
    """``decode``'s ``goodput`` as the loop's policy, or None for a fixed K.

    None (the default): True wherever ``measurable`` says the policy can be measured and run, else a fixed K.
    False: a fixed K. True: the K set the drafter can switch between (``goodput_ks``; up to its K, ``gamma``),
    with this situation's cost table (measured once, then read from the disk cache); refused with a fixed
    ``gamma``, an adaptive policy or a drafter that cannot change K from round to round. A ``CostTable``: its
    costs, refused unless it was measured for this situation. A ``GoodputK``: as it is. The policy's largest K is
    the loop's K (the caller runs ``check_drafter`` on it). context: the rows' context (``context_of``).
    objective: the measured policies' (``GoodputK.objective``): "makespan" for a fixed batch, "throughput" for a
    serving engine."""
    if goodput is None:
        goodput = measurable(drafter, target_params, draft_params, gamma=gamma, gamma_given=gamma_given,
                             adaptive=adaptive, slots=slots)  # fmt: skip
    if goodput is False:
        return None
    if goodput is True:
        if drafter is None:
            raise ValueError("goodput=True chooses a draft length each round: it needs a drafter")
        if gamma_given or adaptive is not None:
            what = "a fixed gamma (exactly that K)" if gamma_given else "an adaptive policy"
            raise ValueError(f"goodput=True chooses K each round, which {what} excludes: pass one or the other")
        ks = V.goodput_ks(drafter, gamma)
        if ks is None:
            V.check_goodput(GoodputK((gamma,), (1.0,)), drafter, gamma)  # raises, naming why
        kw = dict(batch=batch, slots=slots, ks=ks, context=context)
        table = cost_table(target, target_params, drafter, draft_params, **kw)
        return V.check_goodput(table.policy(objective=objective), drafter, gamma)
    if isinstance(goodput, bool) or not isinstance(goodput, GoodputK | CostTable):
        raise ValueError(f"goodput must be None, True, False, a CostTable or a GoodputK, got {goodput!r:.80}")
    if gamma_given or adaptive is not None:
        raise ValueError("a goodput policy chooses K each round: it excludes a fixed gamma and an adaptive policy")
    if isinstance(goodput, CostTable):
        goodput.check(CostKey.of(target, target_params, drafter, draft_params, batch, slots, goodput.key.ks, context))
        goodput = goodput.policy(objective=objective)
    return V.check_goodput(goodput, drafter, goodput.k_max)  # its largest K is the loop's


def main(argv=None) -> int:
    """``python -m jspec costs``: measure (or read back) and print the cost tables of a model and drafter."""
    import argparse
    import sys

    from jspec.loaders import compile_cache_flag, load_model, model_loader, wants_unstacked
    from jspec.ngram import NgramDrafter

    ap = argparse.ArgumentParser(prog="python -m jspec costs", description=main.__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    ap.add_argument("--drafter", default="ngram", choices=("ngram", "eagle"), help="eagle: the bundled head")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--slots", type=int, default=512, help="cache slots per row")
    ap.add_argument("--context", type=int, default=CONTEXT_STEP, help="tokens per row before the timed rounds")
    ap.add_argument("--refresh", action="store_true", help="measure again instead of reading the disk cache")
    ap.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache directory ('none': off)")
    args = ap.parse_args(argv)
    try:
        batches = [V.check_count("--batches", int(b)) for b in args.batches.split(",")]
        V.check_count("--slots", args.slots)
        V.check_count("--context", args.context)
        compile_cache_flag(args.compile_cache)
        loaded = load_model(model_loader(), args.model, "float32", unstacked=wants_unstacked("auto"))
        _, params, target, _ = loaded
        if args.drafter == "ngram":
            drafter, dparams = NgramDrafter(vocab_size=target.vocab_size), None
        else:
            drafter, dparams = model_loader("jspec.drafter_loaders", "eagle")(None, loaded, V.DEFAULT_GAMMA)
        gamma = V.check_drafter(target, drafter, None, draft_params=dparams, target_params=params)
        ks = V.goodput_ks(drafter, gamma)
        for b in batches:
            context = context_of(args.context, args.slots)
            kw = dict(batch=b, slots=args.slots, ks=ks, context=context, refresh=args.refresh)
            print(cost_table(target, params, drafter, dparams, **kw).report())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
