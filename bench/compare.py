"""Side-by-side speedup of speculative decoding against the target alone, on a running orchestrator.

    python -m bench.compare [--address localhost:50051] [--k 4] [--reps 3] [--temperature 0]

Each prompt runs with K = 0 (the target alone, same path) and with K, alternating
so that machine drift cancels; the speedup is the ratio of tokens/s within each
pair, reported as median and spread. A seed makes sampled runs comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import grpc

from bench.metrics import delta, leviathan_alpha, scrape, value
from bench.run import generate
from specdec.v1 import generation_pb2_grpc

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for learning a new language, one sentence each.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the water cycle for a ten year old.",
    "What is 17 times 23? Show your working.",
]


def per_round(before: dict, after: dict) -> dict:
    d = delta(before, after)
    rounds = value(d, "specdec_wire_bytes_per_round_count") or 1.0
    res = {
        "wire_bytes_per_round_mean": value(d, "specdec_wire_bytes_per_round_sum") / rounds,
        "rpcs_per_round_mean": value(d, "specdec_rpcs_per_round_sum") / rounds,
    }
    decoding = value(d, "specdec_round_phase_seconds_count", phase="verify") or 1.0  # rounds that prefilled are apart
    for phase in ("draft", "verify", "accept", "rpc"):
        res[f"{phase}_ms_per_round_mean"] = 1000 * value(d, "specdec_round_phase_seconds_sum", phase=phase) / decoding
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--metrics-url",
        default="http://localhost:8001/metrics",
        help="the orchestrator's metrics, scraped for bytes, RPCs and phase times per round ('' skips)",
    )
    args = ap.parse_args()
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(args.address))
    run = lambda prompt, k: generate(stub, prompt, k, args.temperature, args.top_p, args.seed, args.max_tokens)
    run("Hello", args.k)  # warm-up
    before = scrape(args.metrics_url) if args.metrics_url else None
    ratios, acc, drafted, rejected, rounds, emitted = [], 0, 0, 0, 0, 0
    for rep in range(args.reps):
        for i, prompt in enumerate(PROMPTS):
            order = (0, args.k) if (rep + i) % 2 == 0 else (args.k, 0)
            rate = {}
            for k in order:
                r = run(prompt, k)
                rate[k] = r["tokens"] / r["seconds"]
                if k:
                    acc, drafted, rejected = (
                        acc + r["accepted"],
                        drafted + r["drafted"],
                        rejected + r["rejected_rounds"],
                    )
                    rounds, emitted = rounds + r["rounds"], emitted + r["emitted"]
            ratios.append(rate[args.k] / rate[0])
    wire = per_round(before, scrape(args.metrics_url)) if before is not None else {}  # K = 0 rounds included
    q = statistics.quantiles(ratios, n=4)
    report = {
        "k": args.k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "pairs": len(ratios),
        "speedup_median": statistics.median(ratios),
        "speedup_p25": q[0],
        "speedup_p75": q[2],
        "acceptance_rate": acc / drafted if drafted else 0.0,
        "alpha": leviathan_alpha(acc, rejected),
        "tokens_per_round": emitted / rounds if rounds else 0.0,
        **wire,
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
