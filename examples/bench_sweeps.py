"""K sweep and batch sweep, each with plain decoding measured in the same run.

- K sweep (closed loop, concurrency --k-concurrency): n-gram drafter (and a draft model with
  ``--draft-layers``) at every K of --ks; speedup over plain vs K, with the cost model's prediction from the
  measured acceptance and measured per-phase costs at that K, and acceptance by position.
- batch sweep: closed loop at every concurrency of --batches (1..64), plain and n-gram at K = --gamma;
  each batch serves max(--n x workloads, 2 x batch) requests so the rows stay full; output tokens/s and the
  speedup over plain at the same batch.

The two sweeps are separate run groups (``suite.run_specs(group=...)``): where they share a load (the K sweep's
concurrency is one of the batches) every ratio, in the headline and the tables, is still taken against the
plain run of the run's own group, measured with it on the same jobs.

Writes <out>/sweeps.{json,md}, speedup_vs_k.png, acceptance_by_position.png, batch_sweep.png.

    python examples/bench_sweeps.py [--ks 1,2,3,4,6,8] [--batches 1,4,16,64] [--draft-layers 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time

from bench_spec_vs_plain import truncated_draft

from jspec.bench import report, suite
from jspec.bench.runner import Load

K_GROUP = "K sweep"


def _point(series, r, plain, key, value):
    """The K sweep plots the decode-phase speedup (what the cost model describes); the batch sweep the
    end-to-end output rate (saturation throughput). Both ratios are kept in every point, unless the two runs
    served different requests (a wall limit or deadlines cut them differently) or one of them none
    (``report.no_ratio``): then there is no ratio, and ``different_requests`` says why."""
    why = report.no_ratio(r.summary, plain.summary)
    dec = e2e = None
    if not why:
        rd, pd = r.summary["decode_tokens_per_s"], plain.summary["decode_tokens_per_s"]
        dec = rd / pd if rd > 0 and pd > 0 else None  # nothing decoded after the first tokens: no decode ratio
        e2e = r.summary["output_tokens_per_s"] / max(plain.summary["output_tokens_per_s"], 1e-9)
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
        "tokens_per_s": r.summary["output_tokens_per_s"],
        "predicted": cm.get("speedup"),
        "predicted_seed": seed.get("speedup"),
        "tokens_per_round": r.decode_stats["tokens_per_round"],
        "acceptance_rate": r.decode_stats["acceptance_rate"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suite.add_common_args(ap)
    ap.add_argument("--ks", default="1,2,3,4,6,8")
    ap.add_argument("--k-concurrency", type=int, default=1)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--gamma", type=int, default=4, help="K of the batch sweep")
    ap.add_argument("--draft-layers", type=int, default=0, help="also sweep K for a truncated-target draft")
    ap.add_argument("--skip-k", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    ap.set_defaults(out="results/sweeps", n=2, max_new_tokens=64)
    args = ap.parse_args(argv)
    try:
        cfg = suite.config_from_args(args, gamma=args.gamma, k_concurrency=args.k_concurrency)
    except (ValueError, OSError) as e:  # an unusable --compile-cache too
        ap.error(str(e))
    t0 = time.perf_counter()
    target = suite.load_target(args.model, args.dtype, args.layers)
    jobs, desc = suite.prepare_jobs(target, cfg)
    results, k_points, b_points = [], [], []

    if not args.skip_k:
        print("K sweep")
        ks = [int(x) for x in args.ks.split(",")]
        specs = [suite.plain_spec()] + [suite.ngram_spec(target, k) for k in ks]
        draft = truncated_draft(target, args.draft_layers) if args.draft_layers else None
        if draft is not None:
            specs += [suite.model_spec(f"draft {args.draft_layers}L K={k}", *draft, k) for k in ks]
        rs = suite.run_specs(target, specs, [Load.closed(args.k_concurrency, cfg.timeout_s)], jobs, cfg, group=K_GROUP)
        plain = rs[0]
        for r in rs[1:]:
            series = "ngram" if r.spec.label.startswith("ngram") else f"draft {args.draft_layers}L"
            k_points.append(_point(series, r, plain, "k", r.spec.gamma))
        results += rs

    if not args.skip_batch:
        print("batch sweep")
        for b in (int(x) for x in args.batches.split(",")):
            n_needed = max(cfg.n_per_workload, -(-2 * b // len(cfg.workloads)))
            bcfg = dataclasses.replace(cfg, n_per_workload=n_needed)
            bjobs, _ = suite.prepare_jobs(target, bcfg)
            bspecs = [suite.plain_spec(), suite.ngram_spec(target, args.gamma)]
            rs = suite.run_specs(
                target, bspecs, [Load.closed(b, cfg.timeout_s)], bjobs, bcfg, group=f"batch sweep b={b}"
            )
            plain = rs[0]
            b_points.append({"series": "plain", "batch": b, "tokens_per_s": plain.summary["output_tokens_per_s"]})
            b_points.append(_point(f"ngram K={args.gamma}", rs[1], plain, "batch", b))
            results += rs

    cmd = " ".join(["python examples/bench_sweeps.py", *map(shlex.quote, argv or sys.argv[1:])])
    lines = suite.headline(results)
    pl = suite.payload("sweeps", None, suite.meta(target, cfg, desc), results, headline=lines, command=cmd,
                       sweeps={"k": k_points, "batch": b_points})  # fmt: skip
    plots = []
    if k_points:
        title = f"{target.name}, closed loop c={args.k_concurrency}"
        plots.append(("speedup_vs_k.png", lambda path: report.plot_speedup_vs_k(k_points, path, title)))
        kpl = dict(pl, runs=[r.to_json(False) for r in results if r.extra.get("group") == K_GROUP])
        plots.append(("acceptance_by_position.png", lambda path: report.plot_acceptance_by_position(kpl, path)))
    if b_points:
        plots.append(("batch_sweep.png", lambda path: report.plot_batch_sweep(b_points, path, target.name)))
    pl["markdown_extra"] = [_sweep_tables(k_points, b_points)]
    paths, _ = suite.write_results(args.out, "sweeps", pl, plots)  # results first, then the plots
    print("\n".join(["", *lines, "", f"wrote {paths['markdown']} ({time.perf_counter() - t0:.0f} s)"]))
    return 0


def _sweep_tables(k_points, b_points) -> str:
    out = []
    if k_points:
        out.append("## K sweep\n")
        rows = [[p["series"], p["k"], _x(p["speedup"], p), _x(p.get("predicted")), _x(p.get("predicted_seed")),
                 f"{p['tokens_per_round']:.2f}", f"{100 * p['acceptance_rate']:.0f}%"] for p in k_points]  # fmt: skip
        out.append(report._table(["drafter", "K", "measured (decode)", "cost model (whole rounds)", "seed model",
                                  "tokens/round", "acceptance"], rows))  # fmt: skip
    if b_points:
        out.append("\n## Batch sweep\n")
        rows = [[p["series"], p["batch"], f"{p['tokens_per_s']:.1f}", _x(p.get("speedup"), p)] for p in b_points]
        out.append(report._table(["config", "batch", "out tok/s", "vs plain (end-to-end)"], rows))
    return "\n".join(out)


def _x(v, point=None) -> str:
    if v is None and point is not None and point.get("different_requests"):
        return report.no_ratio_cell(point["different_requests"])
    return "-" if v is None else f"{v:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
