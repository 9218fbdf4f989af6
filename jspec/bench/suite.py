"""``python -m jspec bench``: the default suite, and the building blocks the suite scripts in ``examples/`` use.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jspec.bench import checks, metrics, peers, plotting, ratios, report, runner, runspec, serving_record, workloads
from jspec.bench.args import add_common_args, add_peer_args, config_from_args, make_out_dir, peer_names
from jspec.bench.runspec import Load, RunResult, Sampling, Spec
from jspec.loaders import end_ids


@dataclasses.dataclass
class Target:
    """A loaded checkpoint (through ``jspec.loaders.model_loader()``) and where it came from."""

    name: str
    config: Any
    params: Any
    model: Any
    tokenizer: Any
    path: str | None
    dtype: str

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(end_ids(self.tokenizer))  # every end token (Llama-3: <|eot_id|> too)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def info(self) -> dict[str, Any]:
        cfg = self.config
        cfg_d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
        return {
            "name": self.name,
            "dtype": self.dtype,
            "config": cfg_d,
            "params_bytes": metrics.tree_bytes(self.params),
            **metrics.file_fingerprint(self.path),
        }


def _checkpoint_path(load, name: str) -> str | None:
    """The checkpoint file behind ``name``: the path itself, or the loader module's ``resolve(name)`` when
    it has one (the registered loader of this repository does), read without importing any model package."""
    if os.path.exists(name):
        return name
    mod = inspect.getmodule(load)
    resolve = getattr(mod, "resolve", None)
    if callable(resolve):
        try:
            return os.fspath(resolve(name))
        except Exception:
            return None
    return None


def load_target(name: str = "smollm2-135m-instruct", dtype: str = "float32", layers: str = "stacked") -> Target:
    """layers: "stacked", "unstacked" (per-layer arrays: faster CPU decode steps, longer compiles) or "auto"
    (unstacked on CPU and GPU)."""
    from jspec.loaders import load_model, model_loader, wants_unstacked

    unstacked = wants_unstacked(layers)  # refuses anything else before loading
    load = model_loader()
    config, params, model, tok = load_model(load, name, dtype, unstacked=unstacked)
    if tok is None:
        raise SystemExit(f"'{name}' has no tokenizer; the benchmark workloads need one")
    return Target(name, config, params, model, tok, _checkpoint_path(load, name), dtype)


def tokenizer_info(tok) -> dict[str, Any]:
    tmpl = getattr(tok, "chat_template", None)
    return {
        "type": type(tok).__name__,
        "vocab_size": getattr(tok, "vocab_size", None),
        "eos_id": getattr(tok, "eos_id", None),
        "eos_ids": list(getattr(tok, "eos_ids", ())),
        "bos_id": getattr(tok, "bos_id", None),
        "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest()[:16] if tmpl else None,
        "summary": f"{type(tok).__name__} (vocab {getattr(tok, 'vocab_size', '?')}, EOS {getattr(tok, 'eos_id', '?')})",
    }


# --------------------------------------------------------------------------------------------------------
# Specs


def plain_spec() -> Spec:
    return Spec("plain", peer="plain")


def ngram_spec(target: Target, gamma: int = 4, max_ngram: int = 3, min_ngram: int = 1, adaptive=None) -> Spec:
    from jspec.ngram import NgramDrafter

    d = NgramDrafter(max_ngram, min_ngram, vocab_size=target.model.vocab_size)
    variant = (max_ngram, min_ngram) != (3, 1)
    label = f"ngram K={gamma}" + (f" n={max_ngram}..{min_ngram}" if variant else "")
    # Compared with the peers' prompt lookup only when configured like it (n-grams 3..1); K is checked where the
    # peers' K is known: ``headline`` and ``tables.peers_table`` give no ratio against a peer that ran another K
    # (``ratios.ratio_blockers``).
    spec = Spec(label, d, gamma, None, adaptive=adaptive, peer=None if variant else "prompt_lookup")
    return dataclasses.replace(spec, label=label + " adaptive") if spec.adaptive is not None else spec


def model_spec(label: str, draft_model, draft_params, gamma: int = 4, peer: str | None = "assisted") -> Spec:
    from jspec.drafters import ModelDrafter

    return Spec(label, ModelDrafter(draft_model), gamma, draft_params, peer=peer)


# --------------------------------------------------------------------------------------------------------
# Running


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
    """Per-phase costs of every run of one load, sampled interleaved (see ``metrics.PhaseTimer``)."""
    from jspec.serve import engine_slots
    from jspec.state import DecodeConfig

    timers = []
    for res in group:
        spec = res.spec
        slots = engine_slots(target.model, spec.drafter, cfg.max_len)  # the engine's own cache, tree scratch included
        config = DecodeConfig(res.engine["gamma"], slots, target.eos_ids, False, spec.adaptive, spec.block_verify)
        timers.append(
            metrics.PhaseTimer(target.model, target.params, spec.drafter, spec.draft_params, config,
                               res.load.concurrency, context_len, temperature=cfg.sampling.temperature,
                               top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, min_p=cfg.sampling.min_p)
        )  # fmt: skip
    for res, ph in zip(group, metrics.measure_phases_interleaved(timers, cfg.phase_repeats)):
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


def pass_ratios(r: RunResult, plain: RunResult) -> dict[str, list[float | None]] | None:
    """Per pass: r's end-to-end and decode throughput over plain's in the same pass (None for one pass); a
    pass in which the two served different requests, or one of them none (``ratios.no_ratio``), has None: no
    ratio."""
    a, b = r.extra.get("passes") or [], plain.extra.get("passes") or []
    if min(len(a), len(b)) < 2:
        return None
    same = [ratios.no_ratio(x, y) is None for x, y in zip(a, b)]

    def ratio(x, y, key):  # no decode ratio where a side emitted nothing after its first tokens (as headline)
        rx, ry = x[f"{key}_tokens_per_s"], y[f"{key}_tokens_per_s"]
        return rx / ry if rx > 0 and ry > 0 else None

    return {key: [ratio(x, y, key) if ok else None for x, y, ok in zip(a, b, same)] for key in ("output", "decode")}


def _ratios_text(xs: Sequence[float | None]) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}" for x in xs)


def _range_text(xs: Sequence[float | None]) -> str:
    kept = [x for x in xs if x is not None]
    return f"{min(kept):.2f}-{max(kept):.2f}x" if kept else "-"


def _median_text(xs: Sequence[float | None]) -> str:
    kept = [x for x in xs if x is not None]
    return f"{statistics.median(kept):.2f}x" if kept else "-"


def run_peer_set(
    target: Target,
    names: Sequence[str],
    jobs,
    cfg: SuiteConfig,
    gamma: int,
    plain: RunResult | None,
    assistant_layers: int | None = None,
    log=print,
    jspec_runs: Sequence[RunResult] = (),
) -> list[peers.PeerRun]:
    """The named peers on the same checkpoint file and jobs; each available run records how it differs from
    jspec's run (weights' and KV cache's precision, device, thread count: ``peers.like_for_like_problems``; at
    temperature 0 greedy outputs other than ``plain``'s: ``ratios.outputs_differ``) as
    ``info["not_like_for_like"]``, where ``headline`` and the report look before printing a ratio.

    Both peers get one thread count: ``cfg.peer_threads``, else jspec's (``metrics.jspec_threads``: XLA's pool),
    recorded in ``info["jspec"]``. ``jspec_runs``: jspec's runs, for ``info["after_jspec_s"]``: per jspec run the
    peer is compared with (its technique, closed loop at concurrency 1), the seconds from the end of its last pass
    to the start of the peer's timed run (``ratios.peer_gap_s``): the peers run after jspec's runs, not
    interleaved with them."""
    if not names:
        return []
    if target.dtype != "float32":  # no peer runs jspec's bfloat16: every ratio would compare precisions too
        why = (
            f"jspec runs {target.dtype} here, transformers float32 and llama.cpp the file's own weight types: "
            "no like-for-like ratio"
        )
        return [peers.PeerRun(n, "plain", n, False, why) for n in names]
    ours = metrics.jspec_threads()
    threads = cfg.peer_threads or ours["threads"]
    runs = peers.run_peers(
        names,
        target.path,
        jobs,
        assistant_layers=assistant_layers,
        gamma=gamma,
        max_new_tokens=cfg.max_new_tokens,
        max_len=cfg.max_len,
        eos_ids=target.eos_ids,
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        min_p=cfg.sampling.min_p,
        decode_text=target.decode_text,
        scorer=_scorer,
        max_wall_s=cfg.max_wall_s,
        freeze_gc=cfg.freeze_gc,
        threads=threads,
    )
    backend = jax.default_backend()
    for p in runs:
        if not p.available:
            log(f"  {p.label:<28} skipped: {p.reason}")
            continue
        p.info["jspec"] = {"dtype": target.dtype, "backend": backend, "threads": ours["threads"],
                           "threads_how": ours["how"]}  # fmt: skip
        p.info["not_like_for_like"] = peers.like_for_like_problems(
            p.info, dtype=target.dtype, backend=backend, threads=ours["threads"]
        )
        as_run = RunResult(
            plain_spec(), Load.closed(1), cfg.sampling, cfg.max_new_tokens, p.records, p.summary, {}, {}, {}
        )
        p.quality = checks.quality_summary(as_run, plain)
        differ = None
        if plain is not None:
            differ = ratios.outputs_differ(p.quality, p.summary, plain.summary, cfg.sampling.temperature,
                                           ref="jspec's plain")  # fmt: skip
        if differ:  # not the same outputs: a ratio would compare other work
            p.info["not_like_for_like"].append(differ)
        mates = [r for r in jspec_runs if _peer_mate(r, p.technique)]
        gaps = {r.spec.label: ratios.peer_gap_s({"passes": r.extra.get("passes")}, p.info) for r in mates}
        p.info["after_jspec_s"] = {k: v for k, v in gaps.items() if v is not None}
        note = f"  (not like for like: {'; '.join(p.info['not_like_for_like'])})" if p.info["not_like_for_like"] else ""
        log(f"  {p.label:<28} {'closed c=1':<18} {p.summary['output_tokens_per_s']:7.1f} tok/s{note}")
    return runs


def _peer_mate(r: RunResult, technique: str) -> bool:
    """Whether jspec's run ``r`` is the one a peer of ``technique`` is compared with (closed loop, concurrency 1)."""
    return r.load.mode == "closed" and r.load.concurrency == 1 and (r.spec.peer or r.spec.kind) == technique


def payload(
    name: str,
    argv: Sequence[str] | None,
    meta_d: dict,
    results: Sequence[RunResult],
    peer_runs: Sequence[peers.PeerRun] = (),
    **extra,
) -> dict[str, Any]:
    cmd = None
    if argv is not None:
        cmd = " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0]) or "python", *argv])
    return {
        "suite": name,
        "command": extra.pop("command", None) or cmd,
        "meta": meta_d,
        "runs": [r.to_json() for r in results],
        "peers": [p.to_json() for p in peer_runs],
        **extra,
    }


def write_outputs(out_dir: str, name: str, pl: dict[str, Any], plots: Sequence[str] = ()) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    js = report.write_json(os.path.join(out_dir, f"{name}.json"), pl)
    md = report.write_markdown(os.path.join(out_dir, f"{name}.md"), pl, plots)
    return {"json": js, "markdown": md}


def write_results(
    out_dir: str,
    name: str,
    pl: dict[str, Any],
    plots: Sequence[tuple[str, Callable[[str], str]]] = (),
    log=print,
) -> tuple[dict[str, str], list[str]]:
    """``<out_dir>/<name>.json`` and ``.md`` first, then the plots: each (file name, draw(path) -> path), drawn
    into ``out_dir`` and linked from the Markdown, which is written again with them. Without matplotlib (an
    optional dependency) the plots are skipped with a note: a finished benchmark never loses its results to a
    plot. Returns the paths written ({"json", "markdown"}) and the plots drawn."""
    paths = write_outputs(out_dir, name, pl)
    if not plots:
        return paths, []
    missing = plotting.plotting_unavailable()
    if missing:
        log(f"plots skipped: {missing}")
        return paths, []
    drawn = [draw(os.path.join(out_dir, file)) for file, draw in plots]
    report.write_markdown(paths["markdown"], pl, drawn)
    return paths, drawn


def headline(results: Sequence[RunResult], peer_runs: Sequence[peers.PeerRun] = ()) -> list[str]:
    """One line per speculative run: its speedup over plain at the same load in the same run group
    (``run_specs(group=...)``), and its ratio to the peers of its technique where they are like for like
    (``ratios.ratio_blockers``: same weights' and cache's precision, same device, same K), else why not.

    No ratio is printed between runs that served different requests (``ratios.requests_differ``: a wall limit
    or deadlines cut them differently) or where a side finished no request (``ratios.nothing_served``: every
    request failed, e.g. refused by the engine), and an open loop's end-to-end ratio is not printed (its wall
    time is the arrivals' span, whatever the decoding speed): its decode ratio is. Nor is one at temperature > 0
    (``ratios.sampled_note``: the two sides sampled other outputs, as ``python -m jspec generate --compare`` says),
    against plain or a peer: the decode ratio is. At temperature 0 a run whose outputs differ from plain's is
    flagged (``ratios.outputs_differ``): its ratios compare other outputs. Against a peer (one run), jspec's side
    is the median over its passes (``ratios.jspec_rates``), as the line says, and what the ratio still compares
    besides the implementations follows it (``ratios.peer_caveats``: another prompt-lookup policy, with each
    side's tokens per verify round; the time between the two runs, which are not interleaved)."""
    lines = []
    for r in results:
        if r.spec.kind == "plain":
            continue
        group = r.extra.get("group")
        plain = next(
            (p for p in results if p.spec.kind == "plain" and p.load == r.load and p.extra.get("group") == group),
            None,
        )
        if plain is None:
            continue
        sp = r.summary["output_tokens_per_s"] / max(plain.summary["output_tokens_per_s"], 1e-9)
        rd, pd = r.summary["decode_tokens_per_s"], plain.summary["decode_tokens_per_s"]
        # No decode ratio when a side decoded nothing after its first tokens (every request ended at its first).
        dsp = f"{rd / pd:.2f}x" if rd > 0 and pd > 0 else "no ratio (no tokens after the first)"
        where = f"{r.load.name}, {group}" if group else r.load.name
        sampled = ratios.sampled_note(r.sampling.temperature)
        # Why no end-to-end ratio is given though the two runs served the same requests: an open loop's wall time
        # is its arrivals'; at temperature > 0 the two sides sampled other outputs.
        no_e2e = "; ".join(filter(None, [ratios.open_loop_note() if r.load.mode == "open" else None, sampled]))
        why = ratios.no_ratio(r.summary, plain.summary)
        if why:
            line = f"{r.spec.label} @ {where}: no ratio to plain in pass 1 ({why})"
        elif no_e2e:
            line = f"{r.spec.label} @ {where}: {dsp} plain decode (end-to-end: {no_e2e})"
        else:
            line = f"{r.spec.label} @ {where}: {sp:.2f}x plain end-to-end, {dsp} decode"
        differ = None if why else ratios.outputs_differ(r.quality, r.summary, plain.summary, r.sampling.temperature)
        if differ:  # greedy speculation reproduces plain decoding: these ratios compare other outputs
            line += f" [{differ}: the ratios compare other outputs]"
        per = pass_ratios(r, plain)
        if per is not None:
            e2e = "" if no_e2e else f"{_ratios_text(per['output'])} end-to-end, "
            med = f"{_median_text(per['decode'])}" if no_e2e else f"{_median_text(per['output'])} / "
            med += "" if no_e2e else _median_text(per["decode"])
            line += "; by pass (" if why else " in pass 1 ("
            rng = _range_text(per["decode"])
            rng = rng if no_e2e else f"{_range_text(per['output'])} / {rng}"
            line += f"passes: {e2e}{_ratios_text(per['decode'])} decode; median {med}, min-max {rng}"
            if None in per["decode"]:
                line += "; '-': that pass's runs served different requests (or one of them none)"
            line += ")"
        cm = r.cost_model or {}
        if cm.get("measured_rounds"):
            line += f" (cost model: {cm['measured_rounds']['speedup']:.2f}x from whole rounds"
            if cm.get("seed", {}).get("speedup"):
                wide = cm["seed"].get("all_rounds_wide", True)
                line += f", {cm['seed']['speedup']:.2f}x seed formula" + ("" if wide else " (if every round drafted K)")
            line += ")"
        if r.load.mode == "closed" and r.load.concurrency == 1:
            for p in peer_runs:
                ps = p.summary
                if p.available and p.technique == (r.spec.peer or r.spec.kind) and ps.get("decode_tokens_per_s"):
                    blocked = ratios.ratio_blockers(p.info, p.technique, r.spec.describe())
                    if blocked:
                        line += f"; vs {p.label}: no ratio ({blocked}: not like for like)"
                        continue
                    jt, jd, how = ratios.jspec_rates({"summary": r.summary, "passes": r.extra.get("passes")}, ps)
                    if jt is None:
                        line += f"; vs {p.label}: no ratio ({how})"
                        continue
                    if sampled:  # the peer sampled other outputs too: its decode ratio only
                        dec = f"{jd / ps['decode_tokens_per_s']:.2f}x decode" if jd else "no decode ratio"
                        line += f"; vs {p.label}: {dec} (end-to-end: {sampled})"
                    else:
                        line += f"; vs {p.label}: {jt / max(ps['output_tokens_per_s'], 1e-9):.2f}x end-to-end"
                        if jd:
                            line += f", {jd / ps['decode_tokens_per_s']:.2f}x decode"
                    if how != "one pass":
                        line += f" (jspec: {how}; the peer: its one run)"
                    caveats = ratios.peer_caveats({"spec": r.spec.describe(), "passes": r.extra.get("passes")},
                                                  p.technique, p.info)  # fmt: skip
                    if p.technique != "plain":  # next to the lookup policy, when there is one
                        ptr = p.info.get("tokens_per_round")
                        caveats.insert(p.technique == "prompt_lookup",
                                       f"tokens/round jspec {r.decode_stats.get('tokens_per_round', 0):.2f}, the "
                                       f"peer {'-' if ptr is None else f'{ptr:.2f}'}")  # fmt: skip
                    if caveats:
                        line += f" [{'; '.join(caveats)}]"
        lines.append(line)
    return lines


# --------------------------------------------------------------------------------------------------------
# Command


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
        target = load_target(args.model, args.dtype, args.layers)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_suite(args, argv, names, cfg, target, t0, rec)


def _run_suite(args, argv: Sequence[str] | None, names, cfg, target, t0: float, rec) -> int:
    jobs, desc = prepare_jobs(target, cfg)
    print(f"{len(jobs)} requests ({', '.join(cfg.workloads)}), input tokens median {desc['input_len']['median']:.0f}")
    specs = [plain_spec(), ngram_spec(target, args.gamma)]
    loads = [Load.closed(1, cfg.timeout_s)]
    if args.concurrency > 1:
        loads.append(Load.closed(args.concurrency, cfg.timeout_s))
    results = run_specs(target, specs, loads, jobs, cfg)
    cmd = rec.data["command"]
    serving_record.add_runs(rec, results)
    rec.write()  # jspec's runs, unfinished until the peers have run
    meta_d = meta(target, cfg, desc)
    if names:  # jspec's runs first: the peers below are slow, and may fail or be stopped
        pl = payload(args.name, None, meta_d, results, headline=headline(results), command=cmd, peers_pending=names)
        paths = write_outputs(args.out, args.name, pl)
        print(f"jspec's runs written to {paths['json']} (the peers' runs follow)")
    plain1 = next(r for r in results if r.spec.kind == "plain" and r.load.concurrency == 1)
    peer_runs = run_peer_set(target, names, jobs, cfg, args.gamma, plain1, jspec_runs=results)
    lines = headline(results, peer_runs)
    pl = payload(args.name, None, meta_d, results, peer_runs, headline=lines, command=cmd)
    record_path = serving_record.finish(rec, peer_runs, headline=lines)
    plots = [
        (f"{args.name}_latency_c1.png", lambda path: plotting.plot_latency(pl, path, loads[0].name)),
        (f"{args.name}_acceptance.png", lambda path: plotting.plot_acceptance_by_position(pl, path)),
    ]
    paths, drawn = write_results(args.out, args.name, pl, plots)
    print("\n".join(["", *lines]))
    print(f"\nwrote {record_path}, {paths['json']}, {paths['markdown']} and {len(drawn)} plots "
          f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
