"""The HTTP serving benchmark (``examples/bench_http_serving.py``): at each Poisson arrival rate, a plain and a
speculative (n-gram) ``python -m jspec serve`` driven over loopback by ``http_runner``, and the in-process
runner (``runner.run``) serving the same jobs at the same arrival times: speculation on against off, and the
HTTP path's overhead, in one run. The configurations run one at a time (a server is started for its run and
stopped after it), in an order rotated from pass to pass.

The servers are built like the in-process engine (same rows, cache, prompt buckets, stop-id slots; no
log-probabilities, logit-bias slots or penalty counts, which the in-process engine does not compute either), so
both sides run the same device programs. The result file (``jspec.bench.record``) holds every pass;
``extra["comparisons"]`` the seed's record per configuration (TTFT and ITL p50/p95, tokens/s, requests/s,
errors) and the issue's goals, each with the numbers it was judged on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from jspec.bench import http_runner, record, runspec, serving_record, suite_runs, targets
from jspec.bench.args import add_common_args, config_from_args, make_out_dir, rate_list
from jspec.bench.runspec import Load, RunResult, Spec

HTTP, IN_PROCESS = "http", "in-process"
SERVED_NAME = "bench"


def _server_args(args, spec: Spec, cfg: suite_runs.SuiteConfig, n_jobs: int) -> list[str]:
    out = ["--model", args.model, "--served-model-name", SERVED_NAME, "--rows", str(args.rows),
           "--max-len", str(cfg.max_len), "--bucket", str(cfg.bucket), "--rounds-per-sync", str(cfg.rounds_per_sync),
           "--max-queue", str(n_jobs), "--no-logprobs", "--no-penalties", "--max-logit-bias", "0",
           "--dtype", args.dtype, "--layers", args.layers, "--log-level", "warning"]  # fmt: skip
    out += ["--drafter", "none"] if spec.drafter is None else ["--drafter", "ngram", "--gamma", str(spec.gamma)]
    out += ["--adaptive"] if spec.adaptive is not None else []
    if args.compile_cache is not None:
        out += ["--compile-cache", args.compile_cache]
    return out


def _run_one(args, target, spec: Spec, transport: str, load: Load, jobs, cfg, port: int) -> RunResult:
    label = f"{spec.label} ({transport})"
    if transport == IN_PROCESS:
        r = suite_runs.run_one(target, spec, load, jobs, cfg)
    else:
        log = os.path.join(args.out, f"server-{spec.label.replace(' ', '_').replace('=', '')}.log")
        with http_runner.ServerProcess(_server_args(args, spec, cfg, len(jobs)), port, log) as server:
            r = http_runner.run(server.url, SERVED_NAME, spec, load, jobs, max_new_tokens=cfg.max_new_tokens,
                                sampling=cfg.sampling, max_wall_s=cfg.max_wall_s,
                                decode_text=target.decode_text)  # fmt: skip
            r.engine["server_start_s"] = server.start_s
        s = r.summary
        print(f"  {label:<28} {load.name:<18} {s['output_tokens_per_s']:7.1f} tok/s (decode "
              f"{s['decode_tokens_per_s']:6.1f})  {s['finished']}/{s['submitted']} done  TTFT p95 "
              f"{s['ttft_ms']['p95'] or 0:.0f} ms  ITL p95 {s['itl_ms']['p95'] or 0:.1f} ms", flush=True)  # fmt: skip
    r.spec = dataclasses.replace(spec, label=label)
    r.extra["transport"] = transport
    return r


def _pass(r: RunResult, position: int, first: RunResult) -> dict[str, Any]:
    s = r.summary
    return {
        **{k: s.get(k) for k in ("request_set", "submitted", "finished", "errors", "timeouts", "not_run")},
        "position": position, "output_tokens": s["output_tokens"], "wall_s": s["wall_s"],
        "output_tokens_per_s": s["output_tokens_per_s"], "decode_tokens_per_s": s["decode_tokens_per_s"],
        "tokens_per_round": r.decode_stats.get("tokens_per_round"),
        "same_tokens_as_first_pass": r.tokens_by_id() == first.tokens_by_id(),
    }  # fmt: skip


def seed_record(r: RunResult) -> dict[str, Any]:
    """The seed's record of one run: TTFT and ITL p50/p95, tokens/s, requests/s, errors and timeouts."""
    s = r.summary
    return {
        "ttft_ms_p50": s["ttft_ms"]["median"], "ttft_ms_p95": s["ttft_ms"]["p95"],
        "itl_ms_p50": s["itl_ms"]["median"], "itl_ms_p95": s["itl_ms"]["p95"],
        "itl_nonzero_ms_p95": s["itl_nonzero_ms"]["p95"], "tpot_ms_p50": s["tpot_ms"]["median"],
        "output_tokens_per_s": s["output_tokens_per_s"], "decode_tokens_per_s": s["decode_tokens_per_s"],
        "finished_requests_per_s": s["finished_requests_per_s"], "submitted": s["submitted"],
        "finished": s["finished"], "errors": s["errors"], "timeouts": s["timeouts"],
        "tokens_per_round": r.decode_stats.get("tokens_per_round"),
        "acceptance_rate": r.decode_stats.get("acceptance_rate"),
    }  # fmt: skip


def comparisons(runs: dict[tuple[str, str], RunResult]) -> dict[str, Any]:
    """One rate's runs ({(spec label, transport): result}) -> each run's seed record, speculation against plain
    over HTTP, the HTTP path against in-process, and the goals judged on them (first pass)."""
    rec = {f"{label} ({t})": seed_record(r) for (label, t), r in runs.items()}
    out: dict[str, Any] = {"runs": rec}
    plain = next((r for (_, t), r in runs.items() if t == HTTP and r.spec.drafter is None), None)
    spec = next((r for (_, t), r in runs.items() if t == HTTP and r.spec.drafter is not None), None)
    if plain is not None and spec is not None:
        p, s = seed_record(plain), seed_record(spec)
        out["speculative_vs_plain_http"] = {
            "itl_ms_p95": [s["itl_ms_p95"], p["itl_ms_p95"]],
            "finished_requests_per_s": [s["finished_requests_per_s"], p["finished_requests_per_s"]],
            "same_tokens": spec.tokens_by_id() == plain.tokens_by_id(),
        }
        n_min = min(p["submitted"], s["submitted"])
        out["goals"] = {
            "plain_p95_ttft_under_2s": (p["ttft_ms_p95"] or 0) < 2000,
            "speculative_lower_p95_itl": (s["itl_ms_p95"] or 0) < (p["itl_ms_p95"] or 0),
            "speculative_requests_per_s_not_lower": s["finished_requests_per_s"] >= p["finished_requests_per_s"],
            "zero_errors_over_200_requests": n_min >= 200 and not (p["errors"] + s["errors"] + p["timeouts"]
                                                                   + s["timeouts"]),
        }  # fmt: skip
    overhead = {}
    for (label, t), r in runs.items():
        local = runs.get((label, IN_PROCESS))
        if t == HTTP and local is not None:
            h, i = seed_record(r), seed_record(local)
            overhead[label] = {
                "tokens_per_s_loss": 1 - h["output_tokens_per_s"] / i["output_tokens_per_s"],
                "decode_tokens_per_s_loss": 1 - h["decode_tokens_per_s"] / i["decode_tokens_per_s"],
                "ttft_ms_p95": [h["ttft_ms_p95"], i["ttft_ms_p95"]],
                "itl_ms_p95": [h["itl_ms_p95"], i["itl_ms_p95"]],
                "same_tokens": r.tokens_by_id() == local.tokens_by_id(),
            }
    if overhead:
        out["http_overhead"] = overhead
        if "goals" in out:
            out["goals"]["http_overhead_under_5pct_tokens_per_s"] = all(
                o["tokens_per_s_loss"] < 0.05 for o in overhead.values()
            )
    return out


def main(argv=None, prog: str = "python examples/bench_http_serving.py") -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--rates", default="1", help="Poisson arrival rates, requests/s")
    ap.add_argument("--rows", type=int, default=8, help="engine rows (the servers' and the in-process runner's)")
    ap.add_argument("--gamma", type=int, default=4, help="the n-gram drafter's K")
    ap.add_argument("--adaptive", action="store_true", help="the n-gram rows draft K or nothing, by their acceptance")
    ap.add_argument("--port", type=int, default=None, help="the servers' loopback port (default: a free one)")
    ap.add_argument("--in-process", default="all", choices=("all", "plain", "none"),
                    help="the configurations also run in-process at the same rates (the HTTP overhead)")  # fmt: skip
    # 200 requests (50 per workload) of up to 64 tokens: one configuration's run at a rate where plain decoding keeps
    # up takes ~6 minutes on 2 cores, and a run compares three or four of them.
    ap.set_defaults(out="results/serving-http", n=50, max_new_tokens=64, passes=1, no_phases=True)
    args = ap.parse_args(argv)
    try:
        rates = rate_list("--rates", args.rates)
        cfg = config_from_args(args, gamma=args.gamma, rows=args.rows)
        make_out_dir(args.out)
        rec = serving_record.start("serving-http", prog, argv, args, ap)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    from jspec.server.launch import free_port

    t0 = time.perf_counter()
    target = targets.load_target(args.model, args.dtype, args.layers)
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    specs = [runspec.plain_spec(), runspec.ngram_spec(target, args.gamma, adaptive=args.adaptive or None)]
    local = {"all": specs, "plain": specs[:1], "none": []}[args.in_process]
    # Each spec's two transports side by side: the machine's speed drifts over minutes, and the overhead figure
    # compares them.
    configs = [c for s in specs for c in [(s, HTTP)] + ([(s, IN_PROCESS)] if s in local else [])]
    port = args.port or free_port()
    results, comps = [], {}
    for rate in rates:
        load = Load.open(rate, args.rows, args.seed, cfg.timeout_s)
        first: dict[tuple[str, str], RunResult] = {}
        for i in range(cfg.passes):
            for position, (spec, transport) in enumerate(record.rotation(configs, i)):
                r = _run_one(args, target, spec, transport, load, jobs, cfg, port)
                suite_runs.free_compiled()
                key = (spec.label, transport)
                first.setdefault(key, r)
                first[key].extra.setdefault("passes", []).append(_pass(r, position, first[key]))
        results += first.values()
        comps[load.name] = comparisons(first)
    serving_record.add_runs(rec, results)
    path = serving_record.finish(rec, comparisons=comps, workloads=desc, runs=[r.to_json(False) for r in results])
    for name, c in comps.items():
        print(f"\n{name}:")
        for label, s in c["runs"].items():
            print(f"  {label:<28} TTFT p50/p95 {s['ttft_ms_p50'] or 0:6.0f}/{s['ttft_ms_p95'] or 0:6.0f} ms  ITL "
                  f"p50/p95 {s['itl_ms_p50'] or 0:5.1f}/{s['itl_ms_p95'] or 0:6.1f} ms  "
                  f"{s['output_tokens_per_s']:6.1f} tok/s  {s['finished_requests_per_s']:.2f} req/s  "
                  f"errors {s['errors']}")  # fmt: skip
        for k in ("goals", "http_overhead"):
            if k in c:
                print(f"  {k}: {c[k]}")
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0
