"""Distil a small draft from the target (DistillSpec-style, on-policy) and evaluate its acceptance.

1. On-policy data: the TARGET answers prompts (chat questions and requests about Python standard-library
   docstrings, i.e. real text that ships with Python, less the passages the benchmark's grounded workload uses
   and any docstring sharing text with them: ``models.training.prompts.draft_training_prompts``) with
   ``jspec.decode``, batched, at temperature ``--temperature``. Each batch's target log-probabilities are computed
   once (one teacher forward over prompt + answer), and their top ``--teacher-k`` are cached next to the tokens.
2. The frequent-token head's map (``--head-size`` tokens) is counted on the generated answers.
3. The draft (``--layers`` layers copied from the target, plus the target's embedding and head rows) is
   trained with AdamW to minimise KL(target || draft) on those positions; ``ocp.CheckpointManager`` saves
   every ``--ckpt-every`` steps and a rerun resumes from the last checkpoint.
4. The draft is saved (``models.draft.save_draft``) and its acceptance measured with ``jspec.decode`` on
   held-out chat prompts, greedy and at T = 1.

The draft goes to ``${JSPEC_CACHE:-~/.cache/jspec}/draft/<name>``, the target data (shared by drafts
trained from the same data settings) to ``.../draft/_data/<settings>``, never into the repository; a rerun
with a finished draft only prints its evaluation unless ``--force`` (evaluating the saved draft first, never
retraining it, when it has none or one made with other ``--gamma`` / ``--eval-max-new``). The training metrics
are kept with each checkpoint, so a resumed run reports the whole run's. The first run under a name records its
settings (``<name>/args.json``); a later one with other settings (model, data, schedule, ...) is refused, naming
them, rather than resuming that run's checkpoint or reusing its draft. Defaults take a few minutes on
a 2-core CPU (the target's generation and teacher pass dominate: ``--gen-batches`` sets how much).

    python examples/train_draft.py [--name smollm2-2L-8k] [--layers 2] [--head-size 8192] [--force]
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

from jspec import decode as dec
from jspec.drafters import ModelDrafter
from models import draft as D
from models import registry
from models.training import prompts, runs
from models.training.data import answer, cached_batches, encode, right_pad, save_json, save_npz
from models.training.prompts import DRAFT_EVAL_PROMPTS


@dataclasses.dataclass(frozen=True)
class Args:
    """The trainer's flags as ``parse_args`` returns them (same names; ``parser`` documents them and holds the
    defaults: start from ``parse_args([])`` and ``dataclasses.replace`` what differs)."""

    model: str
    name: str
    layers: int
    frozen_layers: int
    head_size: int
    gen_batches: int
    gen_batch: int
    max_prompt: int
    max_new: int
    temperature: str
    doc_fraction: float
    teacher_k: int
    teacher_batch: int
    val_batches: int
    prompt_loss: bool
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
    data_only: bool
    force: bool
    seed: int


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default=None, help="cache name (default: <model>-<layers>L-<head>)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--frozen-layers", type=int, default=0, help="leading draft layers kept as the target's")
    ap.add_argument("--head-size", type=int, default=8192, help="frequent-token head size N; 0 = full head")
    ap.add_argument("--gen-batches", type=int, default=8, help="target generation batches (the data budget)")
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=160)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument(
        "--temperature",
        default="0.8",
        help="sampling temperature of the target's answers; a comma list cycles over the rows of a batch",
    )
    ap.add_argument("--doc-fraction", type=float, default=0.25, help="share of docstring prompts")
    ap.add_argument("--teacher-k", type=int, default=32)
    ap.add_argument("--teacher-batch", type=int, default=4)
    ap.add_argument("--val-batches", type=int, default=1, help="data batches held out for validation")
    ap.add_argument("--prompt-loss", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="override epochs")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--eval-max-new", type=int, default=64)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--data-only", action="store_true", help="stop after generating the data")
    ap.add_argument("--force", action="store_true", help="retrain even if a finished draft is cached")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def parse_args(argv=None) -> Args:
    ap = parser()
    args = ap.parse_args(argv)
    # Counts that would fail (or train nothing) only after the target's data was generated: refused here.
    for flag, low in (
        ("layers", 1),
        ("gen_batches", 1),
        ("gen_batch", 1),
        ("max_prompt", 1),
        ("max_new", 1),
        ("teacher_k", 1),
        ("teacher_batch", 1),
        ("val_batches", 0),
        ("batch", 1),
        ("epochs", 1),
        ("steps", 0),
        ("warmup", 0),
        ("ckpt_every", 1),
        ("gamma", 1),
        ("eval_max_new", 1),
        ("head_size", 0),
    ):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected {low} or more")
    if not 0 <= args.frozen_layers <= args.layers:
        ap.error(f"--frozen-layers {args.frozen_layers}: expected 0 to --layers ({args.layers})")
    if not 0 <= args.doc_fraction < 1:
        ap.error(f"--doc-fraction {args.doc_fraction:g}: expected a share in [0, 1)")
    if args.name is None:
        head = f"{args.head_size // 1024}k" if args.head_size and args.head_size % 1024 == 0 else args.head_size
        args.name = f"{args.model}-{args.layers}L-{head or 'full'}"
    return Args(**vars(args))


# ---- stage 1: on-policy data with cached teacher log-probs ---------------------------------------------


def generate_data(args, target, data_dir: str, train_prompts: list[str]) -> list[str]:
    """One npz per batch: tokens [B, W] (prompt + answer, right-padded), lengths, prompt lengths, teacher
    top-k log-probs (float16) and ids [B, W, k]. Existing batches are kept (resume)."""
    tok = target.tokenizer
    width = args.max_prompt + args.max_new
    teacher = jax.jit(D.teacher_topk, static_argnums=(0, 3))
    temps = [float(t) for t in str(args.temperature).split(",")]

    def make(i, path):
        chunk = train_prompts[i * args.gen_batch : (i + 1) * args.gen_batch]
        if len(chunk) < args.gen_batch:
            raise SystemExit(f"only {len(train_prompts)} training prompts: lower --gen-batches or --gen-batch")
        ids = [encode(tok, p, args.max_prompt) for p in chunk]
        temperature = [temps[r % len(temps)] for r in range(len(ids))]
        seqs, new_tokens = answer(
            target.model,
            target.params,
            ids,
            max_new=args.max_new,
            temperature=temperature,
            eos_ids=tok.eos_ids,
            seed=args.seed * 1000 + i,
        )
        tokens = right_pad(seqs, width)
        t_logp = np.zeros((len(seqs), width, args.teacher_k), np.float16)
        t_ids = np.zeros((len(seqs), width, args.teacher_k), np.int32)
        # Longest rows first so each teacher chunk is cut to its own width (rounded to 64 to bound the
        # number of compiled shapes): padding is otherwise a third of the teacher's work. [B, W, V] logits in
        # one call would take ~1 GB, hence the chunks.
        order = np.argsort([-len(s) for s in seqs], kind="stable")
        for r in range(0, len(seqs), args.teacher_batch):
            rows = order[r : r + args.teacher_batch]
            w = min(-(-max(len(seqs[j]) for j in rows) // 64) * 64, width)
            lp, ti = teacher(target.config, target.params, jnp.asarray(tokens[rows, :w]), args.teacher_k)
            t_logp[rows, :w] = np.asarray(lp, np.float16)
            t_ids[rows, :w] = np.asarray(ti, np.int32)
        save_npz(
            path,
            tokens=tokens,
            lengths=np.array([len(s) for s in seqs], np.int32),
            prompt_lengths=np.array([len(p) for p in ids], np.int32),
            t_logp=t_logp,
            t_ids=t_ids,
        )
        return new_tokens

    return cached_batches(data_dir, "batch", list(range(args.gen_batches)), "target data", make)


def batch_path(data_dir: str, i: int) -> str:
    return os.path.join(data_dir, f"batch_{i:04d}.npz")


def check_prompt_budget(args, data_dir: str, n_prompts: int) -> None:
    """Refuse, before the target loads, a data budget (``--gen-batches`` x ``--gen-batch``) whose missing batches
    need more training prompts than there are: ``generate_data`` would stop at the first such batch, after
    generating the ones before it. Batches already cached are not generated again, so they do not count."""
    missing = [i for i in range(args.gen_batches) if not os.path.exists(batch_path(data_dir, i))]
    if missing and (missing[-1] + 1) * args.gen_batch > n_prompts:
        raise SystemExit(
            f"--gen-batches {args.gen_batches} x --gen-batch {args.gen_batch} asks for more than the {n_prompts} "
            "training prompts: lower --gen-batches or --gen-batch"
        )


def data_dir(args) -> str:
    """Shared by every draft trained from the same target data (it does not depend on the draft)."""
    key = (
        f"{args.model}-T{args.temperature}-p{args.max_prompt}-n{args.max_new}-b{args.gen_batch}"
        f"-d{args.doc_fraction:g}-k{args.teacher_k}-s{args.seed}"
    )
    # "-xb": docstrings without the benchmark's passages (``draft_docstring_prompts``); data cached before held them.
    key += "-xb" if args.doc_fraction else ""
    return os.path.join(D.cache_root(), "_data", key)


def load_data(files: list[str], prompt_loss: bool):
    parts = [dict(np.load(f)) for f in files]
    data = {k: np.concatenate([p[k] for p in parts]) for k in ("tokens", "lengths", "prompt_lengths")}
    data["t_logp"] = np.concatenate([p["t_logp"] for p in parts])
    data["t_ids"] = np.concatenate([p["t_ids"] for p in parts])
    n, w = data["tokens"].shape
    j = np.arange(w)[None, :]
    # Position j is trained to predict token j + 1; answers are on-policy, prompt text optional.
    start = np.zeros(n, np.int32)[:, None] if prompt_loss else (data["prompt_lengths"] - 1)[:, None]
    data["mask"] = (j >= start) & (j < data["lengths"][:, None] - 1)
    return data


# ---- stage 2-3: token map, draft, training -------------------------------------------------------------


def batch_schedule(data, batch: int, epochs: int, seed: int) -> list[tuple[np.ndarray, int]]:
    """(rows, width) per step for ``epochs`` shuffled passes. Rows are bucketed by length (two widths: most
    chat rows fit the short one) so padding costs little, with at most two compiled shapes; a step never
    mixes buckets. Deterministic in ``seed``, so a resumed run sees the same batches."""
    width = data["tokens"].shape[1]
    short = min(-(-int(np.percentile(data["lengths"], 75)) // 32) * 32, width)
    buckets = [(np.nonzero(data["lengths"] <= short)[0], short), (np.nonzero(data["lengths"] > short)[0], width)]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(epochs):
        epoch = []
        for rows, w in buckets:
            rows = rng.permutation(rows)
            epoch += [(rows[i : i + batch], w) for i in range(0, len(rows) - batch + 1, batch)]
        out += [epoch[i] for i in rng.permutation(len(epoch))]
    return out


def train(args, target, data, out_dir: str):
    """(draft config, params, per-step metrics, the step they start at, training seconds): the metrics and
    seconds of the steps before a resume come from ``runs.save_history``'s file (``runs.resumed_history``), so a
    run resumed at its last checkpoint (one stopped while validating or evaluating) reports the run's metrics, not
    those of no step."""
    t0 = time.perf_counter()
    tok = target.tokenizer
    answers = [
        data["tokens"][i, data["prompt_lengths"][i] : data["lengths"][i]] for i in range(data["tokens"].shape[0])
    ]
    dcfg = D.draft_config(target.config, args.layers, args.head_size, name=args.name)
    token_map = None
    if args.head_size:
        counts = D.token_counts(answers, target.config.vocab_size)
        token_map = D.frequent_token_map(counts, args.head_size, always=list(tok.eos_ids))
        covered = counts[token_map].sum() / max(counts.sum(), 1)
        print(f"frequent-token head: {args.head_size} tokens cover {covered:.4f} of the generated answers")
    params = D.init_from_target(dcfg, target.params, token_map)
    trainable, frozen = D.split_trainable(params)

    schedule = batch_schedule(data, args.batch, args.epochs, args.seed)
    if not schedule:  # every length bucket holds fewer rows than a batch: nothing would train (or --steps hangs)
        raise SystemExit(
            f"no training batch: {data['tokens'].shape[0]} generated rows, none of whose length buckets fills "
            f"--batch {args.batch}: lower --batch or generate more (--gen-batches)"
        )
    total = args.steps or len(schedule)
    while len(schedule) < total:  # --steps beyond the epochs: keep cycling with fresh shuffles
        schedule += batch_schedule(data, args.batch, 1, args.seed + len(schedule))
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, total // 4), total, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.98, weight_decay=args.weight_decay))
    opt_state = opt.init(trainable)
    step_fn = D.make_train_step(dcfg, opt, args.frozen_layers)

    mgr = runs.checkpoint_manager(out_dir)
    hist_path = os.path.join(out_dir, "ckpt_history.json")
    start, state = runs.restore_latest(mgr, {"trainable": trainable, "opt": opt_state}, total)
    trainable, opt_state = state["trainable"], state["opt"]
    history, from_step, seconds_before = runs.resumed_history(hist_path, start)

    dev = {k: jnp.asarray(v) for k, v in data.items() if k in ("tokens", "mask", "t_logp", "t_ids")}
    bar = tqdm(range(start, total), desc="distil", unit="step", initial=start, total=total)
    for s in bar:
        rows, w = schedule[s]
        rows = jnp.asarray(rows)
        trainable, opt_state, m = step_fn(
            trainable,
            frozen,
            opt_state,
            dev["tokens"][rows, :w],
            dev["mask"][rows, :w],
            dev["t_logp"][rows, :w],
            dev["t_ids"][rows, :w],
        )
        m = {key: float(v) for key, v in m.items()}
        history.append(m)
        bar.set_postfix(kl=f"{m['kl']:.3f}", agree=f"{m['agree']:.3f}")
        if (s + 1) % args.ckpt_every == 0 or s + 1 == total:
            mgr.save(s + 1, args=ocp.args.StandardSave({"trainable": trainable, "opt": opt_state}))
            if from_step == 0:  # metrics of every step so far: a resume keeps the run's first ones
                runs.save_history(hist_path, s + 1, seconds_before + time.perf_counter() - t0, history)
    mgr.wait_until_finished()
    mgr.close()
    params = D.merge_params(trainable, frozen)
    return dcfg, params, history, from_step, seconds_before + time.perf_counter() - t0


def training_summary(history: list[dict], from_step: int) -> dict:
    """The report's training metrics: mean KL and top-1 agreement over the first and the last tenth of
    ``history`` (the steps from ``from_step``), the last tenth's target mass in the head; None where no step is
    recorded (a checkpoint of the last step, made before the metrics were kept, and nothing left to run)."""
    k = max(len(history) // 10, 1)
    first, last = history[:k], history[-k:]

    def avg(h, key):
        return float(np.mean([m[key] for m in h])) if h else None

    return {
        "kl_start": avg(first, "kl"),
        "kl_end": avg(last, "kl"),
        "agree_start": avg(first, "agree"),
        "agree_end": avg(last, "agree"),
        "support_end": avg(last, "support"),
        "metrics_from_step": from_step,
        "metrics_steps": len(history),
    }


def summary_line(name: str, summary: dict) -> str:
    """``training_summary`` in words; metrics that cover only the steps after a resume say so."""
    if not summary["metrics_steps"]:
        return runs.no_metrics_line(name, summary["metrics_from_step"])
    since = runs.since_step(summary["metrics_from_step"])
    return (
        f"{name}: KL{since} {summary['kl_start']:.3f} -> {summary['kl_end']:.3f}, top-1 agreement "
        f"{summary['agree_start']:.3f} -> {summary['agree_end']:.3f} ({summary['metrics_steps']} steps), target "
        f"mass in the head {summary['support_end']:.3f}"
    )


# ---- stage 4: evaluation ----------------------------------------------------------------------------------


def validate(dcfg, params, val, batch: int) -> dict:
    """KL / top-1 agreement / head coverage on held-out target answers (teacher-forced, no decoding)."""
    loss = jax.jit(D.distill_loss, static_argnums=0)
    sums, weight = {}, 0.0
    for i in range(0, val["tokens"].shape[0], batch):
        sl = slice(i, i + batch)
        n = float(val["mask"][sl].sum())
        _, m = loss(dcfg, params, *(jnp.asarray(val[k][sl]) for k in ("tokens", "mask", "t_logp", "t_ids")))
        for key, v in m.items():
            sums[key] = sums.get(key, 0.0) + float(v) * n
        weight += n
    return {key: v / max(weight, 1.0) for key, v in sums.items()}


def evaluate(target, loaded: D.LoadedDraft, gamma: int, max_new: int, seed: int = 0) -> dict:
    tok = target.tokenizer
    ids = [encode(tok, p, 512) for p in DRAFT_EVAL_PROMPTS]
    res = {}
    for label, temp in (("greedy", 0.0), ("T=1", 1.0)):
        out = dec.decode(
            target.model,
            target.params,
            ids,
            drafter=ModelDrafter(loaded.model),
            draft_params=loaded.params,
            gamma=gamma,
            max_new_tokens=max_new,
            temperature=temp,
            eos_ids=tok.eos_ids,
            seed=seed,
        )
        st = out.stats
        res[label] = {
            "acceptance_rate": st["acceptance_rate"],
            "tokens_per_round": st["tokens_per_round"],
            "accepted_at": st["accepted_at"],
            "proposed_at": st["proposed_at"],
            "per_position": [a / p if p else None for a, p in zip(st["accepted_at"], st["proposed_at"])],
            "new_tokens": sum(st["new_tokens"]),
        }
    return res


def print_eval(ev: dict, gamma: int):
    for label, r in ev.items():
        per = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["per_position"])
        print(
            f"held-out {label:6s} K={gamma}: acceptance {r['acceptance_rate']:.3f}  tokens/round "
            f"{r['tokens_per_round']:.2f}  accepted/proposed per position [{per}]  ({r['new_tokens']} tokens)"
        )


def print_val(val: dict, n_val: int | None = None) -> None:
    what = f" ({n_val} batch)" if n_val else ""
    print(
        f"held-out target answers{what}: KL {val['kl']:.3f}, top-1 agreement {val['agree']:.3f}, target mass in "
        f"the head {val['support']:.3f}"
    )


def eval_settings(args) -> dict:
    """What the held-out evaluation depends on besides the draft: a cached draft whose report was made with other
    values is evaluated again (not retrained)."""
    return {
        "gamma": args.gamma,
        "eval_max_new": args.eval_max_new,
        "seed": args.seed,
        "prompts": list(DRAFT_EVAL_PROMPTS),
    }


def recorded_eval_settings(report: dict, draft_args: dict) -> dict:
    """``eval_settings`` of a report's evaluation. A report made before they were recorded ran with its ``gamma``
    and the arguments the draft was saved with (``draft_args``: that run evaluated it); its prompts were not
    recorded (they are not compared)."""
    if "eval_settings" in report:
        return report["eval_settings"]
    return {"gamma": report.get("gamma"), **{k: draft_args[k] for k in ("eval_max_new", "seed") if k in draft_args}}


def stale_evaluation(report: dict, args, draft_args: dict | None = None) -> list[str]:
    """Why ``report``'s held-out evaluation is not the one this run would make: [] when it is, ["none"] when it
    has none, else the evaluation settings that differ (``eval_settings``)."""
    if not report.get("eval"):
        return ["none"]
    return runs.differences(recorded_eval_settings(report, draft_args or {}), eval_settings(args))


def cached_draft(args, final: str, eval_path: str) -> dict:
    """A finished draft under --name is never retrained (``--force`` does that): its report is eval.json, or for a
    draft never evaluated (``--no-eval``, or a run stopped while evaluating) the training report its draft.json
    keeps. The evaluation runs (again), on the saved draft, when there is none or it was made with other
    ``eval_settings``, unless ``--no-eval`` (or ``--data-only``); then it is printed."""
    with open(os.path.join(final, D.META_FILE)) as f:
        extra = json.load(f).get("extra") or {}
    if os.path.isfile(eval_path):
        with open(eval_path) as f:
            report = json.load(f)
    else:
        report = dict(extra.get("report") or {"name": args.name, "gamma": args.gamma})
        report["eval"] = {}
    print(f"cached draft at {final} (--force retrains)")
    stale = stale_evaluation(report, args, extra.get("args") or {})
    if stale and not (args.no_eval or args.data_only):
        why = "it was never evaluated" if stale == ["none"] else f"evaluation settings changed: {', '.join(stale)}"
        print(f"evaluating it ({why})")
        target = registry.load(args.model, dtype="float32")
        loaded = D.load_draft(final, target_config=target.config, tokenizer=target.tokenizer)
        report["eval"] = evaluate(target, loaded, args.gamma, args.eval_max_new, args.seed)
        report["gamma"], report["eval_settings"] = args.gamma, eval_settings(args)
        save_json(eval_path, report, indent=1)
    elif stale and stale != ["none"]:
        print(f"(evaluated with other settings: {', '.join(stale)}; --no-eval does not evaluate it again)")
    if isinstance(report.get("val"), dict):
        print_val(report["val"])
    if report["eval"]:
        print_eval(report["eval"], report["gamma"])
    else:
        print("not evaluated (--no-eval)")
    return report


# ---- the run ---------------------------------------------------------------------------------------------

# Arguments that do not change the trained draft: a cached draft or checkpoint made with other values is the same
# (the name is the draft's identity; the teacher's batch only chunks the same computation; the rest only evaluate:
# a cached draft evaluated with other ``eval_settings`` is evaluated again, not retrained).
_NOT_TRAINING = frozenset(
    {"name", "force", "ckpt_every", "gamma", "eval_max_new", "no_eval", "data_only", "teacher_batch"}
)


def training_settings(args) -> dict:
    return runs.settings(vars(args), _NOT_TRAINING)


def check_same_run(args, out_dir: str) -> None:
    """A draft or checkpoint under ``out_dir`` made with other training settings (model, data, schedule, ...) is
    refused by name: it would be printed as this run's result, or resumed on another schedule. A directory with
    neither (fresh, or left by a run that stopped before its first checkpoint) records this run's settings in
    ``out_dir/args.json`` instead."""
    final = os.path.join(out_dir, "draft")

    def unrecorded():  # a draft saved before args.json existed keeps its arguments in its own metadata
        meta = os.path.join(final, D.META_FILE)
        if not os.path.isfile(meta):
            return None
        with open(meta) as f:
            recorded = json.load(f).get("extra", {}).get("args")
        return runs.settings(recorded, _NOT_TRAINING) if recorded else None

    runs.check_same_run(
        training_settings(args),
        os.path.join(out_dir, "args.json"),
        os.path.isdir(final) or runs.has_checkpoint(os.path.join(out_dir, "ckpt")),
        holder=f"{out_dir} holds a draft (or training checkpoint) made",
        remedy="give this run another --name, or --force to retrain under this one",
        unrecorded=unrecorded,
    )


def run(args: Args) -> dict:
    """Train (or reuse, or resume) the draft ``args`` describe and evaluate it: its report."""
    out_dir = os.path.join(D.cache_root(), args.name)
    final = os.path.join(out_dir, "draft")
    eval_path = os.path.join(out_dir, "eval.json")
    if args.force and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)  # the target data lives elsewhere (data_dir) and is kept
    check_same_run(args, out_dir)
    if os.path.isfile(os.path.join(final, D.META_FILE)):  # save_draft writes it last: the draft is finished
        return cached_draft(args, final, eval_path)

    t0 = time.perf_counter()
    train_prompts = prompts.draft_training_prompts(args.seed, args.doc_fraction)  # refused before the target loads
    check_prompt_budget(args, data_dir(args), len(train_prompts))
    target = registry.load(args.model, dtype="float32")
    if args.layers > target.config.num_layers:  # refused before the target's data is generated
        raise SystemExit(
            f"--layers {args.layers}: the draft copies target layers, and {args.model} has {target.config.num_layers}"
        )
    files = generate_data(args, target, data_dir(args), train_prompts)
    n_val = min(args.val_batches, len(files) - 1)
    data = load_data(files[: len(files) - n_val], args.prompt_loss)
    val = load_data(files[len(files) - n_val :], prompt_loss=False) if n_val else None
    t_data = time.perf_counter() - t0
    n_answer = int(sum(data["lengths"] - data["prompt_lengths"]))
    print(f"data: {len(files)} batches, {n_answer} answer tokens, {int(data['mask'].sum())} trained positions")
    if args.data_only:
        return {"data_seconds": t_data}

    # A run resumed from a checkpoint of the last step (one stopped while validating or evaluating) makes no
    # step: its metrics and seconds are those kept with the checkpoint (train), not NaN and ~0 s.
    dcfg, params, history, from_step, t_train = train(args, target, data, out_dir)
    summary = training_summary(history, from_step)
    print(f"trained {summary_line(dcfg.name, summary)}; data {t_data:.0f} s, training {t_train:.0f} s")
    report = {"name": args.name, "gamma": args.gamma, "data_seconds": t_data, "train_seconds": t_train, **summary}
    if val is not None:
        report["val"] = validate(dcfg, params, val, args.batch)
        print_val(report["val"], n_val)
    # The draft keeps its training report: a rerun after --no-eval (or a run stopped while evaluating) only
    # evaluates it (cached_draft).
    D.save_draft(final, dcfg, params, target.tokenizer, extra={"args": dict(vars(args)), "report": report})
    report["eval"] = {}
    if not args.no_eval:
        loaded = D.load_draft(final, target_config=target.config, tokenizer=target.tokenizer)
        report["eval"] = evaluate(target, loaded, args.gamma, args.eval_max_new, args.seed)
        report["eval_settings"] = eval_settings(args)
        print_eval(report["eval"], args.gamma)
        save_json(eval_path, report, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s; draft saved to {final}")
    return report


def main(argv=None) -> dict:
    return run(parse_args(argv))
