"""Speculation off vs on, for each drafter, on the four workloads, with peers measured in the same run.

Configurations (all greedy by default, so every speculative run is also checked token for token against
plain decoding): plain; n-gram prompt lookup at K = --gamma; optionally a draft model at K = --gamma:
``--draft-layers L`` = the target's first L layers + its head (no training; the same truncated draft is
given to transformers' assisted generation), ``--draft NAME`` = a distilled draft from
``examples/train_draft.py``. Each runs through the continuous-batching engine at closed-loop concurrency 1
(low-load latency) and --concurrency (saturation throughput), in separate runs.

Writes <out>/spec_vs_plain.{json,md} once jspec's runs are done (``peers_pending`` names the peers still to run),
again with the peers' runs, then plots (latency CDFs at concurrency 1, acceptance by position). The peers run after
jspec's runs (not interleaved: the time between is recorded), on one thread count (``--peer-threads``, default
jspec's XLA pool size).

    python examples/bench_spec_vs_plain.py [--n 4] [--gamma 4] [--draft-layers 4] [--peers transformers,llama_cpp]
        [--ngram-variants '12;8,4,2']   (more n-gram configurations, K[,MAX_NGRAM,MIN_NGRAM], in the same run)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jspec.bench import headlines, plotting, report, runspec, serving_record, suite_peers, suite_runs, targets
from jspec.bench.args import add_common_args, add_peer_args, config_from_args, make_out_dir, peer_names
from jspec.bench.runspec import Load
from models.bench_drafts import check_draft_layers, distilled_draft, truncated_draft


def draft_specs(target: targets.Target, args, gamma: int) -> list:
    specs = []
    if getattr(args, "draft_layers", 0):
        m, p = truncated_draft(target, args.draft_layers)
        specs.append(runspec.model_spec(f"draft {args.draft_layers}L K={gamma}", m, p, gamma, peer="assisted"))
    if getattr(args, "draft", None):
        m, p = distilled_draft(target, args.draft)
        specs.append(runspec.model_spec(f"draft {args.draft} K={gamma}", m, p, gamma, peer="assisted_distilled"))
    return specs


def ngram_variant(text: str) -> tuple[int, int, int]:
    """'K' or 'K,MAX_NGRAM,MIN_NGRAM' -> (K, MAX_NGRAM, MIN_NGRAM)."""
    parts = text.split(",")
    if len(parts) not in (1, 3) or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--ngram-variants: expected K or K,MAX_NGRAM,MIN_NGRAM, got '{text}'")
    k, hi, lo = (int(p) for p in parts) if len(parts) == 3 else (int(parts[0]), 3, 1)
    if not 1 <= lo <= hi or k < 1:
        raise SystemExit(f"--ngram-variants: need K >= 1 and 1 <= MIN_NGRAM <= MAX_NGRAM, got '{text}'")
    return k, hi, lo


def ngram_variants(text: str, gamma: int) -> list[tuple[int, int, int]]:
    """--ngram-variants: ';'-separated ``ngram_variant``s, refused (ValueError) where one repeats another or the
    main n-gram configuration (K = --gamma, n-grams 3..1): two runs of one configuration under one label."""
    try:
        variants = [ngram_variant(v) for v in filter(None, text.split(";"))]
    except SystemExit as e:  # ngram_variant's own message, as a usage error
        raise ValueError(str(e)) from None
    seen = {(gamma, 3, 1)}
    for k, hi, lo in variants:
        if (k, hi, lo) in seen:
            main = " (the main n-gram run: K = --gamma, n-grams 3..1)" if (k, hi, lo) == (gamma, 3, 1) else ""
            raise ValueError(f"--ngram-variants {text!r}: K={k} n={hi}..{lo} is already in the run{main}")
        seen.add((k, hi, lo))
    return variants


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="saturation run; 1 = latency run only")
    ap.add_argument("--draft-layers", type=int, default=0, help="add a truncated-target draft model of L layers")
    ap.add_argument("--draft", default=None, help="add a distilled draft (name or directory)")
    add_peer_args(ap)
    ap.add_argument(
        "--ngram-variants",
        default="",
        help="more n-gram configurations in the same run, ';'-separated K[,MAX_NGRAM,MIN_NGRAM] (e.g. '12;8,4,2'; "
        "the default n-gram range is 3..1)",
    )
    ap.set_defaults(out="results/spec_vs_plain")
    args = ap.parse_args(argv)
    try:
        variant_args = ngram_variants(args.ngram_variants, args.gamma)  # before the model is loaded
        names = peer_names(args.peers)
        if args.draft_layers:
            check_draft_layers(args.draft_layers)
        cfg = config_from_args(args, gamma=args.gamma, concurrency=args.concurrency, peer_threads=args.peer_threads)
        make_out_dir(args.out)  # an unusable --out fails now, not after the runs
        rec = serving_record.start("spec_vs_plain", "python examples/bench_spec_vs_plain.py", argv, args, ap)
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
    specs = [runspec.plain_spec(), runspec.ngram_spec(target, args.gamma), *draft_specs(target, args, args.gamma)]
    variants = [runspec.ngram_spec(target, *v) for v in variant_args]
    # A variant is compared with the peers' prompt lookup only at the peers' K (--gamma).
    specs[2:2] = [v if v.gamma == args.gamma else dataclasses.replace(v, peer=None) for v in variants]
    loads = [Load.closed(1, cfg.timeout_s)] + ([Load.closed(args.concurrency, cfg.timeout_s)] * (args.concurrency > 1))
    results = suite_runs.run_specs(target, specs, loads, jobs, cfg)
    cmd = rec.data["command"]
    serving_record.add_runs(rec, results)
    rec.write()  # jspec's runs, unfinished until the peers have run
    meta = suite_runs.meta(target, cfg, desc)
    if names:  # jspec's runs first: the peers below are slow, and may fail or be stopped
        pl = report.payload("spec_vs_plain", None, meta, results, headline=headlines.headline(results), command=cmd,
                            peers_pending=names)  # fmt: skip
        paths = report.write_outputs(args.out, "spec_vs_plain", pl)
        print(f"jspec's runs written to {paths['json']} (the peers' runs follow)")
    plain1 = results[0]
    peer_runs = suite_peers.run_peer_set(target, names, jobs, cfg, args.gamma, plain1,
                                         assistant_layers=args.draft_layers, jspec_runs=results)  # fmt: skip
    lines = headlines.headline(results, peer_runs)
    pl = report.payload("spec_vs_plain", None, meta, results, peer_runs, headline=lines, command=cmd)
    record_path = serving_record.finish(rec, peer_runs, headline=lines)
    plots = [
        ("spec_vs_plain_latency_c1.png", lambda path: plotting.plot_latency(pl, path, loads[0].name)),
        ("spec_vs_plain_acceptance.png", lambda path: plotting.plot_acceptance_by_position(pl, path)),
    ]
    paths, _ = report.write_results(args.out, "spec_vs_plain", pl, plots)  # results first, then the plots
    print("\n".join(["", *lines, "", f"wrote {record_path}, {paths['markdown']} ({time.perf_counter() - t0:.0f} s)"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
