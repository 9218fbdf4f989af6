"""Result files (``jspec.bench.record``) and what is rendered from them (``jspec.bench.render``): the committed
files validate and their summaries follow from their passes, the README's table and docs/results.md are the
rendering of the committed files, and the format's pieces on small synthetic records."""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess

import pytest

from jspec.bench import record, render

pytestmark = pytest.mark.fast  # the fast tier: make test-fast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COMMITTED = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json")))


# --------------------------------------------------------------------------------------------------------
# The committed files and their renderings


def test_results_are_committed():
    assert COMMITTED, "docs/results/ holds no result file: the README's numbers would have no source"


def test_readme_table_is_the_rendering_of_the_committed_results():
    rendered, _ = render.render(ROOT)
    with open(os.path.join(ROOT, "README.md")) as f:
        current = f.read()
    assert current == rendered["README.md"], (
        "README.md's results table differs from `python -m jspec report`'s rendering:\n"
        + render.first_difference("README.md", current, rendered["README.md"])
    )


def test_results_md_is_the_rendering_of_the_committed_results():
    rendered, _ = render.render(ROOT)
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        current = f.read()
    assert current == rendered["docs/results.md"], (
        "docs/results.md differs from `python -m jspec report`'s rendering:\n"
        + render.first_difference("docs/results.md", current, rendered["docs/results.md"])
    )


@pytest.mark.parametrize("path", COMMITTED, ids=os.path.basename)
def test_committed_result_file_is_traceable_and_its_summary_follows_from_its_passes(path):
    with open(path) as f:
        data = json.load(f)
    assert record.validate(data) == []
    assert data["command"].startswith("python ")
    assert len(data["git"]["commit"]) == 40 and data["machine"]["cpu_model"] and data["jax"]["jax"]
    # Every ratio recomputed here from the raw runs (tokens / seconds), not read from the summary.
    for cell, meta in data["cells"].items():
        passes = [
            {r["config"]: r["tokens"] / r["seconds"] for r in p["runs"]} for p in data["passes"] if p["cell"] == cell
        ]
        for ratio in meta["ratios"]:
            values = [p[ratio["of"]] / max(p[o] for o in ratio["over"]) for p in passes]
            assert len(values) >= 5, (cell, ratio["name"])
            got = data["summary"][cell]["ratios"][ratio["name"]]
            assert got["median"] == pytest.approx(statistics.median(values), rel=1e-9)
            assert (got["min"], got["max"]) == pytest.approx((min(values), max(values)), rel=1e-9)
        for config in meta["configs"]:
            tps = [p[config] for p in passes if config in p]
            assert data["summary"][cell]["configs"][config]["tokens_per_s"]["median"] == pytest.approx(
                statistics.median(tps), rel=1e-9
            )


def test_python_m_jspec_report_check_passes_on_the_repository():
    from jspec import cli

    assert cli.main(["report", "--check", "--root", ROOT]) == 0


# --------------------------------------------------------------------------------------------------------
# record.py on synthetic records

CELL = "edit b=1"


def synthetic(rates, *, bench="grid", started="2026-01-02T00:00:00+00:00", smoke=(), order=record.rotation, peers=()):
    """A record of one cell whose pass i ran config c at ``rates[i][c]`` tokens/s (tokens = rate, 1 second)."""
    configs = list(rates[0])
    rec = record.Record(bench, "python examples/bench_grid.py --passes 5", {"smoke": list(smoke)}, path="unused.json")
    rec.data["started"], rec.data["finished"] = started, started
    rec.data["git"] = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False}
    rec.cell(CELL, workload="edit", batch=1)
    for c in configs:
        rec.config(CELL, c, kind="plain" if c == "plain" else "peer" if c in peers else "jspec")
    for i, by_config in enumerate(rates):
        rec.add_pass(
            CELL, i, [record.run_entry(c, pos, by_config[c], 1.0, 10, 2.5) for pos, c in enumerate(order(configs, i))]
        )
    for c in configs:
        if c != "plain" and c not in peers:
            rec.ratio(CELL, c, ["plain"], f"{c} vs plain")
            if peers:
                rec.ratio(CELL, c, list(peers), f"{c} vs best peer")
    rec.data["summary"] = record.summarize(rec.data)
    return rec.data


FIVE = [
    {"plain": 10, "spec": 20},
    {"plain": 10, "spec": 15},
    {"plain": 20, "spec": 22},
    {"plain": 10, "spec": 30},
    {"plain": 5, "spec": 6},
]  # fmt: skip  per-pass ratios 2.0, 1.5, 1.1, 3.0, 1.2


def test_spread_is_the_median_with_min_and_max():
    assert record.spread([3, 1, 2, 5, 4]) == {"median": 3, "min": 1, "max": 5, "n": 5}
    assert record.spread([1, 2, 3, 4])["median"] == 2.5
    assert record.spread([None, 2.0, None])["n"] == 1
    assert record.spread([])["median"] is None


def test_rotation_puts_every_config_in_every_position():
    assert [record.rotation("ABC", i) for i in range(4)] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    assert [record.rotation("AB", i) for i in range(3)] == [list("AB"), list("BA"), list("AB")]
    firsts = {record.rotation("ABCD", i)[0] for i in range(4)}
    assert firsts == set("ABCD")


def test_summary_is_the_median_of_per_pass_ratios():
    s = record.summarize(synthetic(FIVE))[CELL]
    r = s["ratios"]["spec vs plain"]
    assert r["by_pass"] == pytest.approx([2.0, 1.5, 1.1, 3.0, 1.2])
    assert (r["median"], r["min"], r["max"], r["n"]) == pytest.approx((1.5, 1.1, 3.0, 5))
    assert s["configs"]["plain"]["tokens_per_s"] == {"median": 10, "min": 5, "max": 20, "n": 5}


def test_a_ratio_over_several_configs_takes_the_fastest_in_each_pass():
    rates = [{"plain": 10, "spec": 30, "peer a": 12, "peer b": 15}] * 3 + [
        {"plain": 10, "spec": 30, "peer a": 20, "peer b": 5}
    ] * 2
    s = record.summarize(synthetic(rates, peers=("peer a", "peer b")))[CELL]
    assert s["ratios"]["spec vs best peer"]["by_pass"] == pytest.approx([2.0, 2.0, 2.0, 1.5, 1.5])


def test_a_synthetic_record_validates_and_round_trips(tmp_path):
    data = synthetic(FIVE)
    assert record.validate(data) == []
    path = record.write(data, str(tmp_path / "r.json"))
    assert record.load(path)["summary"] == json.loads(json.dumps(data["summary"]))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: d.pop("command"), "missing command"),
        (lambda d: d["git"].pop("commit"), "missing git.commit"),
        (lambda d: d["git"].update(commit="HEAD"), "git.commit: not a commit id"),
        (lambda d: d["machine"].pop("cpu_model"), "missing machine.cpu_model"),
        (lambda d: d["jax"].pop("jax"), "missing jax.jax"),
        (lambda d: d.update(finished=None), "missing finished"),
        (lambda d: d["passes"][0]["runs"][0].pop("seconds"), "passes[0].runs[0]: missing seconds"),
        (lambda d: d["passes"][0]["runs"][0].update(tokens_per_s=99.0), "tokens_per_s is not tokens / seconds"),
        (lambda d: d["summary"][CELL]["ratios"]["spec vs plain"].update(median=9.9), "summary differs"),
        (lambda d: d["passes"][1]["runs"][0].update(position=5), "positions are not 0..1"),
    ],
)
def test_validation_names_what_is_missing_or_wrong(damage, problem):
    data = synthetic(FIVE)
    damage(data)
    problems = record.validate(data)
    assert any(problem in p for p in problems), problems


def test_a_ratio_needs_five_passes_in_alternating_order():
    problems = record.validate(synthetic(FIVE[:4]))
    assert any("over 4 passes (needs >= 5)" in p for p in problems), problems
    fixed = synthetic(FIVE, order=lambda configs, i: configs)
    assert any("same order in every pass" in p for p in record.validate(fixed))


def test_load_names_the_file_and_its_problems(tmp_path):
    data = synthetic(FIVE)
    del data["jax"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(record.RecordError, match=r"bad.json: missing jax"):
        record.load(str(path))


def test_out_path_defaults_under_results_and_never_overwrites(tmp_path):
    assert record.default_path("grid").startswith(os.path.join("results", "grid-"))
    assert record.default_path("grid").endswith("Z.json")
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    with pytest.raises(OSError, match="already exists"):
        record.check_out_path(str(taken))
    assert record.check_out_path(str(tmp_path / "new" / "r.json")).endswith("r.json")


def test_command_line_is_shell_quoted():
    assert record.command_line("python x.py", ["--a", "b c", "it's"]) == "python x.py --a 'b c' 'it'\"'\"'s'"


def test_git_state_is_dirty_only_for_files_other_than_results(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "docs" / "results" / "r.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert record.git_state(str(tmp_path))["dirty"] is False
    (tmp_path / "docs" / "results" / "r.json").write_text('{"a": 1}\n')
    (tmp_path / "untracked.py").write_text("")
    state = record.git_state(str(tmp_path))
    assert state["dirty"] is False and len(state["commit"]) == 40
    (tmp_path / "code.py").write_text("x = 2\n")
    assert record.git_state(str(tmp_path))["dirty"] is True


# --------------------------------------------------------------------------------------------------------
# render.py on synthetic records


def _root(tmp_path, files, readme_extra=""):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for name, data in files.items():
        record.write(data, str(tmp_path / "docs" / "results" / name))
    (tmp_path / "README.md").write_text(f"# x\n\n{render.TABLE_BEGIN}\nold\n{render.TABLE_END}\n{readme_extra}")
    return str(tmp_path)


def test_readme_rows_come_from_the_newest_file_of_their_kind(tmp_path):
    old = synthetic([{"plain": 10, "spec": 11}] * 5, started="2026-01-01T00:00:00+00:00")
    new = synthetic(FIVE, started="2026-02-01T00:00:00+00:00")
    other = synthetic([{"plain": 10, "spec": 40}] * 5, bench="suite", started="2026-03-01T00:00:00+00:00")
    files = render.load_committed(_root(tmp_path, {"a.json": old, "b.json": new, "c.json": other}))
    assert [os.path.basename(p) for p, _ in files] == ["c.json", "b.json", "a.json"]
    table, missing = render.readme_table(files, rows=[("grid", CELL, "spec"), ("grid", "chat b=8", "spec")])
    row = table.splitlines()[2]
    assert row == "| edit | spec | 1 | 2.50 | 1.50x (1.10-3.00) | - | " + render.machine_text(new) + " |"
    assert missing == ["grid: chat b=8: spec"]
    assert "b.json" in table and "a.json" not in table


def test_readme_row_gives_the_peer_ratio_and_flags_smoke_runs(tmp_path):
    rates = [{"plain": 10, "spec": 30, "tf plain": 12, "tf lookup": 15}] * 5
    data = synthetic(rates, peers=("tf plain", "tf lookup"), smoke=["max_new_tokens 16 < 256 (edit)"])
    table, _ = render.readme_table([("docs/results/s.json", data)], rows=[("grid", CELL, "spec")])
    assert "| 3.00x (3.00-3.00) | 2.00x (2.00-2.00) |" in table
    assert "smoke run (max_new_tokens 16 < 256 (edit))" in table


def test_report_rewrites_then_check_passes_and_a_hand_edit_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(render, "README_ROWS", (("grid", CELL, "spec"),))
    root = _root(tmp_path, {"r.json": synthetic(FIVE)})
    assert render.main(["--check", "--root", root]) == 1
    assert "README.md differs from the rendering" in capsys.readouterr().err
    assert render.main(["--root", root]) == 0
    assert render.main(["--check", "--root", root]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("1.50x", "1.60x"))
    assert render.main(["--check", "--root", root]) == 1
    err = capsys.readouterr().err
    assert "README.md differs" in err and "1.60x" in err and "docs/results.md differs" not in err


def test_report_refuses_a_file_that_does_not_validate(tmp_path, capsys):
    data = synthetic(FIVE)
    del data["command"]
    root = _root(tmp_path, {"bad.json": data})
    assert render.main(["--check", "--root", root]) == 2
    assert "bad.json: missing command" in capsys.readouterr().err


def test_results_md_has_a_section_per_file_newest_first(tmp_path):
    files = [("docs/results/n.json", synthetic(FIVE, started="2026-02-01T00:00:00+00:00")),
             ("docs/results/o.json", synthetic(FIVE, started="2026-01-01T00:00:00+00:00"))]  # fmt: skip
    text = render.results_md(files)
    assert text.index("(results/n.json)") < text.index("(results/o.json)")
    assert "`python examples/bench_grid.py --passes 5`" in text and "`0123456789ab`" in text
    assert "| spec vs plain | 1.50x (1.10-3.00) | 5 | 2.00 1.50 1.10 3.00 1.20 |" in text


def test_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="lacks the markers"):
        render.replace_table("# no table here\n", "x")


def test_results_md_gives_the_rounds_at_each_k_the_cost_table_and_the_prediction():
    data = synthetic(FIVE)
    data["cells"][CELL]["configs"]["spec"].update(round_costs=[{"0": 1.0, "4": 1.5}], predicted_vs_plain=1.6)
    for p in data["passes"]:  # the first pass is the one read: later passes' k_rounds must not be
        for r in p["runs"]:
            r["k_rounds"] = {"0": 3, "4": 5} if p["pass"] == 0 and r["config"] == "spec" else {"0": 9}
    text = render.results_md([("docs/results/k.json", data)])
    assert "| spec | 0:3 4:5 | 0:1.00 4:1.50 | 1.60x | 1.50x (1.10-3.00) |" in text
    # Without any of them (a plain-only or fixed-K file that no table prices) there is no such table.
    assert "Draft lengths and the cost model" not in render.results_md([("docs/results/f.json", synthetic(FIVE))])
