"""Counting collectives in compiled (partitioned) HLO text: ``jitted.lower(...).compile().as_text()``.

Static counts (ops in the program text) say little about a loop: a collective inside the layer scan runs
once per layer, one inside the decode ``while`` once per round. ``analyze`` therefore walks the call graph
from the entry computation, multiplying by known trip counts (XLA records ``known_trip_count`` for scans),
taking the larger branch of a conditional (the worst-case round), and reporting the data-dependent loop
(the decode loop: no known trip count) separately as "per round". A while loop whose metadata carries
``jspec.rounds.AT_MOST_ONCE`` is a branch written as a loop of 0 or 1 trips: counted as one trip, like the
taken branch of a conditional.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jspec.rounds import AT_MOST_ONCE

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_OP = re.compile(r"=\s+(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"true_computation=%?([\w.\-]+),\s*false_computation=%?([\w.\-]+)")
_CALLS = re.compile(r"\s(?:call|async-start)\(.*(?:to_apply|calls)=%?([\w.\-]+)")


@dataclasses.dataclass
class Collective:
    op: str  # e.g. "all-gather"
    shape: str  # result type, e.g. "f32[2,4,16,8]"


def parse(hlo: str) -> tuple[str, dict[str, list[str]]]:
    """(entry computation name, {computation: instruction lines})."""
    comps: dict[str, list[str]] = {}
    entry = ""
    cur = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            if line.strip() == "}":
                cur = None
            else:
                comps[cur].append(line)
    return entry, comps


def _own(lines: list[str]) -> list[Collective]:
    out = []
    for line in lines:
        m = _OP.search(line)
        if m and "-done" not in line.split("=", 1)[1].split("(", 1)[0]:
            out.append(Collective(m.group(2), m.group(1)))
    return out


@dataclasses.dataclass
class Analysis:
    """outside_loop: collectives run once per call, outside the decode loop (prefill, set-up); per_round:
    those of one iteration of the decode loop (worst-case branch of every conditional, inner scans
    multiplied out), as (op, result shape, times) entries; ops: every collective of the program text."""

    outside_loop: list[tuple[str, str, int]]
    per_round: list[tuple[str, str, int]]
    ops: list[Collective]
    decode_loops: int

    @staticmethod
    def _count(entries) -> dict[str, int]:
        c = Counter()
        for op, _, n in entries:
            c[op] += n
        return dict(sorted(c.items()))

    def summary(self) -> dict:
        return {
            "per_round": self._count(self.per_round),
            "per_round_total": sum(n for *_, n in self.per_round),
            "outside_loop": self._count(self.outside_loop),
            "static_total": len(self.ops),
            "decode_loops": self.decode_loops,
        }


def _scale(entries, n: int):
    return [(op, shape, k * n) for op, shape, k in entries]


def _total(entries) -> int:
    return sum(k for *_, k in entries)


def analyze(hlo: str) -> Analysis:
    entry, comps = parse(hlo)
    memo: dict[str, tuple[list, list, int]] = {}

    def walk(name: str) -> tuple[list, list, int]:
        """(collectives outside data-dependent loops, collectives per iteration of such loops, #loops)."""
        if name in memo:
            return memo[name]
        lines = comps.get(name, [])
        once = [(c.op, c.shape, 1) for c in _own(lines)]
        per: list = []
        loops = 0
        for line in lines:
            w = _WHILE.search(line)
            if w:
                cond_once, cond_per, cl = walk(w.group(1))
                body_once, body_per, bl = walk(w.group(2))
                trip = _TRIP.search(line)
                if trip:  # a scan: its body runs a known number of times per execution of this computation
                    once += _scale(body_once + cond_once, int(trip.group(1)))
                    per += body_per + cond_per
                    loops += bl + cl
                elif AT_MOST_ONCE in line:  # a branch as a loop (``jspec.rounds.cond_in_place``): worst case
                    once += body_once + cond_once
                    per += body_per + cond_per
                    loops += bl + cl
                else:  # the decode loop: what one iteration costs
                    per += body_once + cond_once
                    loops += 1 + bl + cl
                continue
            branches = []
            b = _BRANCHES.search(line)
            if b:
                branches = [x.strip().lstrip("%") for x in b.group(1).split(",")]
            tf = _TRUE_FALSE.search(line)
            if tf:
                branches = [tf.group(1), tf.group(2)]
            if branches:
                results = [walk(x) for x in branches]
                once += max((r[0] for r in results), key=_total)
                per += max((r[1] for r in results), key=_total)
                loops += max(r[2] for r in results)
                continue
            c = _CALLS.search(line)
            if c:
                o, p, lp = walk(c.group(1))
                once += o
                per += p
                loops += lp
        memo[name] = (once, per, loops)
        return memo[name]

    once, per, loops = walk(entry)
    ops = [c for lines in comps.values() for c in _own(lines)]
    return Analysis(once, per, ops, loops)


def dims(shape: str) -> list[list[int]]:
    """'(f32[2,3], s32[4])' or 'f32[2,3]{1,0}' -> [[2, 3], [4]]."""
    return [[int(d) for d in m.split(",") if d] for m in re.findall(r"\[([\d,]*)\]", shape)]


def cache_collectives(hlo: str, slots: int, head_dim: int) -> list[Collective]:
    """Collectives that move KV-cache data: any result with a [..., S, D] (slots, head dim) tail, i.e. a cache
    (or cache layer) all-gathered / permuted / reduced between devices. Must be empty for a sharded decode."""
    out = []
    for c in analyze(hlo).ops:
        if any(len(d) >= 2 and d[-2:] == [slots, head_dim] for d in dims(c.shape)):
            out.append(c)
    return out
