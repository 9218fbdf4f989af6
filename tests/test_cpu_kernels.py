"""The CPU kernels (``models.cpu_kernels``): products, attention and argmax against float64 numpy, panel
packing, the row-independence the kernels promise, the XLA fallback, the errors, the build cache (its key,
pruning, a read-only cache) and an AddressSanitizer run of the attention."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling import argmax
from models import cpu_kernels
from models.cpu_kernels import PackedMatrix, matmul, pack

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the CPU matmul kernel is not available here (no C++ compiler?)"
)


def test_kernel_builds_wherever_a_compiler_is_found():
    """The kernel tests skip where the kernel cannot exist (no C++ compiler, another CPU architecture, or
    JSPEC_CPU_KERNEL=0); a compiler that fails on the source or a missing FFI symbol must fail here instead
    of silently turning every kernel test into a skip."""
    import ctypes
    import platform

    if os.environ.get("JSPEC_CPU_KERNEL", "1") == "0":
        pytest.skip("JSPEC_CPU_KERNEL=0 turns the kernel off")
    if cpu_kernels._compiler() is None or platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        pytest.skip("no C++ compiler or an unsupported architecture: the XLA fallback is what runs")
    lib = ctypes.cdll.LoadLibrary(cpu_kernels.build())  # raises with the compiler's message
    assert lib.JspecPackedMatmulF32 and lib.JspecRowArgmaxF32
    assert cpu_kernels.available()


@pytest.fixture(autouse=True)
def _on_cpu():
    """The kernels are CPU kernels: run every test on a CPU device, also on a machine with an accelerator."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)


def _close(got, x, w):
    """f32 products of K terms against the float64 product: the tolerance scales with sqrt(K) * |x| |w|."""
    want = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.sqrt(x.shape[1]) * np.abs(x).max() * np.abs(w).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6 * scale, rtol=0)


def test_pack_unpack_and_rows_round_trip():
    w = np.arange(7 * 3 * 20, dtype=np.float32).reshape(7, 3, 20)  # N = 60: two panels, the second padded
    p = pack(jnp.asarray(w))
    assert p.panels.shape == (2, 7, 32) and p.shape == (7, 3, 20) and (p.k, p.n) == (7, 60)
    np.testing.assert_array_equal(np.asarray(p.unpack()), w)
    np.testing.assert_array_equal(np.asarray(p.panels[1, :, 28:]), 0)  # the padding columns
    ids = jnp.asarray([[0, 59], [31, 32]])
    np.testing.assert_array_equal(np.asarray(p.rows(ids)), w.reshape(7, 60).T[np.asarray(ids)])
    # Two leading axes contracted (an output projection [H, D, E]).
    p2 = pack(jnp.asarray(w.reshape(7, 3, 20).transpose(1, 0, 2).copy()), k=21)
    assert (p2.k, p2.n) == (21, 20)


def test_pack_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="takes float32 weights, got bfloat16"):
        pack(jnp.zeros((4, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16, not float16"):
        pack(jnp.zeros((4, 32)), dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"shape \(4, 32\) as 5 contracted rows"):
        pack(jnp.zeros((4, 32)), k=5)
    with pytest.raises(ValueError, match="x has 3 features, the packed weight contracts 4"):
        matmul(jnp.zeros((2, 3)), pack(jnp.zeros((4, 32))))


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 576, 960),
        (2, 576, 96),
        (3, 576, 960),
        (4, 1536, 96),
        (5, 7, 32),
        (9, 1536, 576),
        (12, 64, 100),
        (13, 64, 64),
        (40, 33, 70),
    ],
)
def test_kernel_matches_float64(m, k, n):
    """Row counts on both sides of the 12-row register tile, a K that is not a multiple of anything, and
    widths that need a padded last panel; the big ones run on more than one thread."""
    x, w = _data(m, k, n, seed=m * 1000 + n)
    got = jax.jit(matmul)(jnp.asarray(x), pack(jnp.asarray(w)))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    _close(got, x, w)


def _bf16(w):
    """w rounded to bfloat16 (nearest even) and back: the weights the bf16 panels hold, in float32."""
    return np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 8192), (3, 1152, 576), (13, 64, 100)])
def test_bf16_panels_multiply_the_rounded_weights_in_f32(m, k, n):
    """bf16 panels (a draft head's weights): exactly the rounded weights, widened and multiplied in f32, so
    the product has f32 accuracy against x @ bf16(W), on the kernel and through the XLA fallback alike."""
    x, w = _data(m, k, n, seed=m + n)
    p = pack(jnp.asarray(w), dtype=jnp.bfloat16)
    assert p.dtype == jnp.bfloat16 and p.panels.nbytes == pack(jnp.asarray(w)).panels.nbytes // 2
    np.testing.assert_array_equal(np.asarray(p.unpack().astype(jnp.float32)), _bf16(w))
    got = jax.jit(matmul)(jnp.asarray(x), p)
    assert got.dtype == jnp.float32
    _close(got, x, _bf16(w))
    assert np.abs(np.asarray(got) - x @ w).max() > 1e-3  # it did use the rounded weights
    # A row alone gets the same bits as inside the call (the kernel's one-chain-per-output promise).
    np.testing.assert_array_equal(np.asarray(jax.jit(matmul)(jnp.asarray(x[-1:]), p)), np.asarray(got)[-1:])
    # cast_panels rounds packed f32 panels the same way, and leaves other leaves alone.
    tree = {"a": pack(jnp.asarray(w)), "b": jnp.ones(3)}
    cast = cpu_kernels.cast_panels(tree, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(cast["a"].panels), np.asarray(p.panels))
    assert cast["b"].dtype == jnp.float32


@needs_kernel
def test_kernel_batched_leading_axes_and_wide_matrix():
    """x [B, T, K] against a vocabulary-sized matrix (thousands of panels over the thread pool)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64), dtype=np.float32)
    w = rng.standard_normal((64, 8192 + 16), dtype=np.float32)
    got = jax.jit(matmul)(jnp.asarray(x), pack(jnp.asarray(w)))
    assert got.shape == (2, 3, 8208)
    _close(np.asarray(got).reshape(6, -1), x.reshape(6, 64), w)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """The kernel's promise: one in-order multiply-add chain per output element, so a token's product is the
    same bits alone (a decode step) as inside a 9- or 20-row call (a verification pass)."""
    x, w = _data(20, 576, 960, seed=3)
    wp = pack(jnp.asarray(w))
    f = jax.jit(matmul)
    whole = np.asarray(f(jnp.asarray(x), wp))
    for lo, hi in [(4, 5), (5, 7), (5, 8), (2, 6), (0, 9), (11, 20)]:  # every tile shape: 1-3 wide, 4-6 split
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[lo:hi]), wp)), whole[lo:hi])


def test_xla_fallback_computes_the_same_product(monkeypatch):
    """Off the CPU, or without the kernel, the panels are multiplied by an XLA einsum."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    x, w = _data(3, 40, 50, seed=4)
    _close(jax.jit(matmul)(jnp.asarray(x), pack(jnp.asarray(w))), x, w)
    # bf16 panels (cast by a user, or ``pack(dtype=bfloat16)``) are widened to f32: x @ bf16(W) at f32 accuracy.
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), pack(jnp.asarray(w)))
    assert isinstance(p16, PackedMatrix) and p16.dtype == jnp.bfloat16
    _close(jax.jit(matmul)(jnp.asarray(x), p16), x, _bf16(w))


def _norm64(x, scale, eps):
    """RMSNorm in float64 (the reference for the fused kernel)."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale.astype(np.float64)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (9, 576, 3072), (13, 1536, 96), (40, 33, 70)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_matmul_matches_float64(m, k, n, dtype):
    """RMSNorm inside the matmul kernel against float64 numpy: the norm (x / sqrt(mean(x^2) + eps) * scale, a
    K that is not a multiple of the vector width in one case) and the product at f32 accuracy, for f32 and
    bf16 panels; a row alone gets the same bits as inside the call."""
    x, w = _data(m, k, n, seed=7 * m + k)
    x = x * 3.0 + 0.5  # rows whose norm is far from 1
    scale = np.random.default_rng(m).uniform(0.5, 2.0, k).astype(np.float32)
    eps = 1e-5
    p = pack(jnp.asarray(w), dtype=jnp.dtype(dtype))
    wf = w if dtype == "float32" else _bf16(w)
    f = jax.jit(lambda x, s, p: cpu_kernels.norm_matmul(x, s, eps, p))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(scale), p))
    xn = _norm64(x, scale, eps)
    want = xn @ wf.astype(np.float64)
    tol = 4e-6 * np.sqrt(k) * np.abs(xn).max() * np.abs(wf).max()
    np.testing.assert_allclose(got.astype(np.float64), want, atol=tol, rtol=0)
    # The norm is not skipped or applied twice: without it the product is far off.
    assert np.abs(x.astype(np.float64) @ wf - want).max() > 100 * tol
    for lo, hi in [(m - 1, m), (0, min(m, 3))]:
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[lo:hi]), jnp.asarray(scale), p)), got[lo:hi])


def test_norm_matmul_fallback_and_errors(monkeypatch):
    """Without the kernel: the XLA RMSNorm, then the panels' product (the same maths); shape errors by name."""
    x, w = _data(4, 40, 50, seed=5)
    scale = np.linspace(0.5, 1.5, 40, dtype=np.float32)
    with pytest.raises(ValueError, match="must match K=40"):
        cpu_kernels.norm_matmul(jnp.asarray(x), jnp.ones(39), 1e-5, pack(jnp.asarray(w)))
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    got = jax.jit(lambda x, s, p: cpu_kernels.norm_matmul(x, s, 1e-6, p))(
        jnp.asarray(x), jnp.asarray(scale), pack(jnp.asarray(w))
    )
    _close(got, _norm64(x, scale, 1e-6).astype(np.float32), w)


@needs_kernel
@pytest.mark.parametrize("m,v", [(1, 49152), (9, 49152), (3, 20000), (20, 37), (2, 1)])
def test_row_argmax_is_the_lowest_index_of_the_maximum(m, v):
    """The argmax kernel against numpy (lowest index on ties): random rows, rows of tied integers (ties inside
    a vector, across the vector chains and across the 8192-column chunks), rows of -inf, and rows holding a
    NaN (V - 1, as ``jspec.sampling.argmax``); a row alone gets the same id as inside the call."""
    rng = np.random.default_rng(m * 7 + v)
    x = rng.standard_normal((m, v)).astype(np.float32)
    if m >= 3:
        x[1] = rng.integers(0, 4, v).astype(np.float32)  # many ties of the maximum
        x[2] = -np.inf
    if m >= 9:
        x[4, 5] = np.nan
        x[5, v - 1] = 99.0  # the last column (the tail after the vector chains)
        if v > 40000:
            x[3, [9000, 17000, 40000]] = 50.0  # the same maximum in three chunks: the first one wins
    f = jax.jit(cpu_kernels.row_argmax)
    got = np.asarray(f(jnp.asarray(x)))
    want = np.where(np.isnan(x).any(axis=1), v - 1, np.argmax(np.nan_to_num(x, nan=-np.inf), axis=1))
    assert got.dtype == np.int32 and got.shape == (m,)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(argmax)(jnp.asarray(x))))  # the jspec contract
    if m >= 9:
        assert got[4] == v - 1 and got[5] == v - 1 and (v <= 40000 or got[3] == 9000)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[m - 1 :]))), got[m - 1 :])
    # Leading axes are flattened and restored.
    assert np.asarray(f(jnp.asarray(x)[None])).shape == (1, m)


def test_build_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match="compiling .*cpu_kernels.cc failed"):
        cpu_kernels.build()
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left to be loaded later


def test_old_builds_are_pruned(monkeypatch, tmp_path):
    # A stand-in compiler (writes its -o file): a new build keeps itself and the 3 most recently used others.
    cxx = tmp_path / "fake-cxx"
    cxx.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(cxx))
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    old = [kdir / f"cpu_kernels-old{i}.so" for i in range(6)]
    for i, f in enumerate(old):
        f.write_bytes(b"")
        os.utime(f, (1000 + i, 1000 + i))  # old5 was used last
    (kdir / "unrelated.txt").write_text("kept")
    built = cpu_kernels.build()
    left = sorted(p.name for p in kdir.iterdir())
    assert left == sorted([os.path.basename(built), "cpu_kernels-old3.so", "cpu_kernels-old4.so",
                           "cpu_kernels-old5.so", "unrelated.txt"])  # fmt: skip
    os.utime(old[3], (10, 10))
    assert cpu_kernels.build() == built  # cached: no rebuild, nothing pruned, and its use is recorded
    assert os.path.getmtime(built) > 1000 and (kdir / "cpu_kernels-old3.so").exists()


def _fake_compiler(tmp_path):
    """A stand-in compiler: writes its -o file and records each compile command's arguments (a line each, not
    the ``--version`` queries) in ``args.txt``."""
    cxx = tmp_path / "fake-cxx"
    log = tmp_path / "args.txt"
    record = f'[ "$1" = --version ] || echo "$@" >> {log}'
    cxx.write_text(f'#!/bin/sh\n{record}\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cxx.chmod(0o755)
    return cxx, log


def test_cache_key_covers_flags_headers_and_jaxlib(monkeypatch, tmp_path):
    """The cached library's key changes with everything its code depends on: the compile flags, the FFI
    headers it includes (jaxlib's ``xla/ffi/api/*.h``) and the jaxlib version; and ``build`` compiles with
    the flags it keys on (another flag set builds another library)."""
    inc = tmp_path / "include"
    api = inc / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    (api / "ffi.h").write_text("// v1\n")
    (api / "README").write_text("not a header")
    flags = cpu_kernels._FLAGS

    def key(flags=flags):
        return cpu_kernels._cache_key(b"source", "/usr/bin/c++", "c++ 1.0", flags, str(inc))

    base = key()
    assert key() == base and len(base) == 16
    assert key((*flags, "-DNDEBUG")) != base
    assert key(tuple(f for f in flags if f != "-O3") + ("-O2",)) != base
    (api / "README").write_text("changed, not a header")
    assert key() == base
    (api / "ffi.h").write_text("// v2\n")
    changed = key()
    assert changed != base
    (api / "api.h").write_text("// new\n")
    current = key()
    assert current not in (base, changed)
    monkeypatch.setattr(cpu_kernels.jaxlib, "__version__", "0.0.0-other")
    assert key() != current

    cxx, log = _fake_compiler(tmp_path)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    first = cpu_kernels.build()
    monkeypatch.setattr(cpu_kernels, "_FLAGS", (*flags, "-DJSPEC_TEST_FLAG"))
    second = cpu_kernels.build()
    assert second != first and os.path.exists(first) and os.path.exists(second)
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "-DJSPEC_TEST_FLAG" not in calls[0] and "-DJSPEC_TEST_FLAG" in calls[1]
    assert all(f in calls[0].split() for f in flags)


def test_a_read_only_cache_still_serves_its_library(monkeypatch, tmp_path):
    """Recording a use (the library's mtime, for pruning) fails on a read-only or another user's cache; the
    library is still there, so ``build`` returns it instead of raising (``available`` would turn the kernel
    off)."""
    cxx, log = _fake_compiler(tmp_path)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(cxx))
    built = cpu_kernels.build()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", args[0])

    monkeypatch.setattr(os, "utime", refuse)
    assert cpu_kernels.build() == built
    assert len(log.read_text().splitlines()) == 1  # not rebuilt


def test_pruning_tolerates_a_library_removed_meanwhile(monkeypatch, tmp_path):
    """Another process can delete a library between the listing and its mtime: pruning skips it."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    libs = [kdir / f"cpu_kernels-{i}.so" for i in range(6)]
    for i, f in enumerate(libs):
        f.write_bytes(b"")
        os.utime(f, (1000 + i, 1000 + i))
    getmtime = os.path.getmtime

    def racing(path):
        if os.path.basename(path) == "cpu_kernels-5.so":
            os.unlink(path)  # pruned by someone else just now
        return getmtime(path)

    monkeypatch.setattr(os.path, "getmtime", racing)
    cpu_kernels._prune(str(libs[0]))
    assert sorted(p.name for p in kdir.iterdir()) == [f"cpu_kernels-{i}.so" for i in (0, 2, 3, 4)]


_ASAN_SCRIPT = """
import sys
import jax
import jax.numpy as jnp
import numpy as np

jnp.zeros(1).block_until_ready()
print("started", flush=True)
from models import cpu_kernels

cpu_kernels.build = lambda verbose=False: sys.argv[1]
assert cpu_kernels.available()
rng = np.random.default_rng(0)
# Every head dim (each a different row tile: 12, 6 and 3 rows with AVX-512), a full block of query rows and
# every slot visible (the scores buffer read to its end); each call's S at least twice the last, so a
# thread's buffer is allocated at exactly the size asked for.
for d, s in ((32, 64), (64, 256), (128, 1024)):
    q = rng.standard_normal((1, 1, 16, d), dtype=np.float32)
    kv = rng.standard_normal((1, 1, 1, s, d), dtype=np.float32)
    mask = np.ones((1, 1, s), bool)
    f = lambda q, k, v, m: cpu_kernels.cache_attention(q, k, v, m, 0, 0.125, lambda: jnp.zeros(q.shape))
    assert np.isfinite(np.asarray(jax.jit(f)(q, kv, kv, mask))).all()
# The scan for each row's last visible slot, at the start of its mask row and on its tiers: a row with no
# visible slot, one that sees slot 0 only, one that sees up to 13, one up to S - 1 with a hole.
s = 600
q = rng.standard_normal((1, 4, 1, 32), dtype=np.float32)
kv = rng.standard_normal((1, 1, 1, s, 32), dtype=np.float32)
mask = np.arange(s)[None, None, :] <= np.asarray([-1, 0, 13, s - 1])[None, :, None]
mask[0, 3, 5] = False
assert np.isfinite(np.asarray(jax.jit(f)(q, kv, kv, mask))).all()
print("ASAN-CHECK-OK")
"""


@needs_kernel
def test_cache_attention_reads_stay_in_its_buffers(tmp_path):
    """The kernel built with AddressSanitizer (at -O0, ~2 s) runs cache attention in a fresh process: a read
    past a buffer (the weighted sum's row tiles read past the block's last lane into the scores buffer's slack)
    is an error there, not an unused value. Skips where the compiler or this machine cannot run ASan."""
    cxx = cpu_kernels._compiler()
    runtime = [
        subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        for lib in ("libasan.so", "libstdc++.so")
    ]
    if not os.path.isabs(runtime[0]):
        pytest.skip(f"{cxx} has no libasan.so to preload")
    so = tmp_path / "asan.so"
    cmd = [cxx, "-O0", "-fsanitize=address", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
    cmd += ["-I", jax.ffi.include_dir(), cpu_kernels._SOURCE, "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"no AddressSanitizer build here: {proc.stderr[-500:]}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_kernels.__file__)))
    # libstdc++ preloaded too: ASan's exception interceptor needs it loaded first (jaxlib throws at startup).
    preload = " ".join(p for p in runtime if os.path.isabs(p))
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _ASAN_SCRIPT, str(so)], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    if "started" not in proc.stdout:
        pytest.skip(f"jax does not start under AddressSanitizer here: {proc.stderr[-500:]}")
    report = proc.stderr[proc.stderr.find("ERROR: AddressSanitizer") :][:3000]
    assert proc.returncode == 0 and "ASAN-CHECK-OK" in proc.stdout, report or proc.stdout + proc.stderr[-3000:]


def _attention_reference(q, k_all, v_all, mask, layer, scale):
    """float64 numpy: query head h reads KV head h // (H / Hkv); masked slots get -1e30 before the softmax."""
    b, t, h, d = q.shape
    hkv = k_all.shape[2]
    k = k_all[layer].astype(np.float64)  # [B, Hkv, S, D]
    v = v_all[layer].astype(np.float64)
    kv_of = np.arange(h) // (h // hkv)
    scores = np.einsum("bthd,bhsd->bths", q.astype(np.float64), k[:, kv_of]) * scale  # [B, T, H, S]
    scores = np.where(mask[:, :, None, :], scores, -1e30)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bths,bhsd->bthd", p, v[:, kv_of])


@needs_kernel
@pytest.mark.parametrize(
    "b,t,h,hkv,s,d,layer",
    [(1, 1, 9, 3, 333, 64, 2), (2, 9, 6, 2, 37, 64, 0), (1, 5, 4, 4, 20, 32, 1), (2, 3, 8, 2, 50, 128, 2)],
)
@pytest.mark.parametrize("visible", ["random", "prefix"])
def test_cache_attention_matches_float64(b, t, h, hkv, s, d, layer, visible):
    """GQA groups, more query rows than one block (a block is a native vector's lanes, 8 or 16; 9 tokens x 3
    heads = 27 rows), several head dims (each a different register tile on AVX2), and a
    layer read in place out of a 3-layer cache; a row with no visible slot is uniform over every slot.
    "prefix": each row sees a causal prefix of a mostly empty cache (a serving cache), where the kernel stops
    reading at the last visible slot."""
    rng = np.random.default_rng(b * 100 + t)
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k_all = rng.standard_normal((3, b, hkv, s, d), dtype=np.float32)
    v_all = rng.standard_normal((3, b, hkv, s, d), dtype=np.float32)
    if visible == "random":
        mask = rng.random((b, t, s)) < 0.5
    else:
        lengths = rng.integers(1, max(2, s // 3), size=b)
        mask = np.arange(s)[None, None, :] <= lengths[:, None, None] + np.arange(t)[None, :, None]
    mask[0, 0] = False
    scale = 1.0 / np.sqrt(d)
    args = [jnp.asarray(a) for a in (q, k_all, v_all, mask)]
    off_cpu = lambda: jnp.zeros(q.shape)  # noqa: E731  (the branch for other platforms; never taken here)
    got = jax.jit(lambda q, k, v, m: cpu_kernels.cache_attention(q, k, v, m, layer, scale, off_cpu))(*args)
    want = _attention_reference(q, k_all, v_all, mask, layer, scale)
    assert got.shape == (b, t, h, d)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got[0, 0]), v_all[layer, 0].mean(1)[np.arange(h) // (h // hkv)], atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("hole", [False, True])
def test_cache_attention_finds_each_rows_last_visible_slot(hole):
    """The kernel reads up to the last slot any row sees, found by a scan from the end (256 bytes at a time,
    then 8, then single bytes): rows whose last visible slot sits on either side of each of those boundaries
    (counted from S = 600), with prefix masks (the vector compare) and with a hole in them (the per-lane
    select), against float64; a slot missed past the scan's stop would change the result."""
    s = 600
    lasts = np.asarray([s - 1, s - 8, s - 9, s - 256, s - 257, s - 264, s - 512, s - 513, 80, 79, 7, 0])
    b, t, h, hkv, d = 1, len(lasts), 2, 1, 32  # 24 query rows: a block of 16 (AVX-512) or 8 and the rest
    rng = np.random.default_rng(11)
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k_all = rng.standard_normal((1, b, hkv, s, d), dtype=np.float32)
    v_all = rng.standard_normal((1, b, hkv, s, d), dtype=np.float32)
    mask = np.arange(s)[None, None, :] <= lasts[None, :, None]
    if hole:
        mask[0, :-1, 0] = False  # every row with more than one slot skips slot 0
    f = jax.jit(lambda q, k, v, m: cpu_kernels.cache_attention(q, k, v, m, 0, 0.25, lambda: jnp.zeros(q.shape)))
    got = np.asarray(f(*(jnp.asarray(a) for a in (q, k_all, v_all, mask))), np.float64)
    np.testing.assert_allclose(got, _attention_reference(q, k_all, v_all, mask, 0, 0.25), atol=2e-5, rtol=0)
    # Each token alone (its block's only rows; S still 600) gets the same bits.
    for i in (0, 4, 11):
        one = f(*(jnp.asarray(a) for a in (q[:, i : i + 1], k_all, v_all, mask[:, i : i + 1])))
        np.testing.assert_array_equal(np.asarray(one), got[:, i : i + 1].astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("tree", [False, True])
def test_cache_attention_row_does_not_depend_on_the_call(tree):
    """A query token's attention is the same bits in a 1-token step as inside a 9-token verification (whose
    rows see up to 8 more slots, and whose blocks hold other rows), for prefix masks (the vector-compare path)
    and for a tree mask (the per-lane path), and equals float64 numpy. 300 visible slots of a 640-slot cache:
    the scores run 8 slots at a time plus a remainder."""
    rng = np.random.default_rng(7)
    b, t, h, hkv, s, d, n = 1, 9, 9, 3, 640, 64, 300
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k_all = rng.standard_normal((2, b, hkv, s, d), dtype=np.float32)
    v_all = rng.standard_normal((2, b, hkv, s, d), dtype=np.float32)
    mask = np.arange(s)[None, None, :] < n + 1 + np.arange(t)[None, :, None]  # token i sees slots < n + 1 + i
    if tree:
        mask[:, 4:, n + 2] = False  # tokens 4.. branch off token 2: rows with a hole, not a prefix
    scale = 1.0 / np.sqrt(d)
    # (the fallback is the branch for other platforms, never taken here)
    f = jax.jit(lambda q, k, v, m: cpu_kernels.cache_attention(q, k, v, m, 1, scale, lambda: jnp.zeros(q.shape)))
    whole = np.asarray(f(jnp.asarray(q), jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(mask)))
    np.testing.assert_allclose(whole, _attention_reference(q, k_all, v_all, mask, 1, scale), atol=2e-5, rtol=0)
    for i in (0, 5, 8):
        one = f(jnp.asarray(q[:, i : i + 1]), jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(mask[:, i : i + 1]))
        np.testing.assert_array_equal(np.asarray(one), whole[:, i : i + 1])
