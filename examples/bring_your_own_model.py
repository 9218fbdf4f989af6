"""Bring your own model: a small Flax NNX decoder written without jspec in mind, decoded by jspec.

The first half is the researcher's model as flax's examples write one (RoPE, grouped-query attention, SwiGLU,
RMSNorm) and their naive generate loop. Its only concession is that attention calls ``self.attention_fn(q, k, v)``
(``nnx.MultiHeadAttention``'s convention) instead of inlining the softmax. The second half, ``main``, wraps a
target and a draft with ``models.adapter.from_nnx`` and decodes with prompt lookup, the draft model and a tree,
checking every greedy output against the naive loop. Random weights, no downloads. See docs/own_model.md.

    python examples/bring_your_own_model.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.decode import decode
from jspec.drafters import Drafter, ModelDrafter, TreeModelDrafter
from jspec.model import Model
from jspec.ngram import NgramDrafter
from jspec.tree import TreeRule, TreeSpec
from models.adapter import from_nnx

# ---- the researcher's model (knows nothing of jspec) ----


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    init_scale: float = 1.0  # > 1: sharper, more position-dependent next-token distributions


def causal_attention(q, k, v):  # [B, T, H, D], [B, T, Hkv, D] x2 -> [B, T, H, D]
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def rope(x, positions, theta: float = 10_000.0):  # x [B, T, H, D], positions [B, T]
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half) / half)
    angle = positions[..., None, None] * freq  # [B, T, 1, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        init = nnx.initializers.normal(cfg.init_scale / cfg.dim**0.5)
        self.q = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.kv = nnx.Linear(cfg.dim, 2 * cfg.kv_heads * self.head_dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.attention_fn = causal_attention

    def __call__(self, x, positions):  # [B, T, E] -> [B, T, E]
        b, t, _ = x.shape
        q = rope(self.q(x).reshape(b, t, self.heads, self.head_dim), positions)
        k, v = jnp.split(self.kv(x).reshape(b, t, 2 * self.kv_heads, self.head_dim), 2, axis=2)
        return self.out(self.attention_fn(q, rope(k, positions), v).reshape(b, t, -1))


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_scale / cfg.dim**0.5)
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(cfg.dim, rngs=rngs), nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.gate_up = nnx.Linear(cfg.dim, 2 * cfg.ffn, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(cfg.ffn, cfg.dim, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        return x + self.down(nnx.silu(gate) * up)


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.dim, rngs=rngs)

    def __call__(self, tokens, positions):  # [B, T] int, [B, T] int -> logits [B, T, V]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x))


@nnx.jit
def forward(model: Decoder, tokens, positions):
    return model(tokens, positions)


def naive_generate(model: Decoder, prompt: list[int], n: int, width: int | None = None) -> list[int]:
    """Greedy, the whole sequence recomputed for every token. One padded buffer of ``width`` tokens keeps one
    compiled forward for every step: causal attention never reads the padding after the last real token."""
    width = width or len(prompt) + n
    seq = jnp.zeros((1, width), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    positions = jnp.arange(width)[None]
    for i in range(len(prompt), len(prompt) + n):
        seq = seq.at[0, i].set(jnp.argmax(forward(model, seq, positions)[0, i - 1]))
    return seq[0, len(prompt) : len(prompt) + n].tolist()


# ---- jspec: everything below is the wrap and the decodes ----

PROMPTS = [[5, 9, 2, 7, 5, 9, 2], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [11, 40, 3]]  # ragged, two of them repetitive
NEW_TOKENS = 24


def build(cfg: Config = Config(), draft_layers: int = 1, seed: int = 0) -> tuple[Decoder, Decoder]:
    """(target, draft). The same seed gives the draft the target's embedding, head and first layer (initialised
    first, in this order): a stand-in for a trained draft that agrees with the target often."""
    draft_cfg = dataclasses.replace(cfg, layers=draft_layers)
    return Decoder(cfg, rngs=nnx.Rngs(seed)), Decoder(draft_cfg, rngs=nnx.Rngs(seed))


def drafters(draft: Model) -> dict[str, Drafter]:
    return {
        "n-gram": NgramDrafter(vocab_size=draft.vocab_size),
        "draft model": ModelDrafter(draft),
        "tree": TreeModelDrafter(draft, TreeSpec((2, 2, 1)), TreeRule.DETERMINISTIC),
    }


def main() -> None:
    target, draft = build()
    jtarget, tparams = from_nnx(target, name="target")  # the whole wrap: one line per model
    jdraft, dparams = from_nnx(draft, name="draft")
    width = max(map(len, PROMPTS)) + NEW_TOKENS
    expected = [naive_generate(target, p, NEW_TOKENS, width) for p in PROMPTS]
    for name, drafter in drafters(jdraft).items():
        out = decode(jtarget, tparams, PROMPTS, drafter=drafter, draft_params=dparams, max_new_tokens=NEW_TOKENS)
        same = out.tokens == expected
        print(f"{name:12s} greedy equals the naive loop: {same}, tokens per round {out.stats['tokens_per_round']:.2f}")
        assert same, (name, out.tokens, expected)
    kw = dict(temperature=0.8, top_p=0.9, seed=0, max_new_tokens=NEW_TOKENS)
    sampled = decode(jtarget, tparams, PROMPTS, drafter=ModelDrafter(jdraft), draft_params=dparams, **kw)
    print("sampled at T=0.8, top-p 0.9 (lossless: the target's own distribution):", sampled.tokens[0])


if __name__ == "__main__":
    main()
