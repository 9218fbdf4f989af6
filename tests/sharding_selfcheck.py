"""Sharded decoding must give the single-device tokens: the runnable check behind tests/test_sharding_devices.py,
which starts it in subprocesses (the fake devices must be set before JAX starts).

Scenarios (each prints one JSON document, or writes it to --out):
  decode       8 fake CPU devices; meshes 2x4, 4x2, 8x1, 1x8 (data x model, preset data_tensor); plain,
               draft-model and n-gram speculative decoding; greedy and seeded sampling; a ragged batch.
               Reports the tokens, the single-device reference tokens, the collectives per round and any
               collective that moves KV-cache data (there must be none). On one mesh each, against
               single-device decode: logprobs=True with eos_ids and per-row stop_token_ids (STOPS_MESH), and a
               draft-model tree in a cache sized by cache_need (TREE_MESH).
  unstacked    the per-layer layout (target and draft) on mesh 2x4: tokens (held to the stacked layout's
               single-device reference), the cache's layout, collectives that move it.
  checkpoint   params saved from a 2x4 mesh, restored onto 4x2 and onto one device; logits compared.
  multiprocess run under ``python -m sharding.launch -n 2 --cpu-devices 4 -- python tests/sharding_selfcheck.py
               multiprocess``: the same speculative decode over jax.distributed, inputs built per process.
  reference    the single-device tokens only.

    python tests/sharding_selfcheck.py decode --devices 8

Every jitted program here is one call that is blocked on before the next (the CPU collective deadlock in
docs: many un-blocked dispatches of collective programs hang XLA:CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

# Nothing that initialises a JAX backend may be imported before ``_setup_devices``.
import jax
import numpy as np

TARGET_KW = dict(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, ffn=128)
MESHES = ("2x4", "4x2", "8x1", "1x8")
NGRAM_MESHES = ("2x4",)
# Plain decoding on the data x model mesh with the model axis split furthest (2x4) and on the pure data mesh (8x1,
# where a round moves no float data); on 4x2 and 1x8 the target is laid out by the same rules, and the draft model's
# decode (its verification is the target's call) runs there.
PLAIN_MESHES = ("2x4", "8x1")
STREAM_MESH = "8x1"  # where round-by-round stepping (state donated every round) is checked
# Draft parameters follow the target's layout on some meshes and are replicated (preset "data") on others.
DRAFT_PRESET = {"2x4": "data_tensor", "4x2": "data", "8x1": "data_tensor", "1x8": "data"}
PROMPT_LENS = (3, 7, 12, 5, 9, 1, 15, 4)
MAX_NEW = (10, 14, 8, 12, 16, 9, 11, 13)
MAX_LEN = 48
GAMMA = 3
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0, seed=0),
    "sampled": dict(
        temperature=[1.0, 0.8, 1.0, 1.2, 1.0, 0.7, 1.0, 1.0],
        top_k=[0, 20, 0, 0, 50, 0, 0, 10],
        top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 0.95, 1.0, 1.0],
        seed=11,
    ),
}
# Per-row seeds (one key per row, split with the rows): checked on ROW_SEEDS_MESH with the draft model and in the
# two-process run, where each process passes its own rows' seeds.
ROW_SEEDS = dict(SAMPLING["sampled"], seed=[101, 102, 103, 104, 105, 106, 107, 108])
ROW_SEEDS_MESH = "2x4"
# End tokens and log-probabilities (the draft model, seeded sampling, logprobs=True, eos_ids and per-row
# stop_token_ids) on STOPS_MESH, one row per device (a stop id given to another row would show). Compared with
# single-device decode: tokens and stop reasons exactly, log-probabilities within LOGPROB_ATOL (float32 sums in
# another order). On 8x1, with job B of tests/test_sharding_devices.py, which finishes before the other job.
STOPS_MESH = "8x1"
LOGPROB_ATOL = 1e-4
# A draft-model tree (sampled children, per-row seeds; all-greedy and mixed greedy / sampled rows) on TREE_MESH,
# where the draft and the target are both split over the model axis: the ancestor mask runs on split KV heads.
TREE_MESH = "2x4"
TREE_SPEC = (2, 2, 1)  # 1 + 2 + 4 + 4 = 11 nodes: 10 scratch slots past the pending token
# The mixed run's temperatures (the greedy run's are all 0). Row 6, the longest (P + N - 1 = 25), is sampled: its
# last rounds verify nodes in the scratch slots, so a cache without the tree's scratch (25 to 28 slots instead of
# 35) gives it other tokens (measured on one device and on 2x4), so the tokens check the cache_need sizing below.
TREE_TEMPERATURE = [0.0, 1.0, 0.8, 0.0, 1.2, 1.0, 0.9, 0.0]


def tiny_models(seed: int = 0):
    """(target cfg, target params, draft cfg, draft params): a 2-layer random Llama and, as its draft, its own
    first layer with the shared embedding and final norm (a LayerSkip-style early exit, so that some
    proposals are accepted). std 0.1 spreads the logits so float noise between layouts cannot flip a token."""
    from models.llama import LlamaConfig, init_random_params

    cfg = LlamaConfig(**TARGET_KW, name="tiny-target")
    dcfg = cfg.replace(num_layers=1, name="tiny-draft")
    tp = init_random_params(cfg, jax.random.key(seed), std=0.1)
    dp = {"embed": tp["embed"], "final_norm": tp["final_norm"], "layers": jax.tree.map(lambda w: w[:1], tp["layers"])}
    return cfg, tp, dcfg, dp


def prompts(seed: int = 0) -> list[list[int]]:
    """Ragged prompts; half of them repeat a short motif so that the n-gram drafter finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(PROMPT_LENS):
        if i % 2:
            motif = rng.integers(0, TARGET_KW["vocab_size"], size=3)
            out.append(np.resize(motif, n).tolist())
        else:
            out.append(rng.integers(0, TARGET_KW["vocab_size"], size=n).tolist())
    return out


def _drafters(cfg, dcfg):
    from jspec.drafters import ModelDrafter
    from jspec.ngram import NgramDrafter
    from models.llama import make_model

    return {
        "plain": None,
        "model": ModelDrafter(make_model(dcfg)),
        "ngram": NgramDrafter(vocab_size=cfg.vocab_size),
    }


def _kw(sampling: str, rows=None, drafter=None) -> dict[str, Any]:
    """decode keyword arguments for a sampling setting, restricted to ``rows`` (per-process inputs); K = GAMMA
    with a drafter (plain decoding takes none)."""
    kw = dict(
        max_len=MAX_LEN, max_new_tokens=list(MAX_NEW), **(ROW_SEEDS if sampling == "row_seeds" else SAMPLING[sampling])
    )
    if drafter is not None:
        kw["gamma"] = GAMMA
    if rows is not None:
        kw = {k: ([v[i] for i in rows] if isinstance(v, list) else v) for k, v in kw.items()}
    return kw


def _plan(mesh, draft_preset: str, cfg, tp, dcfg, dp):
    from models.llama import param_logical_axes
    from sharding.sharded_decode import make_plan

    return make_plan(
        mesh,
        "data_tensor",
        draft_preset,
        target_axes=param_logical_axes(cfg),
        target_shapes=tp,
        draft_axes=param_logical_axes(dcfg),
        draft_shapes=dp,
    )


def reference(drafter_names=("plain", "model", "ngram")) -> dict:
    """Single-device tokens: plain ``jspec.decode.decode`` (no sharding code involved)."""
    from jspec.decode import decode
    from models.llama import make_model

    cfg, tp, dcfg, dp = tiny_models()
    drafters = _drafters(cfg, dcfg)
    out: dict = {}
    for name in drafter_names:
        dr = drafters[name]
        for s in SAMPLING:
            dparams = dp if name == "model" else None
            res = decode(make_model(cfg), tp, prompts(), drafter=dr, draft_params=dparams, **_kw(s, drafter=dr))
            out.setdefault(name, {})[s] = res.tokens
    dr = drafters["model"]
    out["model"]["row_seeds"] = decode(
        make_model(cfg), tp, prompts(), drafter=dr, draft_params=dp, **_kw("row_seeds", drafter=dr)
    ).tokens
    return out


def decode_scenario(meshes=MESHES, with_reference: bool = True) -> dict:
    from models.llama import make_model, param_logical_axes
    from sharding import hlo
    from sharding.mesh import make_mesh, parse_shape
    from sharding.placement import shard_params
    from sharding.rules import spec_str
    from sharding.sharded_decode import gather_output, prepare_sharded

    t0 = time.perf_counter()
    result: dict = {"devices": jax.device_count(), "meshes": {}}
    if with_reference:
        result["reference"] = reference()
        result["reference_seconds"] = time.perf_counter() - t0
    cfg, tp, dcfg, dp = tiny_models()
    model = make_model(cfg)
    drafters = _drafters(cfg, dcfg)
    for mesh_name in meshes:
        mesh = make_mesh(parse_shape(mesh_name))
        plan = _plan(mesh, DRAFT_PRESET[mesh_name], cfg, tp, dcfg, dp)
        stp = shard_params(tp, param_logical_axes(cfg), mesh, plan.target)
        sdp = shard_params(dp, param_logical_axes(dcfg), mesh, plan.draft_rules)
        entry: dict = {"draft_preset": DRAFT_PRESET[mesh_name]}
        for name, dr in drafters.items():
            if (name == "ngram" and mesh_name not in NGRAM_MESHES) or (
                name == "plain" and mesh_name not in PLAIN_MESHES
            ):
                continue
            t1 = time.perf_counter()
            dparams = sdp if name == "model" else None
            builds = {
                s: prepare_sharded(
                    model, stp, prompts(), plan=plan, drafter=dr, draft_params=dparams, **_kw(s, drafter=dr)
                )
                for s in SAMPLING
            }
            compiled = builds["greedy"].compile()  # one compilation serves both settings (sampling is data)
            text = compiled.as_text()
            outs = {}
            for s, sd in builds.items():
                st = sd.run_state(compiled)  # blocked: see the module docstring
                outs[s] = gather_output(st)
            if mesh_name == ROW_SEEDS_MESH and name == "model":  # per-row keys: a key input of another shape
                sd = prepare_sharded(
                    model, stp, prompts(), plan=plan, drafter=dr, draft_params=dparams, **_kw("row_seeds", drafter=dr)
                )
                outs["row_seeds"] = gather_output(sd.run_state())
            entry[name] = {
                "tokens": {s: o.tokens for s, o in outs.items()},
                "accepted": {s: o.stats["accepted"] for s, o in outs.items()},
                "collectives": hlo.analyze(text).summary(),
                "per_round_ops": [list(e) for e in hlo.analyze(text).per_round],
                "cache_collectives": [f"{c.op} {c.shape}" for c in hlo.cache_collectives(text, MAX_LEN, cfg.head_dim)],
                "cache_spec": spec_str(st.cache.k.sharding.spec),
                "seq_spec": spec_str(st.seq.sharding.spec),
                "draft_cache_spec": spec_str(st.draft_state.k.sharding.spec) if name == "model" else None,
                "seconds": time.perf_counter() - t1,
            }
            if mesh_name == STREAM_MESH and name == "model":
                entry[name].update(_stream_check(builds["greedy"]))
        if mesh_name == STOPS_MESH:
            base = entry["model"]["tokens"]["sampled"]  # the single-device tokens (checked by the tests)
            entry["stops"] = _stops_check(model, tp, dp, stp, sdp, plan, drafters["model"], base)
        if mesh_name == TREE_MESH:
            entry["tree"] = _tree_check(model, tp, dp, stp, sdp, plan, dcfg)
        result["meshes"][mesh_name] = entry
    result["seconds"] = time.perf_counter() - t0
    return result


def stop_choice(tokens: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """(eos_ids, stop_token_ids per row) picked from the rows' tokens decoded without end tokens, so that several
    rows really end early and each row's ids matter: row 0's middle token is the EOS id (it ends any row that
    emits it); rows 2, 4 and 6 stop at a middle token of their own (row 4 also holds row 6's id, which it never
    emits); rows 1, 3, 5 and 7 hold a token that the next row (in the next block of rows on a 4- or 8-way data axis)
    emits early and they never emit: ids that reached another row than their own would end it early, or not end
    the row that owns them."""
    eos = [tokens[0][len(tokens[0]) // 2]]
    own = {i: tokens[i][len(tokens[i]) // 2] for i in (2, 4, 6)}
    stops: list[list[int]] = []
    for i, row in enumerate(tokens):
        if i == 0:
            ids = []
        elif i in own:
            ids = [own[i]] + ([own[6]] if i == 4 and own[6] not in row else [])
        else:
            ids = [x for x in tokens[(i + 1) % len(tokens)][1:] if x not in row and x not in eos][:1]
        stops.append(ids)
    return eos, stops


def _stops_check(model, tp, dp, stp, sdp, plan, drafter, base) -> dict:
    """Draft-model decoding with seeded sampling, logprobs=True, eos_ids and per-row stop_token_ids
    (``stop_choice`` of ``base``, the rows' tokens decoded without end tokens) on ``plan``'s mesh and on one
    device: tokens, stop reasons and log-probabilities of both (the latter gathered by ``gather_output``'s
    log-probability branch)."""
    from jspec.decode import decode
    from sharding.rules import spec_str
    from sharding.sharded_decode import gather_output, prepare_sharded

    t0 = time.perf_counter()
    eos, stops = stop_choice(base)
    kw = dict(_kw("sampled", drafter=drafter), eos_ids=eos, stop_token_ids=stops, logprobs=True)
    ref = decode(model, tp, prompts(), drafter=drafter, draft_params=dp, **kw)
    sd = prepare_sharded(model, stp, prompts(), plan=plan, drafter=drafter, draft_params=sdp, **kw)
    st = sd.run_state()
    got = gather_output(st)
    diffs = [abs(a - b) for x, y in zip(got.logprobs, ref.logprobs) for a, b in zip(x, y)]
    # The same decode with per-row request options on top: even rows ban their base's first token, odd rows
    # hold their end tokens back for 4 tokens; [B, M] biases and [B] min_tokens split with their rows; every
    # third row a repetition and a frequency penalty ([B, V] counts in the state); and the 3 most likely tokens
    # at each position ([B, S+1, 3] state).
    bias = [{row[0]: float("-inf")} if i % 2 == 0 else None for i, row in enumerate(base)]
    n_min = [0 if i % 2 == 0 else 4 for i in range(len(base))]
    rep = [1.5 if i % 3 == 0 else 1.0 for i in range(len(base))]
    freq = [0.5 if i % 3 == 0 else 0.0 for i in range(len(base))]
    okw = dict(kw, logit_bias=bias, min_tokens=n_min, top_logprobs=3, repetition_penalty=rep, frequency_penalty=freq)
    oref = decode(model, tp, prompts(), drafter=drafter, draft_params=dp, **okw)
    osd = prepare_sharded(model, stp, prompts(), plan=plan, drafter=drafter, draft_params=sdp, **okw)
    ost = osd.run_state()
    ogot = gather_output(ost)
    return {
        "options": {
            "logit_bias": [None if b is None else {str(k): str(v) for k, v in b.items()} for b in bias],
            "min_tokens": n_min,
            "bias_ids_spec": spec_str(ost.sampling.bias_ids.sharding.spec),
            "min_tokens_spec": spec_str(ost.sampling.min_tokens.sharding.spec),
            "tokens": ogot.tokens,
            "stop": [r.name for r in ogot.stop_reason],
            "reference_tokens": oref.tokens,
            "reference_stop": [r.name for r in oref.stop_reason],
            "top_logprobs": ogot.top_logprobs,
            "reference_top_logprobs": oref.top_logprobs,
            "top_ids_spec": spec_str(ost.top_ids.sharding.spec),
            "out_counts_spec": spec_str(ost.out_counts.sharding.spec),
        },
        "base_tokens": base,
        "eos_ids": eos,
        "stop_token_ids": stops,
        "stop_ids_spec": spec_str(st.sampling.stop_ids.sharding.spec),
        "tokens": got.tokens,
        "stop": [r.name for r in got.stop_reason],
        "logprobs": got.logprobs,
        "reference_tokens": ref.tokens,
        "reference_stop": [r.name for r in ref.stop_reason],
        "reference_logprobs": ref.logprobs,
        "logprob_shapes_equal": [len(x) for x in got.logprobs] == [len(y) for y in ref.logprobs],
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "logprob_atol": LOGPROB_ATOL,
        "accepted": got.stats["accepted"],
        "seconds": time.perf_counter() - t0,
    }


def _tree_check(model, tp, dp, stp, sdp, plan, dcfg) -> dict:
    """A draft-model tree (``TREE_SPEC``, children sampled without replacement, per-row seeds), all-greedy and
    mixed greedy / sampled rows (one compilation serves both), on ``plan``'s mesh with a cache of exactly
    ``cache_need`` slots (the rows' P + N - 1 and the tree's scratch, ``jspec.validate.tree_scratch``) and on one
    device with decode's default cache (rounded up to 128 slots): the tokens must be equal, which they would not
    be if the mesh's cache lacked the scratch (row 6's last rounds would verify fewer nodes: other draws)."""
    from jspec.decode import prepare
    from jspec.drafters import TreeModelDrafter
    from jspec.tree import TreeRule, TreeSpec
    from jspec.validate import tree_scratch
    from models.llama import make_model
    from sharding import hlo
    from sharding.agreement import cache_need
    from sharding.sharded_decode import gather_output, prepare_sharded

    t0 = time.perf_counter()
    tree = TreeModelDrafter(make_model(dcfg), TreeSpec(TREE_SPEC), TreeRule.WITHOUT_REPLACEMENT)
    need = cache_need(model, tree, prompts(), list(MAX_NEW))
    settings = {"greedy": dict(ROW_SEEDS, temperature=0.0), "mixed": dict(ROW_SEEDS, temperature=TREE_TEMPERATURE)}
    common = dict(drafter=tree, max_new_tokens=list(MAX_NEW), goodput=False)  # fixed: the same K as the reference
    refs = {s: prepare(model, tp, prompts(), draft_params=dp, **common, **kw) for s, kw in settings.items()}
    builds = {
        s: prepare_sharded(model, stp, prompts(), plan=plan, draft_params=sdp, max_len=need, **common, **kw)
        for s, kw in settings.items()
    }
    compiled = builds["greedy"].compile()
    text = compiled.as_text()
    outs = {s: gather_output(sd.run_state(compiled)) for s, sd in builds.items()}
    ref_outs = {s: pd.run() for s, pd in refs.items()}
    return {
        "mixed_temperature": TREE_TEMPERATURE,
        "nodes": TreeSpec(TREE_SPEC).num_nodes,
        "scratch": tree_scratch(tree),
        "cache_need": need,
        "slots": builds["greedy"].config.slots,
        "reference_slots": refs["greedy"].config.slots,
        "tokens": {s: o.tokens for s, o in outs.items()},
        "stop": {s: [r.name for r in o.stop_reason] for s, o in outs.items()},
        "reference_tokens": {s: o.tokens for s, o in ref_outs.items()},
        "accepted": {s: o.stats["accepted"] for s, o in outs.items()},
        "cache_collectives": [f"{c.op} {c.shape}" for c in hlo.cache_collectives(text, need, TARGET_KW["head_dim"])],
        "seconds": time.perf_counter() - t0,
    }


def _stream_check(sd) -> dict:
    """Round-by-round decoding from Python with the jitted (prefill, round) pair: the tokens must be those of
    the fused loop, and the round must consume (donate) the state it is given."""
    rows: list[list[int]] = [[] for _ in range(sd.global_batch)]
    stream = sd.stream()
    for chunk in stream:
        for i, toks in enumerate(chunk):
            rows[i] += toks
    out = stream.output()
    pre, step = sd.step_fns()
    tp, dp, *inputs = sd.args()
    st0 = jax.block_until_ready(pre(tp, dp, *inputs))
    jax.block_until_ready(step(tp, dp, st0))
    return {
        "stream_tokens": rows,
        "stream_stop": [r.name for r in stream.stop_reasons],
        "stream_output": {"tokens": out.tokens, "stop": [r.name for r in out.stop_reason]},
        "state_donated": bool(st0.cache.k.is_deleted()),
    }


UNSTACKED_MESHES = ("2x4",)  # data x tensor: both axes


def unstacked_scenario() -> dict:
    """The per-layer layout (``unstack_layers(fused=False)``, the one that verifies cheaply on GPUs) under the mesh
    and the rules table, target and draft alike: tokens on each mesh, the cache's layout and any collective that
    moves it, per drafter and sampling setting."""
    from models.llama import logical_axes, make_model, unstack_layers
    from sharding import hlo
    from sharding.mesh import make_mesh, parse_shape
    from sharding.placement import shard_params
    from sharding.rules import spec_str
    from sharding.sharded_decode import gather_output, make_plan, prepare_sharded

    cfg, tp, dcfg, dp = tiny_models()
    tp, dp = unstack_layers(tp, fused=False), unstack_layers(dp, fused=False)
    model = make_model(cfg)
    drafters = _drafters(cfg, dcfg)
    # No one-device decode in this layout: the tokens are held to the stacked layout's single-device reference
    # (``reference``, job A of tests/test_sharding_devices.py), which the per-layer layout must reproduce anyway.
    out: dict = {"meshes": {}}
    for mesh_name in UNSTACKED_MESHES:
        mesh = make_mesh(parse_shape(mesh_name))
        t_axes, d_axes = logical_axes(cfg, tp), logical_axes(dcfg, dp)
        plan = make_plan(
            mesh, "data_tensor", DRAFT_PRESET[mesh_name],
            target_axes=t_axes, target_shapes=tp, draft_axes=d_axes, draft_shapes=dp,
        )  # fmt: skip
        stp = shard_params(tp, t_axes, mesh, plan.target)
        sdp = shard_params(dp, d_axes, mesh, plan.draft_rules)
        entry: dict = {"wq_spec": spec_str(stp["layers"][0]["attn"]["wq"].sharding.spec)}
        for name, dr in drafters.items():
            dparams = sdp if name == "model" else None
            builds = {
                s: prepare_sharded(
                    model, stp, prompts(), plan=plan, drafter=dr, draft_params=dparams, **_kw(s, drafter=dr)
                )
                for s in SAMPLING
            }
            compiled = builds["greedy"].compile()
            text = compiled.as_text()
            tokens, st = {}, None
            for s, sd in builds.items():
                st = sd.run_state(compiled)
                tokens[s] = gather_output(st).tokens
            entry[name] = {
                "tokens": tokens,
                "cache_spec": spec_str(st.cache.k.sharding.spec),
                "cache_collectives": [f"{c.op} {c.shape}" for c in hlo.cache_collectives(text, MAX_LEN, cfg.head_dim)],
                "decode_loops": hlo.analyze(text).decode_loops,
                "per_round_ops": [list(e) for e in hlo.analyze(text).per_round],
            }
        out["meshes"][mesh_name] = entry
    return out


def checkpoint_scenario() -> dict:
    import jax.numpy as jnp

    from models.llama import make_model, param_logical_axes
    from sharding.checkpoint import restore_decode_params, save_decode_params
    from sharding.mesh import make_mesh, single_device_mesh
    from sharding.placement import shard_params
    from sharding.rules import rules, spec_str

    cfg, tp, dcfg, dp = tiny_models()
    tokens = jnp.asarray(np.asarray(prompts()[0] * 4)[:12].reshape(1, 12).repeat(8, 0))  # [8, 12]
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (8, 12))

    def logits(c, params):
        m = make_model(c)
        return np.asarray(jax.jit(lambda p: m.apply(p, tokens, positions, m.init_cache(8, 16))[0])(params))

    src = make_mesh((2, 4))
    r = rules("data_tensor")
    stp = shard_params(tp, param_logical_axes(cfg), src, r)
    sdp = shard_params(dp, param_logical_axes(dcfg), src, r)
    before = {"target": logits(cfg, stp), "draft": logits(dcfg, sdp)}
    out: dict = {"saved_from": "2x4", "restored": {}}
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/ckpt"
        save_decode_params(path, stp, sdp)
        for name, mesh, tr, dr in [
            ("4x2", make_mesh((4, 2)), r, rules("data")),
            ("1x8", make_mesh((1, 8)), r, r),  # 4 KV heads cannot split 8 ways: the rules are refitted
            ("1 device", single_device_mesh(), rules("replicated"), rules("replicated")),
        ]:
            rtp, rdp = restore_decode_params(path, mesh, tr, param_logical_axes(cfg), dr, param_logical_axes(dcfg))
            after = {"target": logits(cfg, rtp), "draft": logits(dcfg, rdp)}
            same_params = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves((tp, dp)), jax.tree.leaves((rtp, rdp)))
            )
            out["restored"][name] = {
                "devices": len(mesh.devices.flat),
                "params_equal": bool(same_params),
                "max_abs_logit_diff": {k: float(np.max(np.abs(after[k] - before[k]))) for k in before},
                "wq_spec": spec_str(rtp["layers"]["attn"]["wq"].sharding.spec),
                "wk_spec": spec_str(rtp["layers"]["attn"]["wk"].sharding.spec),
                "draft_wq_spec": spec_str(rdp["layers"]["attn"]["wq"].sharding.spec),
            }
    return out


def multiprocess_scenario() -> dict:
    from jax.experimental import multihost_utils

    from jspec.decode import decode
    from models.llama import make_model, param_logical_axes
    from sharding.distributed import rows_for_process
    from sharding.mesh import make_mesh
    from sharding.placement import shard_params
    from sharding.sharded_decode import prepare_sharded

    cfg, tp, dcfg, dp = tiny_models()
    mesh = make_mesh((2, 4))
    plan = _plan(mesh, "data", cfg, tp, dcfg, dp)
    stp = shard_params(tp, param_logical_axes(cfg), mesh, plan.target)
    sdp = shard_params(dp, param_logical_axes(dcfg), mesh, plan.draft_rules)
    rows = rows_for_process(plan, len(PROMPT_LENS)).tolist()
    local_prompts = [prompts()[i] for i in rows]
    drafter = _drafters(cfg, dcfg)["model"]
    out: dict = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "local_device_ids": [d.id for d in jax.local_devices()],
        "rows": rows,
        "tokens": {},
    }
    try:  # 7 rows over the 2-way data axis: replicated, every process would build and decode every row
        rows_for_process(plan, len(PROMPT_LENS) - 1)
    except ValueError as e:
        out["indivisible_rows"] = str(e)

    def local(**kw):  # this process's rows of the batch on the 2x4 mesh
        return prepare_sharded(
            make_model(cfg), stp, local_prompts, plan=plan, drafter=drafter, draft_params=sdp, process_local=True, **kw
        )

    for s in (*SAMPLING, "row_seeds"):
        out["tokens"][s] = local(**_kw(s, rows, drafter)).run().tokens
    # Request options in one process's rows only: process 1's rows (the batch's second half) ban their greedy
    # first token (logit_bias width 4 there, 0 in process 0) under a repetition penalty (token counts kept in
    # both processes); process 0's rows stop at their greedy third token (stop-id width 4 there, 0 in process 1).
    # The processes pad to the widest and agree on the counts, so both compile one program; process 0 also
    # decodes the whole batch with the same per-row options unsharded, on its own, as the reference (the same
    # single-device decode in the other process would only repeat it).
    greedy = out["tokens"]["greedy"]
    n = len(greedy)
    second = [r >= n // 2 for r in range(n)]
    full = dict(
        _kw("greedy", None, drafter),
        logit_bias=[{greedy[r][0]: float("-inf")} if second[r] else None for r in range(n)],
        repetition_penalty=[1.3 if second[r] else 1.0 for r in range(n)],
        stop_token_ids=[[] if second[r] else [greedy[r][2]] for r in range(n)],
    )
    opts = _kw("greedy", rows, drafter)
    if jax.process_index() == 1:  # only process 1's rows ask for token counts
        opts.update(logit_bias=[full["logit_bias"][r] for r in rows], repetition_penalty=1.3)
    else:
        opts["stop_token_ids"] = [full["stop_token_ids"][r] for r in rows]
    try:
        toks = local(**opts).run().tokens
        ref = None
        if jax.process_index() == 0:
            ref = decode(make_model(cfg), tp, prompts(), drafter=drafter, draft_params=dp, **full).tokens
        out["options"] = {
            "tokens": toks,
            "reference": ref,
            "logit_bias_rows": [r for r in rows if second[r]],
            "stop_rows": [r for r in rows if not second[r]],
        }
    except Exception as e:  # reported, not raised: the other scenarios' results still come back
        out["options"] = {"error": f"{type(e).__name__}: {e}"[:300]}

    def greedy_on(mesh) -> dict:  # this process's rows of the batch on another mesh, and the decoded batch
        plan_m = _plan(mesh, "data", cfg, tp, dcfg, dp)
        rows_m = rows_for_process(plan_m, len(PROMPT_LENS)).tolist()
        sd = prepare_sharded(
            make_model(cfg),
            shard_params(tp, param_logical_axes(cfg), mesh, plan_m.target),
            [prompts()[i] for i in rows_m],
            plan=plan_m,
            drafter=drafter,
            draft_params=shard_params(dp, param_logical_axes(dcfg), mesh, plan_m.draft_rules),
            process_local=True,
            **_kw("greedy", rows_m, drafter),
        )
        return {"rows": rows_m, "tokens": sd.run().tokens}

    # The batch not split over processes (data axis 1, the model axis over both): every process passes every
    # row, and the batch is 8, not 16.
    out["replicated"] = greedy_on(make_mesh((1, 8)))
    # Row blocks some processes share while the data axis is split: a 4x2 mesh whose blocks 1 and 2 each span
    # both processes (devices 2 and 4, 3 and 5). Each process holds 3 of the 4 blocks and passes 6 rows; the
    # batch is 8 (the old count refused it as a batch of 12).
    devs = jax.devices()  # process 0's four, then process 1's
    out["shared_blocks"] = greedy_on(make_mesh((4, 2), devices=[devs[i] for i in (0, 1, 2, 4, 3, 5, 6, 7)]))
    # A bad row in one process only: every process raises (the others naming it) instead of waiting for good in
    # a collective the failing process never reaches.
    bad = [list(p) for p in local_prompts]
    if jax.process_index() == 1:
        bad[0][0] = cfg.vocab_size
    try:
        prepare_sharded(
            make_model(cfg),
            stp,
            bad,
            plan=plan,
            drafter=drafter,
            draft_params=sdp,
            process_local=True,
            **_kw("greedy", rows, drafter),
        )
        out["bad_row"] = "accepted"
    except ValueError as e:
        out["bad_row"] = str(e)
    # Re-laying out parameters that already span both processes (as a restore returns them): np.asarray of
    # such an array fails on the shards this process cannot address, so put must reshard it on device.
    from sharding.rules import rules, spec_str

    try:
        moved = shard_params(stp, param_logical_axes(cfg), mesh, rules("data"))
        wq = np.asarray(moved["layers"]["attn"]["wq"].addressable_data(0))
        same = bool(np.array_equal(wq, np.asarray(tp["layers"]["attn"]["wq"])))
        out["relayout"] = {"wq_spec": spec_str(moved["layers"]["attn"]["wq"].sharding.spec), "equal": same}
    except Exception as e:  # reported, not raised: the other scenarios' results still come back
        out["relayout"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    # One seed for the batch in process 0, per-row seeds in process 1: two programs whose collectives would never
    # meet; refused in both processes.
    try:
        local(**_kw("row_seeds" if jax.process_index() == 1 else "sampled", rows, drafter))
        out["mixed_seed_kinds"] = "accepted"
    except ValueError as e:
        out["mixed_seed_kinds"] = str(e)
    # Each process's own rows but process_local forgotten: every device would take its rows from its own
    # process's "whole batch", mixing the two; refused in both processes instead.
    try:
        kw = _kw("greedy", rows, drafter)
        prepare_sharded(make_model(cfg), stp, local_prompts, plan=plan, drafter=drafter, draft_params=sdp, **kw)
        out["mixed_batches"] = "accepted"
    except ValueError as e:
        out["mixed_batches"] = str(e)
    out.update(_multiprocess_refusals(cfg, tp, dcfg, dp, plan, stp, sdp, rows, local_prompts, drafter))
    multihost_utils.sync_global_devices("selfcheck done")
    return out


LOCAL_MESH_ROWS = (1, 6)  # the row each process decodes on a mesh of its own device


def _multiprocess_refusals(cfg, tp, dcfg, dp, plan, stp, sdp, rows, local_prompts, drafter) -> dict:
    """What the processes must agree on, and a decode that involves no other process. Every case but the first
    is refused in both processes (nothing compiled); the last one would leave the processes in different
    collectives if it were not caught by the first one (it must stay last)."""
    from models.llama import make_model, param_logical_axes
    from sharding.mesh import make_mesh, single_device_mesh
    from sharding.placement import shard_params
    from sharding.sharded_decode import make_plan, prepare_sharded

    me, model, out = jax.process_index(), make_model(cfg), {}

    def refused(name, *args, **kw):
        try:
            prepare_sharded(*args, **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)

    # A mesh of this process's own device: a local decode while another process runs, with other prompts and
    # process_local left False (it gathered across processes, and refused the different prompts).
    local = single_device_mesh()
    plan_l = make_plan(local, "data_tensor")
    row = LOCAL_MESH_ROWS[me]
    sd = prepare_sharded(
        model,
        shard_params(tp, param_logical_axes(cfg), local, plan_l.target),
        [prompts()[row]],
        plan=plan_l,
        **_kw("greedy", [row]),
    )
    out["local_mesh"] = {"row": row, "tokens": sd.run().tokens}
    # A mesh of the other process's devices only: refused at once (its checks would gather over both processes).
    other = [d for d in jax.devices() if d.process_index != me][:1]
    refused("other_process_mesh", model, tp, local_prompts, plan=make_plan(make_mesh((1, 1), devices=other)))

    def refused_rows(name, sampling="greedy", **kw):
        """This process's rows with the draft model on ``plan`` (process_local), ``kw`` overriding."""
        base = dict(plan=plan, drafter=drafter, draft_params=sdp, process_local=True, **_kw(sampling, rows, drafter))
        refused(name, model, stp, local_prompts, **{**base, **kw})

    # One seed for the batch, a different one in each process: each would sample its rows under another key.
    refused_rows("different_seeds", "sampled", seed=11 + me)
    # Another draft preset in process 1: other programs (their collectives would never meet).
    refused_rows("different_plans", plan=plan if me == 0 else _plan(plan.mesh, "data_tensor", cfg, tp, dcfg, dp))
    # The whole batch with other budgets in each process and no max_len: the cache sizes follow the budgets (128
    # and 256 slots), but the inputs are what differs and what the error must name.
    budgets = dict(temperature=0.0, max_new_tokens=10 if me == 0 else 200)
    refused("different_budgets", model, stp, prompts(), plan=plan, **budgets)
    # Every process holds every row (data axis 1): process 1's row 3 prompt and row 5 seed differ from process 0's.
    mesh_r = make_mesh((1, 8))
    plan_r = _plan(mesh_r, "data", cfg, tp, dcfg, dp)
    kw, ps = _kw("row_seeds", range(8)), [list(x) for x in prompts()]
    if me == 1:
        ps[3][0] = (ps[3][0] + 1) % cfg.vocab_size
        kw["seed"] = [s + 100 * (i == 5) for i, s in enumerate(kw["seed"])]
    stp_r = shard_params(tp, param_logical_axes(cfg), mesh_r, plan_r.target)
    refused("shared_rows_differ", model, stp_r, ps, plan=plan_r, process_local=True, **kw)
    # max_len in process 1 only (process_local): process 0 alone would gather the cache size its rows need.
    refused_rows("mixed_max_len", max_len=None if me == 0 else MAX_LEN)
    # process_local=True in process 0 only: the first collective compares it, before any other.
    refused_rows("mixed_process_local", process_local=me == 0)
    return out


def errors_scenario() -> dict:
    """The messages a user gets for the two set-up mistakes the sharded decode rejects."""
    from models.llama import make_model, param_logical_axes
    from sharding.mesh import make_mesh
    from sharding.placement import shard_params
    from sharding.sharded_decode import prepare_sharded

    cfg, tp, dcfg, dp = tiny_models()
    mesh = make_mesh((4, 2))
    plan = _plan(mesh, "data", cfg, tp, dcfg, dp)
    out = {}
    try:  # 6 rows over a 4-way data axis
        stp = shard_params(tp, param_logical_axes(cfg), mesh, plan.target)
        prepare_sharded(make_model(cfg), stp, prompts()[:6], plan=plan, **_kw("greedy", range(6)))
    except ValueError as e:
        out["indivisible_batch"] = str(e)
    try:  # parameters never placed on the mesh
        prepare_sharded(make_model(cfg), tp, prompts(), plan=plan, **_kw("greedy"))
    except ValueError as e:
        out["unplaced_params"] = str(e)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "scenarios", nargs="+", choices=["decode", "checkpoint", "errors", "multiprocess", "reference", "unstacked"]
    )
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (all but multiprocess)")
    ap.add_argument("--meshes", default=",".join(MESHES), help="decode: meshes to run (data x model)")
    ap.add_argument("--no-reference", action="store_true", help="decode: skip the single-device reference")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    args = ap.parse_args(argv)
    res: dict = {}
    if "multiprocess" in args.scenarios:
        from sharding.distributed import initialize

        if args.scenarios != ["multiprocess"] or not initialize():
            raise SystemExit("multiprocess runs alone, under `python -m sharding.launch` (needs JSPEC_COORDINATOR)")
        res["multiprocess"] = multiprocess_scenario()
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before any backend use
        for sc in args.scenarios:
            t0 = time.perf_counter()
            if sc == "decode":
                res[sc] = decode_scenario(tuple(args.meshes.split(",")), not args.no_reference)
            elif sc == "unstacked":
                res[sc] = unstacked_scenario()
            elif sc == "checkpoint":
                res[sc] = checkpoint_scenario()
            elif sc == "errors":
                res[sc] = errors_scenario()
            else:
                res[sc] = reference()
            res[sc + "_seconds"] = time.perf_counter() - t0
    text = json.dumps(res)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print("RESULT " + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
