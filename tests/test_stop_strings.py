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


@pytest.mark.parametrize("stops", ["ab", [""], [1], None])
def test_bad_stop_strings_are_refused(stops):
    with pytest.raises(ValueError, match="stop strings must be"):
        StopStrings(stops, spell)


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


def cut_reference(tokens, stops):
    """decode's tokens cut after the first token whose prefix's text holds a stop string (whole-text search)."""
    for n in range(1, len(tokens) + 1):
        if any(s in spell(tokens[:n]) for s in stops):
            return tokens[:n], True
    return tokens, False


def test_engine_stop_strings_end_each_request_at_its_own():
    kw = dict(drafter=CHAIN, draft_params=DPARAMS, gamma=3)
    full = [dec.decode(TARGET, TPARAMS, [p], max_new_tokens=16, **kw).tokens[0] for p in PROMPTS]
    # Per request: a string its output holds (two letters from its middle), a string it never holds, none.
    stops = [[spell(full[0][5:7])], ["dddddd"], [], [spell(full[3][2:4]), spell(full[3][9:10])]]
    eng = Engine(TARGET, TPARAMS, batch=2, max_len=32, detokenize=spell, rounds_per_sync=2, **kw)
    got, queue, owner = {}, list(range(len(PROMPTS))), {}
    while queue or owner:
        for row in eng.free_rows():
            if row in owner:
                done = owner.pop(row)
                got[done] = (got[done], eng.stop_reason(row), eng.matched_stop(row))
            if queue:
                i = queue.pop(0)
                owner[row] = i
                got[i] = [eng.add(row, PROMPTS[i], 16, stop=stops[i])]
        if not owner:
            break
        for row, toks in eng.step().items():
            got[owner[row]] += toks
    for i in range(len(PROMPTS)):
        want, hit = cut_reference(full[i], stops[i])
        toks, reason, matched = got[i]
        assert toks == want, i
        assert reason == (dec.StopReason.STOP_STRING if hit else dec.StopReason.MAX_NEW_TOKENS), i
        assert (matched is not None) == hit and (matched is None or matched in spell(toks)), i
    assert got[0][1] == dec.StopReason.STOP_STRING and got[1][1] == dec.StopReason.MAX_NEW_TOKENS
    # A string in the very first token of a request that stops there anyway (a budget of 1): still the string's.
    eng.add(0, PROMPTS[0], 1, stop=[spell(full[0][:1])])
    assert eng.stop_reason(0) == dec.StopReason.STOP_STRING and eng.matched_stop(0) == spell(full[0][:1])
    with pytest.raises(ValueError, match=r"need the engine's detokenize"):
        Engine(TARGET, TPARAMS, batch=1, max_len=16).add(0, [0], 3, stop=["a"])
    assert np.all([len(got[i][0]) <= 16 for i in got])
