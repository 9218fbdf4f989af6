"""The HTTP serving benchmark (``examples/bench_http_serving.py``): at each Poisson arrival rate, a plain and one
or more speculative ``python -m jspec serve`` (``--drafters``, spelled as the grid spells them:
``ngram``, ``ngram:K``, ``ngram:goodput``) driven over loopback by ``http_runner``, and the in-process runner
(``runner.run``) serving the same jobs at the same arrival times with the same engine settings: speculation
on against off, and the HTTP path's overhead, in one run. The configurations run one at a time (a server is
started for its run and stopped after it); each drafter's HTTP and in-process runs side by side, the drafters'
order rotated and each pair's order swapped from pass to pass (``pass_order``).

The servers are built like the in-process engine (same rows, cache, prompt buckets, stop-id slots; no
log-probabilities, logit-bias slots or penalty counts, which the in-process engine does not compute either), so
both sides run the same device programs. The result file (``jspec.bench.record``) holds every pass (each with
its seed record); ``extra["comparisons"]`` the seed's record per configuration (TTFT and ITL p50/p95, tokens/s,
requests/s, errors) of the first pass and, over several passes, each field's median over them, and the issue's
goals, each with the numbers it was judged on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from jspec.bench import grid, http_runner, record, runspec, serving_record, suite_runs, targets
from jspec.bench.args import add_common_args, config_from_args, make_out_dir, rate_list
from jspec.bench.runspec import Load, RunResult, Spec

HTTP, IN_PROCESS = "http", "in-process"
SERVED_NAME = "bench"


def _server_args(args, spec: Spec, cfg: suite_runs.SuiteConfig, n_jobs: int) -> list[str]:
    out = ["--model", args.model, "--served-model-name", SERVED_NAME, "--rows", str(args.rows),
           "--max-len", str(cfg.max_len), "--bucket", str(cfg.bucket), "--rounds-per-sync", str(cfg.rounds_per_sync),
           "--max-queue", str(n_jobs), "--no-logprobs", "--no-penalties", "--max-logit-bias", "0",
           "--dtype", args.dtype, "--layers", args.layers, "--log-level", "warning"]  # fmt: skip
    out += server_drafter_args(spec)
    if args.compile_cache is not None:
        out += ["--compile-cache", args.compile_cache]
    return out


def server_drafter_args(spec: Spec) -> list[str]:
    """``python -m jspec serve``'s drafter flags for a spec of ``http_specs``: the engine the in-process run
    builds from the same spec (``Spec.engine_gamma``, ``goodput``, ``adaptive``)."""
    if spec.drafter is None:
        return ["--drafter", "none"]
    d = spec.drafter
    out = ["--drafter", "ngram", "--ngram-max", str(d.max_ngram), "--ngram-min", str(d.min_ngram)]
    out += ["--goodput"] if spec.goodput else ["--gamma", str(spec.gamma)]
    return out + (["--adaptive"] if spec.adaptive is not None else [])


def parse_drafters(text: str | None, gamma: int | None, adaptive: bool) -> list[grid.DrafterChoice]:
    """--drafters (the grid's spellings, ``grid.parse_drafter``), or ``ngram:K`` from --gamma (4 by default);
    before any model loads. ValueError naming the flag and what is wrong."""
    if text is not None and gamma is not None:
        raise ValueError("--gamma and --drafters both set K: give K in --drafters (ngram:K)")
    names = [t.strip() for t in (text if text is not None else f"ngram:{gamma or 4}").split(",")]
    if not all(names):
        raise ValueError(f"--drafters {text!r}: an empty entry")
    choices = []
    for name in names:
        try:
            c = grid.parse_drafter(name)
        except ValueError as e:
            raise ValueError(f"--drafters: {e}") from None
        if c.kind != "ngram":
            raise ValueError(f"--drafters: {name!r}: this benchmark runs the n-gram drafter (ngram, ngram:K, "
                             f"ngram:goodput); serve {c.kind} with python -m jspec serve --drafter eagle")  # fmt: skip
        if c.goodput and adaptive:
            raise ValueError(f"--adaptive with {name!r}: goodput chooses K each round, adaptive per row; pick one")
        choices.append(c)
    dup = sorted({c.name for c in choices if [d.name for d in choices].count(c.name) > 1})
    if dup:
        raise ValueError(f"--drafters {text!r}: {dup[0]} is given twice")
    return choices


def http_specs(target, choices: Sequence[grid.DrafterChoice], adaptive: bool = False) -> list[Spec]:
    """Plain decoding, then each n-gram choice (``ngram:goodput``: the engine's goodput=True, K up to 4)."""
    return [runspec.plain_spec()] + [
        runspec.ngram_spec(target, c.k, adaptive=adaptive or None, goodput=c.goodput) for c in choices
    ]


def pass_order(groups: Sequence[Sequence[Any]], index: int) -> list[Any]:
    """Pass ``index``'s order of the configurations: the groups (a drafter's HTTP and in-process runs) rotated
    (``record.rotation``), and each group's own order too (HTTP first in one pass, in-process in the next), so
    that no configuration always runs first or right after the same one, and each pair stays side by side."""
    return [c for g in record.rotation(list(groups), index) for c in record.rotation(list(g), index)]


def run_passes(groups: Sequence[Sequence[tuple[Spec, str]]], passes: int, run_one: Callable[[Spec, str], RunResult],
               log=print) -> dict[tuple[str, str], RunResult]:  # fmt: skip
    """Every configuration ``passes`` times in ``pass_order``; returns the first pass's result per (spec label,
    transport), each holding every pass in ``extra["passes"]`` (``_pass``: its position, throughput and seed
    record)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    first: dict[tuple[str, str], RunResult] = {}
    for i in range(passes):
        if passes > 1:
            log(f"  pass {i + 1}/{passes}")
        for position, (spec, transport) in enumerate(pass_order(groups, i)):
            start = time.time()
            r = run_one(spec, transport)
            end = time.time()
            key = (spec.label, transport)
            first.setdefault(key, r)
            entry = {**_pass(r, position, first[key]), "pass": i, "wall_clock": [start, end]}
            first[key].extra.setdefault("passes", []).append(entry)
    return first


def _run_one(args, target, spec: Spec, transport: str, load: Load, jobs, cfg, port: int) -> RunResult:
    label = f"{spec.label} ({transport})"
    if transport == IN_PROCESS:
        r = suite_runs.run_one(target, spec, load, jobs, cfg)
    else:
        log = os.path.join(args.out, f"server-{re.sub(r'[^A-Za-z0-9_.-]+', '_', spec.label)}.log")
        with http_runner.ServerProcess(_server_args(args, spec, cfg, len(jobs)), port, log) as server:
            r = http_runner.run(server.url, SERVED_NAME, spec, load, jobs, max_new_tokens=cfg.max_new_tokens,
                                sampling=cfg.sampling, max_wall_s=cfg.max_wall_s,
                                decode_text=target.decode_text)  # fmt: skip
            r.engine["server_start_s"] = server.start_s
        r.engine["server_exit_status"] = server.returncode  # 0: it drained and stopped cleanly
        if server.returncode != 0:
            print(f"  {label}: the server exited with status {server.returncode}; see {log}", flush=True)
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
        "seed_record": seed_record(r),
    }  # fmt: skip


def pass_medians(r: RunResult) -> dict[str, Any]:
    """Each numeric field of the seed record, its median over the run's passes (None where a pass has none)."""
    recs = [p["seed_record"] for p in r.extra.get("passes", ())]
    out: dict[str, Any] = {"passes": len(recs)}
    for k in recs[0] if recs else ():
        vals = [x[k] for x in recs]
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        out[k] = statistics.median(vals) if ok else None
    return out


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
    """One rate's runs ({(spec label, transport): result}) -> each run's seed record (first pass; over several
    passes also each field's median over them), each speculative configuration against plain over HTTP, the HTTP
    path against in-process, and the goals judged on them (first pass), per speculative configuration."""
    rec = {f"{label} ({t})": seed_record(r) for (label, t), r in runs.items()}
    out: dict[str, Any] = {"runs": rec}
    if any(len(r.extra.get("passes", ())) > 1 for r in runs.values()):
        out["median_over_passes"] = {f"{label} ({t})": pass_medians(r) for (label, t), r in runs.items()}
    plain = next((r for (_, t), r in runs.items() if t == HTTP and r.spec.drafter is None), None)
    specs = {label: r for (label, t), r in runs.items() if t == HTTP and r.spec.drafter is not None}
    if plain is not None and specs:
        p = seed_record(plain)
        out["speculative_vs_plain_http"], out["goals"] = {}, {}
        for label, spec in specs.items():
            s = seed_record(spec)
            out["speculative_vs_plain_http"][label] = {
                "itl_ms_p95": [s["itl_ms_p95"], p["itl_ms_p95"]],
                "finished_requests_per_s": [s["finished_requests_per_s"], p["finished_requests_per_s"]],
                "same_tokens": spec.tokens_by_id() == plain.tokens_by_id(),
            }
            n_min = min(p["submitted"], s["submitted"])
            out["goals"][label] = {
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
        for label, goals in out.get("goals", {}).items():
            judged = [o for lab, o in overhead.items() if lab in (label, plain.label)]
            goals["http_overhead_under_5pct_tokens_per_s"] = all(o["tokens_per_s_loss"] < 0.05 for o in judged)
    return out


def main(argv=None, prog: str = "python examples/bench_http_serving.py") -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--rates", default="1", help="Poisson arrival rates, requests/s")
    ap.add_argument("--rows", type=int, default=8, help="engine rows (the servers' and the in-process runner's)")
    ap.add_argument("--drafters", default=None, help="comma-separated, as the grid spells them: ngram, ngram:K, "
                    "ngram:goodput (K chosen each round from measured costs, up to 4); default ngram:4")  # fmt: skip
    ap.add_argument("--gamma", type=int, default=None, help="the n-gram drafter's K without --drafters (default 4)")
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
        choices = parse_drafters(args.drafters, args.gamma, args.adaptive)
        make_out_dir(args.out)
        rec = serving_record.start("serving-http", prog, argv, args, ap)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    from jspec.server.launch import free_port

    t0 = time.perf_counter()
    target = targets.load_target(args.model, args.dtype, args.layers)
    jobs, desc = suite_runs.prepare_jobs(target, cfg)
    specs = http_specs(target, choices, args.adaptive)
    local = {"all": specs, "plain": specs[:1], "none": []}[args.in_process]
    # Each spec's two transports side by side: the machine's speed drifts over minutes, and the overhead figure
    # compares them.
    groups = [[(s, HTTP)] + ([(s, IN_PROCESS)] if s in local else []) for s in specs]
    port = args.port or free_port()
    results, comps = [], {}
    for rate in rates:
        load = Load.open(rate, args.rows, args.seed, cfg.timeout_s)

        def one(spec: Spec, transport: str, load=load) -> RunResult:
            r = _run_one(args, target, spec, transport, load, jobs, cfg, port)
            suite_runs.free_compiled()
            return r

        first = run_passes(groups, cfg.passes, one)
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
