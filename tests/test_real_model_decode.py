"""SmolLM2-135M-Instruct (the real default model): speculative greedy decoding equals plain greedy decoding,
and the command-line main job works end to end."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import requires_torch

from jspec import decode as dec
from jspec.ngram import NgramDrafter, NgramTreeDrafter

QUESTIONS = [
    "Rewrite in plain words: The committee has decided that the meeting will be postponed until next week.",
    "List three colours of the rainbow.",
    "Repeat this line twice: the cat sat on the mat.",
    "What is 12 plus 7?",
]


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    tok = smollm2.tokenizer
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(smollm2, chat_prompts):
    """Plain greedy continuations, two prompts per batch of 2 (prompts of different lengths in a batch)."""
    out = []
    for i in range(0, len(chat_prompts), 2):
        out += dec.decode(
            smollm2.model,
            smollm2.params,
            chat_prompts[i : i + 2],
            max_new_tokens=40,
            eos_ids=[smollm2.tokenizer.eos_id],
        ).tokens
    return out


def _hf_greedy(hf, ids, eos, **extra):
    """transformers' greedy generate of up to 40 tokens after one prompt ``ids``, stopping at ``eos``."""
    import torch

    with torch.no_grad():
        return hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=40,
            eos_token_id=eos,
            pad_token_id=eos,
            **extra,
        )


@requires_torch
def test_plain_decode_equals_transformers_greedy_generate(smollm2, chat_prompts, plain, hf_smollm2):
    """``jspec.decode`` itself (ragged batches of 2, prompt padding, EOS) against transformers' greedy generate on
    each prompt alone: the reference every speculative run below is held to."""

    eos = smollm2.tokenizer.eos_id
    for ids, ours in zip(chat_prompts, plain):
        gen = _hf_greedy(hf_smollm2, ids, eos)
        assert ours == gen[0, len(ids) :].tolist()
    assert any(row[-1] == eos for row in plain) and any(len(row) == 40 for row in plain)  # both stops ran


@requires_torch
def test_request_options_match_transformers(smollm2, chat_prompts, plain, hf_smollm2):
    """Per-row logit_bias, min_tokens and repetition_penalty in one batch of 2, plain and n-gram speculative,
    against transformers' greedy generate with ``sequence_bias`` (SequenceBiasLogitsProcessor), ``min_new_tokens``
    (MinNewTokensLengthLogitsProcessor) and ``repetition_penalty`` (RepetitionPenaltyLogitsProcessor) on each
    prompt alone; with the top 5 log-probabilities at every position
    against those of the raw logits transformers reports (``output_logits``)."""
    import torch

    eos = smollm2.tokenizer.eos_id
    # Row 1: a prompt whose plain answer ends (EOS) before 40 tokens, a repetition penalty, and no end token
    # allowed before 5 more tokens than that answer had; row 0: another prompt, its plain answer's first token
    # banned by a large negative bias and another token pushed up. (transformers applies a repetition penalty
    # before sequence_bias, vLLM and jspec after: no row takes both.)
    ended = [i for i, row in enumerate(plain) if row[-1] == eos and len(row) < 35]
    assert ended, [len(r) for r in plain]  # min_tokens needs an end token to hold back
    pick = [next(i for i in range(len(plain)) if i != ended[0]), ended[0]]
    prompts, bare = [chat_prompts[i] for i in pick], [plain[i] for i in pick]
    biases = [{bare[0][0]: -50.0, bare[0][2]: 2.5}, None]
    min_tokens = [0, len(bare[1]) + 5]
    penalties = [1.0, 1.3]
    kw = dict(max_new_tokens=40, eos_ids=[eos], logit_bias=biases, min_tokens=min_tokens, logprobs=True, top_logprobs=5)
    kw["repetition_penalty"] = penalties
    out = dec.decode(smollm2.model, smollm2.params, prompts, **kw)
    ours = out.tokens
    v = smollm2.model.vocab_size
    spec = dec.decode(smollm2.model, smollm2.params, prompts, drafter=NgramDrafter(3, 1, vocab_size=v), gamma=4, **kw)
    assert spec.tokens == ours
    # Drafts were accepted (multi-token rounds read processed logits at every block position). The penalized row's
    # n-gram drafts are all rejected here (the penalty steers it off repeats); counting drafts inside a block is
    # pinned exactly by the toy tests (test_logit_processors).
    assert 0 < spec.stats["accepted"] < spec.stats["proposed"]  # multi-token commits and corrections both ran
    for ids, got, bias, n_min, rep, tops, spec_tops in zip(
        prompts, ours, biases, min_tokens, penalties, out.top_logprobs, spec.top_logprobs
    ):
        gen = _hf_greedy(
            hf_smollm2,
            ids,
            eos,
            sequence_bias=[[[t], b] for t, b in bias.items()] if bias else None,
            min_new_tokens=n_min,
            repetition_penalty=rep,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert got == gen.sequences[0, len(ids) :].tolist()
        raw = torch.log_softmax(torch.cat(gen.logits).double(), dim=-1)  # [T, V], before the processors
        theirs = torch.topk(raw, 5, dim=-1)
        for mine in (tops, spec_tops):  # verification rounds (n-gram) report them as plain steps do
            assert [[t for t, _ in alts] for alts in mine] == theirs.indices.tolist()
            np.testing.assert_allclose([[x for _, x in alts] for alts in mine], theirs.values.numpy(), atol=2e-4)
    assert ours[0] != bare[0] and ours[0][0] != bare[0][0] and len(ours[1]) >= min_tokens[1]


# The CLI's default target layout on CPU (per-layer arrays): its logits are compared with transformers'
# (test_models_smollm2), the CLI main job below decodes n-gram speculation with it against plain, and the
# SmolLM2 EAGLE test (tests/test_eagle.py) decodes a batch of 2 with it.
# The n-gram chain (NgramDrafter(3, 1), K=4) on the stacked layout these tests decode:
# test_request_options_match_transformers decodes it against plain on a ragged batch of 2 with EOS, with drafts
# accepted and rejected (its penalized row's); not repeated here without the options.
def test_greedy_speculative_equals_plain_real_model(smollm2, chat_prompts, plain):
    """An n-gram tree (NgramTreeDrafter(3, 4)) against plain decoding, every chat prompt, ragged batches of 2."""
    drafter = NgramTreeDrafter(3, 4, vocab_size=smollm2.model.vocab_size)
    got, proposed, accepted = [], 0, 0
    for i in range(0, len(chat_prompts), 2):
        out = dec.decode(
            smollm2.model,
            smollm2.params,
            chat_prompts[i : i + 2],
            drafter=drafter,
            goodput=False,
            max_new_tokens=40,
            eos_ids=[smollm2.tokenizer.eos_id],
        )
        got += out.tokens
        proposed += out.stats["proposed"]
        accepted += out.stats["accepted"]
    assert got == plain
    assert 0 < accepted < proposed  # multi-token commits and corrections both ran


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "jspec", "generate", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def test_cli_stop_strings_end_the_answer_before_the_first(smollm2_path, smollm2):
    """--stop: the answer (n-gram speculation, several tokens a round) ends at the round that completes the first
    stop string; the tokens end with the one completing it and the text stops right before it."""
    r = _cli("--prompt", QUESTIONS[2], "--drafter", "ngram", "--max-new-tokens", "40", "--json", "--stop", "ZZZ",
             "--stop", ".")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stop"] == "." and out["stats"]["stop_reason"] == "stop_string"
    full = smollm2.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    before = smollm2.tokenizer.decode(out["token_ids"][:-1], skip_special_tokens=True)
    assert "." in full and "." not in before  # the last token completes the first "."
    assert out["text"] == full[: full.index(".")]
    assert (
        out["stats"]["kept_tokens"] == len(out["token_ids"]) <= out["stats"]["new_tokens"]
        and len(out["token_ids"]) < 40
    )


def test_cli_json_main_job(smollm2_path, tmp_path):
    # The defaults (unstacked target layers, a persistent compilation cache), with the cache in a temp dir.
    cache_dir = tmp_path / "xla"
    r = _cli(
        "--prompt", QUESTIONS[2], "--drafter", "ngram", "--max-new-tokens", "24", "--compare", "--json",
        env={"JSPEC_COMPILE_CACHE": str(cache_dir)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert any(cache_dir.iterdir()), "the compiled programs were not written to the persistent cache"
    out = json.loads(r.stdout)
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 24
    for key in ("new_tokens", "rounds", "tokens_per_round", "acceptance_rate", "seconds", "tokens_per_s"):
        assert key in out["stats"], key
    assert out["stats"]["seconds"] > 0 and out["stats"]["tokens_per_s"] > 0
    assert out["identical_to_plain"] is True and out["speedup"] > 0
    assert out["token_ids"] == out["plain"]["token_ids"]  # the flag's own inputs, not only the flag


@pytest.mark.measures_costs
def test_demo_main_job_speculates_on_code_editing(smollm2, monkeypatch, capsys):
    """``make run``'s demo: the answer copies the prompt's code, so prompt lookup keeps several tokens a round, and
    the speculative output is plain decoding's token for token (its exit status says so). Its draft length is the
    default's, chosen each round from the cost table it measures first. The session's model stands in for a second
    load of the same checkpoint."""
    import re

    from jspec import demo

    monkeypatch.setattr(demo, "model_loader", lambda: lambda *_, **__: smollm2)
    assert demo.main(["--max-new-tokens", "40", "--compile-cache", "none"]) == 0
    out, err = capsys.readouterr()
    assert "def dedent(" in out  # the function it was asked to annotate, repeated
    assert "output identical]" in err and "[speedup " in err
    assert "[cost table: " in err and "K chosen each round (0: " in err
    per_round = float(re.search(r"\(([0-9.]+) tokens/round", err).group(1))
    assert per_round > 1.5, err  # a copy: most rounds keep drafts (plain decoding keeps 1.00)
    assert demo.main(["--function", "textwrap:no_such_function", "--compile-cache", "none"]) == 2
    assert "'textwrap:no_such_function': no Python source to read" in capsys.readouterr().err


def test_cli_bad_input_is_a_clear_error(smollm2_path):
    r = _cli("--prompt", "hi", "--temperature", "1", "--top-p", "1.5", "--max-new-tokens", "4")
    assert r.returncode == 2 and "--top-p must be in (0, 1]" in r.stderr
    r = _cli("--prompt", "hi", "--model", "no-such-model")
    assert r.returncode != 0 and "unknown model" in r.stderr


def test_cli_trained_drafters_greedy_equals_plain(smollm2, tmp_path, monkeypatch, capsys):
    """--drafter draft|layerskip|eagle|model through the CLI entry points. The artefacts are untrained (a 2-layer
    copy with a 4096-row head, the bare first 6 layers, a fresh EAGLE head): losslessness must not depend on
    training, and rejections exercise the correction path. The chains are built by the CLI's own builder and
    loaders, not decoded here: their greedy equality on SmolLM2 is test_draft_model's real-model test (the same
    2-layer, 4096-row draft at K=3), test_layerskip's and test_eagle's SmolLM2 tests. Decoded through the CLI:
    the trees the flags build from those drafters, the target as its own draft, and the bundled EAGLE head,
    which --drafter eagle takes when no --draft-model is given."""
    import argparse

    import numpy as np

    from jspec import cli
    from jspec.drafters import ModelDrafter
    from models import draft as D
    from models import eagle as E
    from models import eagle_checkpoint
    from models.layerskip import LayerSkipDrafter

    dcfg = D.draft_config(smollm2.config, 2, head_size=4096)
    D.save_draft(tmp_path / "draft", dcfg, D.init_from_target(dcfg, smollm2.params), tokenizer=smollm2.tokenizer)
    ecfg = E.EagleConfig(smollm2.config, head_tokens=4096, name="untrained")
    E.save_head(tmp_path / "eagle", ecfg, E.init_head(ecfg, smollm2.params, jax.random.key(0)))
    real = cli.model_loader
    # The target comes from the session fixture (no second GGUF read); drafter loaders are the real ones.
    monkeypatch.setattr(
        cli,
        "model_loader",
        lambda group="jspec.model_loaders", name=None: (
            (lambda *_, **__: smollm2) if group == "jspec.model_loaders" else real(group, name)
        ),
    )
    loaded = smollm2
    for drafter, spec, kind in (
        ("draft", tmp_path / "draft", ModelDrafter),
        ("layerskip", "exit:6", LayerSkipDrafter),
        ("eagle", tmp_path / "eagle", E.EagleDrafter),
    ):
        ns = argparse.Namespace(drafter=drafter, draft_model=str(spec), gamma=3, tree=None, dynamic_tree=None)
        built, dparams = cli.build_drafter(ns, smollm2.model, loaded)
        assert type(built) is kind and dparams is not None, (drafter, built)
        assert built.vocab_size == smollm2.model.vocab_size, drafter
    assert built.ecfg.head_tokens == 4096 and built.max_draft >= 3  # the saved head, not the bundled (8192)
    base = ["generate", "--prompt", QUESTIONS[1], "--max-new-tokens", "12", "--compare", "--json"]
    base += ["--compile-cache", "none"]
    runs = []
    for drafter, spec, extra in (
        ("layerskip", "exit:6", ["--tree", "2,1", "--no-goodput"]),  # the exit as a stand-alone tree draft (as_model)
        ("eagle", tmp_path / "eagle", ["--dynamic-tree", "2,2,4"]),  # EAGLE-2 trees from the untrained head
        # The target as its own draft: every proposal is accepted. --logprobs: one log-probability per
        # generated token (decode's own values are checked in test_logprobs.py).
        ("model", "smollm2-135m-instruct", ["--gamma", "3", "--logprobs"]),
    ):
        assert cli.main([*base, "--drafter", drafter, "--draft-model", str(spec), *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["identical_to_plain"] is True and out["token_ids"] == out["plain"]["token_ids"], drafter
        assert out["stats"]["proposed"] > 0 and out["stats"]["new_tokens"] == len(out["token_ids"]) > 0, drafter
        assert np.sum(out["stats"]["proposed_at"]) == out["stats"]["proposed"], drafter
        assert out["stats"]["gamma"] == (2 if drafter != "model" else 3), drafter  # a tree reports its depth as K
        runs.append(out)
    assert out["stats"]["accepted"] == out["stats"]["proposed"], out["stats"]
    # Without --draft-model, --drafter eagle decodes with the bundled head (models/heads/), here at the K it is
    # benchmarked with on AVX2 (README, "Choosing K"), round by round: --stream writes the greedy text (plain's,
    # from the runs above) as it goes (stepped from Python, compiled ahead).
    no_json = [a for a in base if a not in ("--json", "--compare")]
    assert cli.main([*no_json, "--stream", "--drafter", "eagle", "--gamma", "2"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == runs[0]["text"] + "\n"
    assert f"[eagle: {runs[0]['stats']['new_tokens']} tokens" in streamed.err
    # greedy picks each step's most likely token, so no log-probability is below log(1/V).
    lps = out["logprobs"]
    assert len(lps) == len(out["token_ids"]) and all(-np.log(smollm2.config.vocab_size) <= x <= 0 for x in lps)
    assert "logprobs" not in out["plain"]["stats"]
    # Missing or malformed specs are clear errors naming the flag.
    monkeypatch.setattr(eagle_checkpoint, "BUNDLED_DIR", str(tmp_path / "no-bundle"))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "empty-cache"))
    assert cli.main([*base, "--drafter", "eagle"]) == 2
    assert "--drafter eagle needs --draft-model" in capsys.readouterr().err
    eagle = [*base, "--drafter", "eagle", "--draft-model", str(tmp_path / "eagle")]
    assert cli.main([*eagle, "--dynamic-tree", "2,2"]) == 2
    assert "--dynamic-tree wants TOP_K,DEPTH,BUDGET (three integers), got '2,2'" in capsys.readouterr().err
    assert cli.main([*eagle, "--dynamic-tree", "2,2,9"]) == 2
    assert "budget must be in [2, 7] for top_k=2, depth=2, got 9" in capsys.readouterr().err
    assert cli.main([*eagle, "--dynamic-tree", "2,2,4", "--tree", "2,1"]) == 2
    assert "--tree and --dynamic-tree are exclusive" in capsys.readouterr().err
    assert cli.main([*eagle, "--tree", "2,1", "--gamma", "3"]) == 2  # a tree drafts to its depth: not silently 2
    assert "--gamma does not apply with --tree: a tree drafts to its depth" in capsys.readouterr().err
    assert cli.main([*base, "--drafter", "layerskip", "--draft-model", "exit:x"]) == 2
    assert "expected exit:E" in capsys.readouterr().err
    assert cli.main([*base, "--drafter", "draft", "--draft-model", str(tmp_path / "nothing")]) == 2
    assert "no draft" in capsys.readouterr().err
    assert cli.main([*base, "--drafter", "model"]) == 2
    assert "--drafter model needs --draft-model" in capsys.readouterr().err
    # --drafter model refuses a checkpoint with another tokenizer (here another vocabulary) before decoding.
    pytest.importorskip("transformers")
    from test_models_hf import tiny_model

    tiny_model("llama", tied=True).save_pretrained(tmp_path / "other")
    assert cli.main([*base, "--drafter", "model", "--draft-model", str(tmp_path / "other")]) == 2
    assert "vocabulary mismatch" in capsys.readouterr().err


def test_loader_layout_argument_only_reaches_loaders_that_take_it():
    from jspec.loaders import load_model

    seen = []
    assert load_model(lambda name, dtype: (name, dtype), "m", "float32", unstacked=True) == ("m", "float32")
    load_model(lambda name, dtype, unstacked=False: seen.append(unstacked), "m", "float32", unstacked=True)
    load_model(lambda name, dtype, **kw: seen.append(kw), "m", "float32", unstacked=False)
    assert seen == [True, {"unstacked": False}]


def test_layers_auto_is_unstacked_on_cpu_and_gpu_only(monkeypatch):
    import jax

    from jspec.loaders import wants_unstacked

    assert wants_unstacked("unstacked") and not wants_unstacked("stacked")
    for backend, unstacked in (("cpu", True), ("gpu", True), ("tpu", False)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert wants_unstacked("auto") is unstacked, backend
    with pytest.raises(ValueError, match="--layers must be one of auto, stacked, unstacked, got 'fused'"):
        wants_unstacked("fused")
    # The benchmark suite's loader (default --layers auto) passes the resolved layout to the model loader.
    from jspec import loaders
    from jspec.bench import targets

    seen = []
    monkeypatch.setattr(
        loaders,
        "model_loader",
        lambda *a, **k: lambda name, dtype, unstacked: seen.append(unstacked) or (None, None, None, object()),
    )
    targets.load_target("m", layers="auto")
    assert seen == [False]  # default_backend is "tpu" here
    with pytest.raises(ValueError, match="got 'fused'"):
        targets.load_target("m", layers="fused")
    assert seen == [False]  # refused before loading
