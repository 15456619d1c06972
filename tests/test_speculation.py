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


def _call(wall_s=0.0, compute_s=0.0, queue_s=0.0, sessions=1, rows=1, pass_s=0.0, row_s=0.0) -> sp.CallCost:
    return sp.CallCost(wall_s, compute_s, queue_s, sessions, rows, pass_s, row_s)


def test_round_costs_are_unknown_until_a_drafted_round_was_measured():
    c = sp.RoundCosts()
    assert c.round_s(4) is None
    c.observe(0.010, _call(0.009, 0.008, pass_s=0.008))  # the draft down: a round of the target alone
    assert c.round_s(4) is None
    c.observe(0.012, _call(0.009, 0.008, rows=3, pass_s=0.008, row_s=0.001), _call(0.003, 0.002, pass_s=0.0007))
    assert c.round_s(4) is not None


def test_alone_a_round_costs_its_wall_time_the_step_plus_its_rows_and_its_draft_steps():
    c = sp.RoundCosts(rate=1.0)  # each observation replaces the last: exact values
    target = _call(wall_s=0.0100, compute_s=0.0090, rows=3, pass_s=0.0090, row_s=0.0010)  # 6 ms + 1 ms a row
    draft = _call(wall_s=0.0030, compute_s=0.0024, pass_s=0.0008)  # two steps of 0.8 ms (+ a feed), 0.6 ms RPC
    c.observe(0.0135, target, draft)
    assert c.round_overhead == pytest.approx(0.0135 - 0.0090 - 0.0030)
    assert c.draft_call == pytest.approx(0.0006)
    got = c.round_s(4)
    assert got[0] == pytest.approx(0.0015 + 0.0060 + 0.0010)
    assert got[2] == pytest.approx(0.0015 + 0.0060 + 3 * 0.0010 + 0.0006 + 2 * 0.0008)
    assert sp.best_k(0.7, got) > 0  # alone on a CPU a verify row is a sixth of a step: drafting pays


def test_under_load_the_pass_is_shared_and_dear_rows_take_speculation_to_the_target_alone():
    """16 sessions in a pass split its fixed 6 ms; what remains of a round is its rows, 2 ms each where the
    cores' multiply-adds bound the pass: a drafted token costs more than the alpha of a good draft returns."""
    c = sp.RoundCosts(rate=1.0)
    c.observe(0.0105, _call(0.0075, 0.0067, rows=1, pass_s=0.0067, row_s=0.0007),  # alone: 0.8 ms of RPC a call
              _call(0.0021, 0.0013, pass_s=0.0013, row_s=0.0001))
    target = _call(wall_s=0.050, compute_s=0.038, queue_s=0.010, sessions=16, rows=16, pass_s=0.038, row_s=0.002)
    draft = _call(wall_s=0.012, compute_s=0.010, sessions=16, rows=16, pass_s=0.003, row_s=0.0001)
    c.observe(0.065, target, draft)  # its 5 ms outside the passes are mostly waits for busy event loops
    assert c.round_overhead == pytest.approx(0.0105 - 0.0067 - 0.0021) and c.draft_call == pytest.approx(0.0008)
    assert c.target.share(1) == pytest.approx(0.006 / 16 + 0.002)
    assert sp.best_k(0.7, c.round_s(8)) == 0
    # the same load where a row costs almost nothing (a GPU's memory-bound pass): speculation stays on
    c.observe(0.065, _call(0.050, 0.038, 0.010, 16, 16, 0.038, 0.00002),
              _call(0.012, 0.010, 0.0, 16, 16, 0.003, 0.00001))
    assert sp.best_k(0.7, c.round_s(8)) > 0


def test_prompt_lookup_rounds_price_the_verify_but_not_the_draft():
    c = sp.RoundCosts(rate=1.0)
    c.observe(0.010, _call(0.008, 0.007, rows=3, pass_s=0.007, row_s=0.0005), _call(0.002, 0.0016, pass_s=0.0008))
    c.observe(0.006, _call(0.0055, 0.005, rows=3, pass_s=0.005, row_s=0.0005))  # copied tokens: no draft call
    assert c.draft_call == pytest.approx(0.0004)
    assert c.round_s(2)[2] == pytest.approx(0.0010 + 0.0035 + 3 * 0.0005 + 0.0004 + 2 * 0.0008)


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
    """A process alone on its servers whose rounds cost step_s + round_s_per_k * k (plus the draft's call): a
    tenth of a drafted token's cost is its verify row, the rest the draft's step."""
    s = sp.Speculation()
    s.costs = sp.RoundCosts(rate=1.0)
    row = 0.1 * round_s_per_k
    s.costs.observe(step_s + row + draft_call_s + 0.9 * round_s_per_k,
                    _call(step_s + row, step_s + row, rows=2, pass_s=step_s + row, row_s=row),
                    _call(draft_call_s + 0.9 * round_s_per_k, 0.9 * round_s_per_k, pass_s=0.9 * round_s_per_k))
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
    target, draft = _call(0.014, 0.013, rows=5, pass_s=0.013, row_s=0.0006), _call(0.006, 0.005, pass_s=0.0012)
    for _ in range(50):
        shared.observe(True, 4, 4, 0.02, target, draft)  # greedy: all accepted
        shared.observe(False, 4, 0, 0.02, target, draft)  # sampled: none
        shared.observe(False, 4, 4, 0.02, target)  # prompt lookup's rounds do not count towards alpha
    assert sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3).acceptance.alpha > 0.9
    assert sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3).acceptance.alpha < 0.25


def test_one_short_request_that_missed_everything_does_not_set_the_process_alpha_to_zero():
    """A warm-up of a few rounds would otherwise start every later request at alpha 0, at K = 0, where no
    request measures alpha again but the explorers."""
    shared = sp.Speculation()
    for _ in range(3):
        shared.observe(True, 3, 0, 0.01, _call(0.007, 0.006, pass_s=0.006), _call(0.003, 0.002, pass_s=0.0007))
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
        shared.observe(True, 4, 0, 0.045, _call(0.014, 0.013, rows=5, pass_s=0.013, row_s=0.0008),
                       _call(0.03, 0.029, pass_s=0.0072))
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
