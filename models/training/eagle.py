"""Train an EAGLE draft head for SmolLM2-135M on the target's own text and features, then measure acceptance.

1. Data (``models.training.eagle_data``): the target answers chat prompts (``models.training.prompts``) through
   ``jspec.decode``, batched, alternating greedy and T = ``--temperature`` batches; ``--self-batches N`` adds N
   batches of requests the target writes itself (Magpie); ``--doc-tokens`` adds stdlib docstrings and reference
   manual passages laid out as answers (a target pass, no generation). One target pass over prompt + answer gives
   f_t (final normed hidden) at every position, stored as float16 next to the tokens; ``--fuse 2,15`` adds those
   layers' outputs (an EAGLE-3-style fused head).
2. Frequent-token map: the N (``--head-tokens``) most frequent tokens of the generated answers, EOS always in.
3. Training (optax AdamW, warm-up + cosine): on windows of ``--window`` tokens, the head runs ``--unroll``
   passes of training-time test (pass u feeds on pass u-1's predictions and attends as draft step u does,
   ``models.eagle.head_unrolled``); loss per pass = ``--reg-weight`` * smooth-L1(f^, f) + ``--ce-weight`` *
   KL(target restricted to the N tokens || head), pass u weighted ``--pass-decay``^u. The agreement the progress
   bar prints is in-sample.
4. Evaluation (``models.training.eagle_eval``): acceptance per draft position with ``jspec.decode`` on held-out
   chat prompts, greedy and T = 1, and the training passes teacher-forced on the held-out greedy answers.

Where it writes: ``${JSPEC_CACHE:-~/.cache/jspec}/eagle/<name>/`` (``args.json``: the run's training settings;
``ckpt/`` and ``ckpt_history.json``: the last checkpoint and the metrics of the steps before it; ``head/``: the
finished head; ``eval.json``), and the data under ``.../eagle/_data/``, cached per batch and shared by every head
trained from the same data settings (a retrain with other head settings only pays for training, a larger budget
only for the new batches). Never into the repository.

Resuming: the same command again resumes from the last checkpoint (saved every ``--ckpt-every`` steps); the same
``--name`` with other training settings is refused, naming them. A finished head is never retrained without
``--force`` (which deletes ``<name>/``, not the data): a rerun prints its evaluation, evaluating it first when it
has none or one made with other evaluation settings (``--gamma``, ``--eval-max-new``, ``--unroll``, ``--seed``).
``--init-from NAME|DIR`` fine-tunes a trained head of the same shape (its token map, or with ``--remap`` one from
this run's data; ``--fuse`` on an unfused head, or more ``--head-layers``, graft the new parts on as the identity).
``--export DIR`` also writes the finished head with bf16 weights (``models.eagle.export_head``), its held-out
evaluation in meta.json with ``evaluated_dtype`` and ``evaluated_layout`` (the f32 head on the stacked f32 target
was evaluated, not the bf16 export).

    python examples/train_eagle.py [--name smollm2-8k] [--head-tokens 8192] [--gen-batches 3] [--force]
        [--export models/heads/NAME]

How the bundled head ``models/heads/smollm2-8k-chat-mp5`` was made, each run fine-tuning the one before (ST3_DIR
and MP3_DIR: the ``--export`` directories of st3 and mp3, in git history as ``models/heads/smollm2-8k-chat-st3`` at
commit 07c92a8 and ``models/heads/smollm2-8k-chat-mp3`` at commit 1258c00):

    python examples/train_eagle.py --name smollm2-8k-chat --eval-max-new 192
    python examples/train_eagle.py --name smollm2-8k-chat-st --init-from smollm2-8k-chat --max-new 384 \\
        --gen-batches 0-11,32-51 --epochs 1 --lr 5e-4 --eval-max-new 192
    python examples/train_eagle.py --name smollm2-8k-chat-st2 --init-from smollm2-8k-chat-st --max-new 384 \\
        --gen-batches 0-11,32-67 --epochs 1 --lr 3e-4 --eval-max-new 192
    python examples/train_eagle.py --name smollm2-8k-chat-st3 --init-from smollm2-8k-chat-st2 --max-new 384 \\
        --gen-batches 0-11,32-83 --epochs 1 --lr 3e-4 --eval-max-new 192 --export ST3_DIR
    python examples/train_eagle.py --name smollm2-8k-chat-mp --init-from ST3_DIR --gen-batches none \\
        --self-batches 48 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192
    python examples/train_eagle.py --name smollm2-8k-chat-mp2 --init-from smollm2-8k-chat-mp --gen-batches none \\
        --self-batches 96 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192
    python examples/train_eagle.py --name smollm2-8k-chat-mp3 --init-from smollm2-8k-chat-mp2 --gen-batches none \\
        --self-batches 160 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192 --export MP3_DIR
    python examples/train_eagle.py --name smollm2-8k-chat-mp5 --init-from MP3_DIR --remap --gen-batches none \\
        --self-batches 24 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192 \\
        --export models/heads/smollm2-8k-chat-mp5
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

from models import eagle as EG
from models import llama, registry
from models.training import eagle_data, eagle_eval, runs


@dataclasses.dataclass(frozen=True)
class Args:
    """The trainer's flags as ``parse_args`` returns them (same names; ``parser`` documents them and holds the
    defaults: start from ``parse_args([])`` and ``dataclasses.replace`` what differs)."""

    model: str
    name: str
    head_tokens: int
    ffn: int
    head_layers: int
    fuse: tuple[int, ...]
    init_from: str
    remap: bool
    gen_batches: str
    self_batches: int
    gen_batch: int
    max_prompt: int
    max_new: int
    temperature: float
    feature_batch: int
    doc_tokens: int
    doc_width: int
    prompt_loss: bool
    window: int
    unroll: int
    pass_decay: float
    ce_weight: float
    reg_weight: float
    noise: float
    batch: int
    epochs: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float
    ckpt_every: int
    gamma: int
    eval_max_new: int
    no_eval: bool
    force: bool
    export: str
    seed: int


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default=None, help="cache name (default: <model>-<N>)")
    ap.add_argument("--head-tokens", type=int, default=8192, help="frequent-token draft vocabulary N; 0 = all")
    ap.add_argument("--ffn", type=int, default=0, help="head layer FFN width (0: the target's)")
    ap.add_argument(
        "--head-layers",
        type=int,
        default=0,
        help="the head's decoder layers (0: one, or --init-from's); more than --init-from's grafts new layers "
        "on top that start as the identity",
    )
    ap.add_argument(
        "--fuse",
        default="",
        help="target layers whose outputs join f as the head's input, e.g. '2,15' (EAGLE-3 fusion; '' = none)",
    )
    ap.add_argument(
        "--init-from",
        default="",
        help="fine-tune this trained head (name or directory; same --head-tokens/--ffn/--fuse; its token map)",
    )
    ap.add_argument(
        "--remap",
        action="store_true",
        help="with --init-from: rebuild the frequent-token map from this run's data instead of keeping the head's",
    )
    ap.add_argument(
        "--gen-batches",
        default="14",
        help="target generation batches (the data budget): N for batches 0..N-1, or ranges like '0-11,32-51'",
    )
    ap.add_argument(
        "--self-batches",
        type=int,
        default=0,
        help="batches of requests the target writes itself (Magpie) and answers, next to --gen-batches",
    )
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="of the odd (sampled) generation batches")
    ap.add_argument("--feature-batch", type=int, default=8)
    ap.add_argument(
        "--doc-tokens", type=int, default=40000, help="off-policy stdlib docstrings + reference topics (0: none)"
    )
    ap.add_argument("--doc-width", type=int, default=256)
    ap.add_argument("--prompt-loss", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--unroll", type=int, default=3, help="training-time-test passes (draft steps trained)")
    ap.add_argument("--pass-decay", type=float, default=0.8)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument(
        "--reg-weight",
        type=float,
        default=1.0,
        help="weight of the feature regression; 0 trains on tokens alone, as EAGLE-3 does (f^ then is the "
        "head's own state, read through the target's LM-head rows)",
    )
    ap.add_argument("--noise", type=float, default=0.0, help="uniform noise on input features")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="override epochs")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--eval-max-new", type=int, default=64)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--force", action="store_true", help="retrain even if a finished head is cached")
    ap.add_argument(
        "--export",
        default="",
        help="also write the finished head with bf16 weights to this directory (how models/heads/ is made)",
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap


def parse_args(argv=None) -> Args:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        args.fuse = tuple(int(x) for x in args.fuse.split(",")) if args.fuse.strip() else ()
    except ValueError:
        ap.error(f"--fuse {args.fuse!r}: expected comma-separated layer indices such as '2,15'")
    if args.head_layers < 0:
        ap.error(f"--head-layers {args.head_layers}: expected 0 (one, or --init-from's) or more")
    # Counts that would fail (or train nothing) only after the target's data was generated: refused here.
    for flag, low in (
        ("self_batches", 0),
        ("gen_batch", 1),
        ("max_prompt", 1),
        ("max_new", 1),
        ("feature_batch", 1),
        ("window", 2),  # a window of w pairs holds w + 1 tokens; one of fewer than 3 is never kept
        ("unroll", 1),
        ("batch", 1),
        ("epochs", 1),
        ("steps", 0),
        ("warmup", 0),
        ("ckpt_every", 1),
        ("gamma", 1),
        ("eval_max_new", 1),
        ("head_tokens", 0),
        ("ffn", 0),
    ):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected {low} or more")
    if args.doc_tokens > 0 and args.doc_width < 1:
        ap.error(f"--doc-width {args.doc_width}: expected 1 or more (or --doc-tokens 0)")
    try:
        gen_ids = eagle_data.batch_ids(args.gen_batches)
    except SystemExit as e:
        ap.error(str(e))
    if not gen_ids and not args.self_batches:
        ap.error(f"--gen-batches {args.gen_batches}: no generated data without --self-batches N")
    if args.name is None:
        n = args.head_tokens
        args.name = f"{args.model}-{f'{n // 1024}k' if n and n % 1024 == 0 else (n or 'full')}"
        if args.fuse:
            args.name += "-f" + "-".join(str(i) for i in args.fuse)
    return Args(**vars(args))


# ---- stages 2-3: map, head, training ---------------------------------------------------------------------


def make_loss(ecfg: EG.EagleConfig, args):
    decay = jnp.asarray([args.pass_decay**u for u in range(args.unroll)], jnp.float32)

    def loss_fn(trainable, token_ids, target_params, rows, feats, tokens, mask, answer, noise_key):
        """feats [B, w+1, R] (raw: fused layers then f), tokens [B, w+1], mask [B, w], answer [B, w] (metric
        only); rows [N, E] the subset's LM-head rows."""
        hp = {**trainable, "token_ids": token_ids}
        f_in = EG.fuse_features(ecfg, hp, feats[:, :-1].astype(jnp.float32))  # g_i (f_i without fusion)
        if args.noise:  # EAGLE's feature noise: the rollout reads imperfect features
            f_in = f_in + args.noise * jax.random.uniform(noise_key, f_in.shape, minval=-1.0, maxval=1.0)
        f_hat = EG.head_unrolled(ecfg, hp, target_params, f_in, tokens[:, 1:], args.unroll)  # [U, B, w, E]
        target = feats[:, 1:, -f_hat.shape[-1] :].astype(jnp.float32)  # f_{i+1}
        reg = jnp.mean(optax.huber_loss(f_hat, target[None], delta=1.0), axis=-1)  # [U, B, w]
        t_logp = jax.nn.log_softmax(EG.subset_logits(target, rows), axis=-1)  # [B, w, N] target on the subset
        logq = jax.nn.log_softmax(EG.subset_logits(f_hat.reshape((-1,) + f_hat.shape[2:]), rows), axis=-1)
        logq = logq.reshape(f_hat.shape[:3] + (-1,))
        p = jnp.exp(t_logp)
        kl = jnp.sum(p[None] * (t_logp[None] - logq), axis=-1)  # [U, B, w]
        agree = (jnp.argmax(logq, -1) == jnp.argmax(t_logp, -1)[None]).astype(jnp.float32)
        m = mask.astype(jnp.float32)[None]
        denom = jnp.maximum(jnp.sum(m), 1.0)
        per_pass = lambda x: jnp.sum(x * m, axis=(1, 2)) / denom  # noqa: E731
        loss = jnp.sum(decay * (args.reg_weight * per_pass(reg) + args.ce_weight * per_pass(kl))) / jnp.sum(decay)
        # In-sample agreement on the answers alone: the prompt's pairs include the chat template's fixed
        # system prompt, which the head memorises (~0.8 agreement) and the drafter never drafts.
        a = answer.astype(jnp.float32)[None]
        agree_answer = jnp.sum(agree * a, axis=(1, 2)) / jnp.maximum(jnp.sum(a), 1.0)
        metrics = {"loss": loss, "reg": per_pass(reg), "kl": per_pass(kl), "agree": per_pass(agree)}
        return loss, {**metrics, "agree_answer": agree_answer}

    return loss_fn


def draft_vocabulary(args, answers: list, vocab_size: int, eos_ids) -> np.ndarray | None:
    """The ``--head-tokens`` most frequent tokens of the generated answers (every end token in), or None: the full
    vocabulary, or a fine-tuned head's own map. ``--remap`` rebuilds a fine-tuned head's map from this run's
    data: its LM head is the target's tied rows, so a new map needs no new weights."""
    if (args.init_from and not args.remap) or not args.head_tokens or args.head_tokens >= vocab_size:
        return None
    counts = EG.token_counts(answers, vocab_size)
    token_ids = EG.frequent_tokens(counts, args.head_tokens, always=list(eos_ids))
    cover = counts[token_ids].sum() / max(counts.sum(), 1)
    print(f"draft vocabulary: {args.head_tokens} most frequent tokens cover {cover:.4f} of the generated text")
    return token_ids


def init_source(args, target_cfg):
    """The head ``--init-from`` names, checked against this run's head settings (a head of another shape
    cannot be fine-tuned into this one)."""
    src, hp = EG.restore_head(EG.resolve_head(args.init_from), target_cfg)
    mine = (args.head_tokens or target_cfg.vocab_size, args.ffn or target_cfg.ffn, tuple(args.fuse))
    theirs = (src.n, src.ffn or target_cfg.ffn, src.fuse)
    graft = not src.fuse and bool(args.fuse)  # an unfused head learns to fuse: it starts as itself
    if mine != theirs and not (graft and mine[:2] == theirs[:2]):
        raise SystemExit(
            f"--init-from {args.init_from}: that head has (head tokens, ffn, fuse) = {theirs}, this run asks "
            f"for {mine}: pass the same --head-tokens / --ffn, and the same --fuse or none on an unfused head"
        )
    layers = getattr(args, "head_layers", 0) or src.layers
    if layers < src.layers:
        raise SystemExit(
            f"--head-layers {layers}: --init-from {args.init_from} has {src.layers} layers (a head can gain "
            "layers, not lose them)"
        )
    if graft:
        src = dataclasses.replace(src, fuse=tuple(args.fuse))
        hp = EG.graft_fusion(src, hp)
    if layers > src.layers:  # the new layers start as the identity: the head drafts as before
        src = dataclasses.replace(src, layers=layers)
        hp = EG.graft_layers(src, hp, jax.random.key(getattr(args, "seed", 0)))
    return src, hp


def check_token_map(out_dir: str, token_ids, resuming: bool) -> None:
    """The frequent-token map a checkpoint was trained under, kept beside it (``token_ids.npy``): a resumed run
    that builds another one (the data, or the --init-from head it takes its map from, changed in between) is
    refused, since its weights would then draft other tokens than they learnt. A fresh run records its map."""
    path = os.path.join(out_dir, "token_ids.npy")
    here = np.asarray(token_ids, np.int32)
    if not resuming:
        os.makedirs(out_dir, exist_ok=True)
        np.save(path, here)
    elif os.path.isfile(path) and not np.array_equal(np.load(path), here):
        raise SystemExit(
            f"{out_dir}: its checkpoint was trained under another frequent-token map than this run builds (the data "
            "or the --init-from head changed since it was saved); resuming would pair its weights with other "
            "tokens: train under a new --name, or delete that directory to start over"
        )


def train(args, target, data, token_ids, out_dir: str):
    """(config, head params, per-step metrics, the step they start at, training seconds): the metrics and
    seconds of the steps before a resume come from ``runs.save_history``'s file (``runs.resumed_history``)."""
    t0 = time.perf_counter()
    layers = args.head_layers or 1
    ecfg = EG.EagleConfig(target.config, args.head_tokens, args.ffn, name=args.name, fuse=args.fuse, layers=layers)
    if args.init_from:  # fine-tuning: the trained head's weights and its own frequent-token map (or --remap's)
        src, hp = init_source(args, target.config)
        ecfg = dataclasses.replace(ecfg, layers=src.layers)
        if token_ids is not None:
            hp = {**hp, "token_ids": jnp.asarray(token_ids, jnp.int32)}
    else:
        hp = EG.init_head(ecfg, target.params, jax.random.key(args.seed), token_ids)
    trainable, ids = EG.split_trainable(hp)
    rows = EG.EagleDrafter(ecfg).draft_params(target.params, hp)[1]["rows"]
    m = data["tokens"].shape[0]
    steps_per_epoch = max(m // args.batch, 1)
    total = args.steps or args.epochs * steps_per_epoch
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, total // 4), total, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.98, weight_decay=args.weight_decay))
    opt_state = opt.init(trainable)
    loss_fn = make_loss(ecfg, args)
    tparams = {"embed": target.params["embed"]}  # all the head reads of the target

    @jax.jit
    def step(trainable, opt_state, tparams, rows, feats, tokens, mask, answer, key):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(trainable, ids, tparams, rows, feats, tokens, mask, answer, key)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, metrics

    mgr = runs.checkpoint_manager(out_dir)
    hist_path = os.path.join(out_dir, "ckpt_history.json")
    check_token_map(out_dir, ids, resuming=mgr.latest_step() is not None)
    start, state = runs.restore_latest(mgr, {"trainable": trainable, "opt": opt_state}, total)
    trainable, opt_state = state["trainable"], state["opt"]
    history, from_step, seconds_before = runs.resumed_history(hist_path, start)
    bar = tqdm(range(start, total), desc="train head", unit="step", initial=start, total=total)
    for s in bar:
        # Deterministic in (seed, step): a resumed run sees the batches it would have seen.
        rng = np.random.default_rng((args.seed, s // steps_per_epoch))
        perm = rng.permutation(m)
        sel = np.sort(perm[(s % steps_per_epoch) * args.batch : (s % steps_per_epoch + 1) * args.batch])
        trainable, opt_state, met = step(
            trainable,
            opt_state,
            tparams,
            rows,
            jnp.asarray(data["feats"][sel]),
            jnp.asarray(data["tokens"][sel]),
            jnp.asarray(data["mask"][sel]),
            jnp.asarray(data["answer"][sel]),
            jax.random.key(args.seed * 100_003 + s),
        )
        met = {k: np.asarray(v).tolist() for k, v in met.items()}
        history.append(met)
        bar.set_postfix(loss=f"{met['loss']:.3f}", agree=" ".join(f"{a:.2f}" for a in met["agree_answer"]))
        if (s + 1) % args.ckpt_every == 0 or s + 1 == total:
            mgr.save(s + 1, args=ocp.args.StandardSave({"trainable": trainable, "opt": opt_state}))
            if from_step == 0:  # metrics of every step so far: a resume keeps the run's first ones
                runs.save_history(hist_path, s + 1, seconds_before + time.perf_counter() - t0, history)
    mgr.wait_until_finished()
    mgr.close()
    return ecfg, {**trainable, "token_ids": ids}, history, from_step, seconds_before + time.perf_counter() - t0


def training_summary(history: list[dict], from_step: int) -> dict:
    """The report's training metrics: mean loss over the first and the last tenth of ``history`` (the steps
    from ``from_step``), the last tenth's per-pass KL, smooth-L1 and in-sample agreement; None where no step is
    recorded (a checkpoint of the last step, made before the metrics were kept, and nothing left to run)."""
    k = max(len(history) // 10, 1)
    first, last = history[:k], history[-k:]

    def avg(h, key):
        return np.mean([x[key] for x in h], axis=0).tolist() if h else None

    return {
        "loss_start": avg(first, "loss"),
        "loss_end": avg(last, "loss"),
        "kl_end": avg(last, "kl"),
        "reg_end": avg(last, "reg"),
        "agree_end": avg(last, "agree"),
        "agree_answer_end": avg(last, "agree_answer"),
        "metrics_from_step": from_step,
        "metrics_steps": len(history),
    }


def summary_line(name: str, summary: dict) -> str:
    """``training_summary`` in words; metrics that cover only the steps after a resume say so."""
    if not summary["metrics_steps"]:
        return runs.no_metrics_line(name, summary["metrics_from_step"])
    since = runs.since_step(summary["metrics_from_step"])

    def r(v):
        return np.round(v, 3).tolist()

    return (
        f"{name}: loss{since} {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} "
        f"({summary['metrics_steps']} steps); per pass: KL {r(summary['kl_end'])}, "
        f"smooth-L1 {r(summary['reg_end'])}, top-1 agreement (in-sample) {r(summary['agree_end'])}, "
        f"on answers {r(summary['agree_answer_end'])}"
    )


# ---- the run ---------------------------------------------------------------------------------------------

# Arguments that do not change the trained head: a cached head or checkpoint made with other values is the same.
_NOT_TRAINING = frozenset({"force", "export", "no_eval", "eval_max_new", "gamma", "name", "ckpt_every"})


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def _training_args(args_dict: dict) -> dict:
    return runs.settings(args_dict, _NOT_TRAINING)


def check_same_run(args, out_dir: str, eval_path: str) -> None:
    """A head or checkpoint under ``out_dir`` made with other training settings is refused by name (it was
    reused as this run's result, or resumed on a new schedule); a directory with neither (fresh, or left by a
    run that stopped before its first checkpoint, whose ``ckpt/`` the checkpoint manager made empty) records
    this run's settings instead."""

    def unrecorded():  # made before args.json existed: its report has the arguments
        if not os.path.isfile(eval_path):
            return None
        with open(eval_path) as f:
            return _training_args(json.load(f).get("args", {}))

    runs.check_same_run(
        _training_args(vars(args)),
        os.path.join(out_dir, "args.json"),
        os.path.isdir(os.path.join(out_dir, "head")) or runs.has_checkpoint(os.path.join(out_dir, "ckpt")),
        holder=f"{out_dir} holds a head trained",
        remedy="give this run another --name, or --force to retrain",
        unrecorded=unrecorded,
    )


def run(args: Args) -> dict:
    """Train (or reuse, or resume) the head ``args`` describe, evaluate it and export it: its report."""
    if args.remap and not args.init_from:
        raise SystemExit("--remap rebuilds a fine-tuned head's token map: it needs --init-from")
    out_dir = os.path.join(EG.cache_root(), args.name)
    final = os.path.join(out_dir, "head")
    eval_path = os.path.join(out_dir, "eval.json")
    if args.force and os.path.isdir(out_dir):
        if args.init_from and _inside(EG.resolve_head(args.init_from), out_dir):
            raise SystemExit(
                f"--force would delete {out_dir}, which holds the head --init-from {args.init_from} names: "
                "give this run another --name"
            )
        shutil.rmtree(out_dir)  # the target data (eagle_data.data_dir) is kept
    check_same_run(args, out_dir, eval_path)
    if os.path.isfile(os.path.join(final, "meta.json")):  # save_head writes it last: the head is finished
        return eagle_eval.cached_head(args, final, eval_path)

    t0 = time.perf_counter()
    target = registry.load(args.model, dtype="float32")
    try:  # bad --fuse layers or --head-layers are refused before any model call
        EG.EagleConfig(target.config, args.head_tokens, args.ffn, fuse=args.fuse, layers=args.head_layers or 1)
    except ValueError as e:
        raise SystemExit(f"--fuse / --head-layers: {e}") from None
    if args.init_from:  # so is a head to fine-tune that does not fit this run
        init_source(args, target.config)
    # The target's text and features come from the CPU decode layout (per-layer weights on the CPU kernels,
    # ~2x faster there); training reads the stacked params.
    gen = target._replace(params=llama.unstack_layers(target.params)) if jax.default_backend() == "cpu" else target
    data_dir = eagle_data.data_dir(args)
    files = eagle_data.generate_data(args, gen, data_dir) + eagle_data.generate_self_data(args, gen, data_dir)
    if not files:
        raise SystemExit("no generated data: --gen-batches none needs --self-batches N")
    doc_dir = os.path.join(EG.cache_root(), "_data", f"{args.model}-docs-w{args.doc_width}-s{args.seed}")
    doc_files = eagle_data.generate_doc_data(args, gen, doc_dir)
    extra = eagle_data.layer_files(args, gen, files + doc_files)
    del gen
    data, answers = eagle_data.load_windows(files + doc_files, args.window, args.prompt_loss, extra)
    answers = answers[: len(files) * args.gen_batch]  # the generated answers only (the frequent-token map)
    t_data = time.perf_counter() - t0
    n_ans = int(sum(len(a) for a in answers))
    print(
        f"data: {n_ans} generated tokens in {len(files)} batches + {len(doc_files)} docstring files; "
        f"{int(data['mask'].sum())} trained pairs"
    )
    token_ids = draft_vocabulary(args, answers, target.config.vocab_size, target.tokenizer.eos_ids)

    # A run resumed from a checkpoint of the last step makes no step: its metrics and seconds are those kept
    # with the checkpoint (train), not NaN and ~0 s.
    ecfg, hp, history, from_step, t_train = train(args, target, data, token_ids, out_dir)
    summary = training_summary(history, from_step)
    print(f"trained {summary_line(args.name, summary)}; data {t_data:.0f} s, training {t_train:.0f} s")
    report = {
        "name": args.name,
        "gamma": args.gamma,
        "data_seconds": t_data,
        "train_seconds": t_train,
        "generated_tokens": n_ans,
        **summary,
        "args": dict(vars(args)),
        "eval": {},
    }
    EG.save_head(final, ecfg, hp, {k_: v_ for k_, v_ in report.items() if k_ != "eval"})
    if not args.no_eval:
        report["eval"] = eagle_eval.evaluate(target, final, args.gamma, args.eval_max_new, args.seed, args.unroll)
        report["eval_settings"] = eagle_eval.eval_settings(args)
        eagle_eval.print_eval(report["eval"], args.gamma)
        with open(eval_path, "w") as f:
            json.dump(report, f, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s; head saved to {final}")
    eagle_eval.export(args, final, report)
    return report


def main(argv=None) -> dict:
    return run(parse_args(argv))
