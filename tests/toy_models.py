"""Table-driven toy models over a 3-5 token vocabulary, for exact distribution tests.

The next-token logits depend on the last two tokens and the position of the last one:
``logits = table[parent, token, pos % M]`` (parent = the token before, 0 at the very start). They follow
jspec's model protocol for real: the parent is read back from the model's own cache (token ids stored as
1-dim "keys"), found through the same attention mask a transformer uses, so cache commits, rollbacks and
tree masks are exercised exactly as for a real model: a stale or leaked cache entry changes the output.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np

from jspec.cache import KVCache, attention_mask, write_layer
from jspec.drafters import Drafter
from jspec.model import Model


def make_table_model(table: np.ndarray, name: str = "toy") -> Model:
    """table: [V, V, M, V] logits indexed by (parent token, token, position % M)."""
    tab = jnp.asarray(table, jnp.float32)
    v, _, m, _ = table.shape

    def apply(params, tokens, positions, cache, tree_mask=None):
        b, t = tokens.shape
        s = cache.k.shape[3]
        new = tokens.astype(jnp.float32)[:, None, :, None]  # [B, 1, T, 1]
        k = write_layer(cache.k[0], new, cache.lengths)
        mask = attention_mask(cache.lengths, t, s, tree_mask)  # [B, T, S]
        own = cache.lengths[:, None] + jnp.arange(t)[None, :]
        slot = jnp.arange(s)[None, None, :]
        visible = mask & (slot != own[:, :, None])
        parent = jnp.max(jnp.where(visible, slot, -1), axis=-1)  # the latest visible earlier slot
        prev = jnp.take_along_axis(k[:, 0, :, 0], jnp.maximum(parent, 0), axis=1).astype(jnp.int32)
        prev = jnp.where(parent >= 0, prev, 0)
        logits = params[prev, tokens, positions % m]
        return logits, KVCache(k[None], cache.v, cache.lengths)

    def init_cache(batch, slots):
        return KVCache.init(1, batch, 1, slots, 1)

    return Model(apply=apply, init_cache=init_cache, vocab_size=v, name=name), tab


def random_table(seed: int, vocab: int, period: int, scale: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(vocab, vocab, period, vocab)) * scale


# ---- an independent NumPy reference of the sampling transforms and the exact sequence distribution ----


def ref_transform(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Reference for one distribution, written from the definitions (float64)."""
    logits = np.asarray(logits, np.float64)
    v = logits.shape[-1]
    if temperature == 0:
        out = np.zeros(v)
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(v), key=lambda i: -p[i])
    keep = set(range(v))
    if 0 < top_k < v:
        kth = p[order[top_k - 1]]
        keep = {i for i in keep if p[i] >= kth}
    if top_p < 1.0:
        mass = sum(p[i] for i in keep)
        chosen, acc = set(), 0.0
        for i in order:
            if i not in keep:
                continue
            if acc < top_p:
                chosen.add(i)
            acc += p[i] / mass
        keep &= {i for i in keep if p[i] >= min(p[j] for j in chosen)}
    out = np.array([p[i] if i in keep else 0.0 for i in range(v)])
    out /= out.sum()
    if min_p > 0:
        out = np.where(out >= min_p * out.max(), out, 0.0)
        out /= out.sum()
    return out


def exact_sequence_distribution(table: np.ndarray, prompt: list[int], n_new: int, **sampling) -> dict:
    """P(generated sequence) for every sequence of n_new tokens, by enumeration."""
    v, _, m, _ = table.shape
    out = {}
    for seq in itertools.product(range(v), repeat=n_new):
        prob = 1.0
        full = list(prompt)
        for tok in seq:
            parent = full[-2] if len(full) >= 2 else 0
            prob *= ref_transform(table[parent, full[-1], (len(full) - 1) % m], **sampling)[tok]
            full.append(tok)
        if prob > 0:
            out[seq] = prob
    return out


def exact_causal_distribution(logits_fn, vocab: int, prompt: list[int], n_new: int, **sampling) -> dict:
    """P(generated sequence) for every sequence of n_new tokens from a causal model, whose logits at a position
    depend on the tokens up to it only: ONE uncached forward over the prompt followed by every (n_new - 1)-token
    continuation, ``logits_fn(rows [M, T]) -> [M, T, V]``, holds the next-token logits after every prefix (the
    prefix x of length d is read from the row that starts with x). Products of the NumPy reference transform."""
    p0, tail = len(prompt), n_new - 1
    conts = np.array(list(itertools.product(range(vocab), repeat=tail)), np.int32).reshape(-1, tail)
    rows = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(conts), 1)), conts], axis=1)
    logits = np.asarray(logits_fn(jnp.asarray(rows)), np.float64)
    assert logits.shape == (len(conts), p0 + tail, vocab), logits.shape
    probs = {(): 1.0}
    for depth in range(n_new):
        nxt = {}
        for pre, p in probs.items():
            row = sum(tok * vocab ** (tail - 1 - i) for i, tok in enumerate(pre))
            dist = ref_transform(logits[row, p0 - 1 + depth], **sampling)
            for tok in np.flatnonzero(dist > 0):
                nxt[pre + (int(tok),)] = p * dist[tok]
        probs = nxt
    return probs


def empirical(tokens: np.ndarray) -> dict:
    seqs, counts = np.unique(np.asarray(tokens), axis=0, return_counts=True)
    n = counts.sum()
    return {tuple(int(x) for x in s): c / n for s, c in zip(seqs, counts)}


def chi_square(tokens: np.ndarray, exact: dict) -> tuple[float, int]:
    """Pearson chi-square of observed whole sequences against the exact distribution (outcomes with
    expected count < 5 pooled into one cell). Returns (statistic, degrees of freedom)."""
    tokens = np.asarray(tokens)
    n = tokens.shape[0]
    seqs, counts = np.unique(tokens, axis=0, return_counts=True)
    obs = {tuple(int(x) for x in s): int(c) for s, c in zip(seqs, counts)}
    unseen_impossible = sum(c for s, c in obs.items() if s not in exact)
    if unseen_impossible:
        return float("inf"), 1
    big = [s for s, p in exact.items() if p * n >= 5]
    small = [s for s, p in exact.items() if p * n < 5]
    cells = [(obs.get(s, 0), exact[s] * n) for s in big]
    if small:
        cells.append((sum(obs.get(s, 0) for s in small), sum(exact[s] for s in small) * n))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return float(stat), len(cells) - 1


def chi2_critical(df: int, z: float = 4.265) -> float:
    """Upper critical value of chi-square(df) by the Wilson-Hilferty approximation; z=4.265 is the
    one-sided 1e-5 quantile of the standard normal (a false alarm once in 100,000 runs)."""
    c = 2.0 / (9.0 * df)
    return df * (1 - c + z * np.sqrt(c)) ** 3


def grouped_rows(prompt: list[int], groups: list[dict], n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """n rows per sampling group, all in one batch: (prompts [n * G, P] int32, per-row ``temperature`` /
    ``top_k`` / ``top_p`` / ``min_p`` columns [n * G] for ``jspec.decode``), group g owning rows
    [g * n, (g + 1) * n)."""
    cols = {
        key: np.repeat([g.get(key, d) for g in groups], n)
        for key, d in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
    }
    return np.tile(np.asarray(prompt, np.int32), (n * len(groups), 1)), cols


class Forwarding(Drafter):
    """A test drafter wrapping ``inner``: its declared capabilities, its optional methods and everything else it
    does not define itself are the inner drafter's."""

    is_tree = property(lambda self: self.inner.is_tree)
    shares_target_cache = property(lambda self: self.inner.shares_target_cache)
    verify_updates_state = property(lambda self: self.inner.verify_updates_state)
    needs_params = property(lambda self: self.inner.needs_params)
    max_draft = property(lambda self: self.inner.max_draft)
    draft_model = property(lambda self: self.inner.draft_model)

    def init(self, *args):
        return self.inner.init(*args)

    def observe(self, *args):
        return self.inner.observe(*args)

    def check_target(self, *args):
        return self.inner.check_target(*args)

    def __getattr__(self, name):  # vocab_size, a tree's shape, verify, ...
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclasses.dataclass(frozen=True)
class MisreportedQ(Forwarding):
    """A deliberately lossy drafter for the power checks: it proposes exactly what ``inner`` proposes (a
    chain, or a tree's nodes) but reports q mixed with the uniform distribution (weight 1 - w), so
    verification accepts and corrects against a q the tokens were not drawn from."""

    inner: Drafter  # any drafter, chain or tree
    w: float

    def _misreport(self, prop):
        return dataclasses.replace(prop, q=self.w * prop.q + (1 - self.w) / self.vocab_size)

    def propose(self, params, state, ctx, key, k):
        return self._misreport(self.inner.propose(params, state, ctx, key, k))

    def propose_tree(self, params, state, ctx, key):
        return self._misreport(self.inner.propose_tree(params, state, ctx, key))
