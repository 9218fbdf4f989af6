"""When a ratio between two runs' throughputs is given, and what it still compares.

A ratio of two throughputs is only meaningful between runs that did the same work: ``no_ratio`` says why not
when they served other requests (``requests_differ``: a wall limit or deadlines cut them differently) or one
served none (``nothing_served``); ``open_loop_note`` and ``sampled_note`` say why an end-to-end ratio is left
out (an open loop's wall time is its arrivals'; sampled outputs differ); ``outputs_differ`` flags greedy
outputs that are not plain's. Against a peer, ``ratio_blockers`` says why a pair is not like for like,
``jspec_rates`` takes jspec's side over its passes, and ``peer_caveats`` what the ratio still compares (another
prompt-lookup policy, the time between the two runs). The tables, the headline and the result files all ask
here, so they give and refuse the same ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

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
    exact match ``checks.quality_summary`` records), else, every finished request the same, the totals of
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
    ``suite_runs.run_specs``) to the start of the peer's timed run (``peer_info["wall_clock"]``), or None when either
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


def ratio_blockers(peer_info: dict[str, Any], technique: str, spec: dict[str, Any]) -> str | None:
    """Why jspec's run of ``spec`` (``Spec.describe()``) and a peer run are not like for like, or None when
    they are. What the peer ran, judged against jspec's dtype and device when it was measured
    (``peers.like_for_like_problems``, recorded by ``suite_peers.run_peer_set`` as ``not_like_for_like``: its weights'
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
