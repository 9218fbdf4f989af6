"""Model definitions and checkpoint loading for jspec (jspec itself never imports this package)."""

from models.checkpoint import CheckpointError
from models.llama import LlamaConfig, init_random_params, make_model, param_logical_axes
from models.registry import LoadedModel, load
from models.tokenizer import Tokenizer

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
