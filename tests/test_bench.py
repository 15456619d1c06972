"""The production-size profile: the published architectures, and a projection that reduces to Leviathan's bound."""

import pytest
import torch

from bench.metrics import leviathan_bound
from bench.production import CONFIGS, build, markdown, profile, projected_speedup


def test_the_profile_builds_llama_3_2_1b_and_3b_with_their_published_parameter_counts():
    counts = {
        name: sum(p.numel() for p in build(cfg, torch.bfloat16, "meta").parameters()) for name, cfg in CONFIGS.items()
    }
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
    head = r["head"]  # a one-layer head for the 3B, timed against the same target steps
    assert head["target_step_ms"] == r["target_step_ms"] and head["c"] == pytest.approx(
        head["draft_step_ms"] / r["target_step_ms"]
    )
    assert 0 < r["models"]["head"]["parameters"] < r["models"]["Llama-3.2-1B"]["parameters"]
    assert "one-layer head drafting for the 3B" in markdown(r)


def _run(tokens, seconds, accepted=0, drafted=0, rejected=0, rounds=1, lookup_tokens=0, lookup_accepted=0, decode=None):
    return {
        "tokens": tokens,
        "seconds": seconds,
        "accepted": accepted,
        "drafted": drafted,
        "rejected_rounds": rejected,
        "rounds": rounds,
        "emitted": tokens,
        "ttft": 0.01,
        "lookup_tokens": lookup_tokens,
        "lookup_accepted": lookup_accepted,
        "decode_tokens_per_s": decode,
    }


def _metrics(rounds, decoding_rounds, draft_s, verify_s, step_s, job):
    """The orchestrator's round counters and phase sums, and one server's one-token forward passes."""
    phase = lambda p, kind: (f"specdec_round_phase_seconds_{kind}", (("phase", p),))
    forward = lambda kind: (f"specdec_forward_seconds_{kind}", (("job", job), ("tokens", "1")))
    return {
        ("specdec_rounds_total", ()): rounds,
        phase("draft", "sum"): draft_s,
        phase("verify", "sum"): verify_s,
        phase("verify", "count"): decoding_rounds,
        forward("sum"): step_s * 10,
        forward("count"): 10,
    }


def test_decoding_rate_leaves_out_the_first_message_and_its_wait():
    from bench.run import decode_rate

    assert decode_rate(40, 0.5, 3, 0.1) == pytest.approx(37 / 0.4)
    assert decode_rate(3, 0.5, 3, 0.1) is None  # the first message carried every token
    assert decode_rate(0, 0.5, 0, None) is None


def test_the_bench_takes_c_from_the_servers_steps_and_bounds_the_decoding_speedup_of_the_draft_alone():
    """c is the draft's one-token step over the target's, each from its server's forward histogram; round times
    are per decoding round; the bound is compared with the decoding speedup, and given to plain K arms only,
    since a K+lookup arm's proposals come partly from prompt lookup."""
    from bench.report import markdown
    from bench.run import summarize

    runs = {
        "0": [_run(40, 0.4, rounds=40, decode=110.0)],
        "3": [_run(40, 0.3, accepted=12, drafted=30, rejected=8, rounds=10, decode=160.0)],
        "3+lookup": [
            _run(
                40,
                0.25,
                accepted=15,
                drafted=30,
                rejected=5,
                rounds=10,
                lookup_tokens=10,
                lookup_accepted=6,
                decode=180.0,
            )
        ],
    }
    metric = {
        "0": _metrics(40, 39, 0.0, 0.36, 0.008, "target"),
        "3": _metrics(10, 9, 0.03, 0.117, 0.0012, "draft"),
        "3+lookup": _metrics(10, 9, 0.02, 0.117, 0.0010, "draft"),
    }
    res = summarize(
        runs, metric, {"3": [1.3, 1.0], "3+lookup": [1.6, 0.9]}, {"3": [1.4, 1.2], "3+lookup": [1.7, 1.0]}, 0.0, 1.0
    )
    plain, looked = res["per_k"]["3"], res["per_k"]["3+lookup"]
    assert res["target_step_ms"] == pytest.approx(8.0)
    assert plain["c"] == pytest.approx(0.0012 / 0.008) and looked["c"] == pytest.approx(0.0010 / 0.008)
    assert plain["round_ms"]["verify"] == pytest.approx(13.0) and plain["round_ms"]["draft"] == pytest.approx(30 / 9)
    assert plain["bound"] == pytest.approx(leviathan_bound(0.6, 3, plain["c"]))
    assert plain["decode_speedup"]["median"] == pytest.approx(1.3)
    assert plain["efficiency"] == pytest.approx(1.3 / plain["bound"])  # the decoding speedup, not end to end
    assert "bound" not in looked and "efficiency" not in looked
    assert looked["lookup_share"] == pytest.approx(1 / 3) and looked["lookup_accepted_over_proposed"] == 0.6
    assert res["best_k"] == 3 and res["best_lookup"] == "3+lookup"  # the best plain K is reported on its own
    ratios = sorted([1.6 / 1.3, 0.9 / 1.0])  # prompt by prompt, not the ratio of the medians
    gain = looked["over_plain_k"]
    assert gain["median"] == pytest.approx(sum(ratios) / 2) and ratios[0] < gain["p25"] < gain["median"]
    report = {
        "machine": {"date": "d", "cpu": "c", "cores": 2, "gpu": None, "torch": "t", "transformers": "t"},
        "draft_model": "d",
        "target_model": "t",
        "prompts": 1,
        "reps": 1,
        "max_tokens": 40,
        "lookup_ks": [3],
        "prompt_lookup_min": 2,
        "services": {"T=0.0": res},
        "wall_seconds": 60,
    }
    md = markdown(report)
    assert "| 3+lookup | 1.25" in md and "prompt lookup proposed 33% of the tokens, 60% of them accepted" in md
    assert "| 3 | 1.15 [1.07, 1.23] | 1.30 [1.25, 1.35] |" in md
    header = next(line for line in md.splitlines() if line.startswith("| K |")).split(" | ")
    row = next(line for line in md.splitlines() if line.startswith("| 3 |")).split(" | ")
    assert row[header.index("TTFT ms")] == "10"  # the median time to first token, in ms


def test_the_auto_arm_reports_its_mean_k_and_the_share_of_rounds_at_each_k_and_is_never_the_best_fixed_k():
    from bench.report import markdown
    from bench.run import summarize

    runs = {
        "0": [_run(40, 0.4, rounds=40, decode=110.0)],
        "2": [_run(40, 0.3, accepted=10, drafted=20, rejected=6, rounds=10, decode=150.0)],
        "auto": [_run(40, 0.25, accepted=14, drafted=20, rejected=4, rounds=10, decode=170.0)],
    }
    auto = _metrics(10, 9, 0.03, 0.11, 0.0012, "draft")
    # decoding rounds at K = 0, 1, 3 and 3: the histogram's cumulative buckets
    cum = {0: 1, 1: 2, 2: 2, 3: 4}
    for k in range(9):
        auto[("specdec_speculative_tokens_bucket", (("le", f"{k:.1f}"),))] = cum.get(k, 4)
    auto[("specdec_speculative_tokens_sum", ())] = 7
    auto[("specdec_speculative_tokens_count", ())] = 4
    metric = {
        "0": _metrics(40, 39, 0.0, 0.36, 0.008, "target"),
        "2": _metrics(10, 9, 0.02, 0.117, 0.0012, "draft"),
        "auto": auto,
    }
    res = summarize(runs, metric, {"2": [1.3], "auto": [1.6]}, {"2": [1.4], "auto": [1.7]}, 0.0, 1.0)
    row = res["per_k"]["auto"]
    assert row["k"] == pytest.approx(7 / 9) and row["adaptive"]  # K per decoding round (9 here)
    assert row["k_share"] == {0: 0.25, 1: 0.25, 3: 0.5}
    assert "bound" not in row and "efficiency" not in row  # K varies: no bound
    assert res["best_k"] == 2  # the best fixed K, though auto was faster
    report = {
        "machine": {"date": "d", "cpu": "c", "cores": 2, "gpu": None, "torch": "t", "transformers": "t"},
        "draft_model": "d",
        "target_model": "t",
        "prompts": 1,
        "reps": 1,
        "max_tokens": 40,
        "lookup_ks": [],
        "prompt_lookup_min": 2,
        "services": {"T=0.0": res},
        "wall_seconds": 60,
    }
    md = markdown(report)
    assert "| auto (mean K 0.78) | 1.60 [1.60, 1.60] | 1.70 [1.70, 1.70] |" in md
    assert "rounds at K = 0: 25%, K = 1: 25%, K = 3: 50%" in md


@pytest.mark.parametrize("assisted", [False, True])
def test_the_peers_first_chunk_is_its_first_generated_tokens_not_the_prompt(tiny_draft, tokenizer, assisted):
    from bench.run import _FirstChunk

    ids = torch.tensor([[1, 5, 9, 13]])
    first = _FirstChunk()
    out = tiny_draft.generate(
        ids,
        assistant_model=tiny_draft if assisted else None,
        streamer=first,
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
        pad_token_id=0,
    )
    assert out.shape[1] == 12 and first.at is not None
    assert first.tokens == 1 if not assisted else 1 <= first.tokens <= 8


def test_the_exactness_report_counts_outputs_that_differ_and_where_each_first_does():
    from bench.exactness import compare, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # one ended (EOS) where the other went on
    report = compare({"a": [1, 2], "b": [3, 4], "c": [5]}, {"a": [1, 2], "b": [3, 9], "c": [6]})
    assert report == {"differ": 2, "of": 3, "first_divergence": [0, 1]}


def test_the_load_arms_take_turns_running_first_and_outputs_are_checked_against_one_stream():
    from bench.load import request_times, run_load

    order = []

    def arm(name: str, ids: list[int]):
        def send(prompt: str) -> dict:
            order.append(name)
            return {**request_times(0.0, [(0.001, 1), (0.002, 1)], 0.003), "ids": ids}

        return send, lambda p: p

    report = run_load({"a": arm("a", [1, 2]), "b": arm("b", [3, 4])}, ["p"], [1], reps=4, progress=lambda _: None)
    runs = order[2:]  # after each arm's uncounted run
    assert runs == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert report["a"][1]["differ_from_alone"] == 0 and report["a"][1]["requests"] == 4


def test_the_bench_puts_both_model_servers_on_the_device_asked_in_bfloat16_on_a_gpu_unless_told():
    from bench.run import server_environment

    assert server_environment(None, None) == {}  # the servers' own settings, else the CPU's float32
    gpu = server_environment("cuda", None)
    assert gpu == {
        "SPECDEC_TARGET_DEVICE": "cuda",
        "SPECDEC_TARGET_DTYPE": "bfloat16",
        "SPECDEC_DRAFT_DEVICE": "cuda",
        "SPECDEC_DRAFT_DTYPE": "bfloat16",
    }
    assert server_environment("cuda:1", "float16")["SPECDEC_DRAFT_DTYPE"] == "float16"
    assert server_environment("cpu", None) == {"SPECDEC_TARGET_DEVICE": "cpu", "SPECDEC_DRAFT_DEVICE": "cpu"}


def test_the_load_report_names_the_card_and_how_each_server_s_passes_ran():
    from bench.load import markdown, passes_by_way

    scraped = {
        ("specdec_forward_passes_total", (("job", "target"), ("way", "in_turn"))): 40.0,
        ("specdec_forward_passes_total", (("job", "target"), ("way", "eager"))): 3.0,
        ("specdec_forward_passes_total", (("job", "target"), ("way", "captured"))): 0.0,
        ("specdec_forward_passes_total", (("job", "draft"), ("way", "graphed"))): 12.0,
        ("specdec_forward_tokens_total", (("job", "draft"),)): 99.0,
    }
    passes = passes_by_way(scraped)
    assert passes == {"target": {"in_turn": 40.0, "eager": 3.0}, "draft": {"graphed": 12.0}}
    machine = {"date": "d", "cpu": "EPYC", "cores": 16, "gpu": "NVIDIA H100 80GB HBM3"}
    report = {"machine": machine, "prompts": 1, "max_tokens": 8, "reps": 1, "arms": {}, "concurrency": [1]}
    md = markdown(report | {"forward": {}, "passes": passes})
    assert md.startswith("# specdec bench --concurrency: NVIDIA H100 80GB HBM3 (host: EPYC, 16 cores)")
    assert "target: 40 in_turn, 3 eager; draft: 12 graphed" in md


def test_draft_arms_cross_each_draft_with_each_activations_value_and_settings_string():
    from bench.drafts import make_arms

    assert make_arms(["a", "b"], [], []) == {"a": ("a", {}), "b": ("b", {})}
    arms = make_arms(["a"], ["int8"], ["", "SPECDEC_DRAFT_QUANTIZE=int4,X=1"])
    assert arms == {
        "a@int8@": ("a", {"SPECDEC_DRAFT_ACTIVATIONS": "int8"}),
        "a@int8@SPECDEC_DRAFT_QUANTIZE=int4,X=1": (
            "a",
            {"SPECDEC_DRAFT_ACTIVATIONS": "int8", "SPECDEC_DRAFT_QUANTIZE": "int4", "X": "1"},
        ),
    }
