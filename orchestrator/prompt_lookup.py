"""Prompt lookup: proposals copied from the sequence itself (Saxena, 2023; vLLM's "ngram" method).

Answers repeat their context: a summary quotes its passage, code reuses its names, a list
repeats its own frame. When the last n tokens of the sequence (n_max >= n >= n_min, longest
first) occurred before, the tokens that followed their latest earlier occurrence are a
proposal that costs no draft call. The orchestrator verifies it like a draft's, as a point
mass q = 1 on each proposed token, so the ratio test keeps the output exactly the target's.
"""

from __future__ import annotations


class PromptLookup:
    """An index of one growing sequence's n-grams, each mapped to where it last ended."""

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest repeated suffix of history; [] when none repeats.

        history only ever grows between calls (the orchestrator's token history).
        """
        end = len(history)
        for e in range(max(self._indexed, self.n_min), end):  # n-grams that have a continuation: e < end
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self._ends[tuple(history[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            e = self._ends.get(tuple(history[end - n :]))
            if e is not None:
                return history[e : e + k]
        return []
