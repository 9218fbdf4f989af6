"""The request-serving runs of the suite commands (``suite_runs.run_specs``: ``python -m jspec bench``,
``examples/bench_spec_vs_plain.py``, ``bench_chain_vs_tree.py``, ``bench_sweeps.py``, ``bench_serving.py``) as a
result file (``record.Record``).

A cell is one load (closed loop at a concurrency, or an open loop) of one run group; its configs are the specs,
each pass's entry a spec's output tokens over the run's wall time in that pass, at its position in the pass's
order. A cell gets "X vs plain" ratios only where an end-to-end ratio means something: a closed loop, greedy,
every pass of both runs serving the same requests (``ratios.no_ratio``). Peers, which run once after jspec's
passes, are kept in ``extra["peers"]`` without a ratio (a ratio needs ``record.MIN_PASSES`` passes in rotation).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from jspec.bench import ratios, record
from jspec.bench.runspec import RunResult

SIZE_FLAGS = ("n", "max_new_tokens", "passes")  # below their defaults: a smoke run
_RAW = ("position", "output_tokens", "wall_s")  # what ``suite_runs.run_specs`` records of each pass


def start(bench: str, prog: str, argv: Sequence[str] | None, args: argparse.Namespace, ap: argparse.ArgumentParser):
    """The run's record, begun before the model loads: its path (``--record``, else ``results/<bench>-<UTC
    time>.json``) checked, its settings every flag's value, and ``settings["smoke"]`` what a flag of
    ``SIZE_FLAGS`` reduced below its default."""
    path = record.check_out_path(args.record or record.default_path(bench), "--record")
    settings: dict[str, Any] = dict(vars(args))
    smoke = []
    for name in SIZE_FLAGS:
        default, value = ap.get_default(name), settings.get(name)
        if isinstance(default, int) and isinstance(value, int) and value < default:
            smoke.append(f"--{name.replace('_', '-')} {value} < {default}")
    settings["smoke"] = smoke
    return record.Record(bench, record.command_line(prog, argv), settings, path)


def _entry(r: RunResult, p: dict[str, Any]) -> dict[str, Any]:
    return record.run_entry(
        r.label, p["position"], p["output_tokens"], p["wall_s"], None, p.get("tokens_per_round"),
        decode_tokens_per_s=p.get("decode_tokens_per_s"), same_tokens_as_first_pass=p.get("same_tokens_as_first_pass"),
    )  # fmt: skip


def add_runs(rec: record.Record, results: Sequence[RunResult]) -> None:
    """Every load of every run group as a cell, with each pass's numbers and the ratios to plain."""
    cells: dict[tuple[str | None, str], list[RunResult]] = {}
    for r in results:
        cells.setdefault((r.extra.get("group"), r.load.name), []).append(r)
    for (group, load), runs in cells.items():
        cell = load if group is None else f"{group}: {load}"
        first = runs[0]
        rec.cell(cell, load=load, group=group, mode=first.load.mode, concurrency=first.load.concurrency,
                 temperature=first.sampling.temperature, max_new_tokens=first.max_new_tokens)  # fmt: skip
        for r in runs:
            rec.config(cell, r.label, kind="plain" if r.spec.kind == "plain" else "jspec", spec=r.spec.describe())
        passes = [r.extra.get("passes") or [] for r in runs]
        usable = min(len(p) for p in passes)
        raw = all(all(k in p[i] for k in _RAW) for p in passes for i in range(usable))
        if not raw or not all(p[i]["wall_s"] > 0 for p in passes for i in range(usable)):
            why = "a pass lacks its raw numbers" if not raw else "a run took no time (no request served)"
            rec.extra.setdefault("notes", []).append(f"{cell}: {why}: no passes recorded")
            continue
        for i in range(usable):
            rec.add_pass(cell, i, [_entry(r, p[i]) for r, p in zip(runs, passes)])
        plain = next((r for r in runs if r.spec.kind == "plain"), None)
        if plain is None or not usable or first.load.mode != "closed" or first.sampling.temperature > 0:
            continue
        plain_passes = passes[runs.index(plain)]
        for r, p in zip(runs, passes):
            same_work = all(ratios.no_ratio(a, b) is None for a, b in zip(p[:usable], plain_passes[:usable]))
            if r is not plain and same_work:
                rec.ratio(cell, r.label, [plain.label], f"{r.label} vs plain")


def finish(rec: record.Record, peer_runs: Sequence[Any] = (), **extra: Any) -> str:
    """After ``add_runs``: add the peers (one run each, no ratio) and ``extra``, mark the run finished and write
    it."""
    rec.extra["peers"] = [
        {
            "label": p.label,
            "technique": p.technique,
            "available": p.available,
            "reason": p.reason,
            "output_tokens_per_s": p.summary.get("output_tokens_per_s"),
            "decode_tokens_per_s": p.summary.get("decode_tokens_per_s"),
            "not_like_for_like": p.info.get("not_like_for_like"),
            "after_jspec_s": p.info.get("after_jspec_s"),
        }
        for p in peer_runs
    ]
    rec.extra.update(extra)
    rec.finish()
    return rec.write()
