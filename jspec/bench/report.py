"""Results as JSON (everything), a Markdown summary (the tables) and matplotlib plots.

The payload every script writes is one dict:
``{"suite", "command", "meta": {environment, model, tokenizer, sampling, stop rules, workloads}, "runs":
[RunResult.to_json()], "peers": [PeerRun.to_json()], "sweeps": {...}}``. ``markdown(payload)`` renders it;
the plot functions take the same payload (or sweep points) and write PNGs (Agg backend, no display).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

MB = 1 << 20


def write_json(path: str, payload: dict[str, Any]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=_default)
    return path


def _default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


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


_COUNTS = ("submitted", "finished", "errors", "timeouts", "not_run")


def _served_counts(s: dict[str, Any]) -> str:
    out = f"{s.get('finished')}/{s.get('submitted')} finished"
    for key, what in (("not_run", "not run"), ("timeouts", "timed out"), ("errors", "failed")):
        if s.get(key):
            out += f", {s[key]} {what}"
    return out


def requests_differ(a: dict[str, Any], b: dict[str, Any], names: Sequence[str] = ("this run", "plain")) -> str | None:
    """Why the throughputs of two runs (their summaries, or ``_pass_summary`` entries) are not over the same
    requests, or None when they are: a wall limit (--max-wall-s) or deadlines (--timeout-s) can leave other
    requests unrun or timed out on each side, and a ratio of the two rates would then compare other work.
    Compared by ``request_set`` (which requests, and how each ended) where both have it, else by the counts
    both recorded (an older result); nothing recorded on a side counts as the same."""
    da, db = a.get("request_set"), b.get("request_set")
    if da is not None and db is not None:
        if da == db:
            return None
    elif all(a.get(k) == b.get(k) for k in _COUNTS if k in a and k in b):
        return None
    same_counts = all(a.get(k) == b.get(k) for k in _COUNTS)
    detail = (
        "the same counts but other requests"
        if same_counts
        else f"{names[0]} {_served_counts(a)}, {names[1]} {_served_counts(b)}"
    )
    return f"different requests served ({detail})"


def nothing_served(a: dict[str, Any], b: dict[str, Any], names: Sequence[str] = ("this run", "plain")) -> str | None:
    """Why two runs' throughputs give no ratio although they served the same requests, or None: a side that
    finished no request (every one failed, timed out or was not run: e.g. max_new_tokens past the cache) or
    delivered no token, whose rate of 0 would read as a 0.00x speed-up. A count not recorded is not judged."""
    for name, s in zip(names, (a, b)):
        if s.get("submitted") and s.get("finished") == 0:
            return f"{name} finished no requests ({_served_counts(s)})"
        if s.get("output_tokens_per_s", 1.0) <= 0:
            return f"{name} delivered no tokens"
    return None


def no_ratio(a: dict[str, Any], b: dict[str, Any], names: Sequence[str] = ("this run", "plain")) -> str | None:
    """Why the throughputs of two runs give no ratio (``nothing_served``, ``requests_differ``), or None."""
    return nothing_served(a, b, names) or requests_differ(a, b, names)


def no_ratio_cell(why: str) -> str:
    """A table cell for a ratio not given because of ``why`` (``no_ratio``)."""
    return "no ratio: " + ("different requests" if why.startswith("different requests") else "nothing served")


def open_loop_note() -> str:
    return "arrival-bound: an open loop's wall time is set by its arrivals"


def sampled_note(temperature: float | None) -> str | None:
    """Why two runs at ``temperature`` > 0 give no end-to-end ratio (as ``python -m jspec generate --compare``
    says), or None at temperature 0: each side sampled its own outputs (other lengths, other stops), and each
    end-to-end rate includes its prefill, a larger share of a shorter output. Their decode ratio is kept."""
    if not temperature:
        return None
    return f"not like for like at temperature {temperature:g}: the sampled outputs differ, each rate with its prefill"


SAMPLED_CELL = "- (sampled: not like for like)"  # a table's end-to-end ratio at temperature > 0 (``sampled_note``)


def outputs_differ(
    quality: dict[str, Any] | None,
    summary: dict[str, Any],
    ref_summary: dict[str, Any],
    temperature: float | None = 0.0,
    ref: str = "plain",
) -> str | None:
    """At temperature 0, why a run's greedy outputs are not its reference's (jspec's plain run on the same jobs),
    or None when they are the same (or not compared: at temperature > 0 ``sampled_note`` applies). Greedy
    speculation reproduces plain decoding token for token, so a difference is a bug or another numerical target,
    and a throughput ratio then compares other outputs: 'outputs differ from plain: N of M requests' (from the
    exact match ``runner.quality_summary`` records), else, every finished request the same, the totals of
    output tokens when they differ (requests that timed out or failed count their tokens too)."""
    if temperature:
        return None
    q = quality or {}
    n, em = q.get("exact_match_n"), q.get("exact_match_vs_plain")
    differ = q.get("differ_from_plain_n")
    if differ is None and em is not None and n:  # a result written before the count was recorded
        differ = round((1 - em) * n)
    if differ:
        return f"outputs differ from {ref}: {differ} of {n} requests"
    a, b = summary.get("output_tokens"), ref_summary.get("output_tokens")
    if a is not None and b is not None and a != b:
        return f"outputs differ from {ref}: {a} vs {b} output tokens"
    return None


DIFFER_SUFFIX = " (outputs differ)"  # a table's ratio between runs whose greedy outputs differ (``outputs_differ``)


def peer_gap_s(run: dict[str, Any], peer_info: dict[str, Any]) -> float | None:
    """Seconds from the end of jspec's last pass of ``run`` (its ``passes``' wall clocks, recorded by
    ``suite.run_specs``) to the start of the peer's timed run (``peer_info["wall_clock"]``), or None when either
    was not recorded. The peers run after all of jspec's runs, not interleaved with them as jspec's passes are:
    the machine's speed can drift over that gap."""
    ends = [p["wall_clock"][1] for p in run.get("passes") or () if p.get("wall_clock")]
    start = (peer_info.get("wall_clock") or (None,))[0]
    return start - max(ends) if ends and start is not None else None


def _gap_text(gap: float) -> str:
    return f"not interleaved: the peer ran {gap:.0f} s after jspec's run"


# jspec's n-gram drafter (``jspec.ngram``); the peers' prompt lookup is ``peers.LOOKUP_POLICY``.
LOOKUP_POLICY_JSPEC = "most recent match, its continuation repeated up to K"


def peer_caveats(run: dict[str, Any], technique: str, peer_info: dict[str, Any]) -> list[str]:
    """What a ratio between jspec's ``run`` (its JSON, or the same keys) and a like-for-like peer run still
    compares besides the two implementations: another prompt-lookup policy (``peers.LOOKUP_POLICY``: jspec's
    n-gram drafter takes the most recent match and fills K, the peers the first match up to the history's end),
    and the time between the two runs (``peer_gap_s``)."""
    out = []
    if technique == "prompt_lookup":
        spec = run.get("spec") or {}
        ours = LOOKUP_POLICY_JSPEC if spec.get("drafter") == "NgramDrafter" else f"a {spec.get('drafter')}"
        theirs = peer_info.get("lookup_policy") or "not recorded"
        out.append(f"different lookup policy (jspec: {ours}; the peer: {theirs})")
    gap = peer_gap_s(run, peer_info)
    if gap is not None:
        out.append(_gap_text(gap))
    return out


def tokens_per_round_text(run: dict[str, Any], peer_info: dict[str, Any]) -> str:
    """jspec's tokens per verify round and the peer's (where observable: ``peers.tokens_per_round``)."""
    ours = (run.get("decode_stats") or {}).get("tokens_per_round")
    return f"{_f(ours, 2)} / {_f(peer_info.get('tokens_per_round'), 2)}"


def _temperature(r: dict[str, Any]) -> float:
    return (r.get("sampling") or {}).get("temperature") or 0.0


def jspec_rates(run: dict[str, Any], peer_summary: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """jspec's throughput to set against a peer's single run: the median over jspec's passes (``--passes``)
    of its output and decode rates, over the passes that served the peer's requests; with one pass, that
    pass. Returns (output tok/s, decode tok/s, how) or (None, None, why not)."""
    passes = run.get("passes") or []
    if len(passes) < 2:
        why = no_ratio(run["summary"], peer_summary, ("jspec", "the peer"))
        if why:
            return None, None, why
        return run["summary"]["output_tokens_per_s"], run["summary"].get("decode_tokens_per_s"), "one pass"
    ok = [p for p in passes if not no_ratio(p, peer_summary)]
    if not ok:
        return None, None, no_ratio(passes[0], peer_summary, ("jspec", "the peer")) or ""
    how = f"median of {len(ok)} passes"
    if len(ok) < len(passes):
        how += f" (of {len(passes)}; the others served other requests than the peer)"
    dec = [p.get("decode_tokens_per_s") for p in ok]
    return (
        _median([p["output_tokens_per_s"] for p in ok]),
        _median(dec) if all(d is not None for d in dec) else None,
        how,
    )


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


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


def ratio_blockers(peer_info: dict[str, Any], technique: str, spec: dict[str, Any]) -> str | None:
    """Why jspec's run of ``spec`` (``Spec.describe()``) and a peer run are not like for like, or None when
    they are. What the peer ran, judged against jspec's dtype and device when it was measured
    (``peers.like_for_like_problems``, recorded by ``suite.run_peer_set`` as ``not_like_for_like``: its weights'
    precision, its KV cache's, its device), and the draft length: a peer's speculative technique drafts a fixed
    K (``gamma`` in its info), so a jspec run at another K, or one that adapts K, is another configuration."""
    problems = peer_info.get("not_like_for_like")
    out = ["not checked against jspec's precision and device"] if problems is None else list(problems)
    if technique != "plain":
        k, peer_k = spec.get("gamma"), peer_info.get("gamma")
        if spec.get("adaptive") is not None:
            out.append(f"jspec adapts K (up to {k}), the peer drafts K={peer_k}")
        elif peer_k is None:
            out.append("the peer's K was not recorded")
        elif k != peer_k:
            out.append(f"jspec K={k}, the peer's K={peer_k}")
    return "; ".join(out) or None


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


def gc_note(runs: Sequence[dict[str, Any]], peers: Sequence[dict[str, Any]] = ()) -> str:
    """One line on Python's garbage collector inside the timed runs (jspec's and the peers')."""
    stats = [r.get("engine", {}).get("gc") for r in runs] + [p.get("info", {}).get("gc") for p in peers]
    stats = [g for g in stats if g]
    if not stats:
        return ""
    frozen = sum(bool(g["frozen"]) for g in stats)
    how = (
        "the Python heap frozen after each warm-up (`gc.freeze`, as vLLM and SGLang do)"
        if frozen == len(stats)
        else f"the Python heap frozen in {frozen} of {len(stats)} runs"
    )
    n = sum(g["collections"] for g in stats)
    total = sum(g["pause_ms_total"] for g in stats)
    worst = max(g["pause_ms_max"] for g in stats)
    return (
        f"Timed runs: {how}; collections that ran inside them: {n} in all, {total:.1f} ms, the longest "
        f"{worst:.1f} ms (first pass of each configuration)."
    )


def markdown(payload: dict[str, Any], plots: Sequence[str] = ()) -> str:
    runs, peers, meta = payload.get("runs", []), payload.get("peers", []), payload.get("meta", {})
    parts = [f"# jspec benchmark: {payload.get('suite', '')}", ""]
    if payload.get("command"):
        parts += [f"Command: `{payload['command']}`", ""]
    parts += [meta_block(meta), ""]
    if payload.get("headline"):
        parts += ["## Headline", "", *[f"- {line}" for line in payload["headline"]], ""]
    sections: list[tuple[str | None, str]] = []  # (run group, load), in order of appearance
    for r in runs:
        if (r.get("group"), r["load_name"]) not in sections:
            sections.append((r.get("group"), r["load_name"]))
    for group, ln in sections:
        parts += [f"## {group}: {ln}" if group else f"## {ln}", "", results_table(runs, ln, group), ""]
    parts += [
        "Throughput counts emitted tokens only (accepted candidates + correction/bonus tokens; rejected "
        "candidates never count). out tok/s = all emitted tokens / run wall time (prefills and queueing "
        "included); decode tok/s = tokens after each request's first emission / time after it (a peer's first "
        "burst can carry several tokens). ITL: a round that emits n tokens gives one interval and n - 1 zero "
        "gaps (bursts). acceptance = accepted / proposed candidates; tokens/round = emitted / rounds (the "
        "prefill's first token is no round's). A ratio is given only between runs that served the same "
        "requests (a wall limit or deadlines can cut two runs differently: 'no ratio: different requests'); an "
        "open loop's end-to-end rate is set by its arrivals, so only its decode rate is compared; so is a run at "
        "temperature > 0 ('sampled: not like for like'), whose sampled outputs differ from the other side's "
        "(other lengths, other stops, each end-to-end rate with its prefill). At temperature 0 greedy speculation "
        "reproduces plain decoding token for token: a ratio marked '(outputs differ)' is between runs whose "
        "outputs differ (the '= plain' column says how many requests), so it compares other outputs.",
        "",
    ]
    note = gc_note(runs, peers)
    if note:
        parts += [note, ""]
    if any(r.get("cost_model") for r in runs):
        parts += ["## Cost model check (seed section 3)", "", cost_table(runs), ""]
        parts += [
            "Costs are separately jitted pieces on the serving shapes (medians of repeats, configurations "
            "sampled in turn). 'seed model' = baseline x E[N] / (K d + verify + state) with E[N] from the "
            "measured per-position acceptance; 'pieces model' uses the measured tokens per round (E[N]) and "
            "weights rounds where nothing was proposed (a 1-token verify) by their measured share ('wide "
            "share'); 'rounds model' does the same with the whole fused round timed (round ms with every "
            "candidate proposed, miss round ms with none) instead of the sum of its pieces. baseline = the "
            "plain round. ratio = predicted / measured decode speedup.",
            "",
        ]
    if peers:
        parts += ["## Peers (same checkpoint file, same prompt ids, measured in the same run)", ""]
        parts += [peers_table(runs, peers), ""]
        parts += [
            "Each peer runs once, after all of jspec's runs: its ratios are not interleaved as jspec's A/B passes "
            "are, and the machine's speed can drift between the two (the last column gives how long after jspec's "
            "last pass of that configuration the peer's timed run began). Both peers get one thread count (jspec's "
            "XLA pool size unless --peer-threads gives another; another count is not like for like). Prompt lookup "
            "is another policy on each side (jspec: the most recent match, its continuation repeated up to K; "
            "transformers and llama-cpp-python: the first match, stopping at the history's end), so its ratio "
            "compares policies too: the tokens per verify round of both sides are given (transformers': tokens "
            "after the first streamer push / the pushes after it, one push per verify round; llama-cpp-python "
            "yields one token at a time, so its rounds are not observable). A peer whose greedy (temperature 0) "
            "outputs differ from jspec's plain run gets no ratio ('outputs differ from jspec's plain').",
            "",
        ]
    parts += ["## Quality on the same tasks", "", quality_table(runs, peers), ""]
    parts += ["## Memory", "", memory_table(runs), ""]
    if runs:
        parts += [f"Memory: {runs[0]['memory']['how']}.", ""]
    for extra in payload.get("markdown_extra", []):
        parts += [extra, ""]
    for p in plots:
        parts += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    return "\n".join(parts)


def write_markdown(path: str, payload: dict[str, Any], plots: Sequence[str] = ()) -> str:
    with open(path, "w") as f:
        f.write(markdown(payload, plots))
    return path


# --------------------------------------------------------------------------------------------------------
# Plots


def plotting_unavailable() -> str | None:
    """None when the plots can be drawn, else why not: matplotlib is optional (``pip install -e '.[bench]'``)."""
    try:
        _plt()
    except ImportError as e:
        return f"matplotlib is not importable ({e}); pip install -e '.[bench]' for the plots"
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values, label):
    import numpy as np

    v = np.sort(np.asarray(values, float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def _served(q: dict) -> bool:
    """Finished normally: errors, timeouts and requests never run have no latency to plot."""
    return q["error"] is None and not q["timed_out"] and q["ttft_s"] is not None and q["latency_s"] is not None


def plot_latency(payload: dict[str, Any], path: str, load_name: str | None = None) -> str:
    """CDFs of TTFT, inter-token interval and total latency per configuration (and peer)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for r in payload.get("runs", []):
        if load_name is not None and r["load_name"] != load_name:
            continue
        reqs = [q for q in r.get("requests", []) if _served(q)]
        lab = r["spec"]["label"] + ("" if load_name else f" ({r['load_name']})")
        _cdf(axes[0], [q["ttft_s"] * 1e3 for q in reqs], lab)
        _cdf(axes[1], r.get("itl_ms_all", []), lab)
        _cdf(axes[2], [q["latency_s"] for q in reqs], lab)
    for p in payload.get("peers", []):
        if not p.get("available"):
            continue
        reqs = [q for q in p.get("requests", []) if _served(q)]
        _cdf(axes[0], [q["ttft_s"] * 1e3 for q in reqs], p["label"])
        _cdf(axes[1], p.get("itl_ms_all", []), p["label"])
        _cdf(axes[2], [q["latency_s"] for q in reqs], p["label"])
    axes[0].set_xlabel("time to first token (ms)")
    axes[1].set_xlabel("inter-token interval (ms; bursts give 0)")
    axes[1].set_xscale("symlog", linthresh=1.0)
    axes[2].set_xlabel("request latency (s)")
    for ax in axes:
        ax.set_ylabel("fraction of requests / intervals")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_acceptance_by_position(payload: dict[str, Any], path: str) -> str:
    """accepted / proposed candidates at each draft position (tree: depth), per speculative run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for r in payload.get("runs", []):
        acc = r["decode_stats"].get("acceptance_by_position") or []
        if r["spec"]["kind"] == "plain" or not acc:
            continue
        xs = [i + 1 for i, a in enumerate(acc) if a is not None]
        ax.plot(xs, [a for a in acc if a is not None], marker="o", label=f"{r['spec']['label']} ({r['load_name']})")
    ax.set_xlabel("draft position (tree: depth)")
    ax.set_ylabel("accepted / proposed")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_speedup_vs_k(points: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """points: {"series", "k", "speedup", "predicted"?, "tokens_per_round"?}: measured speedup over plain
    (same run) vs K, with the cost model's prediction dashed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    series: dict[str, list] = {}
    for p in points:
        series.setdefault(p["series"], []).append(p)
    for name, ps in series.items():
        # A point without a speedup (its runs served other requests than plain's) is not drawn.
        ps = sorted((p for p in ps if p.get("speedup") is not None), key=lambda p: p["k"])
        if not ps:
            continue
        (line,) = ax.plot([p["k"] for p in ps], [p["speedup"] for p in ps], marker="o", label=f"{name} measured")
        pred = [(p["k"], p["predicted"]) for p in ps if p.get("predicted") is not None]
        if pred:
            ax.plot(*zip(*pred), ls="--", color=line.get_color(), alpha=0.7, label=f"{name} cost model")
    ax.axhline(1.0, color="gray", lw=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("K (candidates per round)")
    ax.set_ylabel("speedup over plain (decode tok/s)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_batch_sweep(points: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """points: {"series", "batch", "tokens_per_s", "speedup"?}: throughput and speedup vs batch size."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    series: dict[str, list] = {}
    for p in points:
        series.setdefault(p["series"], []).append(p)
    for name, ps in series.items():
        ps = sorted(ps, key=lambda p: p["batch"])
        axes[0].plot([p["batch"] for p in ps], [p["tokens_per_s"] for p in ps], marker="o", label=name)
        sp = [(p["batch"], p["speedup"]) for p in ps if p.get("speedup") is not None]
        if sp:
            axes[1].plot(*zip(*sp), marker="o", label=name)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("speedup over plain at the same batch")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (closed-loop concurrency)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
