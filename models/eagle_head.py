"""The EAGLE head as a model: its config, its parameters and its forward passes.

Kept apart from the drafter (``models.eagle_drafter``) and the checkpoints (``models.eagle_checkpoint``) because
training reads exactly this and nothing else: ``head_unrolled`` is the training-time forward, ``init_head``,
``graft_fusion`` and ``graft_layers`` start a run, ``split_trainable`` freezes the token map. Drafting calls the
same ``head_features`` per step, so what is trained is what drafts.

Dimension vocabulary: B batch, T tokens in a call, V vocab, N tokens of the draft head's vocabulary (the
frequent-token subset; N = V for a full head), E hidden width, S cache slots.

Features. f_t is the target's final normed hidden state at position t, the vector its LM head turns into
p(x_{t+1}) (``models.llama.forward(..., return_hidden=True)``).

Fusion (EAGLE-3, optional: ``EagleConfig.fuse``). The target also returns the outputs of a few lower layers
(``llama.forward(..., hidden_layers=fuse)``); ``fuse_features`` norms each, concatenates them with f_i and
projects back to E, and that g_i replaces f_i wherever a target feature enters the head (prefill,
verification). The rollout's later steps read the head's own f^, as without fusion.

Head step. Pair i is (f_i, x_{i+1}): RMSNorm(emb(x_{i+1})) and RMSNorm(f_i) are concatenated, projected
2E -> E, run through one Llama decoder layer (its own 1-layer KV cache, RoPE position i) and a final RMSNorm,
giving f^_{i+1}, the head's guess of the target's next feature; its logits over the N frequent tokens are
f^_{i+1} . rows, where rows [N, E] are the target's own LM-head rows of those tokens. Every other token gets
q = 0: it is never proposed, and the verifier's residual max(0, p - q) supplies it, so decoding stays
lossless (q is exactly what the head samples).

Parameters. Trainable head params (``init_head``): emb_norm, feat_norm, fc, layers (one stacked Llama
block), out_norm, with ``fuse`` the fusion's per-layer norms and projection, plus the frozen ``token_ids`` [N]
(ascending). ``models.eagle_drafter.EagleDrafter.draft_params`` builds the runtime params once per target:
(target params, head params + the gathered ``rows`` [N, E]).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import KVCache
from models import cpu_kernels, llama
from models.llama import LlamaConfig, Params


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static description of a head (hashable: part of the drafter, a static jit argument).

    target: the target's config (widths, vocabulary, RoPE, dtype). head_tokens: N, the size of the draft
    vocabulary (0 or V: the full LM head). ffn: the head layer's feed-forward width (0: the target's).
    fuse: target layers (ascending, each < L - 1) whose outputs join the final feature f_i as the head's
    input (EAGLE-3's low / mid / high fusion, ``fuse_features``); () = f_i alone (EAGLE-1/2). layers: the
    head's decoder layers (EAGLE uses one; ``graft_layers`` deepens a trained head).
    """

    target: LlamaConfig
    head_tokens: int = 8192
    ffn: int = 0
    name: str = "eagle"
    fuse: tuple[int, ...] = ()
    layers: int = 1

    def __post_init__(self):
        if not 0 <= self.head_tokens <= self.target.vocab_size:
            raise ValueError(f"head_tokens={self.head_tokens} must be in [0, {self.target.vocab_size}]")
        if isinstance(self.layers, bool) or not isinstance(self.layers, (int, np.integer)) or self.layers < 1:
            raise ValueError(f"layers={self.layers!r} must be an int >= 1")
        object.__setattr__(self, "layers", int(self.layers))
        f = tuple(self.fuse)
        if f and (list(f) != sorted(set(f)) or f[0] < 0 or f[-1] >= self.target.num_layers - 1):
            raise ValueError(
                f"fuse={f} must be distinct ascending target layers in [0, {self.target.num_layers - 1}) "
                "(the last layer's output is f itself)"
            )
        object.__setattr__(self, "fuse", f)

    @property
    def n(self) -> int:
        return self.head_tokens or self.target.vocab_size

    @property
    def layer_cfg(self) -> LlamaConfig:
        """The head's decoder layers: the target's attention shape, ``layers`` layers, their own FFN width."""
        # Full attention over the head's own cache whatever the target's layers do (a draft's choice: it changes
        # what the head proposes, never what is accepted).
        return self.target.replace(
            num_layers=self.layers, ffn=self.ffn or self.target.ffn, name=f"{self.name}-layer", sliding_layers=(),
            sliding_window=None,
        )  # fmt: skip

    @property
    def raw_width(self) -> int:
        """Width of the target features the head reads: (len(fuse) + 1) E."""
        return (len(self.fuse) + 1) * self.target.hidden

    def to_json(self) -> dict:
        d = {"target": dataclasses.asdict(self.target), "head_tokens": self.head_tokens, "ffn": self.ffn}
        return {**d, "fuse": list(self.fuse), "layers": self.layers}

    @classmethod
    def from_json(cls, d: dict, name: str = "eagle") -> EagleConfig:
        fuse = tuple(int(i) for i in d.get("fuse", ()))  # heads saved before fusion existed have none
        layers = int(d.get("layers", 1))  # nor did they say their depth: one layer
        return cls(LlamaConfig(**d["target"]), int(d["head_tokens"]), int(d["ffn"]), name, fuse, layers)


# --------------------------------------------------------------------------------------------------------
# Head parameters.


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def init_head(ecfg: EagleConfig, target_params: Params, key: jax.Array, token_ids: np.ndarray | None = None) -> Params:
    """Fresh head params (float32 numpy-drawn like ``llama.init_random_params``).

    The layer's attention/MLP output projections start small so the untrained layer is close to the identity
    on the fc output; fc starts as [0 | I]: f^_{i+1} = f_i plus a learned correction, a start that already
    lives in the target's feature space. out_norm starts at the target's final-norm scale (the features are
    that norm's output). token_ids default to the N lowest ids.
    """
    cfg = ecfg.target
    e = cfg.hidden
    layer = llama.init_random_params(ecfg.layer_cfg, key, std=0.02)["layers"]
    layer = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), layer)
    ids = np.arange(ecfg.n, dtype=np.int32) if token_ids is None else np.asarray(token_ids, np.int32)
    check_token_ids(ecfg, ids)
    fc = np.concatenate([np.zeros((e, e), np.float32), np.eye(e, dtype=np.float32)], axis=0)
    hp = {
        "emb_norm": {"scale": jnp.ones((e,), jnp.float32)},
        "feat_norm": {"scale": jnp.ones((e,), jnp.float32)},
        "fc": {"kernel": jnp.asarray(fc)},
        "layers": layer,
        "out_norm": {"scale": jnp.asarray(target_params["final_norm"]["scale"], jnp.float32)},
        "token_ids": jnp.asarray(ids),
    }
    return graft_fusion(ecfg, hp) if ecfg.fuse else hp


def graft_fusion(ecfg: EagleConfig, hp: Params) -> Params:
    """``hp`` (an unfused head's params) with a fresh fusion for ``ecfg.fuse``: kernel [0 | ... | 0 | I], so
    g_i = f_i and the grafted head drafts exactly as ``hp`` did until training teaches it what the lower layers
    add (the steps past the first read the head's own f^, which lives in f's space). ``init_head`` starts every
    fused head this way; examples/train_eagle.py grafts onto a trained unfused head (``--init-from`` with
    ``--fuse``)."""
    if not ecfg.fuse:
        raise ValueError("graft_fusion: the config has no fuse layers")
    if "fuse" in hp:
        raise ValueError("graft_fusion: the head already has a fusion")
    e, n = ecfg.target.hidden, len(ecfg.fuse)
    kernel = np.concatenate([np.zeros((n * e, e), np.float32), np.eye(e, dtype=np.float32)], axis=0)
    return {**hp, "fuse": {"norm": jnp.ones((n, e), jnp.float32), "kernel": jnp.asarray(kernel)}}


def graft_layers(ecfg: EagleConfig, hp: Params, key: jax.Array) -> Params:
    """``hp`` (a trained head's params, fewer layers than ``ecfg.layers``) with fresh layers appended on top,
    each starting as the identity: its attention and MLP output projections are zero, so the deeper head drafts
    exactly as ``hp`` did until training gives the new layers a share of the work (the other weights are drawn
    as ``init_head`` draws them, so their gradients are not zero once the projections move)."""
    have = jax.tree.leaves(hp["layers"])[0].shape[0]
    if have >= ecfg.layers:
        raise ValueError(f"graft_layers: the head has {have} layers, the config asks for {ecfg.layers}")
    extra = ecfg.layer_cfg.replace(num_layers=ecfg.layers - have)
    new = llama.init_random_params(extra, key, std=0.02)["layers"]
    new = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), new)
    new["attn"]["wo"] = jnp.zeros_like(new["attn"]["wo"])
    new["mlp"]["w_down"] = jnp.zeros_like(new["mlp"]["w_down"])
    old = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), hp["layers"])
    return {**hp, "layers": jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), old, new)}


def abstract_head(ecfg: EagleConfig) -> Params:
    """ShapeDtypeStruct tree of the head params (what ``save_head`` writes), for a shape-checked restore."""
    cfg = ecfg.target
    shapes = llama.abstract_params(ecfg.layer_cfg)["layers"]
    e = cfg.hidden

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    tree = {
        "emb_norm": {"scale": f32(e)},
        "feat_norm": {"scale": f32(e)},
        "fc": {"kernel": f32(2 * e, e)},
        "layers": jax.tree.map(lambda s: f32(*s.shape), shapes),
        "out_norm": {"scale": f32(e)},
        "token_ids": jax.ShapeDtypeStruct((ecfg.n,), jnp.int32),
    }
    if ecfg.fuse:
        tree["fuse"] = {"norm": f32(len(ecfg.fuse), e), "kernel": f32(ecfg.raw_width, e)}
    return tree


def split_trainable(hp: Params) -> tuple[Params, jax.Array]:
    """(trainable params, frozen token_ids [N])."""
    return {k: v for k, v in hp.items() if k != "token_ids"}, hp["token_ids"]


def param_count(hp: Params) -> int:
    """Trainable parameters read per draft step (the rows included when present)."""
    leaves = [x for k, sub in hp.items() if k != "token_ids" for x in jax.tree.leaves(sub)]
    return int(sum(math.prod(x.shape) for x in leaves))


# --------------------------------------------------------------------------------------------------------
# Forward.


def fuse_features(ecfg: EagleConfig, hp: Params, raw: jax.Array) -> jax.Array:
    """The target features [B, T, (len(fuse) + 1) E] (``llama.forward(..., hidden_layers=ecfg.fuse)``) ->
    the head's input g_i [B, T, E]: each fused layer's output RMS-normed (their scales differ by orders of
    magnitude along the residual stream), concatenated with f_i and projected (EAGLE-3). Identity without
    ``fuse``. Applied once where the target's features arrive (prefill, verification), so the drafter state,
    the catch-up and the rollout only ever see E-wide features."""
    if not ecfg.fuse:
        return raw
    cfg = ecfg.target
    dt = cfg.jdtype
    e, n = cfg.hidden, len(ecfg.fuse)
    raw = raw.astype(dt)
    parts = [_rms(raw[..., i * e : (i + 1) * e], hp["fuse"]["norm"][i].astype(dt), cfg.rms_eps) for i in range(n)]
    return llama.dense(jnp.concatenate(parts + [raw[..., n * e :]], axis=-1), hp["fuse"]["kernel"])


def target_features(
    ecfg: EagleConfig, target_params: Params, tokens, positions, cache, tree_mask=None, logits_at=None
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One target pass -> (logits, raw features [B, T, raw_width], cache): what every head call site reads."""
    return llama.forward(
        ecfg.target, target_params, tokens, positions, cache, tree_mask, True, logits_at, hidden_layers=ecfg.fuse
    )


def head_features(
    ecfg: EagleConfig,
    hp: Params,
    target_params: Params,
    feats: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """The head on T pairs: feats [B, T, E] (f_i), tokens [B, T] (x_{i+1}), positions [B, T] (i) ->
    (f^ [B, T, E] predicted next features, cache with the T entries written at ``lengths + t``, uncommitted).
    tree_mask [B, T, T] bool: which of the T pairs each pair sees (default causal), for candidate trees."""
    cfg, lcfg = ecfg.target, ecfg.layer_cfg
    dt = cfg.jdtype
    emb = llama.embed(cfg, target_params, tokens)
    x = jnp.concatenate(
        [
            _rms(emb, hp["emb_norm"]["scale"].astype(dt), cfg.rms_eps),
            _rms(feats.astype(dt), hp["feat_norm"]["scale"].astype(dt), cfg.rms_eps),
        ],
        axis=-1,
    )
    x = llama.dense(x, hp["fc"]["kernel"])
    x, cache = llama.run_layers(lcfg, {"layers": hp["layers"]}, x, positions, cache, tree_mask)
    return _rms(x, hp["out_norm"]["scale"].astype(dt), cfg.rms_eps), cache


def unroll_mask(t: int, u: int) -> np.ndarray:
    """[T, (u+1)T] bool: what pass u (0 = true features) of training-time test sees at position i, i.e.
    what draft step u of a rollout sees at inference: the committed pairs j <= i - u (computed from true
    features: slots j of pass 0), then the rollout's own entries, one per pass v in 1..u at j = i - (u - v)."""
    i = np.arange(t)[:, None]
    j = np.arange(t)[None, :]
    blocks = [j <= i - u] + [j == i - (u - v) for v in range(1, u + 1)]
    return np.concatenate(blocks, axis=1)


def head_unrolled(
    ecfg: EagleConfig, hp: Params, target_params: Params, feats: jax.Array, tokens: jax.Array, unroll: int
) -> jax.Array:
    """Training-time test (EAGLE-3): the head on every pair of whole sequences for ``unroll`` passes, pass u
    feeding on pass u-1's predicted features and attending exactly as draft step u does in ``propose``.

    feats [B, T, E] (true f_i), tokens [B, T] (x_{i+1}) -> f^ [U, B, T, E]; pass u at i predicts f_{i+1}.
    """
    cfg, lcfg = ecfg.target, ecfg.layer_cfg
    dt = cfg.jdtype
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = llama.rope_tables(pos, lcfg.head_dim, *lcfg.rope_of(False))  # as run_layers rotates the head
    emb = _rms(llama.embed(cfg, target_params, tokens), hp["emb_norm"]["scale"].astype(dt), cfg.rms_eps)
    cache = init_head_cache(ecfg, b, unroll * t)
    k_all, v_all = cache.k, cache.v
    block = llama.Block(lcfg)
    f_in, outs = feats.astype(dt), []
    for u in range(unroll):
        x = jnp.concatenate([emb, _rms(f_in, hp["feat_norm"]["scale"].astype(dt), cfg.rms_eps)], axis=-1)
        x = x @ hp["fc"]["kernel"].astype(dt)
        mask = np.zeros((t, unroll * t), bool)
        mask[:, : (u + 1) * t] = unroll_mask(t, u)
        lengths = jnp.full((b,), u * t, jnp.int32)
        for li in range(ecfg.layers):
            x, k_all, v_all = block.apply(
                {"params": jax.tree.map(lambda w, li=li: w[li], hp["layers"])},
                x,
                cos,
                sin,
                k_all,
                v_all,
                jnp.int32(li),
                lengths,
                jnp.broadcast_to(mask, (b, t, t * unroll)),
            )
        f_hat = _rms(x, hp["out_norm"]["scale"].astype(dt), cfg.rms_eps)
        outs.append(f_hat)
        # Position i of the next pass reads the prediction of f_i (made at i - 1); position 0 keeps f_0.
        f_in = jnp.concatenate([feats[:, :1].astype(dt), f_hat[:, :-1]], axis=1)
    return jnp.stack(outs)


def subset_logits(f_hat: jax.Array, rows: jax.Array) -> jax.Array:
    """f^ [B, T, E] . rows [N, E] -> logits over the head's tokens [B, T, N] float32. Only these N rows are
    read: on SmolLM2-135M the full tied head (49152 rows) would cost 6x more than the 8k-row one. ``rows`` may
    be a ``cpu_kernels.PackedMatrix`` of rows^T [E, N] (``EagleDrafter.draft_params`` next to a packed target)."""
    if isinstance(rows, cpu_kernels.PackedMatrix):
        return cpu_kernels.matmul(f_hat, rows)
    return jnp.einsum("bte,ne->btn", f_hat, rows.astype(f_hat.dtype), preferred_element_type=jnp.float32)


def expand_to_vocab(q_sub: jax.Array, token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """[..., N] probabilities over the subset -> [..., V] with exactly 0 outside it. Scattered even when N == V:
    a full head's ids are arange(V) when checked (``check_token_ids``), but ids traced under a caller's jit are
    not, and a permutation taken as arange would report q of other tokens than those drawn."""
    full = jnp.zeros(q_sub.shape[:-1] + (vocab_size,), q_sub.dtype)
    return full.at[..., token_ids].set(q_sub)


def check_token_ids(ecfg: EagleConfig, ids: np.ndarray) -> None:
    """The head's vocabulary: N distinct ascending ids in [0, V). ``expand_to_vocab`` scatters q over them: a
    repeated id would overwrite q, so the q verified would not be the q sampled."""
    v = ecfg.target.vocab_size
    if ids.shape != (ecfg.n,) or ids.min() < 0 or ids.max() >= v or np.any(np.diff(ids) <= 0):
        raise ValueError(f"token_ids must be {ecfg.n} distinct ascending ids in [0, {v}), got {ids[:8]}...")


def init_head_cache(ecfg: EagleConfig, batch: int, slots: int) -> KVCache:
    """The head's own cache: k/v [layers, B, Hkv, S, D]."""
    return llama.init_cache(ecfg.layer_cfg, batch, slots)
