"""``python -m jspec generate`` and ``bench`` refuse flags that would be ignored or fail, before any model is
loaded; --compare's label; the compilation cache's switch."""

import json

import pytest

from jspec import cli, loaders

pytestmark = pytest.mark.fast  # the fast tier: make test-fast


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--drafter", "none", "--draft-model", "x"], "--draft-model does not apply to --drafter none"),
        (["--drafter", "ngram", "--tree", "2,1"], "--tree does not apply to --drafter ngram"),
        (["--drafter", "ngram-tree", "--dynamic-tree", "2,2,4"], "--dynamic-tree does not apply"),
        (["--drafter", "ngram", "--branches", "2"], "--branches does not apply to --drafter ngram "),
        (["--drafter", "eagle", "--ngram-max", "4"], "--ngram-max does not apply to --drafter eagle"),
        (["--drafter", "model", "--ngram-min", "2"], "--ngram-min does not apply"),
        (["--drafter", "eagle", "--tree-budget", "3"], "--tree-budget applies to --tree"),
        (["--drafter", "eagle", "--dynamic-tree", "2,2,4", "--tree-rule", "iid"], "--tree-rule applies to --tree"),
        (["--drafter", "none", "--adaptive"], "need a drafter"),
        (["--drafter", "none", "--block-verify"], "need a drafter"),
        (["--drafter", "ngram-tree", "--block-verify"], "--block-verify verifies a chain's candidates as one block"),
        (["--drafter", "eagle", "--tree", "2,1", "--block-verify"], "which --tree excludes"),
        (["--drafter", "model", "--dynamic-tree", "2,2,4", "--block-verify"], "which --dynamic-tree excludes"),
        (["--drafter", "layerskip", "--dynamic-tree", "2,2,4", "--adaptive"], "--adaptive drafts a chain's K or"),
        (["--drafter", "ngram-tree", "--adaptive"], "which --drafter ngram-tree excludes"),
        (["--drafter", "none", "--gamma", "3"], "--gamma needs a drafter"),
        (["--drafter", "none", "--compare"], "--compare needs a drafter"),
        (["--drafter", "ngram", "--gamma", "0"], "--gamma 0: a drafter drafts K >= 1"),
        (["--drafter", "eagle", "--tree", "2,1", "--gamma", "3"], "--gamma does not apply with --tree"),
        (["--drafter", "model", "--dynamic-tree", "2,2,4", "--gamma", "2"], "--gamma does not apply with --dynamic"),
        (["--raw", "--system", "be terse"], "--system needs the chat template, which --raw turns off"),
        (["--top-k", "5"], "--top-k 5 has no effect at --temperature 0 (greedy)"),
        (["--top-p", "0.9"], "--top-p 0.9 has no effect at --temperature 0"),
        (["--min-p", "0.1", "--temperature", "0"], "--min-p 0.1 has no effect"),
        (["--drafter", "eagle", "--tree", "3,,1"], "--tree wants comma-separated branching factors"),
        (["--drafter", "eagle", "--dynamic-tree", "2,2"], "--dynamic-tree wants TOP_K,DEPTH,BUDGET (three integers)"),
        (["--stream", "--json"], "--stream prints the text as it is generated; --json prints one object"),
        (["--stop-token-ids", "2,-1"], "--stop-token-ids wants comma-separated token ids (e.g. 2,7), got '2,-1'"),
        (["--stop-token-ids", "2,,7"], "--stop-token-ids wants comma-separated token ids"),
        (["--logit-bias", "2"], "--logit-bias wants comma-separated TOKEN_ID:BIAS pairs (e.g. 2:-100,7:1.5 or"),
        (["--logit-bias", "x:1"], "--logit-bias wants comma-separated TOKEN_ID:BIAS pairs"),
        (["--logit-bias", "2:high"], "--logit-bias wants comma-separated TOKEN_ID:BIAS pairs"),
        (["--logit-bias", "2:1,2:-1"], "--logit-bias names token 2 twice"),
        (["--logit-bias", "\u00b2:1"], "--logit-bias wants comma-separated TOKEN_ID:BIAS pairs"),
        (["--logit-bias", "2:nan"], "--logit-bias's biases must be finite (or -inf, a ban), got [nan]"),
        (["--logit-bias", "2:inf"], "--logit-bias's biases must be finite (or -inf, a ban), got [inf]"),
        (
            ["--logit-bias", "2:-1e9"],
            "--logit-bias's biases must be in [-100, 100] (or -inf, a ban), got [-1000000000.0]",
        ),
        (["--min-tokens", "-1"], "--min-tokens -1 must be in [0, --max-new-tokens (128)]"),
        (["--top-logprobs", "3"], "--top-logprobs needs --logprobs"),
        (["--stop", ""], "--stop: stop strings must be non-empty strings"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be in [0.01, 100] (1 = disabled), got [0.0]"),
        (["--repetition-penalty", "nan"], "--repetition-penalty must be in [0.01, 100] (1 = disabled), got [nan]"),
        (["--min-tokens", "3", "--ignore-eos"], "--min-tokens with --ignore-eos holds back nothing"),
        (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2] (0 = disabled), got [3.0]"),
        (["--frequency-penalty", "nan"], "--frequency-penalty must be in [-2, 2] (0 = disabled), got [nan]"),
        (["--top-logprobs", "21", "--logprobs"], "--top-logprobs must be an int in [0, 20], got 21"),
        (["--top-logprobs", "-1"], "--top-logprobs must be an int in [0, 20], got -1"),
        (["--min-tokens", "9", "--max-new-tokens", "8"], "--min-tokens 9 must be in [0, --max-new-tokens (8)]"),
    ],
)
def test_ignored_flags_are_refused(flags, message, monkeypatch, capsys):
    def no_load(*_, **__):
        raise AssertionError("the flags must be refused before a model is loaded")

    monkeypatch.setattr(cli, "model_loader", no_load)
    assert cli.main(["generate", "--prompt", "hi", "--compile-cache", "none", *flags]) == 2
    assert message in capsys.readouterr().err


class _Loaded(Exception):
    pass


@pytest.mark.parametrize(
    "flags",
    [
        ["--drafter", "ngram-tree", "--branches", "2", "--ngram-max", "4", "--ngram-min", "2"],
        ["--drafter", "eagle", "--tree", "3,1", "--tree-budget", "4", "--tree-rule", "iid", "--draft-model", "x"],
        ["--drafter", "layerskip", "--dynamic-tree", "2,2,4"],
        ["--drafter", "layerskip", "--adaptive"],
        ["--drafter", "none"],
        ["--drafter", "ngram-tree", "--gamma", "3"],  # its depth
        ["--drafter", "ngram", "--gamma", "2", "--compare", "--system", "be terse"],
        ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05"],
    ],
)
def test_flags_their_drafter_reads_pass_the_check(flags, monkeypatch):
    def loader(*_, **__):
        raise _Loaded  # the check passed: the model would load now

    monkeypatch.setattr(cli, "model_loader", loader)
    with pytest.raises(_Loaded):
        cli.main(["generate", "--prompt", "hi", "--compile-cache", "none", *flags])


def test_an_unusable_compile_cache_is_a_clear_error(tmp_path, monkeypatch, capsys):
    def no_load(*_, **__):
        raise AssertionError("the cache directory must be refused before a model is loaded")

    monkeypatch.setattr(cli, "model_loader", no_load)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("not a directory")
    assert cli.main(["generate", "--prompt", "hi", "--compile-cache", str(tmp_path / "file" / "xla")]) == 2
    assert "error:" in capsys.readouterr().err


class _Tok:
    eos_ids = [2]

    def encode(self, text):
        return [1, 2]

    def encode_chat(self, messages):
        return [1, 2]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _fake_decodes(monkeypatch, spec_ids, plain_ids):
    """generate with a stand-in model whose speculative run gives ``spec_ids`` at 30 tok/s and plain decoding
    ``plain_ids`` at 10 tok/s (no decoding: only what generate prints of them is tested)."""
    from types import SimpleNamespace

    target = SimpleNamespace(vocab_size=3)
    monkeypatch.setattr(cli, "model_loader", lambda *a, **k: lambda name, dtype: (None, None, target, _Tok()))

    def run(target, params, prompt_ids, drafter, dparams, args, eos, max_len=None, stream=None):
        ids, tps = (spec_ids, 30.0) if drafter is not None else (plain_ids, 10.0)
        stats = {"logprobs": None, "top_logprobs": None, "new_tokens": len(ids), "gamma": 4, "cache_slots": 64,
                 "rounds": 2, "tokens_per_round": 1.5, "acceptance_rate": 0.5, "proposed": 4, "accepted": 2,
                 "accepted_at": [2], "proposed_at": [4], "stop_reason": "eos", "seconds": len(ids) / tps,
                 "tokens_per_s": tps, "compile_seconds": 0.0}  # fmt: skip
        return list(ids), stats

    monkeypatch.setattr(cli, "_run", run)


def _decode_kwargs(monkeypatch, flags) -> dict:
    """The keyword arguments ``generate`` with ``flags`` passes to ``jspec.decode.prepare`` (a stand-in model)."""
    from types import SimpleNamespace

    target = SimpleNamespace(vocab_size=3)
    monkeypatch.setattr(cli, "model_loader", lambda *a, **k: lambda name, dtype: (None, None, target, _Tok()))
    seen = {}

    def prepare(*_, **kw):
        seen.update(kw)
        raise _Loaded

    monkeypatch.setattr(cli, "prepare", prepare)
    with pytest.raises(_Loaded):
        cli.main(["generate", "--prompt", "hi", "--compile-cache", "none", *flags])
    return seen


def test_stop_token_ids_reach_the_decode_call_beside_ignore_eos(monkeypatch):
    """--ignore-eos drops the model's end tokens, not the ids asked for with --stop-token-ids."""
    seen = _decode_kwargs(monkeypatch, ["--stop-token-ids", "2, 0", "--ignore-eos"])
    assert seen["stop_token_ids"] == [2, 0] and seen["eos_ids"] == []


def test_logit_bias_and_min_tokens_reach_the_decode_call(monkeypatch):
    flags = ["--logit-bias", "2:-inf, 0:1.5", "--min-tokens", "3", "--repetition-penalty", "1.2"]
    flags += ["--presence-penalty", "0.5", "--frequency-penalty", "-0.25"]
    seen = _decode_kwargs(monkeypatch, flags)
    assert seen["logit_bias"] == {2: float("-inf"), 0: 1.5} and seen["min_tokens"] == 3
    assert (seen["repetition_penalty"], seen["presence_penalty"], seen["frequency_penalty"]) == (1.2, 0.5, -0.25)
    seen = _decode_kwargs(monkeypatch, ["--logprobs", "--top-logprobs", "4"])
    assert seen["logprobs"] is True and seen["top_logprobs"] == 4


def test_min_tokens_holds_back_the_stop_strings_too(monkeypatch):
    """--ignore-eos --min-tokens 3 --stop x: no end token for the decode to mask, but the stream's stop-string
    check holds the strings back, so the decode call is told the row has strings (decode refuses a min_tokens
    with nothing to hold back)."""
    seen = _decode_kwargs(monkeypatch, ["--ignore-eos", "--min-tokens", "3", "--stop", "x"])
    assert seen["min_tokens"] == 3 and seen["eos_ids"] == [] and seen["stop_strings"] == [True]
    seen = _decode_kwargs(monkeypatch, ["--ignore-eos", "--min-tokens", "3", "--stop-token-ids", "1"])
    assert seen["min_tokens"] == 3 and seen["stop_strings"] == [False]


def test_compare_when_sampling_gives_no_speedup_between_different_outputs(monkeypatch, capsys):
    """At --temperature > 0 the two sides sample other outputs (here 3 and 6 tokens), each rate with its prefill:
    the ratio of their tokens/s (3.00x) was printed as a speedup. It is labelled not like for like, with each
    side's tokens and rate; greedy (the same output) still prints the speedup."""
    flags = ["generate", "--prompt", "hi", "--compile-cache", "none", "--compare"]
    _fake_decodes(monkeypatch, [1, 0, 2], [1, 1, 0, 1, 0, 2])
    assert cli.main([*flags, "--temperature", "1"]) == 0
    err = capsys.readouterr().err
    assert "no speedup: not like for like at --temperature 1.0: the sampled outputs differ" in err
    assert "speculative 3 tokens at 30.0 tok/s, plain 6 tokens at 10.0 tok/s" in err
    assert "3.00x" not in err and "[speedup" not in err
    assert cli.main([*flags, "--temperature", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speedup"] is None and out["tokens_per_s_ratio"] == 3.0
    assert "sampled outputs differ (speculative 3 tokens, plain 6)" in out["not_like_for_like"]
    _fake_decodes(monkeypatch, [1, 0, 2], [1, 0, 2])
    for temperature in ("0", "1"):  # the same output: the same work on both sides
        assert cli.main([*flags, "--temperature", temperature]) == 0
        assert "[speedup 3.00x over plain decoding, measured in this run; output identical]" in capsys.readouterr().err


@pytest.fixture
def jax_cache_config():
    """JAX's compilation-cache settings, restored after the test (the test session's cache is configured)."""
    import jax

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    yield jax
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_an_explicit_compile_cache_wins_over_the_environment(command, jax_cache_config, tmp_path, monkeypatch):
    """With JAX_COMPILATION_CACHE_DIR set, --compile-cache DIR and --compile-cache none were ignored, and the
    minimum compile time to cache (JAX's 1 s) was left as it was. A given flag wins; without it the environment's
    directory is used; either way every program is cached."""
    from jspec.bench import targets

    jax = jax_cache_config
    env_dir, flag_dir = str(tmp_path / "env"), str(tmp_path / "flag")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", env_dir)

    def loader(*_, **__):
        raise _Loaded

    monkeypatch.setattr(cli, "model_loader", loader)
    monkeypatch.setattr(targets, "load_target", loader)
    argv = ["generate", "--prompt", "hi"] if command == "generate" else ["bench", "--out", str(tmp_path / "out")]
    for flags, want in (([], env_dir), (["--compile-cache", flag_dir], flag_dir), (["--compile-cache", "none"], None)):
        jax.config.update("jax_compilation_cache_dir", env_dir)  # as JAX takes it from the environment at import
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # JAX's default
        with pytest.raises(_Loaded):
            cli.main([*argv, *flags])
        assert jax.config.jax_compilation_cache_dir == want, flags
        if want is not None:
            assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0, flags
    # A default directory (explicit=False, what an absent flag passes): the environment's overrides it.
    assert loaders.enable_compile_cache(flag_dir) == env_dir


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--phase-repeats", "0"], "--phase-repeats 0: must be >= 1"),
        (["--bucket", "0"], "--bucket 0: must be >= 1"),
        (["--n", "0"], "--n 0: must be >= 1 (requests per workload)"),
        (["--passes", "0"], "--passes 0: must be >= 1"),
        (["--max-len", "0"], "--max-len 0: must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--rounds-per-sync", "0"], "--rounds-per-sync 0: must be >= 1"),
        (["--gamma", "0"], "--gamma 0: must be >= 1"),
        (["--concurrency", "0"], "--concurrency 0: must be >= 1"),
        (["--max-new-tokens", "700"], "--max-new-tokens 700 > --max-len 640: no request fits"),
        (["--timeout-s", "-1"], "--timeout-s -1.0: must be a number of seconds > 0"),
        (["--max-wall-s", "0"], "--max-wall-s 0.0: must be a number of seconds > 0"),
        (["--workloads", ""], "--workloads '': name at least one of math, code, chat, grounded"),
        (["--workloads", "math,poems"], "--workloads: unknown poems"),
        (["--workloads", "math,math"], "names a workload twice"),
        (["--top-k", "5"], "--top-k 5 has no effect at --temperature 0 (greedy)"),
        (["--min-p", "0.1"], "--min-p 0.1 has no effect at --temperature 0"),
        (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be finite and >= 0"),
        (["--seed", "-1"], "--seed must be in [0, "),
        (["--peers", "transformers,vllm"], "--peers: unknown vllm"),
    ],
)
def test_bench_refuses_bad_settings_before_loading_a_model(flags, message, monkeypatch, capsys):
    """`python -m jspec bench` checked nothing: --phase-repeats 0 failed after every run, --bucket 0 on a division
    by zero, --workloads '' on a KeyError, --concurrency 0 dropped the saturation run, a filter at temperature 0
    was ignored. Each is now an `error:` line and exit status 2, before any model is loaded."""
    from jspec.bench import targets

    def no_load(*_, **__):
        raise AssertionError("the settings must be refused before a model is loaded")

    monkeypatch.setattr(targets, "load_target", no_load)
    monkeypatch.setattr(cli, "model_loader", no_load)
    assert cli.main(["bench", "--compile-cache", "none", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
