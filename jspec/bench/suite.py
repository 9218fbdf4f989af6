"""``python -m jspec bench``: the default suite, built from the blocks the suite scripts in ``examples/`` use too.

Default suite (several minutes on a 2-core CPU with the default model, 5 passes):
1. the four workloads (math, code, chat, grounded), ``--n`` requests each, tokenised with the chat template;
2. plain decoding and n-gram (prompt-lookup) speculation, K = ``--gamma``, greedy, each served through the
   continuous-batching engine at closed-loop concurrency 1 (low-load latency) and ``--concurrency`` (saturation
   throughput), in separate runs, interleaved in one process so ratios share the machine's state;
3. per-phase costs and the cost-model check next to each measured speedup, quality on the same tasks and
   exact match with plain greedy;
4. peers on the same checkpoint file and prompt ids when installed (transformers plain and prompt lookup;
   llama-cpp-python plain and prompt lookup), at batch 1, after jspec's runs (not interleaved with them: the
   time between is recorded), on one thread count (jspec's XLA pool size unless ``--peer-threads`` gives one);
5. ``<out>/<suite>.json`` (everything), ``<out>/<suite>.md`` (tables) and PNG plots: the JSON and Markdown are
   written once jspec's runs are done (``peers_pending`` names the peers still to run), again with the peers'
   runs, then the plots; and the run's result file (``--record``, default ``results/suite-<UTC time>.json``:
   ``serving_record``), with every pass of every configuration.

The blocks: ``targets`` (the checkpoint), ``runspec`` (the configurations and loads), ``suite_runs`` (jspec's
runs in interleaved passes, with their checks), ``suite_peers`` (the peers' runs), ``headlines`` (the summary
lines) and ``report`` (the JSON and Markdown).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from jspec.bench import headlines, plotting, report, runspec, serving_record, suite_peers, suite_runs, targets
from jspec.bench.args import add_common_args, add_peer_args, config_from_args, make_out_dir, peer_names
from jspec.bench.runspec import Load


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jspec bench", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--gamma", type=int, default=4, help="K for the n-gram drafter")
    ap.add_argument("--concurrency", type=int, default=8, help="saturation run's closed-loop concurrency")
    add_peer_args(ap)
    ap.add_argument("--name", default="default_suite")
    args = ap.parse_args(argv)
    # Bad input (a missing or unreadable path too) is a message, not a traceback, as `jspec generate` does; only
    # the set-up is covered: an error during the runs keeps its traceback.
    t0 = time.perf_counter()
    try:
        names = peer_names(args.peers)
        cfg = config_from_args(args, gamma=args.gamma, concurrency=args.concurrency, peer_threads=args.peer_threads)
        make_out_dir(args.out)  # an unusable --out fails now, not after the runs
        rec = serving_record.start("suite", "python -m jspec bench", argv, args, ap)
        print(f"loading {args.model} ({args.dtype}) ...")
        target = targets.load_target(args.model, args.dtype, args.layers)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_suite(args, argv, names, cfg, target, t0, rec)


def _run_suite(args, argv: Sequence[str] | None, names, cfg, target, t0: float, rec) -> int:
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    print(f"{len(jobs)} requests ({', '.join(cfg.workloads)}), input tokens median {desc['input_len']['median']:.0f}")
    specs = [runspec.plain_spec(), runspec.ngram_spec(target, args.gamma)]
    loads = [Load.closed(1, cfg.timeout_s)]
    if args.concurrency > 1:
        loads.append(Load.closed(args.concurrency, cfg.timeout_s))
    results = suite_runs.run_specs(target, specs, loads, jobs, cfg)
    cmd = rec.data["command"]
    serving_record.add_runs(rec, results)
    rec.write()  # jspec's runs, unfinished until the peers have run
    meta_d = suite_runs.meta(target, cfg, desc)
    if names:  # jspec's runs first: the peers below are slow, and may fail or be stopped
        pl = report.payload(
            args.name, None, meta_d, results, headline=headlines.headline(results), command=cmd, peers_pending=names
        )
        paths = report.write_outputs(args.out, args.name, pl)
        print(f"jspec's runs written to {paths['json']} (the peers' runs follow)")
    plain1 = next(r for r in results if r.spec.kind == "plain" and r.load.concurrency == 1)
    peer_runs = suite_peers.run_peer_set(target, names, jobs, cfg, args.gamma, plain1, jspec_runs=results)
    lines = headlines.headline(results, peer_runs)
    pl = report.payload(args.name, None, meta_d, results, peer_runs, headline=lines, command=cmd)
    record_path = serving_record.finish(rec, peer_runs, headline=lines)
    plots = [
        (f"{args.name}_latency_c1.png", lambda path: plotting.plot_latency(pl, path, loads[0].name)),
        (f"{args.name}_acceptance.png", lambda path: plotting.plot_acceptance_by_position(pl, path)),
    ]
    paths, drawn = report.write_results(args.out, args.name, pl, plots)
    print("\n".join(["", *lines]))
    print(f"\nwrote {record_path}, {paths['json']}, {paths['markdown']} and {len(drawn)} plots "
          f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
