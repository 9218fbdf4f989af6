"""The sharded decode and the serving engine's step lower for TPU and CUDA, on this CPU host (``jax.export``).

The sharded programs are built on abstract meshes of 8 and 16 devices (``jax.sharding.AbstractMesh``: no device
of them exists here) with the rules table fitted to the model, params that are only shapes carrying the table's
shardings (``sharding.shard_abstract``) in the layout jspec picks for the platform (stacked layers on TPU, the
per-layer layout on CUDA), and checked as the unsharded ones are (``tests/lowering.py``). Collectives
only exist after XLA partitions the program on its target, so here the module must hold none, and the KV cache
it returns must be laid out as the table says: batch over data, KV heads over the model axis where they divide,
never the sequence. The collectives XLA inserts per round are counted on 8 fake CPU devices
(``tests/test_sharding_devices.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest
from jax.sharding import AbstractMesh
from lowering import PLATFORMS, analyze, result_shardings
from test_lowering import BACKEND, DRAFT_LAYERS, drafters, target

from jspec.cache import KV_AXES
from jspec.loaders import wants_unstacked
from jspec.serve import Engine
from models import shapes
from models.draft import draft_config
from models.llama import abstract_params, logical_axes, make_model, unstack_layers
from sharding import make_plan, prepare_sharded, shard_abstract
from sharding.mesh import DATA, MODEL
from sharding.rules import spec

MESHES = {  # name -> (data, model)
    "8-data": (8, 1),
    "8-tensor": (1, 8),
    "8-data-tensor": (2, 4),
    "16-tensor": (1, 16),
}
# Llama 3.1 8B's shapes (heads, KV heads, hidden, FFN, vocabulary: every dimension the rules table splits) with 4 of
# its 32 layers: the table lays out each layer alike and the checks do not depend on the count, while the per-layer
# (CUDA) layout traces every layer on its own (the 32-layer exports took ~3x as long). The full layer count lowers
# sharded in test_smollm2_shapes_lower_sharded_with_unsplittable_heads (SmolLM2's 30) and unsharded with 8B's 32
# in test_lowering.py.
LLAMA_8B_SHAPES = dataclasses.replace(shapes.LLAMA_3_1_8B, num_layers=4, name="llama-3.1-8b-4-layers")
ALL_PATHS = (
    "plain", "ngram", "draft-chain", "block-verify", "static-tree", "dynamic-tree", "eagle-chain", "eagle-tree",
    "eagle-dynamic-tree", "layerskip",
)  # fmt: skip
MODEL_DRAFTS = ("draft-chain", "block-verify", "static-tree", "dynamic-tree")
OPTIONS = dict(max_new_tokens=16, temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=True)


@functools.cache
def sharded(cfg, mesh_name: str, path: str, platform: str):
    """The ``ShardedDecode`` of ``path`` on an abstract mesh, in the layout jspec picks for the platform under a
    mesh: stacked layers on TPU, the unfused per-layer layout (``unstack_layers(fused=False)``) on CUDA."""
    data, model = MESHES[mesh_name]
    mesh = AbstractMesh((data, model), (DATA, MODEL))
    params = abstract_params(cfg)
    drafter, dparams, extra = drafters(cfg, "tpu")[path]  # stacked draft params, laid out below
    per_layer = wants_unstacked("auto", BACKEND[platform])
    if per_layer:
        params = jax.eval_shape(functools.partial(unstack_layers, fused=False), params)
        if path in MODEL_DRAFTS:
            dparams = jax.eval_shape(functools.partial(unstack_layers, fused=False), dparams)
    axes = logical_axes(cfg, params)
    dcfg = draft_config(cfg, DRAFT_LAYERS)
    draft_axes = logical_axes(dcfg.llama, dparams) if path in MODEL_DRAFTS else None
    plan = make_plan(
        mesh, "data_tensor", target_axes=axes, target_shapes=params,
        draft_axes=draft_axes, draft_shapes=dparams if draft_axes else None,
    )  # fmt: skip
    tp = shard_abstract(params, axes, mesh, plan.target)
    if path in MODEL_DRAFTS:
        dp = shard_abstract(dparams, draft_axes, mesh, plan.draft_rules)
    elif dparams is not None:  # EAGLE, LayerSkip: the target's own params, then the drafter's (replicated)
        dp = (tp, shard_abstract(dparams[1], None, mesh, plan.target) if dparams[1] is not None else None)
    else:
        dp = None
    prompts = [list(range(5 + r, 20 + 2 * r)) for r in range(max(data, 2))]
    sd = prepare_sharded(make_model(cfg), tp, prompts, plan=plan, drafter=drafter, draft_params=dp, **OPTIONS, **extra)
    return sd, mesh, plan


def check_sharded(cfg, mesh_name: str, path: str, platform: str) -> list[tuple[str, ...]]:
    """Export and check; returns the exported cache's layout per dimension."""
    sd, mesh, plan = sharded(cfg, mesh_name, path, platform)
    what = f"{path} on {cfg.name}, mesh {mesh_name}, for {platform}"
    try:
        text = sd.export((platform,)).mlir_module()
    except Exception as e:
        raise AssertionError(f"{what} does not lower: {type(e).__name__}: {e}") from e
    problems = analyze(text).problems(platform)
    assert not problems, f"{what}: " + "; ".join(problems)
    got = result_shardings(text)["result.cache.k"]
    shape = (cfg.num_layers, sd.global_batch, cfg.num_kv_heads, sd.config.slots, cfg.head_dim)
    want = [() if a is None else (a,) for a in spec(KV_AXES, shape, mesh, plan.target)]
    want += [()] * (len(shape) - len(want))
    assert got == want, f"{what}: the KV cache is laid out {got}, the table says {want}"
    assert got[3] == () and got[4] == (), f"{what}: the cache's sequence or head dim is split: {got}"
    return got


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_every_sharded_path_lowers_on_a_data_by_tensor_mesh(path, platform):
    check_sharded(LLAMA_8B_SHAPES, "8-data-tensor", path, platform)


# The other meshes, each with another drafter (every path runs on the data x tensor mesh above), one per partition
# rule: the batch alone split (8-data), the KV heads split as far as they go (8 over 8-tensor), and a model axis
# wider than the KV heads (8 over 16-tensor: the fitted table keeps them whole). A 16-device data mesh and a 4x4
# data x tensor mesh apply the rules of 8-data and 8-data-tensor (the same model axis) to another batch: not
# repeated.
OTHER_MESHES = [
    ("8-data", "ngram"),
    ("8-tensor", "draft-chain"),
    ("16-tensor", "layerskip"),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mesh_name,path", OTHER_MESHES, ids=[f"{m}-{p}" for m, p in OTHER_MESHES])
def test_sharded_decode_lowers_on_8_and_16_device_meshes(mesh_name, path, platform):
    check_sharded(LLAMA_8B_SHAPES, mesh_name, path, platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_smollm2_shapes_lower_sharded_with_unsplittable_heads(platform):
    # 3 KV heads over a 4-way model axis: the fitted table keeps heads whole, the batch still splits.
    assert check_sharded(shapes.SMOLLM2_135M, "8-data-tensor", "eagle-tree", platform)[1:3] == [(DATA,), ()]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("path,rounds", [("ngram", 1), ("eagle-tree", 4)])
def test_the_engine_step_lowers(path, rounds, platform):
    cfg = shapes.SMOLLM2_135M
    model, params = target(cfg, platform)
    drafter, dparams, extra = drafters(cfg, platform)[path]
    engine = Engine(
        model, params, batch=4, max_len=256, drafter=drafter, draft_params=dparams, rounds_per_sync=rounds,
        logprobs=True, top_logprobs=2, penalties=True, max_logit_bias=2, **extra,
    )  # fmt: skip
    text = engine.export((platform,)).mlir_module()
    # One round is straight-line code; several run in one data-dependent loop that returns when a row stops.
    problems = analyze(text).problems(platform, loops=0 if rounds == 1 else 1)
    assert not problems, f"the engine's step ({path}, {rounds} rounds per sync) for {platform}: " + "; ".join(problems)
    with pytest.raises(ValueError, match="abstract params"):
        engine.add(0, [1, 2, 3], max_new_tokens=4)
