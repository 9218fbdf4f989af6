"""The shapes of models jspec is built for, as ``LlamaConfig``s with no weights: for lowering checks and cost
tables on random weights of the real sizes (nothing is downloaded; ``models.llama.abstract_params`` and
``init_random_params`` take them).

Numbers from each model's published config.json, Llama 3's RoPE scaling (``rope_type: llama3``) included, so that
what is lowered is the model's own computation; these configs serve shapes and random weights, never a forward
pass against the real weights.
"""

from __future__ import annotations

from models.config import RopeScaling
from models.llama import LlamaConfig

SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, ffn=1536,
    rope_theta=100000.0, tie_embeddings=True, bos_id=1, eos_id=2, max_positions=8192, name="smollm2-135m",
)  # fmt: skip
LLAMA_3_2_1B = LlamaConfig(
    vocab_size=128256, hidden=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, ffn=8192,
    rope_theta=500000.0, tie_embeddings=True, bos_id=128000, eos_id=128001, max_positions=131072,
    rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), dtype="bfloat16", name="llama-3.2-1b",
)  # fmt: skip
LLAMA_3_1_8B = LlamaConfig(
    vocab_size=128256, hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, ffn=14336,
    rope_theta=500000.0, tie_embeddings=False, bos_id=128000, eos_id=128001, max_positions=131072,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), dtype="bfloat16", name="llama-3.1-8b",
)  # fmt: skip

SHAPES: dict[str, LlamaConfig] = {c.name: c for c in (SMOLLM2_135M, LLAMA_3_2_1B, LLAMA_3_1_8B)}


def shape(name: str) -> LlamaConfig:
    """A config by name, refused with the known names."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
