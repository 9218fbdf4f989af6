"""Where a sharded decode runs, and how its state and models are held to that layout.

A ``DecodePlan`` is a mesh with the target's rules and the draft's; the caller makes it (``make_plan``) and it is
read by placement, multi-process runs (``sharding.distributed``) and the program builder
(``sharding.sharded_decode``). The pins are the plan applied inside the program: ``state_shardings`` and
``StateConstraint`` for the loop state, ``pinned_model`` / ``pinned_drafter`` for the models' logits and caches.
They exist because the partitioner, left to itself, may choose other layouts for the loop's carry and the
logits than the rules table says, and pay for them in collectives every round.

Measured on the tiny test model, mesh 2x4, draft-model speculation (collectives per round, from the HLO):
114 without the model pin (vocab-sharded logits spread collectives through sampling and verification), 37
with it, of which 22 are the model calls' own. The state constraint changes nothing there (propagation
already keeps the cache split) but keeps the state pinned for drafters whose models are not wrapped. No
configuration moved KV-cache data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.model import Model
from jspec.state import DecodeState
from sharding.mesh import check_auto_axes
from sharding.placement import cache_shardings, rows_sharding
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
