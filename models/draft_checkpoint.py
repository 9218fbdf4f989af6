"""Saved draft models: their format on disk, where they are found, and loading one checked against a target.

On disk a draft is a directory: ``params/`` (an orbax checkpoint) and ``draft.json`` (config, the shape and
dtype of every leaf, the tokenizer's tokens), so it restores onto any device layout without the target.

Kept apart from the model (``models.draft_model``) because the trainer writes drafts and the CLI and registry
read them, neither needing the forward pass. Every save and restore refuses leaves other than the config
implies, so a directory never loads as another model than it says.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model import Model
from models import cpu_kernels
from models.draft_compat import check_compatible, special_ids, tokenizer_tokens, tokens_fingerprint
from models.draft_model import DraftConfig, make_draft_model
from models.llama import LlamaConfig, Params, abstract_params, is_packed, unstack_layers

FORMAT_VERSION = 1
META_FILE = "draft.json"
PARAMS_DIR = "params"


def cache_root() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/draft``: where trained drafts live (never in the repository)."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "draft")


def _leaf_specs(params: Params) -> dict[str, list]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(p): [list(x.shape), jnp.dtype(x.dtype).name] for p, x in flat}


def _config_leaf_specs(dcfg: DraftConfig) -> dict[str, list]:
    """``_leaf_specs`` of the params a draft of ``dcfg`` has: the stacked Llama tree in its dtype, with a
    frequent-token head in place of an untied ``lm_head``."""
    tree = abstract_params(dcfg.llama)
    if dcfg.head_size:
        tree.pop("lm_head", None)
        n = dcfg.head_size
        tree["head"] = {
            "weight": jax.ShapeDtypeStruct((n, dcfg.llama.hidden), dcfg.llama.jdtype),
            "ids": jax.ShapeDtypeStruct((n,), jnp.int32),
            "index": jax.ShapeDtypeStruct((dcfg.vocab_size,), jnp.int32),
        }
    return _leaf_specs(tree)


def _check_leaf_specs(holder: str, leaves: dict[str, list], dcfg: DraftConfig) -> None:
    """Refuse leaves (``_leaf_specs``) other than those ``dcfg`` implies, naming the first that differs: restored
    as recorded, they would load another depth or dtype than the config says, or fail far from the cause."""

    def spec(s) -> str:
        return f"{tuple(s[0])} {s[1]}"

    want = _config_leaf_specs(dcfg)
    for key, w in want.items():
        if key not in leaves:
            raise ValueError(f"{holder} has no leaf {key}; the draft's config implies {spec(w)}")
        got = [list(leaves[key][0]), str(leaves[key][1])]
        if got != w:
            raise ValueError(f"{holder} has leaf {key} of {spec(got)}; the draft's config implies {spec(w)}")
    extra = sorted(leaves.keys() - want.keys())
    if extra:
        raise ValueError(f"{holder} has leaf {extra[0]} of {spec(leaves[extra[0]])}; the draft's config has none")


def _check_head_maps(holder: str, head: Params, vocab_size: int) -> None:
    """The frequent-token head's integer maps must be each other's inverse: ``ids`` N distinct ids in [0, V),
    ``index[ids] = arange(N)`` and N everywhere else (else ``expand_logits`` puts q on the wrong tokens)."""
    ids = np.asarray(jax.device_get(head["ids"]))
    index = np.asarray(jax.device_get(head["index"]))
    n = ids.shape[0]
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{holder}: head id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != n:
        raise ValueError(f"{holder}: head id {int(uniq[counts > 1][0])} appears more than once")
    want = np.full(vocab_size, n, np.int64)
    want[ids] = np.arange(n)
    wrong = np.flatnonzero(index != want)
    if wrong.size:
        v = int(wrong[0])
        raise ValueError(f"{holder}: head index[{v}] is {int(index[v])}, the head ids imply {int(want[v])}")


def save_draft(
    path: str | os.PathLike,
    dcfg: DraftConfig,
    params: Params,
    tokenizer=None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write a draft directory (``params/`` orbax checkpoint + ``draft.json``); overwrites. Returns the path.

    tokenizer: the target's, recorded so ``load_draft`` can refuse a target with another tokenizer.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    # restore_draft refuses leaves other than the config implies: such params are refused before anything is written.
    _check_leaf_specs(f"save_draft '{path}': the params", _leaf_specs(params), dcfg)
    if dcfg.head_size:
        _check_head_maps(f"save_draft '{path}'", params["head"], dcfg.vocab_size)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, META_FILE)):  # an overwrite: the old json must not vouch for new params
        os.remove(os.path.join(path, META_FILE))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(path, PARAMS_DIR), params, force=True)
    ckpt.wait_until_finished()
    tokens = tokenizer_tokens(tokenizer) if tokenizer is not None else None
    meta = {
        "format": FORMAT_VERSION,
        "llama": dataclasses.asdict(dcfg.llama),
        "head_size": dcfg.head_size,
        "source_layers": list(dcfg.source_layers),
        "leaves": _leaf_specs(params),
        "tokenizer": None
        if tokens is None
        else {"sha256": tokens_fingerprint(tokens), "tokens": tokens, **special_ids(tokenizer)},
        "extra": extra or {},
    }
    tmp = os.path.join(path, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(path, META_FILE))  # the json appears last: its presence marks a complete save
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    meta_path = os.path.join(os.fspath(path), META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no draft at '{path}' ({META_FILE} missing: not a draft directory, or unfinished)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"'{path}': draft format {meta.get('format')!r}, this code reads {FORMAT_VERSION}")
    return meta


def config_from_meta(meta: dict[str, Any]) -> DraftConfig:
    return DraftConfig(LlamaConfig(**meta["llama"]), int(meta["head_size"]), tuple(meta["source_layers"]))


ShardingSpec = jax.sharding.Sharding | Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | None


def restore_draft(
    path: str | os.PathLike, sharding: ShardingSpec = None, dtype: Any = None
) -> tuple[DraftConfig, Params]:
    """Restore a saved draft onto any device layout.

    sharding: one ``jax.sharding.Sharding`` for every leaf, or ``fn(leaf path, shape) -> Sharding`` (e.g. to
      shard the head rows over a mesh axis), or None for the default device. Restoring through
      ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` targets is what lets a checkpoint written on one
      topology load onto another.
    dtype: cast floating leaves (e.g. "bfloat16") while restoring; integer maps keep their dtype.
    """
    import orbax.checkpoint as ocp

    meta = read_meta(path)
    dcfg = config_from_meta(meta)
    _check_leaf_specs(f"'{path}': {META_FILE}", meta["leaves"], dcfg)
    if dtype is not None:
        dcfg = dataclasses.replace(dcfg, llama=dcfg.llama.replace(dtype=dtype))
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(key: str, spec) -> jax.ShapeDtypeStruct:
        shape, dt = tuple(spec[0]), jnp.dtype(spec[1])
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = dcfg.llama.jdtype
        if sharding is None:
            shd = default
        elif isinstance(sharding, jax.sharding.Sharding):
            shd = sharding
        else:
            shd = sharding(key, shape)
        return jax.ShapeDtypeStruct(shape, dt, sharding=shd)

    leaves = meta["leaves"]
    # Rebuild the tree structure from the recorded key paths ("['layers']['attn']['wq']" -> nested dicts).
    abstract: dict[str, Any] = {}
    for key, spec in leaves.items():
        parts = [p.strip("'\"") for p in key.strip("[]").split("][")]
        node = abstract
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = target(key, spec)
    params = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(os.fspath(path)), PARAMS_DIR), abstract)
    if dcfg.head_size:
        _check_head_maps(f"'{path}'", params["head"], dcfg.vocab_size)
    return dcfg, params


class LoadedDraft(NamedTuple):
    config: DraftConfig
    params: Params
    model: Model
    path: str
    meta: dict[str, Any]

    def drafter(self):
        from jspec.drafters import ModelDrafter

        return ModelDrafter(self.model)


def resolve_draft(path_or_name: str | os.PathLike) -> str:
    """A draft directory, or a name in the cache (``cache_root()/<name>``, where train_draft.py writes)."""
    s = os.fspath(path_or_name)
    if os.path.isfile(os.path.join(s, META_FILE)):
        return s
    cached = os.path.join(cache_root(), s)
    for cand in (cached, os.path.join(cached, "draft")):
        if os.path.isfile(os.path.join(cand, META_FILE)):
            return cand
    raise FileNotFoundError(
        f"no draft '{s}': neither a draft directory nor a trained draft under {cache_root()} "
        "(train one with: python examples/train_draft.py)"
    )


def load_draft(
    path_or_name: str | os.PathLike,
    *,
    target_config: LlamaConfig | None = None,
    tokenizer=None,
    sharding: ShardingSpec = None,
    dtype: Any = None,
    unstacked: bool = False,
) -> LoadedDraft:
    """Load a saved draft (directory or cache name) and check it against the target.

    target_config / tokenizer: the target's; a vocabulary size, tokenizer or special-id mismatch raises
    ``DraftMismatchError`` naming it (a draft saved without a tokenizer is checked on size only).
    unstacked: return the params in the CPU decode layout (``models.llama.unstack_layers``), as for the target.
    """
    path = resolve_draft(path_or_name)
    meta = read_meta(path)
    if target_config is not None or tokenizer is not None:
        vocab = meta["llama"]["vocab_size"]
        tok_meta = meta.get("tokenizer")
        target_vocab = target_config.vocab_size if target_config is not None else tokenizer.vocab_size
        target_tokens = draft_tokens = None
        if tokenizer is not None and tok_meta is not None:
            target_tokens = tokenizer_tokens(tokenizer)
            if tokens_fingerprint(target_tokens) != tok_meta["sha256"]:
                draft_tokens = tok_meta["tokens"]
            else:
                draft_tokens = target_tokens  # identical: skip the 49k-string comparison
        check_compatible(
            target_vocab,
            vocab,
            target_tokens,
            draft_tokens,
            target_name=target_config.name if target_config is not None else "target",
            draft_name=meta["llama"]["name"],
            target_special=special_ids(tokenizer) if tokenizer is not None else None,
            draft_special={k: tok_meta.get(k) for k in ("eos_id", "bos_id")} if tok_meta else None,
        )
    dcfg, params = restore_draft(path, sharding, dtype)
    if unstacked:
        params = unstack_layers(params)
        if is_packed(params) and dcfg.head_size:  # the frequent-token head on the CPU kernel too
            head = params["head"]
            params = {**params, "head": {**head, "weight": cpu_kernels.pack(jnp.asarray(head["weight"]).T)}}
    return LoadedDraft(dcfg, params, make_draft_model(dcfg), path, meta)
