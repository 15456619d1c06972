"""Evaluate a draft through the real services on held-out prompts (issue 3).

    specdec up &                                   # with the draft to evaluate
    python -m training.evaluate [--address localhost:50051] [--prompts 40] [--prompt-set held-out|bench]

Reports, at K = 4 for T = 0 and T = 0.7 (top_p 0.9): alpha = accepted / (accepted +
rounds ending in a rejection), accepted/drafted, tokens per round tau; c = one
draft step / one target step measured here with the runners the services use; and
the speedup (1 - a^(K+1)) / ((1 - a)(Kc + 1)) predicted at the best K.
Prompt sets: the generator's held-out content (default), or the bench's hand-written
prompts (bench/prompts.json, which the generator never produces).
"""

from __future__ import annotations

import argparse
import json
import statistics

import grpc
import torch

from bench.metrics import leviathan_alpha, leviathan_bound
from bench.production import pass_ms
from bench.services import load_prompts
from specdec import models
from specdec.config import ROLE_DEFAULTS, ModelServerConfig
from specdec.runners import make_runner, resolve_activations, resolve_kv_cache, resolve_quantize
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc
from training.prompts import make_prompts

_DEFAULT_THREADS = torch.get_num_threads()


def step_ms(runner, context: int = 200, reps: int = 30, threads: int = 0) -> float:
    """Median time of one 1-token step after `context` tokens, with the CPU threads its server uses (0: torch's default)."""
    torch.set_num_threads(threads or _DEFAULT_THREADS)
    return pass_ms(runner, 1, context, reps, warmup=0)  # measure_c warms both runners up first


def measure_c(
    draft: str, target: str, draft_runner: str, target_runner: str, draft_quantize: str = "auto"
) -> tuple[float, float]:
    tok = models.load_tokenizer(target)
    d_model = models.load_model(draft)
    t_model, gguf = models.load_model(target), models.gguf_file(target)
    quantize = resolve_quantize(draft_quantize, "draft", d_model)  # the forms each server takes by default
    d_act = resolve_activations("auto", "draft", d_model, kind=draft_runner, quantize=quantize)
    t_act = resolve_activations("auto", "target", t_model, kind=target_runner, gguf=gguf)
    d_kv, t_kv = resolve_kv_cache("auto", "draft", d_act, None), resolve_kv_cache("auto", "target", t_act, gguf)
    d = make_runner(d_model, len(tok), 4096, draft_runner, quantize=quantize, activations=d_act, kv_cache=d_kv)
    t = make_runner(t_model, len(tok), 4096, target_runner, gguf=gguf, activations=t_act, kv_cache=t_kv)
    d_threads, t_threads = (ROLE_DEFAULTS[role].get("threads", 0) for role in ("draft", "target"))
    step_ms(d, reps=5, threads=d_threads), step_ms(t, reps=5, threads=t_threads)
    d_ms, t_ms = [], []
    for _ in range(3):  # interleaved, so drift hits both
        d_ms.append(step_ms(d, threads=d_threads))
        t_ms.append(step_ms(t, threads=t_threads))
    return statistics.median(d_ms), statistics.median(t_ms)


def run(stub, conversations, k, temperature, top_p, max_tokens, seed):
    acc = drafted = rejected = rounds = emitted = 0
    for i, messages in enumerate(conversations):
        req = pb.GenerateRequest(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + i,
            num_speculative_tokens=k,
            prompt_lookup_min=0,
        )  # the draft's own alpha: no lookup
        for m in messages:
            req.messages.add(role=m["role"], content=m["content"])
        for msg in stub.Generate(req, timeout=600):
            if msg.HasField("stats"):
                s = msg.stats
                acc, drafted, rejected = acc + s.accepted_tokens, drafted + s.draft_tokens, rejected + s.rejected_rounds
                rounds, emitted = rounds + s.rounds, emitted + s.mean_tokens_per_round * s.rounds
    return {
        "alpha": leviathan_alpha(acc, rejected),
        "accepted_over_drafted": acc / max(drafted, 1),
        "tau": emitted / max(rounds, 1),
        "rounds": rounds,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft", default="models/smollm2-draft", help="the draft the services run, to time c")
    ap.add_argument("--target", default=models.DEFAULT_TARGET)
    ap.add_argument("--draft-runner", default=ModelServerConfig.runner, help="as the services run it")
    ap.add_argument("--target-runner", default=ModelServerConfig.runner, help="as the services run it")
    ap.add_argument("--draft-quantize", default=ModelServerConfig.quantize, help="as the draft service runs it")
    ap.add_argument("--prompt-set", default="held-out", choices=["held-out", "bench"])
    args = ap.parse_args(argv)
    if args.prompt_set == "bench":
        conversations = [[{"role": "user", "content": p["prompt"]}] for p in load_prompts(args.prompts)]
    else:
        conversations = make_prompts(args.prompts, seed=7, held_out=True)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(args.address))
    report = {"prompt_set": args.prompt_set, "prompts": len(conversations), "k": args.k}
    for name, temperature, top_p in (("greedy", 0.0, 1.0), ("t0.7_top_p0.9", 0.7, 0.9)):
        report[name] = run(stub, conversations, args.k, temperature, top_p, args.max_tokens, seed=1)
    d_ms, t_ms = measure_c(args.draft, args.target, args.draft_runner, args.target_runner, args.draft_quantize)
    c = d_ms / t_ms
    report.update(draft_step_ms=d_ms, target_step_ms=t_ms, c=c, draft_quantize=args.draft_quantize)
    for name in ("greedy", "t0.7_top_p0.9"):
        a = report[name]["alpha"]
        best = max(range(1, 9), key=lambda k: leviathan_bound(a, k, c))
        report[name].update(
            best_k=best,
            predicted_speedup_best_k=leviathan_bound(a, best, c),
            predicted_speedup_k4=leviathan_bound(a, 4, c),
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
