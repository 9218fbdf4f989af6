"""Draft models: a small Llama that shares the target's tokenizer, built from the target and distilled to it.

One name for the whole draft-model story (``from models import draft as D``), each part a module of its own:

- ``models.draft_model``: the draft itself: its config, its parameters copied from the target (with an
  optional frequent-token head) and its forward pass as a ``jspec.model.Model``.
- ``models.token_map``: which N tokens a frequent-token head keeps (shared with the EAGLE heads).
- ``models.draft_distill``: distillation to the target: the teacher's top k, the KL loss, the train step.
- ``models.draft_compat``: whether a draft can draft for a target (vocabulary, token strings, special ids).
- ``models.draft_checkpoint``: drafts on disk: save, restore onto any device layout, and load checked against
  a target.
"""

from models.draft_checkpoint import (
    FORMAT_VERSION,
    META_FILE,
    PARAMS_DIR,
    LoadedDraft,
    ShardingSpec,
    cache_root,
    config_from_meta,
    load_draft,
    read_meta,
    resolve_draft,
    restore_draft,
    save_draft,
)
from models.draft_compat import (
    DraftMismatchError,
    as_drafter,
    check_compatible,
    check_models_compatible,
    tokenizer_tokens,
    tokens_fingerprint,
)
from models.draft_distill import distill_loss, make_train_step, merge_params, split_trainable, teacher_topk
from models.draft_model import (
    DraftConfig,
    draft_config,
    draft_logical_axes,
    expand_logits,
    forward,
    hidden,
    init_from_target,
    make_draft_model,
    subset_logits,
)
from models.token_map import frequent_token_map, token_counts

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "PARAMS_DIR",
    "DraftConfig",
    "DraftMismatchError",
    "LoadedDraft",
    "ShardingSpec",
    "as_drafter",
    "cache_root",
    "check_compatible",
    "check_models_compatible",
    "config_from_meta",
    "distill_loss",
    "draft_config",
    "draft_logical_axes",
    "expand_logits",
    "forward",
    "frequent_token_map",
    "hidden",
    "init_from_target",
    "load_draft",
    "make_draft_model",
    "make_train_step",
    "merge_params",
    "read_meta",
    "resolve_draft",
    "restore_draft",
    "save_draft",
    "split_trainable",
    "subset_logits",
    "teacher_topk",
    "token_counts",
    "tokenizer_tokens",
    "tokens_fingerprint",
]
