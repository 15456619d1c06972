"""How close quantized activations (8 and 16 bits), and a float16 KV cache, keep the target to its float32 products
and cache, teacher-forced on held-out text.

    python -m bench.quality [--model SPEC] [--prompts 24] [--answer-tokens 96] [--passages 24]
                            [--activations int8 int16] [--kv-cache model float16] [--record]
    specdec gate [the same flags]: --record, the verdicts written to the gate (specdec/runners/gate.py)

Two texts, neither seen in training: the target's own greedy answers (float32) to held-out prompts
(training.prompts, held_out=True), and plain English from a corpus Python ships (the standard library's
documentation topics, pydoc_data). Each form (gate.form_name: activations x KV cache) is measured on its own, and
each text runs through each runner in one pass; at every position of the answer or passage the report takes top-1
agreement, KL(p_float32 || p_quantized) and the log-likelihood of the actual next token, from which each
perplexity and its change.
"""

from __future__ import annotations

import argparse
import datetime
import math
from pathlib import Path

import torch

from bench.services import machine, save
from specdec import models
from specdec.runners import LeanLlamaRunner, gate


def answers(runner, tokenizer, n: int, tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the runner's greedy answer, where the answer starts) for n held-out prompts."""
    from training.prompts import make_prompts

    out = []
    for chat in make_prompts(n, seed=7, held_out=True):
        ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
        cache, answer = runner.new_cache(), []
        logits = runner.forward(cache, ids, 1)
        for _ in range(tokens):
            answer.append(int(logits[-1].argmax()))
            if answer[-1] == tokenizer.eos_token_id:
                break
            logits = runner.forward(cache, answer[-1:], 1)
        out.append((ids + answer, len(ids)))
    return out


def passages(tokenizer, n: int, tokens: int = 256) -> list[tuple[list[int], int]]:
    """n passages of `tokens` tokens of the standard library's documentation; all but the first 16 are scored."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    step = max(len(ids) // n, tokens)
    return [(ids[i * step : i * step + tokens], 16) for i in range(n)]


def compare(r32, r8, texts: list[tuple[list[int], int]]) -> dict:
    """Teacher-forced agreement of runner r8 with runner r32 over texts (ids, where scoring starts)."""
    agree, kl, nll32, nll8, count = 0, 0.0, 0.0, 0.0, 0
    for ids, start in texts:
        n = len(ids) - start  # positions start - 1 .. len - 2 predict ids[start:]
        if n < 1:
            continue
        l32 = r32.forward(r32.new_cache(), ids[:-1], n).double().log_softmax(-1)  # [n, vocab]
        l8 = r8.forward(r8.new_cache(), ids[:-1], n).double().log_softmax(-1)
        nxt = torch.tensor(ids[start:])
        agree += int((l32.argmax(-1) == l8.argmax(-1)).sum())
        kl += float((l32.exp() * (l32 - l8)).sum())
        nll32 -= float(l32.gather(1, nxt[:, None]).sum())
        nll8 -= float(l8.gather(1, nxt[:, None]).sum())
        count += n
    ppl32, ppl8 = math.exp(nll32 / count), math.exp(nll8 / count)
    return {
        "positions": count,
        "top1_agreement": agree / count,
        "mean_kl": kl / count,
        "perplexity_float32": ppl32,
        "perplexity_quantized": ppl8,
        "perplexity_change": ppl8 / ppl32 - 1,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="specdec gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_TARGET, help="a target whose weights come from a GGUF file")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=96)
    p.add_argument("--passages", type=int, default=24)
    p.add_argument("--activations", nargs="+", default=["int8", "int16"], choices=["int8", "int16"])
    p.add_argument("--kv-cache", nargs="+", default=["model", "float16"], choices=["model", "float16"])
    p.add_argument("--record", action="store_true", help="write the verdicts to the gate, keyed by the file's sha256")
    p.add_argument("--out", default="results/quality")
    args = p.parse_args(argv)
    gguf = models.gguf_file(args.model)
    if gguf is None:
        p.error(f"{args.model} has no GGUF file: quantized activations multiply a GGUF file's blocks")
    tokenizer, model = models.load_tokenizer(args.model), models.load_model(args.model)
    r32 = LeanLlamaRunner(model, len(tokenizer), 4096, gguf=gguf)
    texts = {
        "answers": answers(r32, tokenizer, args.prompts, args.answer_tokens),
        "passages": passages(tokenizer, args.passages),
    }
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "float32": r32.describe()}
    for activations in args.activations:
        for kv_cache in args.kv_cache:
            rq = LeanLlamaRunner(model, len(tokenizer), 4096, gguf=gguf, activations=activations, kv_cache=kv_cache)
            form = gate.form_name(activations, kv_cache)
            report[form] = {"runner": rq.describe(), **{name: compare(r32, rq, t) for name, t in texts.items()}}
            report[form]["passed"] = gate.verdict(report[form])
    if args.record:
        gate.record(gguf, report)
    return save(report, Path(args.out), "quality")


if __name__ == "__main__":
    main()
