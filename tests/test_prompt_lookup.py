"""Prompt lookup proposes what followed the longest repeated suffix, at its latest earlier occurrence."""

from __future__ import annotations

import random

import pytest

from orchestrator.prompt_lookup import PromptLookup


def brute_force(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, read off a scan from scratch."""
    end = len(history)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = history[end - n :]
        for e in range(end - 1, n - 1, -1):  # latest occurrence first; it must end before the suffix does
            if history[e - n : e] == suffix:
                return history[e : e + k]
    return []


def test_the_tokens_after_the_latest_earlier_occurrence_are_proposed():
    lookup = PromptLookup(2, 4)
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8]
    assert lookup.propose(history[:8], 3) == [4, 5, 1]  # suffix 1 2 3 ended at 3
    assert lookup.propose(history + [1, 2, 3], 3) == [7, 8, 1]  # now 1 2 3 last ended at 8


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    lookup = PromptLookup(1, 3)
    history = [5, 6, 7, 9, 6, 7, 8, 5, 6, 7]  # (6, 7) last ended at 6, but (5, 6, 7) ended at 3
    assert lookup.propose(history, 2) == [9, 6]


def test_nothing_is_proposed_without_a_repeat_of_at_least_n_min_tokens():
    lookup = PromptLookup(3, 4)
    assert lookup.propose([1, 2, 3, 4], 4) == []
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3], 4) == []  # only 2 tokens repeat
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 4], 4) == [9, 2, 3, 4]
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 4, 5], 0) == []


def test_a_proposal_near_the_end_is_as_long_as_what_followed():
    assert PromptLookup(1, 2).propose([4, 4, 4], 5) == [4]  # (4, 4) ended at 2; one token followed


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (3, 6)])
def test_the_growing_index_proposes_what_a_scan_from_scratch_proposes(n_min, n_max):
    rng = random.Random(n_min * 10 + n_max)
    for _ in range(20):
        lookup, history = PromptLookup(n_min, n_max), [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        for _ in range(30):
            k = rng.randrange(0, 6)
            assert lookup.propose(history, k) == (brute_force(history, k, n_min, n_max) if k else [])
            history += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # a round appends 1 to K + 1 tokens


def test_bad_bounds_are_refused():
    for bounds in ((0, 3), (3, 2)):
        with pytest.raises(ValueError):
            PromptLookup(*bounds)
