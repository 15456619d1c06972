"""specdec bench: how much sooner tokens arrive, measured side by side, against the bound and the in-process peer.

    specdec bench [--quick] [--out DIR] [--draft-model M] [--target-model M]
    specdec bench --production [--device cuda]     # Llama 3.2 1B/3B sizes: see bench/production.py
    specdec bench --concurrency 1,4,8,16 [--llama-server PATH]   # throughput under load: see bench/load.py

Starts the three services on free loopback ports. For each temperature (0, and
0.7 with top_p 0.9), each repetition and each prompt of bench/prompts.json, it
runs K = 0 (the target alone, same path), every K in a shuffled order, then
K = 0 again. Arms named "K+lookup" run K with prompt lookup, whose rounds propose
tokens copied from the sequence itself when its last tokens repeat, and ask the
draft only otherwise (the proposals' source is mixed, so no bound applies to them).
The arm "auto" leaves K unset on a second orchestrator over the same model servers,
run with adaptive speculation (orchestrator/speculation.py), so that it chooses K
round by round from what its own requests measured (--no-auto skips it).
Each K's speedup is its tokens/s over the mean of that prompt's two K = 0 runs,
so machine drift cancels; the report gives the median and quartiles.
Two rates: end to end (all tokens over the request's time, as a client sees it,
the prompt's prefill included) and decoding (the tokens after the first streamed
message over the time after it; speculative decoding speeds up only this part).
The metrics of the three servers, scraped around every run, give per K: the split
of a decoding round into draft, verify, accept and RPC time, bytes and RPCs per
round, and c = the draft's mean one-token step / the target's (each server's own
forward-pass histogram; the target's from the K = 0 runs). With alpha =
accepted / (accepted + rounds ending in a rejection), the Leviathan bound is
(1 - alpha^(K+1)) / ((1 - alpha)(Kc + 1)), a bound on the decoding speedup, and
efficiency = decoding speedup / bound.
Then the in-process peer: transformers assisted generation (generate(assistant_model=...))
against its own generate(), on the same models and prompts.
Writes report.json, report.md and speedup.png under --out.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import grpc

from bench.metrics import delta, histogram_median, leviathan_alpha, leviathan_bound, mean_step_s, scrape_all, value
from bench.services import load_prompts, machine, start_services, stop_services
from specdec import models
from specdec.config import DEFAULT_DRAFT, OrchestratorConfig
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

TEMPERATURES = ((0.0, 1.0), (0.7, 0.9))


def generate(
    stub,
    prompt: str,
    k: int | None,
    temperature: float,
    top_p: float,
    seed: int,
    max_tokens: int,
    draft_confidence: float = 0.0,
    lookup_min: int = 0,
) -> dict:
    """k None leaves num_speculative_tokens unset: the orchestrator's default, or its adaptive choice."""
    req = pb.GenerateRequest(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        draft_confidence_threshold=draft_confidence,
        prompt_lookup_min=lookup_min,
    )
    if k is not None:
        req.num_speculative_tokens = k
    req.messages.add(role="user", content=prompt)
    t = time.perf_counter()
    stats, first_s, first_tokens = None, None, 0
    for msg in stub.Generate(req, timeout=600):
        if first_s is None and msg.token_ids:
            first_s, first_tokens = time.perf_counter() - t, len(msg.token_ids)
        if msg.HasField("stats"):
            stats = msg.stats
    seconds = time.perf_counter() - t
    return {
        "tokens": stats.completion_tokens,
        "seconds": seconds,
        "decode_tokens_per_s": decode_rate(stats.completion_tokens, seconds, first_tokens, first_s),
        "accepted": stats.accepted_tokens,
        "drafted": stats.draft_tokens,
        "rejected_rounds": stats.rejected_rounds,
        "rounds": stats.rounds,
        "emitted": stats.mean_tokens_per_round * stats.rounds,
        "ttft": stats.time_to_first_token_seconds,
        "lookup_tokens": stats.lookup_tokens,
        "lookup_accepted": stats.lookup_accepted_tokens,
    }


def decode_rate(tokens: int, seconds: float, first_tokens: int, first_s: float | None) -> float | None:
    """Tokens/s after the first streamed message: the tokens it did not carry over the time since it came.
    None when it carried them all. The first message waits for the prompt's prefill, which speculative
    decoding does not shorten; vLLM's time per output token leaves it out the same way."""
    if first_s is None or tokens <= first_tokens or seconds <= first_s:
        return None
    return (tokens - first_tokens) / (seconds - first_s)


AUTO = "auto"  # the arm whose K the orchestrator chooses round by round (adaptive speculation)


def arm_name(k: int | None, lookup_min: int) -> str:
    if k is None:
        return AUTO
    return f"{k}+lookup" if lookup_min else str(k)


def quartiles(xs: list[float]) -> dict:
    if len(xs) < 2:
        return {"median": xs[0] if xs else None, "p25": xs[0] if xs else None, "p75": xs[0] if xs else None}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2]}


def run_services(args, prompts, arms, progress) -> dict:
    """arms: (K, prompt_lookup_min) pairs besides K = 0."""
    out_dir = Path(args.out)
    procs, address, metrics_urls, (auto_address, auto_urls), forward = start_services(
        args.draft_model, args.target_model, out_dir / "services.log"
    )
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    auto_stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(auto_address))
    results = {}
    try:
        generate(stub, "Hello!", 4, 0.0, 1.0, 0, 8)  # warm-up
        generate(auto_stub, "Hello!", None, 0.0, 1.0, 0, 8)
        rng = random.Random(0)
        for temperature, top_p in TEMPERATURES:
            names = [arm_name(*arm) for arm in arms]
            runs = {name: [] for name in ["0", *names]}
            metric = {name: {} for name in ["0", *names]}
            speedups = {name: [] for name in names}
            decode_speedups = {name: [] for name in names}
            for rep in range(args.reps):
                for i, p in enumerate(prompts):
                    order = rng.sample(arms, len(arms))
                    base, rate, base_decode, decode = [], {}, [], {}
                    for k, lookup_min in [(0, 0), *order, (0, 0)]:
                        name = arm_name(k, lookup_min)
                        urls = auto_urls if k is None else metrics_urls
                        before = scrape_all(urls)
                        r = generate(
                            auto_stub if k is None else stub,
                            p["prompt"],
                            k,
                            temperature,
                            top_p,
                            seed=1000 * rep + i,
                            max_tokens=args.max_tokens,
                            draft_confidence=args.draft_confidence,
                            lookup_min=lookup_min,
                        )
                        d = delta(before, scrape_all(urls))
                        for key, v in d.items():
                            metric[name][key] = metric[name].get(key, 0.0) + v
                        runs[name].append(r)
                        if k == 0:
                            base.append(r["tokens"] / r["seconds"])
                            base_decode.append(r["decode_tokens_per_s"])
                        else:
                            rate[name] = r["tokens"] / r["seconds"]
                            decode[name] = r["decode_tokens_per_s"]
                        progress.update(1)
                    for name, v in rate.items():
                        speedups[name].append(v / statistics.mean(base))
                        if decode[name] and all(base_decode):
                            decode_speedups[name].append(decode[name] / statistics.mean(base_decode))
            results[f"T={temperature}"] = summarize(runs, metric, speedups, decode_speedups, temperature, top_p)
    finally:
        stop_services(procs)
    return results, forward


def _k_shares(m: dict) -> dict[int, float]:
    """The share of decoding rounds at each K, from the specdec_speculative_tokens histogram."""
    cum = [0.0] + [value(m, "specdec_speculative_tokens_bucket", le=f"{k:.1f}") for k in range(9)]
    total = value(m, "specdec_speculative_tokens_count") or 1.0
    return {k: (cum[k + 1] - cum[k]) / total for k in range(9) if cum[k + 1] > cum[k]}


def summarize(runs, metric, speedups, decode_speedups, temperature, top_p) -> dict:
    """Per arm (K, or K+lookup): rates, acceptance, c, the decoding round's split and, for the draft alone, the
    bound. Round times are of decoding rounds: the orchestrator times a round that prefills a session apart."""
    target_step_s = mean_step_s(metric["0"], "target")
    per_k = {}
    for name, rs in runs.items():
        m, adaptive = metric[name], name == AUTO
        k = None if adaptive else int(name.split("+")[0])
        lookup = not adaptive and name != str(k)
        rounds = value(m, "specdec_rounds_total") or 1.0
        decoding_rounds = value(m, "specdec_round_phase_seconds_count", phase="verify") or 1.0
        acc, drafted = sum(r["accepted"] for r in rs), sum(r["drafted"] for r in rs)
        rej = sum(r["rejected_rounds"] for r in rs)
        looked, looked_acc = sum(r["lookup_tokens"] for r in rs), sum(r["lookup_accepted"] for r in rs)
        alpha = leviathan_alpha(acc, rej)
        draft_step_s = mean_step_s(m, "draft")
        c = draft_step_s / target_step_s if target_step_s else 0.0
        row = {
            "k": k,
            "lookup": lookup,
            "tokens_per_s": quartiles([r["tokens"] / r["seconds"] for r in rs]),
            "decode_tokens_per_s": quartiles([r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"]]),
            "latency_s": quartiles([r["seconds"] for r in rs]),
            "ttft_s": quartiles([r["ttft"] for r in rs]),
            "alpha": alpha,
            "accepted_over_drafted": acc / drafted if drafted else 0.0,
            "tokens_per_round": sum(r["emitted"] for r in rs) / max(sum(r["rounds"] for r in rs), 1),
            "c": c,
            "draft_step_ms": 1000 * draft_step_s,
            "round_ms": {
                ph: 1000 * value(m, "specdec_round_phase_seconds_sum", phase=ph) / decoding_rounds
                for ph in ("draft", "verify", "accept", "rpc")
            },
            "wire_bytes_per_round_mean": value(m, "specdec_wire_bytes_per_round_sum") / rounds,
            "wire_bytes_per_round_median_at_most": histogram_median(m, "specdec_wire_bytes_per_round"),
            "rpcs_per_round_mean": value(m, "specdec_rpcs_per_round_sum") / rounds,
        }
        if name != "0":
            row["speedup"] = quartiles(speedups[name])
            row["decode_speedup"] = quartiles(decode_speedups[name])
        if adaptive:  # k: the mean K of its decoding rounds; no bound, since K varies
            row["k"] = value(m, "specdec_speculative_tokens_sum") / decoding_rounds
            row["adaptive"] = True
            row["k_share"] = _k_shares(m)
        elif lookup:
            if looked:
                row["lookup_share"] = looked / drafted
                row["lookup_accepted_over_proposed"] = looked_acc / looked
            if str(k) in speedups:  # the same prompts' runs without lookup, pair by pair
                row["over_plain_k"] = quartiles([a / b for a, b in zip(speedups[name], speedups[str(k)])])
        elif k:
            row["bound"] = leviathan_bound(alpha, k, c)
            decoding = row["decode_speedup"]["median"]
            row["efficiency"] = decoding / row["bound"] if row["bound"] and decoding else None
        per_k[name] = row
    speed = lambda name: per_k[name]["speedup"]["median"]
    fixed = lambda row: row["k"] and not row["lookup"] and not row.get("adaptive")
    best = max((n for n, row in per_k.items() if fixed(row)), key=speed, default=None)
    best_lookup = max((n for n, row in per_k.items() if row["lookup"]), key=speed, default=None)
    return {
        "temperature": temperature,
        "top_p": top_p,
        "per_k": per_k,
        "best_k": int(best) if best else None,
        "best_lookup": best_lookup,
        "target_step_ms": 1000 * target_step_s,
    }


class _FirstChunk:
    """A generate() streamer that notes when the first generated tokens come and how many: generate() puts
    the prompt first, then each step's (or each assisted round's) new tokens."""

    def __init__(self):
        self.puts, self.at, self.tokens = 0, None, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at, self.tokens = time.perf_counter(), value.numel()

    def end(self) -> None:
        pass


def run_peer(args, prompts, progress) -> dict:
    """transformers' assisted generation against its own generate(), same models, alternated."""
    import torch

    tok = models.load_tokenizer(args.target_model)
    target = models.load_model(args.target_model)
    draft = models.load_model(args.draft_model)
    out = {}
    for temperature, top_p in TEMPERATURES:
        ratios, decode_ratios, rates = [], [], {"plain": [], "assisted": []}
        for i, p in enumerate(prompts):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            kw = dict(max_new_tokens=args.max_tokens, pad_token_id=tok.eos_token_id)
            kw.update(do_sample=True, temperature=temperature, top_p=top_p) if temperature else kw.update(
                do_sample=False
            )
            rate, decode = {}, {}
            for mode in ("plain", "assisted") if i % 2 == 0 else ("assisted", "plain"):
                torch.manual_seed(i)
                first = _FirstChunk()
                t = time.perf_counter()
                gen = target.generate(ids, assistant_model=draft if mode == "assisted" else None, streamer=first, **kw)
                seconds, tokens = time.perf_counter() - t, gen.shape[1] - ids.shape[1]
                rate[mode] = tokens / seconds
                decode[mode] = decode_rate(tokens, seconds, first.tokens, first.at and first.at - t)
                rates[mode].append(rate[mode])
                progress.update(1)
            ratios.append(rate["assisted"] / rate["plain"])
            if decode["assisted"] and decode["plain"]:
                decode_ratios.append(decode["assisted"] / decode["plain"])
        out[f"T={temperature}"] = {
            "speedup": quartiles(ratios),
            "decode_speedup": quartiles(decode_ratios),
            "plain_tokens_per_s": quartiles(rates["plain"]),
            "assisted_tokens_per_s": quartiles(rates["assisted"]),
        }
    return out


def server_environment(device: str | None, dtype: str | None) -> dict[str, str]:
    """The model servers' settings for --device and --dtype: both servers on the device, bfloat16 on a GPU unless
    a dtype is named."""
    dtype = dtype or (None if device is None or device.startswith("cpu") else "bfloat16")
    named = {"DEVICE": device, "DTYPE": dtype}
    return {f"SPECDEC_{role}_{key}": value for role in ("TARGET", "DRAFT") for key, value in named.items() if value}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--production" in argv:  # the production-size profile (bench/production.py)
        from bench.production import main as production_main

        return production_main([a for a in argv if a != "--production"])
    ap = argparse.ArgumentParser(
        prog="specdec bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke check under 5 minutes: 6 prompts, K in {2, 4}, one repetition"
    )
    ap.add_argument("--out", default=None, help="results folder (default results/bench-DATE)")
    ap.add_argument("--draft-model", default=os.environ.get("SPECDEC_DRAFT_MODEL", DEFAULT_DRAFT))
    ap.add_argument("--target-model", default=os.environ.get("SPECDEC_TARGET_MODEL", models.DEFAULT_TARGET))
    ap.add_argument(
        "--prompts", type=int, default=None, help="prompts, round-robin over the families (default 42; --quick 6)"
    )
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--device",
        default=None,
        help="the model servers' device (cpu, cuda...; default: their SPECDEC_*_DEVICE, else cpu); on a GPU the "
        "dtype defaults to bfloat16",
    )
    ap.add_argument("--dtype", default=None, help="the model servers' dtype (default: the device's)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per generation (default 40)")
    ap.add_argument("--ks", default=None, help="comma-separated K values (default 1..8)")
    ap.add_argument(
        "--lookup-ks",
        default=None,
        help="comma-separated K values also run with prompt lookup, as arms K+lookup (default 2,3,4; "
        "--quick 3; '' for none)",
    )
    ap.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=2,
        help="prompt_lookup_min of the K+lookup arms: the shortest repeat they copy from (default 2)",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers assisted-generation peer")
    ap.add_argument(
        "--no-auto",
        action="store_true",
        help="skip the arm 'auto', whose K a second orchestrator with adaptive speculation chooses",
    )
    ap.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="draft_confidence_threshold of every request: rounds stop drafting early below it (default 0: always K)",
    )
    load = ap.add_argument_group("load (bench/load.py): throughput and latency with N requests at a time")
    load.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated N, e.g. 1,4,8,16: run the load benchmark instead of the speedup one",
    )
    load.add_argument(
        "--load-prompts", type=int, default=8, help="chat prompts, round-robin over the families (default 8)"
    )
    load.add_argument("--load-tokens", type=int, default=96, help="max_tokens of each request (default 96)")
    load.add_argument(
        "--llama-server",
        default=None,
        help="a llama.cpp llama-server binary: the same load against it on the target's GGUF file",
    )
    args = ap.parse_args(argv)
    os.environ.update(server_environment(args.device, args.dtype))  # the services the bench starts inherit it
    if args.concurrency:
        from bench.load import main as load_main

        args.reps = args.reps or 3
        args.out = args.out or f"results/load-{time.strftime('%Y%m%d-%H%M%S')}"
        report = load_main(args)
        print(f"specdec bench: wrote {args.out}/load.json, load.md, load.png")
        print((Path(args.out) / "load.md").read_text())
        return 0
    if not 0 <= args.draft_confidence < 1:
        ap.error(f"--draft-confidence must be in [0, 1), got {args.draft_confidence}")
    # The full run's size keeps it within 45 minutes on the 2-core VM at its slowest seen speed (about
    # 16 tokens/s through the services): 42 prompts (6 per family) x 2 temperatures x 10 runs x 40 tokens.
    args.prompts = args.prompts or (6 if args.quick else 42)
    args.reps = args.reps or 1
    args.max_tokens = args.max_tokens or 40
    ks = [int(k) for k in args.ks.split(",")] if args.ks else ([2, 4] if args.quick else list(range(1, 9)))
    lookup_ks = args.lookup_ks if args.lookup_ks is not None else ("3" if args.quick else "2,3,4")
    lookup_ks = [int(k) for k in lookup_ks.split(",") if k.strip()]
    longest = OrchestratorConfig.prompt_lookup_max  # the orchestrator the bench starts runs with its default
    if not 1 <= args.prompt_lookup_min <= longest:
        ap.error(
            f"--prompt-lookup-min must be within [1, {longest}] (the orchestrator's --prompt-lookup-max), "
            f"got {args.prompt_lookup_min}"
        )
    if min(ks + lookup_ks) < 1:
        ap.error("every K of --ks and --lookup-ks must be at least 1 (K = 0 always runs)")
    arms = [(k, 0) for k in ks] + [(k, args.prompt_lookup_min) for k in lookup_ks]
    if not args.no_auto:
        arms.append((None, 0))
    args.out = args.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if args.quick else ''}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts)
    peer_prompts = prompts[: 3 if args.quick else 14]
    from tqdm import tqdm

    total = len(TEMPERATURES) * args.reps * len(prompts) * (len(arms) + 2) + (
        0 if args.no_peer else 2 * 2 * len(peer_prompts)
    )
    t0 = time.monotonic()
    with tqdm(total=total, unit="gen", desc="specdec bench") as progress:
        report = {
            "machine": machine(),
            "draft_model": args.draft_model,
            "target_model": args.target_model,
            "prompts": len(prompts),
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "ks": ks,
            "lookup_ks": lookup_ks,
            "prompt_lookup_min": args.prompt_lookup_min,
            "draft_confidence_threshold": args.draft_confidence,
        }
        report["services"], report["forward"] = run_services(args, prompts, arms, progress)
        if not args.no_peer:
            report["transformers_assisted"] = run_peer(args, peer_prompts, progress)
            report["transformers_assisted"]["prompts"] = len(peer_prompts)
    report["wall_seconds"] = time.monotonic() - t0
    from bench.report import write_report

    write_report(report, Path(args.out))
    print(f"specdec bench: wrote {args.out}/report.json, report.md, speedup.png")
    print((Path(args.out) / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
