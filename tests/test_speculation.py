"""Adaptive speculation's choice of K: the expected-tokens model, the learned costs, the per-request alpha."""

from __future__ import annotations

import random

import pytest

from orchestrator import speculation as sp


def test_expected_tokens_is_leviathans_tau_with_its_limits():
    assert sp.expected_tokens(0.0, 4) == 1.0  # nothing accepted: the target's own token
    assert sp.expected_tokens(1.0, 4) == 5.0  # everything accepted, plus the bonus token
    assert sp.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert sp.expected_tokens(0.999999, 3) == pytest.approx(4.0, rel=1e-5)


def test_best_k_is_zero_when_a_drafted_token_costs_more_than_it_yields():
    round_s = [10.0 + 6.0 * k for k in range(9)]  # each drafted token costs 0.6 of a target step
    assert sp.best_k(0.5, round_s) == 0
    assert sp.best_k(0.9, round_s) > 0  # at a high enough alpha it pays all the same


def test_best_k_grows_with_alpha_and_reaches_the_cap():
    round_s = [10.0 + 1.0 * k for k in range(9)]  # a drafted token costs a tenth of a step
    ks = [sp.best_k(a, round_s) for a in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8
    assert len(set(ks)) >= 4


def test_best_k_takes_the_smaller_k_on_a_tie():
    assert sp.best_k(0.5, [2.0, 3.0]) == 0  # 1 token in 2 s against 1.5 tokens in 3 s


def test_round_costs_are_unknown_until_a_drafted_round_was_measured():
    c = sp.RoundCosts()
    assert c.round_s(4) is None
    c.observe(0, 0.010)  # the draft down: a round of the target alone
    assert c.round_s(4) is None
    c.observe(2, 0.012, draft_wall_s=0.003, draft_compute_s=0.002)
    assert c.round_s(4) is not None


def test_round_costs_price_unmeasured_k_on_the_line_through_measured_ones():
    c = sp.RoundCosts(rate=1.0)  # each observation replaces the last: exact values
    for k in (2, 4):
        c.observe(k, 0.005 + 0.0005 * k + 0.001, draft_wall_s=0.001, draft_compute_s=0.0)
        c.observe(k, 0.005 + 0.0005 * k, draft_wall_s=0.0005 + 0.0008 * k, draft_compute_s=0.0008 * k)
    got = c.round_s(6)
    want = [0.005 + 0.0005 * k + (0.0005 + 0.0008 * k if k else 0.0) for k in range(7)]
    assert got == pytest.approx(want)


def test_round_costs_with_one_measured_k_charge_each_row_the_prior_share():
    c = sp.RoundCosts(rate=1.0)
    c.observe(3, 0.010, draft_wall_s=0.002, draft_compute_s=0.0015)
    got = c.round_s(4)
    slope = sp.ROW_PRIOR * 0.010
    assert got[3] == pytest.approx(0.010 + 0.0005 + 3 * 0.0005)
    assert got[0] == pytest.approx(0.010 - 3 * slope)
    assert got[4] == pytest.approx(0.010 + slope + 0.0005 + 4 * 0.0005)


def test_prompt_lookup_rounds_price_the_verify_but_not_the_draft():
    c = sp.RoundCosts(rate=1.0)
    c.observe(2, 0.008, draft_wall_s=0.002, draft_compute_s=0.0016)
    c.observe(2, 0.006)  # copied tokens: no draft call, the round's time is all verify
    assert c.round_s(2)[2] == pytest.approx(0.006 + 0.0004 + 2 * 0.0008)


def test_a_draft_call_that_catches_up_after_rounds_of_the_target_alone_does_not_price_a_drafted_token():
    """After rounds at K = 0 the next draft call first feeds the tokens the draft missed: its time is a
    catch-up, and taken as a round's cost it would make drafting look dearer the more a request rests at 0."""
    c = sp.RoundCosts(rate=1.0)
    c.observe(1, 0.005, draft_wall_s=0.0012, draft_compute_s=0.0008, draft_fed=2)
    c.observe(1, 0.005, draft_wall_s=0.0040, draft_compute_s=0.0035, draft_fed=9)
    assert c.round_s(1)[1] == pytest.approx(0.005 + 0.0004 + 0.0008)


def test_acceptance_estimate_starts_at_its_prior_and_converges_to_the_rounds_alpha():
    a = sp.Acceptance(prior_alpha=0.3, prior_rounds=4.0, decay=1.0)
    assert a.alpha == pytest.approx(0.3)
    rng = random.Random(0)
    for _ in range(3000):  # rounds of K = 4 where each draft survives with probability 0.8 until one fails
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        a.observe(4, n)
    assert a.alpha == pytest.approx(0.8, abs=0.02)


def test_a_requests_alpha_follows_its_recent_rounds():
    a = sp.Acceptance(prior_alpha=0.6)
    for _ in range(30):
        a.observe(3, 3)
    high = a.alpha
    for _ in range(30):
        a.observe(3, 0)
    assert high > 0.9 and a.alpha < 0.3  # the prior (0.6, worth 4 rounds) keeps it off the extremes


def _shared(round_s_per_k: float, step_s: float = 0.010, draft_call_s: float = 0.0005) -> sp.Speculation:
    """A process whose measured rounds cost step_s + round_s_per_k * k (plus the draft's call)."""
    s = sp.Speculation()
    s.costs = sp.RoundCosts(rate=1.0)
    for k in (1, 3):  # a tenth of a drafted token's cost is its verify row, the rest the draft's step
        s.costs.observe(k, step_s + 0.1 * round_s_per_k * k, draft_wall_s=draft_call_s + 0.9 * round_s_per_k * k,
                        draft_compute_s=0.9 * round_s_per_k * k)
    return s


def test_adaptive_k_starts_at_the_configured_k_until_a_round_was_measured():
    ak = sp.AdaptiveK(sp.Speculation(), greedy=True, cap=8, start_k=3)
    assert [ak.next_k() for _ in range(3)] == [3, 3, 3]
    assert sp.AdaptiveK(sp.Speculation(), greedy=True, cap=2, start_k=3).next_k() == 2


def test_adaptive_k_settles_at_the_target_alone_and_probes_with_one_draft():
    ak = sp.AdaptiveK(_shared(round_s_per_k=0.008), greedy=True, cap=8, start_k=3)
    for _ in range(20):
        ak.observe(3, 0)  # the draft never agrees
    ks = [ak.next_k() for _ in range(2 * sp.PROBE_EVERY)]
    assert ks == ([0] * (sp.PROBE_EVERY - 1) + [1]) * 2


def test_adaptive_k_drafts_more_for_a_request_the_draft_gets_right():
    shared = _shared(round_s_per_k=0.0015)
    easy, hard = (sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3) for _ in range(2))
    for _ in range(20):
        easy.observe(4, 4)
        hard.observe(4, 1)
    assert easy.next_k() > hard.next_k() >= 1


def test_a_new_request_starts_from_the_alpha_of_its_kind():
    shared = _shared(round_s_per_k=0.0015)
    for _ in range(50):
        shared.observe(True, 4, 4, 0.02, draft_wall_s=0.006, draft_compute_s=0.005)  # greedy: all accepted
        shared.observe(False, 4, 0, 0.02, draft_wall_s=0.006, draft_compute_s=0.005)  # sampled: none
        shared.observe(False, 4, 4, 0.02)  # prompt lookup's rounds do not count towards alpha
    assert sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3).acceptance.alpha > 0.9
    assert sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3).acceptance.alpha < 0.25


def test_one_short_request_that_missed_everything_does_not_set_the_process_alpha_to_zero():
    """A warm-up of a few rounds would otherwise start every later request at alpha 0, at K = 0, where no
    request measures alpha again but the explorers."""
    shared = sp.Speculation()
    for _ in range(3):
        shared.observe(True, 3, 0, 0.01, draft_wall_s=0.003, draft_compute_s=0.002)
    assert shared.prior_alpha(True) > 0.45


def test_a_request_starts_the_draft_only_if_its_remaining_tokens_repay_the_drafts_prefill():
    shared = _shared(round_s_per_k=0.0015)  # a round: 10 ms + 1.5 ms a drafted token + 0.5 ms for the call
    shared.observe_start(3, 0.050)  # the process's first start, cold: left out
    assert shared.costs.draft_start == 0.0
    for extra in (0.015, 0.014, 0.016):  # a request's first draft call: about 15 ms of prefill more
        shared.observe_start(3, 0.0005 + 3 * 0.00135 + extra)
    assert shared.costs.draft_start == pytest.approx(0.015)
    assert sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3).explorer  # the first request of its kind explores
    ak = sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3)
    assert not ak.explorer
    k = ak.next_k(remaining=1000, draft_started=True)
    alpha = ak.acceptance.alpha
    costs = shared.costs.round_s(8)
    per_token_saved = costs[0] - costs[k] / sp.expected_tokens(alpha, k)
    assert k > 0 and per_token_saved > 0
    enough = int(0.015 / per_token_saved) + 1
    assert ak.next_k(remaining=enough, draft_started=False) == k  # repays the prefill: start the draft
    assert [ak.next_k(remaining=enough - 2, draft_started=False) for _ in range(2 * sp.PROBE_EVERY)] == [0] * (
        2 * sp.PROBE_EVERY)  # does not, and no probe either: a probe would start the draft
    assert ak.next_k(remaining=enough - 2, draft_started=True) == k  # once started, its prefill is paid


def test_every_few_requests_one_starts_the_draft_where_the_estimates_say_the_target_alone_wins():
    """Requests that leave the draft idle measure neither alpha nor the costs; without explorers a pessimistic
    estimate would never be revised."""
    shared = _shared(round_s_per_k=0.008)  # drafting does not pay at any alpha below about 0.8
    for _ in range(200):
        shared.observe(True, 4, 0, 0.045, draft_wall_s=0.03, draft_compute_s=0.029)
    starts = []
    for _ in range(3 * sp.PROBE_EVERY):
        ak = sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3)
        starts.append(ak.next_k(remaining=100, draft_started=False))
    assert starts == ([1] + [0] * (sp.PROBE_EVERY - 1)) * 3
    assert sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3).explorer  # counted apart for sampled requests


def test_a_cap_of_zero_keeps_every_round_on_the_target_alone_even_for_an_explorer():
    shared = _shared(round_s_per_k=0.0015)
    ak = sp.AdaptiveK(shared, greedy=True, cap=0, start_k=0)
    assert ak.explorer
    assert [ak.next_k(remaining=100, draft_started=False) for _ in range(3)] == [0, 0, 0]
    assert [ak.next_k(remaining=100, draft_started=True) for _ in range(2 * sp.PROBE_EVERY)] == [0] * (2 * sp.PROBE_EVERY)
