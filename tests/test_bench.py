"""The production-size profile: the published architectures, and a projection that reduces to Leviathan's bound."""

import pytest
import torch

from bench.metrics import leviathan_bound
from bench.production import CONFIGS, build, markdown, profile, projected_speedup


def test_the_profile_builds_llama_3_2_1b_and_3b_with_their_published_parameter_counts():
    counts = {name: sum(p.numel() for p in build(cfg, torch.bfloat16, "meta").parameters())
              for name, cfg in CONFIGS.items()}
    assert counts == {"Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824}


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_projection_is_leviathans_bound_when_verify_costs_one_step_and_rounds_cost_nothing_else(alpha):
    step, draft = 20.0, 1.5
    flat = {k: step for k in range(9)}
    for k in range(1, 9):
        assert projected_speedup(alpha, k, draft, flat, 0.0) == pytest.approx(leviathan_bound(alpha, k, draft / step))
    # a costlier verify pass or per-round overhead can only lower it
    steep = {k: step * (1 + 0.1 * k) for k in range(9)}
    assert projected_speedup(alpha, 4, draft, steep, 0.0) < projected_speedup(alpha, 4, draft, flat, 0.0)
    assert projected_speedup(alpha, 4, draft, flat, 2.0) < projected_speedup(alpha, 4, draft, flat, 0.0)


def test_a_shrunk_profile_times_every_k_and_projects_the_best_one():
    r = profile("cpu", "float32", context=16, reps=1, overhead_ms=1.0, max_k=4, shrink_by=32)
    assert list(r["verify_ms"]) == ["0", "1", "2", "3", "4"] and all(v > 0 for v in r["verify_ms"].values())
    assert r["c"] == pytest.approx(r["draft_step_ms"] / r["target_step_ms"])
    for p in r["projection"].values():
        assert p["best_projected"] == max(v["projected"] for v in p["per_k"].values())
    assert "Projected" in markdown(r) and "shrunk 32x" in markdown(r)


def _run(tokens, seconds, accepted=0, drafted=0, rejected=0, rounds=1, lookup_tokens=0, lookup_accepted=0):
    return {"tokens": tokens, "seconds": seconds, "accepted": accepted, "drafted": drafted, "rejected_rounds": rejected,
            "rounds": rounds, "emitted": tokens, "ttft": 0.01, "lookup_tokens": lookup_tokens,
            "lookup_accepted": lookup_accepted}


def _metrics(rounds, draft_s, verify_s):
    phase = lambda p: ("specdec_round_phase_seconds_sum", (("phase", p),))
    return {("specdec_rounds_total", ()): rounds, phase("draft"): draft_s, phase("verify"): verify_s}


def test_the_bench_gives_c_per_token_the_draft_drafted_and_a_bound_only_to_the_draft_alone():
    """A K+lookup arm's proposals come partly from prompt lookup: its c counts only the draft's tokens, and the
    bound, which assumes every round drafts K from the draft, is given to plain K arms only."""
    from bench.report import markdown
    from bench.run import summarize

    runs = {"0": [_run(40, 0.4, rounds=40)],
            "3": [_run(40, 0.3, accepted=12, drafted=30, rejected=8, rounds=10)],
            "3+lookup": [_run(40, 0.25, accepted=15, drafted=30, rejected=5, rounds=10, lookup_tokens=10,
                              lookup_accepted=6)]}
    metric = {"0": _metrics(40, 0.0, 0.4), "3": _metrics(10, 0.03, 0.15), "3+lookup": _metrics(10, 0.02, 0.15)}
    res = summarize(runs, metric, {"3": [1.3, 1.0], "3+lookup": [1.6, 0.9]}, 0.0, 1.0)
    plain, looked = res["per_k"]["3"], res["per_k"]["3+lookup"]
    assert plain["c"] == pytest.approx((0.03 / 30) / 0.01)  # target step: 0.4 s over 40 rounds
    assert looked["c"] == pytest.approx((0.02 / 20) / 0.01)  # 30 proposed, 10 of them by lookup
    assert plain["bound"] == pytest.approx(leviathan_bound(0.6, 3, plain["c"]))
    assert "bound" not in looked and "efficiency" not in looked
    assert looked["lookup_share"] == pytest.approx(1 / 3) and looked["lookup_accepted_over_proposed"] == 0.6
    assert res["best_k"] == 3 and res["best_lookup"] == "3+lookup"  # the best plain K is reported on its own
    ratios = sorted([1.6 / 1.3, 0.9 / 1.0])  # prompt by prompt, not the ratio of the medians
    gain = looked["over_plain_k"]
    assert gain["median"] == pytest.approx(sum(ratios) / 2) and ratios[0] < gain["p25"] < gain["median"]
    report = {"machine": {"date": "d", "cpu": "c", "cores": 2, "gpu": None, "torch": "t", "transformers": "t"},
              "draft_model": "d", "target_model": "t", "prompts": 1, "reps": 1, "max_tokens": 40, "lookup_ks": [3],
              "prompt_lookup_min": 2, "services": {"T=0.0": res}, "wall_seconds": 60}
    md = markdown(report)
    assert "| 3+lookup | 1.25" in md and "prompt lookup proposed 33% of the tokens, 60% of them accepted" in md
