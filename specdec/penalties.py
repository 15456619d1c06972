"""What the penalties read (specdec/rules.py): each token's occurrences in a row's history, kept per session.

Row i of a call at position first counts tokens[: first + i]: its output part (from the rules' output_start) for
frequency_penalty and presence_penalty, all of it for repetition_penalty. A session's counts follow its history
the way its grammar matcher does: a call takes back the tokens its history no longer holds (a rejected round) and
adds the new ones, so it costs its own tokens and the tokens the history holds, not a count over the whole history
(1.4 ms a call at 8,300 tokens when every call counted everything).
"""

from __future__ import annotations

import numpy as np

from specdec.prefix_cache import common_prefix
from specdec.sampling import lookup


class TokenCounts:
    """Occurrences of every token in a session's committed history (the tokens before a call's drafts)."""

    def __init__(self, output_start: int, vocab: int):
        self.output_start = output_start
        self.tokens: list[int] = []  # the history counted
        self.output = np.zeros(vocab, dtype=np.int32)  # occurrences at positions >= output_start
        self.held = np.zeros(vocab, dtype=np.int32)  # occurrences anywhere

    def rows(self, tokens: list[int], first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens any row's history holds (ascending), and for each row i < n and each of them: its occurrences
        in the output before the row (tokens[output_start : first + i]), float32, and whether the prompt or output
        before the row holds it, bool; [n, len(tokens held)] each. tokens[first:] are the call's drafts."""
        self._move(tokens[:first])
        drafts = tokens[first : first + n - 1]
        held = np.flatnonzero(self.held)
        cand = np.union1d(held, drafts) if drafts else held
        counts = np.repeat(self.output[cand][None].astype(np.float32), n, axis=0)
        seen = np.repeat(self.held[cand][None] > 0, n, axis=0)
        for j, c in enumerate(np.searchsorted(cand, drafts).tolist()):  # rows after draft j count it
            seen[j + 1 :, c] = True
            counts[j + 1 :, c] += first + j >= self.output_start
        return cand, counts, seen

    def _move(self, history: list[int]) -> None:
        keep = common_prefix(self.tokens, history)
        self._add(self.tokens[keep:], keep, -1)
        del self.tokens[keep:]
        self._add(history[keep:], keep, 1)
        self.tokens.extend(history[keep:])

    def _add(self, tokens: list[int], at: int, sign: int) -> None:
        """Count tokens (at positions at, at + 1, ...) in, or with sign -1 out."""
        if tokens:
            t = np.asarray(tokens, dtype=np.int64)
            np.add.at(self.held, t, sign)
            np.add.at(self.output, t[max(self.output_start - at, 0) :], sign)


def row_edits(rules, counts: TokenCounts | None, tokens: list[int], first: int, n: int, scored=None) -> list:
    """(row index, column index, function of those logits) for the bias, the penalties and min_tokens of rules
    (specdec.rules.Rules), in that order, as numpy indices: only the columns they touch. counts: the session's, where
    the rules count tokens; scored: a draft's scored token ids (ascending), whose columns its rows hold, or None."""
    edits, every_row = [], np.arange(n)[:, None]
    if rules.bias:
        cols, found = _columns([t for t, _ in rules.bias], scored)
        if len(cols):
            add = np.array([b for _, b in rules.bias], dtype=np.float32)[found]
            edits.append((every_row, cols, lambda x: x + add))
    if rules.counts_tokens:
        cand, occurrences, seen = counts.rows(tokens, first, n)  # tokens, [n, len(cand)] twice
        cols, keep = _columns(cand, scored)
        if len(cols):
            c, s = occurrences[:, keep], seen[:, keep]
            edits.append((every_row, cols, lambda x: _penalize(rules, x, c, s)))
    short = [i for i in range(n) if first + i - rules.output_start < rules.min_tokens]
    blocked, _ = _columns(rules.blocked, scored)
    if short and len(blocked):
        edits.append((np.array(short)[:, None], blocked, lambda x: np.full_like(x, -np.inf)))
    return edits


def _columns(tokens, scored: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The columns of the tokens a row holds (a token's own, or its column among a draft's scored ids), and which of
    the tokens have one."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if scored is None or not len(tokens):
        return tokens, np.ones(len(tokens), dtype=bool)
    at, found = lookup(scored, tokens)
    return at[found], found


def _penalize(rules, x: np.ndarray, counts: np.ndarray, seen: np.ndarray) -> np.ndarray:
    if rules.repetition != 1.0:
        x = np.where(seen, np.where(x > 0, x / np.float32(rules.repetition), x * np.float32(rules.repetition)), x)
    return x - np.float32(rules.frequency) * counts - np.float32(rules.presence) * (counts > 0)
