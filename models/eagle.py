"""EAGLE-style draft head: one small transformer layer that drafts from the target's own hidden features.

One name for the whole EAGLE story (``from models.eagle import load_eagle``, ``from models import eagle as EG``),
each part a module of its own:

- ``models.eagle_head``: the head as a model: its config, its parameters (fresh, grafted, abstract) and its
  forward passes (the target's features, their fusion, the head step, training-time test).
- ``models.eagle_drafter``: the head as a jspec drafter: chains (``EagleDrafter``), static trees
  (``.as_tree``) and EAGLE-2 dynamic trees (``.as_dynamic_tree``).
- ``models.eagle_checkpoint``: heads on disk: save, restore, export in bf16, the bundled heads, and
  ``load_eagle`` (drafter and draft params from a saved head).

The head's vocabulary is a frequent-token map (``models.token_map``, the same rule as the distilled drafts');
training is ``models.training.eagle``.
"""

from models.eagle_checkpoint import (
    BUNDLED_DIR,
    DEFAULT_HEAD,
    FORMAT_VERSION,
    bundled_heads,
    cache_root,
    export_head,
    load_eagle,
    read_meta,
    resolve_head,
    restore_head,
    save_head,
)
from models.eagle_drafter import EagleDrafter, EagleDynamicTreeDrafter, EagleState, EagleTreeDrafter
from models.eagle_head import (
    EagleConfig,
    abstract_head,
    check_token_ids,
    expand_to_vocab,
    fuse_features,
    graft_fusion,
    graft_layers,
    head_features,
    head_unrolled,
    init_head,
    init_head_cache,
    param_count,
    split_trainable,
    subset_logits,
    target_features,
    unroll_mask,
)
from models.token_map import frequent_token_map, token_counts

# One rule for every restricted head (see ``models.token_map.frequent_token_map``): counts descending, ties to the
# lower id, EOS always kept.
frequent_tokens = frequent_token_map

__all__ = [
    "BUNDLED_DIR",
    "DEFAULT_HEAD",
    "FORMAT_VERSION",
    "EagleConfig",
    "EagleDrafter",
    "EagleDynamicTreeDrafter",
    "EagleState",
    "EagleTreeDrafter",
    "abstract_head",
    "bundled_heads",
    "cache_root",
    "check_token_ids",
    "expand_to_vocab",
    "export_head",
    "frequent_tokens",
    "fuse_features",
    "graft_fusion",
    "graft_layers",
    "head_features",
    "head_unrolled",
    "init_head",
    "init_head_cache",
    "load_eagle",
    "param_count",
    "read_meta",
    "resolve_head",
    "restore_head",
    "save_head",
    "split_trainable",
    "subset_logits",
    "target_features",
    "token_counts",
    "unroll_mask",
]
