"""The EAGLE trainer's caches and reruns (``models.training.eagle``), on its helpers (no model run, no training):
fused-layer files follow the tokens of their data file, templated batches store and re-check their requests, a
finished head is evaluated again (never retrained) when it was not evaluated or the evaluation settings changed and
keeps its training metrics, a resume keeps the metrics of the steps before it, the teacher-forced evaluation
measures the run's --unroll passes, and cut docstring passages are reported."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from test_eagle import TINY, TINY_PARAMS, random_head

from models.eagle import EagleConfig, EagleDrafter
from models.training import eagle as train_eagle
from models.training import eagle_data, eagle_eval, runs
from models.training.prompts import EAGLE_EVAL_PROMPTS


def _token_features(calls):
    """A stand-in for ``feature_fn``: every feature of a position is its token id, so what a file was computed
    from is read off its values; ``calls`` counts the passes."""

    def feature_fn(cfg, layers=()):
        def features(params, tokens):
            calls.append(np.asarray(tokens).shape)
            width = (len(layers) or 1) * cfg.hidden
            return np.repeat(np.asarray(tokens)[..., None], width, axis=-1).astype(np.float32)

        return features

    return feature_fn


def test_layer_files_follow_their_data_files_tokens(tmp_path, monkeypatch):
    """A layer file was reused whenever it existed: a batch written again (deleted, regenerated) was paired with
    the fused-layer features of its old tokens. Now a layer file records its tokens' digest and is computed
    again when they differ, or when it predates the digest; with the same tokens it is reused."""
    calls = []
    monkeypatch.setattr(eagle_data, "feature_fn", _token_features(calls))
    target = SimpleNamespace(config=SimpleNamespace(hidden=2), params=None)
    args = SimpleNamespace(fuse=(0, 2), feature_batch=2)
    data = str(tmp_path / "batch_0000.npz")
    old = np.arange(2 * 32, dtype=np.int32).reshape(2, 32)
    lengths = np.array([32, 20], np.int32)  # the widest row fills the width: every column is computed
    np.savez(data, tokens=old, lengths=lengths)
    [path] = eagle_data.layer_files(args, target, [data])
    assert path == str(tmp_path / "batch_0000.layers0-2.npz") and len(calls) == 1
    feats = np.load(path)["layer_feats"]
    assert feats.shape == (2, 32, 4)
    np.testing.assert_array_equal(feats[..., 3], old)

    eagle_data.layer_files(args, target, [data])  # the same tokens: reused
    assert len(calls) == 1

    new = old + 100  # the batch written again
    np.savez(data, tokens=new, lengths=lengths)
    eagle_data.layer_files(args, target, [data])
    assert len(calls) == 2
    np.testing.assert_array_equal(np.load(path)["layer_feats"][..., 0], new)  # was old's

    np.savez(path, layer_feats=np.zeros((2, 32, 4), np.float16))  # made before the digest was recorded
    eagle_data.layer_files(args, target, [data])
    assert len(calls) == 3
    np.testing.assert_array_equal(np.load(path)["layer_feats"][..., 1], new)

    same_values = new.astype(np.int64)  # a digest covers the dtype too: other bytes, other file
    assert eagle_data.tokens_digest(same_values, lengths) != eagle_data.tokens_digest(new, lengths)
    assert eagle_data.tokens_digest(new, lengths) == eagle_data.tokens_digest(new.copy(), lengths.copy())
    assert eagle_data.tokens_digest(new, lengths) != eagle_data.tokens_digest(new, lengths - 1)


class _Tok:
    """Chat-encodes a request as its characters' codes after two template ids; EOS is 0."""

    eos_ids = (0,)

    def encode_chat(self, messages, add_generation_prompt=True):
        ids = [1, 2]
        for m in messages:
            ids += [3 + ord(c) % 90 for c in m["content"]]
        return ids


def test_templated_batches_store_and_recheck_their_requests(tmp_path, monkeypatch):
    """Which requests land in a templated batch depends on the Python version (its docstrings are shuffled with
    the generator that then orders the chat requests), and batch files stored none: another Python reused them
    for other requests. Now each batch stores its requests and a rerun whose order differs is refused naming the
    file; a file from before they were stored is checked on its prompt tokens."""
    order = ["alpha", "bravo", "charlie", "delta"]
    monkeypatch.setattr(eagle_data, "training_prompts", lambda seed: list(order))
    monkeypatch.setattr(eagle_data, "feature_fn", _token_features([]))
    decoded = []

    def fake_decode(model, params, prompts, **kw):
        decoded.append(len(prompts))
        return SimpleNamespace(tokens=[[7, 0]] * len(prompts), stats={"new_tokens": [2] * len(prompts)})

    monkeypatch.setattr(eagle_data.dec, "decode", fake_decode)
    target = SimpleNamespace(tokenizer=_Tok(), config=SimpleNamespace(hidden=2), params=None, model=None)
    args = SimpleNamespace(
        seed=0, gen_batch=2, gen_batches="2", max_prompt=16, max_new=4, temperature=0.8, feature_batch=2
    )
    files = eagle_data.generate_data(args, target, str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["batch_0000.npz", "batch_0001.npz"] and decoded == [2, 2]
    assert [str(p) for p in np.load(files[0])["prompts"]] == ["alpha", "bravo"]
    assert [str(p) for p in np.load(files[1])["prompts"]] == ["charlie", "delta"]
    with np.load(files[0]) as d:  # the prompt tokens are the template then the request's codes
        np.testing.assert_array_equal(
            d["tokens"][1, : d["prompt_lengths"][1]], [1, 2] + [3 + ord(c) % 90 for c in "bravo"]
        )

    assert eagle_data.generate_data(args, target, str(tmp_path)) == files  # the same order: reused
    assert decoded == [2, 2]
    order[:] = ["alpha", "charlie", "bravo", "delta"]  # another Python's order
    with pytest.raises(SystemExit, match=r"batch_0000.npz answers other requests .* \(row 1: this run's is 'charlie'"):
        eagle_data.generate_data(args, target, str(tmp_path))

    with np.load(files[0]) as d:  # batch_0000 as written before the requests were stored
        legacy = {k: d[k] for k in d.files if k != "prompts"}
    np.savez(files[0], **legacy)
    with pytest.raises(SystemExit, match=r"batch_0000.npz answers other requests .* \(row 1: this run's is 'charlie'"):
        eagle_data.generate_data(args, target, str(tmp_path))
    order[:] = ["alpha", "bravo", "charlie", "delta"]  # the order that wrote it: its prompt tokens match
    assert eagle_data.generate_data(args, target, str(tmp_path)) == files
    assert decoded == [2, 2]


def _fake_eval(gamma):
    row = {
        "acceptance_rate": 0.5,
        "tokens_per_round": 1.5,
        "survival": [0.5] * gamma,
        "conditional": [0.5] * gamma,
        "new_tokens": 10,
        "coverage": 1.0,
    }
    return {"greedy": {**row, "teacher_forced": [0.4, 0.3, 0.2]}, "T=1": row}


def test_a_finished_head_is_evaluated_again_not_retrained(tmp_path, monkeypatch, capsys):
    """After a --no-eval run (or one that stopped while evaluating) the rerun took the training path: it resumed
    at the last step, ran none, and rewrote meta.json with NaN metrics and ~0 s. A cached head whose evaluation
    was made with another --gamma or --eval-max-new printed and exported that one. Now a finished head is never
    retrained: its report (the metrics meta.json keeps) is evaluated when it has no evaluation or other
    evaluation settings, and --no-eval only prints what there is."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    head = tmp_path / "eagle" / "run" / "head"
    head.mkdir(parents=True)
    kept = {"name": "run", "gamma": 4, "train_seconds": 480.0, "loss_start": 2.5, "loss_end": 1.25}
    kept["args"] = json.loads(json.dumps(vars(train_eagle.parse_args(["--name", "run", "--no-eval"]))))
    meta = {**kept, "format": 1, "kind": "eagle", "config": {}, "adapter_width": 0, "head_tokens": 8192}
    (head / "meta.json").write_text(json.dumps(meta))
    loads, evals = [], []
    monkeypatch.setattr(train_eagle.registry, "load", lambda *a, **kw: loads.append(a) or "TARGET")

    def fake_evaluate(target, path, gamma, max_new, seed=0, unroll=3):
        evals.append((target, path, gamma, max_new, seed, unroll))
        return _fake_eval(gamma)

    monkeypatch.setattr(eagle_eval, "evaluate", fake_evaluate)

    report = train_eagle.main(["--name", "run", "--no-eval"])
    assert (loads, evals) == ([], []) and report == {**kept, "eval": {}}
    assert "not evaluated (--no-eval)" in capsys.readouterr().out

    report = train_eagle.main(["--name", "run"])
    assert evals == [("TARGET", str(head), 4, 64, 0, 3)] and len(loads) == 1
    assert report["loss_start"] == 2.5 and report["train_seconds"] == 480.0  # the training run's, not NaN / 0 s
    assert json.loads((head / "meta.json").read_text()) == meta  # not rewritten
    saved = json.loads((head.parent / "eval.json").read_text())
    assert saved["eval"] == _fake_eval(4) and saved["eval_settings"]["gamma"] == 4
    assert saved["eval_settings"]["eval_max_new"] == 64 and saved["eval_settings"]["prompts"] == EAGLE_EVAL_PROMPTS

    train_eagle.main(["--name", "run"])  # evaluated with these settings: printed only
    assert len(evals) == 1
    report = train_eagle.main(["--name", "run", "--gamma", "5"])
    assert evals[1][2:] == (5, 64, 0, 3) and report["gamma"] == 5 and report["eval"] == _fake_eval(5)
    train_eagle.main(["--name", "run", "--gamma", "5"])
    assert len(evals) == 2
    capsys.readouterr()
    report = train_eagle.main(["--name", "run", "--gamma", "5", "--eval-max-new", "192", "--no-eval"])
    assert len(evals) == 2 and report["eval"] == _fake_eval(5)
    assert "evaluated with other settings: eval_max_new; --no-eval" in capsys.readouterr().out
    train_eagle.main(["--name", "run", "--eval-max-new", "192"])  # gamma back to 4 as well
    assert evals[2][2:] == (4, 192, 0, 3)


def test_evaluation_settings_of_reports_made_before_they_were_recorded():
    """A report without ``eval_settings`` ran with its gamma and recorded arguments and 3 teacher-forced passes;
    its prompts were not recorded and are not compared."""
    P = train_eagle.parse_args
    old = {"gamma": 4, "args": {"eval_max_new": 64, "seed": 0, "unroll": 2, "gamma": 4}, "eval": {"greedy": {}}}
    assert eagle_eval.stale_evaluation(old, P([])) == []
    assert eagle_eval.stale_evaluation(old, P(["--unroll", "2"])) == ["unroll"]  # it measured 3 passes
    assert eagle_eval.stale_evaluation(old, P(["--eval-max-new", "192", "--gamma", "2"])) == ["eval_max_new", "gamma"]
    assert eagle_eval.stale_evaluation({**old, "eval": {}}, P([])) == ["none"]
    mine = eagle_eval.eval_settings(P([]))
    moved = {**old, "eval_settings": {**mine, "prompts": mine["prompts"][:-1]}}  # a held-out prompt added since
    assert eagle_eval.stale_evaluation(moved, P([])) == ["prompts"]


def test_a_resume_keeps_the_metrics_of_the_steps_before_it(tmp_path):
    """The metrics of a resumed run covered only its own steps (none at all after a resume at the last step:
    NaN). Now the steps' metrics and seconds are kept next to each checkpoint and read back on a resume
    (``models.training.runs``' helpers, which the draft trainer uses too)."""
    path = str(tmp_path / "ckpt_history.json")
    hist = [{"loss": float(v), "agree": [v / 10, v / 20]} for v in range(1, 5)]  # steps 0-3
    assert runs.resumed_history(path, 0) == ([], 0, 0.0)
    assert runs.resumed_history(path, 4) == ([], 4, 0.0)  # a checkpoint without them
    runs.save_history(path, 4, 8.0, hist)
    assert runs.resumed_history(path, 4) == (hist, 0, 8.0)
    assert runs.resumed_history(path, 2) == (hist[:2], 0, 4.0)  # the save of step 4 never finished
    assert runs.resumed_history(path, 6) == ([], 6, 0.0)  # kept fewer steps than the checkpoint
    assert not os.path.exists(path + ".tmp")

    keys = ("loss", "reg", "kl", "agree", "agree_answer")
    hist = [{k: float(v) if k == "loss" else [v, 2 * v] for k in keys} for v in range(20)]
    s = train_eagle.training_summary(hist, 0)  # a tenth: 2 steps
    assert s["loss_start"] == 0.5 and s["loss_end"] == 18.5 and s["agree_end"] == [18.5, 37.0]
    assert (s["metrics_from_step"], s["metrics_steps"]) == (0, 20)
    line = train_eagle.summary_line("run", s)
    assert "loss 0.500 -> 18.500 (20 steps)" in line and "since" not in line
    assert "loss since step 40 0.500 -> 18.500" in train_eagle.summary_line(
        "run", train_eagle.training_summary(hist, 40)
    )
    none = train_eagle.training_summary([], 60)
    assert none["loss_start"] is None and none["agree_end"] is None and none["metrics_steps"] == 0
    assert "no training step recorded (the checkpoint of step 60" in train_eagle.summary_line("run", none)
    json.dumps(none, allow_nan=False)  # no NaN in the report


def test_a_resume_under_another_token_map_is_refused(tmp_path):
    """The frequent-token map is rebuilt on every run (from the data or the --init-from head), not stored in the
    checkpoint: a resume under another map paired the trained weights with other tokens, silently."""
    out = str(tmp_path / "run")
    train_eagle.check_token_map(out, [3, 5, 9], resuming=False)
    train_eagle.check_token_map(out, [3, 5, 9], resuming=True)  # the same map: resumed
    with pytest.raises(SystemExit, match="trained under another frequent-token map than this run builds"):
        train_eagle.check_token_map(out, [3, 5, 10], resuming=True)
    train_eagle.check_token_map(str(tmp_path / "old"), [1], resuming=True)  # a checkpoint from before the record


def test_features_past_float16_range_are_refused():
    """The data files store features in float16: a value past 65504 became inf there (and the head's loss NaN)."""
    np.testing.assert_array_equal(eagle_data.as_float16(np.array([1.5, -2.0]), "x"), np.array([1.5, -2.0], np.float16))
    for bad in (7e4, np.inf, np.nan):
        with pytest.raises(SystemExit, match="past float16's range"):
            eagle_data.as_float16(np.array([1.0, bad], np.float32), "the outputs of layers 2,15")


def test_teacher_forced_hits_measure_the_runs_passes():
    """The teacher-forced evaluation ran 3 passes whatever --unroll trained: now it runs ``unroll``, and pass u
    does not depend on the passes after it (the first passes of a longer run are a shorter run's)."""
    ecfg = EagleConfig(TINY, head_tokens=40)
    ids = np.sort(np.random.default_rng(3).permutation(TINY.vocab_size)[:40])
    hp = random_head(ecfg, TINY_PARAMS, 3, 0.1, ids)
    hp = EagleDrafter(ecfg).draft_params(TINY_PARAMS, hp)[1]
    target = SimpleNamespace(config=TINY, params=TINY_PARAMS)
    prompts, answers = [[1, 5, 9], [4, 8]], [[3, 7, 2, 6], [11, 12, 13]]  # pairs: 4 - 1 + 3 - 1 = 5
    hits = {u: eagle_eval.teacher_forced_hits(target, ecfg, hp, prompts, answers, u) for u in (2, 4)}
    default = eagle_eval.teacher_forced_hits(target, ecfg, hp, prompts, answers)
    assert hits[2].shape == (2, 5) and hits[4].shape == (4, 5) and default.shape == (3, 5)
    np.testing.assert_array_equal(hits[4][:2], hits[2])
    np.testing.assert_array_equal(hits[4][:3], default)


def test_cut_docstring_passages_are_reported(tmp_path, monkeypatch, capsys):
    """Passages longer than --doc-width were cut to it without a word: now the count, the longest and the
    tokens not trained on are printed (the cached files are unchanged)."""
    assert eagle_data.cut_note([10, 256, 3], 256) is None
    assert eagle_data.cut_note([300, 100, 256, 400], 256) == (
        "docstring data: 2 of 4 passages are longer than --doc-width 256 tokens (up to 400) and were cut to it: "
        "188 of the passages' 1056 tokens are not trained on"
    )
    docs = [("q", "d" * n) for n in (9, 29, 40, 5)]  # chat-encoded: 2 + 1 + n tokens = 12, 32, 43, 8
    monkeypatch.setattr(eagle_data, "doc_answers", lambda: list(docs))
    monkeypatch.setattr(eagle_data, "topic_answers", lambda: [])
    monkeypatch.setattr(eagle_data, "feature_fn", _token_features([]))
    target = SimpleNamespace(tokenizer=_Tok(), config=SimpleNamespace(hidden=2), params=None)
    args = SimpleNamespace(doc_tokens=80, doc_width=20, seed=0, feature_batch=1)  # one file of 4 passages
    [path] = eagle_data.generate_doc_data(args, target, str(tmp_path))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "docstring data: 2 of 4 passages are longer than --doc-width 20 tokens (up to 43) and were cut to it: "
        "35 of the passages' 95 tokens are not trained on"
    )
    assert sorted(np.load(path)["lengths"].tolist()) == [8, 12, 20, 20]


def test_an_export_records_what_its_evaluation_computed_with(tmp_path):
    """The exported head's meta.json kept held-out metrics measured with the f32 head on the stacked, unpacked
    target next to ``stored_dtype`` bfloat16, saying nothing of the difference. Each evaluation row now records
    its head's dtype and the target's layout, and the export writes them next to ``stored_dtype``, with a note
    that the bf16 rounding was not evaluated; an evaluation made before they were recorded says "not recorded"."""
    from models import eagle as EG
    from models import llama

    ecfg = EagleConfig(TINY, head_tokens=40, name="tiny-eagle")
    hp = random_head(ecfg, TINY_PARAMS, 0)
    drafter = EagleDrafter(ecfg, 2)
    _, dp = drafter.draft_params(TINY_PARAMS, hp)
    assert eagle_eval.eval_numerics(TINY_PARAMS, dp) == {"evaluated_dtype": "float32", "target_layout": "stacked"}
    unstacked = llama.unstack_layers(TINY_PARAMS, packed=False)
    assert eagle_eval.eval_numerics(unstacked, drafter.draft_params(unstacked, hp)[1])["target_layout"] == "unstacked"
    packed = llama.unstack_layers(TINY_PARAMS, packed=True)
    if llama.is_packed(packed):  # the CPU kernel's layout: the head's matrices packed in bfloat16 next to it
        got = eagle_eval.eval_numerics(packed, drafter.draft_params(packed, hp)[1])
        assert got["target_layout"] == "packed" and "bfloat16" in got["evaluated_dtype"].split("+")

    final = EG.save_head(tmp_path / "head", ecfg, hp, {"name": "run"})
    row = {**_fake_eval(2)["T=1"], "evaluated_dtype": "float32", "target_layout": "stacked"}
    report = {"gamma": 2, "eval": {"greedy": row, "T=1": row}, "eval_settings": {"gamma": 2}}
    args = SimpleNamespace(export=str(tmp_path / "export"))
    eagle_eval.export(args, final, report)
    meta = json.loads((tmp_path / "export" / "meta.json").read_text())
    assert (meta["stored_dtype"], meta["evaluated_dtype"], meta["evaluated_layout"]) == (
        "bfloat16",
        "float32",
        "stacked",
    )
    assert "measured with the head's weights in float32 on a stacked target" in meta["eval_note"]
    assert "rounding was not evaluated" in meta["eval_note"]
    old = {"gamma": 2, "eval": _fake_eval(2), "eval_settings": {"gamma": 2}}  # made before they were recorded
    eagle_eval.export(SimpleNamespace(export=str(tmp_path / "old")), final, old)
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    assert (meta["evaluated_dtype"], meta["evaluated_layout"]) == ("not recorded", "not recorded")
    eagle_eval.export(SimpleNamespace(export=str(tmp_path / "none")), final, {"eval": {}})  # --no-eval
    meta = json.loads((tmp_path / "none" / "meta.json").read_text())
    assert meta["stored_dtype"] == "bfloat16" and "evaluated_dtype" not in meta
