"""What a run is checked against once served: task quality and plain decoding's outputs, and the cost model.

``quality_summary``: per workload, the task's quality measures (math accuracy, code validity and property
checks, grounded copy/edit exactness and similarity, completion rate), and with a reference (plain greedy on
the same jobs) the share of requests whose tokens equal it. ``cost_model_check``: the seed's cost model
(``jspec.cost_model``) and two variants fed with measured costs (``phase_costs``) and rates, next to the
measured decode speedup over plain at the same load; ``predict_k_rounds`` prices rounds as they were timed.
"""

from __future__ import annotations

from typing import Any

from jspec import cost_model
from jspec.bench import ratios
from jspec.bench.metrics import RequestRecord
from jspec.bench.runspec import RunResult


def quality_summary(result: RunResult, reference: RunResult | None = None) -> dict[str, Any]:
    """Task quality of a run; with ``reference`` (plain greedy on the same jobs) also the exact-match rate
    (``exact_match_vs_plain`` over the ``exact_match_n`` requests both finished, ``differ_from_plain_n`` of them
    with other tokens).

    math: answer accuracy; code: ``ast.parse`` validity, defines the function, property check; grounded:
    exact copy/edit rate, mean similarity to the expected text, grounding; all: completion rate (EOS)."""
    by_w: dict[str, list[RequestRecord]] = {}
    for r in result.records:
        if r.ok:
            by_w.setdefault(r.workload, []).append(r)
    out: dict[str, Any] = {}
    for w, recs in sorted(by_w.items()):
        q = [r.quality for r in recs]
        d: dict[str, Any] = {"n": len(recs), "completion_rate": sum(r.stop_reason == "eos" for r in recs) / len(recs)}
        if w == "math":
            d["accuracy"] = _mean([x.get("correct") for x in q])
        elif w == "code":
            d["parses"] = _mean([x.get("parses") for x in q])
            d["defines_function"] = _mean([x.get("defines_function") for x in q])
            d["property_check"] = _mean([x.get("correct") for x in q])
        elif w == "grounded":
            d["exact"] = _mean([x.get("correct") for x in q if "correct" in x])
            d["similarity"] = _mean([x.get("similarity") for x in q if "similarity" in x])
            d["grounding"] = _mean([x.get("grounding") for x in q])
        else:
            d["nonempty"] = _mean([x.get("nonempty") for x in q])
        out[w] = d
    if reference is not None and result.sampling.greedy and reference.sampling.greedy:
        ref = reference.tokens_by_id()
        mine = result.tokens_by_id()
        both = [i for i in mine if i in ref]
        same = sum(mine[i] == ref[i] for i in both)
        out["exact_match_vs_plain"] = same / len(both) if both else None
        out["exact_match_n"] = len(both)
        out["differ_from_plain_n"] = len(both) - same  # ``ratios.outputs_differ`` flags the ratios of such a run
    return out


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def predict_k_rounds(
    baseline_ms: float, draft_step_ms: float, verify_ms: float, rates, k: int, state_ms: float = 0.0
) -> cost_model.CostModelResult:
    """``cost_model.predict`` for rounds that draft K candidates and verify K + 1 positions, as the costs were
    timed: gamma = K, whatever positions the decode measured. ``rates`` (``conditional_rates_from_stats``)
    stop at the last position any round proposed; the positions past it were drafted and never accepted
    (rate 0), so they must not shorten the cycle (``predict`` would take gamma = len(rates) < K, pricing
    fewer draft steps than the rounds ran)."""
    rates = [float(x) for x in rates][:k]
    return cost_model.predict(
        baseline_ms_per_token=baseline_ms,
        draft_ms=draft_step_ms,
        verify_ms=verify_ms,
        state_ms=state_ms,
        gamma=k,
        accept_at=rates + [0.0] * (k - len(rates)),
    )


def cost_model_check(spec_run: RunResult, plain_run: RunResult, phases: dict, plain_phases: dict) -> dict[str, Any]:
    """The seed's cost model next to the measured decode speedup (same load, same jobs).

    baseline = the plain round (ms per token per row); measured costs from ``phase_costs.measure_phases``.
    - "seed": speedup = baseline * E[N] / (K d + verify + state), E[N] from the measured per-position
      acceptance (chains only; ``cost_model.predict``).
    - "measured_en": E[N] = the measured tokens per round, and a cycle that mixes wide rounds (draft + verify
      + state) with rounds where no row proposed (draft + plain step + state), weighted by their measured
      share.
    - "measured_rounds": the same E[N] and share, with the whole fused round timed (wide and narrow) instead
      of the sum of its pieces: what the loop really runs, branching and buffer copies included.
    ratio = predicted / measured (1: the model explains the measurement; > 1: overheads it leaves out).

    The two runs must have served the same requests, and some (``ratios.no_ratio``): otherwise nothing measured
    is compared (measured speedups None, ``different_requests`` says why); the predictions are still given. An
    open loop's end-to-end ratio is not recorded (its wall time follows the arrivals: ``output_speedup_note``)."""
    # The model describes the decode loop, so it is checked against the decode-phase rate (prefill and
    # queueing excluded); the end-to-end output rate ratio is recorded next to it.
    measured = spec_run.summary["decode_tokens_per_s"] / max(plain_run.summary["decode_tokens_per_s"], 1e-12)
    end_to_end = spec_run.summary["output_tokens_per_s"] / max(plain_run.summary["output_tokens_per_s"], 1e-12)
    ds = spec_run.decode_stats
    base = plain_phases["round_ms"]
    out: dict[str, Any] = {"baseline_ms": base}
    differ = ratios.no_ratio(spec_run.summary, plain_run.summary)
    if differ:
        measured = end_to_end = None
        out["different_requests"] = differ
    elif getattr(getattr(spec_run, "load", None), "mode", "closed") == "open":
        end_to_end = None
        out["output_speedup_note"] = ratios.open_loop_note()
    out.update(measured_speedup=measured, measured_output_speedup=end_to_end)
    d, v, s = phases.get("draft_ms") or 0.0, phases.get("verify_ms") or 0.0, phases.get("state_ms") or 0.0
    k = phases.get("gamma") or spec_run.spec.gamma
    if spec_run.spec.kind == "chain" and k:
        try:
            # The pieces were timed drafting K and verifying K + 1 positions, as every wide round does: the cycle
            # is K draft steps (d / K each), whatever positions were measured (``predict_k_rounds``).
            rates = cost_model.conditional_rates_from_stats(ds["accepted_at"], ds["proposed_at"])
            pred = predict_k_rounds(base, d / k, v, rates, k, s)
            out["seed"] = {
                "expected_tokens": pred.expected_tokens,
                "cycle_ms": pred.cycle_ms,
                "speedup": pred.speedup,
                "ratio_to_measured": pred.ratio_to(measured) if measured else None,
                "accept_at": list(pred.accept_at),
                # The seed formula assumes every round drafts K and verifies K + 1: with rounds that proposed
                # nothing (an n-gram miss) it predicts another configuration than the one measured.
                "all_rounds_wide": ds.get("wide_verify_fraction") is None or ds["wide_verify_fraction"] >= 1.0,
            }
        except ValueError as e:  # e.g. no position was ever proposed
            out["seed"] = {"error": str(e)}
    en = ds["tokens_per_round"]
    f = ds.get("wide_verify_fraction")
    # A tree round always verifies its N nodes (no 1-token fallback), so its cycle is always the wide one.
    f = 1.0 if f is None or spec_run.spec.kind == "tree" else f
    if en >= 1:
        # Pieces: the seed's cycle, with rounds where nothing was proposed costing a 1-token step instead.
        cycle = f * (d + v + s) + (1 - f) * (d + plain_phases["plain_step_ms"] + s)
        # Whole rounds: the fused round as the loop runs it, wide and narrow, so branching and copies count.
        narrow = phases.get("round_narrow_ms") or phases["round_ms"]
        cycle_round = f * phases["round_ms"] + (1 - f) * narrow
        for name, cyc in (("measured_en", cycle), ("measured_rounds", cycle_round)):
            if cyc > 0:
                sp = base * en / cyc
                out[name] = {
                    "expected_tokens": en,
                    "wide_fraction": f,
                    "cycle_ms": cyc,
                    "speedup": sp,
                    "ratio_to_measured": sp / measured if measured else None,
                }
    return out
