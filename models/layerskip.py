"""LayerSkip-style self-speculation for Llama-family models: the first E layers of the target draft, the
remaining layers verify, and nothing the draft computed is computed twice.

Dimension vocabulary: B batch, T tokens in a call, K draft length, V vocab, S cache slots, L layers,
E the exit layer (a static int: the draft runs layers [0, E)), Dm the model width (models/llama.py calls it
E), F the exit adapter's inner width, N the tokens of a restricted draft head.

Drafting (``LayerSkipDrafter.propose``): K autoregressive steps of layers [0, E) of the TARGET, writing their
K/V straight into the target's own cache (layers < E, slots committed, committed + 1, ...: the pending token,
then each draft token), then (exit adapter) + final norm + LM head. Those cache entries are exactly what the
target computes for the same tokens, so verification (``LayerSkipDrafter.verify``) only runs layers [0, E) on
the last draft token (the draft never fed it back) and layers [E, L) on all K + 1 positions, starting from the
layer-E hidden states the draft kept in its state.

Options, all lossless (the decoder verifies against the full target with q = what the draft sampled):
- exit adapter: a small residual SwiGLU block trained to map layer E's hidden state towards what the full
  model predicts (``examples/train_early_exit.py``). It has no attention, so it needs no cache of its own and
  costs F * Dm * 3 weights per draft token.
- restricted draft head: the LM head reads only N frequent token rows (FR-Spec's idea). On SmolLM2-135M the
  full tied head is 21% of the model and is read by every draft step; with 8k rows it is 6x cheaper. Tokens
  outside the subset get q = 0: they are never proposed, and the verifier's residual max(0, p - q) covers them.

Parameters: the drafter's params are ``(target_params, ex)``: the caller passes the target's params as the
draft params too (JAX does not copy them); ``ex`` is None or the dict built by ``draft_params``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jspec.cache import KVCache
from jspec.drafters import DraftContext, Drafter, Proposal
from jspec.model import Model
from jspec.sampling import distribution, sample, split_keys
from models import llama
from models.llama import LlamaConfig, Params

# Logit of a token outside a restricted draft head: finite so temperature scaling cannot make NaNs, small
# enough that softmax gives it exactly 0 in float32.
_OUTSIDE_HEAD = -1e30


# --------------------------------------------------------------------------------------------------------
# Running a range of the target's layers.


def run_layer_range(
    cfg: LlamaConfig,
    params: Params,
    h: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    start: int,
    stop: int,
) -> tuple[jax.Array, KVCache]:
    """Layers [start, stop) of the target on hidden states; same contract as ``models.llama.run_layers``.

    h [B, T, Dm]; positions [B, T] int32; cache k/v [L, B, Hkv, S, D] (the T entries are written at slots
    ``cache.lengths + t`` of layers [start, stop), other layers untouched). Returns (h [B, T, Dm], cache).

    Why not ``llama.run_layers(start=, stop=)``: it slices the stacked weights ``w[start:stop]`` before its
    scan, which materialises a copy of those layers' weights on every call; inside a decode round that is
    pure extra memory traffic (measured on SmolLM2, 22 layers, 5 tokens: 330 ms vs 104 ms median under
    load). Here the scan runs over layer indices and indexes each layer inside the loop, as a full-depth
    scan does. ``tests/test_layerskip.py`` checks it against ``llama.run_layers``.
    """
    if not 0 <= start < stop <= cfg.num_layers:
        raise ValueError(f"layer range [{start}, {stop}) outside [0, {cfg.num_layers})")
    if llama.is_unstacked(params):  # no slicing: the Python loop takes the range
        return llama.run_layers(cfg, params, h, positions, cache, start=start, stop=stop)
    inputs = llama.layer_inputs(cfg, positions, cache.lengths, cache.k.shape[3])  # each layer kind's masks, RoPE
    block = llama.Block(cfg)
    layers = params["layers"]

    def body(carry, layer):
        x, k_all, v_all = carry
        lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False), layers)
        cos, sin, mask = llama.inputs_of_layer(cfg, inputs, layer)
        x, k_all, v_all = block.apply({"params": lp}, x, cos, sin, k_all, v_all, layer, cache.lengths, mask)
        return (x, k_all, v_all), None

    (h, k, v), _ = jax.lax.scan(body, (h, cache.k, cache.v), jnp.arange(start, stop, dtype=jnp.int32))
    return h, dataclasses.replace(cache, k=k, v=v)


# --------------------------------------------------------------------------------------------------------
# Exit adapter.


class ExitAdapter(nn.Module):
    """h + W_down(silu(W_gate n) * W_up n), n = RMSNorm(h): one residual SwiGLU block (a decoder layer
    without attention), between layer E's hidden state and the target's final norm + LM head.

    W_down starts at zero, so an untrained adapter is the identity: training starts from the plain early
    exit and can only move away from it where the loss says so.
    """

    width: int  # F
    eps: float = 1e-5

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:  # [B, T, Dm] -> [B, T, Dm]
        dm = h.shape[-1]
        scale = self.param("norm_scale", nn.initializers.ones, (dm,))
        w_gate = self.param("w_gate", nn.initializers.normal(1.0 / math.sqrt(dm)), (dm, self.width))
        w_up = self.param("w_up", nn.initializers.normal(1.0 / math.sqrt(dm)), (dm, self.width))
        w_down = self.param("w_down", nn.initializers.zeros, (self.width, dm))
        hf = h.astype(jnp.float32)
        n = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + self.eps) * scale
        y = (jax.nn.silu(n @ w_gate) * (n @ w_up)) @ w_down
        return (hf + y).astype(h.dtype)


def init_adapter(cfg: LlamaConfig, key: jax.Array, width: int) -> Params:
    """Exit adapter parameters: norm_scale [Dm], w_gate / w_up [Dm, F], w_down [F, Dm] (zeros), float32."""
    return ExitAdapter(width, cfg.rms_eps).init(key, jnp.zeros((1, 1, cfg.hidden), jnp.float32))["params"]


def apply_adapter(cfg: LlamaConfig, adapter: Params, h: jax.Array) -> jax.Array:
    """[B, T, Dm] -> [B, T, Dm]."""
    width = adapter["w_gate"].shape[1]
    return ExitAdapter(width, cfg.rms_eps).apply({"params": adapter}, h)


def head_rows(cfg: LlamaConfig, target_params: Params, token_ids: jax.Array) -> jax.Array:
    """The LM head's rows for a token subset: token_ids [N] -> [N, Dm] (tied: embedding rows), in either layout
    (an untied head packed for the CPU kernel is read through its panels)."""
    return llama.lm_head_rows(cfg, target_params, token_ids)


def exit_logits(cfg: LlamaConfig, target_params: Params, ex: dict | None, h: jax.Array) -> jax.Array:
    """Hidden state after layer E [B, T, Dm] -> draft logits [B, T, V] float32: (adapter) + the target's final
    norm + LM head, or its restricted rows (``ex["head"]`` [N, Dm], ``ex["token_ids"]`` [N]; every other
    token gets a logit that softmax maps to exactly 0)."""
    ex = ex or {}
    if "adapter" in ex:
        h = apply_adapter(cfg, ex["adapter"], h)
    hn = llama.final_norm(cfg, target_params, h)
    if "head" not in ex:
        return llama.lm_head(cfg, target_params, hn)
    sub = jnp.einsum("bte,ne->btn", hn, ex["head"].astype(hn.dtype), preferred_element_type=jnp.float32)
    full = jnp.full(sub.shape[:2] + (cfg.vocab_size,), _OUTSIDE_HEAD, jnp.float32)
    return full.at[:, :, ex["token_ids"]].set(sub)


@functools.cache
def exit_model(cfg: LlamaConfig, exit_layer: int) -> Model:
    """The exit as a stand-alone draft ``Model``: layers [0, E) with a cache of their own ([E, B, Hkv, S, D]),
    then (adapter) + final norm + LM head (``exit_logits``). Its params are ``(target params cut to E layers,
    ex)`` (``LayerSkipDrafter.as_model``). This is what the candidate-tree drafters run: a tree's nodes are
    scratch entries of the draft's own cache, so the chain's sharing of the target cache does not carry over
    and the verification runs all L layers. One ``Model`` per (config, E), so jit sees one static identity."""
    if not 1 <= exit_layer < cfg.num_layers:
        raise ValueError(f"exit_layer={exit_layer} must be in [1, {cfg.num_layers - 1}]")
    cfg_e = cfg.layers_of(tuple(range(exit_layer)), name=f"{cfg.name}-exit{exit_layer}")

    def apply(params, tokens, positions, cache, tree_mask=None):
        tparams, ex = params
        h = llama.embed(cfg_e, tparams, tokens)
        h, cache = llama.run_layers(cfg_e, tparams, h, positions, cache, tree_mask)
        return exit_logits(cfg_e, tparams, ex, h), cache

    def make_cache(batch: int, slots: int) -> KVCache:
        return llama.init_cache(cfg_e, batch, slots)

    return Model(apply=apply, init_cache=make_cache, vocab_size=cfg.vocab_size, name=cfg_e.name)


# --------------------------------------------------------------------------------------------------------
# The drafter.


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(Drafter):
    """Self-speculation with the target's first ``exit_layer`` layers (jspec drafter protocol, shares the
    target's cache and replaces the verification call).

    cfg: the target's config. exit_layer: E, 1 <= E < L. adapter: the exit goes through an ``ExitAdapter``
    (its params in ``ex["adapter"]``). head_tokens: N > 0 restricts the draft head to N token rows (0: the
    full head). max_draft: the largest K this drafter will be asked for (its state holds K hidden states, and
    the decoder's loop state needs one fixed shape before K is known).
    """

    cfg: LlamaConfig
    exit_layer: int
    adapter: bool = False
    head_tokens: int = 0
    max_draft: int = 8

    shares_target_cache: ClassVar[bool] = True
    needs_params: ClassVar[bool] = True

    def __post_init__(self):
        if not 1 <= self.exit_layer < self.cfg.num_layers:
            raise ValueError(f"exit_layer={self.exit_layer} must be in [1, {self.cfg.num_layers - 1}]")
        if not 0 <= self.head_tokens <= self.cfg.vocab_size:
            raise ValueError(f"head_tokens={self.head_tokens} must be in [0, {self.cfg.vocab_size}]")
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def check_target(self, target: Model, target_params, draft_params) -> None:
        # Layers [0, E) run in propose with draft_params[0] and write the target's committed cache; [E, L) run in
        # verify with this config's forward pass: both must be the target's own.
        who = f"LayerSkip (exit after layer {self.exit_layer})"
        llama.check_model_of(target, self.cfg, who)
        if target_params is not None and draft_params is not None:
            llama.check_same_params(target_params, draft_params[0], who)

    def draft_params(self, target_params: Params, exit_params: dict | None = None) -> tuple[Params, dict | None]:
        """(target params, runtime exit params) for ``decode(..., draft_params=...)``.

        exit_params: what ``examples/train_early_exit.py`` saves, ``{"adapter": ..., "token_ids": [N]}``
        (either key as this drafter needs). The restricted head's rows are gathered here, once, not per step.
        """
        exit_params = dict(exit_params or {})
        unknown = sorted(set(exit_params) - {"adapter", "token_ids"})
        if unknown:
            raise ValueError(f"exit params hold {unknown[0]!r}: only 'adapter' and 'token_ids' are read")
        if not self.head_tokens and "token_ids" in exit_params:
            raise ValueError("exit params give token_ids but the drafter has head_tokens=0 (the full head)")
        if self.adapter != ("adapter" in exit_params):
            raise ValueError(f"drafter adapter={self.adapter} but exit params have keys {sorted(exit_params)}")
        out = {}
        if self.adapter:
            out["adapter"] = exit_params["adapter"]
        if self.head_tokens:
            ids = jnp.asarray(exit_params.get("token_ids", np.zeros((0,), np.int32)), jnp.int32)
            if ids.shape != (self.head_tokens,):
                raise ValueError(f"head_tokens={self.head_tokens} needs token_ids of shape ({self.head_tokens},)")
            v = self.cfg.vocab_size
            try:  # checked on the host when the ids are concrete (not under a trace), as EAGLE's
                host = np.asarray(ids)
            except jax.errors.TracerArrayConversionError:
                host = None
            if host is not None and (host.min() < 0 or host.max() >= v or np.unique(host).size != host.size):
                # An id out of range was read from another row (or dropped on write); a repeat split q's mass.
                raise ValueError(f"token_ids must be {self.head_tokens} distinct ids in [0, {v}), got {host.tolist()}")
            out["token_ids"] = ids
            out["head"] = head_rows(self.cfg, target_params, ids)
        return target_params, (out or None)

    def as_model(self, draft_params: tuple[Params, dict | None]) -> tuple[Model, tuple[Params, dict | None]]:
        """This exit as a stand-alone draft model (``exit_model``) and its params, from what ``draft_params``
        returned: for ``jspec.drafters.TreeModelDrafter`` / ``DynamicTreeDrafter``, which build candidate trees
        from any draft ``Model``. Unstacked layers are shared with the target; stacked ones are sliced once
        here (an [E, ...] copy), not per call."""
        tparams, ex = draft_params
        e, layers = self.exit_layer, tparams["layers"]
        first = layers[:e] if llama.is_unstacked(tparams) else jax.tree.map(lambda w: w[:e], layers)
        return exit_model(self.cfg, e), ({**tparams, "layers": first}, ex)

    def init(self, params, prompt: jax.Array, prompt_len: jax.Array, slots: int) -> jax.Array:
        """Nothing to prefill (the target's prefill filled every layer); the state is the layer-E hidden
        states handed from ``propose`` to ``verify`` in the same round: [B, max_draft, Dm]."""
        return jnp.zeros((prompt.shape[0], self.max_draft, self.cfg.hidden), self.cfg.jdtype)

    def observe(self, params, state, ctx: DraftContext):
        # Rounds without proposals verify the pending token with the target's own 1-token call, which writes
        # every layer itself; the state is only read by the verify of the round that proposed it.
        return state

    def propose(self, params, state, ctx: DraftContext, key: jax.Array, k: int) -> Proposal:
        """K draft tokens [B, K] and their q [B, K, V]; the target cache gains layers [0, E) of the pending
        token and of the first K - 1 draft tokens (uncommitted, at slots committed + i)."""
        if k > self.max_draft:
            raise ValueError(f"LayerSkipDrafter(max_draft={self.max_draft}) asked for k={k} candidates")
        cfg, e = self.cfg, self.exit_layer
        tparams, ex = params
        cache = ctx.target_cache
        b = ctx.seq.shape[0]
        committed = ctx.seq_len - 1  # slot and position of the pending token
        x0 = ctx.seq[jnp.arange(b), committed]

        def step(carry, key_i):
            cache, x, i = carry
            pos = committed + i
            h = llama.embed(cfg, tparams, x[:, None])
            # Earlier draft entries count as committed for this call's mask: the draft token attends to them.
            h, cache = run_layer_range(cfg, tparams, h, pos[:, None], cache.with_lengths(pos), 0, e)
            q = distribution(exit_logits(cfg, tparams, ex, h)[:, 0], ctx.sampling)
            nx = sample(key_i, q)
            return (cache, nx, i + 1), (nx, q, h[:, 0])

        (cache, _, _), (xs, qs, hs) = jax.lax.scan(step, (cache, x0, jnp.int32(0)), split_keys(key, k))
        hs = jnp.swapaxes(hs, 0, 1)  # [B, K, Dm]: inputs pending, d1 .. d_{K-1}
        new_state = jax.lax.dynamic_update_slice_in_dim(state, hs.astype(state.dtype), 0, axis=1)
        return Proposal(
            tokens=xs.T,
            q=jnp.swapaxes(qs, 0, 1),
            n_draft=ctx.max_draft,
            state=new_state,
            target_cache=cache.with_lengths(committed),
        )

    def verify(
        self,
        target: Model,
        target_params: Params,
        draft_params,
        state: jax.Array,  # [B, max_draft, Dm]
        tokens: jax.Array,  # [B, K+1] pending token, then the K draft tokens
        positions: jax.Array,  # [B, K+1]
        cache: KVCache,
    ) -> tuple[jax.Array, KVCache]:
        """Target logits [B, K+1, V] for the verification, equal to a full target pass over ``tokens``, and
        the cache with every layer written for the K+1 positions."""
        cfg, e = self.cfg, self.exit_layer
        k = tokens.shape[1] - 1
        committed = cache.lengths
        # Layers [0, E) of the first K tokens are already in the cache (the draft wrote them); only the last
        # draft token still needs them, and it sees the draft's entries as its prefix.
        h_last = llama.embed(cfg, target_params, tokens[:, k:])
        h_last, cache = run_layer_range(
            cfg, target_params, h_last, positions[:, k:], cache.with_lengths(committed + k), 0, e
        )
        cache = cache.with_lengths(committed)
        h = jnp.concatenate([state[:, :k].astype(h_last.dtype), h_last], axis=1)  # [B, K+1, Dm]
        h, cache = run_layer_range(cfg, target_params, h, positions, cache, e, cfg.num_layers)
        return llama.head(cfg, target_params, h), cache


# --------------------------------------------------------------------------------------------------------
# Exit parameters on disk (orbax).


def abstract_exit_params(cfg: LlamaConfig, adapter_width: int = 0, head_tokens: int = 0) -> dict:
    """ShapeDtypeStruct tree of what ``save_exit_params`` writes, for a shape-checked restore."""
    out = {}
    if adapter_width:
        shapes = jax.eval_shape(lambda: init_adapter(cfg, jax.random.key(0), adapter_width))
        out["adapter"] = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    if head_tokens:
        out["token_ids"] = jax.ShapeDtypeStruct((head_tokens,), jnp.int32)
    return out


# The target's config fields a trained exit adapter or EAGLE head depends on: another value is another model
# (its hidden states are not the ones the weights were trained on), even where every shape agrees.
TARGET_FIELDS = (
    "vocab_size",
    "hidden",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "num_layers",
    "ffn",
    "rms_eps",
    "tie_embeddings",
    "qkv_bias",
)


def target_record(cfg: LlamaConfig) -> dict:
    """What meta.json records of the target an adapter was trained for: ``TARGET_FIELDS`` (compared on restore
    by ``check_trained_for``) and its name (for people: the same model loaded from GGUF or HF is named differently)."""
    return {**{f: getattr(cfg, f) for f in TARGET_FIELDS}, "name": cfg.name}


def check_trained_for(holder: str, saved: dict, target_cfg: LlamaConfig) -> None:
    """Refuse ``target_cfg`` by name unless it agrees with ``saved`` (a ``target_record`` or a config as a dict)
    on every ``TARGET_FIELDS`` entry ``saved`` has (one recorded before a field existed is not compared)."""
    for f in TARGET_FIELDS:
        if f not in saved:
            continue
        a, b = saved[f], getattr(target_cfg, f)
        # Floats compared loosely: a GGUF stores 1e-5 as float32 (9.99999974e-06), config.json as 1e-05.
        same = math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) or isinstance(b, float) else a == b
        if not same:
            raise ValueError(f"{holder} was trained for {f}={a}, target has {b}")


def save_exit_params(
    path: str | os.PathLike, exit_params: dict, meta: dict | None = None, target_cfg: LlamaConfig | None = None
) -> None:
    """Write ``exit_params`` ({"adapter": ..., "token_ids": ...}) with orbax under ``path/params`` and
    ``meta`` (exit layer, widths, model name, metrics) to ``path/meta.json``. Overwrites. ``target_cfg``: the
    model the params were trained for, recorded as meta.json's ``target`` (``target_record``), so that
    ``restore_exit_params`` refuses another model by name."""
    path = os.path.abspath(os.fspath(path))  # orbax requires absolute paths
    os.makedirs(path, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(path, "params"), exit_params, force=True)
    ckpt.wait_until_finished()
    meta = dict(meta or {})
    if target_cfg is not None:
        meta["target"] = target_record(target_cfg)
    meta["adapter_width"] = int(exit_params["adapter"]["w_gate"].shape[1]) if "adapter" in exit_params else 0
    meta["head_tokens"] = int(exit_params["token_ids"].shape[0]) if "token_ids" in exit_params else 0
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def load_exit_meta(path: str | os.PathLike) -> dict:
    with open(os.path.join(os.fspath(path), "meta.json")) as f:
        return json.load(f)


def _stored_shapes(ckpt, path: str) -> Any:
    tree = ckpt.metadata(os.path.join(path, "params"))
    tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)  # orbax >= 0.11 wraps the tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def check_stored(holder: str, stored: Any, expected: Any) -> None:
    """Refuse, naming the leaf, stored arrays (``_stored_shapes``) that are not the tree ``expected`` restores
    into (a meta.json that disagrees with params/): orbax's own error names no key. A float leaf may be stored in
    another float dtype (``eagle.export_head`` writes bf16; the restore casts it), never as an integer one or the
    other way round."""

    def flat(tree) -> dict:
        return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    def spec(x) -> str:
        return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"

    def floating(x) -> bool:
        return jnp.issubdtype(x.dtype, jnp.floating)

    got, want = flat(stored), flat(expected)
    for key, w in want.items():
        if key not in got:
            raise ValueError(f"{holder}: no stored leaf {key} (expected {spec(w)})")
        g = got[key]
        if tuple(g.shape) != tuple(w.shape) or floating(g) != floating(w):
            raise ValueError(f"{holder}: stored leaf {key} is {spec(g)}, not compatible with the expected {spec(w)}")
    extra = sorted(got.keys() - want.keys())
    if extra:
        raise ValueError(f"{holder}: stored leaf {extra[0]} ({spec(got[extra[0]])}) is not expected")


def restore_exit_params(
    path: str | os.PathLike, cfg: LlamaConfig | None = None, target: Any = None, *, holder: str | None = None
) -> dict:
    """Read what ``save_exit_params`` wrote. With ``target`` (a tree of ``jax.ShapeDtypeStruct``, e.g. from
    ``abstract_exit_params``) orbax restores into exactly those shapes, dtypes and shardings; with ``cfg``
    only, the target is built from ``meta.json``; with neither, from the checkpoint's own metadata. Leaves
    without a sharding land on the default device, whatever device wrote them.

    With ``cfg`` (the target model) the params must have been trained for it: meta.json's ``target`` record
    (``save_exit_params(target_cfg=)``) is compared field by field, and an adapter of another width is refused
    by name (files written before the record existed are checked on that width only). Stored arrays of another
    shape than the target's are refused naming the leaf (``check_stored``); ``holder`` names the file there."""
    path = os.path.abspath(os.fspath(path))
    ckpt = ocp.StandardCheckpointer()
    if cfg is not None:
        meta = load_exit_meta(path)
        holder = holder or f"exit adapter '{path}'"
        if isinstance(meta.get("target"), dict):
            check_trained_for(holder, meta["target"], cfg)
        stored = _stored_shapes(ckpt, path)
        if "adapter" in stored and stored["adapter"]["norm_scale"].shape != (cfg.hidden,):
            raise ValueError(
                f"{holder} was trained for hidden={stored['adapter']['norm_scale'].shape[0]}, target has {cfg.hidden}"
            )
        if target is None:
            target = abstract_exit_params(cfg, meta["adapter_width"], meta["head_tokens"])
        check_stored(holder, stored, target)
    elif target is None:
        target = _stored_shapes(ckpt, path)
    else:
        check_stored(holder or f"'{path}'", _stored_shapes(ckpt, path), target)
    # A leaf without a sharding goes to the default device. Left to orbax, it would take the sharding
    # recorded at save time, and a file written on one host's cpu:0 would not load on a GPU host.
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: (
            x if getattr(x, "sharding", None) is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default)
        ),
        target,
    )
    return ckpt.restore(os.path.join(path, "params"), target)


def default_cache_dir() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/early_exit``: where trained exit adapters live."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "early_exit")


def exit_cache_path(model_name: str, exit_layer: int, adapter_width: int, head_tokens: int) -> str:
    """One directory per (model, E, F, N) under ``default_cache_dir()``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name.lower())
    return os.path.join(default_cache_dir(), f"{safe}-E{exit_layer}-F{adapter_width}-N{head_tokens}")
