"""The target model a benchmark serves: a checkpoint loaded through ``jspec.loaders.model_loader()``.

``load_target`` loads it (by registry name or path, in a dtype, with stacked or per-layer arrays) into a
``Target``: config, params, model, tokenizer, and the checkpoint file it came from, whose identity (size and
hash of its first MiB) goes into every result next to ``tokenizer_info``. The package never imports
``models``: the registered loader resolves names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
from collections.abc import Sequence
from typing import Any

from jspec.bench import metrics
from jspec.loaders import end_ids


@dataclasses.dataclass
class Target:
    """A loaded checkpoint (through ``jspec.loaders.model_loader()``) and where it came from."""

    name: str
    config: Any
    params: Any
    model: Any
    tokenizer: Any
    path: str | None
    dtype: str

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(end_ids(self.tokenizer))  # every end token (Llama-3: <|eot_id|> too)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def info(self) -> dict[str, Any]:
        cfg = self.config
        cfg_d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
        return {
            "name": self.name,
            "dtype": self.dtype,
            "config": cfg_d,
            "params_bytes": metrics.tree_bytes(self.params),
            **metrics.file_fingerprint(self.path),
        }


def _checkpoint_path(load, name: str) -> str | None:
    """The checkpoint file behind ``name``: the path itself, or the loader module's ``resolve(name)`` when
    it has one (the registered loader of this repository does), read without importing any model package."""
    if os.path.exists(name):
        return name
    mod = inspect.getmodule(load)
    resolve = getattr(mod, "resolve", None)
    if callable(resolve):
        try:
            return os.fspath(resolve(name))
        except Exception:
            return None
    return None


def load_target(name: str = "smollm2-135m-instruct", dtype: str = "float32", layers: str = "stacked") -> Target:
    """layers: "stacked", "unstacked" (per-layer arrays: faster CPU decode steps, longer compiles) or "auto"
    (unstacked on CPU and GPU)."""
    from jspec.loaders import load_model, model_loader, wants_unstacked

    unstacked = wants_unstacked(layers)  # refuses anything else before loading
    load = model_loader()
    config, params, model, tok = load_model(load, name, dtype, unstacked=unstacked)
    if tok is None:
        raise SystemExit(f"'{name}' has no tokenizer; the benchmark workloads need one")
    return Target(name, config, params, model, tok, _checkpoint_path(load, name), dtype)


def tokenizer_info(tok) -> dict[str, Any]:
    tmpl = getattr(tok, "chat_template", None)
    return {
        "type": type(tok).__name__,
        "vocab_size": getattr(tok, "vocab_size", None),
        "eos_id": getattr(tok, "eos_id", None),
        "eos_ids": list(getattr(tok, "eos_ids", ())),
        "bos_id": getattr(tok, "bos_id", None),
        "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest()[:16] if tmpl else None,
        "summary": f"{type(tok).__name__} (vocab {getattr(tok, 'vocab_size', '?')}, EOS {getattr(tok, 'eos_id', '?')})",
    }
