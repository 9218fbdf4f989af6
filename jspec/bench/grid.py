"""The headline benchmark: speculative against plain decoding over a grid of batch sizes x workloads x drafters,
in one process, every ratio measured pass by pass in a rotating order.

The target is the default checkpoint (SmolLM2-135M-Instruct) in f32, loaded through ``jspec.loaders`` in the
layer layout that decodes fastest here (``wants_unstacked("auto")``), greedy. A cell is one workload at one
batch size B: ``--prompts`` prompts of that workload (at least B), decoded as batches of B prompts through
``jspec.decode.prepare``. Every configuration (plain decoding and each drafter) is compiled once and run once
untimed on each batch of the cell; then each of ``passes`` passes runs every configuration once, back to back,
the order rotated by one from pass to pass (``record.rotation``), timing the execution alone (compilation is
reported apart). A configuration's tokens/s in a pass is its tokens over its seconds on all the cell's batches.
Every speculative output is compared token for token with plain decoding's (greedy speculation is lossless):
a difference is recorded, and ``run`` reports it (the script exits 1).

At batch 1 a peer can run in the same rotation: transformers' plain greedy ``generate`` and its prompt lookup
(``prompt_lookup_num_tokens``), on the same GGUF file and the same prompt ids, one prompt at a time
(``peer_transformers.run_transformers``). "vs best peer" is a drafter's tokens/s over the faster of the peer's two
configurations in the same pass.

Drafters (``parse_drafter``): ``ngram[:K]`` (``jspec.ngram.NgramDrafter``, K = 4), ``eagle[:K]`` (the EAGLE head
bundled for the default model through the ``eagle`` drafter loader, a chain of K = 2) and ``eagle-tree[:B1xB2..]``
(the same head drafting a static tree, (4, 1) by default, deterministic rule). Each cell's numbers go into one
result file (``record.Record``): per pass and configuration the tokens, seconds, rounds and tokens per round; per
cell the medians with their min-max spread.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from jspec.bench import metrics, peer_transformers, peers, record, runspec, workloads

MAX_NEW_TOKENS = {"edit": 256, "chat": 128}  # edit answers copy the prompt's function: long
REQUESTS: dict[str, Callable[[int, int], list]] = {
    "edit": workloads.edit_requests,
    "chat": workloads.chat_requests,
}
DEFAULT_BATCHES = (1, 8)
DEFAULT_WORKLOADS = ("edit", "chat")
DEFAULT_DRAFTERS = ("ngram", "eagle", "eagle-tree")
DEFAULT_PASSES = 5
DEFAULT_PROMPTS = 4  # prompts per cell at batch 1; a batch-B cell decodes at least B
PEER_BATCH = 1  # the peers' speculative paths decode one request at a time
PEERS = ("none", "transformers")


# --------------------------------------------------------------------------------------------------------
# Drafters


@dataclasses.dataclass(frozen=True)
class DrafterChoice:
    """One drafter configuration of the grid: ``kind`` ngram / eagle / eagle-tree, ``k`` a chain's K, ``tree``
    a static tree's branching factors."""

    kind: str
    k: int | None = None
    tree: tuple[int, ...] | None = None
    goodput: bool = False  # K chosen each round up to ``k`` from measured costs (jspec.goodput)

    @property
    def name(self) -> str:
        if self.kind == "eagle-tree":
            return f"eagle tree ({','.join(map(str, self.tree or ()))})"
        return f"{self.kind} goodput K<={self.k}" if self.goodput else f"{self.kind} K={self.k}"

    @property
    def depth(self) -> int:
        return len(self.tree) if self.tree else int(self.k or 0)

    def tree_nodes(self) -> int:
        """Nodes a round verifies (the pending token included): 1 + K for a chain."""
        if not self.tree:
            return 1 + int(self.k or 0)
        nodes, width = 1, 1
        for b in self.tree:
            width *= b
            nodes += width
        return nodes


DRAFTER_KINDS = {"ngram": 4, "eagle": 2, "eagle-tree": (4, 1)}  # kind -> its default K or tree


def parse_drafter(text: str) -> DrafterChoice:
    """``ngram``, ``ngram:K``, ``eagle``, ``eagle:K``, ``eagle-tree`` or ``eagle-tree:B1xB2x...`` (or
    ``B1,B2,...``); ``ngram:goodput`` / ``eagle:goodput``: K chosen each round from measured costs, up to the
    kind's default K. ValueError naming what is wrong."""
    kind, _, arg = text.strip().partition(":")
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter {kind!r}; choose from {', '.join(DRAFTER_KINDS)} (e.g. ngram:4, eagle:2, "
                         "eagle-tree:4x1)")  # fmt: skip
    default = DRAFTER_KINDS[kind]
    if kind == "eagle-tree":
        parts = arg.replace("x", ",").split(",") if arg else [str(b) for b in default]
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"{text!r}: a tree is branching factors >= 1 per level, e.g. eagle-tree:4x1")
        return DrafterChoice(kind, tree=tuple(int(p) for p in parts))
    if arg.strip() == "goodput":
        return DrafterChoice(kind, k=default, goodput=True)
    if arg and not (arg.strip().isdigit() and int(arg) >= 1):
        raise ValueError(f"{text!r}: K must be an integer >= 1 (e.g. {kind}:4)")
    return DrafterChoice(kind, k=int(arg) if arg else default)


# --------------------------------------------------------------------------------------------------------
# Settings


@dataclasses.dataclass(frozen=True)
class GridSettings:
    batches: tuple[int, ...] = DEFAULT_BATCHES
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    drafters: tuple[DrafterChoice, ...] = tuple(parse_drafter(d) for d in DEFAULT_DRAFTERS)
    passes: int = DEFAULT_PASSES
    prompts: int = DEFAULT_PROMPTS
    max_new_tokens: dict[str, int] = dataclasses.field(default_factory=lambda: dict(MAX_NEW_TOKENS))
    peers: str = "transformers"
    seed: int = 0
    model: str = "smollm2-135m-instruct"

    def __post_init__(self):
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches {list(self.batches)}: give batch sizes >= 1")
        unknown = [w for w in self.workloads if w not in REQUESTS]
        if not self.workloads or unknown:
            raise ValueError(f"workloads {list(self.workloads)}: choose from {', '.join(REQUESTS)}")
        if not self.drafters:
            raise ValueError("drafters: name at least one (plain decoding always runs)")
        names = [d.name for d in self.drafters]
        if len(set(names)) < len(names):
            raise ValueError(f"drafters {names}: one is given twice")
        if self.passes < 2:
            raise ValueError(f"passes {self.passes}: need >= 2 to alternate the order ({DEFAULT_PASSES} by default)")
        if self.prompts < 1:
            raise ValueError(f"prompts {self.prompts}: must be >= 1")
        bad = {w: n for w, n in self.max_new_tokens.items() if n < 1}
        if bad or any(w not in self.max_new_tokens for w in self.workloads):
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: need one >= 1 per workload")
        if self.peers not in PEERS:
            raise ValueError(f"peers {self.peers!r}: choose from {', '.join(PEERS)}")

    def smoke(self) -> list[str]:
        """What this run reduced below the real settings (empty: a real run)."""
        out = []
        for w in self.workloads:
            if self.max_new_tokens[w] < MAX_NEW_TOKENS[w]:
                out.append(f"max_new_tokens {self.max_new_tokens[w]} < {MAX_NEW_TOKENS[w]} ({w})")
        if self.prompts < DEFAULT_PROMPTS:
            out.append(f"prompts {self.prompts} < {DEFAULT_PROMPTS}")
        if self.passes < DEFAULT_PASSES:
            out.append(f"passes {self.passes} < {DEFAULT_PASSES}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": "float32",
            "layers": "auto",
            "sampling": "greedy",
            "chat_template": True,
            "batches": list(self.batches),
            "workloads": list(self.workloads),
            "drafters": [d.name for d in self.drafters],
            "passes": self.passes,
            "prompts": self.prompts,
            "max_new_tokens": {w: self.max_new_tokens[w] for w in self.workloads},
            "peers": self.peers,
            "seed": self.seed,
            "smoke": self.smoke(),
        }


# --------------------------------------------------------------------------------------------------------
# Building the configurations


@dataclasses.dataclass
class Config:
    """A configuration as ``prepare`` takes it."""

    name: str
    drafter: Any = None
    draft_params: Any = None
    gamma: int | None = None
    nodes: int = 1  # positions a round verifies
    goodput: Any = False  # the K of each round chosen from measured costs (gamma unset): decode's ``goodput``


def build_configs(target, choices: Sequence[DrafterChoice]) -> list[Config]:
    """Plain decoding first, then each drafter; the EAGLE head is loaded once, through the ``eagle`` drafter
    loader (``jspec.loaders``), with the largest K its chains need."""
    from jspec.loaders import model_loader
    from jspec.ngram import NgramDrafter
    from jspec.tree import TreeRule, TreeSpec

    configs = [Config("plain")]
    eagle_k = max([c.k or 1 for c in choices if c.kind == "eagle"] + [1])
    head = None
    for c in choices:
        gamma = None if c.goodput else c.k
        if c.kind == "ngram":
            ngram = NgramDrafter(vocab_size=target.model.vocab_size)
            configs.append(Config(c.name, ngram, None, gamma, 1 + c.k, c.goodput))
            continue
        if head is None:
            head = model_loader("jspec.drafter_loaders", "eagle")(None, target, eagle_k)
        drafter, dparams = head
        if c.kind == "eagle":
            configs.append(Config(c.name, drafter, dparams, gamma, 1 + c.k, c.goodput))
        else:
            tree = drafter.as_tree(TreeSpec(c.tree), TreeRule.DETERMINISTIC)
            configs.append(Config(c.name, tree, dparams, None, c.tree_nodes()))
    return configs


# --------------------------------------------------------------------------------------------------------
# One cell


@dataclasses.dataclass
class Batch:
    """One batch of the cell, prepared for every configuration."""

    prompts: list[tuple[int, ...]]
    prepared: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict)
    plain_tokens: list[list[int]] | None = None


def cell_prompts(target, workload: str, batch: int, settings: GridSettings) -> tuple[list, dict[str, Any]]:
    """The cell's batches of prompt ids (``prompts`` rounded up to whole batches of ``batch``) and its labels."""
    n_batches = math.ceil(max(settings.prompts, batch) / batch)
    reqs = REQUESTS[workload](n_batches * batch, settings.seed)
    jobs = runspec.make_jobs(reqs, target.tokenizer, chat_template=True)
    failed = [j for j in jobs if j.prompt is None]
    if failed:
        raise ValueError(f"{workload}: prompt {failed[0].id} could not be tokenised: {failed[0].error}")
    lens = [len(j.prompt) for j in jobs]
    labels = {
        "workload": workload,
        "batch": batch,
        "prompts": len(jobs),
        "distinct_prompts": len({j.prompt for j in jobs}),
        "prompt_tokens": {"min": min(lens), "median": statistics.median(lens), "max": max(lens)},
        "max_new_tokens": settings.max_new_tokens[workload],
        "prompt_set": workloads.workload_fingerprint(reqs),
    }
    return [jobs[i * batch : (i + 1) * batch] for i in range(n_batches)], labels


def prepare_cell(target, configs: Sequence[Config], batches: Sequence[Batch], max_new: int, log=print):
    """Compile every configuration on every batch and run it once untimed; returns per config its compile and
    first-run seconds. One cache size per batch for every configuration (the largest tree's scratch included),
    so that no configuration attends over more slots than another.

    A goodput configuration also gets the cost table its policy chose from (``round_costs``: per batch, each K's
    round cost relative to a plain step), and every speculative configuration whose draft lengths that table prices
    gets the cost model's prediction of its speed against plain decoding (``predicted_vs_plain``): plain's
    prefill (``prefill_seconds``), then its rounds at each K priced by the table in plain steps."""
    from jspec.decode import prepare

    scratch = max(c.nodes for c in configs) - 1
    costs = {c.name: {"compile_seconds": 0.0, "first_run_seconds": 0.0} for c in configs}
    predicted: dict[str, float] = {}  # per priced config: its predicted seconds over every batch
    plain_seconds = 0.0
    for b in batches:
        need = max(len(p) for p in b.prompts) + max_new - 1 + scratch
        max_len = -(-need // 128) * 128
        k_rounds: dict[str, dict[int, int]] = {}  # per config: its rounds at each K on this batch
        table: dict[int, float] = {}  # the first goodput config's round costs, K -> plain steps
        for c in configs:
            prep = prepare(target.model, target.params, [list(p) for p in b.prompts], drafter=c.drafter,
                           draft_params=c.draft_params, gamma=c.gamma, max_new_tokens=max_new,
                           eos_ids=target.eos_ids, max_len=max_len, goodput=c.goodput)  # fmt: skip
            t0 = time.perf_counter()
            b.compiled[c.name] = prep.compile()
            t1 = time.perf_counter()
            out = prep.run(b.compiled[c.name])
            t2 = time.perf_counter()
            b.prepared[c.name] = prep
            costs[c.name]["compile_seconds"] += t1 - t0
            costs[c.name]["first_run_seconds"] += t2 - t1
            k_rounds[c.name] = dict(zip(prep.config.draft_lengths, out.stats["k_rounds"]))
            if c.name == "plain":
                b.plain_tokens = out.tokens
                plain_s = t2 - t1
                plain_seconds += plain_s
                prefill_s = _prefill_seconds(prep, b.compiled[c.name])
            policy = prep.config.goodput
            if policy is not None:
                costs[c.name].setdefault("round_costs", []).append(dict(zip(map(str, policy.ks), policy.costs)))
                table = table or dict(zip(policy.ks, policy.costs))
        # Greedy: the first run's rounds are every run's. A plain step's time is plain's decode time (its seconds
        # past the prefill) over its rounds; a configuration's decode is its rounds priced in plain steps.
        step_s = (plain_s - prefill_s) / max(1, sum(k_rounds["plain"].values()))
        for c in configs:
            if c.drafter is None or not table or not set(k_rounds[c.name]) <= set(table):
                continue
            units = sum(n * table[k] for k, n in k_rounds[c.name].items())
            predicted[c.name] = predicted.get(c.name, 0.0) + prefill_s + units * step_s
        costs["plain"]["prefill_seconds"] = costs["plain"].get("prefill_seconds", 0.0) + prefill_s
    for name, seconds in predicted.items():
        costs[name]["predicted_vs_plain"] = plain_seconds / seconds
    for name, cost in costs.items():
        predicts = f", the cost model predicts {cost['predicted_vs_plain']:.2f}x plain" if name in predicted else ""
        log(f"    {name:<26} compiled in {cost['compile_seconds']:.1f} s, first run {cost['first_run_seconds']:.2f} s"
            f"{predicts}")  # fmt: skip
    return costs


def _prefill_seconds(prep, compiled, repeats: int = 3) -> float:
    """The median seconds of plain decoding's prefill on this batch: the same compiled call with a budget of one
    new token (the prefill's), so that no round runs."""
    import jax.numpy as jnp

    inputs = dataclasses.replace(prep.inputs, max_new=jnp.ones_like(prep.inputs.max_new))
    one = dataclasses.replace(prep, inputs=inputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = one.run(compiled)
        times.append(time.perf_counter() - t0)
    if sum(out.stats["rounds"]):
        raise RuntimeError(f"a budget of one new token ran {sum(out.stats['rounds'])} rounds: not a prefill alone")
    return statistics.median(times)


def time_config(name: str, batches: Sequence[Batch], position: int) -> dict[str, Any]:
    """One timed run of config ``name`` over the cell's batches (execution and the transfer to the host)."""
    tokens = rounds = 0
    seconds = emitted = proposed = accepted = 0.0
    same = True
    k_rounds: dict[str, int] = {}  # loop rounds at each K the config could choose (a goodput config: several)
    for b in batches:
        prep = b.prepared[name]
        t0 = time.perf_counter()
        out = prep.run(b.compiled[name])
        seconds += time.perf_counter() - t0
        s = out.stats
        tokens += sum(s["new_tokens"])
        r = sum(s["rounds"])
        rounds += r
        emitted += s["tokens_per_round"] * r
        proposed += s["proposed"]
        accepted += s["accepted"]
        same = same and out.tokens == b.plain_tokens
        for k, n in zip(prep.config.draft_lengths, s["k_rounds"]):
            k_rounds[str(k)] = k_rounds.get(str(k), 0) + n
    return record.run_entry(
        name, position, tokens, seconds, rounds, emitted / rounds if rounds else None,
        acceptance=accepted / proposed if proposed else None, same_as_plain=same, k_rounds=k_rounds,
    )  # fmt: skip


@dataclasses.dataclass
class Peer:
    """transformers on the target's GGUF file, loaded once, run in the passes of batch-1 cells."""

    path: str
    model: Any
    k: int
    threads: int | None

    @property
    def configs(self) -> dict[str, str]:
        return {"transformers plain": "plain", f"transformers prompt-lookup K={self.k}": "prompt_lookup"}

    def time(self, name: str, jobs, batches: Sequence[Batch], max_new: int, eos_ids, position: int):
        (run,) = peer_transformers.run_transformers(self.path, jobs, techniques=(self.configs[name],), gamma=self.k,
                                                    max_ngram=3, max_new_tokens=max_new, eos_ids=list(eos_ids),
                                                    threads=self.threads, model=self.model)  # fmt: skip
        if not run.available:
            raise RuntimeError(f"{name}: {run.reason}")
        s = run.summary
        if s["finished"] != s["submitted"]:
            raise RuntimeError(f"{name}: {s['submitted'] - s['finished']} requests failed: {s['error_messages']}")
        plain = [t for b in batches for t in b.plain_tokens]
        same = [r.tokens for r in run.records] == plain
        tpr = run.info.get("tokens_per_round")
        entry = record.run_entry(name, position, s["output_tokens"], s["wall_s"], None, tpr, same_as_plain=same)
        return entry, run.info


def run_cell(rec: record.Record, target, configs, workload: str, batch: int, settings: GridSettings, peer, log=print):
    """Measure one cell into ``rec``; returns the mismatches with plain decoding found."""
    from jspec.bench.suite_runs import free_compiled

    cell = f"{workload} b={batch}"
    jobs_by_batch, labels = cell_prompts(target, workload, batch, settings)
    log(f"{cell}: {labels['prompts']} prompts ({labels['distinct_prompts']} distinct), "
        f"{len(jobs_by_batch)} batch(es), {labels['max_new_tokens']} new tokens")  # fmt: skip
    batches = [Batch([j.prompt for j in jobs]) for jobs in jobs_by_batch]
    max_new = labels["max_new_tokens"]
    costs = prepare_cell(target, configs, batches, max_new, log)
    rec.cell(cell, **labels)
    for c in configs:
        rec.config(cell, c.name, kind="plain" if c.drafter is None else "jspec", verified_positions=c.nodes,
                   gamma=c.gamma, **costs[c.name])  # fmt: skip
    names = [c.name for c in configs]
    with_peer = peer is not None and batch == PEER_BATCH
    if with_peer:
        for name in peer.configs:
            rec.config(cell, name, kind="peer", library="transformers", technique=peer.configs[name])
        names += list(peer.configs)
    mismatches, peer_info = [], {}
    for i in range(settings.passes):
        runs = []
        with metrics.timed_region_gc(True) as gc_stats:
            for pos, name in enumerate(record.rotation(names, i)):
                if name in (peer.configs if with_peer else {}):
                    jobs = [j for jobs in jobs_by_batch for j in jobs]
                    entry, peer_info[name] = peer.time(name, jobs, batches, max_new, target.eos_ids, pos)
                else:
                    entry = time_config(name, batches, pos)
                runs.append(entry)
        for r in runs:
            if not r["same_as_plain"] and r["config"] in [c.name for c in configs]:
                mismatches.append({"cell": cell, "config": r["config"], "pass": i})
        rec.add_pass(cell, i, runs, gc=gc_stats)
        log(f"  pass {i + 1}/{settings.passes}: " + ", ".join(f"{r['config']} {r['tokens_per_s']:.1f}" for r in runs))
    for c in configs[1:]:
        rec.ratio(cell, c.name, ["plain"], f"{c.name} vs plain")
    if with_peer:
        problems = sorted({p for info in peer_info.values() for p in _peer_problems(info)})
        for name, info in peer_info.items():
            rec.config(cell, name, kind="peer", library="transformers", technique=peer.configs[name],
                       **{k: info.get(k) for k in ("transformers", "torch", "threads", "device", "weights_dtype")},
                       not_like_for_like=problems)  # fmt: skip
        if not problems:  # a ratio only against a peer that computes what jspec computes, where jspec does
            for c in configs[1:]:
                rec.ratio(cell, c.name, list(peer.configs), f"{c.name} vs best peer")
    free_compiled()
    return mismatches


def _peer_problems(info: dict[str, Any]) -> list[str]:
    import jax

    return peers.like_for_like_problems(
        info, dtype="float32", backend=jax.default_backend(), threads=metrics.jspec_threads()["threads"]
    )


def cell_lines(summary: dict[str, Any]) -> list[str]:
    """A cell's ratios, one line each: median (min-max) over the passes."""
    out = []
    for name, r in summary["ratios"].items():
        if r["median"] is not None:
            of = summary["configs"][r["of"]]["tokens_per_round"]["median"]
            tpr = f", {of:.2f} tokens/round" if of is not None else ""
            out.append(f"  {name}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}, {r['n']} passes){tpr}")
    return out


# --------------------------------------------------------------------------------------------------------
# The whole grid


def load_peer(target, settings: GridSettings, log=print) -> Peer | None:
    """The peer, when asked for and a batch-1 cell will run it; refuses (RuntimeError) when it cannot load."""
    if settings.peers == "none" or PEER_BATCH not in settings.batches:
        return None
    missing = peers._missing(["torch", "transformers"])
    if missing:
        raise RuntimeError(f"--peers transformers: not installed: {', '.join(missing)} (or pass --peers none)")
    if target.path is None or not str(target.path).endswith(".gguf"):
        raise RuntimeError(f"--peers transformers needs the target's GGUF file, got {target.path}")
    threads = metrics.jspec_threads()["threads"]
    if threads:
        import torch

        torch.set_num_threads(threads)
    log(f"loading transformers' model of {target.path} ...")
    k = next((d.k for d in settings.drafters if d.kind == "ngram"), DRAFTER_KINDS["ngram"])
    return Peer(target.path, peer_transformers.load_transformers(target.path), int(k), threads)


def run(settings: GridSettings, command: str, out: str | None = None, log=print) -> tuple[str, list[dict]]:
    """Every cell of the grid into one result file (written after each cell). Returns its path and the
    greedy mismatches with plain decoding (none expected)."""
    from jspec.bench.targets import load_target, tokenizer_info

    rec = record.Record("grid", command, settings.to_json(), out)
    log(f"loading {settings.model} (float32) ...")
    target = load_target(settings.model, "float32", "auto")
    rec.extra.update(model=target.info(), tokenizer=tokenizer_info(target.tokenizer), mismatches=[])
    configs = build_configs(target, settings.drafters)
    peer = load_peer(target, settings, log)
    mismatches: list[dict] = []
    for workload in settings.workloads:
        for batch in settings.batches:
            mismatches += run_cell(rec, target, configs, workload, batch, settings, peer, log)
            rec.extra["mismatches"] = mismatches
            rec.write()
            log("\n".join(cell_lines(record.summarize(rec.data)[f"{workload} b={batch}"])))
    rec.finish()
    return rec.write(), mismatches
