"""Session-wide fixtures: the real SmolLM2 checkpoint and its transformers reference, each loaded ONCE.

Fixtures that need torch/transformers skip with a visible reason when those are absent; the JAX side of
the project never needs them.
"""

from __future__ import annotations

import gc
import importlib.util

import pytest

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
TORCH_REASON = "torch/transformers not installed (reference implementation): pip install -e '.[test]'"
requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason=TORCH_REASON)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Free every compiled program after each test module.

    XLA:CPU maps each executable into memory regions of its own (~3 per program, eager ops included). One
    process running the whole suite compiles many thousands, and past Linux's vm.max_map_count (65530) the
    compiler's mmap fails: the suite died with a segfault / abort inside XLA compilation near its end
    (measured: ~15k maps by 12% of the suite). Clearing per module keeps the count at one module's worth;
    shared fixtures only recompile what the next module calls.
    """
    yield
    import jax

    jax.clear_caches()
    gc.collect()


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
