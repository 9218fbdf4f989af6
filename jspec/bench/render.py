"""``python -m jspec report [--check]``: the README's results table and docs/results.md, rendered from the
committed result files (docs/results/*.json, ``jspec.bench.record``).

- docs/results.md: one section per result file, newest first: its command, commit, machine, JAX version, dates,
  settings, and per cell a table of medians with their [min-max] over the passes and each pass's numbers.
- README.md: the table between ``TABLE_BEGIN`` and ``TABLE_END``, one row per entry of ``README_ROWS`` (the one
  place that decides which rows appear), each read from the newest committed file of its kind holding its cell.

Without ``--check`` both files are rewritten; with it nothing is written and the command exits 1, naming the
file and the first difference, when either differs from the rendering.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from jspec.bench import record

TABLE_BEGIN = "<!-- results-table:begin -->"
TABLE_END = "<!-- results-table:end -->"
RESULTS_MD = os.path.join("docs", "results.md")

# The README's rows: (kind of result file, cell, config). Each is read from the newest committed file of that kind
# (its ``bench``) that measured the cell; a row no committed file holds is left out (the command names it).
README_ROWS: tuple[tuple[str, str, str], ...] = (
    ("grid", "edit b=1", "ngram K=4"),
    ("grid", "edit b=1", "ngram goodput K<=4"),
    ("grid", "chat b=1", "eagle tree (4,1)"),
    ("grid", "chat b=1", "ngram goodput K<=4"),
    ("grid", "chat b=1", "eagle K=2"),
    ("grid", "chat b=1", "eagle goodput K<=2"),
    ("grid", "chat b=4", "ngram goodput K<=4"),
    ("grid", "edit b=4", "ngram goodput K<=4"),
    ("grid", "edit b=8", "ngram goodput K<=4"),
    ("grid", "chat b=8", "ngram K=4"),
    ("grid", "chat b=8", "ngram goodput K<=4"),
    ("grid", "chat b=8", "eagle K=2"),
    ("grid", "chat b=8", "eagle goodput K<=2"),
    ("grid", "chat b=16", "ngram goodput K<=4"),
    ("grid", "chat b=32", "ngram goodput K<=4"),
)


def load_committed(root: str = ".") -> list[tuple[str, dict[str, Any]]]:
    """Every docs/results/*.json under ``root`` as (path relative to ``root``, record), validated (RecordError
    naming the file and its problems), newest first."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, record.COMMITTED_DIR, "*.json"))):
        found.append((os.path.relpath(path, root).replace(os.sep, "/"), record.load(path)))
    return sorted(found, key=lambda f: (f[1]["started"], f[0]), reverse=True)


# --------------------------------------------------------------------------------------------------------
# Formatting


def ratio_text(r: dict[str, Any] | None) -> str:
    """ "1.45x (1.38-1.52)": the median and the min-max over the passes."""
    if not r or r.get("median") is None:
        return "-"
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def value_text(s: dict[str, Any] | None, digits: int = 1) -> str:
    """ "123.4 [118.0-130.2]": a median and its [min-max]."""
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def machine_text(data: dict[str, Any]) -> str:
    """The CPU model without its trademarks and clock, and the usable cores; on an accelerator its kind."""
    jx = data["jax"]
    if jx["backend"] != "cpu":
        return f"{jx['device_kind']} ({jx['backend']})"
    cpu = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*$", "", data["machine"]["cpu_model"])
    return f"{' '.join(cpu.split())}, {data['machine']['cores_usable']} cores"


def smoke_note(data: dict[str, Any]) -> str | None:
    reduced = data["settings"].get("smoke") or []
    if not reduced:
        return None
    return f"smoke run ({'; '.join(reduced)}): a check of the pipeline, not a measurement"


def _kinds(cell: dict[str, Any], kind: str) -> set[str]:
    return {name for name, meta in cell["configs"].items() if meta.get("kind") == kind}


def find_ratio(data: dict[str, Any], cell: str, config: str, against: str) -> dict[str, Any] | None:
    """The cell's summary ratio of ``config`` over the configs of kind ``against`` ("plain" or "peer")."""
    over = _kinds(data["cells"][cell], against)
    for r in data["summary"][cell]["ratios"].values():
        if r["of"] == config and over and set(r["over"]) == over:
            return r
    return None


def holds(data: dict[str, Any], cell: str, config: str) -> bool:
    return config in data["cells"].get(cell, {}).get("configs", {})


def outputs_differ(data: dict[str, Any], cell: str, config: str) -> bool:
    return any(
        r["config"] == config and r.get("same_as_plain") is False
        for p in data["passes"]
        if p["cell"] == cell
        for r in p["runs"]
    )


# --------------------------------------------------------------------------------------------------------
# The README table


def readme_table(files: Sequence[tuple[str, dict[str, Any]]], rows=None) -> tuple[str, list[str]]:
    """The text between the markers, and the rows (``README_ROWS`` by default) no committed file holds."""
    lines = [
        "| workload | drafter | batch | tokens/round | speedup vs plain | vs best peer | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    used: list[tuple[str, dict[str, Any]]] = []
    missing = []
    for kind, cell, config in README_ROWS if rows is None else rows:
        src = next(((p, d) for p, d in files if d["bench"] == kind and holds(d, cell, config)), None)
        if src is None:
            missing.append(f"{kind}: {cell}: {config}")
            continue
        path, data = src
        if src not in used:
            used.append(src)
        labels = data["cells"][cell]["labels"]
        summary = data["summary"][cell]
        tpr = summary["configs"][config]["tokens_per_round"]["median"]
        vs_plain = ratio_text(find_ratio(data, cell, config, "plain"))
        if outputs_differ(data, cell, config):
            vs_plain += " (outputs differ from plain)"
        vs_peer = ratio_text(find_ratio(data, cell, config, "peer"))
        lines.append(
            f"| {labels.get('workload', cell)} | {config} | {labels.get('batch', '-')} | "
            f"{'-' if tpr is None else f'{tpr:.2f}'} | {vs_plain} | {vs_peer} | {machine_text(data)} |"
        )
    lines.append("")
    if used:
        lines.append(
            _wrap(
                "Each ratio is the median of its per-pass ratios over the passes (configurations run back to back, "
                'in an order rotated from pass to pass), with the min-max over the passes in brackets; "vs best '
                "peer\" divides by the faster of transformers' plain and prompt-lookup decoding in the same pass. From "
                + ", ".join(f"[{os.path.basename(p)}]({p})" for p, _ in used)
                + "; commands, settings and every pass in [docs/results.md](docs/results.md)."
            )
        )
        notes = [f"{os.path.basename(p)}: {smoke_note(d)}" for p, d in used if smoke_note(d)]
        if notes:
            lines += ["", *(_wrap(f"**{n}.**") for n in notes)]
    else:
        lines.append("No committed result file holds these rows yet (docs/results/).")
    return "\n".join(lines), missing


def _wrap(text: str) -> str:
    return textwrap.fill(text, 115, break_long_words=False, break_on_hyphens=False)


def replace_table(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table`` (ValueError when they are missing)."""
    begin, end = readme.find(TABLE_BEGIN), readme.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md lacks the markers {TABLE_BEGIN} ... {TABLE_END} (in that order)")
    return readme[: begin + len(TABLE_BEGIN)] + "\n" + table + "\n" + readme[end:]


# --------------------------------------------------------------------------------------------------------
# docs/results.md


def results_md(files: Sequence[tuple[str, dict[str, Any]]]) -> str:
    out = [
        "# Results",
        "",
        _wrap(
            "Rendered by `python -m jspec report` from the result files in [docs/results/](results/), newest first; "
            "do not edit it by hand. A value is the median over the passes with [min-max] over the passes; a ratio is "
            "the median of the per-pass ratios (each pass runs every configuration back to back, in an order rotated "
            "from pass to pass). Tokens/s count every generated token over the timed execution (compilation excluded)."
        ),
    ]
    if not files:
        out += ["", "No result file is committed yet."]
    for path, data in files:
        out += ["", *file_section(path, data)]
    return "\n".join(out) + "\n"


def file_section(path: str, data: dict[str, Any]) -> list[str]:
    name = os.path.basename(path)
    git, m, jx = data["git"], data["machine"], data["jax"]
    dirty = ", with uncommitted changes to tracked files" if git["dirty"] else ""
    out = [f"## {data['bench']}: {data['started'][:10]} ([{name}](results/{name}))", ""]
    note = smoke_note(data)
    if note:
        out += [f"**{note[0].upper() + note[1:]}.**", ""]
    settings = ", ".join(f"{k} {_compact(v)}" for k, v in data["settings"].items() if k != "smoke")
    out += [
        f"- command: `{data['command']}`",
        f"- commit: `{git['commit'][:12]}`{dirty}",
        f"- machine: {m['cpu_model']}, {m['cores_usable']} usable cores of {m.get('cores_total', '?')}; "
        f"{m['platform']}; Python {m['python']}",
        f"- JAX {jx['jax']} (jaxlib {jx['jaxlib']}), backend {jx['backend']}, device {jx['device_kind']}",
        f"- run: {data['started']} to {data['finished']}",
        f"- settings: {settings}",
    ]
    for cell, meta in data["cells"].items():
        out += ["", *cell_section(cell, meta, data["summary"][cell], data)]
    return out


def _compact(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_compact(x)}" for k, x in v.items())
    if isinstance(v, list | tuple):
        return ",".join(_compact(x) for x in v) or "-"
    return str(v)


def cell_section(cell: str, meta: dict[str, Any], summary: dict[str, Any], data: dict[str, Any]) -> list[str]:
    labels = ", ".join(f"{k} {_compact(v)}" for k, v in meta["labels"].items())
    out = [f"### {cell}", "", f"{labels}; {summary['passes']} passes.", ""]
    out += ["| config | tokens/s | tokens/round | acceptance | compile s |", "|---|---|---|---|---|"]
    for name, s in summary["configs"].items():
        comp = meta["configs"][name].get("compile_seconds")
        differ = " (outputs differ from plain)" if outputs_differ(data, cell, name) else ""
        out.append(
            f"| {name}{differ} | {value_text(s['tokens_per_s'])} | {value_text(s['tokens_per_round'], 2)} | "
            f"{value_text(s['acceptance'], 2)} | {'-' if comp is None else f'{comp:.1f}'} |"
        )
    if summary["ratios"]:
        out += ["", "| ratio | median (min-max) | passes | by pass |", "|---|---|---|---|"]
        for name, r in summary["ratios"].items():
            by = " ".join("-" if x is None else f"{x:.2f}" for x in r["by_pass"])
            out.append(f"| {name} | {ratio_text(r)} | {r['n']} | {by} |")
    out += cost_model_lines(cell, meta, data)
    problems = sorted({p for c in meta["configs"].values() for p in c.get("not_like_for_like") or ()})
    if problems:
        out += ["", f"No ratio against the peer: {'; '.join(problems)}."]
    passes = [p for p in data["passes"] if p["cell"] == cell]
    if passes:
        out += ["", "Tokens/s by pass, in the order run:", ""]
        for p in passes:
            runs = ", ".join(f"{r['config']} {r['tokens_per_s']:.1f}" for r in p["runs"])
            out.append(f"- pass {p['pass'] + 1}: {runs}")
    return out


def cost_model_lines(cell: str, meta: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """The draft lengths each speculative configuration ran (rounds at each K, from the first pass: greedy runs
    repeat), the goodput policy's cost table (per batch of the cell: each K's round cost in plain steps) and the
    cost model's prediction against the measured median; empty where the file has none of them."""
    first = {r["config"]: r for p in data["passes"] if p["cell"] == cell and p["pass"] == 0 for r in p["runs"]}
    rows = []
    for name, c in meta["configs"].items():
        k_rounds = (first.get(name) or {}).get("k_rounds") or {}
        if c.get("kind") != "jspec" or not (len(k_rounds) > 1 or "round_costs" in c or "predicted_vs_plain" in c):
            continue
        ks = " ".join(f"{k}:{n}" for k, n in k_rounds.items()) or "-"
        table = "; ".join(" ".join(f"{k}:{x:.2f}" for k, x in t.items()) for t in c.get("round_costs", [])) or "-"
        pred = c.get("predicted_vs_plain")
        rows.append(f"| {name} | {ks} | {table} | {'-' if pred is None else f'{pred:.2f}x'} | "
                    f"{ratio_text(find_ratio(data, cell, name, 'plain'))} |")  # fmt: skip
    if not rows:
        return []
    head = [
        "",
        _wrap(
            "Draft lengths and the cost model: rounds run at each K (K:rounds), the goodput policy's round costs "
            "relative to a plain step (K:cost, per batch), and the cost model's prediction (plain's prefill, then "
            "the rounds priced by that table) against the measured ratio."
        ),
        "",
        "| config | rounds at K | round costs | predicted vs plain | measured vs plain |",
        "|---|---|---|---|---|",
    ]
    return head + rows


# --------------------------------------------------------------------------------------------------------
# The command


def render(root: str = ".") -> tuple[dict[str, str], list[str]]:
    """{path: rendered text} for README.md and docs/results.md under ``root``, and the README rows no file
    holds."""
    files = load_committed(root)
    table, missing = readme_table(files)
    with open(os.path.join(root, "README.md")) as f:
        readme = replace_table(f.read(), table)
    return {"README.md": readme, RESULTS_MD.replace(os.sep, "/"): results_md(files)}, missing


def first_difference(path: str, current: str, rendered: str) -> str:
    diff = list(difflib.unified_diff(current.splitlines(), rendered.splitlines(), path, "rendering", lineterm="", n=0))
    return "\n".join(diff[:12])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jspec report",
        description="Render the README's results table and docs/results.md from the committed result files "
        "(docs/results/*.json).",
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from the rendering")
    ap.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    args = ap.parse_args(argv)
    try:
        rendered, missing = render(args.root)
    except (OSError, ValueError) as e:  # RecordError included: the file and its problems
        print(f"error: {e}", file=sys.stderr)
        return 2
    for row in missing:
        print(f"note: no committed result file holds the README row {row}", file=sys.stderr)
    stale = []
    for rel, text in rendered.items():
        path = os.path.join(args.root, rel)
        current = open(path).read() if os.path.exists(path) else ""
        if current == text:
            continue
        if args.check:
            stale.append(
                f"{rel} differs from the rendering of docs/results/*.json:\n{first_difference(rel, current, text)}"
            )
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {rel}")
    if stale:
        print("\n".join(stale) + "\nrun `python -m jspec report` to render them", file=sys.stderr)
        return 1
    return 0
