"""CPU kernels for decode and verification passes, called through XLA's FFI: a packed-panel matmul (also with
the RMSNorm of its input inside, ``norm_matmul``), an attention that reads one layer of the stacked KV cache in
place (``cache_attention``) and a row argmax over logits (``row_argmax``, a model's ``Model.argmax``).

Dimension vocabulary: M rows (B * T tokens of a call), K contracted width, N output width.

Why: a decoder step is bound by reading its weights once. XLA:CPU does that at one token per call (its
matrix-vector product), but at 2-16 tokens, the size of a speculative verification pass, its matmul kernels
repack every weight matrix on every call: a 9-token SmolLM2 pass cost ~2x a 1-token step, and every drafter
pays that. ``kernels/cpu_kernels.cc`` keeps weights in 32-column panels ([N/32, K, 32], packed once, at
``models.llama.unstack_layers`` time) and streams each panel once per call with all rows' accumulators in
registers, so 1-12 rows cost about what one row costs (with AVX-512; measured on a Zen 4 EPYC). The register
tile is sized for the vector width the kernel is compiled for: on an AVX2-only CPU (a Zen 3 EPYC, 16 registers
of 8 floats) it is 6 rows by half a panel (1-3 rows: the whole panel in one pass), and a 9-token call cost
~2x a 1-token one there, against ~3.4x with XLA's matmuls (a tile sized for AVX-512 spilled its accumulators
and cost 8x); ~1.5x after later fixes (docs/results.md).

The kernel is compiled from source with the system C++ compiler on first use (about 2 s, for this CPU:
``-march=native``) and cached under ``~/.cache/jspec/kernels`` (``JSPEC_CACHE`` moves it), keyed by the
source, the compiler and its flags, the CPU's features, the jax and jaxlib versions and jaxlib's FFI headers.
A read-only cache holding the library is used as it is. Without a compiler, on other platforms or with
``JSPEC_CPU_KERNEL=0`` nothing is packed and the XLA matmuls run as before; ``available()`` says which.
Off the CPU (or when the kernel is not registered) a packed matrix is multiplied with an XLA einsum, so packed
parameters stay correct everywhere.

Each output element is one multiply-add chain over k in order, so a row's result does not depend on how many
rows share the call (a verification pass and a one-token step agree bit for bit on their matmuls).

The attention kernel replaces, for the unstacked layout's static layer index, XLA's slice copies of each
layer's K and V and its few-row attention dots (library calls of ~15-50 us fixed cost each); it stops
reading at the last slot any query row can see. Its vectors are the CPU's native width (a block of 8 query rows
on AVX2, 16 on AVX-512): written with 16-float vectors everywhere, GCC lowered them on AVX2 through the stack,
and a block cost ~8x more (Zen 3: 131 against 16 us for 3 rows over 256 slots; 30 layers of a 1-token call
10.6 against 2.8 ms, of a batch-8 decode step 54 against 14 ms).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jspec.sampling import argmax

PANEL = 32  # columns per panel (two AVX-512 vectors); the kernel's register tile follows the CPU's vector width
TARGET = "jspec_packed_matmul_f32"
TARGET_BF16 = "jspec_packed_matmul_bf16"
NORM_TARGET = "jspec_norm_matmul_f32"
NORM_TARGET_BF16 = "jspec_norm_matmul_bf16"
ARGMAX_TARGET = "jspec_row_argmax_f32"
ATTENTION_TARGET = "jspec_cache_attention_f32"
ATTENTION_HEAD_DIMS = (32, 64, 128)
_SOURCE = os.path.join(os.path.dirname(__file__), "kernels", "cpu_kernels.cc")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """A weight W of logical ``shape`` whose first ``k`` elements' worth of leading axes are contracted:
    as a matrix it is [K, N] (N = prod(shape) / K), stored as ``panels`` [ceil(N / 32), K, 32] with the
    last panel zero-padded."""

    panels: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))

    @property
    def n(self) -> int:
        return math.prod(self.shape) // self.k

    @property
    def dtype(self):
        return self.panels.dtype

    def unpack(self) -> jax.Array:
        """The weight in its logical shape."""
        p, k, c = self.panels.shape
        return self.panels.transpose(1, 0, 2).reshape(k, p * c)[:, : self.n].reshape(self.shape)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Columns ``ids`` [...] of the [K, N] matrix as rows [..., K] (an embedding lookup on a transposed
        table) without unpacking the rest."""
        return self.panels[ids // PANEL, :, ids % PANEL]


def pack(w: jax.Array, k: int | None = None, dtype=jnp.float32) -> PackedMatrix:
    """W [K, ...] (or any shape whose leading axes multiply to ``k``) -> PackedMatrix. W must be f32 (a model's
    compute dtype on the kernel; XLA:CPU's bf16 is slower than f32 anyway). ``dtype=jnp.bfloat16`` stores the
    panels rounded to bf16, half the bytes to read; ``matmul`` still multiplies in f32 (for draft heads)."""
    if w.dtype != jnp.float32:
        raise ValueError(f"pack: the CPU kernel takes float32 weights, got {w.dtype}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"pack: panels are stored as float32 or bfloat16, not {jnp.dtype(dtype)}")
    k = w.shape[0] if k is None else k
    if k <= 0 or w.size % k:
        raise ValueError(f"pack: cannot read a weight of shape {w.shape} as {k} contracted rows")
    n = w.size // k
    p = -(-n // PANEL)
    m = jnp.pad(w.reshape(k, n), ((0, 0), (0, p * PANEL - n)))
    return PackedMatrix(m.reshape(k, p, PANEL).transpose(1, 0, 2).astype(dtype), tuple(w.shape), k)


def cast_panels(tree, dtype):
    """Every ``PackedMatrix`` in a pytree with its panels stored as ``dtype`` (rounded to nearest even, as
    ``pack(dtype=...)`` does); other leaves unchanged."""

    def cast(m):
        return dataclasses.replace(m, panels=m.panels.astype(dtype)) if isinstance(m, PackedMatrix) else m

    return jax.tree.map(cast, tree, is_leaf=lambda m: isinstance(m, PackedMatrix))


def matmul(x: jax.Array, w: PackedMatrix) -> jax.Array:
    """x [..., K] @ W -> [..., N] float32 (W's trailing logical axes flattened into N). x is cast to the
    panels' dtype, as the XLA matmuls cast to the weights', except for bf16 panels (``pack(dtype=bfloat16)``):
    those are widened to f32 and x stays f32, on the kernel and off it alike."""
    if x.shape[-1] != w.k:
        raise ValueError(f"matmul: x has {x.shape[-1]} features, the packed weight contracts {w.k}")
    lead = x.shape[:-1]
    padded = w.panels.shape[0] * PANEL
    bf16 = w.panels.dtype == jnp.bfloat16
    x2 = x.reshape(-1, w.k).astype(jnp.float32 if bf16 else w.panels.dtype)  # [M, K]

    def xla(x2, panels):  # the same product from the panels: other platforms, or panels cast to another dtype
        panels = panels.astype(jnp.float32) if bf16 else panels
        y = jnp.einsum("mk,pkc->mpc", x2, panels, preferred_element_type=jnp.float32)
        return y.reshape(x2.shape[0], padded)

    if (w.panels.dtype == jnp.float32 or bf16) and available():

        def kernel(x2, panels):
            out = jax.ShapeDtypeStruct((x2.shape[0], padded), jnp.float32)
            return jax.ffi.ffi_call(TARGET_BF16 if bf16 else TARGET, out, vmap_method="sequential")(x2, panels)

        y = jax.lax.platform_dependent(x2, w.panels, cpu=kernel, default=xla)
    else:
        y = xla(x2, w.panels)
    return y[:, : w.n].reshape(*lead, w.n)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``models.llama.RMSNorm`` on f32 rows: x / sqrt(mean(x^2) + eps) * scale."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def norm_matmul(x: jax.Array, scale: jax.Array, eps: float, w: PackedMatrix) -> jax.Array:
    """``matmul(rms_norm(x, scale, eps), w)`` for f32 x: on the CPU kernel the norm runs inside the call (XLA
    ran it as three small ops of ~15-25 us each at a few rows, ~1 ms of a 9-token SmolLM2 call). The kernel's
    sum of squares is ordered differently from XLA's, so the two paths can differ in the last bits: a model
    must take one of them for every call (``models.llama`` takes this one for every packed layer and head)."""
    if x.shape[-1] != w.k or scale.shape != (w.k,):
        raise ValueError(f"norm_matmul: x [..., {x.shape[-1]}] and scale {scale.shape} must match K={w.k}")
    if x.dtype != jnp.float32 or w.panels.dtype not in (jnp.float32, jnp.bfloat16) or not available():
        return matmul(rms_norm(x.astype(jnp.float32), scale.astype(jnp.float32), eps).astype(x.dtype), w)
    lead = x.shape[:-1]
    padded = w.panels.shape[0] * PANEL
    x2 = x.reshape(-1, w.k)
    s = scale.astype(jnp.float32)

    def xla(x2, s, panels):
        y = jnp.einsum("mk,pkc->mpc", rms_norm(x2, s, eps), panels.astype(jnp.float32))
        return y.reshape(x2.shape[0], padded)

    def kernel(x2, s, panels):
        out = jax.ShapeDtypeStruct((x2.shape[0], padded), jnp.float32)
        target = NORM_TARGET_BF16 if panels.dtype == jnp.bfloat16 else NORM_TARGET
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, s, panels, eps=np.float32(eps))

    y = jax.lax.platform_dependent(x2, s, w.panels, cpu=kernel, default=xla)
    return y[:, : w.n].reshape(*lead, w.n)


def row_argmax(x: jax.Array) -> jax.Array:
    """logits [..., V] -> [...] int32: the lowest index of each row's maximum, V - 1 for a row holding a NaN
    (``jspec.sampling.argmax``'s contract, which is also the fallback off the CPU kernel). A model's
    ``Model.argmax``: XLA:CPU's three passes over a 9-token call's [9, 49152] logits took ~0.3 ms of a round."""
    if x.dtype != jnp.float32 or x.shape[-1] == 0 or not available():
        return argmax(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])

    def kernel(x2):
        out = jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32)
        return jax.ffi.ffi_call(ARGMAX_TARGET, out, vmap_method="sequential")(x2)

    return jax.lax.platform_dependent(x2, cpu=kernel, default=argmax).reshape(lead)


def cache_attention_applies(q: jax.Array, k_all: jax.Array, layer) -> bool:
    """Whether ``cache_attention`` takes this call: float32, a supported head dim, a static layer index (the
    unstacked layout), the CPU as the default backend."""
    return (
        isinstance(layer, int)
        and jax.default_backend() == "cpu"
        and q.dtype == k_all.dtype == jnp.float32
        and q.shape[-1] in ATTENTION_HEAD_DIMS
        and available()
    )


def cache_attention(q, k_all, v_all, mask, layer: int, scale: float, fallback):
    """softmax(q K^T * scale, masked) V over layer ``layer`` of the cache, read in place.

    q [B, T, H, D] (after RoPE); k_all, v_all [L, B, Hkv, S, D] (this call's entries already written);
    mask [B, T, S] bool. Returns [B, T, H, D] float32. Query head h reads KV head h // (H / Hkv). A row with no
    visible slot gets uniform weights, as ``models.llama``'s masked softmax does. ``fallback()`` computes the
    same thing with XLA ops; it runs off the CPU.
    """

    if not available():
        return fallback()

    def kernel(q, k_all, v_all, mask):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        call = jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")
        return call(q, k_all, v_all, mask, layer=np.int64(layer), scale=np.float32(scale))

    return jax.lax.platform_dependent(q, k_all, v_all, mask, cpu=kernel, default=lambda *_: fallback())


def _cache_dir() -> str:
    root = os.environ.get("JSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jspec")
    return os.path.join(root, "kernels")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")


_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")  # the compile command's options
_FFI_HEADERS = os.path.join("xla", "ffi", "api")  # under jax.ffi.include_dir(): what the kernel includes


def _ffi_headers_digest(include_dir: str) -> str:
    """sha256 over the names and bytes of the FFI headers (``xla/ffi/api/*.h``) the kernel is compiled against:
    they come from jaxlib, and a build against other headers may not match the running jaxlib's ABI."""
    h = hashlib.sha256()
    api = os.path.join(include_dir, _FFI_HEADERS)
    names = sorted(f for f in os.listdir(api) if f.endswith(".h")) if os.path.isdir(api) else []
    for name in names:
        with open(os.path.join(api, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _cache_key(source: bytes, cxx: str, cxx_version: str, flags, include_dir: str) -> str:
    """The cached library's name: everything its machine code depends on. The source, the compiler (path and
    ``--version`` line) and its flags, the FFI headers in ``include_dir``, the CPU (``-march=native``), the jax
    and jaxlib versions, and the machine."""
    parts = (
        source,
        cxx,
        cxx_version,
        "\0".join(flags),
        _ffi_headers_digest(include_dir),
        _cpu_features(),
        jax.__version__,
        jaxlib.__version__,
        platform.machine(),
    )
    return hashlib.sha256(b"\1".join(p if isinstance(p, bytes) else p.encode() for p in parts)).hexdigest()[:16]


def build(verbose: bool = False) -> str:
    """Compile the kernel (if not cached) and return the shared library's path. Raises RuntimeError with the
    compiler's message on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    include_dir = jax.ffi.include_dir()
    key = _cache_key(source, cxx, "".join(version), _FLAGS, include_dir)
    out = os.path.join(_cache_dir(), f"cpu_kernels-{key}.so")
    if os.path.exists(out):
        try:
            os.utime(out)  # its mtime is when it was last used: what ``_prune`` keeps
        except OSError:  # a read-only or another user's cache: the library is still there to load
            pass
        return out
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    cmd = [cxx, *_FLAGS, "-I", include_dir, _SOURCE, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {_SOURCE} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders each write their own temp file
    _prune(out)
    if verbose:
        print(f"built {out}")
    return out


KEEP_BUILDS = 4


def _prune(current: str) -> None:
    """Delete all but the ``KEEP_BUILDS`` most recently used libraries (each source, compiler, CPU or jaxlib
    change builds a new one). Several environments sharing the cache each keep theirs while in use; a process
    that has one loaded keeps its mapping after the file is removed."""
    used = {}
    for f in os.listdir(_cache_dir()):
        if f.startswith("cpu_kernels-") and f.endswith(".so"):
            path = os.path.join(_cache_dir(), f)
            try:
                used[path] = os.path.getmtime(path)
            except OSError:  # another process pruned it since the listing
                pass
    libs = sorted(used, key=used.__getitem__, reverse=True)
    for f in [f for f in libs if f != current][KEEP_BUILDS - 1 :]:
        try:
            os.unlink(f)
        except OSError:  # another process pruned it first
            pass


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered for the CPU platform (once per process)."""
    if os.environ.get("JSPEC_CPU_KERNEL", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JspecPackedMatmulF32), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.JspecPackedMatmulBF16), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.JspecCacheAttentionF32), platform="cpu")
        jax.ffi.register_ffi_target(NORM_TARGET, jax.ffi.pycapsule(lib.JspecNormMatmulF32), platform="cpu")
        jax.ffi.register_ffi_target(NORM_TARGET_BF16, jax.ffi.pycapsule(lib.JspecNormMatmulBF16), platform="cpu")
        jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(lib.JspecRowArgmaxF32), platform="cpu")
    except Exception as e:  # no compiler, a failed build: the XLA matmuls still work
        warnings.warn(f"jspec CPU matmul kernel unavailable, using XLA's matmuls: {e}", stacklevel=2)
        return False
    return True
