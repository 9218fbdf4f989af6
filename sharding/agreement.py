"""Multi-process agreement: the collectives by which every process of a sharded decode checks, before
compiling, that all of them will run the same program on the same inputs.

Why: on several processes each one compiles and runs its own copy of the program, and the collectives of two
programs that differ never meet (a hang, not an error), while rows that differ between the processes holding
them would be mixed silently. So ``sharding.sharded_decode.prepare_sharded`` gathers digests of what each
process was given and refuses, in every process alike, any difference, naming it; a process whose own check
failed still joins the gather, so that none is left waiting in it. Each function here is either such a
collective (every process calls it at the same point) or computes what one carries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh

from jspec.model import Model
from jspec.sampling import SamplingParams
from jspec.state import DecodeConfig
from jspec.validate import tree_scratch
from sharding.placement import local_rows
from sharding.plan import DecodePlan


def spans_processes(mesh: Mesh) -> bool:
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


def gather(values: Sequence[int]) -> np.ndarray:
    """A collective (every process calls it at the same point, with as many values): every process's ``values``
    (int32) as a [processes, len(values)] table, the same in every process."""
    row = np.asarray(values, np.int32)
    return np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)


def raise_failed(failed: np.ndarray, error: Exception | None, what: str) -> None:
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


def refuse_unequal(column: np.ndarray, what: str, hint: str) -> None:
    """Refuses (in every process: each sees the same table) a gathered value that differs between processes."""
    if np.any(column != column[0]):
        groups = [np.nonzero(column == v)[0].tolist() for v in dict.fromkeys(column.tolist())]
        raise ValueError(f"{what} (groups of equal ones: {groups}): {hint}")


def setup_digest(plan: DecodePlan, process_local: bool, max_len: int | None, target_params: Any, draft_params: Any):
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


def agree_on_inputs(
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
    table = gather([error is not None, *values])
    raise_failed(table[:, 0], error, "their rows' inputs or decode options")
    if not process_local:
        refuse_unequal(
            table[:, 1],
            "process_local=False, but the processes passed different inputs",
            "pass the same prompts and options in every process, or each process's own rows (rows_for_process) "
            "with process_local=True",
        )
    refuse_unequal(
        table[:, 2],
        "the processes passed different decode settings, drafters or kinds of seed",
        "every process must compile the same program",
    )
    if process_local:
        refuse_unequal(
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


def asks_penalties(kwargs: dict) -> bool:
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
