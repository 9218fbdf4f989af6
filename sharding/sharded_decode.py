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

The plan and its pins are ``sharding.plan``; the checks by which several processes agree on one program are
``sharding.agreement``. This module builds the jitted program and the call that runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jspec.decode import prepare
from jspec.loop import decode_round, generate_arrays, prefill
from jspec.model import Model
from jspec.sampling import SamplingParams
from jspec.state import DecodeConfig, DecodeOutput, DecodeState, to_output
from jspec.stream import DecodeStream
from sharding.agreement import (
    agree_on_inputs,
    asks_penalties,
    cache_need,
    gather,
    global_batch,
    raise_failed,
    refuse_unequal,
    setup_digest,
    spans_processes,
)
from sharding.placement import local_rows, put, put_rows
from sharding.plan import (
    DecodePlan,
    StateConstraint,
    make_plan,
    pinned_drafter,
    pinned_model,
    state_shardings,
)

# The plan's names are imported from here too (``from sharding.sharded_decode import make_plan, prepare_sharded``).
__all__ = [
    "DecodePlan",
    "ShardedDecode",
    "StateConstraint",
    "gather_output",
    "make_plan",
    "pinned_drafter",
    "pinned_model",
    "prepare_sharded",
    "state_shardings",
]


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


def _pad_width(a: np.ndarray, width: int, fill) -> np.ndarray:
    """[B, W] -> [B, width] (width >= W), the new slots ``fill``."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)


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
    cross = spans_processes(plan.mesh)  # refuses a mesh over some processes only (in each of them)
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
        setup = setup_digest(plan, process_local, max_len, target_params, draft_params)
        if process_local and error is None:
            d = plan.data_size
            held = len(local_rows(plan.rows((d,), d), (d,)))  # this process's share of the data axis: held / d
            try:
                global_b = global_batch(len(prompts), held, d)
            except ValueError as e:
                global_b, error = -1, e
        table = gather([error is not None, setup, len(prompts), global_b, asks_penalties(kwargs)])
        refuse_unequal(
            table[:, 1],
            "the processes passed different plans (mesh, rules), parameter layouts, process_local or max_len",
            "every process must pass the same, or they compile different programs whose collectives never meet",
        )
        raise_failed(table[:, 0], error, "their parameters or rows")
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
            table = gather([error is not None, need])
            raise_failed(table[:, 0], error, "their rows' inputs")
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
    widths = agree_on_inputs(pd, error, target, drafter, plan, process_local, global_b) if cross else None
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
