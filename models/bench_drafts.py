"""Draft models the benchmark scripts build for a loaded target (``jspec.bench.targets.Target``: config, params,
tokenizer): the target's own first L layers (no training), or a distilled draft by name."""

from __future__ import annotations

import jax

from models.draft import load_draft
from models.llama import is_unstacked, make_model


def check_draft_layers(layers: int, num_layers: int | None = None) -> None:
    """--draft-layers L for a truncated-target draft: 1 <= L < the target's ``num_layers`` (all of them would be
    the target itself). ValueError naming the flag; with ``num_layers`` None (the target not loaded yet) only L >= 1
    is checked."""
    if layers < 1:
        raise ValueError(f"--draft-layers {layers}: must be >= 1 (the draft is the target's first L layers)")
    if num_layers is not None and layers >= num_layers:
        raise ValueError(
            f"--draft-layers {layers}: the target has {num_layers} layers; a truncated draft takes 1 to "
            f"{num_layers - 1} of them (all of them would be the target itself)"
        )


def truncated_draft(target, layers: int):
    """(Model, params) of the target's first ``layers`` decoder layers + final norm + LM head: a draft that
    needs no training and shares the tokenizer. Its params are views of the target's (no copy of the head)."""
    check_draft_layers(layers, target.config.num_layers)
    cfg = target.config.replace(num_layers=layers, name=f"{target.config.name}-first{layers}")
    params = dict(target.params)
    first = target.params["layers"]
    params["layers"] = first[:layers] if is_unstacked(params) else jax.tree.map(lambda w: w[:layers], first)
    return make_model(cfg), params


def distilled_draft(target, name: str):
    """(Model, params) of a draft trained by examples/train_draft.py (``models.draft``), checked against the
    target's tokenizer."""
    d = load_draft(name, target_config=target.config, tokenizer=target.tokenizer, unstacked=is_unstacked(target.params))
    return d.model, d.params
