"""Model definitions and checkpoint loading for jspec (jspec itself never imports this package).

The loaders (``load``, ``LoadedModel``, ``Tokenizer``) are imported when first used: the model definitions need
neither gguf nor tokenizers, so a machine without them (an accelerator image) can still build and run models.
"""

from models.checkpoint import CheckpointError
from models.llama import LlamaConfig, init_random_params, make_model, param_logical_axes

_LAZY = {"LoadedModel": "models.registry", "load": "models.registry", "Tokenizer": "models.tokenizer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "LlamaConfig",
    "LoadedModel",
    "Tokenizer",
    "init_random_params",
    "load",
    "make_model",
    "param_logical_axes",
]
