"""What the trainers share to make their data: the chat-formatted request, the target's answers through
``jspec.decode``, right-padded token rows, per-batch caches, and files written atomically (a run stopped while
writing one leaves no half file for the next run to read)."""

from __future__ import annotations

import json
import os

import numpy as np
from tqdm import tqdm

from jspec import decode as dec


def encode(tok, text: str, max_prompt: int, quiet: bool = False) -> list[int]:
    """The chat-formatted request, cut to its last ``max_prompt`` tokens (``--max-prompt``; said when it happens,
    unless ``quiet``): the end, the chat header of the answer, is kept when a request (a docstring) is long. 5 of the
    EAGLE trainer's 3358 templated requests are longer than its default 192 and lose their system turn."""
    ids = tok.encode_chat([{"role": "user", "content": text}])
    if len(ids) > max_prompt and not quiet:
        print(f"request of {len(ids)} tokens cut to its last {max_prompt} (--max-prompt): {text[:60]!r}...")
    return ids[-max_prompt:]


def answer(model, params, prompt_ids: list[list[int]], *, max_new: int, temperature, eos_ids, seed: int):
    """The target answers ``prompt_ids`` with ``jspec.decode`` (``temperature``: one, or one per row): (prompt +
    answer of each row, the number of generated tokens)."""
    out = dec.decode(
        model,
        params,
        prompt_ids,
        max_new_tokens=max_new,
        temperature=temperature,
        eos_ids=eos_ids,
        seed=seed,
    )
    return [list(p) + list(t) for p, t in zip(prompt_ids, out.tokens)], sum(out.stats["new_tokens"])


def right_pad(seqs: list[list[int]], width: int) -> np.ndarray:
    """[len(seqs), width] int32: each sequence from the left, zeros after it."""
    tokens = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
    return tokens


def save_npz(path: str, **arrays) -> None:
    """``np.savez`` to ``path``, written atomically."""
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)


def save_json(path: str, obj, **dump_kw) -> None:
    """``json.dump`` to ``path``, written atomically (a failed write leaves ``path.tmp``, never a half ``path``)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, **dump_kw)
    os.replace(path + ".tmp", path)


def cached_batches(data_dir: str, name: str, ids: list[int], desc: str, make, check=None) -> list[str]:
    """One npz per batch i, ``data_dir/<name>_<i:04d>.npz``; ``make(i, path)`` writes a missing one and returns
    its generated-token count (the progress bar's). Existing batches are kept, so a rerun resumes; ``check(i,
    path)``, if given, vets each one (raising SystemExit to refuse it)."""
    os.makedirs(data_dir, exist_ok=True)
    files = []
    bar = tqdm(ids, desc=desc, unit="batch")
    for i in bar:
        files.append(os.path.join(data_dir, f"{name}_{i:04d}.npz"))
        if not os.path.exists(files[-1]):
            bar.set_postfix(new_tokens=make(i, files[-1]))
        elif check is not None:
            check(i, files[-1])
    return files
