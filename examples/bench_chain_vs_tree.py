"""Chain vs tree speculation at one verification budget (seed section 6), same draft model, same prompts.

For each budget N (positions the target verifies per round, the pending token included):
- chain: K = N - 1 candidates from the draft (``ModelDrafter``), one K+1-wide target call;
- static trees: ``TreeSpec((w, 1, 1, ...), budget=N)`` for w = 2 and 4 branches at the root, N nodes
  verified under the ancestor mask (``TreeModelDrafter``); the wide one suits a draft whose first guess is
  often wrong but whose top 4 often hold the target's token;
- dynamic tree: EAGLE-2 style ``DynamicTreeDrafter(model, top_k=..., depth=..., budget=N)``.
All greedy (the deterministic tree rule) and all through the continuous-batching engine, plain decoding as
the reference, at closed-loop concurrency 1 and --concurrency. The tables report tokens per round (accepted
path length + 1) next to throughput: a tree may accept longer paths and still lose on time, since it spends
its budget on branches and on a per-level draft rollout.

The draft is ``--draft-layers L`` (the target's first L layers, no training) or ``--draft NAME`` (distilled
by examples/train_draft.py); ``--layerskip NAME|exit:E`` compares LayerSkip's own chain (early-layer K/V shared
with the target) with trees drafted by the same exit as a stand-alone model; ``--ngram`` the n-gram drafter,
whose trees are b continuations x depth: they verify 1 + b * depth <= N nodes, so at a budget b does not
divide (N - 1) they verify FEWER positions than the chain (their labels give their own N and the budget).
--budgets (N >= 2), --widths (each root width at most N - 1), --rules and --concurrency (entries >= 2) are checked
before the model loads, every tree built then. Writes <out>/chain_vs_tree.{json,md} and plots.

    python examples/bench_chain_vs_tree.py [--budgets 5,8] [--draft-layers 4 | --draft NAME | --layerskip NAME]
        [--widths 2,4] [--no-dynamic] [--n 2] [--concurrency 4,16]
"""

from __future__ import annotations

import argparse
import math
import time

from jspec.bench import headlines, plotting, report, runspec, serving_record, suite_runs, targets
from jspec.bench.args import add_common_args, config_from_args, int_list, list_flag, make_out_dir
from jspec.bench.runspec import Load, Spec
from jspec.drafters import DynamicTreeDrafter, ModelDrafter, TreeModelDrafter
from jspec.tree import TreeRule, TreeSpec, check_dynamic_tree
from models.bench_drafts import check_draft_layers, distilled_draft, truncated_draft


def static_tree(budget: int, width: int = 2) -> TreeSpec:
    """``width`` branches at the root (at most budget - 1), then single children, cut to ``budget`` nodes in
    breadth-first order."""
    if not 1 <= width <= budget - 1:
        raise ValueError(f"a root width of {width} does not fit budget N={budget}: it must be in [1, {budget - 1}]")
    depth = max(1, math.ceil((budget - 1) / width))
    return TreeSpec((width,) + (1,) * (depth - 1), budget=budget)


def _rule_suffix(rule: TreeRule, rules) -> str:
    """Labels name the rule only when a run compares several (the default, deterministic, stays unnamed)."""
    return "" if len(rules) == 1 and rule == TreeRule.DETERMINISTIC else f" {rule.name.lower().replace('_', '-')}"


def static_tree_specs(model, params, n: int, widths, rules=(TreeRule.DETERMINISTIC,), prefix="static tree"):
    """One ``TreeModelDrafter`` row per (root width, rule) at budget N, drafted by ``model``."""
    specs = []
    for width in widths:
        st = static_tree(n, width)
        for rule in rules:
            name = f"{prefix} {st.branching} (N={st.num_nodes})" + _rule_suffix(rule, rules)
            specs.append(Spec(name, TreeModelDrafter(model, st, rule), st.max_depth, params, peer="tree"))
    return specs


def dynamic_shape(n: int) -> tuple[int, int]:
    """(top_k, depth) of the dynamic tree at budget N."""
    return min(4, n - 1), max(2, min(n - 1, 4))


def specs_for_budget(model, params, n: int, widths=(2, 4), dynamic: bool = True, rules=(TreeRule.DETERMINISTIC,)):
    chain = Spec(f"chain K={n - 1} (N={n})", ModelDrafter(model), n - 1, params, peer="chain")
    trees = static_tree_specs(model, params, n, widths, rules)
    top_k, depth = dynamic_shape(n)
    dyn = Spec(
        f"dynamic tree k={top_k} d={depth} (N={n})",
        DynamicTreeDrafter(model, top_k=top_k, depth=depth, budget=n),
        depth,
        params,
        peer="tree",
    )
    return [chain, *trees, *([dyn] if dynamic else [])]


def layerskip_specs_for_budget(target, spec: str, n: int, widths=(2, 4), rules=(TreeRule.DETERMINISTIC,)) -> list[Spec]:
    """LayerSkip self-speculation at budget N: its chain (K = N - 1, early-layer K/V shared with the target)
    vs static trees drafted by the same exit as a stand-alone model (``LayerSkipDrafter.as_model``)."""
    from models.registry import load_layerskip_drafter

    drafter, dparams = load_layerskip_drafter(spec, target, n - 1)
    chain = Spec(f"layerskip chain K={n - 1} (N={n})", drafter, n - 1, dparams, peer="chain")
    model, mparams = drafter.as_model(dparams)
    return [chain, *static_tree_specs(model, mparams, n, widths, rules, prefix="layerskip tree")]


def ngram_specs_for_budget(target, n: int) -> list[Spec]:
    """The n-gram drafter at budget N: a K = N - 1 chain vs trees of b continuations x depth (1 + b*depth <= N),
    for each b in (2, 3) that fits. A tree verifies as many positions as the chain (N) only when b divides
    N - 1; otherwise it verifies fewer, and its label says so ("N=7 of budget 8"): not an equal-budget row."""
    from jspec.ngram import NgramDrafter, NgramTreeDrafter

    v = target.config.vocab_size
    specs = [Spec(f"ngram chain K={n - 1} (N={n})", NgramDrafter(vocab_size=v), n - 1, None, peer="chain")]
    for b in (2, 3):
        depth = (n - 1) // b
        if depth >= 1:
            d = NgramTreeDrafter(b, depth, vocab_size=v)
            nodes = 1 + b * depth
            size = f"N={nodes}" if nodes == n else f"N={nodes} of budget {n}"
            specs.append(Spec(f"ngram tree {b}x{depth} ({size})", d, depth, None, peer="tree"))
    return specs


def _budget_note(ngram: bool) -> str:
    note = "N = positions verified per round (the pending token included)."
    if ngram:
        note += (
            " The n-gram trees are b continuations x depth: 'N=7 of budget 8' verifies 7 positions where the chain "
            "at that budget verifies 8, so those rows are not at an equal verification budget."
        )
    return note


def parse_rules(text: str) -> tuple[TreeRule, ...]:
    """--rules: comma-separated rule names (deterministic, iid, without-replacement), refused (ValueError) where one
    is unknown or given twice."""

    def rule(name: str) -> TreeRule:
        key = name.upper().replace("-", "_")
        if key not in TreeRule.__members__:
            raise ValueError(name)
        return TreeRule[key]

    names = ", ".join(r.name.lower().replace("_", "-") for r in TreeRule)
    return tuple(list_flag("--rules", text, rule, f"rule names ({names})"))


def check_shapes(budgets, widths, dynamic: bool) -> None:
    """Every tree the runs will build, built now (no model needed), so that a root width or a budget that does
    not fit fails before the model loads: each static tree's root width (``static_tree``) and, with ``dynamic``,
    the dynamic tree's budget (``check_dynamic_tree``)."""
    for n in budgets:
        for w in widths:
            try:
                static_tree(n, w)
            except ValueError as e:
                raise ValueError(f"--widths / --budgets: {e}") from None
        if dynamic:
            top_k, depth = dynamic_shape(n)
            try:
                check_dynamic_tree(TreeRule.DETERMINISTIC, top_k, depth, n)
            except ValueError as e:
                raise ValueError(
                    f"--budgets: N={n} does not fit the dynamic tree: {e} (--no-dynamic skips it)"
                ) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--budgets", default="5,8", help="verification budgets N (positions per round)")
    ap.add_argument(
        "--concurrency",
        default="4",
        help="comma-separated closed-loop batch sizes besides 1 (which always runs), e.g. 4,16; '' for 1 alone",
    )
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--draft", default=None, help="a distilled draft instead of the truncated target")
    ap.add_argument("--ngram", action="store_true", help="n-gram chain vs n-gram trees instead of a draft model")
    ap.add_argument("--widths", default="2,4", help="root widths of the static trees (draft model, --layerskip)")
    ap.add_argument("--no-dynamic", action="store_true", help="skip the dynamic tree (draft model only)")
    ap.add_argument(
        "--rules",
        default="deterministic",
        help="static-tree verification rules to compare (draft model, --layerskip): "
        "deterministic,iid,without-replacement",
    )
    ap.add_argument(
        "--layerskip", default=None, help="LayerSkip exit (trained adapter name or exit:E) instead of a draft"
    )
    ap.set_defaults(out="results/chain_vs_tree", n=2)
    args = ap.parse_args(argv)
    if args.ngram and args.layerskip:
        ap.error("--ngram and --layerskip are exclusive")
    # Flags the chosen drafter does not read are refused rather than ignored.
    default = {name: ap.get_default(name) for name in ("draft_layers", "rules", "widths")}
    given = {
        "--draft": args.draft is not None,
        "--draft-layers": args.draft_layers != default["draft_layers"],
        "--no-dynamic": args.no_dynamic,
        "--rules": args.rules != default["rules"],
        "--widths": args.widths != default["widths"],
    }
    mode = "--ngram" if args.ngram else "--layerskip" if args.layerskip else None
    reads = {None: set(given), "--ngram": set(), "--layerskip": {"--widths", "--rules"}}[mode]
    for flag in (f for f, on in given.items() if on and f not in reads):
        ap.error(f"{flag} does not apply to {mode}")
    if given["--draft"] and given["--draft-layers"]:
        ap.error("--draft-layers (a truncated target) and --draft (a distilled draft) are exclusive")
    try:  # every list whole, and every tree's shape, before the model loads
        budgets = int_list(
            "--budgets",
            args.budgets,
            least=2,
            why=" (a budget N verifies the pending token and K = N - 1 >= 1 candidates)",
        )
        batches = int_list(
            "--concurrency",
            args.concurrency,
            least=2,
            empty_ok=True,
            why=" (concurrency 1 always runs; '' for it alone)",
        )
        widths = int_list("--widths", args.widths)
        rules = parse_rules(args.rules)
        if mode is None and not args.draft:
            check_draft_layers(args.draft_layers)
        if mode != "--ngram":
            check_shapes(budgets, widths, dynamic=mode is None and not args.no_dynamic)
        cfg = config_from_args(args)
        make_out_dir(args.out)  # an unusable --out fails now, not after the runs
        rec = serving_record.start("chain_vs_tree", "python examples/bench_chain_vs_tree.py", argv, args, ap)
    except (ValueError, OSError) as e:  # an unusable --compile-cache too
        ap.error(str(e))
    t0 = time.perf_counter()
    target = targets.load_target(args.model, args.dtype, args.layers)
    if mode is None and not args.draft:
        try:
            check_draft_layers(args.draft_layers, target.config.num_layers)
        except ValueError as e:
            ap.error(str(e))
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    specs = [runspec.plain_spec()]
    if args.ngram:
        for n in budgets:
            specs += [s for s in ngram_specs_for_budget(target, n) if s.label not in {t.label for t in specs}]
    elif args.layerskip:
        for n in budgets:
            specs += layerskip_specs_for_budget(target, args.layerskip, n, widths, rules)
    else:
        draft = distilled_draft(target, args.draft) if args.draft else truncated_draft(target, args.draft_layers)
        for n in budgets:
            specs += specs_for_budget(*draft, n, widths, dynamic=not args.no_dynamic, rules=rules)
    loads = [Load.closed(1, cfg.timeout_s)] + [Load.closed(c, cfg.timeout_s) for c in batches]
    results = suite_runs.run_specs(target, specs, loads, jobs, cfg)
    lines = headlines.headline(results)
    cmd = rec.data["command"]
    serving_record.add_runs(rec, results)
    draft_name = (
        "n-gram lookup"
        if args.ngram
        else f"LayerSkip {args.layerskip}"
        if args.layerskip
        else args.draft or f"first {args.draft_layers} layers of the target"
    )
    pl = report.payload("chain_vs_tree", None, suite_runs.meta(target, cfg, desc), results, headline=lines, command=cmd,
                       markdown_extra=[f"Draft model: {draft_name}. {_budget_note(args.ngram)}"])  # fmt: skip
    plots = [
        ("chain_vs_tree_acceptance.png", lambda path: plotting.plot_acceptance_by_position(pl, path)),
        ("chain_vs_tree_latency_c1.png", lambda path: plotting.plot_latency(pl, path, loads[0].name)),
    ]
    record_path = serving_record.finish(rec, headline=lines, draft=draft_name)
    paths, _ = report.write_results(args.out, "chain_vs_tree", pl, plots)  # results first, then the plots
    print("\n".join(["", *lines, "", f"wrote {record_path}, {paths['markdown']} ({time.perf_counter() - t0:.0f} s)"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
