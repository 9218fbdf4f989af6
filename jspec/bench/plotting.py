"""The matplotlib plots of a benchmark's results, written as PNG files (Agg backend, no display).

``plot_latency`` (CDFs of TTFT, inter-token intervals and request latency per configuration and peer) and
``plot_acceptance_by_position`` take the JSON payload (``report``); ``plot_speedup_vs_k`` and
``plot_batch_sweep`` take a sweep's points. matplotlib is optional (``pip install -e '.[bench]'``):
``plotting_unavailable`` says why the plots cannot be drawn, and the suite scripts then skip them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plotting_unavailable() -> str | None:
    """None when the plots can be drawn, else why not: matplotlib is optional (``pip install -e '.[bench]'``)."""
    try:
        _plt()
    except ImportError as e:
        return f"matplotlib is not importable ({e}); pip install -e '.[bench]' for the plots"
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values, label):
    import numpy as np

    v = np.sort(np.asarray(values, float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def _served(q: dict) -> bool:
    """Finished normally: errors, timeouts and requests never run have no latency to plot."""
    return q["error"] is None and not q["timed_out"] and q["ttft_s"] is not None and q["latency_s"] is not None


def plot_latency(payload: dict[str, Any], path: str, load_name: str | None = None) -> str:
    """CDFs of TTFT, inter-token interval and total latency per configuration (and peer)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for r in payload.get("runs", []):
        if load_name is not None and r["load_name"] != load_name:
            continue
        reqs = [q for q in r.get("requests", []) if _served(q)]
        lab = r["spec"]["label"] + ("" if load_name else f" ({r['load_name']})")
        _cdf(axes[0], [q["ttft_s"] * 1e3 for q in reqs], lab)
        _cdf(axes[1], r.get("itl_ms_all", []), lab)
        _cdf(axes[2], [q["latency_s"] for q in reqs], lab)
    for p in payload.get("peers", []):
        if not p.get("available"):
            continue
        reqs = [q for q in p.get("requests", []) if _served(q)]
        _cdf(axes[0], [q["ttft_s"] * 1e3 for q in reqs], p["label"])
        _cdf(axes[1], p.get("itl_ms_all", []), p["label"])
        _cdf(axes[2], [q["latency_s"] for q in reqs], p["label"])
    axes[0].set_xlabel("time to first token (ms)")
    axes[1].set_xlabel("inter-token interval (ms; bursts give 0)")
    axes[1].set_xscale("symlog", linthresh=1.0)
    axes[2].set_xlabel("request latency (s)")
    for ax in axes:
        ax.set_ylabel("fraction of requests / intervals")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_acceptance_by_position(payload: dict[str, Any], path: str) -> str:
    """accepted / proposed candidates at each draft position (tree: depth), per speculative run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for r in payload.get("runs", []):
        acc = r["decode_stats"].get("acceptance_by_position") or []
        if r["spec"]["kind"] == "plain" or not acc:
            continue
        xs = [i + 1 for i, a in enumerate(acc) if a is not None]
        ax.plot(xs, [a for a in acc if a is not None], marker="o", label=f"{r['spec']['label']} ({r['load_name']})")
    ax.set_xlabel("draft position (tree: depth)")
    ax.set_ylabel("accepted / proposed")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_speedup_vs_k(points: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """points: {"series", "k", "speedup", "predicted"?, "tokens_per_round"?}: measured speedup over plain
    (same run) vs K, with the cost model's prediction dashed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    series: dict[str, list] = {}
    for p in points:
        series.setdefault(p["series"], []).append(p)
    for name, ps in series.items():
        # A point without a speedup (its runs served other requests than plain's) is not drawn.
        ps = sorted((p for p in ps if p.get("speedup") is not None), key=lambda p: p["k"])
        if not ps:
            continue
        (line,) = ax.plot([p["k"] for p in ps], [p["speedup"] for p in ps], marker="o", label=f"{name} measured")
        pred = [(p["k"], p["predicted"]) for p in ps if p.get("predicted") is not None]
        if pred:
            ax.plot(*zip(*pred), ls="--", color=line.get_color(), alpha=0.7, label=f"{name} cost model")
    ax.axhline(1.0, color="gray", lw=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("K (candidates per round)")
    ax.set_ylabel("speedup over plain (decode tok/s)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_batch_sweep(points: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """points: {"series", "batch", "tokens_per_s", "speedup"?}: throughput and speedup vs batch size."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    series: dict[str, list] = {}
    for p in points:
        series.setdefault(p["series"], []).append(p)
    for name, ps in series.items():
        ps = sorted(ps, key=lambda p: p["batch"])
        axes[0].plot([p["batch"] for p in ps], [p["tokens_per_s"] for p in ps], marker="o", label=name)
        sp = [(p["batch"], p["speedup"]) for p in ps if p.get("speedup") is not None]
        if sp:
            axes[1].plot(*zip(*sp), marker="o", label=name)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("speedup over plain at the same batch")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (closed-loop concurrency)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
