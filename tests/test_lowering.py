"""Every decode path lowers for TPU and CUDA, on this CPU host, with real model shapes (``jax.export``, abstract
values: no weights are built). Each export is checked as a program for that platform (``tests/lowering.py``):
exactly one data-dependent loop (the rounds), no host callback, no CPU-only custom call (jspec's C++ kernels),
no explicit collective. A failure names the path, the model shape and the platform.

The layout is the one jspec picks for the platform (``jspec.loaders.wants_unstacked``): stacked layers on TPU,
per-layer weights on CUDA. The greedy/sampled choice is an array, so one program serves both; the request
options that change the program (penalty counts, log-probabilities) get a program of their own.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax import export
from lowering import PLATFORMS, analyze

from jspec.decode import prepare
from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter
from jspec.loaders import wants_unstacked
from jspec.ngram import NgramDrafter
from jspec.tree import TreeSpec
from models import eagle, shapes
from models.draft import draft_config, init_from_target, make_draft_model
from models.gguf_loader import config_from_gguf, open_gguf
from models.layerskip import LayerSkipDrafter
from models.llama import LlamaConfig, abstract_params, make_model, unstack_layers

BACKEND = {"tpu": "tpu", "cuda": "gpu"}
PROMPTS = [list(range(5, 29)), list(range(40, 57))]  # two rows, ragged
GREEDY = dict(max_new_tokens=16)
OPTIONS = dict(  # every request option, sampled rows: penalties and log-probabilities compile their own program
    max_new_tokens=16, temperature=[0.8, 0.0], top_k=[40, 0], top_p=[0.9, 1.0], min_p=[0.05, 0.0], seed=[1, 2],
    logit_bias={11: 2.0}, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, min_tokens=2,
    stop_token_ids=[[7], [9, 10]], logprobs=True, top_logprobs=3,
)  # fmt: skip


def unstacked(platform: str) -> bool:
    return wants_unstacked("auto", BACKEND[platform])


@functools.cache
def target(cfg: LlamaConfig, platform: str):
    """(Model, abstract params in the platform's layout). Off the CPU nothing is packed for the C++ kernels."""
    params = abstract_params(cfg)
    if unstacked(platform):
        params = jax.eval_shape(functools.partial(unstack_layers, packed=False), params)
    return make_model(cfg), params


DRAFT_LAYERS = 2  # a draft model of the target's first layers


def _draft(cfg, platform):
    dcfg = draft_config(cfg, DRAFT_LAYERS)
    params = jax.eval_shape(functools.partial(init_from_target, dcfg), abstract_params(cfg))
    if unstacked(platform):
        params = jax.eval_shape(functools.partial(unstack_layers, packed=False), params)
    return make_draft_model(dcfg), params


def _eagle(cfg, params):
    ecfg = eagle.EagleConfig(cfg, head_tokens=min(8192, cfg.vocab_size))
    chain = eagle.EagleDrafter(ecfg, max_draft=4)
    _, head = jax.eval_shape(chain.draft_params, params, eagle.abstract_head(ecfg))
    return chain, (params, head)  # the target's own params, as draft_params passes them (checked by identity)


def _layerskip(cfg, params):
    drafter = LayerSkipDrafter(cfg, exit_layer=cfg.num_layers // 4, max_draft=4)
    return drafter, (params, None)


def drafters(cfg: LlamaConfig, platform: str) -> dict:
    """path -> (drafter, draft params, extra prepare keyword arguments)."""
    _, params = target(cfg, platform)
    draft, dparams = _draft(cfg, platform)
    eagle_chain, eagle_params = _eagle(cfg, params)
    ls, ls_params = _layerskip(cfg, params)
    return {
        "plain": (None, None, {}),
        "ngram": (NgramDrafter(vocab_size=cfg.vocab_size), None, {}),
        "draft-chain": (ModelDrafter(draft), dparams, {}),
        "block-verify": (ModelDrafter(draft), dparams, {"block_verify": True}),
        "static-tree": (TreeModelDrafter(draft, TreeSpec((3, 2, 1))), dparams, {}),
        "dynamic-tree": (DynamicTreeDrafter(draft, top_k=3, depth=3, budget=10), dparams, {}),
        "eagle-chain": (eagle_chain, eagle_params, {}),
        "eagle-tree": (eagle_chain.as_tree(TreeSpec((3, 2, 1))), eagle_params, {}),
        "eagle-dynamic-tree": (eagle_chain.as_dynamic_tree(top_k=3, depth=3, budget=10), eagle_params, {}),
        "layerskip": (ls, ls_params, {}),
    }


PATHS = (
    "plain", "ngram", "draft-chain", "block-verify", "static-tree", "dynamic-tree", "eagle-chain", "eagle-tree",
    "eagle-dynamic-tree", "layerskip",
)  # fmt: skip


def lower(cfg: LlamaConfig, path: str, platform: str, options: dict) -> str:
    model, params = target(cfg, platform)
    drafter, dparams, extra = drafters(cfg, platform)[path]
    what = f"{path} on {cfg.name} for {platform}"
    prepared = prepare(model, params, PROMPTS, drafter=drafter, draft_params=dparams, **options, **extra)
    try:
        exported = prepared.export((platform,))
    except Exception as e:  # a CPU-only custom call is refused by export itself: say where
        raise AssertionError(f"{what} does not lower: {type(e).__name__}: {e}") from e
    return exported.mlir_module()


def check(text: str, what: str, platform: str) -> None:
    problems = analyze(text).problems(platform)
    assert not problems, f"{what}: " + "; ".join(problems)


@pytest.fixture(scope="module")
def smollm2_config(smollm2_path) -> LlamaConfig:
    """SmolLM2-135M-Instruct's own config, read from the GGUF that ships in its package."""
    return config_from_gguf(open_gguf(smollm2_path), "float32")


def test_the_shape_table_holds_smollm2s_real_shapes(smollm2_config):
    fields = ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn", "rope_theta")
    assert {f: getattr(shapes.SMOLLM2_135M, f) for f in fields} == {f: getattr(smollm2_config, f) for f in fields}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("path", PATHS)
def test_every_decode_path_lowers_for_accelerators_with_smollm2_shapes(smollm2_config, path, platform):
    # Sampled rows with every request option: the greedy rows' code is in the same program (temperature is data).
    what = f"{path} (sampled, every request option) on SmolLM2-135M for {platform}"
    check(lower(smollm2_config, path, platform, OPTIONS), what, platform)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("path", ["plain", "ngram", "eagle-tree"])
def test_the_default_program_lowers(smollm2_config, path, platform):
    # Without penalties or log-probabilities: the program most calls compile.
    check(lower(smollm2_config, path, platform, GREEDY), f"{path} (greedy) on SmolLM2-135M for {platform}", platform)


# Llama-3 shapes: 128k vocabularies, grouped-query attention 32:8, bf16; each path on one of them.
LLAMA3_CASES = [
    (shapes.LLAMA_3_2_1B, "plain"),
    (shapes.LLAMA_3_2_1B, "eagle-tree"),
    (shapes.LLAMA_3_2_1B, "layerskip"),
    (shapes.LLAMA_3_1_8B, "ngram"),
    (shapes.LLAMA_3_1_8B, "draft-chain"),
    (shapes.LLAMA_3_1_8B, "dynamic-tree"),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cfg,path", LLAMA3_CASES, ids=[f"{c.name}-{p}" for c, p in LLAMA3_CASES])
def test_decode_lowers_with_llama3_shapes(cfg, path, platform):
    check(lower(cfg, path, platform, OPTIONS), f"{path} on {cfg.name} for {platform}", platform)


# ---- the checks themselves must be able to fail ----


def _exported(fn, *args, platform="tpu") -> str:
    return export.export(jax.jit(fn), platforms=(platform,))(*args).mlir_module()


def test_the_checks_see_a_second_loop_and_a_host_callback():
    x = jax.ShapeDtypeStruct((4,), np.float32)

    def two_loops(x):
        x = jax.lax.while_loop(lambda c: c.sum() < 10, lambda c: c + 1, x)
        return jax.lax.while_loop(lambda c: c.sum() < 20, lambda c: c + 1, x)

    def scan_and_loop(x):
        x = jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0]
        return jax.lax.while_loop(lambda c: c.sum() < 20, lambda c: c + 1, x)

    assert len(analyze(_exported(two_loops, x)).decode_loops) == 2
    assert analyze(_exported(scan_and_loop, x)).problems("tpu") == []  # a scan is a counted loop

    def printing(x):
        jax.debug.print("x {}", x)
        return x + 1

    # export refuses a callback outright; lowered for this CPU, the module shows its custom call.
    report = analyze(jax.jit(printing).lower(x).as_text())
    assert report.host_callbacks() and any("host callbacks" in p for p in report.problems("cuda", loops=0))


def test_the_checks_see_a_cpu_only_custom_call():
    text = "func.func public @main() {\n    %0 = stablehlo.custom_call @jspec_packed_matmul_f32(%a) : () -> ()\n  }\n"
    problems = analyze(text).problems("tpu", loops=0)
    assert problems == ["custom calls that are not tpu ops: jspec_packed_matmul_f32"]


def test_a_branch_written_as_a_loop_is_not_a_decode_loop():
    from jspec.rounds import switch_in_place

    def one_round(i, x):
        return switch_in_place(i, [lambda c: c + 1, lambda c: c * 2], x)

    report = analyze(_exported(one_round, jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((4,), np.float32)))
    assert report.loops == 2 and report.decode_loops == []
