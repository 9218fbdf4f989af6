"""Session-wide fixtures: the real SmolLM2 checkpoint and its transformers reference, each loaded ONCE.

Fixtures that need torch/transformers skip with a visible reason when those are absent; the JAX side of
the project never needs them.
"""

from __future__ import annotations

import importlib.util

import pytest

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
TORCH_REASON = "torch/transformers not installed (reference implementation): pip install -e '.[test]'"
requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason=TORCH_REASON)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from models.checkpoint import CheckpointError
    from models.registry import resolve

    try:
        return resolve("smollm2")
    except CheckpointError as e:  # the message says how to install the package
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """``models.registry.LoadedModel`` (config, params, model, tokenizer) of SmolLM2-135M-Instruct in f32."""
    from models.registry import load

    return load(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_apply(smollm2):
    """One jitted apply for the session, so each input shape compiles once across test files."""
    import jax

    return jax.jit(smollm2.model.apply)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' LlamaForCausalLM loaded from the same GGUF file, float32 (torch CPU)."""
    if not HAVE_TORCH:
        pytest.skip(TORCH_REASON)
    from models.hf_reference import transformers_from_gguf

    return transformers_from_gguf(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    if not HAVE_TORCH:
        pytest.skip(TORCH_REASON)
    from models.hf_reference import transformers_tokenizer_from_gguf

    return transformers_tokenizer_from_gguf(smollm2_path)
