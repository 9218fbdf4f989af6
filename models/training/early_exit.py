"""Train an exit adapter for LayerSkip self-speculation on SmolLM2-135M (the target stays frozen), then
measure the draft acceptance with and without it.

    python examples/train_early_exit.py                  # E=4, F=512, 8192-row draft head, 300 steps
    python examples/train_early_exit.py --exit-layer 8 --width 1024 --steps 400 --force

1. Data: the target itself writes the text. Chat prompts plus prompts built from the Python standard library's
   own docstrings (no downloads; both in ``models.training.prompts``) go through ``jspec.decode`` (half greedy,
   half sampled at T=0.7); prompt + answer are the training sequences (~13k tokens at the defaults). The text
   is cached in ``${JSPEC_CACHE:-~/.cache/jspec}/early_exit/data-*.json`` (named by the prompts, the tokens per
   prompt and ``--gen-batch``, on which it depends) and shared by every E (delete it to regenerate).
2. Split: the sequences are shuffled (``--seed``) and the last whole ones, the fewest that hold a tenth of the
   tokens (256 at least), are held out; no sequence is split between the two sides. Draft head rows: the N
   most frequent tokens of the training sequences and of the stdlib docstrings outside the held-out prompts
   (ties and the remainder in BPE merge order, which roughly follows frequency), EOS always included.
3. Features, once: the hidden state after layer E of every token, and the full model's next-token
   distribution restricted to those N tokens (its top 64, renormalised). The early-exit loss is the
   cross-entropy from that teacher to exit head(adapter(h_E)). The adapter has no attention, so tokens are
   independent training examples and each step samples a batch of them.
4. optax AdamW with warm-up + cosine decay, a tqdm bar, resumable ``ocp.CheckpointManager`` checkpoints
   (features and checkpoints live in ``<result>.work/`` until training ends); the result goes to
   ``${JSPEC_CACHE:-~/.cache/jspec}/early_exit/smollm2-E{E}-F{F}-N{N}/`` (orbax, ~3.5 MB) and training is
   skipped when it is already there (``--force`` retrains from scratch, reusing the cached text). The settings
   are recorded (``args.json`` in the work directory, ``args`` in the result's meta.json): a rerun with other
   settings (steps, lr, batch, seed, data, ...) is refused, naming them, instead of resuming that run's
   features and checkpoints or reusing its result.
5. Evaluation on held-out chat prompts through ``jspec.decode`` (K=4, greedy and T=1): acceptance with and
   without the adapter, same head rows; greedy outputs are checked against plain decoding.

Why E=4, F=512 (measured with this data, 300 steps, held-out tokens, greedy agreement of the exit with the
full model): without an adapter the early exit is nearly useless at any depth (E=4: 4%, E=8: 3%, E=12: 6%,
E=16: 9%, E=20: 14%); with it, E=4: 36%, E=8: 37%, E=12: 39%, E=16: 41%, E=20: 51%; at E=4 the width hardly
matters (F=512: 36.0%, 1024: 36.5%, 2048: 35.9%). A draft step at E=4 reads ~4 layers + 0.9M adapter + the
8k-row head, about 0.15 of a target step, and acceptance barely improves until E is several times larger.

Cost: ~9 CPU-minutes with data generation, ~4.5 without (cached text), i.e. ~4-5 minutes of wall time on two
free cores; it took 13-20 minutes while other jobs kept the 2-core machine at a load average of 12-14.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jspec.cost_model import survival_from_stats
from jspec.decode import decode
from models import llama
from models.layerskip import (
    LayerSkipDrafter,
    apply_adapter,
    default_cache_dir,
    exit_cache_path,
    head_rows,
    init_adapter,
    load_exit_meta,
    restore_exit_params,
    run_layer_range,
    save_exit_params,
)
from models.registry import load
from models.training import runs
from models.training.data import answer, save_json, save_npz
from models.training.prompts import EARLY_EXIT_EVAL_CHATS, early_exit_prompt_texts

TEACHER_TOP = 64  # the teacher's top tokens over the head rows kept per position (make_features)


def build_prompts(tok, n_doc: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    texts, paras = early_exit_prompt_texts(n_doc, seed)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts], paras


def generate_data(cfg, params, model, tok, n_doc: int, new_tokens: int, batch: int) -> list[list[int]]:
    """Prompt + target-written answer for each prompt: rows alternate greedy and T=0.7 sampling."""
    prompts, _ = build_prompts(tok, n_doc)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a compilation
    seqs = [None] * len(prompts)
    for start in tqdm(range(0, len(order), batch), desc="generating", unit="batch"):
        idx = order[start : start + batch]
        rows, _ = answer(
            model,
            params,
            [prompts[i] for i in idx],
            max_new=new_tokens,
            temperature=[0.0 if i % 2 == 0 else 0.7 for i in idx],
            eos_ids=cfg.eos_ids,
            seed=start,
        )
        for i, seq in zip(idx, rows):
            seqs[i] = seq
    return seqs


def frequent_tokens(tok, seqs: list[list[int]], paras: list[str], n: int, eos_id, vocab: int) -> np.ndarray:
    """[N] sorted token ids: the most frequent in ``seqs`` and ``paras`` (give it training text only), the end
    tokens ``eos_id`` (one id or several; decoding stops at any, so each must be proposable) forced in, the rest
    filled in BPE merge order (low ids first)."""
    counts = np.zeros((vocab,), np.int64)
    for s in seqs:
        np.add.at(counts, np.asarray(s), 1)
    for p in paras:
        np.add.at(counts, np.asarray(tok.encode(p), np.int64), 1)
    ends = [] if eos_id is None else np.atleast_1d(np.asarray(eos_id, np.int64))
    counts[ends] = counts.max() + 1
    # lexsort: primary key -count, ties by id (merge order), so unseen tokens come in id order.
    order = np.lexsort((np.arange(vocab), -counts))
    return np.sort(order[:n]).astype(np.int32)


def heldout_split(lengths: list[int], min_tokens: int = 256) -> int:
    """How many leading sequences are trained on. ``lengths``: the training tokens of each sequence, in order
    (positions with a next token). The held-out part is the last whole sequences, the fewest that hold
    ``max(min_tokens, total // 10)`` tokens, with at least one sequence left for training: a cut at a token
    count would put the start of one sequence in training and its end in the held-out tokens."""
    if len(lengths) < 2:
        raise ValueError(f"{len(lengths)} sequence(s): a held-out split needs two at least")
    want = max(min_tokens, sum(lengths) // 10)
    n, held = len(lengths), 0
    while n > 1 and held < want:
        n -= 1
        held += lengths[n]
    return n


def training_paragraphs(paras: list[str], heldout_texts: list[str]) -> list[str]:
    """The stdlib paragraphs that no held-out prompt quotes (those are held-out text)."""
    return [p for p in paras if not any(p in t for t in heldout_texts)]


def split_and_head_rows(tok, seqs, texts, paras, n_head: int, eos_id: int, vocab: int, min_tokens: int = 256):
    """(number of training sequences, head rows [N]) for sequences in their final order (``texts``: the prompt
    text of each): held out are the last whole sequences (``heldout_split``), and the head rows are counted
    on the training sequences and the paragraphs outside the held-out prompts only."""
    n_train = heldout_split([len(s) - 1 for s in seqs], min_tokens)
    ids = frequent_tokens(tok, seqs[:n_train], training_paragraphs(paras, texts[n_train:]), n_head, eos_id, vocab)
    return n_train, ids


def make_features(cfg, params, seqs, ids, exit_layer: int, top: int = TEACHER_TOP, batch: int = 4):
    """Per token (every position that has a next token): h_E [M, Dm], teacher top-``top`` over the head rows
    (indices into ``ids`` and renormalised probabilities), full-vocabulary argmax, and the full model's
    probability of those top tokens (for the T=1 acceptance estimate)."""
    width = max(len(s) for s in seqs)
    width = -(-width // 32) * 32
    sub_ids = jnp.asarray(ids)

    @jax.jit
    def feats(params, sub_ids, tokens):  # [B, T]; params are arguments, not constants folded into the program
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        cache = llama.init_cache(cfg, b, t)
        h = llama.embed(cfg, params, tokens)
        h_e, cache = run_layer_range(cfg, params, h, pos, cache, 0, exit_layer)
        h_l, _ = run_layer_range(cfg, params, h_e, pos, cache, exit_layer, cfg.num_layers)
        logits = llama.head(cfg, params, h_l)  # [B, T, V]
        p_full = jax.nn.softmax(logits, axis=-1)
        p_sub = jax.nn.softmax(logits[..., sub_ids], axis=-1)
        top_p, top_i = jax.lax.top_k(p_sub, top)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        p_full_top = jnp.take_along_axis(p_full[..., sub_ids], top_i, axis=-1)
        return h_e, top_i.astype(jnp.int32), top_p, jnp.argmax(logits, -1).astype(jnp.int32), p_full_top

    outs = []
    for start in tqdm(range(0, len(seqs), batch), desc="teacher features", unit="batch"):
        chunk = seqs[start : start + batch]
        arr = np.zeros((len(chunk), width), np.int32)
        for i, s in enumerate(chunk):
            arr[i, : len(s)] = s
        res = jax.device_get(feats(params, sub_ids, jnp.asarray(arr)))
        for i, s in enumerate(chunk):
            n = len(s) - 1  # the last token has no next token to predict
            outs.append(tuple(r[i, :n] for r in res))
    return [np.concatenate([o[j] for o in outs]) for j in range(5)], [len(s) - 1 for s in seqs]


def exit_head_logits(cfg, params, head, adapter, h):  # h [M, Dm] -> logits over the head rows [M, N]
    if adapter is not None:
        h = apply_adapter(cfg, adapter, h[:, None])[:, 0]
    hn = llama.final_norm(cfg, params, h[:, None])[:, 0]
    return hn @ head.T


def train(args, cfg, params, feats, ids, ckpt_dir, n_val: int) -> dict:
    h_e, top_i, top_p, _, _ = feats
    m = h_e.shape[0]
    # The last n_val tokens are held out: whole sequences (``heldout_split``).
    train_idx = np.arange(m - n_val)
    head = head_rows(cfg, params, jnp.asarray(ids))
    tx = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 10), args.steps, args.lr * 0.05),
        weight_decay=0.0,
    )
    adapter = init_adapter(cfg, jax.random.key(args.seed), args.width)
    opt_state = tx.init(adapter)
    data = tuple(jnp.asarray(x) for x in (h_e, top_i, top_p))

    norm = {"final_norm": params["final_norm"]}

    def loss_fn(adapter, norm, head, h, ti, tp):
        logq = jax.nn.log_softmax(exit_head_logits(cfg, norm, head, adapter, h), axis=-1)
        return -jnp.mean(jnp.sum(tp * jnp.take_along_axis(logq, ti, axis=-1), axis=-1))

    @jax.jit
    def step(adapter, opt_state, i, norm, head, data):
        pick = jax.random.choice(jax.random.fold_in(jax.random.key(args.seed + 1), i), len(train_idx), (args.batch,))
        h, ti, tp = (x[pick] for x in data)
        loss, grads = jax.value_and_grad(loss_fn)(adapter, norm, head, h, ti, tp)
        updates, opt_state = tx.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss

    mngr = ocp.CheckpointManager(
        os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=50)
    )
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        state = mngr.restore(start, args=ocp.args.StandardRestore({"adapter": adapter, "opt": opt_state}))
        adapter, opt_state = state["adapter"], state["opt"]
        print(f"resuming from the checkpoint at step {start}")
    bar = tqdm(range(start, args.steps), desc="training", unit="step", initial=start, total=args.steps)
    loss = None
    for i in bar:
        adapter, opt_state, loss = step(adapter, opt_state, jnp.int32(i), norm, head, data)
        if (i + 1) % 25 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
        mngr.save(i + 1, args=ocp.args.StandardSave({"adapter": adapter, "opt": opt_state}))
    mngr.wait_until_finished()
    mngr.close()
    return adapter


def token_metrics(cfg, params, feats, ids, adapter, n_val: int) -> dict:
    """On held-out tokens: greedy agreement (exit argmax == the full model's argmax) and the T=1 acceptance
    estimate sum_x min(p(x), q(x)) over the teacher's top tokens (a lower bound)."""
    h_e, top_i, _, full_arg, p_full_top = (x[-n_val:] for x in feats)
    head = head_rows(cfg, params, jnp.asarray(ids))
    norm = {"final_norm": params["final_norm"]}
    f = jax.jit(lambda a, norm, head, h: jax.nn.softmax(exit_head_logits(cfg, norm, head, a, h), axis=-1))
    q = np.concatenate(
        [np.asarray(f(adapter, norm, head, jnp.asarray(h_e[i : i + 512]))) for i in range(0, n_val, 512)]
    )
    greedy = float(np.mean(ids[q.argmax(-1)] == full_arg))
    q_top = np.take_along_axis(q, top_i, axis=-1)
    return {"greedy_agree": greedy, "t1_accept_lb": float(np.mean(np.minimum(q_top, p_full_top).sum(-1)))}


def evaluate(cfg, params, model, tok, exit_layer, ex_params, k: int, new_tokens: int) -> dict:
    """Acceptance on the held-out chats through jspec.decode, with and without the adapter."""
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in EARLY_EXIT_EVAL_CHATS]
    results = {}
    head = {"token_ids": ex_params["token_ids"]} if "token_ids" in ex_params else {}
    n_head = len(ex_params["token_ids"]) if head else 0
    plain = decode(model, params, prompts, max_new_tokens=new_tokens, eos_ids=cfg.eos_ids, max_len=256)
    for use_adapter in (False, True):
        drafter = LayerSkipDrafter(cfg, exit_layer, adapter=use_adapter, head_tokens=n_head, max_draft=k)
        ex = dict(head, adapter=ex_params["adapter"]) if use_adapter else head
        dparams = drafter.draft_params(params, ex)
        for temp in (0.0, 1.0):
            out = decode(
                model,
                params,
                prompts,
                drafter=drafter,
                draft_params=dparams,
                gamma=k,
                max_new_tokens=new_tokens,
                temperature=temp,
                eos_ids=cfg.eos_ids,
                seed=1,
                max_len=256,
            )
            if temp == 0.0:
                assert out.tokens == plain.tokens, "greedy self-speculation must reproduce plain greedy decoding"
            s = out.stats
            name = f"{'adapter' if use_adapter else 'no adapter'}, T={temp:g}"
            results[name] = {
                "acceptance_rate": s["acceptance_rate"],
                "tokens_per_round": s["tokens_per_round"],
                "survival_at": [round(float(x), 3) for x in survival_from_stats(s["accepted_at"], s["proposed_at"])],
            }
    return results


@dataclasses.dataclass(frozen=True)
class Args:
    """The trainer's flags as ``parse_args`` returns them (same names; ``parser`` documents them and holds the
    defaults: start from ``parse_args([])`` and ``dataclasses.replace`` what differs)."""

    model: str
    exit_layer: int
    width: int
    head_tokens: int
    steps: int
    batch: int
    lr: float
    seed: int
    doc_prompts: int
    new_tokens: int
    gen_batch: int
    eval_k: int
    eval_new_tokens: int
    no_eval: bool
    force: bool


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--exit-layer", type=int, default=4, help="E: the draft runs layers [0, E)")
    ap.add_argument("--width", type=int, default=512, help="F: the adapter's inner width")
    ap.add_argument("--head-tokens", type=int, default=8192, help="N draft head rows (0 = the full head)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=512, help="tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--doc-prompts", type=int, default=36, help="prompts built from stdlib docstrings")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens the target writes per prompt")
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--force", action="store_true", help="retrain from scratch even if the result is cached")
    return ap


def parse_args(argv=None) -> Args:
    ap = parser()
    args = ap.parse_args(argv)
    # Counts that would fail (or train nothing) only after the text was generated: refused here. The exit
    # layer's upper bound is the model's (check_model_bounds).
    for flag, low in (
        ("exit_layer", 1),
        ("width", 1),
        ("head_tokens", 0),
        ("steps", 1),
        ("batch", 1),
        ("doc_prompts", 0),
        ("new_tokens", 1),
        ("gen_batch", 1),
        ("eval_k", 1),
        ("eval_new_tokens", 1),
    ):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected {low} or more")
    if 0 < args.head_tokens < TEACHER_TOP:
        ap.error(
            f"--head-tokens {args.head_tokens}: expected 0 (the full head) or {TEACHER_TOP} or more (the teacher "
            f"keeps its top {TEACHER_TOP} over the head rows)"
        )
    return Args(**vars(args))


def check_model_bounds(args, cfg) -> None:
    """What needs the loaded model: the exit layer E (the draft runs layers [0, E), the full model more) and the
    head rows (at most the vocabulary). SystemExit naming the flag."""
    if not 1 <= args.exit_layer < cfg.num_layers:
        raise SystemExit(
            f"--exit-layer {args.exit_layer}: expected 1 to {cfg.num_layers - 1} ({args.model} has "
            f"{cfg.num_layers} layers; the draft runs the first E)"
        )
    if args.head_tokens > cfg.vocab_size:
        raise SystemExit(f"--head-tokens {args.head_tokens}: {args.model}'s vocabulary has {cfg.vocab_size} tokens")


# Arguments that do not change the trained adapter (they only evaluate it, or start over).
_NOT_TRAINING = frozenset({"eval_k", "eval_new_tokens", "no_eval", "force"})
_FORCE = "pass --force to retrain from scratch (the cached text is kept)"


def training_settings(args) -> dict:
    return runs.settings(vars(args), _NOT_TRAINING)


def saved_state(out_dir: str, work: str) -> bool:
    """Whether a result, or features or checkpoints of a run, are saved (what ``check_same_run`` compares)."""
    return (
        os.path.isfile(os.path.join(out_dir, "meta.json"))
        or os.path.isfile(os.path.join(work, "features.npz"))
        or runs.has_checkpoint(os.path.join(work, "ckpt"))
    )


def data_file(args) -> str:
    """The cached text: it does not depend on E or the adapter (one file serves every configuration), but on the
    prompts, the tokens written per prompt and the generation batch (rows of a batch share its padding, its
    seed and its order)."""
    name = f"data-{args.model}-d{args.doc_prompts}-n{args.new_tokens}-b{args.gen_batch}.json"
    return os.path.join(default_cache_dir(), name)


def cached_text(args, cfg, params, model, tok) -> list[list[int]]:
    """The sequences of ``data_file``, generated (``generate_data``) and written atomically when missing: a run
    stopped while writing it leaves no half file for the next to read."""
    path = data_file(args)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    seqs = generate_data(cfg, params, model, tok, args.doc_prompts, args.new_tokens, args.gen_batch)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_json(path, seqs)
    return seqs


def check_same_run(args, out_dir: str, work: str) -> None:
    """The result under ``out_dir`` (its path names model, E, F and N; ``meta.json`` records the rest), or the
    features and checkpoints under ``work``, made with other settings are refused by name: the result would be
    evaluated as this run's, the checkpoints resumed on another schedule, the features reused for other data.
    With neither, this run's settings are recorded in ``work/args.json``."""
    mine = training_settings(args)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        # Made before the settings were recorded: its meta.json still names the schedule and the adapter width.
        theirs = meta.get("args") or dict(
            {k: meta[k] for k in ("model", "exit_layer", "steps", "batch", "lr") if k in meta},
            **({"width": meta["adapter_width"]} if "adapter_width" in meta else {}),
        )
        holder = f"{out_dir} holds an exit adapter trained"
        runs.refuse_if_different(theirs, mine, holder, f"rerun with those, or {_FORCE}")
        return

    def unrecorded():  # features or checkpoints of a run made before the settings were recorded
        raise SystemExit(
            f"{work} holds features or checkpoints of a run whose settings were not recorded (its head rows were "
            f"counted another way): {_FORCE}"
        )

    saved = os.path.isfile(os.path.join(work, "features.npz")) or runs.has_checkpoint(os.path.join(work, "ckpt"))
    runs.check_same_run(
        mine,
        os.path.join(work, "args.json"),
        saved,
        holder=f"{work} holds features or checkpoints of a run made",
        remedy=f"rerun with those, or {_FORCE}",
        unrecorded=unrecorded,
    )


def run(args: Args) -> None:
    """Train (or reuse, or resume) the exit adapter ``args`` describe and evaluate it."""
    t0 = time.perf_counter()
    out_dir = exit_cache_path(args.model, args.exit_layer, args.width, args.head_tokens)
    work = out_dir + ".work"
    if args.force:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if saved_state(out_dir, work):
        check_same_run(args, out_dir, work)  # before the model loads: a refusal costs nothing
    cfg, params, model, tok = load(args.model, dtype="float32")
    check_model_bounds(args, cfg)  # before this run's settings are recorded, and before any text is generated
    check_same_run(args, out_dir, work)  # records them where nothing is saved
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        print(f"cached: {out_dir} (--force retrains)")
        ex_params = restore_exit_params(out_dir, cfg)
        meta = load_exit_meta(out_dir)
    else:
        os.makedirs(work, exist_ok=True)
        seqs = cached_text(args, cfg, params, model, tok)
        texts, paras = early_exit_prompt_texts(args.doc_prompts)
        if len(texts) != len(seqs):
            raise SystemExit(
                f"{data_file(args)} holds {len(seqs)} sequences for {len(texts)} prompts (the stdlib's docstrings "
                "changed since it was written): delete it to regenerate the text"
            )
        order = np.random.default_rng(args.seed).permutation(len(seqs))
        seqs, texts = [seqs[i] for i in order], [texts[i] for i in order]  # held out: the last whole sequences
        n_head = args.head_tokens or cfg.vocab_size
        n_train, ids = split_and_head_rows(tok, seqs, texts, paras, n_head, cfg.eos_ids, cfg.vocab_size)
        feat_file = os.path.join(work, "features.npz")  # a resumed run skips straight to training
        if os.path.exists(feat_file):
            with np.load(feat_file) as z:
                if "ids" not in z.files or not np.array_equal(z["ids"], ids):  # e.g. the cached text was regenerated
                    raise SystemExit(f"{feat_file} was computed for other head rows: {_FORCE}")
                feats = [z[f"f{j}"] for j in range(5)]
        else:
            feats, _ = make_features(cfg, params, seqs, ids, args.exit_layer)
            # Written atomically: its presence marks saved features.
            save_npz(feat_file, ids=ids, **{f"f{j}": x for j, x in enumerate(feats)})
        m = feats[0].shape[0]
        n_val = sum(len(s) - 1 for s in seqs[n_train:])
        assert m == sum(len(s) - 1 for s in seqs), (m, "features do not match the sequences")
        print(
            f"{len(seqs)} sequences, {m} tokens ({n_val} held out: the last {len(seqs) - n_train} whole "
            f"sequences), head rows {len(ids)} (counted on the {n_train} training sequences)"
        )
        before = token_metrics(cfg, params, feats, ids, None, n_val)
        adapter = train(args, cfg, params, feats, ids, os.path.join(work, "ckpt"), n_val)
        after = token_metrics(cfg, params, feats, ids, adapter, n_val)
        print(f"held-out tokens without adapter: {before}")
        print(f"held-out tokens with adapter:    {after}")
        ex_params = {"adapter": adapter}
        if args.head_tokens:
            ex_params["token_ids"] = jnp.asarray(ids)
        meta = {
            "model": args.model,
            "exit_layer": args.exit_layer,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "train_tokens": int(m - n_val),
            "heldout_tokens": int(n_val),
            "heldout_sequences": len(seqs) - n_train,
            "args": training_settings(args),
            "heldout_tokens_no_adapter": before,
            "heldout_tokens_adapter": after,
        }
        save_exit_params(out_dir, ex_params, meta, target_cfg=cfg)
        meta = load_exit_meta(out_dir)
        shutil.rmtree(work, ignore_errors=True)  # features and resume checkpoints are no longer needed
        print(f"saved {out_dir} ({time.perf_counter() - t0:.0f} s so far)")
    if not args.no_eval:
        res = evaluate(cfg, params, model, tok, meta["exit_layer"], ex_params, args.eval_k, args.eval_new_tokens)
        print(f"held-out chats, K={args.eval_k}, E={meta['exit_layer']}, head rows {meta['head_tokens'] or 'all'}:")
        for name, r in res.items():
            print(
                f"  {name:16s} acceptance {r['acceptance_rate']:.3f}  tokens/round {r['tokens_per_round']:.2f}  "
                f"P(first i accepted) {r['survival_at']}"
            )
        meta["eval"] = res
        save_json(os.path.join(out_dir, "meta.json"), meta, indent=1, sort_keys=True)
    print(f"done in {time.perf_counter() - t0:.0f} s")


def main(argv=None) -> None:
    run(parse_args(argv))
