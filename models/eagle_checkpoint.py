"""Saved EAGLE heads: their format on disk, where they are found, and loading one as a drafter.

Why a module of its own: training writes heads (``examples/train_eagle.py``) and the CLI, the registry and the
benchmarks read them, without either needing the head's maths. A head is a directory: ``params/`` (orbax, through
``models.layerskip``'s checkpoint helpers, which refuse stored leaves of another shape) and ``meta.json``
(format, kind, config, metrics). A name resolves to a directory, a head trained under ``cache_root()``, or a
head bundled in ``models/heads/`` (stored in bf16 by ``export_head``) so that a chat drafter works without the
hours of CPU its training costs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.eagle_drafter import EagleDrafter
from models.eagle_head import EagleConfig, abstract_head, check_token_ids
from models.layerskip import check_trained_for, load_exit_meta, restore_exit_params, save_exit_params
from models.llama import LlamaConfig, Params

FORMAT_VERSION = 1


def save_head(path: str | os.PathLike, ecfg: EagleConfig, hp: Params, meta: dict | None = None) -> str:
    """Write ``path/params`` (orbax) and ``path/meta.json`` (config, frequent-token map size, metrics).
    ``hp`` may carry runtime ``rows``; they are not saved (rebuilt from the target). Overwrites."""
    hp = {k: v for k, v in hp.items() if k != "rows"}
    meta = {**(meta or {}), "format": FORMAT_VERSION, "kind": "eagle", "config": ecfg.to_json()}
    save_exit_params(path, hp, meta)
    return os.fspath(path)


def restore_head(path: str | os.PathLike, target_cfg: LlamaConfig | None = None) -> tuple[EagleConfig, Params]:
    """Read what ``save_head`` wrote: (config, head params). With ``target_cfg`` the head must match it
    (same widths, depth, norm epsilon, embedding tying, attention biases and vocabulary: a head trained for
    another model of the same width would load and draft nothing useful). The params come back float32 (a bf16
    export widened); the drafter casts them to the target's dtype where it uses them."""
    meta = load_exit_meta(path)
    if meta.get("kind") != "eagle" or meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"'{path}' is not an EAGLE head of format {FORMAT_VERSION}")
    ecfg = EagleConfig.from_json(meta["config"], name=os.path.basename(os.path.normpath(os.fspath(path))))
    if target_cfg is not None:
        # Every field of models.layerskip.TARGET_FIELDS (qkv_bias included: a Llama head on a Qwen2 target of
        # the same widths); a head saved before qkv_bias was recorded was trained for a model without biases.
        check_trained_for(f"head '{path}'", dataclasses.asdict(ecfg.target), target_cfg)
        ecfg = dataclasses.replace(ecfg, target=target_cfg)
    # Stored arrays that disagree with meta.json's config (another depth, fusion, head size) are refused by leaf.
    params = restore_exit_params(path, target=abstract_head(ecfg), holder=f"EAGLE head '{path}'")
    check_token_ids(ecfg, np.asarray(params["token_ids"]))  # what expand_to_vocab scatters q over
    return ecfg, params


def cache_root() -> str:
    """``${JSPEC_CACHE:-~/.cache/jspec}/eagle``: where examples/train_eagle.py writes its heads and data."""
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "eagle")


# Heads shipped in the repository (``export_head``, bf16: ~6.6 MB each), so a chat drafter works without the
# hours of CPU its data and training cost. DEFAULT_HEAD is what ``--drafter eagle`` and bench_eagle.py use
# when no head is named.
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")
DEFAULT_HEAD = "smollm2-8k-chat-mp5"


def bundled_heads() -> list[str]:
    """Names of the heads under ``BUNDLED_DIR``."""
    if not os.path.isdir(BUNDLED_DIR):
        return []
    return sorted(n for n in os.listdir(BUNDLED_DIR) if os.path.isfile(os.path.join(BUNDLED_DIR, n, "meta.json")))


def resolve_head(path_or_name: str | os.PathLike) -> str:
    """A head directory, a name under ``cache_root()`` (where examples/train_eagle.py writes), or a bundled
    head's name; a trained head shadows a bundled one of the same name."""
    s = os.fspath(path_or_name)
    for cand in (s, os.path.join(cache_root(), s, "head"), os.path.join(BUNDLED_DIR, s)):
        if os.path.isfile(os.path.join(cand, "meta.json")):
            return cand
    raise FileNotFoundError(
        f"no EAGLE head '{s}': neither a head directory, a trained head under {cache_root()} nor a bundled head "
        f"({', '.join(bundled_heads()) or 'none'}) (train one with: python examples/train_eagle.py)"
    )


def export_head(
    src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "bfloat16", extra_meta: dict | None = None
) -> str:
    """Write the head at ``src`` (directory or name) to ``dst`` with its float parameters stored in ``dtype``
    (bf16 halves the files: how ``BUNDLED_DIR`` keeps under the repository's 20 MB limit). ``restore_head``
    widens them back to float32, so what loads is the ``dtype``-rounded head (on a packed CPU target
    its matrices are packed in bf16 anyway); the frequent-token map and meta.json's metrics are kept,
    ``extra_meta`` (e.g. the held-out evaluation) joins them."""
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"export dtype must be a float type, got {dtype!r}")
    path = resolve_head(src)
    ecfg, hp = restore_head(path)
    hp = {k: v if k == "token_ids" else jax.tree.map(lambda x: x.astype(dt), v) for k, v in hp.items()}
    meta = {k: v for k, v in read_meta(path).items() if k not in ("format", "kind", "config")}
    meta.update(extra_meta or {})
    meta.update(stored_dtype=dt.name, exported_from=meta.get("name") or os.path.basename(os.path.normpath(path)))
    return save_head(dst, ecfg, hp, meta)


def load_eagle(
    path_or_name: str | os.PathLike,
    target_cfg: LlamaConfig,
    target_params: Params,
    max_draft: int = 8,
    packed_dtype: str = "bfloat16",
) -> tuple[EagleDrafter, tuple[Params, Params]]:
    """(drafter, draft params) for ``jspec.decode`` from a saved head (directory or cache name);
    ``packed_dtype``: see ``EagleDrafter.draft_params``."""
    ecfg, hp = restore_head(resolve_head(path_or_name), target_cfg)
    drafter = EagleDrafter(ecfg, max_draft)
    return drafter, drafter.draft_params(target_params, hp, packed_dtype)


def read_meta(path_or_name: str | os.PathLike) -> dict[str, Any]:
    with open(os.path.join(resolve_head(path_or_name), "meta.json")) as f:
        return json.load(f)
