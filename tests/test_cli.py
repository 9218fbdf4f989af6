"""``python -m jspec generate`` refuses flags that its drafter would ignore, before any model is loaded."""

import pytest

from jspec import cli


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
        ["--drafter", "layerskip", "--dynamic-tree", "2,2,4", "--adaptive"],
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
