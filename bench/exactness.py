"""How often greedy speculative output differs from the target alone, by K and under load, in a chosen dtype.

Where the runner is batch-invariant (specdec's CPU kernels, float32) the answer is never, and the tests hold
it. Off those kernels (bfloat16 on a CPU takes torch's ops, as a GPU does) a verify pass of K + 1 rows sums in
another order than a one-row step, and a batch of sessions in another than a lone one, so a near-tie between
the two best tokens can break the other way. This measures the rate, through the real services:

    python -m bench.exactness --dtype bfloat16 --prompts 16 --tokens 48 --k 1,2,3,4 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.load import grpc_sender, run_jobs
from bench.services import load_prompts, machine, save, start_services, stop_services
from specdec import models


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (the shorter's end counts), None where equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(reference: dict[str, list[int]], outputs: dict[str, list[int]]) -> dict:
    """Outputs that differ from the reference, of how many, and where each first differs."""
    at = {p: first_divergence(reference[p], ids) for p, ids in outputs.items()}
    where = sorted(i for i in at.values() if i is not None)
    return {"differ": len(where), "of": len(outputs), "first_divergence": where}


def run(address: str, prompts: list[str], tokens: int, ks: list[int], concurrency: int, progress=print) -> dict:
    def outputs(k: int | None, workers: int) -> dict[str, list[int]]:
        results, _ = run_jobs(grpc_sender(address, k, tokens), prompts, workers)
        return {p: r["ids"] for p, r in zip(prompts, results)}

    reference = outputs(0, 1)  # the target alone, one request at a time
    report = {"alone": {}, "under_load": {}}
    for k in ks:
        report["alone"][k] = compare(reference, outputs(k, 1))
        progress(f"K = {k}, alone: {report['alone'][k]['differ']} of {len(prompts)} differ from the target alone")
    for k in [0, *ks]:
        report["under_load"][k] = compare(reference, outputs(k, concurrency))
        progress(f"K = {k}, {concurrency} at once: {report['under_load'][k]['differ']} of {len(prompts)} differ")
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--k", default="1,2,3,4")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--draft-model", default="embedded:smollm2-135m-draft")
    p.add_argument("--target-model", default=models.DEFAULT_TARGET)
    p.add_argument("--out", default="results/exactness")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SPECDEC_TARGET_DTYPE"] = os.environ["SPECDEC_DRAFT_DTYPE"] = args.dtype
    prompts = [q["prompt"] for q in load_prompts(args.prompts)]
    procs, address, _, _, forward = start_services(args.draft_model, args.target_model, out / "services.log")
    try:
        run_jobs(grpc_sender(address, 0, 4), prompts[:1], 1)  # warm-up
        report = run(address, prompts, args.tokens, [int(k) for k in args.k.split(",")], args.concurrency)
    finally:
        stop_services(procs)
    report = {
        "machine": machine(),
        "dtype": args.dtype,
        "forward": forward,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        **report,
    }
    return save(report, out, "exactness")


if __name__ == "__main__":
    main()
