"""jspec's runs of a suite: every configuration at every load, over interleaved passes, then their checks.

``SuiteConfig`` holds what is fixed across the runs (workloads, sampling, budgets, cache slots, passes);
``prepare_jobs`` builds and tokenises the prompt sets and ``meta`` describes the environment, model and
workloads for the result. ``run_specs`` serves every ``Spec`` at every ``Load`` through ``runner.run``, the
order alternating from pass to pass so drift in the machine's speed is not credited to one configuration; then
it measures per-phase costs (``attach_phases``), quality against plain and the cost-model check (``checks``).
``free_compiled`` drops compiled programs between configurations.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jspec.bench import checks, metrics, phase_costs, runner, runspec, workloads
from jspec.bench.runspec import Load, RunResult, Sampling, Spec
from jspec.bench.targets import Target, tokenizer_info


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """Everything fixed across the runs of one suite (written into the result)."""

    workloads: tuple[str, ...] = workloads.WORKLOADS
    n_per_workload: int = 4
    seed: int = 0
    max_new_tokens: int = 96
    max_len: int = 640
    sampling: Sampling = Sampling()
    chat_template: bool = True
    bucket: int = 64
    timeout_s: float | None = None
    phase_repeats: int = 5
    measure_phases: bool = True
    max_wall_s: float | None = None
    rounds_per_sync: int = 1  # decode rounds per engine step (one host sync each)
    passes: int = 1  # runs of every configuration, in alternating order (see ``run_specs``)
    freeze_gc: bool = True  # Python heap frozen in timed runs (``metrics.timed_region_gc``), peers' too
    peer_threads: int | None = None  # both peers' thread count; None: jspec's (``metrics.jspec_threads``)


def prepare_jobs(target: Target, cfg: SuiteConfig) -> tuple[list[runspec.Job], dict[str, Any]]:
    """Build and tokenise the prompt sets; returns the jobs and the workload description for the result."""
    reqs = workloads.build(cfg.workloads, cfg.n_per_workload, cfg.seed)
    jobs = runspec.make_jobs(reqs, target.tokenizer, cfg.chat_template)
    per: dict[str, Any] = {}
    for w in cfg.workloads:
        lens = [len(j.prompt) for j in jobs if j.workload == w and j.prompt is not None]
        per[w] = {"n": sum(j.workload == w for j in jobs), "input_len": workloads.length_summary(lens)}
    desc = {
        "names": list(cfg.workloads),
        "n_per_workload": cfg.n_per_workload,
        "fingerprint": workloads.workload_fingerprint(reqs),
        "per_workload": per,
        "input_len": workloads.length_summary([len(j.prompt) for j in jobs if j.prompt is not None]),
        "python_for_grounded_passages": sys.version.split()[0],
    }
    return jobs, desc


def meta(target: Target, cfg: SuiteConfig, jobs_desc: dict[str, Any]) -> dict[str, Any]:
    return {
        "environment": metrics.environment(),
        "model": target.info(),
        "tokenizer": tokenizer_info(target.tokenizer),
        "chat_template": cfg.chat_template,
        "sampling": dataclasses.asdict(cfg.sampling),
        "stop_rules": {"eos_ids": list(target.eos_ids), "max_new_tokens": cfg.max_new_tokens},
        "max_len": cfg.max_len,
        "cache_policy": "index-masked KV cache, max_len slots per row, no prefix sharing",
        "seed": cfg.seed,
        "workloads": jobs_desc,
        "suite_config": dataclasses.asdict(cfg),
    }


def _scorer(req, text):
    return workloads.score(req, text)


def run_one(target: Target, spec: Spec, load: Load, jobs, cfg: SuiteConfig, log=print) -> RunResult:
    res = runner.run(
        target.model,
        target.params,
        spec,
        load,
        jobs,
        max_new_tokens=cfg.max_new_tokens,
        max_len=cfg.max_len,
        sampling=cfg.sampling,
        eos_ids=target.eos_ids,
        seed=cfg.seed,
        bucket=cfg.bucket,
        decode_text=target.decode_text,
        scorer=_scorer,
        max_wall_s=cfg.max_wall_s,
        rounds_per_sync=cfg.rounds_per_sync,
        freeze_gc=cfg.freeze_gc,
    )
    s = res.summary
    log(
        f"  {spec.label:<28} {load.name:<18} {s['output_tokens_per_s']:7.1f} tok/s "
        f"(decode {s['decode_tokens_per_s']:6.1f})  "
        f"{s['finished']}/{s['submitted']} done  tokens/round {res.decode_stats['tokens_per_round']:.2f}  "
        f"TTFT p50 {s['ttft_ms']['median'] or 0:.0f} ms  ITL p95 {s['itl_ms']['p95'] or 0:.1f} ms"
    )
    return res


def attach_phases(target: Target, group: Sequence[RunResult], cfg: SuiteConfig, context_len: int) -> None:
    """Per-phase costs of every run of one load, sampled interleaved (see ``phase_costs.PhaseTimer``)."""
    from jspec.serve import engine_slots
    from jspec.state import DecodeConfig

    timers = []
    for res in group:
        spec = res.spec
        slots = engine_slots(target.model, spec.drafter, cfg.max_len)  # the engine's own cache, tree scratch included
        config = DecodeConfig(res.engine["gamma"], slots, target.eos_ids, False, spec.adaptive, spec.block_verify)
        timers.append(
            phase_costs.PhaseTimer(target.model, target.params, spec.drafter, spec.draft_params, config,
                               res.load.concurrency, context_len, temperature=cfg.sampling.temperature,
                               top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, min_p=cfg.sampling.min_p)
        )  # fmt: skip
    for res, ph in zip(group, phase_costs.measure_phases_interleaved(timers, cfg.phase_repeats)):
        res.phases = ph
        scratch = ph.get("round_scratch_bytes")
        if scratch is not None:
            res.memory["round_scratch_bytes"] = scratch
            res.memory["device_bytes_with_scratch"] = res.memory["device_bytes"] + scratch


def free_compiled() -> None:
    """Drop every compiled program. XLA:CPU maps each program's code into memory regions of its own (one set
    per kernel), and a long benchmark compiling dozens of engines passed Linux's vm.max_map_count (65530):
    "LLVM ERROR: Unable to allocate section memory". Nothing compiled is shared between configurations, and
    compilation is never timed, so freeing between them costs nothing measured."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def run_specs(
    target: Target,
    specs: Sequence[Spec],
    loads: Sequence[Load],
    jobs,
    cfg: SuiteConfig,
    log=print,
    group: str | None = None,
) -> list[RunResult]:
    """Every spec at every load (spec order interleaved within each load), then phases, quality vs plain and
    the cost-model check. The first spec should be plain: it is the reference for speedups and exact match.

    group: a name for this call's runs (``extra["group"]``), for a script that calls ``run_specs`` more than
    once on loads that may coincide (the K sweep and the batch sweep): ``headline`` and the report's tables pair
    each run with the plain run of its own group only, measured with it on the same jobs.

    With ``cfg.passes`` = N > 1 every spec runs N times per load, the order reversed on every other pass
    (A B, B A, A B, ...): these CPUs' speed drifts over minutes, and a single pass could credit the drift to
    whichever configuration ran in the fast spell. The tables report the first pass; each result keeps every
    pass's throughput in ``extra["passes"]`` (with whether its tokens equal the first pass's), from which
    ``headline`` gives each pass's ratio and their median. A peer runs once: its ratio takes the median of
    jspec's passes (``ratios.jspec_rates``). Each pass records its wall clock (start and end of the run, warm-up
    included, Unix seconds), from which ``ratios.peer_gap_s`` gives how long after it a peer ran."""
    results: list[RunResult] = []
    ctx = int(np.median([len(j.prompt) for j in jobs if j.prompt is not None]) + cfg.max_new_tokens // 2)
    if cfg.passes < 1:
        raise ValueError(f"passes must be >= 1, got {cfg.passes}")
    for load in loads:
        slots: list[RunResult | None] = [None] * len(specs)
        for i in range(cfg.passes):
            order = range(len(specs)) if i % 2 == 0 else reversed(range(len(specs)))
            if cfg.passes > 1:
                log(f"  pass {i + 1}/{cfg.passes}")
            for position, j in enumerate(order):
                start = time.time()
                r = run_one(target, specs[j], load, jobs, cfg, log)
                end = time.time()
                free_compiled()
                if slots[j] is None:
                    slots[j] = r
                summary = {**_pass_summary(r, slots[j]), "wall_clock": [start, end], "position": position}
                slots[j].extra.setdefault("passes", []).append(summary)
        done = [r for r in slots if r is not None]
        if group is not None:
            for r in done:
                r.extra["group"] = group
        if cfg.measure_phases:
            attach_phases(target, done, cfg, ctx)
            free_compiled()
        plain = next((r for r in done if r.spec.kind == "plain"), None)
        for r in done:
            r.quality = checks.quality_summary(r, plain if r is not plain else None)
            if plain is not None and r is not plain and r.phases and plain.phases:
                r.cost_model = checks.cost_model_check(r, plain, r.phases, plain.phases)
        results += done
    return results


def _pass_summary(r: RunResult, first: RunResult) -> dict[str, Any]:
    s = r.summary
    return {
        # Which requests this pass served (``ratios.requests_differ``): a wall limit can cut passes differently.
        **{k: s.get(k) for k in ("request_set", "submitted", "finished", "errors", "timeouts", "not_run")},
        "output_tokens": s["output_tokens"],
        "wall_s": s["wall_s"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "decode_tokens_per_s": s["decode_tokens_per_s"],
        "ttft_ms_p50": s["ttft_ms"]["median"],
        "tokens_per_round": r.decode_stats.get("tokens_per_round"),
        "same_tokens_as_first_pass": r.tokens_by_id() == first.tokens_by_id(),
        "gc": r.engine.get("gc"),
    }
