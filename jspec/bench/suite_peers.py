"""The peers' runs of a suite, and how each differs from jspec's run it is compared with.

``run_peers`` runs the named peer libraries (``PEER_NAMES``: ``peer_transformers``, ``peer_llama_cpp``);
``run_peer_set`` runs them on the same checkpoint file and jobs as jspec's runs, after them, with one thread count
for both, and records in each peer run's info what makes it not like for like with jspec's (precision, device,
threads: ``peers.like_for_like_problems``; greedy outputs other than jspec's plain run: ``ratios.outputs_differ``),
its quality, and how long after jspec's runs it ran. The headline and the peers table read those records before
giving a ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jspec.bench import checks, metrics, peer_llama_cpp, peer_transformers, peers, ratios
from jspec.bench.runspec import Load, RunResult, plain_spec
from jspec.bench.suite_runs import SuiteConfig, _scorer
from jspec.bench.targets import Target

PEER_NAMES = ("transformers", "llama_cpp", "llama-cpp-python")  # what ``run_peers`` knows


def run_peers(
    names: Sequence[str], gguf_path: str | None, jobs, *, assistant_layers: int | None = None, **kw
) -> list[peers.PeerRun]:
    """Run the named peer libraries ("transformers", "llama_cpp"); unknown names and a missing checkpoint
    path are recorded as skipped."""
    max_len = kw.pop("max_len", 2048)  # llama.cpp's context size; transformers sizes its cache itself
    out: list[peers.PeerRun] = []
    for name in names:
        if gguf_path is None or not str(gguf_path).endswith(".gguf"):
            out.append(
                peers.PeerRun(name, "plain", f"{name}", False, f"needs the GGUF checkpoint path, got {gguf_path}")
            )
            continue
        if name == "transformers":
            techniques = ["plain", "prompt_lookup"] + (["assisted"] if assistant_layers else [])
            out += peer_transformers.run_transformers(
                gguf_path, jobs, techniques=techniques, assistant_layers=assistant_layers, **kw
            )
        elif name in ("llama_cpp", "llama-cpp-python"):
            out += peer_llama_cpp.run_llama_cpp(gguf_path, jobs, max_len=max_len, **kw)
        else:
            out.append(peers.PeerRun(name, "plain", name, False, f"unknown peer {name!r} (transformers, llama_cpp)"))
    return out


def run_peer_set(
    target: Target,
    names: Sequence[str],
    jobs,
    cfg: SuiteConfig,
    gamma: int,
    plain: RunResult | None,
    assistant_layers: int | None = None,
    log=print,
    jspec_runs: Sequence[RunResult] = (),
) -> list[peers.PeerRun]:
    """The named peers on the same checkpoint file and jobs; each available run records how it differs from
    jspec's run (weights' and KV cache's precision, device, thread count: ``peers.like_for_like_problems``; at
    temperature 0 greedy outputs other than ``plain``'s: ``ratios.outputs_differ``) as
    ``info["not_like_for_like"]``, where ``headline`` and the report look before printing a ratio.

    Both peers get one thread count: ``cfg.peer_threads``, else jspec's (``metrics.jspec_threads``: XLA's pool),
    recorded in ``info["jspec"]``. ``jspec_runs``: jspec's runs, for ``info["after_jspec_s"]``: per jspec run the
    peer is compared with (its technique, closed loop at concurrency 1), the seconds from the end of its last pass
    to the start of the peer's timed run (``ratios.peer_gap_s``): the peers run after jspec's runs, not
    interleaved with them."""
    if not names:
        return []
    if target.dtype != "float32":  # no peer runs jspec's bfloat16: every ratio would compare precisions too
        why = (
            f"jspec runs {target.dtype} here, transformers float32 and llama.cpp the file's own weight types: "
            "no like-for-like ratio"
        )
        return [peers.PeerRun(n, "plain", n, False, why) for n in names]
    ours = metrics.jspec_threads()
    threads = cfg.peer_threads or ours["threads"]
    runs = run_peers(
        names,
        target.path,
        jobs,
        assistant_layers=assistant_layers,
        gamma=gamma,
        max_new_tokens=cfg.max_new_tokens,
        max_len=cfg.max_len,
        eos_ids=target.eos_ids,
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        min_p=cfg.sampling.min_p,
        decode_text=target.decode_text,
        scorer=_scorer,
        max_wall_s=cfg.max_wall_s,
        freeze_gc=cfg.freeze_gc,
        threads=threads,
    )
    backend = jax.default_backend()
    for p in runs:
        if not p.available:
            log(f"  {p.label:<28} skipped: {p.reason}")
            continue
        p.info["jspec"] = {"dtype": target.dtype, "backend": backend, "threads": ours["threads"],
                           "threads_how": ours["how"]}  # fmt: skip
        p.info["not_like_for_like"] = peers.like_for_like_problems(
            p.info, dtype=target.dtype, backend=backend, threads=ours["threads"]
        )
        as_run = RunResult(
            plain_spec(), Load.closed(1), cfg.sampling, cfg.max_new_tokens, p.records, p.summary, {}, {}, {}
        )
        p.quality = checks.quality_summary(as_run, plain)
        differ = None
        if plain is not None:
            differ = ratios.outputs_differ(p.quality, p.summary, plain.summary, cfg.sampling.temperature,
                                           ref="jspec's plain")  # fmt: skip
        if differ:  # not the same outputs: a ratio would compare other work
            p.info["not_like_for_like"].append(differ)
        mates = [r for r in jspec_runs if _peer_mate(r, p.technique)]
        gaps = {r.spec.label: ratios.peer_gap_s({"passes": r.extra.get("passes")}, p.info) for r in mates}
        p.info["after_jspec_s"] = {k: v for k, v in gaps.items() if v is not None}
        note = f"  (not like for like: {'; '.join(p.info['not_like_for_like'])})" if p.info["not_like_for_like"] else ""
        log(f"  {p.label:<28} {'closed c=1':<18} {p.summary['output_tokens_per_s']:7.1f} tok/s{note}")
    return runs


def _peer_mate(r: RunResult, technique: str) -> bool:
    """Whether jspec's run ``r`` is the one a peer of ``technique`` is compared with (closed loop, concurrency 1)."""
    return r.load.mode == "closed" and r.load.concurrency == 1 and (r.spec.peer or r.spec.kind) == technique
