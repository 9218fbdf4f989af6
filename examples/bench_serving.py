"""Serving under load: closed loop at fixed concurrencies and open loop at fixed Poisson arrival rates,
plain vs n-gram speculation, through the continuous-batching engine (a finished row takes the next waiting
request while the others keep decoding).

Low-load latency and saturation throughput are separate runs: the lowest concurrency / rate shows latency
(TTFT, inter-token bursts, total), the highest shows throughput and queueing. Arrival times are a pure
function of --seed (``runner.poisson_arrivals``); a per-request deadline (--timeout-s) records timeouts,
and requests that fail are recorded as errors without stopping the run.

Writes <out>/serving.{json,md} and one latency-CDF plot per load.

    python examples/bench_serving.py [--closed 1,8] [--rates 0.5,4] [--rows 8] [--timeout-s 120]
"""

from __future__ import annotations

import argparse
import re
import time

from jspec.bench import headlines, plotting, report, runspec, serving_record, suite_runs, targets
from jspec.bench.args import add_common_args, config_from_args, int_list, make_out_dir, rate_list
from jspec.bench.runspec import Load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--closed", default="1,8", help="closed-loop concurrencies ('' for none)")
    ap.add_argument("--rates", default="0.5,4", help="open-loop Poisson rates, requests/s ('' for none)")
    ap.add_argument("--rows", type=int, default=8, help="engine rows for the open-loop runs")
    ap.add_argument("--gamma", type=int, default=4)
    ap.set_defaults(out="results/serving", n=3)
    args = ap.parse_args(argv)
    try:  # both lists whole, before the model loads
        closed = int_list("--closed", args.closed, empty_ok=True)
        rates = rate_list("--rates", args.rates, empty_ok=True)
        if not closed and not rates:
            raise ValueError("--closed and --rates are both empty: no load to run")
        cfg = config_from_args(args, gamma=args.gamma, rows=args.rows)
        make_out_dir(args.out)  # an unusable --out fails now, not after the runs
        rec = serving_record.start("serving", "python examples/bench_serving.py", argv, args, ap)
    except (ValueError, OSError) as e:  # an unusable --compile-cache too
        ap.error(str(e))
    t0 = time.perf_counter()
    target = targets.load_target(args.model, args.dtype, args.layers)
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    loads = [Load.closed(c, cfg.timeout_s) for c in closed]
    loads += [Load.open(r, args.rows, args.seed, cfg.timeout_s) for r in rates]
    specs = [runspec.plain_spec(), runspec.ngram_spec(target, args.gamma)]
    results = suite_runs.run_specs(target, specs, loads, jobs, cfg)
    lines = headlines.headline(results)
    cmd = rec.data["command"]
    serving_record.add_runs(rec, results)
    pl = report.payload("serving", None, suite_runs.meta(target, cfg, desc), results, headline=lines, command=cmd)
    plots = []
    for load in loads:
        slug = re.sub(r"[^a-z0-9]+", "_", load.name.lower()).strip("_")
        plots.append(
            (f"serving_latency_{slug}.png", lambda path, name=load.name: plotting.plot_latency(pl, path, name))
        )
    record_path = serving_record.finish(rec, headline=lines)
    paths, _ = report.write_results(args.out, "serving", pl, plots)  # results first, then the plots
    print("\n".join(["", *lines, "", f"wrote {record_path}, {paths['markdown']} ({time.perf_counter() - t0:.0f} s)"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
