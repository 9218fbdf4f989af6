"""Device meshes with named axes.

The decode shards over two named axes: ``data`` (rows of the batch) and ``model`` (attention heads, MLP
width, vocabulary). A mesh shape may leave one axis as -1 to take every device the others leave over, so the
same command line works on 1, 8 or 256 devices.

Axis types are chosen, never defaulted: ``jax.make_mesh`` defaults to Explicit axes (in jax >= 0.7) while
``jax.sharding.Mesh`` defaults to Auto. jspec uses **Auto**: the model and decode code carry no sharding
annotations (no ``out_sharding=`` on contractions or gathers), so under Explicit axes a head-sharded einsum or
a vocab-sharded embedding lookup would be a type error, and ``with_sharding_constraint`` would only assert.
Under Auto, the shardings given to ``jax.jit`` at the boundary plus the decode's per-round constraint
(``DecodeConfig.constrain``) are propagated by the SPMD partitioner through the unannotated model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
MODEL = "model"
DEFAULT_AXES = (DATA, MODEL)


def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Fill at most one -1 entry so that the product equals ``num_devices``.

    >>> resolve_shape((2, -1), 8)
    (2, 4)
    """
    shape = tuple(int(s) for s in shape)
    free = [i for i, s in enumerate(shape) if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh shape {shape}: at most one axis may be -1 (fill the rest)")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: sizes must be positive (or -1 for one axis)")
    fixed = math.prod(s for s in shape if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh shape {shape}: {num_devices} devices are not a multiple of {fixed}")
        shape = tuple(num_devices // fixed if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, but {num_devices} are used")
    return shape


def parse_shape(text: str) -> dict[str, int]:
    """'data=2,model=-1' or '2x4' (data x model) -> {'data': 2, 'model': 4}; for command lines."""
    text = text.strip()
    form = "'data=2,model=4' or '2x4' (data x model)"

    def size(s: str) -> int:
        try:
            return int(s)
        except ValueError:
            raise ValueError(f"mesh shape {text!r}: {s.strip()!r} is not an axis size; write it as {form}") from None

    if "=" in text:
        out: dict[str, int] = {}
        for part in text.split(","):
            name, eq, n = (x.strip() for x in part.partition("="))
            if not eq or not name:
                raise ValueError(f"mesh shape {text!r}: {part.strip()!r} is not name=size; write it as {form}")
            if name in out:
                raise ValueError(f"mesh shape {text!r}: axis {name!r} is given twice")
            out[name] = size(n)
        return out
    sizes = [size(s) for s in text.lower().split("x")]
    if len(sizes) != len(DEFAULT_AXES):
        raise ValueError(f"mesh shape {text!r}: expected {len(DEFAULT_AXES)} sizes like '2x4' (data x model)")
    return dict(zip(DEFAULT_AXES, sizes))


def check_auto_axes(mesh: Mesh) -> None:
    """Refuses a mesh with an axis that is not ``AxisType.Auto`` (``jax.make_mesh``'s default is Explicit): the
    model and decode code carry no sharding annotations, so under Explicit axes a sharded decode would fail deep
    in tracing (a head-sharded contraction without ``out_sharding=``), far from the cause."""
    types = tuple(getattr(mesh, "axis_types", None) or ())
    if any(t != AxisType.Auto for t in types):
        names = tuple(getattr(mesh, "axis_names", ()))
        found = ", ".join(f"{n}={t}" for n, t in zip(names, types))
        raise ValueError(
            f"the mesh's axis types are {found}, but a sharded decode needs every axis Auto (the model code carries "
            "no sharding annotations): build the mesh with sharding.mesh.make_mesh, or pass "
            "axis_types=(jax.sharding.AxisType.Auto,) * n to jax.make_mesh"
        )


def make_mesh(
    shape: Mapping[str, int] | Sequence[int] = (-1, 1),
    axis_names: Sequence[str] = DEFAULT_AXES,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType = AxisType.Auto,
) -> Mesh:
    """A mesh over ``devices`` (default: every device of every process) with named axes.

    shape: sizes per axis, as a sequence aligned with ``axis_names`` or a mapping ``{name: size}``; one size
      may be -1 (fills the rest). The default ``(-1, 1)`` is pure data parallelism over all devices.
    axis_types: one type for every axis; only Auto is accepted (see the module docstring); kept as a parameter so
      that a caller passing Explicit gets a clear refusal here rather than a failure deep in a decode's tracing.

    Device order comes from ``jax.make_mesh`` (topology-aware on TPU/GPU: the ``model`` axis, last, gets the
    fastest links). Across processes the leading axis varies slowest, so with ``data`` first each process
    holds whole batch rows and the model-axis collectives stay inside a host when ``model`` fits on one.
    """
    if axis_types != AxisType.Auto:
        raise ValueError(
            f"axis_types={axis_types}: the decode needs Auto mesh axes (the model code carries no sharding "
            "annotations, which Explicit axes require); leave axis_types at its default"
        )
    if isinstance(shape, Mapping):
        unknown = set(shape) - set(axis_names)
        if unknown:
            raise ValueError(f"mesh axes {sorted(unknown)} are not among {tuple(axis_names)}")
        shape = [shape.get(name, 1) for name in axis_names]
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} does not match axis names {tuple(axis_names)}")
    devs = list(devices) if devices is not None else jax.devices()
    sizes = resolve_shape(shape, len(devs))
    types = (axis_types,) * len(sizes)
    if devices is None:
        return jax.make_mesh(sizes, tuple(axis_names), axis_types=types)
    return Mesh(np.asarray(devs, dtype=object).reshape(sizes), tuple(axis_names), axis_types=types)


def single_device_mesh(device: jax.Device | None = None, axis_names: Sequence[str] = DEFAULT_AXES) -> Mesh:
    """A 1x1 mesh on one device (default: this process's first, which it can address even when several
    processes run): the same code path as a real mesh, with nothing sharded."""
    return make_mesh((1,) * len(axis_names), axis_names, devices=[device or jax.local_devices()[0]])
