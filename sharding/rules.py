"""The one table: logical axis names (what models and caches call their dimensions) -> mesh axes.

Models name their dimensions (``models.llama.param_logical_axes``; the cache's ``jspec.cache.KV_AXES``);
nothing else in the code base mentions mesh axes. A preset is one column of ``TABLE``.

Presets (mesh axes ``data`` x ``model``):
- ``replicated``: every array whole on every device; all devices compute the same thing.
- ``data``: rows of the batch (prompts, decode state, KV cache, activations) split over ``data``; parameters
  replicated. No collectives inside the model; per round only the loop's scalar "any row still running?"
  reductions.
- ``tensor``: Megatron-style tensor parallelism over ``model``: query/KV heads (attention weights and the KV
  cache), the MLP width and the vocabulary (embedding / LM head) split; the batch is not split. Costs two
  all-reduces per layer (after the attention output and MLP down projections) plus the vocabulary ones.
- ``data_tensor``: both at once (rows over ``data``, heads/MLP/vocab over ``model``).

Dimensions never sharded, and why:
- ``embed`` (hidden): the contraction dimension of every projection; splitting it would all-reduce every
  matmul's output, and the residual stream would need its own layout.
- ``head_dim``: the attention dot product contracts it; splitting it adds a reduction per attention.
- ``layers``: the layer loop is a ``lax.scan`` that slices one layer per step; a layer-sharded stack would
  move weights between devices every step (that would be pipelining, which this package does not do).
- ``cache_seq``: a KV write of a few tokens per row is a scatter into the sequence axis; with that axis
  split the write needs the update sharded like the cache (or an all-gather of the cache). The cache is split
  over batch rows and KV heads instead.

Divisibility: a dimension whose size the mesh axis does not divide falls back to replication for that array
(e.g. 3 KV heads on a 2-way ``model`` axis: K/V weights and cache replicated over ``model``, while the 9 query
heads of a 3-way axis would still split). ``describe`` lists such fallbacks. The batch is the exception: the
decode raises instead (see ``sharding.sharded_decode``), because a silently replicated batch is not data
parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import DATA, MODEL

PRESETS = ("replicated", "data", "tensor", "data_tensor")

# fmt: off
# logical axis       replicated  data   tensor  data_tensor
TABLE: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "batch":        (None,       DATA,  None,   DATA),
    "heads":        (None,       None,  MODEL,  MODEL),
    "kv_heads":     (None,       None,  MODEL,  MODEL),
    "mlp":          (None,       None,  MODEL,  MODEL),
    "vocab":        (None,       None,  MODEL,  MODEL),
    "embed":        (None,       None,  None,   None),
    "head_dim":     (None,       None,  None,   None),
    "layers":       (None,       None,  None,   None),
    "cache_seq":    (None,       None,  None,   None),
}
# fmt: on

AxesTree = Any  # a pytree whose leaves are tuples of logical names (one per array dimension)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """One column of the table: ``mapping`` pairs (logical name, mesh axis or None), hashable so it can key a
    jit cache. Build with ``rules(preset)`` or ``rules(preset, vocab=None)`` to override single entries."""

    mapping: tuple[tuple[str, str | None], ...]
    name: str = "custom"

    def __post_init__(self):
        missing = set(TABLE) - {k for k, _ in self.mapping}
        if missing:
            raise ValueError(f"sharding rules {self.name!r} lack entries for {sorted(missing)}")

    def __getitem__(self, logical: str) -> str | None:
        for k, v in self.mapping:
            if k == logical:
                return v
        raise KeyError(
            f"logical axis {logical!r} has no entry in the sharding table (known: {', '.join(TABLE)}); "
            "add it to sharding.rules.TABLE"
        )

    def as_dict(self) -> dict[str, str | None]:
        return dict(self.mapping)

    def replace(self, **overrides: str | None) -> ShardingRules:
        d = self.as_dict()
        for k in overrides:
            if k not in d:
                raise KeyError(f"unknown logical axis {k!r}; known: {', '.join(d)}")
        d.update(overrides)
        return ShardingRules(tuple(d.items()), f"{self.name}+" + ",".join(f"{k}={v}" for k, v in overrides.items()))


def rules(preset: str | ShardingRules = "data_tensor", **overrides: str | None) -> ShardingRules:
    """The rules of a preset (a column of ``TABLE``), optionally with single entries overridden."""
    if isinstance(preset, ShardingRules):
        base = preset
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown sharding preset {preset!r}; choose one of {', '.join(PRESETS)}")
        col = PRESETS.index(preset)
        base = ShardingRules(tuple((k, v[col]) for k, v in TABLE.items()), preset)
    return base.replace(**overrides) if overrides else base


def spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: ShardingRules, fallbacks: list | None = None
) -> PartitionSpec:
    """PartitionSpec of one array from its logical axis names.

    A dimension is split over its mesh axis only if that axis has size > 1, divides the dimension, and is not
    already used by an earlier dimension of the same array; otherwise it is replicated (and, when
    ``fallbacks`` is a list, a note is appended to it).
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out: list[str | None] = []
    for name, size in zip(axes, shape):
        m = rules[name] if name is not None else None
        if m is not None and m not in mesh.shape:
            raise ValueError(f"rules map {name!r} to mesh axis {m!r}, not in mesh axes {tuple(mesh.shape)}")
        if m is None or mesh.shape[m] == 1:
            out.append(None)
        elif size % mesh.shape[m] or m in used:
            if fallbacks is not None:
                why = "already used" if m in used else f"{size} % {mesh.shape[m]} != 0"
                fallbacks.append(f"{name}[{size}] replicated over {m!r} ({why})")
            out.append(None)
        else:
            used.add(m)
            out.append(m)
    while out and out[-1] is None:  # P('data', None) == P('data'); the short form reads better in dumps
        out.pop()
    return PartitionSpec(*out)


# A query head must live with its KV head: splitting query heads while the KV heads stay whole makes the
# partitioner split the (replicated) cache by heads inside the layer loop and all-gather it back every round.
_FOLLOWS = {"heads": "kv_heads"}


def logical_sizes(axes: AxesTree, shapes: Any) -> dict[str, set[int]]:
    """{logical name: the sizes it has across the tree's arrays}. ``shapes`` must have ``axes``' structure
    (a mismatch, e.g. unstacked parameters against stacked axes, would pair names with the wrong sizes)."""
    if shapes is None:
        raise ValueError("logical axes were given without the parameter shapes to fit them to")
    sizes: dict[str, set[int]] = {}

    def add(a, x):
        if len(a) != len(x.shape):
            raise ValueError(f"logical axes {a} do not match shape {tuple(x.shape)}")
        for name, n in zip(a, x.shape):
            if name is not None:
                sizes.setdefault(name, set()).add(int(n))

    try:
        jax.tree.map(add, axes, shapes, is_leaf=_is_axes)
    except ValueError as e:  # jax names the first structural difference
        if "logical axes" in str(e):
            raise
        raise ValueError(f"the parameter shapes do not have the structure of the logical axes: {e}") from e
    return sizes


def fit_rules(rules: ShardingRules, axes: AxesTree, shapes: Any, mesh: Mesh) -> ShardingRules:
    """Rules adjusted to one model on one mesh: a logical axis that some array of the model cannot split
    evenly is replicated everywhere (not only in that array), and query heads are replicated when the KV
    heads are (``_FOLLOWS``): switched off here, mapped to no mesh axis, or to an axis of size 1, while the
    query heads would split. Without this, e.g. 8 query heads over an 8-way ``model`` axis next to 4 KV
    heads would split attention by query head while the cache stays whole, and the cache is all-gathered
    every round. ``describe`` shows the result per parameter."""
    sizes = logical_sizes(axes, shapes)
    off = {}
    for name, ns in sizes.items():
        m = rules[name]
        if m is not None and m in mesh.shape and any(n % mesh.shape[m] for n in ns):
            off[name] = None

    def splits(axis: str | None) -> bool:
        return axis is not None and mesh.shape.get(axis, 1) > 1

    for name, leader in _FOLLOWS.items():
        # Switched off for divisibility: the follower too. Left whole by the rules (None, or an axis of size 1):
        # the follower only where it would split (so a data-only mesh keeps the preset as it is).
        if rules[name] is not None and (leader in off or (not splits(rules[leader]) and splits(rules[name]))):
            off[name] = None
    return rules.replace(**off) if off else rules


def named(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, shape, mesh, rules))


def tree_shardings(axes: AxesTree, shapes: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """NamedSharding per leaf. ``axes``: pytree of logical-name tuples; ``shapes``: the same pytree with
    arrays or ``jax.ShapeDtypeStruct`` leaves (anything with ``.shape``)."""
    return jax.tree.map(lambda a, x: named(a, x.shape, mesh, rules), axes, shapes, is_leaf=_is_axes)


def spec_str(s: PartitionSpec) -> str:
    """'P(None, 'data', 'model')', the same on every JAX version (reprs differ)."""
    return "P(" + ", ".join(repr(x) for x in tuple(s)) + ")"


def describe(axes: AxesTree, shapes: Any, mesh: Mesh, rules: ShardingRules) -> dict[str, str]:
    """{'path': 'PartitionSpec (fallback notes)'} for every leaf: what a preset does to a model, on a mesh.
    ``shapes`` must have ``axes``' structure (as for ``logical_sizes``): a ValueError names the difference."""
    out = {}
    flat_axes, treedef = jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)
    try:
        flat_shapes = treedef.flatten_up_to(shapes)
    except (ValueError, TypeError) as e:  # zipping two flattenings would pair names with the wrong arrays
        raise ValueError(f"the parameter shapes do not have the structure of the logical axes: {e}") from e
    for (path, a), x in zip(flat_axes, flat_shapes, strict=True):
        notes: list[str] = []
        s = spec_str(spec(a, x.shape, mesh, rules, notes))
        out[jax.tree_util.keystr(path)] = s + (f"  ({'; '.join(notes)})" if notes else "")
    return out


def table_markdown() -> str:
    """The table as markdown, for the README."""
    lines = ["| logical axis | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 1) + "|"]
    for k, cols in TABLE.items():
        lines.append(f"| {k} | " + " | ".join(c or "-" for c in cols) + " |")
    return "\n".join(lines)
