"""Reference models from transformers (torch CPU) for parity tests and benchmarks. Imports torch lazily."""

from __future__ import annotations

import os


def transformers_from_gguf(path: str | os.PathLike, dtype: str = "float32"):
    """``AutoModelForCausalLM`` loaded by transformers' own GGUF converter from the same file.

    transformers refuses GGUF files unless ``accelerate`` is importable, although its GGUF path does not use
    it on CPU; when it is absent we lift that one gate instead of adding a dependency.
    """
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    path = os.fspath(path)
    gate = modeling_utils.is_accelerate_available
    if not gate():
        # Only for this call: elsewhere (e.g. save_pretrained) the flag selects code that needs accelerate.
        modeling_utils.is_accelerate_available = lambda: True
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
        )
    finally:
        modeling_utils.is_accelerate_available = gate
    return model.eval()


def transformers_tokenizer_from_gguf(path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = os.fspath(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
