"""The example scripts refuse counts they cannot use when they parse their arguments, before any model loads and
before anything is written, where they used to fail (or silently do nothing) after compiling, after generating
the training data, or after recording a run's settings that then blocked the corrected rerun. And the
benchmarks write their measured runs before the cost-model timing that comes after them. No model runs here."""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from models import registry  # noqa: E402


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded: the arguments must be refused before that")


# (script, its argument list, the flag the refusal names). Train scripts: parse_args; benchmarks: main.
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
    mod = importlib.import_module(script)
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
    import train_draft
    import train_eagle
    import train_early_exit

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
    import train_early_exit as T

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
    import train_draft

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(train_draft, "docstring_prompts", lambda: [f"doc {i}" for i in range(300)])
    monkeypatch.setattr(train_draft.registry, "load", _no_model)
    n = len(train_draft.chat_prompts()) * 4 // 3  # a quarter of them docstrings, the default
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
    import train_draft

    monkeypatch.setattr(train_draft, "docstring_prompts", lambda: [f"doc {i}" for i in range(100)])
    n_chat = len(train_draft.chat_prompts())
    with pytest.raises(SystemExit, match=rf"--doc-fraction 0.5 asks for {n_chat} docstring requests .* gives 100"):
        train_draft.training_prompts(0, 0.5)
    most = 100 / (n_chat + 100)
    assert len(train_draft.training_prompts(0, int(most * 1000) / 1000)) <= n_chat + 100
    assert len(train_draft.training_prompts(0, 0.1)) == n_chat + round(n_chat / 9)


# ---------------------------------------------------------------- benchmarks: the runs before the cost timing


def _cost_timing_fails(*a, **kw):
    raise RuntimeError("the cost timing failed")


def test_bench_draft_writes_its_runs_before_the_cost_timing(tmp_path, monkeypatch):
    """--json was written only after the cost timing that follows the decode runs: when that failed or was
    stopped, every measured run was lost. Now the runs' results are written first, the cost model's fields after."""
    import bench_draft

    tok = SimpleNamespace(encode_chat=lambda messages: [1, 2, 3], eos_ids=(0,))
    target = SimpleNamespace(tokenizer=tok, model=None, params=None)
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
    monkeypatch.setattr(bench_draft, "measure_costs", _cost_timing_fails)
    out = tmp_path / "runs.json"
    with pytest.raises(RuntimeError, match="cost timing"):
        bench_draft.main(["--drafts", "d", "--gammas", "2", "--repeats", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["costs"] is None and res["prompts"] == bench_draft.PROMPTS
    [row] = res["rows"]
    assert (row["draft"], row["gamma"], row["speedup"], row["identical_to_plain"]) == ("d", 2, 2.0, True)
    assert row["accepted_at"] == [6, 6] and row["proposed_at"] == [12, 12] and "predicted_speedup" not in row
    assert not os.path.exists(str(out) + ".tmp")


def test_bench_eagle_writes_its_runs_before_the_cost_timing_and_refuses_an_ignored_dtype(tmp_path, monkeypatch):
    """--out was written only after the propose/verify timing that follows the decode runs: when that failed or
    was stopped, every measured run was lost. Now the runs are written first, the summary and cost model after.
    And a single non-default --packed-dtypes on an unpacked target (which ignores it) was taken silently."""
    import bench_eagle

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
    assert res["results"] is None and res["mismatches"] == []
    assert sorted(res["runs"]) == ["eagle K=2 T=0", "ngram K=4 T=0", "plain T=0"]
    [run] = res["runs"]["eagle K=2 T=0"]
    assert run["tokens_per_s"] == 52.0 and run["same_as_plain"] and run["accepted_at"] == [1, 1]
    assert not os.path.exists(str(out) + ".tmp")
