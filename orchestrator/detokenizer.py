"""Incremental text of the generated tokens, with stop strings.

Text is released only when nothing can change it: the last (longest stop - 1)
characters wait until a stop string is ruled out, and a character still split
across tokens (U+FFFD at the end) waits for its remaining bytes.

A round decodes only the tokens since the last complete character, with a few
before them (vLLM's and TGI's incremental detokenizing): the text of the tokens
before is kept. Decoding every token each round cost O(length) a round, 0.7 ms
at 4,000 tokens on the orchestrator's one event loop.
"""

from __future__ import annotations

CONTEXT = 4  # tokens decoded again before the new ones: a decoder's rule at a token's start sees what precedes it


class TextStream:
    def __init__(self, tokenizer, stops: list[str] = ()):
        self._tok = tokenizer
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the text of every token so far, as one decode of them all gives it
        self._sent = 0
        self.stopped = False
        self._read = 0  # the tokens whose text ends on a complete character: later tokens cannot change it
        self._stable = ""  # their text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _text(self) -> str:
        """The text of self.ids: the kept text of the first _read tokens, and what the tokens after them add to
        the last CONTEXT before them (each decoded from the same token, so a leading space or a character split
        across them comes out as in one decode of all). A window whose text does not extend its context's is
        decoded whole."""
        start = max(self._read - CONTEXT, 0)
        before, now = self._decode(self.ids[start : self._read]), self._decode(self.ids[start:])
        text = self._stable + now[len(before) :] if now.startswith(before) else self._decode(self.ids)
        if not text.endswith("\ufffd"):
            self._read, self._stable = len(self.ids), text
        return text

    def _first_stop(self, text: str, start: int) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def extend(self, new_ids: list[int]) -> int:
        """Append tokens; returns how many of them are kept (fewer when a stop string ended the text)."""
        base = len(self.ids)
        self.ids.extend(new_ids)
        text = self._text()
        hit = self._first_stop(text, max(0, self._sent - self._hold)) if self.stops else None
        if hit is None:
            self.text = text
            return len(new_ids)
        # the first token whose text completes the stop string; tokens after it are dropped
        idx, _ = hit
        for m in range(base + 1, len(self.ids) + 1):
            if self._first_stop(self._decode(self.ids[:m]), max(0, self._sent - self._hold)) is not None:
                break
        del self.ids[m:]
        self.text = text[:idx]
        self.stopped = True
        return m - base

    def take_text(self, final: bool = False) -> str:
        """The text not yet released that nothing can change any more."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        if not final:
            while end > self._sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
