"""``jspec.decode`` under ``jax.jit`` with explicit in/out shardings, on one or many processes.

The whole decode (prefill + ``lax.while_loop`` over rounds) stays one jitted program, as in the unsharded
path; sharding only adds
- in_shardings from the placed parameters and the table (prompt rows over the batch axis),
- out_shardings for the final ``DecodeState`` (``state_shardings``),
- ``DecodeConfig.constrain = StateConstraint(plan)``: a ``with_sharding_constraint`` of the loop state after
  prefill and after every round, so the partitioner keeps the KV cache split over (batch, KV heads) through
  the loop instead of choosing a layout for the carry by itself (which can mean an all-gather per round).
- the target model and a draft model wrapped by ``pinned_model``: their logits are gathered once per call
  and their caches pinned to the table's layout,
- donation of the per-call inputs that the state takes over unchanged (prompt lengths, budgets, sampling
  parameters): their buffers become the output's (6 aliased buffers in the compiled program).

Measured on the tiny test model, mesh 2x4, draft-model speculation (collectives per round, from the HLO):
114 without the model pin (vocab-sharded logits spread collectives through sampling and verification), 37
with it, of which 22 are the model calls' own. The state constraint changes nothing there (propagation
already keeps the cache split) but keeps the state pinned for drafters whose models are not wrapped. No
configuration moved KV-cache data.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jspec.decode import prepare
from jspec.loop import decode_round, generate_arrays, prefill
from jspec.model import Model
from jspec.sampling import SamplingParams
from jspec.state import DecodeConfig, DecodeOutput, DecodeState, to_output
from jspec.stream import DecodeStream
from jspec.validate import tree_scratch
from sharding.mesh import check_auto_axes
from sharding.placement import cache_shardings, local_rows, put, put_rows, rows_sharding
from sharding.rules import ShardingRules, fit_rules, named, rules

LOGITS_AXES = ("batch", None, "vocab")  # [B, T, V] as the LM head computes them


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Where a decode runs: a mesh, the target's rules and (optionally different) draft rules.

    The draft's ``batch`` entry always follows the target's, so a row's draft state lives on the devices that
    hold its target state and no row moves between devices during a round. ``draft=None``: same as target.
    A replicated draft model next to a tensor-parallel target is ``draft=rules('data')`` (parameters whole on
    every device, draft cache still split by rows). draft_fitted: whether the draft rules were fitted to the
    draft model's own shapes (``make_plan`` with ``draft_axes``); a draft model under unfitted rules that split
    it is refused when the decode is prepared.
    """

    mesh: Mesh
    target: ShardingRules
    draft: ShardingRules | None = None
    draft_fitted: bool = True

    def __post_init__(self):
        check_auto_axes(self.mesh)
        for which, r in (("target", self.target), ("draft", self.draft)):
            for logical, axis in () if r is None else r.mapping:
                if axis is not None and axis not in self.mesh.shape:
                    raise ValueError(
                        f"the {which} rules {r.name!r} map {logical!r} to mesh axis {axis!r}, which the mesh "
                        f"(axes {tuple(self.mesh.shape)}) does not have"
                    )

    @property
    def batch_axis(self) -> str | None:
        return self.target["batch"]

    @property
    def draft_rules(self) -> ShardingRules:
        return (self.draft or self.target).replace(batch=self.batch_axis)

    @property
    def data_size(self) -> int:
        return self.mesh.shape[self.batch_axis] if self.batch_axis else 1

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def rows(self, shape: tuple[int, ...], batch: int) -> NamedSharding:
        return rows_sharding(self.mesh, self.batch_axis, shape, batch)


def make_plan(
    mesh: Mesh,
    target: str | ShardingRules = "data_tensor",
    draft: str | ShardingRules | None = None,
    *,
    target_axes: Any = None,
    target_shapes: Any = None,
    draft_axes: Any = None,
    draft_shapes: Any = None,
) -> DecodePlan:
    """``DecodePlan`` from preset names (or rules). Given a model's logical axes and parameter shapes
    (arrays or ShapeDtypeStructs), its rules are fitted to the mesh (``sharding.rules.fit_rules``: axes that
    do not divide are replicated, query heads follow KV heads), which also fixes the cache layout. The draft
    model is fitted to its own shapes, starting from its preset (default: the target's preset, not the
    target's fitted rules); without ``draft_axes`` its rules stay unfitted, and ``prepare_sharded`` refuses
    a draft model that they would split."""
    t = rules(target)
    if target_axes is not None:
        t = fit_rules(t, target_axes, target_shapes, mesh)
    d = rules(target if draft is None else draft)
    if draft_axes is not None:
        d = fit_rules(d, draft_axes, draft_shapes, mesh)
    elif draft is None:
        d = None  # no draft model described: the draft state follows the target's rules
    return DecodePlan(mesh, t, d, draft_fitted=draft_axes is not None)


# The statistics that are per row ([B]); the others are per draft position ([K]) or scalars, replicated even
# when K happens to equal B.
ROW_STATS = ("rounds", "emitted", "proposed", "accepted")


def state_shardings(st: DecodeState, plan: DecodePlan) -> DecodeState:
    """A ``DecodeState`` whose leaves are the shardings of ``st``'s (arrays or ShapeDtypeStructs).

    Every array whose leading dimension is the batch is split over the batch axis (tokens, lengths, budgets,
    sampling parameters, per-row keys); KV caches (the target's, and a drafter's inside ``draft_state``) over
    (batch, KV heads) by the target's / draft's rules; everything else (one key for the batch, flags) is
    replicated. Statistics go by name: the per-row ones (``ROW_STATS``) are split, the per-position ones
    (``accepted_at``, ``proposed_at``: [K]) and the scalars replicated, also when K equals the batch. Field by
    field, so fields added to the state later get the same treatment without a change here (a statistic added
    later is replicated until ``ROW_STATS`` names it).
    """
    b = st.seq.shape[0]

    def stats(s):
        return dataclasses.replace(
            s,
            **{
                f.name: plan.rows(tuple(getattr(s, f.name).shape), b) if f.name in ROW_STATS else plan.replicated()
                for f in dataclasses.fields(s)
            },
        )

    def field(name: str, x: Any):
        if name == "stats":
            return stats(x)
        return cache_shardings(x, plan.mesh, plan.draft_rules if name == "draft_state" else plan.target, b)

    return dataclasses.replace(st, **{f.name: field(f.name, getattr(st, f.name)) for f in dataclasses.fields(st)})


@dataclasses.dataclass(frozen=True)
class StateConstraint:
    """``DecodeConfig.constrain`` hook: pins the loop state to ``state_shardings`` (hashable, so the
    config stays a valid static jit argument)."""

    plan: DecodePlan

    def __call__(self, st: DecodeState) -> DecodeState:
        return jax.lax.with_sharding_constraint(st, state_shardings(st, self.plan))


@functools.lru_cache(maxsize=64)
def pinned_model(model: Model, plan: DecodePlan, model_rules: ShardingRules) -> Model:
    """``model`` with its outputs pinned: logits [B, T, V] split over rows only, the cache per the table.

    Without the logits pin, a vocabulary-sharded LM head hands vocab-sharded logits to sampling, and the
    partitioner then spreads small collectives through softmax, sort (top-k/top-p), cumsum and argmax; pinned,
    the logits are all-gathered once per model call and sampling/verification run locally per row. The cache
    pin (also on ``init_cache``) keeps every write local: the cache never changes layout inside a round.
    Cached per (model, plan, rules) because the decoder compares models by the identity of their functions.
    """

    def pin_cache(cache, b: int):
        return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, plan.mesh, model_rules, b))

    def apply(params, tokens, positions, cache, tree_mask=None):
        b = tokens.shape[0]
        logits, cache = model.apply(params, tokens, positions, cache, tree_mask)
        # First as the LM head makes them (vocab split), then gathered: pinning only the gathered layout lets
        # the partitioner all-gather the [V, E] embedding instead of the much smaller [B, T, V] logits.
        logits = jax.lax.with_sharding_constraint(logits, named(LOGITS_AXES, logits.shape, plan.mesh, model_rules))
        logits = jax.lax.with_sharding_constraint(logits, plan.rows(tuple(logits.shape), b))
        return logits, pin_cache(cache, b)

    def apply_at(params, tokens, positions, cache, index):
        b = tokens.shape[0]
        logits, cache = model.apply_at(params, tokens, positions, cache, index)
        logits = jax.lax.with_sharding_constraint(
            logits[:, None], named(LOGITS_AXES, (b, 1, logits.shape[-1]), plan.mesh, model_rules)
        )
        logits = jax.lax.with_sharding_constraint(logits, plan.rows(tuple(logits.shape), b))
        return logits[:, 0], pin_cache(cache, b)

    def init_cache(batch: int, slots: int):
        return pin_cache(model.init_cache(batch, slots), batch)

    return dataclasses.replace(
        model, apply=apply, init_cache=init_cache, apply_at=None if model.apply_at is None else apply_at
    )


def pinned_drafter(drafter, plan: DecodePlan):
    """A drafter that runs a draft ``Model`` (its ``draft_model``, the ``model`` field of ``ModelDrafter`` and the
    tree model drafters) gets the pinned draft model under the draft rules; any other drafter is returned
    unchanged."""
    inner = None if drafter is None else drafter.draft_model
    if inner is not None:
        split = [k for k, v in plan.draft_rules.mapping if k != "batch" and v is not None and plan.mesh.shape[v] > 1]
        if not plan.draft_fitted and split:
            raise ValueError(
                f"the plan's draft rules split {split} of the draft model but were never fitted to its shapes "
                "(an axis the mesh cannot divide would be replicated in some arrays only, e.g. query heads split "
                "while KV heads stay whole): pass draft_axes= and draft_shapes= to make_plan"
            )
        return dataclasses.replace(drafter, model=pinned_model(inner, plan, plan.draft_rules))
    return drafter


def _shardings_of(tree: Any, mesh: Mesh, what: str) -> Any:
    def one(x):
        s = getattr(x, "sharding", None)
        if not isinstance(s, NamedSharding) or s.mesh != mesh:
            raise ValueError(
                f"{what} must be placed on the plan's mesh first (sharding.shard_params or "
                f"sharding.checkpoint.restore); found a leaf with sharding {s}"
            )
        return s

    return jax.tree.map(one, tree)


def _freeze(tree: Any):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


@functools.lru_cache(maxsize=64)
def _jitted(
    target: Model, drafter, config: DecodeConfig, plan: DecodePlan, key_impl: Any, frozen_in, frozen_abs, donate: bool
):
    in_shardings = jax.tree.unflatten(*frozen_in)
    abstract = jax.tree.unflatten(*frozen_abs)

    def run(target_params, draft_params, prompt, prompt_len, max_new, sampling, key_data):
        key = jax.random.wrap_key_data(key_data, impl=key_impl)
        return generate_arrays(
            target, drafter, config, target_params, draft_params, prompt, prompt_len, max_new, sampling, key
        )

    out_shardings = state_shardings(jax.eval_shape(run, *abstract), plan)
    return jax.jit(
        run,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=(3, 4, 5) if donate else (),
    )


@functools.lru_cache(maxsize=64)
def _step_fns(target: Model, drafter, config: DecodeConfig, plan: DecodePlan, key_impl: Any, frozen_in, frozen_abs):
    """Jitted prefill and single round for stepping from Python; the round donates the state it is given,
    so the KV caches are updated in place round after round."""
    in_shardings = jax.tree.unflatten(*frozen_in)
    abstract = jax.tree.unflatten(*frozen_abs)

    def pre(target_params, draft_params, prompt, prompt_len, max_new, sampling, key_data):
        key = jax.random.wrap_key_data(key_data, impl=key_impl)
        st = prefill(target, drafter, config, target_params, draft_params, prompt, prompt_len, max_new, sampling, key)
        return config.constrain(st)

    def step(target_params, draft_params, st):
        return decode_round(target, drafter, config, target_params, draft_params, st)

    st_abs = jax.eval_shape(pre, *abstract)
    st_sh = state_shardings(st_abs, plan)
    b = st_abs.seq.shape[0]
    _, emitted, n_emit = jax.eval_shape(step, abstract[0], abstract[1], st_abs)
    step_out = (st_sh, plan.rows(emitted.shape, b), plan.rows(n_emit.shape, b))
    pre_j = jax.jit(pre, in_shardings=in_shardings, out_shardings=st_sh, donate_argnums=(3, 4, 5))
    step_j = jax.jit(
        step, in_shardings=(in_shardings[0], in_shardings[1], st_sh), out_shardings=step_out, donate_argnums=(2,)
    )
    return pre_j, step_j


@dataclasses.dataclass
class ShardedDecode:
    """A validated sharded decode call (the sharded counterpart of ``jspec.decode.PreparedDecode``).

    ``params`` are placed once and reused; the per-call inputs are kept on the host (this process's rows
    only, when inputs are built per process) and placed afresh for every run, because they are donated.
    """

    fn: Any  # jitted (target_params, draft_params, prompt, prompt_len, max_new, sampling, key_data) -> state
    config: DecodeConfig
    plan: DecodePlan
    params: tuple[Any, Any]
    host_inputs: tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray]
    global_batch: int
    input_shardings: tuple
    step_key: tuple = ()  # (target, drafter, config, plan, key_impl, frozen in_shardings, frozen shapes)

    def args(self) -> tuple:
        """(target_params, draft_params, prompt [B, P] int32 right-padded, prompt_len [B], max_new [B],
        sampling (fields [B, ...]), key_data: [W] uint32 replicated or [B, W] per-row keys), placed; the per-row
        arrays (per-row keys too) are split over the data axis, and in multi-process runs each process supplies
        only its own rows of them."""
        prompt, plen, mnew, samp, key_data = self.host_inputs
        sh_prompt, sh_plen, sh_mnew, sh_samp, sh_key = self.input_shardings
        b = self.global_batch

        def rows(x, sh):
            return put_rows(x, sh, (b, *x.shape[1:]))

        sampling = SamplingParams(**{k: rows(v, getattr(sh_samp, k)) for k, v in samp.items()})
        keys = rows(key_data, sh_key) if key_data.ndim == 2 else put(key_data, sh_key)
        placed = (rows(prompt, sh_prompt), rows(plen, sh_plen), rows(mnew, sh_mnew), sampling, keys)
        return (*self.params, *placed)

    def lower(self):
        return self.fn.lower(*self.args())

    def abstract_args(self) -> tuple:
        """``args()`` as ``jax.ShapeDtypeStruct``s: nothing is placed (the plan's mesh may be abstract)."""
        return jax.tree.unflatten(*self.step_key[-1])

    def export(self, platforms: Sequence[str]) -> jax_export.Exported:
        """The whole sharded decode lowered for ``platforms`` (e.g. ``("tpu",)``) with ``jax.export``, on any
        host: with a plan on a ``jax.sharding.AbstractMesh`` of the target machine's shape, no device of it is
        needed. XLA partitions the program (and inserts its collectives) when the target compiles it."""
        return jax_export.export(self.fn, platforms=tuple(platforms))(*self.abstract_args())

    def compile(self):
        """Compile ahead of time (no execution)."""
        return self.lower().compile()

    def hlo(self) -> str:
        """The compiled (partitioned) HLO text, for counting collectives (``sharding.hlo``)."""
        return self.compile().as_text()

    def run_state(self, compiled=None) -> DecodeState:
        """Run and return the final (global, sharded) ``DecodeState``, blocked until ready."""
        return jax.block_until_ready((compiled or self.fn)(*self.args()))

    def run(self, compiled=None) -> DecodeOutput:
        return gather_output(self.run_state(compiled))

    def step_fns(self):
        """(prefill, round): the jitted pieces ``stream`` runs; the round's state argument is donated."""
        return _step_fns(*self.step_key)

    def stream(self) -> DecodeStream:
        """Like ``jspec.decode.decode_stream``: yields, after prefill and after every round, the tokens each row
        emitted (all rows, in every process), with the stream's ``stop_reasons``, ``logprobs`` and ``output()``.
        Every step fetches its tokens to the host, so each round is blocked on before the next is dispatched
        (XLA:CPU deadlocks on long queues of programs with collectives). With several processes, every process
        must step the stream (and call ``output()``) alike: the fetches are collectives."""
        pre, step = self.step_fns()
        top = bool(self.config.top_logprobs)
        return DecodeStream(pre, step, self.args(), self.config.logprobs, _to_host, gather_output, top)

    def run_timed(self) -> DecodeOutput:
        """Like ``PreparedDecode.run_timed``: compile, then time execution + gathering the tokens alone."""
        t0 = time.perf_counter()
        compiled = self.compile()
        args = jax.block_until_ready(self.args())
        t1 = time.perf_counter()
        st = jax.block_until_ready(compiled(*args))
        out = gather_output(st)
        t2 = time.perf_counter()
        total = sum(out.stats["new_tokens"])
        out.stats.update(compile_seconds=t1 - t0, seconds=t2 - t1, tokens_per_s=total / (t2 - t1))
        return out


def _to_host(tree: Any) -> Any:
    """Global arrays -> numpy in every process (an all-gather across processes when needed)."""
    if jax.process_count() > 1 and not all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def gather_output(st: DecodeState) -> DecodeOutput:
    """Host-side tokens and statistics of a (possibly multi-process) final state, in every process.

    Only the small per-row arrays travel; the caches are never gathered."""
    lp = st.logprob
    seq, seq_len, plen, stop, stats = _to_host((st.seq, st.seq_len, st.prompt_len, st.stop, st.stats))
    lp = _to_host(lp) if lp.shape[1] else np.zeros(lp.shape, np.float32)  # [B, 0] without logprobs
    top_ids, top_lp = st.top_ids, st.top_logprob
    if top_ids.shape[1]:  # [B, 0, 0] without top_logprobs
        top_ids, top_lp = _to_host((top_ids, top_lp))
    else:
        top_ids, top_lp = np.zeros(top_ids.shape, np.int32), np.zeros(top_lp.shape, np.float32)
    host = dataclasses.replace(
        st,
        seq=seq,
        seq_len=seq_len,
        prompt_len=plen,
        stop=stop,
        stats=stats,
        logprob=lp,
        top_ids=top_ids,
        top_logprob=top_lp,
        cache=None,
        draft_state=None,
    )
    return to_output(host)


def _spans_processes(mesh: Mesh) -> bool:
    """Whether a decode on ``mesh`` involves other processes: True when the mesh holds devices of every process
    (the agreement checks of ``prepare_sharded`` then gather over all processes), False when it holds devices
    of this process only (a purely local decode, e.g. on ``single_device_mesh``, even when several processes
    run). A mesh over some processes but not all is refused: the checks gather over every process, and those
    outside the mesh would never join them."""
    if isinstance(mesh, AbstractMesh):  # a program to lower for another machine (``ShardedDecode.export``)
        return False
    procs = sorted({d.process_index for d in mesh.devices.flat})
    if procs == [jax.process_index()]:
        return False
    if len(procs) == jax.process_count():
        return True
    raise ValueError(
        f"the plan's mesh holds devices of process(es) {procs} of {jax.process_count()} (this is process "
        f"{jax.process_index()}): a sharded decode runs on a mesh over this process's devices only, or over the "
        "devices of every process (its agreement checks gather over all processes)"
    )


def _digest(*parts: Any) -> int:
    """31 bits of a SHA-256 over arrays and strings (with their dtypes and shapes), never 0: an int32 (what a gather
    carries without 64-bit mode) that 0 can stand beside as "nothing here"."""
    h = hashlib.sha256()
    for a in parts:
        a = np.frombuffer(a.encode(), np.uint8) if isinstance(a, str) else np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return (int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF) or 1


def _gather(values: Sequence[int]) -> np.ndarray:
    """A collective (every process calls it at the same point, with as many values): every process's ``values``
    (int32) as a [processes, len(values)] table, the same in every process."""
    row = np.asarray(values, np.int32)
    return np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)


def _raise_failed(failed: np.ndarray, error: Exception | None, what: str) -> None:
    """After a gather that carried each process's ``error is not None``: the processes whose local check failed
    raise their own error, the others a ValueError naming them, so that none goes on to a collective the others
    never reach."""
    if error is not None:
        raise error
    if np.any(failed):
        raise ValueError(
            f"process(es) {np.nonzero(failed)[0].tolist()} refused {what} (their own error says why); "
            f"process {jax.process_index()}'s were valid"
        )


def _refuse_unequal(column: np.ndarray, what: str, hint: str) -> None:
    """Refuses (in every process: each sees the same table) a gathered value that differs between processes."""
    if np.any(column != column[0]):
        groups = [np.nonzero(column == v)[0].tolist() for v in dict.fromkeys(column.tolist())]
        raise ValueError(f"{what} (groups of equal ones: {groups}): {hint}")


def _setup_digest(plan: DecodePlan, process_local: bool, max_len: int | None, target_params: Any, draft_params: Any):
    """What decides the program a process compiles and the checks it runs before comparing any input: the plan
    (rules, and the mesh's axes, shape, devices and axis types), the parameters' layouts, process_local and
    max_len (without one, process_local runs gather the cache size the rows need: one more collective)."""

    def layout(tree):  # any leaf: one that is not an array is refused by name after this digest's gather
        leaves, treedef = jax.tree.flatten(tree)
        spec = lambda x: str(getattr(getattr(x, "sharding", None), "spec", None))  # noqa: E731
        shape = lambda x: str(getattr(x, "shape", type(x)))  # noqa: E731
        return str(treedef), [(shape(x), str(getattr(x, "dtype", "")), spec(x)) for x in leaves]

    m = plan.mesh
    mesh = (
        tuple(m.axis_names),
        tuple(m.devices.shape),
        [d.id for d in m.devices.flat],
        tuple(str(t) for t in getattr(m, "axis_types", ())),
    )
    return _digest(
        repr((bool(process_local), max_len, plan.target, plan.draft, plan.draft_fitted, mesh))
        + repr((layout(target_params), layout(draft_params)))
    )


def static_digest(config: DecodeConfig, drafter: Any, target: Model, key: jax.Array) -> int:
    """Digest of what a process's prepared decode compiles into its program beyond the agreed set-up: the decode
    settings, the drafter, the target's name, and whether the key is one for the batch or one per row (one
    process with seed=[...] and another with seed=7 would compile two programs whose collectives never meet).
    The kind of key is its ``ndim``, not its shape: with process_local=True per-row keys are [local rows], and
    processes may legitimately hold different numbers of rows."""
    static = repr((config, drafter, target.name, key.ndim, str(jax.random.key_impl(key))))
    return _digest(re.sub(r" at 0x[0-9a-fA-F]+", "", static))  # the drafter's functions print their addresses


def _agree_on_inputs(
    pd: Any, error: Exception | None, target: Model, drafter, plan: DecodePlan, process_local: bool, global_b: int
) -> tuple[int, int, int]:
    """A collective after ``jspec.decode.prepare`` in every process (``pd``: its result, None where ``error``
    says why it failed): refuses, in every process and in this order, rows a process refused; with
    process_local=False, inputs that are not the same everywhere; decode settings, drafters or kinds of seed
    that differ (the program's static parts); with process_local=True, one key for the whole batch that differs
    between processes, and rows held by several processes (a data axis smaller than the process count, or row
    blocks that span processes) whose inputs differ between them (their devices would take different copies).
    Returns the widest prompt width, stop-id width and logit-bias width (every process must compile the same
    shapes; process-local rows with more ids in one process than another are padded to the widest)."""
    n_rows = global_b if process_local else 0  # global_b and process_local are agreed on by now
    values = [0] * (6 + n_rows)
    if error is None:
        i = pd.inputs
        prompt, plen, mnew, sampling, key = i.prompt, i.prompt_len, i.max_new, i.sampling, i.key
        prompt, plen, mnew = np.asarray(prompt), np.asarray(plen), np.asarray(mnew)
        samp = [np.asarray(getattr(sampling, f.name)) for f in dataclasses.fields(SamplingParams)]
        key_data = np.asarray(jax.random.key_data(key))
        if not process_local:
            # Every process claims to hold the whole batch: each device would take its rows from its own process's
            # copy, so copies that differ would be mixed silently. Compared before the settings, which hold
            # input-derived fields (the cache slots follow the prompts and budgets when max_len is not given).
            values[0] = _digest(prompt, plen, mnew, *samp, key_data)
        values[1] = static_digest(pd.config, drafter, target, key)
        if process_local and key.ndim == 0:  # one key for the batch: the same in every process
            values[2] = _digest(key_data)
        values[3] = prompt.shape[1]
        values[4], values[5] = sampling.stop_ids.shape[1], sampling.bias_ids.shape[1]
        if process_local:  # per global row, among the processes that hold it (0: a row this process lacks)
            held = local_rows(plan.rows((global_b,), global_b), (global_b,))
            for j, r in enumerate(held.tolist()):
                own_key = key_data[j] if key.ndim == 1 else key_data[:0]
                fields = _row_fields(sampling, j)  # without padding: processes may pad a row to other widths
                values[6 + r] = _digest(prompt[j, : plen[j]], plen[j], mnew[j], *fields, own_key)
    table = _gather([error is not None, *values])
    _raise_failed(table[:, 0], error, "their rows' inputs or decode options")
    if not process_local:
        _refuse_unequal(
            table[:, 1],
            "process_local=False, but the processes passed different inputs",
            "pass the same prompts and options in every process, or each process's own rows (rows_for_process) "
            "with process_local=True",
        )
    _refuse_unequal(
        table[:, 2],
        "the processes passed different decode settings, drafters or kinds of seed",
        "every process must compile the same program",
    )
    if process_local:
        _refuse_unequal(
            table[:, 3],
            "the processes passed different seeds or keys for the whole batch",
            "one seed (or key) for the batch must be the same in every process; per-row seeds go with their rows",
        )
        rows = table[:, 7:]
        bad = [r for r in range(n_rows) if len(set(rows[:, r][rows[:, r] != 0].tolist())) > 1]
        if bad:
            raise ValueError(
                f"process_local=True, but processes that hold the same rows passed different inputs for row(s) "
                f"{bad[:16]}{' ...' if len(bad) > 16 else ''}: every process holding a row (rows_for_process) must "
                "pass the same prompt, budget, sampling parameters and seed for it, or its devices would decode "
                "different copies of it"
            )
    return int(table[:, 4].max()), int(table[:, 5].max()), int(table[:, 6].max())


def _row_fields(sampling: SamplingParams, j: int) -> list[np.ndarray]:
    """Row j's sampling fields with the unused (-1) id slots left out."""
    out = []
    for f in dataclasses.fields(SamplingParams):
        a = np.asarray(getattr(sampling, f.name))[j]
        if f.name in ("stop_ids", "bias_ids"):
            a = a[a >= 0]
        elif f.name == "bias":
            a = a[np.asarray(sampling.bias_ids)[j] >= 0]
        out.append(a)
    return out


def _pad_width(a: np.ndarray, width: int, fill) -> np.ndarray:
    """[B, W] -> [B, width] (width >= W), the new slots ``fill``."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)


def _asks_penalties(kwargs: dict) -> bool:
    """Whether decode keyword arguments ask for a repetition / presence / frequency penalty in some row (a value
    that is not a number counts as asking: ``jspec.decode.prepare`` then names the problem)."""
    for name, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        try:
            if np.any(np.asarray(kwargs.get(name, off), dtype=np.float64) != off):
                return True
        except (TypeError, ValueError):
            return True
    return bool(kwargs.get("penalties"))


MAX_SLOTS = 2**31 - 1  # a cache size must fit the int32 the agreement gathers carry (and the positions)


def cache_need(target: Model, drafter: Any, prompts: Sequence[Sequence[int]] | np.ndarray, budget: Any) -> int:
    """The cache slots this process's rows need when ``max_len`` is not given, as ``jspec.decode`` sizes it (the
    last token takes no slot; a tree's scratch; no more than the target's context), in Python ints (no overflow
    whatever the budget). Refuses a size beyond ``MAX_SLOTS``, which no int32 gather or position can carry."""
    if budget is None:
        raise ValueError("max_new_tokens=None (generate until EOS or a full cache) needs max_len")
    lens = [len(p) for p in prompts]
    budgets = np.broadcast_to(np.asarray(budget, dtype=object), (len(lens),)).tolist()
    need = max((n + int(m) - 1 for n, m in zip(lens, budgets)), default=0)
    need += tree_scratch(drafter)  # a tree's scratch, as prepare reserves it
    if target.max_positions is not None:
        need = min(need, target.max_positions)
    # No rows or a budget < 1: prepare names the problem (max_len=0 would be refused first, misleadingly).
    need = max(need, 1)
    if need > MAX_SLOTS:
        raise ValueError(
            f"the rows need a KV cache of {need} slots (prompt + max_new_tokens - 1), more than {MAX_SLOTS} "
            "(an int32): lower max_new_tokens"
        )
    return need


def global_batch(local: int, held: int, data_size: int) -> int:
    """The global batch of a process that passed ``local`` rows and holds ``held`` of the data axis's
    ``data_size`` row blocks: rows split over processes add up, rows several processes hold (the model axis
    spanning processes, or the batch not split at all) count once."""
    if held == 0:
        raise ValueError(
            "this process holds none of the data axis's row blocks (its devices are not in the plan's mesh): "
            "run the decode on a mesh over every process's devices"
        )
    if local % held:
        raise ValueError(
            f"this process passed {local} rows but holds {held} of the {data_size} row blocks of the data "
            "axis: pass the rows of rows_for_process(plan, batch)"
        )
    return local * data_size // held


def prepare_sharded(
    target: Model,
    target_params: Any,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    plan: DecodePlan,
    drafter=None,
    draft_params: Any = None,
    process_local: bool = False,
    donate: bool = True,
    max_len: int | None = None,
    **kwargs,
) -> ShardedDecode:
    """Validate and build a sharded decode; keyword arguments as ``jspec.decode.prepare``.

    target_params / draft_params: already placed on ``plan.mesh`` (``shard_params`` or a restore); their
      shardings become the jit's in_shardings.
    prompts: all B rows, or with ``process_local=True`` only this process's rows (``rows_for_process``), in
      order; per-row keyword arguments (temperature, max_new_tokens, ...) then cover those rows only.
    The batch must be divisible by the data axis (pad it with dummy rows otherwise).

    debug_checks=True is refused (a ValueError): the sharded program is not checkified.

    Several processes: on a mesh over every process's devices, every process calls this alike, and collectives
    compare, in this order, the plan (rules, mesh), the parameters' layouts, ``process_local`` and ``max_len``
    (the first collective, whatever else differs); with process_local=False, then the whole batch of inputs, then
    the decode settings (options, drafter, kind of seed); with process_local=True, then the cache size the rows
    need (when ``max_len`` is not given), then the decode settings, then one seed or key for the batch, then each
    row among the processes that hold it. Any difference is a ValueError in every process, naming it. On a mesh
    of this process's devices only (e.g. ``sharding.mesh.single_device_mesh``) the decode is local: nothing is
    compared with other processes and ``process_local`` changes nothing. A mesh over some processes but not all
    is refused.

    Limit: every process must choose the same kind of mesh. If one process passes a mesh of its own devices only
    while another passes a mesh over every process, the local one skips the agreement collectives (and decodes
    alone) while the other waits in them for good: a hang, not an error, since noticing it would take a
    collective that the local decode never makes.
    """
    cross = _spans_processes(plan.mesh)  # refuses a mesh over some processes only (in each of them)
    error: Exception | None = None
    try:
        tp_sh = _shardings_of(target_params, plan.mesh, "target_params")
        dp_sh = _shardings_of(draft_params, plan.mesh, "draft_params")
    except ValueError as e:  # raised after the first gather below: the other processes must not wait in it
        if not cross:
            raise
        error = e
    global_b = len(prompts)
    if cross:
        # The first collective, the same in every process whatever it was given: the set-up that decides which
        # program each process compiles and which collectives follow (process_local, the plan, the parameter
        # layouts), and the batch of process_local rows.
        setup = _setup_digest(plan, process_local, max_len, target_params, draft_params)
        if process_local and error is None:
            d = plan.data_size
            held = len(local_rows(plan.rows((d,), d), (d,)))  # this process's share of the data axis: held / d
            try:
                global_b = global_batch(len(prompts), held, d)
            except ValueError as e:
                global_b, error = -1, e
        table = _gather([error is not None, setup, len(prompts), global_b, _asks_penalties(kwargs)])
        _refuse_unequal(
            table[:, 1],
            "the processes passed different plans (mesh, rules), parameter layouts, process_local or max_len",
            "every process must pass the same, or they compile different programs whose collectives never meet",
        )
        _raise_failed(table[:, 0], error, "their parameters or rows")
        if table[:, 4].any():  # one process's rows with penalties: every process keeps the token counts
            kwargs = {**kwargs, "penalties": True}
        if process_local and np.any(table[:, 3] != global_b):
            raise ValueError(
                f"the processes' rows ({table[:, 2].tolist()}) make batches of {table[:, 3].tolist()}, not one "
                "batch: pass the rows of rows_for_process(plan, batch) in every process"
            )
        if process_local and max_len is None:  # every process must compile the same cache size
            need, error = 0, None
            try:
                need = cache_need(target, drafter, prompts, kwargs.get("max_new_tokens", 64))
            except Exception as e:  # any error (an OverflowError too): the others must not wait in the gather
                need, error = 0, e
            table = _gather([error is not None, need])
            _raise_failed(table[:, 0], error, "their rows' inputs")
            max_len = -(-int(table[:, 1].max()) // 128) * 128
            if target.max_positions is not None:
                max_len = min(max_len, target.max_positions)
    # This process's rows are checked here, between collectives: a process that refused them while the others
    # went on to the next gather would leave those waiting in it for good.
    pd, error = None, None
    try:
        pd = prepare(
            target, target_params, prompts, drafter=drafter, draft_params=draft_params, max_len=max_len, **kwargs
        )
        if pd.config.debug_checks:
            raise ValueError(
                "debug_checks=True is not supported by a sharded decode (its on-device check would need the "
                "sharded program checkified): check the drafter with jspec.decode.decode(..., debug_checks=True)"
            )
    except Exception as e:  # any error: the other processes must not wait for this one in the gather below
        if not cross:
            raise
        error = e
    widths = _agree_on_inputs(pd, error, target, drafter, plan, process_local, global_b) if cross else None
    if global_b % plan.data_size:
        raise ValueError(
            f"batch {global_b} is not divisible by the data axis ({plan.batch_axis}={plan.data_size}); "
            "pad the batch with dummy rows"
        )
    config = dataclasses.replace(pd.config, constrain=StateConstraint(plan))
    target, drafter = pinned_model(target, plan, plan.target), pinned_drafter(drafter, plan)
    i = pd.inputs
    prompt, plen, mnew, sampling, key = i.prompt, i.prompt_len, i.max_new, i.sampling, i.key
    prompt, plen, mnew = np.asarray(prompt), np.asarray(plen), np.asarray(mnew)
    pw = prompt.shape[1] if widths is None else widths[0]
    prompt = np.pad(prompt, ((0, 0), (0, pw - prompt.shape[1])))
    samp = {f.name: np.asarray(getattr(sampling, f.name)) for f in dataclasses.fields(SamplingParams)}
    if widths is not None:  # as wide as the widest process's rows (-1: an unused slot)
        samp["stop_ids"] = _pad_width(samp["stop_ids"], widths[1], -1)
        samp["bias_ids"] = _pad_width(samp["bias_ids"], widths[2], -1)
        samp["bias"] = _pad_width(samp["bias"], widths[2], 0.0)
    key_data = np.asarray(jax.random.key_data(key))  # [W] or [B, W] (W: the key's words, 2 for threefry)
    per_row_keys = key.ndim == 1
    key_impl = jax.random.key_impl(key)  # a str or a PRNGSpec depending on the JAX version; both hashable

    def rows(x):
        return plan.rows((global_b, *x.shape[1:]), global_b)

    input_shardings = (
        rows(prompt),
        rows(plen),
        rows(mnew),
        SamplingParams(**{k: rows(v) for k, v in samp.items()}),
        rows(key_data) if per_row_keys else plan.replicated(),  # per-row keys [B, ...] go with their rows
    )
    in_shardings = (tp_sh, dp_sh, *input_shardings)
    host = (prompt, plen, mnew, SamplingParams(**samp), key_data)
    abstract = (
        *(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t) for t in (target_params, draft_params)),
        *(jax.tree.map(lambda x: jax.ShapeDtypeStruct((global_b, *x.shape[1:]), x.dtype), t) for t in host[:4]),
        jax.ShapeDtypeStruct((global_b, *key_data.shape[1:]) if per_row_keys else key_data.shape, key_data.dtype),
    )
    # Entries are hashable (NamedSharding, ShapeDtypeStruct), so equal calls reuse one jitted function and
    # its compilation.
    key = (target, drafter, config, plan, key_impl, _freeze(in_shardings), _freeze(abstract))
    fn = _jitted(*key, donate)
    return ShardedDecode(
        fn,
        config,
        plan,
        (target_params, draft_params),
        (prompt, plen, mnew, samp, key_data),
        global_b,
        input_shardings,
        key,
    )
