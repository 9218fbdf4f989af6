"""Session-wide fixtures: the real SmolLM2 checkpoint and its transformers reference, each loaded ONCE.

Fixtures that need torch/transformers skip with a visible reason when those are absent; the JAX side of
the project never needs them.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

# LLVM at -O1 instead of XLA:CPU's default -O3, for this test process and the CLI subprocesses it starts. The
# suite is compile-bound (~57% of its time in XLA compilation, 3.4k programs); measured on a 2-core Zen 3:
# the tiny EAGLE decode loop compiles in 6.1 s instead of 8.8 s, two compile-heavy test files ran 159 s
# instead of 222 s, and the real SmolLM2 decode loops ran no slower (2.4-2.9 s against 2.7-3.4 s for 48
# tokens). Floating-point semantics do not depend on it (no fast-math either way). Set in XLA_FLAGS before
# jax creates its CPU client; a level given in XLA_FLAGS already wins.
#
# And no YNNPACK reduce fusions: XLA:CPU (jax 0.10.2) hands reductions to YNNPACK, which ran the attention
# softmax of the toy models' 300k-row distribution tests, a reduce over a strided axis of [300000, 1, 16, 4, 1],
# at 0.8 s a call against 0.07 s as an XLA loop fusion; the layerskip distribution test ran 35 s instead of
# 51 s (after compilation). Also a flag no test's semantics depend on.
#
# And XLA:CPU's older loop emitters instead of its MLIR fusion emitters: a decode loop is ~550 small fusions, each
# compiled on its own. Measured on the 2-core Xeon (jax 0.10.2): a table-model tree decode loop compiles in 4.8 s
# instead of 9.8 s; test_decode_core + test_compressed + test_decode_transformer ran 210 s instead of 289 s (one
# process, nothing beside it); the real SmolLM2 runs ~15% slower (40 tokens, batch 2: 5.06 s against 4.25 s)
# and compiles ~1 s faster, so the real-model files lose a little of what the toy-model files gain. Subprocesses
# that set XLA_FLAGS for fake devices add ``TEST_XLA_FLAGS``.
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=1 --xla_cpu_experimental_ynn_fusion_type=-reduce"
    " --xla_cpu_use_fusion_emitters=false"
)
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in TEST_XLA_FLAGS.split():
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags

# Test files that take longest, scheduled first so that the two pytest-xdist workers (`make test` runs
# `-n 2 --dist loadfile`) finish together instead of one waiting on a long file started last.
HEAVY_FIRST = (
    "test_eagle.py",
    "test_sharding_devices.py",
    "test_real_model_decode.py",
    "test_layerskip.py",
    "test_decode_core.py",
    "test_tree.py",
    "test_server.py",
)
_COMPILE_CACHE_ENV = "JSPEC_TEST_COMPILE_CACHE"
# The run's own cost tables (``jspec.costs``), shared by the workers and the CLI subprocesses: a test never reads a
# table the user's machine measured, nor leaves one behind.
_COST_CACHE_ENV = "JSPEC_CACHE"


def pytest_configure(config):
    """One persistent compilation cache for the whole run, shared by the xdist workers: a program another
    worker or an earlier test file (``jax.clear_caches`` runs after each file) already compiled is read back
    instead of compiled again. The controller creates the directory before the workers start (they inherit
    the environment) and removes it at the end, so nothing carries over between runs."""
    if not hasattr(config, "workerinput") and _COMPILE_CACHE_ENV not in os.environ:
        os.environ[_COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="jspec-test-xla-")
        config._jspec_compile_cache = os.environ[_COMPILE_CACHE_ENV]
        os.environ[_COST_CACHE_ENV] = tempfile.mkdtemp(prefix="jspec-test-costs-")
        config._jspec_cost_cache = os.environ[_COST_CACHE_ENV]
    from jspec.loaders import enable_compile_cache  # the CLI's own switch

    # explicit: the run's own directory wins over a JAX_COMPILATION_CACHE_DIR of the user's, which would otherwise
    # receive every program the suite compiles (and keep them: only the run's directory is removed at the end).
    enable_compile_cache(os.environ[_COMPILE_CACHE_ENV], explicit=True)


def pytest_unconfigure(config):
    for name in ("_jspec_compile_cache", "_jspec_cost_cache"):
        path = getattr(config, name, None)
        if path:
            shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: the order within a file is kept


HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
TORCH_REASON = "torch/transformers not installed (the peer reference): pip install -e '.[test]'"


def need_torch() -> None:
    """The transformers parity tests fail, not skip, without torch (a run without them checks nothing against
    a peer), unless JSPEC_SKIP_TORCH=1 says the run knows."""
    if HAVE_TORCH:
        return
    if os.environ.get("JSPEC_SKIP_TORCH") == "1":
        pytest.skip(f"{TORCH_REASON} (JSPEC_SKIP_TORCH=1)")
    pytest.fail(f"{TORCH_REASON}; JSPEC_SKIP_TORCH=1 skips these tests")


@pytest.fixture
def _torch():
    need_torch()


requires_torch = pytest.mark.usefixtures("_torch")


def _refuse_profile(*args, **kwargs):
    raise AssertionError(
        "this test measured a cost table (the goodput default): give it a fixed K (gamma=, goodput=False) or mark "
        "it measures_costs"
    )


@pytest.fixture(autouse=True, scope="module")
def _no_cost_profiles():
    """A decode with a drafter and no fixed K measures a cost table the first time (goodput, the default), which
    takes seconds and makes the rounds' K depend on timings. A test that means to measure one is marked
    ``measures_costs`` (``_cost_profiles_where_marked``); anything else, module fixtures included (this one is set
    up before them), fails rather than measuring unnoticed: pass gamma= or goodput=False."""
    import jspec.costs

    with pytest.MonkeyPatch.context() as mp:
        real = jspec.costs.profile
        mp.setattr(jspec.costs, "profile", _refuse_profile)
        yield real


@pytest.fixture(autouse=True)
def _cost_profiles_where_marked(request, monkeypatch, _no_cost_profiles):
    if request.node.get_closest_marker("measures_costs"):
        import jspec.costs

        monkeypatch.setattr(jspec.costs, "profile", _no_cost_profiles)


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
        # The real-model tests are the ones a user relies on most: they fail rather than skip unless the
        # run says it knows they will not run.
        if os.environ.get("JSPEC_SKIP_REAL_MODEL") == "1":
            pytest.skip(f"SmolLM2 checkpoint unavailable (JSPEC_SKIP_REAL_MODEL=1): {e}")
        pytest.fail(f"SmolLM2 checkpoint unavailable ({e}); `make setup` installs it, JSPEC_SKIP_REAL_MODEL=1 skips")


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
    need_torch()
    from models.hf_reference import transformers_from_gguf

    return transformers_from_gguf(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    need_torch()
    from models.hf_reference import transformers_tokenizer_from_gguf

    return transformers_tokenizer_from_gguf(smollm2_path)
