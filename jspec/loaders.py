"""Finding and loading checkpoints, shared by the CLI, the benchmarks and the tests.

The core never imports a model zoo: checkpoints are found through the ``jspec.model_loaders`` entry-point
group (this repository's ``models`` package registers ``llama``), so any installed package can provide them.
A loader is ``load(name_or_path, dtype) -> (config, params, model: jspec.model.Model, tokenizer)``; one that
also takes ``unstacked=`` is asked for the parameter layout that decodes fastest (``--layers``). Trained
drafters come through ``jspec.drafter_loaders`` the same way. Also here: JAX's persistent compilation cache,
which every command turns on so that a repeated run does not compile again.
"""

from __future__ import annotations

import inspect
import os
from importlib.metadata import entry_points


def model_loader(group: str = "jspec.model_loaders", name: str | None = None):
    found = [ep for ep in entry_points(group=group) if name is None or ep.name == name]
    if not found:
        what = f"'{name}' loader" if name else "loader"
        raise SystemExit(
            f"no {what} is registered in the '{group}' entry-point group; install this repository "
            "(pip install -e .) or a package that provides one"
        )
    return found[0].load()


COMPILE_CACHE_DEFAULT = os.environ.get("JSPEC_COMPILE_CACHE", os.path.join("~", ".cache", "jspec", "xla"))


LAYER_LAYOUTS = ("auto", "stacked", "unstacked")


def wants_unstacked(layers: str, backend: str | None = None) -> bool:
    """--layers: "auto" picks the per-layer weights on CPU and GPU and the stacked ones elsewhere. backend: the
    platform the program is for ("cpu", "gpu" or "cuda", "tpu"; default: JAX's default backend).

    CPU: XLA:CPU's decode steps run 1.6-2x faster on them. GPU (one H200, docs/results.md, 2026-12-04): plain
    decoding ran alike in both layouts, but inside the stacked layers' scan a 3-token verification cost
    1.25-1.38 plain steps against 1.04 unstacked, so EAGLE's tree (4,1) went from 1.10x to 1.47x plain. Stacked
    (one scan over layers) is what sharding rules and checkpoints use and compiles 2-3x faster; TPUs were never
    measured, so they keep it."""
    if layers not in LAYER_LAYOUTS:
        raise ValueError(f"--layers must be one of {', '.join(LAYER_LAYOUTS)}, got {layers!r}")
    if layers == "auto":
        import jax

        return (backend or jax.default_backend()) in ("cpu", "gpu", "cuda", "rocm")
    return layers == "unstacked"


def load_model(load, name: str, dtype: str, unstacked: bool):
    """Call a ``jspec.model_loaders`` loader; ``unstacked`` is passed only to loaders that accept it (a loader
    written against the two-argument contract keeps working, in its own layout)."""
    try:
        params = inspect.signature(load).parameters
    except (TypeError, ValueError):
        params = {}
    takes = "unstacked" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return load(name, dtype, unstacked=unstacked) if takes else load(name, dtype)


def end_ids(tok) -> list[int]:
    """Every id that ends generation: ``tok.eos_ids``, else the single ``tok.eos_id``."""
    ends = getattr(tok, "eos_ids", None)
    if ends is None:
        ends = [] if getattr(tok, "eos_id", None) is None else [tok.eos_id]
    return [int(i) for i in ends]


def enable_compile_cache(path: str | None, explicit: bool = False) -> str | None:
    """Keep compiled programs on disk (JAX's persistent cache), so a repeated command does not recompile.
    Returns the directory used, or None when the cache is off.

    ``path`` None/'none'/'off' disables it. explicit=False (a default directory): JAX_COMPILATION_CACHE_DIR,
    when set, wins. explicit=True (the user's --compile-cache): ``path`` wins over JAX_COMPILATION_CACHE_DIR,
    'none' included. Whichever directory is used, every program is cached, however fast it compiled."""
    import jax

    off = not path or path.lower() in ("none", "off")
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if env and not explicit:
        path, off = env, False
    if off:
        if env:  # JAX took $JAX_COMPILATION_CACHE_DIR as its directory at import
            jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Our programs compile in seconds on CPU; JAX's default threshold (1 s) would skip the smaller ones.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def compile_cache_flag(flag: str | None) -> str | None:
    """``enable_compile_cache`` for a ``--compile-cache`` flag: not given (None), $JAX_COMPILATION_CACHE_DIR when
    set, else ``COMPILE_CACHE_DEFAULT``; given, it wins ('none' included)."""
    if flag is None:
        return enable_compile_cache(COMPILE_CACHE_DEFAULT)
    return enable_compile_cache(flag, explicit=True)
