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


def _call(wall_s=0.0, compute_s=0.0, queue_s=0.0, sessions=1, active=None, rules_s=0.0) -> sp.CallCost:
    return sp.CallCost(wall_s, compute_s, queue_s, sessions, active or sessions, rules_s)


# The embedded target's passes on a 2-core CPU (s by rows; docs/performance.md, 2026-11-25): a step reads the
# weights, each further row costs its multiply-adds, about 1.6-2 ms once a pass is compute-bound; the int8
# draft's steps.
TARGET_CURVE = [(1, 0.0069), (2, 0.0079), (4, 0.0109), (8, 0.0181), (16, 0.0334), (32, 0.0644)]
DRAFT_CURVE = [(1, 0.0010), (2, 0.0011), (4, 0.0013), (8, 0.0017), (16, 0.0026)]


def _costs(target=TARGET_CURVE, draft=DRAFT_CURVE) -> sp.RoundCosts:
    c = sp.RoundCosts(rate=1.0)  # each observation replaces the last: exact values
    c.set_curves(target, draft)
    return c


def test_round_costs_are_unknown_until_the_curves_and_a_drafted_round_are():
    c = sp.RoundCosts()
    c.observe(0.010, _call(0.009, 0.008))  # the draft down: a round of the target alone
    c.set_curves(TARGET_CURVE, DRAFT_CURVE)
    assert c.round_s(4) is None
    c.observe(0.012, _call(0.009, 0.008), _call(0.003, 0.002))
    assert c.round_s(4) is not None
    assert sp.RoundCosts().round_s(4) is None


def test_alone_a_round_costs_its_wall_time_the_pass_over_its_rows_its_draft_steps_and_the_calls():
    c = _costs()
    c.observe(0.0135, _call(wall_s=0.0100, compute_s=0.0090), _call(wall_s=0.0030, compute_s=0.0024))
    assert c.round_overhead == pytest.approx(0.0135 - 0.0090 - 0.0030) and c.draft_call == pytest.approx(0.0006)
    got = c.round_s(4)
    assert got[0] == pytest.approx(0.0069 + 0.0015)
    assert got[3] == pytest.approx(0.0109 + 0.0015 + 0.0006 + 3 * 0.0010)
    assert sp.best_k(0.7, got) > 0  # alone on a CPU a verify row is a sixth of a step: drafting pays


def test_under_load_a_round_is_priced_at_the_width_everyones_rows_make_and_dear_rows_end_drafting():
    """4 sessions calling: at K = 0 a pass of 4 rows, 10.9 ms for 4 tokens; drafting 1 each, a pass of 8 rows and
    a draft step for 4. Priced at the current 4-row pass's slope (1.5 ms a row) drafting would look free."""
    c = _costs()
    c.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))  # alone: 1 ms of RPC a round, 1 ms a draft call
    c.observe(0.030, _call(0.025, 0.0109, 0.010, sessions=4), _call(0.004, 0.0013, sessions=4))
    assert c.round_overhead == pytest.approx(0.0010) and c.draft_call == pytest.approx(0.0010)
    got = c.round_s(8)
    assert got[0] == pytest.approx((0.0109 + 0.001) / 4)
    assert got[1] == pytest.approx((0.0181 + 0.001 + 0.001) / 4 + 0.0013 / 4)
    assert sp.best_k(0.65, got) == 0
    assert sp.best_k(0.95, got) > 0  # a draft that is nearly always right still pays


def test_drafting_that_splits_the_batch_is_priced_at_the_sessions_a_drafted_round_meets():
    c = _costs()
    c.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))
    c.observe(0.030, _call(0.025, 0.0109, sessions=4), _call(0.004, 0.0013, sessions=4))
    together = c.round_s(2)
    c.observe(0.030, _call(0.025, 0.0109, sessions=2, active=4), _call(0.004, 0.0011, sessions=1, active=4))
    split = c.round_s(2)
    assert split[0] == pytest.approx(together[0])  # K = 0 still meets everyone calling
    assert split[1] > together[1] and split[2] > together[2]


def test_where_rows_are_nearly_free_speculation_stays_on_under_load():
    flat = [(1, 0.0040), (4, 0.0041), (16, 0.0043), (64, 0.0050)]  # a GPU's memory-bound pass
    c = _costs(flat, [(1, 0.0018), (16, 0.0019)])
    c.observe(0.0070, _call(0.0050, 0.0040), _call(0.0020, 0.0018))
    c.observe(0.030, _call(0.025, 0.0042, sessions=16), _call(0.004, 0.0019, sessions=16))
    assert sp.best_k(0.7, c.round_s(8)) > 0


def test_a_narrow_pass_timed_slow_under_load_is_priced_as_the_wider_ones_and_does_not_make_drafting_look_cheap():
    """The target's curve as published at a load's tail (2026-11-26): its 1- and 3-row passes ran while the cores
    answered the other sessions' calls. Read as it is, a K = 0 round of 2 sessions costs a 1-row pass, 6.6 ms, and
    the 2 sessions left draft even at alpha 0.5."""
    loaded = [(1, 0.0066), (2, 0.0038), (3, 0.0078), (4, 0.0046), (5, 0.0049), (6, 0.0060), (8, 0.0067)]
    c = _costs(loaded, [(1, 0.0004), (2, 0.0005), (4, 0.0006), (8, 0.0008)])
    assert [s for _, s in c.target_curve] == [0.0038, 0.0038, 0.0046, 0.0046, 0.0049, 0.0060, 0.0067]
    c.observe(0.0062, _call(0.0048, 0.0038, sessions=2), _call(0.0014, 0.0005, sessions=1, active=2))
    got = c.round_s(3)
    assert got[0] == pytest.approx((0.0038 + 0.0010) / 2)
    assert sp.best_k(0.5, got) == 0


def test_a_drafted_round_is_never_priced_as_shared_by_more_sessions_than_call_the_server():
    """The sessions a drafted round met are averaged over drafted rounds only, which at a load's tail are few: after
    a load of 4, the one session left is priced as alone, not as a quarter of a 4-session pass."""
    c = _costs()
    c.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))  # alone: 1 ms of RPC a round, 1 ms a draft call
    c.observe(0.030, _call(0.025, 0.0109, 0.010, sessions=4), _call(0.004, 0.0013, sessions=4))
    c.observe(0.0090, _call(0.0080, 0.0069))  # the others are gone: a round of the target alone
    assert c.verify_sessions == 4 and c.active == 1
    got = c.round_s(2)
    assert got[0] == pytest.approx(0.0069 + 0.0010)
    assert got[1] == pytest.approx(0.0079 + 0.0010 + 0.0010 + 0.0010)  # a 2-row pass, the calls, one draft step


def test_prompt_lookup_rounds_measure_the_target_but_not_the_draft():
    c = _costs()
    c.observe(0.010, _call(0.008, 0.007), _call(0.002, 0.0016))
    c.observe(0.006, _call(0.0055, 0.005, sessions=3, active=3))  # copied tokens: no draft call
    assert c.draft_call == pytest.approx(0.0004) and c.verify_sessions == 1 and c.active == 3


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
    row = 0.1 * round_s_per_k
    s.costs = _costs(
        [(1, step_s), (100, step_s + 99 * row)], [(1, 0.9 * round_s_per_k), (16, 16 * 0.9 * round_s_per_k)]
    )
    s.costs.observe(
        step_s + row + draft_call_s + 0.9 * round_s_per_k,
        _call(step_s + row, step_s + row),
        _call(draft_call_s + 0.9 * round_s_per_k, 0.9 * round_s_per_k),
    )
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


def test_a_requests_output_rules_are_priced_per_row_for_it_alone():
    """A grammar's masks cost each verify row and each draft step of the request that has one: at the same alpha it
    drafts less than a request without rules, down to the target alone when a masked step costs more than a drafted
    token saves; the process's round costs leave the rules out, so other requests' K does not move."""
    shared = _shared(round_s_per_k=0.0015)
    plain, ruled, dear = (sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3) for _ in range(3))
    for ak in (plain, ruled, dear):
        for _ in range(20):
            ak.observe(4, 2)  # alpha about 0.67
    ruled.observe_rules(4, _call(0.012, 0.010, rules_s=5 * 0.0003), _call(0.006, 0.005, rules_s=4 * 0.0008))
    dear.observe_rules(4, _call(0.012, 0.010, rules_s=5 * 0.002), _call(0.006, 0.005, rules_s=4 * 0.004))
    assert plain.next_k() > ruled.next_k() > dear.next_k() == 0
    assert ruled.rules_row_s == pytest.approx({"target": 0.0003, "draft": 0.0008})
    # the next request with rules starts from what the last ones' rows cost; one without starts from nothing
    assert sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3, ruled=True).rules_row_s["draft"] > 0.0008
    assert sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3).rules_row_s == {"target": 0.0, "draft": 0.0}
    # a round's rules stay out of the process's costs: priced as the same round without them
    with_rules, without, counted = _costs(), _costs(), _costs()
    with_rules.observe(0.0205, _call(0.0122, 0.010, rules_s=0.002), _call(0.006, 0.005, rules_s=0.0003))
    without.observe(0.0182, _call(0.0102, 0.010), _call(0.0057, 0.005))
    counted.observe(0.0205, _call(0.0122, 0.010), _call(0.006, 0.005))  # the rules taken for the round's own time
    assert with_rules.round_s(8) == pytest.approx(without.round_s(8))
    assert counted.round_s(8)[0] > without.round_s(8)[0]


def test_a_sampled_requests_recovery_from_a_rejection_is_priced_at_the_rounds_odds_of_one():
    """A sampled round that ends in a rejection fetches the target's and the draft's rows there (the whole vocabulary
    at top_p 1) before it draws the residual. The request prices that at 1 - alpha^K a round: where it is dear it
    drafts less, down to the target alone; greedy never pays it; the next request with the same sampling settings
    starts from it; and the process's round costs leave it out."""
    shared = _shared(round_s_per_k=0.0015)
    wide, narrow = (0.7, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0)
    cheap, dear, greedy = (
        sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3, sampling=narrow),
        sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3, sampling=wide),
        sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3),
    )
    for ak in (cheap, dear, greedy):
        for _ in range(20):
            ak.observe(4, 2)  # alpha about 0.67
    before = cheap.next_k()
    cheap.observe_recovery(4, 2, 0.0002)
    dear.observe_recovery(4, 2, 0.03)  # three steps: at alpha 0.67 a rejection costs more than drafting saves
    dear.observe_recovery(4, 4, 5.0)  # every draft accepted: no recovery, nothing learned
    greedy.observe_recovery(4, 2, 0.012)
    assert dear.recover_s == pytest.approx(0.03) and greedy.recover_s == 0.0
    assert before >= cheap.next_k() > dear.next_k() == 0
    assert greedy.next_k() == before
    # the next request with the same settings starts where the last ones left off; other settings from nothing
    assert sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3, sampling=wide).next_k() == 0
    assert sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3, sampling=(1.0, 1.0, 0, 0.0)).recover_s == 0.0
    # a round's recovery stays out of the process's costs
    with_recovery, without = sp.Speculation(), sp.Speculation()
    for s in (with_recovery, without):
        s.costs = _costs()
    with_recovery.observe(False, 4, 2, 0.0305, _call(0.0122, 0.010), _call(0.006, 0.005), recover_s=0.012)
    without.observe(False, 4, 2, 0.0185, _call(0.0122, 0.010), _call(0.006, 0.005))
    assert with_recovery.costs.round_s(8) == pytest.approx(without.costs.round_s(8))


def test_the_process_remembers_the_recovery_of_a_bounded_number_of_sampling_settings():
    shared = _shared(round_s_per_k=0.0015)
    for i in range(sp.RECOVERY_KINDS + 5):
        sp.AdaptiveK(shared, greedy=False, cap=8, start_k=3, sampling=(0.7, 0.9, i, 0.0)).observe_recovery(4, 1, 0.01)
    assert len(shared.recovery_s) == sp.RECOVERY_KINDS
    assert (0.7, 0.9, 0, 0.0) not in shared.recovery_s and (0.7, 0.9, sp.RECOVERY_KINDS + 4, 0.0) in shared.recovery_s


def test_a_new_request_starts_from_the_alpha_of_its_kind():
    shared = _shared(round_s_per_k=0.0015)
    target, draft = _call(0.014, 0.013), _call(0.006, 0.005)
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
        shared.observe(True, 3, 0, 0.01, _call(0.007, 0.006), _call(0.003, 0.002))
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
        2 * sp.PROBE_EVERY
    )  # does not, and no probe either: a probe would start the draft
    assert ak.next_k(remaining=enough - 2, draft_started=True) == k  # once started, its prefill is paid


def test_every_few_requests_one_starts_the_draft_where_the_estimates_say_the_target_alone_wins():
    """Requests that leave the draft idle measure neither alpha nor the costs; without explorers a pessimistic
    estimate would never be revised."""
    shared = _shared(round_s_per_k=0.008)  # drafting does not pay at any alpha below about 0.8
    for _ in range(200):
        shared.observe(True, 4, 0, 0.045, _call(0.014, 0.013), _call(0.03, 0.029))
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
    assert [ak.next_k(remaining=100, draft_started=True) for _ in range(2 * sp.PROBE_EVERY)] == [0] * (
        2 * sp.PROBE_EVERY
    )


def test_a_request_the_draft_gets_right_stays_at_k_0_while_others_call_and_drafting_does_not_pay_for_them():
    """In a mixed batch a drafter's rounds meet the others in other passes than their own: it would split
    their batches. So while drafting does not pay at the acceptance of requests of its kind, it stays with them;
    alone, it drafts for its own acceptance."""
    shared = sp.Speculation()
    shared.costs = _costs()
    shared.costs.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))  # alone
    easy = sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3)
    for _ in range(40):
        easy.observe(4, 4)  # this request's draft is nearly always right; the process's alpha stays at its prior
    assert easy.next_k() > 0
    shared.costs.observe(0.020, _call(0.015, 0.0079, sessions=2), _call(0.003, 0.0011, sessions=1, active=2))
    assert sp.best_k(easy.acceptance.alpha, shared.costs.round_s(8)) > 0  # on its own it would draft
    assert easy.next_k() == 0


def test_while_others_call_and_drafting_does_not_pay_no_request_explores_or_probes():
    """An explorer's or a probe's drafted rounds would split the others' batches; alone they are how alpha
    and the costs stay measured, and they resume then."""
    shared = sp.Speculation()
    shared.costs = _costs()
    shared.costs.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))
    shared.costs.observe(0.020, _call(0.015, 0.0109, sessions=4), _call(0.003, 0.0013, sessions=4))
    explorer = sp.AdaptiveK(shared, greedy=True, cap=8, start_k=3)
    assert explorer.explorer
    assert explorer.next_k(remaining=100, draft_started=False) == 0
    assert [explorer.next_k(remaining=100, draft_started=True) for _ in range(3 * sp.PROBE_EVERY)] == [0] * (
        3 * sp.PROBE_EVERY
    )
    shared.costs.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))  # alone again
    assert explorer.next_k(remaining=100, draft_started=False) >= 1


def test_alone_rounds_that_take_longer_than_modelled_raise_the_price_of_their_kind():
    """Alone, a round's cost is its wall time. The model's least-overhead parts priced drafted rounds 16-27% under
    what they took and rounds at K = 0 12% under (2026-12-08), so drafting looked cheaper than it was: each kind's
    measured ratio scales its price, while alone only."""
    learned, unscaled = sp.RoundCosts(rate=0.5), sp.RoundCosts(rate=0.5)  # the same rounds, told their K or not
    for c in (learned, unscaled):
        c.set_curves(TARGET_CURVE, DRAFT_CURVE)
        c.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))  # 1 ms outside the passes and a draft call
    before = learned.round_s(4)
    assert sp.best_k(0.6, before) > 0  # the model's parts alone: drafting pays at alpha 0.6
    for _ in range(20):  # alone, drafted rounds take 1.3x the model's figure, rounds at K = 0 exactly it
        drafted = (1.3 * before[2], _call(0.0089, 0.0079), _call(0.0022, 0.0012))
        alone = (4 * 0.0069 + 0.001, _call(0.0286, 0.0276))
        learned.observe(*drafted, k=2)
        learned.observe(*alone, k=0, tokens=4)
        unscaled.observe(*drafted)
        unscaled.observe(*alone)
    assert learned.scale[True] == pytest.approx(1.3, rel=0.01) and learned.scale[False] == pytest.approx(1.0, rel=0.01)
    after = learned.round_s(4)
    assert after[0] == pytest.approx(before[0]) and after[2] == pytest.approx(1.3 * before[2], rel=0.01)
    assert sp.best_k(0.6, after) == 0
    assert unscaled.round_s(4) == pytest.approx(before)
    # under load the wall time holds the others' work: neither learned nor applied there
    load = (0.030, _call(0.025, 0.0109, sessions=4), _call(0.004, 0.0013, sessions=4))
    learned.observe(*load, k=2)
    unscaled.observe(*load)
    assert learned.scale[True] == pytest.approx(1.3, rel=0.01)
    assert learned.round_s(4) == pytest.approx(unscaled.round_s(4))


def test_a_rounds_output_rules_are_left_out_of_the_models_error():
    """A request prices its rules' rows itself (AdaptiveK.rules_row_s): the same time counted in the scale would
    charge them twice."""
    plain, ruled = (sp.RoundCosts(rate=1.0) for _ in range(2))
    for c in (plain, ruled):
        c.set_curves(TARGET_CURVE, DRAFT_CURVE)
        c.observe(0.0100, _call(0.0079, 0.0069), _call(0.0021, 0.0011))
    plain.observe(0.0150, _call(0.009, 0.0079), _call(0.003, 0.0021), k=2)
    ruled.observe(0.0165, _call(0.010, 0.0079, rules_s=0.001), _call(0.0035, 0.0021, rules_s=0.0005), k=2)
    assert plain.scale[True] != 1.0 and ruled.scale[True] == pytest.approx(plain.scale[True])
