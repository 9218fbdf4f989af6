"""Reading a program that ``jax.export`` lowered for another platform (TPU, CUDA) on this CPU host.

What the tests check in the exported StableHLO, and why:
- ``decode_loops``: the while loops whose trip count is data-dependent and that no other loop contains (a loop
  inside a function counts where that function is called). A whole decode must have exactly one: the rounds
  of ``jspec.loop.run_loop``. A scan (the stacked layers, the sampling's bisections) is a loop counted against
  a constant, and a branch written as a loop of 0 or 1 trips (``jspec.rounds.switch_in_place``, whose name
  scope the op's location keeps) is a branch; a second top-level data-dependent loop would be a second phase.
- ``custom_calls``: every ``stablehlo.custom_call`` target. A host callback (``jax.debug.print``, a pure
  callback) or a CPU-only custom call (jspec's C++ kernels, LAPACK) must never reach a TPU or CUDA program;
  ``unexpected_calls`` names any target outside the small allowlist of partitioning markers and the GPU's own
  random-bits kernel.
- ``collectives``: explicit collective ops. jspec's programs are partitioned by XLA from sharding annotations,
  so the exported module must hold none; the collectives XLA inserts are counted on the compiled program
  (``sharding.hlo``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jspec.rounds import AT_MOST_ONCE

PLATFORMS = ("tpu", "cuda")

# Custom calls allowed in an accelerator program: sharding and partitioning markers, and the CUDA random-bits
# kernel JAX itself lowers threefry to on GPUs.
ALLOWED_CALLS = {
    "tpu": {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"},
    "cuda": {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "cu_threefry2x32",
        "cu_threefry2x32_ffi",
    },
}
HOST_CALLBACK = re.compile(r"callback", re.IGNORECASE)
COLLECTIVE_OPS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)

_FUNC = re.compile(r"^\s*func\.func\s+(?:public|private)?\s*@([\w.$-]+)\(")
_WHILE = re.compile(r"=\s*stablehlo\.while\(")
_CALL = re.compile(r"\b(?:func\.)?call\s+@([\w.$-]+)\(")
_CUSTOM = re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)")
_COLLECTIVE = re.compile(r"\bstablehlo\.(" + "|".join(COLLECTIVE_OPS) + r")\b")
# A scan's condition: its counter against a constant trip count, and nothing else.
_COUNTED = re.compile(r"stablehlo\.compare\s+LT,\s*%iterArg\w*,\s*%c\w*,")
_LOC_REF = re.compile(r"loc\((#loc\d+)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")


def _locations(text: str) -> dict[str, str]:
    """#locN -> every name its location holds, its callers' and fused parts' included."""
    defs = {}
    for line in text.splitlines():
        m = _LOC_DEF.match(line)
        if m:
            defs[m.group(1)] = m.group(2)
    resolved: dict[str, str] = {}

    def names(ref: str, depth: int = 0) -> str:
        if ref in resolved or depth > 50:
            return resolved.get(ref, "")
        body = defs.get(ref, "")
        out = " ".join([*re.findall(r'"([^"]*)"', body), *(names(r, depth + 1) for r in re.findall(r"#loc\d+", body))])
        resolved[ref] = out
        return out

    return {ref: names(ref) for ref in defs}


@dataclasses.dataclass
class _While:
    func: str
    line: int
    indent: int
    cond: list[str] = dataclasses.field(default_factory=list)
    in_cond: bool = True
    parent: _While | None = None
    branch: bool = False  # a ``switch_in_place`` branch: at most one trip

    @property
    def counted(self) -> bool:
        ops = [s for s in self.cond if not s.startswith("stablehlo.return") and not s.startswith("^")]
        return len(ops) == 1 and _COUNTED.search(ops[0]) is not None


@dataclasses.dataclass
class ModuleReport:
    """decode_loops: (function, line) of each top-level data-dependent while loop; custom_calls: target ->
    count; collectives: explicit collective op -> count; loops: every while loop (counted or not)."""

    decode_loops: list[tuple[str, int]]
    custom_calls: Counter
    collectives: Counter
    loops: int

    def unexpected_calls(self, platform: str) -> list[str]:
        return sorted(c for c in self.custom_calls if c not in ALLOWED_CALLS[platform])

    def host_callbacks(self) -> list[str]:
        return sorted(c for c in self.custom_calls if HOST_CALLBACK.search(c))

    def problems(self, platform: str, loops: int = 1) -> list[str]:
        """What is wrong with this module as a whole decode for ``platform`` (empty: nothing). loops: how many
        top-level data-dependent loops it must have (one for a decode, none for one round)."""
        out = []
        if len(self.decode_loops) != loops:
            where = ", ".join(f"{f}:{n}" for f, n in self.decode_loops) or "none"
            out.append(f"{len(self.decode_loops)} top-level data-dependent while loops (want {loops}): {where}")
        if self.host_callbacks():
            out.append(f"host callbacks: {', '.join(self.host_callbacks())}")
        bad = [c for c in self.unexpected_calls(platform) if c not in self.host_callbacks()]
        if bad:
            out.append(f"custom calls that are not {platform} ops: {', '.join(bad)}")
        if self.collectives:
            out.append(f"explicit collectives: {dict(self.collectives)}")
        return out


_RESULT_SHARDING = re.compile(r'jax\.result_info = "([^"]+)", sdy\.sharding = #sdy\.sharding<@\w+, \[(.*?)\]>')


def result_shardings(text: str) -> dict[str, list[tuple[str, ...]]]:
    """The main function's result shardings (Shardy's annotations): result name (e.g. "result.cache.k") -> the
    mesh axes each dimension is split over (() for a whole dimension)."""
    out = {}
    for name, dims in _RESULT_SHARDING.findall(text):
        out[name] = [tuple(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{[^}]*\}", dims)]
    return out


def analyze(text: str) -> ModuleReport:
    """Read an exported module's text (``jax.export.Exported.mlir_module()``)."""
    whiles: list[_While] = []
    calls: list[tuple[str, str, _While | None]] = []  # (caller, callee, innermost enclosing while)
    custom: Counter = Counter()
    collectives: Counter = Counter()
    func = None
    stack: list[_While] = []
    locations = _locations(text)
    for n, line in enumerate(text.splitlines(), 1):
        m = _FUNC.match(line)
        if m:
            func, stack = m.group(1), []
            continue
        if func is None:
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stack and indent == stack[-1].indent and stripped.startswith("}"):
            if stripped.startswith("} do {"):
                stack[-1].in_cond = False
            else:
                ref = _LOC_REF.search(stripped)
                stack[-1].branch = ref is not None and AT_MOST_ONCE in locations.get(ref.group(1), "")
                stack.pop()
            continue
        if stack and stack[-1].in_cond and indent > stack[-1].indent and stripped != "cond {":
            stack[-1].cond.append(stripped)
        for c in _CUSTOM.findall(line):
            custom[c] += 1
        for c in _COLLECTIVE.findall(line):
            collectives[c] += 1
        for callee in _CALL.findall(line):
            calls.append((func, callee, stack[-1] if stack else None))
        if _WHILE.search(line):
            w = _While(func, n, indent, parent=stack[-1] if stack else None)
            whiles.append(w)
            stack.append(w)
    # A function is "in a loop" when some call to it is inside a while loop, or comes from a function in one.
    looped: set[str] = set()
    changed = True
    while changed:
        changed = False
        for caller, callee, w in calls:
            if callee not in looped and (w is not None or caller in looped):
                looped.add(callee)
                changed = True
    top = [w for w in whiles if not (w.counted or w.branch) and w.parent is None and w.func not in looped]
    return ModuleReport([(w.func, w.line) for w in top], custom, collectives, len(whiles))
