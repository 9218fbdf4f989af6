"""K sweep and batch sweep, each with plain decoding measured in the same run.

- K sweep (closed loop, concurrency --k-concurrency): n-gram drafter (and a draft model with
  ``--draft-layers``) at every K of --ks; speedup over plain vs K, with the cost model's prediction from the
  measured acceptance and measured per-phase costs at that K, and acceptance by position.
- batch sweep: closed loop at every concurrency of --batches (1..64), plain and n-gram at K = --gamma;
  each batch serves max(--n x workloads, 2 x batch) requests so the rows stay full; output tokens/s and the
  speedup over plain at the same batch.

The two sweeps are separate run groups (``suite_runs.run_specs(group=...)``): where they share a load (the K sweep's
concurrency is one of the batches) every ratio, in the headline and the tables, is still taken against the
plain run of the run's own group, measured with it on the same jobs.

With --passes N every sweep point is the median over the passes (each ratio taken pass by pass, as the
headline's median). At temperature > 0 the batch sweep gives no end-to-end ratio (the two sides sample other
outputs), only the decode ratio. Each group's prompt set is recorded in ``meta.workloads_by_group``.

--ks and --batches are checked whole (integers >= 1, none twice) before the model loads. Writes
<out>/sweeps.{json,md} after the K sweep and after each batch (a later failure keeps the groups done), then
speedup_vs_k.png, acceptance_by_position.png, batch_sweep.png.

    python examples/bench_sweeps.py [--ks 1,2,3,4,6,8] [--batches 1,4,16,64] [--draft-layers 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from jspec.bench import headlines, plotting, ratios, report, runspec, serving_record, suite_runs, tables, targets
from jspec.bench.args import add_common_args, config_from_args, int_list, make_out_dir
from jspec.bench.runspec import Load
from models.bench_drafts import check_draft_layers, truncated_draft

K_GROUP = "K sweep"


def _median(xs):
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


def _rate(r) -> float:
    """A run's output tokens/s: the median over its passes (--passes), else its one run's."""
    passes = r.extra.get("passes") or []
    if len(passes) > 1:
        return statistics.median(p["output_tokens_per_s"] for p in passes)
    return r.summary["output_tokens_per_s"]


def _point(series, r, plain, key, value):
    """The K sweep plots the decode-phase speedup (what the cost model describes); the batch sweep the
    end-to-end output rate (saturation throughput). Both ratios are kept in every point, unless the two runs
    served different requests (a wall limit or deadlines cut them differently) or one of them none
    (``ratios.no_ratio``): then there is no ratio, and ``different_requests`` says why. At temperature > 0 there
    is no end-to-end ratio (``ratios.sampled_note``: the two sides sampled other outputs), ``end_to_end_note``
    says so; the decode ratio stays.

    With --passes N each ratio is the median of the per-pass ratios (``headlines.pass_ratios``, over the passes in
    which both runs served the same requests, as the headline's median) and ``tokens_per_s`` the median of the
    passes' rates; ``passes`` says how many. Acceptance and tokens per round are the first pass's.

    At temperature 0 a run whose greedy outputs are not plain decoding's (``ratios.outputs_differ``) keeps its
    ratios, flagged: ``outputs_differ`` says why, and the tables mark them as the suite's do."""
    per = headlines.pass_ratios(r, plain)
    dec = e2e = None
    if per is None:
        why = ratios.no_ratio(r.summary, plain.summary)
        if not why:
            rd, pd = r.summary["decode_tokens_per_s"], plain.summary["decode_tokens_per_s"]
            dec = rd / pd if rd > 0 and pd > 0 else None  # nothing decoded after the first tokens: no decode ratio
            e2e = r.summary["output_tokens_per_s"] / max(plain.summary["output_tokens_per_s"], 1e-9)
    else:
        dec, e2e = _median(per["decode"]), _median(per["output"])
        # No pass with a ratio: every pass served other requests on the two sides (or one side none).
        why = None if e2e is not None else ratios.no_ratio(r.extra["passes"][0], plain.extra["passes"][0])
    sampled = ratios.sampled_note(r.sampling.temperature)
    if sampled:
        e2e = None
    differ = None if why else ratios.outputs_differ(r.quality, r.summary, plain.summary, r.sampling.temperature)
    sp = dec if key == "k" else e2e
    cm = (r.cost_model or {}).get("measured_rounds") or {}
    seed = (r.cost_model or {}).get("seed") or {}
    return {
        "series": series,
        key: value,
        "speedup": sp,
        "speedup_decode": dec,
        "speedup_end_to_end": e2e,
        "different_requests": why,
        "outputs_differ": differ,
        "end_to_end_note": sampled,
        "passes": len(r.extra.get("passes") or []) or 1,
        "tokens_per_s": _rate(r),
        "predicted": cm.get("speedup"),
        "predicted_seed": seed.get("speedup"),
        "tokens_per_round": r.decode_stats["tokens_per_round"],
        "acceptance_rate": r.decode_stats["acceptance_rate"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--ks", default="1,2,3,4,6,8")
    ap.add_argument("--k-concurrency", type=int, default=1)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--gamma", type=int, default=4, help="K of the batch sweep")
    ap.add_argument("--draft-layers", type=int, default=0, help="also sweep K for a truncated-target draft")
    ap.add_argument("--skip-k", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    ap.set_defaults(out="results/sweeps", n=2, max_new_tokens=64)
    args = ap.parse_args(argv)
    if args.skip_k and args.skip_batch:
        ap.error("--skip-k and --skip-batch together leave nothing to run")
    if args.skip_k and args.draft_layers:
        ap.error("--draft-layers adds a draft to the K sweep, which --skip-k skips")
    try:  # every list whole, before the model loads: not at the group that fails after the others ran
        ks = int_list("--ks", args.ks)
        batches = int_list("--batches", args.batches)
        if args.draft_layers:
            check_draft_layers(args.draft_layers)
        cfg = config_from_args(args, gamma=args.gamma, k_concurrency=args.k_concurrency)
        make_out_dir(args.out)  # an unusable --out fails now, not after the runs
        rec = serving_record.start("sweeps", "python examples/bench_sweeps.py", argv, args, ap)
    except (ValueError, OSError) as e:  # an unusable --compile-cache too
        ap.error(str(e))
    t0 = time.perf_counter()
    target = targets.load_target(args.model, args.dtype, args.layers)
    if args.draft_layers:
        try:
            check_draft_layers(args.draft_layers, target.config.num_layers)
        except ValueError as e:
            ap.error(str(e))
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    cmd = rec.data["command"]
    meta = suite_runs.meta(target, cfg, desc)
    # Each group's own prompt set: the batch sweep serves more requests at a large batch (see the module's doc).
    meta["workloads_by_group"] = {}
    results, k_points, b_points = [], [], []

    def payload():
        pl = report.payload("sweeps", None, meta, results, headline=headlines.headline(results), command=cmd,
                           sweeps={"k": k_points, "batch": b_points})  # fmt: skip
        pl["markdown_extra"] = [_sweep_tables(k_points, b_points, cfg.passes)]
        return pl

    if not args.skip_k:
        print("K sweep")
        specs = [runspec.plain_spec()] + [runspec.ngram_spec(target, k) for k in ks]
        draft = truncated_draft(target, args.draft_layers) if args.draft_layers else None
        if draft is not None:
            specs += [runspec.model_spec(f"draft {args.draft_layers}L K={k}", *draft, k) for k in ks]
        rs = suite_runs.run_specs(
            target, specs, [Load.closed(args.k_concurrency, cfg.timeout_s)], jobs, cfg, group=K_GROUP
        )
        meta["workloads_by_group"][K_GROUP] = desc
        plain = rs[0]
        for r in rs[1:]:
            series = "ngram" if r.spec.label.startswith("ngram") else f"draft {args.draft_layers}L"
            k_points.append(_point(series, r, plain, "k", r.spec.gamma))
        results += rs
        report.write_outputs(args.out, "sweeps", payload())  # each group's results as soon as it is done

    if not args.skip_batch:
        print("batch sweep")
        for b in batches:
            n_needed = max(cfg.n_per_workload, -(-2 * b // len(cfg.workloads)))
            bcfg = dataclasses.replace(cfg, n_per_workload=n_needed)
            bjobs, bdesc = suite_runs.prepare_jobs(target, bcfg)
            group = f"batch sweep b={b}"
            bspecs = [runspec.plain_spec(), runspec.ngram_spec(target, args.gamma)]
            rs = suite_runs.run_specs(target, bspecs, [Load.closed(b, cfg.timeout_s)], bjobs, bcfg, group=group)
            meta["workloads_by_group"][group] = bdesc
            plain = rs[0]
            b_points.append({"series": "plain", "batch": b, "n_per_workload": n_needed, "tokens_per_s": _rate(plain)})
            b_points.append(dict(_point(f"ngram K={args.gamma}", rs[1], plain, "batch", b), n_per_workload=n_needed))
            results += rs
            report.write_outputs(args.out, "sweeps", payload())

    pl = payload()
    lines = pl["headline"]
    serving_record.add_runs(rec, results)
    record_path = serving_record.finish(rec, headline=lines, sweeps={"k": k_points, "batch": b_points})
    plots = []
    how = f", median of {cfg.passes} passes" if cfg.passes > 1 else ""
    if k_points:
        title = f"{target.name}, closed loop c={args.k_concurrency}{how}"
        plots.append(("speedup_vs_k.png", lambda path: plotting.plot_speedup_vs_k(k_points, path, title)))
        kpl = dict(pl, runs=[r.to_json(False) for r in results if r.extra.get("group") == K_GROUP])
        plots.append(("acceptance_by_position.png", lambda path: plotting.plot_acceptance_by_position(kpl, path)))
    if b_points:
        btitle = f"{target.name}{how}"
        plots.append(("batch_sweep.png", lambda path: plotting.plot_batch_sweep(b_points, path, btitle)))
    paths, _ = report.write_results(args.out, "sweeps", pl, plots)  # results first, then the plots
    print("\n".join(["", *lines, "", f"wrote {record_path}, {paths['markdown']} ({time.perf_counter() - t0:.0f} s)"]))
    return 0


def _sweep_tables(k_points, b_points, passes: int = 1) -> str:
    out = []
    if passes > 1:
        out.append(
            f"Sweep points: medians over the {passes} passes (each ratio taken pass by pass, as in the headline); "
            "acceptance and tokens/round from the first pass.\n"
        )
    if k_points:
        out.append("## K sweep\n")
        rows = [[p["series"], p["k"], _x(p["speedup"], p), _x(p.get("predicted")), _x(p.get("predicted_seed")),
                 f"{p['tokens_per_round']:.2f}", f"{100 * p['acceptance_rate']:.0f}%"] for p in k_points]  # fmt: skip
        out.append(tables._table(["drafter", "K", "measured (decode)", "cost model (whole rounds)", "seed model",
                                  "tokens/round", "acceptance"], rows))  # fmt: skip
    if b_points:
        out.append("\n## Batch sweep\n")
        rows = [[p["series"], p["batch"], p.get("n_per_workload", "-"), f"{p['tokens_per_s']:.1f}",
                 _x(p.get("speedup_end_to_end"), p, p.get("end_to_end_note")), _x(p.get("speedup_decode"), p)]
                for p in b_points]  # fmt: skip
        out.append(tables._table(["config", "batch", "requests per workload", "out tok/s", "vs plain (end-to-end)",
                                  "vs plain (decode)"], rows))  # fmt: skip
    return "\n".join(out)


def _x(v, point=None, no_ratio_note=None) -> str:
    if v is None and point is not None and point.get("different_requests"):
        return ratios.no_ratio_cell(point["different_requests"])
    if v is None and no_ratio_note:
        return ratios.SAMPLED_CELL
    if v is not None and point is not None and point.get("outputs_differ"):
        return f"{v:.2f}x (outputs differ)"
    return "-" if v is None else f"{v:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
