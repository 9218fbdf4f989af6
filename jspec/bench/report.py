"""A benchmark's report: its results as JSON (everything) and a Markdown summary (the tables).

The payload every script writes is one dict:
``{"suite", "command", "meta": {environment, model, tokenizer, sampling, stop rules, workloads}, "runs":
[RunResult.to_json()], "peers": [PeerRun.to_json()], "sweeps": {...}}``. ``markdown(payload)`` renders it from
the tables of ``tables`` and the notes that explain them; the plots (``plotting``) take the same payload (or
sweep points) and write PNGs. ``payload`` builds it from the runs, ``write_outputs`` writes the JSON and the
Markdown, and ``write_results`` then the plots, linked from the Markdown.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jspec.bench import plotting
from jspec.bench.tables import cost_table, memory_table, meta_block, peers_table, quality_table, results_table

if TYPE_CHECKING:
    from jspec.bench.peers import PeerRun
    from jspec.bench.runspec import RunResult


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


def payload(
    name: str,
    argv: Sequence[str] | None,
    meta_d: dict,
    results: Sequence[RunResult],
    peer_runs: Sequence[PeerRun] = (),
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
    js = write_json(os.path.join(out_dir, f"{name}.json"), pl)
    md = write_markdown(os.path.join(out_dir, f"{name}.md"), pl, plots)
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
    write_markdown(paths["markdown"], pl, drawn)
    return paths, drawn
