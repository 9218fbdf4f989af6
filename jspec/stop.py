"""Stop strings (vLLM's and OpenAI's ``stop``): a request ends at the first of its strings to appear in its text.

Text exists only on the host, so this is a host-side check over the tokens a stream or the serving engine
returns after each step, given the caller's detokenizer (jspec never imports a tokenizer). A step can emit
several tokens (accepted drafts): the request keeps the tokens up to the one that completes the string, and its
text ends right before the string (vLLM's default, ``include_stop_str_in_output=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def check_stop_strings(stops) -> tuple[str, ...]:
    """``stops`` as a tuple of non-empty strings (one string is refused: "\\n\\n" would not mean ["\\n", "\\n"])."""
    if isinstance(stops, str) or not isinstance(stops, Sequence):
        raise ValueError(f"stop strings must be a list of strings, got {stops!r:.80}")
    bad = [s for s in stops if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop strings must be non-empty strings, got {bad!r:.80}")
    return tuple(stops)


class StopStrings:
    """One request's stop strings over its generated tokens, fed step by step.

    detokenize: token ids -> text (e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``), applied to the
    whole output so far, so merges and multi-byte characters across token boundaries come out as the tokenizer
    writes them. Only the text near the end is searched after each step (a string that spans steps is found)."""

    def __init__(self, stops: Sequence[str], detokenize: Callable[[list[int]], str]):
        self.stops = check_stop_strings(stops)
        self._detokenize = detokenize
        self._longest = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self._searched = 0  # text length before the last step: earlier text held no stop string
        self.matched: str | None = None  # the stop string that ended the request
        self.text: str | None = None  # the request's text, cut before ``matched``, once it ended

    def _find(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string in text[start:] (the longest among those starting there): (position, string)."""
        hits = [(text.find(s, start), -len(s), s) for s in self.stops]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            return None
        pos, _, s = min(hits)
        return pos, s

    def feed(self, new_tokens: Sequence[int]) -> int | None:
        """Add a step's tokens. Returns None while no stop string appeared, else how many of ``new_tokens`` the
        request keeps (the last of them completes the string); afterwards ``matched`` and ``text`` are set."""
        if self.matched is not None:
            raise ValueError(f"this request already ended at the stop string {self.matched!r}")
        if not self.stops:
            self.tokens += list(new_tokens)
            return None
        before = len(self.tokens)
        # A string may begin in earlier text that the new tokens complete (or that the tokenizer rewrites).
        start = max(0, self._searched - self._longest - 8)
        text = self._detokenize(self.tokens + list(new_tokens))
        if self._find(text, start) is None:
            self.tokens += list(new_tokens)
            self._searched = len(text)
            return None
        for keep in range(1, len(new_tokens) + 1):  # the first token that completes a string
            text = self._detokenize(self.tokens + list(new_tokens[:keep]))
            hit = self._find(text, start)
            if hit is not None:
                self.tokens += list(new_tokens[:keep])
                self.matched, self.text = hit[1], text[: hit[0]]
                return keep
        raise AssertionError(f"a stop string in the text of {before} + {len(new_tokens)} tokens but in no prefix")

    @staticmethod
    def cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
        """``text`` cut before the first of ``stops`` in it, and that string (None when none occurs)."""
        best = None
        for s in stops:
            pos = text.find(s)
            if pos >= 0 and (best is None or (pos, -len(s)) < (best[0], -len(best[1]))):
                best = (pos, s)
        return (text, None) if best is None else (text[: best[0]], best[1])
