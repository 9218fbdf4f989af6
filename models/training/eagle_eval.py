"""The EAGLE trainer's evaluation (stage 5 of ``models.training.eagle``) and what it reports.

A saved head is evaluated on the held-out chat prompts (``prompts.EAGLE_EVAL_PROMPTS``) with ``jspec.decode``,
greedy and at T = 1: acceptance per draft position, and the training passes teacher-forced on the held-out greedy
answers (what position-1 acceptance tracks; the rollout computes exactly what training computes, see
tests/test_eagle.py). A finished head is never retrained: ``cached_head`` evaluates it again when its report has no
evaluation or one made with other settings (``stale_evaluation``), and ``export`` writes its bf16 copy.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec import decode as dec
from jspec.cost_model import conditional_rates_from_stats
from models import eagle as EG
from models import llama, registry
from models.training import runs
from models.training.data import encode
from models.training.prompts import EAGLE_EVAL_PROMPTS


def teacher_forced_hits(
    target, ecfg, hp, prompts: list[list[int]], answers: list[list[int]], unroll: int = 3
) -> np.ndarray:
    """[U, n] bool, per pass u < ``unroll`` (the training run's ``--unroll``) and answer pair i (i >= P - 1, in
    order): ``head_unrolled`` pass u, teacher-forced on the target's own features of prompt + answer, puts its
    argmax on the answer's actual token x_{i+2}. hp: the head's params with ``rows``
    (``EagleDrafter.draft_params`` next to an unpacked target)."""
    cfg = target.config
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    b, w = len(seqs), -(-max(len(s) for s in seqs) // 16) * 16
    toks = np.zeros((b, w), np.int32)
    for r, s in enumerate(seqs):
        toks[r, : len(s)] = s
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    _, raw, _ = EG.target_features(ecfg, target.params, jnp.asarray(toks), pos, llama.init_cache(cfg, b, w))
    feats = EG.fuse_features(ecfg, hp, raw)
    f_hat = EG.head_unrolled(ecfg, hp, target.params, feats[:, :-1], jnp.asarray(toks[:, 1:]), unroll)
    best = np.stack([np.asarray(jnp.argmax(EG.subset_logits(f_hat[u], hp["rows"]), -1)) for u in range(unroll)])
    pred = np.asarray(hp["token_ids"])[best]  # [U, B, w-1] token predicted for x_{i+2}
    hits = [np.zeros((unroll, 0), bool)]
    for r, s in enumerate(seqs):
        i = np.arange(len(prompts[r]) - 1, len(s) - 2)
        hits.append(pred[:, r, i] == toks[r, i + 2][None])
    return np.concatenate(hits, axis=1)


def teacher_forced_agreement(
    target, drafter, dparams, prompts: list[list[int]], answers: list[list[int]], unroll: int = 3
):
    """Per pass u < ``unroll``: the share of answer pairs at which pass u is right (``teacher_forced_hits``). The
    training computation on held-out text, against the full-vocabulary token (a token outside the draft
    vocabulary is a miss): for a greedy answer, pass 0 is the acceptance rate draft position 1 would have if a
    round started at every position."""
    hits = teacher_forced_hits(target, drafter.ecfg, dparams[1], prompts, answers, unroll)
    return (hits.sum(axis=1) / max(hits.shape[1], 1)).tolist()


def eval_numerics(target_params, head_params) -> dict:
    """What an evaluation computed with: ``evaluated_dtype``, the float dtypes of the head's own weights as the
    drafter read them (the LM-head rows it gathers from the target are the target's), and ``target_layout``:
    "stacked", "unstacked", or "packed" (the CPU kernel's layout, next to which the head's matrices are packed in
    bfloat16 by default)."""
    own = [x for k, v in head_params.items() if k not in ("token_ids", "rows") for x in jax.tree.leaves(v)]
    dtypes = sorted({jnp.dtype(x.dtype).name for x in own if jnp.issubdtype(x.dtype, jnp.floating)})
    tp = target_params
    layout = "packed" if llama.is_packed(tp) else "unstacked" if llama.is_unstacked(tp) else "stacked"
    return {"evaluated_dtype": "+".join(dtypes), "target_layout": layout}


def evaluate(target, path: str, gamma: int, max_new: int, seed: int = 0, unroll: int = 3) -> dict:
    """Acceptance per draft position on the held-out prompts, greedy and T = 1 (one decode each), and the
    teacher-forced agreement of the ``unroll`` training passes on the greedy answers
    (``teacher_forced_agreement``). Each row records what it computed with (``eval_numerics``): the saved head
    restored in the target's dtype (float32 here) on the target as loaded, not the bf16 ``--export``."""
    tok = target.tokenizer
    drafter, dparams = EG.load_eagle(path, target.config, target.params, max_draft=gamma)
    numerics = eval_numerics(dparams[0], dparams[1])
    ids = [encode(tok, p, 512) for p in EAGLE_EVAL_PROMPTS]
    res = {}
    for label, temp in (("greedy", 0.0), ("T=1", 1.0)):
        out = dec.decode(
            target.model,
            target.params,
            ids,
            drafter=drafter,
            draft_params=dparams,
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
            "survival": [a / p if p else None for a, p in zip(st["accepted_at"], st["proposed_at"])],
            "conditional": conditional_rates_from_stats(st["accepted_at"], st["proposed_at"]).tolist(),
            "new_tokens": sum(st["new_tokens"]),
            # Share of held-out output inside the draft vocabulary (the rest can only come from the residual).
            "coverage": float(np.isin(np.concatenate(out.tokens), np.asarray(dparams[1]["token_ids"])).mean()),
            **numerics,
        }
        if temp == 0.0:
            res[label]["teacher_forced"] = teacher_forced_agreement(target, drafter, dparams, ids, out.tokens, unroll)
    return res


def print_eval(ev: dict, gamma: int):
    for label, r in ev.items():
        surv = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["survival"])
        cond = " ".join(f"{x:.2f}" for x in r["conditional"])
        print(
            f"held-out {label:6s} K={gamma}: tokens/round {r['tokens_per_round']:.2f}, acceptance "
            f"{r['acceptance_rate']:.3f}; per position: accepted/proposed [{surv}], conditional [{cond}] "
            f"({r['new_tokens']} tokens, {100 * r.get('coverage', float('nan')):.1f}% inside the draft vocabulary)"
        )
        if "teacher_forced" in r:
            tf = " ".join(f"{x:.2f}" for x in r["teacher_forced"])
            print(f"held-out {label:6s} teacher-forced agreement per training pass on the answers: [{tf}]")


# ---- which evaluation a report holds -----------------------------------------------------------------------


def eval_settings(args) -> dict:
    """What the held-out evaluation depends on besides the head: a cached head whose report was made with other
    values is evaluated again (not retrained). ``unroll``: the teacher-forced passes measured."""
    return {
        "gamma": args.gamma,
        "eval_max_new": args.eval_max_new,
        "seed": args.seed,
        "unroll": args.unroll,
        "prompts": list(EAGLE_EVAL_PROMPTS),
    }


def recorded_eval_settings(report: dict) -> dict:
    """``eval_settings`` of a report's evaluation. A report made before they were recorded ran with its
    ``gamma`` and the arguments it records; its teacher-forced passes were 3 whatever ``--unroll`` was, and its
    prompts were not recorded (they are not compared)."""
    if "eval_settings" in report:
        return report["eval_settings"]
    a = report.get("args", {})
    return {"gamma": report.get("gamma"), **{k: a[k] for k in ("eval_max_new", "seed") if k in a}, "unroll": 3}


def stale_evaluation(report: dict, args) -> list[str]:
    """Why ``report``'s held-out evaluation is not the one this run would make: [] when it is, ["none"] when it
    has none, else the evaluation settings that differ (``eval_settings``)."""
    if not report.get("eval"):
        return ["none"]
    return runs.differences(recorded_eval_settings(report), eval_settings(args))


# Keys save_head adds to the report it keeps in the head's meta.json (the rest is the report, less "eval").
_HEAD_META = frozenset({"format", "kind", "config", "adapter_width", "head_tokens", "target"})


def cached_head(args, final: str, eval_path: str) -> dict:
    """A finished head under --name is never retrained (``--force`` does that): its report is eval.json, or
    for a head never evaluated (``--no-eval``, or a run that stopped during the evaluation) the training
    metrics its meta.json keeps. The evaluation runs (again) when there is none or it was made with other
    ``eval_settings``, unless ``--no-eval``; then it is printed and exported."""
    if os.path.isfile(eval_path):
        with open(eval_path) as f:
            report = json.load(f)
    else:
        with open(os.path.join(final, "meta.json")) as f:
            report = {k: v for k, v in json.load(f).items() if k not in _HEAD_META}
        report["eval"] = {}
    print(f"cached head at {final} (--force retrains)")
    stale = stale_evaluation(report, args)
    if stale and not args.no_eval:
        why = "it was never evaluated" if stale == ["none"] else f"evaluation settings changed: {', '.join(stale)}"
        print(f"evaluating it ({why})")
        target = registry.load(args.model, dtype="float32")
        report["eval"] = evaluate(target, final, args.gamma, args.eval_max_new, args.seed, args.unroll)
        report["gamma"], report["eval_settings"] = args.gamma, eval_settings(args)
        with open(eval_path, "w") as f:
            json.dump(report, f, indent=1)
    elif stale and stale != ["none"]:
        print(f"(evaluated with other settings: {', '.join(stale)}; --no-eval does not evaluate it again)")
    if report["eval"]:
        print_eval(report["eval"], report["gamma"])
    else:
        print("not evaluated (--no-eval)")
    export(args, final, report)
    return report


EXPORT_DTYPE = "bfloat16"


def export(args, final: str, report: dict) -> None:
    """``--export DIR``: the head in bf16 with its held-out evaluation and the settings it ran with
    (``eval_settings``) in meta.json (``models.eagle.export_head``), and what that evaluation computed with next to
    the export's ``stored_dtype``: ``evaluated_dtype`` and ``evaluated_layout`` (``eval_numerics``; "not
    recorded" for an evaluation made before they were), with ``eval_note`` saying the bf16 rounding was not what
    was evaluated when the two differ."""
    if not args.export:
        return
    extra = {"eval": report.get("eval", {})}
    if extra["eval"]:
        extra["eval_settings"] = recorded_eval_settings(report)
        row = next(iter(extra["eval"].values()))
        dtype = row.get("evaluated_dtype", "not recorded")
        extra.update(evaluated_dtype=dtype, evaluated_layout=row.get("target_layout", "not recorded"))
        if dtype != EXPORT_DTYPE:
            extra["eval_note"] = (
                f"the held-out metrics were measured with the head's weights in {dtype} on a "
                f"{extra['evaluated_layout']} target, before the export stored them in {EXPORT_DTYPE}: the exported "
                "head's rounding was not evaluated"
            )
    out = EG.export_head(final, args.export, dtype=EXPORT_DTYPE, extra_meta=extra)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"exported (bf16) to {out}: {size / 1e6:.1f} MB")
