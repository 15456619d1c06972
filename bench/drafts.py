"""Drafts side by side through the services: alpha at a fixed K, and one stream's tokens/s with adaptive K against
the target alone, greedy and sampled, each ratio taken within one rep.

    python -m bench.drafts --draft models/smollm2-draft --draft models/smollm2-head [--prompts 12] [--tokens 96]
    python -m bench.drafts --draft models/smollm2-draft --draft-activations float32 --draft-activations int8
    python -m bench.drafts --draft models/smollm2-head --draft-env '' --draft-env SPECDEC_DRAFT_QUANTIZE=int4

Each draft gets its own services (`specdec up` and the adaptive orchestrator, bench/services.py), all running at
once on the same target model; the arms run one after the other within a rep, every draft in turn, so the
machine's drift hits them all. The prompts are the training generator's held-out ones (training/prompts.py), which
no draft trained on. alpha = accepted / (accepted + rounds ending in a rejection), at --k with prompt lookup off.
Each --draft-activations value runs every draft again with its server's activations set so (an arm is named
"draft@activations" then); each --draft-env value, settings NAME=VALUE[,NAME=VALUE] for the services ('' for none),
likewise (an arm "draft@settings").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import grpc

from bench.load import run_jobs
from bench.metrics import delta, leviathan_alpha, mean_step_s, scrape_all, value
from bench.services import machine, save, start_services, stop_services
from specdec import models
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc
from training.prompts import make_prompts

MODES = {"greedy": (0.0, 1.0), "t0.7": (0.7, 0.9)}  # temperature, top_p


def sender(address: str, k: int | None, tokens: int, temperature: float, top_p: float):
    """send((i, messages)): one streamed Generate, seeded by i; its tokens and speculative stats."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))

    def send(job) -> dict:
        i, messages = job
        req = pb.GenerateRequest(max_tokens=tokens, temperature=temperature, top_p=top_p, seed=1 + i)
        req.prompt_lookup_min = 0  # the draft's own alpha
        if k is not None:
            req.num_speculative_tokens = k
        for m in messages:
            req.messages.add(role=m["role"], content=m["content"])
        ids, stats = [], None
        for msg in stub.Generate(req, timeout=900):
            ids += msg.token_ids
            stats = msg.stats if msg.HasField("stats") else stats
        return {"ids": ids, "accepted": stats.accepted_tokens, "rejected": stats.rejected_rounds}

    return send


def one_run(services, jobs: list, tokens: int, k: int) -> dict:
    """Per mode: tokens/s one request at a time at K = 0 and with adaptive K, alpha at K = k and how far its rounds'
    guesses held, and each server's one-token step (the target's from its K = 0 steps, the draft's from its
    drafting) with c, their ratio."""
    _, address, urls, (auto_address, _), _ = services
    out = {}
    for mode, (temperature, top_p) in MODES.items():
        before, rate = scrape_all(urls), {}
        for arm, (addr, arm_k) in {"k0": (address, 0), "auto": (auto_address, None)}.items():
            t0 = time.perf_counter()
            results, _ = run_jobs(sender(addr, arm_k, tokens, temperature, top_p), jobs, 1)
            rate[arm] = sum(len(r["ids"]) for r in results) / (time.perf_counter() - t0)
        fixed, _ = run_jobs(sender(address, k, tokens, temperature, top_p), jobs, 1)
        alpha = leviathan_alpha(sum(r["accepted"] for r in fixed), sum(r["rejected"] for r in fixed))
        out[mode] = {"k0_tokens_per_s": rate["k0"], "auto_tokens_per_s": rate["auto"], "alpha": alpha}
        out[mode]["speedup"] = rate["auto"] / rate["k0"]
        metrics = delta(before, scrape_all(urls))
        out[mode].update(step_costs(metrics) | accepted_through(metrics, k))
    return out


def accepted_through(metrics: dict, k: int) -> dict:
    """The share of the fixed-K rounds whose drafted tokens 1..i were all accepted, for i = 1..k (the orchestrator's
    per-position counters): how far the draft's guesses hold, the first position alone beside alpha."""
    out = {}
    for i in range(1, k + 1):
        drafted = value(metrics, "specdec_draft_tokens_per_position_total", position=str(i))
        if drafted:
            out[f"accepted_through_{i}"] = (
                value(metrics, "specdec_accepted_tokens_per_position_total", position=str(i)) / drafted
            )
    return out


def step_costs(metrics: dict) -> dict:
    """Each server's mean one-token step over a run (the target's from its K = 0 steps) and c, their ratio."""
    draft, target = mean_step_s(metrics, "draft"), mean_step_s(metrics, "target")
    out = {"draft_step_ms": 1e3 * draft, "target_step_ms": 1e3 * target}
    if draft and target:
        out["c"] = draft / target
    return out


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def make_arms(drafts: list[str], activations: list[str], envs: list[str]) -> dict[str, tuple[str, dict]]:
    """name -> (draft, the services' extra settings): each draft, times each activations value ("draft@int8"),
    times each settings string "NAME=VALUE[,NAME=VALUE]" ("draft@NAME=VALUE"; '' for none)."""
    arms = {d: (d, {}) for d in drafts}
    if activations:
        arms = {f"{d}@{a}": (d, {"SPECDEC_DRAFT_ACTIVATIONS": a}) for d in drafts for a in activations}
    if envs:
        extra = {spec: dict(kv.split("=", 1) for kv in spec.split(",") if kv) for spec in envs}
        arms = {f"{n}@{spec}": (d, {**env, **extra[spec]}) for n, (d, env) in arms.items() for spec in envs}
    return arms


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", action="append", required=True, help="a draft model (repeatable)")
    p.add_argument("--draft-activations", action="append", help="the draft server's --activations (repeatable)")
    p.add_argument("--draft-env", action="append", help="the services' settings NAME=VALUE[,...] (repeatable)")
    p.add_argument("--target", default=models.DEFAULT_TARGET)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="the fixed K alpha is measured at")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="results/drafts")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = list(enumerate(make_prompts(args.prompts, seed=7, held_out=True)))
    arms = make_arms(args.draft, args.draft_activations or [], args.draft_env or [])
    services = {
        name: start_services(d, args.target, out / f"services-{i}.log", env=env)
        for i, (name, (d, env)) in enumerate(arms.items())
    }
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    try:
        for started in services.values():  # warm-up: kernels, caches, adaptive K's first costs
            one_run(started, jobs[:2], 16, args.k)
        for rep in range(args.reps):
            for d, started in services.items():
                runs[d].append(one_run(started, jobs, args.tokens, args.k))
                print(f"rep {rep} {d}: {json.dumps(runs[d][-1])}", flush=True)
    finally:
        for procs, *_ in services.values():
            stop_services(procs)
    report = {"machine": machine(), "prompts": len(jobs), "tokens": args.tokens, "k": args.k, "drafts": {}}
    for d, rs in runs.items():
        report["drafts"][d] = {mode: {key: spread([r[mode][key] for r in rs]) for key in rs[0][mode]} for mode in MODES}
    return save(report, out, "drafts")


if __name__ == "__main__":
    main()
