"""What a pass costs as the context grows, by KV cache dtype: the target as a server takes it on this machine, in
one process, every arm in each rep so the machine's drift hits all.

    python -m bench.contexts [--contexts 200 1000 3000] [--reps 3] [--kv-cache model float16]

Per rep and KV cache: the median of a 1-row step and of a 4-row verify after each context (bench.production's
pass_ms), and of a batched step of 8 sessions holding 200 and 600 tokens each. Reported: each figure's median
[min, max] over reps, and float16 over model per rep.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from bench.production import pass_ms
from bench.services import machine, save
from specdec import models
from specdec.config import ROLE_DEFAULTS
from specdec.runners import resolve_activations
from specdec.runners.lean_llama import LeanLlamaRunner


def batched_ms(runner, sessions: int, context: int, reps: int = 15) -> float:
    """Median time of one step of `sessions` sessions in one pass, each after `context` tokens."""
    caches = [runner.new_cache() for _ in range(sessions)]
    for c in caches:
        runner.forward(c, [i % 1000 + 1 for i in range(context)], 1)
    times = []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        runner.forward_batch(caches, [[r + 5]] * sessions, [1] * sessions)
        times.append(time.perf_counter() - t0)
        for c in caches:
            runner.crop(c, context)
    return 1000 * statistics.median(times[2:])


def one_rep(runners: dict, contexts: list[int]) -> dict:
    out = {}
    for kv, runner in runners.items():
        arm = {f"step@{n}": pass_ms(runner, 1, n, 20) for n in contexts}
        arm |= {f"verify4@{n}": pass_ms(runner, 4, n, 10) for n in contexts}
        arm |= {f"8 sessions@{n}": batched_ms(runner, 8, n) for n in (200, 600)}
        out[kv] = arm
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.contexts", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_TARGET)
    p.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 3000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-cache", nargs="+", default=["model", "float16"])
    p.add_argument("--out", default="results/contexts")
    args = p.parse_args(argv)
    torch.set_num_threads(ROLE_DEFAULTS["target"].get("threads") or torch.get_num_threads())
    model, gguf = models.load_model(args.model), models.gguf_file(args.model)
    activations = resolve_activations("auto", "target", model, gguf=gguf)
    vocab = len(models.load_tokenizer(args.model))
    runners = {
        kv: LeanLlamaRunner(model, vocab, 8192, gguf=gguf, activations=activations, kv_cache=kv) for kv in args.kv_cache
    }
    reps = []
    for r in range(args.reps):
        reps.append(one_rep(runners, args.contexts))
        rounded = {kv: {k: round(v, 2) for k, v in arm.items()} for kv, arm in reps[-1].items()}
        print(f"rep {r}: {rounded}")
    spread = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    report = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": machine(),
        "runners": {kv: r.describe() for kv, r in runners.items()},
        "ms": {kv: {k: spread([rep[kv][k] for rep in reps]) for k in reps[0][kv]} for kv in args.kv_cache},
    }
    if "model" in runners and "float16" in runners:
        report["float16_over_model"] = {
            k: spread([rep["float16"][k] / rep["model"][k] for rep in reps]) for k in reps[0]["model"]
        }
    return save(report, Path(args.out), "contexts")


if __name__ == "__main__":
    main()
