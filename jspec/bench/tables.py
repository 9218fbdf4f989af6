"""The Markdown tables of a benchmark's report, each rendered from the JSON payload's runs and peers.

``results_table`` (one row per configuration at one load: throughput, its ratio to plain, latency
percentiles, rounds), ``cost_table`` (the cost-model check next to the measured speedups), ``quality_table``
(task quality and exact match with plain), ``memory_table``, ``peers_table`` (each peer next to jspec's run of
the same technique) and ``meta_block`` (machine, versions, model, workloads). Which ratios a cell gives, and
why one is refused, is decided in ``ratios``; ``report.markdown`` puts the tables together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jspec.bench.ratios import (
    DIFFER_SUFFIX,
    SAMPLED_CELL,
    jspec_rates,
    no_ratio,
    no_ratio_cell,
    outputs_differ,
    peer_caveats,
    ratio_blockers,
    sampled_note,
)

MB = 1 << 20


def _f(x, nd: int = 1, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x}{unit}"
    return f"{x:.{nd}f}{unit}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def tokens_per_round_text(run: dict[str, Any], peer_info: dict[str, Any]) -> str:
    """jspec's tokens per verify round and the peer's (where observable: ``peer_transformers.tokens_per_round``)."""
    ours = (run.get("decode_stats") or {}).get("tokens_per_round")
    return f"{_f(ours, 2)} / {_f(peer_info.get('tokens_per_round'), 2)}"


def _temperature(r: dict[str, Any]) -> float:
    return (r.get("sampling") or {}).get("temperature") or 0.0


def _plain_of(runs: Sequence[dict], load_name: str, group: str | None = None) -> dict | None:
    """The plain run at ``load_name`` in the same run group (``run_specs(group=...)``): sweeps that share a
    load are separate groups (other jobs, other moments), so a run is never divided by another group's plain."""
    return next((r for r in runs if _in(r, load_name, group) and r["spec"]["kind"] == "plain"), None)


def _in(r: dict, load_name: str, group: str | None) -> bool:
    return r["load_name"] == load_name and r.get("group") == group


def _run_label(r: dict) -> str:
    """A run's label with its load (and its group when it has one), for tables that mix loads."""
    where = f"{r['group']}, {r['load_name']}" if r.get("group") else r["load_name"]
    return f"{r['spec']['label']} ({where})"


def results_table(runs: Sequence[dict], load_name: str, group: str | None = None) -> str:
    """One row per configuration at one load (of one run group): throughput, its ratio to plain, latency
    percentiles, rounds."""
    plain = _plain_of(runs, load_name, group)
    base = plain["summary"]["output_tokens_per_s"] if plain else None
    dbase = plain["summary"].get("decode_tokens_per_s") if plain else None
    rows = []
    for r in runs:
        if not _in(r, load_name, group):
            continue
        s, d, q = r["summary"], r["decode_stats"], r.get("quality") or {}
        tps, dps = s["output_tokens_per_s"], s.get("decode_tokens_per_s")
        out_ratio = _f(tps / base, 2, "x") if base else "-"
        dec_ratio = _f(dps / dbase, 2, "x") if dbase and dps else "-"
        why = no_ratio(s, plain["summary"]) if plain is not None and r is not plain else None
        differ = (
            outputs_differ(q, s, plain["summary"], _temperature(r)) if plain is not None and r is not plain else None
        )
        if why:  # not the same work on both sides, or none: no ratio (the finished column says what each served)
            out_ratio = dec_ratio = no_ratio_cell(why)
        elif r["load"].get("mode") == "open" and r is not plain:
            out_ratio = "- (arrival-bound)"
        elif sampled_note(_temperature(r)) and r is not plain:
            out_ratio = SAMPLED_CELL
        if differ and not why:  # greedy outputs that are not plain's: the ratios compare other outputs
            out_ratio += DIFFER_SUFFIX if out_ratio.endswith("x") else ""
            dec_ratio += DIFFER_SUFFIX if dec_ratio.endswith("x") else ""
        same = _pct(q.get("exact_match_vs_plain")) if r["spec"]["kind"] != "plain" else "ref"
        if differ:
            same += f" ({differ})"
        rows.append(
            [
                r["spec"]["label"],
                _f(tps),
                out_ratio,
                _f(dps),
                dec_ratio,
                _f(s["finished_requests_per_s"], 2),
                f"{_f(s['ttft_ms']['median'], 0)} / {_f(s['ttft_ms']['p95'], 0)}",
                f"{_f(s['itl_ms']['median'], 1)} / {_f(s['itl_ms']['p95'], 1)}",
                f"{_f(s['latency_ms']['median'] and s['latency_ms']['median'] / 1e3, 2)} / "
                f"{_f(s['latency_ms']['p95'] and s['latency_ms']['p95'] / 1e3, 2)}",
                _f(d["tokens_per_round"], 2),
                _pct(d["acceptance_rate"]) if r["spec"]["kind"] != "plain" else "-",
                f"{s['finished']}/{s['submitted']} ({s['errors']} err, {s['timeouts']} t/o)",
                same,
            ]
        )
    header = [
        "config",
        "out tok/s",
        "vs plain",
        "decode tok/s",
        "vs plain",
        "req/s",
        "TTFT p50/p95 ms",
        "ITL p50/p95 ms",
        "latency p50/p95 s",
        "tokens/round",
        "acceptance",
        "finished",
        "= plain",
    ]
    return _table(header, rows)


def cost_table(runs: Sequence[dict]) -> str:
    rows = []
    for r in runs:
        cm, ph = r.get("cost_model"), r.get("phases") or {}
        if not cm:
            continue
        seed, men, mr = cm.get("seed") or {}, cm.get("measured_en") or {}, cm.get("measured_rounds") or {}
        e2e = _f(cm.get("measured_output_speedup"), 2, "x")
        if cm.get("output_speedup_note"):
            e2e = f"- ({cm['output_speedup_note']})"
        elif sampled_note(_temperature(r)):
            e2e = SAMPLED_CELL
        dec = _f(cm.get("measured_speedup"), 2, "x")
        plain = _plain_of(runs, r["load_name"], r.get("group"))
        if plain is not None and outputs_differ(r.get("quality"), r["summary"], plain["summary"], _temperature(r)):
            e2e += DIFFER_SUFFIX if e2e.endswith("x") else ""
            dec += DIFFER_SUFFIX if dec.endswith("x") else ""
        rows.append(
            [
                _run_label(r),
                no_ratio_cell(cm["different_requests"]) if cm.get("different_requests") else e2e,
                dec,
                _f(seed.get("speedup"), 2, "x"),
                _f(seed.get("ratio_to_measured"), 2),
                _f(men.get("speedup"), 2, "x"),
                _f(men.get("ratio_to_measured"), 2),
                _f(mr.get("speedup"), 2, "x"),
                _f(mr.get("ratio_to_measured"), 2),
                _f(men.get("expected_tokens"), 2),
                _f(men.get("wide_fraction"), 2),
                _f(ph.get("draft_ms"), 1),
                _f(ph.get("verify_ms"), 1),
                _f(ph.get("state_ms"), 1),
                _f(ph.get("round_ms"), 1),
                _f(ph.get("round_narrow_ms"), 1),
                _f(cm.get("baseline_ms"), 1),
            ]
        )
    header = [
        "config (load)",
        "measured end-to-end",
        "measured decode",
        "seed model",
        "ratio",
        "pieces model",
        "ratio",
        "rounds model",
        "ratio",
        "E[N]",
        "wide share",
        "draft ms",
        "verify ms",
        "state ms",
        "round ms",
        "miss round ms",
        "plain round ms",
    ]
    return _table(header, rows) if rows else "(no speculative runs)"


def quality_table(runs: Sequence[dict], peers: Sequence[dict] = ()) -> str:
    rows = []
    for r in [*runs, *[p for p in peers if p.get("available")]]:
        q = r.get("quality") or {}
        label = _run_label(r) if "spec" in r else r["label"]
        m, c, g, ch = q.get("math", {}), q.get("code", {}), q.get("grounded", {}), q.get("chat", {})
        comp = [x.get("completion_rate") for x in (m, c, g, ch) if x]
        rows.append(
            [
                label,
                _pct(m.get("accuracy")),
                _pct(c.get("parses")),
                _pct(c.get("property_check")),
                _pct(g.get("exact")),
                _f(g.get("similarity"), 2),
                _f(g.get("grounding"), 2),
                _pct(sum(comp) / len(comp)) if comp else "-",
                _pct(q.get("exact_match_vs_plain")) if "exact_match_vs_plain" in q else "-",
            ]
        )
    header = [
        "config",
        "math accuracy",
        "code ast.parse",
        "code property",
        "grounded exact",
        "grounded similarity",
        "grounding",
        "completion (EOS)",
        "= jspec plain",
    ]
    return _table(header, rows)


def memory_table(runs: Sequence[dict]) -> str:
    rows = []
    for r in runs:
        m, ph = r["memory"], r.get("phases") or {}
        scratch = ph.get("round_scratch_bytes")
        total = m["device_bytes"] + (scratch or 0)
        rows.append(
            [
                _run_label(r),
                _f(m["params_bytes"] / MB, 1),
                _f(m["draft_params_bytes"] / MB, 1),
                _f((m["cache_bytes"] + m["draft_state_bytes"]) / MB, 1),
                _f(scratch / MB if scratch is not None else None, 1),
                _f(total / MB, 1),
                _f(m["max_rss_bytes"] / MB, 0),
            ]
        )
    header = ["config", "params MB", "draft MB", "caches MB", "round scratch MB", "device total MB",
              "process peak RSS MB so far"]  # fmt: skip
    return _table(header, rows)


def peers_table(runs: Sequence[dict], peers: Sequence[dict]) -> str:
    """Each peer next to the jspec run of the same technique at concurrency 1, measured in the same run. A
    pair that is not like for like (``ratio_blockers``), or that served other requests (``requests_differ``),
    gets the reason instead of a ratio; at temperature > 0 the end-to-end ratio is not given (``sampled_note``),
    the decode ratio is. The peer runs once; jspec's side is the median over its passes (``jspec_rates``), as its
    cell says. Next to each ratio: both sides' tokens per verify round (the peer's where observable) and what it
    still compares besides the implementations (``peer_caveats``: another prompt-lookup policy, the time between
    the two runs, which are not interleaved)."""
    c1 = [r for r in runs if r["load"]["mode"] == "closed" and r["load"]["concurrency"] == 1]
    rows = []
    for p in peers:
        if not p.get("available"):
            rows.append([p["label"], "skipped: " + str(p.get("reason")), *[""] * 10])
            continue
        s = p["summary"]
        tps, dps = s["output_tokens_per_s"], s.get("decode_tokens_per_s")
        mates = [r for r in c1 if (r["spec"].get("peer") or r["spec"]["kind"]) == p["technique"]]
        q = p.get("quality") or {}
        if not mates:
            mates = [None]
        for mate in mates:
            jt = jd = None
            how = ""
            why = ratio_blockers(p.get("info") or {}, p["technique"], mate["spec"]) if mate else None
            if mate:
                jt, jd, how = jspec_rates(mate, s)
            if why:
                ratio_out, ratio_dec = f"no ratio: {why} (not like for like)", "-"
            elif mate and jt is None:
                ratio_out, ratio_dec = f"no ratio: {how}", "-"
            else:
                ratio_out = _f(jt / tps, 2, "x") if jt and tps else "-"
                ratio_dec = _f(jd / dps, 2, "x") if jd and dps else "-"
                if mate and sampled_note(_temperature(mate)):  # both sampled, other outputs: decode ratio only
                    ratio_out = SAMPLED_CELL
            if jt is None and mate:  # no ratio: its first pass's rate, said to be that
                jt_cell = f"{_f(mate['summary']['output_tokens_per_s'])} (pass 1)"
            else:
                jt_cell = _f(jt) + (f" ({how})" if jt is not None and how != "one pass" else "")
            caveats = peer_caveats(mate, p["technique"], p.get("info") or {}) if mate and not why and jt else []
            rows.append(
                [
                    p["label"],
                    _f(tps),
                    _f(dps),
                    f"{_f(s['ttft_ms']['median'], 0)} / {_f(s['itl_ms']['median'], 1)} / {_f(s['itl_ms']['p95'], 1)}",
                    (_run_label(mate) if mate.get("group") else mate["spec"]["label"]) if mate else "-",
                    jt_cell,
                    ratio_out,
                    ratio_dec,
                    _pct(q.get("exact_match_vs_plain")),
                    f"{s['finished']}/{s['submitted']}",
                    tokens_per_round_text(mate, p.get("info") or {}) if mate else "-",
                    "; ".join(caveats) or "-",
                ]
            )
    header = [
        "peer (batch 1)",
        "peer out tok/s",
        "peer decode tok/s",
        "peer TTFT p50 / ITL p50 / p95 ms",
        "jspec row",
        "jspec out tok/s (median of its passes)",
        "jspec / peer (out)",
        "jspec / peer (decode)",
        "= jspec plain",
        "finished",
        "tokens/round jspec / peer",
        "the ratio also compares",
    ]
    return _table(header, rows) if rows else "(no peers requested)"


def meta_block(meta: dict[str, Any]) -> str:
    env, model = meta.get("environment", {}), meta.get("model", {})
    lines = [
        f"- Machine: {env.get('cpu_model')} ({env.get('cpu_cores')} cores, load average at start "
        f"{', '.join(f'{x:.1f}' for x in env.get('load_average') or [])}), {env.get('platform')}",
        f"- Versions: jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, flax {env.get('flax')}, "
        f"python {env.get('python')}; backend {env.get('backend')} ({env.get('device')}); date {env.get('date')}",
        f"- Model: {model.get('name')} ({model.get('path')}, sha256 of first MiB "
        f"{str(model.get('sha256_first_mib'))[:12]}), {model.get('dtype')}",
        f"- Tokenizer: {meta.get('tokenizer', {}).get('summary')}; chat template "
        f"{'on' if meta.get('chat_template') else 'off'}",
        f"- Sampling: {meta.get('sampling')}; stop: {meta.get('stop_rules')}; cache slots {meta.get('max_len')}",
    ]
    threads = env.get("threads") or {}
    if threads:
        lines.append(f"- jspec's threads: {_f(threads.get('threads'))} ({threads.get('how')})")
    for w, d in (meta.get("workloads") or {}).get("per_workload", {}).items():
        lines.append(
            f"- Workload {w}: {d['n']} requests, input tokens median {_f(d['input_len'].get('median'), 0)} "
            f"(p95 {_f(d['input_len'].get('p95'), 0)}, max {_f(d['input_len'].get('max'), 0)})"
        )
    if meta.get("workloads"):
        lines.append(f"- Prompt set fingerprint: {meta['workloads'].get('fingerprint')} (seed {meta.get('seed')})")
    return "\n".join(lines)
