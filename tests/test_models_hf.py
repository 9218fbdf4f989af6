"""Hugging Face directory loader: tiny random transformers models saved with ``save_pretrained``."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import requires_torch

from models.checkpoint import CheckpointError
from models.hf_loader import config_from_hf, load_hf
from models.llama import make_model
from models.registry import load

pytestmark = requires_torch

TOKENS = np.array([[5, 77, 12, 99, 3, 64, 31, 8, 120, 45]], np.int32)


def tiny_model(kind: str, tied: bool, dtype="float32", seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        initializer_range=0.2,  # large enough that a mapping error moves logits well past the tolerance
    )
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
        with torch.no_grad():  # default init zeroes biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():  # norm weights default to ones; random ones catch a swapped attn/mlp norm
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(getattr(torch, dtype)).eval()


def torch_logits(model):
    import torch

    with torch.no_grad():
        return model.float()(torch.from_numpy(TOKENS).long()).logits[0].numpy()


def our_logits(cfg, params):
    m = make_model(cfg)
    t = TOKENS.shape[1]
    logits, _ = jax.jit(m.apply)(params, jnp.asarray(TOKENS), jnp.arange(t, dtype=jnp.int32)[None], m.init_cache(1, 16))
    return np.asarray(logits[0])


@pytest.mark.parametrize(
    "kind,tied,sharded",
    [("llama", True, False), ("llama", False, True), ("qwen2", False, False), ("qwen2", False, True)],
    ids=["llama-tied-single", "llama-untied-sharded", "qwen2-bias-single", "qwen2-bias-sharded"],
)
def test_logits_match_torch(tmp_path, kind, tied, sharded):
    model = tiny_model(kind, tied)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    files = {p.name for p in tmp_path.iterdir()}
    assert ("model.safetensors.index.json" in files) == sharded
    if sharded:
        assert len([f for f in files if f.endswith(".safetensors")]) > 2
    cfg, params = load_hf(tmp_path)
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.tie_embeddings == tied
    assert ("lm_head" in params) == (not tied)
    diff = np.abs(our_logits(cfg, params) - torch_logits(model)).max()
    assert diff <= 1e-4, diff


def test_single_file_wins_over_a_sharded_index_like_transformers(tmp_path):
    """A directory holding both model.safetensors and model.safetensors.index.json (with its shards):
    transformers' from_pretrained loads model.safetensors and never reads the index; jspec followed the index.
    The two layouts hold different models' weights, and the expected logits are transformers' from the directory."""
    import shutil

    import transformers

    single, sharded = tiny_model("llama", tied=False, seed=0), tiny_model("llama", tied=False, seed=1)
    sharded.save_pretrained(tmp_path, max_shard_size="40KB")  # first: save_pretrained deletes other weight files
    single.save_pretrained(tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    want = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    assert np.abs(want - torch_logits(sharded)).max() > 0.1  # the layouts really differ
    cfg, params = load_hf(tmp_path)
    assert np.abs(our_logits(cfg, params) - want).max() <= 1e-4


def test_bfloat16_checkpoint(tmp_path):
    model = tiny_model("llama", tied=False, dtype="bfloat16", seed=1)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    import torch
    import transformers

    cfg32, p32 = load_hf(tmp_path, dtype="float32")
    # bf16 -> f32 is exact, so our f32 model reproduces torch in f32 on the same (bf16-valued) weights. The
    # reference is reloaded in f32: the bf16 module's RoPE frequency buffer was itself rounded to bf16.
    ref_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert np.abs(our_logits(cfg32, p32) - torch_logits(ref_model)).max() <= 1e-4
    cfg16, p16 = load_hf(tmp_path, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    ref = model.model.layers[1].mlp.down_proj.weight.detach().float().numpy().astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(p16["layers"]["mlp"]["w_down"][1]).T, ref)
    lg16 = our_logits(cfg16, p16)
    lg32 = our_logits(cfg32, p32)
    assert np.abs(lg16 - lg32).max() < 0.05 * np.abs(lg32).max()


def test_registry_loads_a_directory(tmp_path):
    tiny_model("qwen2", tied=False).save_pretrained(tmp_path)
    cfg, params, model, tok = load(str(tmp_path))
    assert model.vocab_size == 128 and cfg.num_layers == 2 and tok is None


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf(tmp_path)


def test_truncated_safetensors(tmp_path):
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_hf(tmp_path)


def test_unsupported_model_type_and_rope_scaling(tmp_path):
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(conf | {"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2' \(supported: llama, mistral, qwen2, qwen3"):
        config_from_hf(tmp_path)
    scaled = conf | {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "longrope", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(CheckpointError, match="RoPE scaling 'longrope' is not supported"):
        config_from_hf(tmp_path)
    # A type in one place hid the other's, and a factor without a type was read as plain RoPE.
    both = conf | {"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "yarn", "factor": 4}}
    for bad, message in [
        (both, "RoPE scaling 'yarn' is not supported"),
        (conf | {"rope_scaling": {"factor": 8.0}}, r"rope_scaling has \['factor'\] but no type"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(conf | {"rope_parameters": {"rope_theta": 5000.0}}))
    assert config_from_hf(tmp_path).rope_theta == 5000.0


def _safetensors(path, tensors: dict, patch=None):
    """Write a safetensors file by hand, ``patch`` editing the header entries first (a corrupt or exotic file)."""
    import struct

    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    for name, change in (patch or {}).items():
        header[name].update(change)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def test_safetensors_headers_are_checked_tensor_by_tensor(tmp_path):
    """A header whose byte range does not hold its shape failed as a bare numpy reshape naming no tensor, an
    unsupported dtype named only the file, and a tensor found in two shards came from the last shard in file
    order even where the index names the other."""
    from models.hf_loader import index_safetensors

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 7.0, np.float32)
    _safetensors(tmp_path / "model.safetensors", {"w": a}, patch={"w": {"shape": [2, 2]}})
    with pytest.raises(CheckpointError, match=r"tensor 'w' of shape \(2, 2\) and dtype F32 spans 24 bytes"):
        index_safetensors(tmp_path)
    _safetensors(tmp_path / "model.safetensors", {"w": a}, patch={"w": {"dtype": "F8_E4M3"}})
    with pytest.raises(CheckpointError, match="tensor 'w' has dtype F8_E4M3, not supported"):
        index_safetensors(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    _safetensors(tmp_path / "a.safetensors", {"w": a})
    _safetensors(tmp_path / "b.safetensors", {"w": b, "x": b})
    index = {"weight_map": {"w": "a.safetensors", "x": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refs = index_safetensors(tmp_path)
    np.testing.assert_array_equal(refs["w"].load(), a)
    np.testing.assert_array_equal(refs["x"].load(), b)


def test_context_length_and_partial_rope_from_config(tmp_path):
    """max_position_embeddings becomes the model's context (decode refuses positions past it);
    partial_rotary_factor (RoPE on part of each head, as transformers applies it) is refused, not ignored."""
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    cfg = config_from_hf(tmp_path)
    assert cfg.max_positions == conf["max_position_embeddings"] and make_model(cfg).max_positions == cfg.max_positions
    (tmp_path / "config.json").write_text(json.dumps(conf | {"partial_rotary_factor": 0.5}))
    with pytest.raises(CheckpointError, match="unsupported setting partial_rotary_factor=0.5"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(conf | {"partial_rotary_factor": 1.0}))
    assert config_from_hf(tmp_path) == cfg
    # null is unset for transformers (its config keeps no partial_rotary_factor), so plain RoPE; it was refused.
    (tmp_path / "config.json").write_text(json.dumps(conf | {"partial_rotary_factor": None}))
    import transformers

    assert "partial_rotary_factor" not in transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert config_from_hf(tmp_path) == cfg


def test_generation_stops_at_every_end_token_like_transformers(tmp_path):
    """config.json and generation_config.json may list several end tokens (Llama-3.1: <|end_of_text|>,
    <|eom_id|>, <|eot_id|>); the loader kept only config.json's first, so decoding ran past the one the model
    actually ends its turn with. The loaded config now carries them all, and greedy decoding with them stops
    exactly where transformers' generate (which reads generation_config.json itself) stops."""
    import torch
    import transformers

    from jspec.decode import decode

    model = tiny_model("llama", tied=True)
    prompt = TOKENS[:, :4]
    with torch.no_grad():
        free = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=12, do_sample=False, eos_token_id=None)
    free = free[0, prompt.shape[1] :].tolist()
    # An end token that first appears a few tokens in, listed only by generation_config.json.
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    unused = next(t for t in range(128) if t not in free)
    model.config.eos_token_id = [unused]
    model.generation_config = transformers.GenerationConfig(eos_token_id=[unused, stop], pad_token_id=unused)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = reloaded.generate(torch.from_numpy(prompt).long(), max_new_tokens=12, do_sample=False)
    theirs = theirs[0, prompt.shape[1] :].tolist()
    assert theirs == free[: free.index(stop) + 1]  # the peer does stop there

    cfg, params = load_hf(tmp_path)
    assert (cfg.eos_id, cfg.eos_ids) == (unused, (unused, stop))
    kw = dict(max_new_tokens=12, temperature=0.0, eos_ids=cfg.eos_ids)
    out = decode(make_model(cfg), params, [prompt[0].tolist()], **kw)
    assert out.tokens[0] == theirs

    conf = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(conf | {"eos_token_id": [stop, None]}))
    with pytest.raises(CheckpointError, match=r"generation_config.json.*eos_token_id must be a token id or a list"):
        config_from_hf(tmp_path)


def test_registry_hands_config_json_to_the_tokenizer(tmp_path, hf_smollm2_tokenizer):
    """A repository whose tokenizer_config.json names no EOS keeps its end tokens in config.json (and
    generation_config.json): the registry must pass them on, or generation never stops at EOS."""
    model = tiny_model("llama", tied=True)
    model.config.eos_token_id = [2, 7]
    model.save_pretrained(tmp_path)
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    tcfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in tcfg.items() if k not in ("bos_token", "eos_token")}))
    cfg, _, _, tok = load(str(tmp_path))
    assert tok.eos_ids == cfg.eos_ids == (2, 7) and tok.eos_id == 2


def _tiny_tokenizer_dir(
    path, tcfg: dict, special_tokens_map: dict | None = None, config: dict | None = None, post_processor=None
):
    """A hand-built byte-free BPE tokenizer.json (single letters, four special tokens, ``post_processor``) with
    ``tcfg`` as its tokenizer_config.json; what transformers' AutoTokenizer and ``Tokenizer.from_hf_dir`` both
    read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as tk_models

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)} | {c: i + 4 for i, c in enumerate("abcdefghij ")}
    backend = HFTokenizer(tk_models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.add_special_tokens(specials)
    if post_processor is not None:
        backend.post_processor = post_processor
    path.mkdir(exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"} | tcfg))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_named_chat_templates_without_a_default_are_refused_like_transformers(tmp_path):
    """tokenizer_config.json may hold a list of named templates. jspec took the first whatever its name (an
    empty list was a bare IndexError); transformers renders the one named "default" and otherwise refuses,
    listing the names."""
    import transformers

    from models.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "a"}]
    named = [{"name": "tool_use", "template": "T{{ messages[0].content }}"}, {"name": "rag", "template": "R"}]
    path = _tiny_tokenizer_dir(tmp_path / "tok", {"eos_token": "</s>", "chat_template": named})
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    with pytest.raises(ValueError, match=r"no default specified.*\['rag', 'tool_use'\]"):
        theirs.apply_chat_template(chat, tokenize=False)
    tok = Tokenizer.from_hf_dir(path)  # loads (plain text needs no template), refuses to chat, naming them
    assert tok.encode("abc") == [4, 5, 6]
    with pytest.raises(ValueError, match=r"names chat templates \['rag', 'tool_use'\] and none of them 'default'"):
        tok.apply_chat_template(chat)
    _tiny_tokenizer_dir(path, {"eos_token": "</s>", "chat_template": []})
    with pytest.raises(ValueError, match=r"\(an empty list\)"):
        Tokenizer.from_hf_dir(path).apply_chat_template(chat)
    _tiny_tokenizer_dir(path, {"eos_token": "</s>", "chat_template": [*named, {"name": "default", "template": "D"}]})
    theirs = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(chat, tokenize=False)
    assert Tokenizer.from_hf_dir(path).apply_chat_template(chat) == theirs == "D"
    _tiny_tokenizer_dir(path, {"chat_template": [{"name": "default"}]})
    with pytest.raises(CheckpointError, match=r"chat_template entry \{'name': 'default'\} is not"):
        Tokenizer.from_hf_dir(path)


def test_tool_use_template_renders_when_tools_are_given_like_transformers(tmp_path):
    """Named templates with "tool_use" (Hermes-2-Pro's layout): transformers renders it when the caller passes
    tools, "default" otherwise; jspec rendered "default" and dropped the tools. The same from template files
    (chat_template.jinja + additional_chat_templates/tool_use.jinja, transformers 5's layout), which take priority
    over tokenizer_config.json's entry."""
    import transformers

    from models.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "a"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    named = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools[0].function.name }}{{ messages[0].content }}"},
    ]
    path = _tiny_tokenizer_dir(tmp_path / "tok", {"eos_token": "</s>", "chat_template": named})
    files = _tiny_tokenizer_dir(tmp_path / "files", {"eos_token": "</s>", "chat_template": "ignored"})
    (files / "chat_template.jinja").write_text("F{{ messages[0].content }}")
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text("U{{ tools | length }}")
    for p, plain, with_tools in ((path, "Da", "Tfa"), (files, "Fa", "U1")):
        theirs = transformers.AutoTokenizer.from_pretrained(p)
        ours = Tokenizer.from_hf_dir(p)
        assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False) == plain
        got = ours.apply_chat_template(chat, tools=tools)
        assert got == theirs.apply_chat_template(chat, tools=tools, tokenize=False) == with_tools
        assert ours.encode_chat(chat, tools=tools) == ours.encode(with_tools, add_bos=False)
    # Without a default, tools still pick tool_use (transformers too); without tools it is refused.
    only = _tiny_tokenizer_dir(tmp_path / "only", {"eos_token": "</s>", "chat_template": named[1:]})
    theirs = transformers.AutoTokenizer.from_pretrained(only).apply_chat_template(chat, tools=tools, tokenize=False)
    assert Tokenizer.from_hf_dir(only).apply_chat_template(chat, tools=tools) == theirs == "Tfa"
    with pytest.raises(ValueError, match=r"names chat templates \['tool_use'\] and none of them 'default'"):
        Tokenizer.from_hf_dir(only).apply_chat_template(chat)


def test_null_special_token_means_none_like_transformers(tmp_path):
    """``"bos_token": null`` (Qwen2.5's tokenizer_config.json, whose config.json still says bos_token_id
    151643) is no BOS for transformers, so ``{{ bos_token }}`` renders empty; jspec treated it as a missing key
    and took config.json's id. special_tokens_map.json, which transformers reads over a tokenizer_config.json
    without added_tokens_decoder (as here), is read too (a null there also means none)."""
    import transformers

    from models.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "a"}]
    config = {"bos_token_id": 0, "eos_token_id": 1}
    template = "[{{ bos_token }}]{{ messages[0].content }}"
    cases = [  # (tokenizer_config.json's bos_token or absent, special_tokens_map.json or None, our bos_id)
        (None, None, None),
        ("absent", None, 0),  # no entry anywhere: jspec's fallback to config.json (transformers has none)
        (None, {"bos_token": "<s>"}, 0),
        ("<|im_start|>", {"bos_token": {"content": "<s>", "special": True}}, 0),
        ("<s>", {"bos_token": None}, None),
    ]
    for i, (bos, stm, want) in enumerate(cases):
        tcfg = {"eos_token": "</s>", "chat_template": template} | ({} if bos == "absent" else {"bos_token": bos})
        path = _tiny_tokenizer_dir(tmp_path / f"t{i}", tcfg, stm, config)
        tok = Tokenizer.from_hf_dir(path, config=config)
        assert tok.bos_id == want, (bos, stm)
        assert tok.apply_chat_template(chat) == ("[]a" if want is None else "[<s>]a")
        if bos != "absent":
            theirs = transformers.AutoTokenizer.from_pretrained(path)
            assert theirs.bos_token_id == want and theirs.apply_chat_template(chat, tokenize=False) == (
                tok.apply_chat_template(chat)
            )
        assert not tok.add_bos or want is not None


def test_bad_safetensors_offsets_and_index_are_named(tmp_path):
    """data_offsets were only checked against the end of the file: [-8, n - 8] passed and read the last 8 bytes
    of the JSON header as weights; two tensors sharing bytes read each other's weights; an index without a
    weight_map was a bare KeyError."""
    from models.hf_loader import index_safetensors

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 7.0, np.float32)
    cases = [
        ({"w": {"data_offsets": [-8, 16]}}, r"tensor 'w' has data_offsets \[-8, 16\]"),  # 24 bytes, 8 of header
        ({"x": {"data_offsets": [12, 36]}}, r"tensors 'w' and 'x' overlap"),  # x starts inside w's [0, 24)
        ({"w": {"data_offsets": [24, 0]}}, r"tensor 'w' has data_offsets \[24, 0\]"),
        ({"w": {"data_offsets": [0]}}, r"tensor 'w' needs a shape and data_offsets"),
        ({"w": {"shape": None}}, r"tensor 'w' needs a shape and data_offsets"),
    ]
    for patch, message in cases:
        _safetensors(tmp_path / "model.safetensors", {"w": a, "x": b}, patch=patch)
        with pytest.raises(CheckpointError, match=message):
            index_safetensors(tmp_path)
    _safetensors(tmp_path / "model.safetensors", {"w": a, "x": b})
    np.testing.assert_array_equal(index_safetensors(tmp_path)["x"].load(), b)  # the unpatched file reads back
    (tmp_path / "model.safetensors").unlink()  # else it is read and the index ignored, as transformers does
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no weight_map"):
        index_safetensors(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        index_safetensors(tmp_path)


def test_config_json_errors_are_named_and_bos_is_read_like_eos(tmp_path):
    """num_attention_heads was read outside the missing-key handler (a bare KeyError); bos_token_id was taken
    raw, so -1 (older conversions' "none", which eos already drops) became BOS id -1 and a list or a string
    passed through."""
    conf = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path = tmp_path / "config.json"

    def cfg_with(**changes):
        path.write_text(json.dumps({k: v for k, v in (conf | changes).items() if v != "drop"}))
        return config_from_hf(tmp_path)

    assert (cfg_with().bos_id, cfg_with().num_heads) == (1, 4)
    with pytest.raises(CheckpointError, match="config.json: missing key 'num_attention_heads'"):
        cfg_with(num_attention_heads="drop")
    with pytest.raises(CheckpointError, match="config.json: .*NoneType"):
        cfg_with(num_attention_heads=None)
    assert cfg_with(bos_token_id=-1).bos_id is None
    assert cfg_with(bos_token_id=None).bos_id is None
    assert cfg_with(bos_token_id=[1]).bos_id == 1
    with pytest.raises(CheckpointError, match=r"bos_token_id must be a token id or a list of token ids, got '1'"):
        cfg_with(bos_token_id="1")


def test_malformed_json_files_are_named(tmp_path):
    """A config.json, tokenizer_config.json, generation_config.json or special_tokens_map.json that is not valid
    JSON failed with a bare JSONDecodeError naming no file, and one holding a list or a string with an
    AttributeError (``.get`` on a list); each is a CheckpointError naming the file."""
    from models.tokenizer import Tokenizer

    conf = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96}
    conf |= {"num_hidden_layers": 2, "num_attention_heads": 4}
    path = _tiny_tokenizer_dir(tmp_path / "tok", {"eos_token": "</s>"}, {"eos_token": "</s>"}, conf)
    assert config_from_hf(path).num_heads == 4 and Tokenizer.from_hf_dir(path).eos_id == 1  # the valid files load
    good = {name: (path / name).read_text() for name in ("config.json", "tokenizer_config.json")}
    cases = {
        "config.json": lambda: config_from_hf(path),
        "generation_config.json": lambda: config_from_hf(path),
        "tokenizer_config.json": lambda: Tokenizer.from_hf_dir(path),
        "special_tokens_map.json": lambda: Tokenizer.from_hf_dir(path),
    }
    bad = {'{"model_type": "llama",': "not valid JSON", "[1, 2]": "expected a JSON object, got list"}
    bad['"llama"'] = "expected a JSON object, got str"
    for name, read in cases.items():
        for text, message in bad.items():
            (path / name).write_text(text)
            with pytest.raises(CheckpointError, match=re.escape(f"{path / name}: {message}")):
                read()
        (path / name).write_text(good.get(name, "{}"))


def test_special_tokens_map_is_read_only_beside_a_legacy_tokenizer_config(tmp_path):
    """transformers 5 reads special_tokens_map.json only when tokenizer_config.json has no added_tokens_decoder
    (the legacy layout), and then its entries replace tokenizer_config.json's; a tokenizer_config.json with one
    (what save_pretrained writes) is read alone. jspec always let special_tokens_map.json win. Both layouts,
    the two files naming different EOS tokens, against transformers' AutoTokenizer."""
    import transformers

    from models.tokenizer import Tokenizer

    decoder = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
        | {"special": True}
        for i, t in enumerate(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    }
    seen = set()
    for layout, tcfg in (("legacy", {}), ("saved", {"added_tokens_decoder": decoder})):
        path = _tiny_tokenizer_dir(tmp_path / layout, tcfg | {"eos_token": "</s>"}, {"eos_token": "<|im_end|>"})
        theirs = transformers.AutoTokenizer.from_pretrained(path).eos_token_id
        tok = Tokenizer.from_hf_dir(path)
        assert tok.eos_id == theirs and tok.eos_ids == (theirs,), layout
        seen.add(theirs)
    assert seen == {1, 3}  # the layouts really differ: </s> read alone, <|im_end|> from special_tokens_map.json


def test_chat_template_features_render_like_transformers(tmp_path):
    """Three things transformers' chat-template renderer has and jspec's lacked, each compared with transformers'
    apply_chat_template on the same template: TRL's ``{% generation %}`` blocks (assistant-mask templates: the
    template did not even parse), ``tools`` and ``documents`` defined as None (``tools is not none`` was true for
    the undefined variable), and tojson's ensure_ascii / separators / sort_keys arguments (refused before)."""
    import transformers

    from models.tokenizer import Tokenizer

    chat = [{"role": "user", "content": "a<b>&"}, {"role": "assistant", "content": "caf\u00e9", "z": 1, "k": [1, 2]}]
    templates = {
        "generation": (
            "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
            "{{ m.content }}!{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        ),
        "tools": (
            "{% if tools is not none %}T{{ tools | length }}{% endif %}{% if documents is not none %}D{% endif %}"
            "{% if tools is defined %}d{% endif %}{{ messages[0].content }}"
        ),
        "tojson": (
            "{{ messages[1] | tojson(indent=2, sort_keys=True, separators=(',', ': ')) }}|"
            "{{ messages[1] | tojson(ensure_ascii=True) }}|{{ messages[0] | tojson }}"
        ),
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for name, template in templates.items():
        path = _tiny_tokenizer_dir(tmp_path / name, {"eos_token": "</s>", "chat_template": template})
        theirs = transformers.AutoTokenizer.from_pretrained(path)
        ours = Tokenizer.from_hf_dir(path)
        for kw in ({}, {"tools": tools}):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, **kw)
            assert ours.apply_chat_template(chat, add_generation_prompt=False, **kw) == want, (name, kw, want)
            if name == "tools":  # what the comparison covers: no tools is None (and defined), given tools show
                assert want == ("T1da<b>&" if kw else "da<b>&")


def test_chat_messages_and_special_tokens_reach_the_template_like_transformers(tmp_path):
    """transformers' apply_chat_template drops the keys of a message whose value is None (OpenAI-style
    ``"content": None`` rendered as "None" here), copies a message's reasoning (``reasoning_content``, ``thinking``
    or ``reasoning``) to ``reasoning_content`` and ``thinking`` both, and gives the template every named special
    token (a missing one undefined, not "") with the caller's keyword arguments overriding them:
    ``apply_chat_template(chat, bos_token="")`` was a TypeError (bos_token given twice). Compared with transformers
    on the same template, messages and arguments."""
    import transformers

    from models.tokenizer import Tokenizer

    template = (
        "{{ bos_token is defined }}[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}][{{ unk_token }}]"
        "{{ sep_token is defined }}{% for m in messages %}<{{ m.role }}>"
        "{% if m.content is defined %}{{ m.content }}{% else %}-{% endif %}"
        "{% if m.reasoning_content is defined %}(r={{ m.reasoning_content }},t={{ m.thinking }}){% endif %}"
        "{{ m | tojson }}{% endfor %}"
    )
    chat = [
        {"role": "user", "content": "a", "name": None},
        {"role": "assistant", "content": None, "reasoning": "x", "tool_calls": None},
        {"role": "assistant", "content": "b", "thinking": "y"},
        {"role": "assistant", "content": "c", "reasoning_content": "r", "thinking": "t", "reasoning": None},
    ]
    files = {  # tokenizer_config.json entries; the second has no BOS (undefined for the template)
        "named": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|im_end|>", "unk_token": "<|im_start|>"},
        "no-bos": {"bos_token": None, "eos_token": "</s>"},
    }
    seen = set()
    for name, tcfg in files.items():
        path = _tiny_tokenizer_dir(tmp_path / name, tcfg | {"chat_template": template})
        theirs = transformers.AutoTokenizer.from_pretrained(path)
        ours = Tokenizer.from_hf_dir(path)
        assert ours.special_tokens_map == theirs.special_tokens_map, name
        for kw in ({}, {"bos_token": ""}, {"eos_token": "E", "pad_token": "P", "sep_token": "S"}):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, **kw)
            assert ours.apply_chat_template(chat, add_generation_prompt=False, **kw) == want, (name, kw, want)
            seen.add(want.split("<user>")[0])
    assert chat[1] == {"role": "assistant", "content": None, "reasoning": "x", "tool_calls": None}  # not edited
    # What the comparison covers: the named tokens, the caller's overrides, undefined ones (a null BOS, no sep).
    assert seen == {
        "True[<s>][</s>][<|im_end|>][<|im_start|>]False",
        "True[][</s>][<|im_end|>][<|im_start|>]False",
        "True[<s>][E][P][<|im_start|>]True",
        "False[][</s>][][]False",
        "True[][</s>][][]False",
        "False[][E][P][]True",
    }
    assert (  # content None left out; reasoning copied, first to "thinking" and last to "reasoning_content"
        '<assistant>-(r=x,t=x){"thinking": "x", "role": "assistant", "reasoning": "x", "reasoning_content": "x"}'
        '<assistant>b(r=y,t=y){"thinking": "y", "role": "assistant", "content": "b", "reasoning_content": "y"}'
    ) in want
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])


def test_rope_theta_is_read_where_transformers_reads_it(tmp_path):
    """transformers 5 takes the RoPE base from rope_scaling's (else rope_parameters') rope_theta, then the
    top-level rope_theta, then 10000; the loader ignored a rope_theta inside rope_scaling and used the
    top-level one or 10000. Each case against transformers' own config; two different dicts are refused
    (transformers would silently ignore rope_parameters)."""
    import transformers

    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    base = {k: v for k, v in conf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    cases = [
        {"rope_scaling": {"rope_type": "default", "rope_theta": 2500.0}},
        {"rope_scaling": {"type": "default", "rope_theta": 2500.0}, "rope_theta": 7000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 2500.0}, "rope_theta": 7000.0},
        {"rope_parameters": {"rope_type": "default"}, "rope_theta": 7000.0},
        {"rope_scaling": {"rope_type": "default"}, "rope_theta": 7000.0},
        {"rope_theta": 7000.0},
        {},
        {"rope_scaling": {"rope_type": "default", "rope_theta": 2500.0}, "rope_parameters": {}},
    ]
    seen = set()
    for case in cases:
        (tmp_path / "config.json").write_text(json.dumps(base | case))
        theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"]
        assert config_from_hf(tmp_path).rope_theta == theirs, case
        seen.add(theirs)
    assert seen == {2500.0, 7000.0, 10000.0}  # the cases reach each source of the value
    both = {"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 9.0}}
    (tmp_path / "config.json").write_text(json.dumps(base | both))
    with pytest.raises(CheckpointError, match="rope_scaling .* and rope_parameters .* differ: transformers would"):
        config_from_hf(tmp_path)
    same = {"rope_scaling": both["rope_parameters"], "rope_parameters": both["rope_parameters"]}
    (tmp_path / "config.json").write_text(json.dumps(base | same))
    assert config_from_hf(tmp_path).rope_theta == 9.0
    (tmp_path / "config.json").write_text(json.dumps(base | {"rope_theta": "5000"}))
    with pytest.raises(CheckpointError, match="rope_theta must be a positive number, got '5000'"):
        config_from_hf(tmp_path)


def test_qwen2_sliding_window_layers_like_transformers(tmp_path):
    """use_sliding_window was refused outright; transformers' Qwen2Config slides only layers i >=
    max_window_layers (or those layer_types names), so a config whose max_window_layers covers every layer (or
    whose sliding_window is null) has none and loads. The layers that slide (and their window) are those of the
    layer_types transformers derives."""
    import transformers

    tiny_model("qwen2", tied=False).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.pop("layer_types", None)
    want = config_from_hf(tmp_path)
    cases = [
        {"use_sliding_window": True, "max_window_layers": 2, "sliding_window": 16},
        {"use_sliding_window": True, "max_window_layers": 5, "sliding_window": 16},
        {"use_sliding_window": True, "sliding_window": 16},  # default max_window_layers 28
        {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": None},
        {"use_sliding_window": False, "max_window_layers": 0, "sliding_window": 16},
        {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 16},
        {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": 16},
        {"use_sliding_window": True, "max_window_layers": 0, "layer_types": ["full_attention"] * 2},
        {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]},
    ]
    types_with_sliding = ["full_attention", "sliding_attention"]
    for case in cases:
        (tmp_path / "config.json").write_text(json.dumps(conf | case))
        types = transformers.AutoConfig.from_pretrained(tmp_path).layer_types
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if sliding:  # the layers transformers slides, with its window
            got = config_from_hf(tmp_path)
            assert (got.sliding_layers, got.sliding_window) == (tuple(sliding), 16), case
            assert got.replace(sliding_layers=(), sliding_window=None) == want
        else:
            assert config_from_hf(tmp_path) == want, case
    # layer_types naming a sliding layer while the window is off: Qwen2Config sets sliding_window to None and keeps
    # layer_types, and transformers' model then fails (it does not fall back to full attention); refused by name.
    import torch

    off = {"use_sliding_window": False, "sliding_window": 16}, {"use_sliding_window": True, "sliding_window": None}
    for case, why in zip(off, ("use_sliding_window is false", "sliding_window is null")):
        (tmp_path / "config.json").write_text(json.dumps(conf | case | {"layer_types": ["full_attention"] * 2}))
        assert config_from_hf(tmp_path) == want  # all full: loads
        (tmp_path / "config.json").write_text(json.dumps(conf | case | {"layer_types": types_with_sliding}))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert theirs.config.sliding_window is None and theirs.config.layer_types == types_with_sliding
        for use_cache in (True, False):
            with pytest.raises((TypeError, ValueError)), torch.no_grad():
                theirs(torch.from_numpy(TOKENS).long(), use_cache=use_cache)
        with pytest.raises(CheckpointError, match=rf"layers \[1\] sliding_attention but {why}: sliding layers without"):
            config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(conf | {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": None})
    )
    with pytest.raises(CheckpointError, match="max_window_layers must be a layer count, got None"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(conf | {"layer_types": ["full_attention", "linear_attention"]}))
    with pytest.raises(CheckpointError, match="unsupported layer type 'linear_attention' in layer_types"):
        config_from_hf(tmp_path)


def test_bos_and_eos_are_added_where_transformers_adds_them(tmp_path):
    """An EOS-appending tokenizer: jspec's encode never appended EOS, and it let tokenizer_config.json's
    add_bos_token override the post-processor. transformers 5 drops add_bos_token / add_eos_token when there is a
    tokenizer.json and lets its post-processor decide, so the same holds here: every combination of
    post-processor and flags, against AutoTokenizer (encode, and a chat prompt, which gets neither added)."""
    import transformers
    from tokenizers import processors

    from models.tokenizer import Tokenizer

    template = processors.TemplateProcessing
    posts = {
        "none": None,
        "eos": template(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]),
        "bos": template(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]),
        "both": template(single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 1)]),
    }
    seen = set()
    for name, post in posts.items():
        for flags in (
            {},
            {"add_bos_token": True, "add_eos_token": True},
            {"add_bos_token": False, "add_eos_token": False},
        ):
            tcfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages[0].content }}"} | flags
            path = _tiny_tokenizer_dir(
                tmp_path / f"{name}{len(flags)}{flags.get('add_eos_token')}", tcfg, None, None, post
            )
            theirs = transformers.AutoTokenizer.from_pretrained(path)
            tok = Tokenizer.from_hf_dir(path)
            assert tok.encode("abc") == theirs("abc")["input_ids"], (name, flags)
            chat = [{"role": "user", "content": "abc"}]
            assert tok.encode_chat(chat) == theirs.apply_chat_template(chat, tokenize=True, return_dict=False)
            seen.add(tuple(tok.encode("abc")))
    assert seen == {(4, 5, 6), (4, 5, 6, 1), (0, 4, 5, 6), (0, 4, 5, 6, 1)}


def test_truncation_and_padding_in_tokenizer_json_are_off_like_transformers(tmp_path):
    """tokenizer.json may store truncation and padding, which the ``tokenizers`` backend then applies to every
    encode: a "max_length": 8 there cut every prompt (and chat prompt) to 8 tokens, padding lengthened short ones.
    transformers turns both off unless a call asks for them; compared with AutoTokenizer on long and short text."""
    import transformers
    from tokenizers import Tokenizer as HFTokenizer

    from models.tokenizer import Tokenizer

    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "<|im_start|>{{ messages[0].content }}"}
    path = _tiny_tokenizer_dir(tmp_path / "tok", tcfg)
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=12, pad_id=0, pad_token="<s>")
    backend.save(str(path / "tokenizer.json"))
    saved = json.loads((path / "tokenizer.json").read_text())
    assert saved["truncation"]["max_length"] == 8 and saved["padding"]["strategy"] == {"Fixed": 12}
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_hf_dir(path)
    for text in ("abcdefghij abcdefghij abc", "ab"):
        want = theirs(text)["input_ids"]
        assert tok.encode(text) == want, text
        chat = [{"role": "user", "content": text}]
        assert tok.encode_chat(chat) == theirs.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert len(tok.encode("abcdefghij abcdefghij abc")) == 25 and len(tok.encode("ab")) == 2  # one token a letter


def test_model_type_defaults_of_absent_keys_like_transformers(tmp_path):
    """A config.json without num_key_value_heads has 8 KV heads for Mistral and 32 for Qwen2 in transformers
    (their config classes' defaults; null, like Llama's default, is one per attention head, where transformers
    accepts null at all): the loader took one per attention head for all three. A Mistral config without
    sliding_window slides 4096 tokens in transformers, in every layer, and so does the loaded config; it loaded as
    full attention. Each case against AutoConfig."""
    import transformers

    base = {"vocab_size": 128, "hidden_size": 512, "intermediate_size": 96, "num_hidden_layers": 2}
    base["num_attention_heads"] = 64  # neither 8 nor 32: every default is told apart
    seen = {}
    for mtype in ("llama", "mistral", "qwen2"):
        for kv in ("absent", None, 4):
            conf = base | {"model_type": mtype} | ({} if kv == "absent" else {"num_key_value_heads": kv})
            if mtype == "mistral":
                conf["sliding_window"] = None  # full attention (the absent window is the next case)
            (tmp_path / "config.json").write_text(json.dumps(conf))
            if (mtype, kv) == ("mistral", None):  # MistralConfig's field is a plain int: its validation refuses null
                with pytest.raises(Exception, match="num_key_value_heads"):
                    transformers.AutoConfig.from_pretrained(tmp_path)
                continue
            theirs = transformers.AutoConfig.from_pretrained(tmp_path).num_key_value_heads
            assert config_from_hf(tmp_path).num_kv_heads == theirs, (mtype, kv)
            seen[mtype, kv] = theirs
    assert (seen["llama", "absent"], seen["mistral", "absent"], seen["qwen2", "absent"]) == (64, 8, 32)
    assert seen["llama", None] == seen["qwen2", None] == 64
    no_window = base | {"model_type": "mistral", "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(no_window))
    assert transformers.AutoConfig.from_pretrained(tmp_path).sliding_window == 4096
    got = config_from_hf(tmp_path)  # every Mistral layer slides that window
    assert (got.sliding_window, got.sliding_layers) == (4096, (0, 1))
    (tmp_path / "config.json").write_text(json.dumps(no_window | {"sliding_window": None}))
    assert (config_from_hf(tmp_path).sliding_window, config_from_hf(tmp_path).sliding_layers) == (None, ())
