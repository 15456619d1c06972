"""The draft's training data generation: answers a second of the target, per way of running it, side by side.

    python -m bench.datagen [--prompts 64] [--tokens 96] [--reps 2]

The training prompts (training.prompts, as training.distill asks them), greedy, one batch of --prompts rows, every
arm in each rep one after the other:
  - padded: training.batched.generate, the left-padded torch forward (F.linear), in float32 and in bfloat16 (what
    training.distill takes where the CPU multiplies bf16 in hardware);
  - served: training.batched.generate_served, the runner's own forward as the model server runs it (each row a
    session, the step's rows in one pass of specdec's kernels), with float32 and with 8- and 16-bit activations.
Reported: tokens/s per arm (median [min, max] over reps) and each arm's ratio to padded float32 rep by rep.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.services import machine, save
from specdec import models
from specdec.runners import LeanLlamaRunner
from training import batched
from training.distill import chat_prompts


def arms(tokenizer, spec: str) -> dict:
    """name -> (runner, generator)."""
    gguf = models.gguf_file(spec)
    f32 = models.load_model(spec)
    out = {
        "padded float32": (LeanLlamaRunner(f32, len(tokenizer), 4096), batched.generate),
        "served float32": (LeanLlamaRunner(f32, len(tokenizer), 4096, gguf=gguf), batched.generate_served),
        **{
            f"served {a}": (
                LeanLlamaRunner(f32, len(tokenizer), 4096, gguf=gguf, activations=a),
                batched.generate_served,
            )
            for a in ("int8", "int16")
        },
    }
    if models.cpu_has_native_bf16():
        bf16 = models.load_model(spec, dtype="bfloat16")
        out["padded bfloat16"] = (LeanLlamaRunner(bf16, len(tokenizer), 4096), batched.generate)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="results/datagen")
    args = p.parse_args(argv)
    spec = models.DEFAULT_TARGET
    tokenizer = models.load_tokenizer(spec)
    prompts = chat_prompts(tokenizer, args.prompts, seed=11)[: args.prompts]
    eos = {tokenizer.eos_token_id}
    runs = arms(tokenizer, spec)
    for runner, generate in runs.values():  # warm-up: kernels, plans, caches
        generate(runner, prompts[:4], 4, 0.0, 1.0, eos, 0)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(args.reps):
        for name, (runner, generate) in runs.items():
            t0 = time.perf_counter()
            got = generate(runner, prompts, args.tokens, 0.0, 1.0, eos, rep)
            rates[name].append(sum(len(ids) for ids, *_ in got) / (time.perf_counter() - t0))
            print(f"rep {rep} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    spread = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    base = rates["padded float32"]
    report = {
        "machine": machine(),
        "prompts": len(prompts),
        "tokens": args.tokens,
        "reps": args.reps,
        "tokens_per_s": {name: spread(xs) for name, xs in rates.items()},
        "over_padded_float32": {name: spread([x / b for x, b in zip(xs, base)]) for name, xs in rates.items()},
    }
    return save(report, Path(args.out), "datagen")


if __name__ == "__main__":
    main()
