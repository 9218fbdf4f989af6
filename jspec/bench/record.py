"""The result file every benchmark command writes: one JSON file per run.

A record holds what is needed to trace a number back to how it was made:

- ``schema``: this format's version (``SCHEMA``); ``bench``: the benchmark's name (the kind of file);
- ``command``: the exact command line, shell-quoted, runnable from the repository root;
- ``git``: ``commit`` and ``dirty`` (uncommitted changes to tracked files, result files excluded);
- ``machine``: CPU model, usable and total cores, platform, Python; ``jax``: jax and jaxlib versions, the backend,
  the device kind and count;
- ``started`` / ``finished``: UTC timestamps (``finished`` is null while the run is going on, so a file written
  by a run that was stopped does not validate);
- ``settings``: the script's settings (``settings["smoke"]`` lists what was reduced below the real settings);
- ``cells``: the measured situations (e.g. one workload at one batch size), each with ``labels``, its
  ``configs`` (what each configuration is) and its ``ratios`` (``of`` one config ``over`` others: a pass's ratio
  is ``of``'s tokens/s over the fastest of ``over`` in that pass);
- ``passes``: every pass's raw numbers, per cell: the order the configs ran in and per config its tokens,
  seconds, tokens/s, rounds, tokens per round and position in the order;
- ``summary``: per cell, each config's and each ratio's median with the min and max over passes, computed
  from ``passes`` (``summarize``), never copied from elsewhere;
- ``extra``: anything else the script reports.

``validate`` names what a file lacks; ``load`` reads and validates one. A ratio needs ``MIN_PASSES`` passes and
the configs of a cell must not run in the same order in every pass (``rotation`` gives each pass's order).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

SCHEMA = 1
MIN_PASSES = 5
RESULTS_DIR = "results"  # where a run's file goes by default (not committed)
COMMITTED_DIR = os.path.join("docs", "results")  # the files behind the numbers the documents cite
_RESULT_PREFIXES = (RESULTS_DIR + "/", COMMITTED_DIR.replace(os.sep, "/") + "/")
_REL_TOL = 1e-9


class RecordError(ValueError):
    """A result file that cannot be read or does not validate; the message names the file and the problems."""


# --------------------------------------------------------------------------------------------------------
# Where and how a run was made


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def command_line(prog: str, argv: Sequence[str] | None = None) -> str:
    """``prog`` (e.g. "python examples/bench_grid.py", "python -m jspec bench") followed by the arguments,
    shell-quoted: the command that reproduces the run. ``argv`` None: this process's ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prog, *map(shlex.quote, args)]).strip()


def repo_root() -> str:
    """The directory holding the ``jspec`` package (the repository root in a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_state(root: str | None = None) -> dict[str, Any]:
    """{"commit", "dirty"} of the checkout at ``root`` (default ``repo_root()``): dirty when a tracked file other
    than a result file has uncommitted changes. Outside a checkout (or without git) both are None and "error"
    says why: such a record does not validate."""
    root = root or repo_root()

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=True, timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": None, "dirty": None, "error": f"{type(e).__name__}: {e}"[:300]}
    dirty = [p for p in changed if not p.strip('"').startswith(_RESULT_PREFIXES)]
    return {"commit": commit, "dirty": bool(dirty), "changed": dirty[:20]}


def machine() -> dict[str, Any]:
    """CPU model, the cores this process may use and the machine's total, platform, Python."""
    from jspec.bench.metrics import cpu_model

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cores_usable": usable,
        "cores_total": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def jax_info() -> dict[str, Any]:
    """jax and jaxlib versions, the default backend, its first device's kind and the device count."""
    import jax

    from jspec.bench.metrics import environment

    env = environment()
    dev = jax.devices()[0]
    return {
        "jax": env["jax"],
        "jaxlib": env["jaxlib"],
        "backend": env["backend"],
        "device_kind": getattr(dev, "device_kind", dev.platform),
        "device_count": env["device_count"],
        "matmul_precision": env["matmul_precision"],
    }


def default_path(bench: str, when: datetime.datetime | None = None) -> str:
    """``results/<bench>-<UTC timestamp>.json`` (``-2``, ``-3``, ... added when a run of the same second took it)."""
    when = when or datetime.datetime.now(datetime.UTC)
    base = os.path.join(RESULTS_DIR, f"{bench}-{when.strftime('%Y%m%dT%H%M%SZ')}")
    path, n = base + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.json"
    return path


def check_out_path(path: str, flag: str = "--out") -> str:
    """A record's path, checked before a model loads: its folder is created (or must be writable), and a file
    already there is refused (one file per run: a run never overwrites another's)."""
    if os.path.isdir(path):
        raise OSError(f"{flag} {path}: a directory; give a file name (.json)")
    if os.path.exists(path):
        raise OSError(f"{flag} {path}: already exists (one file per run; choose another name)")
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"{flag} {path}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{flag} {path}: {folder} is not writable")
    return path


def rotation(items: Sequence[Any], index: int) -> list[Any]:
    """Pass ``index``'s order: ``items`` rotated left by ``index`` (A B C, B C A, C A B, ...; with two
    items A B, B A, A B, ...), so that no configuration always runs first or always right after another."""
    n = len(items)
    if n == 0:
        return []
    k = index % n
    return [*items[k:], *items[:k]]


# --------------------------------------------------------------------------------------------------------
# Building a record


def run_entry(
    config: str,
    position: int,
    tokens: int,
    seconds: float,
    rounds: int | None = None,
    tokens_per_round: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One config's numbers in one pass (``tokens_per_s`` = tokens / seconds)."""
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"{config}: seconds must be a finite number > 0, got {seconds!r}")
    return {
        "config": config,
        "position": int(position),
        "tokens": int(tokens),
        "seconds": float(seconds),
        "tokens_per_s": int(tokens) / float(seconds),
        "rounds": None if rounds is None else int(rounds),
        "tokens_per_round": tokens_per_round,
        **extra,
    }


class Record:
    """A run's result file, filled in as the run goes: ``cell`` and ``config`` describe what is measured,
    ``ratio`` what is compared, ``add_pass`` adds each pass's numbers, ``write`` computes the summary and
    writes the file (call it after each cell: a run that stops keeps what it measured, with ``finished`` null
    until ``finish``)."""

    def __init__(self, bench: str, command: str, settings: dict[str, Any], path: str | None = None):
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", bench):
            raise ValueError(f"bench name {bench!r}: lower-case letters, digits, '.', '_' and '-' only")
        self.path = path or default_path(bench)
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "bench": bench,
            "command": command,
            "git": git_state(),
            "machine": machine(),
            "jax": jax_info(),
            "started": utc_now(),
            "finished": None,
            "settings": settings,
            "cells": {},
            "passes": [],
            "summary": {},
            "extra": {},
        }

    @property
    def extra(self) -> dict[str, Any]:
        return self.data["extra"]

    def cell(self, name: str, **labels: Any) -> None:
        if name in self.data["cells"]:
            raise ValueError(f"cell {name!r} is already in the record")
        self.data["cells"][name] = {"labels": labels, "configs": {}, "ratios": []}

    def config(self, cell: str, name: str, **meta: Any) -> None:
        self._cell(cell)["configs"][name] = meta

    def ratio(self, cell: str, of: str, over: Sequence[str], name: str | None = None) -> str:
        c = self._cell(cell)
        missing = [x for x in [of, *over] if x not in c["configs"]]
        if missing or not over:
            raise ValueError(f"cell {cell!r}: a ratio needs known configs (unknown: {missing or 'none over'})")
        name = name or f"{of} vs {' / '.join(over)}"
        c["ratios"].append({"name": name, "of": of, "over": list(over)})
        return name

    def add_pass(self, cell: str, index: int, runs: Sequence[dict[str, Any]], **extra: Any) -> None:
        c = self._cell(cell)
        unknown = [r["config"] for r in runs if r["config"] not in c["configs"]]
        if unknown:
            raise ValueError(f"cell {cell!r}: pass {index} has unknown configs {unknown}")
        runs = sorted(runs, key=lambda r: r["position"])
        self.data["passes"].append(
            {"cell": cell, "pass": int(index), "order": [r["config"] for r in runs], "runs": list(runs), **extra}
        )

    def finish(self) -> None:
        self.data["finished"] = utc_now()

    def write(self, path: str | None = None) -> str:
        self.data["summary"] = summarize(self.data)
        return write(self.data, path or self.path)

    def _cell(self, name: str) -> dict[str, Any]:
        try:
            return self.data["cells"][name]
        except KeyError:
            raise ValueError(f"no cell {name!r} in the record (add it with cell())") from None


def start(bench: str, prog: str, argv: Sequence[str] | None, settings: dict[str, Any], out: str | None = None,
          flag: str = "--out") -> Record:  # fmt: skip
    """A script's record, begun before its model loads: the path (``out``, else ``default_path(bench)``) checked
    (``check_out_path``), the command ``prog`` + ``argv`` (None: this process's arguments)."""
    path = check_out_path(out or default_path(bench), flag)
    return Record(bench, command_line(prog, argv), settings, path)


def write(data: dict[str, Any], path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


# --------------------------------------------------------------------------------------------------------
# Summaries


def spread(values: Sequence[float]) -> dict[str, Any]:
    """{"median", "min", "max", "n"} of ``values`` (None entries dropped; all None when nothing is left)."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "n": len(kept)}


def pass_ratio(runs: dict[str, dict[str, Any]], of: str, over: Sequence[str]) -> float | None:
    """One pass's ratio: ``of``'s tokens/s over the fastest of ``over``'s (None when one of them did not run)."""
    if of not in runs or any(o not in runs for o in over):
        return None
    den = max(runs[o]["tokens_per_s"] for o in over)
    return runs[of]["tokens_per_s"] / den if den > 0 else None


_CONFIG_STATS = ("tokens_per_s", "tokens_per_round", "acceptance")


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per cell: each config's ``tokens_per_s``, ``tokens_per_round`` and ``acceptance`` over the passes, and
    each ratio's per-pass values and their ``spread``."""
    out: dict[str, Any] = {}
    for name, cell in data.get("cells", {}).items():
        passes = [{r["config"]: r for r in p["runs"]} for p in data.get("passes", []) if p["cell"] == name]
        configs = {}
        for cfg in cell["configs"]:
            runs = [p[cfg] for p in passes if cfg in p]
            configs[cfg] = {k: spread([r.get(k) for r in runs]) for k in _CONFIG_STATS}
        ratios = {}
        for r in cell["ratios"]:
            values = [pass_ratio(p, r["of"], r["over"]) for p in passes]
            ratios[r["name"]] = {"of": r["of"], "over": r["over"], "by_pass": values, **spread(values)}
        out[name] = {"passes": len(passes), "configs": configs, "ratios": ratios}
    return out


# --------------------------------------------------------------------------------------------------------
# Reading and checking


_REQUIRED = {
    "command": str,
    "bench": str,
    "started": str,
    "finished": str,
    "settings": dict,
    "cells": dict,
    "passes": list,
    "summary": dict,
}
_REQUIRED_IN = {
    "git": {"commit": str, "dirty": bool},
    "machine": {"cpu_model": str, "cores_usable": int, "platform": str, "python": str},
    "jax": {"jax": str, "jaxlib": str, "backend": str, "device_kind": str},
}
_RUN_FIELDS = {"config": str, "position": int, "tokens": int, "seconds": float, "tokens_per_s": float}


def _type_ok(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def validate(data: Any, min_passes: int = MIN_PASSES) -> list[str]:
    """What is missing or wrong in a record, each problem named (empty: valid). Checks the fields above, every
    run's numbers (tokens/s = tokens / seconds, positions 0..n-1), that configs do not run in one fixed order,
    that every ratio has at least ``min_passes`` passes, and that the summary is what ``summarize`` computes
    from the passes."""
    if not isinstance(data, dict):
        return [f"not a JSON object (got {type(data).__name__})"]
    problems = []
    if data.get("schema") != SCHEMA:
        problems.append(f"schema: expected {SCHEMA}, got {data.get('schema')!r}")
    for key, kind in _REQUIRED.items():
        if key not in data or data[key] is None:
            problems.append(f"missing {key}")
        elif not _type_ok(data[key], kind) or (kind is str and not data[key].strip()):
            problems.append(f"{key}: expected a non-empty {kind.__name__}, got {data[key]!r}"[:200])
    for group, fields in _REQUIRED_IN.items():
        sub = data.get(group)
        if not isinstance(sub, dict):
            problems.append(f"missing {group}")
            continue
        for key, kind in fields.items():
            if sub.get(key) is None:
                problems.append(f"missing {group}.{key}")
            elif not _type_ok(sub[key], kind):
                problems.append(f"{group}.{key}: expected {kind.__name__}, got {sub[key]!r}"[:200])
    commit = (data.get("git") or {}).get("commit")
    if isinstance(commit, str) and not re.fullmatch(r"[0-9a-f]{40}", commit):
        problems.append(f"git.commit: not a commit id: {commit!r}")
    if problems:  # the rest reads these fields
        return problems
    return _check_passes(data, min_passes)


def _check_passes(data: dict[str, Any], min_passes: int) -> list[str]:
    problems = []
    cells = data["cells"]
    for i, p in enumerate(data["passes"]):
        where = f"passes[{i}]"
        if p.get("cell") not in cells:
            problems.append(f"{where}: unknown cell {p.get('cell')!r}")
            continue
        runs = p.get("runs") or []
        if not runs:
            problems.append(f"{where}: no runs")
        for j, r in enumerate(runs):
            for key, kind in _RUN_FIELDS.items():
                if r.get(key) is None:
                    problems.append(f"{where}.runs[{j}]: missing {key}")
                elif not _type_ok(r[key], kind):
                    problems.append(f"{where}.runs[{j}].{key}: expected {kind.__name__}, got {r[key]!r}")
            if all(_type_ok(r.get(k), float) for k in ("tokens", "seconds", "tokens_per_s")) and r["seconds"] > 0:
                if not _close(r["tokens_per_s"], r["tokens"] / r["seconds"]):
                    problems.append(f"{where}.runs[{j}]: tokens_per_s is not tokens / seconds")
            if r.get("config") not in cells[p["cell"]]["configs"]:
                problems.append(f"{where}.runs[{j}]: unknown config {r.get('config')!r}")
        if sorted(r.get("position") for r in runs if isinstance(r.get("position"), int)) != list(range(len(runs))):
            problems.append(f"{where}: positions are not 0..{len(runs) - 1}")
    for name in cells:
        orders = [tuple(p["order"]) for p in data["passes"] if p.get("cell") == name and "order" in p]
        if len(orders) > 1 and len(orders[0]) > 1 and len(set(orders)) == 1:
            problems.append(f"cell {name!r}: the configs ran in the same order in every pass (not alternated)")
    if problems:
        return problems
    recomputed = summarize(data)
    for name, cell in recomputed.items():
        for rname, r in cell["ratios"].items():
            if r["n"] < min_passes:
                problems.append(f"cell {name!r}: ratio {rname!r} over {r['n']} passes (needs >= {min_passes})")
    if not _close(data["summary"], recomputed):
        bad = [c for c in recomputed if not _close(data["summary"].get(c), recomputed[c])]
        bad += [c for c in data["summary"] if c not in recomputed]
        problems.append(f"summary differs from the one recomputed from the passes (cells: {', '.join(bad)})")
    return problems


def load(path: str, min_passes: int = MIN_PASSES) -> dict[str, Any]:
    """A result file, read and validated (RecordError naming the file and every problem)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: cannot read: {e}") from None
    problems = validate(data, min_passes)
    if problems:
        raise RecordError(f"{path}: " + "; ".join(problems))
    return data
