"""The draft and early-exit trainers resume a checkpoint, or reuse a finished result, only when it was made with
the same settings (as the EAGLE trainer does), and the early-exit trainer holds out whole sequences and counts its
head rows on training text only. No training runs here: the checks, the split and the count are called directly.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from models.training import draft as train_draft
from models.training import eagle as train_eagle
from models.training import early_exit as T
from models.training import runs as RS
from models.training.prompts import DRAFT_EVAL_PROMPTS


def _no_model(*args, **kwargs):
    raise RuntimeError("the model was loaded: the settings check must refuse before that")


# ---------------------------------------------------------------- the shared helper


def test_a_checkpoint_folder_without_a_finished_step_holds_nothing(tmp_path):
    """ocp.CheckpointManager creates its folder before the first save, and writes a step under a temporary name
    until it is complete: only a folder named by its step number is a checkpoint to resume."""
    ckpt = tmp_path / "ckpt"
    assert not RS.has_checkpoint(str(ckpt))
    ckpt.mkdir()
    assert not RS.has_checkpoint(str(ckpt))
    (ckpt / "20.orbax-checkpoint-tmp-1234").mkdir()
    assert not RS.has_checkpoint(str(ckpt))
    (ckpt / "20").mkdir()
    assert RS.has_checkpoint(str(ckpt))


# ---------------------------------------------------------------- the draft trainer


def test_draft_trainer_refuses_a_checkpoint_or_draft_made_with_other_settings(tmp_path):
    """A checkpoint under --name was resumed, and a finished draft reused, whatever settings made them; now the
    first run records its settings and a later one with other values is refused, naming each (recorded value
    first), unless only settings that leave the draft unchanged differ."""
    P = train_draft.parse_args
    out = str(tmp_path / "run")
    train_draft.check_same_run(P(["--lr", "5e-4"]), out)  # nothing saved: recorded
    os.makedirs(os.path.join(out, "ckpt"))  # the manager's folder, before its first save: still nothing saved
    train_draft.check_same_run(P(["--lr", "1e-3"]), out)  # so this run's settings replace those
    with open(os.path.join(out, "args.json")) as f:
        recorded = json.load(f)
    assert recorded["lr"] == 0.001 and "name" not in recorded and "ckpt_every" not in recorded

    os.makedirs(os.path.join(out, "ckpt", "20"))  # its first checkpoint
    train_draft.check_same_run(P(["--lr", "1e-3"]), out)  # the same run again (a resume): accepted
    same = ["--lr", "1e-3", "--ckpt-every", "5", "--gamma", "5", "--eval-max-new", "8", "--no-eval", "--data-only"]
    train_draft.check_same_run(P(same + ["--teacher-batch", "2"]), out)
    with pytest.raises(SystemExit, match=r"other settings \(epochs: 4 there, 6 here\)"):
        train_draft.check_same_run(P(["--lr", "1e-3", "--epochs", "6"]), out)
    with pytest.raises(SystemExit) as e:
        train_draft.check_same_run(P(["--gen-batches", "3", "--head-size", "4096"]), out)
    msg = str(e.value)
    assert "gen_batches: 8 there, 3 here, head_size: 8192 there, 4096 here, lr: 0.001 there, 0.002 here" in msg
    assert "another --name" in msg and "--force" in msg

    # A draft saved before args.json existed: its draft.json keeps the arguments it was trained with.
    old = tmp_path / "old"
    (old / "draft").mkdir(parents=True)
    args = dict(vars(P(["--layers", "3"])), name="old", ckpt_every=7)
    (old / "draft" / "draft.json").write_text(json.dumps({"extra": {"args": args}}))
    train_draft.check_same_run(P(["--layers", "3", "--name", "old"]), str(old))
    with pytest.raises(SystemExit, match=r"other settings \(layers: 3 there, 2 here\)"):
        train_draft.check_same_run(P([]), str(old))


def test_draft_trainer_main_refuses_before_loading_the_model(tmp_path, monkeypatch):
    """A finished draft under the name was printed as this run's result (and a checkpoint resumed) with any
    settings: main now refuses before it loads the target."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(train_draft.registry, "load", _no_model)
    run = tmp_path / "draft" / "mine"
    (run / "draft").mkdir(parents=True)
    (run / "draft" / "draft.json").write_text("{}")
    (run / "eval.json").write_text(json.dumps({"gamma": 3, "eval": {}}))
    (run / "args.json").write_text(json.dumps({"model": "smollm2", "lr": 0.002, "steps": 0}))
    with pytest.raises(SystemExit, match=r"draft/mine holds a draft .* \(steps: 0 there, 40 here\)"):
        train_draft.main(["--name", "mine", "--steps", "40", "--no-eval"])
    # The same settings: reused (its evaluation, none here, is not made with --no-eval).
    assert train_draft.main(["--name", "mine", "--gamma", "4", "--no-eval"]) == {"gamma": 3, "eval": {}}


def _fake_draft_eval(gamma):
    row = {"acceptance_rate": 0.5, "tokens_per_round": 1.5, "per_position": [0.5] * gamma, "new_tokens": 10}
    return {"greedy": row, "T=1": row}


def test_a_finished_draft_is_evaluated_again_not_retrained(tmp_path, monkeypatch, capsys):
    """eval.json was written under --no-eval too, with "eval": {}, and marked the draft finished: every later run
    printed that empty evaluation; and a cached draft was printed with its evaluation at the old K whatever --gamma
    or --eval-max-new this run gave. Now a finished draft is never retrained: it is evaluated (the saved draft,
    with this run's settings) when it has no evaluation or one made with other settings, and --no-eval only
    prints what there is. Its training report (draft.json) stands in for a missing eval.json."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    run = tmp_path / "draft" / "run"
    (run / "draft").mkdir(parents=True)
    kept = {"name": "run", "gamma": 3, "train_seconds": 120.0, "kl_start": 2.5, "kl_end": 0.75}
    kept["val"] = {"kl": 0.9, "agree": 0.6, "support": 0.95}
    args = json.loads(json.dumps(vars(train_draft.parse_args(["--name", "run", "--no-eval"]))))
    meta = {"format": 1, "extra": {"args": args, "report": kept}}
    (run / "draft" / "draft.json").write_text(json.dumps(meta))
    loads, evals = [], []
    target = SimpleNamespace(config="CONFIG", tokenizer="TOKENIZER")
    monkeypatch.setattr(train_draft.registry, "load", lambda *a, **kw: loads.append(a) or target)
    monkeypatch.setattr(train_draft.D, "load_draft", lambda path, **kw: ("LOADED", path, kw["target_config"]))

    def fake_evaluate(target, loaded, gamma, max_new, seed=0):
        evals.append((target, loaded, gamma, max_new, seed))
        return _fake_draft_eval(gamma)

    monkeypatch.setattr(train_draft, "evaluate", fake_evaluate)

    report = train_draft.main(["--name", "run", "--no-eval"])
    assert (loads, evals) == ([], []) and report == {**kept, "eval": {}}
    assert "not evaluated (--no-eval)" in capsys.readouterr().out
    assert not (run / "eval.json").exists()

    report = train_draft.main(["--name", "run"])
    assert evals == [(target, ("LOADED", str(run / "draft"), "CONFIG"), 3, 64, 0)] and len(loads) == 1
    assert report["kl_start"] == 2.5 and report["train_seconds"] == 120.0 and report["val"] == kept["val"]
    saved = json.loads((run / "eval.json").read_text())
    assert saved["eval"] == _fake_draft_eval(3) and saved["eval_settings"]["gamma"] == 3
    assert saved["eval_settings"]["eval_max_new"] == 64 and saved["eval_settings"]["prompts"] == DRAFT_EVAL_PROMPTS
    assert json.loads((run / "draft" / "draft.json").read_text()) == meta  # not retrained

    train_draft.main(["--name", "run"])  # evaluated with these settings: printed only
    assert len(evals) == 1
    report = train_draft.main(["--name", "run", "--gamma", "5"])
    assert evals[1][2:] == (5, 64, 0) and report["gamma"] == 5 and report["eval"] == _fake_draft_eval(5)
    capsys.readouterr()
    report = train_draft.main(["--name", "run", "--gamma", "5", "--eval-max-new", "192", "--no-eval"])
    assert len(evals) == 2 and report["eval"] == _fake_draft_eval(5)
    assert "evaluated with other settings: eval_max_new; --no-eval" in capsys.readouterr().out
    train_draft.main(["--name", "run", "--eval-max-new", "192"])  # gamma back to 3 as well
    assert evals[2][2:] == (3, 192, 0)

    # An eval.json written before the settings were recorded (by the run that trained the draft, with its
    # arguments), and one that a --no-eval run wrote with an empty evaluation.
    legacy = {"name": "run", "gamma": 3, "kl_start": 2.5, "eval": _fake_draft_eval(3)}
    (run / "eval.json").write_text(json.dumps(legacy))
    assert train_draft.main(["--name", "run"]) == legacy and len(evals) == 3
    train_draft.main(["--name", "run", "--eval-max-new", "32"])
    assert evals[3][2:] == (3, 32, 0)
    (run / "eval.json").write_text(json.dumps({**legacy, "eval": {}}))
    assert train_draft.main(["--name", "run"])["eval"] == _fake_draft_eval(3) and len(evals) == 5


def test_a_resumed_draft_run_keeps_the_metrics_of_the_steps_before_it(tmp_path):
    """Checkpoints kept no training metrics: a resumed run reported kl_start at the resume step, and a run stopped
    while validating or evaluating (resumed at its last checkpoint) made no step and wrote NaN kl_start, kl_end and
    agree_end. Now the metrics and seconds are kept next to each checkpoint and read back on a resume (train, on a
    tiny target: 4 steps, then a rerun that resumes at step 4)."""
    import jax

    from models.llama import LlamaConfig, init_random_params

    # The history file's helpers (models.training.runs, shared with the EAGLE trainer) are tested in
    # test_train_eagle_cache.
    hist = [{"kl": float(v), "agree": v / 10, "support": 1.0} for v in range(1, 5)]  # steps 0-3
    none = train_draft.training_summary([], 4)
    assert none["kl_start"] is None and none["metrics_steps"] == 0
    assert "no training step recorded (the checkpoint of step 4" in train_draft.summary_line("run", none)
    json.dumps(none, allow_nan=False)  # no NaN in the report
    assert "KL since step 2 1.000 -> 4.000" in train_draft.summary_line("r", train_draft.training_summary(hist, 2))

    cfg = LlamaConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, ffn=32)
    target = SimpleNamespace(config=cfg, params=init_random_params(cfg, jax.random.key(0), std=0.3), tokenizer=None)
    rng = np.random.default_rng(0)
    n, w, k = 8, 16, 4
    lengths = np.full(n, w, np.int32)
    t_logp = np.log(rng.dirichlet(np.ones(k), size=(n, w))).astype(np.float16)
    data = {
        "tokens": rng.integers(0, 32, (n, w)).astype(np.int32),
        "lengths": lengths,
        "prompt_lengths": np.full(n, 4, np.int32),
        "mask": np.ones((n, w), bool),
        "t_logp": t_logp,
        "t_ids": np.argsort(rng.random((n, w, 32)), axis=-1)[..., :k].astype(np.int32),
    }
    args = train_draft.parse_args(
        ["--layers", "1", "--head-size", "0", "--batch", "2", "--steps", "4", "--ckpt-every", "2"]
    )
    out = str(tmp_path / "run")
    _, _, history, from_step, seconds = train_draft.train(args, target, data, out)
    assert len(history) == 4 and from_step == 0 and seconds > 0
    first = train_draft.training_summary(history, from_step)
    # Rerun (the first stopped after its last checkpoint): no step left, the metrics are the first run's.
    _, _, again, from_step, seconds_again = train_draft.train(args, target, data, out)
    with open(os.path.join(out, "ckpt_history.json")) as f:
        kept = json.load(f)
    assert kept["step"] == 4 and kept["history"] == history and kept["seconds"] <= seconds
    assert again == history and from_step == 0 and seconds_again >= kept["seconds"]
    assert train_draft.training_summary(again, from_step) == first and first["kl_start"] == history[0]["kl"]


# ---------------------------------------------------------------- the early-exit trainer


def test_early_exit_trainer_refuses_features_checkpoints_or_a_result_made_with_other_settings(tmp_path):
    P = T.parse_args
    out = str(tmp_path / "smollm2-E4-F512-N8192")
    work = out + ".work"
    T.check_same_run(P(["--steps", "50"]), out, work)  # nothing saved: recorded
    os.makedirs(os.path.join(work, "ckpt"))  # the manager's folder, before its first save
    T.check_same_run(P([]), out, work)  # still nothing saved: this run's settings replace those
    with open(os.path.join(work, "args.json")) as f:
        assert json.load(f)["steps"] == 300

    open(os.path.join(work, "features.npz"), "wb").close()  # features are computed for this run's data and rows
    T.check_same_run(P([]), out, work)
    T.check_same_run(P(["--eval-k", "2", "--eval-new-tokens", "8", "--no-eval"]), out, work)
    with pytest.raises(SystemExit) as e:
        T.check_same_run(P(["--lr", "1e-3", "--seed", "1"]), out, work)
    assert "other settings (lr: 0.002 there, 0.001 here, seed: 0 there, 1 here)" in str(e.value)
    assert "--force" in str(e.value)
    os.remove(os.path.join(work, "features.npz"))
    os.makedirs(os.path.join(work, "ckpt", "50"))  # a checkpoint alone counts too
    with pytest.raises(SystemExit, match=r"other settings \(doc_prompts: 36 there, 10 here\)"):
        T.check_same_run(P(["--doc-prompts", "10"]), out, work)

    # Features or checkpoints left by a run that recorded nothing: their head rows were counted the old way.
    os.remove(os.path.join(work, "args.json"))
    with pytest.raises(SystemExit, match="settings were not recorded"):
        T.check_same_run(P([]), out, work)

    # A finished result: its meta.json records the settings; one written before that names the schedule.
    os.makedirs(out)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"exit_layer": 4, "args": {"steps": 300, "lr": 0.002, "new_tokens": 64}}, f)
    T.check_same_run(P(["--new-tokens", "64", "--no-eval"]), out, work)
    with pytest.raises(SystemExit, match=r"holds an exit adapter trained with other settings \(new_tokens: 64 there"):
        T.check_same_run(P([]), out, work)
    legacy = {"model": "smollm2", "exit_layer": 4, "steps": 300, "batch": 512, "lr": 0.002, "adapter_width": 512}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(dict(legacy, head_tokens=8192, train_tokens=12000), f)
    T.check_same_run(P(["--seed", "3"]), out, work)  # not recorded then: nothing to compare it with
    with pytest.raises(SystemExit, match=r"other settings \(batch: 512 there, 256 here, steps: 300 there, 400 here\)"):
        T.check_same_run(P(["--batch", "256", "--steps", "400"]), out, work)


def test_early_exit_trainer_main_refuses_a_cached_result_before_loading_the_model(tmp_path, monkeypatch):
    """A cached adapter was evaluated as this run's result whatever --steps/--lr/... this run asked for."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "load", _no_model)
    out = tmp_path / "early_exit" / "smollm2-E4-F512-N8192"
    out.mkdir(parents=True)
    (out / "meta.json").write_text(json.dumps({"exit_layer": 4, "args": {"steps": 300, "lr": 0.002}}))
    with pytest.raises(SystemExit, match=r"\(steps: 300 there, 400 here\)"):
        T.main(["--steps", "400", "--no-eval"])


def test_early_exit_text_cache_follows_gen_batch_and_is_written_atomically(tmp_path, monkeypatch):
    """The cached text's file name left out --gen-batch, on which the text depends (rows of a batch share its
    padding, seed and order): a run with another one read text it would not have written. And the file was written
    in place: a run stopped while writing it left a half file that every later run failed to read. Now the name
    has the batch and the file appears whole (written to .tmp, then renamed)."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    calls = []

    def fake_generate(cfg, params, model, tok, n_doc, new_tokens, batch):
        calls.append(batch)
        return [[1, 2, batch]] if batch != 3 else [[1, 2], [3, object()]]  # an object: the write fails midway

    monkeypatch.setattr(T, "generate_data", fake_generate)
    P = T.parse_args
    assert T.cached_text(P([]), None, None, None, None) == [[1, 2, 16]]
    assert T.cached_text(P(["--gen-batch", "8"]), None, None, None, None) == [[1, 2, 8]]  # not batch 16's text
    assert T.cached_text(P([]), None, None, None, None) == [[1, 2, 16]] and calls == [16, 8]  # cached
    assert T.data_file(P(["--gen-batch", "8"])) != T.data_file(P([]))
    assert os.path.basename(T.data_file(P([]))) == "data-smollm2-d36-n128-b16.json"

    with pytest.raises(TypeError):
        T.cached_text(P(["--gen-batch", "3"]), None, None, None, None)
    assert not os.path.exists(T.data_file(P(["--gen-batch", "3"])))  # no half file for the next run to read
    assert sorted(os.listdir(tmp_path / "early_exit")) == [
        "data-smollm2-d36-n128-b16.json",
        "data-smollm2-d36-n128-b3.json.tmp",
        "data-smollm2-d36-n128-b8.json",
    ]


def test_early_exit_holds_out_whole_sequences():
    """The held-out tokens were the last max(256, M // 10) token positions, a cut that fell inside a sequence
    (its start trained on, its end held out); now they are the fewest last whole sequences that hold as many."""
    from models.training.early_exit import heldout_split

    # 19 tokens, at least 6 held out: the last sequence (4) is short of 6, the last two (3 + 4) are not.
    assert heldout_split([5, 7, 3, 4], min_tokens=6) == 2
    assert heldout_split([5, 7, 3, 4], min_tokens=4) == 3  # the last sequence alone holds 4
    assert heldout_split([5, 7, 3, 4], min_tokens=1000) == 1  # one sequence is always left to train on
    # 100 sequences of 30 tokens: a tenth (300 > 256) is 10 sequences.
    assert heldout_split([30] * 100) == 90
    # 20 sequences of 30 tokens: 600 // 10 = 60 < 256, so 256 tokens: 9 sequences (270) held out.
    assert heldout_split([30] * 20) == 11
    with pytest.raises(ValueError):
        heldout_split([50])


def test_early_exit_head_rows_are_counted_on_training_text_only():
    """The head rows were counted on every generated sequence, held-out ones included, and on every stdlib
    paragraph, those quoted by held-out prompts included."""
    from models.training.early_exit import split_and_head_rows, training_paragraphs

    seqs = [[1, 1, 1, 2], [3, 3, 1], [4, 4, 4, 4, 4], [5, 5, 5]]  # 3 + 2 + 4 + 2 = 11 positions with a next token
    texts = ["chat a", "chat b", "Summarize:\n\nBETA para", "chat d"]
    paras = ["ALPHA para", "BETA para"]
    tok = SimpleNamespace(encode={"ALPHA para": [6] * 6, "BETA para": [7] * 8}.__getitem__)
    assert training_paragraphs(paras, texts[2:]) == ["ALPHA para"]

    # At least 5 held out: the last two sequences (2 + 4 = 6). Training text: 1 x4, 2 x1, 3 x2, and ALPHA's 6 x6;
    # EOS (9) is forced to the top. Held out (never counted): 4 x5, 5 x3, BETA's 7 x8.
    n_train, ids = split_and_head_rows(tok, seqs, texts, paras, 3, eos_id=9, vocab=10, min_tokens=5)
    assert n_train == 2
    np.testing.assert_array_equal(ids, [1, 6, 9])
    # Six rows: then 3 (2), 2 (1), and the first unseen id in merge order, 0 (not the held-out 4, 5 or 7).
    _, ids = split_and_head_rows(tok, seqs, texts, paras, 6, eos_id=9, vocab=10, min_tokens=5)
    np.testing.assert_array_equal(ids, [0, 1, 2, 3, 6, 9])


# ---------------------------------------------------------------- the EAGLE trainer, on the shared helper


def test_eagle_trainer_check_on_the_shared_helper(tmp_path):
    """train_eagle.check_same_run calls models.training.runs (once examples/_run_settings.py): the same behaviour,
    including a head made before args.json existed, compared with the arguments in its eval.json (and not recorded
    over)."""
    P = train_eagle.parse_args
    out, ev = str(tmp_path / "run"), str(tmp_path / "run" / "eval.json")
    train_eagle.check_same_run(P(["--lr", "5e-4"]), out, ev)
    train_eagle.check_same_run(P(["--lr", "3e-4"]), out, ev)  # nothing saved: replaced
    os.makedirs(os.path.join(out, "ckpt", "50"))
    train_eagle.check_same_run(P(["--lr", "3e-4", "--ckpt-every", "10", "--gamma", "5"]), out, ev)
    with pytest.raises(SystemExit, match=r"holds a head trained with other settings \(lr: 0.0003 there, 0.001 here\)"):
        train_eagle.check_same_run(P(["--lr", "1e-3"]), out, ev)

    old = tmp_path / "old"
    (old / "head").mkdir(parents=True)
    (old / "eval.json").write_text(json.dumps({"args": {"lr": 5e-4, "epochs": 1, "gamma": 9, "name": "old"}}))
    train_eagle.check_same_run(P(["--lr", "5e-4", "--epochs", "1"]), str(old), str(old / "eval.json"))
    assert not (old / "args.json").exists()
    with pytest.raises(SystemExit, match=r"\(epochs: 1 there, 3 here\)"):
        train_eagle.check_same_run(P(["--lr", "5e-4"]), str(old), str(old / "eval.json"))
