"""The headline benchmark's grid (``jspec.bench.grid``, ``examples/bench_grid.py``): its flags, its settings, and
one cell measured on the toy model of test_decode_core into a result file that validates."""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
from types import SimpleNamespace

import pytest
from test_decode_core import DRAFT_PARAMS, DRAFTER, TARGET, TARGET_PARAMS, VOCAB

from jspec.bench import grid, record
from jspec.goodput import GoodputK
from jspec.ngram import NgramDrafter


def _bench_grid():
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "bench_grid.py")
    spec = importlib.util.spec_from_file_location("examples_bench_grid", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_drafters_parse_with_their_defaults_and_names():
    assert grid.parse_drafter("ngram") == grid.DrafterChoice("ngram", k=4)
    assert grid.parse_drafter("ngram:8").name == "ngram K=8"
    assert grid.parse_drafter("eagle").name == "eagle K=2"
    tree = grid.parse_drafter("eagle-tree")
    assert (tree.name, tree.depth, tree.tree_nodes()) == ("eagle tree (4,1)", 2, 1 + 4 + 4)
    assert grid.parse_drafter("eagle-tree:3x2").tree_nodes() == 1 + 3 + 6
    for bad, message in (("medusa", "unknown drafter 'medusa'"), ("ngram:0", "K must be an integer >= 1"),
                         ("eagle-tree:4x0", "branching factors >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            grid.parse_drafter(bad)


def test_default_settings_are_the_real_run_and_reductions_mark_a_smoke_run():
    real = grid.GridSettings()
    assert real.smoke() == [] and real.passes >= record.MIN_PASSES
    assert real.batches == (1, 8) and real.workloads == ("edit", "chat") and real.peers == "transformers"
    assert [d.name for d in real.drafters] == ["ngram K=4", "eagle K=2", "eagle tree (4,1)"]
    assert real.max_new_tokens == {"edit": 256, "chat": 128}
    tiny = grid.GridSettings(workloads=("edit",), max_new_tokens={"edit": 16}, prompts=1)
    assert tiny.smoke() == ["max_new_tokens 16 < 256 (edit)", "prompts 1 < 4"]
    assert tiny.to_json()["smoke"] == tiny.smoke()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1,0"], "--batches '1,0': 0 is below 1"),
        (["--batches", "8,8"], "gives 8 twice"),
        (["--workloads", "math"], "--workloads: unknown math"),
        (["--drafters", "ngram,medusa"], "unknown drafter 'medusa'"),
        (["--drafters", "ngram,ngram:4"], "one is given twice"),
        (["--passes", "1"], "passes 1: need >= 2"),
        (["--max-new", "0"], "--max-new 0: must be >= 1"),
        (["--prompts", "0"], "prompts 0: must be >= 1"),
    ],
)
def test_bench_grid_refuses_bad_flags_before_loading_a_model(argv, message, monkeypatch, capsys, tmp_path):
    def no_run(*a, **kw):
        raise AssertionError("the flags must be refused before anything runs")

    monkeypatch.setattr(grid, "run", no_run)
    with pytest.raises(SystemExit) as e:
        _bench_grid().main([*argv, "--out", str(tmp_path / "r.json"), "--compile-cache", "none"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_grid_refuses_an_existing_result_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(grid, "run", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("ran")))
    taken = tmp_path / "r.json"
    taken.write_text("{}")
    with pytest.raises(SystemExit):
        _bench_grid().main(["--out", str(taken), "--compile-cache", "none"])
    assert "already exists" in capsys.readouterr().err


def test_a_cell_measures_every_config_in_rotating_passes_and_checks_outputs(monkeypatch):
    """One cell on the toy model (batch 2, two batches): plain, n-gram and a draft model, 5 passes. Every pass
    holds every config once, in the rotated order; the tokens are each config's real output counts; greedy
    speculation reproduces plain's tokens; the file validates and its ratio is the median of the per-pass
    tokens/s ratios computed here from the raw entries."""
    target = SimpleNamespace(model=TARGET, params=TARGET_PARAMS, eos_ids=(), tokenizer=None)
    jobs = [[SimpleNamespace(id=f"p{b}{i}", prompt=(0, 1, 2, 1)[: 2 + i + b]) for i in range(2)] for b in range(2)]
    labels = {"workload": "toy", "batch": 2, "prompts": 4, "distinct_prompts": 4, "max_new_tokens": 9}
    monkeypatch.setattr(grid, "cell_prompts", lambda *a: (jobs, labels))
    monkeypatch.setattr("jspec.bench.suite_runs.free_compiled", lambda: None)
    configs = [
        grid.Config("plain"),
        grid.Config("ngram K=3", NgramDrafter(vocab_size=VOCAB), None, 3, 4),
        grid.Config("model K=2", DRAFTER, DRAFT_PARAMS, 2, 3),
        grid.Config("model goodput", DRAFTER, DRAFT_PARAMS, None, 3, GoodputK((0, 2), (1.0, 1.5))),
    ]
    settings = grid.GridSettings(workloads=("edit",), passes=5, peers="none")
    rec = record.Record("grid", "python examples/bench_grid.py", settings.to_json(), "unused.json")
    mismatches = grid.run_cell(rec, target, configs, "toy", 2, settings, None, log=lambda *a: None)
    assert mismatches == []
    rec.finish()
    rec.data["summary"] = record.summarize(rec.data)
    assert record.validate(rec.data) == [] or all("git" in p for p in record.validate(rec.data))
    passes = rec.data["passes"]
    names = ["plain", "ngram K=3", "model K=2", "model goodput"]
    assert [p["order"] for p in passes] == [names[i % 4 :] + names[: i % 4] for i in range(5)]
    for p in passes:
        runs = {r["config"]: r for r in p["runs"]}
        assert all(r["same_as_plain"] for r in p["runs"])
        assert runs["plain"]["tokens"] == 4 * 9 and runs["plain"]["tokens_per_round"] == 1.0
        assert runs["ngram K=3"]["tokens"] == 4 * 9 and runs["model K=2"]["tokens_per_round"] > 1.0
    per_pass = [
        {r["config"]: r["tokens"] / r["seconds"] for r in p["runs"]}["model K=2"]
        / {r["config"]: r["tokens"] / r["seconds"] for r in p["runs"]}["plain"]
        for p in passes
    ]
    got = rec.data["summary"]["toy b=2"]["ratios"]["model K=2 vs plain"]
    assert got["median"] == pytest.approx(statistics.median(per_pass)) and got["n"] == 5
    assert set(rec.data["summary"]["toy b=2"]["ratios"]) == {
        "ngram K=3 vs plain",
        "model K=2 vs plain",
        "model goodput vs plain",
    }
    # The goodput config's cost table, and the cost model's prediction: its rounds at each K priced by the table,
    # over plain's rounds. Both runs decode 2 batches of 2 rows x 9 tokens; a round at K = 2 costs 1.5.
    meta = rec.data["cells"]["toy b=2"]["configs"]["model goodput"]
    assert meta["round_costs"] == [{"0": 1.0, "2": 1.5}] * 2
    k_rounds = [r["k_rounds"] for p in passes for r in p["runs"] if r["config"] == "model goodput"][0]
    plain_rounds = [r["rounds"] for p in passes for r in p["runs"] if r["config"] == "plain"][0]
    assert sum(k_rounds.values()) < plain_rounds  # it speculated (the draft model accepts)
    # Each batch's rounds cost between 1 and 1.5 plain steps each; the batches weigh by their plain seconds, so
    # only the order of magnitude is known here.
    lo, hi = plain_rounds / (1.5 * sum(k_rounds.values())), plain_rounds / sum(k_rounds.values())
    assert lo / 2 < meta["predicted_vs_plain"] < hi * 2
    # The table prices K = 0 and 2: the fixed K = 2 run too, not the K = 3 one. Plain's prefill is part of its run.
    configs = rec.data["cells"]["toy b=2"]["configs"]
    assert "predicted_vs_plain" in configs["model K=2"] and "predicted_vs_plain" not in configs["ngram K=3"]
    assert 0 < configs["plain"]["prefill_seconds"] < configs["plain"]["first_run_seconds"]


def test_grid_cell_lines_give_median_and_spread():
    summary = {
        "configs": {"s": {"tokens_per_round": {"median": 2.5}}},
        "ratios": {"s vs plain": {"of": "s", "median": 1.5, "min": 1.25, "max": 1.75, "n": 5}},
    }
    assert grid.cell_lines(summary) == ["  s vs plain: 1.50x (1.25-1.75, 5 passes), 2.50 tokens/round"]


def test_grid_never_imports_models():
    assert "models" not in {m.split(".")[0] for m in sys.modules if m.startswith("jspec.bench.grid")}
    with open(grid.__file__) as f:
        source = f.read()
    assert "import models" not in source and "from models" not in source
