"""``python -m jspec generate``: run a real checkpoint with or without speculation (checkpoints and trained
drafters are found through entry points: ``jspec.loaders``). ``python -m jspec demo`` is ``make run``'s
demonstration (``jspec.demo``), ``python -m jspec bench`` runs the benchmark suite, ``python -m jspec serve`` the
OpenAI-compatible HTTP server (``jspec.server``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

from jspec import validate as V
from jspec.decode import prepare
from jspec.drafters import ModelForm, TreeForms
from jspec.loaders import (
    COMPILE_CACHE_DEFAULT,
    LAYER_LAYOUTS,
    compile_cache_flag,
    end_ids,
    load_model,
    model_loader,
    wants_unstacked,
)
from jspec.model import Model
from jspec.state import StopReason
from jspec.stop import StopStrings
from jspec.validate import DEFAULT_GAMMA

# The last four come from the ``jspec.drafter_loaders`` entry points (this repository's ``models``).
DRAFTERS = ("none", "ngram", "ngram-tree", "model", "draft", "layerskip", "eagle")
TRAINED_DRAFTERS = ("model", "draft", "layerskip", "eagle")  # loaded through jspec.drafter_loaders
GOODPUT_HELP = (
    "each round, the K (0, 1, 2 or 4; a tree: a plain step or the tree) that commits most tokens per second, from "
    "round costs measured once per situation: the default where the drafter can change K and neither --gamma nor "
    "--adaptive fixes it; --no-goodput: the fixed K"
)


def build_drafter(args, target, loaded=None):
    """-> (drafter, draft_params) for the --drafter choice.

    loaded: the target as its loader returned it (config, params, model, tokenizer); the trained drafters'
    loaders need it (LayerSkip and EAGLE read the target's own weights; a draft is checked against its
    tokenizer). A loader ``fn(spec, loaded, max_draft) -> (drafter or Model, draft params)``."""
    if args.drafter == "none":
        return None, None
    ngram = (_given(args, "ngram_max", 3), _given(args, "ngram_min", 1))
    if args.drafter == "ngram":
        from jspec.ngram import NgramDrafter

        return NgramDrafter(*ngram, vocab_size=target.vocab_size), None
    if args.drafter == "ngram-tree":
        from jspec.ngram import NgramTreeDrafter

        depth = _given(args, "gamma", DEFAULT_GAMMA)  # its chains' length: the tree's depth
        return NgramTreeDrafter(_given(args, "branches", 3), depth, *ngram, vocab_size=target.vocab_size), None
    if args.drafter in TRAINED_DRAFTERS:
        fn = model_loader("jspec.drafter_loaders", args.drafter)
        drafter, dparams = fn(args.draft_model, loaded, _given(args, "gamma", DEFAULT_GAMMA))
        if isinstance(drafter, Model):  # a plain draft model: chain or tree as the flags say
            drafter = _model_drafter(args, drafter)
        elif (args.tree or args.dynamic_tree) and isinstance(drafter, ModelForm):
            # A drafter that can also run as a stand-alone draft model (LayerSkip's exit) builds trees as one.
            dmodel, dparams = drafter.as_model(dparams)
            drafter = _model_drafter(args, dmodel)
        elif args.tree and args.dynamic_tree:
            raise ValueError("--tree and --dynamic-tree are exclusive")
        elif args.tree and isinstance(drafter, TreeForms):
            # A drafter with a tree form of its own (EAGLE: the head needs the target's features per node).
            drafter = drafter.as_tree(*_tree_spec(args))
        elif args.dynamic_tree and isinstance(drafter, TreeForms):
            drafter = drafter.as_dynamic_tree(*_dynamic_tree_args(args))
        elif args.tree or args.dynamic_tree:
            flag = "--dynamic-tree" if args.dynamic_tree else "--tree"
            raise ValueError(f"{flag} does not apply to --drafter {args.drafter}")
        return drafter, dparams
    raise SystemExit(f"unknown drafter '{args.drafter}'; choose from {', '.join(DRAFTERS)}")


def _given(args, name: str, default):
    """A flag whose default is None so that check_flags can tell "given" from "defaulted"."""
    value = getattr(args, name, None)
    return default if value is None else value


# Flags that only some drafters read: given to another drafter they would be ignored, so they are refused.
_FLAG_DRAFTERS = {
    "draft_model": TRAINED_DRAFTERS,
    "tree": TRAINED_DRAFTERS,
    "dynamic_tree": TRAINED_DRAFTERS,
    "branches": ("ngram-tree",),
    "ngram_max": ("ngram", "ngram-tree"),
    "ngram_min": ("ngram", "ngram-tree"),
}


def tree_flag(args) -> str | None:
    """The flag that makes the drafter a tree (--tree, --dynamic-tree, --drafter ngram-tree), or None."""
    tree = "--tree" if args.tree else "--dynamic-tree" if args.dynamic_tree else None
    return tree or ("--drafter ngram-tree" if args.drafter == "ngram-tree" else None)


def check_chain_flags(args, tree: str | None) -> None:
    """Refuse the chain-only flags (--adaptive, --block-verify) with a tree (``tree``: ``tree_flag(args)``)."""
    if args.adaptive and tree:
        raise ValueError(f"--adaptive drafts a chain's K or nothing per row, which {tree} excludes")
    if args.block_verify and tree:
        raise ValueError(f"--block-verify verifies a chain's candidates as one block, which {tree} excludes")


def check_flags(args) -> None:
    """Refuse flag combinations in which a flag would be silently ignored (before any model is loaded)."""
    for name, drafters in _FLAG_DRAFTERS.items():
        if getattr(args, name) is not None and args.drafter not in drafters:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} does not apply to --drafter {args.drafter} (read by: {', '.join(drafters)})")
    if args.tree_budget is not None and args.tree is None:
        raise ValueError("--tree-budget applies to --tree")
    if args.tree_rule is not None and args.tree is None:
        raise ValueError("--tree-rule applies to --tree (an --dynamic-tree chooses its children deterministically)")
    if args.drafter == "none" and (args.adaptive or args.block_verify or args.goodput is not None):
        raise ValueError(
            "--adaptive, --block-verify and --[no-]goodput need a drafter (--drafter none decodes plainly)"
        )
    check_chain_flags(args, tree_flag(args))
    if args.goodput and (args.gamma is not None or args.adaptive):
        flag = "--gamma (a fixed K)" if args.gamma is not None else "--adaptive"
        raise ValueError(f"--goodput chooses K each round, which {flag} excludes")
    if args.drafter == "none" and (args.gamma is not None or args.compare):
        flag = "--gamma" if args.gamma is not None else "--compare"
        raise ValueError(f"{flag} needs a drafter (--drafter none decodes plainly)")
    if args.gamma is not None and args.gamma < 1:
        raise ValueError(f"--gamma {args.gamma}: a drafter drafts K >= 1 tokens a round (--drafter none for plain)")
    if args.gamma is not None and (args.tree or args.dynamic_tree):
        flag = "--tree" if args.tree else "--dynamic-tree"
        raise ValueError(f"--gamma does not apply with {flag}: a tree drafts to its depth, which its shape sets")
    if args.stream and args.json:
        raise ValueError("--stream prints the text as it is generated; --json prints one object at the end")
    if args.system is not None and args.raw:
        raise ValueError("--system needs the chat template, which --raw turns off")
    if args.tree is not None and not all(p.strip().isdigit() for p in args.tree.split(",")):
        raise ValueError(f"--tree wants comma-separated branching factors (e.g. 3,2,1), got '{args.tree}'")
    if args.dynamic_tree is not None:
        _dynamic_tree_args(args)  # its format, before any model is loaded
    if args.min_tokens < 0 or args.min_tokens > args.max_new_tokens:
        raise ValueError(f"--min-tokens {args.min_tokens} must be in [0, --max-new-tokens ({args.max_new_tokens})]")
    if args.min_tokens and args.ignore_eos and args.stop_token_ids is None and not args.stop:
        raise ValueError(
            "--min-tokens with --ignore-eos holds back nothing: there is no end token (--stop-token-ids) or "
            "--stop string to keep back"
        )
    # The request's values, by the checks decode runs (named as flags), before a model loads: its vocabulary (the
    # ids' range) is checked by decode itself.
    with V.as_flags(_REQUEST_FLAGS):
        V.sampling_params(
            1,
            args.temperature,
            args.top_k,
            args.top_p,
            args.min_p,
            stop_token_ids(args),
            logit_bias=logit_bias(args),
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        )
        V.check_top_logprobs(args.top_logprobs, logprobs=True)  # its range; --logprobs below
        V.check_seed(args.seed)
    if args.top_logprobs and not args.logprobs:
        raise ValueError("--top-logprobs needs --logprobs (the chosen tokens' log-probabilities come with them)")
    if args.stop is not None:
        try:
            V.check_stop_strings(args.stop)
        except ValueError as e:
            raise ValueError(f"--stop: {e}") from None
    V.check_greedy_filters(args.temperature, args.top_k, args.top_p, args.min_p)


# decode's keywords that are flags of ``generate`` (``jspec.validate``'s messages name them)
_REQUEST_FLAGS = (
    "temperature", "top_k", "top_p", "min_p", "stop_token_ids", "logit_bias", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "top_logprobs", "seed",
)  # fmt: skip


def stop_token_ids(args) -> list[int]:
    """--stop-token-ids as a list of ids ([] without it); their range is checked against the model's vocabulary
    by ``jspec.decode.prepare``."""
    if args.stop_token_ids is None:
        return []
    parts = [p.strip() for p in args.stop_token_ids.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--stop-token-ids wants comma-separated token ids (e.g. 2,7), got '{args.stop_token_ids}'")
    return [int(p) for p in parts]


def logit_bias(args) -> dict[int, float] | None:
    """--logit-bias ID:BIAS,... as a dict (None without it); the biases' range is checked by
    ``jspec.validate.sampling_params``, the ids against the model's vocabulary by ``decode``."""
    if args.logit_bias is None:
        return None
    out: dict[int, float] = {}
    for part in args.logit_bias.split(","):
        tid, sep, val = part.partition(":")
        try:
            if not sep or not tid.strip().isdigit():
                raise ValueError
            tid, bias = int(tid), float(val)
        except ValueError:
            raise ValueError(
                f"--logit-bias wants comma-separated TOKEN_ID:BIAS pairs (e.g. 2:-100,7:1.5 or 2:-inf), got "
                f"'{args.logit_bias}'"
            ) from None
        if tid in out:
            raise ValueError(f"--logit-bias names token {tid} twice")
        out[tid] = bias
    return out


def _tree_spec(args):
    """(TreeSpec, TreeRule) from --tree, --tree-budget and --tree-rule."""
    from jspec.tree import TreeRule, TreeSpec

    spec = TreeSpec(tuple(int(c) for c in args.tree.split(",")), args.tree_budget)  # format: check_flags
    return spec, TreeRule[_given(args, "tree_rule", "deterministic").upper().replace("-", "_")]


def _dynamic_tree_args(args) -> tuple[int, int, int]:
    """(top_k, depth, budget) from --dynamic-tree TOP_K,DEPTH,BUDGET."""
    parts = args.dynamic_tree.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--dynamic-tree wants TOP_K,DEPTH,BUDGET (three integers), got '{args.dynamic_tree}'")
    top_k, depth, budget = (int(p) for p in parts)
    return top_k, depth, budget


def _model_drafter(args, dmodel):
    """A chain drafter, or a tree drafter when --tree / --dynamic-tree is given."""
    from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter

    if args.tree and args.dynamic_tree:
        raise ValueError("--tree and --dynamic-tree are exclusive")
    if args.tree:
        return TreeModelDrafter(dmodel, *_tree_spec(args))
    if args.dynamic_tree:
        top_k, depth, budget = _dynamic_tree_args(args)
        return DynamicTreeDrafter(dmodel, top_k=top_k, depth=depth, budget=budget)
    return ModelDrafter(dmodel)


def _stream_timed(prepared, tok, out, stops=(), min_tokens=0):
    """Decode round by round, writing the text to ``out`` as it grows; the statistics of ``run_timed``.
    ``seconds`` time the steps alone (each with its host sync), not the detokenizing and printing between them,
    whose cost grows with the rounds and the text: plain decoding, with more rounds, would pay more of it.
    stops: stop strings (``jspec.stop``): the decode ends at the round that completes one, the tokens after it
    are dropped from the output (``kept_tokens``; the statistics and the rate count every token decoded) and the
    stop reason is STOP_STRING; with ``min_tokens``, only a string completed after the first min_tokens counts. The
    text written holds back its last characters while they could begin a stop string, so no part of one
    reaches ``out`` (``StopStrings.visible``)."""
    t0 = time.perf_counter()
    fns = prepared.compile_stream()
    compile_s = time.perf_counter() - t0
    stream = prepared.stream(fns)
    shown, seconds = "", 0.0
    checker = StopStrings(stops, lambda x: tok.decode(x, skip_special_tokens=True), min_tokens)
    while True:
        t = time.perf_counter()
        chunk = next(stream, None)
        seconds += time.perf_counter() - t
        if chunk is None or checker.feed(chunk[0]) is not None:  # at a stop string, the text ends before it
            break
        # A tokenizer may rewrite earlier text as more arrives: only a stable extension of what is on the screen
        # is written.
        text = checker.visible()
        if text.startswith(shown):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    result = stream.output()
    ids = checker.tokens
    if checker.matched is not None:  # the state ran the stopping round to its end
        result.cut(0, len(ids), StopReason.STOP_STRING)
    text = checker.visible(final=True)
    rest = text[len(shown) :] if text.startswith(shown) else f"\n[the text above changed as it grew; in full:]\n{text}"
    print(rest, file=out)
    total = sum(result.stats["new_tokens"])
    result.stats.update(compile_seconds=compile_s, seconds=seconds, tokens_per_s=total / seconds)
    return result


def _run(target, params, prompt_ids, drafter, dparams, args, eos, max_len=None, stream=None):
    """One timed decode; with ``stream`` = (tokenizer, file), stepped round by round and written to the file."""
    prepared = prepare(
        target,
        params,
        [prompt_ids],
        max_len=max_len,
        drafter=drafter,
        draft_params=dparams,
        gamma=args.gamma if drafter is not None else None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        eos_ids=eos,
        stop_token_ids=stop_token_ids(args),
        min_tokens=args.min_tokens,
        stop_strings=[bool(args.stop)],  # what --min-tokens holds back besides end tokens (the stream's check)
        logit_bias=logit_bias(args),
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        adaptive=args.adaptive and drafter is not None,  # --compare's plain run has no draft to adapt
        goodput=args.goodput if drafter is not None else None,
        block_verify=args.block_verify and drafter is not None,
        logprobs=args.logprobs,  # on both sides of --compare, so that they time the same work
        top_logprobs=args.top_logprobs,
    )
    if stream is None:
        out = prepared.run_timed()
    else:
        out = _stream_timed(prepared, *stream, stops=args.stop or (), min_tokens=args.min_tokens)
    st = out.stats
    return out.tokens[0], {
        "logprobs": out.logprobs[0] if out.logprobs is not None else None,
        "top_logprobs": out.top_logprobs[0] if out.top_logprobs is not None else None,
        "new_tokens": st["new_tokens"][0],  # decoded (with --stop, tokens past the string too)
        "kept_tokens": len(out.tokens[0]),
        "gamma": prepared.config.gamma,  # the K the loop ran: a tree's depth for tree drafters
        "draft_lengths": list(prepared.config.draft_lengths),  # the K a round could choose (--goodput: several)
        "k_rounds": st["k_rounds"],  # rounds at each of them
        "cache_slots": prepared.config.slots,
        "rounds": st["rounds"][0],
        "tokens_per_round": st["tokens_per_round"],
        "acceptance_rate": st["acceptance_rate"],
        "proposed": st["proposed"],
        "accepted": st["accepted"],
        "accepted_at": st["accepted_at"],
        "proposed_at": st["proposed_at"],
        "stop_reason": out.stop_reason[0].name.lower(),
        "seconds": st["seconds"],
        "tokens_per_s": st["tokens_per_s"],
        "compile_seconds": st["compile_seconds"],
    }


def generate(args) -> int:
    check_flags(args)
    load = model_loader()
    loaded = load_model(load, args.model, args.dtype, unstacked=wants_unstacked(args.layers))
    _, params, target, tok = loaded
    if tok is None:
        raise SystemExit(f"'{args.model}' has no tokenizer; jspec generate needs one")
    if args.raw:
        prompt_ids = tok.encode(args.prompt)
    else:
        # An empty --system "" is an empty system turn (as transformers renders it), not the template's default.
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = tok.encode_chat(msgs)
    eos = [] if args.ignore_eos else end_ids(tok)
    drafter, dparams = build_drafter(args, target, loaded)
    # Stop strings need the text between rounds: the decode steps round by round (into nothing without --stream).
    stream = (tok, sys.stdout) if args.stream else ((tok, io.StringIO()) if args.stop else None)
    ids, stats = _run(target, params, prompt_ids, drafter, dparams, args, eos, stream=stream)
    stats.update(drafter=args.drafter)
    logprobs = stats.pop("logprobs")
    tops = stats.pop("top_logprobs")
    # With --min-tokens a stop string counts only where it ends after the first min_tokens tokens' text (as the
    # stream's check).
    floor = len(tok.decode(ids[: args.min_tokens], skip_special_tokens=True)) if args.min_tokens else 0
    text, matched = StopStrings.cut(tok.decode(ids, skip_special_tokens=True), args.stop or (), floor)
    result = {
        "text": text,
        "token_ids": ids,
        "prompt_tokens": len(prompt_ids),
        "stats": stats,
    }
    if args.stop:
        result["stop"] = matched  # the stop string that ended the answer, or None
    if logprobs is not None:
        result["logprobs"] = logprobs
    if tops is not None:
        result["top_logprobs"] = [[[i, tok.decode([i]), lp] for i, lp in pos] for pos in tops]
    if args.compare and drafter is not None:
        # The same cache as the speculative run (a tree's default reserves its scratch): attention reads every slot.
        # Streamed too under --stream (into nothing): both sides pay a host sync per round.
        quiet = (tok, io.StringIO()) if args.stream or args.stop else None
        plain_ids, plain = _run(
            target, params, prompt_ids, None, None, args, eos, max_len=stats["cache_slots"], stream=quiet
        )
        plain.pop("logprobs")
        plain.pop("top_logprobs")
        result["plain"] = {"token_ids": plain_ids, "stats": plain}
        result["identical_to_plain"] = plain_ids == ids
        ratio = stats["tokens_per_s"] / plain["tokens_per_s"]
        if args.temperature == 0 or result["identical_to_plain"]:
            result["speedup"] = ratio
        else:
            # Sampling drew other outputs on the two sides (other lengths, other stops), and each rate includes its
            # prefill, a larger share of a shorter output: the ratio of the rates is no speed-up of the same work.
            result["speedup"] = None
            result["tokens_per_s_ratio"] = ratio
            result["not_like_for_like"] = (
                f"sampled outputs differ (speculative {len(ids)} tokens, plain {len(plain_ids)}); each rate includes "
                "its prefill"
            )
    if args.json:
        print(json.dumps(result))
        return 0
    if not args.stream:  # else already written
        print(result["text"])
    print(_stats_line(args.drafter if drafter is not None else "none", stats), file=sys.stderr)
    if logprobs is not None:
        print(f"[log-probability of the {len(logprobs)} generated tokens: {sum(logprobs):.4f}]", file=sys.stderr)
    for i, alts in enumerate(result.get("top_logprobs", [])):
        shown = "  ".join(f"{text!r} {lp:.3f}" for _, text, lp in alts)
        print(f"[{i}] {tok.decode([ids[i]])!r} {logprobs[i]:.3f} | {shown}", file=sys.stderr)
    if "plain" in result:
        print(_stats_line("plain", result["plain"]["stats"]), file=sys.stderr)
        if result["speedup"] is None:  # sampling, other outputs: the two rates are not over the same work
            p = result["plain"]["stats"]
            print(
                f"[no speedup: not like for like at --temperature {args.temperature}: the sampled outputs differ "
                f"(same distribution, other draws): speculative {stats['new_tokens']} tokens at "
                f"{stats['tokens_per_s']:.1f} tok/s, plain {p['new_tokens']} tokens at {p['tokens_per_s']:.1f} tok/s, "
                "each rate with its prefill; --temperature 0 compares the same output]",
                file=sys.stderr,
            )
        else:
            if result["identical_to_plain"]:
                same = "identical"
            else:  # greedy must match token for token: a float near-tie, or a bug
                same = "DIFFERENT from greedy plain decoding (a float near-tie between two tokens, or a bug)"
            print(
                f"[speedup {result['speedup']:.2f}x over plain decoding, measured in this run; output {same}]",
                file=sys.stderr,
            )
    return 0


def _stats_line(name, s) -> str:
    acc = "" if name in ("none", "plain") else f", acceptance {s['acceptance_rate']:.2f}"
    if len(s.get("draft_lengths", ())) > 1:  # --goodput: how often each K was chosen
        acc += ", rounds at K " + " ".join(f"{k}:{n}" for k, n in zip(s["draft_lengths"], s["k_rounds"]))
    return (
        f"[{name}: {s['new_tokens']} tokens in {s['rounds']} rounds ({s['tokens_per_round']:.2f}/round{acc}), "
        f"{s['seconds']:.2f} s, {s['tokens_per_s']:.1f} tok/s, compile {s['compile_seconds']:.1f} s, "
        f"stop: {s['stop_reason']}]"
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark suite has its own options
        from jspec.bench.suite import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["report"]:  # the README's results table and docs/results.md, from docs/results/*.json
        from jspec.bench.render import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["costs"]:  # the measured round costs a goodput policy chooses K from
        from jspec.costs import main as costs_main

        return costs_main(argv[1:])
    if argv[:1] == ["serve"]:  # the OpenAI-compatible HTTP server (jspec.server)
        from jspec.server.launch import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["demo"]:  # make run: speculative against plain decoding on a code-editing request
        from jspec.demo import main as demo_main

        return demo_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m jspec", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run the default benchmark suite (python -m jspec bench --help)")
    sub.add_parser("costs", help="measure and print round costs at each K (python -m jspec costs --help)")
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server (python -m jspec serve --help)")
    sub.add_parser("demo", help="speculative vs plain decoding on a code-editing request (python -m jspec demo --help)")
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="optional system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--drafter", default="ngram", choices=DRAFTERS)
    g.add_argument(
        "--draft-model",
        default=None,
        help="--drafter model: a model sharing the tokenizer; draft/eagle: a trained draft or head (directory or "
        "cache name; eagle without one: the head bundled for SmolLM2); layerskip: a trained exit adapter, or "
        "exit:E for the bare first E layers",
    )
    g.add_argument(
        "--gamma",
        type=int,
        default=None,
        help=f"K, candidates every round of a chain drafter (default: up to {DEFAULT_GAMMA}, chosen each round, see "
        "--goodput); --drafter ngram-tree: its depth",
    )
    g.add_argument("--adaptive", action="store_true", help="per row, draft K or nothing, from the measured acceptance")
    g.add_argument("--goodput", action=argparse.BooleanOptionalAction, default=None, help=GOODPUT_HELP)
    g.add_argument("--block-verify", action="store_true", help="block verification of chains (Sun et al.)")
    g.add_argument(
        "--tree", default=None, help="static tree (model drafters, LayerSkip, EAGLE): branching per depth, e.g. 3,2,1"
    )
    g.add_argument("--tree-budget", type=int, default=None, help="keep the first N nodes of --tree")
    g.add_argument(
        "--tree-rule",
        default=None,
        choices=("deterministic", "iid", "without-replacement"),
        help="how --tree's children are drawn (default deterministic: the most likely tokens)",
    )
    g.add_argument(
        "--dynamic-tree", default=None, help="EAGLE-2 style tree (model drafters, LayerSkip, EAGLE): TOP_K,DEPTH,BUDGET"
    )
    g.add_argument("--branches", type=int, default=None, help="continuations of --drafter ngram-tree (default 3)")
    g.add_argument("--ngram-max", type=int, default=None, help="longest suffix n-gram looked up (default 3)")
    g.add_argument("--ngram-min", type=int, default=None, help="shortest suffix n-gram looked up (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="run past the model's end tokens (not --stop-token-ids)")
    g.add_argument(
        "--stop-token-ids",
        default=None,
        help="comma-separated token ids that also end the answer, emitted as an end token is (vLLM's stop_token_ids)",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="end tokens (EOS, --stop-token-ids) and --stop strings cannot come before this many tokens "
        "(vLLM's min_tokens)",
    )
    g.add_argument(
        "--logit-bias",
        default=None,
        help="TOKEN_ID:BIAS,... added to the target's logits before sampling (OpenAI's logit_bias; -inf bans a token)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide (multiply, when not positive) the logits of tokens in the prompt or the answer by it; 1 = off",
    )
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtracted once per token already in the answer"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence of a token in the answer"
    )
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the answer before this text (repeatable; vLLM's stop): decoded round by round to find it",
    )
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    g.add_argument(
        "--layers",
        default="auto",
        choices=LAYER_LAYOUTS,
        help="target (and draft model) weights: unstacked decodes 1.6-2x faster on CPU (per-layer arrays, on the "
        "CPU kernels of models.cpu_kernels where they build) and verifies drafts cheaper on a GPU, stacked compiles "
        "~2-3x faster; auto = unstacked on CPU and GPU, stacked on other backends",
    )
    g.add_argument(
        "--compile-cache",
        default=None,
        help="persistent XLA compilation cache directory ('none' to disable): a second run with the same shapes "
        f"skips compilation; default $JAX_COMPILATION_CACHE_DIR when set, else {COMPILE_CACHE_DEFAULT} "
        "($JSPEC_COMPILE_CACHE); given, it wins",
    )
    g.add_argument(
        "--compare",
        action="store_true",
        help="also run plain decoding and report the speedup (at --temperature > 0, unless the outputs match, each "
        "side's tokens/s: the sampled outputs differ, so no speedup)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument(
        "--stream",
        action="store_true",
        help="print the text round by round as it is generated (rounds stepped from Python, one host sync each)",
    )
    g.add_argument(
        "--logprobs",
        action="store_true",
        help="the target's log-probability of each generated token (in --json output; else their sum on stderr)",
    )
    g.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        help="with --logprobs: the N (<= 20) most likely tokens at each generated position, with their "
        "log-probabilities (in --json output as [id, text, logprob]; else each token's on stderr)",
    )
    args = ap.parse_args(argv)
    try:
        check_flags(args)  # before anything is set up
        compile_cache_flag(args.compile_cache)
        return generate(args)
    except (ValueError, OSError) as e:  # bad input (a missing or unreadable path too): a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
