"""Stop strings (``jspec.stop``): the search over a growing text, the tokens kept when several arrive in one
step, and the serving engine against decode's tokens cut where the text first holds a string (found with
str.find over the whole text, independently of the incremental search)."""

import numpy as np
import pytest
from test_logit_processors import CHAIN, DPARAMS, PROMPTS, TARGET, TPARAMS

from jspec import decode as dec
from jspec.serve import Engine
from jspec.stop import StopStrings

LETTERS = "abcd"


def spell(ids) -> str:
    """A toy detokenizer: token i is the letter LETTERS[i]."""
    return "".join(LETTERS[i] for i in ids)


def test_a_string_completed_inside_a_step_keeps_the_tokens_up_to_it():
    s = StopStrings(["cab", "dd"], spell)
    assert s.feed([0, 1]) is None and s.feed([2]) is None  # "abc"
    assert s.feed([0, 1, 3, 3]) == 2  # "abc" + "ab": "cab" completes at the second new token
    assert (s.matched, s.text, s.tokens) == ("cab", "ab", [0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="already ended at the stop string 'cab'"):
        s.feed([0])


def test_the_earliest_string_wins_and_a_string_in_one_token_counts():
    s = StopStrings(["bc", "abcd", "d"], spell)
    assert s.feed([0, 1, 2, 3]) == 3  # "abc": "bc" completes at token 3 ("abcd" would need token 4)
    assert (s.matched, s.text) == ("bc", "a")
    t = StopStrings(["d"], spell)
    assert t.feed([3]) == 1 and t.text == ""
    assert StopStrings.cut("xxabyyab", ["ab", "yy"]) == ("xx", "ab")
    assert StopStrings.cut("xx", ["ab"]) == ("xx", None)


def test_a_detokenizer_that_rewrites_earlier_text_is_followed():
    """Two tokens that merge into one character (as UTF-8 bytes do): the string appears only once both are in."""

    def merge(ids):
        text = "".join(LETTERS[i] for i in ids)
        return text.replace("ab", "X")

    s = StopStrings(["Xc"], merge)
    assert s.feed([0]) is None and s.feed([1]) is None  # "X"
    assert s.feed([2, 3]) == 1 and s.text == ""


def test_one_string_is_one_stop_string_and_ties_go_to_the_longest():
    s = StopStrings("bc", spell)  # OpenAI's and vLLM's stop="bc": not the two strings "b" and "c"
    assert s.stops == ("bc",) and s.feed([0, 1]) is None and s.feed([2, 3]) == 1 and s.matched == "bc"
    # Token 0 writes "abc": "ab" and "abc" both begin at 0 in its text; the longer is the one reported.
    t = StopStrings(["ab", "abc"], lambda ids: "".join(["abc", "d", "e", "f"][i] for i in ids))
    assert t.feed([1, 0]) == 2 and (t.matched, t.text) == ("abc", "d")


@pytest.mark.parametrize("stops", [[""], [1], None, ["a", ""]])
def test_bad_stop_strings_are_refused(stops):
    with pytest.raises(ValueError, match="stop strings must be"):
        StopStrings(stops, spell)
    with pytest.raises(ValueError, match="min_tokens must be an int >= 0"):
        StopStrings(["a"], spell, min_tokens=-1)


def cut_reference(tokens, stops, min_tokens=0):
    """decode's tokens cut after the first token past the first min_tokens that completes a stop string, as
    vLLM checks: from then on, after each token, for a string ending in the text that token added (a whole-text
    search per prefix; spell's text grows by one letter a token)."""
    for n in range(min_tokens + 1, len(tokens) + 1):
        text = spell(tokens[:n])
        if any(text.endswith(s) for s in stops):
            return tokens[:n], True
    return tokens, False


def test_random_streams_match_the_whole_text_reference():
    """Random outputs fed in random steps, random stop strings and min_tokens: the tokens kept, the text and the
    string match the reference, and ``visible()`` never shows a character the final text lacks nor any part of
    the string that ended it."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 20))).tolist()
        stops = ["".join(LETTERS[i] for i in rng.integers(0, 4, size=int(rng.integers(1, 4)))) for _ in range(2)]
        n_min = int(rng.integers(0, 6))
        want, hit = cut_reference(tokens, stops, n_min)
        s = StopStrings(stops, spell, n_min)
        i, keep, shown = 0, None, []
        while i < len(tokens) and keep is None:
            step = tokens[i : i + int(rng.integers(1, 5))]
            keep = s.feed(step)
            i += len(step)
            shown.append(s.visible())
        final = s.visible(final=True)
        assert s.tokens == want and (s.matched is not None) == hit, (tokens, stops, n_min)
        if hit:  # the text ends before the longest string the last token completed
            text = spell(want)
            pos = len(text) - max(len(x) for x in stops if text.endswith(x))
            assert final == s.text == text[:pos] and text.startswith(s.matched, pos)
        else:
            assert final == spell(tokens)
        assert all(final.startswith(v) for v in shown)
        hits += hit
    assert 100 < hits < 390  # both outcomes well represented


def test_visible_text_holds_back_a_possible_beginning():
    s = StopStrings(["cda"], spell)
    s.feed([0, 1, 2])
    assert (s.visible(), s.visible(final=True)) == ("a", "abc")  # "bc" could begin "cda"
    s.feed([3])
    assert s.visible() == "ab"
    assert s.feed([1]) is None and s.visible() == "abc"
    odd = StopStrings([], lambda ids: "ab\ufffd" if len(ids) == 1 else "abé")  # a character split over tokens
    odd.feed([0])
    assert (odd.visible(), odd.visible(final=True)) == ("ab", "ab\ufffd")
    odd.feed([1])
    assert odd.visible() == "abé"


class _FakeStream:
    """decode_stream's protocol over fixed chunks (one row), for the CLI's stepping."""

    def __init__(self, chunks):
        self.chunks, self.sent = list(chunks), []

    def __iter__(self):
        return self

    def __next__(self):
        if not self.chunks:
            raise StopIteration
        self.sent.append(self.chunks.pop(0))
        return [self.sent[-1]]

    def output(self):
        toks = [t for c in self.sent for t in c]
        stats = {"new_tokens": [len(toks)]}
        return dec.DecodeOutput([toks], [dec.StopReason.RUNNING], stats, [[-0.5] * len(toks)], None)


def test_cli_stream_never_shows_part_of_a_stop_string():
    """--stream --stop: "c" of the stop string "cd" arrives a round before "d"; it must not be printed."""
    import io
    from types import SimpleNamespace

    from jspec import cli

    stream = _FakeStream([[0, 1], [2], [3, 0, 1]])
    prepared = SimpleNamespace(compile_stream=lambda: None, stream=lambda fns: stream)
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: spell(ids))
    out = io.StringIO()
    result = cli._stream_timed(prepared, tok, out, stops=("cd",))
    assert out.getvalue() == "ab\n"
    assert result.tokens == [[0, 1, 2, 3]] and result.stop_reason == [dec.StopReason.STOP_STRING]
    assert result.logprobs == [[-0.5] * 4] and result.stats["new_tokens"] == [6]  # every token decoded counts
    # With min_tokens 2 the "ab" of the first two tokens does not count (the first two complete it); the one the
    # last step completes does.
    out = io.StringIO()
    stream = _FakeStream([[0, 1], [2], [3, 0, 1]])
    prepared = SimpleNamespace(compile_stream=lambda: None, stream=lambda fns: stream)
    result = cli._stream_timed(prepared, tok, out, stops=("ab",), min_tokens=2)
    assert out.getvalue() == "abcd\n" and result.tokens == [[0, 1, 2, 3, 0, 1]]
    assert result.stop_reason == [dec.StopReason.STOP_STRING]


def test_engine_stop_strings_end_each_request_at_its_own():
    kw = dict(drafter=CHAIN, draft_params=DPARAMS, gamma=3)
    full = [dec.decode(TARGET, TPARAMS, [p], max_new_tokens=16, **kw).tokens[0] for p in PROMPTS]
    # Per request: a string its output holds (two letters from its middle), a string it never holds, none.
    # Request 3's min_tokens skips its first string where it comes before token 5 (no EOS: only the strings).
    stops = [[spell(full[0][5:7])], "dddddd", [], [spell(full[3][2:4]), spell(full[3][9:10])]]
    n_min = [0, 0, 0, 5]
    eng = Engine(TARGET, TPARAMS, batch=2, max_len=32, detokenize=spell, rounds_per_sync=2, **kw)
    got, shown, queue, owner = {}, {}, list(range(len(PROMPTS))), {}
    while queue or owner:
        for row in eng.free_rows():
            if row in owner:
                done = owner.pop(row)
                got[done] = (got[done], eng.stop_reason(row), eng.matched_stop(row), eng.text(row))
            if queue:
                i = queue.pop(0)
                owner[row] = i
                got[i] = [eng.add(row, PROMPTS[i], 16, stop=stops[i], min_tokens=n_min[i])]
                shown[i] = [eng.text(row)]
        if not owner:
            break
        for row, toks in eng.step().items():
            got[owner[row]] += toks
            shown[owner[row]].append(eng.text(row))
    for i in range(len(PROMPTS)):
        strings = [stops[i]] if isinstance(stops[i], str) else stops[i]
        want, hit = cut_reference(full[i], strings, n_min[i])
        toks, reason, matched, text = got[i]
        assert toks == want, i
        assert reason == (dec.StopReason.STOP_STRING if hit else dec.StopReason.MAX_NEW_TOKENS), i
        assert (matched is not None) == hit and (matched is None or matched in spell(toks)), i
        # The text shown: cut before the string the last token completed, whole otherwise, and every text shown
        # on the way a beginning of it (no part of the string ever shown).
        assert text == (spell(want)[: len(spell(want)) - len(matched)] if hit else spell(want)), i
        assert all(text.startswith(v) for v in shown[i]), (i, shown[i], text)
    before = spell(full[3][:5])
    assert spell(full[3][2:4]) in before and len(got[3][0]) > 5  # min_tokens really skipped an early match
    assert got[0][1] == dec.StopReason.STOP_STRING and got[1][1] == dec.StopReason.MAX_NEW_TOKENS
    # A string in the very first token of a request that stops there anyway (a budget of 1): still the string's.
    eng.add(0, PROMPTS[0], 1, stop=[spell(full[0][:1])])
    assert eng.stop_reason(0) == dec.StopReason.STOP_STRING and eng.matched_stop(0) == spell(full[0][:1])
    bare = Engine(TARGET, TPARAMS, batch=1, max_len=16)
    with pytest.raises(ValueError, match=r"need the engine's detokenize"):
        bare.add(0, [0], 3, stop=["a"])
    with pytest.raises(ValueError, match=r"text\(row\) needs the engine's detokenize"):
        bare.text(0)
    with pytest.raises(ValueError, match=r"row 0: min_tokens \(2\) holds back nothing: .* or stop string"):
        bare.add(0, [0], 3, min_tokens=2)  # no EOS ids, no stop ids, no stop strings
    assert np.all([len(got[i][0]) <= 16 for i in got])


def test_decode_with_stop_strings_cuts_each_row_at_its_own():
    """decode(stop=..., detokenize=...): per-row strings (one never met, none, min_tokens skipping an early one),
    a batch of 4 with a chain drafter: each row's tokens and log-probabilities are decode's cut where the
    whole-text reference first finds a string, its stop reason STOP_STRING (else decode's own)."""
    kw = dict(drafter=CHAIN, draft_params=DPARAMS, gamma=3, max_new_tokens=16, logprobs=True)
    full = dec.decode(TARGET, TPARAMS, PROMPTS, **kw)
    stops = [spell(full.tokens[0][5:7]), ["dddddd"], None, [spell(full.tokens[3][2:4]), spell(full.tokens[3][9:10])]]
    n_min = [0, 0, 0, 5]
    got = dec.decode(TARGET, TPARAMS, PROMPTS, stop=stops, detokenize=spell, min_tokens=n_min, **kw)
    for i in range(len(PROMPTS)):
        strings = [] if stops[i] is None else [stops[i]] if isinstance(stops[i], str) else stops[i]
        want, hit = cut_reference(full.tokens[i], strings, n_min[i])
        assert got.tokens[i] == want, i
        assert got.stop_reason[i] == (dec.StopReason.STOP_STRING if hit else full.stop_reason[i]), i
        assert got.logprobs[i] == full.logprobs[i][: len(want)], i
    assert got.stop_reason[0] == dec.StopReason.STOP_STRING and got.stop_reason[1] != dec.StopReason.STOP_STRING
    assert spell(full.tokens[3][2:4]) in spell(full.tokens[3][:5]) and len(got.tokens[3]) > 5  # min_tokens skipped it
    # One string for every row, met early by all of them: the steps end there, not at the budget.
    early = dec.decode(TARGET, TPARAMS, PROMPTS, stop=[s for s in LETTERS], detokenize=spell, **kw)
    assert all(len(t) == 1 for t in early.tokens) and set(early.stop_reason) == {dec.StopReason.STOP_STRING}
    assert max(early.stats["rounds"]) < max(full.stats["rounds"])
    # No row with a string (stop=[] or one None per row): the fused loop's output, as without stop=.
    for none in ([], [None] * len(PROMPTS)):
        assert dec.decode(TARGET, TPARAMS, PROMPTS, stop=none, detokenize=spell, **kw).tokens == full.tokens


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stop=["a"]), "stop strings need detokenize"),
        (dict(detokenize=spell), "detokenize is only used to find stop strings"),
        (dict(stop=[["a"], None], detokenize=spell), "stop has 2 per-row entries for 4 rows"),
        (dict(stop=[""], detokenize=spell), "stop strings must be non-empty strings"),
        (dict(min_tokens=2), r"row 0: min_tokens \(2\) holds back nothing"),
        (dict(stop="a", detokenize=spell, stop_strings=[True] * 4), "decode sets stop_strings from stop="),
    ],
)
def test_decode_stop_string_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dec.decode(TARGET, TPARAMS, PROMPTS, max_new_tokens=8, **kwargs)
    # min_tokens with stop strings and no end token: the strings are what it holds back.
    dec.decode(TARGET, TPARAMS, PROMPTS, max_new_tokens=8, min_tokens=2, stop="a", detokenize=spell)
    with pytest.raises(ValueError, match="decode_stream yields every token"):
        dec.decode_stream(TARGET, TPARAMS, PROMPTS, max_new_tokens=8, stop="a", detokenize=spell)


def test_engine_tree_top_logprobs_are_cut_with_the_tokens_at_a_stop_string():
    """A tree drafter in the engine with top_logprobs: the alternatives of the tokens a stop string keeps (cut in
    the step that completes it) are decode's own for those tokens, and as many."""
    from test_logit_processors import GREEDY_TREE

    kw = dict(drafter=GREEDY_TREE, draft_params=DPARAMS, goodput=False)
    full = dec.decode(TARGET, TPARAMS, PROMPTS[:2], max_new_tokens=16, logprobs=True, top_logprobs=2, **kw)
    stops = [spell(full.tokens[0][6:9]), spell(full.tokens[1][4:6])]
    eng = Engine(TARGET, TPARAMS, batch=2, max_len=32, logprobs=True, top_logprobs=2, detokenize=spell, **kw)
    toks, tops = {}, {}
    for r in range(2):
        toks[r] = [eng.add(r, PROMPTS[r], 16, stop=stops[r])]
        tops[r] = list(eng.last_top_logprobs[r])
    while eng.free_rows() != [0, 1]:
        for r, t in eng.step().items():
            assert len(eng.last_top_logprobs[r]) == len(t) == len(eng.last_logprobs[r])
            toks[r] += t
            tops[r] += eng.last_top_logprobs[r]
    for r in range(2):
        want, hit = cut_reference(full.tokens[r], [stops[r]])
        assert hit and toks[r] == want and eng.stop_reason(r) == dec.StopReason.STOP_STRING
        ref = full.top_logprobs[r][: len(want)]
        assert [[i for i, _ in a] for a in tops[r]] == [[i for i, _ in a] for a in ref]
        np.testing.assert_allclose([[v for _, v in a] for a in tops[r]], [[v for _, v in a] for a in ref], atol=1e-5)
        assert eng.text(r) == spell(want)[: spell(want).index(stops[r])]
