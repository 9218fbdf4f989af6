"""Orbax checkpoints of (sharded) target and draft parameters, restorable onto any mesh.

A checkpoint stores each array with its global shape; the layout it had when saved does not matter on
restore, because every leaf is restored against a ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``
target built from the table for the new mesh: a 2x4-mesh checkpoint restores onto 4x2, onto 8x1 or onto a
single device (``sharding.mesh.single_device_mesh``), optionally in another dtype. Restoring without
target shardings on another topology fails in orbax ("Topology mismatch"), so ``restore`` always builds
them.

Multi-process: every process calls ``save`` / ``restore`` with the same arguments (orbax writes each shard
once and coordinates through ``jax.distributed``).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import AxesTree, ShardingRules, fit_rules, tree_shardings

TARGET = "target"
DRAFT = "draft"


def save(path: str | os.PathLike, tree: Any, *, force: bool = False) -> None:
    """Save a pytree of arrays (sharded or not) and wait until it is on disk. ``path`` must not exist unless
    ``force``; it is made absolute because orbax requires it."""
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(path), tree, force=force)
    ckpt.wait_until_finished()


def stored_shapes(path: str | os.PathLike) -> Any:
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (no sharding), read from the metadata."""
    meta = ocp.StandardCheckpointer().metadata(os.path.abspath(path))
    # orbax >= 0.11 wraps the tree (StepMetadata.item_metadata.tree); older versions return it bare.
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def _check_dtype(dtype: Any) -> None:
    """A restore dtype must be a floating-point one: it recasts weights, and an integer dtype would truncate them."""
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(
            f"dtype={jnp.dtype(dtype)} is not a floating-point dtype: a restore recasts the floating-point leaves "
            "(weights) to it, and an integer dtype would truncate them (give e.g. bfloat16 or float32, or None)"
        )


def abstract(shapes: Any, shardings: Any, dtype: Any = None) -> Any:
    """ShapeDtypeStruct targets: the leaves of ``shapes`` (anything with shape/dtype) with ``shardings``;
    ``dtype`` (a floating-point dtype; others are refused) recasts the floating-point leaves only (token-id maps
    stay integers: 1025 in bf16 is 1024)."""
    _check_dtype(dtype)

    def leaf(x, s):
        cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(tuple(x.shape), dtype if cast else x.dtype, sharding=s)

    return jax.tree.map(leaf, shapes, shardings)


def restore(path: str | os.PathLike, target: Any) -> Any:
    """Restore against a tree of ``jax.ShapeDtypeStruct`` with shardings (see ``abstract``)."""
    return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)


def restore_params(
    path: str | os.PathLike,
    axes: AxesTree | None,
    mesh: Mesh,
    rules: ShardingRules,
    *,
    shapes: Any = None,
    dtype: Any = None,
) -> Any:
    """Restore a parameter tree onto ``mesh`` with the table's layout (``axes`` None: replicated).

    shapes: the expected tree (e.g. ``models.llama.param_shapes`` as ShapeDtypeStructs, or arrays); default:
      read from the checkpoint. dtype: a floating-point dtype (e.g. bfloat16) the floating-point leaves are
      recast to on restore; other leaves (integers) keep their stored dtype; default: every leaf as stored.
    """
    _check_dtype(dtype)  # before reading anything
    shapes = stored_shapes(path) if shapes is None else shapes
    if axes is None:
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), shapes)
    else:
        shardings = tree_shardings(axes, shapes, mesh, rules)
    return restore(path, abstract(shapes, shardings, dtype))


def save_decode_params(path: str | os.PathLike, target_params: Any, draft_params: Any = None, **kw) -> None:
    """Target and draft parameters in one checkpoint (items ``target`` and ``draft``)."""
    tree = {TARGET: target_params}
    if draft_params is not None:
        tree[DRAFT] = draft_params
    save(path, tree, **kw)


def restore_decode_params(
    path: str | os.PathLike,
    mesh: Mesh,
    target_rules: ShardingRules,
    target_axes: AxesTree,
    draft_rules: ShardingRules | None = None,
    draft_axes: AxesTree | None = None,
    *,
    dtype: Any = None,
) -> tuple[Any, Any]:
    """(target_params, draft_params or None) onto ``mesh``; the draft gets its own rules (e.g. replicated
    next to a tensor-parallel target: ``rules('data')``), defaulting to the target's. Both are fitted to the
    stored shapes on this mesh (``fit_rules``), so rules fitted for the mesh the checkpoint was saved from
    cannot leave query heads split over KV heads that this one replicates. Without ``draft_axes`` a stored
    draft is restored whole on every device (and ``draft_rules`` cannot be given). dtype: as ``restore_params``'s
    (floating-point leaves only)."""
    _check_dtype(dtype)
    shapes = stored_shapes(path)
    tr = fit_rules(target_rules, target_axes, shapes[TARGET], mesh)
    shardings = {TARGET: tree_shardings(target_axes, shapes[TARGET], mesh, tr)}
    if draft_rules is not None and draft_axes is None:
        raise ValueError("draft_rules were given without draft_axes: the draft cannot be laid out without its axes")
    if DRAFT in shapes:
        if draft_axes is None:
            shardings[DRAFT] = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), shapes[DRAFT])
        else:
            dr = fit_rules(draft_rules or target_rules, draft_axes, shapes[DRAFT], mesh)
            shardings[DRAFT] = tree_shardings(draft_axes, shapes[DRAFT], mesh, dr)
    out = restore(path, abstract(shapes, shardings, dtype))
    return out[TARGET], out.get(DRAFT)
