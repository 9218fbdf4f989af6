"""Tokenizer + chat template, built from GGUF metadata or a Hugging Face directory, with no network access.

GGUF files carry either a byte-level BPE vocabulary (``tokenizer.ggml.model`` "gpt2": ``tokenizer.ggml.tokens`` +
``merges`` and a pre-tokenizer id ``tokenizer.ggml.pre``) or a SentencePiece one ("llama": tokens + ``scores``,
read by ``models.sp_tokenizer``), token types, BOS/EOS ids and a Jinja chat template; we assemble the same
pipeline with the ``tokenizers`` library. CONTROL tokens (type 3) are registered as special tokens: otherwise text
like ``<|im_start|>`` would be split into ordinary pieces.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from models.checkpoint import (
    GGUF_END_TEXTS,
    GGUF_FIM_END_TEXTS,
    CheckpointError,
    gguf_end_ids,
    gguf_special_id,
    hf_id_list,
    read_json,
)
from models.llama import end_token_ids
from models.sp_tokenizer import CONTROL as _CONTROL
from models.sp_tokenizer import UNKNOWN as _UNKNOWN
from models.sp_tokenizer import USER_DEFINED as _USER_DEFINED
from models.sp_tokenizer import spm_backend

# tokenizer.ggml.model values read here (llama.cpp's vocabulary types "gpt2" = BPE and "llama" = SPM).
_GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# Texts of the tokens llama.cpp ends generation at by their spelling (checkpoint.gguf_end_ids).
_END_TEXTS = GGUF_END_TEXTS.union(*GGUF_FIM_END_TEXTS.values())

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool = True):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), _byte_level(use_regex=False)]
    )


# ``tokenizer.ggml.pre`` -> the pre-tokenizer the vocabulary was trained with. Getting this wrong changes
# token boundaries silently, so unknown ids are rejected instead of guessed.
_PRE_TOKENIZERS = {
    # SmolLM / StarCoder: every digit is its own piece, then the GPT-2 byte-level regex.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "starcoder": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    # llama.cpp's name for GPT-2's rules ("default", its fallback, splits differently); it knows no "gpt2" (that
    # is tokenizer.ggml.model's value) and refuses a file naming it, so it is refused here too.
    "gpt-2": _byte_level,
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}
# llama.cpp's LLAMA3 pre-tokenizer type: a piece that is a whole vocabulary entry is that token, merges or not
# (tokenizer.json's ``ignore_merges``), and BOS is added unless the file says otherwise.
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): a chat template sees each
# one the checkpoint names as a variable.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning goes by, the standard one first (transformers' chat_template_utils._REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's part of a chat for training masks (TRL's
    templates). transformers parses it with its AssistantTracker extension, which renders the body as it is (and
    records where it fell); rendering the body as it is, is all a prompt needs."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter (Jinja's own escapes HTML characters and takes only indent).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _render_env() -> jinja2.Environment:
    # Same settings as the reference chat-template renderers, so whitespace comes out identical.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):  # Llama-3.1+ templates date their system prompt with it
        return datetime.datetime.now().strftime(fmt)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = _tojson
    return env


class Tokenizer:
    """encode/decode plus the checkpoint's chat template and special ids.

    bos_id / eos_id: ints or None. add_bos: whether ``encode`` prepends BOS (False for ChatML models, whose
    template writes ``<|im_start|>`` itself); add_eos: whether it appends EOS (GGUF ``add_eos_token``, an HF
    tokenizer.json whose post-processor appends it). eos_ids: every id that ends generation, the canonical
    ``eos_id`` first, then ``extra_eos_ids`` (Llama-3's ``<|eot_id|>``, GGUF's end-of-turn tokens, the lists of
    config.json and generation_config.json): pass it to ``jspec.decode(eos_ids=...)``, as transformers and
    llama.cpp stop at any of them. chat_template: one template, or {name: template} (transformers' named
    templates: "default", and "tool_use" where the caller passes tools). chat_bos: ``encode_chat`` gives the
    prompt exactly one BOS when ``add_bos`` (llama.cpp's rule for GGUF files: a BOS the template writes first is
    dropped, then the tokenizer adds its own), rather than only what the template writes (transformers').
    template_error: what ``apply_chat_template`` says when there is no template to use (e.g. named templates none
    of which is the default). special_tokens: the texts of the other named special
    tokens the checkpoint gives (``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``; None:
    ``pad_token`` from ``pad_id``), which chat templates see as variables beside ``bos_token`` and ``eos_token``.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | Mapping[str, str] | None = None,
        add_bos: bool = False,
        pad_id: int | None = None,
        extra_eos_ids: Sequence[int] = (),
        template_error: str | None = None,
        add_eos: bool = False,
        special_tokens: Mapping[str, str] | None = None,
        chat_bos: bool = False,
    ):
        self.backend = backend
        self.template_error = template_error  # why there is no chat template, when the checkpoint says
        self.bos_id = bos_id
        self.eos_ids = end_token_ids([eos_id, *extra_eos_ids])
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_bos = chat_bos
        named = dict(chat_template) if isinstance(chat_template, Mapping) else {"default": chat_template}
        self.chat_templates = {k: v for k, v in named.items() if v}  # name -> template
        self.chat_template = self.chat_templates.get("default")
        if special_tokens is None:
            special_tokens = {} if pad_id is None else {"pad_token": backend.id_to_token(pad_id)}
        unknown = sorted(set(special_tokens) - set(_SPECIAL_TOKEN_NAMES[2:]))
        if unknown:
            raise ValueError(
                f"special_tokens: unknown name {unknown[0]!r} (known: {', '.join(_SPECIAL_TOKEN_NAMES[2:])})"
            )
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        env = _render_env()
        self._templates = {k: env.from_string(v) for k, v in self.chat_templates.items()}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.backend.id_to_token(self.eos_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special token -> its text, for those the checkpoint has (transformers' ``special_tokens_map``)."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token} | self.special_tokens
        return {k: named[k] for k in _SPECIAL_TOKEN_NAMES if named.get(k) is not None}

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """text -> token ids (special-token text such as ``<|im_end|>`` maps to its single id); BOS first and EOS
        last where the checkpoint says (``add_bos`` / ``add_eos``, which the arguments override)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kw) -> str:
        """Render the checkpoint's chat template (a string; tokenize with ``encode_chat`` or ``encode``).

        As transformers' ``apply_chat_template``: keys of a message whose value is None are left out, a message's
        reasoning (``reasoning_content``, ``thinking`` or ``reasoning``) is given as ``reasoning_content`` and
        ``thinking`` both, and the template sees every named special token (``special_tokens_map``; one the
        checkpoint lacks is undefined), which ``kw`` may override (``bos_token=""``). Of named templates, the one
        named "tool_use" renders where ``tools`` is given, else "default" (transformers' choice).
        """
        name = "tool_use" if kw.get("tools") is not None and "tool_use" in self._templates else "default"
        template = self._templates.get(name)
        if template is None:
            if self.template_error:
                raise ValueError(self.template_error)
            if self._templates:
                raise ValueError(f"the chat templates {sorted(self._templates)} include no 'default' to use")
            raise ValueError("this checkpoint has no chat template")
        if len(messages) == 0:
            raise ValueError("cannot apply the chat template to an empty conversation: give at least one message")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            # A fresh dict: the template never sees (or edits) the caller's.
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        # tools and documents are always defined, None unless given, as transformers renders them: templates test
        # `tools is not none`, which an undefined variable passes.
        kw = {"tools": None, "documents": None} | self.special_tokens_map | kw
        return template.render(messages=chat, add_generation_prompt=add_generation_prompt, **kw)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kw) -> list[int]:
        """The rendered conversation's token ids (``kw``: the template's variables, as ``apply_chat_template``).
        A prompt never gets EOS (it must not end the text). BOS: what the template writes (transformers'
        apply_chat_template tokenizes with add_special_tokens=False); with ``chat_bos`` (GGUF files), exactly one
        where ``add_bos``, as llama.cpp's chat path gives it."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kw)
        if self.chat_bos and self.add_bos and self.bos_id is not None:
            bos = self.bos_token
            return [self.bos_id] + self.encode(text.removeprefix(bos) if bos else text, add_bos=False, add_eos=False)
        return self.encode(text, add_bos=False, add_eos=False)

    # ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> Tokenizer:
        """From a parsed GGUF file (``models.gguf_loader.GGUFFile``, ``open_gguf``) or its metadata alone
        (``GGUFMetadata``, ``read_gguf_metadata``: a vocabulary-only file read in a fraction of the time)."""
        get = gf.get
        kind = get("tokenizer.ggml.model")
        if kind not in _GGUF_TOKENIZER_MODELS:
            raise CheckpointError(
                f"{gf.path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; supported: "
                + ", ".join(f"'{k}' ({v})" for k, v in _GGUF_TOKENIZER_MODELS.items())
            )
        tokens = get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{gf.path}: no tokenizer.ggml.tokens: the metadata holds no vocabulary")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise CheckpointError(
                f"{gf.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        ends = gguf_end_ids(get)
        # llama.cpp makes every end-of-generation token it finds by its text a CONTROL token, whatever its type in
        # the file: its text in a prompt is then that one token, not pieces of it.
        types = [_CONTROL if t in _END_TEXTS and i in ends else ty for i, (t, ty) in enumerate(zip(tokens, types))]
        # An id outside the vocabulary is None: llama.cpp ignores it (checkpoint.gguf_special_id).
        unk_id, pad_id = gguf_special_id(get, "unknown"), gguf_special_id(get, "padding")
        if kind == "gpt2":
            backend, add_bos = _gpt2_backend(gf.path, get, tokens), False
            special_types = (_CONTROL,)
        else:
            scores = get("tokenizer.ggml.scores")
            if scores is None:
                raise CheckpointError(
                    f"{gf.path}: a SentencePiece vocabulary without tokenizer.ggml.scores: its merge order is unknown"
                )
            if len(scores) != len(tokens):
                raise CheckpointError(
                    f"{gf.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
                )
            # llama.cpp's defaults for a SentencePiece vocabulary: a space prefix and BOS.
            prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            backend, add_bos = spm_backend(tokens, scores, types, unk_id, prefix), True
            # llama.cpp matches UNKNOWN tokens in the text too (its special-token cache), as transformers does.
            special_types = (_CONTROL, _UNKNOWN)
        pre = get("tokenizer.ggml.pre")
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special_types]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        return cls(
            backend,
            bos_id=gguf_special_id(get, "bos"),
            eos_id=gguf_special_id(get, "eos"),
            chat_template=get("tokenizer.chat_template"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", add_bos or pre in _LLAMA3_PRE)),
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
            pad_id=pad_id,
            # The named tokens transformers' GGUF tokenizer has besides BOS/EOS (integrations/gguf).
            special_tokens={k: tokens[i] for k, i in (("unk_token", unk_id), ("pad_token", pad_id)) if i is not None},
            # llama.cpp ends generation at end-of-turn / end-of-message too (Llama-3's <|eot_id|>, <|eom_id|>), and
            # at every token spelled like one (checkpoint.GGUF_END_TEXTS), named in the metadata or not.
            extra_eos_ids=ends,
            chat_bos=True,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, config: dict | None = None) -> Tokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja``) in an HF directory."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise CheckpointError(f"{path}: no tokenizer.json")
        backend = _HFTokenizer.from_file(tj)
        # tokenizer.json may store truncation / padding, which the backend then applies to every encode (a
        # "max_length": 8 cut each prompt to 8 tokens); transformers turns both off unless a call asks for them.
        backend.no_truncation()
        backend.no_padding()
        tcfg = read_json(os.path.join(path, "tokenizer_config.json")) or {}
        template = tcfg.get("chat_template")
        template_error = None
        # Template files take priority over tokenizer_config.json's entry (transformers 5): chat_template.jinja is
        # the default, additional_chat_templates/NAME.jinja the named others.
        files = {}
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            files["default"] = os.path.join(path, "chat_template.jinja")
        extra = os.path.join(path, "additional_chat_templates")
        if os.path.isdir(extra):
            files |= {f.removesuffix(".jinja"): os.path.join(extra, f) for f in sorted(os.listdir(extra))
                      if f.endswith(".jinja")}  # fmt: skip
        if files:
            template = {}
            for name, file in files.items():
                with open(file, encoding="utf-8") as f:
                    template[name] = f.read()
            template = template["default"] if list(template) == ["default"] else template
        source = "the template files name" if files else "tokenizer_config.json names"
        if isinstance(template, list | dict):
            # Several named templates: transformers uses "tool_use" when tools are given and "default" otherwise,
            # and without a default refuses to render (the caller must pick); taking the first would chat in a
            # format nobody chose.
            template = _named_templates(template, path) if isinstance(template, list) else template
            if "default" not in template:
                template_error = (
                    f"{path}: {source} chat templates "
                    f"{sorted(template) if template else '(an empty list)'} and none of them 'default': "
                    "no chat template to use"
                )
        elif template is not None and not isinstance(template, str):
            raise CheckpointError(
                f"{path}: chat_template must be a string or a list of named templates, got {type(template).__name__}"
            )
        # transformers 5 (PreTrainedTokenizerBase._from_pretrained) reads special_tokens_map.json only for a
        # tokenizer_config.json without "added_tokens_decoder" (the legacy layout), and then its entries replace
        # tokenizer_config.json's; a tokenizer_config.json with one (what save_pretrained writes) is read alone.
        # An explicit null in either is "no such token", not a missing entry.
        stm = {} if "added_tokens_decoder" in tcfg else read_json(os.path.join(path, "special_tokens_map.json")) or {}

        def token_text(key):
            """The text of special token ``key`` the tokenizer files name (None: null or not named)."""
            where = "special_tokens_map.json" if key in stm else "tokenizer_config.json"
            tok = stm[key] if key in stm else tcfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if tok is not None and not isinstance(tok, str):
                raise CheckpointError(f"{path}: {key} of {where} must be a token string or null, got {tok!r}")
            return tok

        def token_id(key):
            where = "special_tokens_map.json" if key in stm else "tokenizer_config.json"
            if key not in stm and key not in tcfg:  # older repositories name their special tokens in config.json
                ids = hf_id_list(config, f"{key}_id", os.path.join(path, "config.json"))
                return ids[0] if ids else None
            tok = token_text(key)
            if tok is None:
                return None
            found = backend.token_to_id(tok)
            if found is None:
                raise CheckpointError(f"{path}: {key} {tok!r} of {where} is not in the vocabulary")
            return found

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        # transformers' generate stops at every id of generation_config.json (else config.json).
        extra_eos_ids = hf_id_list(config, "eos_token_id", os.path.join(path, "config.json")) + hf_id_list(
            read_json(gen := os.path.join(path, "generation_config.json")), "eos_token_id", gen
        )
        # BOS first / EOS last where tokenizer.json's post-processor puts them. transformers 5 drops
        # tokenizer_config.json's add_bos_token and add_eos_token when there is a tokenizer.json
        # (PreTrainedTokenizerBase._from_pretrained), so the post-processor alone decides; probed on one letter.
        canonical_eos = (end_token_ids([eos_id, *extra_eos_ids]) or (None,))[0]
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            chat_template=template,
            add_bos=bos_id is not None and full[:1] == [bos_id] and plain[:1] != [bos_id],
            add_eos=canonical_eos is not None and full[-1:] == [canonical_eos] and plain[-1:] != [canonical_eos],
            pad_id=token_id("pad_token"),
            extra_eos_ids=extra_eos_ids,
            template_error=template_error,
            # What the template sees as these (transformers' special_tokens_map): the files' texts, no fallback.
            special_tokens={k: token_text(k) for k in _SPECIAL_TOKEN_NAMES[2:]},
        )


def _gpt2_backend(path, get, tokens: list[str]) -> _HFTokenizer:
    """A gpt2-style byte-level BPE vocabulary (tokens + merges) split by its ``tokenizer.ggml.pre`` rules."""
    pre = get("tokenizer.ggml.pre")
    if pre is None:
        raise CheckpointError(
            f"{path}: no tokenizer.ggml.pre: llama.cpp would split the text with its 'default' rules, "
            f"which jspec does not implement (known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: unknown pre-tokenizer '{pre}' (known: {', '.join(sorted(_PRE_TOKENIZERS))})")
    merges = get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{path}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    backend = _HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            fuse_unk=False,
            ignore_merges=pre in _LLAMA3_PRE,
        )
    )
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _named_templates(entries: list, path: str) -> dict[str, str]:
    """tokenizer_config.json's ``[{"name": ..., "template": ...}, ...]`` -> {name: template}."""
    named = {}
    for t in entries:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
            raise CheckpointError(f"{path}: chat_template entry {t!r} is not {{'name': str, 'template': str}}")
        named[t["name"]] = t["template"]
    return named
