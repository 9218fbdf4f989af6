"""The EAGLE trainer's data (stages 1-2 of ``models.training.eagle``): the target's text and its features.

Three sources, each cached per file under ``${JSPEC_CACHE:-~/.cache/jspec}/eagle/_data/``: the target's answers to
the templated training prompts (``generate_data``, batch i answers prompts [i B, (i + 1) B)), its answers to
requests it wrote itself (``generate_self_data``), and off-policy text shipped with Python laid out as answers
(``generate_doc_data``). Each file holds tokens [B, W] (prompt + answer, right-padded), lengths, prompt lengths and
the target's final normed hidden f at every position [B, W, E] (float16); ``layer_files`` adds the ``--fuse``
layers' outputs next to each. ``load_windows`` cuts it all into the training windows.
"""

from __future__ import annotations

import hashlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jspec import decode as dec
from models import eagle as EG
from models import llama
from models.training.data import answer, cached_batches, encode, right_pad, save_npz
from models.training.prompts import (
    doc_answers,
    held_out_prompts,
    request_key,
    too_close,
    topic_answers,
)
from models.training.prompts import eagle_training_prompts as training_prompts


def feature_fn(cfg, layers: tuple[int, ...] = ()):
    """jit: (params, tokens [B, W]) -> f [B, W, E], the target's final normed hidden at every position, or with
    ``layers`` the outputs of those layers only [B, W, len(layers) E] (the fused head's extra features). The
    LM head runs on one token per row only (``logits_at``): its [B, W, V] logits would be ~20% of the work
    and, at W = 576, ~0.9 GB for 8 rows. params are an argument, never a baked-in constant."""

    @jax.jit
    def features(params, tokens):
        b, w = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
        cache = llama.init_cache(cfg, b, w)
        at = jnp.zeros((b,), jnp.int32)
        _, f, _ = llama.forward(cfg, params, tokens, pos, cache, return_hidden=True, logits_at=at, hidden_layers=layers)
        return f[..., : len(layers) * cfg.hidden] if layers else f

    return features


def as_float16(x, what: str) -> np.ndarray:
    """``x`` as the float16 the data files store, refusing values past its range (65504): a target whose
    residual stream runs that large would store inf and train the head on NaN losses with no other sign."""
    x = np.asarray(x)
    big = float(np.max(np.abs(x))) if x.size else 0.0
    if not np.isfinite(big) or big > float(np.finfo(np.float16).max):
        raise SystemExit(f"{what} reach {big:.4g}, past float16's range ({np.finfo(np.float16).max:g}): the data files "
                         "store features in float16, which would hold inf there")  # fmt: skip
    return x.astype(np.float16)


def _width(lengths, width: int) -> int:
    """The columns a feature pass computes: the longest row, rounded up to 32 (bounds the compiled shapes)."""
    return min(-(-int(max(lengths)) // 32) * 32, width)


# ---- the target's answers: templated and self-written requests ---------------------------------------------


def batch_ids(spec) -> list[int]:
    """``--gen-batches``: N (batches 0 .. N-1) or ranges and indices, e.g. '0-11,32-51'. Batch i answers
    training prompts [i * gen_batch, (i + 1) * gen_batch), so ranges pick which requests to spend the budget on
    (the STYLES requests start at batch 32) while the batches already cached stay usable."""
    if str(spec).strip().lower() == "none":  # only --self-batches (or the docstrings) as data
        return []
    if isinstance(spec, int) or str(spec).isdigit():
        n = int(spec)
        if n < 1:
            raise SystemExit(f"--gen-batches {spec}: at least one batch")
        return list(range(n))
    ids = set()
    for part in str(spec).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise SystemExit(f"--gen-batches {spec!r}: expected N or ranges like '0-11,32-51' (got {part!r})")
        ids.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(ids)


def data_dir(args) -> str:
    key = f"{args.model}-T{args.temperature:g}-p{args.max_prompt}-n{args.max_new}-b{args.gen_batch}-s{args.seed}"
    return os.path.join(EG.cache_root(), "_data", key)


def answer_batch(args, target, features, prompt_ids: list[list[int]], temp: float, seed: int, path: str, **extra):
    """The target answers ``prompt_ids`` (``--max-new`` tokens at ``temp``); tokens, lengths and its features
    go to ``path`` (written atomically, with ``extra`` arrays). Returns the number of generated tokens."""
    tok, cfg = target.tokenizer, target.config
    width = args.max_prompt + args.max_new
    seqs, new_tokens = answer(
        target.model, target.params, prompt_ids, max_new=args.max_new, temperature=temp, eos_ids=tok.eos_ids, seed=seed
    )
    tokens = right_pad(seqs, width)
    w = _width([len(s) for s in seqs], width)
    feats = np.zeros((len(seqs), width, cfg.hidden), np.float16)
    for r in range(0, len(seqs), args.feature_batch):  # [B, W, V] logits at once would take ~1 GB
        feats[r : r + args.feature_batch, :w] = as_float16(
            features(target.params, jnp.asarray(tokens[r : r + args.feature_batch, :w])), "target features"
        )
    save_npz(
        path,
        tokens=tokens,
        lengths=np.array([len(s) for s in seqs], np.int32),
        prompt_lengths=np.array([len(p) for p in prompt_ids], np.int32),
        feats=feats,
        temperature=np.float32(temp),
        **extra,
    )
    return new_tokens


def generate_data(args, target, data_dir: str) -> list[str]:
    """``--gen-batches``: one npz per batch of training prompts (``eagle_training_prompts``), greedy for even
    batches and ``--temperature`` for odd; the requests are stored in the npz (``prompts``). Existing batches
    are kept (a rerun resumes) once ``check_batch_prompts`` finds they answer this run's requests."""
    prompts = training_prompts(args.seed)
    ids = batch_ids(args.gen_batches)
    if ids and (ids[-1] + 1) * args.gen_batch > len(prompts):
        raise SystemExit(
            f"--gen-batches {args.gen_batches} x --gen-batch {args.gen_batch} asks for more than the "
            f"{len(prompts)} training prompts: lower one of them"
        )
    if not ids:
        return []
    features = feature_fn(target.config)

    def chunk(i):
        return prompts[i * args.gen_batch : (i + 1) * args.gen_batch]

    def make(i, path):
        prompt_ids = [encode(target.tokenizer, p, args.max_prompt) for p in chunk(i)]
        temp = 0.0 if i % 2 == 0 else args.temperature  # greedy and sampled text: both decoding modes
        return answer_batch(args, target, features, prompt_ids, temp, args.seed * 1000 + i, path, prompts=chunk(i))

    def check(i, path):
        check_batch_prompts(path, chunk(i), target.tokenizer, args.max_prompt)

    return cached_batches(data_dir, "batch", ids, "target text + features", make, check)


def check_batch_prompts(path: str, prompts: list[str], tok, max_prompt: int) -> None:
    """A cached ``batch_*`` file must answer the prompts this run puts in that batch, which depend on the Python
    version (``eagle_training_prompts`` shuffles the stdlib's docstring requests, whose number differs between
    versions, with the generator that then shuffles the rest). Compared on the requests the file stores
    (``prompts``), or, in a file written before they were stored, on its prompt tokens (``encode`` of this run's
    requests): a mismatch is refused naming the file, rather than training on a mix of two orders (some requests
    twice, others never)."""
    with np.load(path) as d:
        if "prompts" in d:
            theirs, mine = [str(t) for t in d["prompts"]], list(prompts)
        else:
            theirs = [d["tokens"][r, :n].tolist() for r, n in enumerate(d["prompt_lengths"])]
            mine = [encode(tok, p, max_prompt, quiet=True) for p in prompts]
    if theirs != mine:
        r = next((r for r, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
        here = repr(prompts[r][:60]) if r < len(prompts) else "none"
        raise SystemExit(
            f"{path} answers other requests than this run puts in that batch (row {r}: this run's is {here}; "
            f"{len(theirs)} rows there, {len(mine)} here). Which requests land in a batch depends on the Python "
            "version (its docstrings are among them) and the trainer's prompt lists: run the Python version that "
            f"wrote the folder's batches, or delete its batch_*.npz files to write them again ({os.path.dirname(path)})"
        )


def user_turn_prefix(tok) -> list[int]:
    """The chat template up to where a user's message starts (system turn + ``<|im_start|>user\\n``)."""
    mark = "\x00USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], False)
    return tok.encode(text[: text.index(mark)], add_bos=False, add_eos=False)  # a prefix: nothing appended


def self_prompts(target, batch: int, seed: int, held_out: list[str], max_len: int = 96) -> list[str]:
    """``batch`` user requests written by the target itself (Magpie, Xu et al. 2024): sampled at T = 1 from the
    chat template cut where a user message starts, so the requests follow the target's own idea of what users
    ask (far more kinds than our templates). Kept: finished within ``max_len`` tokens, at least four words,
    not a repeat, not ``too_close`` to a held-out prompt. Deterministic in ``seed``."""
    tok = target.tokenizer
    prefix = user_turn_prefix(tok)
    kept, seen = [], set()
    for attempt in range(8):
        out = dec.decode(
            target.model,
            target.params,
            [prefix] * (2 * batch),
            max_new_tokens=max_len,
            temperature=1.0,
            eos_ids=tok.eos_ids,
            seed=seed * 100 + attempt,
        )
        for t in out.tokens:
            if not t or t[-1] not in tok.eos_ids:
                continue  # ran past max_len: not a finished request
            text = tok.decode(t[:-1]).strip()
            key = request_key(text)
            if len(text.split()) < 4 or key in seen or too_close(text, held_out):
                continue
            seen.add(key)
            kept.append(text)
            if len(kept) == batch:
                return kept
    raise SystemExit(f"self-written prompts: only {len(kept)} of {batch} usable after 8 tries (seed {seed})")


def generate_self_data(args, target, data_dir: str) -> list[str]:
    """``--self-batches``: batch i answers ``--gen-batch`` requests the target wrote itself (``self_prompts``,
    seed i), greedy for even i and ``--temperature`` for odd; the requests are stored in the npz (``prompts``)."""
    if not args.self_batches:
        return []
    features = feature_fn(target.config)
    held_out = held_out_prompts()

    def make(i, path):
        texts = self_prompts(target, args.gen_batch, args.seed * 1000 + i, held_out)
        prompt_ids = [encode(target.tokenizer, p, args.max_prompt) for p in texts]
        temp = 0.0 if i % 2 == 0 else args.temperature
        seed = args.seed * 1000 + 500 + i
        return answer_batch(args, target, features, prompt_ids, temp, seed, path, prompts=texts)

    files = cached_batches(data_dir, "self", list(range(args.self_batches)), "self-written prompts", make)
    check_cached_prompts(files, held_out)
    return files


def check_cached_prompts(files: list[str], held_out: list[str]) -> None:
    """Batches written before a held-out prompt was added may restate it: the check made when a batch is
    written runs again on every cached one, and a hit is refused naming the file."""
    for path in files:
        with np.load(path) as d:
            texts = [str(t) for t in d["prompts"]] if "prompts" in d else []
        close = [t for t in texts if too_close(t, held_out)]
        if close:
            raise SystemExit(
                f"{path}: its request {close[0]!r} is too close to a held-out prompt (added after the batch was "
                "written): delete the file to write it again"
            )


# ---- text shipped with Python, laid out as answers ---------------------------------------------------------


def generate_doc_data(args, target, data_dir: str) -> list[str]:
    """Off-policy real text, cheap: stdlib docstrings, then the reference manual's topics, laid out as
    assistant answers of a chat, ~``--doc-tokens`` tokens; only a target forward per token (no generation),
    features stored like ``generate_data``. The loss is distillation (the target's own distribution at every
    position), so the head learns the target's feature dynamics on this text, not the text. The docstrings come
    first in the same order as before the topics were added, so cached files stay valid."""
    if args.doc_tokens <= 0:
        return []
    os.makedirs(data_dir, exist_ok=True)
    tok, cfg = target.tokenizer, target.config
    width = args.doc_width
    rng = np.random.default_rng(args.seed)
    pairs = doc_answers()
    rng.shuffle(pairs)
    extra = topic_answers()
    rng.shuffle(extra)
    pairs += extra

    features = feature_fn(cfg)

    rows_per_file = args.feature_batch * 4
    n_files = -(-args.doc_tokens // (rows_per_file * width))
    if n_files * rows_per_file > len(pairs):
        raise SystemExit(
            f"--doc-tokens {args.doc_tokens} needs {n_files} files of {rows_per_file} passages ({width} tokens "
            f"each at most), more than the {len(pairs)} passages of text shipped with Python: lower it"
        )
    files, it, full_lengths = [], iter(pairs), []
    bar = tqdm(range(n_files), desc="docstring features", unit="file")
    for i in bar:
        path = os.path.join(data_dir, f"docs_{i:04d}.npz")
        files.append(path)
        seqs, plens = [], []
        while len(seqs) < rows_per_file:
            q, doc = next(it)
            user = [{"role": "user", "content": q}]
            prompt = tok.encode_chat(user)
            full = tok.encode_chat(user + [{"role": "assistant", "content": doc}], add_generation_prompt=False)
            seqs.append(full[:width])
            plens.append(len(prompt))
            full_lengths.append(len(full))
        if os.path.exists(path):  # the prompts above were still consumed: later files stay the same
            with np.load(path) as d:  # ... if the cached file holds as many passages as this run puts in one
                cached = [np.asarray(t[:n]).tolist() for t, n in zip(d["tokens"], d["lengths"])]
            if cached != seqs:
                raise SystemExit(
                    f"{path} holds other passages than this run would put there ({len(cached)} rows; this run "
                    f"writes {rows_per_file} per file, from --feature-batch {args.feature_batch}): use the "
                    "--feature-batch that wrote it, or delete the folder"
                )
            continue
        tokens = right_pad(seqs, width)
        feats = np.zeros((len(seqs), width, cfg.hidden), np.float16)
        for r in range(0, len(seqs), args.feature_batch):
            feats[r : r + args.feature_batch] = as_float16(
                features(target.params, jnp.asarray(tokens[r : r + args.feature_batch])), "target features"
            )
        save_npz(
            path,
            tokens=tokens,
            lengths=np.array([len(sq) for sq in seqs], np.int32),
            prompt_lengths=np.array(plens, np.int32),
            feats=feats,
            temperature=np.float32(-1),
        )
    note = cut_note(full_lengths, width)
    if note:
        print(note)
    return files


def cut_note(lengths: list[int], width: int) -> str | None:
    """What ``generate_doc_data`` cut: a passage (request + text, chat-formatted) longer than ``--doc-width``
    tokens keeps its first ``width`` (its end is never trained on). None when nothing was cut."""
    cut = [n for n in lengths if n > width]
    if not cut:
        return None
    return (
        f"docstring data: {len(cut)} of {len(lengths)} passages are longer than --doc-width {width} tokens (up to "
        f"{max(cut)}) and were cut to it: {sum(n - width for n in cut)} of the passages' {sum(lengths)} tokens are "
        "not trained on"
    )


# ---- the fused head's extra features, and the training windows --------------------------------------------


def tokens_digest(tokens: np.ndarray, lengths: np.ndarray) -> str:
    """sha256 of a data file's tokens and lengths (their dtypes and shapes included): what its layer file was
    computed from."""
    h = hashlib.sha256()
    for a in (np.ascontiguousarray(tokens), np.ascontiguousarray(lengths)):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def layer_files(args, target, files: list[str]) -> list[str]:
    """Next to each data file, the outputs of the ``--fuse`` layers [B, W, len(fuse) E] float16, computed from
    its tokens (one target pass; the generated text is not regenerated), cached per layer set. A layer file
    records the ``tokens_digest`` of the tokens it was computed from; one whose data file was written again since
    (a deleted batch regenerated), or made before the digest was recorded, is computed again."""
    if not args.fuse:
        return []
    features = feature_fn(target.config, args.fuse)
    tag = "-".join(str(i) for i in args.fuse)
    out = []
    for f in tqdm(files, desc=f"layer {tag} features", unit="file"):
        path = f"{f[:-4]}.layers{tag}.npz"
        out.append(path)
        with np.load(f) as d:
            tokens, lengths = d["tokens"], d["lengths"]
        digest = tokens_digest(tokens, lengths)
        if os.path.exists(path):
            with np.load(path) as d:
                stored = str(d["digest"]) if "digest" in d else None
            if stored == digest:
                continue
            if stored:
                tqdm.write(f"{path}: computed from other tokens than {f} holds now (written again): computing it again")
            else:
                tqdm.write(f"{path}: made before layer files recorded their data file's tokens: computing it again")
        w = _width(lengths, tokens.shape[1])
        lf = np.zeros(tokens.shape + (len(args.fuse) * target.config.hidden,), np.float16)
        for r in range(0, tokens.shape[0], args.feature_batch):
            out_r = features(target.params, jnp.asarray(tokens[r : r + args.feature_batch, :w]))
            lf[r : r + args.feature_batch, :w] = as_float16(out_r, f"the outputs of layers {tag}")
        save_npz(path, layer_feats=lf, digest=np.asarray(digest))
    return out


def load_windows(files: list[str], window: int, prompt_loss: bool, layers: list[str] | None = None):
    """Cut every sequence into windows of ``window`` pairs. Pair i of a window is (f_i, x_{i+1}) and its
    targets f_{i+1}, x_{i+2}: a window holds window + 1 tokens/features. Returns dict of arrays
    feats [M, w+1, R] float16 (R = E, or with ``layers``, the ``layer_files`` of ``files``, the fused layers'
    outputs then f: the head's raw features), tokens [M, w+1], mask [M, w] (pair i is trained), answer [M, w]
    (pair i is one the drafter meets when decoding: i >= P - 1, its x_{i+2} a token of the answer after the
    first, which the target samples at prefill) plus the answers."""
    feats, tokens, masks, in_answer, answers = [], [], [], [], []
    for fi, f in enumerate(files):
        d = dict(np.load(f))
        if layers:
            d["feats"] = np.concatenate([np.load(layers[fi])["layer_feats"], d["feats"]], axis=-1)
        for r in range(d["tokens"].shape[0]):
            n, p = int(d["lengths"][r]), int(d["prompt_lengths"][r])
            answers.append(d["tokens"][r, p:n])
            # Windows start at pair p-2, which predicts f_{p-1}: the prompt's last feature, from which the prefill
            # samples the answer's first token (never drafted, so that pair is left out of the loss: ``answer``).
            first = 0 if prompt_loss else max(p - 2, 0)
            for s in range(first, n - 1, window):
                e = min(s + window + 1, n)
                if e - s < 3:
                    continue
                tk = np.zeros(window + 1, np.int32)
                ft = np.zeros((window + 1, d["feats"].shape[2]), np.float16)
                tk[: e - s], ft[: e - s] = d["tokens"][r, s:e], d["feats"][r, s:e]
                m = np.zeros(window, bool)
                m[: e - s - 1] = True  # pair i needs x_{i+1} and f_{i+1} (whose LM head gives the CE target)
                tokens.append(tk)
                feats.append(ft)
                masks.append(m)
                in_answer.append(m & (s + np.arange(window) >= p - 1))
    data = {"feats": np.stack(feats), "tokens": np.stack(tokens), "mask": np.stack(masks)}
    return {**data, "answer": np.stack(in_answer)}, answers
