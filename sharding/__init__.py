"""Sharded speculative decoding: meshes, the logical-axis table, placement, the jitted sharded decode,
multi-process runs and checkpoints. See "Sharded and multi-host decoding" in README.md.

    mesh = make_mesh({"data": 2, "model": -1})
    plan = make_plan(mesh, "data_tensor", draft="data")
    tp = shard_params(params, param_logical_axes(cfg), mesh, plan.target)
    out = prepare_sharded(model, tp, prompts, plan=plan, drafter=..., draft_params=...).run()
"""

from sharding.mesh import DATA, MODEL, make_mesh, parse_shape, resolve_shape, single_device_mesh
from sharding.placement import (
    cache_shardings,
    local_rows,
    param_shardings,
    put,
    put_rows,
    put_tree,
    shard_abstract,
    shard_params,
)
from sharding.plan import DecodePlan, StateConstraint, make_plan, state_shardings
from sharding.rules import PRESETS, TABLE, ShardingRules, describe, rules, spec, table_markdown, tree_shardings
from sharding.sharded_decode import ShardedDecode, gather_output, prepare_sharded

__all__ = [
    "shard_abstract",
    "DATA",
    "MODEL",
    "PRESETS",
    "TABLE",
    "DecodePlan",
    "ShardedDecode",
    "ShardingRules",
    "StateConstraint",
    "cache_shardings",
    "describe",
    "gather_output",
    "local_rows",
    "make_mesh",
    "make_plan",
    "param_shardings",
    "parse_shape",
    "prepare_sharded",
    "put",
    "put_rows",
    "put_tree",
    "resolve_shape",
    "rules",
    "shard_params",
    "single_device_mesh",
    "spec",
    "state_shardings",
    "table_markdown",
    "tree_shardings",
]
