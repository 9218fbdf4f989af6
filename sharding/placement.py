"""Putting arrays where the table says: parameters, KV caches, the decode state.

Single process: ``jax.device_put``. Multiple processes (``jax.distributed``): every process holds only its
own devices' shards, so a global array is assembled from host data with ``jax.make_array_from_callback``
(every process passes the same global value, e.g. params initialised from one seed or read from one
checkpoint) or with ``jax.make_array_from_process_local_data`` (each process passes only its rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jspec.cache import KV_AXES
from sharding.rules import AxesTree, ShardingRules, named, tree_shardings


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """Place one array whose global value every process knows (host data), or re-lay out a ``jax.Array``
    that already spans the processes (a restored checkpoint: ``np.asarray`` of it would fail on the shards
    this process cannot address)."""
    if (
        jax.process_count() == 1
        or sharding.is_fully_addressable  # a mesh of this process's devices only: nothing to assemble
        or (isinstance(x, jax.Array) and not x.is_fully_addressable)
    ):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # each process builds only its addressable shards from the full host copy
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def put_tree(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(put, tree, shardings)


def put_rows(local: Any, sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> jax.Array:
    """Place local [B_local, ...] rows (this process's ``local_rows``) of a global [B, ...] array."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:  # this process's devices only: local is global
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(local), global_shape)


def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """Indices along dimension 0 of the global array that this process's devices hold, ascending: the rows a
    process must build itself when inputs are made per process."""
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*idx[0].indices(global_shape[0])))
    return np.asarray(sorted(rows), np.int64)


def param_shardings(axes: AxesTree, params: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """NamedSharding per parameter (``params`` may be arrays or ``jax.ShapeDtypeStruct``)."""
    return tree_shardings(axes, params, mesh, rules)


def shard_params(params: Any, axes: AxesTree | None, mesh: Mesh, rules: ShardingRules) -> Any:
    """Place a parameter tree on ``mesh`` following the table. ``axes=None`` replicates every leaf (for a
    drafter whose parameters carry no logical names)."""
    if axes is None:
        return put_tree(params, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params))
    return put_tree(params, param_shardings(axes, params, mesh, rules))


def shard_abstract(params: Any, axes: AxesTree | None, mesh: Mesh | AbstractMesh, rules: ShardingRules) -> Any:
    """``shard_params`` without data: ``jax.ShapeDtypeStruct``s carrying the table's shardings, on a mesh that
    may be a ``jax.sharding.AbstractMesh`` (a machine this host is not: ``ShardedDecode.export`` lowers for it).
    ``params``: arrays or ShapeDtypeStructs (``models.llama.abstract_params``)."""
    if axes is None:
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
    else:
        shardings = param_shardings(axes, params, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)


def is_kv_cache(x: Any) -> bool:
    """A cache with the [L, B, Hkv, S, D] layout of ``jspec.cache.KVCache`` (duck-typed, so drafters' own
    cache classes with ``k``/``v``/``lengths`` are recognised too)."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and all(hasattr(x, f) for f in ("k", "v", "lengths"))
        and getattr(x.k, "ndim", 0) == len(KV_AXES)
    )


def rows_sharding(mesh: Mesh, batch_axis: str | None, shape: tuple[int, ...], batch: int) -> NamedSharding:
    """Split dimension 0 over the batch axis when it is the batch dimension; otherwise replicate."""
    size = mesh.shape[batch_axis] if batch_axis is not None else 1
    if size > 1 and len(shape) >= 1 and shape[0] == batch and batch % size == 0:
        return NamedSharding(mesh, PartitionSpec(batch_axis))
    return NamedSharding(mesh, PartitionSpec())


def cache_shardings(cache: Any, mesh: Mesh, rules: ShardingRules, batch: int) -> Any:
    """Shardings for any pytree that may contain KV caches (a cache, a drafter's state, the decode state):
    K/V arrays follow ``KV_AXES`` (batch and KV heads split, never the sequence), and so does every other leaf
    of a cache laid out like them ([L, B, Hkv, *, D]: a compressed cache's block summaries and scratch pad);
    every other leaf is split over the batch axis when its leading dimension is the batch (B), else
    replicated."""
    batch_axis = rules["batch"]

    def leaf(x):
        return rows_sharding(mesh, batch_axis, tuple(x.shape), batch)

    def node(x):
        if not is_kv_cache(x):
            return leaf(x)
        k = tuple(x.k.shape)

        def in_cache(y):
            s = tuple(y.shape)
            if len(s) == len(KV_AXES) and s[:3] == k[:3] and s[4] == k[4]:
                return named(KV_AXES, s, mesh, rules)
            return leaf(y)

        return jax.tree.map(in_cache, x)

    return jax.tree.map(node, cache, is_leaf=is_kv_cache)
