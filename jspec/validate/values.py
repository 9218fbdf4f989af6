"""Single values and ids: whole numbers, flags, seeds, counts, EOS ids, PRNG keys; and command-line flag names."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np


def _has_bool(x) -> bool:
    """A bool anywhere in a (nested) list or tuple, or a bool array in one: numpy promotes [2, True] to ints,
    hiding it."""
    if isinstance(x, bool | np.bool_) or getattr(x, "dtype", None) == np.bool_:
        return True
    return isinstance(x, list | tuple) and any(_has_bool(v) for v in x)


def int_array(x, name: str) -> np.ndarray:
    """``x`` as an int64 array. A value that is not a whole number (2.7, True, a string) or does not fit
    int64 is an error naming ``name``: numpy's int cast would truncate or wrap it silently."""
    try:
        a = np.asarray(x)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"{name} must be integers, got {x!r:.80}: {e}") from None
    whole = a.dtype.kind in "iu" or (a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a)))
    if not whole or _has_bool(x):  # 3.0 is 3; an empty list is float64 and stays empty
        raise ValueError(f"{name} must be integers, got {x!r:.80}")
    if a.size and (a.min() < -(2**63) or a.max() >= 2**63):  # uint64 or a float past int64
        raise ValueError(f"{name} is out of range: {x!r:.80}")
    return a.astype(np.int64)


def check_flag(name: str, value) -> bool:
    """A boolean option as a bool: a truthy "no" or "off" would switch the feature on, so only bools are taken."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_seed(seed) -> int:
    """A seed ``jax.random.key`` keeps whole: without 64-bit mode it keeps the low 32 bits (2**32 gives seed 0's
    stream, -1 gives 2**32 - 1's), so a seed outside [0, 2**32) is refused rather than folded onto another."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an int, got {seed!r}")
    top = 2**63 if jax.config.jax_enable_x64 else 2**32
    if not 0 <= int(seed) < top:
        raise ValueError(f"seed must be in [0, {top}) (other values alias seeds in that range), got {seed}")
    return int(seed)


def check_count(name: str, value, least: int = 1) -> int:
    """An integer setting (a batch, a cache size, a width) as an int >= ``least``: a float, a bool or a string is
    refused, not cast."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def check_eos(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """``eos_ids`` (a sequence of token ids) -> the static tuple of DecodeConfig; an id that is not a whole
    number or outside [0, V) could never end a row, so it is an error rather than cast or kept."""
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, int | np.integer):
        raise ValueError(f"eos_ids must be a sequence of token ids, got the single value {eos_ids!r}: use [{eos_ids}]")
    ids = int_array(list(eos_ids), "eos_ids")
    if ids.ndim != 1:
        raise ValueError(f"eos_ids must be a flat sequence of token ids, got shape {ids.shape}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"eos_ids must be token ids in [0, {vocab_size}), got {bad.tolist()}")
    return tuple(sorted({int(e) for e in ids}))  # a set: [2, 3], [3, 2] and [2, 2, 3] share one compilation


def decode_key(seed, key, b: int) -> jax.Array:
    """The loop's PRNG key: ``key``, or one made from ``seed`` (default 0); both given is refused (one would be
    ignored). One seed / key drives the whole batch; B seeds (a sequence) or a [B] key array give each row its
    own stream (per-request seeds). A raw uint32[2] (or [B, 2]) key is wrapped, so it and the typed key it stands
    for share one compilation."""
    if key is not None:
        if seed is not None:
            raise ValueError("give seed or key, not both (the seed would be ignored)")
        key = key if isinstance(key, jax.Array) else jnp.asarray(key)
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            w = jax.random.key_data(jax.random.key(0)).shape[-1]  # words per key of the default PRNG (2: threefry)
            if key.dtype != jnp.uint32 or key.shape not in ((w,), (b, w)):
                raise ValueError(
                    f"key must be a jax.random.key (or [B] of them) or raw uint32 key data [{w}] / [B, {w}] with "
                    f"B = {b}, got {key.dtype}{list(key.shape)}"
                )
            key = jax.random.wrap_key_data(key)
        if key.shape not in ((), (b,)):
            raise ValueError(f"key must be one PRNG key (shape ()) or one per row (shape ({b},)), got {key.shape}")
        return key
    if seed is None:
        return jax.random.key(0)
    if isinstance(seed, list | tuple | np.ndarray):
        seeds = [check_seed(x) for x in np.asarray(seed, dtype=object).reshape(-1)] if np.ndim(seed) == 1 else None
        if seeds is None or len(seeds) != b:
            raise ValueError(f"seed must be one int or a list of {b} (one per row), got {seed!r:.80}")
        return jnp.stack([jax.random.key(x) for x in seeds])
    return jax.random.key(check_seed(seed))


@contextlib.contextmanager
def as_flags(names: Iterable[str]):
    """Inside, a ValueError whose message starts with one of ``names`` (``decode``'s keywords) names the command-line
    flag instead (``top_p must be ...`` -> ``--top-p must be ...``): the CLI and the benchmark scripts check their
    flags with these same functions."""
    names = tuple(names)
    try:
        yield
    except ValueError as e:
        m = re.match(r"(\w+)", str(e))
        if m is None or m.group(1) not in names:
            raise
        raise ValueError("--" + m.group(1).replace("_", "-") + str(e)[m.end() :]) from None
