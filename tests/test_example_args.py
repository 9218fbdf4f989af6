"""The example scripts refuse counts they cannot use when they parse their arguments, before any model loads and
before anything is written, where they used to fail (or silently do nothing) after compiling, after generating
the training data, or after recording a run's settings that then blocked the corrected rerun. And the
benchmarks write their measured runs before the cost-model timing that comes after them. No model runs here."""

from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace

import pytest
from example_scripts import load_example

from models import registry
from models.training import draft as train_draft
from models.training import eagle as train_eagle
from models.training import early_exit as train_early_exit
from models.training import prompts

# The trainers' parsers live in the library (examples/train_*.py call their main); the benchmarks are scripts.
TRAINERS = {"train_draft": train_draft, "train_eagle": train_eagle, "train_early_exit": train_early_exit}


def _script(name):
    return TRAINERS[name] if name in TRAINERS else load_example(name)


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded: the arguments must be refused before that")


# (script, its argument list, the flag the refusal names). Trainers: parse_args; benchmarks: main.
BAD = [
    ("train_draft", ["--ckpt-every", "0"], "--ckpt-every"),
    ("train_draft", ["--batch", "0"], "--batch"),
    ("train_draft", ["--epochs", "0"], "--epochs"),
    ("train_draft", ["--gen-batches", "0"], "--gen-batches"),
    ("train_draft", ["--layers", "0"], "--layers"),
    ("train_draft", ["--steps", "-1"], "--steps"),
    ("train_draft", ["--frozen-layers", "3"], "--frozen-layers"),
    ("train_draft", ["--doc-fraction", "1"], "--doc-fraction"),
    ("train_draft", ["--doc-fraction", "-0.1"], "--doc-fraction"),
    ("train_eagle", ["--ckpt-every", "0"], "--ckpt-every"),
    ("train_eagle", ["--batch", "0"], "--batch"),
    ("train_eagle", ["--epochs", "0"], "--epochs"),
    ("train_eagle", ["--window", "1"], "--window"),
    ("train_eagle", ["--unroll", "0"], "--unroll"),
    ("train_eagle", ["--gen-batches", "0"], "--gen-batches"),
    ("train_eagle", ["--gen-batches", "5-2"], "--gen-batches"),
    ("train_eagle", ["--gen-batches", "none"], "--gen-batches"),
    ("train_early_exit", ["--steps", "0"], "--steps"),
    ("train_early_exit", ["--exit-layer", "0"], "--exit-layer"),
    ("train_early_exit", ["--head-tokens", "32"], "--head-tokens"),
    ("train_early_exit", ["--batch", "0"], "--batch"),
    ("bench_draft", ["--repeats", "0"], "--repeats"),
    ("bench_selfspec", ["--repeats", "0"], "--repeats"),
    ("bench_forward", ["--repeats", "0", "--no-torch"], "--repeats"),
    ("bench_forward", ["--new", "0", "--no-torch"], "--new"),
    ("bench_sync", ["--reps", "0"], "--reps"),
    ("bench_sharded", ["--repeats", "0", "--devices", "0"], "--repeats"),
    ("bench_eagle", ["--reps", "0"], "--reps"),
    ("bench_eagle", ["--packed-dtypes", "bfloat16,float16"], "--packed-dtypes"),
]


@pytest.mark.parametrize("script, argv, flag", BAD, ids=[f"{s}{' '.join(['', *a])}" for s, a, _ in BAD])
def test_bad_counts_are_refused_when_parsed(script, argv, flag, tmp_path, monkeypatch, capsys):
    mod = _script(script)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "load", _no_model)
    for name in ("load", "build"):  # bench_selfspec's and train_early_exit's loader, bench_sharded's model
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, _no_model)
    entry = mod.parse_args if script.startswith("train_") else mod.main
    with pytest.raises(SystemExit) as e:
        entry(argv)
    assert e.value.code == 2  # argparse's usage error
    assert f"error: {flag}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing written, no cache made


def test_usable_counts_still_parse():
    assert train_draft.parse_args(["--steps", "0", "--frozen-layers", "2", "--doc-fraction", "0"]).steps == 0
    assert train_eagle.parse_args(["--window", "2", "--gen-batches", "none", "--self-batches", "2"]).window == 2
    assert train_early_exit.parse_args(["--head-tokens", "0"]).head_tokens == 0
    assert train_early_exit.parse_args(["--head-tokens", "64", "--steps", "1"]).steps == 1


# ---------------------------------------------------------------- bounds that need the model


def _fake_cfg():
    return SimpleNamespace(num_layers=30, vocab_size=1000, eos_ids=(0,), name="fake")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exit-layer", "30"], "--exit-layer 30: expected 1 to 29"),
        (["--head-tokens", "2000"], "--head-tokens 2000: smollm2's vocabulary has 1000 tokens"),
    ],
)
def test_early_exit_refuses_an_exit_layer_beyond_the_model_before_recording_the_run(
    argv, message, tmp_path, monkeypatch
):
    """--exit-layer 0 or >= the model's layers failed after the text was generated and the run's settings were
    recorded; the bound needs the model, so it is checked once the model loads, before anything is written."""
    T = train_early_exit
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "load", lambda *a, **kw: (_fake_cfg(), None, None, None))

    def generate(*a, **kw):
        raise AssertionError("text generated")

    monkeypatch.setattr(T, "generate_data", generate)
    with pytest.raises(SystemExit, match=message):
        T.main(argv)
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # no args.json, no text


def test_draft_trainer_refuses_layers_beyond_the_target_and_a_budget_beyond_the_prompts(tmp_path, monkeypatch):
    """--layers beyond the target's failed once the data was generated; a --gen-batches budget beyond the
    training prompts failed at the first batch that lacked prompts, after generating the ones before it."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(prompts, "draft_docstring_prompts", lambda: [f"doc {i}" for i in range(300)])
    monkeypatch.setattr(train_draft.registry, "load", _no_model)
    n = len(prompts.draft_chat_prompts()) * 4 // 3  # a quarter of them docstrings, the default
    with pytest.raises(SystemExit, match=rf"--gen-batches 100 x --gen-batch 16 .* {n} training prompts"):
        train_draft.main(["--gen-batches", "100"])

    monkeypatch.setattr(train_draft.registry, "load", lambda *a, **kw: SimpleNamespace(config=_fake_cfg()))

    def generate(*a, **kw):
        raise AssertionError("data generated")

    monkeypatch.setattr(train_draft, "generate_data", generate)
    with pytest.raises(SystemExit, match="--layers 31: .* smollm2 has 30"):
        train_draft.main(["--layers", "31"])


def test_draft_trainer_refuses_a_doc_fraction_beyond_the_docstrings(monkeypatch):
    """A --doc-fraction that asks for more docstring requests than the standard library gives trained on
    another mix (all of them), silently."""
    monkeypatch.setattr(prompts, "draft_docstring_prompts", lambda: [f"doc {i}" for i in range(100)])
    n_chat = len(prompts.draft_chat_prompts())
    with pytest.raises(SystemExit, match=rf"--doc-fraction 0.5 asks for {n_chat} docstring requests .* gives 100"):
        prompts.draft_training_prompts(0, 0.5)
    most = 100 / (n_chat + 100)
    assert len(prompts.draft_training_prompts(0, int(most * 1000) / 1000)) <= n_chat + 100
    assert len(prompts.draft_training_prompts(0, 0.1)) == n_chat + round(n_chat / 9)


def test_draft_trainer_leaves_out_the_benchmarks_grounded_passages():
    """train_draft's docstring requests came from the same stdlib modules as the benchmark's grounded passages:
    textwrap.dedent, heapq.merge, statistics.median, ... were training prompts, so a draft could be measured on
    its training text. Every passage source is now left out, under any name (statistics.Fraction is
    fractions.Fraction), and so is a docstring sharing 8 consecutive words with one (textwrap.fill's with
    textwrap.wrap's); the data cached before (which held them) is not reused."""
    import inspect

    from jspec.bench import workloads

    def names(d, name):  # the two templates: "...`name`. ..." and "...:\n\nname: doc"
        return f"`{name}`" in d or f"\n{name}:" in d

    docs = prompts.draft_docstring_prompts()
    assert docs  # the other docstrings are kept
    for source in workloads._PASSAGE_SOURCES:
        assert not any(names(d, source.replace(":", ".")) for d in docs), source
        words = inspect.getdoc(getattr(importlib.import_module(source.split(":")[0]), source.split(":")[1])).split()
        runs = {" ".join(words[i : i + 8]) for i in range(len(words) - 7)}
        assert not any(r in " ".join(d.split()) for d in docs for r in runs), source
    assert not any(names(d, "statistics.Fraction") or names(d, "textwrap.fill") for d in docs)
    assert any(names(d, "textwrap.indent") for d in docs)  # no passage shares its text
    assert train_draft.data_dir(train_draft.parse_args(["--doc-fraction", "0.25"])).endswith("-d0.25-k32-s0-xb")


# ---------------------------------------------------------------- benchmarks: the runs before the cost timing


def _cost_timing_fails(*a, **kw):
    raise RuntimeError("the cost timing failed")


def _fake_bench_draft(monkeypatch, target_name: str):
    """examples/bench_draft with a stand-in target (named ``target_name``), draft and decode: each run emits 3
    tokens in 4 rounds, the speculative ones twice as fast as plain."""
    bench_draft = load_example("bench_draft")
    tok = SimpleNamespace(encode_chat=lambda messages: [1, 2, 3], eos_ids=(0,))
    target = SimpleNamespace(tokenizer=tok, model=None, params=None, config=SimpleNamespace(name=target_name))
    monkeypatch.setattr(bench_draft.registry, "load", lambda *a, **kw: target)
    monkeypatch.setattr(bench_draft, "get_draft", lambda name, *a: SimpleNamespace(drafter=lambda: None, params=None))

    class Prepared:
        config = SimpleNamespace(slots=64)

        def __init__(self, gamma=0):
            self.gamma = gamma

        def run_timed(self):
            k = self.gamma
            stats = {"seconds": 0.1 if k else 0.2, "accepted_at": [1] * k, "proposed_at": [2] * k, "rounds": [4]}
            return SimpleNamespace(tokens=[[5, 6, 7]], lengths=[3], stats={**stats, "new_tokens": [3]})

    monkeypatch.setattr(bench_draft.dec, "prepare", lambda *a, gamma=0, **kw: Prepared(gamma))
    monkeypatch.setattr(bench_draft, "warm_up", lambda groups: 0)
    return bench_draft


def test_bench_draft_writes_its_runs_before_the_cost_timing(tmp_path, monkeypatch):
    """--json was written only after the cost timing that follows the decode runs: when that failed or was
    stopped, every measured run was lost. Now the runs' results are written first, the cost model's fields after."""
    bench_draft = _fake_bench_draft(monkeypatch, "fake")
    monkeypatch.setattr(bench_draft, "measure_costs", _cost_timing_fails)
    out = tmp_path / "runs.json"
    with pytest.raises(RuntimeError, match="cost timing"):
        bench_draft.main(["--drafts", "d", "--gammas", "2", "--repeats", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["extra"]["costs"] is None and res["extra"]["prompts"] == bench_draft.PROMPTS
    assert [p["order"] for p in res["passes"]] == [["plain", "d K=2"], ["d K=2", "plain"]]
    assert res["summary"]["chat b=1"]["ratios"]["d K=2 vs plain"]["by_pass"] == [2.0, 2.0]
    [row] = res["extra"]["rows"]
    assert (row["draft"], row["gamma"], row["speedup"], row["identical_to_plain"]) == ("d", 2, 2.0, True)
    assert row["accepted_at"] == [6, 6] and row["proposed_at"] == [12, 12] and "predicted_speedup" not in row
    assert not os.path.exists(str(out) + ".tmp")


def test_bench_eagle_writes_its_runs_before_the_cost_timing_and_refuses_an_ignored_dtype(tmp_path, monkeypatch):
    """--out was written only after the propose/verify timing that follows the decode runs: when that failed or
    was stopped, every measured run was lost. Now the runs are written first, the summary and cost model after.
    And a single non-default --packed-dtypes on an unpacked target (which ignores it) was taken silently."""
    bench_eagle = load_example("bench_eagle")
    tok = SimpleNamespace(encode_chat=lambda messages: [1, 2, 3], eos_ids=(0,))
    cfg = SimpleNamespace(vocab_size=16)
    monkeypatch.setattr(bench_eagle.registry, "load", lambda *a, **kw: (cfg, {"unpacked": True}, None, tok))
    monkeypatch.setattr(bench_eagle.llama, "is_packed", lambda params: False)
    with pytest.raises(SystemExit, match="--packed-dtypes float32: only a packed target"):
        bench_eagle.main(["--packed-dtypes", "float32"])

    head = SimpleNamespace(ecfg=SimpleNamespace(n=8))
    monkeypatch.setattr(bench_eagle.EG, "load_eagle", lambda *a, **kw: (head, (None, {})))
    monkeypatch.setattr(bench_eagle.EG, "read_meta", lambda h: {})
    monkeypatch.setattr(bench_eagle.EG, "param_count", lambda p: 0)
    monkeypatch.setattr(bench_eagle.dec, "prepare", lambda *a, gamma=0, **kw: gamma)

    def timed_run(gamma, programs):
        stats = {"new_tokens": [5], "seconds": 0.1, "prefill_seconds": 0.02, "tokens_per_s": 50.0 + gamma}
        stats.update(rounds=[2], accepted_at=[1] * gamma, proposed_at=[2] * gamma, compile_seconds=0.0)
        return SimpleNamespace(stats=stats, tokens=[[4, 5, 6, 7, 8]])

    monkeypatch.setattr(bench_eagle, "timed_run", timed_run)
    monkeypatch.setattr(bench_eagle, "time_round_parts", _cost_timing_fails)
    out = tmp_path / "runs.json"
    argv = ["--ks", "2", "--reps", "1", "--prompts", "1", "--temperatures", "0", "--out", str(out)]
    with pytest.raises(RuntimeError, match="cost timing"):
        bench_eagle.main(argv)
    res = json.loads(out.read_text())
    assert res["extra"]["results"] is None and res["extra"]["mismatches"] == [] and res["finished"] is None
    assert list(res["cells"]["T=0"]["configs"]) == ["plain", "ngram K=4", "eagle K=2"]
    [one_pass] = res["passes"]
    run = next(r for r in one_pass["runs"] if r["config"] == "eagle K=2")
    assert run["tokens_per_s"] == 50.0 and run["same_as_plain"] and run["tokens_per_round"] == 2.0
    assert res["summary"]["T=0"]["ratios"]["eagle K=2 vs plain"]["median"] == 1.0
    assert not os.path.exists(str(out) + ".tmp")


# ---------------------------------------------------------------- the suite scripts: lists, layers, --out, writes


# (script, its argument list, the flag the refusal names): refused when parsed, nothing loaded or written.
BAD_SUITE = [
    ("bench_sweeps", ["--ks", "1,2,"], "--ks"),  # a trailing comma crashed once the earlier groups had run
    ("bench_sweeps", ["--ks", "0,2"], "--ks"),
    ("bench_sweeps", ["--batches", "1,0"], "--batches"),
    ("bench_sweeps", ["--batches", "4,x"], "--batches"),
    ("bench_sweeps", ["--batches", "4,4"], "--batches"),
    ("bench_sweeps", ["--draft-layers", "-1"], "--draft-layers"),
    ("bench_sweeps", ["--skip-k", "--draft-layers", "2"], "--draft-layers"),
    ("bench_spec_vs_plain", ["--draft-layers", "-2"], "--draft-layers"),
    ("bench_spec_vs_plain", ["--gamma", "8", "--ngram-variants", "12;8"], "--ngram-variants"),
    ("bench_spec_vs_plain", ["--gamma", "8", "--ngram-variants", "8,3,1"], "--ngram-variants"),
    ("bench_spec_vs_plain", ["--ngram-variants", "12;12,3,1"], "--ngram-variants"),
    ("bench_spec_vs_plain", ["--ngram-variants", "8,4"], "--ngram-variants"),
    ("bench_spec_vs_plain", ["--peer-threads", "0"], "--peer-threads"),
    ("bench_chain_vs_tree", ["--rules", "deterministc"], "--rules"),
    ("bench_chain_vs_tree", ["--rules", "iid,iid"], "--rules"),
    ("bench_chain_vs_tree", ["--budgets", "5,1"], "--budgets"),  # K = 0
    ("bench_chain_vs_tree", ["--budgets", "3", "--widths", "4"], "--widths"),  # a root wider than the budget
    ("bench_chain_vs_tree", ["--budgets", "100"], "--budgets"),  # past the dynamic tree's pool
    ("bench_chain_vs_tree", ["--concurrency", "1,4"], "--concurrency"),  # 1 was dropped silently
    ("bench_chain_vs_tree", ["--concurrency", "0"], "--concurrency"),
    ("bench_chain_vs_tree", ["--draft-layers", "0"], "--draft-layers"),
    ("bench_serving", ["--closed", "1,x"], "--closed"),
    ("bench_serving", ["--closed", "0"], "--closed"),
    ("bench_serving", ["--rates", "0.5,-1"], "--rates"),
    ("bench_serving", ["--rates", "nan"], "--rates"),
    ("bench_serving", ["--closed", "", "--rates", ""], "--closed"),
    ("bench_selfspec", ["--settings", "4:1,4"], "--settings"),
    ("bench_selfspec", ["--settings", "4:0"], "--settings"),
    ("bench_selfspec", ["--settings", "4:2,4:2"], "--settings"),
    ("bench_sharded", ["--drafter", "plain", "--gamma", "4", "--devices", "0"], "--gamma"),  # was set to 0
    ("bench_sharded", ["--gamma", "0", "--devices", "0"], "--gamma"),
    ("eagle_agreement", ["--self-batches", "8"], "--self-batches"),  # ignored without --maps-from
    ("eagle_agreement", ["--head-tokens", "4096"], "--head-tokens"),
    ("eagle_agreement", ["--maps-from", "d", "--self-batches", "0"], "--self-batches"),
]


@pytest.mark.parametrize("script, argv, flag", BAD_SUITE, ids=[f"{s}{' '.join(['', *a])}" for s, a, _ in BAD_SUITE])
def test_bench_lists_and_flags_are_refused_before_the_model_loads(script, argv, flag, tmp_path, monkeypatch, capsys):
    from jspec.bench import targets

    monkeypatch.setattr(targets, "load_target", _no_model)
    test_bad_counts_are_refused_when_parsed(script, argv, flag, tmp_path, monkeypatch, capsys)


def test_list_flags_parse_what_they_should():
    from jspec.bench import args

    assert args.int_list("--ks", " 1, 2,8") == [1, 2, 8]
    assert args.int_list("--concurrency", "", least=2, empty_ok=True) == []
    assert args.rate_list("--rates", "0.5,4") == [0.5, 4.0]
    with pytest.raises(ValueError, match=r"--ks '': give at least one value"):
        args.int_list("--ks", "")
    with pytest.raises(ValueError, match="--rates '1,1.0' gives 1.0 twice"):
        args.rate_list("--rates", "1,1.0")
    with pytest.raises(ValueError, match="--rates 'inf': inf is not a rate"):
        args.rate_list("--rates", "inf")


def _fake_target(num_layers=30):
    cfg = SimpleNamespace(num_layers=num_layers, name="fake", vocab_size=100)
    return SimpleNamespace(name="fake", config=cfg, model=SimpleNamespace(vocab_size=100), params={}, dtype="float32")


def _jobs_prepared(*a, **kw):
    raise AssertionError("jobs prepared: the check passed")


@pytest.mark.parametrize("script", ["bench_spec_vs_plain", "bench_sweeps", "bench_chain_vs_tree"])
def test_draft_layers_are_checked_against_the_target_as_soon_as_it_loads(script, tmp_path, monkeypatch, capsys):
    """--draft-layers L >= the target's layers made a 'draft' of the whole target (or failed deep in the runs):
    refused once the target is known, before anything runs; L = layers - 1 passes the check."""
    from jspec.bench import suite_runs, targets

    mod = load_example(script)
    monkeypatch.setattr(targets, "load_target", lambda *a, **kw: _fake_target(30))
    monkeypatch.setattr(suite_runs, "prepare_jobs", _jobs_prepared)
    argv = ["--compile-cache", "none", "--out", str(tmp_path / "out"), "--peers", "none"]
    argv = argv if script == "bench_spec_vs_plain" else argv[:-2]
    with pytest.raises(SystemExit) as e:
        mod.main([*argv, "--draft-layers", "30"])
    assert e.value.code == 2
    assert "error: --draft-layers 30: the target has 30 layers" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="jobs prepared"):
        mod.main([*argv, "--draft-layers", "29"])


@pytest.mark.parametrize("script", ["bench_spec_vs_plain", "bench_sweeps", "bench_serving", "bench_chain_vs_tree"])
def test_an_unusable_out_is_refused_before_the_model_loads(script, tmp_path, monkeypatch, capsys):
    """--out was created only when the results were written, after every run: a file in its place lost them.
    Now it is created (or refused) first, as python -m jspec bench does."""
    from jspec.bench import targets

    mod = load_example(script)
    monkeypatch.setattr(targets, "load_target", _no_model)
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(SystemExit) as e:
        mod.main(["--compile-cache", "none", "--out", str(blocked / "out")])
    assert e.value.code == 2 and f"error: --out {blocked / 'out'}" in capsys.readouterr().err

    class Loaded(Exception):
        pass

    def load(*a, **kw):
        assert (tmp_path / "fresh").is_dir()  # made before the model loads
        raise Loaded

    monkeypatch.setattr(targets, "load_target", load)
    with pytest.raises(Loaded):
        mod.main(["--compile-cache", "none", "--out", str(tmp_path / "fresh")])


def _summary(out, dec):
    from jspec.bench import metrics

    return {**metrics.summarize_requests([], 1.0), "output_tokens_per_s": out, "decode_tokens_per_s": dec}


_MEMORY = dict(params_bytes=0, draft_params_bytes=0, cache_bytes=0, draft_state_bytes=0, device_bytes=0,
               max_rss_bytes=0, how="fake")  # fmt: skip


def _run(spec, out, dec, load=None, temperature=0.0, passes=None, group=None):
    """A finished run at canned rates (output, decode tok/s); ``passes``: [(output, decode)] per pass."""
    from jspec.bench import runspec

    extra = {} if group is None else {"group": group}
    if passes is not None:
        extra["passes"] = [{"output_tokens_per_s": o, "decode_tokens_per_s": d} for o, d in passes]
    stats = {"tokens_per_round": 2.0, "acceptance_rate": 0.5, "accepted_at": [1], "proposed_at": [2]}
    return runspec.RunResult(spec, load or runspec.Load.closed(1), runspec.Sampling(temperature), 8, [],
                             _summary(out, dec), stats, dict(_MEMORY), {}, extra=extra)  # fmt: skip


def _specs():
    from jspec.bench.runspec import Spec
    from jspec.ngram import NgramDrafter

    return Spec("plain", peer="plain"), Spec("ngram K=4", NgramDrafter(vocab_size=100), 4, peer="prompt_lookup")


def test_spec_vs_plain_writes_jspecs_runs_before_the_peers(tmp_path, monkeypatch):
    """The results were written only after the peers (slow, and they may fail): jspec's runs were lost with them.
    Now they are written first (peers_pending names the peers still to run)."""
    from jspec.bench import suite_peers, suite_runs, targets

    bench = load_example("bench_spec_vs_plain")

    plain, ngram = _specs()
    monkeypatch.setattr(targets, "load_target", lambda *a, **kw: _fake_target())
    monkeypatch.setattr(suite_runs, "prepare_jobs", lambda target, cfg: ([], {}))
    monkeypatch.setattr(suite_runs, "meta", lambda *a: {})
    monkeypatch.setattr(suite_runs, "run_specs", lambda *a, **kw: [_run(plain, 10.0, 10.0), _run(ngram, 20.0, 30.0)])

    def peers_fail(*a, **kw):
        raise RuntimeError("the peers failed")

    monkeypatch.setattr(suite_peers, "run_peer_set", peers_fail)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="peers failed"):
        bench.main(["--compile-cache", "none", "--out", str(out), "--peers", "transformers", "--concurrency", "1",
                    "--record", str(tmp_path / "r.json")])  # fmt: skip
    res = json.loads((out / "spec_vs_plain.json").read_text())
    assert [r["spec"]["label"] for r in res["runs"]] == ["plain", "ngram K=4"]
    assert res["peers"] == [] and res["peers_pending"] == ["transformers"]
    assert res["headline"][0].startswith("ngram K=4 @ closed c=1: 2.00x plain end-to-end, 3.00x decode")


def test_sweeps_write_each_group_with_its_own_prompt_set_and_take_the_median_pass(tmp_path, monkeypatch):
    """bench_sweeps wrote its results only at the end (a failing batch lost the K sweep), recorded the K sweep's
    prompt set for every batch group (which serve more requests at a large batch), and its points took pass 1
    where the headline gives the median: plain runs 10 tok/s in every pass, n-gram 30, 20 and 25 (ratios 3, 2,
    2.5: median 2.5; pass 1 alone 3)."""
    from jspec.bench import suite_runs, targets

    bench_sweeps = load_example("bench_sweeps")

    plain, ngram = _specs()
    monkeypatch.setattr(targets, "load_target", lambda *a, **kw: _fake_target())
    monkeypatch.setattr(suite_runs, "prepare_jobs", lambda target, cfg: ([], {"n_per_workload": cfg.n_per_workload}))
    monkeypatch.setattr(suite_runs, "meta", lambda target, cfg, desc: {"workloads": desc})
    groups = []

    def run_specs(target, specs, loads, jobs, cfg, group=None):
        groups.append(group)
        if group == "batch sweep b=16":
            raise RuntimeError("the b=16 group failed")
        passes = [(30.0, 60.0), (20.0, 40.0), (25.0, 50.0)]
        return [
            _run(plain, 10.0, 20.0, loads[0], passes=[(10.0, 20.0)] * 3, group=group),
            *[_run(s, 30.0, 60.0, loads[0], passes=passes, group=group) for s in specs[1:]],
        ]

    monkeypatch.setattr(suite_runs, "run_specs", run_specs)
    out = tmp_path / "out"
    argv = ["--compile-cache", "none", "--out", str(out), "--ks", "2", "--batches", "1,16", "--passes", "3", "--n", "2"]
    with pytest.raises(RuntimeError, match="b=16 group failed"):
        bench_sweeps.main(argv)
    assert groups == ["K sweep", "batch sweep b=1", "batch sweep b=16"]
    res = json.loads((out / "sweeps.json").read_text())
    assert [r["group"] for r in res["runs"]] == ["K sweep"] * 2 + ["batch sweep b=1"] * 2
    by_group = res["meta"]["workloads_by_group"]
    assert by_group == {"K sweep": {"n_per_workload": 2}, "batch sweep b=1": {"n_per_workload": 2}}
    [k_point] = res["sweeps"]["k"]
    assert k_point["speedup"] == pytest.approx(2.5) and k_point["speedup_end_to_end"] == pytest.approx(2.5)
    assert k_point["tokens_per_s"] == pytest.approx(25.0) and k_point["passes"] == 3
    assert "median 2.50x" in res["headline"][0]
    assert "medians over the 3 passes" in (out / "sweeps.md").read_text()


def test_sweeps_record_a_large_batch_groups_own_prompt_set(tmp_path, monkeypatch):
    """At batch 16 with 4 workloads the batch sweep serves 8 requests per workload (2 x batch in all), not
    --n 2: its group records that set, not the K sweep's."""
    from jspec.bench import report, suite_runs, targets

    bench_sweeps = load_example("bench_sweeps")

    monkeypatch.setattr(targets, "load_target", lambda *a, **kw: _fake_target())
    monkeypatch.setattr(suite_runs, "prepare_jobs", lambda target, cfg: ([], {"n_per_workload": cfg.n_per_workload}))
    monkeypatch.setattr(suite_runs, "meta", lambda target, cfg, desc: {"workloads": desc})
    monkeypatch.setattr(report, "write_results", lambda out, name, pl, plots: ({"markdown": "-"}, []))  # no plots

    def run_specs(target, specs, loads, jobs, cfg, group=None):
        return [_run(s, 10.0, 10.0, loads[0], group=group) for s in specs]

    monkeypatch.setattr(suite_runs, "run_specs", run_specs)
    out = tmp_path / "out"
    argv = ["--compile-cache", "none", "--out", str(out), "--skip-k", "--batches", "16", "--n", "2"]
    assert bench_sweeps.main([*argv, "--record", str(tmp_path / "r.json")]) == 0
    res = json.loads((out / "sweeps.json").read_text())
    assert res["meta"]["workloads_by_group"] == {"batch sweep b=16": {"n_per_workload": 8}}
    assert [p["n_per_workload"] for p in res["sweeps"]["batch"]] == [8, 8]


def test_sampled_runs_give_no_end_to_end_ratio():
    """At temperature > 0 the speculative and plain runs sample other outputs (other lengths, other stops), so
    their end-to-end rates are not over the same work (python -m jspec generate --compare says 'not like for
    like'): no end-to-end ratio in the headline, the results table, the cost table, against a peer, or in a
    sweep point; the decode ratio stays. The same runs at temperature 0 keep both (the control)."""
    from jspec.bench import headlines, peers, tables

    bench_sweeps = load_example("bench_sweeps")

    plain, ngram = _specs()
    peer = peers.PeerRun("transformers", "prompt_lookup", "transformers prompt-lookup K=4", True,
                         summary=_summary(15.0, 25.0),
                         info={"weights_dtype": "float32", "kv_cache_dtype": "float32", "device": "cpu", "gamma": 4,
                               "not_like_for_like": []})  # fmt: skip
    for t in (0.0, 0.8):
        p, s = _run(plain, 10.0, 20.0, temperature=t), _run(ngram, 30.0, 50.0, temperature=t)
        s.cost_model = {"measured_output_speedup": 3.0, "measured_speedup": 2.5}
        (line,) = headlines.headline([p, s], [peer])
        runs = [p.to_json(False), s.to_json(False)]
        row = next(r for r in tables.results_table(runs, "closed c=1").splitlines() if r.startswith("| ngram K=4"))
        cost = tables.cost_table(runs).splitlines()[2]
        peer_row = tables.peers_table(runs, [peer.to_json(False)]).splitlines()[2]
        point = bench_sweeps._point("ngram", s, p, "batch", 1)
        if t == 0:
            assert line.startswith("ngram K=4 @ closed c=1: 3.00x plain end-to-end, 2.50x decode")
            assert "vs transformers prompt-lookup K=4: 2.00x end-to-end, 2.00x decode" in line
            assert "| 3.00x |" in row and "| 3.00x |" in cost and "| 2.00x | 2.00x |" in peer_row
            assert point["speedup"] == pytest.approx(3.0) and point["end_to_end_note"] is None
            continue
        assert line.startswith("ngram K=4 @ closed c=1: 2.50x plain decode (end-to-end: not like for like at ")
        assert "temperature 0.8: the sampled outputs differ" in line and "3.00x" not in line
        assert "vs transformers prompt-lookup K=4: 2.00x decode (end-to-end: not like for like" in line
        assert "| - (sampled: not like for like) |" in row and "| 2.50x |" in row and "3.00x" not in row
        assert "| - (sampled: not like for like) |" in cost and "3.00x" not in cost
        assert "| - (sampled: not like for like) | 2.00x |" in peer_row
        assert point["speedup"] is None and point["speedup_end_to_end"] is None
        assert point["speedup_decode"] == pytest.approx(2.5) and "not like for like" in point["end_to_end_note"]
        table = bench_sweeps._sweep_tables([], [point])
        assert "- (sampled: not like for like) | 2.50x |" in table


def test_bench_selfspec_sizes_its_cache_from_the_prompts_before_any_training(monkeypatch):
    """bench_selfspec decoded into a hidden 256-slot cache: a longer prompt + --max-new-tokens failed in prepare,
    after --train had trained the adapters. The cache now holds the longest prompt + --max-new-tokens, and a
    request past the model's context (or an exit layer past its layers) is refused before any training."""
    bench_selfspec = load_example("bench_selfspec")

    def trained(*a, **kw):
        raise AssertionError("an adapter was looked up or trained")

    long_prompt = [1] * 300
    tok = SimpleNamespace(encode_chat=lambda messages: long_prompt)
    cfg = SimpleNamespace(num_layers=30, eos_ids=(0,), name="fake", max_positions=None, vocab_size=1000)
    monkeypatch.setattr(bench_selfspec, "load", lambda *a, **kw: (cfg, {}, None, tok))
    monkeypatch.setattr(bench_selfspec, "exit_params_for", trained)
    with pytest.raises(SystemExit) as e:
        bench_selfspec.main(["--settings", "30:1"])  # E=30 of 30 layers
    assert e.value.code == 2

    seen = {}

    class Prepared(Exception):
        pass

    def prepare(model, params, prompts, max_len=None, max_new_tokens=None, **kw):
        seen.update(max_len=max_len, max_new_tokens=max_new_tokens)
        raise Prepared

    monkeypatch.setattr(bench_selfspec, "exit_params_for", lambda *a: (None, None))
    monkeypatch.setattr(
        bench_selfspec, "LayerSkipDrafter", lambda *a, **kw: SimpleNamespace(draft_params=lambda *a: {})
    )
    monkeypatch.setattr(bench_selfspec, "prepare", prepare)
    with pytest.raises(Prepared):
        bench_selfspec.main(["--max-new-tokens", "96", "--adapter", "off"])
    assert seen["max_new_tokens"] == 96 and seen["max_len"] >= len(long_prompt) + 96 - 1


def test_bench_selfspec_refusals_name_their_flags(monkeypatch, capsys):
    bench_selfspec = load_example("bench_selfspec")
    tok = SimpleNamespace(encode_chat=lambda messages: [1] * 300)
    cfg = SimpleNamespace(num_layers=30, eos_ids=(0,), name="fake", max_positions=350, vocab_size=1000)
    monkeypatch.setattr(bench_selfspec, "load", lambda *a, **kw: (cfg, {}, None, tok))
    monkeypatch.setattr(bench_selfspec, "exit_params_for", _no_model)
    for argv, message in (
        (["--settings", "30:1", "--max-new-tokens", "8"], "error: --settings 30:1: exit layer E=30 must be below"),
        (["--max-new-tokens", "96"], "error: --max-new-tokens 96: the longest prompt (300 tokens) + 96 new tokens"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_selfspec.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_bench_draft_names_the_target_it_ran(tmp_path, monkeypatch, capsys):
    """The summary header said 'SmolLM2-135M' whatever --model ran."""
    bench_draft = _fake_bench_draft(monkeypatch, "other-model-7L")
    costs = {"target_step_ms": 1.0, "verify_ms": {2: 1.5}, "draft_ms": {"d": 0.2}}
    monkeypatch.setattr(bench_draft, "measure_costs", lambda *a: costs)
    bench_draft.main(["--drafts", "d", "--gammas", "2", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "other-model-7L f32, batch 1, greedy" in out and "SmolLM2" not in out
