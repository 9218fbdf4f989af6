"""Stop strings (vLLM's and OpenAI's ``stop``): a request ends at the first of its strings to appear in its text.

Text exists only on the host, so this is a host-side check over the tokens a stream or the serving engine
returns after each step, given the caller's detokenizer (jspec never imports a tokenizer). A step can emit
several tokens (accepted drafts): the request keeps the tokens up to the one that completes the string, and its
text ends right before the string (vLLM's default, ``include_stop_str_in_output=False``). With min_tokens, a
string counts only where a token after the request's first min_tokens completes it (vLLM's rule: it checks the
strings from then on, each ending in the newest text), as its end tokens are held back.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from jspec.validate import check_stop_strings


class StopStrings:
    """One request's stop strings over its generated tokens, fed step by step.

    detokenize: token ids -> text (e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``), applied to the
    whole output so far, so merges and multi-byte characters across token boundaries come out as the tokenizer
    writes them. Only the text near the end is searched after each step (a string that spans steps is found).
    min_tokens: a string counts only where it ends in the text after the first min_tokens tokens, i.e. a later
    token completes it (vLLM's ``min_tokens``: one that began earlier counts, one wholly inside does not).
    ``visible()`` is the text a stream may show so far. With no strings, ``feed`` only collects the tokens."""

    def __init__(self, stops: Sequence[str], detokenize: Callable[[list[int]], str], min_tokens: int = 0):
        self.stops = check_stop_strings(stops)
        try:  # an int or a NumPy integer, not a bool or a float
            n_min = None if isinstance(min_tokens, bool) else operator.index(min_tokens)
        except TypeError:
            n_min = None
        if n_min is None or n_min < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
        self.min_tokens = n_min
        self._detokenize = detokenize
        self._longest = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self._searched = 0  # text length before the last step: earlier text held no stop string
        self._floor = 0 if n_min == 0 else None  # where a string must end after (None: min_tokens not reached)
        self._last: str | None = None  # the text of ``tokens`` when the last step computed it
        self.matched: str | None = None  # the stop string that ended the request
        self.text: str | None = None  # the request's text, cut before ``matched``, once it ended

    def _find(self, text: str, start: int) -> tuple[int, str] | None:
        return _earliest(text, self.stops, start, self._floor)

    def feed(self, new_tokens: Sequence[int]) -> int | None:
        """Add a step's tokens. Returns None while no stop string appeared, else how many of ``new_tokens`` the
        request keeps (the last of them completes the string); afterwards ``matched`` and ``text`` are set."""
        if self.matched is not None:
            raise ValueError(f"this request already ended at the stop string {self.matched!r}")
        new_tokens = list(new_tokens)
        if not self.stops:
            self.tokens += new_tokens
            self._last = None
            return None
        before = len(self.tokens)
        text = self._detokenize(self.tokens + new_tokens)
        if before + len(new_tokens) <= self.min_tokens:  # the first min_tokens tokens' text is not searched
            self.tokens += new_tokens
            self._searched, self._last = len(text), text
            return None
        if self._floor is None:
            self._floor = len(self._detokenize((self.tokens + new_tokens)[: self.min_tokens]))
        # A string may begin in earlier text that the new tokens complete (or that the tokenizer rewrites).
        start = max(0, self._searched - self._longest - 8)
        if self._find(text, start) is None:
            self.tokens += new_tokens
            self._searched, self._last = len(text), text
            return None
        for keep in range(max(1, self.min_tokens - before + 1), len(new_tokens) + 1):  # the first completing one
            text = self._detokenize(self.tokens + new_tokens[:keep])
            hit = self._find(text, start)
            if hit is not None:
                self.tokens += new_tokens[:keep]
                self.matched, self.text = hit[1], text[: hit[0]]
                return keep
        raise AssertionError(f"a stop string in the text of {before} + {len(new_tokens)} tokens but in no prefix")

    def visible(self, final: bool = False) -> str:
        """The text so far as a stream may show it: once a string matched, the text before it; else (``final``:
        the request ended otherwise) the whole text; else the text without its last len(longest string) - 1
        characters, which could begin a string the next tokens complete (vLLM holds them back alike), and
        without a trailing U+FFFD (a token ending inside a UTF-8 character, until the rest arrives). A
        tokenizer may still rewrite earlier characters as text grows; callers showing text by differences
        should check that what they showed is a prefix of the new text."""
        if self.matched is not None:
            return self.text
        text = self._last if self._last is not None else self._detokenize(self.tokens)
        self._last = text
        if final:
            return text
        text = text[: len(text) - (self._longest - 1)] if self._longest > 1 else text
        return text.rstrip("\ufffd")

    @staticmethod
    def cut(text: str, stops: Sequence[str], floor: int = 0) -> tuple[str, str | None]:
        """``text`` cut before the first of ``stops`` in it that ends past ``floor`` (the length of the first
        min_tokens tokens' text: ``StopStrings``' rule), and that string (None when none occurs)."""
        hit = _earliest(text, check_stop_strings(stops) if stops else (), 0, floor)
        return (text, None) if hit is None else (text[: hit[0]], hit[1])


def _earliest(text: str, stops: Sequence[str], start: int, floor: int) -> tuple[int, str] | None:
    """The earliest of ``stops`` in text[start:] that ends past ``floor`` (the longest among those starting
    there): (position, string), or None."""
    hits = [(text.find(s, max(start, floor - len(s) + 1)), -len(s), s) for s in stops]
    hits = [h for h in hits if h[0] >= 0]
    if not hits:
        return None
    pos, _, s = min(hits)
    return pos, s
