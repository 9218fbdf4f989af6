"""The headline: one line per speculative run with its ratios to plain and to the peers, or why none.

``headline`` gives each run's speedup over plain at the same load in the same run group, per pass and their
median (``pass_ratios``) when there were several, the cost model's prediction next to it, and its ratio to each
like-for-like peer of its technique with what that ratio still compares. Every ratio it gives or refuses follows
the rules of ``ratios``, as the report's tables do.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from jspec.bench import peers, ratios
from jspec.bench.runspec import RunResult


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
