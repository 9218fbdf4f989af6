"""Teacher-forced agreement of EAGLE heads on the same held-out greedy answers, paired: what position-1
acceptance tracks, on twice the answers of train_eagle.py's 6-prompt evaluation, every head on the same pairs.

The target answers the 12 held-out prompts (``models.training.prompts.held_out_prompts``: train_eagle.py's
evaluation prompts and bench_eagle.py's) greedily once; every head then runs ``models.eagle.head_unrolled`` over
prompt + answer (the training computation, 3 passes of training-time test) and each pass's argmax is compared
with the answer's token x_{i+2}. ``--maps-from DIR --self-batches N`` also scores each head under the
``--head-tokens`` most frequent tokens of the answers in the first N self-written batches of train_eagle's data
directory DIR (how ``train_eagle.py --remap --self-batches N`` builds its map): a head's LM head is the target's
tied rows, so a map swaps without retraining.

    python examples/eagle_agreement.py --heads MP3_DIR,smollm2-8k-chat-mp5 \\
        --maps-from ~/.cache/jspec/eagle/_data/smollm2-T0.8-p192-n384-b32-s0 --self-batches 24
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

from jspec import decode as dec
from models import eagle as EG
from models import registry
from models.training.data import encode
from models.training.eagle_eval import teacher_forced_hits
from models.training.prompts import held_out_prompts


def data_map(data_dir: str, batches: int, n: int, vocab_size: int, eos_ids) -> np.ndarray:
    if batches < 1:
        raise SystemExit(f"--maps-from {data_dir}: --self-batches {batches} reads no answers to build a map from")
    files = [os.path.join(os.path.expanduser(data_dir), f"self_{i:04d}.npz") for i in range(batches)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"--maps-from {data_dir} --self-batches {batches}: {len(missing)} missing, e.g. {missing[0]}")
    answers = []
    for f in files:
        d = np.load(f)
        for r in range(d["tokens"].shape[0]):
            answers.append(d["tokens"][r, int(d["prompt_lengths"][r]) : int(d["lengths"][r])])
    return EG.frequent_tokens(EG.token_counts(answers, vocab_size), n, always=list(eos_ids))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default=EG.DEFAULT_HEAD, help="comma-separated head names or directories")
    ap.add_argument("--maps-from", default="", help="train_eagle data directory to build a token map from")
    ap.add_argument(
        "--self-batches", type=int, default=None, help="its first N self-written batches make the map (default 24)"
    )
    ap.add_argument("--head-tokens", type=int, default=None, help="tokens in that map (default 8192)")
    ap.add_argument("--max-new", type=int, default=192)
    args = ap.parse_args(argv)
    if not args.maps_from:  # both only shape the --maps-from map
        for flag, value in (("--self-batches", args.self_batches), ("--head-tokens", args.head_tokens)):
            if value is not None:
                ap.error(f"{flag} {value} applies to the map built by --maps-from DIR, which is not given")
    args.self_batches = 24 if args.self_batches is None else args.self_batches
    args.head_tokens = 8192 if args.head_tokens is None else args.head_tokens
    for flag, value in (("--self-batches", args.self_batches), ("--head-tokens", args.head_tokens)):
        if value < 1:
            ap.error(f"{flag} {value}: must be >= 1")

    target = registry.load("smollm2", dtype="float32")
    tok, cfg = target.tokenizer, target.config
    new_map = None
    if args.maps_from:
        new_map = data_map(args.maps_from, args.self_batches, args.head_tokens, cfg.vocab_size, tok.eos_ids)
    prompts = [encode(tok, p, 512) for p in held_out_prompts()]  # the EAGLE trainer's evaluation + the benchmark's
    out = dec.decode(
        target.model, target.params, prompts, max_new_tokens=args.max_new, temperature=0.0, eos_ids=tok.eos_ids
    )
    first = None
    for head in filter(None, args.heads.split(",")):
        ecfg, hp = EG.restore_head(EG.resolve_head(head), cfg)
        maps = {"own map": np.asarray(hp["token_ids"])}
        if new_map is not None:
            maps["data map"] = new_map
        for label, ids in maps.items():
            _, hp_map = EG.EagleDrafter(ecfg).draft_params(target.params, {**hp, "token_ids": jnp.asarray(ids)})
            h = teacher_forced_hits(target, ecfg, hp_map, prompts, out.tokens)
            cover = float(np.isin(np.concatenate(out.tokens), ids).mean())
            line = f"{head} ({label}, answers {cover:.1%} inside): passes 0-2 {np.round(h.mean(1), 4).tolist()}"
            if first is None:
                first = h[0]
            else:
                line += f"; pass 0 vs the first: {int(np.sum(h[0] & ~first))} gained, {int(np.sum(first & ~h[0]))} lost"
            print(line + f" (n={h.shape[1]})", flush=True)


if __name__ == "__main__":
    main()
