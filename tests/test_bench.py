"""The benchmark runner on a toy model (fast): recorded fields, counts, latency percentiles, reproducible arrivals,
errors and timeouts that do not stop a run; workloads, quality checks, phase costs, cost model, reports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_core import DRAFT_PARAMS, DRAFTER, TARGET, TARGET_PARAMS

from jspec.bench import checks, metrics, peers, plotting, ratios, report, runner, runspec, tables, workloads
from jspec.bench.runspec import Job, Load, Spec
from jspec.state import DecodeConfig
from jspec.validate import check_prompts, sampling_params

MAX_LEN = 64  # the shapes of test_serve.py: its compiled engine functions are reused
PLAIN = Spec("plain", peer="plain")
CHAIN = Spec("model K=3", DRAFTER, 3, DRAFT_PARAMS, peer="assisted")


def _jobs(n=8):
    # Token ids of the 3-token toy vocabulary; prompt lengths 1..4; one request too long for the cache.
    jobs = [Job(f"r{i}", ("a", "b")[i % 2], tuple([i % 3, 1, 2, 0][: 1 + i % 4])) for i in range(n)]
    jobs.insert(3, Job("too-long", "a", (1,) * 60))
    jobs.insert(5, Job("bad-tokenisation", "b", None, "ValueError: cannot encode"))
    return jobs


def _run(spec, load, jobs=None, **kw):
    kw.setdefault("max_new_tokens", 9)
    return runner.run(TARGET, TARGET_PARAMS, spec, load, jobs or _jobs(), max_len=MAX_LEN, **kw)


@pytest.fixture(scope="module")
def closed_runs():
    return {spec.label: _run(spec, Load.closed(2)) for spec in (PLAIN, CHAIN)}


def _check_dist(d):
    assert d["n"] > 0
    assert 0 <= d["median"] <= d["p95"] <= d["p99"] <= d["max"] + 1e-12
    assert d["mean"] <= d["max"] + 1e-12


@pytest.mark.parametrize("label", ["plain", "model K=3"])
def test_closed_loop_records_every_field(closed_runs, label):
    res = closed_runs[label]
    s, ds = res.summary, res.decode_stats
    for key in ("submitted", "finished", "errors", "timeouts", "not_run", "output_tokens", "wall_s",
                "output_tokens_per_s", "finished_requests_per_s", "ttft_ms", "itl_ms", "latency_ms",
                "queue_ms", "input_len", "output_len", "completion_rate", "stop_reasons"):  # fmt: skip
        assert key in s, key
    for key in ("rounds", "emitted", "proposed", "accepted", "rejected", "tokens_per_round", "acceptance_rate",
                "accepted_at", "proposed_at", "acceptance_by_position", "definition"):  # fmt: skip
        assert key in ds, key
    for key in ("ttft_ms", "itl_ms", "latency_ms"):
        _check_dist(s[key])
    # Counts add up: every submitted request is finished, an error or a timeout.
    assert s["submitted"] == 10 and s["errors"] == 2 and s["timeouts"] == 0
    assert s["finished"] + s["errors"] + s["timeouts"] + s["not_run"] == s["submitted"]
    assert sum(s["stop_reasons"].values()) == s["submitted"]
    ok = [r for r in res.records if r.ok]
    assert all(len(r.tokens) == 9 for r in ok)  # max_new_tokens, no EOS in the toy model
    # Each request: the prefill's first token + what its rounds emitted; bursts add up to the tokens.
    for r in ok:
        assert len(r.tokens) == 1 + r.stats["emitted"]
        assert sum(n for _, n in r.emissions) == len(r.tokens)
        assert r.stats["accepted"] <= r.stats["proposed"]
        assert r.ttft <= r.latency
        assert all(t1 <= t2 for (t1, _), (t2, _) in zip(r.emissions, r.emissions[1:]))
    # Throughput counts emitted tokens only, never rejected candidates.
    assert s["output_tokens"] == sum(len(r.tokens) for r in res.records)
    assert ds["emitted"] + len(ok) == s["output_tokens"]
    assert math.isclose(s["output_tokens_per_s"], s["output_tokens"] / s["wall_s"])
    assert ds["rounds"] == sum(r.stats["rounds"] for r in ok)
    assert math.isclose(ds["tokens_per_round"], ds["emitted"] / ds["rounds"])
    assert sum(ds["accepted_at"]) == ds["accepted"] and sum(ds["proposed_at"]) == ds["proposed"]
    assert ds["rejected"] == ds["proposed"] - ds["accepted"]
    # The ITL list has one entry per token after the first of every request: bursts give zero gaps.
    assert s["itl_ms"]["n"] == sum(len(r.tokens) - 1 for r in ok)
    json.dumps(res.to_json())  # everything serialises


def test_speculative_run_is_speculative_and_matches_plain(closed_runs):
    plain, spec = closed_runs["plain"], closed_runs["model K=3"]
    ds = spec.decode_stats
    assert ds["proposed"] > 0 and 0 < ds["acceptance_rate"] < 1 and ds["tokens_per_round"] > 1
    assert ds["rounds"] < plain.decode_stats["rounds"]
    assert plain.decode_stats["proposed"] == 0 and plain.decode_stats["tokens_per_round"] == 1.0
    q = checks.quality_summary(spec, plain)
    assert q["exact_match_vs_plain"] == 1.0 and q["exact_match_n"] == 8  # greedy: identical tokens
    zero_gaps = [x for r in spec.records if r.ok for x in r.itl() if x == 0.0]
    assert zero_gaps  # some round emitted a burst of several tokens


def test_failing_requests_are_recorded_and_the_run_continues(closed_runs):
    res = closed_runs["plain"]
    by_id = {r.id: r for r in res.records}
    assert by_id["too-long"].stop_reason == "error" and "must fit" in by_id["too-long"].error
    assert by_id["bad-tokenisation"].error == "ValueError: cannot encode"
    assert not by_id["too-long"].tokens and by_id["too-long"].ttft is None
    assert all(by_id[f"r{i}"].ok for i in range(8))  # the ones after the failures were served
    assert any("must fit" in m for m in res.summary["error_messages"])


def test_poisson_arrivals_reproducible_from_seed():
    a = runner.poisson_arrivals(5.0, 2000, seed=7)
    assert np.array_equal(a, runner.poisson_arrivals(5.0, 2000, seed=7))
    assert not np.array_equal(a, runner.poisson_arrivals(5.0, 2000, seed=8))
    assert np.all(np.diff(a) > 0)
    assert abs(2000 / a[-1] - 5.0) < 0.5  # rate
    gaps = np.diff(a)
    assert abs(np.std(gaps) / np.mean(gaps) - 1.0) < 0.1  # exponential gaps: CV 1


def test_open_loop_uses_the_seeded_arrivals_and_queues():
    jobs = _jobs(6)
    res = _run(CHAIN, Load.open(rate=400.0, rows=2, seed=3), jobs)
    expected = runner.poisson_arrivals(400.0, len(jobs), 3)
    assert [r.arrival for r in res.records] == pytest.approx(list(expected))
    s = res.summary
    assert s["finished"] == 6 and s["errors"] == 2
    _check_dist(s["queue_ms"])
    assert all(r.admitted >= r.arrival for r in res.records if r.admitted is not None)


def test_timeouts_are_recorded_without_stopping_the_run():
    jobs = [Job(f"t{i}", "a", (0, 1, 2)) for i in range(6)]
    res = _run(PLAIN, Load.closed(2, timeout_s=0.0), jobs, max_new_tokens=12)
    s = res.summary
    assert s["timeouts"] == 6 and s["finished"] == 0 and s["errors"] == 0
    assert all(r.timed_out and r.stop_reason == "timeout" for r in res.records)
    assert s["output_tokens_per_s"] >= 0 and s["submitted"] == 6


def test_running_request_past_its_deadline_is_cancelled():
    """A fake clock (+10 ms per reading) makes every request overrun a 50 ms deadline while decoding: each is
    recorded as a timeout with the tokens it got, and cancelled (Engine.cancel), so its row takes the next
    request at once. Before, the late rows decoded to their end (tokens discarded) and the requests queued
    behind them timed out in the queue, never run."""
    ticks = itertools.count()
    jobs = [Job(f"d{i}", "a", (0, 1, 2)) for i in range(5)]
    res = _run(PLAIN, Load.closed(2, timeout_s=0.05), jobs, max_new_tokens=12, warmup=False,
               clock=lambda: next(ticks) * 0.01)  # fmt: skip
    s = res.summary
    assert s["timeouts"] == 5 and s["finished"] == 0
    assert all(r.admitted is not None and r.tokens and r.timed_out for r in res.records)
    # Cut short: fewer than 12 tokens, and the counters of the rounds that gave them.
    assert all(len(r.tokens) == 1 + r.stats["emitted"] < 12 for r in res.records)


def test_wall_limit_marks_the_rest_not_run():
    jobs = [Job(f"w{i}", "a", (0, 1)) for i in range(5)]
    res = _run(PLAIN, Load.closed(2), jobs, max_wall_s=0.0, warmup=False)
    assert res.summary["not_run"] == 5 and res.summary["finished"] == 0  # the limit has passed at the start
    # A clock that ticks once per reading: the limit passes while the first two requests decode (9 tokens,
    # several readings per step), so they finish and the three their clients send later never start.
    ticks = iter(range(10**6))
    res = _run(PLAIN, Load.closed(2), jobs, max_wall_s=8.0, warmup=False, clock=lambda: float(next(ticks)))
    assert [r.stop_reason for r in res.records].count("not_run") == 3 and res.summary["finished"] == 2
    assert all(r.admitted <= 8.0 for r in res.records if r.admitted is not None)


def test_wall_limit_ends_an_open_loop_once_drained():
    """Open loop, arrivals at 0.68, 1.70, 1.72, 1.72 and 2.27 s (Poisson, rate 1/s, seed 0), a 0.1 s limit:
    the first arrival comes after the limit, so nothing starts, and the run ends at the limit instead of
    sleeping until an arrival only to mark it not run (which also diluted throughput)."""
    jobs = [Job(f"o{i}", "a", (0, 1)) for i in range(5)]
    res = _run(PLAIN, Load.open(1.0, rows=2, seed=0), jobs, max_wall_s=0.1, warmup=False)
    assert res.summary["not_run"] == 5 and res.summary["finished"] == 0
    assert 0.1 <= res.summary["wall_s"] < 0.5, res.summary["wall_s"]


def test_inter_token_intervals_are_bursts():
    em = [(1.0, 1), (1.5, 3), (1.75, 1), (2.0, 2)]
    assert metrics.inter_token_intervals(em) == [0.5, 0.0, 0.0, 0.25, 0.25, 0.0]
    d = metrics.dist_summary([0, 0, 1, 2, 10])
    assert d["median"] == 1 and d["p95"] <= d["max"] == 10
    assert metrics.dist_summary([])["median"] is None


def test_workloads_are_seeded_and_checkable():
    a = workloads.build(workloads.WORKLOADS, 5, seed=1)
    assert workloads.workload_fingerprint(a) == workloads.workload_fingerprint(
        workloads.build(workloads.WORKLOADS, 5, 1)
    )
    assert workloads.workload_fingerprint(a) != workloads.workload_fingerprint(
        workloads.build(workloads.WORKLOADS, 5, 2)
    )
    assert [r.workload for r in a[:4]] == list(workloads.WORKLOADS)
    for r in a:
        assert r.messages[-1]["role"] == "user" and r.messages[-1]["content"]
    math_r = next(r for r in a if r.kind == "math")
    ans = math_r.check["answer"]
    assert workloads.score(math_r, f"Step 1 ... so 3 + 4.\nThe answer is {ans:,}.")["correct"]
    assert not workloads.score(math_r, f"The answer is {ans + 1}")["correct"]
    grounded = [r for r in a if r.kind == "grounded"]
    edit = next(r for r in grounded if "expected" in r.check)
    sc = workloads.score(edit, edit.check["expected"])
    assert sc["correct"] and sc["similarity"] == 1.0
    assert workloads.length_summary([3, 1, 2])["median"] == 2


def test_code_check_parses_runs_and_sandboxes():
    tests = [[[3], 14], [[0], 0]]
    good = "```python\ndef sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))\n```"
    r = workloads.check_code(good, "sum_of_squares", tests)
    assert r["parses"] and r["correct"] and r["passed"] == 2
    wrong = workloads.check_code("def sum_of_squares(n):\n    return n", "sum_of_squares", tests)
    assert wrong["parses"] and not wrong["correct"]
    assert not workloads.check_code("def f(:\n", "f", tests)["parses"]
    evil = workloads.check_code("import os\ndef sum_of_squares(n):\n    return os.getpid()", "sum_of_squares", tests)
    assert not evil["correct"] and "refused" in evil["error"]
    loop = workloads.check_code("def sum_of_squares(n):\n    while True:\n        pass", "sum_of_squares", tests, 3.0)
    assert not loop["correct"] and loop["error"]
    # What small models write around a correct function: a print, a class, a main guard. These were scored
    # wrong (print and class missing from the sandbox's builtins, __name__ refused as a dunder name).
    script = (
        "class Acc:\n    def __init__(self):\n        self.t = 0\n"
        "def sum_of_squares(n):\n    a = Acc()\n    for i in range(1, n + 1):\n        a.t += i * i\n    return a.t\n"
        "print(sum_of_squares(3))\n"
        "if __name__ == '__main__':\n    print('main', sum_of_squares(2))\n"
    )
    r = workloads.check_code(script, "sum_of_squares", tests)
    assert r["correct"] and r["passed"] == 2, r
    sneaky = workloads.check_code("def sum_of_squares(n):\n    return __builtins__", "sum_of_squares", tests)
    assert "refused: name __builtins__" in sneaky["error"]


def test_cost_model_check_arithmetic():
    """cost_model_check on hand-made measurements, every number worked out by hand (chain, K = 3):
    drafted positions [100, 100, 100] with [80, 40, 20] in the accepted prefix: E[N] = 1 + .8 + .4 + .2 = 2.4;
    seed cycle 3 x (3 ms / 3) + 12 + 1 = 16 ms, speedup 10 x 2.4 / 16 = 1.5 (the plain round is 10 ms);
    pieces: 3/4 wide rounds 3 + 12 + 1 = 16 ms and 1/4 narrow 3 + 8 + 1 = 12 ms: 15 ms, 10 x 2.5 / 15 = 5/3;
    whole rounds: 3/4 x 17 + 1/4 x 13 = 16 ms, 10 x 2.5 / 16 = 1.5625. Measured 150 / 100 = 1.5 tok/s ratio."""
    from types import SimpleNamespace as NS

    stats = dict(tokens_per_round=2.5, wide_verify_fraction=0.75, accepted_at=[80, 40, 20], proposed_at=[100] * 3)
    spec_run = NS(
        summary={"decode_tokens_per_s": 150.0, "output_tokens_per_s": 140.0},
        decode_stats=stats,
        spec=NS(kind="chain", gamma=3),
    )
    plain_run = NS(summary={"decode_tokens_per_s": 100.0, "output_tokens_per_s": 112.0})
    phases = dict(draft_ms=3.0, verify_ms=12.0, state_ms=1.0, round_ms=17.0, round_narrow_ms=13.0, gamma=3)
    cm = checks.cost_model_check(spec_run, plain_run, phases, {"round_ms": 10.0, "plain_step_ms": 8.0})
    assert cm["measured_speedup"] == pytest.approx(1.5) and cm["measured_output_speedup"] == pytest.approx(1.25)
    assert cm["seed"]["accept_at"] == pytest.approx([0.8, 0.5, 0.5])
    assert cm["seed"]["expected_tokens"] == pytest.approx(2.4) and cm["seed"]["cycle_ms"] == pytest.approx(16.0)
    assert cm["seed"]["speedup"] == pytest.approx(1.5) and cm["seed"]["ratio_to_measured"] == pytest.approx(1.0)
    assert cm["seed"]["all_rounds_wide"] is False  # a quarter of the rounds proposed nothing
    assert cm["measured_en"]["cycle_ms"] == pytest.approx(15.0)
    assert cm["measured_en"]["speedup"] == pytest.approx(5 / 3)
    assert cm["measured_en"]["ratio_to_measured"] == pytest.approx(10 / 9)
    assert cm["measured_rounds"]["cycle_ms"] == pytest.approx(16.0)
    assert cm["measured_rounds"]["speedup"] == pytest.approx(1.5625)
    # A tree verifies its N nodes every round: the whole cycle is the wide one whatever the fraction says.
    tree = checks.cost_model_check(
        NS(summary=spec_run.summary, decode_stats=stats, spec=NS(kind="tree", gamma=3)),
        plain_run,
        phases,
        {"round_ms": 10.0, "plain_step_ms": 8.0},
    )
    assert "seed" not in tree and tree["measured_rounds"]["cycle_ms"] == pytest.approx(17.0)
    assert tree["measured_en"]["cycle_ms"] == pytest.approx(16.0)


def test_phase_costs_and_cost_model(closed_runs):
    from jspec.bench import phase_costs

    config = DecodeConfig(3, MAX_LEN)
    ph = phase_costs.measure_phases(TARGET, TARGET_PARAMS, DRAFTER, DRAFT_PARAMS, config, 2, 6, repeats=2)
    plain_ph = {"round_ms": ph["plain_step_ms"], "plain_step_ms": ph["plain_step_ms"]}  # saves compiling plain
    for key in ("draft_ms", "verify_ms", "state_ms", "round_ms", "plain_step_ms"):
        assert ph[key] > 0, key
    assert ph["verify_positions"] == 4 and "how" in ph
    cm = checks.cost_model_check(closed_runs["model K=3"], closed_runs["plain"], ph, plain_ph)
    assert cm["measured_speedup"] > 0
    assert cm["seed"]["speedup"] > 0 and cm["seed"]["ratio_to_measured"] > 0
    assert cm["measured_en"]["expected_tokens"] == closed_runs["model K=3"].decode_stats["tokens_per_round"]
    assert cm["measured_rounds"]["cycle_ms"] > 0 and cm["measured_rounds"]["ratio_to_measured"] > 0


def test_report_writes_json_markdown_and_plots(closed_runs, tmp_path):
    runs = list(closed_runs.values())
    runs[1].quality = checks.quality_summary(runs[1], runs[0])
    skipped = peers.PeerRun("llama-cpp-python", "plain", "llama-cpp-python plain", False, "not installed")
    pl = {"suite": "toy", "command": "pytest", "meta": {"environment": metrics.environment()},
          "runs": [r.to_json() for r in runs], "peers": [skipped.to_json()], "headline": ["toy: 1.00x"]}  # fmt: skip
    js = report.write_json(str(tmp_path / "toy.json"), pl)
    assert json.load(open(js))["runs"][0]["spec"]["label"] == "plain"
    png = plotting.plot_latency(pl, str(tmp_path / "lat.png"))
    acc = plotting.plot_acceptance_by_position(pl, str(tmp_path / "acc.png"))
    k = plotting.plot_speedup_vs_k([{"series": "m", "k": 1, "speedup": 1.1, "predicted": 1.2}], str(tmp_path / "k.png"))
    md = report.markdown(pl, [png, acc, k])
    assert "| plain |" in md and "model K=3" in md and "skipped: not installed" in md
    assert "## Headline\n\n- toy: 1.00x" in md
    assert all((tmp_path / p).stat().st_size > 0 for p in ("lat.png", "acc.png", "k.png"))


def test_passes_alternate_the_order_and_give_each_pass_ratio(closed_runs, monkeypatch):
    """--passes: A B, B A, A B; the first pass's results are reported, every pass's throughput is kept and the
    headline ratios are taken pass by pass (the canned speeds below give exact ratios)."""
    from jspec.bench import headlines, suite_runs

    speeds = iter([(10.0, 20.0), (30.0, 60.0), (40.0, 100.0), (8.0, 10.0), (12.0, 30.0), (24.0, 45.0)])
    order = []

    def fake_run_one(target, spec, load, jobs, cfg, log):
        order.append(spec.label)
        out, dec = next(speeds)
        base = closed_runs[spec.label]
        summary = {**base.summary, "output_tokens_per_s": out, "decode_tokens_per_s": dec}
        return dataclasses.replace(base, summary=summary, extra={})

    monkeypatch.setattr(suite_runs, "run_one", fake_run_one)
    monkeypatch.setattr(suite_runs, "free_compiled", lambda: None)
    cfg = suite_runs.SuiteConfig(measure_phases=False, passes=3)
    jobs = _jobs()
    res = suite_runs.run_specs(None, [PLAIN, CHAIN], [Load.closed(2)], jobs, cfg, log=lambda *a: None)
    assert order == ["plain", "model K=3", "model K=3", "plain", "plain", "model K=3"]
    plain, chain = res
    assert plain.summary["output_tokens_per_s"] == 10.0 and chain.summary["output_tokens_per_s"] == 30.0
    per = headlines.pass_ratios(chain, plain)
    assert per["output"] == pytest.approx([3.0, 5.0, 2.0]) and per["decode"] == pytest.approx([3.0, 10.0, 1.5])
    assert all(p["same_tokens_as_first_pass"] for p in chain.extra["passes"])
    line = headlines.headline(res)[0]
    assert "median 3.00x / 3.00x" in line and "passes: 3.00, 5.00, 2.00 end-to-end" in line
    with pytest.raises(ValueError, match="passes must be >= 1"):
        suite_runs.run_specs(
            None, [PLAIN], [Load.closed(2)], jobs, suite_runs.SuiteConfig(passes=0), log=lambda *a: None
        )


def test_suite_passes_go_into_the_result_file_with_their_positions(closed_runs, monkeypatch):
    """Every pass of ``run_specs`` becomes a pass of the run's result file (``serving_record``): each config's
    tokens over its run's wall time, at its position in that pass's order (A B, B A, ...), and the ratio to plain
    is the median of the per-pass ratios (canned rates: 3, 5, 2, 4, 1.5 -> median 3)."""
    from jspec.bench import record, serving_record, suite_runs

    rates = [(10.0, 30.0), (10.0, 50.0), (20.0, 40.0), (10.0, 40.0), (20.0, 30.0)]  # (plain, model) per pass
    calls = []

    def fake_run_one(target, spec, load, jobs, cfg, log):
        calls.append(spec.label)
        rate = rates[(len(calls) - 1) // 2][spec.label != "plain"]
        base = closed_runs[spec.label]
        summary = {**base.summary, "output_tokens_per_s": rate, "wall_s": base.summary["output_tokens"] / rate}
        return dataclasses.replace(base, summary=summary, extra={})

    monkeypatch.setattr(suite_runs, "run_one", fake_run_one)
    monkeypatch.setattr(suite_runs, "free_compiled", lambda: None)
    cfg = suite_runs.SuiteConfig(measure_phases=False, passes=5)
    res = suite_runs.run_specs(None, [PLAIN, CHAIN], [Load.closed(2)], _jobs(), cfg, log=lambda *a: None)
    rec = record.Record("suite", "python -m jspec bench --passes 5", {"smoke": []}, "unused.json")
    serving_record.add_runs(rec, res)
    rec.finish()
    rec.data["summary"] = record.summarize(rec.data)
    assert [p["order"] for p in rec.data["passes"]] == [["plain", "model K=3"], ["model K=3", "plain"]] * 2 + [
        ["plain", "model K=3"]
    ]
    ratio = rec.data["summary"]["closed c=2"]["ratios"]["model K=3 vs plain"]
    assert ratio["by_pass"] == pytest.approx([3.0, 5.0, 2.0, 4.0, 1.5]) and ratio["median"] == pytest.approx(3.0)
    problems = record.validate(rec.data)
    assert problems == [] or all("git" in p for p in problems), problems


def test_missing_peer_is_skipped_with_a_reason(monkeypatch):
    from jspec.bench import suite_peers

    monkeypatch.setattr(peers, "_missing", lambda mods: list(mods))
    out = suite_peers.run_peers(
        ["llama_cpp", "transformers", "vllm"], "/x/model.gguf", [], max_new_tokens=4, eos_ids=[2]
    )
    assert [p.available for p in out] == [False] * len(out)
    assert all(p.reason for p in out)
    assert any("unknown peer" in p.reason for p in out)
    assert suite_peers.run_peers(["transformers"], None, [], max_new_tokens=4, eos_ids=[2])[0].reason.startswith(
        "needs"
    )


def test_warmup_compiles_everything_the_timed_run_calls():
    """With warm-up, the timed part of a run compiles nothing: a compile there once cost a first step seconds.
    Warm-up must use the run's own EOS ids (static in the decode config) and step even when every warm
    request ends at its first token."""
    from jspec.serve import _engine_fns

    eos, max_new, load = (2,), 9, Load.closed(2)
    jobs = [j for j in _jobs() if j.prompt is not None and len(j.prompt) + max_new <= MAX_LEN]
    lens = [len(j.prompt) for j in jobs]
    runner._warm(TARGET, TARGET_PARAMS, CHAIN, load, MAX_LEN, eos, 64, lens, max_new, runspec.Sampling())
    config = runner._engine(TARGET, TARGET_PARAMS, CHAIN, load.concurrency, MAX_LEN, eos, 0, 64).config
    fns = _engine_fns(TARGET, DRAFTER, config, 1)
    before = [f._cache_size() for f in fns]
    assert before[1] > 0 and before[2] > 0  # insert and step were compiled for this config
    res = runner.run(TARGET, TARGET_PARAMS, CHAIN, load, jobs, max_len=MAX_LEN, max_new_tokens=max_new,
                     eos_ids=eos, warmup=False)  # fmt: skip
    assert all(r.error is None for r in res.records)
    assert [f._cache_size() for f in fns] == before


def test_warmup_compiles_the_clamped_last_bucket():
    """max_len = 64 with bucket 30: prompts of 61-64 tokens are padded to 64, not 90. A 62-token prompt's
    width must be compiled by the warm-up, not by the timed run (a stand-in of max_len - 4 = 60 tokens would
    compile width 60 instead)."""
    from jspec.serve import _engine_fns

    eos, max_new, load, bucket = (2,), 2, Load.closed(1), 30
    jobs = [Job("long", "a", (1,) * 62)]  # 62 tokens + 2 new = max_len
    runner._warm(TARGET, TARGET_PARAMS, PLAIN, load, MAX_LEN, eos, bucket, [62], max_new, runspec.Sampling())
    config = runner._engine(TARGET, TARGET_PARAMS, PLAIN, load.concurrency, MAX_LEN, eos, 0, bucket).config
    fns = _engine_fns(TARGET, None, config, 1)
    before = [f._cache_size() for f in fns]
    res = runner.run(TARGET, TARGET_PARAMS, PLAIN, load, jobs, max_len=MAX_LEN, max_new_tokens=max_new,
                     eos_ids=eos, warmup=False, bucket=bucket)  # fmt: skip
    assert [r.error for r in res.records] == [None]
    assert [f._cache_size() for f in fns] == before


def test_warmup_takes_every_prompt_the_engine_takes(monkeypatch):
    """A prompt of max_len - N + 1 tokens fits the engine (the last new token needs no slot), so the warm-up
    must compile its width too (it was left out, and its first insert compiled inside the timed run)."""
    seen = []
    real = runner._warm
    monkeypatch.setattr(runner, "_warm", lambda *a, **k: (seen.append(list(a[7])), real(*a, **k))[1])
    jobs = [Job("edge", "a", (1,) * 63)]  # 63 + 2 new tokens: 64 slots
    res = runner.run(TARGET, TARGET_PARAMS, PLAIN, Load.closed(1), jobs, max_new_tokens=2, max_len=MAX_LEN)
    assert [r.error for r in res.records] == [None] and seen == [[63]]


def test_warmup_fits_a_cache_its_dummies_would_overflow():
    """max_len 4 with 3 new tokens: a 1-token prompt fits, a 2-token warm-up dummy would not (the warm-up
    raised before the run started)."""
    jobs = [Job("short", "a", (1,))]
    res = runner.run(TARGET, TARGET_PARAMS, PLAIN, Load.closed(1), jobs, max_new_tokens=3, max_len=4)
    assert [r.error for r in res.records] == [None]


def test_spec_takes_adaptive_as_decode_does():
    """Spec(adaptive=True/False) as decode and Engine take it: True is the default AdaptiveK (describe() and
    the phase cost model read its fields), False is none (ngram_spec did label it "adaptive")."""
    from types import SimpleNamespace

    from jspec.adaptive import AdaptiveK

    on = Spec("chain", DRAFTER, 3, DRAFT_PARAMS, adaptive=True)
    assert on.adaptive == AdaptiveK() and on.describe()["adaptive"] == dataclasses.asdict(AdaptiveK())
    assert Spec("chain", DRAFTER, 3, DRAFT_PARAMS, adaptive=False).adaptive is None
    assert Spec("chain", DRAFTER, 3, DRAFT_PARAMS, adaptive=np.True_).adaptive == AdaptiveK()
    target = SimpleNamespace(model=TARGET)
    assert runspec.ngram_spec(target, adaptive=False).label == "ngram K=4"
    assert runspec.ngram_spec(target, adaptive=True).label == "ngram K=4 adaptive"


def test_chain_vs_tree_budgets():
    """bench_chain_vs_tree compares shapes at one verification budget N: every static tree has exactly N nodes
    (the root included), the node a budget cut keeps below a wide root hangs under the top-ranked child, and
    --widths / --no-dynamic choose the rows; a width that does not fit the budget is an error."""
    from jspec.tree import TreeRule

    bench = _examples_module("bench_chain_vs_tree")

    for budget, width, branching in [(5, 3, (3, 1)), (5, 4, (4,)), (8, 2, (2, 1, 1, 1))]:
        st = bench.static_tree(budget, width)
        assert (st.branching, st.num_nodes) == (branching, budget)
    with pytest.raises(ValueError, match="root width of 9 does not fit budget N=5"):
        bench.static_tree(5, 9)  # not narrowed to 4 behind the user's back (two --widths would give one row twice)
    parent, depth, rank = bench.static_tree(5, 3).arrays
    assert (list(parent), list(depth), list(rank)) == ([-1, 0, 0, 0, 1], [0, 1, 1, 1, 2], [0, 0, 1, 2, 0])
    labels = [s.label for s in bench.specs_for_budget(DRAFTER.model, DRAFT_PARAMS, 5, widths=(3,), dynamic=False)]
    assert labels == ["chain K=4 (N=5)", "static tree (3, 1) (N=5)"]
    assert len(bench.specs_for_budget(DRAFTER.model, DRAFT_PARAMS, 5)) == 4  # chain, (2, 1), (4,), dynamic
    rules = (TreeRule.DETERMINISTIC, TreeRule.WITHOUT_REPLACEMENT)
    specs = bench.specs_for_budget(DRAFTER.model, DRAFT_PARAMS, 5, widths=(4,), dynamic=False, rules=rules)
    assert [s.label for s in specs[1:]] == [
        "static tree (4,) (N=5) deterministic",
        "static tree (4,) (N=5) without-replacement",
    ]
    assert [s.drafter.rule for s in specs[1:]] == list(rules)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ngram", "--widths", "3"], "--widths does not apply to --ngram"),
        (["--ngram", "--rules", "iid"], "--rules does not apply to --ngram"),
        (["--layerskip", "exit:4", "--no-dynamic"], "--no-dynamic does not apply to --layerskip"),
        (["--layerskip", "exit:4", "--draft", "d"], "--draft does not apply to --layerskip"),
        (["--draft", "d", "--draft-layers", "2"], "are exclusive"),
        (["--ngram", "--layerskip", "exit:4"], "are exclusive"),
    ],
)
def test_chain_vs_tree_refuses_flags_its_drafter_ignores(flags, message, capsys):
    bench = _examples_module("bench_chain_vs_tree")
    with pytest.raises(SystemExit) as e:
        bench.main(flags)  # refused while parsing: no model is loaded
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_ngram_variants_parse_and_label():
    """bench_spec_vs_plain --ngram-variants: 'K' keeps the default 3..1 n-gram range, 'K,MAX,MIN' sets it, and
    the spec's label names a non-default range (specs in one run need distinct labels); malformed values are
    an error naming the flag."""
    from jspec.bench import targets

    bench = _examples_module("bench_spec_vs_plain")

    assert bench.ngram_variant("12") == (12, 3, 1)
    assert bench.ngram_variant("8,4,2") == (8, 4, 2)
    for bad in ("8,4", "x", "8,1,2", "0"):
        with pytest.raises(SystemExit, match="--ngram-variants"):
            bench.ngram_variant(bad)
    target = targets.Target("toy", None, None, TARGET, None, None, "float32")
    labels = [runspec.ngram_spec(target, *bench.ngram_variant(v)).label for v in ("8", "8,4,2")]
    assert labels == ["ngram K=8", "ngram K=8 n=4..2"]
    spec = runspec.ngram_spec(target, 8, 4, 2)
    assert (spec.gamma, spec.drafter.max_ngram, spec.drafter.min_ngram) == (8, 4, 2)


def test_timed_region_gc_freezes_the_heap_and_times_what_still_runs():
    """Inside: every object alive at entry is frozen (an oldest-generation collection then walks only what
    the run allocated), and collections are counted and timed; on exit the heap is unfrozen, so what a run
    dropped can still be collected. Without freeze nothing is frozen but collections are still timed."""
    import gc

    assert gc.get_freeze_count() == 0
    alive = len(gc.get_objects())
    with metrics.timed_region_gc() as st:
        assert gc.get_freeze_count() >= alive // 2 and st["frozen_objects"] >= alive // 2
        gc.collect()
        gc.collect()
    assert gc.get_freeze_count() == 0
    assert st["frozen"] and st["collections"] == 2 and 0 < st["pause_ms_max"] <= st["pause_ms_total"]
    with metrics.timed_region_gc(freeze=False) as st:
        assert gc.get_freeze_count() == 0
        gc.collect()
    assert not st["frozen"] and st["frozen_objects"] == 0 and st["collections"] == 1
    with pytest.raises(RuntimeError), metrics.timed_region_gc():
        raise RuntimeError("a failing run")
    assert gc.get_freeze_count() == 0  # unfrozen on the way out of a failure too
    gc.freeze()  # a caller's own freeze is left in place
    try:
        with metrics.timed_region_gc():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_runs_are_timed_with_the_heap_frozen_and_say_so(closed_runs):
    """The runner's clock is read only inside the timed part: the heap is frozen at every reading (and not
    after the run); the run records its GC stats, which the report's GC line sums."""
    import gc

    frozen_at_reads = []

    def clock():
        frozen_at_reads.append(gc.get_freeze_count())
        return time.perf_counter()

    res = _run(PLAIN, Load.closed(2), [Job(f"g{i}", "a", (0, 1)) for i in range(3)], warmup=False, clock=clock)
    assert len(frozen_at_reads) > 3 and min(frozen_at_reads) > 0 and gc.get_freeze_count() == 0
    assert res.engine["gc"]["frozen"] and res.engine["gc"]["frozen_objects"] > 0
    off = _run(PLAIN, Load.closed(2), [Job("g", "a", (0, 1))], warmup=False, freeze_gc=False)
    assert not off.engine["gc"]["frozen"]
    runs = [r.to_json(with_requests=False) for r in (res, off, *closed_runs.values())]
    runs[0]["engine"]["gc"] = dict(runs[0]["engine"]["gc"], collections=2, pause_ms_total=30.0, pause_ms_max=20.0)
    for r in runs[1:]:
        r["engine"]["gc"] = dict(r["engine"]["gc"], collections=1, pause_ms_total=5.0, pause_ms_max=5.0)
    note = report.gc_note(runs)
    assert "frozen in 3 of 4 runs" in note and "5 in all, 45.0 ms, the longest 20.0 ms" in note


def test_peers_are_timed_with_the_heap_frozen_too():
    import gc

    seen = []

    def generate_one(prompt, rec, t0):
        seen.append(gc.get_freeze_count())
        rec.emissions.append((time.perf_counter() - t0, 1))
        rec.tokens, rec.stop_reason, rec.finished = [1], "eos", time.perf_counter() - t0

    run = peers.PeerRun("fake", "plain", "fake plain", True)
    records, _ = peers._serve_sequentially([Job("p", "a", (0, 1)), Job("q", "a", (1,))], generate_one, None, run)
    assert len(seen) == 2 and min(seen) > 0 and gc.get_freeze_count() == 0
    assert run.info["gc"]["frozen"] and all(r.ok for r in records)
    peers._serve_sequentially([Job("p", "a", (0,))], generate_one, None, run, freeze_gc=False)
    assert seen[-1] == 0 and not run.info["gc"]["frozen"]


def test_peer_emissions_are_cut_with_their_tokens_at_eos():
    """transformers' streamer pushes tokens past EOS; they are cut from the record, and so must their bursts be
    (else zero gaps for dropped tokens pull the peer's inter-token intervals towards 0)."""
    from jspec.bench.metrics import RequestRecord
    from jspec.bench.peer_transformers import _trim_emissions

    rec = RequestRecord("r", "a", 0, 0.0)
    rec.emissions = [(0.1, 1), (0.2, 3), (0.3, 2)]
    _trim_emissions(rec, 3)
    assert rec.emissions == [(0.1, 1), (0.2, 2)]
    _trim_emissions(rec, 3)
    assert rec.emissions == [(0.1, 1), (0.2, 2)]


def test_spec_without_gamma_takes_the_drafters_own():
    """A Spec with no gamma runs the K decode would: 0 plain, 4 for a chain, a tree's depth (its old default 0
    is refused by the engine for any drafter now that a given gamma must be the K that runs)."""
    from jspec.ngram import NgramDrafter, NgramTreeDrafter

    assert Spec("plain").gamma == 0
    assert Spec("chain", NgramDrafter(vocab_size=5)).gamma == 4
    assert Spec("tree", NgramTreeDrafter(2, 3, vocab_size=5)).gamma == 3
    assert Spec("chain", DRAFTER, 3, DRAFT_PARAMS).gamma == 3
    jobs = [Job("a", "a", (1, 2, 0, 1, 2, 0))]
    res = runner.run(TARGET, TARGET_PARAMS, Spec("tree", NgramTreeDrafter(2, 3, vocab_size=TARGET.vocab_size)),
                     Load.closed(1), jobs, max_new_tokens=4, max_len=MAX_LEN)  # fmt: skip
    assert [r.error for r in res.records] == [None]


def _phase_drafters():
    """(name, target, target params, drafter, draft params, K): drafters whose round takes a path of its own."""
    import test_eagle
    import test_layerskip

    from jspec.tree import TreeSpec
    from models.layerskip import LayerSkipDrafter

    ls = LayerSkipDrafter(test_layerskip.TINY, 2, adapter=True, head_tokens=40, max_draft=3)
    ls_params = ls.draft_params(test_layerskip.TINY_PARAMS, test_layerskip.random_exit(test_layerskip.TINY, ls, 11))
    eagle, eagle_params, _ = test_eagle.tiny_drafter(k=3)
    tree = eagle.as_tree(TreeSpec((2, 1)))
    tp = test_eagle.TINY_PARAMS
    return [
        ("layerskip", test_layerskip.TINY_MODEL, test_layerskip.TINY_PARAMS, ls, ls_params, 3),
        ("eagle", test_eagle.TINY_MODEL, tp, eagle, eagle_params, 3),
        ("eagle tree", test_eagle.TINY_MODEL, tp, tree, eagle_params, tree.max_depth),
    ]


def test_phase_pieces_compose_to_the_round_for_every_drafter_path():
    """The phase timer's pieces (draft, verify, accept + commit) re-trace the round, so they must take its
    paths: LayerSkip drafts from the target's cache (the draft piece crashed: no target cache in its context),
    EAGLE verifies through its own call (the piece timed a plain target call the round never makes), and a
    greedy batch verifies on argmax ids (the pieces built [B, T, V] distributions). Composed, the pieces
    must commit exactly the sequence the real round commits; sampled, they must run."""
    from jspec.bench.phase_costs import _phase_fns, fresh

    rows = np.asarray([[1, 5, 9, 3, 7, 2], [2, 4, 6, 8, 10, 12]], np.int32)
    for name, target, tp, drafter, dp, k in _phase_drafters():
        config = DecodeConfig(k, 32)
        for greedy in (True, False):
            pre, _, draft, verify, update, round_ = _phase_fns(target, drafter, config, greedy)
            sampling = sampling_params(2, 0.0 if greedy else 1.0)
            key = jax.random.key(3)
            plen = jnp.full((2,), rows.shape[1], jnp.int32)
            st = pre(tp, dp, jnp.asarray(rows), plen, jnp.full((2,), 20, jnp.int32), sampling, key)
            prop = draft(dp, fresh(st), key)
            p, cache = verify(tp, dp, fresh(st.cache), st, prop)
            seq, _ = update(st, prop, p, cache, key)
            if greedy:
                assert p.shape[:2] == (2, prop.tokens.shape[1] + (0 if getattr(drafter, "is_tree", False) else 1))
                assert p.ndim == 2
                np.testing.assert_array_equal(np.asarray(seq), np.asarray(round_(tp, dp, fresh(st)).seq), name)
            else:
                assert p.ndim == 3 and np.allclose(np.asarray(p).sum(-1), 1.0, atol=1e-5), name


def test_run_settings_are_checked_before_any_request():
    """A bad run setting used to reach Engine.add with every request, which recorded each as that request's
    error and finished '0/N done' (max_new_tokens=0 read as a 0.00x speed-up); a negative timeout marked every
    request timed out, and --n 0 failed later on a NaN median."""
    bad = [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(max_new_tokens=4, max_len=0), "max_len must be an integer >= 1, got 0"),
        (dict(max_new_tokens=4, max_wall_s=-1), "max_wall_s must be >= 0 seconds"),
        (dict(max_new_tokens=4, sampling=runspec.Sampling(top_p=1.5)), r"top_p must be in \(0, 1\]"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            runner.run(TARGET, TARGET_PARAMS, PLAIN, Load.closed(1), _jobs(), **{"max_len": MAX_LEN, **kw})
    with pytest.raises(ValueError, match="timeout_s .* must be >= 0 seconds or None, got -1"):
        Load.closed(1, timeout_s=-1)
    with pytest.raises(ValueError, match="n_per_workload .* must be an integer >= 1, got 0"):
        workloads.build(["math"], 0)


def test_peer_ratios_compare_like_with_like():
    """Only like-for-like peer ratios: an n-gram variant (other n-gram lengths, or another K) is not divided by
    the peers' prompt lookup at --gamma, a bfloat16 jspec run is not compared with float32 peers, --min-p
    reaches the run (it was parsed by no flag and dropped), and every result records the matmul precision
    (JAX's GPU default runs f32 matmuls in TF32, which the suite now turns off for f32 runs on a GPU)."""
    import argparse
    from types import SimpleNamespace

    from jspec.bench import suite_peers, suite_runs
    from jspec.bench.args import add_common_args, config_from_args

    target = SimpleNamespace(model=SimpleNamespace(vocab_size=8), dtype="bfloat16", eos_ids=(2,), path="x.gguf")
    assert runspec.ngram_spec(target, 4).peer == "prompt_lookup"
    assert runspec.ngram_spec(target, 4, 8, 4).peer is None
    skipped = suite_peers.run_peer_set(target, ["transformers"], [], suite_runs.SuiteConfig(), 4, None)
    assert not skipped[0].available and "jspec runs bfloat16 here, transformers float32" in skipped[0].reason
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    cfg = config_from_args(ap.parse_args(["--min-p", "0.1", "--temperature", "1", "--compile-cache", "none"]))
    assert cfg.sampling.min_p == 0.1
    assert "matmul_precision" in metrics.environment()


def _examples_module(name):
    """An examples/ script imported as a module (its main() not run), anew on each call."""
    from example_scripts import load_example

    return load_example(name, fresh=True)


def _tiny_gguf(path):
    """A GGUF file of one Q4_1 tensor and two F32 ones, file type MOSTLY_Q4_1."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    w.add_tensor(
        "blk.0.ffn_up.weight", quantize(x, gguf.GGMLQuantizationType.Q4_1), raw_dtype=gguf.GGMLQuantizationType.Q4_1
    )
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


_LLAMA_INFO = {"weights_dtype": "Q4_1+F32+Q8_0", "kv_cache_dtype": "float16", "device": "cpu", "gamma": 3}
_TORCH_INFO = {"weights_dtype": "float32", "kv_cache_dtype": "float32", "device": "cpu", "gamma": 3}


def test_peer_runs_record_their_weights_cache_and_device(tmp_path, monkeypatch):
    """llama.cpp runs the GGUF's own types (the default model: 210 Q4_1 tensors, 61 F32, 1 Q8_0) and an f16 KV
    cache; transformers falls back to the CPU when torch sees no GPU. Each is recorded, and compared with
    jspec's dtype and JAX's backend, every difference is named."""
    from jspec.bench import peer_llama_cpp, peer_transformers

    w = peers.gguf_weights(_tiny_gguf(tmp_path / "t.gguf"))
    assert w == {"file_type": "MOSTLY_Q4_1", "tensor_types": {"Q4_1": 1, "F32": 2}, "dtype": "F32+Q4_1"}
    from types import SimpleNamespace

    ctx = SimpleNamespace(type_k=1, type_v=1)  # llama.cpp's default context: GGML_TYPE_F16 keys and values
    info = peer_llama_cpp.llama_cpp_info(str(tmp_path / "t.gguf"), SimpleNamespace(context_params=ctx), False)
    assert info["weights_dtype"] == "F32+Q4_1" and info["kv_cache_dtype"] == "float16" and info["device"] == "cpu"
    assert peer_llama_cpp.llama_cpp_info(str(tmp_path / "t.gguf"), SimpleNamespace(), True)["kv_cache_dtype"] is None
    assert peers.like_for_like_problems(_LLAMA_INFO, dtype="float32", backend="cpu") == [
        "native Q4_1+F32+Q8_0 weights",
        "float16 KV cache",
        "jspec runs float32",
    ]
    assert peers.like_for_like_problems(_TORCH_INFO, dtype="float32", backend="cpu") == []
    assert peers.like_for_like_problems({**_TORCH_INFO, "device": "cuda:0"}, dtype="float32", backend="gpu") == []
    assert peers.like_for_like_problems(_TORCH_INFO, dtype="float32", backend="gpu") == [
        "peer on cpu, jspec on gpu",
        "jspec runs float32",
    ]
    assert peers.like_for_like_problems({}, dtype="float32", backend="cpu")[:2] == [
        "weights' precision not recorded",
        "KV cache's precision not recorded",
    ]
    # transformers' device when JAX runs on a GPU that torch does not see: the CPU, which the check names.
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dev = peer_transformers._torch_device(None)
    assert dev == "cpu"
    assert "peer on cpu, jspec on gpu" in peers.like_for_like_problems({**_TORCH_INFO, "device": dev},
                                                                        dtype="float32", backend="gpu")  # fmt: skip


def test_default_model_file_is_recorded_as_its_quantised_types(smollm2_path):
    """SmolLM2-135M's 30 layers hold 7 Q4_1 matrices each (q, k, v, o, gate, up, down: 210) and 2 F32 norms
    (60, plus the final norm: 61); the tied embedding is the one Q8_0 tensor."""
    w = peers.gguf_weights(smollm2_path)
    assert w["file_type"] == "MOSTLY_Q4_1" and w["dtype"] == "Q4_1+F32+Q8_0"
    assert w["tensor_types"] == {"Q4_1": 30 * 7, "F32": 30 * 2 + 1, "Q8_0": 1}


def _fake_run(spec, out, dec, group=None):
    load = Load.closed(1)
    summary = {**metrics.summarize_requests([], 1.0), "output_tokens_per_s": out, "decode_tokens_per_s": dec}
    extra = {"group": group} if group else {}
    return runspec.RunResult(spec, load, runspec.Sampling(), 8, [], summary, {"tokens_per_round": 1.0}, {}, {},
                             extra=extra)  # fmt: skip


def _fake_peer(label, technique, out, dec, info, problems):
    summary = {**metrics.summarize_requests([], 1.0), "output_tokens_per_s": out, "decode_tokens_per_s": dec}
    info = dict(info, not_like_for_like=problems) if problems is not None else dict(info)
    return peers.PeerRun(label.split()[0], technique, label, True, None, summary=summary, info=info)


def test_peer_ratios_only_like_for_like_in_headline_and_table():
    """jspec ngram K=3 (f32 on the CPU: 60 tok/s end to end, 90 decode) against four prompt-lookup peers: a
    like-for-like one (30 / 30 tok/s: 2.00x end to end, 3.00x decode), llama.cpp on its Q4_1 weights and f16
    cache, transformers on another device, transformers at K=4. Only the first gets a ratio; the others say why
    not (the old headline and table divided by all four)."""
    spec = Spec("ngram K=3", DRAFTER, 3, DRAFT_PARAMS, peer="prompt_lookup")
    results = [_fake_run(PLAIN, 40.0, 45.0), _fake_run(spec, 60.0, 90.0)]
    llama = peers.like_for_like_problems(_LLAMA_INFO, dtype="float32", backend="cpu")
    on_gpu = peers.like_for_like_problems({**_TORCH_INFO, "device": "cuda"}, dtype="float32", backend="cpu")
    runs = [
        _fake_peer("transformers prompt-lookup K=3", "prompt_lookup", 30.0, 30.0, _TORCH_INFO, []),
        _fake_peer("llama-cpp-python prompt-lookup K=3", "prompt_lookup", 20.0, 20.0, _LLAMA_INFO, llama),
        _fake_peer("transformers(gpu) prompt-lookup K=3", "prompt_lookup", 15.0, 15.0, _TORCH_INFO, on_gpu),
        _fake_peer("transformers prompt-lookup K=4", "prompt_lookup", 10.0, 10.0, {**_TORCH_INFO, "gamma": 4}, []),
        _fake_peer("transformers(unchecked) prompt-lookup K=3", "prompt_lookup", 5.0, 5.0, _TORCH_INFO, None),
    ]
    from jspec.bench import headlines

    (line,) = headlines.headline(results, runs)
    assert "vs transformers prompt-lookup K=3: 2.00x end-to-end, 3.00x decode" in line
    assert (
        "vs llama-cpp-python prompt-lookup K=3: no ratio (native Q4_1+F32+Q8_0 weights; float16 KV cache; "
        "jspec runs float32: not like for like)" in line
    )
    assert "vs transformers(gpu) prompt-lookup K=3: no ratio (peer on gpu, jspec on cpu; jspec runs float32" in line
    assert "vs transformers prompt-lookup K=4: no ratio (jspec K=3, the peer's K=4: not like for like)" in line
    assert "transformers(unchecked) prompt-lookup K=3: no ratio (not checked against jspec's precision" in line
    assert line.count("x end-to-end") == 1
    adaptive = dataclasses.replace(spec, adaptive=True)
    assert "jspec adapts K (up to 3)" in ratios.ratio_blockers(_TORCH_INFO | {"not_like_for_like": []},
                                                               "prompt_lookup", adaptive.describe())  # fmt: skip
    table = tables.peers_table([r.to_json(False) for r in results], [p.to_json(False) for p in runs])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert "| 2.00x | 3.00x |" in rows["transformers prompt-lookup K=3"]
    assert (
        "no ratio: native Q4_1+F32+Q8_0 weights; float16 KV cache; jspec runs float32 (not like for like) | - |"
        in (rows["llama-cpp-python prompt-lookup K=3"])
    )
    assert "no ratio: jspec K=3, the peer's K=4 (not like for like)" in rows["transformers prompt-lookup K=4"]
    assert "x |" not in rows["transformers(gpu) prompt-lookup K=3"].split("| ngram K=3 |")[1]


def test_run_peer_set_records_what_is_not_like_for_like(monkeypatch):
    """Both peers are given one thread count, jspec's (2 here) unless the suite names another, and a peer that
    ran on another count (llama.cpp's prompts on 4 threads; transformers on 3 when told 3) is not like for like."""
    from types import SimpleNamespace

    from jspec.bench import suite_peers, suite_runs

    fake = [
        _fake_peer("llama-cpp-python plain", "plain", 20.0, 20.0, {**_LLAMA_INFO, "threads": 2, "threads_batch": 4},
                   None),
        _fake_peer("transformers plain", "plain", 20.0, 20.0, {**_TORCH_INFO, "threads": 2}, None),
    ]  # fmt: skip
    given = {}
    monkeypatch.setattr(suite_peers, "run_peers", lambda *a, **k: given.update(k) or fake)
    monkeypatch.setattr(metrics, "jspec_threads", lambda: {"threads": 2, "how": "two CPUs"})
    target = SimpleNamespace(dtype="float32", eos_ids=(2,), path="x.gguf", decode_text=None)
    logged = []
    out = suite_peers.run_peer_set(
        target, ["llama_cpp", "transformers"], [], suite_runs.SuiteConfig(), 4, None, log=logged.append
    )
    backend = jax.default_backend()
    assert given["threads"] == 2
    assert out[0].info["jspec"] == {"dtype": "float32", "backend": backend, "threads": 2, "threads_how": "two CPUs"}
    assert out[0].info["not_like_for_like"][:2] == ["native Q4_1+F32+Q8_0 weights", "float16 KV cache"]
    if backend == "cpu":
        assert out[0].info["not_like_for_like"][2] == "peer on 2 (4 for prompts) threads, jspec on 2"
    assert out[1].info["not_like_for_like"] == ([] if backend == "cpu" else [f"peer on cpu, jspec on {backend}",
                                                                             "jspec runs float32"])  # fmt: skip
    assert "not like for like: native Q4_1" in logged[0]
    fake[1].info.update(threads=3)  # what torch reports after set_num_threads(3)
    out = suite_peers.run_peer_set(
        target, ["transformers"], [], suite_runs.SuiteConfig(peer_threads=3), 4, None, log=print
    )
    assert given["threads"] == 3
    if backend == "cpu":
        assert out[1].info["not_like_for_like"] == ["peer on 3 threads, jspec on 2", "jspec runs float32"]


def test_decode_rate_counts_tokens_after_the_first_emission():
    """transformers' assisted / prompt-lookup generation can push several tokens in its first call (prefill and
    a verified draft together). Those tokens came before the decode clock starts: a peer record whose first
    burst is 3 tokens, then 1 and 2 (6 tokens, first emission at 1 s, last at 3 s) has 3 decode tokens in 2 s;
    a jspec-like record (1, 2, 2 tokens at 0.5, 1.5, 2.5 s) has 4 in 2 s. Decode rate (3 + 4) / 4 = 1.75 tok/s
    (counting len - 1: (5 + 4) / 4 = 2.25); TPOT 2/3 s and 1/2 s."""
    from jspec.bench.metrics import RequestRecord

    peer = RequestRecord("p", "a", 4, 0.0, admitted=0.0, emissions=[(1.0, 3), (2.0, 1), (3.0, 2)],
                         tokens=[5] * 6, finished=3.0)  # fmt: skip
    ours = RequestRecord("j", "a", 4, 0.0, admitted=0.0, emissions=[(0.5, 1), (1.5, 2), (2.5, 2)],
                         tokens=[5] * 5, finished=2.5)  # fmt: skip
    s = metrics.summarize_requests([peer, ours], 3.0)
    assert s["decode_tokens_per_s"] == pytest.approx(1.75)
    assert s["tpot_ms"]["max"] == pytest.approx(2000 / 3) and s["tpot_ms"]["median"] == pytest.approx(1750 / 3)
    assert peer.decode_tokens == 3 and ours.decode_tokens == 4
    one_burst = RequestRecord("b", "a", 4, 0.0, admitted=0.0, emissions=[(1.0, 4)], tokens=[5] * 4, finished=1.0)
    assert metrics.summarize_requests([one_burst], 1.0)["decode_tokens_per_s"] == 0.0  # no decode phase at all


def test_scripts_count_tokens_per_round_as_decode_does():
    """tokens per round = tokens the rounds emitted / rounds: each request's first token comes from the prefill,
    no round. Two requests of 9 and 5 new tokens in 4 and 2 rounds: (8 + 4) / 6 = 2.0 (bench_eagle and
    bench_selfspec divided all 14 tokens: 2.33). And it is what jspec.decode reports for a real decode."""
    from jspec import decode as dec

    assert metrics.tokens_per_round([9, 5], [4, 2]) == pytest.approx(2.0)
    assert metrics.tokens_per_round([1], [0]) == 0.0
    eagle = _examples_module("bench_eagle")
    assert eagle.tokens_per_round([{"tokens": 9, "rounds": 4}, {"tokens": 5, "rounds": 2}]) == pytest.approx(2.0)
    selfspec = _examples_module("bench_selfspec")
    total: dict = {}
    selfspec.add_run(total, {"new_tokens": [9], "rounds": [4], "loop_rounds": 4, "seconds": 1.0})
    selfspec.add_run(total, {"new_tokens": [5], "rounds": [2], "loop_rounds": 2, "seconds": 0.5})
    assert total == {"tokens": 14, "seconds": 1.5, "loop_rounds": 6, "emitted": 12, "rounds": 6}
    assert selfspec.tokens_per_round(total) == pytest.approx(2.0)
    out = dec.prepare(TARGET, TARGET_PARAMS, [[1, 2, 0], [2, 1]], drafter=DRAFTER, draft_params=DRAFT_PARAMS,
                      gamma=3, max_new_tokens=9, max_len=MAX_LEN).run()  # fmt: skip
    s = out.stats
    assert metrics.tokens_per_round(s["new_tokens"], s["rounds"]) == pytest.approx(s["tokens_per_round"])


def test_percent_problems_have_whole_exact_answers():
    """75% of an odd multiple of 10 is not whole: seed 3's 18th math problem was '$70 with a 25% discount',
    stored as 52 (floored) while the true answer is 52.5. Every percent problem's stored answer is now the
    exact one, computed here with Fractions from the problem's own text."""
    import re
    from fractions import Fraction

    seen, quarter = 0, 0
    for seed in range(5):
        for r in workloads.math_requests(60, seed):
            m = re.search(r"costs \$(\d+)\. .* gets a (\d+)% discount", r.messages[-1]["content"])
            if m:
                seen += 1
                quarter += m[2] == "25"
                assert Fraction(int(m[1]) * (100 - int(m[2])), 100) == r.check["answer"], r
    assert seen == 30 and quarter >= 3  # the 25% discounts, where a price could make the answer fractional


def test_bench_sync_pads_engine_prompts_as_the_fused_loop_does():
    """The engine padded each prompt to a multiple of 64 (its default bucket), the fused prepare to a multiple
    of 16: a 17-token prompt prefilled 64 positions against 32. Both now pad to the same width."""

    sync = _examples_module("bench_sync")
    eng = sync.make_engine(TARGET, TARGET_PARAMS, None, 0, (), MAX_LEN, 2)
    assert eng.rounds_per_sync == 2
    inserted, insert = [], eng._insert

    def spy(*args):  # the padded prompt the engine really prefills
        inserted.append(args[4].shape[1])
        return insert(*args)

    eng._insert = spy
    for n in (1, 15, 16, 17, 40, 63):
        fused_width = check_prompts(TARGET, [[1] * n], 1, MAX_LEN)[0].shape[1]
        eng.add(0, [1] * n, 1)  # one token: the request ends at once and frees its row
        assert inserted[-1] == fused_width, n


def test_sweep_groups_pair_each_run_with_its_own_plain(closed_runs, monkeypatch):
    """bench_sweeps' K sweep and batch sweep both run at closed c=1 (other jobs, other moments): each
    n-gram run is divided by the plain run of its own sweep. Canned speeds: K sweep plain 10 / chain 30 tok/s
    (3.00x), batch sweep plain 20 / chain 30 (1.50x); the old pairing divided both by the K sweep's plain."""
    from jspec.bench import headlines, suite_runs

    speeds = iter([10.0, 30.0, 20.0, 30.0])

    def fake_run_one(target, spec, load, jobs, cfg, log):
        v = next(speeds)
        base = closed_runs[spec.label]
        summary = {**base.summary, "output_tokens_per_s": v, "decode_tokens_per_s": v}
        return dataclasses.replace(base, load=load, summary=summary, extra={})

    monkeypatch.setattr(suite_runs, "run_one", fake_run_one)
    monkeypatch.setattr(suite_runs, "free_compiled", lambda: None)
    cfg = suite_runs.SuiteConfig(measure_phases=False)
    quiet = dict(log=lambda *a: None)
    res = suite_runs.run_specs(None, [PLAIN, CHAIN], [Load.closed(1)], _jobs(), cfg, group="K sweep", **quiet)
    res += suite_runs.run_specs(None, [PLAIN, CHAIN], [Load.closed(1)], _jobs(), cfg, group="batch sweep b=1", **quiet)
    lines = headlines.headline(res)
    assert lines[0].startswith("model K=3 @ closed c=1, K sweep: 3.00x plain end-to-end")
    assert lines[1].startswith("model K=3 @ closed c=1, batch sweep b=1: 1.50x plain end-to-end")
    md = report.markdown({"runs": [r.to_json(False) for r in res], "meta": {}})
    k_part, b_part = md.split("## K sweep: closed c=1")[1].split("## batch sweep b=1: closed c=1")
    assert "| model K=3 | 30.0 | 3.00x |" in k_part
    assert "| model K=3 | 30.0 | 1.50x |" in b_part.split("Throughput counts")[0]
    assert "model K=3 (batch sweep b=1, closed c=1)" in md  # the quality and memory tables tell the groups apart


def test_cost_model_script_refuses_what_it_cannot_use(capsys):
    cm = _examples_module("cost_model")
    for argv, message in (
        (["--measured-speedup", "1.5"], "--measured-speedup needs --alpha or --accept-at"),
        (
            ["--accept-at", "0.9,0.8", "--gamma", "3"],
            "--gamma 3 needs acceptance rates for 3 positions, --accept-at gives 2",
        ),
        (["--alpha", "1.5"], "alpha must be a probability in [0, 1], got 1.5"),
    ):
        with pytest.raises(SystemExit) as e:
            cm.main(argv)
        assert e.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    cm.main(["--accept-at", "0.9,0.8", "--gamma", "1", "--measured-speedup", "1.5"])  # a shorter K is fine
    assert "predicted / measured" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------
# Ratios only over the same work, peers against jspec's median pass, open loops, the scripts' measurements


def _outcome_summary(outcomes, out, dec):
    """A summary of requests r0, r1, ... ending as ``outcomes`` ("finished" / "not_run" / "timeout"), at
    canned rates (output, decode tok/s)."""
    from jspec.bench.metrics import RequestRecord

    recs = []
    for i, o in enumerate(outcomes):
        r = RequestRecord(f"r{i}", "a", 2, 0.0, admitted=0.0, emissions=[(0.5, 1)], tokens=[1])
        if o == "finished":
            r.finished, r.stop_reason = 1.0, "eos"
        elif o == "timeout":
            r.timed_out, r.stop_reason = True, "timeout"
        else:
            r.emissions, r.tokens, r.admitted, r.stop_reason = [], [], None, "not_run"
        recs.append(r)
    return {**metrics.summarize_requests(recs, 1.0), "output_tokens_per_s": out, "decode_tokens_per_s": dec}


def _fake_result(spec, summary, load=None, passes=None):
    stats = {"tokens_per_round": 1.0, "acceptance_rate": 0.5}
    extra = {"passes": passes} if passes is not None else {}
    stats.update(accepted_at=[1, 1, 1], proposed_at=[2, 2, 2])
    return runspec.RunResult(spec, load or Load.closed(1), runspec.Sampling(), 8, [], summary, stats, {}, {},
                             extra=extra)  # fmt: skip


def test_no_ratio_between_runs_that_served_different_requests():
    """--max-wall-s / --timeout-s can cut two runs of the same jobs differently: plain finished r0 and r1, the
    speculative run r0 only (r1 not run). Their rates are over different work, so no speedup is printed (the old
    headline said 2.00x), in the headline, the results table, the cost-model check, a pass's ratio, the sweeps'
    points and against a peer."""
    from jspec.bench import headlines

    full, cut = ["finished", "finished"], ["finished", "not_run"]
    assert _outcome_summary(full, 1, 1)["request_set"] != _outcome_summary(cut, 1, 1)["request_set"]
    assert _outcome_summary(full, 1, 1)["request_set"] == _outcome_summary(full, 5, 5)["request_set"]
    # Same counts, other requests: still different work.
    a, b = _outcome_summary(["finished", "not_run"], 1, 1), _outcome_summary(["not_run", "finished"], 1, 1)
    assert "the same counts but other requests" in ratios.requests_differ(a, b)
    assert ratios.requests_differ({"finished": 2}, {"finished": 2}) is None  # older results: counts only
    plain = _fake_result(PLAIN, _outcome_summary(full, 10.0, 10.0))
    spec = _fake_result(CHAIN, _outcome_summary(cut, 20.0, 20.0))
    (line,) = headlines.headline([plain, spec])
    assert "no ratio to plain in pass 1 (different requests served (this run 1/2 finished, 1 not run, plain 2/2" in line
    assert "x plain" not in line and "2.00x" not in line
    table = tables.results_table([plain.to_json(False), spec.to_json(False)], "closed c=1")
    row = next(r for r in table.splitlines() if r.startswith("| model K=3 |"))
    assert row.count("no ratio: different requests") == 2 and "2.00x" not in row
    cm = checks.cost_model_check(spec, plain, {"draft_ms": 3.0, "verify_ms": 12.0, "state_ms": 1.0, "round_ms": 17.0},
                                 {"round_ms": 10.0, "plain_step_ms": 8.0})  # fmt: skip
    assert cm["measured_speedup"] is None and cm["measured_output_speedup"] is None
    assert "different requests" in cm["different_requests"] and cm["measured_rounds"]["ratio_to_measured"] is None
    sweeps = _examples_module("bench_sweeps")
    point = sweeps._point("ngram", spec, plain, "k", 3)
    assert point["speedup"] is None and "different requests" in point["different_requests"]
    assert "no ratio: different requests" in sweeps._sweep_tables([point], [])
    # Passes: the second pass's runs served different requests: no ratio for it, the median over the others.
    same = {"request_set": "x", "finished": 2, "submitted": 2}
    cut_pass = {"request_set": "y", "finished": 1, "submitted": 2, "not_run": 1}
    pp = [dict(same, output_tokens_per_s=10.0, decode_tokens_per_s=10.0)] * 3
    sp = [dict(same, output_tokens_per_s=30.0, decode_tokens_per_s=30.0),
          dict(cut_pass, output_tokens_per_s=90.0, decode_tokens_per_s=90.0),
          dict(same, output_tokens_per_s=20.0, decode_tokens_per_s=20.0)]  # fmt: skip
    p3 = _fake_result(PLAIN, _outcome_summary(full, 10.0, 10.0), passes=pp)
    s3 = _fake_result(CHAIN, _outcome_summary(full, 30.0, 30.0), passes=sp)
    assert headlines.pass_ratios(s3, p3)["output"] == [3.0, None, 2.0]
    (line,) = headlines.headline([p3, s3])
    assert "passes: 3.00, -, 2.00 end-to-end" in line and "median 2.50x / 2.50x" in line
    assert "'-': that pass's runs served different requests" in line
    # A peer that served both requests against jspec's run that served one.
    peer = _fake_peer("transformers assisted K=3", "assisted", 5.0, 5.0, _TORCH_INFO, [])
    peer.summary.update(_outcome_summary(full, 5.0, 5.0))
    (line,) = headlines.headline([plain, spec], [peer])
    assert "vs transformers assisted K=3: no ratio (different requests served (jspec 1/2" in line
    table = tables.peers_table([plain.to_json(False), spec.to_json(False)], [peer.to_json(False)])
    assert "no ratio: different requests served" in table and "4.00x" not in table


def test_peer_ratio_takes_the_median_of_jspecs_passes():
    """A peer runs once; jspec with --passes 3 ran at 30 (pass 1), 90 and 60 tok/s. The ratio to the peer's 30
    tok/s is the median pass, 60 / 30 = 2.00x, labelled as such (the old ratio took pass 1: 1.00x)."""
    from jspec.bench import headlines

    spec = Spec("ngram K=3", DRAFTER, 3, DRAFT_PARAMS, peer="prompt_lookup")
    full = ["finished", "finished"]
    base = _outcome_summary(full, 30.0, 30.0)
    passes = [{k: base[k] for k in ("request_set", "submitted", "finished", "errors", "timeouts", "not_run")}
              | {"output_tokens_per_s": v, "decode_tokens_per_s": v} for v in (30.0, 90.0, 60.0)]  # fmt: skip
    plain = _fake_result(PLAIN, _outcome_summary(full, 10.0, 10.0), passes=[dict(passes[0])] * 3)
    ng = _fake_result(spec, base, passes=passes)
    peer = _fake_peer("transformers prompt-lookup K=3", "prompt_lookup", 30.0, 30.0, _TORCH_INFO, [])
    peer.summary.update(_outcome_summary(full, 30.0, 30.0))
    (line,) = headlines.headline([plain, ng], [peer])
    assert ("vs transformers prompt-lookup K=3: 2.00x end-to-end, 2.00x decode (jspec: median of 3 passes; the "
            "peer: its one run)") in line  # fmt: skip
    table = tables.peers_table([plain.to_json(False), ng.to_json(False)], [peer.to_json(False)])
    row = table.splitlines()[2]
    assert "| 60.0 (median of 3 passes) | 2.00x | 2.00x |" in row
    assert "jspec out tok/s (median of its passes)" in table.splitlines()[0]


def test_open_loop_prints_no_end_to_end_ratio():
    """An open loop's wall time is the arrivals' span whatever the decoding speed: its end-to-end ratio (here
    1.00x) says nothing about speculation, so only the decode ratio is printed, in the headline, the table and
    the cost-model check."""
    from jspec.bench import headlines

    load = Load.open(2.0, rows=2)
    full = ["finished", "finished"]
    plain = _fake_result(PLAIN, _outcome_summary(full, 10.0, 20.0), load)
    spec = _fake_result(CHAIN, _outcome_summary(full, 10.0, 50.0), load)
    (line,) = headlines.headline([plain, spec])
    assert line.startswith("model K=3 @ open 2/s rows=2: 2.50x plain decode (end-to-end: arrival-bound")
    assert "end-to-end," not in line and "1.00x" not in line
    table = tables.results_table([plain.to_json(False), spec.to_json(False)], load.name)
    row = next(r for r in table.splitlines() if r.startswith("| model K=3 |"))
    assert "| - (arrival-bound) |" in row and "| 2.50x |" in row
    cm = checks.cost_model_check(spec, plain, {"draft_ms": 3.0, "verify_ms": 12.0, "state_ms": 1.0, "round_ms": 17.0},
                                 {"round_ms": 10.0, "plain_step_ms": 8.0})  # fmt: skip
    assert cm["measured_output_speedup"] is None and cm["measured_speedup"] == pytest.approx(2.5)
    assert "arrival-bound" in cm["output_speedup_note"]


def test_cost_model_prices_the_k_the_rounds_drafted():
    """K = 4 rounds whose last two positions were never proposed (an n-gram lookup that never found more than 2):
    the rates stop at 2 positions, but the pieces were timed drafting 4 and verifying 5. E[N] = 1 + .8 + .4 = 2.2
    with rates [.8, .5, 0, 0]; cycle 4 x (4 ms / 4) + 12 + 1 = 17 ms (the old call took gamma = 2: 15 ms)."""
    from types import SimpleNamespace as NS

    stats = dict(
        tokens_per_round=2.2, wide_verify_fraction=1.0, accepted_at=[80, 40, 0, 0], proposed_at=[100, 100, 0, 0]
    )
    spec_run = NS(summary={"decode_tokens_per_s": 150.0, "output_tokens_per_s": 140.0}, decode_stats=stats,
                  spec=NS(kind="chain", gamma=4))  # fmt: skip
    plain_run = NS(summary={"decode_tokens_per_s": 100.0, "output_tokens_per_s": 112.0})
    phases = dict(draft_ms=4.0, verify_ms=12.0, state_ms=1.0, round_ms=17.0, gamma=4)
    cm = checks.cost_model_check(spec_run, plain_run, phases, {"round_ms": 10.0, "plain_step_ms": 8.0})
    assert cm["seed"]["cycle_ms"] == pytest.approx(17.0) and cm["seed"]["expected_tokens"] == pytest.approx(2.2)
    assert cm["seed"]["accept_at"] == pytest.approx([0.8, 0.5, 0.0, 0.0])
    assert cm["seed"]["speedup"] == pytest.approx(10 * 2.2 / 17)
    pred = checks.predict_k_rounds(10.0, 1.0, 12.0, [0.8, 0.5], 4, 1.0)
    assert pred.gamma == 4 and pred.cycle_ms == pytest.approx(17.0)
    assert checks.predict_k_rounds(10.0, 1.0, 12.0, [0.8, 0.5, 0.5], 2).accept_at == (0.8, 0.5)


def test_run_memory_says_the_device_peak_is_the_processs(closed_runs):
    """JAX cannot reset the device's peak bytes in use: the number is the process's peak so far, not a run's."""
    mem = closed_runs["plain"].memory
    assert "process_device_peak_bytes" in mem and "device_peak_bytes" not in mem
    assert "since the process started" in mem["how"]


def test_chain_vs_tree_ngram_labels_say_when_a_tree_verifies_less_than_the_budget():
    """--ngram trees are b continuations x depth: at budget 8, 2x3 and 3x2 trees verify 7 nodes, not 8."""
    from types import SimpleNamespace

    bench = _examples_module("bench_chain_vs_tree")
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=TARGET.vocab_size))
    labels = [s.label for s in bench.ngram_specs_for_budget(target, 8)]
    assert labels == ["ngram chain K=7 (N=8)", "ngram tree 2x3 (N=7 of budget 8)", "ngram tree 3x2 (N=7 of budget 8)"]
    labels = [s.label for s in bench.ngram_specs_for_budget(target, 5)]
    assert labels[1:] == ["ngram tree 2x2 (N=5)", "ngram tree 3x1 (N=4 of budget 5)"]
    assert "not at an equal verification budget" in bench._budget_note(True)
    assert "EQUAL" not in bench.__doc__


def test_bench_eagle_checks_greedy_output_and_rates_decode_alone():
    """bench_eagle compares every greedy speculative run's tokens with plain's (the check bench_gpu.sh relies
    on) and rates the decode without its prefill: at T = 1 the two sides emit different lengths, over which an
    end-to-end rate spreads one prefill differently."""
    eagle = _examples_module("bench_eagle")
    assert eagle.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert eagle.first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert eagle.first_difference([1, 2], [1, 2, 3]) == 2
    # 33 tokens in 1.1 s of which the prefill took 0.3 s: 32 decode tokens in 0.8 s.
    assert eagle.decode_rate(33, 1.1, 0.3) == pytest.approx(40.0)
    assert eagle.decode_rate(1, 1.1, 0.3) is None and eagle.decode_rate(5, 0.2, 0.3) is None
    rs = [{"x": 4.0}, {"x": None}, {"x": 9.0}]
    assert eagle.paired(rs, [{"x": 2.0}, {"x": 1.0}, {"x": 3.0}], "x") == [2.0, 3.0]


def test_bench_eagle_cost_model_takes_propose_and_verify_in_whole_plain_rounds():
    """bench_eagle timed propose and verify as multiples of a bare target step (target.apply) and multiplied them
    by a whole plain decode round per token, which also samples, writes the cache and runs the loop: propose and
    verify took on the round's overhead, 'rest' came out too small and the draft's share too large. Now they are
    multiples of a whole plain round timed with them.

    Timed apart: propose 2 ms, verify 6 ms, bare step 4 ms, whole plain round 5 ms; at the decode's speed the plain
    round took 10 ms per token, so the scale is 10 / 5 = 2: propose 4 ms, verify 12 ms. The head's round took
    20 ms: rest 20 - 4 - 12 = 4 ms, propose 4 / 20 = 20% of the round (the old units: 5 and 15 ms, rest 0, 25%).
    K = 2 at conditional rates [0.5, 0.5]: E[N] = 1 + 0.5 + 0.25 = 1.75; cycle 2 x (4 / 2) + 12 = 16 ms;
    predicted 10 x 1.75 / 16 = 1.09375 (a plain round x E[N] / (propose + verify), 5 x 1.75 / 8), against a
    measured 1.25: ratio 0.875."""
    eagle = _examples_module("bench_eagle")
    p = {"propose_ms": 2.0, "verify_ms": 6.0, "plain_step_ms": 4.0, "plain_round_ms": 5.0}
    c = eagle.cost_at_decode_speed(p, 2, 20.0, 10.0, [0.5, 0.5], 1.25)
    assert c["propose_ms_at_decode_speed"] == pytest.approx(4.0) and c["verify_ms_at_decode_speed"] == pytest.approx(
        12.0
    )
    assert c["unmodelled_ms"] == pytest.approx(4.0) and c["draft_share"] == pytest.approx(0.2)
    assert c["propose_in_plain_rounds"] == pytest.approx(0.4) and c["verify_in_plain_rounds"] == pytest.approx(1.2)
    assert c["plain_round_in_bare_steps"] == pytest.approx(1.25)
    assert c["predicted_speedup"] == pytest.approx(1.09375) and c["predicted_over_measured"] == pytest.approx(0.875)
    doc = " ".join(eagle.__doc__.split())
    assert "multiples of a whole plain decode round" in doc and "plain round x E[N] / (propose + verify)" in doc


def test_bench_eagle_times_each_program_after_one_untimed_run():
    """The first time a configuration meets a program (its decode and prompt width) both the decode and its
    prefill are compiled and run once untimed; later runs of the same program reuse them. Every run also
    times its prefill alone (for the decode-only rate)."""
    from jspec import decode as dec

    eagle = _examples_module("bench_eagle")
    programs: dict = {}
    kw = dict(drafter=DRAFTER, draft_params=DRAFT_PARAMS, gamma=3, max_new_tokens=6, max_len=MAX_LEN)
    a = dec.prepare(TARGET, TARGET_PARAMS, [[1, 2, 0]], seed=1, **kw)
    b = dec.prepare(TARGET, TARGET_PARAMS, [[2, 1, 0, 1]], seed=2, **kw)  # the same padded width: same program
    c = dec.prepare(TARGET, TARGET_PARAMS, [[1] * 20], seed=3, **kw)  # another width
    outs = [eagle.timed_run(p, programs) for p in (a, b, c)]
    assert len(programs) == 2 and eagle.program_key(a) == eagle.program_key(b) != eagle.program_key(c)
    assert [o.stats["compile_seconds"] > 0 for o in outs] == [True, False, True]
    assert all(0 < o.stats["prefill_seconds"] and o.stats["seconds"] > 0 for o in outs)
    assert outs[0].tokens == dec.prepare(TARGET, TARGET_PARAMS, [[1, 2, 0]], seed=1, **kw).run().tokens


def _donated(tree) -> bool:
    """Every buffer of ``tree`` (its K/V and feature arrays, not the [B] lengths) consumed by a donating call."""
    big = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and x.ndim >= 2]
    return bool(big) and all(x.is_deleted() for x in big)


def test_bench_scripts_cost_pieces_take_the_cache_donated():
    """bench_eagle's and bench_selfspec's timed pieces update the KV cache in place, as the fused round does:
    undonated, each call copied the whole cache into its output (about 1.6 ms at 640 slots for SmolLM2), a cost
    the decode loop never pays. Each call gets fresh copies; the ones handed in are consumed."""
    import test_eagle
    import test_layerskip

    from models.layerskip import LayerSkipDrafter

    eagle = _examples_module("bench_eagle")
    drafter, dparams, _ = test_eagle.tiny_drafter(k=2)
    parts = eagle.round_parts(test_eagle.TINY_MODEL, drafter, dparams, test_eagle.TINY_PARAMS, [1, 5, 9, 3], 2, ())
    # The head's state and cache, the target's cache (verify reads only the shape of the state's feature block).
    donated = {
        "propose_ms": lambda a: [a[1]],
        "verify_ms": lambda a: [a[3].cache, a[6]],
        "plain_step_ms": lambda a: [a[3]],
        "plain_round_ms": lambda a: [a[2].cache, a[2].seq],  # a plain decode round's whole state
    }
    for name, (fn, args) in parts.items():
        a = args()
        jax.block_until_ready(fn(*a))
        assert all(_donated(x) for x in donated[name](a)), name
        b = args()  # fresh copies every call
        assert not any(_donated(x) for x in donated[name](b)), name
    selfspec = _examples_module("bench_selfspec")
    ls = LayerSkipDrafter(test_layerskip.TINY, 2, adapter=False, head_tokens=0, max_draft=2)
    lp = ls.draft_params(test_layerskip.TINY_PARAMS, {})
    parts = selfspec.component_parts(test_layerskip.TINY, test_layerskip.TINY_PARAMS, test_layerskip.TINY_MODEL, ls,
                                     lp, 2, [1, 5, 9, 3], 32)  # fmt: skip
    donated = {"plain_step": [1], "draft": [1, 2], "verify": [6]}
    for name, (fn, args) in parts.items():
        a = args()
        jax.block_until_ready(fn(*a))
        assert all(_donated(a[i]) for i in donated[name]), name
        assert selfspec.time_ms(fn, args, n=2) > 0  # each timed call on fresh copies (a consumed one would raise)


def test_bench_draft_times_no_first_execution():
    """run_timed compiled afresh on every call (its compile excluded), so every timed repeat ran a program for
    the first time. warm_up caches each compile and runs each decode once, untimed."""
    from jspec import decode as dec

    bench = _examples_module("bench_draft")
    preps = [dec.prepare(TARGET, TARGET_PARAMS, [p], max_new_tokens=4, max_len=MAX_LEN) for p in ([1, 2], [2, 0, 1])]
    assert bench.warm_up([preps]) == 2
    assert all(p.compile() is p.compile() for p in preps)
    assert preps[0].run_timed().stats["compile_seconds"] < 0.05  # reused, not compiled again


def test_bench_forward_compares_on_one_device_kind_only(monkeypatch):
    """On a GPU host JAX ran on the GPU and transformers on the CPU, and the ratio compared devices. transformers
    now runs on JAX's device kind, or the script refuses before measuring anything."""
    fwd = _examples_module("bench_forward")
    assert fwd.torch_device_for("cpu", False) == "cpu" and fwd.torch_device_for("cpu", True) == "cpu"
    assert fwd.torch_device_for("gpu", True) == "cuda"
    with pytest.raises(SystemExit, match="JAX runs on gpu here and torch cannot"):
        fwd.torch_device_for("gpu", False)
    with pytest.raises(SystemExit, match="JAX runs on tpu here"):
        fwd.torch_device_for("tpu", True)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def load(*a, **k):
        raise AssertionError("the model was loaded before the device check")

    monkeypatch.setattr(fwd.registry, "load", load)
    with pytest.raises(SystemExit, match="JAX_PLATFORMS=cpu"):
        fwd.main([])


def test_suite_writes_its_results_before_plots_and_without_matplotlib(closed_runs, tmp_path, monkeypatch, capsys):
    """The suite drew its plots before writing the JSON and Markdown: without matplotlib (an optional
    dependency) a finished run lost every result to an ImportError. Results are written first; without
    matplotlib the plots are skipped with a note."""
    import sys
    from types import SimpleNamespace

    from jspec.bench import suite, suite_runs, targets

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(targets, "load_target", lambda *a: SimpleNamespace(model=TARGET))
    monkeypatch.setattr(suite_runs, "prepare_jobs", lambda target, cfg: (_jobs(), {"input_len": {"median": 2.0}}))
    monkeypatch.setattr(suite_runs, "meta", lambda *a: {})
    runs = [dataclasses.replace(r, load=Load.closed(1), extra={}) for r in closed_runs.values()]
    monkeypatch.setattr(suite_runs, "run_specs", lambda *a, **k: runs)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--name", "toy", "--peers", "none", "--compile-cache", "none", "--concurrency", "1",
            "--record", str(tmp_path / "r.json")]  # fmt: skip
    assert suite.main(argv) == 0
    assert "plots skipped: matplotlib is not importable" in capsys.readouterr().out
    assert [r["spec"]["label"] for r in json.loads((out / "toy.json").read_text())["runs"]] == ["plain", "model K=3"]
    md = (out / "toy.md").read_text()
    assert "## Headline\n\n- model K=3 @ closed c=1:" in md and ".png" not in md
    assert not list(out.glob("*.png"))


def test_write_results_draws_plots_after_the_results(tmp_path):
    """With matplotlib, each plot is drawn once the JSON and Markdown are on disk, and linked from the Markdown."""

    if plotting.plotting_unavailable():
        pytest.skip(plotting.plotting_unavailable())
    seen = []

    def draw(path):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        open(path, "w").close()
        return path

    paths, drawn = report.write_results(str(tmp_path), "x", {"suite": "x", "runs": []}, [("x_plot.png", draw)])
    assert seen == [["x.json", "x.md"]] and drawn == [str(tmp_path / "x_plot.png")]
    assert "![x_plot.png](x_plot.png)" in (tmp_path / "x.md").read_text()


def test_runs_that_finished_nothing_get_no_ratio():
    """max_new_tokens past max_len: every request was refused by Engine.add, both runs finished 0 of N and the
    headline printed "0.00x plain". runner.run refuses the setting up front, and a run that finished no request
    gets no ratio (headline, results table, cost-model check)."""
    from jspec.bench import headlines
    from jspec.bench.metrics import RequestRecord

    with pytest.raises(ValueError, match=r"max_new_tokens \(65\) must be <= max_len \(64\): no request could fit"):
        runner.run(TARGET, TARGET_PARAMS, PLAIN, Load.closed(1), _jobs(), max_new_tokens=65, max_len=MAX_LEN)
    failed = [RequestRecord(f"r{i}", "a", 2, 0.0, stop_reason="error", error="ValueError: must fit") for i in range(2)]
    summary = metrics.summarize_requests(failed, 1.0)
    plain, spec = _fake_result(PLAIN, summary), _fake_result(CHAIN, dict(summary))
    (line,) = headlines.headline([plain, spec])
    assert "no ratio to plain in pass 1 (this run finished no requests (0/2 finished, 2 failed))" in line, line
    assert "0.00x" not in line
    table = tables.results_table([plain.to_json(False), spec.to_json(False)], "closed c=1")
    row = next(r for r in table.splitlines() if r.startswith("| model K=3 |"))
    assert row.count("no ratio: nothing served") == 2 and "0.00x" not in row
    cm = checks.cost_model_check(spec, plain, {"draft_ms": 3.0, "verify_ms": 12.0, "state_ms": 1.0, "round_ms": 17.0},
                                 {"round_ms": 10.0, "plain_step_ms": 8.0})  # fmt: skip
    assert cm["measured_speedup"] is None and "finished no requests" in cm["different_requests"]


def test_bench_scripts_refuse_bad_settings_before_loading_a_model(monkeypatch, capsys):
    """The example suite scripts share the suite's checks (``args.config_from_args``) and their own counts."""
    from jspec.bench import targets

    def no_load(*_, **__):
        raise AssertionError("the settings must be refused before a model is loaded")

    monkeypatch.setattr(targets, "load_target", no_load)
    for name, argv, message in (
        ("bench_serving", ["--phase-repeats", "0"], "--phase-repeats 0: must be >= 1"),
        ("bench_serving", ["--rows", "0"], "--rows 0: must be >= 1"),
        ("bench_sweeps", ["--k-concurrency", "0"], "--k-concurrency 0: must be >= 1"),
        ("bench_spec_vs_plain", ["--max-new-tokens", "700"], "--max-new-tokens 700 > --max-len 640"),
        ("bench_spec_vs_plain", ["--peers", "vllm"], "--peers: unknown vllm"),
        ("bench_spec_vs_plain", ["--peer-threads", "0"], "--peer-threads 0: must be >= 1"),
        ("bench_chain_vs_tree", ["--workloads", ","], "--workloads ',': name at least one"),
    ):
        with pytest.raises(SystemExit) as e:
            _examples_module(name).main([*argv, "--compile-cache", "none"])
        assert e.value.code == 2, (name, argv)
        assert message in capsys.readouterr().err, (name, argv)


def test_a_pass_that_decoded_nothing_after_the_first_tokens_has_no_decode_ratio():
    """max_new_tokens=1: every token is a request's first, so decode rates are 0 on both sides; the per-pass
    decode ratios were 0 / 1e-9 = 0.00x while the headline said "no ratio". Output ratios stay (10 / 5 = 2)."""
    from jspec.bench import headlines

    def passes(out, dec):
        return [{"output_tokens_per_s": out, "decode_tokens_per_s": dec} for _ in range(2)]

    spec, plain = _fake_result(CHAIN, {}, passes=passes(10.0, 0.0)), _fake_result(PLAIN, {}, passes=passes(5.0, 0.0))
    assert headlines.pass_ratios(spec, plain) == {"output": [2.0, 2.0], "decode": [None, None]}
    spec = _fake_result(CHAIN, {}, passes=passes(10.0, 3.0))
    plain = _fake_result(PLAIN, {}, passes=passes(5.0, 1.5))
    assert headlines.pass_ratios(spec, plain) == {"output": [2.0, 2.0], "decode": [2.0, 2.0]}


# ---------------------------------------------------------------------------------------------------------------
# Measurement honesty: results before the peers, outputs that differ, threads, lookup policies, the peers' gap


def _ngram_spec():
    from jspec.ngram import NgramDrafter

    return Spec("ngram K=4", NgramDrafter(vocab_size=100), 4, peer="prompt_lookup")


def _tabled(run, tokens_per_round=2.0):
    """A ``_fake_run`` with what the Markdown's tables read (decode counters, memory)."""
    run.decode_stats = {"tokens_per_round": tokens_per_round, "acceptance_rate": 0.5}
    run.memory = dict(params_bytes=0, draft_params_bytes=0, cache_bytes=0, draft_state_bytes=0, device_bytes=0,
                      max_rss_bytes=0, how="fake")  # fmt: skip
    return run


def test_suite_writes_jspecs_runs_before_the_peers(tmp_path, monkeypatch):
    """python -m jspec bench wrote nothing until the peers finished: a peer that crashed (or a Ctrl-C) lost every
    jspec run. jspec's runs are now written first (peers_pending names the peers still to run), then again with
    the peers'. Canned rates: plain 10 / 10 tok/s, n-gram 20 / 30 (2.00x end to end, 3.00x decode)."""
    from types import SimpleNamespace

    from jspec.bench import suite, suite_peers, suite_runs, targets

    runs = [_tabled(_fake_run(PLAIN, 10.0, 10.0)), _tabled(_fake_run(_ngram_spec(), 20.0, 30.0))]
    monkeypatch.setattr(targets, "load_target", lambda *a: SimpleNamespace(model=TARGET))
    monkeypatch.setattr(suite_runs, "prepare_jobs", lambda target, cfg: ([], {"input_len": {"median": 2.0}}))
    monkeypatch.setattr(suite_runs, "meta", lambda *a: {})
    monkeypatch.setattr(suite_runs, "run_specs", lambda *a, **k: runs)
    monkeypatch.setattr(report, "write_results", lambda out, name, pl, plots: (report.write_outputs(out, name, pl), []))

    def peers_fail(*a, **kw):
        raise KeyboardInterrupt  # stopped while the peers ran

    monkeypatch.setattr(suite_peers, "run_peer_set", peers_fail)
    out = tmp_path / "out"
    argv = [
        "--out",
        str(out),
        "--name",
        "s",
        "--peers",
        "transformers",
        "--compile-cache",
        "none",
        "--concurrency",
        "1",
    ]
    with pytest.raises(KeyboardInterrupt):
        suite.main([*argv, "--record", str(tmp_path / "r1.json")])
    res = json.loads((out / "s.json").read_text())
    assert [r["spec"]["label"] for r in res["runs"]] == ["plain", "ngram K=4"]
    assert res["peers"] == [] and res["peers_pending"] == ["transformers"]
    assert res["headline"][0].startswith("ngram K=4 @ closed c=1: 2.00x plain end-to-end, 3.00x decode")
    assert "| ngram K=4 |" in (out / "s.md").read_text()
    peer = _fake_peer("transformers plain", "plain", 5.0, 5.0, _TORCH_INFO, [])
    given = {}
    monkeypatch.setattr(suite_peers, "run_peer_set", lambda *a, **kw: given.update(kw, cfg=a[3]) or [peer])
    assert suite.main([*argv, "--peer-threads", "3", "--record", str(tmp_path / "r2.json")]) == 0
    res = json.loads((out / "s.json").read_text())
    assert [p["label"] for p in res["peers"]] == ["transformers plain"] and "peers_pending" not in res
    assert given["jspec_runs"] == runs  # for the time from jspec's runs to each peer's
    assert given["cfg"].peer_threads == 3 and res["meta"] == {}
    assert suite.main([*argv, "--peer-threads", "0"]) == 2  # refused before anything runs


def _with_records(run, tokens_by_id):
    """``run`` (a RunResult or PeerRun) serving finished requests with these tokens."""
    from jspec.bench.metrics import RequestRecord

    run.records = [RequestRecord(i, "a", 2, 0.0, admitted=0.0, emissions=[(0.5, len(t))], tokens=list(t), finished=1.0,
                                 stop_reason="eos") for i, t in tokens_by_id.items()]  # fmt: skip
    return run


def test_greedy_outputs_that_differ_from_plain_are_flagged():
    """At temperature 0 greedy speculation reproduces plain decoding, and a ratio between runs with other outputs
    compares other work: the exact match was computed and never used. Plain emitted r0 = [1, 2, 3] and
    r1 = [4, 5]; the speculative run r0 the same and r1 = [4, 6]: 1 of 2 requests differ (exact match 50%). Its
    ratios (3.00x end to end, 2.50x decode) are flagged in the headline, the results table and the cost table. So
    is a run with every finished request equal but other totals of output tokens (40 vs 36: a timed-out request's
    tokens count too). The control (the same tokens) and a sampled run (T = 0.8) are not flagged."""
    from jspec.bench import headlines

    plain = _with_records(_tabled(_fake_run(PLAIN, 10.0, 20.0)), {"r0": [1, 2, 3], "r1": [4, 5]})
    spec = _with_records(_tabled(_fake_run(_ngram_spec(), 30.0, 50.0)), {"r0": [1, 2, 3], "r1": [4, 6]})
    same = _with_records(_tabled(_fake_run(_ngram_spec(), 30.0, 50.0)), {"r0": [1, 2, 3], "r1": [4, 5]})
    q = checks.quality_summary(spec, plain)
    assert (q["exact_match_vs_plain"], q["exact_match_n"], q["differ_from_plain_n"]) == (0.5, 2, 1)
    assert checks.quality_summary(same, plain)["differ_from_plain_n"] == 0
    for r in (spec, same):
        r.quality = checks.quality_summary(r, plain)
        r.cost_model = {"measured_output_speedup": 3.0, "measured_speedup": 2.5}
    (line,) = headlines.headline([plain, spec])
    assert line.startswith("ngram K=4 @ closed c=1: 3.00x plain end-to-end, 2.50x decode [outputs differ from plain: "
                           "1 of 2 requests: the ratios compare other outputs]")  # fmt: skip
    runs = [plain.to_json(False), spec.to_json(False)]
    row = next(r for r in tables.results_table(runs, "closed c=1").splitlines() if r.startswith("| ngram K=4"))
    assert "| 3.00x (outputs differ) |" in row and "| 2.50x (outputs differ) |" in row
    assert "| 50% (outputs differ from plain: 1 of 2 requests) |" in row
    cost = tables.cost_table(runs).splitlines()[2]
    assert "| 3.00x (outputs differ) | 2.50x (outputs differ) |" in cost
    sweeps = _examples_module("bench_sweeps")  # the sweeps' points and tables too
    point = sweeps._point("ngram", spec, plain, "k", 4)
    assert point["outputs_differ"] == "outputs differ from plain: 1 of 2 requests"
    assert "x (outputs differ)" in sweeps._sweep_tables([point], [])
    assert sweeps._point("ngram", same, plain, "k", 4)["outputs_differ"] is None
    # The same tokens: nothing flagged.
    (line,) = headlines.headline([plain, same])
    assert "differ" not in line
    runs = [plain.to_json(False), same.to_json(False)]
    assert "differ" not in tables.results_table(runs, "closed c=1") and "differ" not in tables.cost_table(runs)
    # Every finished request the same, other totals of output tokens.
    same.summary = {**same.summary, "output_tokens": 40}
    plain.summary = {**plain.summary, "output_tokens": 36}
    (line,) = headlines.headline([plain, same])
    assert "[outputs differ from plain: 40 vs 36 output tokens: the ratios compare other outputs]" in line
    # Sampled: other outputs are expected (sampled_note says so instead).
    assert ratios.outputs_differ(q, spec.summary, plain.summary, 0.8) is None
    assert ratios.outputs_differ({"exact_match_vs_plain": 0.75, "exact_match_n": 4}, {}, {}) == (
        "outputs differ from plain: 1 of 4 requests"  # a result written before the count was recorded
    )


def test_a_peer_whose_greedy_outputs_differ_gets_no_ratio(monkeypatch):
    """A like-for-like transformers plain run (f32, CPU, jspec's thread count) whose greedy outputs differ from
    jspec's plain run in 1 of 2 requests compared other work: no ratio, the reason named as ratio_blockers names
    others. The same peer with plain's tokens keeps its ratio (2.00x: 20 / 10 tok/s)."""
    from types import SimpleNamespace

    from jspec.bench import suite_peers, suite_runs

    if jax.default_backend() != "cpu":
        pytest.skip("the fake peer runs on the CPU")
    plain = _with_records(_fake_run(PLAIN, 20.0, 20.0), {"r0": [1, 2, 3], "r1": [4, 5]})
    plain.summary.update(metrics.summarize_requests(plain.records, 1.0), output_tokens_per_s=20.0,
                         decode_tokens_per_s=20.0)  # fmt: skip
    monkeypatch.setattr(metrics, "jspec_threads", lambda: {"threads": 2, "how": "two CPUs"})
    target = SimpleNamespace(dtype="float32", eos_ids=(2,), path="x.gguf", decode_text=None)
    for tokens, expect in (({"r0": [1, 2, 3], "r1": [4, 6]}, "differ"), ({"r0": [1, 2, 3], "r1": [4, 5]}, "same")):
        peer = _with_records(_fake_peer("transformers plain", "plain", 10.0, 10.0, {**_TORCH_INFO, "threads": 2},
                                        None), tokens)  # fmt: skip
        peer.summary.update(metrics.summarize_requests(peer.records, 1.0), output_tokens_per_s=10.0,
                            decode_tokens_per_s=10.0)  # fmt: skip
        monkeypatch.setattr(suite_peers, "run_peers", lambda *a, peer=peer, **k: [peer])
        (p,) = suite_peers.run_peer_set(
            target, ["transformers"], [], suite_runs.SuiteConfig(), 4, plain, log=lambda *a: None
        )
        row = tables.peers_table([plain.to_json(False)], [p.to_json(False)]).splitlines()[2]
        if expect == "differ":
            assert p.info["not_like_for_like"] == ["outputs differ from jspec's plain: 1 of 2 requests"]
            assert "no ratio: outputs differ from jspec's plain: 1 of 2 requests (not like for like)" in row
            assert "2.00x" not in row
        else:
            assert p.info["not_like_for_like"] == []
            assert "| 2.00x | 2.00x |" in row


def test_peer_thread_counts_are_compared_with_jspecs():
    """transformers ran at torch's default and llama.cpp on os.cpu_count() threads (prompts too), and nothing
    recorded or compared them. A peer on another count than jspec's (both on the CPU) is not like for like; an
    unrecorded count counts as another; on another device only the device is named."""
    two = {**_TORCH_INFO, "threads": 2}
    assert peers.like_for_like_problems(two, dtype="float32", backend="cpu", threads=2) == []
    assert peers.like_for_like_problems(two, dtype="float32", backend="cpu", threads=4) == [
        "peer on 2 threads, jspec on 4",
        "jspec runs float32",
    ]
    assert peers.like_for_like_problems(_TORCH_INFO, dtype="float32", backend="cpu", threads=2) == [
        "the peer's thread count not recorded, jspec on 2 threads",
        "jspec runs float32",
    ]
    llama = {**two, "threads_batch": 16}  # llama.cpp's prompt threads, left at every CPU
    assert peers.like_for_like_problems(llama, dtype="float32", backend="cpu", threads=2)[0] == (
        "peer on 2 (16 for prompts) threads, jspec on 2"
    )
    assert peers.like_for_like_problems(two, dtype="float32", backend="cpu") == []  # jspec's count unknown
    assert peers.like_for_like_problems(two, dtype="float32", backend="gpu", threads=2) == [
        "peer on cpu, jspec on gpu",
        "jspec runs float32",
    ]


def test_jspec_thread_count_is_xlas_pool(monkeypatch):
    """jspec's side of the check: XLA:CPU's pool takes one thread per CPU of the affinity mask, one with the
    multi-threaded Eigen kernels off; on an accelerator no host count is compared."""
    import os

    if jax.default_backend() != "cpu":
        assert metrics.jspec_threads()["threads"] is None
        return
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert metrics.jspec_threads()["threads"] == 3
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    assert metrics.jspec_threads()["threads"] == 1
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert metrics.jspec_threads()["threads"] is None


def test_llama_cpp_gets_one_thread_count_for_generation_and_prompts(monkeypatch):
    """llama-cpp-python took n_threads = os.cpu_count() and left n_threads_batch (its prompt threads) at its own
    default. Both are now the count given, and recorded; its rounds are not observable (it yields one token at a
    time), which its info says."""
    import importlib.machinery
    import sys
    import types

    from jspec.bench import peer_llama_cpp

    made = []

    class Llama:
        def __init__(self, **kw):
            made.append(kw)
            self.n_threads, self.n_threads_batch = kw["n_threads"], kw["n_threads_batch"]

        def reset(self):
            pass

        def generate(self, prompt, **kw):
            yield from (5, 2)

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    (run,) = peer_llama_cpp.run_llama_cpp("/x/m.gguf", [Job("p", "a", (1, 2))], techniques=("plain",), max_new_tokens=4,
                                 max_len=32, eos_ids=(2,), threads=3)  # fmt: skip
    assert run.available, run.reason
    assert (made[0]["n_threads"], made[0]["n_threads_batch"]) == (3, 3)
    assert (run.info["threads"], run.info["threads_batch"]) == (3, 3) and run.info["tokens_per_round"] is None
    assert run.records[0].tokens == [5, 2]


def test_peer_tokens_per_round_come_from_the_streamers_pushes():
    """transformers pushes each verify round's tokens to the streamer once (the prompt first): pushes of 3, 1 and
    2 tokens are 3 rounds; the first (the prefill, which verified a first draft too) is left out as jspec's
    tokens/round leaves out its prefill: 3 tokens in 2 rounds, 1.5. A second request pushing 1 then 4 adds 4
    tokens in 1 round: (3 + 4) / (2 + 1) = 7/3. A request with one push has no round after its first."""
    from jspec.bench import peer_transformers
    from jspec.bench.metrics import RequestRecord

    rec = RequestRecord("p", "a", 2, 0.0, admitted=0.0)
    s = peer_transformers._TimingStreamer(rec, time.perf_counter())
    for push in ([[9, 9]], [[1, 2, 3]], [[4]], [[5, 6]]):  # the prompt, then three rounds
        s.put(np.asarray(push))
    rec.finished = 1.0
    assert [k for _, k in rec.emissions] == [3, 1, 2] and rec.tokens == [1, 2, 3, 4, 5, 6]
    assert peer_transformers.tokens_per_round([rec]) == pytest.approx(1.5)
    other = RequestRecord("q", "a", 2, 0.0, admitted=0.0, emissions=[(0.1, 1), (0.2, 4)], tokens=[1] * 5, finished=1.0)
    once = RequestRecord("r", "a", 2, 0.0, admitted=0.0, emissions=[(0.1, 3)], tokens=[1] * 3, finished=1.0)
    assert peer_transformers.tokens_per_round([rec, other, once]) == pytest.approx(7 / 3)
    assert peer_transformers.tokens_per_round([once]) is None


def test_prompt_lookup_ratio_names_the_policies_tokens_per_round_and_the_time_between():
    """jspec's n-gram drafter takes the most recent match and fills K; transformers' prompt lookup takes the first
    match and stops at the history's end: their ratio (2.00x: 20 / 10 tok/s) compares lookup policies too, and
    says so with both sides' tokens per round (jspec 2.00, the peer 1.50). jspec's two passes ended at t = 110 and
    130 s, the peer's timed run began at 430 s: 300 s later, not interleaved as jspec's passes are. A plain peer
    gets no lookup label."""
    from types import SimpleNamespace

    from jspec.bench import headlines, suite_peers, suite_runs

    spec = _ngram_spec()
    passes = [{"output_tokens_per_s": 20.0, "decode_tokens_per_s": 20.0, "wall_clock": [100.0, 110.0]},
              {"output_tokens_per_s": 20.0, "decode_tokens_per_s": 20.0, "wall_clock": [120.0, 130.0]}]  # fmt: skip
    plain = _tabled(_fake_run(PLAIN, 20.0, 20.0), 1.0)
    plain.extra["passes"] = [dict(p) for p in passes]
    ng = _tabled(_fake_run(spec, 20.0, 20.0))
    ng.extra["passes"] = passes
    info = {**_TORCH_INFO, "gamma": 4, "lookup_policy": peers.LOOKUP_POLICY["transformers"], "tokens_per_round": 1.5,
            "wall_clock": [430.0, 500.0]}  # fmt: skip
    pl = _fake_peer("transformers prompt-lookup K=4", "prompt_lookup", 10.0, 10.0, info, [])
    pp = _fake_peer("transformers plain", "plain", 10.0, 10.0, {**_TORCH_INFO, "wall_clock": [330.0, 400.0]}, [])
    lines = headlines.headline([plain, ng], [pl, pp])
    (line,) = lines
    assert "vs transformers prompt-lookup K=4: 2.00x end-to-end, 2.00x decode" in line
    assert (
        "[different lookup policy (jspec: most recent match, its continuation repeated up to K; the peer: first "
        "(leftmost) match, up to K tokens, stopping at the history's end); tokens/round jspec 2.00, the peer 1.50; "
        "not interleaved: the peer ran 300 s after jspec's run]" in line
    )
    runs = [plain.to_json(False), ng.to_json(False)]
    table = tables.peers_table(runs, [pl.to_json(False), pp.to_json(False)])
    rows = {r.split(" | ")[0].lstrip("| "): r for r in table.splitlines()[2:]}
    assert "| 2.00 / 1.50 | different lookup policy (jspec: most recent match" in rows["transformers prompt-lookup K=4"]
    assert "not interleaved: the peer ran 300 s after jspec's run |" in rows["transformers prompt-lookup K=4"]
    assert rows["transformers plain"].endswith("| 1.00 / - | not interleaved: the peer ran 200 s after jspec's run |")
    assert "after all of jspec's runs" in report.markdown({"runs": runs, "peers": [pl.to_json(False)]})
    # run_peer_set records the gap per jspec run the peer is compared with.
    target = SimpleNamespace(dtype="float32", eos_ids=(2,), path="x.gguf", decode_text=None)
    import unittest.mock

    with unittest.mock.patch.object(suite_peers, "run_peers", lambda *a, **k: [pl]):
        (p,) = suite_peers.run_peer_set(target, ["transformers"], [], suite_runs.SuiteConfig(), 4, None,
                                        log=lambda *a: None, jspec_runs=[plain, ng])  # fmt: skip
    assert p.info["after_jspec_s"] == {"ngram K=4": 300.0}


def test_runs_and_peers_record_their_wall_clock():
    """Every jspec pass records its wall-clock start and end; a peer's timed part too: the peers run after jspec's
    runs, and the report gives the time between."""
    from jspec.bench import suite_runs

    def fake_run_one(target, spec, load, jobs, cfg, log):
        return _fake_run(spec, 10.0, 10.0)

    import unittest.mock

    before = time.time()
    with unittest.mock.patch.object(suite_runs, "run_one", fake_run_one), \
            unittest.mock.patch.object(suite_runs, "free_compiled", lambda: None):  # fmt: skip
        cfg = suite_runs.SuiteConfig(measure_phases=False, passes=2)
        res = suite_runs.run_specs(None, [PLAIN, CHAIN], [Load.closed(1)], _jobs(), cfg, log=lambda *a: None)
    clocks = [p["wall_clock"] for r in res for p in r.extra["passes"]]
    assert len(clocks) == 4 and all(before <= a <= b <= time.time() for a, b in clocks)
    run = peers.PeerRun("fake", "plain", "fake plain", True)

    def generate_one(prompt, rec, t0):
        rec.emissions, rec.tokens, rec.finished = [(0.0, 1)], [1], 0.0

    before = time.time()
    peers._serve_sequentially([Job("p", "a", (0,))], generate_one, None, run)
    start, end = run.info["wall_clock"]
    assert before <= start <= end <= time.time()
