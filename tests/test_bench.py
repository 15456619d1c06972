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
