"""Soak a running `specdec up`: waves of mixed requests, then each service's memory and open files.

    .venv/bin/python tools/soak.py [--waves 12] [--per-wave 40] [--concurrency 4] [--address localhost:50051]

Each wave sends greedy and sampled requests, requests the client cancels after three messages, long
prompts, and malformed ones (which must come back INVALID_ARGUMENT), `concurrency` at a time. After each
wave it prints the resident memory and open file descriptors of the draft, target and orchestrator
processes (found by their command lines; Linux). A leak shows as a column that keeps growing; at the end
the orchestrator's request counters must add up to the requests sent and both KV pools must be empty.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.metrics import scrape, value
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot.",
    "List five fruits as JSON.",
    "Write a Python function that reverses a list.",
    "What is 17 * 23?",
    "Summarize: The cat sat on the mat all day, watching the birds.",
]
KINDS = ("greedy", "sampled", "cancel", "malformed", "long")


def service_pids() -> dict[str, int]:
    out = subprocess.run(["pgrep", "-f", "specdec"], capture_output=True, text=True).stdout.split()
    found = {}
    for pid in out:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        for role in ("draft", "target", "orchestrator"):
            if role in argv and "cli.main" in argv:
                found[role] = int(pid)
    return found


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def one(stub, i: int) -> str:
    rnd = random.Random(i)
    kind = rnd.choice(KINDS)
    req = pb.GenerateRequest(
        max_tokens=rnd.choice([8, 24, 48]),
        temperature=0.0 if kind == "greedy" else 0.7,
        seed=i,
        num_speculative_tokens=rnd.choice([0, 1, 3, 5]),
    )
    req.messages.add(role="user", content=rnd.choice(PROMPTS) * (6 if kind == "long" else 1))
    if kind == "malformed":
        req.top_p = 2.0
    try:
        stream = stub.Generate(req, timeout=120)
        for n, _ in enumerate(stream):
            if kind == "cancel" and n == 2:
                stream.cancel()
                break
    except grpc.RpcError as e:
        expected = {"malformed": grpc.StatusCode.INVALID_ARGUMENT, "cancel": grpc.StatusCode.CANCELLED}.get(kind)
        if e.code() != expected:
            return f"unexpected {e.code().name}: {e.details()}"
    return ""


def ended_requests(url: str) -> float:
    """Requests the orchestrator counted as finished (by finish reason) or errored (by status code)."""
    return sum(
        v for (name, _), v in scrape(url).items() if name in ("specdec_requests_total", "specdec_request_errors_total")
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--metrics", default="http://localhost:8001/metrics", help="the orchestrator's metrics")
    ap.add_argument(
        "--pool-metrics",
        nargs=2,
        default=["http://localhost:8002/metrics", "http://localhost:8003/metrics"],
        metavar=("DRAFT", "TARGET"),
        help="the model servers' metrics",
    )
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--per-wave", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    pids = service_pids()
    if set(pids) != {"draft", "target", "orchestrator"}:
        raise SystemExit(f"soak: found {sorted(pids)} of the three services; start them with `specdec up`")
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(args.address))
    before, problems = ended_requests(args.metrics), []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for w in range(args.waves):
            t = time.monotonic()
            problems += [
                p for p in pool.map(lambda i: one(stub, i), range(w * args.per_wave, (w + 1) * args.per_wave)) if p
            ]
            print(
                f"wave {w:2d} ({time.monotonic() - t:4.1f} s): "
                + ", ".join(
                    f"{role} {rss_mb(pid)} MB {len(os.listdir(f'/proc/{pid}/fd'))} fds"
                    for role, pid in sorted(pids.items())
                ),
                flush=True,
            )
    time.sleep(1)
    sent, seen = args.waves * args.per_wave, ended_requests(args.metrics) - before
    sessions = [value(scrape(url), "specdec_kv_sessions") for url in args.pool_metrics]
    print(
        f"requests sent {sent}, counted finished or errored {seen:.0f}; unexpected outcomes: {len(problems)}; "
        f"KV sessions left: draft {sessions[0]:.0f}, target {sessions[1]:.0f}"
    )
    for p in problems[:5]:
        print("  " + p)
    return 0 if seen == sent and not problems and not any(sessions) else 1


if __name__ == "__main__":
    raise SystemExit(main())
