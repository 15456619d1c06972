"""Two checkouts of specdec, or two settings, side by side: tokens/s of the target alone (K = 0) and with
adaptive speculation, and the target's step, for a change that must not cost speed (a refactor, a new default)
or should gain it.

    python -m bench.versions --base 07b4b0c [--head REV] [--prompts 8] [--tokens 64] [--reps 3] [--temperature 0]
        [--top-p 1] [--k K]
    python -m bench.versions --base HEAD --head HEAD --head-env SPECDEC_TARGET_ACTIVATIONS=int8
    python -m bench.versions --base HEAD --base-env SPECDEC_TARGET_KV_CACHE_DTYPE=model --ignore-eos --tokens 1024

Both checkouts' services run at once on the same machine; the prompts go one at a time to each in turn, rep by
rep, so the machine's drift hits both. --k adds an arm at that fixed K, one prompt at a time. The target's step
is its 1-row passes' mean time over each run (specdec_forward_seconds{tokens="1"}); the ratio head / base is
taken within each rep, and speculation's tokens/s over the same checkout's K = 0 too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.load import grpc_sender, run_jobs
from bench.metrics import delta, scrape, value
from bench.services import load_prompts, machine, start_services, stop_services
from specdec import models
from specdec.config import DEFAULT_DRAFT

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, folder: Path) -> Path:
    """A worktree of rev (named in this checkout: HEAD is this one's) at folder, made once, moved to rev."""
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True, text=True)
    rev = rev.stdout.strip()
    if not folder.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "--detach", "--quiet", rev], check=True)
    return folder


def one_run(services, prompts: list[str], tokens: int, temperature=0.0, top_p=1.0, k=None, ignore_eos=False) -> dict:
    """The prompts one at a time at K = 0, then through the adaptive orchestrator, then at the fixed K k (if any),
    then all at once at K = 0; the target's 1-row passes."""
    _, address, urls, (auto_address, _), _ = services
    sender = lambda address, k: grpc_sender(address, k, tokens, temperature, top_p, ignore_eos)
    before = scrape(urls["target"])
    results, wall = run_jobs(sender(address, 0), prompts, 1)
    d = delta(before, scrape(urls["target"]))
    auto, auto_wall = run_jobs(sender(auto_address, None), prompts, 1)
    fixed = {}
    if k:
        at_k, k_wall = run_jobs(sender(address, k), prompts, 1)
        fixed["k_tokens_per_s"] = sum(len(r["ids"]) for r in at_k) / k_wall
    load, load_wall = run_jobs(sender(address, 0), prompts, len(prompts))
    steps = value(d, "specdec_forward_seconds_count", tokens="1")
    return {
        "tokens_per_s": sum(len(r["ids"]) for r in results) / wall,
        "auto_tokens_per_s": sum(len(r["ids"]) for r in auto) / auto_wall,
        **fixed,
        "all_at_once_tokens_per_s": sum(len(r["ids"]) for r in load) / load_wall,
        "step_ms": 1e3 * value(d, "specdec_forward_seconds_sum", tokens="1") / steps if steps else None,
    }


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the revision to compare with")
    p.add_argument("--head", default=None, help="the revision compared (default: the working tree)")
    p.add_argument("--head-env", action="append", default=[], help="KEY=VALUE for the head's services (repeatable)")
    p.add_argument("--base-env", action="append", default=[], help="KEY=VALUE for the base's services (repeatable)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (seed 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's")
    p.add_argument("--k", type=int, default=0, help="also run every prompt at this fixed K")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to --tokens")
    p.add_argument("--out", default="results/versions")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = checkout(args.base, Path(tempfile.gettempdir()) / f"specdec-{args.base}")
    prompts = [q["prompt"] for q in load_prompts(args.prompts)]
    head = checkout(args.head, Path(tempfile.gettempdir()) / f"specdec-{args.head}") if args.head else None
    trees = {"base": base, "head": head}
    env = {name: dict(kv.split("=", 1) for kv in getattr(args, f"{name}_env")) for name in ("base", "head")}
    services = {
        name: start_services(DEFAULT_DRAFT, models.DEFAULT_TARGET, out / f"{name}.log", tree, env[name])
        for name, tree in trees.items()
    }
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for started in services.values():  # warm-up
            one_run(started, prompts[:2], 8)
        for rep in range(args.reps):
            for name, started in services.items():
                runs[name].append(
                    one_run(started, prompts, args.tokens, args.temperature, args.top_p, args.k, args.ignore_eos)
                )
                print(f"rep {rep} {name}: {runs[name][-1]}")
    finally:
        for procs, *_ in services.values():
            stop_services(procs)
    report = {"machine": machine(), "base": args.base, "prompts": len(prompts), "tokens": args.tokens}
    report["temperature"], report["top_p"], report["k"] = args.temperature, args.top_p, args.k
    report["head_env"], report["base_env"], report["ignore_eos"] = env["head"], env["base"], args.ignore_eos
    for key in ("tokens_per_s", "auto_tokens_per_s", "k_tokens_per_s", "all_at_once_tokens_per_s", "step_ms"):
        if key not in runs["base"][0]:
            continue
        report[key] = {name: spread([r[key] for r in rs]) for name, rs in runs.items()}
        report[key + "_ratio"] = spread([h[key] / b[key] for h, b in zip(runs["head"], runs["base"])])
        if key in ("auto_tokens_per_s", "k_tokens_per_s"):  # speculation over the same checkout's K = 0, rep by rep
            over = {name: spread([r[key] / r["tokens_per_s"] for r in rs]) for name, rs in runs.items()}
            report[key.replace("tokens_per_s", "over_k0")] = over
    (out / "versions.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
